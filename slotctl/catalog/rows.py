"""One metadata row per slot file, made by reading it (``slotctl ls``, ``slotctl prune``), and the question it
answers.

A row says what a file is (size, times, state version, tokens, memory kind, checkpoints, the bytes of
draft state) and what a server does with it (``verdict``, from :func:`slotctl.validate.validate_file`:
the structure and the server's rules always; with models, the prediction; with a load checker, the real
check). Each file is parsed once and only its metadata is read: tensor bytes are seeked over, never read.

Rows are plain dicts with the keys of docs/json.md (``ls``), so that they cross process boundaries:
:func:`made_rows` spreads the files over a process pool when there are enough of them to pay for it,
and yields rows in the order of the paths, one at a time (memory stays flat in the number of files).
What a row depends on besides its file is its question (:func:`request_key`); a verdict kept for keep or
serve has one too (:func:`verdict_key`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterator

from slotctl.catalog.classes import broken_verdicts
from slotctl.catalog.index import local_identity
from slotctl.errors import ExitStatus
from slotctl.sources import remote_url

#: what prune reports for an ``undecided`` file whose payload no layout fits: the server refuses it or aborts
CUT_SHORT = "undecided: cut short (refused or aborts)"
#: the rows' and verdicts' format: a row or verdict kept in a catalog under another is not read (made again)
#: (2: rows say their ``build``; verdicts say ``other_model`` and ``corrupt``, stored states' names carry the
#: model's content identity)
ROW_FORMAT = "2"
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
        "build": report.build,
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
            "draft_size": 0, "damaged": False, "verdict": "unreadable", "build": None, "certain": True,
            "uncertain": [], "reuse": None,
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

def request_key(request: Request) -> str:
    """What a row depends on besides its file: the server it was judged for (the models named by their
    identity, not only their paths), whether the real check ran, and slotctl's version."""
    import hashlib

    from slotctl import __version__

    parts = [__version__, ROW_FORMAT, repr(request.setup), str(request.real_check)]
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


def made_rows(paths: list[str], request: Request, processes: int | None, now: float) -> Iterator[dict]:
    """A row per path, in order, each made by reading its file: in worker processes (:func:`_rows`), or in
    threads when some are objects in a store (:func:`_remote_rows`)."""
    if any(remote_url(p) for p in paths):
        return _remote_rows(paths, request, now)
    return _rows(paths, request, processes, now)


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
