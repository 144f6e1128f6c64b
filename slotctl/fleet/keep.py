"""``slotctl keep``: a foreground process that keeps a running llama-server's slots across its restarts.

Every ``every`` seconds (:meth:`Keeper.tick`):

* **health**: ``GET /health``; no answer (or 503 while loading) is the server *down*. Its identity
  (:func:`server_identity`: ``/props`` model path, build, slots, slot context and ``/v1/models`` meta) is read
  each time it answers. Back after being down, up with another identity (llama-swap swapped the model
  behind the URL), or a slot keep saved now showing no task at all (a new process, restarted between two
  looks) is a *restart*: every slot that holds nothing gets the newest state of the store that
  validates for the server now running (:meth:`Keeper.restore_all`; one the server would refuse or abort on
  is never sent unless ``force``: :mod:`slotctl.live.judge`), restored and proven (:mod:`slotctl.live.prove`:
  not where the proving request would spend the restore). So does every empty slot when keep starts. A
  state saved before the server's ``-np``, ``-kvu`` or cache types changed is converted first, by migrate's
  conversion step (:func:`slotctl.fleet.migrate.convert_for`: exact for streams, lossy for cache types only
  with ``allow_lossy``); a state that cannot be is skipped, saying why. A state skipped is kept so in the
  store's catalog (:class:`slotctl.catalog.Index`) and not read again while it and the server are unchanged.
* **save**: each idle slot (``is_processing`` false) whose last task (``/slots`` ``id_task``, ``n_prompt_tokens``)
  changed since keep last saved or restored it, with at least ``min_tokens`` prompt tokens, is saved by the
  server under a working name (``keep-slotN-incoming-PID-RANDOM.bin`` in ``--slot-save-path``, private to the
  process); only after the save
  answered 200 and the file parses with the token count and size the server reported is it copied into the
  store, atomically, as ``slotN-MODEL-TOKENS.bin`` (MODEL: a hash of the server's model identity, TOKENS: a
  hash of the saved tokens: one state is stored once). The working file is then removed.
* **budget**: with ``max_size``, the store is pruned by :mod:`slotctl.prune`'s rules (least recently used
  first; temporary files never touched).

Each action is one :class:`Event` (a log line, or a ``--json`` line). :meth:`Keeper.stop` (SIGTERM) makes
the loop do a last save of the changed slots and return. A killed keep loses nothing it stored (every copy is
a temporary file renamed into place); a server killed mid-save never leaves a torn file in the store (its
answer never comes, or the file does not check).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from slotctl.errors import SlotctlError, error_entry
from slotctl.live import http
from slotctl.fleet.migrate import IDENTITY_KEYS
from slotctl.fleet.states import copy_atomic, open_store, read_saved
from slotctl.live.prove import local_setup, prove
from slotctl.server.flags import ServerFlags
from slotctl.server.saved import Learnt, saved_flags

#: the name the server saves a slot under before keep checks it (in --slot-save-path): private to this keep
#: process (its pid and a random word: two keepers of one server never share it), removed on every way out
INCOMING = "keep-slot{slot}-incoming-{pid}-{nonce}.bin"
#: every keep's working files, whatever their process (prune never touches them)
INCOMING_GLOB = "keep-slot*-incoming*.bin"
#: seconds a working file of a keep process that is gone stays untouched before keep removes it at its start
ORPHAN_AGE = 3600.0
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


def server_identity(facts: http.ServerFacts) -> dict:
    """What tells this server process's model and shape apart from another's."""
    meta = facts.model_meta or {}
    return {"model_path": facts.model_path, "build_info": facts.build_info, "total_slots": facts.total_slots,
            "n_ctx_slot": facts.n_ctx_slot, **{k: meta.get(k) for k in IDENTITY_KEYS}}


def model_hash(facts: http.ServerFacts) -> str:
    """A short hash of the model as the server reports it (``/v1/models`` meta; the model's file name when
    the server does not answer it): part of each stored file's name, so a state is offered only to a server
    running the model that made it."""
    meta = facts.model_meta or {}
    ident = [meta.get(k) for k in IDENTITY_KEYS]
    if all(v is None for v in ident):
        ident = [os.path.basename(facts.model_path or "")]
    return hashlib.sha256(repr(ident).encode()).hexdigest()[:8]


def tokens_hash(tokens: np.ndarray) -> str:
    """A short hash of a slot's tokens (as little-endian int32)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()[:16]


