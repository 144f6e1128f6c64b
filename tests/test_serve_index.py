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


@settings(max_examples=300, deadline=None)
@given(st.lists(tokens, min_size=0, max_size=30), tokens, st.integers(0, 14), tokens)
def test_extends_finds_what_comparing_every_state_finds(stored, prefix, min_tokens, besides):
    ix = StateIndex("p")
    for i, t in enumerate(stored):
        ix.add(State(f"s{i}", np.asarray(t, dtype=np.int32), "kv", 0))
    p, b = np.asarray(prefix, dtype=np.int32), np.asarray(besides, dtype=np.int32)
    want = any(t[:len(prefix)] == prefix and len(t) >= min_tokens and b[:len(t)].tolist() != t for t in stored)
    assert ix.extends(p, min_tokens, b, scan=10**9) == want
    # past ``scan`` states beginning with the prefix, the answer is yes (unsure): never a wrong no
    assert ix.extends(p, min_tokens, b, scan=2) in (want, True)


@settings(max_examples=500, deadline=None)
@given(st.lists(tokens, min_size=0, max_size=20), tokens, tokens, st.integers(0, 3), tokens, st.integers(1, 6))
def test_no_state_beats_a_slot_when_extends_says_so(stored, prompt, generated, cut, rest, min_gain):
    """serve's shortcut (slotctl.serve.completion.Completions.by_text): a slot holds its last prompt's tokens and what was
    generated; a request's tokens begin with that prompt but for at most ``margin`` tokens. When no state
    begins with the prompt less the margin, holds ``min_gain`` more and is not a prefix of what the slot holds,
    no state shares ``min_gain`` tokens more of the request than the slot: the lookup would restore nothing."""
    margin = 3
    ix = StateIndex("p")
    held = np.asarray(prompt + generated, dtype=np.int32)
    request = np.asarray(prompt[:max(len(prompt) - cut, 0)] + rest, dtype=np.int32)
    states = [np.asarray(t, dtype=np.int32) for t in stored]
    # states of this conversation too: what the slot holds, and ones that begin like the request
    states += [held, request[:len(request) // 2], request, np.concatenate([request, held])]
    for i, t in enumerate(states):
        ix.add(State(f"s{i}", t, "kv", 0))
    n = max(len(prompt) - margin, 0)
    if not ix.extends(np.asarray(prompt[:n], dtype=np.int32), n + min_gain, held):
        slot = common_prefix(held, request)
        assert all(common_prefix(t, request) < slot + min_gain for t in states)
