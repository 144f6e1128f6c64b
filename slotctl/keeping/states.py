"""One running server's stored states, kept in one store: what ``keep`` and ``serve`` do alike
(:class:`ServerStates`).

Its one reason to change: what one server and store are to a process, the server's facts and the flags its
saves say (:meth:`ServerStates.set_facts`, :meth:`ServerStates.learn`), the two requests that move a state
(``POST /slots/N?action=save|restore``), and the parts it is composed of, each with a reason of its own:
the server's model identified by its content (:mod:`slotctl.keeping.identity`), the stored states judged
through the store's catalog (:mod:`slotctl.keeping.judging`), a state placed or converted into the slot
directory to be restored (:mod:`slotctl.keeping.placing`), a checked save named and stored once
(:mod:`slotctl.keeping.storing`), the store's budget and what processes left swept
(:mod:`slotctl.keeping.housekeeping`). What differs between keep and serve is theirs: keep's loop
(:mod:`slotctl.fleet.keep`), serve's request path (:mod:`slotctl.serve`). Every failure raises: the caller
says it, and goes on.

Safe from several threads at once (serve judges and stores in worker threads; keep's ``/ui`` page judges
beside keep's loop): what is kept in memory, here and in its parts, is guarded by one lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Callable

from slotctl import seal
from slotctl.keeping import housekeeping, names, storing
from slotctl.keeping.housekeeping import ORPHAN_AGE
from slotctl.keeping.identity import ModelIdentifier, NotIdentified
from slotctl.keeping.judged import Judged
from slotctl.keeping.judging import Judging
from slotctl.keeping.placing import ConversionFailed, Placing
from slotctl.keeping.store import Saved, open_store, read_saved
from slotctl.live import http
from slotctl.live.prove import learnt_from
from slotctl.server.flags import ServerFlags
from slotctl.server.saved import Learnt, saved_flags

#: the names callers import from here, whose homes are the parts
__all__ = ["ConversionFailed", "NotIdentified", "ORPHAN_AGE", "ServerStates", "slots_restarted"]


def _quiet(event: str, message: str, **details) -> None:
    pass


class ServerStates:
    """The server at ``url`` (its ``--slot-save-path`` is ``slot_dir`` on this machine; None: nothing is saved
    or restored, states are only judged: the fleet view) and the store ``store`` (a directory, an ``s3://``
    prefix, an open store, or None: ``slot_dir`` itself), for the process of ``role`` (``keep``, ``serve``:
    its working files' names; None: it has none, the fleet view).

    ``flags`` / ``given``: what the server does not report (``-kvu``, ``-ctk``, ``-ctv``), for the fields named
    in ``given``, until the server's own saves say otherwise (:meth:`learn`). ``allow_lossy``: the conversion
    step may re-encode cache rows (keep's ``--allow-lossy``). ``max_size`` / ``retention``: the store's budget
    and how many of each slot's newest states it keeps (:meth:`prune`). ``catalog`` False: verdicts are not
    kept in the store's catalog (``--no-cache``); ``create_catalog`` False: kept only in a catalog keep or
    serve made (the fleet view writes nothing new into a store it only looks at). ``log(event, message,
    **details)`` gets the catalog's lines, the model's identification and what a save taught (``learned``,
    ``warning``: ``slot`` among the details). ``draft_model``, ``background``, ``progress``: how the model is
    identified (:class:`~slotctl.keeping.identity.ModelIdentifier`). ``router_model``: ``url`` is a router, and
    this the model whose states these are (every request to it names the model).

    Its parts: :attr:`identifier` (the server's model), :attr:`judging` (the verdicts), :attr:`placing` (a
    state brought into the slot directory); its methods of theirs delegate to them."""

    def __init__(self, url: str, slot_dir: str | os.PathLike | None, store=None, *, role: str | None = None,
                 api_key: str | None = None, timeout: float = 600.0, max_size: int | None = None,
                 retention: int | None = None, catalog: bool = True, flags=None, given: frozenset[str] = frozenset(),
                 allow_lossy: bool = False, log: Callable | None = None, create_catalog: bool = True,
                 draft_model: str | os.PathLike | None = None, background: bool = False, progress=None,
                 router_model: str | None = None):
        if role is not None and role not in names.ROLES:
            raise ValueError(f"role {role!r}: expected one of {names.ROLES}")
        self.role = role
        self.url = http.normalize_url(url)
        #: the model this server is behind the router at ``url`` (every request names it: slotctl.live.router);
        #: None: ``url`` is one model's own server (or the model :func:`slotctl.live.router.use_model` set)
        self.router_model = router_model
        self.slot_dir = Path(slot_dir) if slot_dir is not None else None
        self.store = store if hasattr(store, "where") else open_store(
            store, self.slot_dir if self.slot_dir is not None else Path(store if "://" not in str(store) else "."),
            create=role is not None)     # keep and serve write there: the default store made
        self.api_key, self.timeout = api_key, timeout
        self.max_size, self.retention, self.allow_lossy = max_size, retention, allow_lossy
        self.log = log or _quiet
        #: the flags judged with: the ones given, with what the server's saves said over them (:meth:`learn`);
        #: ``learn_due``: a save to learn from is to be made (:meth:`probe`), set when the server's facts are first
        #: read or change
        self.learnt = Learnt(flags or ServerFlags(), frozenset(given))
        self.learn_due = True
        self.facts: http.ServerFacts | None = None
        #: connections kept open to the server for the requests made here (:class:`slotctl.live.transport.Pool`;
        #: None: a connection per request): serve gives its worker threads one
        self.pool: http.Pool | None = None
        #: called before each write into the store (a state stored): the lock's check (keep's; raises when the
        #: lock is lost)
        self.before_write: Callable[[], None] | None = None
        self._lock = threading.RLock()
        self._facts_before: http.ServerFacts | None = None
        self.identifier = ModelIdentifier(self._lock, self.log, draft_model=draft_model, background=background,
                                          progress=progress, on_identified=self._identified_behind)
        self.judging = Judging(self.store, self._lock, self.learnt, facts=lambda: self.facts,
                               model=lambda: self.model, allow_lossy=allow_lossy, catalog=catalog,
                               create_catalog=create_catalog, log=self.log)
        self.placing = Placing(self.store, self.slot_dir, role, allow_lossy=allow_lossy)

    # -- the server ------------------------------------------------------------------------------------

    def read_facts(self, api_key: str | None = None, timeout: float | None = None) -> http.ServerFacts:
        """``/props``, ``/slots``, ``/v1/models`` read again (``api_key``: a client's, when there is none of the
        process's own) and taken (:meth:`set_facts`)."""
        facts = http.server_facts(self.url, api_key=api_key or self.api_key, model=self.router_model,
                                  timeout=timeout if timeout is not None else self.timeout, pool=self.pool)
        self.set_facts(facts)
        return facts

    def set_facts(self, facts: http.ServerFacts, *, restarted: bool = False) -> bool:
        """The server's facts as just read; True when its model is another than before (llama-swap swapped it,
        its file was replaced, or none was known). ``restarted``: the server was seen to start again since the
        last facts (its model is identified anew from its file); so is one whose slots show it
        (:func:`slots_restarted`). The model is told by its content
        (:meth:`identify`). The verdicts made for other facts are forgotten (the setup is learnt from them:
        another ``-c``, another build is another setup); another model forgets what the saves taught (another
        command line); a save to learn the flags from is due when the model, the slot count or the slot context
        changed."""
        with self._lock:
            self.facts, old = facts, self._facts_before
        if old is not None and old.url == facts.url and slots_restarted(old.slots, facts.slots):
            restarted = True        # a new server process, as GET /slots shows it
        model = self.identify(facts, restarted=restarted)
        with self._lock:
            old = self._facts_before
            if model != self.model or old is None or learnt_from(facts) != learnt_from(old):
                self.judging.forget_all()
            if (model != self.model or old is None or facts.total_slots != old.total_slots
                    or facts.n_ctx_slot != old.n_ctx_slot):
                self.learn_due = True
            other = model != self.model
            if other:
                self.learnt.forget()
            self._facts_before, self.model = facts, model
        return other

    def _identified_behind(self, facts: http.ServerFacts) -> None:
        """The model hashed in the background identified from ``facts``: taken again (:meth:`set_facts`: ``model``
        set there, and what a model change forgets, serve's index made anew), unless newer facts came."""
        if self.facts is facts:
            self.set_facts(facts)

    def probe(self, slot: int, api_key: str | None = None) -> None:
        """The server's ``-kvu``/``-ctk``/``-ctv`` learnt (:meth:`learn`) from a save of ``slot`` (idle: the
        caller's choice, the one holding the fewest tokens) into a working file of the slot directory, read
        (metadata only) and removed: its stream count always, its cache types when the slot holds cells (a slot
        that holds nothing saves its stream count alone, 36-40 bytes with b11434). Raises when the save fails
        (the flags judged with stay as they are); not due again until the facts change."""
        work = names.work_name(self.role, slot, "probe")
        path = self.slot_dir / work
        try:
            answer = self.save(slot, work, api_key)
            got = read_saved(path, answer)
            if got.problem is not None:
                raise http.ServerAnswerError(f"{path}: {got.problem}")
            self.learn(got.flags, slot, "probe")
        finally:
            self.learn_due = False
            names.discard(path)

    def learn(self, written, slot: int, source: str) -> None:
        """What a save of ``slot`` by the server now running says of its ``-kvu``/``-ctk``/``-ctv``
        (``written``: :func:`slotctl.slotfile.written_flags` of the file, read by
        :func:`slotctl.server.saved.saved_flags`) taken over (:meth:`Learnt.take`): states are judged (and
        converted) for it from now on, the verdicts made before forgotten. A flag given that the save
        contradicts: a ``warning`` event, once per flag and value; what changed: a ``learned`` event
        (``source``: "probe" or "save")."""
        total = self.facts.total_slots if self.facts is not None else None
        with self._lock:
            events, changed = self.learnt.take(saved_flags(written, total), slot=slot, total_slots=total,
                                               source=source)
            if changed:
                self.judging.forget_all()     # the flags are part of the question
        for event, message, details in events:
            self.log(event, message, slot=slot, **details)

    # -- the model's identity: the identifier's --------------------------------------------------------

    @property
    def model(self) -> str | None:
        """The short digest of the server's model as the facts last taken say (the MODEL of its states' names;
        None: not identified)."""
        return self.identifier.model

    @model.setter
    def model(self, model: str | None) -> None:
        self.identifier.model = model

    @property
    def server_model(self):
        """:attr:`slotctl.keeping.identity.ModelIdentifier.server_model`."""
        return self.identifier.server_model

    @property
    def unidentified(self) -> str | None:
        """Why the server's model is not identified (None: it is)."""
        return self.identifier.unidentified

    def server_restarted(self) -> None:
        self.identifier.server_restarted()

    def identify(self, facts: http.ServerFacts, *, restarted: bool = False) -> str | None:
        return self.identifier.identify(facts, restarted=restarted)

    def refusal(self, name: str) -> str | None:
        return self.identifier.refusal(name)

    def takes(self, name: str) -> bool:
        return self.identifier.takes(name)

    def check_model(self) -> None:
        self.identifier.check_model(self.facts)

    def found_damaged(self, name: str) -> None:
        """The stored state ``name`` was found not to be the bytes stored (:class:`~slotctl.seal.ChecksumMismatch`):
        never offered again by this process, its verdict forgotten, and a save of its tokens is stored beside it."""
        with self._lock:
            self.identifier.found_damaged(name)
            self.judging.forget([name])

    # -- the verdicts: judging's -----------------------------------------------------------------------

    @property
    def use_catalog(self) -> bool:
        return self.judging.use_catalog

    def setup(self, slot: int):
        return self.judging.setup(slot)

    def question(self) -> str:
        return self.judging.question()

    def listing(self, match: Callable[[str], bool]) -> dict[str, tuple[str | None, int, int]]:
        return self.judging.listing(match)

    def identity(self, name: str) -> tuple[str, int] | None:
        return self.judging.identity(name)

    def forget(self, gone) -> None:
        self.judging.forget(gone)

    def keep_only(self, prefix: str, present) -> None:
        self.judging.keep_only(prefix, present)

    def held(self) -> int:
        return self.judging.held()

    def catalog(self, create: bool):
        return self.judging.catalog(create)

    def judge(self, name: str, slot: int) -> Judged:
        return self.judging.judge(name, slot)

    def remember(self, name: str, judged: Judged, taken: int) -> None:
        self.judging.remember(name, judged, taken)

    def candidates(self, slot: int) -> list[str]:
        """The store's states saved from ``slot`` by a server running the model now running (its content: the
        target's and, for a state that carries a draft state, the draft's: :meth:`takes`), newest first; none
        while the model is not identified."""
        if self.model is None:
            return []
        return [n for n in self.store.names(seal.slot_prefix(slot, self.model)) if self.takes(n)]

    # -- placing and restoring -------------------------------------------------------------------------

    @contextlib.contextmanager
    def converted(self, name: str, slot: int, judged: Judged):
        """The stored state ``name`` (``judged``: its verdict, with the changes planned) converted for ``slot``
        of the server now running (:meth:`slotctl.keeping.placing.Placing.converted`) and the converted file
        judged as any state is (:meth:`slotctl.keeping.judging.Judging.judge_converted`: kept with the state's
        verdict): yields (its name in the slot directory, the conversion, the converted file's
        :class:`~slotctl.keeping.judged.Judged`), the file removed after. :class:`ConversionFailed` when the
        download or the conversion fails."""
        taken = time.time_ns()      # before the source is read (the catalog's row of the converted verdict)
        with self.placing.converted(name, slot, self.setup) as (work, conv):
            sent = self.judging.judge_converted(name, judged, self.slot_dir / work, slot, taken)
            yield work, conv, sent

    def placed(self, name: str, slot: int = 0, identity: str | None = None):
        """:meth:`slotctl.keeping.placing.Placing.placed`: the stored state ``name`` in the slot directory while
        the block runs, its identity and checksum checked."""
        return self.placing.placed(name, slot, identity)

    def restore(self, name: str, slot: int, *, placed: str | None = None, identity: str | None = None,
                checksum: str | None = None, api_key: str | None = None) -> dict:
        """The stored state ``name`` restored into ``slot``: the server's answer (its own error raised). Never a
        state of another model than the server's (:meth:`takes`), nor while the server's model is not identified
        or its file changed (:meth:`check_model`: :class:`NotIdentified`).
        ``placed``: the name of a file already in the slot directory holding it (a conversion, :meth:`converted`,
        whose ``checksum`` it must still have; a copy :meth:`placed` made), restored as it is; else it is placed
        for the restore (:meth:`placed`, with ``identity``, checked against the checksum in its name). A state of
        a directory store is then read as a reader reads (:meth:`slotctl.keeping.placing.Placing.used`)."""
        if placed is None:      # placed (its identity, then its checksum, checked), then restored as below
            with self.placed(name, slot, identity) as there:
                return self.restore(name, slot, placed=there, api_key=api_key)
        if checksum is not None:     # a conversion's file: its bytes as they were written
            self.placing.check_placed(placed, checksum)
        self.check_model()      # the last look before the request: the model file unchanged, the state its model's
        if not self.takes(name):
            raise NotIdentified(f"{name}: not restored: {self.refusal(name)}", code="other_model")
        answer = http.restore_slot(self.url, slot, placed, api_key=api_key or self.api_key, timeout=self.timeout,
                                   check=False, pool=self.pool, model=self.router_model)
        self.placing.used(name)
        return answer

    # -- saving and storing ----------------------------------------------------------------------------

    def work_name(self, slot: int, what: str = "incoming") -> str:
        """A working name of the process's own for one save of ``slot`` (in the slot directory)."""
        return names.work_name(self.role, slot, what)

    def save(self, slot: int, work: str, api_key: str | None = None) -> dict:
        """``slot`` saved by the server into its slot directory as ``work``: its answer (checked: the slot
        and the file name are the ones asked)."""
        return http.save_slot(self.url, slot, work, api_key=api_key or self.api_key, timeout=self.timeout,
                              check=False, pool=self.pool, model=self.router_model)

    def discard(self, work: str) -> None:
        """A working file removed from the slot directory (gone already: nothing to do)."""
        names.discard(self.slot_dir / work)

    def read_back(self, slot: int, work: str, answer: dict) -> Saved:
        """The file the server saved as ``work`` for ``slot``, read against its ``answer`` (it parses, with the
        token count and size the server reported: :attr:`Saved.problem` None), and what it says of the server's
        flags taken over (:meth:`learn`). Named as a state of ``slot`` (:meth:`named`) when it parses and the
        server's model is identified."""
        got = read_saved(self.slot_dir / work, answer)
        if got.problem is not None:
            return dataclasses.replace(got, slot=slot)
        self.learn(got.flags, slot, "save")
        return self.named(dataclasses.replace(got, slot=slot))

    def named(self, saved: Saved, *, wait: float | None = None) -> Saved:
        """``saved`` named as a stored state of the server's model (:func:`slotctl.keeping.storing.named`), or as it
        is while the model is not identified. ``wait``: seconds to wait for a model being hashed in the background
        (serve names its save when it stores it, off the request path: the first conversation after a start is
        stored too)."""
        return storing.named(saved, self.identifier.current(wait))

    def put_saved(self, saved: Saved) -> bool:
        """A checked save stored under its name, once (:func:`slotctl.keeping.storing.put_saved`: False when a
        state of its slot, model and tokens is stored already). :class:`NotIdentified` when the server's model is
        not identified, or its file changed since (:meth:`check_model`): a state is stored only under the
        identity of the model that wrote it."""
        self.check_model()
        if saved.name is None:
            raise NotIdentified(f"the server's model is not identified: {self.unidentified}")
        return storing.put_saved(self.store, saved, damaged=self.identifier.damaged(),
                                 before_write=self.before_write)

    # -- the store's housekeeping ----------------------------------------------------------------------

    def prune(self, on_file: Callable[[str, int, str, str], None], slot: int | None = None) -> None:
        """The store held under its budget (:func:`slotctl.keeping.housekeeping.prune`: ``retention`` for
        ``slot``'s states, ``max_size``)."""
        housekeeping.prune(self.store, on_file, max_size=self.max_size, retention=self.retention, slot=slot,
                           candidates=self.candidates)

    def sweep(self, on_file: Callable[[Path, int, int], None], *, age: float = ORPHAN_AGE,
              now: float | None = None) -> None:
        """What this role's processes that are gone left swept (:func:`slotctl.keeping.housekeeping.sweep`)."""
        housekeeping.sweep(self.slot_dir, self.store, self.role, on_file, age=age, now=now)

    def sweep_own(self, on_file: Callable[[Path, int], None]) -> None:
        """This process's own working files still there removed (:func:`slotctl.keeping.housekeeping.sweep_own`)."""
        housekeeping.sweep_own(self.slot_dir, self.role, on_file)


def slots_restarted(before: list | None, now: list | None) -> bool:
    """Whether ``GET /slots`` as it is ``now`` shows a new server process since it was ``before``: a slot that had
    run a task shows none (an erase keeps its task id), or the highest task id is lower (a new process counts
    from 0 again). A server that ran no task between the two shows nothing."""
    def tasks(slots) -> dict:
        return {e.get("id"): e.get("id_task") for e in slots or () if isinstance(e, dict)}

    old, new = tasks(before), tasks(now)
    if any(isinstance(old.get(i), int) and not isinstance(t, int) for i, t in new.items()):
        return True
    top_old = max((t for t in old.values() if isinstance(t, int) and not isinstance(t, bool)), default=None)
    top_new = max((t for t in new.values() if isinstance(t, int) and not isinstance(t, bool)), default=None)
    return top_old is not None and top_new is not None and top_new < top_old
