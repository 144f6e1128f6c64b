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

from slotctl.format.cells import MAX_SEQ, CellArray
from slotctl.format.common import MAX_LAYERS, CheckError, Counted, Expect
from slotctl.format.records import RecordArray


def _section_cells(c) -> int:
    return c.cell_count


_HEAD = (
    "type" / cs.Computed("recurrent"),
    "cell_count" / cs.Int32ul,
    "cells" / CellArray(this.cell_count, 0, limit=MAX_SEQ, what="recurrent cells (one per sequence)"),
    "s_trans" / Expect(cs.Int32ul, [0, 1], "s_trans"),
    "n_layer" / Counted(cs.Int32ul, "layer count", limit=MAX_LAYERS),
)

#: the fields before the records, the same whatever the record counts (a layout tried at an offset where
#: this does not parse fails there for every count)
recurrent_head = cs.Struct(*_HEAD)


def records_fit(n_r: int, n_s: int, n_layer: int) -> bool:
    """Whether ``n_r`` r and ``n_s`` s records can follow a head saying ``n_layer``: the memory writes one
    of each per layer that has it (``state_write_data`` skips the others), so never more than ``n_layer``."""
    return n_r <= n_layer and n_s <= n_layer


def _records_fit(n_r: int, n_s: int) -> cs.Construct:
    def check(c) -> bool:
        if not records_fit(n_r, n_s, c.n_layer):
            raise CheckError(f"a layer count of at least {max(n_r, n_s)} (records of {n_r} r and {n_s} s layers), "
                             f"found {c.n_layer}", c.n_layer_at)
        return True

    return cs.Computed(check)


def recurrent_section(*, n_r: int, n_s: int) -> cs.Struct:
    return cs.Struct(
        *_HEAD[:-1],
        "n_layer_at" / cs.Tell,
        _HEAD[-1],
        "records_fit" / _records_fit(n_r, n_s),
        "r" / RecordArray(n_r, _section_cells, "r data"),
        "s" / RecordArray(n_s, _section_cells, "s data", transposed=lambda c: c.s_trans == 1),
    )
