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
import threading
import time
from pathlib import Path
from typing import Callable

from slotctl import seal
from slotctl.errors import SlotctlError, UsageError
from slotctl.keeping import names
from slotctl.keeping.judged import After, Judged, judge_file
from slotctl.keeping.store import Saved, changed_since, copy_atomic, open_store, read_saved
from slotctl.live import http
from slotctl.live.identity import ServerModel, Unidentified, identify
from slotctl.live.prove import learnt_from, local_setup, local_setup_key, server_reads_checkpoints
from slotctl.model.content import cached_content, file_key
from slotctl.server.flags import ServerFlags
from slotctl.server.saved import Learnt, saved_flags


#: seconds a working file left by a process of another machine (or named by the previous release, without its
#: machine's tag) stays untouched before keep or serve removes it at its start: a process of this machine that
#: is gone leaves its own removed at once (:meth:`ServerStates.sweep`)
ORPHAN_AGE = 3600.0


class ConversionFailed(Exception):
    """A stored state could not be converted for the server (its download or its rewrite failed)."""


class NotIdentified(UsageError):
    """The server's model is not identified by its content (yet, or at all), or a state is not its model's:
    nothing is stored for it or restored into it (:attr:`ServerStates.unidentified` says why)."""

    def __init__(self, message: str, *, code: str = "model_unidentified"):
        super().__init__(message, code=code)


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
        #: the server's model as its content says (:class:`slotctl.live.identity.ServerModel`; None: not identified,
        #: :attr:`unidentified` says why); ``model``: its short digest, the MODEL of its states' names
        self.server_model: ServerModel | None = None
        self.model: str | None = None
        self.unidentified: str | None = "the server's facts are not read yet"
        #: the draft model's file (``-md``: no server reports it); ``background``: a model is hashed in a thread of
        #: its own (serve: requests go uncached meanwhile), else in the caller's (keep); ``progress(done, total)``
        #: as it is hashed
        self.draft_model, self.background, self.progress = draft_model, background, progress
        #: the model file's path and identities when it was identified; the file changed since, to other bytes,
        #: while the server has not been seen to restart (:meth:`server_restarted`)
        self._identified: tuple[str | None, tuple[str, ...]] | None = None
        self._stale = False
        self._hashing: threading.Thread | None = None
        #: called before each write into the store (a state stored): the lock's check (keep's; raises when the
        #: lock is lost)
        self.before_write: Callable[[], None] | None = None
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
        self._lock = threading.RLock()
        self._facts_before: http.ServerFacts | None = None
        self._said_unidentified: str | None = None
        #: the stored states whose bytes were found not to be the ones stored (their checksum): never offered again
        self._damaged: set[str] = set()

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
                self._forget_judged()
            if (model != self.model or old is None or facts.total_slots != old.total_slots
                    or facts.n_ctx_slot != old.n_ctx_slot):
                self.learn_due = True
            other = model != self.model
            if other:
                self.learnt.forget()
            self._facts_before, self.model = facts, model
        return other

    # -- the model's identity --------------------------------------------------------------------------

    def server_restarted(self) -> None:
        """The server was seen to start again (keep's restart, serve's view of the slots): its model is identified
        anew from its file at the next facts (a file replaced while it ran is the model it loads now)."""
        with self._lock:
            self._stale = False
            self._identified = None

    def identify(self, facts: http.ServerFacts, *, restarted: bool = False) -> str | None:
        """The short digest of the model the server ``facts`` describe runs, by its file's content
        (:func:`slotctl.live.identity.identify`: once per file identity, from the cache after); None while it is
        not identified (:attr:`unidentified` says why, an ``unidentified`` event once per reason).

        A server process's model is the one identified when it was first seen (or seen to restart): its file
        changed since to other bytes (replaced in place) leaves the model the server runs unknown, so nothing is
        stored or restored until the server is seen to start again (:meth:`server_restarted`; a file touched
        or its mode changed, the same bytes, changes nothing). In the background (serve) a model not in the
        cache is hashed in a thread of its own, meanwhile not identified."""
        if restarted:
            self.server_restarted()
        path = facts.model_path
        with self._lock:
            ident, known, stale, hashing = self.server_model, self._identified, self._stale, self._hashing
        if hashing is not None and hashing.is_alive():
            return None
        if stale:
            return None
        if ident is not None and known is not None and known[0] == path:
            if _current_keys(ident) == known[1]:
                return ident.short      # the same process, its file unchanged: one stat per file
            again = self._identified_now(facts, quiet=True)
            if again is not None and again.target.digest == ident.target.digest:
                with self._lock:
                    self._identified = (path, _recorded_keys(again))
                return ident.short      # touched, or its mode changed: the same bytes
            with self._lock:
                self.server_model, self._stale = None, True
            self._unidentified(f"the model file {path} changed since the server loaded it"
                               + (f" (its content is now model {again.short})" if again is not None else "")
                               + ": which model the server runs is not known until it is seen to start again; "
                                 "nothing is stored or restored meanwhile")
            return None
        if self.background and path and cached_content(path) is None:
            self._unidentified(f"the server's model {path} is being identified by its content (hashed once per "
                               f"file): requests go uncached meanwhile", event=False)
            t = threading.Thread(target=self._identify_behind, args=(facts,), name="slotctl-identify", daemon=True)
            with self._lock:
                self._hashing = t
            t.start()
            return None
        made = self._identified_now(facts)
        return made.short if made is not None else None

    def _identified_now(self, facts: http.ServerFacts, *, quiet: bool = False) -> ServerModel | None:
        """The model identified from ``facts`` (hashed here when the cache does not hold it), taken (unless
        ``quiet``: only asked); None when it cannot be (said)."""
        t0 = time.perf_counter()
        try:
            made = identify(facts.model_path, facts.model_meta, self.draft_model, progress=self.progress)
        except Unidentified as e:
            if not quiet:
                with self._lock:
                    self.server_model, self.model = None, None
                self._unidentified(str(e))
            return None
        if quiet:
            return made
        hashed = [c for c in (made.target, made.draft) if c is not None and not c.cached]
        with self._lock:
            self.server_model, self.unidentified = made, None
            self._identified = (facts.model_path, _recorded_keys(made))
            self._said_unidentified = None
        how = (f"hashed {sum(c.size for c in hashed) / 1e9:,.2f} GB in {time.perf_counter() - t0:.1f} s" if hashed
               else "from the cache")
        self.log("identified", f"the server's model {facts.model_path} is model {made.short} by its content ({how})"
                 + (f"; draft model {made.draft.short}" if made.draft is not None else ""),
                 model=made.target.digest, draft_model=made.draft.digest if made.draft is not None else None,
                 cached=not hashed, seconds=round(time.perf_counter() - t0, 3))
        return made

    def _identify_behind(self, facts: http.ServerFacts) -> None:
        """The background identification (serve): once the model is known, the facts taken again (:meth:`set_facts`:
        ``model`` set there, and what a model change forgets, serve's index made anew), unless newer facts came."""
        try:
            made = self._identified_now(facts)
        finally:
            with self._lock:
                self._hashing = None
        if made is not None and self.facts is facts:
            self.set_facts(facts)

    def _unidentified(self, why: str, *, event: bool = True) -> None:
        with self._lock:
            self.unidentified = why
            said, self._said_unidentified = self._said_unidentified, why
        if event and said != why:
            self.log("unidentified", why)

    def refusal(self, name: str) -> str | None:
        """Why the stored state ``name`` is not for the server now running (another model, an unknown one, a draft
        state of another draft model: :meth:`slotctl.live.identity.ServerModel.refusal`; the server's model not
        identified), or None when it is."""
        with self._lock:
            ident, damaged = self.server_model, name in self._damaged
        if damaged:
            return "its content is not the state that was stored (its checksum): never restored"
        if ident is None:
            return f"the server's model is not identified: {self.unidentified}"
        return ident.refusal(seal.parse_name(name))

    def found_damaged(self, name: str) -> None:
        """The stored state ``name`` was found not to be the bytes stored (:class:`~slotctl.seal.ChecksumMismatch`):
        never offered again by this process, its verdict forgotten, and a save of its tokens is stored beside it."""
        with self._lock:
            self._damaged.add(name)
            self._judged.pop(name, None)
            self._kept.discard(name)

    def takes(self, name: str) -> bool:
        """Whether the stored state ``name`` is this server's model's (:meth:`refusal` None)."""
        return self.refusal(name) is None

    def check_model(self) -> None:
        """:class:`NotIdentified` unless the server's model is identified and its file unchanged since (one
        ``stat`` per file): before a state is stored or restored (a file replaced meanwhile is noticed here, and
        its server's model is not known until it is seen to start again)."""
        with self._lock:
            ident, known = self.server_model, self._identified
        if ident is not None and known is not None and _current_keys(ident) == known[1]:
            return
        if ident is not None and self.facts is not None:
            self.identify(self.facts)
        with self._lock:
            if self.server_model is not None:
                return
        raise NotIdentified(f"the server's model is not identified: {self.unidentified}")

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
        """The store's states saved from ``slot`` by a server running the model now running (its content: the
        target's and, for a state that carries a draft state, the draft's: :meth:`takes`), newest first; none
        while the model is not identified."""
        if self.model is None:
            return []
        return [n for n in self.store.names(seal.slot_prefix(slot, self.model)) if self.takes(n)]

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
        cannot be read.

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
        sent is not converted again. :class:`ConversionFailed` when the download or the conversion fails.

        The state's bytes must have the checksum its name says before they are converted (the download's, or
        the store's file read once, which must not change while it is converted:
        :class:`~slotctl.seal.ChecksumMismatch`, raised as it is); the converted file's checksum is made as it is
        written (``Conversion.checksum``) and checked again before it is restored (:meth:`restore`)."""
        from slotctl.keeping.conversion import convert_for

        said = seal.parse_name(name)
        if said is None or said.checksum is None:
            raise seal.ChecksumMismatch(f"{self.store.where(name)}: its name carries no checksum: never restored")
        work = names.work_name(self.role, slot, "converted")
        dest = self.slot_dir / work
        taken = time.time_ns()      # before the source is read (the catalog's row of the converted verdict)
        try:
            try:
                where = self.store.where(name)
                with self._staging(slot) as staging:
                    if where.startswith("s3://"):
                        src = self.store.local(name, staging, checksum=said.checksum)
                        before = None
                    else:
                        src, before = Path(where), _checked_in_place(where, said.checksum)
                    conv = convert_for(src, self.setup(slot), dest, allow_lossy=self.allow_lossy,
                                       lossy_remedy="not allowed")
                    if before is not None and _identity_of(where) != before:
                        raise changed_since(where)
                if not conv.changes:
                    raise ConversionFailed("nothing to convert")
            except (ConversionFailed, seal.ChecksumMismatch):
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

    @contextlib.contextmanager
    def _staging(self, slot: int):
        """A directory of this process's own in the slot directory (a working name: swept once the process is
        gone), removed after."""
        import shutil

        path = self.slot_dir / names.staging_name(self.role, slot)
        path.mkdir(mode=0o700)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # -- placing and restoring -------------------------------------------------------------------------

    @contextlib.contextmanager
    def placed(self, name: str, slot: int = 0, identity: str | None = None):
        """The stored state ``name`` in the server's slot directory while the block runs, for ``slot``: yields
        its name there. A copy (a directory store: through a temporary file, never a torn file) or a download
        (an ``s3://`` store, whole or absent) under a working name of this process's own (``placed``: no
        client's file of the state's name is ever sent in its place, and a process killed meanwhile leaves
        nothing the next one does not sweep), removed after; the store's own file only when the store is the
        slot directory itself (``--store`` given so). ``identity``: the identity of the bytes a verdict was
        made on (``Judged.identity``): the file the server reads must still have it (a copy: the source opened
        has it before and after the copy; a download: its reads were pinned to that ETag; the store's own file
        in the slot directory: its ``stat``), else nothing is placed
        (:func:`~slotctl.keeping.store.changed_since`). The bytes placed must have the checksum the state's
        name says (:mod:`slotctl.seal`: hashed as they are copied or downloaded, or read once where they are),
        else nothing is placed (:class:`~slotctl.seal.ChecksumMismatch`): a state damaged since it was stored
        is never sent."""
        said = seal.parse_name(name)
        expected = said.checksum if said is not None else None
        if expected is None:
            raise seal.ChecksumMismatch(f"{self.store.where(name)}: its name carries no checksum: never restored")
        if getattr(self.store, "same", False):     # the store is the slot directory: its own file is read
            here = self.slot_dir / name
            if identity is not None and _identity_of(here) != identity:
                raise changed_since(here)       # before its bytes are read
            if _checked_in_place(here, expected) != identity and identity is not None:
                raise changed_since(here)
            yield name
            return
        work = names.work_name(self.role, slot, "placed")
        placed = self.slot_dir / work
        try:
            where = self.store.where(name)
            if where.startswith("s3://"):     # downloaded whole, complete or absent, and checked
                self.store.local(name, self.slot_dir, identity=identity, checksum=expected, as_name=work)
            else:       # not a hard link: that would change the state's ctime, its identity
                copy_atomic(where, placed, identity=identity, checksum=expected)
            yield work
        finally:
            _unlink(placed)

    def restore(self, name: str, slot: int, *, placed: str | None = None, identity: str | None = None,
                checksum: str | None = None, api_key: str | None = None) -> dict:
        """The stored state ``name`` restored into ``slot``: the server's answer (its own error raised). Never a
        state of another model than the server's (:meth:`takes`), nor while the server's model is not identified
        or its file changed (:meth:`check_model`: :class:`NotIdentified`).
        ``placed``: the name of a file already in the slot directory holding it (a conversion, :meth:`converted`,
        whose ``checksum`` it must still have; a copy :meth:`placed` made), restored as it is; else it is placed
        for the restore (:meth:`placed`, with ``identity``, checked against the checksum in its name). A state of a directory store is then read as a reader reads (:func:`_used`): a budget
        prunes the least recently used by the access time, which the copy (``copy_file_range``) does not
        update."""
        if placed is None:      # placed (its identity, then its checksum, checked), then restored as below
            with self.placed(name, slot, identity) as there:
                return self.restore(name, slot, placed=there, api_key=api_key)
        if checksum is not None:     # a conversion's file: its bytes as they were written
            _checked_in_place(self.slot_dir / placed, checksum)
        self.check_model()      # the last look before the request: the model file unchanged, the state its model's
        if not self.takes(name):
            raise NotIdentified(f"{name}: not restored: {self.refusal(name)}", code="other_model")
        answer = http.restore_slot(self.url, slot, placed, api_key=api_key or self.api_key, timeout=self.timeout,
                                   check=False, pool=self.pool, model=self.router_model)
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
                              check=False, pool=self.pool, model=self.router_model)

    def discard(self, work: str) -> None:
        """A working file removed from the slot directory (gone already: nothing to do)."""
        _unlink(self.slot_dir / work)

    def read_back(self, slot: int, work: str, answer: dict) -> Saved:
        """The file the server saved as ``work`` for ``slot``, read against its ``answer`` (it parses, with the
        token count and size the server reported: :attr:`Saved.problem` None), and what it says of the server's
        flags taken over (:meth:`learn`). Named as a state of ``slot`` (:attr:`Saved.name`: the model's content
        identity, and the draft model's for a state that carries a draft state, and its checksum:
        :func:`slotctl.seal.state_name`) when it parses and the server's model is identified."""
        got = read_saved(self.slot_dir / work, answer)
        if got.problem is not None:
            return dataclasses.replace(got, slot=slot)
        self.learn(got.flags, slot, "save")
        return self.named(dataclasses.replace(got, slot=slot))

    def named(self, saved: Saved, *, wait: float | None = None) -> Saved:
        """``saved`` (a checked save of ``saved.slot``) named as a stored state of the server's model
        (:func:`slotctl.seal.state_name`), or as it is (``name`` None) while the model is not identified. ``wait``:
        seconds to wait for a model being hashed in the background (serve names its save when it stores it, off
        the request path: the first conversation after a start is stored too)."""
        with self._lock:
            hashing = self._hashing
        if wait is not None and hashing is not None:
            hashing.join(wait)
        with self._lock:
            ident = self.server_model
        if ident is None or saved.checksum is None or saved.slot is None:
            return saved
        tokens = saved.tokens if saved.tokens is not None else ()
        return dataclasses.replace(saved, name=seal.state_name(saved.slot, ident.short, tokens, saved.checksum,
                                                               ident.draft_part(saved.draft)))

    def put_saved(self, saved: Saved) -> bool:
        """A checked save (``saved.path``, the working file) stored under its name, once: False when a state of
        its slot, model and tokens is in the store already (whatever its checksum: written by another process
        meanwhile, too); a directory store on the slot directory's file system takes a hard link, nothing
        copied, else a copy through a temporary file; an ``s3://`` store an object created only if absent. The
        working file stays: the caller's to remove. :class:`NotIdentified` when the server's model is not
        identified, or its file changed since (:meth:`check_model`): a state is stored only under the identity
        of the model that wrote it."""
        self.check_model()
        if saved.name is None:
            raise NotIdentified(f"the server's model is not identified: {self.unidentified}")
        name, path = saved.name, saved.path
        said = seal.parse_name(name)
        prefix = name[:-len(f"{said.checksum}.bin")]
        with self._lock:
            damaged = set(self._damaged)
        if set(self.store.named(prefix)) - damaged:
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

    def sweep(self, on_file: Callable[[Path, int, int], None], *, age: float = ORPHAN_AGE,
              now: float | None = None) -> None:
        """What this role's processes that are gone (killed: SIGKILL leaves no way to clean up) left in the slot
        directory removed (:func:`slotctl.keeping.names.leftover`: working files, their atomic writes' temporary
        files, staging directories): at once when the name says the process ran on this machine and its pid is
        no process here; a name of another machine (or of the previous release, without its machine's tag) only
        once untouched for ``age`` seconds (and, without a tag, its pid no process here). The store's own
        temporary files untouched for ``age`` seconds too (a directory store: another keep or serve may be
        writing one). ``on_file(path, pid, size)`` for each (pid 0: the store's)."""
        import shutil

        now = time.time() if now is None else now
        here = names.host_tag()
        try:
            entries = list(os.scandir(self.slot_dir))
        except OSError:
            entries = []
        for e in entries:
            left = names.leftover(e.name)
            if left is None or left.role != self.role or (left.pid == os.getpid() and left.host in (here, None)):
                continue
            path = Path(e.path)
            try:
                st = e.stat(follow_symlinks=False)
                if left.host != here and now - st.st_mtime < age:
                    continue                    # another machine's, or unknown: only when long untouched
                if left.host in (here, None) and _alive(left.pid):
                    continue
                if left.directory:
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except OSError:
                continue
            on_file(path, left.pid, 0 if left.directory else st.st_size)
        sweep_temps = getattr(self.store, "sweep_temps", None)
        if sweep_temps is not None:
            sweep_temps(age, now, lambda p, size: on_file(p, 0, size))

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


def _identity_of(path) -> str | None:
    from slotctl.catalog import local_identity

    try:
        return local_identity(os.stat(path))
    except OSError:
        return None


def _checked_in_place(path, expected: str) -> str:
    """The file at ``path`` read once and its bytes checked against ``expected`` (:func:`slotctl.seal.verify`);
    its identity (:func:`slotctl.catalog.local_identity`) as it was read."""
    from slotctl.catalog import local_identity
    from slotctl.paths import open_regular

    with open_regular(path, what="slot file ") as f:
        ident = local_identity(os.fstat(f.fileno()))
        seal.verify(path, expected, seal.checksum(f))
        return ident


def _recorded_keys(ident: ServerModel) -> tuple[str, ...]:
    """The identities of the model files (target, then draft) as they were when their content was hashed."""
    return tuple(k for c in (ident.target, ident.draft) if c is not None for k in c.keys)


def _current_keys(ident: ServerModel) -> tuple[str, ...] | None:
    """The identities of the model files as they are now (one ``stat`` each); None when one is gone."""
    try:
        return tuple(file_key(os.stat(p)) for c in (ident.target, ident.draft) if c is not None for p in c.files)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process of this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


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
