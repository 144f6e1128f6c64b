"""Where a slot file's record headers are, worked out from its head, so they are fetched in one batch.

The walk of :mod:`slotctl.slotfile` reads a few bytes per record header (~2 per layer and stream) one after
the other; over a network every read is a round trip, and on a cold local disk a wait for the disk.
:func:`prefetch` reads the head (state header, token words, the first section's head and first record),
predicts every other record header of that section (all layers with the first one's type and row size,
as every model with uniform layers writes them), the region behind the section (the next stream or
section, or an appendix) and the end of the file, and fetches them all in one batch (``warm``: one round
trip to a store; locally the kernel is given the whole batch at once); then the next section the same
way (iSWA's second KV section, a hybrid's recurrent one), and each appendix blob's sections. A KV section
costs one batch; a recurrent one two (its r records, whose count the file does not say, then its s
records). Then the walk runs as always and is the verification: a file whose records are not where
predicted (layers of different sizes, cells with ext or several sequences) simply reads what it misses,
as it does without a prediction. Nothing here decides anything about the file.

Each object is predicted from its own head: the head is fetched anyway (for a listing, while the listing
is checked for slot files), so a prediction shared by the files of a directory would save no round trip.
"""

from __future__ import annotations

import struct
from typing import Sequence

from slotctl.format.appendix import SCKP_MAGIC, SDFT_MAGIC
from slotctl.format.blob import BLOB_HEADER_SIZE
from slotctl.format.cells import MAX_SEQ
from slotctl.format.common import MAX_LAYERS, MAX_STREAMS
from slotctl.format.header import HEADER_FIXED_SIZE, STATE_SEQ_MAGIC, SUPPORTED_VERSIONS, FixedHeader

#: bytes fetched where the next stream, section or appendix is predicted to start, and at the end
REGION = 16 << 10
#: bytes fetched per predicted record header (a header is 12 bytes)
RECORD = 16
#: the largest cell array read with its section's data header in one request (a larger one is read by the walk)
CELLS_AT_ONCE = 8 << 20
#: appendix blobs whose records are predicted (the walk reads the rest as it goes)
MAX_BLOBS = 64


class _Ranged:
    """The reads a prediction needs, from a reader with ``read_ranges`` (a :class:`~slotctl.sources.RangedFile`)."""

    def __init__(self, f):
        self.f = f

    def get(self, offset: int, n: int) -> bytes | None:
        if offset < 0 or offset + n > self.f.size:
            return None
        data = self.f.read_ranges([(offset, n)])[0]
        return data if len(data) == n else None


def _u32s(b: bytes, n: int) -> tuple:
    return struct.unpack_from(f"<{n}I", b)


