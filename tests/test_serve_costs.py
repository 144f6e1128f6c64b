"""serve's restore-or-prefill prediction (slotctl.serve.costs) and what it reads of a relayed answer
(slotctl.serve.relayed): plain code, fed the server's own answers' shapes (b11434's ``timings``, a slot
restore's and save's answers, its SSE streams as the ``openai`` SDK and ``/completion`` read them). The policy
against a real server is tests/test_serve.py's."""

from __future__ import annotations

import json

from slotctl.serve.costs import MIN_PREFILL, WINDOW, Costs
from slotctl.serve.relayed import TAIL, Tail


def restore_answer(n_read: int, ms: float) -> dict:
    """A slot restore's answer as b11434 gives it."""
    return {"id_slot": 0, "filename": "x.bin", "n_restored": 100, "n_read": n_read, "timings": {"restore_ms": ms}}


def save_answer(n_written: int, ms: float) -> dict:
    return {"id_slot": 0, "filename": "x.bin", "n_saved": 100, "n_written": n_written, "timings": {"save_ms": ms}}


def test_nothing_is_predicted_before_it_is_measured():
    c = Costs()
    assert c.predict(n_request=1000, held=0, kept=900, size=1 << 20) is None
    assert c.prefill_ms(100) is None and not c.cheaper_than_any_restore(10)
    c.prefilled({"prompt_n": 500, "prompt_ms": 1000.0})
    assert c.predict(n_request=1000, held=0, kept=900, size=1 << 20) is None     # the restore not measured
    assert set(c.known()) == {"prefill_ms_per_token", "restore_ms_per_mb", "save_ms_per_mb", "place_ms_per_mb",
                              "store_ms_per_mb"}


def test_a_restore_is_chosen_only_when_predicted_faster():
    c = Costs()
    c.prefilled({"prompt_n": 1000, "prompt_ms": 2000.0})         # 2 ms a token: a model whose prefill costs
    c.restored(restore_answer(10_000_000, 100.0))                # 0.01 ms a kB
    c.placed(10_000_000, 0.05)                                   # 5 ms a MB into the slot directory
    big = c.predict(n_request=2000, held=0, kept=1900, size=10_000_000)
    assert big.restore and big.prefill_ms == 4000.0
    assert abs(big.restore_ms - (50.0 + 100.0 + 200.0)) < 1e-6 and big.as_dict()["chose"] == "restore"
    # a prefill that costs little (a tiny model): the same state is not worth it
    cheap = Costs()
    cheap.prefilled({"prompt_n": 1000, "prompt_ms": 20.0})
    cheap.restored(restore_answer(10_000_000, 100.0))
    cheap.placed(10_000_000, 0.05)
    small = cheap.predict(n_request=2000, held=0, kept=1900, size=10_000_000)
    assert not small.restore and small.as_dict()["chose"] == "prefill"
    # what the slot holds is not prefilled either way
    assert cheap.predict(n_request=2000, held=1500, kept=1900, size=10_000_000).prefill_ms == 10.0
    # no state pays when the prefill is cheaper than the fastest placing measured
    assert cheap.cheaper_than_any_restore(100) and not c.cheaper_than_any_restore(100)


def test_priors_the_servers_save_and_the_stores_writes():
    c = Costs()
    c.prefilled({"prompt_n": 100, "prompt_ms": 100.0})
    c.saved(save_answer(1_000_000, 10.0))       # before any restore: the save's speed stands for the read's
    c.stored(1_000_000, 0.02)                   # before any placing: the store's writes stand for it
    p = c.predict(n_request=200, held=0, kept=190, size=1_000_000)
    assert abs(p.read_ms - 10.0) < 1e-9 and abs(p.place_ms - 20.0) < 1e-9
    # a state already in the slot directory (a conversion's file), or a store that is the slot directory:
    # nothing to place
    assert c.predict(n_request=200, held=0, kept=190, size=1_000_000, placed=True).place_ms == 0.0
    free = Costs(placed_free=True)
    free.prefilled({"prompt_n": 100, "prompt_ms": 100.0})
    free.saved(save_answer(1_000_000, 10.0))
    assert free.predict(n_request=200, held=0, kept=190, size=1_000_000).place_ms == 0.0
    assert not free.cheaper_than_any_restore(1)


def test_measurements_weigh_by_size_and_only_the_newest_count():
    c = Costs()
    c.prefilled({"prompt_n": MIN_PREFILL - 1, "prompt_ms": 1000.0})      # a few tokens: a batch's fixed time
    c.prefilled({"prompt_n": 1, "prompt_ms": 5.0})
    c.prefilled(None)
    c.prefilled({"prompt_n": "x", "prompt_ms": 5.0})
    assert c.prefill_ms(1) is None
    c.prefilled({"prompt_n": 100, "prompt_ms": 100.0})
    c.prefilled({"prompt_n": 900, "prompt_ms": 1900.0})
    assert c.prefill_ms(1) == 2.0 * 1000 / 1000          # sums, not a mean of ratios (1 and 2.11)
    for _ in range(WINDOW):
        c.prefilled({"prompt_n": 100, "prompt_ms": 50.0})
    assert c.prefill_ms(10) == 5.0                       # the old ones left the window
    c.restored({"n_read": 0, "timings": {"restore_ms": 3}})  # nothing read: not a measurement
    c.restored("not a dict")
    assert c.known()["restore_ms_per_mb"] is None


def sse(*events: dict, done: bool = False) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def test_a_stream_is_complete_at_its_last_event():
    timings = {"prompt_n": 40, "prompt_ms": 12.5, "cache_n": 3, "predicted_n": 8}
    # the OpenAI-compatible endpoints: data: [DONE] ends the stream (the openai SDK closes right after it)
    t = Tail("text/event-stream; charset=utf-8")
    t.feed(sse({"choices": [{"delta": {"content": "a"}}]}))
    assert t.stream and not t.final()
    t.feed(sse({"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": timings}, done=True))
    assert t.final() and t.timings() == timings
    # /completion: the event with a stop_type but "none" ends it
    c = Tail("text/event-stream")
    c.feed(sse({"content": "a", "stop": False, "stop_type": "none"}))
    assert not c.final()
    c.feed(sse({"content": "", "stop": True, "stop_type": "limit", "timings": timings}))
    assert c.final() and c.timings()["prompt_ms"] == 12.5
    # a JSON answer is complete from its headers
    j = Tail("application/json")
    j.feed(json.dumps({"content": "x", "timings": dict(timings, flag=True, name="n")}).encode())
    assert j.final() and j.timings() == timings            # numbers only
    assert Tail("text/event-stream").timings() is None


def test_only_the_tail_of_a_long_answer_is_kept():
    t = Tail("text/event-stream")
    for _ in range(200):
        t.feed(sse({"choices": [{"delta": {"content": "x" * 500}}]}))
    assert len(t.data) <= 2 * TAIL and not t.final()
    t.feed(sse({"choices": [], "timings": {"prompt_n": 5, "prompt_ms": 1.0}}, done=True))
    assert t.final() and t.timings() == {"prompt_n": 5, "prompt_ms": 1.0}
