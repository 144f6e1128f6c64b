"""The blocking side of ``slotctl serve``: what it asks the server and the store, run in worker threads.

The server's states are kept as keep keeps them (:class:`slotctl.keeping.states.ServerStates`: the server's
flags learnt from its saves, each stored state judged through the store's catalog, placed and restored,
converted for another ``-np``/``-kvu``, each save checked and stored under the names keep writes too,
prune's budget); what is serve's own is here: the stored states' tokens for prefix lookups
(:class:`slotctl.serve.index.StateIndex`), the counters, and what serve says of each save and restore.

Every failure is the caller's to count: a method raises, the proxy sends the request uncached.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from slotctl.keeping import names
from slotctl.keeping.judged import Judged
from slotctl.keeping.states import ServerStates
from slotctl.keeping.store import Saved
from slotctl.live import http
from slotctl.serve.index import State, StateIndex, as_tokens
from slotctl.server.reuse import request_reuse

#: verdicts serve restores (validate's: nothing dropped, nothing refused)
RESTORABLE = ("restores",)


@dataclass
class Counters:
    """What serve did, for ``GET /slotctl/stats`` and the log: requests seen, cached (given a slot and a
    lookup), passed through untouched, restores done / skipped by the verdict / failed, saves done /
    deduplicated / failed, lookups failed, prompt tokens predicted to be reused thanks to a restore, states
    converted for this server's -np/-kvu / conversions that failed."""

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
    restored_tokens: int = 0
    pruned: int = 0
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
                 router_model: str | None = None, counters: Counters | None = None):
        super().__init__(url, slot_dir, store, role="serve", api_key=api_key, timeout=timeout, max_size=max_size,
                         catalog=catalog, flags=flags, given=given, log=log, router_model=router_model)
        self.counters = counters if counters is not None else Counters()
        self.index: StateIndex | None = None
        self._listed = 0.0
        self._syncing = threading.Lock()
        self.catalog(create=True)       # the stored states' tokens are kept there from the first listing

    # -- the server ------------------------------------------------------------------------------------

    def refresh_facts(self, api_key: str | None = None) -> http.ServerFacts:
        """``/props``, ``/slots``, ``/v1/models`` read again (``api_key``: a client's, when serve has none of its
        own); a new model starts a new index."""
        return self.read_facts(api_key, timeout=min(self.timeout, 30.0))

    def set_facts(self, facts: http.ServerFacts) -> bool:
        other = super().set_facts(facts)
        if other:
            with self._lock:
                self.index = StateIndex(self.model)
                self._listed = 0.0
        return other

    # -- the index -------------------------------------------------------------------------------------

    def sync_index(self, every: float = 2.0) -> None:
        """The index made to hold the store's states for the server's model (listed at most every ``every``
        seconds: other serve processes may store states meanwhile; one listing at a time). A state whose
        identity the catalog knows is not read again (:class:`slotctl.catalog.Index`)."""
        if self.index is None or time.monotonic() - self._listed < every:
            return
        with self._syncing:
            self._sync_index(every)

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
        listed = self.listing(lambda name: names.of_model(name, index.model))
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

    def prepare(self, slot, tokens: np.ndarray, min_gain: int, key: str | None = None) -> int:
        """With ``slot`` held (a :class:`slotctl.serve.slots.Slot`), in a worker thread: restore the stored
        state that keeps the most of the prompt ``tokens``, when its verdict for this server is ``restores``
        and it keeps at least ``min_gain`` tokens more than the slot holds. A state another server's
        ``-np``/``-kvu`` made is converted for this one first (:meth:`converted`) and the converted file judged
        the same way; a conversion that fails leaves the request uncached. The prompt tokens the server is
        predicted to reuse: the restored state's (its ``restored`` event's ``reuse``), else what the slot
        already holds of the prompt."""
        from slotctl.keeping.states import ConversionFailed
        from slotctl.serve.slots import SlotView

        c = self.counters
        held = SlotView.held(slot, tokens)
        if len(tokens) - held < min_gain:
            return held
        try:
            found = self.lookup(tokens)
        except Exception as e:  # noqa: BLE001 - the store down: uncached
            c.add("lookup_failures")
            self.log("error", f"the store cannot be read ({e}): the request goes uncached")
            return held
        for state, common in found:
            if common - held < min_gain:
                break
            judged = self.judge(state.name, slot.id)
            refused = self.why_not(judged)
            if refused is not None:
                self._refused(state, slot, *refused, catalog=judged.catalog)
                continue
            gain = self.reuse(judged, state, common, len(tokens))
            if gain - held < min_gain:
                continue
            if judged.restores:
                return self._restore(slot, state, gain, held, len(tokens), key, judged=judged)
            t0 = time.perf_counter()
            try:
                with self.converted(state.name, slot.id, judged) as (placed, conv, sent):
                    c.add("conversions")
                    if sent.verdict not in RESTORABLE:
                        self._refused(state, slot, sent.verdict, converted_reason(conv.changes, sent.error))
                        continue
                    gain = self.reuse(sent, state, common, len(tokens))
                    if gain - held < min_gain:
                        continue
                    return self._restore(slot, state, gain, held, len(tokens), key, placed, conv.changes,
                                         (time.perf_counter() - t0) * 1000, judged=sent)
            except ConversionFailed as e:
                c.add("conversion_failures")
                self.log("error", f"slot {slot.id}: no restore ({e}): the request goes uncached", slot=slot.id,
                         name=state.name)
                return held
        return held

    def _refused(self, state: State, slot, verdict: str, reason: str | None, *, catalog: bool = False) -> None:
        self.counters.add("restores_refused_by_verdict")
        self.log("refused", f"{state.name}: not restored into slot {slot.id}: validate says {verdict}"
                            + (f" ({reason})" if reason else "")
                            + (" (unchanged since serve judged it: the catalog's row, not read again)"
                               if catalog else ""),
                 slot=slot.id, name=state.name, verdict=verdict, **({"catalog": True} if catalog else {}))

    def _restore(self, slot, state: State, gain: int, held: int, n_request: int, key: str | None,
                 placed: str | None = None, changes: list[str] | None = None, convert_ms: float = 0.0, *,
                 judged: Judged) -> int:
        """``state`` restored into ``slot`` (``judged``: its verdict, ``restores``: sent only while the state has
        the identity it was made on); ``gain``, the prompt tokens the request is predicted to keep."""
        from slotctl.serve.slots import EMPTY

        c = self.counters
        slot.tokens = EMPTY         # whatever happens now, the slot's old tokens are gone
        t0 = time.perf_counter()
        answer = self.restore(state.name, slot.id, placed=placed, identity=None if placed else judged.identity,
                              api_key=key)
        slot.tokens = state.tokens
        c.add("restores")
        c.add("restored_tokens", gain)
        how = f" converted ({'; '.join(changes)}, {convert_ms:.0f} ms)" if changes else ""
        extra = {"converted": changes, "convert_ms": round(convert_ms, 3)} if changes else {}
        if judged.catalog:
            extra["catalog"] = True     # the verdict from the catalog: the state not opened to judge it
        self.log("restored", f"{state.name}{how} restored into slot {slot.id}: {answer.get('n_restored', 0):,} "
                             f"tokens in {(time.perf_counter() - t0) * 1000:.0f} ms; the request keeps "
                             f"{gain:,} of its {n_request:,} (the slot held {held:,})",
                 slot=slot.id, name=state.name, n_restored=answer.get("n_restored"), reuse=gain, held=held,
                 seconds=round(time.perf_counter() - t0, 6), **extra)
        return gain

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

    def store_saved(self, saved: Saved) -> None:
        """A checked save stored under its content's name (once: a state already stored, saved from this slot
        or another, is not stored again: :meth:`ServerStates.put_saved`), indexed, the store held under its
        budget; the working file removed whatever happens. A router's model (``router_model``) is unloaded at
        the router's next swap, and the next turn of the conversation is restored from this state: judged now,
        off the request path (its verdict kept in memory and in the catalog for the identity it has once stored:
        :meth:`judge`), not when the turn comes."""
        name = saved.name
        stored = False
        try:
            if self.index is not None and self.index.holding(saved.tokens) is not None:
                stored = False      # the same tokens, saved from another slot
            else:
                stored = self.put_saved(saved)
            if stored:
                self.counters.add("saves")
                self.log("stored", f"slot {saved.slot}: stored as {self.store.where(name)} ({saved.size:,} bytes, "
                                   f"{len(saved.tokens):,} tokens)", slot=saved.slot, name=name, size=saved.size,
                         n_tokens=len(saved.tokens))
            else:
                self.counters.add("saves_deduplicated")
            if self.index is not None:
                self.index.add(State(name, saved.tokens, saved.kind, saved.size))
            self._prune()
        finally:
            self.discard(saved.path.name)       # (a hard link's ctime, part of the state's identity, changes here)
        if stored and self.router_model is not None:
            try:
                self.judge(name, saved.slot)
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


def converted_reason(changes: list[str], error: str | None) -> str:
    """Why a state converted for the server is not restored: the conversion's changes, the converted file's
    first error."""
    return f"converted ({'; '.join(changes)}): {error}"
