"""The cell reader (format.cells) against a plain reference walk: cells of any mix of sizes (runs, short
repeating patterns, sizes without a pattern, across chunk boundaries) read as the loader reads them, one
after the other; and what a cell walked one by one costs in the file's budget."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotctl.errors import FormatError
from slotctl.format import cells as cellfmt
from slotctl.format.common import WALKED_CELL_COST, FileBudget, parse


def _encode(ks: list[int], ext_words: int = 0) -> bytes:
    out = bytearray()
    for i, k in enumerate(ks):
        out += struct.pack("<iI", 1000 + i, k)
        out += struct.pack(f"<{ext_words}i", *range(ext_words))
        out += struct.pack(f"<{k}i", *[(i + j) % cellfmt.MAX_SEQ for j in range(k)])
    return bytes(out)


def _reference(data: bytes, n: int, ext_words: int):
    """The cells read one after the other, as llama_kv_cache::state_read_meta reads them."""
    pos, ks, ids, at = [], [], [], 0
    for _ in range(n):
        p, k = struct.unpack_from("<iI", data, at)
        at += 8 + 4 * ext_words
        pos.append(p)
        ks.append(k)
        ids.append(list(struct.unpack_from(f"<{k}i", data, at)))
        at += 4 * k
    return pos, ks, ids, at


def _parse(data: bytes, n: int, ext_words: int = 0, budget: FileBudget | None = None):
    f = io.BytesIO(data + b"\0" * 16)
    cells = parse(cellfmt.CellArray(n, 4 * ext_words), f, "KV cells", size=len(data) + 16, file_budget=budget)
    return cells, f.tell()


#: a run of one size, a short repeating pattern, or sizes without a pattern
_pieces = st.one_of(
    st.tuples(st.integers(0, 3), st.integers(1, 300)).map(lambda t: [t[0]] * t[1]),
    st.tuples(st.lists(st.integers(0, 4), min_size=2, max_size=8), st.integers(1, 40)).map(lambda t: t[0] * t[1]),
    st.lists(st.integers(0, 5), min_size=1, max_size=300),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_pieces, min_size=1, max_size=6).map(lambda ps: [k for p in ps for k in p]),
       st.sampled_from([0, 3]), st.sampled_from([cellfmt.CHUNK_BYTES, 256, 1000]))
def test_cells_of_any_sizes_read_as_the_loader_reads_them(ks, ext_words, chunk):
    data = _encode(ks, ext_words)
    old = cellfmt.CHUNK_BYTES
    cellfmt.CHUNK_BYTES = chunk   # small chunks: cells and patterns that cross a read's end
    try:
        cells, end = _parse(data, len(ks), ext_words)
    finally:
        cellfmt.CHUNK_BYTES = old
    pos, nks, ids, want_end = _reference(data, len(ks), ext_words)
    assert end == want_end
    assert cells.pos.tolist() == pos and cells.n_seq_id.tolist() == nks
    assert [list(map(int, cells.seq_ids[i])) for i in range(len(ks))] == ids


def test_cells_without_a_pattern_are_read_whole_and_their_walk_is_charged():
    """Sizes without a pattern over more cells than one stretch of the walk: read to the end (they were
    refused after ~1,000 cells, each 32 cells costing a fresh 8 MiB read against the budget), and each
    walked cell charged :data:`WALKED_CELL_COST`, so the budget bounds the Python steps of a file."""
    rng = np.random.default_rng(5)
    ks = rng.integers(1, 3, 3 * cellfmt.WALK_STRETCH + 17).tolist()
    data = _encode(ks)
    budget = FileBudget(1 << 40)
    cells, end = _parse(data, len(ks), budget=budget)
    assert end == len(data) and cells.n_seq_id.tolist() == ks
    assert budget.used >= len(ks) * WALKED_CELL_COST
    # the same cells in a file whose budget is nearly spent: refused where the budget ran out
    tight = FileBudget(1 << 40)
    tight.used = tight.limit - len(data) - WALKED_CELL_COST * len(ks) // 2
    with pytest.raises(FormatError, match="KV cells: the file's cells"):
        _parse(data, len(ks), budget=tight)


def test_runs_and_patterns_walk_no_cell_one_by_one_beyond_their_probe():
    """A run of one size and an alternating pattern cost their bytes, not a Python step per cell."""
    for ks in ([1] * 50_000, [1, 2] * 25_000, [1] * 20_000 + [2, 3, 1] * 10_000):
        budget = FileBudget(1 << 40)
        cells, _ = _parse(_encode(ks), len(ks), budget=budget)
        assert cells.n_seq_id.tolist() == ks
        assert budget.used < 2 * len(_encode(ks)) + 64 * WALKED_CELL_COST, budget.used
