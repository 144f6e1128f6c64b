"""One metadata row per slot file, for whole directories (``slotctl ls``, ``slotctl prune``).

A row says what a file is (size, times, state version, tokens, memory kind, checkpoints, the bytes of
draft state) and what a server does with it (``verdict``, from :func:`slotctl.validate.validate_file`:
the structure and the server's rules always; with models, the prediction; with a load checker, the real
check). Each file is parsed once and only its metadata is read: tensor bytes are seeked over, never read.

Rows are plain dicts with the keys of docs/json.md (``ls``), so that they cross process boundaries:
:func:`catalog` spreads the files over a process pool when there are enough of them to pay for it,
and yields rows in the order of the paths, one at a time (memory stays flat in the number of files).
"""

from __future__ import annotations

import json
import os
import threading
import time
from stat import S_ISREG
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterable, Iterator

from slotctl.errors import ExitStatus
from slotctl.paths import CATALOG_FILE, STDIN
from slotctl.sources import remote_url

#: what prune reports for an ``undecided`` file whose payload no layout fits: the server refuses it or aborts
CUT_SHORT = "undecided: cut short (refused or aborts)"
#: below this many files the pool costs more than it saves
POOL_MIN_FILES = 48
#: files a worker takes at a time
POOL_CHUNK = 32