def _kv(r: _Ranged, at: int, size: int, version: int) -> tuple[list[tuple[int, int]], int] | None:
    """The record headers of the KV section at ``at`` after the first K record, and where the section ends,
    as its head predicts them (None when it predicts nothing: not a KV section of one sequence's cells).

    A slot saved by a server of ``-np N`` without a unified cache has N streams, all empty (a ``u32 0``)
    but its own: the empty ones before it are read here, the ones after it are predicted empty."""
    b = r.get(at, 4)
    if b is None:
        return None
    (n_stream,) = _u32s(b, 1)
    if not 1 <= n_stream <= MAX_STREAMS:
        return None
    words = r.get(at + 4, min(4 * n_stream, size - at - 4) // 4 * 4)
    if not words:
        return None
    counts = _u32s(words, len(words) // 4)
    full = next((j for j, c in enumerate(counts) if c), None)
    if full is None:                   # no stream holds cells: nothing to predict, the section's end is known
        return ([], at + 4 + 4 * n_stream) if len(counts) == n_stream else None
    cells, stream = counts[full], at + 4 + 4 * full
    if cells > (size - stream) // 12:
        return None
    cell0 = stream + 4
    # cells of one sequence without ext: 12 bytes each (pos, n_seq_id = 1, seq_id); the walk checks. The cells
    # (which the walk reads) and the stream's data header behind them in one read; beyond CELLS_AT_ONCE
    # the first cell and the header alone
    data_at = cell0 + 12 * cells
    if data_at + 28 > size:
        return None
    # the first cell before the block: usually in what was read already (the head, the region behind the
    # section before), and what tells a recurrent section (one cell of no ids) from a KV one
    head = r.get(cell0, 12)
    if head is None or struct.unpack_from("<I", head, 4)[0] != 1:
        return None
    if 12 * cells <= CELLS_AT_ONCE:
        block = r.f.read_ranges([(stream, 4 + 12 * cells + 28)])[0]   # from the stream's start: one block
        first, tail = block[4:16], block[4 + 12 * cells:]
    else:
        first, tail = r.f.read_ranges([(cell0, 12), (data_at, 28)])
    if len(tail) < 28 or len(first) < 12 or struct.unpack_from("<I", first, 4)[0] != 1:
        return None
    v_trans, n_layer = _u32s(tail, 2)
    k0 = data_at + (16 if version >= 4 else 8)
    _ktype, row_k = struct.unpack_from("<iQ", tail, k0 - data_at)
    if not 1 <= n_layer <= MAX_LAYERS or row_k == 0 or v_trans > 1:
        return None
    rec = 12 + row_k * cells
    ranges = [(k0 + i * rec, RECORD) for i in range(1, 2 * n_layer) if k0 + i * rec + 12 <= size]
    # K records 1.., then V records (as many, of the same bytes); then the streams left, predicted empty
    return ranges, k0 + 2 * n_layer * rec + 4 * (n_stream - full - 1)


#: sections of one payload or blob predicted one after the other (hybrid iSWA has three)
MAX_SECTIONS = 4
#: the most ranges predicted for one file: an 80-layer model's 160 records in the payload and in 64
#: checkpoints' blobs and more; a hostile file's counts cost no more requests than this
MAX_RANGES = 32768


def _recurrent(r: _Ranged, at: int, size: int, room: int = MAX_RANGES) -> tuple[list[tuple[int, int]], int] | None:
    """The record headers of the recurrent section at ``at`` and where the section ends, as its head and
    its r records predict them; the r record headers are fetched here, in one batch, to learn how many
    layers have r (the file does not say: the GGUF does), counting the records of the first one's type and
    row size, and where the s records begin. None when it predicts nothing (no recurrent section's head).

    ``u32 cell_count; cells; u32 s_trans; u32 n_layer``, then r records, then s records (as many)."""
    b = r.get(at, 4)
    if b is None:
        return None
    (cells,) = _u32s(b, 1)
    if cells > MAX_SEQ:
        return None
    block = r.get(at + 4, min(size - at - 4, cells * (8 + 4 * MAX_SEQ) + 8 + 12))
    if block is None:
        return None
    p = 0
    for _ in range(cells):       # cells of 0 or more ids (one sequence's save: one cell of none)
        if p + 8 > len(block):
            return None
        (k,) = struct.unpack_from("<I", block, p + 4)
        if k > MAX_SEQ:
            return None
        p += 8 + 4 * k
    if p + 20 > len(block):
        return None
    s_trans, n_layer = struct.unpack_from("<II", block, p)
    _type, row = struct.unpack_from("<iQ", block, p + 8)
    if s_trans > 1 or not 1 <= n_layer <= MAX_LAYERS:
        return None
    r0 = at + 4 + p + 8
    rec = 12 + row * cells
    want = [(r0 + i * rec, RECORD) for i in range(1, n_layer + 1) if r0 + i * rec + 12 <= size]
    if 2 * len(want) > room:
        return None
    if want:
        r.f.warm(want)           # one round trip (locally: the kernel reads them together), then from the cache
    heads = r.f.read_ranges(want) if want else []
    n_r = 1
    for h in heads:              # the r records: as long as the first one's type and row size repeat
        if len(h) < 12 or struct.unpack_from("<iQ", h) != (_type, row):
            break
        n_r += 1
    s0 = r0 + n_r * rec
    sh = r.get(s0, 12)
    if sh is None:
        return None
    if s_trans:                  # element-major s records: type, element size, n_embd
        _t, el, n_embd = struct.unpack_from("<iII", sh)
        srec = 12 + n_embd * cells * el
    else:
        srec = 12 + struct.unpack_from("<iQ", sh)[1] * cells
    ranges = [(s0 + j * srec, RECORD) for j in range(1, n_r) if s0 + j * srec + 12 <= size]
    return want + ranges, s0 + n_r * srec


def _sections(r: _Ranged, f, pos: int, size: int, version: int, fetched: list,
              extra: Sequence[tuple[int, int]] = ()) -> int | None:
    """Predict the sections from ``pos`` one after the other (a KV section, else a recurrent one), each
    section's record headers and the region behind it fetched in one batch (``extra`` goes with the
    first); stop at the end, at an appendix or where nothing is predicted. Returns where the last
    predicted section ends (None: not even the first one was predicted)."""
    end = None
    for _ in range(MAX_SECTIONS):
        room = MAX_RANGES - len(fetched)
        pred = _kv(r, pos, size, version) or _recurrent(r, pos, size, room)
        if pred is None or len(pred[0]) > room:   # beyond the file's share of predictions: the walk reads it
            break
        ranges, end = pred
        if end > size:
            return None
        batch = _merge([*ranges, *extra, *([(end, min(REGION, size - end))] if end < size else [])])
        extra = ()
        if batch:
            f.warm(batch)
            fetched += batch
        pos = end
        b = r.get(pos, 4) if pos < size else None
        if b is None or struct.unpack("<I", b)[0] in (SCKP_MAGIC, SDFT_MAGIC):
            break
    return end


def _blob(r: _Ranged, f, at: int, size: int, version: int, fetched: list) -> int | None:
    """Predict and fetch the KV section of the blob whose ``u64 length`` is at ``at``; the blob's end."""
    b = r.get(at, 8)
    if b is None:
        return None
    (length,) = struct.unpack("<Q", b)
    end = at + 8 + length
    if end > size:
        return None
    if length > BLOB_HEADER_SIZE:   # the blob's sections; with the first batch, what follows the blob
        _sections(r, f, at + 8 + BLOB_HEADER_SIZE, end, version, fetched,
                  [(end, min(REGION, size - end))] if end < size else [])
    return end


def prefetch(f) -> list[tuple[int, int]]:
    """Fetch the record headers of ``f`` that its head predicts: the target payload's in one batch, then each
    appendix blob's in one more; the ranges fetched (none when the head predicts nothing). ``f`` has
    ``size``, ``read_ranges`` (the bytes a prediction needs) and ``warm`` (a batch fetched for the walk's
    reads): a :class:`~slotctl.sources.RangedFile`, or a local file's
    :class:`~slotctl.sources.LocalRanges`, whose batch the kernel reads at once."""
    r = _Ranged(f)
    size = f.size
    head = r.get(0, HEADER_FIXED_SIZE)
    if head is None:
        return []
    h = FixedHeader.parse(head)
    version, n_words = h.version, h.n_words
    if h.magic != STATE_SEQ_MAGIC or version not in SUPPORTED_VERSIONS or n_words > (size - HEADER_FIXED_SIZE) // 4:
        return []
    # with the first section's batch: the token words (beyond the first read for long prompts) and the end of
    # the file (a chain ends it); behind each section, the next one or an appendix
    fetched: list[tuple[int, int]] = []
    extra = [(HEADER_FIXED_SIZE, 4 * n_words)] + ([(size - REGION, REGION)] if size > REGION else [])
    end = _sections(r, f, HEADER_FIXED_SIZE + 4 * n_words, size, version, fetched, extra)
    if end is None:
        return []
    _appendices(r, f, end, size, version, fetched)
    return _merge(fetched)


def _appendices(r: _Ranged, f, pos: int, size: int, version: int, fetched: list) -> None:
    """SCKP's checkpoints (at most :data:`MAX_BLOBS` blobs predicted) and SDFT's draft blob, from ``pos``."""
    blobs = 0
    b = r.get(pos, 4)
    if b is not None and struct.unpack("<I", b)[0] == SCKP_MAGIC:
        c = r.get(pos + 8, 4)
        count = struct.unpack("<I", c)[0] if c else 0
        cur = pos + 12
        for _ in range(min(count, MAX_BLOBS)):
            cur = _blob(r, f, cur + 16, size, version, fetched)          # n_tokens, pos_min, pos_max; tgt
            for _part in ("dft", "spec"):
                if cur is None:
                    return
                blobs += 1
                cur = _blob(r, f, cur, size, version, fetched) if _part == "dft" else _skip(r, cur, size)
            if cur is None:
                return
        pos = cur
        b = r.get(pos, 4)
    if b is not None and struct.unpack("<I", b)[0] == SDFT_MAGIC and blobs < MAX_BLOBS:
        _blob(r, f, pos + 8, size, version, fetched)


def _skip(r: _Ranged, at: int, size: int) -> int | None:
    """The end of the ``u64 length``-prefixed bytes at ``at`` (the speculative state: not parsed)."""
    b = r.get(at, 8)
    if b is None:
        return None
    end = at + 8 + struct.unpack("<Q", b)[0]
    return end if end <= size else None


def _merge(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges sorted, overlapping and adjacent ones joined (fewer requests for the same bytes)."""
    out: list[list[int]] = []
    for off, n in sorted(ranges):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return [(a, b) for a, b in out]
