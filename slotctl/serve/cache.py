"""The blocking side of ``slotctl serve``: what it asks the server and the store, run in worker threads.

The server's states are kept as keep keeps them (:class:`slotctl.keeping.states.ServerStates`: the server's
flags learnt from its saves, each stored state judged through the store's catalog, placed and restored,
converted for another ``-np``/``-kvu``, each save checked and stored under the names keep writes too,
prune's budget); what is serve's own is here: the stored states' tokens for prefix lookups
(:class:`slotctl.serve.index.StateIndex`), the counters, and what serve says of each save and restore.

Every failure is the caller's to count: a method raises, the proxy sends the request uncached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from slotctl import seal
from slotctl.keeping.judged import Judged
from slotctl.keeping.states import ServerStates
from slotctl.keeping.store import Saved
from slotctl.live import http
from slotctl.serve.costs import Costs, Prediction
from slotctl.serve.index import State, StateIndex, as_tokens
from slotctl.server.reuse import request_reuse

#: verdicts serve restores (validate's: nothing dropped, nothing refused)
RESTORABLE = ("restores",)
#: seconds a request to the store may take in the request path before the store counts as down (every later
#: request then goes uncached at once, and the store is tried again in the background)
STORE_STALL = 5.0

#: what happened to a request's prompt, for the metrics (``slotctl_serve_request_outcomes_total``): its slot
#: held at least ``--min-gain`` of it; a stored state was restored; a restore was predicted slower than
#: prefill; nothing held and nothing restored; the cache could not be used (the store down or stalled, no
#: lease, a lookup or restore that failed); not given a slot at all
OUTCOMES = ("slot_hit", "restored", "prefill", "cold", "uncached", "passed_through")


@dataclass
class Prepared:
    """What :meth:`Cache.prepare` did for a request: the prompt tokens the server is predicted to keep
    (``reused``), what happened (``outcome``, one of :data:`OUTCOMES`), the prediction it chose by (None: not
    measured yet, or nothing to choose), and the restore's seconds when it restored."""

    reused: int
    outcome: str
    prediction: Prediction | None = None
    seconds: float | None = None


class StoreOff(Exception):
    """The store is not to be used now (:meth:`Cache.unusable`): nothing is written to it."""


class GaveUp(Exception):
    """The request stopped waiting for the store (:class:`Gate`): nothing is sent to the server for it."""


class Gate:
    """One request's wait on the store's side of a restore, between the proxy (which gives up at its
    deadline: :meth:`give_up`) and the worker thread (which passes it before it sends the server the restore:
    :meth:`enter`); whichever comes first wins, so a restore is either the server's to do, and waited for,
    or never sent."""

    def __init__(self):
        self._lock = threading.Lock()
        self.given_up = self.entered = False

    def enter(self) -> bool:
        with self._lock:
            self.entered = not self.given_up
            return self.entered

    def give_up(self) -> bool:
        """True when given up (the restore was not sent); False when the server has it already."""
        with self._lock:
            self.given_up = not self.entered
            return self.given_up


