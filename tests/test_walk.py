"""The candidate search of slotfile's walk: its shortcuts (sections shared through the memo, a layout without V
told from the parse with V, candidates skipped once a section of theirs failed) find exactly what trying
every candidate layout on its own finds, on every file a real llama-server wrote and on damaged copies."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from slotctl.errors import FormatError
from slotctl.format.memory import candidate_layouts
from slotctl.slotfile import _try_layouts, open_slot_file, parse_memory
from slotctl.format.cells import Cells

from conftest import DATA

FILES = sorted(DATA.glob("srv-*.bin")) + sorted((DATA / "kinds").glob("srv-*.bin"))


def _each_alone(f, offset: int, end: int, version: int, ext: bool) -> list:
    """Every candidate layout parsed on its own (no memo, nothing shared): those that parse."""
    out = []
    for cand in candidate_layouts():
        if any(s.has_ext for s in cand.sections) != ext:
            continue
        try:
            out.append(parse_memory(f, offset, end, cand, version))
        except FormatError:
            continue
    return out


def _plain(x):
    """A parsed section as plain values (cells' arrays as lists), to compare."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, Cells):
        seq = x.seq_ids
        return [x.pos.tolist(), x.n_seq_id.tolist(), None if x.ext is None else x.ext.tolist(),
                [list(map(int, seq[i])) for i in range(len(x))]]
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x


def _same(a: list, b: list) -> None:
    assert [m.layout for m in a] == [m.layout for m in b]
    assert [m.end for m in a] == [m.end for m in b]
    assert [_plain(m.sections) for m in a] == [_plain(m.sections) for m in b]


def _check(path) -> None:
    sf = open_slot_file(path)
    if sf.header_end is None:
        return
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        for ext in (False, True):
            _same(_try_layouts(f, sf.header_end, size, sf.version, "target memory", ext=ext),
                  _each_alone(f, sf.header_end, size, sf.version, ext))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_the_candidate_search_finds_what_each_layout_alone_finds(path):
    _check(path)


@pytest.mark.parametrize("path", FILES[:4] + FILES[-4:], ids=lambda p: p.name)
def test_the_candidate_search_agrees_on_damaged_copies(tmp_path, path):
    """Bytes of the payload changed at random (counts, types, row sizes among them): the same fits, or the
    same none."""
    raw = bytearray(path.read_bytes())
    rng = random.Random(path.name)
    n_words = int.from_bytes(raw[8:12], "little")
    start = 12 + 4 * n_words
    for i in range(12):
        bad = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(start, min(len(bad), start + 4096))
            bad[at] = rng.randrange(256)
        p = tmp_path / f"bad{i}.bin"
        p.write_bytes(bytes(bad))
        _check(p)


def _record_headers(sf) -> list[int]:
    """Where each K and V record header of the file's KV sections is (target memory, checkpoint and draft
    blobs), but the first of each stream, which the prediction reads with the section's cells."""
    mems = [sf.target] + [b.memory for c in sf.checkpoints or () for b in (c.tgt, c.dft)]
    mems += [sf.draft.memory] if sf.draft is not None else []
    out = []
    for mem in mems:
        if mem is None:
            continue
        for layout, sec in zip(mem.layout.sections, mem.sections):
            if layout.type == "recurrent":    # the first r record is read with the section's head
                out += [r.data.offset - 12 for r in list(sec.r)[1:] + list(sec.s)]
                continue
            for stream in sec.streams:
                if stream.data is not None:   # the first K record is read with the section's head
                    out += [r.data.offset - 12 for r in list(stream.data.k)[1:] + list(stream.data.v)]
    return out


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_a_local_files_record_headers_are_predicted_in_a_batch_per_section(path):
    """The two-read rule, locally: the ranges format.ahead hands the kernel in a batch per section
    (sources.LocalRanges) hold every record header the walk then reads, on files a real server wrote of
    every memory kind: KV, iSWA's two sections, recurrent and hybrid sections, and appendix blobs."""
    from slotctl.format.ahead import prefetch
    from slotctl.sources import LocalRanges

    sf = open_slot_file(path)
    with open(path, "rb") as f:
        fetched = prefetch(LocalRanges(f))
    heads = _record_headers(sf)
    assert heads
    missed = [h for h in heads if not any(off <= h and h + 12 <= off + n for off, n in fetched)]
    assert not missed, (missed[:5], fetched[:5])


class _Sparse:
    """A file of ``size`` bytes held as the few regions written (zeros elsewhere), with the interface
    format.ahead reads through (``size``, ``read_ranges``, ``warm``): the hostile counts of a huge object
    without its bytes. It counts the ranges it is handed."""

    def __init__(self, size: int):
        self.size, self.regions, self.ranges = size, {}, 0

    def write(self, at: int, data: bytes) -> None:
        self.regions[at] = data

    def read_ranges(self, ranges):
        self.ranges += len(ranges)
        out = []
        for off, n in ranges:
            buf = bytearray(n)
            for at, data in self.regions.items():
                lo, hi = max(off, at), min(off + n, at + len(data))
                if lo < hi:
                    buf[lo - off:hi - off] = data[lo - at:hi - at]
            out.append(bytes(buf))
        return out

    def warm(self, ranges):
        self.ranges += len(ranges)


def test_a_hostile_files_predictions_are_bounded():
    """A payload and 64 checkpoint blobs each claiming 4,096 layers of records 1 MiB apart (an object of
    half a petabyte, nearly all hole): the prediction hands over at most MAX_RANGES ranges, not the 2M its
    counts ask for, and the walk reads the rest as it goes."""
    import struct

    from slotctl.format.ahead import MAX_RANGES, prefetch
    from slotctl.format.appendix import SCKP_MAGIC
    from slotctl.format.blob import BLOB_MAGIC

    row, layers = 1 << 20, 4096
    rec = 12 + row

    def kv(f, at):   # one stream, one cell; K and V records of one size; returns the section's end
        f.write(at, struct.pack("<IIiIiIIIIiQ", 1, 1, 0, 1, 0, 0, layers, 0, 0, 1, row))
        return at + 36 + 2 * layers * rec

    f = _Sparse(1 << 49)
    f.write(0, struct.pack("<III", 0x67677371, 4, 0))
    end = kv(f, 12)
    f.write(end, struct.pack("<III", SCKP_MAGIC, 1, 64))
    cur = end + 12
    for _ in range(64):
        body = cur + 16 + 8 + 8
        blob_end = kv(f, body)
        f.write(cur + 16, struct.pack("<QIi", blob_end - (cur + 24), BLOB_MAGIC, 0))
        f.write(blob_end, struct.pack("<QQ", 0, 0))
        cur = blob_end + 16
    f.size = cur + 4096
    fetched = prefetch(f)
    # the counts ask for 65 x 8,191 = 532,415 ranges
    assert 8000 < len(fetched) <= min(MAX_RANGES, 32768) and f.ranges <= 70000, (len(fetched), f.ranges)
