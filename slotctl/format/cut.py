"""A memory payload the file ends inside: where, in the order llama.cpp reads it, and what it reads after.

llama.cpp's file loader reads the payload field by field (``state_read_meta``, then ``state_read_data``
per stream; a composite memory section by section). :func:`locate_cut` walks the same order over a file
that ends too early and says which field the end falls in, whether that field is tensor data, and what
the loader would read after it: more records of the same shape, or something else (another record
shape, a stream's or a section's header). Tensor bytes are never read.

:func:`completion` gives the bytes that complete such a payload when every field after the end repeats
the record the end falls in (the record's header again, zeros for the data): the payload the loader
sees when what it reads beyond the end of the file keeps the values of the record before (see
:mod:`slotctl.validate.check`, ``payload_cut``).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from slotctl.format.cells import MAX_CELLS, MAX_SEQ
from slotctl.format.common import MAX_LAYERS, MAX_STREAMS
from slotctl.format.kv import ext_size
from slotctl.format.memory import MemoryLayout

ROW = "row"            # i32 type; u64 row_size; data[cells * row_size]
ELEMENTS = "elements"  # i32 type; u32 el_size; u32 n_embd; data[n_embd * cells * el_size]


@dataclass
class Cut:
    """Where the file ends inside a payload.

    ``field``: what the loader reads there ("K data", "V data (transposed)", "s data", "cell 3",
    "n_layer", ...); ``section``: index of the section; ``in_data``: the end falls inside a record's tensor
    data, or right after it; ``record``: that record's shape and header (``(shape, header bytes, data
    size)``); ``after``: the shapes read after it, in order ("row", "elements", or what else: "stream 1",
    "section 1 (swa KV)", ...).
    """

    offset: int
    field: str
    section: int
    in_data: bool = False
    record: tuple[str, bytes, int] | None = None
    data_left: int = 0
    after: list[tuple[str, int]] = field(default_factory=list)   # (shape or what, data size)

    @property
    def repeats(self) -> bool:
        """Whether everything read after the end has the shape of the record the end falls in."""
        return self.in_data and self.record is not None and all(s == self.record[0] for s, _ in self.after)

    def describe(self) -> str:
        return self.field


class _End(Exception):
    def __init__(self, what: str, in_data: bool = False):
        self.what = what
        self.in_data = in_data


class _Beyond(Exception):
    """A count beyond what its layer can hold (docs/design.md, "Bounds"): the loader refuses the payload
    there, so it is no payload cut short; and walking it would cost time and memory by an untrusted count."""


def _bounded(value: int, limit: int) -> int:
    if value > limit:
        raise _Beyond
    return value


class _Walker:
    def __init__(self, f: BinaryIO, pos: int, size: int):
        self.f, self.pos, self.size = f, pos, size

    def fixed(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise _End(what)
        self.f.seek(self.pos)
        self.pos += n
        return struct.unpack(fmt, self.f.read(n))

    def skip(self, n: int, what: str, in_data: bool) -> None:
        if self.pos + n > self.size:
            raise _End(what, in_data)
        self.pos += n


def locate_cut(f: BinaryIO, offset: int, size: int, layout: MemoryLayout, version: int) -> Cut | None:
    """Walk ``layout`` from ``offset`` in the loader's order; the :class:`Cut` where the file (``size``
    bytes) ends, or None when the payload is complete, or when a count on the way is beyond what its
    layer can hold (streams, cells, layers: the bounds of :mod:`slotctl.format.cells` and
    :mod:`slotctl.format.common`), which the loader refuses before any end."""
    w = _Walker(f, offset, size)
    secs = layout.sections
    cut: Cut | None = None
    state: dict = {}
    for si, sec in enumerate(secs):
        try:
            if sec.type == "kv":
                _walk_kv(w, sec, version, state)
            else:
                _walk_recurrent(w, sec, state)
        except _Beyond:
            return None
        except _End as e:
            cut = Cut(size, e.what, si, in_data=e.in_data)
            rec = state.get("record")
            if e.in_data and rec is not None:
                cut.record = rec
                cut.data_left = state["data_end"] - size
                cut.after = list(state.get("after", []))
            cut.after += [(f"section {j} ({secs[j].describe()})", 0) for j in range(si + 1, len(secs))]
            return cut
    return None


def _records(w: _Walker, what: str, n: int, shape: str, cells: int, state: dict, after: list) -> None:
    """``n`` records of ``shape``; on the end inside one, ``state`` says which and what follows it."""
    for i in range(n):
        start = w.pos
        if start == w.size and state.get("data_end") == start:
            raise _End(f"{what} header (record {i}), right after the data of the record before", True)
        if shape == ROW:
            _t, row = w.fixed("<iQ", f"{what} header (record {i})")
            data = cells * row
        else:
            _t, el, n_embd = w.fixed("<iII", f"{what} header (record {i})")
            data = n_embd * cells * el
        w.f.seek(start)
        header = w.f.read(w.pos - start)
        state["record"] = (shape, header, data)
        state["data_end"] = w.pos + data
        state["after"] = [(shape, data)] * (n - i - 1) + after
        w.skip(data, f"{what} (record {i})", True)


def _cells(w: _Walker, n: int, ext: int) -> None:
    """Skip ``n`` cells (``i32 pos; u32 n_seq_id; ext; i32 seq_id[n_seq_id]``), runs of one size at a time
    read in chunks of at most 1 MiB; ``_End`` names the cell the file ends in."""
    i = 0
    while i < n:
        if w.pos + 8 > w.size:
            raise _End(f"cell {i}")
        w.f.seek(w.pos)
        (n_seq,) = struct.unpack_from("<I", w.f.read(8), 4)
        rec = 8 + ext + 4 * n_seq
        m = min(n - i, max(1, (1 << 20) // rec), (w.size - w.pos) // rec)
        if m == 0:
            w.pos += 8
            w.skip(rec - 8, f"cell {i}", False)   # the file ends inside this cell
        fields = [("pos", "<i4"), ("n_seq_id", "<u4")] + ([("rest", f"V{rec - 8}")] if rec > 8 else [])
        w.f.seek(w.pos)
        arr = np.frombuffer(w.f.read(m * rec), dtype=np.dtype(fields))
        same = arr["n_seq_id"] == n_seq
        r = m if bool(same.all()) else int(np.argmin(same))
        w.pos += r * rec
        i += r


def _walk_kv(w: _Walker, sec, version: int, state: dict) -> None:
    (n_stream,) = w.fixed("<I", "n_stream")
    _bounded(n_stream, MAX_STREAMS)
    total = 0
    for s in range(n_stream):
        later_streams = [(f"stream {t}", 0) for t in range(s + 1, n_stream)]
        (cells,) = w.fixed("<I", f"stream {s} cell_count")
        if not cells:
            continue
        total = _bounded(total + cells, MAX_CELLS)
        _cells(w, cells, ext_size(version, sec.has_ext))
        v_trans, n_layer = w.fixed("<II", "v_trans and n_layer")
        _bounded(n_layer, MAX_LAYERS)
        if version >= 4:
            w.fixed("<II", "n_rot_k and n_rot_v")
        v_shape = ELEMENTS if v_trans else ROW
        n_v = n_layer if sec.v_records else 0
        v_after = [(v_shape, 0)] * n_v
        _records(w, "K data", n_layer, ROW, cells, state, v_after + later_streams)
        _records(w, "V data (transposed)" if v_trans else "V data", n_v, v_shape, cells, state, later_streams)


def _walk_recurrent(w: _Walker, sec, state: dict) -> None:
    (cells,) = w.fixed("<I", "cell_count")
    _cells(w, _bounded(cells, MAX_SEQ), 0)
    s_trans, _n_layer = w.fixed("<II", "s_trans and n_layer")
    s_shape = ELEMENTS if s_trans else ROW
    _records(w, "r data", sec.n_r, ROW, cells, state, [(s_shape, 0)] * sec.n_s)
    _records(w, "s data (transposed)" if s_trans else "s data", sec.n_s, s_shape, cells, state, [])


def completion(cut: Cut) -> list[bytes | int]:
    """What completes the payload after the end of the file when every record after the end repeats the
    one the end falls in: the rest of its data, then each record after it with the same header and its
    data. Pieces are bytes, or an int for that many zero bytes (tensor data, never made)."""
    assert cut.repeats
    _shape, header, data = cut.record
    out: list[bytes | int] = [cut.data_left]
    for _ in cut.after:
        out += [header, data]
    return out


class Extended(io.RawIOBase):
    """A file read as its first ``size`` bytes followed by the pieces of ``tail`` (bytes, or an int: that
    many zero bytes, made only when read): for parsing a completed payload without reading the file or
    the completion's tensor data into memory."""

    def __init__(self, f: BinaryIO, size: int, tail: list[bytes | int]):
        self.f, self.size, self._pos = f, size, 0
        self.pieces: list[tuple[int, int, bytes | None]] = []
        at = size
        for p in tail:
            n = p if isinstance(p, int) else len(p)
            self.pieces.append((at, at + n, None if isinstance(p, int) else p))
            at += n
        self.end = at

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else self.end + pos)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.end - self._pos
        n = max(0, min(n, self.end - self._pos))
        out = bytearray()
        while len(out) < n:
            pos = self._pos + len(out)
            want = n - len(out)
            if pos < self.size:
                self.f.seek(pos)
                chunk = self.f.read(min(want, self.size - pos))
                if not chunk:
                    break
                out += chunk
                continue
            start, stop, data = next(p for p in self.pieces if p[0] <= pos < p[1])
            k = min(want, stop - pos)
            out += data[pos - start:pos - start + k] if data is not None else bytes(k)
        self._pos += len(out)
        return bytes(out)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)
