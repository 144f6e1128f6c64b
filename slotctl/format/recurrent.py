"""The recurrent section (``llama_memory_recurrent::state_write``).

```
u32 cell_count; CELL[cell_count] (no ext); u32 s_trans; u32 n_layer
r records (one per layer that has r), then s records (one per layer that has s)
```
``n_layer`` is the model's block count, not the record count: which layers carry recurrent state is
known only from the GGUF, so the record counts are schema arguments. Written even with no cells.
"""

from __future__ import annotations

import construct as cs
from construct import this

from slotctl.format.cells import CellArray
from slotctl.format.common import MAX_LAYERS, Counted, Expect
from slotctl.format.records import element_record, row_record


def _section_cells(c) -> int:
    # record (c) -> section (c._)
    return c._.cell_count


def recurrent_section(*, n_r: int, n_s: int) -> cs.Struct:
    r_record = row_record(_section_cells, "r data")
    s_rows = row_record(_section_cells, "s data")
    s_elems = element_record(_section_cells, "s data (transposed)")
    return cs.Struct(
        "type" / cs.Computed("recurrent"),
        "cell_count" / cs.Int32ul,
        "cells" / CellArray(this.cell_count, 0),
        "s_trans" / Expect(cs.Int32ul, [0, 1], "s_trans"),
        "n_layer" / Counted(cs.Int32ul, "layer count", limit=MAX_LAYERS),
        "r" / cs.Array(n_r, r_record),
        "s" / cs.Array(n_s, cs.IfThenElse(lambda c: c.s_trans == 1, s_elems, s_rows)),
    )
