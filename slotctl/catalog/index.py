"""The catalog's index on disk: what reading each file found, kept so that a file whose identity has not
changed is not read again (SQLite, WAL: several processes share it).

Per file (and per question asked of it: ``key``) its identity (a local file's device, inode, size, mtime_ns and
ctime_ns; an object's key and ETag), when it was read, the row ls prints, its tokens (for serve's prefix
lookups), its memory kind and the model fingerprint it was stored under; and per file its first bytes (whether
it is a slot file). Where an index lives (:func:`index_path`), the identities (:func:`local_identity`,
:func:`object_identity`), the index itself (:class:`Index`) and files deleted leaving it (:func:`forget`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

from slotctl.paths import CATALOG_FILE
from slotctl.sources import remote_url

#: the index's layout; an index of another version (or another slotctl version) is rebuilt, never read
INDEX_VERSION = 2
#: the index of a store directory, beside its files (when the directory is writable); ls does not count it
INDEX_NAME = CATALOG_FILE
#: a row read less than this long after its file last changed is not trusted (a file may still change
#: within its mtime's granularity): the file is read again
RACY_SECONDS = 3.0
#: how long a process waits for another's transaction before going on without the index
BUSY_SECONDS = 2.0
#: the environment variable that sets another rule than :data:`RACY_SECONDS` (seconds, >= 0): the tests' way
#: to trust a row of an object just put, whose Last-Modified (the row's "changed") is when it was put
RACY_ENV = "SLOTCTL_RACY_SECONDS"


def racy_ns() -> int:
    """The racy rule in nanoseconds, as the index's times are kept: :data:`RACY_SECONDS`, or ``$SLOTCTL_RACY_SECONDS``
    when it is a number >= 0."""
    try:
        seconds = float(os.environ.get(RACY_ENV, RACY_SECONDS))
    except ValueError:
        seconds = RACY_SECONDS
    return int((seconds if seconds >= 0 else RACY_SECONDS) * 1e9)

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

        paths = [p for p in paths if storable(p)]
        try:
            with self._lock:
                return self._get(paths, key, identities)
        except sqlite3.Error as e:
            self._give_up(e)
            return {}

    def _get(self, paths: list[str], key: str, identities: dict[str, str]) -> dict[str, Cached]:
        import numpy as np

        out: dict[str, Cached] = {}
        racy = racy_ns()
        cur = self._conn.cursor()
        for i in range(0, len(paths), 500):
            chunk = paths[i:i + 500]
            q = (f"SELECT path, identity, changed_ns, read_ns, row, kind, tokens, model FROM files "
                 f"WHERE key = ? AND path IN ({','.join('?' * len(chunk))})")
            for path, ident, changed, read, row, kind, tokens, model in cur.execute(q, (key, *chunk)):
                if ident != identities.get(path) or not isinstance(read, int) or not isinstance(changed, int) \
                        or read - changed < racy:
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
                     [(path, ident, changed, now, head) for path, ident, changed, head in items if storable(path)]))

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
                      for path, ident, changed, c in items if storable(path)]))

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
        gone = [(p,) for p in paths if storable(p)]
        self._write(("DELETE FROM files WHERE path = ?", gone), ("DELETE FROM heads WHERE path = ?", gone))


def storable(path: str) -> bool:
    """Whether the index can hold ``path``: a name whose bytes are not UTF-8 (decoded with surrogate escapes)
    is no SQLite text; such a file is read every time, never cached."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Stale(Exception):
    pass


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
