"""Per-layer tensor records shared by KV and recurrent sections.

Row records: ``i32 ggml type; u64 row_size; u8[cell_count * row_size]``.
Element-major (transposed) records: ``i32 type; u32 el_size; u32 n_embd; u8[n_embd * cell_count * el_size]``.
The cell count comes from the enclosing stream; ``cells`` is a context lambda giving it.
"""

from __future__ import annotations

import construct as cs

from slotctl.format import ggml
from slotctl.format.common import Expect, Payload

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