@dataclass
class Counters:
    """What serve did, for ``GET /slotctl/stats`` and the log: requests seen, cached (given a slot and a
    lookup), passed through untouched, restores done / skipped by the verdict / failed, saves done /
    deduplicated / failed, lookups failed, prompt tokens predicted to be reused thanks to a restore, states
    converted for this server's -np/-kvu / conversions that failed; completions passed through because the
    server refuses the client's key (``unauthorized``) or their body was not read (``unread_bodies``: over
    ``--max-body``)."""

    requests: int = 0
    cached: int = 0
    passed_through: int = 0
    restores: int = 0
    restores_refused_by_verdict: int = 0
    restore_failures: int = 0
    conversions: int = 0
    conversion_failures: int = 0
    saves: int = 0
    saves_deduplicated: int = 0
    save_failures: int = 0
    lookup_failures: int = 0
    matched_by_text: int = 0
    upstream_errors: int = 0
    client_disconnects: int = 0
    unauthorized: int = 0
    unread_bodies: int = 0
    restored_tokens: int = 0
    pruned: int = 0
    #: requests given a slot, by what happened to their prompt (:data:`OUTCOMES`)
    slot_hit: int = 0
    restored: int = 0
    prefill: int = 0
    cold: int = 0
    uncached: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class Cache(ServerStates):
    """serve's side of the server's states (:class:`~slotctl.keeping.states.ServerStates`, as keep keeps them:
    the server at ``url``, its ``--slot-save-path`` ``slot_dir`` here, the store ``store``, or None:
    ``slot_dir`` itself): the stored states' tokens for the request path's lookups (:attr:`index`), the
    counters, and each save checked, stored, indexed and the store pruned, every one said. ``router_model``: one
    model behind the router at ``url`` (:mod:`slotctl.serve.models`: one cache per model, sharing the process's
    ``counters`` and open ``store``)."""

    def __init__(self, url: str, slot_dir: str | os.PathLike, store=None, *,
                 api_key: str | None = None, max_size: int | None = None, timeout: float = 600.0,
                 catalog: bool = True, log=None, flags=None, given: frozenset[str] = frozenset(),
                 restore_policy: str = "cost", draft_model=None, progress=None, router_model: str | None = None,
                 counters: Counters | None = None):
        # the model is hashed (once per file) in a thread of its own: requests go uncached meanwhile
        super().__init__(url, slot_dir, store, role="serve", api_key=api_key, timeout=timeout, max_size=max_size,
                         catalog=catalog, flags=flags, given=given, log=log, draft_model=draft_model,
                         background=True, progress=progress, router_model=router_model)
        self.counters = counters if counters is not None else Counters()
        self.index: StateIndex | None = None
        self._listed = 0.0
        self._syncing = threading.Lock()
        #: what restores and prefill cost, measured (:mod:`slotctl.serve.costs`); ``restore_policy`` "cost": a
        #: restore only when predicted faster than the prefill it spares; "tokens": by ``--min-gain`` alone
        self.costs = Costs(placed_free=bool(getattr(self.store, "same", False)))
        self.by_cost = restore_policy == "cost"
        #: why the store is not used now (None: it is): no lease held, or a request gave up on it (its work
        #: still running: :meth:`stalled`)
        self.lease_off: str | None = None
        self._stalled = 0
        self._off_said: str | None = None
        self.catalog(create=True)       # the stored states' tokens are kept there from the first listing

    # -- the server ------------------------------------------------------------------------------------

    def refresh_facts(self, api_key: str | None = None) -> http.ServerFacts:
        """``/props``, ``/slots``, ``/v1/models`` read again (``api_key``: a client's, when serve has none of its
        own); a new model starts a new index."""
        return self.read_facts(api_key, timeout=min(self.timeout, 30.0))

    def set_facts(self, facts: http.ServerFacts, *, restarted: bool = False) -> bool:
        other = super().set_facts(facts, restarted=restarted)
        if other:
            with self._lock:
                self.index = StateIndex(self.model)
                self._listed = 0.0
        return other

    # -- the store's availability ----------------------------------------------------------------------

    def unusable(self) -> str | None:
        """Why the store is not to be used now (the request goes uncached), or None: no lease held (an
        ``s3://`` store's: another serve may write it), the store known down (a request to it failed to
        answer: tried again in the background), or a request that gave up on it whose work still runs."""
        if self.lease_off is not None:
            return self.lease_off
        if self.where_s3():
            from slotctl.store.s3 import known_down

            down = known_down()
            if down is not None:
                return str(down)
        if self._stalled:
            return "the store did not answer within a request's time (its request still runs)"
        return None

    def where_s3(self) -> bool:
        return self.store.where("").startswith("s3://")

    def stall_begins(self) -> None:
        """A request stopped waiting for its work on the store: the store is not used until it ends
        (:meth:`stall_ends`)."""
        with self._lock:
            self._stalled += 1

    def stall_ends(self) -> None:
        with self._lock:
            self._stalled -= 1

    def said_off(self) -> None:
        """The store's use said off or on again (a ``cache`` event) when that changed since last said."""
        why = self.unusable()
        if why == self._off_said or (why is not None and self._off_said is not None):
            return
        self._off_said = why
        if why is not None:
            self.log("cache", f"the cache is off: {why}: requests are sent uncached (the store is tried again in the "
                              f"background)", state="off", reason=why)
        else:
            self.log("cache", "the cache is on again: the store answers", state="on")

    # -- the index -------------------------------------------------------------------------------------

    def sync_index(self, every: float = 2.0) -> None:
        """The index made to hold the store's states for the server's model (listed at most every ``every``
        seconds: other serve processes may store states meanwhile; one listing at a time). A state whose
        identity the catalog knows is not read again (:class:`slotctl.catalog.Index`)."""
        if self.index is None or time.monotonic() - self._listed < every:
            return
        if not self._syncing.acquire(blocking=False):
            return      # another thread lists it: the index as it is (no thread waits on a store that stalls)
        try:
            self._sync_index(every)
        finally:
            self._syncing.release()

    def index_fresh(self, every: float = 2.0) -> bool:
        """Whether the index was listed less than ``every`` seconds ago (or there is none to list)."""
        return self.index is None or time.monotonic() - self._listed < every

    def may_beat(self, prompt: np.ndarray, held: np.ndarray, min_gain: int, margin: int) -> bool:
        """Whether a stored state could keep ``min_gain`` tokens more than a slot holding ``held`` of a request
        whose tokens begin with ``prompt`` but for its last ``margin`` (the index as last listed). Such a state
        would share more of the request than the slot, so it begins with what the slot shares of it (at
        least ``prompt`` less ``margin``), is longer by ``min_gain``, and is not a prefix of ``held``."""
        if self.index is None:
            return False
        n = max(len(prompt) - margin, 0)
        return self.index.extends(prompt[:n], n + min_gain, held)

    def _sync_index(self, every: float) -> None:
        index = self.index
        if index is None or time.monotonic() - self._listed < every:
            return
        listed = self.listing(self.takes)     # the server's model's states (its content, in their names)
        gone = set(index.states) - set(listed)
        index.forget(gone)
        self.forget(gone)
        new = [n for n in listed if n not in index.states]
        if new:
            where = {n: self.store.where(n) for n in new}
            catalog = self.catalog(create=False)
            known = catalog.get(list(where.values()), "tokens", {where[n]: listed[n][0] for n in new
                                                                 if listed[n][0]}) if catalog else {}
            made = []
            for n in new:
                c = known.get(where[n])
                if c is not None and c.tokens is not None:
                    index.add(State(n, c.tokens, c.kind, listed[n][2]))
                    continue
                st = self._read_state(n)
                if st is not None:
                    index.add(st)
                    if listed[n][0]:
                        from slotctl.catalog import Cached

                        made.append((where[n], listed[n][0], listed[n][1], Cached(None, st.kind, st.tokens,
                                                                                  self.model)))
            catalog = self.catalog(create=bool(made))
            if catalog:
                catalog.put("tokens", made)
            self.log("indexed", f"{len(new)} stored state(s) indexed, {len(new) - len(made)} known to the "
                                f"catalog", n=len(new), read=len(made))
        catalog = self.catalog(create=False) if gone else None
        if catalog:
            catalog.forget([self.store.where(n) for n in gone])
        self._listed = time.monotonic()

    def _read_state(self, name: str) -> State | None:
        """A stored state's tokens, memory kind and size, from its file (tensor bytes never read); None when
        it does not parse (not offered)."""
        from slotctl.slotfile import open_slot_file

        try:
            sf = open_slot_file(self.store.where(name))
        except Exception as e:  # noqa: BLE001 - a state that does not read is not offered
            self.log("error", f"{name}: not indexed: {e}", name=name)
            return None
        try:
            if sf.tokens is None or sf.tokens.error is not None or sf.tokens.media:
                return None
            return State(name, as_tokens(sf.tokens.tokens), sf.target.layout.kind if sf.target else None, sf.size)
        finally:
            sf.close()

    def lookup(self, tokens: np.ndarray) -> list[tuple[State, int]]:
        self.sync_index()
        return self.index.lookup(tokens) if self.index is not None else []

    # -- judging ---------------------------------------------------------------------------------------

    def reuse(self, judged: Judged, state: State, common: int, n_request: int) -> int:
        """The prompt tokens a request of ``n_request`` tokens sharing ``common`` with ``state`` keeps."""
        return request_reuse(judged.kind or "", judged.n_swa, state.n_tokens, common, n_request, judged.extending)

    @staticmethod
    def why_not(judged: Judged) -> tuple[str, str | None] | None:
        """Why serve does not restore a state judged so (``judged``): the verdict and the reason it says; None
        when it restores it as it is, or converted (its conversion not judged yet, or judged ``restores``)."""
        if judged.restores:
            return None
        if not judged.convert:
            why = judged.refusal(who="server", remedy="serve never re-encodes a state")
            return judged.verdict, (f"{judged.error}; {why}" if judged.error and why else judged.error or why)
        if judged.after is not None and judged.after.verdict not in RESTORABLE:
            return judged.after.verdict, converted_reason(judged.convert, judged.after.error)
        return None

    # -- the restore policy ----------------------------------------------------------------------------

    def prepare(self, slot, tokens: np.ndarray, min_gain: int, key: str | None = None,
                gate: Gate | None = None) -> Prepared:
        """With ``slot`` held (a :class:`slotctl.serve.slots.Slot`), in a worker thread: restore the stored
        state that keeps the most of the prompt ``tokens``, when its verdict for this server is ``restores``,
        it keeps at least ``min_gain`` tokens more than the slot holds, and the restore is predicted faster
        than the prefill it spares (:meth:`slotctl.serve.costs.Costs.predict`; not measured yet: the token rule
        alone). A state another server's ``-np``/``-kvu`` made is converted for this one first
        (:meth:`converted`) and the converted file judged the same way; a conversion that fails leaves the
        request uncached. Each request to the store is given :data:`STORE_STALL` seconds (past them the store
        counts as down); ``gate``: the request may stop waiting before the restore is sent (:class:`Gate`),
        and then nothing is sent. What it did: :class:`Prepared` (the prompt tokens the server is predicted
        to reuse: the restored state's, its ``restored`` event's ``reuse``, else what the slot already holds).
        A state whose bytes are not the ones its name's checksum says is never sent (the next is tried)."""
        from slotctl.serve.slots import SlotView
        from slotctl.store.s3 import request_timeout

        held = SlotView.held(slot, tokens)
        own = "slot_hit" if held >= min_gain else "cold"
        if len(tokens) - held < min_gain:
            return Prepared(held, own)
        if self.by_cost and self.costs.cheaper_than_any_restore(len(tokens) - held):
            return Prepared(held, own)      # no state could pay: the store is not asked
        try:
            with request_timeout(STORE_STALL) if self.where_s3() else contextlib.nullcontext():
                return self._prepare(slot, tokens, min_gain, key, gate, held, own)
        except GaveUp:
            return Prepared(held, "uncached")

    def _prepare(self, slot, tokens, min_gain, key, gate, held, own) -> Prepared:
        c = self.counters
        try:
            found = self.lookup(tokens)
        except Exception as e:  # noqa: BLE001 - the store down: uncached
            c.add("lookup_failures")
            self.log("error", f"the store cannot be read ({e}): the request goes uncached")
            return Prepared(held, "uncached")
        for state, common in found:
            if common - held < min_gain:
                break
            # predicted slower even if it kept every token it shares: not judged (a first verdict reads the model)
            pred = self.costs.predict(n_request=len(tokens), held=held, kept=common, size=state.size)
            if pred is not None and not pred.restore and self.by_cost:
                self._prefilled(state, slot, pred, len(tokens), held, common)
                return Prepared(held, "prefill", pred)
            try:
                return self._prepare_one(slot, state, common, held, tokens, min_gain, key, gate)
            except seal.ChecksumMismatch as e:      # nothing sent: the next state is tried
                self._damaged_state(state, slot, e)
            except _NotTaken:
                continue
        return Prepared(held, own)

    def _prepare_one(self, slot, state: State, common: int, held: int, tokens: np.ndarray, min_gain: int,
                     key: str | None, gate: Gate | None) -> Prepared:
        """:meth:`prepare` of one stored state sharing ``common`` tokens with the request: what the request keeps,
        the state restored, or the prefill chosen (predicted faster); :class:`_NotTaken` when it is not restored
        (said when validate or the conversion refuses it); ChecksumMismatch when its bytes are not the ones stored
        (nothing sent)."""
        from slotctl.keeping.states import ConversionFailed

        c = self.counters
        judged = self.judge(state.name, slot.id)
        refused = self.why_not(judged)
        if refused is not None:
            self._refused(state, slot, *refused, catalog=judged.catalog)
            raise _NotTaken
        gain = self.reuse(judged, state, common, len(tokens))
        if gain - held < min_gain:
            raise _NotTaken
        pred = self.costs.predict(n_request=len(tokens), held=held, kept=gain, size=state.size)
        if pred is not None and not pred.restore and self.by_cost:
            self._prefilled(state, slot, pred, len(tokens), held, gain)
            return Prepared(held, "prefill", pred)
        if judged.restores:
            return self._restore(slot, state, gain, held, len(tokens), key, judged=judged, gate=gate, pred=pred)
        t0 = time.perf_counter()
        try:
            with self.converted(state.name, slot.id, judged) as (placed, conv, sent):
                c.add("conversions")
                if sent.verdict not in RESTORABLE:
                    self._refused(state, slot, sent.verdict, converted_reason(conv.changes, sent.error))
                    raise _NotTaken
                gain = self.reuse(sent, state, common, len(tokens))
                if gain - held < min_gain:
                    raise _NotTaken
                return self._restore(slot, state, gain, held, len(tokens), key, placed, conv.changes,
                                     (time.perf_counter() - t0) * 1000, judged=sent, checksum=conv.checksum,
                                     gate=gate, pred=pred)
        except ConversionFailed as e:
            c.add("conversion_failures")
            self.log("error", f"slot {slot.id}: no restore ({e}): the request goes uncached", slot=slot.id,
                     name=state.name)
            return Prepared(held, "uncached")

    def _damaged_state(self, state: State, slot, e: Exception) -> None:
        """``state`` not restored into ``slot``: its bytes are not the ones stored (``e``); never offered again."""
        self.counters.add("restores_refused_by_verdict")
        self.found_damaged(state.name)
        if self.index is not None:
            self.index.forget([state.name])
        self.log("refused", f"{state.name}: not restored into slot {slot.id}: {e}", slot=slot.id, name=state.name,
                 verdict="corrupt", reason="checksum")

    def _refused(self, state: State, slot, verdict: str, reason: str | None, *, catalog: bool = False) -> None:
        self.counters.add("restores_refused_by_verdict")
        self.log("refused", f"{state.name}: not restored into slot {slot.id}: validate says {verdict}"
                            + (f" ({reason})" if reason else "")
                            + (" (unchanged since serve judged it: the catalog's row, not read again)"
                               if catalog else ""),
                 slot=slot.id, name=state.name, verdict=verdict, **({"catalog": True} if catalog else {}))

    def _prefilled(self, state: State, slot, pred: Prediction, n_request: int, held: int, gain: int) -> None:
        self.log("prefill", f"{state.name}: not restored into slot {slot.id}: the prefill of the {n_request - held:,} "
                            f"tokens the slot does not hold is predicted {pred.prefill_ms:.0f} ms, the restore "
                            f"{pred.restore_ms:.0f} ms (placing {pred.place_ms:.0f} ms, the server's read "
                            f"{pred.read_ms:.0f} ms, then {n_request - gain:,} tokens)",
                 slot=slot.id, name=state.name, size=state.size, reuse=gain, held=held, prediction=pred.as_dict())

    def _restore(self, slot, state: State, gain: int, held: int, n_request: int, key: str | None,
                 placed: str | None = None, changes: list[str] | None = None, convert_ms: float = 0.0, *,
                 judged: Judged, checksum: str | None = None, gate: Gate | None = None,
                 pred: Prediction | None = None) -> Prepared:
        """``state`` restored into ``slot`` (``judged``: its verdict, ``restores``: sent only while the state has
        the identity it was made on; placed in the slot directory first, unless a conversion's file is
        ``placed`` there); ``gain``, the prompt tokens the request is predicted to keep. Nothing is sent once the
        request stopped waiting (``gate``: :class:`GaveUp`)."""
        from slotctl.serve.slots import EMPTY

        c = self.counters
        t0 = time.perf_counter()
        placing = self.placed(state.name, slot.id, judged.identity) if placed is None else contextlib.nullcontext(placed)
        with placing as there:
            took = time.perf_counter() - t0
            if placed is None and not self.costs.placed_free:
                self.costs.placed(state.size, took)
            if gate is not None and not gate.enter():
                raise GaveUp
            slot.tokens = EMPTY         # whatever happens now, the slot's old tokens are gone
            answer = self.restore(state.name, slot.id, placed=there, checksum=checksum, api_key=key)
        self.costs.restored(answer)
        slot.tokens = state.tokens
        seconds = time.perf_counter() - t0
        c.add("restores")
        c.add("restored_tokens", gain)
        how = f" converted ({'; '.join(changes)}, {convert_ms:.0f} ms)" if changes else ""
        extra = {"converted": changes, "convert_ms": round(convert_ms, 3)} if changes else {}
        if judged.catalog:
            extra["catalog"] = True     # the verdict from the catalog: the state not opened to judge it
        if pred is not None:
            extra["prediction"] = pred.as_dict()
        self.log("restored", f"{state.name}{how} restored into slot {slot.id}: {answer.get('n_restored', 0):,} "
                             f"tokens in {seconds * 1000:.0f} ms; the request keeps "
                             f"{gain:,} of its {n_request:,} (the slot held {held:,})",
                 slot=slot.id, name=state.name, n_restored=answer.get("n_restored"), reuse=gain, held=held,
                 seconds=round(seconds, 6), size=state.size, **extra)
        return Prepared(gain, "restored", pred, seconds)

    # -- saving ----------------------------------------------------------------------------------------

    def checked(self, slot: int, work: str, answer) -> Saved | None:
        """The file the server saved as ``work`` for ``slot`` checked against its answer to the save: it parses,
        with the token count and size the server reported (:meth:`read_back`). None when the slot held
        nothing (the working file removed); the working file is :meth:`store_saved`'s to store or remove."""
        try:
            what = f"POST {self.url}/slots/{slot}?action=save"
            http.check_shape(what, answer, http.SHAPES["save"])
            if answer["id_slot"] != slot or answer["filename"] != work:
                raise http.ServerAnswerError(f"{what}: unexpected answer: not slot {slot}'s save to {work}")
            got = self.read_back(slot, work, answer)
            if got.problem is not None:
                raise http.ServerAnswerError(f"{got.path}: not stored: {got.problem}")
            if got.n_tokens == 0 or got.media:
                self.discard(work)
                return None
            return dataclasses.replace(got, tokens=as_tokens(got.tokens))
        except BaseException:
            self.discard(work)
            raise

    def store_saved(self, saved: Saved, began: float | None = None) -> None:
        """A checked save stored under its content's name (once: a state already stored, saved from this slot
        or another, is not stored again: :meth:`ServerStates.put_saved`), indexed, the store held under its
        budget; the working file removed whatever happens. :class:`StoreOff` when the store is not to be used
        now (:meth:`unusable`). ``began``: when the save began (``time.perf_counter()``), for the ``stored``
        event's ``seconds``. The next turn of the conversation may come after the server restarted (or, for a
        router's model, after the router's next swap unloaded it), restored from this state: judged now, off the
        request path (its verdict kept in memory and in the catalog for the identity it has once stored:
        :meth:`judge`), before the save counts as done, not when the turn comes (validate's read of the state and,
        once per slot, of the model's GGUF: 0.3-0.7 s of the first returning turn's time to first token on the
        8-layer tiny model, measured). It is indexed before it is judged: a turn that comes while it is judged
        restores it once the verdict is made (judged once), not cold."""
        began = time.perf_counter() if began is None else began
        name = saved.name
        stored = False
        try:
            if saved.name is None:      # saved while the model was hashed (in a thread of its own): named once known
                saved = self.named(saved, wait=self.timeout)
            name = saved.name
            if name is None:
                return      # the server's model not identified: nothing stored (the ``unidentified`` event said why)
            if self.index is not None and self.index.holding(saved.tokens) is not None:
                stored = False      # the same tokens, saved from another slot
            else:
                why = self.unusable()
                if why is not None:
                    raise StoreOff(f"not stored: {why}")
                t0 = time.perf_counter()
                stored = self.put_saved(saved)
                if stored and self.where_s3():
                    self.costs.stored(saved.size, time.perf_counter() - t0)
            seconds = time.perf_counter() - began
            if stored:
                self.discard(saved.path.name)   # (a hard link's ctime, part of the state's identity, changes here)
            # indexed at once, before it is judged: a turn that comes meanwhile (a router's swap takes less than a
            # judgement) finds it, and waits for the verdict in the making (:meth:`judge`, one at a time a state)
            if self.index is not None:
                self.index.add(State(name, saved.tokens, saved.kind, saved.size))
            if stored:
                # the next turn of the conversation may come after a restart (or a router's swap), restored from
                # this state: judged now, off the request path, once its working file is gone; before the save
                # counts as done
                self._judge_stored(name, saved.slot)
                self.counters.add("saves")
                self.log("stored", f"slot {saved.slot}: stored as {self.store.where(name)} ({saved.size:,} bytes, "
                                   f"{len(saved.tokens):,} tokens)", slot=saved.slot, name=name, size=saved.size,
                         n_tokens=len(saved.tokens), seconds=round(seconds, 6))
            else:
                self.counters.add("saves_deduplicated")
            self._prune()
        finally:
            self.discard(saved.path.name)

    def _judge_stored(self, name: str, slot: int) -> None:
        try:
            self.judge(name, slot)
        except Exception:  # noqa: BLE001 - judged when the turn comes, as any state, and said then
            pass

    def _prune(self) -> None:
        if self.max_size is None:
            return

        def pruned(path: str, size: int, action: str, reason: str) -> None:
            self.counters.add("pruned")
            gone = path.rpartition("/")[2]
            if self.index is not None:
                self.index.forget([gone])
            self.forget([gone])
            self.log("pruned", f"{path}: {action} ({reason}), {size:,} bytes", path=path, size=size)

        self.prune(pruned)


class _NotTaken(Exception):
    """A stored state :meth:`Cache.prepare` does not restore (validate, the conversion or the gain say no)."""


def converted_reason(changes: list[str], error: str | None) -> str:
    """Why a state converted for the server is not restored: the conversion's changes, the converted file's
    first error."""
    return f"converted ({'; '.join(changes)}): {error}"
