"""serve's view of the slots and its choice of a slot (slotctl.serve.slots): plain code, tested without a
server or a network: ``GET /slots`` answers as b11434 gives them, the choices the proxy makes from them."""

from __future__ import annotations

import numpy as np

import asyncio

from slotctl.serve.slots import EMPTY, PROBE, REQUEST, SAVE, UNKNOWN, WAIT, SlotView, signature


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
    view.hold(a, REQUEST)            # a request of serve's holds it: its tokens are serve's to say
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
    assert view.choose(prompt, None) is s1
    view.hold(s1, REQUEST)
    # the one sharing the most is held by a request: the next goes to the least recently used free one
    assert view.choose(prompt, -1) is s2
    # sharing fewer than min_gain (a BOS token): the least recently used, not the conversation's slot
    view.release(s1)
    assert view.choose(toks(1, 40, 41, 42, 43), None) is s2
    # a slot asked for by id; one the server does not have: no choice (the server answers)
    assert view.choose(prompt, 0) is s0
    assert view.choose(prompt, 7) is None
    assert SlotView().choose(prompt, None) is None      # no slot known
    # a slot asked for by id and held by serve: waited for
    view.hold(s0, REQUEST)
    assert view.choose(prompt, 0) is WAIT
    view.release(s0)
    # a slot another client works in is left, as long as another is free
    view.busy = {1}
    assert view.choose(prompt, None) is not s1
    # every slot busy with another client's work: the server queues it (the least recently used is named)
    view.busy = {0, 1, 2}
    assert view.choose(prompt, None) is s2


def test_every_slot_held_waits_for_the_first_that_frees():
    """The server's own order (b11434 get_available_slot, its deferred tasks): a request waits for the first slot
    that frees, not for one chosen slot while another frees."""
    async def run():
        view = SlotView(min_gain=4)
        view.apply(entries({}, {}))
        s0, s1 = view.slots[0], view.slots[1]
        s0.tokens = toks(1, 2, 3, 4, 5, 6, 7, 8)        # shares the most with the prompt
        view.hold(s0, REQUEST)
        view.hold(s1, REQUEST)
        prompt = toks(1, 2, 3, 4, 5, 6, 7, 8, 9)
        assert view.choose(prompt, None) is WAIT
        waiting = asyncio.ensure_future(view.take(prompt, None))
        await asyncio.sleep(0)
        assert not waiting.done()
        view.release(s1)                                # s1 frees first: taken, s0 not waited for
        got = await asyncio.wait_for(waiting, 5)
        assert got is s1 and s1.holder == REQUEST and s0.holder == REQUEST

    asyncio.run(run())


def test_a_turn_waits_for_its_own_slot_while_it_is_only_being_saved():
    async def run():
        view = SlotView(min_gain=4)
        view.apply(entries({}, {}))
        own, other = view.slots[0], view.slots[1]
        own.tokens = toks(*range(1, 41))                # the conversation's 40 tokens, its answer being saved
        view.hold(own, SAVE)
        turn = toks(*range(1, 51))
        assert view.choose(turn, None) is WAIT          # not the idle other slot: its own, in a moment
        waiting = asyncio.ensure_future(view.take(turn, None))
        await asyncio.sleep(0)
        assert not waiting.done() and other.idle
        view.release(own)                               # the save done
        assert await asyncio.wait_for(waiting, 5) is own
        # a prompt that shares nothing with the slot being saved takes the idle one at once
        view.release(own)
        view.hold(own, SAVE)
        assert view.choose(toks(1, 90, 91, 92, 93), None) is other
        # an idle slot sharing as much as the one being saved: no wait
        other.tokens = toks(*range(1, 41))
        assert view.choose(turn, None) is other
        # a probe (a save to learn the server's flags) counts as a save
        view.release(own)
        other.tokens = EMPTY
        view.hold(own, PROBE)
        assert view.choose(turn, None) is WAIT

    asyncio.run(run())


def test_a_slot_the_server_no_longer_has_leaves_the_view():
    view = SlotView(min_gain=4)
    view.apply(entries({}, {}, {}))
    s0, s1, s2 = (view.slots[i] for i in range(3))
    view.hold(s2, REQUEST)
    # restarted with -np 2: slot 2 is gone; held by a request, it leaves once given back
    view.apply(entries({"id_task": 0}, {"id_task": 0}))
    assert s2.gone and 2 in view.slots
    assert view.choose(toks(1, 2, 3, 4, 5), 2) is None          # asked for by id: the server's own answer
    assert all(view.choose(toks(1, 2, 3, 4, 5), None) is not s2 for _ in range(3))
    assert s2 not in view.free()
    view.release(s2)
    assert sorted(view.slots) == [0, 1]
    # an idle slot gone leaves at once; shown again later, it is a new slot of the view
    view.apply(entries({"id_task": 1}))
    assert sorted(view.slots) == [0]
    view.apply(entries({"id_task": 2}, {"id_task": 2}))
    assert sorted(view.slots) == [0, 1] and view.slots[1] is not s1 and view.slots[1].idle


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
    view.hold(b, REQUEST)
    assert view.by_text("Once upon a time there was", None) is a       # held by a request: not that one
    view.release(b)
    view.hold(b, SAVE)
    assert view.by_text("Once upon a time there was", None) is b       # only being saved: its turn waits for it
    view.busy = {0}
    assert view.by_text("Once upon a hill", None) is None              # another client's at work there
    a.tokens = EMPTY                                                   # any other change forgets the text
    assert a.text is None


def test_a_probe_takes_the_idle_slot_holding_the_fewest_tokens():
    view = SlotView()
    view.apply(entries({"id_task": 1, "n_prompt_tokens": 50}, {"id_task": 2, "n_prompt_tokens": 20}, {}))
    s0, s1, s2 = (view.slots[i] for i in range(3))
    assert (s0.holds, s1.holds, s2.holds) == (50, 20, 0)
    assert view.for_probe() is s2 and s2.holder == PROBE
    assert view.for_probe() is s1
    view.busy = {0}
    assert view.for_probe() is None
