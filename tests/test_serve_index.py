"""serve's lookup of the stored state sharing the longest token prefix (slotctl.serve.index): the sorted
index finds what comparing every state finds."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from slotctl.serve.index import State, StateIndex, common_prefix

tokens = st.lists(st.integers(0, 5), min_size=0, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(tokens, min_size=0, max_size=30), tokens, st.sets(st.integers(0, 29)))
def test_the_longest_common_prefix_is_found(stored, query, forgotten):
    ix = StateIndex("p")
    for i, t in enumerate(stored):
        ix.add(State(f"s{i}", np.asarray(t, dtype=np.int32), "kv", 0))
    ix.forget([f"s{i}" for i in forgotten])
    left = [np.asarray(t, dtype=np.int32) for i, t in enumerate(stored) if i not in forgotten]
    q = np.asarray(query, dtype=np.int32)
    best = max((common_prefix(t, q) for t in left), default=0)
    found = ix.lookup(q)
    if best == 0:
        assert found == []
        return
    assert found[0][1] == best
    assert all(c == common_prefix(s.tokens, q) for s, c in found)
    assert [c for _s, c in found] == sorted((c for _s, c in found), reverse=True)
    assert len(found) == min(4, sum(1 for t in left if common_prefix(t, q) > 0))


def test_token_ids_sort_as_numbers_not_as_bytes():
    ix = StateIndex("p")
    for i, t in enumerate(([1, 255], [1, 256], [1, 65536], [2])):
        ix.add(State(f"s{i}", np.asarray(t, dtype=np.int32), "kv", 0))
    (s, c), *_ = ix.lookup(np.asarray([1, 256, 7], dtype=np.int32))
    assert s.name == "s1" and c == 2