def iso_time(t: float) -> str:
    """A POSIX time as ISO 8601 UTC (second precision), as every ``mtime`` in the JSON."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Request:
    """What to compute for each file: the server to judge it for (``validate``'s ``ServerSetup``; None:
    structure with the default server's rules) and whether to load layers for real."""

    setup: object = None
    real_check: bool = False
    verbose: bool = False


def _draft_size(sf) -> int:
    """Bytes of draft state: the SDFT appendix plus the draft blobs of every checkpoint."""
    n = sf.sdft.size if sf.sdft is not None else 0
    for c in sf.checkpoints or ():
        n += c.dft.span.size
    return n


def _row_from(path: str, st, sf, report, now: float, standing=None) -> dict:
    tokens = sf.tokens.n_tokens if sf.tokens is not None and sf.tokens.error is None else None
    kind = sf.target.layout.kind if sf.target is not None else None
    checkpoints = [{"n_tokens": c.n_tokens, "pos_min": c.pos_min, "pos_max": c.pos_max,
                    "size": c.tgt.span.size + c.dft.span.size + c.spec.size} for c in sf.checkpoints or ()]
    row = {
        "path": path,
        "name": os.path.basename(path),
        "size": st.size,
        "mtime": iso_time(st.mtime),
        "atime": iso_time(st.used) if st.used is not None else None,
        "age_seconds": max(0, int(now - st.mtime)),
        "state_version": sf.version,
        "n_tokens": tokens,
        "memory_kind": kind,
        "checkpoints": checkpoints,
        "draft_size": _draft_size(sf),
        "damaged": sf.damaged,
        "verdict": report.verdict,
        "certain": report.certain,
        "uncertain": list(report.uncertain),
        "reuse": _reuse(report),
        "findings": [f.as_dict() for f in report.ordered_findings()],
        # undecided: 3, as validate says; but a payload cut short is refused or aborts, whichever (1)
        "exit_code": int(ExitStatus.FAILED if report.verdict == "undecided" and sf.payload_cut
                         else report.exit_status),
    }
    if report.verdict == "undecided" and sf.payload_cut:
        row["payload_cut"] = True    # refused or aborts, whichever: broken (ls/prune --broken)
    if standing is not None:         # slotctl.validate.classes: broken, mismatch, useless, ok, undecided
        row["class"] = str(standing.file_class)
        row["remedy"] = standing.remedy
    if sf.damaged:
        row["error"] = {"code": "damaged", "message": sf.errors[0].one_line()}
    elif report.verdict in broken_verdicts():
        first = next((f for f in report.findings if f.severity == "error"), None)
        row["error"] = {"code": first.code if first else report.verdict,
                        "message": f"{first.layer}: {first.message}" if first else report.verdict}
    return row


def _reuse(report) -> dict | None:
    """The reuse validate predicts for a request extending the saved prompt (``{"n_tokens", "n_reused",
    "checkpoint", "reason", ...}``), when it predicts one; else None."""
    value = getattr(report, "reuse", None)
    return value if isinstance(value, dict) else None


def _unreadable(path: str, e: Exception, st) -> dict:
    """The row of a file that could not be read at all (missing, not a regular file, no permission)."""
    from slotctl.errors import error_entry

    err = error_entry(e, path)
    return {"path": path, "name": os.path.basename(path), "size": st.size if st else None,
            "mtime": iso_time(st.mtime) if st else None,
            "atime": iso_time(st.used) if st and st.used is not None else None,
            "age_seconds": None, "state_version": None, "n_tokens": None, "memory_kind": None, "checkpoints": [],
            "draft_size": 0, "damaged": False, "verdict": "unreadable", "certain": True, "uncertain": [], "reuse": None,
            "findings": [], "class": "broken", "remedy": None, "exit_code": int(ExitStatus.USAGE),
            "error": err.as_dict()}


class _Worker:
    """What one process needs to make rows: the models read once, the load checker started once."""

    def __init__(self, request: Request):
        from slotctl.validate import LoadChecker, Models, ServerSetup

        self.request = request
        self.setup = request.setup if request.setup is not None else ServerSetup()
        self.models = Models(self.setup)
        self.checker = None
        if request.real_check and self.setup.target is not None:
            self.checker = LoadChecker(self.setup, verbose=request.verbose)

    def row(self, path: str, now: float) -> dict:
        from slotctl.errors import StoreDown, UsageError
        from slotctl.paths import stat_error
        from slotctl.sources import Entry, open_input, remote_url
        from slotctl.validate import validate_file
        from slotctl.validate.classes import classify

        st = None
        try:
            if remote_url(path) is not None:   # size and times from the object's first read: no HEAD
                with open_input(path) as f:
                    st = Entry(path, f.size, f.mtime, f.etag, getattr(f, "used", None))
                    report = validate_file(path, self.setup, self.models, self.checker, f=f)
            else:
                try:
                    s = os.stat(path)     # before reading: the access time as the server left it
                except OSError as e:
                    raise stat_error(path, e) from None
                st = Entry(path, s.st_size, s.st_mtime, None, s.st_atime)
                report = validate_file(path, self.setup, self.models, self.checker)
            standing = classify(report, self.setup)
        except StoreDown:       # the store stopped answering: the run stops, not row after row
            raise
        except (OSError, UsageError) as e:
            return _unreadable(path, e, st)
        return _row_from(path, st, report.slot_file, report, now, standing)

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()


_WORKER: _Worker | None = None


def _init_worker(request: Request) -> None:
    global _WORKER
    _WORKER = _Worker(request)


def _work(args: tuple[str, float]) -> dict:
    return _WORKER.row(*args)


def catalog(paths: Iterable[str], request: Request = Request(), *, processes: int | None = None,
            now: float | None = None, index: bool = True, known: "Known | None" = None) -> Iterator[dict]:
    """A row per path, in order. ``processes``: worker processes (default: the CPUs, when the files are
    many and no real check runs; the real check has a child process of its own per worker). ``index``: a
    file (or an object listed under a prefix) whose identity has not changed since its row was made for the
    same question is not read again (:class:`Known`: the index of its directory or prefix); False: every
    file is read. ``known``: the :class:`Known` the paths were expanded with (its stats, listings and index
    rows are used, not made again); it is closed here."""
    paths = list(paths)
    now = time.time() if now is None else now
    if not index:
        if any(remote_url(p) for p in paths):
            yield from _remote_rows(paths, request, now)
        else:
            yield from _rows(paths, request, processes, now)
        return
    known = known if known is not None else Known(request)
    try:
        cached = {}
        for p in paths:
            row = known.row(p, now)
            if row is not None:
                cached[p] = row
        misses = [p for p in paths if p not in cached]
        if any(remote_url(p) for p in misses):
            made = iter(_remote_rows(misses, request, now))
        else:
            made = iter(_rows(misses, request, processes, now))
        for p in paths:
            row = cached.get(p)
            if row is None:
                row = next(made)
                known.made(p, row)
            yield row
        known.flush()
    finally:
        known.close()


def request_key(request: Request) -> str:
    """What a row depends on besides its file: the server it was judged for (the models named by their
    identity, not only their paths), whether the real check ran, and slotctl's version."""
    import hashlib

    from slotctl import __version__

    parts = [__version__, repr(request.setup), str(request.real_check)]
    for attr in ("target", "draft"):
        m = getattr(request.setup, attr, None)
        if m is not None:
            try:
                parts.append(local_identity(os.stat(m)))
            except OSError:
                parts.append("missing")
    return "row:" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def verdict_key(who: str, setup, **asked) -> str:
    """The question a verdict row answers (keep's refusals, serve's verdicts: :meth:`Index.verdict`): ``who``
    (``keep``, ``serve``), the server's setup as validate judges it, the models' identities and slotctl's version
    (:func:`request_key`), and what else the verdict depends on (``asked``: keep's ``--allow-lossy`` and
    ``--force``). ``setup`` None: the setup is named in ``asked`` instead by what it is learnt from
    (``learnt``: :func:`slotctl.live.prove.local_setup_key`, the server's facts, the flags given, the slot, the
    model file's identity), so that asking costs no GGUF read. A verdict made for another question is never
    read."""
    import hashlib

    asked_text = request_key(Request(setup)) + "".join(f"|{k}={v}" for k, v in sorted(asked.items()))
    return f"{who}:" + hashlib.sha256(asked_text.encode()).hexdigest()[:24]


class _Place:
    """One directory's (or prefix's) index, read once: every trusted row for the question asked and every
    first-bytes entry, and what this run learned, written back in one transaction each."""

    def __init__(self, where: str, key: str, log):
        self.index = Index(index_path(where), log=log)
        self.rows = self.index.rows(key)
        self.heads = self.index.heads()
        self.new_rows: list = []
        self.new_heads: list = []


class Known:
    """What the catalog knows of the files a command lists, looked up once per directory or ``s3://``
    prefix (:func:`index_path`: under the user's cache directory): one ``stat`` per local file, the identity
    of an object from the prefix's listing, one ``SELECT`` of every row of the directory for the question
    asked, one of every file's first bytes.

    :meth:`head` gives :func:`slotctl.inputs.expand_slot_paths` a file's first bytes without opening it
    (it calls :meth:`saw` with what it read otherwise), :meth:`row` gives :func:`catalog` a file's row
    without reading it; a file whose identity is not the one a row was made from, or whose row was made
    less than :data:`RACY_SECONDS` after it last changed, is read again. Nothing in it fails a command: an
    index that cannot be used is as empty."""

    def __init__(self, request: Request = Request(), *, log=None):
        self.key = request_key(request)
        self.log = log
        #: when this run began: every identity it takes is as of this time or later, so a row is stored as
        #: read then (never later than the read it was made from)
        self.started_ns = time.time_ns()
        self._places: dict[str, _Place] = {}
        self._dirs: dict[str, tuple] = {}            # a directory as given -> its index, its absolute path/
        self._stats: dict[str, os.stat_result] = {}  # local path as given -> its stat
        self._looked: dict[str, tuple | None] = {}    # path as given -> what _look found
        self._listed: dict[str, object] = {}         # object URL -> its listing's Entry

    # -- where a path's index is, and its identity now ---------------------------------------------------
    def _look(self, p: str) -> tuple[_Place, str, str, int] | None:
        """(the index holding ``p``, ``p``'s key there, its identity now, its changed_ns), taken once per path
        (a local regular file's stat; an object's listing entry); None: not a file the index can hold."""
        got = self._looked.get(p, False)
        if got is not False:
            return got
        got = None
        url = remote_url(p) if "://" in p or p.startswith("s3:") else None
        if p == STDIN:
            pass         # standard input: no identity (a file named "-" here is not what is read)
        elif url is not None:
            e = self._listed.get(url)
            if e is not None and e.etag and _storable(url):
                changed = int(e.mtime * 1e9)
                got = (self._place(url.rpartition("/")[0] + "/"), url, object_identity(e.etag, e.size, changed),
                       changed)
        else:
            st = self._stat(p)
            if st is not None and _storable(p):
                cut = p.rfind(os.sep) + 1
                d = p[:cut]          # the directory as given, with its separator (empty: the current one)
                got = self._dirs.get(d)
                if got is None:
                    a = os.path.abspath(d or ".")
                    got = self._dirs[d] = (self._place(a), a if a.endswith(os.sep) else a + os.sep)
                got = (got[0], got[1] + p[cut:], local_identity(st), st.st_mtime_ns)
        self._looked[p] = got
        return got

    def _place(self, where: str) -> _Place:
        place = self._places.get(where)
        if place is None:
            place = self._places[where] = _Place(where, self.key, self.log)
        return place

    def _stat(self, p: str):
        st = self._stats.get(p)
        if st is None:
            try:
                st = self._stats[p] = os.stat(p)
            except (OSError, ValueError):
                return None
        return st if S_ISREG(st.st_mode) else None

    def _trusted(self, table: str, p: str):
        """What the index's ``table`` holds for ``p`` at its identity now, made long enough after the file
        last changed; else None."""
        look = self._look(p)
        if look is None:
            return None
        place, key, ident, _ = look
        entry = (place.rows if table == "rows" else place.heads).get(key)
        if entry is None or entry[0] != ident or entry[2] - entry[1] < _RACY_NS:
            return None
        return entry[3]

    # -- first bytes ---------------------------------------------------------------------------------------
    def listed(self, entries) -> None:
        """The entries of a prefix's listing (:class:`slotctl.sources.Entry`): their ETags are the identities."""
        for e in entries:
            self._listed[e.path] = e

    def head(self, p: str, st: os.stat_result | None = None) -> bytes | None:
        """The first bytes of ``p`` as the index holds them for its identity now (``st``: its stat, when the
        caller has it), or None (read them)."""
        if st is not None and p not in self._looked:
            self._stats[p] = st
        return self._trusted("heads", p)

    def saw(self, p: str, head: bytes | None) -> None:
        """The first bytes of ``p``, read now: kept for the next run."""
        look = self._look(p) if head is not None else None
        if look is not None:
            place, key, ident, changed = look
            place.new_heads.append((key, ident, changed, bytes(head)))

    # -- rows ----------------------------------------------------------------------------------------------
    def row(self, p: str, now: float) -> dict | None:
        """The row of ``p`` as the index holds it for its identity now (its age and last use as of now), or
        None (read the file)."""
        text = self._trusted("rows", p)
        if text is None:
            return None
        try:
            row = json.loads(text)
        except (ValueError, TypeError):    # a row that is no JSON (a damaged index): the file is read again
            return None
        if not isinstance(row, dict):
            return None
        row["path"], row["name"] = p, os.path.basename(p)
        st = self._stats.get(p)
        if st is None:      # an object: its age from the listing, its last use as it was stored
            row["age_seconds"] = max(0, int(now - self._listed[remote_url(p)].mtime))
        else:
            row["age_seconds"], row["atime"] = max(0, int(now - st.st_mtime)), iso_time(st.st_atime)
        return row

    def made(self, p: str, row: dict) -> None:
        """The row of ``p`` made now (kept unless the file could not be read)."""
        look = self._look(p) if row.get("exit_code") != int(ExitStatus.USAGE) else None
        if look is not None:
            place, key, ident, changed = look
            place.new_rows.append((key, ident, changed, row))

    def flush(self) -> None:
        """What this run read, written to each index (one transaction per table)."""
        for place in self._places.values():
            place.index.put(self.key, [(k, i, c, Cached(r, r.get("memory_kind"), None, None))
                                       for k, i, c, r in place.new_rows], read_ns=self.started_ns)
            place.index.put_heads(place.new_heads, read_ns=self.started_ns)
            place.new_rows, place.new_heads = [], []

    def close(self) -> None:
        for place in self._places.values():
            place.index.close()
        self._places.clear()


def forget(paths: list[str]) -> None:
    """Files deleted (``prune``): their rows and first bytes leave the index of their directory or prefix."""
    by_place: dict[str, list[str]] = {}
    for p in paths:
        url = remote_url(p)
        if url is not None:
            by_place.setdefault(url.rpartition("/")[0] + "/", []).append(url)
        else:
            a = os.path.abspath(p)
            by_place.setdefault(os.path.dirname(a), []).append(a)
    for where, gone in by_place.items():
        if os.path.exists(index_path(where)):
            ix = Index(index_path(where))
            ix.forget(gone)
            ix.close()


def _rows(paths: list[str], request: Request, processes: int | None, now: float) -> Iterator[dict]:
    if processes is None:
        processes = os.cpu_count() or 1
        if len(paths) < POOL_MIN_FILES or request.real_check:
            processes = 1
    if not paths:
        return
    if processes <= 1:
        w = _Worker(request)
        try:
            for p in paths:
                yield w.row(p, now)
        finally:
            w.close()
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    with ctx.Pool(processes, initializer=_init_worker, initargs=(request,)) as pool:
        yield from pool.imap(_work, ((p, now) for p in paths), chunksize=POOL_CHUNK)


#: objects read at once from a store (each read waits on the network, not on a CPU)
STORE_THREADS = 16


def _remote_rows(paths: list[str], request: Request, now: float) -> Iterator[dict]:
    """Rows of files some of which are objects in a store: threads, not processes (a forked child cannot use
    the store's client made in the parent, and the time goes to round trips)."""
    from concurrent.futures import ThreadPoolExecutor

    w = _Worker(request)
    try:
        with ThreadPoolExecutor(STORE_THREADS) as pool:
            yield from pool.map(lambda p: w.row(p, now), paths)
    finally:
        w.close()


def broken_verdicts() -> tuple:
    """The verdicts of files a server refuses or aborts on (``ls --broken``, ``prune --broken``): validate's
    ``Verdict.broken``, read on first use (a listing served from the index never imports validate)."""
    global _BROKEN
    if _BROKEN is None:
        from slotctl.validate.words import Verdict

        _BROKEN = tuple(v for v in Verdict if v.broken)
    return _BROKEN


_BROKEN: tuple | None = None


def is_broken(row: dict) -> bool:
    """Whether the server refuses or aborts on the file of ``row`` whatever its flags: damage in the file
    itself (:mod:`slotctl.validate.classes`; a payload cut short: one or the other)."""
    if "class" in row:
        return row["class"] == "broken"
    return row["verdict"] in broken_verdicts() or row.get("payload_cut", False)


def is_mismatched(row: dict) -> bool:
    """Whether the file of ``row`` is refused only by the flags or the model given (it restores in a server
    started as it was saved): ``ls --mismatched``, ``prune --mismatched``."""
    return row.get("class") == "mismatch"


def is_useless(row: dict) -> bool:
    """Whether the server restores the file of ``row`` but reuses none of it: ``ls --useless``,
    ``prune --useless``."""
    return row.get("class") == "useless"


def is_undecided(row: dict) -> bool:
    """Whether what the server does with the file cannot be told without the model (and it is not cut short:
    that one is broken either way). ``ls --broken`` lists these too; ``prune --broken`` leaves them."""
    return row["verdict"] == "undecided" and not row.get("payload_cut", False)


# -- the index on disk (SQLite) ------------------------------------------------------------------------------
#
# What parsing a file found, kept so that a file whose identity has not changed is not parsed again: per
# file (and per question asked of it: ``key``) its identity (a local file's device, inode, size, mtime_ns and
# ctime_ns; an object's key and ETag), when it was read, the row ls prints, its tokens (for serve's prefix
# lookups), its memory kind and the model fingerprint it was stored under. SQLite from the standard library,
# in WAL mode with short transactions, so that several processes share it.

#: the index's layout; an index of another version (or another slotctl version) is rebuilt, never read
INDEX_VERSION = 2
#: the index of a store directory, beside its files (when the directory is writable); ls does not count it
INDEX_NAME = CATALOG_FILE
#: a row read less than this long after its file last changed is not trusted (a file may still change
#: within its mtime's granularity): the file is read again
RACY_SECONDS = 3.0
#: how long a process waits for another's transaction before going on without the index
BUSY_SECONDS = 2.0
_RACY_NS = int(RACY_SECONDS * 1e9)

_SCHEMA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE files (
    path TEXT NOT NULL,          -- the file's absolute path, or the object's s3:// URL
    key TEXT NOT NULL,           -- what was asked of it: the verdict inputs of an ls row, or 'tokens'
    identity TEXT NOT NULL,      -- local: dev:ino:size:mtime_ns:ctime_ns, object: etag:ETAG:size
    changed_ns INTEGER NOT NULL, -- the file's mtime (ns)
    read_ns INTEGER NOT NULL,    -- when the row was made (ns)
    row TEXT,                    -- ls's row (JSON), for key != 'tokens'
    kind TEXT,                   -- the memory kind
    n_tokens INTEGER,
    tokens BLOB,                 -- the tokens, int32 little-endian
    model TEXT,                  -- the model fingerprint the file was stored under, when known
    PRIMARY KEY (path, key)
);
CREATE TABLE heads (
    path TEXT PRIMARY KEY,       -- as in files
    identity TEXT NOT NULL,
    changed_ns INTEGER NOT NULL,
    read_ns INTEGER NOT NULL,
    head BLOB NOT NULL           -- the file's first bytes: whether it is a slot file (format.magic.is_slot_entry)
);
"""


def cache_home() -> str:
    """slotctl's cache directory: ``$SLOTCTL_CACHE_DIR``, else ``$XDG_CACHE_HOME/slotctl``, else
    ``~/.cache/slotctl``."""
    if os.environ.get("SLOTCTL_CACHE_DIR"):
        return os.path.expanduser(os.environ["SLOTCTL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "slotctl")


def index_path(where: str, *, beside: bool = False) -> str:
    """Where the index of the directory or ``s3://`` prefix ``where`` lives: with ``beside`` (a store
    slotctl writes: serve's) beside a writable directory's files; else (a directory ls only reads, an
    ``s3://`` prefix, a read-only directory) under :func:`cache_home`, named by a hash of its path."""
    import hashlib

    if beside and remote_url(where) is None and os.access(where, os.W_OK):
        return os.path.join(where, INDEX_NAME)
    name = os.path.abspath(where) if remote_url(where) is None else where.rstrip("/") + "/"
    return os.path.join(cache_home(), "catalog", hashlib.sha256(name.encode()).hexdigest()[:24] + ".sqlite")


def local_identity(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def object_identity(etag: str | None, size: int, mtime_ns: int | None = None) -> str | None:
    """An object's identity: its ETag and size, and its Last-Modified when given (an object copied onto
    itself with new metadata, such as its last use, keeps its ETag)."""
    if not etag:
        return None
    return f"etag:{etag}:{size}" + (f":{mtime_ns}" if mtime_ns is not None else "")


@dataclass
class Cached:
    """A row of the index: ``row`` (ls's, or None), ``kind``, ``tokens`` (numpy int32, or None), ``model``."""

    row: dict | None
    kind: str | None
    tokens: object
    model: str | None


class Index:
    """The index at ``path`` (see :func:`index_path`). Every method is one short transaction; any SQLite
    error (a corrupt file, a lock held too long) makes the index unusable for this process: callers then
    read the files themselves (:attr:`usable`). A file of another version, or one that is not an index, is
    rebuilt."""

    def __init__(self, path: str, *, log=None):
        self.path = path
        self.log = log or (lambda message: None)
        self.usable = True
        self._conn = None
        #: one connection, used by one thread at a time (serve judges and indexes in worker threads: two
        #: transactions begun on one connection at once would be an error, and the index given up)
        self._lock = threading.RLock()
        try:
            self._conn = self._open()
        except (OSError, Exception) as e:  # noqa: BLE001 - sqlite3.Error and the rest: no index, never a failure
            self._give_up(e)

    def _give_up(self, e: Exception) -> None:
        self.usable = False
        self.log(f"{self.path}: the catalog is not used ({e})")

    def _open(self):
        import sqlite3

        from slotctl import __version__

        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        for attempt in (0, 1):
            conn = sqlite3.connect(self.path, timeout=BUSY_SECONDS, isolation_level=None, check_same_thread=False)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version == 0 and not conn.execute("SELECT 1 FROM sqlite_master").fetchone():
                    conn.execute("BEGIN IMMEDIATE")
                    if not conn.execute("SELECT 1 FROM sqlite_master").fetchone():
                        for statement in _SCHEMA.split(";"):
                            if statement.strip():
                                conn.execute(statement)
                        conn.execute("INSERT INTO meta VALUES ('slotctl', ?)", (__version__,))
                        conn.execute(f"PRAGMA user_version={INDEX_VERSION}")
                    conn.execute("COMMIT")
                    return conn
                made_by = conn.execute("SELECT value FROM meta WHERE name='slotctl'").fetchone()
                if version == INDEX_VERSION and made_by and made_by[0] == __version__:
                    return conn
                raise _Stale(f"version {version} made by slotctl {made_by[0] if made_by else '?'}")
            except (sqlite3.DatabaseError, _Stale) as e:
                conn.close()
                if attempt:
                    raise
                if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                    raise
                self.log(f"{self.path}: rebuilt ({e})")
                for suffix in ("", "-wal", "-shm"):
                    try:
                        os.unlink(self.path + suffix)
                    except FileNotFoundError:
                        pass
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self.usable = False

    def get(self, paths: list[str], key: str, identities: dict[str, str]) -> dict[str, Cached]:
        """The rows of ``paths`` for ``key`` whose identity is still ``identities[path]`` and that were made
        at least :data:`RACY_SECONDS` after their file last changed; the rest are not returned."""
        if not self.usable or not paths:
            return {}
        import sqlite3

        paths = [p for p in paths if _storable(p)]
        try:
            with self._lock:
                return self._get(paths, key, identities)
        except sqlite3.Error as e:
            self._give_up(e)
            return {}

    def _get(self, paths: list[str], key: str, identities: dict[str, str]) -> dict[str, Cached]:
        import numpy as np

        out: dict[str, Cached] = {}
        cur = self._conn.cursor()
        for i in range(0, len(paths), 500):
            chunk = paths[i:i + 500]
            q = (f"SELECT path, identity, changed_ns, read_ns, row, kind, tokens, model FROM files "
                 f"WHERE key = ? AND path IN ({','.join('?' * len(chunk))})")
            for path, ident, changed, read, row, kind, tokens, model in cur.execute(q, (key, *chunk)):
                if ident != identities.get(path) or not isinstance(read, int) or not isinstance(changed, int) \
                        or read - changed < _RACY_NS:
                    continue
                try:        # a row a damaged index holds is no row: its file is read again
                    out[path] = Cached(json.loads(row) if row is not None else None, kind,
                                       np.frombuffer(tokens, dtype="<i4") if tokens is not None else None, model)
                except (ValueError, TypeError):
                    continue
        return out

    def rows(self, key: str) -> dict[str, tuple[str, int, int, str]]:
        """Every row of the index for ``key`` (one ``SELECT``): path -> (identity, changed_ns, read_ns, ls's
        row as JSON text); the caller checks each identity (:class:`Known`)."""
        return self._select("SELECT path, identity, changed_ns, read_ns, row FROM files WHERE key = ? "
                            "AND row IS NOT NULL", (key,))

    def heads(self) -> dict[str, tuple[str, int, int, bytes]]:
        """Every file's first bytes (one ``SELECT``): path -> (identity, changed_ns, read_ns, head)."""
        return self._select("SELECT path, identity, changed_ns, read_ns, head FROM heads", ())

    def _select(self, query: str, args: tuple) -> dict:
        if not self.usable:
            return {}
        import sqlite3

        try:
            with self._lock:
                return {r[0]: r[1:] for r in self._conn.execute(query, args)}
        except sqlite3.Error as e:
            self._give_up(e)
            return {}

    def _write(self, *batches: tuple[str, list]) -> None:
        """Each (statement, rows) executed for its rows, all in one transaction; any SQLite error makes the
        index unusable for this process."""
        import sqlite3

        try:
            with self._lock, self._conn:
                self._conn.execute("BEGIN IMMEDIATE")
                for statement, rows in batches:
                    self._conn.executemany(statement, rows)
        except sqlite3.Error as e:
            self._give_up(e)

    def put_heads(self, items: list[tuple[str, str, int, bytes]], *, read_ns: int | None = None) -> None:
        """First bytes read now (``read_ns``: when the identities were taken, before the reads): (path,
        identity, changed_ns, head) each, in one transaction."""
        if not self.usable or not items:
            return
        now = time.time_ns() if read_ns is None else read_ns
        self._write(("INSERT OR REPLACE INTO heads VALUES (?, ?, ?, ?, ?)",
                     [(path, ident, changed, now, head) for path, ident, changed, head in items if _storable(path)]))

    def put(self, key: str, items: list[tuple[str, str, int, Cached]], *, read_ns: int | None = None) -> None:
        """Rows made now (``read_ns``: when the identities were taken, before the reads; default now): (path,
        identity, changed_ns, Cached) each, in one transaction."""
        if not self.usable or not items:
            return
        now = time.time_ns() if read_ns is None else read_ns

        def tokens(c: Cached):
            import numpy as np

            return np.asarray(c.tokens, dtype="<i4").tobytes()

        self._write(("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     [(path, key, ident, changed, now, json.dumps(c.row) if c.row is not None else None, c.kind,
                       len(c.tokens) if c.tokens is not None else None,
                       tokens(c) if c.tokens is not None else None, c.model)
                      for path, ident, changed, c in items if _storable(path)]))

    def verdict(self, path: str, key: str, identity: str) -> dict | None:
        """The verdict kept for ``path`` under the question ``key`` (:func:`verdict_key`) while its identity is
        still ``identity`` and the row was made long enough after the file last changed (:meth:`get`): the dict
        :meth:`put_verdict` kept; None otherwise (not kept, the file changed, the row racy or not a dict). What
        the dict holds is its writer's to check: a damaged index may hold anything."""
        got = self.get([path], key, {path: identity}).get(path)
        return got.row if got is not None and isinstance(got.row, dict) else None

    def put_verdict(self, path: str, key: str, identity: str, changed_ns: int, verdict: dict, *,
                    read_ns: int, model: str | None = None) -> None:
        """``verdict`` (a dict of JSON values) kept for ``path`` under ``key`` at ``identity``; ``read_ns``: when
        the identity was taken, before the bytes the verdict was made on were read (so a file changed during the
        read, within its mtime's granularity, is never trusted: :data:`RACY_SECONDS`)."""
        self.put(key, [(path, identity, changed_ns, Cached(verdict, None, None, model))], read_ns=read_ns)

    def forget(self, paths: list[str]) -> None:
        if not self.usable or not paths:
            return
        gone = [(p,) for p in paths if _storable(p)]
        self._write(("DELETE FROM files WHERE path = ?", gone), ("DELETE FROM heads WHERE path = ?", gone))


def _storable(path: str) -> bool:
    """Whether the index can hold ``path``: a name whose bytes are not UTF-8 (decoded with surrogate escapes)
    is no SQLite text; such a file is read every time, never cached."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Stale(Exception):
    pass
