"""The catalog: one metadata row per slot file with validate's verdict, for whole directories and prefixes
(``slotctl ls``, ``slotctl prune``), and the index on disk of what reading each file found.

- ``rows``: a row made by reading a file (in a process pool when the files are many), and the question it
  answers (:func:`request_key`; keep's and serve's verdicts: :func:`verdict_key`);
- ``known``: what the index knows of the files a command lists, looked up once per directory or prefix
  (:class:`Known`);
- ``classes``: a row's class, for the selections of ``ls`` and ``prune`` (:func:`is_broken`, ...);
- ``index``: the index itself (SQLite, WAL: :class:`Index`), where it lives and the files' identities.

:func:`catalog` gives a row per path: from the index when the file's identity has not changed, else made.
The names below are the package's public face: its users import them from here.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

from slotctl.catalog.classes import broken_verdicts, is_broken, is_mismatched, is_undecided, is_useless
from slotctl.catalog.index import (INDEX_NAME, RACY_SECONDS, Cached, Index, cache_home, forget, index_path,
                                   local_identity, object_identity)
from slotctl.catalog.known import Known
from slotctl.catalog.rows import CUT_SHORT, Request, iso_time, made_rows, request_key, verdict_key

__all__ = [
    "CUT_SHORT", "INDEX_NAME", "RACY_SECONDS", "Cached", "Index", "Known", "Request", "broken_verdicts",
    "cache_home", "catalog", "forget", "index_path", "is_broken", "is_mismatched", "is_undecided", "is_useless",
    "iso_time", "local_identity", "object_identity", "request_key", "verdict_key",
]


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
        yield from made_rows(paths, request, processes, now)
        return
    known = known if known is not None else Known(request)
    try:
        cached = {}
        for p in paths:
            row = known.row(p, now)
            if row is not None:
                cached[p] = row
        misses = [p for p in paths if p not in cached]
        made = iter(made_rows(misses, request, processes, now))
        for p in paths:
            row = cached.get(p)
            if row is None:
                row = next(made)
                known.made(p, row)
            yield row
        known.flush()
    finally:
        known.close()
