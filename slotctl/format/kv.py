"""The plain KV cache section (``llama_kv_cache::state_write``), version-aware.

```
u32 n_stream
n_stream x { u32 cell_count; if cell_count: CELL[cell_count]; DATA }
DATA: u32 v_trans; u32 n_layer; [v4: u32 n_rot_k; u32 n_rot_v]; K records; V records
```
Parse parameters: ``version`` (2, 3, 4) and ``lazy``.
"""

from __future__ import annotations

import construct as cs
from construct import this

from slotctl.format.cells import CellArray
from slotctl.format.common import MAX_LAYERS, MAX_STREAMS, Counted, Expect
from slotctl.format.records import RecordArray


def ext_size(version: int, has_ext: bool) -> int:
    """Bytes of cell ext: ``x, y`` in version 2, ``x, y, tok`` from version 3 on."""
    if not has_ext:
        return 0
    return 8 if version <= 2 else 12


def kv_section(*, has_ext: bool = False, v_records: bool = True) -> cs.Struct:
    """Schema of one KV section.

    ``has_ext``: cells carry ext (M-RoPE models and n-gram-head models).
    ``v_records``: layers have V records (False for MLA models, whose layers store no V).
    """
    cells = lambda c: c._.cell_count  # noqa: E731 - data (c) -> stream (c._)
    data = cs.Struct(
        "v_trans" / Expect(cs.Int32ul, [0, 1], "v_trans"),
        "n_layer" / Counted(cs.Int32ul, "layer count", limit=MAX_LAYERS),
        "rot_offset" / cs.Tell,
        "n_rot_k" / cs.If(lambda c: c._params.version >= 4, cs.Int32ul),
        "n_rot_v" / cs.If(lambda c: c._params.version >= 4, cs.Int32ul),
        "k" / RecordArray(this.n_layer, cells, "K data"),
        "v" / RecordArray(lambda c: c.n_layer if v_records else 0, cells, "V data",
                          transposed=lambda c: c.v_trans == 1),
    )
    stream = cs.Struct(
        "cell_count" / cs.Int32ul,
        "cells" / CellArray(this.cell_count, lambda c: ext_size(c._params.version, has_ext)),
        "data" / cs.If(this.cell_count > 0, data),
    )
    return cs.Struct(
        "type" / cs.Computed("kv"),
        "n_stream" / Counted(cs.Int32ul, "stream count", limit=MAX_STREAMS, min_item_size=4),
        "streams" / cs.Array(this.n_stream, stream),
    )
