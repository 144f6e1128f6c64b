"""The blocking side of ``slotctl serve``: what it asks the server and the store, run in worker threads.

Everything here reuses what slotctl has: live mode's HTTP API (``POST /slots/N?action=save|restore``,
``/props`` and ``/slots`` read as :class:`~slotctl.live.http.ServerFacts`), the flags learned from it
(:func:`slotctl.live.prove.local_setup`), validate's verdict (:func:`slotctl.validate.check.validate_file`),
the predicted reuse (:mod:`slotctl.server.reuse`), the store (a directory or an ``s3://`` prefix,
:mod:`slotctl.fleet.states`), prune's budget, keep's names (a hash of the model, a hash of the tokens), and
migrate's conversion step for a state another server's ``-np``/``-kvu`` made
(:func:`slotctl.fleet.migrate.convert_for`, as keep converts).

Every failure is the caller's to count: a method raises, the proxy sends the request uncached.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slotctl.live import http
from slotctl.fleet.keep import model_hash, tokens_hash
from slotctl.live.prove import learnt_from, local_setup, local_setup_key, server_reads_checkpoints
from slotctl.fleet.states import changed_since, copy_atomic, open_store, read_saved
from slotctl.serve.index import State, StateIndex, as_tokens
from slotctl.server.flags import ServerFlags
from slotctl.server.reuse import request_reuse, reuse_for, server_n_swa
from slotctl.server.saved import Learnt, saved_flags

#: the name the server saves a slot under before serve checks it (in --slot-save-path): one per save, so
#: that a slot is given again while its last save is being stored
INCOMING = "serve-slot{slot}-{seq}-incoming.bin"
#: the name of a save made only to learn the server's -kvu/-ctk/-ctv (in --slot-save-path; removed after:
#: :meth:`Cache.probe`)
PROBE = "serve-slot{slot}-{seq}-probe.bin"
#: the name a stored state converted for one slot of the server takes in --slot-save-path while it is restored
#: (removed after: :meth:`Cache.converted`)
CONVERTED = "serve-slot{slot}-{seq}-converted.bin"
#: the names of serve's states: the model's hash, the number of tokens (zero-padded: names sort by length),
#: a hash of the tokens (one state stored once)
STATE_NAME = "serve-{model}-{n:07d}-{tokens}.bin"
#: verdicts serve restores (validate's: nothing dropped, nothing refused)
RESTORABLE = ("restores",)


def state_prefix(model: str) -> str:
    return f"serve-{model}-"


def state_name(model: str, tokens: np.ndarray) -> str:
    return STATE_NAME.format(model=model, n=len(tokens), tokens=tokens_hash(tokens))


@dataclass
class Judged:
    """validate's verdict on a stored state for one slot of the server now running, and what a request
    extending the whole state keeps (``extending``: None when no prediction can be made)."""

    verdict: str
    extending: int | None
    kind: str | None
    n_swa: int
    reason: str | None = None
    #: the changes a conversion for this server makes (its -np/-kvu streams: exact), when the stored file is not
    #: restored as it is and convert can bring it over; the converted file is judged again before it is sent
    convert: list[str] | None = None
    #: the file parsed whole (a damaged file is not converted: judged as it is)
    parsed: bool = False
    #: the identity of the bytes the verdict was made on (:func:`slotctl.catalog.local_identity`, or
    #: :func:`~slotctl.catalog.object_identity` of the ETag the reads were pinned to; None: the store gives
    #: none): a state is sent only while it has this identity (:meth:`Cache.restore`)
    identity: str | None = None
    #: when the file last changed (ns) as the identity says: the catalog's racy rule
    changed_ns: int = 0
    #: the verdict came from the catalog (kept by a serve before, for the same question and identity): the
    #: file was not opened to judge it
    catalog: bool = False

    def as_row(self) -> dict:
        """What the catalog keeps of the verdict (JSON values; the identity is the row's own)."""
        return {"verdict": self.verdict, "extending": self.extending, "kind": self.kind, "n_swa": self.n_swa,
                "reason": self.reason, "convert": self.convert, "parsed": self.parsed}

    @classmethod
    def from_row(cls, row: dict, identity: str, changed_ns: int) -> "Judged | None":
        """The verdict :meth:`as_row` kept, for the file at ``identity``; None when the row is not one (a damaged
        index may hold anything: nothing but these keys, of these types, is taken)."""
        def opt(value, kind) -> bool:
            return value is None or (isinstance(value, kind) and not isinstance(value, bool))

        v, ext, kind, n_swa = row.get("verdict"), row.get("extending"), row.get("kind"), row.get("n_swa")
        reason, convert, parsed = row.get("reason"), row.get("convert"), row.get("parsed")
        if not (isinstance(v, str) and opt(ext, int) and opt(kind, str) and isinstance(n_swa, int)
                and not isinstance(n_swa, bool) and opt(reason, str) and isinstance(parsed, bool)
                and (convert is None or (isinstance(convert, list) and all(isinstance(c, str) for c in convert)))):
            return None
        return cls(v, ext, kind, n_swa, reason, convert, parsed, identity, changed_ns, catalog=True)


@dataclass
class Saved:
    """A slot the server saved, checked, not yet stored: its working file and the state's name."""

    slot: int
    path: Path
    name: str
    tokens: np.ndarray
    kind: str | None
    size: int


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


class ConversionFailed(Exception):
    """A stored state could not be converted for the server (its download or its rewrite failed): the
    request goes uncached."""


class Cache:
    """The server at ``url`` (its ``--slot-save-path`` is ``slot_dir`` here) and the store (``store``: a
    directory, an ``s3://`` prefix, or None: ``slot_dir`` itself). ``flags`` / ``given``: what the server does
    not report (``-kvu``, ``-ctk``, ``-ctv``), for the fields named in ``given``, until the server's own saves
    say otherwise (:meth:`learn`)."""

    def __init__(self, url: str, slot_dir: str | os.PathLike, store: str | None = None, *,
                 api_key: str | None = None, max_size: int | None = None, timeout: float = 600.0,
                 catalog: bool = True, log=None, flags=None, given: frozenset[str] = frozenset()):
        self.url = http.normalize_url(url)
        self.slot_dir = Path(slot_dir)
        self.store = open_store(store, self.slot_dir)
        self.api_key, self.max_size, self.timeout = api_key, max_size, timeout
        #: the flags judged with: the ones given, with what the server's saves said over them (:meth:`learn`);
        #: ``learn_due``: a save to learn from is to be made (:meth:`probe`), set when the server's facts are first
        #: read or change
        self.learnt = Learnt(flags or ServerFlags(), frozenset(given))
        self.learn_due = True
        self.log = log or (lambda event, message, **details: None)
        self.counters = Counters()
        self.facts: http.ServerFacts | None = None
        self.model: str | None = None
        self.index: StateIndex | None = None
        self._judged: dict[tuple[str, int], Judged] = {}
        self._setups: dict[int, object] = {}
        #: slot -> the question serve's verdicts for it answer in the catalog (:func:`slotctl.catalog.verdict_key`)
        self._questions: dict[int, str] = {}
        #: an s3:// store's states as last listed: name -> (identity, changed_ns)
        self._listed_ids: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._listed = 0.0
        self._syncing = threading.Lock()
        self.catalog = None
        if catalog:
            from slotctl.catalog import Index, index_path

            where = index_path(self.store.where(""), beside=True)
            self.catalog = Index(where, log=lambda m: self.log("catalog", m, path=where))

    # -- the server ------------------------------------------------------------------------------------

    def refresh_facts(self, api_key: str | None = None) -> http.ServerFacts:
        """``/props``, ``/slots``, ``/v1/models`` read again (``api_key``: a client's, when serve has none of its
        own); a new model starts a new index."""
        facts = http.server_facts(self.url, api_key=api_key or self.api_key, timeout=min(self.timeout, 30.0))
        model = model_hash(facts)
        old = self.facts
        with self._lock:
            # the setup is learnt from these facts: another of them (another -c, a build) is another setup
            if model != self.model or old is None or learnt_from(facts) != learnt_from(old):
                self._judged.clear()
                self._setups.clear()
                self._questions.clear()
            if (model != self.model or old is None or facts.total_slots != old.total_slots
                    or facts.n_ctx_slot != old.n_ctx_slot):
                self.learn_due = True
            if model != self.model:
                self.index = StateIndex(state_prefix(model))
                self._listed = 0.0
                self.learnt.forget()    # another model (llama-swap): another command line
            self.facts, self.model = facts, model
        return facts

    def probe(self, slot: int, api_key: str | None = None) -> None:
        """The server's ``-kvu``/``-ctk``/``-ctv`` learnt (:meth:`learn`) from a save of ``slot`` (idle, the one
        holding the fewest tokens: the proxy's choice) into a private working file of the slot directory, read
        (metadata only) and removed: its stream count always, its cache types when the slot holds cells (a
        slot that holds nothing saves its stream count alone, 36-40 bytes with b11434). Raises when the save
        fails (the flags judged with stay as they are); not tried again until the facts change."""
        with self._lock:
            self._seq += 1
            name = PROBE.format(slot=slot, seq=f"{os.getpid()}-{self._seq}")
        try:
            answer = http.save_slot(self.url, slot, name, api_key=api_key or self.api_key, timeout=self.timeout,
                                    check=False)
            got = read_saved(self.slot_dir / name, answer)
            if got.problem is not None:
                raise http.ServerAnswerError(f"{self.slot_dir / name}: {got.problem}")
            self.learn(got.flags, slot, "probe")
        finally:
            self.learn_due = False
            _unlink(self.slot_dir / name)

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
                self._judged.clear()
                self._setups.clear()
                self._questions.clear()     # the flags are part of the question
        for event, message, details in events:
            self.log(event, message, slot=slot, **details)

    def _setup(self, slot: int):
        with self._lock:
            setup = self._setups.get(slot)
        if setup is None:
            setup, _notes = local_setup(self.facts, slot, self.learnt.flags, self.learnt.given)
            with self._lock:
                self._setups[slot] = setup
        return setup

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
        if self.index is None or time.monotonic() - self._listed < every:
            return
        listed = self._listing(self.index.prefix)
        self._listed_ids = {n: (ident, changed) for n, (ident, changed, _size) in listed.items() if ident}
        gone = set(self.index.states) - set(listed)
        self.index.forget(gone)
        new = [n for n in listed if n not in self.index.states]
        if new:
            where = {n: self.store.where(n) for n in new}
            known = self.catalog.get(list(where.values()), "tokens", {where[n]: listed[n][0] for n in new
                                                                      if listed[n][0]}) if self.catalog else {}
            made = []
            for n in new:
                c = known.get(where[n])
                if c is not None and c.tokens is not None:
                    self.index.add(State(n, c.tokens, c.kind, listed[n][2]))
                    continue
                st = self._read_state(n)
                if st is not None:
                    self.index.add(st)
                    if listed[n][0]:
                        from slotctl.catalog import Cached

                        made.append((where[n], listed[n][0], listed[n][1], Cached(None, st.kind, st.tokens,
                                                                                  self.model)))
            if self.catalog:
                self.catalog.put("tokens", made)
            self.log("indexed", f"{len(new)} stored state(s) indexed, {len(new) - len(made)} known to the "
                                f"catalog", n=len(new), read=len(made))
        if gone and self.catalog:
            self.catalog.forget([self.store.where(n) for n in gone])
        self._listed = time.monotonic()

    def _listing(self, prefix: str) -> dict[str, tuple[str | None, int, int]]:
        """The store's states beginning with ``prefix``: name -> (identity, changed_ns, size)."""
        from slotctl.catalog import local_identity, object_identity

        where = self.store.where("")
        out = {}
        if where.startswith("s3://"):
            from slotctl.sources import list_prefix

            for e in list_prefix(where) or ():
                name = e.path.rpartition("/")[2]
                if name.startswith(prefix) and name.endswith(".bin"):
                    out[name] = (object_identity(e.etag, e.size), int(e.mtime * 1e9), e.size)
            return out
        with os.scandir(where) as it:
            for d in it:
                if d.name.startswith(prefix) and d.name.endswith(".bin"):
                    try:
                        st = d.stat()
                    except FileNotFoundError:
                        continue
                    out[d.name] = (local_identity(st), st.st_mtime_ns, st.st_size)
        return out

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

    # -- judging and restoring -------------------------------------------------------------------------

    def judge(self, state: State, slot: int) -> Judged:
        """validate's verdict on ``state`` for ``slot`` of the server now running; when it is not ``restores``,
        whether convert can bring the state over to this server's ``-np``/``-kvu`` (``Judged.convert``: planned
        from the file's metadata, nothing written; a lossy conversion, of cache types, never).

        A verdict is made once per state, slot and identity of the state (a local file's device, inode, size,
        ``mtime_ns`` and ``ctime_ns``, one ``stat``; an object's ETag and size, from the store's last listing):
        kept in memory, and in the store's catalog under serve's question for the slot
        (:func:`slotctl.catalog.verdict_key`: what the slot's setup is learnt from, the server's facts, its build
        among them, the flags given or learnt from its saves, the model file's identity, and slotctl's version),
        so that a serve started again judges a state it judged before without opening it (nor the model's
        GGUF). A row is trusted only for the identity it was made on and when made at least
        :data:`slotctl.catalog.RACY_SECONDS` after the file last changed; a state is sent only while it still
        has the identity its verdict was made on (:meth:`restore`)."""
        key = (state.name, slot)
        where = self.store.where(state.name)
        now = self._identity(state.name)
        with self._lock:
            found = self._judged.get(key)
        if found is not None and found.identity == (now[0] if now is not None else None):
            return found
        question = self._question(slot)
        if now is not None and self.catalog is not None:
            row = self.catalog.verdict(where, question, now[0])
            judged = Judged.from_row(row, now[0], now[1]) if row is not None else None
            if judged is not None:
                with self._lock:
                    self._judged[key] = judged
                return judged
        taken = time.time_ns()      # before the read: a row is never newer than the bytes it was made on
        judged = self._judge_file(where, slot, state.kind)
        if judged.verdict not in RESTORABLE and judged.parsed:
            judged.convert, why = self._convertible(where, slot)
            if why:
                judged.reason = f"{judged.reason}; {why}" if judged.reason else why
        self._remember(key, question, judged, taken)
        return judged

    def _remember(self, key: tuple[str, int], question: str, judged: Judged, taken: int) -> None:
        """``judged`` kept for the state and slot ``key``: in memory, and in the catalog under ``question`` for
        the identity it was made on (``taken``: when, before the read)."""
        with self._lock:
            self._judged[key] = judged
        if self.catalog is not None and judged.identity is not None:
            self.catalog.put_verdict(self.store.where(key[0]), question, judged.identity, judged.changed_ns,
                                     judged.as_row(), read_ns=taken, model=self.model)

    def _identity(self, name: str) -> tuple[str, int] | None:
        """The stored state ``name``'s identity now and when it last changed (ns): a local file's ``stat``; an
        object's ETag and size as the store's last listing said (the download that sends it checks the ETag it
        reads: :meth:`restore`). None when there is none."""
        if self.store.where("").startswith("s3://"):
            return self._listed_ids.get(name)
        return self.store.identity(name)

    def _question(self, slot: int) -> str:
        with self._lock:
            question = self._questions.get(slot)
        if question is None:
            from slotctl.catalog import verdict_key

            # what Judged holds besides the file: validate's verdict for the setup and models, the reuse
            # prediction (whether this build reads checkpoints: in the facts), convert's plan (never lossy).
            # Asked by the setup's inputs rather than by the setup, which reads the model's GGUF: a serve
            # started again whose verdicts are all in the catalog reads no GGUF
            question = verdict_key("serve", None, learnt=local_setup_key(self.facts, slot, self.learnt.flags,
                                                                          self.learnt.given))
            with self._lock:
                self._questions[slot] = question
        return question

    def _judge_file(self, where: str, slot: int, kind: str | None) -> Judged:
        """validate's verdict on the file ``where`` for ``slot``, what a request extending it keeps, and the
        identity of the bytes it was made on (the open file's ``fstat``; an object's ETag its reads were
        pinned to)."""
        from slotctl.catalog import local_identity, object_identity
        from slotctl.sources import open_input
        from slotctl.validate.check import validate_file
        from slotctl.validate.setup import Models

        setup = self._setup(slot)
        models = Models(setup)
        with open_input(where) as f:
            if where.startswith("s3://"):
                identity = object_identity(getattr(f, "etag", None), f.size)
                changed = int((getattr(f, "mtime", None) or 0) * 1e9)
            else:
                st = os.fstat(f.fileno())
                identity, changed = local_identity(st), st.st_mtime_ns
            report = validate_file(where, setup, models, f=f)
            sf = report.slot_file
            n_swa = (server_n_swa(models.target, swa_full=setup.settings.swa_full)
                     if models.target is not None else 0)
            extending = None
            parsed = sf is not None and sf.target is not None and not sf.errors
            if sf is not None and sf.target is not None:
                reads = server_reads_checkpoints(self.facts.build_info)
                r = reuse_for(sf, models.target, swa_full=setup.settings.swa_full,
                              n_ctx_checkpoints=setup.n_ctx_checkpoints, reads_checkpoints=reads, extends=True)
                if r is not None:
                    extending = r.n_reused if reads else r.n_reused_b11434
            if sf is not None:
                sf.close()
        first = next((f for f in report.findings if f.severity == "error"), None)
        return Judged(str(report.verdict), extending, kind, n_swa, f"{first.layer}: {first.message}" if first else None,
                      parsed=parsed, identity=identity, changed_ns=changed)

    def _convertible(self, where: str, slot: int) -> tuple[list[str] | None, str | None]:
        """The changes a conversion of ``where`` for ``slot`` makes (None: none, or it cannot be converted,
        then why): migrate's plan (:func:`slotctl.fleet.migrate.plan_for`), lossy re-encoding refused."""
        from slotctl.errors import SlotctlError
        from slotctl.fleet.migrate import Refused, plan_for

        try:
            planned = plan_for(where, self._setup(slot), allow_lossy=False, who="server",
                               lossy_remedy="serve never re-encodes a state")
        except Refused as e:
            return None, str(e)
        except (SlotctlError, OSError) as e:
            return None, f"not converted: {e}"
        if planned.plan is None:
            return None, None
        planned.plan.parsed.close()     # planned only: the file is converted when it is restored
        return planned.changes, None

    @contextlib.contextmanager
    def converted(self, state: State, slot: int):
        """``state`` converted for ``slot`` of the server now running (migrate's conversion step,
        :func:`slotctl.fleet.migrate.convert_for`: streamed into a private file of the slot directory, atomic;
        an ``s3://`` state is downloaded first, into a private directory there, removed once converted) and the
        converted file judged as any state is: yields (its name in the slot directory, its :class:`Judged`),
        the file removed after. :class:`ConversionFailed` when the download or the conversion fails. A
        converted file whose verdict is not ``restores`` is remembered for the state and slot: not converted
        again."""
        from slotctl.fleet.migrate import convert_for

        with self._lock:
            self._seq += 1
            name = CONVERTED.format(slot=slot, seq=f"{os.getpid()}-{self._seq}")
        dest = self.slot_dir / name
        taken = time.time_ns()      # before the source is read (the catalog's row for a refusal after conversion)
        try:
            try:
                where = self.store.where(state.name)
                with tempfile.TemporaryDirectory(prefix=".slotctl-serve-", dir=self.slot_dir) as staging:
                    src = self.store.local(state.name, Path(staging)) if where.startswith("s3://") else Path(where)
                    conv = convert_for(src, self._setup(slot), dest, allow_lossy=False, who="server",
                                       lossy_remedy="serve never re-encodes a state")
                if not conv.changes:
                    raise ConversionFailed("nothing to convert")
            except ConversionFailed:
                raise
            except Exception as e:  # noqa: BLE001 - the caller's to count: the request goes uncached
                raise ConversionFailed(f"{state.name}: not converted for slot {slot}: {e}") from e
            self.counters.add("conversions")
            sent = self._judge_file(os.fspath(dest), slot, state.kind)
            sent.convert = conv.changes
            if sent.verdict not in RESTORABLE:
                with self._lock:
                    judged = self._judged.get((state.name, slot))
                # the state's verdict from now on (its identity unchanged): not converted again, in this process
                # or, through the catalog, the next
                sent = Judged(sent.verdict, None, state.kind, sent.n_swa,
                              f"converted ({'; '.join(conv.changes)}): {sent.reason}", parsed=True,
                              identity=judged.identity if judged is not None else None,
                              changed_ns=judged.changed_ns if judged is not None else 0)
                self._remember((state.name, slot), self._question(slot), sent, taken)
            yield name, sent
        finally:
            _unlink(dest)

    def reuse(self, judged: Judged, state: State, common: int, n_request: int) -> int:
        """The prompt tokens a request of ``n_request`` tokens sharing ``common`` with ``state`` keeps."""
        return request_reuse(judged.kind or "", judged.n_swa, state.n_tokens, common, n_request, judged.extending)

    def restore(self, state: State, slot: int, api_key: str | None = None, placed: str | None = None, *,
                identity: str | None = None) -> dict:
        """``state`` placed in the server's slot directory and restored into ``slot`` (the placed copy
        removed after, unless the store is the slot directory); ``placed``: the name of a file already there
        (a converted state, :meth:`converted`), restored as it is. The server's answer. A state of a directory
        store restored (or converted and restored) is read as a reader reads (:func:`_used`): ``--max-size``
        prunes the least recently used by the access time, which the copy (``copy_file_range``) does not
        update.

        ``identity``: the identity of the bytes the ``restores`` verdict was made on (``Judged.identity``): the
        file the server reads must still have it (a copy: the source opened has it before and after the copy;
        a download: its reads were pinned to that ETag; the store's own file in the slot directory: its
        ``stat``), else nothing is sent (:func:`~slotctl.fleet.states.changed_since`: the request goes uncached
        and the state is judged again at its next lookup)."""
        if placed is not None:
            answer = http.restore_slot(self.url, slot, placed, api_key=api_key or self.api_key, timeout=self.timeout,
                                       check=False)
            self._used(state.name)
            return answer
        name = state.name
        placed = self.slot_dir / name
        copied = not placed.exists()
        where = self.store.where(name)
        if copied:
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
            answer = http.restore_slot(self.url, slot, name, api_key=api_key or self.api_key, timeout=self.timeout,
                                       check=False)
            self._used(name)
            return answer
        finally:
            if copied:
                try:
                    os.unlink(placed)
                except FileNotFoundError:
                    pass

    def _used(self, name: str) -> None:
        """A state of a directory store read as a reader reads (:func:`_used`); an object has no access time."""
        where = self.store.where(name)
        if not where.startswith("s3://"):
            _used(where)

    # -- saving ----------------------------------------------------------------------------------------

    def work_name(self, slot: int) -> str:
        """A working name of its own for one save of ``slot`` (in the slot directory)."""
        with self._lock:
            self._seq += 1
            return INCOMING.format(slot=slot, seq=f"{os.getpid()}-{self._seq}")

    def checked(self, slot: int, work: str, answer) -> Saved | None:
        """The file the server saved as ``work`` for ``slot`` checked against its answer to the save: it parses,
        with the token count and size the server reported (:func:`read_saved`). None when the slot held
        nothing (the working file removed); the working file is :meth:`store_saved`'s to store or remove."""
        path = self.slot_dir / work
        try:
            what = f"POST {self.url}/slots/{slot}?action=save"
            http.check_shape(what, answer, http.SHAPES["save"])
            if answer["id_slot"] != slot or answer["filename"] != work:
                raise http.ServerAnswerError(f"{what}: unexpected answer: not slot {slot}'s save to {work}")
            got = read_saved(path, answer)
            if got.problem is not None:
                raise http.ServerAnswerError(f"{path}: not stored: {got.problem}")
            self.learn(got.flags, slot, "save")
            if got.n_tokens == 0 or got.media:
                _unlink(path)
                return None
            tokens = as_tokens(got.tokens)
            return Saved(slot, path, state_name(self.model, tokens), tokens, got.kind, got.size)
        except BaseException:
            _unlink(path)
            raise

    def discard(self, work: str) -> None:
        """A save's working file removed (a save whose answer never came)."""
        _unlink(self.slot_dir / work)

    def store_saved(self, saved: Saved) -> None:
        """A checked save stored under its content's name (once: a state already stored is not stored
        again; a directory store on the slot directory's file system takes a hard link, nothing copied),
        indexed, the store held under its budget; the working file removed whatever happens."""
        name, path = saved.name, saved.path
        try:
            where = self.store.where(name)
            stored = False
            if self.store.has(name):
                pass
            elif not where.startswith("s3://"):
                try:
                    os.link(path, where)          # never over a state of that name
                    from slotctl.atomic import fsync_dir

                    fsync_dir(os.path.dirname(where))
                    stored = True
                except FileExistsError:
                    pass
                except OSError:
                    self.store.put(path, name, move=False)
                    stored = True
            else:
                self.store.put(path, name, move=False)
                stored = True
            if stored:
                self.counters.add("saves")
                self.log("stored", f"slot {saved.slot}: stored as {where} ({saved.size:,} bytes, "
                                   f"{len(saved.tokens):,} tokens)", slot=saved.slot, name=name, size=saved.size,
                         n_tokens=len(saved.tokens))
            else:
                self.counters.add("saves_deduplicated")
            if self.index is not None:
                self.index.add(State(name, saved.tokens, saved.kind, saved.size))
            self.prune()
        finally:
            _unlink(path)

    def prune(self) -> None:
        if self.max_size is None:
            return

        def pruned(path: str, size: int, action: str, reason: str) -> None:
            self.counters.add("pruned")
            if self.index is not None:
                self.index.forget([path.rpartition("/")[2]])
            self.log("pruned", f"{path}: {action} ({reason}), {size:,} bytes", path=path, size=size)

        self.store.prune(self.max_size, (INCOMING.format(slot="*", seq="*"), CONVERTED.format(slot="*", seq="*"),
                                         PROBE.format(slot="*", seq="*")), pruned)


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
