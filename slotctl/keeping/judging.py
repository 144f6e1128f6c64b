"""Stored states judged for the server now running, each once per identity, the verdicts kept in memory and in
the store's catalog (:class:`Judging`, one per :class:`~slotctl.keeping.states.ServerStates`).

Its one reason to change: what a verdict is made of and where it is kept (the setup validate judges with, the
question a verdict answers in the catalog, the store's identity of a state, the conversion planned when a
state does not restore as it is, one thread judging a state at a time).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable

from slotctl.errors import SlotctlError
from slotctl.keeping.judged import After, Judged, judge_file
from slotctl.live import http
from slotctl.live.prove import local_setup, local_setup_key, server_reads_checkpoints
from slotctl.server.flags import ServerFlags
from slotctl.server.saved import Learnt


class Judging:
    """The verdicts on the states of ``store`` for the server whose facts ``facts()`` returns (None until read),
    running the model ``model()`` (its short digest, kept with a verdict in the catalog), judged with the flags
    ``learnt`` (given, and learnt from its saves: the owner's, shared). ``lock``: the owner's one lock.
    ``allow_lossy``: the conversion step may re-encode cache rows. ``catalog`` False: verdicts are not kept in
    the store's catalog (``--no-cache``); ``create_catalog`` False: kept only in a catalog keep or serve made.
    ``log(event, message, **details)`` gets the catalog's lines."""

    def __init__(self, store, lock, learnt: Learnt, *, facts: Callable[[], http.ServerFacts | None],
                 model: Callable[[], str | None], allow_lossy: bool = False, catalog: bool = True,
                 create_catalog: bool = True, log: Callable):
        self.store, self._lock, self.learnt = store, lock, learnt
        self._facts, self._model = facts, model
        self.allow_lossy, self.log = allow_lossy, log
        self.use_catalog, self.create_catalog = catalog, create_catalog
        self._catalog = None
        #: state name -> its verdict for the server now running (one for every slot: :meth:`judge`)
        self._judged: dict[str, Judged] = {}
        #: state name -> [its lock, the threads that hold or wait for it] while it is judged (:meth:`judge`)
        self._judging: dict[str, list] = {}
        #: the verdicts in memory that the catalog holds too (said from it: ``Judged.catalog``)
        self._kept: set[str] = set()
        self._setups: dict[int, object] = {}
        #: the question verdicts answer in the catalog (:func:`slotctl.catalog.verdict_key`; :meth:`question`)
        self._question: str | None = None
        #: an s3:// store's states as last listed (:meth:`listing`): name -> (identity, changed_ns)
        self._listed_ids: dict[str, tuple[str, int]] = {}

    def forget_all(self) -> None:
        """Every verdict forgotten, and the setups and the question with them (other facts, other flags)."""
        with self._lock:
            self._judged.clear()
            self._kept.clear()
            self._setups.clear()
            self._question = None

    # -- what a verdict answers ------------------------------------------------------------------------

    def setup(self, slot: int):
        """The setup validate judges ``slot``'s states with (:func:`slotctl.live.prove.local_setup`: it reads the
        model's GGUF), made once per slot until the facts or the flags change."""
        with self._lock:
            setup = self._setups.get(slot)
        if setup is None:
            setup, _notes = local_setup(self._facts(), slot, self.learnt.flags, self.learnt.given)
            with self._lock:
                self._setups[slot] = setup
        return setup

    def question(self) -> str:
        """The question a verdict on a state answers in the catalog (:func:`slotctl.catalog.verdict_key`): what
        the server's setup is learnt from (the server's facts, its build among them, the flags given or learnt
        from its saves, the model file's identity: :func:`slotctl.live.prove.local_setup_key`, asked without
        reading the GGUF), whether the conversion step may be lossy, and slotctl's version. The same for keep,
        serve and the fleet view, and for every slot (validate's verdict without a real load, its prediction
        and the conversion's plan read the slot only to know it exists: the setup is named by slot 0): one
        state is judged once for one server."""
        with self._lock:
            question = self._question
        if question is None:
            from slotctl.catalog import verdict_key
            from slotctl.server.saved import SAID

            # a flag the server does not report, given (or learnt) as llama-server's default, makes the setup
            # its default makes: one question, whether the server's save said it yet or not
            flags, default = self.learnt.flags, ServerFlags()
            given = frozenset(n for n in self.learnt.given if n not in SAID or getattr(flags, n) != getattr(default, n))
            question = verdict_key("state", None, learnt=local_setup_key(self._facts(), 0, flags, given),
                                   allow_lossy=self.allow_lossy)
            with self._lock:
                self._question = question
        return question

    # -- the states' identities ------------------------------------------------------------------------

    def listing(self, match: Callable[[str], bool]) -> dict[str, tuple[str | None, int, int]]:
        """The store's states whose names ``match``: name -> (identity, changed_ns, size); an ``s3://`` store's
        identities are kept for :meth:`identity` (one listing, no HEAD per state)."""
        listed = self.store.listing(match)
        with self._lock:
            self._listed_ids = {n: (ident, changed) for n, (ident, changed, _size) in listed.items() if ident}
        return listed

    def identity(self, name: str) -> tuple[str, int] | None:
        """The stored state ``name``'s identity now and when it last changed (ns): a local file's ``stat``; an
        object's ETag and size as the last listing said, else one HEAD (the download that sends it checks the
        ETag it reads: :meth:`slotctl.keeping.placing.Placing.placed`). None when there is none."""
        if self.store.where("").startswith("s3://"):
            with self._lock:
                listed = self._listed_ids.get(name)
            if listed is not None:
                return listed
        return self.store.identity(name)

    # -- the verdicts held -----------------------------------------------------------------------------

    def forget(self, gone) -> None:
        """The verdicts on states gone from the store forgotten (in memory: a process that runs for months
        holds only the store's states)."""
        with self._lock:
            for name in set(gone):
                self._judged.pop(name, None)
                self._kept.discard(name)

    def keep_only(self, prefix: str, present) -> None:
        """The verdicts on the states whose names begin with ``prefix`` and are not ``present`` (the store's
        now) forgotten."""
        present = set(present)
        with self._lock:
            self.forget([n for n in self._judged if n.startswith(prefix) and n not in present])

    def held(self) -> int:
        """How many verdicts are held in memory."""
        with self._lock:
            return len(self._judged)

    def catalog(self, create: bool):
        """The store's catalog (:class:`slotctl.catalog.Index`: beside a directory store, under the cache
        directory for ``s3://``), opened on first use; None without one (``--no-cache``), when it cannot be
        used, or when it does not exist yet and ``create`` is False (nothing is written into a store until there
        is a row to keep). An index that cannot be used as it is is a ``catalog`` line (rebuilt, or not used)."""
        if not self.use_catalog:
            return None
        with self._lock:
            if self._catalog is None:
                from slotctl.catalog import Index, index_path

                where = index_path(self.store.where(""), beside=True)
                if not create and not os.path.exists(where):
                    return None
                self._catalog = Index(where, log=lambda message: self.log("catalog", message, path=where))
            return self._catalog if self._catalog.usable else None

    # -- judging ---------------------------------------------------------------------------------------

    def judge(self, name: str, slot: int) -> Judged:
        """validate's verdict on the stored state ``name`` for ``slot`` of the server now running
        (:class:`~slotctl.keeping.judged.Judged`; the same for every slot: :meth:`question`); when it is not
        ``restores``, whether the conversion step can bring the state over to this server's ``-np``/``-kvu``
        (and cache types, when lossy re-encoding is allowed): planned from the file's metadata, nothing written.

        A verdict is made once per state and identity of the state (a local file's device, inode, size,
        ``mtime_ns`` and ``ctime_ns``, one ``stat``; an object's ETag and size, from the store's last listing
        or one HEAD): kept in memory, and in the store's catalog under the :meth:`question`, so that a
        process started again judges a state judged before without opening it (nor the model's GGUF). A row is
        trusted only for the identity it was made on and when made at least
        :data:`slotctl.catalog.RACY_SECONDS` after the file last changed; a state is sent only while it still
        has the identity its verdict was made on (:meth:`slotctl.keeping.placing.Placing.placed`). OSError or
        SlotctlError when the state cannot be read.

        A state is judged by one thread at a time: another asking meanwhile (serve's request path, while the save
        that stored it judges it) waits for that verdict, and is given it, not a second read."""
        with self._lock:
            judging = self._judging.get(name)
            if judging is None:
                judging = self._judging[name] = [threading.Lock(), 0]
            judging[1] += 1
        try:
            with judging[0]:
                return self._judge(name, slot)
        finally:
            with self._lock:
                judging[1] -= 1
                if judging[1] == 0:
                    del self._judging[name]

    def _judge(self, name: str, slot: int) -> Judged:
        key = name
        where = self.store.where(name)
        try:
            now = self.identity(name)
        except (OSError, SlotctlError):   # the store does not answer: the read below says so
            now = None
        with self._lock:
            found = self._judged.get(key)
            kept = key in self._kept
        if found is not None and found.identity == (now[0] if now is not None else None):
            # judged before, unchanged since: not read again (from the catalog, when it holds the verdict too)
            return dataclasses.replace(found, catalog=True) if kept and not found.catalog else found
        question = self.question()
        if now is not None:
            index = self.catalog(create=False)
            row = index.verdict(where, question, now[0]) if index is not None else None
            judged = Judged.from_row(row, now[0], now[1]) if row is not None else None
            if judged is not None:
                with self._lock:
                    self._judged[key] = judged
                    self._kept.add(key)
                return judged
        taken = time.time_ns()      # before the read: a row is never newer than the bytes it was made on
        judged = judge_file(where, self.setup(slot),
                            reads_checkpoints=server_reads_checkpoints(self._facts().build_info))
        if not judged.restores and judged.parsed:
            self._plan(judged, where, slot)
        self.remember(name, judged, taken)
        return judged

    def _plan(self, judged: Judged, where: str, slot: int) -> None:
        """The conversion of ``where`` for ``slot`` planned into ``judged`` (its changes, or why not)."""
        from slotctl.keeping.conversion import Refused, plan

        try:
            planned = plan(where, self.setup(slot))
        except Refused as e:
            judged.not_converted = str(e)
            return
        except (SlotctlError, OSError) as e:
            # the conversion cannot read it (or it is gone): judged as it is, and serve says why not converted
            judged.not_converted = f"not converted: {e}"
            judged.parsed = False
            return
        planned.close()     # planned only: the file is converted when it is restored
        if planned.lossy and not self.allow_lossy:
            judged.lossy = planned.lossy
        elif planned.changes:
            judged.convert = planned.changes

    def judge_converted(self, name: str, judged: Judged, converted: str | os.PathLike, slot: int,
                        taken: int) -> Judged:
        """The file ``converted`` (the stored state ``name``, whose verdict is ``judged``, converted for ``slot``)
        judged as any state is; what it says kept with the state's verdict (``judged.after``, ``taken``: when the
        state was read), so that a state whose conversion is not sent is not converted again."""
        sent = judge_file(os.fspath(converted), self.setup(slot),
                          reads_checkpoints=server_reads_checkpoints(self._facts().build_info))
        after = After(sent.verdict, sent.sendable, sent.error, sent.why)
        if judged.after != after:       # the state's verdict from now on (its identity unchanged)
            self.remember(name, dataclasses.replace(judged, after=after, catalog=False), taken)
        return sent

    def remember(self, name: str, judged: Judged, taken: int) -> None:
        """``judged`` kept for the state ``name``: in memory, and in the catalog under the :meth:`question` for
        the identity it was made on (``taken``: when, before the read)."""
        key = name
        with self._lock:
            self._judged[key] = judged
            self._kept.discard(key)
        if judged.identity is None:
            return
        index = self.catalog(create=self.create_catalog)
        if index is not None:
            index.put_verdict(self.store.where(name), self.question(), judged.identity, judged.changed_ns,
                              judged.as_row(), read_ns=taken, model=self._model())
            if index.usable:
                with self._lock:
                    self._kept.add(key)
