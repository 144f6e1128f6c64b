"""A memory payload the file ends inside, read as b11434's loader reads it: field by field, byte by byte.

llama.cpp's loader reads a payload one field at a time, each with one ``io.read`` into a variable
(``state_read_meta``, then ``state_read_data`` per stream; a composite memory section by section). On a
file that ends early, b11434's ``llama_file::read_raw_unsafe`` clamps each read to the bytes left: the
field gets what the file still holds and the rest of the variable keeps what it held (locals the source
never initialised: indeterminate), and ``llama_io_read_file::read`` counts the full size anyway. So the
loader goes on past the end, comparing variables the file did not fill with what its context expects,
and when every comparison passes its caller's ``GGML_ASSERT(nread <= state_size)`` aborts the process.

:func:`locate_cut` walks the same fields over such a file and returns a :class:`Cut`: the field the end
falls in and how many of its bytes the file holds; whether the loader checks any field at or after the
end (``settled``: it checks none, so the outcome follows from the fields before the end alone); whether
the bytes the file holds of a checked field already differ from what the context expects (``refuses``:
then no value of the rest can pass); and the completion: the bytes that, after the end, make the payload
the loader sees when every variable it did not fill happens to hold what the context expects (the best
case for the file). Parsing that completed payload and comparing it with the context finds every
mismatch the file's own bytes make certain. The expected values are the caller's (``expected``: a
prediction of the context); tensor bytes are never read or made.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Union

import numpy as np

from slotctl.format.cells import MAX_CELLS, MAX_SEQ
from slotctl.format.common import MAX_LAYERS, MAX_STREAMS
from slotctl.format.kv import ext_size
from slotctl.format.memory import MemoryLayout

#: ``expected(key, section, record)``: what the loader's context holds for a checked field, or None when
#: unknown. Keys: "n_stream", "cell_count" (the cells a stream has: the loader refuses more),
#: "v_trans", "n_layer", "n_rot_k", "n_rot_v", "k_type", "k_row_size", "v_type", "v_row_size",
#: "v_el_size", "n_embd_v_gqa" (KV; ``record`` is the layer's record index), "s_trans", "r_type",
#: "r_row_size", "s_type", "s_row_size", "s_el_size", "n_embd_s" (recurrent)
Expected = Callable[[str, int, "int | None"], "int | None"]


@dataclass(frozen=True)
class Repeat:
    """``count`` copies of ``unit``: completed cells, made only when read."""

    unit: bytes
    count: int

    def __len__(self) -> int:
        return len(self.unit) * self.count


Piece = Union[bytes, int, Repeat]   # bytes; an int: that many zero bytes; a Repeat


@dataclass
class Cut:
    """Where the file ends inside a payload, and what the loader reads from there on.

    ``field``: the field the end falls in ("K row size (stream 0, record 1)", "cell 3 n_seq_id", "V data
    (stream 0, record 0)", ...); ``key``: the check it goes to (a key of :data:`Expected`, "n_seq_id"),
    None for a field the loader does not check (positions, ext, sequence ids, tensor data); ``have``:
    the bytes of it the file holds, of ``size``; ``section``: the section's index. ``settled``: no
    checked field is read at or after the end. ``refuses``: why bytes the file holds already fail a check
    at or after the end (None: they do not). ``completion``: the pieces after the end (see the module
    docstring); None when the walk stopped at a refusal it could not complete past (a cell count beyond
    the context, a cell's sequence-id count).
    """

    offset: int
    field: str
    section: int
    key: str | None = None
    have: int = 0
    size: int = 0
    in_data: bool = False
    settled: bool = True
    refuses: str | None = None
    completion: list[Piece] | None = field(default_factory=list)
    #: the check that refuses (a finding code: "layer_count_mismatch", ...) and where its field is, when the
    #: loader refuses on a field the file holds whole, before it reads past the end (``before_end``)
    code: str | None = None
    at: int | None = None
    before_end: bool = False

    def describe(self) -> str:
        if self.in_data:
            return self.field
        return f"{self.field} (the file holds {self.have} of its {self.size} bytes)"


class _Beyond(Exception):
    """A count beyond what its layer can hold (docs/design.md, "Bounds"): the loader refuses the payload
    there, so it is no payload cut short; and walking it would cost time and memory by an untrusted count."""


class _Refuses(Exception):
    """The loader refuses the payload here. ``code``: the check (a finding code), ``at``: the field's offset,
    ``whole``: the file holds the field whole (a refusal before any read past the end)."""

    def __init__(self, reason: str, code: str | None = None, at: int | None = None, whole: bool = False):
        super().__init__(reason)
        self.code, self.at, self.whole = code, at, whole


#: what each check's failure is called (the finding codes of :mod:`slotctl.validate.compare`) and the
#: loader's own words (b11434 src/llama-kv-cache.cpp, src/llama-memory-recurrent.cpp)
_CHECKS = {
    "n_stream": ("n_stream_mismatch", "n_stream mismatch"),
    "cell_count": ("too_many_cells", "not enough cells in kv cache"),
    "n_seq_id": ("invalid_cell", "invalid seq_id-agnostic kv cell"),
    "v_trans": ("v_trans_mismatch", "incompatible V transposition"),
    "s_trans": ("s_trans_mismatch", "incompatible s transposition"),
    "n_layer": ("layer_count_mismatch", "mismatched layer count"),
    "n_rot_k": ("k_rotation_mismatch", "incompatible key rotation"),
    "n_rot_v": ("v_rotation_mismatch", "incompatible value rotation"),
    "k_type": ("k_type_mismatch", "mismatched key type"),
    "k_row_size": ("k_row_size_mismatch", "mismatched key row size"),
    "v_type": ("v_type_mismatch", "mismatched value type"),
    "v_row_size": ("v_row_size_mismatch", "mismatched value row size"),
    "v_el_size": ("v_row_size_mismatch", "mismatched value element size"),
    "n_embd_v_gqa": ("v_row_size_mismatch", "mismatched GQA embedding size"),
    "r_type": ("r_type_mismatch", "mismatched r type"),
    "r_row_size": ("r_row_size_mismatch", "mismatched r row size"),
    "s_type": ("s_type_mismatch", "mismatched s type"),
    "s_row_size": ("s_row_size_mismatch", "mismatched s row size"),
}


def _bounded(value: int, limit: int) -> int:
    if value > limit:
        raise _Beyond
    return value


class _Reader:
    """The loader's reads: from the file while it lasts, then the completion (expected values)."""

    def __init__(self, f: BinaryIO, pos: int, size: int, expected: Expected | None):
        self.f, self.pos, self.size, self.expected = f, pos, size, expected
        self.cut: Cut | None = None
        self.section = 0
        #: the last field read: (offset, whole in the file)
        self.last: tuple[int, bool] = (pos, True)
        #: how a refusal names the section ("" for a memory of one section)
        self.label = ""

    def want(self, key: str, record: int | None = None) -> int | None:
        return self.expected(key, self.section, record) if self.expected is not None else None

    def check(self, what: str, key: str, value: int, at: int, whole: bool, record: int | None = None, *,
              want: int | None = None, most: bool = False) -> None:
        """The loader's check of a field it read (``at``: its offset): a field the file holds ``whole``
        that fails it refuses the payload there, for certain (b11434 checks before it reads on: the first
        check that fails decides). A field read past the end is left to the cut reasoning."""
        if not whole:
            return
        if want is None:
            want = self.want(key, record)
        if want is None or (value <= want if most else value == want):
            return
        code, words = _CHECKS[key]
        what = self.label + what
        found = (f"{value:,} cells, more than the {want:,} the context has" if most
                 else f"{value:,}, the context expects {want:,}")
        raise _Refuses(f"{what} is {found} (\"{words}\")", code, at, True)

    def _at_end(self, what: str, key: str | None, n: int, in_data: bool) -> int:
        """Note a field at or after the end (``key``: its check, None for an unchecked field); the bytes
        of it the file holds."""
        have = max(0, min(n, self.size - self.pos))
        if self.cut is None:
            self.cut = Cut(self.size, what, self.section, key, have, n, in_data)
        if key is not None:
            self.cut.settled = False
        return have

    def value(self, fmt: str, what: str, key: str | None = None, record: int | None = None, *,
              want: int | None = None, most: bool = False, fill: int | None = None, check: bool = True) -> int:
        """One field (``fmt``: one struct code) the loader checks against ``key`` (None: unchecked).
        ``want``: the value the check expects (default: the caller's ``expected``); ``most``: the check
        is ``value <= want``. Held whole by the file, it is checked here unless ``check`` is False (the
        loader reads a group of fields and checks them after: the caller calls :meth:`check` in the
        loader's order). Beyond the end the field is completed with ``fill`` (default: ``want``, or 0 for
        a ``most`` check, the least value the bytes held allow)."""
        n = struct.calcsize(fmt)
        if self.pos + n <= self.size:
            self.f.seek(self.pos)
            at = self.pos
            self.pos += n
            got = struct.unpack(fmt, self.f.read(n))[0]
            self.last = (at, True)
            if check and key is not None:
                self.check(what, key, got, at, True, record, want=want, most=most)
            return got
        self.last = (self.pos, False)
        have = self._at_end(what, key, n, False)
        if key is not None and want is None and self.expected is not None:
            want = self.expected(key, self.section, record)
        if fill is None:
            fill = 0 if want is None or most else want
        got = b""
        if have:   # past the end the position may be beyond any offset a seek takes (a length of 2^63)
            self.f.seek(self.pos)
            got = self.f.read(have)
        raw = got + struct.pack(fmt, fill)[have:]
        value = struct.unpack(fmt, raw)[0]
        if key is not None and want is not None and have and (value > want if most else value != want) \
                and self.cut.refuses is None:
            # refused here whatever the rest held; the walk goes on (the completion keeps the value, so the
            # comparison names the mismatch, and any before it in the loader's order)
            self.cut.refuses = (f"the {have} byte(s) of {what} the file holds ({got.hex(' ')}) make it "
                                f"{'at least ' if most else ''}{value:,} whatever the rest held, and the context "
                                f"{'has ' + format(want, ',') + ' cells' if most else 'expects ' + format(want, ',')}")
        self.cut.completion.append(raw[have:])
        self.pos += n
        return value

    def data(self, n: int, what: str) -> None:
        """Tensor data (or any bytes the loader does not check) of ``n`` bytes."""
        if self.pos + n <= self.size:
            self.pos += n
            return
        have = self._at_end(what, None, n, True)
        self.cut.completion.append(n - have)
        self.pos += n


def locate_cut(f: BinaryIO, offset: int, size: int, layout: MemoryLayout, version: int,
               expected: Expected | None = None) -> Cut | None:
    """Walk ``layout`` from ``offset`` in the loader's order; the :class:`Cut` where the file (``size``
    bytes) ends, or None when the payload is complete, or when a count on the way is beyond what its
    layer can hold (streams, cells, layers: the bounds of :mod:`slotctl.format.cells` and
    :mod:`slotctl.format.common`), which the loader refuses before any end. After the end, the walk
    follows the values ``expected`` gives (zeros without it: then only ``field`` and ``have`` mean
    anything)."""
    r = _Reader(f, offset, size, expected)
    try:
        for si, sec in enumerate(layout.sections):
            r.section = si
            r.label = f"the {sec.describe()} section's " if len(layout.sections) > 1 else ""
            if sec.type == "kv":
                _walk_kv(r, sec, version)
            else:
                _walk_recurrent(r, sec)
    except _Beyond:
        return None
    except _Refuses as e:      # refused where nothing more can be made of the rest
        if r.cut is None:      # before any read past the end: the first check that fails decides
            r.cut = Cut(r.size, "", r.section, in_data=True)
        r.cut.refuses, r.cut.completion, r.cut.code, r.cut.at = str(e), None, e.code, e.at
        r.cut.before_end = e.whole and (e.at is None or e.at < r.size)
    return r.cut


def _record(r: _Reader, name: str, key: str, shape_v_trans: bool, i: int, cells: int, stream: int) -> None:
    """One record: ``i32 type; u64 row_size`` (or, transposed, ``i32 type; u32 el_size; u32 n_embd``)
    then its data. ``key``: "k", "v", "r" or "s"."""
    where = f"(stream {stream}, record {i})" if key in "kv" else f"(record {i})"
    r.value("<i", f"{name} type {where}", f"{key}_type", i)
    if shape_v_trans:
        el = r.value("<I", f"{name} element size {where}", f"{key}_el_size", i)
        n_embd = r.value("<I", f"{name} width {where}", "n_embd_v_gqa" if key == "v" else "n_embd_s", i)
        r.data(n_embd * cells * el, f"{name} data (transposed) {where}")
    else:
        row = r.value("<Q", f"{name} row size {where}", f"{key}_row_size", i)
        r.data(cells * row, f"{name} data {where}")


def _cells(r: _Reader, n: int, ext: int, n_seq_want: int) -> None:
    """``n`` cells (``i32 pos; u32 n_seq_id; ext; i32 seq_id[n_seq_id]``): runs of one size read from the
    file in chunks of at most 1 MiB; the cell the end falls in field by field; the cells after it
    completed as one :class:`Repeat` (the last position again, ``n_seq_want`` sequence ids)."""
    i, last_pos = 0, 0
    while i < n:
        if r.pos >= r.size:
            unit = struct.pack("<iI", last_pos, n_seq_want) + bytes(ext + 4 * n_seq_want)
            r._at_end(f"cell {i} n_seq_id", "n_seq_id", 8, False)
            r.cut.completion.append(Repeat(unit, n - i))
            r.pos += len(unit) * (n - i)
            return
        if r.pos + 8 <= r.size:
            r.f.seek(r.pos)
            n_seq = struct.unpack("<iI", r.f.read(8))[1]
            if n_seq != n_seq_want:   # state_read_meta checks each cell's count as it reads it
                raise _Refuses(f"cell {i} lists {n_seq:,} sequence ids, a single-sequence save {n_seq_want} "
                               "(\"invalid seq_id-agnostic kv cell\")", "invalid_cell", r.pos + 4, True)
            rec = 8 + ext + 4 * n_seq
            m = min(n - i, max(1, (1 << 20) // rec), (r.size - r.pos) // rec)
        else:
            m = 0
        if m == 0:      # the end falls inside this cell
            last_pos = r.value("<i", f"cell {i} pos", fill=last_pos)
            n_seq = r.value("<I", f"cell {i} n_seq_id", "n_seq_id", want=n_seq_want)
            if n_seq != n_seq_want:     # read whole, before the end: refused (and no seq ids to make)
                r._at_end(f"cell {i} sequence ids", None, ext + 4 * n_seq, True)
                raise _Refuses(f"cell {i} lists {n_seq:,} sequence ids; a single-sequence save {n_seq_want}")
            r.data(ext, f"cell {i} ext")
            r.data(4 * n_seq, f"cell {i} sequence ids")
            i += 1
            continue
        fields = [("pos", "<i4"), ("n_seq_id", "<u4")] + ([("rest", f"V{rec - 8}")] if rec > 8 else [])
        r.f.seek(r.pos)
        arr = np.frombuffer(r.f.read(m * rec), dtype=np.dtype(fields))
        same = arr["n_seq_id"] == n_seq
        k = m if bool(same.all()) else int(np.argmin(same))
        last_pos = int(arr["pos"][k - 1])
        r.pos += k * rec
        i += k


def _fits(r: _Reader, cells: int) -> None:
    """A cell count more than the context has: the loader refuses it before it reads a cell
    (``state_read_meta``: "not enough cells in kv cache"), whatever follows; nothing after it is walked or
    completed (a count of millions would make millions of cells). Read in part (the least value its bytes
    allow is beyond the context): refused as well."""
    have = r.want("cell_count")
    if have is not None and cells > have:
        at, whole = r.last
        if r.cut is None:      # the end lies further on, not walked
            r.cut = Cut(r.size, f"cells, or what follows them (its {cells:,} cells)", r.section, in_data=True)
        raise _Refuses(f"a stream of {cells:,} cells, more than the {have:,} the context has (\"not enough cells "
                       "in kv cache\"; raise -c, or lower -np)", "too_many_cells", at, whole)


def _walk_kv(r: _Reader, sec, version: int) -> None:
    """``llama_kv_cache::state_read_sinfo`` (b11434 src/llama-kv-cache.cpp): n_stream (checked at once),
    then per stream its cell count and cells (``state_read_meta``: the count against the stream's cells
    before any cell, each cell's n_seq_id as it is read) and data (``state_read_data``: v_trans, n_layer,
    n_rot_k and n_rot_v read together, then checked in the order n_layer, the cell count, v_trans, n_rot_k,
    n_rot_v; then each K record's type and row size, each checked as read; then V's)."""
    n_stream = _bounded(r.value("<I", "n_stream", "n_stream"), MAX_STREAMS)
    total = 0
    for s in range(n_stream):
        cells = r.value("<I", f"stream {s} cell_count", "cell_count", most=True, check=False)
        if not cells:
            continue
        _fits(r, cells)
        total = _bounded(total + cells, MAX_CELLS)
        _cells(r, cells, ext_size(version, sec.has_ext), 1)
        head = []
        for key in ("v_trans", "n_layer") + (("n_rot_k", "n_rot_v") if version >= 4 else ()):
            value = r.value("<I", f"stream {s} {key}", key, check=False)
            head.append((key, value, *r.last))
        for key in ("n_layer", "v_trans", "n_rot_k", "n_rot_v"):   # the loader's order of checks
            for k, value, at, whole in head:
                if k == key:
                    r.check(f"stream {s} {key}", key, int(bool(value)) if key == "v_trans" else value, at, whole)
        v_trans, n_layer = head[0][1], _bounded(head[1][1], MAX_LAYERS)
        for i in range(n_layer):
            _record(r, "K", "k", False, i, cells, s)
        for i in range(n_layer if sec.v_records else 0):
            _record(r, "V", "v", bool(v_trans), i, cells, s)


def _walk_recurrent(r: _Reader, sec) -> None:
    """``llama_memory_recurrent::state_read`` (b11434 src/llama-memory-recurrent.cpp): the cell count
    (against the cache's size before any cell, ``state_read_meta``), the cells (each n_seq_id 0 in a
    single-sequence save, checked as read), then ``state_read_data``: s_trans and n_layer read together and
    checked in the order n_layer, the cell count, s_trans; the r records, then the s records (each type and
    row size checked as read; data only when there are cells)."""
    cells = r.value("<I", "cell_count", "cell_count", most=True, check=False)
    _fits(r, cells)
    cells = _bounded(cells, MAX_SEQ)
    _cells(r, cells, 0, 0)
    s_trans = r.value("<I", "s_trans", "s_trans", check=False)
    s_at = r.last
    r.value("<I", "n_layer", "n_layer")
    r.check("s_trans", "s_trans", int(bool(s_trans)), *s_at)
    for i in range(sec.n_r):
        _record(r, "r", "r", False, i, cells, 0)
    for i in range(sec.n_s):
        _record(r, "s", "s", bool(s_trans), i, cells, 0)


def _piece_size(p: Piece) -> int:
    return p if isinstance(p, int) else len(p)


class Extended(io.RawIOBase):
    """A file read as its first ``size`` bytes followed by the pieces of ``tail`` (bytes; an int: that
    many zero bytes; a :class:`Repeat`; made only when read): for parsing a completed payload without
    reading the file or the completion's tensor data into memory."""

    def __init__(self, f: BinaryIO, size: int, tail: list[Piece]):
        self.f, self.size, self._pos = f, size, 0
        self.pieces: list[tuple[int, int, Piece]] = []
        at = size
        for p in tail:
            n = _piece_size(p)
            self.pieces.append((at, at + n, p))
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
            at = pos - start
            if isinstance(data, int):
                out += bytes(k)
            elif isinstance(data, Repeat):
                u = len(data.unit)
                first, last = at // u, (at + k + u - 1) // u
                out += (data.unit * (last - first))[at - first * u:at - first * u + k]
            else:
                out += data[at:at + k]
        self._pos += len(out)
        return bytes(out)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)
