"""One running server's stored states, kept in one store: what ``keep`` and ``serve`` do alike
(:class:`ServerStates`).

Everything here goes through what slotctl has: live mode's HTTP API (``POST /slots/N?action=save|restore``,
:class:`~slotctl.live.http.ServerFacts`), the setup validate judges with (:func:`slotctl.live.prove.local_setup`),
validate's verdict and the predicted reuse (:func:`slotctl.keeping.judged.judge_file`), the store
(:mod:`slotctl.keeping.store`), the names (:mod:`slotctl.keeping.names`), the conversion step
(:mod:`slotctl.keeping.conversion`), the store's catalog (:class:`slotctl.catalog.Index`) and prune's budget.
What differs between keep and serve is theirs: keep's loop (:mod:`slotctl.fleet.keep`), serve's request path
(:mod:`slotctl.serve`). Every failure raises: the caller says it, and goes on.

Safe from several threads at once (serve judges and stores in worker threads; keep's ``/ui`` page judges
beside keep's loop): what is kept in memory is guarded by one lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from slotctl.errors import SlotctlError
from slotctl.keeping import names
from slotctl.keeping.judged import After, Judged, judge_file
from slotctl.keeping.store import Saved, changed_since, copy_atomic, open_store, read_saved
from slotctl.live import http
from slotctl.live.prove import learnt_from, local_setup, local_setup_key, server_reads_checkpoints
from slotctl.server.flags import ServerFlags
from slotctl.server.saved import Learnt, saved_flags


class ConversionFailed(Exception):
    """A stored state could not be converted for the server (its download or its rewrite failed)."""


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
    serve made (the fleet view writes nothing new into a store it only looks at). ``log(event, message, **details)`` gets the catalog's lines
    and what a save taught (``learned``, ``warning``: ``slot`` among the details). ``router_model``: ``url`` is a
    router, and this the model whose states these are (every request to it names the model)."""

    def __init__(self, url: str, slot_dir: str | os.PathLike | None, store=None, *, role: str | None = None,
                 api_key: str | None = None, timeout: float = 600.0, max_size: int | None = None,
                 retention: int | None = None, catalog: bool = True, flags=None, given: frozenset[str] = frozenset(),
                 allow_lossy: bool = False, log: Callable | None = None, create_catalog: bool = True,
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
            store, self.slot_dir if self.slot_dir is not None else Path(store if "://" not in str(store) else "."))
        self.api_key, self.timeout = api_key, timeout
        self.max_size, self.retention, self.allow_lossy = max_size, retention, allow_lossy
        self.log = log or _quiet
        #: the flags judged with: the ones given, with what the server's saves said over them (:meth:`learn`);
        #: ``learn_due``: a save to learn from is to be made (:meth:`probe`), set when the server's facts are first
        #: read or change
        self.learnt = Learnt(flags or ServerFlags(), frozenset(given))
        self.learn_due = True
        self.facts: http.ServerFacts | None = None
        #: the hash of the server's model in the states' names (:func:`slotctl.keeping.names.model_hash`)
        self.model: str | None = None
        #: called before each write into the store (a state stored): the lock's check (keep's; raises when the
        #: lock is lost)
        self.before_write: Callable[[], None] | None = None
        self.use_catalog, self.create_catalog = catalog, create_catalog
        self._catalog = None
        #: state name -> its verdict for the server now running (one for every slot: :meth:`judge`)
        self._judged: dict[str, Judged] = {}
        #: the verdicts in memory that the catalog holds too (said from it: ``Judged.catalog``)
        self._kept: set[str] = set()
        self._setups: dict[int, object] = {}
        #: the question verdicts answer in the catalog (:func:`slotctl.catalog.verdict_key`; :meth:`question`)
        self._question: str | None = None
        #: an s3:// store's states as last listed (:meth:`listing`): name -> (identity, changed_ns)
        self._listed_ids: dict[str, tuple[str, int]] = {}
        self._lock = threading.RLock()

    # -- the server ------------------------------------------------------------------------------------

    def read_facts(self, api_key: str | None = None, timeout: float | None = None) -> http.ServerFacts:
        """``/props``, ``/slots``, ``/v1/models`` read again (``api_key``: a client's, when there is none of the
        process's own) and taken (:meth:`set_facts`)."""
        facts = http.server_facts(self.url, api_key=api_key or self.api_key, model=self.router_model,
                                  timeout=timeout if timeout is not None else self.timeout)
        self.set_facts(facts)
        return facts

    def set_facts(self, facts: http.ServerFacts) -> bool:
        """The server's facts as just read; True when its model is another than before (llama-swap swapped it,
        or none was known). The verdicts made for other facts are forgotten (the setup is learnt from them: another
        ``-c``, another build is another setup); another model forgets what the saves taught (another command
        line); a save to learn the flags from is due when the model, the slot count or the slot context changed."""
        model = names.model_hash(facts)
        with self._lock:
            old = self.facts
            if model != self.model or old is None or learnt_from(facts) != learnt_from(old):
                self._forget_judged()
            if (model != self.model or old is None or facts.total_slots != old.total_slots
                    or facts.n_ctx_slot != old.n_ctx_slot):
                self.learn_due = True
            other = model != self.model
            if other:
                self.learnt.forget()
            self.facts, self.model = facts, model
        return other

    def _forget_judged(self) -> None:
        with self._lock:
            self._judged.clear()
            self._kept.clear()
            self._setups.clear()
            self._question = None

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
            _unlink(path)

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
                self._forget_judged()     # the flags are part of the question
        for event, message, details in events:
            self.log(event, message, slot=slot, **details)

    def setup(self, slot: int):
        """The setup validate judges ``slot``'s states with (:func:`slotctl.live.prove.local_setup`: it reads the
        model's GGUF), made once per slot until the facts or the flags change."""
        with self._lock:
            setup = self._setups.get(slot)
        if setup is None:
            setup, _notes = local_setup(self.facts, slot, self.learnt.flags, self.learnt.given)
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
            question = verdict_key("state", None, learnt=local_setup_key(self.facts, 0, flags, given),
                                   allow_lossy=self.allow_lossy)
            with self._lock:
                self._question = question
        return question

    # -- the store -------------------------------------------------------------------------------------

    def candidates(self, slot: int) -> list[str]:
        """The store's states saved from ``slot`` by a server running the model now running, newest first."""
        return self.store.names(names.slot_prefix(slot, self.model))

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
        ETag it reads: :meth:`placed`). None when there is none."""
        if self.store.where("").startswith("s3://"):
            with self._lock:
                listed = self._listed_ids.get(name)
            if listed is not None:
                return listed
        return self.store.identity(name)

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

    # -- the catalog -----------------------------------------------------------------------------------

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
        has the identity its verdict was made on (:meth:`placed`). OSError or SlotctlError when the state
        cannot be read."""
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
        judged = judge_file(where, self.setup(slot), reads_checkpoints=server_reads_checkpoints(self.facts.build_info))
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
                              judged.as_row(), read_ns=taken, model=self.model)
            if index.usable:
                with self._lock:
                    self._kept.add(key)

    @contextlib.contextmanager
    def converted(self, name: str, slot: int, judged: Judged):
        """The stored state ``name`` (``judged``: its verdict, with the changes planned) converted for ``slot``
        of the server now running (:func:`slotctl.keeping.conversion.convert_for`: streamed into a working file
        of the slot directory, atomic; an ``s3://`` state is downloaded first, into a private directory there,
        removed once converted) and the converted file judged as any state is: yields (its name in the slot
        directory, the conversion, the converted file's :class:`~slotctl.keeping.judged.Judged`), the file
        removed after. The verdict is kept with the state's (``judged.after``): a state whose conversion is not
        sent is not converted again. :class:`ConversionFailed` when the download or the conversion fails."""
        from slotctl.keeping.conversion import convert_for

        work = names.work_name(self.role, slot, "converted")
        dest = self.slot_dir / work
        taken = time.time_ns()      # before the source is read (the catalog's row of the converted verdict)
        try:
            try:
                where = self.store.where(name)
                with tempfile.TemporaryDirectory(prefix=f".slotctl-{self.role}-", dir=self.slot_dir) as staging:
                    src = self.store.local(name, Path(staging)) if where.startswith("s3://") else Path(where)
                    conv = convert_for(src, self.setup(slot), dest, allow_lossy=self.allow_lossy,
                                       lossy_remedy="not allowed")
                if not conv.changes:
                    raise ConversionFailed("nothing to convert")
            except ConversionFailed:
                raise
            except Exception as e:  # noqa: BLE001 - the caller's to say: the state is not restored
                raise ConversionFailed(f"{name}: not converted for slot {slot}: {e}") from e
            sent = judge_file(os.fspath(dest), self.setup(slot),
                              reads_checkpoints=server_reads_checkpoints(self.facts.build_info))
            after = After(sent.verdict, sent.sendable, sent.error, sent.why)
            if judged.after != after:       # the state's verdict from now on (its identity unchanged)
                self.remember(name, dataclasses.replace(judged, after=after, catalog=False), taken)
            yield work, conv, sent
        finally:
            _unlink(dest)

    # -- placing and restoring -------------------------------------------------------------------------

    @contextlib.contextmanager
    def placed(self, name: str, identity: str | None = None):
        """The stored state ``name`` in the server's slot directory while the block runs: yields its name there.
        A copy (a directory store elsewhere: through a temporary file, never a torn file) or a download (an
        ``s3://`` store, whole or absent), removed after; the store's own file when the store is the slot
        directory. ``identity``: the identity of the bytes a verdict was made on (``Judged.identity``): the file
        the server reads must still have it (a copy: the source opened has it before and after the copy; a
        download: its reads were pinned to that ETag; the store's own file in the slot directory: its
        ``stat``), else nothing is placed (:func:`~slotctl.keeping.store.changed_since`)."""
        placed = self.slot_dir / name
        copied = not placed.exists()
        if copied:
            where = self.store.where(name)
            if where.startswith("s3://"):
                self.store.local(name, self.slot_dir, identity=identity)      # downloaded whole, complete or absent
            else:       # not a hard link: that would change the state's ctime, its identity
                copy_atomic(where, placed, identity=identity)
        elif identity is not None:     # the file the server reads is the one in the slot directory
            from slotctl.catalog import local_identity

            try:
                now = local_identity(os.stat(placed))
            except OSError:
                now = None
            if now != identity:
                raise changed_since(placed)
        try:
            yield name
        finally:
            if copied:
                _unlink(placed)

    def restore(self, name: str, slot: int, *, placed: str | None = None, identity: str | None = None,
                api_key: str | None = None) -> dict:
        """The stored state ``name`` restored into ``slot``: the server's answer (its own error raised).
        ``placed``: the name of a file already in the slot directory holding it (a conversion, :meth:`converted`;
        a copy :meth:`placed` made), restored as it is; else it is placed for the restore (:meth:`placed`, with
        ``identity``). A state of a directory store is then read as a reader reads (:func:`_used`): a budget
        prunes the least recently used by the access time, which the copy (``copy_file_range``) does not
        update."""
        if placed is None:
            with self.placed(name, identity) as there:
                return self.restore(name, slot, placed=there, api_key=api_key)
        answer = http.restore_slot(self.url, slot, placed, api_key=api_key or self.api_key, timeout=self.timeout,
                                   check=False, model=self.router_model)
        where = self.store.where(name)
        if not where.startswith("s3://"):       # an object has no access time
            _used(where)
        return answer

    # -- saving ----------------------------------------------------------------------------------------

    def work_name(self, slot: int, what: str = "incoming") -> str:
        """A working name of the process's own for one save of ``slot`` (in the slot directory)."""
        return names.work_name(self.role, slot, what)

    def save(self, slot: int, work: str, api_key: str | None = None) -> dict:
        """``slot`` saved by the server into its slot directory as ``work``: its answer (checked: the slot
        and the file name are the ones asked)."""
        return http.save_slot(self.url, slot, work, api_key=api_key or self.api_key, timeout=self.timeout,
                              check=False, model=self.router_model)

    def discard(self, work: str) -> None:
        """A working file removed from the slot directory (gone already: nothing to do)."""
        _unlink(self.slot_dir / work)

    def read_back(self, slot: int, work: str, answer: dict) -> Saved:
        """The file the server saved as ``work`` for ``slot``, read against its ``answer`` (it parses, with the
        token count and size the server reported: :attr:`Saved.problem` None), and what it says of the server's
        flags taken over (:meth:`learn`). Named as a state of ``slot`` (:attr:`Saved.name`) when it parses."""
        got = read_saved(self.slot_dir / work, answer)
        if got.problem is not None:
            return dataclasses.replace(got, slot=slot)
        self.learn(got.flags, slot, "save")
        tokens = got.tokens if got.tokens is not None else ()
        return dataclasses.replace(got, slot=slot, name=names.state_name(slot, self.model, tokens))

    def put_saved(self, saved: Saved) -> bool:
        """A checked save (``saved.path``, the working file) stored under its name, once: False when a state of
        that name is in the store already (written by another process meanwhile, too); a directory store on
        the slot directory's file system takes a hard link, nothing copied, else a copy through a temporary
        file; an ``s3://`` store an object created only if absent. The working file stays: the caller's to
        remove."""
        name, path = saved.name, saved.path
        if self.store.has(name):
            return False
        if self.before_write is not None:
            self.before_write()
        where = self.store.where(name)
        if not where.startswith("s3://"):
            try:
                os.link(path, where)          # never over a state of that name
            except FileExistsError:
                return False
            except OSError:
                pass        # another file system: copied below
            else:
                from slotctl.atomic import fsync_dir

                fsync_dir(os.path.dirname(where))
                return True
        try:
            self.store.put(path, name, move=False)
        except SlotctlError as e:
            if getattr(e, "code", None) != "exists":
                raise
            return False        # stored by another process between the look and the copy
        return True

    # -- the budget ------------------------------------------------------------------------------------

    def prune(self, on_file: Callable[[str, int, str, str], None], slot: int | None = None) -> None:
        """The store held under its budget: with ``retention``, ``slot``'s states past its newest ``retention``
        deleted; with ``max_size``, prune's rules (least recently used first; every process's working files
        pinned). ``on_file(path, size, action, reason)`` for each file deleted."""
        if self.retention is not None and slot is not None:
            for name in self.candidates(slot)[self.retention:]:
                size = self.store.delete(name)
                on_file(self.store.where(name), size, "deleted", f"older than the newest {self.retention} of slot "
                                                                 f"{slot}")
        if self.max_size is not None:
            self.store.prune(self.max_size, names.WORK_GLOBS, on_file)

    def sweep(self, on_file: Callable[[Path, int, int], None], *, age: float, now: float | None = None) -> None:
        """The working files of this role's processes that are gone (killed: SIGKILL leaves no way to clean up)
        and untouched for ``age`` seconds removed: the pid in the name is no process of this machine (a process
        on another machine sharing the directory keeps its own, being recent). ``on_file(path, pid, size)``
        for each."""
        now = time.time() if now is None else now
        for p in self.slot_dir.glob(f"{self.role}-slot*.bin"):
            owner = names.work_owner(p.name)
            if owner is None or owner[1] == os.getpid():
                continue
            try:
                os.kill(owner[1], 0)
                continue                        # its process is alive
            except ProcessLookupError:
                pass
            except (PermissionError, OverflowError):
                continue
            try:
                st = p.stat()
                if now - st.st_mtime < age:
                    continue
                p.unlink()
            except OSError:
                continue
            on_file(p, owner[1], st.st_size)

    def sweep_own(self, on_file: Callable[[Path, int], None]) -> None:
        """This process's own working files still there removed (at exit: one a save it stopped waiting for
        left, written by the server after); ``on_file(path, size)`` for each."""
        for p in self.slot_dir.glob(names.own_works(self.role)):
            if names.work_owner(p.name) != (self.role, os.getpid()):
                continue
            try:
                size = p.stat().st_size
                p.unlink()
            except OSError:
                continue
            on_file(p, size)


def _used(path: str) -> None:
    """``path`` read as a reader does (its first byte), so that the filesystem notes the access as its mount
    keeps access times (``relatime``: once after each change, then daily); nothing changed (its ctime, its
    identity in the catalog, stays)."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError:
        pass


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
