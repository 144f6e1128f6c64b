"""Per-layer tensor records shared by KV and recurrent sections.

Row records: ``i32 ggml type; u64 row_size; u8[cell_count * row_size]``.
Element-major (transposed) records: ``i32 type; u32 el_size; u32 n_embd; u8[n_embd * cell_count * el_size]``.
The cell count comes from the enclosing stream; ``cells`` is a context lambda giving it.
"""

from __future__ import annotations

import struct

import construct as cs

from slotctl.errors import FormatError
from slotctl.format import ggml
from slotctl.format.common import CheckError, Expect, Payload, Span, TrackingReader, _lazy, _remaining

GGMLTypeId = Expect(cs.Int32sl, sorted(ggml.BY_ID), "a ggml type id of a cache tensor")


def row_record(cells, what: str) -> cs.Struct:
    return cs.Struct(
        "type" / GGMLTypeId,
        "row_size" / cs.Int64ul,
        "data" / Payload(lambda c: cells(c) * c.row_size, what),
    )


def element_record(cells, what: str) -> cs.Struct:
    return cs.Struct(
        "type" / GGMLTypeId,
        "el_size" / cs.Int32ul,
        "n_embd" / cs.Int32ul,
        "data" / Payload(lambda c: c.n_embd * cells(c) * c.el_size, what),
    )


def record_size(rec) -> int:
    """Bytes of tensor data in a parsed record (works on lazy spans and on bytes)."""
    data = rec.data
    return data.size if hasattr(data, "offset") else len(data)


_HEAD = struct.Struct("<iQ")        # row record: type, row_size
_EHEAD = struct.Struct("<iII")      # element record: type, el_size, n_embd
_TYPE_IDS = frozenset(ggml.BY_ID)
_TYPE_WORDS = " or ".join(str(t) for t in sorted(ggml.BY_ID))


class RecordArray(cs.Construct):
    """``count`` records of one section: row records, or element records when ``transposed``.

    Parses to the same Containers as ``Array(count, row_record(...))`` with the same checks (the type
    id, the data length against the bytes that remain), but reads each 12-byte record header with one
    ``struct`` call: a section of an 80-layer model has 160 records, and construct's per-field machinery
    costs ~50 us each, the most of opening a file. Building goes through the record Structs.

    ``cells`` and ``transposed`` are evaluated in the enclosing context (the one holding the records).
    """

    def __init__(self, count, cells, what: str, transposed=False):
        super().__init__()
        self.count = count
        self.cells = cells
        self.what = what
        self.transposed = transposed
        self.rows = row_record(lambda c: cells(c._), what)
        self.elems = element_record(lambda c: cells(c._), f"{what} (transposed)")

    def _parse(self, stream, context, path):
        n = cs.evaluate(self.count, context)
        trans = bool(cs.evaluate(self.transposed, context))
        ncell = self.cells(context)
        lazy = _lazy(context)
        what = f"{self.what} (transposed)" if trans else self.what
        out = cs.ListContainer()
        pos = stream.tell()
        end = pos + _remaining(stream)
        # lazily, each header is read where it is (a pread on a local file) and the stream set once at the end
        pread = stream.pread if lazy and isinstance(stream, TrackingReader) else None
        for _ in range(n):
            start = pos
            head = pread(start, 12) if pread is not None else stream.read(12)
            if len(head) < 12:
                raise CheckError(f"a {what} record header of 12 bytes, but the file ends {len(head)} bytes later",
                                 start)
            if trans:
                typ, el_size, n_embd = _EHEAD.unpack(head)
                size = n_embd * ncell * el_size
            else:
                typ, row_size = _HEAD.unpack(head)
                size = ncell * row_size
            if typ not in _TYPE_IDS:
                raise CheckError(f"a ggml type id of a cache tensor {_TYPE_WORDS}, found {typ}", start)
            at = start + 12
            if size > end - at:
                raise CheckError(f"{what} of {size:,} bytes, but only {end - at:,} bytes remain in the file", at)
            pos = at + size
            if lazy:
                if pread is None:
                    stream.seek(pos)
                data = Span(at, size)
            else:
                data = cs.stream_read(stream, size, path)
            if trans:
                out.append(cs.Container(type=typ, el_size=el_size, n_embd=n_embd, data=data))
            else:
                out.append(cs.Container(type=typ, row_size=row_size, data=data))
        if pread is not None:
            stream.seek(pos)
        return out

    def _build(self, obj, stream, context, path):
        sub = self.elems if cs.evaluate(self.transposed, context) else self.rows
        for i, e in enumerate(obj):
            context._index = i
            sub._build(e, stream, context, path)
        return obj


def _field_at(rec, delta: int) -> int | None:
    """The absolute offset of a record header field ``delta`` bytes after the record starts (None for a
    record parsed from bytes)."""
    data = rec.data
    return data.offset - 12 + delta if hasattr(data, "offset") else None


def row_elements(rec, layer: str) -> int:
    """The elements of one row of a parsed record (a row record's row; all ``n_embd`` elements of one cell
    of an element-major record), when its header sizes hold whole rows of its type.

    Zero is a width: a record of zero-width rows (a row size of 0, an ``n_embd`` of 0) holds no bytes and
    is what the server writes for a tensor of no elements per cell (lfm2's short-convolution layers have an
    ``s`` of 0 elements, b11434 ``llama_memory_recurrent::state_write_data``), so it reads as rows of 0
    elements. A :class:`~slotctl.errors.FormatError` naming the field otherwise: a row size that is not a
    whole number of blocks of its type, an element size that is not the type's (element-major records hold
    unquantized types only). The one rule of a record's width for every command that reads a record's rows
    as numbers (diff, convert, identify, fit); the schema does not need it to locate the record.
    """
    t = ggml.BY_ID[rec.type]
    if "row_size" in rec:
        rs = rec.row_size
        if rs % t.block_bytes:
            raise FormatError(layer, _field_at(rec, 4), f"a {t.name} row size that is a multiple of "
                                                        f"{t.block_bytes} bytes, found {rs:,}")
        return rs // t.block_bytes * t.block
    if t.block != 1 or rec.el_size != t.block_bytes:
        want = f"{t.block_bytes}" if t.block == 1 else "that of an unquantized type (a transposed V is never quantized)"
        raise FormatError(layer, _field_at(rec, 4), f"a {t.name} element size of {want}, found {rec.el_size:,}")
    return rec.n_embd


def check_rotation(n_rot: int, width: int, what: str, layer: str, offset: int | None) -> int:
    """``n_rot`` when rows of ``width`` elements split into Hadamard groups of ``n_rot`` (0: none; else a
    power of two that divides ``width``); else a FormatError naming the field at ``offset``."""
    if n_rot and (n_rot & (n_rot - 1) or width % n_rot):
        raise FormatError(layer, offset, f"a {what} rotation of 0 or a power of two that divides rows of {width:,} "
                                         f"elements, found {n_rot:,}")
    return n_rot
