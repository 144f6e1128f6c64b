"""``slotctl keep``: a foreground process that keeps a running llama-server's slots across its restarts: the
loop, over the server's states as :class:`slotctl.keeping.states.ServerStates` keeps them (what serve does
alike: learning the server's flags, judging, converting, placing and restoring, saving, storing, pruning).

Every ``every`` seconds (:meth:`Keeper.tick`):

* **health**: ``GET /health``; no answer (or 503 while loading) is the server *down*. Its identity
  (:func:`slotctl.keeping.names.server_identity`: ``/props`` model path, build, slots, slot context and
  ``/v1/models`` meta) is read each time it answers. Back after being down, up with another identity
  (llama-swap swapped the model behind the URL), or a slot keep saved now showing no task at all (a new
  process, restarted between two looks) is a *restart*: every slot that holds nothing gets the newest state
  of the store that validates for the server now running (:meth:`Keeper.restore_all`; one the server would
  refuse or abort on is never sent unless ``force``), restored and proven (:mod:`slotctl.live.prove`: not
  where the proving request would spend the restore). So does every empty slot when keep starts. A state
  saved before the server's ``-np``, ``-kvu`` or cache types changed is converted first, by the conversion
  step (:mod:`slotctl.keeping.conversion`: exact for streams, lossy for cache types only with
  ``allow_lossy``); a state that cannot be is skipped, saying why. Every verdict is kept in the store's
  catalog (:class:`slotctl.catalog.Index`), shared with serve and the fleet view: a state is not read again
  to be judged while it and the server are unchanged.
* **save**: each idle slot (``is_processing`` false) whose last task (``/slots`` ``id_task``, ``n_prompt_tokens``)
  changed since keep last saved or restored it, with at least ``min_tokens`` prompt tokens, is saved by the
  server under a working name (``keep-slotN-incoming-PID-RANDOM.bin`` in ``--slot-save-path``, private to the
  process: :func:`slotctl.keeping.names.work_name`); only after the save answered 200 and the file parses
  with the token count and size the server reported is it copied into the store, atomically, as
  ``slotN-MODEL-NTOKENS-TOKENS.bin`` (:func:`slotctl.keeping.names.state_name`: MODEL a hash of the server's
  model identity, TOKENS a hash of the saved tokens: one state is stored once). The working file is then
  removed.
* **budget**: with ``max_size``, the store is pruned by :mod:`slotctl.prune`'s rules (least recently used
  first; temporary and working files never touched).

Each action is one :class:`Event` (a log line, or a ``--json`` line). :meth:`Keeper.stop` (SIGTERM) makes
the loop do a last save of the changed slots and return. A killed keep loses nothing it stored (every copy is
a temporary file renamed into place); a server killed mid-save never leaves a torn file in the store (its
answer never comes, or the file does not check).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

from slotctl.errors import SlotctlError, error_entry
from slotctl.keeping.names import server_identity
from slotctl.keeping.states import ORPHAN_AGE, ServerStates
from slotctl.live import http
from slotctl.live.prove import prove
from slotctl.unattended.stopping import StopFlag

#: seconds a health check may take (a server that does not answer that fast is taken as down)
HEALTH_TIMEOUT = 10.0


@dataclass
class Event:
    """One action: ``event`` (start, up, down, restart, saved, stored, unchanged, skipped, converted, restored,
    proof, pruned, catalog, error, stop), the slot (or None), one line for people, the figures."""

    event: str
    slot: int | None
    message: str
    details: dict = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        from slotctl.catalog import iso_time

        return {"time": iso_time(self.time), "event": self.event, "slot": self.slot, "message": self.message,
                "details": self.details}


class Keeper:
    """The loop of the module docstring for the server at ``url`` (its ``--slot-save-path`` is ``slot_dir`` on
    this machine) and the store ``store`` (``slot_dir`` itself when None), over its
    :class:`~slotctl.keeping.states.ServerStates` (``states``). ``emit(Event)`` gets every action."""

    def __init__(self, url: str, slot_dir: str | os.PathLike, store: str | os.PathLike | None = None, *,
                 every: float = 30.0, min_tokens: int = 1, max_size: int | None = None,
                 api_key: str | None = None, timeout: float = 600.0, emit: Callable[[Event], None] = print,
                 lock=None, retention: int | None = None, prove: bool = True, force: bool = False, flags=None,
                 given: frozenset[str] = frozenset(), allow_lossy: bool = False, catalog: bool = True,
                 draft_model: str | os.PathLike | None = None, progress=None):
        self.emit = emit
        #: the server's states: its flags it does not report (``-kvu``, ``-ctk``, ``-ctv``, the fields named in
        #: ``given``) with what its saves said over them, the verdicts (the store's catalog, shared with serve;
        #: ``--no-cache``: none kept), the store under ``max_size`` and ``retention`` (the newest states kept per
        #: slot and model), stored states re-encoded when the cache types changed only with ``allow_lossy``
        self.states = ServerStates(url, slot_dir, store, role="keep", api_key=api_key, timeout=timeout,
                                   max_size=max_size, retention=retention, catalog=catalog, flags=flags,
                                   given=given, allow_lossy=allow_lossy, log=self._said, draft_model=draft_model,
                                   progress=self._hashing(progress))
        self.url, self.slot_dir, self.store = self.states.url, self.states.slot_dir, self.states.store
        self.every, self.min_tokens = every, min_tokens
        self.api_key, self.timeout = api_key, timeout
        #: restore a state even when validate says the server refuses it or aborts on it (``--force``)
        self.force = force
        self.up: bool | None = None
        self.identity: dict | None = None
        #: slot -> the /slots signature of its state when keep last saved or restored it
        self.seen: dict[int, tuple] = {}
        #: set by stop() from SIGTERM's handler, or by abandon() from the lease's thread (not a threading.Event:
        #: slotctl.unattended.stopping says why)
        self._stop = StopFlag()
        self.errors = 0
        #: running unattended (slotctl.unattended): the lock of this server and store (its journal; checked
        #: before each write: :attr:`lock`), whether restores are proven
        self.lock, self.prove = lock, prove
        #: a lost lock: the loop stops without its last save; monotonic time of the loop's last sign of life
        self.lost: Exception | None = None
        self.beat = time.monotonic()
        #: called after each look at the server with whether it answered (metrics, readiness)
        self.on_look: Callable[[bool], None] | None = None

    def _hashing(self, progress):
        """The progress callback of the model's hashing (``progress``: a bar on a terminal, or None): keep's
        heartbeat goes on meanwhile (a model of many gigabytes takes seconds)."""
        def update(done: int, total: int) -> None:
            self.beat = time.monotonic()
            if progress is not None:
                progress(done, total)

        return update

    @property
    def lock(self):
        return self._lock

    @lock.setter
    def lock(self, lock) -> None:
        self._lock = lock
        self.states.before_write = lock.check if lock is not None else None

    @property
    def facts(self) -> http.ServerFacts | None:
        """The server's facts as keep's last look read them."""
        return self.states.facts

    @facts.setter
    def facts(self, facts: http.ServerFacts) -> None:
        self.states.set_facts(facts)

    @property
    def learnt(self):
        """The server's flags it does not report, as given and as its saves said (:class:`slotctl.server.saved.Learnt`)."""
        return self.states.learnt

    # -- the loop ---------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to do a last save and return (safe from a signal handler): a read in flight is cut
        off (a server that drips its answer holds keep no longer), and the last save's look at the slots
        waits at most :data:`HEALTH_TIMEOUT`."""
        self._stop.set()
        http.cut_off_reads()

    def abandon(self, why: Exception) -> None:
        """Stop at once, without the last save: the lock was lost (another keeper may be writing)."""
        self.lost = why
        self._stop.set()

    def run(self) -> int:
        """Tick every ``every`` seconds until :meth:`stop`; then a last save of the changed slots. 0 (2 when
        the lock was lost)."""
        self._event("start", None, f"keeping {self.url}: slot dir {self.slot_dir}, store {self.store}, every "
                                   f"{self.every:g} s", every=self.every, store=str(self.store))
        self.sweep()
        while not self._stop.is_set():
            self.beat = time.monotonic()
            self.tick()
            self.beat = time.monotonic()
            self._stop.wait(self.every)
        if self.lost is not None:
            self._error(None, self.lost)
            self._event("stop", None, "stopped without a last save: the lock is lost")
            return 2
        if self.up:
            self.save_changed()
        self.sweep_own()
        self._event("stop", None, "stopped: the last save of the changed slots is done")
        return 0

    def sweep_own(self) -> None:
        """At exit, after the last save: this process's own working files still there. Each save removes its
        file, but a save keep stopped waiting for (it failed or timed out: the server may still write it, in
        its task queue's order, before the last save's look at the slots is answered) leaves one behind."""
        self.states.sweep_own(lambda p, size: self._event(
            "pruned", None, f"{p}: deleted (a working file of this keep process that a save it stopped waiting "
                            f"for left), {size:,} bytes", path=str(p), size=size, action="deleted"))

    def sweep(self, now: float | None = None) -> None:
        """Remove what keep processes that are gone (killed: SIGKILL leaves no way to clean up) left
        (:meth:`ServerStates.sweep`: at once when they ran on this machine; a name of another machine, or
        without its machine's tag, once untouched for :data:`ORPHAN_AGE` seconds)."""
        self.states.sweep(lambda p, pid, size: self._event(
            "pruned", None, f"{p}: deleted (" + (f"left by keep process {pid}, which is gone" if pid else
                                                 "a temporary file of a copy into the store, untouched for an "
                                                 "hour") + f"), {size:,} bytes",
            path=str(p), size=size, action="deleted"), age=ORPHAN_AGE, now=now)

    def once(self, *, restore: bool) -> int:
        """One pass, then return (llama-swap's ``cmdStop``, a start hook): the server's facts, then every
        idle slot whose state the store does not have saved (``restore`` False), or every empty slot
        restored and proven (``restore`` True). 0; 2 when the server does not answer or an action failed."""
        self._event("start", None, f"{'restoring' if restore else 'saving'} every slot of {self.url} once: slot "
                                   f"dir {self.slot_dir}, store {self.store}", every=0.0, store=str(self.store))
        try:
            facts = http.server_facts(self.url, api_key=self.api_key, timeout=self.timeout)
        except SlotctlError as e:
            self._error(None, e)
            self._event("stop", None, "stopped: the server did not answer")
            return 2
        self.up, self.identity, self.facts = True, server_identity(facts), facts
        if self.lock is not None:
            self.seen.update(self.lock.known(self.states.model, self.store.has))
        if restore:
            self.probe()
            self.restore_all()
        else:
            self.save_changed()
        self._event("stop", None, f"stopped: every slot {'restored' if restore else 'saved'} once"
                                  + (f", {self.errors} error(s)" if self.errors else ""))
        return 2 if self.errors else 0

    def tick(self) -> None:
        self.store.again()
        try:
            http.get_health(self.url, api_key=self.api_key, timeout=min(self.timeout, HEALTH_TIMEOUT))
            facts = http.server_facts(self.url, api_key=self.api_key, timeout=self.timeout)
        except http.CutOff:     # by stop(): the server's state is not known to have changed
            return
        except (http.ServerUnreachable, http.ServerRefused) as e:
            if self.on_look is not None:
                self.on_look(False)
            if self.up is not False:
                self._event("down", None, f"the server does not answer: {e}")
            self.up = False
            return
        except SlotctlError as e:
            self._error(None, e)
            return
        if self.on_look is not None:
            self.on_look(True)
        ident = server_identity(facts)
        first, back = self.up is None, self.up is False
        changed = self.identity is not None and ident != self.identity
        # a slot keep saved or restored that shows no task at all: a new server process (erase keeps id_task),
        # restarted between two looks
        fresh = [e["id"] for e in facts.slots or () if self.seen.get(e["id"]) and "id_task" not in e]
        self.up, self.identity = True, ident
        # another model (llama-swap): another command line, its flags forgotten; a restart: its model identified
        # anew by its file's content (a file replaced while it ran is the one it loads now)
        self.states.set_facts(facts, restarted=bool(back or changed or fresh))
        if first or back or changed or fresh:
            why = ("keep started" if first else "the server is back" if back else
                   "the server's identity changed (GET /props, /v1/models)" if changed else
                   f"slot(s) {', '.join(map(str, fresh))} ran no task yet: a new server process")
            self._event("up" if first else "restart", None, f"{why}: {facts.total_slots} slot(s), model "
                                                            f"{facts.model_path}", identity=ident)
            if back or changed or fresh:
                self.seen.clear()
            elif self.lock is not None:     # keep started: the states its journal says the store has
                self.seen.update(self.lock.known(self.states.model, self.store.has))
            self.probe()
            self.restore_all()
        self.save_changed()

    # -- saving -----------------------------------------------------------------------------------------

    def _slots(self) -> list[dict]:
        stopping = self._stop.is_set()
        return http.get_slots(self.url, api_key=self.api_key,
                              timeout=min(self.timeout, HEALTH_TIMEOUT) if stopping else self.timeout)

    @staticmethod
    def signature(entry: dict) -> tuple | None:
        """The state of a slot as ``/slots`` shows it: None for a slot that has run no task since the server
        started (or was erased)."""
        if "id_task" not in entry or not entry.get("n_prompt_tokens"):
            return None
        return entry.get("id_task"), entry.get("n_prompt_tokens")

    def _each_idle_slot(self, want: Callable[[dict], bool], action: Callable[[dict], None]) -> None:
        """``action(entry)`` for each idle slot of ``GET /slots`` that ``want(entry)``; errors become events."""
        try:
            slots = self._slots()
        except http.CutOff:     # by stop(): no error; the last save looks again
            return
        except SlotctlError as e:
            self._error(None, e)
            return
        for entry in slots:
            if entry.get("is_processing") or not want(entry):
                continue
            try:
                action(entry)
            except http.CutOff:     # by stop(), in the action's own look at the slots: the last save looks again
                return
            except (SlotctlError, OSError) as e:
                self._error(entry["id"], e)

    def _changed(self, entry: dict) -> bool:
        sig = self.signature(entry)
        return (sig is not None and self.seen.get(entry["id"]) != sig
                and (entry.get("n_prompt_tokens") or 0) >= self.min_tokens)

    def save_changed(self) -> None:
        """Each idle slot that changed saved and stored; none while the server's model is not identified by its
        content (its ``unidentified`` event said why: a state is stored only under the model that wrote it)."""
        if self.states.model is None:
            return
        self._each_idle_slot(self._changed, lambda e: self.save(e["id"], self.signature(e)))

    def save(self, slot: int, sig: tuple) -> None:
        work = self.states.work_name(slot)
        try:
            self._save(slot, sig, work)
        finally:    # stored, refused or failed: the working file never stays
            self.states.discard(work)

    def _save(self, slot: int, sig: tuple, work: str) -> None:
        answer = self.states.save(slot, work)
        self._event("saved", slot, f"slot {slot} saved by the server: {answer['n_saved']:,} tokens, "
                                   f"{answer['n_written']:,} bytes", answer=answer)
        saved = self.states.read_back(slot, work, answer)
        if saved.problem is not None:
            self._event("skipped", slot, f"{saved.path}: not stored: {saved.problem}")
            return
        if saved.name is None:
            self._event("skipped", slot, f"slot {slot}: not stored: the server's model is not identified "
                                         f"({self.states.unidentified})", reason="unidentified")
            return
        n = saved.n_tokens
        self.seen[slot] = sig
        if n < self.min_tokens:
            self._event("skipped", slot, f"slot {slot}: {n:,} tokens, fewer than --min-tokens {self.min_tokens}")
            return
        name = saved.name
        if not self.states.put_saved(saved):
            # in the store already, or stored by another keeper of the same server between the look and the copy
            self._event("unchanged", slot, f"slot {slot}: {name} is already in the store (the same tokens)",
                        name=name)
            self._remember(slot, sig, name)
            return
        self._remember(slot, sig, name)
        self.states.discard(work)       # before the event: whoever reads it finds no working file left
        where = self.store.where(name)
        self._event("stored", slot, f"slot {slot}: stored as {where} ({saved.size:,} bytes, {n:,} tokens)",
                    name=name, path=where, size=saved.size, n_tokens=n)
        self.prune(slot)

    def _remember(self, slot: int, sig: tuple | None, name: str) -> None:
        if self.lock is not None:
            self.lock.remember(slot, sig, self.states.model, name)

    def prune(self, slot: int | None = None) -> None:
        self.states.prune(lambda path, size, action, reason: self._event(
            "pruned", None, f"{path}: {action} ({reason}), {size:,} bytes", path=path, size=size, action=action),
            slot)

    # -- the flags the server does not report ---------------------------------------------------------

    def probe(self) -> None:
        """Before keep judges a state for the server (it started, came back, restarted): its ``-kvu``,
        ``-ctk``, ``-ctv`` learnt from a save of its idle slot holding the fewest tokens (a working file,
        removed: :meth:`slotctl.keeping.states.ServerStates.probe`), as serve learns them: its stream count
        always, its cache types when the slot holds cells (a restarted server's slots hold nothing: the types
        keep's earlier saves said stay). A save that fails is a ``skipped`` line (not an error: keep's own saves
        and restores say what fails); the flags as known are judged with."""
        idle = [e for e in self.facts.slots or () if isinstance(e.get("id"), int) and not e.get("is_processing")]
        if not idle:
            return
        slot = min(idle, key=lambda e: ((e.get("n_prompt_tokens") or 0) if "id_task" in e else 0, e["id"]))["id"]
        try:
            self.states.probe(slot)
        except http.CutOff:     # by stop()
            return
        except (SlotctlError, OSError) as e:    # not learnt: keep's own saves and restores say what fails
            self._event("skipped", slot, f"slot {slot}: the server's -kvu/-ctk/-ctv not learnt from a save ({e}): "
                                         f"judged with the flags as known")

    # -- restoring --------------------------------------------------------------------------------------

    def candidates(self, slot: int) -> list[str]:
        """The store's states for ``slot`` made with the server's model, newest first."""
        return self.states.candidates(slot)

    def restore_all(self) -> None:
        """Restore into each idle slot that holds nothing of its own (no task since the server started)."""
        self._each_idle_slot(lambda e: self.signature(e) is None, lambda e: self.restore(e["id"]))

    def restore(self, slot: int) -> None:
        """The newest state of ``slot`` that the server now running restores (or the newest one at all, with
        ``force``), restored and proven; each one tried before it that it does not restore is a ``skipped``
        line (``details.catalog`` when the verdict came from the catalog: the state not read again)."""
        from slotctl.seal import ChecksumMismatch

        if self.states.model is None:
            self._event("skipped", slot, f"slot {slot}: nothing restored: the server's model is not identified "
                                         f"({self.states.unidentified})", reason="unidentified")
            return
        for name in self.candidates(slot):
            try:
                if self._restore_one(slot, name):
                    return
            except ChecksumMismatch as e:       # nothing sent: the next state is tried
                self.states.found_damaged(name)
                self._event("skipped", slot, f"{name}: not restored: {e}", name=name, verdict="corrupt",
                            reason="checksum")
        self._event("skipped", slot, f"slot {slot}: no state in the store for the server now running")

    def _restore_one(self, slot: int, name: str) -> bool:
        """Restore the store's state ``name`` into ``slot`` and prove it; False when the server would not
        restore it (said, and kept in the catalog with its verdict). As it is when validate says the server
        takes it (or ``force``), else converted for the server now running first (its -np, -kvu, cache types)
        and judged again."""
        from slotctl.keeping.states import ConversionFailed

        judged = self.states.judge(name, slot)
        if judged.convert:
            if judged.after is not None and not judged.after.sendable and not self.force:
                self._refused(slot, name, judged.after.verdict, judged.after.why, judged.catalog)
                return False
            try:
                with self.states.converted(name, slot, judged) as (placed, conv, after):
                    self._event("converted", slot, f"{name}: converted for the server now running ("
                                                   + "; ".join(conv.changes) + ")", name=name, **conv.details)
                    if not after.sendable and not self.force:
                        self._refused(slot, name, after.verdict, after.why, False)
                        return False
                    answer = self.states.restore(name, slot, placed=placed, checksum=conv.checksum)
                    return self._restored(slot, name, answer, self.slot_dir / placed,
                                          after.why if not after.sendable else None)
            except ConversionFailed as e:
                cause = e.__cause__
                if isinstance(cause, (SlotctlError, OSError)):
                    raise cause from None       # the download or the disk: an error line, as before
                raise SlotctlError(str(e)) from None
        if judged.parsed and (refusal := judged.refusal(who="server", remedy="keep --allow-lossy re-encodes them")):
            self._event("skipped", slot, f"{name}: not restored: {refusal}"
                                         + (_FROM_CATALOG if judged.catalog else ""),
                        name=name, reason="conversion", **({"catalog": True} if judged.catalog else {}))
            return False
        if not judged.sendable and not self.force:
            self._refused(slot, name, judged.verdict, judged.why, judged.catalog)
            return False
        # the copy in the slot directory removed once the server has read it: the store keeps the state
        answer = self.states.restore(name, slot, identity=judged.identity)
        return self._restored(slot, name, answer, self.store.where(name), judged.why if not judged.sendable else None)

    def _restored(self, slot: int, name: str, answer: dict, source, forced: str | None) -> bool:
        """The state ``name`` restored into ``slot`` (the server's ``answer``; ``source``: the file it read, or
        the store's state it was a copy of; ``forced``: why validate would not have sent it), then proven:
        True."""
        note = f" (sent with --force: {forced})" if forced else ""
        self._event("restored", slot, f"{name} restored into slot {slot}: {answer['n_restored']:,} tokens{note}",
                    name=name, answer=answer)
        if self.prove:
            p = prove(self.url, slot, source, self.states.setup(slot), build_info=self.facts.build_info,
                      api_key=self.api_key, timeout=self.timeout)
            self._event("proof", slot, f"slot {slot}: {p.summary()}", proof=p.as_dict())
        entry = next((e for e in self._slots() if e["id"] == slot), {})
        self.seen[slot] = self.signature(entry)   # the proving request is not a change to save
        self._remember(slot, self.seen[slot], name)
        return True

    def _refused(self, slot: int, name: str, verdict: str, why: str, catalog: bool) -> None:
        """The state ``name`` not restored into ``slot``: validate's ``verdict`` (``why``, in one line) says the
        server refuses it or aborts on it; ``catalog``: said from the catalog's row (the state not read)."""
        self._event("skipped", slot, f"{name}: not restored: {why} (keep --force restores it anyway)"
                                     + (_FROM_CATALOG if catalog else ""),
                    name=name, verdict=verdict, **({"catalog": True} if catalog else {}))

    # -- events -----------------------------------------------------------------------------------------

    def _said(self, event: str, message: str, slot: int | None = None, **details) -> None:
        """What keep's states say (the catalog's lines, what a save taught) as keep's events."""
        self._event(event, slot, message, **details)

    def _event(self, event: str, slot: int | None, message: str, **details) -> None:
        self.beat = time.monotonic()
        self.emit(Event(event, slot, message, details))

    def _error(self, slot: int | None, e: Exception) -> None:
        self.errors += 1
        err = error_entry(e)
        self._event("error", slot, err.message, error=err.as_dict())


#: how a line said again from the catalog's row ends
_FROM_CATALOG = " (unchanged since keep judged it: the catalog's row, not read again)"
