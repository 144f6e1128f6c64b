"""The cached completion path of ``slotctl serve``: a completion request given a slot, the stored state that pays
restored into it, sent, and its slot saved into the store after a whole answer. This module changes when the
steps of a cached request, or their order, change.

A completion request (:data:`slotctl.server.requests.COMPLETION_PATHS`) whose body is a JSON object serve may
cache (the proxy decides: :meth:`slotctl.serve.proxy.Proxy.completion`) is given a slot first
(:meth:`slotctl.serve.slots.SlotView.choose`, from serve's own view of what each slot holds: ``GET /slots`` is
asked only when a connection to the server was made since it was last asked, and once a second in the
background), or by its text alone when it begins with what a slot was last sent (:meth:`Completions.by_text`);
the stored state that pays is restored into it (:meth:`slotctl.serve.cache.Cache.prepare`), and it goes with
``id_slot`` and ``cache_prompt``; after a whole answer, the slot is saved into the store before another request
may use it (:meth:`Completions._save_then_release`). A request waits for the first slot that frees, as the
server's own deferred tasks do (:meth:`slotctl.serve.slots.SlotView.take`). Whatever fails in the cache, the
request goes on uncached, and a store that does not answer within the request's time (the prefill a restore
would spare: the server's time, never the store's) is left to itself and not asked again until it answers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any, Callable, Protocol

import numpy as np
from aiohttp import web

from slotctl.live import http
from slotctl.serve.body import with_slot
from slotctl.serve.cache import Cache, Gate, Prepared, StoreOff
from slotctl.serve.index import as_tokens, common_prefix
from slotctl.serve.relay import Relay, Relayed
from slotctl.serve.slots import EMPTY, REQUEST, SAVE, UNKNOWN, Slot, SlotView
from slotctl.server.requests import TOKENIZE_FLAGS, prompt_form

#: tokens at the end of a prompt text that may be tokenized otherwise once more text follows it (the last
#: word, number or run of spaces: tokenizers split text into such pieces and merge only within one)
MARGIN = 8
#: seconds a request waits for the store's side of a restore (its lookup, verdict, download) from an ``s3://``
#: store at least: the prefill the restore would spare when longer (the server's time). A first verdict on a
#: state reads the model's GGUF (a few hundred ms with a small model, more on a loaded machine), which this
#: leaves room for; a store that stalls costs one request this much, and the next ones nothing (the store is
#: not asked again until it answers). A directory store is the machine's own disk: waited for
STORE_WAIT = 2.0
#: the same before the server's prefill speed is measured (serve's first requests): a request to the store that
#: takes longer than :data:`slotctl.serve.cache.STORE_STALL` makes it count as down whatever this is
STORE_WAIT_UNMEASURED = 10.0
#: seconds a returning turn sent by its text waits for the store's listing (else its tokens are asked for)
LISTING_WAIT = 0.25
#: worker threads for the store's side of requests (apart from serve's small requests, so that a store that
#: stalls never holds them up)
STORE_THREADS = 4


class Proxy(Protocol):
    """What the cached path uses of its proxy (:class:`slotctl.serve.proxy.Proxy`, which makes it: not imported
    here): its cache, view of the slots, relay, metrics and events, and its steps that keep the view true."""

    cache: Cache
    view: SlotView
    relay: Relay
    min_gain: int
    metrics: Any
    log: Callable[..., None]

    async def small(self, fn, *args, **kwargs) -> Any: ...
    async def post(self, path: str, body: dict, key: str | None) -> Any: ...
    async def get_slots(self, key: str | None) -> list[dict]: ...
    async def check_slots(self, key: str | None) -> bool: ...
    async def health(self, key: str | None) -> None: ...
    async def same_server(self, form: str, key: str | None) -> bool: ...
    async def probe_when_due(self, key: str | None, read_facts: bool = False) -> None: ...
    async def through(self, request: web.Request, raw: bytes) -> web.StreamResponse: ...
    def outcome(self, outcome: str) -> None: ...
    def spawn(self, coro, name: str = "task") -> asyncio.Task: ...


class Completions:
    """The cached path of ``proxy``'s completion requests (see the module docstring), with the worker threads of
    its store's side."""

    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        self.cache = proxy.cache
        self.log = proxy.log
        self.metrics = proxy.metrics
        self.min_gain = proxy.min_gain
        self._store_threads = concurrent.futures.ThreadPoolExecutor(STORE_THREADS, "slotctl-serve-store")

    @property
    def view(self) -> SlotView:
        """The proxy's view of its slots (a router's model's proxy is given its own after it is made)."""
        return self.proxy.view

    def close(self) -> None:
        self._store_threads.shutdown(wait=False)

    async def _on_store(self, fn, *args):
        """``fn(*args)``, work on the store's side (a lookup, a restore, a save stored), in a worker thread of its
        own pool: a store that stalls holds those threads, never the ones of serve's small requests."""
        return await asyncio.get_running_loop().run_in_executor(self._store_threads, fn, *args)

    async def handle(self, request: web.Request, raw: bytes, body: dict, form: str, key: str | None,
                     began: float) -> web.StreamResponse:
        """A completion request serve caches (its body ``raw``, parsed as ``body``; ``key``: serve's own requests'
        for it; ``began``: when serve had it): given a slot and sent (:meth:`send`), or passed through uncached
        when none can be had."""
        c = self.cache.counters
        # serve's view of the slots is read again (GET /slots) only when a connection to the server was made
        # since it was last read (serve's first request, a restarted server): at the same time as the prompt's
        # tokens are asked for when that is known before; after, when asking for them took a new connection.
        # A prompt of tokens asks the server nothing: GET /health is asked instead, for its connection.
        check = None if self.view.trusted else asyncio.ensure_future(self.proxy.check_slots(key))
        text = slot = tokens = None
        waited = 0.0
        try:
            prompt = await self.prompt_of(body, form, key)
            text = prompt if isinstance(prompt, str) else None
            if text is not None and (check is None or await check):
                slot, waited = await self.by_text(text, body.get("id_slot"), form, key)   # no /tokenize first
            if slot is None:
                tokens = await self.tokens_of(prompt, key)
        except Exception as e:  # noqa: BLE001 - the cache never fails a request
            c.add("lookup_failures")
            self.log("error", f"{request.path}: the prompt's tokens cannot be had ({e}): passed through uncached")
        if slot is not None:
            return await self.send(request, body, slot, key, None, text, began, waited)
        if check is not None:
            await check
        if tokens is None or len(tokens) == 0:
            return await self.proxy.through(request, raw)
        if check is None and form != "chat" and prompt_form(body.get("prompt")) == "tokens":
            await self.proxy.health(key)
        if not self.view.trusted and not await self.proxy.check_slots(key):
            self.log("error", "GET /slots cannot be read: the request passes through uncached")
            return await self.proxy.through(request, raw)
        t0 = time.monotonic()
        slot = await self.view.take(tokens, body.get("id_slot"))    # the first slot that frees, as the server's
        waited = time.monotonic() - t0
        if slot is None:
            return await self.proxy.through(request, raw)
        return await self.send(request, body, slot, key, tokens, text, began, waited)

    async def send(self, request: web.Request, body: dict, slot: Slot, key: str | None, tokens: np.ndarray | None,
                   text: str | None, began: float, waited: float) -> web.StreamResponse:
        """The request sent into ``slot`` (held for it), the slot held until its save: prepared first
        (:meth:`_prepare`) when the prompt's ``tokens`` are known; None: a prompt ``text`` that begins with the
        slot's own (:meth:`by_text`), its tokens asked for once the answer was passed on. ``began``: when
        serve had the request; ``waited``: the seconds it waited for its slot (the server alone would have
        too), the rest of what passed until it goes is what serve added."""
        c = self.cache.counters
        c.add("cached")
        handed = False
        try:
            before, prompt_before = slot.tokens, slot.prompt
            if tokens is not None:
                prepared = await self._prepare(slot, tokens, key)
                if self.metrics is not None:
                    self.metrics.prompt(prepared.reused, len(tokens) - prepared.reused)
            else:
                c.add("matched_by_text")
                prepared = Prepared(0, "slot_hit")
            self.proxy.outcome(prepared.outcome)
            data = with_slot(request["slotctl.body"], body, slot.id)
            if self.metrics is not None:
                self.metrics.added_time_to_first_token(max(0.0, time.monotonic() - began - waited))
            relayed = await self.proxy.relay.forward(request, data, self.proxy.relay.headers(request))
            slot.used = time.monotonic()
            self._measured(relayed, prepared, slot)
            if relayed.completed:
                # the save is asked once the answer was passed on, not while its last bytes are on their way
                # (the save's worker thread then held them back by a few milliseconds, measured)
                slot.sig = UNKNOWN
                if tokens is not None:
                    slot.sent(tokens, text, tokens)
                    learnt = None
                else:       # its own text kept (its next turn finds the slot), its tokens asked for meanwhile
                    slot.sent(before, text, prompt_before)
                    learnt = asyncio.ensure_future(self._tokens_sent(slot, text, before, key))
                self.view.hold(slot, SAVE)
                self.proxy.spawn(self._save_then_release(slot, key, learnt), name=f"save-{slot.id}")
                handed = True
            else:
                slot.forget()     # a broken answer: what the slot holds is not known
            return relayed.response
        finally:
            if not handed:
                self.view.release(slot)

    async def _prepare(self, slot: Slot, tokens: np.ndarray, key: str | None) -> Prepared:
        """The restore for a request (:meth:`Cache.prepare`) when one could pay and the store can be used: its
        store side (an ``s3://`` store's) waited for no longer than the prefill the restore would spare (the
        server's time: at least :data:`STORE_WAIT`), then the request goes uncached and the store is left alone
        until that work ends (:meth:`Cache.stall_begins`)."""
        c = self.cache.counters
        held = self.view.held(slot, tokens)
        own = Prepared(held, "slot_hit" if held >= self.min_gain else "cold")
        if not self.view.may_restore(slot, tokens):
            return own
        if self.cache.learn_due:
            await self.proxy.probe_when_due(key, read_facts=True)  # the server's flags learnt before it is judged
        off = self.cache.unusable()
        self.cache.said_off()
        if off is not None:
            return own if own.outcome == "slot_hit" else Prepared(held, "uncached")
        spare = self.cache.costs.prefill_ms(len(tokens) - held)
        wait = STORE_WAIT_UNMEASURED if spare is None else max(STORE_WAIT, spare / 1000.0)
        if not self.cache.by_cost:
            wait = STORE_WAIT_UNMEASURED    # --restore-policy tokens: restored whatever the prefill costs
        if not self.cache.where_s3():
            wait = None     # the machine's own disk
        gate = Gate()
        work = asyncio.ensure_future(self._on_store(self.cache.prepare, slot, tokens, self.min_gain, key, gate))
        try:
            done, _ = await asyncio.wait({work}, timeout=wait)
            if not done and gate.give_up():
                self._stalled(work, wait)
                return Prepared(held, "uncached")
            return await work       # done, or the restore sent to the server: the server's time now
        except Exception as e:  # noqa: BLE001 - a restore that fails: the request goes uncached
            c.add("restore_failures")
            slot.tokens = EMPTY
            self.log("error", f"slot {slot.id}: no restore ({e}): the request goes uncached", slot=slot.id)
            return Prepared(0, "uncached")

    def _stalled(self, work: asyncio.Future, wait: float) -> None:
        """A request stopped waiting for the store's side of its restore after ``wait`` seconds: the store is not
        used until that work ends (said once, a ``cache`` event)."""
        self.cache.counters.add("lookup_failures")
        self.cache.stall_begins()
        self.log("error", f"the store did not answer within {wait * 1000:.0f} ms (the prefill a restore would spare, "
                          f"at least {STORE_WAIT:g} s): the request goes uncached", code="store_stalled")
        self.cache.said_off()

        def ended(_f) -> None:
            self.cache.stall_ends()
            if not _f.cancelled():
                _f.exception()      # retrieved: said already
            self.cache.said_off()

        work.add_done_callback(ended)

    def _measured(self, relayed: Relayed, prepared: Prepared, slot: Slot) -> None:
        """The server's timings of an answer taken (its prefill speed), and a restore-or-prefill choice's
        outcome said (an ``outcome`` event: what was predicted, what the server's timings and the restore
        measured)."""
        timings = relayed.timings
        self.cache.costs.prefilled(timings)
        pred = prepared.prediction
        if pred is None or not timings or not isinstance(timings.get("prompt_ms"), (int, float)):
            return
        restore_ms = (prepared.seconds or 0.0) * 1000.0
        measured = timings["prompt_ms"] + restore_ms
        chose = "restore" if prepared.outcome == "restored" else "prefill"
        predicted = pred.restore_ms if chose == "restore" else pred.prefill_ms
        self.log("outcome", f"slot {slot.id}: {'restored' if chose == 'restore' else 'prefill'}: predicted "
                            f"{predicted:.0f} ms, measured {measured:.0f} ms (the server's prompt "
                            f"{timings['prompt_ms']:.0f} ms for {timings.get('prompt_n', 0):.0f} tokens"
                            + (f", the restore {restore_ms:.0f} ms" if prepared.outcome == "restored" else "") + ")",
                 slot=slot.id, chose=chose, predicted_ms=round(predicted, 3),
                 measured_ms=round(measured, 3), prompt_n=timings.get("prompt_n"), prediction=pred.as_dict())
        if self.metrics is not None:
            self.metrics.predicted(chose, predicted / 1000.0, measured / 1000.0)

    async def by_text(self, text: str, want, form: str, key: str | None) -> tuple[Slot | None, float]:
        """The slot for a prompt ``text`` without asking the server for its tokens (held for it): the slot whose
        own prompt text (:attr:`Slot.text`) ``text`` begins with, the longest such (``want``'s alone when
        given: :meth:`SlotView.by_text`), waited for while its save runs, when no stored state could keep
        ``min_gain`` tokens more of the request than the slot holds (:meth:`Cache.may_beat`: such a state would
        begin with the slot's prompt tokens but their last :data:`MARGIN`, the tokens that more text may
        change). That is the choice :meth:`SlotView.choose` and :meth:`Cache.prepare` make from the prompt's
        tokens: the slot shares the most of it, and nothing is restored. None: the tokens are needed. With the
        seconds it waited for the slot's save."""
        waited = 0.0
        if self.view.by_text(text, want) is None or not await self.proxy.same_server(form, key):
            return None, waited
        if not self.cache.index_fresh() and self.cache.unusable() is None:
            # other serve processes' states, listed as prepare lists them (not waited for long: a store that
            # stalls sends the turn the long way, whose lookup gives up in the server's time)
            listing = asyncio.ensure_future(self._on_store(self.cache.sync_index))
            done, _ = await asyncio.wait({listing}, timeout=LISTING_WAIT)
            if not done or listing.exception() is not None:
                return None, waited
        for _ in range(4):
            s = self.view.by_text(text, want)       # again: other requests ran meanwhile
            if s is None or not self.view.trusted or self.cache.may_beat(s.prompt, s.tokens, self.min_gain, MARGIN):
                return None, waited
            if s.idle:
                self.view.hold(s, REQUEST)
                return s, waited
            t0 = time.monotonic()
            await self.view.idle_again(s)       # its save (the turn came the moment its answer did)
            waited += time.monotonic() - t0
        return None, waited

    async def prompt_of(self, body: dict, form: str, key: str | None):
        """The request's prompt as the server reads it: its ``prompt``, or a chat's ``messages`` through the
        server's ``/apply-template``; None for a chat serve does not cache (no messages, media)."""
        if form == "chat":
            if not isinstance(body.get("messages"), list) or self.cache.facts.mmproj:
                return None
            answer = await self.proxy.post("/apply-template", body, key)
            return answer.get("prompt") if isinstance(answer, dict) else None
        return body.get("prompt")

    async def tokens_of(self, prompt, key: str | None) -> np.ndarray | None:
        """A prompt (:meth:`prompt_of`) as the server tokenizes it: its own token ids, or the server's
        ``/tokenize`` of its text; None when it is no one prompt serve can tokenize (several prompts)."""
        how = prompt_form(prompt)
        if how == "tokens":
            return as_tokens(prompt)
        if how != "text":
            return None
        answer = await self.proxy.post("/tokenize", {"content": prompt, **TOKENIZE_FLAGS}, key)
        toks = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise http.ServerAnswerError(f"POST {self.proxy.relay.base}/tokenize: no token list in the answer")
        return as_tokens(toks)

    async def _save_then_release(self, slot: Slot, key: str | None, learnt: asyncio.Future | None = None) -> None:
        """After a whole answer (the slot held by its save meanwhile, :data:`SAVE`: the conversation's next turn
        waits for it): the slot saved by the server (asked at once, on a kept connection) and the file checked
        (in a worker thread), its ``/slots`` signature noted, then freed; the state is stored after (the slot's
        next request need not wait for the copy). With the store not to be used (:meth:`Cache.unusable`), no
        save is asked (it could not be stored). A request sent by its text (:meth:`by_text`) has its text's
        tokens asked for meanwhile (``learnt``): what the slot now holds, and the prompt tokens kept and
        evaluated for the metrics."""
        began = time.perf_counter()
        saved = None
        try:
            if self.cache.unusable() is None:
                work = self.cache.work_name(slot.id)
                try:
                    answer = await self.proxy.small(self.cache.save, slot.id, work, key)
                    self.cache.costs.saved(answer)
                    saved = await asyncio.to_thread(self.cache.checked, slot.id, work, answer)
                except Exception as e:  # noqa: BLE001 - a save that fails costs the next restore, nothing more
                    self.cache.discard(work)
                    self.cache.counters.add("save_failures")
                    self.log("error", f"slot {slot.id}: not saved: {e}", slot=slot.id)
            if learnt is None:          # the prompt's tokens known before: what the slot holds, saved
                if saved is not None:
                    slot.sent(saved.tokens, slot.text, slot.prompt)
            else:
                prompt = await learnt
                if prompt is None:
                    slot.tokens = saved.tokens if saved is not None else EMPTY
                else:
                    slot.sent(saved.tokens if saved is not None else prompt, slot.text, prompt)
            try:
                entries = await self.proxy.get_slots(key)
                self.view.noted(slot, next((e for e in entries if e.get("id") == slot.id), None))
                if self.view.apply(entries):    # the other slots as the server shows them now: the view read
                    self.cache.learn_due = True
                    self.cache.server_restarted()
            except Exception:  # noqa: BLE001 - unknown: the next check finds the slot's tokens unknown
                slot.sig = UNKNOWN
        finally:
            self.view.release(slot)
        if saved is not None:
            try:
                await self._on_store(self.cache.store_saved, saved, began)
            except StoreOff as e:
                self.cache.counters.add("save_failures")
                self.log("error", f"slot {slot.id}: {e}", slot=slot.id, code="store_off")
            except Exception as e:  # noqa: BLE001 - the store down: the next restore misses it
                self.cache.counters.add("save_failures")
                self.log("error", f"slot {slot.id}: not stored: {e}", slot=slot.id)
            finally:
                self.cache.said_off()
            if self.metrics is not None:
                self.metrics.save_took(time.perf_counter() - began)

    async def _tokens_sent(self, slot: Slot, text: str, before: np.ndarray, key: str | None) -> np.ndarray | None:
        """The server's tokens of a prompt ``text`` sent by :meth:`by_text` into ``slot``, which held ``before``
        (the metrics told what the server kept of it); None when they cannot be had (the slot's text is then
        forgotten: its next request asks for its tokens first)."""
        try:
            tokens = await self.tokens_of(text, key)
        except Exception as e:  # noqa: BLE001 - costs the next request its shortcut, nothing more
            tokens = None
            self.log("error", f"slot {slot.id}: the prompt's tokens cannot be had ({e})", slot=slot.id)
        if tokens is None or len(tokens) == 0:
            self.cache.counters.add("lookup_failures")
            return None
        if self.metrics is not None:
            reused = min(common_prefix(before, tokens), len(tokens) - 1)
            self.metrics.prompt(reused, len(tokens) - reused)
        return tokens
