"""The store held under its budget and the slot directory kept clean of what processes left: :func:`prune`,
:func:`sweep` (at start: what processes that are gone left), :func:`sweep_own` (at exit: this process's own).

Its one reason to change: what is deleted without anyone asking, and when (the budget's rules, the age and the
liveness a leftover is judged by).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from slotctl.keeping import names

#: seconds a working file left by a process of another machine (or named by the previous release, without its
#: machine's tag) stays untouched before keep or serve removes it at its start: a process of this machine that
#: is gone leaves its own removed at once (:func:`sweep`)
ORPHAN_AGE = 3600.0


def prune(store, on_file: Callable[[str, int, str, str], None], *, max_size: int | None = None,
          retention: int | None = None, slot: int | None = None,
          candidates: Callable[[int], list[str]] | None = None) -> None:
    """``store`` held under its budget: with ``retention``, ``slot``'s states past its newest ``retention``
    (``candidates(slot)``: its states, newest first) deleted; with ``max_size``, prune's rules (least recently
    used first; every process's working files pinned). ``on_file(path, size, action, reason)`` for each file
    deleted."""
    if retention is not None and slot is not None:
        for name in candidates(slot)[retention:]:
            size = store.delete(name)
            on_file(store.where(name), size, "deleted", f"older than the newest {retention} of slot {slot}")
    if max_size is not None:
        store.prune(max_size, names.WORK_GLOBS, on_file)


def sweep(slot_dir: Path, store, role: str, on_file: Callable[[Path, int, int], None], *,
          age: float = ORPHAN_AGE, now: float | None = None) -> None:
    """What the processes of ``role`` that are gone (killed: SIGKILL leaves no way to clean up) left in
    ``slot_dir`` removed (:func:`slotctl.keeping.names.leftover`: working files, their atomic writes' temporary
    files, staging directories): at once when the name says the process ran on this machine and its pid is no
    process here; a name of another machine (or of the previous release, without its machine's tag) only once
    untouched for ``age`` seconds (and, without a tag, its pid no process here). ``store``'s own temporary
    files untouched for ``age`` seconds too (a directory store: another keep or serve may be writing one).
    ``on_file(path, pid, size)`` for each (pid 0: the store's)."""
    import shutil

    now = time.time() if now is None else now
    here = names.host_tag()
    try:
        entries = list(os.scandir(slot_dir))
    except OSError:
        entries = []
    for e in entries:
        left = names.leftover(e.name)
        if left is None or left.role != role or (left.pid == os.getpid() and left.host in (here, None)):
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
    sweep_temps = getattr(store, "sweep_temps", None)
    if sweep_temps is not None:
        sweep_temps(age, now, lambda p, size: on_file(p, 0, size))


def sweep_own(slot_dir: Path, role: str, on_file: Callable[[Path, int], None]) -> None:
    """This process's own working files (of ``role``) still in ``slot_dir`` removed (at exit: one a save it
    stopped waiting for left, written by the server after); ``on_file(path, size)`` for each."""
    for p in slot_dir.glob(names.own_works(role)):
        if names.work_owner(p.name) != (role, os.getpid()):
            continue
        try:
            size = p.stat().st_size
            p.unlink()
        except OSError:
            continue
        on_file(p, size)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process of this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