def stored_name(slot: int, model: str, tokens: str) -> str:
    return f"slot{slot}-{model}-{tokens}.bin"


class Keeper:
    """The loop of the module docstring for the server at ``url`` (its ``--slot-save-path`` is ``slot_dir`` on
    this machine) and the store directory ``store`` (``slot_dir`` itself when None). ``emit(Event)`` gets
    every action."""

    def __init__(self, url: str, slot_dir: str | os.PathLike, store: str | os.PathLike | None = None, *,
                 every: float = 30.0, min_tokens: int = 1, max_size: int | None = None,
                 api_key: str | None = None, timeout: float = 600.0, emit: Callable[[Event], None] = print,
                 lock=None, retention: int | None = None, prove: bool = True, force: bool = False, flags=None,
                 given: frozenset[str] = frozenset(), allow_lossy: bool = False, catalog: bool = True):
        self.url = http.normalize_url(url)
        self.slot_dir = Path(slot_dir)
        self.store = open_store(store, self.slot_dir)
        self.every, self.min_tokens, self.max_size = every, min_tokens, max_size
        self.api_key, self.timeout, self.emit = api_key, timeout, emit
        #: restore a state even when validate says the server refuses it or aborts on it (``--force``)
        self.force = force
        #: the server's flags it does not report (``-kvu``, ``-ctk``, ``-ctv``: the fields named in ``given``), with
        #: what its saves said over them (:meth:`learn_flags`, :mod:`slotctl.server.saved`)
        self.learnt = Learnt(flags or ServerFlags(), frozenset(given))
        #: re-encode a state's cache rows when the server's cache types changed (lossy: ``--allow-lossy``)
        self.allow_lossy = allow_lossy
        self.up: bool | None = None
        self.identity: dict | None = None
        self.facts: http.ServerFacts | None = None
        #: slot -> the /slots signature of its state when keep last saved or restored it
        self.seen: dict[int, tuple] = {}
        self._stop = threading.Event()
        self.errors = 0
        #: running unattended (slotctl.unattended): the lock of this server and store (its journal; checked
        #: before each write), the newest states kept per slot and model, whether restores are proven
        self.lock, self.retention, self.prove = lock, retention, prove
        #: a lost lock: the loop stops without its last save; monotonic time of the loop's last sign of life
        self.lost: Exception | None = None
        self.beat = time.monotonic()
        #: called after each look at the server with whether it answered (metrics, readiness)
        self.on_look: Callable[[bool], None] | None = None
        #: the catalog (:class:`slotctl.catalog.Index`, the store's, as serve's): the stored states keep found
        #: the server now running does not restore, not read again while unchanged (``--no-cache``: False)
        self.use_catalog = catalog
        self._catalog = None

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
        for p in self.slot_dir.glob(INCOMING.format(slot="*", pid=os.getpid(), nonce="*")):
            try:
                size = p.stat().st_size
                p.unlink()
            except OSError:
                continue
            self._event("pruned", None, f"{p}: deleted (a working file of this keep process that a save it "
                                        f"stopped waiting for left), {size:,} bytes", path=str(p), size=size,
                        action="deleted")

    def sweep(self, now: float | None = None) -> None:
        """Remove the working files of keep processes that are gone (killed: SIGKILL leaves no way to clean
        up) and untouched for :data:`ORPHAN_AGE` seconds: the pid in the name is no process of this machine.
        A keeper on another machine sharing the directory keeps its own, being recent."""
        import re

        now = time.time() if now is None else now
        for p in self.slot_dir.glob(INCOMING_GLOB):
            m = re.fullmatch(r"keep-slot\d+-incoming-(\d+)-[0-9a-f]+\.bin", p.name)
            if m is None or int(m.group(1)) == os.getpid():
                continue
            try:
                os.kill(int(m.group(1)), 0)
                continue                        # its keeper is alive
            except ProcessLookupError:
                pass
            except (PermissionError, OverflowError):
                continue
            try:
                st = p.stat()
                if now - st.st_mtime < ORPHAN_AGE:
                    continue
                p.unlink()
            except OSError:
                continue
            self._event("pruned", None, f"{p}: deleted (the working file of keep process {m.group(1)}, which is "
                                        f"gone), {st.st_size:,} bytes", path=str(p), size=st.st_size,
                        action="deleted")

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
            self.seen.update(self.lock.known(model_hash(facts), self.store.has))
        if restore:
            self.learn_flags()
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
        other_model = self.facts is not None and model_hash(self.facts) != model_hash(facts)
        self.up, self.identity, self.facts = True, ident, facts
        if first or back or changed or fresh:
            why = ("keep started" if first else "the server is back" if back else
                   "the server's identity changed (GET /props, /v1/models)" if changed else
                   f"slot(s) {', '.join(map(str, fresh))} ran no task yet: a new server process")
            self._event("up" if first else "restart", None, f"{why}: {facts.total_slots} slot(s), model "
                                                            f"{facts.model_path}", identity=ident)
            if back or changed or fresh:
                self.seen.clear()
            elif self.lock is not None:     # keep started: the states its journal says the store has
                self.seen.update(self.lock.known(model_hash(facts), self.store.has))
            if other_model:
                self.learnt.forget()        # another model (llama-swap): another command line
            self.learn_flags()
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
        self._each_idle_slot(self._changed, lambda e: self.save(e["id"], self.signature(e)))

    def save(self, slot: int, sig: tuple) -> None:
        import secrets

        work = INCOMING.format(slot=slot, pid=os.getpid(), nonce=secrets.token_hex(4))
        path = self.slot_dir / work
        try:
            self._save(slot, sig, work, path)
        finally:    # stored (moved), refused or failed: the working file never stays
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _save(self, slot: int, sig: tuple, work: str, path: Path) -> None:
        answer = http.save_slot(self.url, slot, work, api_key=self.api_key, timeout=self.timeout, check=False)
        self._event("saved", slot, f"slot {slot} saved by the server: {answer['n_saved']:,} tokens, "
                                   f"{answer['n_written']:,} bytes", answer=answer)
        saved = read_saved(path, answer)
        if saved.problem is not None:
            self._event("skipped", slot, f"{path}: not stored: {saved.problem}")
            return
        self._learn(saved.flags, slot, "save")
        n = saved.n_tokens
        self.seen[slot] = sig
        if n < self.min_tokens:
            self._event("skipped", slot, f"slot {slot}: {n:,} tokens, fewer than --min-tokens {self.min_tokens}")
            os.unlink(path)
            return
        name = stored_name(slot, model_hash(self.facts), tokens_hash(saved.tokens))
        if self.store.has(name):
            os.unlink(path)
            self._event("unchanged", slot, f"slot {slot}: {name} is already in the store (the same tokens)",
                        name=name)
            self._remember(slot, sig, name)
            return
        if self.lock is not None:
            self.lock.check()
        try:
            self.store.put(path, name)
        except SlotctlError as e:
            if getattr(e, "code", None) != "exists":
                raise
            # another keeper of the same server stored the same state between the look and the copy
            self._event("unchanged", slot, f"slot {slot}: {name} is already in the store (the same tokens)",
                        name=name)
            self._remember(slot, sig, name)
            return
        self._remember(slot, sig, name)
        where = self.store.where(name)
        self._event("stored", slot, f"slot {slot}: stored as {where} ({saved.size:,} bytes, {n:,} tokens)",
                    name=name, path=where, size=saved.size, n_tokens=n)
        self.prune(slot)

    def _remember(self, slot: int, sig: tuple | None, name: str) -> None:
        if self.lock is not None:
            self.lock.remember(slot, sig, model_hash(self.facts), name)

    def prune(self, slot: int | None = None) -> None:
        def pruned(path: str, size: int, action: str, reason: str) -> None:
            self._event("pruned", None, f"{path}: {action} ({reason}), {size:,} bytes", path=path, size=size,
                        action=action)

        if self.retention is not None and slot is not None:
            for name in self.candidates(slot)[self.retention:]:
                size = self.store.delete(name)
                pruned(self.store.where(name), size, "deleted", f"older than the newest {self.retention} of slot "
                                                                 f"{slot}")
        if self.max_size is None:
            return
        self.store.prune(self.max_size, (INCOMING_GLOB,), pruned)

    # -- the flags the server does not report ---------------------------------------------------------

    def learn_flags(self) -> None:
        """Before keep judges a state for the server (it started, came back, restarted): its ``-kvu``,
        ``-ctk``, ``-ctv`` learnt from a save of its idle slot holding the fewest tokens into a working file
        (removed), as serve learns them (:mod:`slotctl.server.saved`): its stream count always, its cache types
        when the slot holds cells (a restarted server's slots hold nothing: the types keep's earlier saves said
        stay). A save that fails is a ``skipped`` line (not an error: keep's own saves and restores say what
        fails); the flags as known are judged with."""
        import secrets

        idle = [e for e in self.facts.slots or () if isinstance(e.get("id"), int) and not e.get("is_processing")]
        if not idle:
            return
        slot = min(idle, key=lambda e: ((e.get("n_prompt_tokens") or 0) if "id_task" in e else 0, e["id"]))["id"]
        work = INCOMING.format(slot=slot, pid=os.getpid(), nonce=secrets.token_hex(4))
        path = self.slot_dir / work
        try:
            answer = http.save_slot(self.url, slot, work, api_key=self.api_key, timeout=self.timeout, check=False)
            saved = read_saved(path, answer)
            if saved.problem is not None:
                raise http.ServerAnswerError(f"{path}: {saved.problem}")
            self._learn(saved.flags, slot, "probe")
        except http.CutOff:     # by stop()
            return
        except (SlotctlError, OSError) as e:    # not learnt: keep's own saves and restores say what fails
            self._event("skipped", slot, f"slot {slot}: the server's -kvu/-ctk/-ctv not learnt from a save ({e}): "
                                         f"judged with the flags as known")
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _learn(self, written, slot: int, source: str) -> None:
        """What a save of ``slot`` says of the server's flags taken over (:meth:`slotctl.server.saved.Learnt.take`):
        its ``warning`` and ``learned`` events."""
        total = self.facts.total_slots if self.facts is not None else None
        events, _changed = self.learnt.take(saved_flags(written, total), slot=slot, total_slots=total, source=source)
        for event, message, details in events:
            self._event(event, slot, message, **details)

    # -- restoring --------------------------------------------------------------------------------------

    def candidates(self, slot: int) -> list[str]:
        """The store's states for ``slot`` made with the server's model, newest first."""
        return self.store.names(f"slot{slot}-{model_hash(self.facts)}-")

    def restore_all(self) -> None:
        """Restore into each idle slot that holds nothing of its own (no task since the server started)."""
        self._each_idle_slot(lambda e: self.signature(e) is None, lambda e: self.restore(e["id"]))

    def restore(self, slot: int) -> None:
        import tempfile

        setup = None
        with tempfile.TemporaryDirectory(prefix="slotctl-keep-") as staging:
            for name in self.candidates(slot):
                known = self._known(slot, name)
                if known is None:
                    continue        # judged before, unchanged since: the catalog's row said it (nothing read)
                if setup is None:   # once per slot, when a state is read: it reads the model's GGUF (about 1 s
                    # for the tiny model); a pass whose every state the catalog knows makes none
                    setup, _notes = local_setup(self.facts, slot, self.learnt.flags, self.learnt.given)
                if self._restore_one(slot, name, Path(staging), setup, known):
                    return
        self._event("skipped", slot, f"slot {slot}: no state in the store for the server now running")

    def _restore_one(self, slot: int, name: str, staging: Path, setup, known) -> bool:
        """Restore the store's state ``name`` into ``slot`` (``setup``: the server now running as validate
        judges for it; ``known``: :meth:`_known`'s) and prove it; False when it does not validate."""
        from slotctl.fleet.migrate import Refused, convert_for
        from slotctl.live.judge import NotSent, check_sendable, why

        try:
            path = self.store.local(name, staging)
        except SlotctlError as e:
            # an object cp refuses to download (damaged: the server refuses it or aborts on it whatever its
            # flags) is judged where it is, by validate's ranged reads, as ls judges it: skipped with its
            # verdict and kept in the catalog, not an error at every pass (and the older states still tried)
            if getattr(e, "code", None) != "damaged" or self.force:
                raise
            try:
                check_sendable(self.store.where(name), setup, force=False)
            except NotSent as refused:
                self._refused(slot, known, name, refused.report)
                return False
            raise
        # converted for the server now running as migrate converts (its -np, -kvu, cache types)
        try:
            conv = convert_for(path, setup, staging / f"converted-{name}", allow_lossy=self.allow_lossy,
                               lossy_remedy="keep --allow-lossy re-encodes them")
        except Refused as e:
            self._not_restored(slot, known, f"{name}: not restored: {e}", name=name, reason="conversion")
            return False
        except SlotctlError:     # a file that does not parse: judged as it is (validate says what the server does)
            conv = None
        if conv is not None and conv.changes:
            self._event("converted", slot, f"{name}: converted for the server now running ("
                                           + "; ".join(conv.changes) + ")", name=name, **conv.details)
            path = conv.path
        try:
            report = check_sendable(path, setup, force=self.force)
        except NotSent as e:
            self._refused(slot, known, name, e.report)
            return False
        placed = self.slot_dir / name
        copied = not placed.exists()
        if copied:
            copy_atomic(path, placed)
        try:
            answer = http.restore_slot(self.url, slot, name, api_key=self.api_key, timeout=self.timeout,
                                       check=False)
        finally:
            if copied:     # the server has read it: the store keeps the state
                os.unlink(placed)
        forced = f" (sent with --force: {why(report)})" if report.refused_or_aborts else ""
        self._event("restored", slot, f"{name} restored into slot {slot}: {answer['n_restored']:,} tokens{forced}",
                    name=name, answer=answer)
        if not self.prove:
            entry = next((e for e in self._slots() if e["id"] == slot), {})
            self.seen[slot] = self.signature(entry)
            self._remember(slot, self.seen[slot], name)
            return True
        p = prove(self.url, slot, path, setup, build_info=self.facts.build_info, api_key=self.api_key,
                  timeout=self.timeout)
        self._event("proof", slot, f"slot {slot}: {p.summary()}", proof=p.as_dict())
        entry = next((e for e in self._slots() if e["id"] == slot), {})
        self.seen[slot] = self.signature(entry)   # the proving request is not a change to save
        self._remember(slot, self.seen[slot], name)
        return True

    # -- the catalog: states the server now running does not restore -------------------------------------
    #
    # A stored state keep judged and did not restore (its conversion refused, or validate's verdict for the
    # server now running refuses or aborts on it) is judged again at every restore pass (every restart, model
    # swap, keep start) until a newer state restores: downloaded whole from an s3:// store, parsed twice
    # (convert's plan, validate), the model's GGUF read. Its skipped line is kept in the catalog, under the
    # question asked (what the server's setup is learnt from: its facts, the flags given, the slot, the model
    # file's identity; slotctl's version, --allow-lossy, --force) and the file's identity: while neither
    # changed, the same line is said again from the row and the file is neither downloaded nor opened (nor
    # the GGUF read, when no other state of the pass is). The verdict stays validate's on those bytes
    # for that server; a state that restores is read as before (its bytes are sent anyway).

    def _index(self, create: bool):
        """The store's catalog (beside a directory store, as serve's; under the cache directory for s3://),
        opened on first use; None with ``--no-cache``, or when it does not exist yet and ``create`` is False
        (nothing is written into a store until keep has a row to keep)."""
        if not self.use_catalog:
            return None
        if self._catalog is None:
            from slotctl.catalog import Index, index_path

            where = index_path(self.store.where(""), beside=True)
            if not create and not os.path.exists(where):
                return None
            # an index it cannot use (not SQLite, another version: rebuilt; locked too long, unreadable: not
            # used) is a `catalog` line, as serve's; keep goes on, judging the states itself
            self._catalog = Index(where, log=lambda message: self._event("catalog", None, message, path=where))
        return self._catalog if self._catalog.usable else None

    def _question(self, slot: int) -> str:
        """keep's question for ``slot`` of the server now running: its setup named by what it is learnt from
        (:func:`slotctl.live.prove.local_setup_key`: asking reads no GGUF), ``--allow-lossy``, ``--force``."""
        from slotctl.catalog import verdict_key
        from slotctl.live.prove import local_setup_key

        return verdict_key("keep", None, learnt=local_setup_key(self.facts, slot, self.learnt.flags, self.learnt.given),
                           allow_lossy=self.allow_lossy, force=self.force)

    def _known(self, slot: int, name: str) -> tuple | None | bool:
        """What the catalog knows of the state ``name`` for ``slot``: None when it holds keep's skipped line
        for the state's identity now (said again, ``details.catalog`` true: nothing read); else what
        :meth:`_not_restored` needs to keep a new one (False without the catalog)."""
        if not self.use_catalog:
            return False
        try:
            got = self.store.identity(name)
        except SlotctlError:     # the store does not answer: the read below says so
            return False
        if got is None:
            return False
        taken = time.time_ns()      # the identity as of now: a row is never newer than the read it is made from
        key, where = self._question(slot), self.store.where(name)
        ix = self._index(create=False)
        said = (ix.verdict(where, key, got[0]) if ix is not None else None) or {}
        details = said.get("details")
        if isinstance(details, dict) and details and isinstance(said.get("message"), str):
            # only the keys keep writes there (a row of a damaged index gives nothing else)
            kept = {k: v for k, v in details.items() if k in ("name", "verdict", "reason") and isinstance(v, str)}
            self._event("skipped", slot, f"{said['message']} (unchanged since keep judged it: the catalog's row, "
                                         f"not read again)", **kept, catalog=True)
            return None
        return key, where, got[0], got[1], taken

    def _refused(self, slot: int, known, name: str, report) -> None:
        """The state ``name`` not restored into ``slot``: validate's ``report`` says the server refuses it or
        aborts on it."""
        from slotctl.live.judge import why

        self._not_restored(slot, known, f"{name}: not restored: {why(report)} (keep --force restores it anyway)",
                           name=name, verdict=str(report.verdict))

    def _not_restored(self, slot: int, known, message: str, **details) -> None:
        """A state not restored into ``slot``: its skipped line, kept in the catalog for the state's identity
        and the question (``known``, from :meth:`_known`)."""
        self._event("skipped", slot, message, **details)
        if not known:
            return
        key, where, ident, changed, taken = known
        ix = self._index(create=True)
        if ix is not None:
            ix.put_verdict(where, key, ident, changed, {"message": message, "details": details}, read_ns=taken,
                           model=model_hash(self.facts))

    # -- events -----------------------------------------------------------------------------------------

    def _event(self, event: str, slot: int | None, message: str, **details) -> None:
        self.beat = time.monotonic()
        self.emit(Event(event, slot, message, details))

    def _error(self, slot: int | None, e: Exception) -> None:
        self.errors += 1
        err = error_entry(e)
        self._event("error", slot, err.message, error=err.as_dict())
