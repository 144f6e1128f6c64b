"""What the catalog knows of the files a command lists (:class:`Known`): their rows and first bytes, looked
up once per directory or prefix in its index (:mod:`slotctl.catalog.index`)."""

from __future__ import annotations

import json
import os
import time
from stat import S_ISREG

from slotctl.catalog.index import Cached, Index, index_path, local_identity, object_identity, racy_ns, storable
from slotctl.catalog.rows import Request, iso_time, request_key
from slotctl.errors import ExitStatus
from slotctl.paths import STDIN
from slotctl.sources import remote_url


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
        #: the racy rule (:func:`slotctl.catalog.index.racy_ns`), read once
        self.racy_ns = racy_ns()
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
            if e is not None and e.etag and storable(url):
                changed = int(e.mtime * 1e9)
                got = (self._place(url.rpartition("/")[0] + "/"), url, object_identity(e.etag, e.size, changed),
                       changed)
        else:
            st = self._stat(p)
            if st is not None and storable(p):
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
        if entry is None or entry[0] != ident or entry[2] - entry[1] < self.racy_ns:
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
