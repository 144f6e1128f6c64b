"""serve's view of the slots and its choice of a slot (slotctl.serve.slots): plain code, tested without a
server or a network: ``GET /slots`` answers as b11434 gives them, the choices the proxy makes from them."""

from __future__ import annotations

import numpy as np

from slotctl.serve.slots import EMPTY, UNKNOWN, SlotView, signature


def toks(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def entries(*slots: dict) -> list[dict]:
    """``GET /slots`` as b11434 answers it (only the keys the view reads)."""
    return [{"id": i, "n_ctx": 512, "is_processing": False, **s} for i, s in enumerate(slots)]


def test_a_view_is_trusted_until_a_connection_is_made():
    view = SlotView(min_gain=4)
    assert not view.trusted          # never read
    view.apply(entries({}, {}))
    assert view.trusted and sorted(view.slots) == [0, 1]
    view.connected()                 # a new connection: maybe a restarted server's
    assert not view.trusted
    view.apply(entries({}, {}))
    assert view.trusted
    view.distrust()
    assert not view.trusted
    empty = SlotView()
    empty.apply([{"id": True}, "x"])    # no slot at all (anything not a slot left out): nothing to trust
    assert not empty.trusted and empty.slots == {}


def test_a_change_serve_did_not_make_forgets_what_the_slot_holds():
    view = SlotView(min_gain=4)
    view.apply(entries({}, {}))
    a, b = view.slots[0], view.slots[1]
    a.sent(toks(1, 2, 3, 4, 5, 6), "hello", toks(1, 2, 3, 4, 5))
    a.sig = (7, 5)
    b.tokens, b.sig = toks(1, 9, 9), (8, 3)
    # slot 0 as serve left it; slot 1 ran another client's task (its signature changed) and is at work
    restarted = view.apply(entries({"id_task": 7, "n_prompt_tokens": 5},
                                   {"id_task": 9, "n_prompt_tokens": 30, "is_processing": True}))
    assert not restarted
    assert list(a.tokens) == [1, 2, 3, 4, 5, 6] and a.text == "hello"
    assert len(b.tokens) == 0 and b.sig == (9, 30) and view.busy == {1}
    assert signature({"id": 0}) is None and signature({"id_task": 3, "n_prompt_tokens": 4}) == (3, 4)
    # task ids counting from 0 again: a new server; every slot serve does not hold holds nothing
    assert view.apply(entries({"id_task": 0, "n_prompt_tokens": 2}, {}))
    assert len(a.tokens) == 0 and a.text is None and view.busy == set()
    # the view lost: every slot unknown
    a.sent(toks(1, 2), "x", toks(1, 2))
    view.lose()
    assert not view.trusted and all(s.sig == UNKNOWN and len(s.tokens) == 0 for s in view.slots.values())


def test_a_slot_held_by_a_request_is_left_as_it_is():
    view = SlotView(min_gain=4)
    view.apply(entries({}, {}))
    a = view.slots[0]
    a.pending = 1                    # a request of serve's waits for it: its tokens are serve's to say
    a.tokens, a.sig = toks(1, 2, 3), (4, 3)
    view.apply(entries({"id_task": 5, "n_prompt_tokens": 10}, {}))
    assert list(a.tokens) == [1, 2, 3] and a.sig == (4, 3)


def test_the_slot_sharing_the_longest_prefix_else_the_least_recently_used():
    view = SlotView(min_gain=4)
    view.apply(entries({}, {}, {}))
    s0, s1, s2 = (view.slots[i] for i in range(3))
    s0.tokens, s0.used = toks(1, 5, 6, 7, 8, 9), 3.0
    s1.tokens, s1.used = toks(1, 2, 3, 4, 5, 6, 7), 2.0
    s2.used = 1.0
    prompt = toks(1, 2, 3, 4, 5, 6, 7, 8)
    assert view.choose(prompt, None) is s1 and s1.pending == 1
    # the one sharing the most is held: the next goes to the least recently used free one (shares only BOS)
    assert view.choose(prompt, -1) is s2
    # sharing fewer than min_gain (a BOS token): the least recently used, not the conversation's slot
    s1.pending = s2.pending = 0
    assert view.choose(toks(1, 40, 41, 42, 43), None) is s2
    # a slot asked for by id; one the server does not have: no choice (the server answers)
    assert view.choose(prompt, 0) is s0
    assert view.choose(prompt, 7) is None
    assert SlotView().choose(prompt, None) is None      # no slot known
    # a slot another client works in is left, as long as another is free
    for s in (s0, s1, s2):
        s.pending = 0
    view.busy = {1}
    assert view.choose(prompt, None) is not s1


def test_a_restore_is_looked_up_only_when_it_could_keep_min_gain_more():
    view = SlotView(min_gain=4)
    view.apply(entries({}))
    s = view.slots[0]
    s.tokens = toks(1, 2, 3, 4, 5, 6)
    assert not view.may_restore(s, toks(1, 2, 3, 4, 5, 6, 7, 8))     # 2 new tokens (+1 evaluated again)
    assert view.may_restore(s, toks(1, 2, 3, 4, 5, 6, 7, 8, 9, 10))
    assert view.held(s, toks(1, 2, 3, 4, 5, 6)) == 5                  # the whole prompt: its last evaluated again
    assert view.held(s, toks(1, 2, 9)) == 2


def test_a_text_that_begins_with_the_slots_own_goes_there():
    view = SlotView(min_gain=4)
    view.apply(entries({}, {}))
    a, b = view.slots[0], view.slots[1]
    a.sent(toks(1, 2, 3), "Once upon", toks(1, 2))
    b.sent(toks(1, 2, 3, 4), "Once upon a time", toks(1, 2, 3))
    assert view.by_text("Once upon a time there was", None) is b      # the longest such
    assert view.by_text("Once upon a hill", None) is a
    assert view.by_text("Once upon a time there was", 0) is a          # the slot asked for alone
    assert view.by_text("Twice", None) is None
    b.pending = 1
    assert view.by_text("Once upon a time there was", None) is a       # held: not that one
    view.busy = {0}
    assert view.by_text("Once upon a hill", None) is None              # another client's at work there
    a.tokens = EMPTY                                                   # any other change forgets the text
    assert a.text is None


def test_a_probe_takes_the_idle_slot_holding_the_fewest_tokens():
    view = SlotView()
    view.apply(entries({"id_task": 1, "n_prompt_tokens": 50}, {"id_task": 2, "n_prompt_tokens": 20}, {}))
    s0, s1, s2 = (view.slots[i] for i in range(3))
    assert (s0.holds, s1.holds, s2.holds) == (50, 20, 0)
    assert view.for_probe() is s2 and s2.pending == 1
    assert view.for_probe() is s1
    view.busy = {0}
    assert view.for_probe() is None
