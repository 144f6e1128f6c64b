"""The going of a prune (:func:`execute`): only what was checked is deleted.

Each file is renamed to a private name (:mod:`slotctl.prune.aside`), checked again there and only then unlinked,
so that a file a server saves over it (in place or by a rename) meanwhile is never the one deleted. A file
that changed since it was planned is put back and left alone; a process killed at any moment leaves every
file as it was, gone, or under its private name, which the next prune puts back. An object is checked by a
HEAD just before its DELETE (:func:`delete_object_checked`).
"""

from __future__ import annotations

import os
import stat
import time
from typing import Callable

from slotctl.errors import error_entry
from slotctl.paths import being_written
from slotctl.prune.aside import drop_note, set_aside
from slotctl.prune.plan import DELETE, FAILED, SKIPPED, WOULD_DELETE, Entry, Plan


def execute(p: Plan, *, dry_run: bool, now_fn: Callable[[], float] = time.time,
            on_file: Callable[[Entry], None] | None = None, index: bool = True) -> Plan:
    """Delete the selected files (``dry_run``: mark them ``would_delete``), each checked again first
    (:func:`delete_checked`); ``index``: the files deleted leave the catalog (:func:`slotctl.catalog.forget`)."""
    from slotctl.sources import remote_url

    remote = remote_url(p.directory) is not None
    for e in p.selected():
        if dry_run:
            e.action = WOULD_DELETE
        elif remote:
            delete_object_checked(e)
        else:
            delete_checked(e, p.policy.grace, now_fn)
        if on_file:
            on_file(e)
    if not dry_run and not remote and any(e.action == DELETE for e in p.entries):
        from slotctl.atomic import fsync_dir

        fsync_dir(p.directory)
    if index and not dry_run and any(e.action == DELETE for e in p.entries):
        from slotctl.catalog import forget

        forget([e.path for e in p.entries if e.action == DELETE])
    return p



def delete_checked(e: Entry, grace: float, now_fn: Callable[[], float] = time.time) -> None:
    """Delete ``e.path`` only if it is still the file planned (inode, size, modification time) and still
    older than ``grace`` seconds, in steps the filesystem makes atomic.

    1. ``rename`` it to a private name in the same directory: from then on a writer that opens the name
       creates a new file there, and one that renames a file onto the name puts a new file there; neither
       touches the file set aside.
    2. Check the file set aside: its identity and age (a writer that opened it before the rename has
       changed its modification time when it truncated or wrote it).
    3. ``unlink`` it; or, when it changed, put it back with ``link`` (which never replaces a file a writer
       made under the name meanwhile) and remove the private name.

    A check and an unlink of the same name, in two steps, would delete whatever a writer had put there in
    between. A process killed between 1 and 3 leaves the file under its private name, which the next
    prune of the directory puts back (:func:`slotctl.prune.aside.restore_set_aside`).
    """
    try:
        aside = set_aside(e.path)
    except FileNotFoundError:
        e.action, e.reason = SKIPPED, "gone before it was deleted"
        return
    except OSError as err:
        e.action, e.error = FAILED, error_entry(err, e.path).message
        return
    fd = None
    try:
        fd = os.open(aside, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        held = _lease(fd)
        st = os.fstat(fd)
        changed = (st.st_ino, st.st_size, st.st_mtime) != (e.ino, e.size, e.mtime) or not stat.S_ISREG(st.st_mode)
        busy = being_written(st, grace, now_fn())
        if held is False:
            busy = "open in another process (being written or read?)"
        if not changed and not busy:
            os.unlink(aside)
            drop_note(aside)
            return
    except OSError as err:
        _put_back(e, aside)
        if e.action != FAILED:
            e.action, e.error = FAILED, error_entry(err, e.path).message
        return
    finally:
        if fd is not None:
            os.close(fd)    # closing the descriptor releases the lease
    _put_back(e, aside)
    if e.action != FAILED:
        e.action, e.reason = SKIPPED, busy if busy and not changed else "changed since it was planned (being written?)"


def _lease(fd: int) -> bool | None:
    """A write lease on the open file ``fd`` (``fcntl(F_SETLEASE, F_WRLCK)``), which the kernel grants only
    when no other descriptor of the file is open anywhere: True when held (no writer can still be writing
    into the file set aside), False when another process has it open, None where the filesystem has no
    leases (NFS, some FUSE mounts: the identity check alone decides there). SIGIO, which a lease break
    would send, is ignored: nothing else knows the private name, and the lease lasts one ``fstat``."""
    import errno
    import fcntl
    import signal

    try:
        signal.signal(signal.SIGIO, signal.SIG_IGN)
    except (ValueError, OSError):   # not the main thread: a break (never expected) would be the default action
        pass
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EBUSY):
            return False
        return None
    return True


def delete_object_checked(e: Entry) -> None:
    """Delete the object ``e.path`` only if it is still the one planned (its ETag and size, by a HEAD just
    before the DELETE). A store has no rename to set an object aside, and no conditional DELETE through
    obstore: an object written under the same key between the HEAD and the DELETE (milliseconds) would be
    deleted; a bucket with versioning keeps it as a version (docs/store.md, prune). An object already gone
    (another host pruning the same prefix) is skipped, not an error."""
    from slotctl.errors import SlotctlError, StoreDown
    from slotctl.sources import store_for

    store = store_for(e.path)
    try:
        now = store.stat(e.path)
        if now is None:
            e.action, e.reason = SKIPPED, "gone before it was deleted (another prune?)"
            return
        if (now.etag, now.size) != (e.etag, e.size):
            e.action, e.reason = SKIPPED, "changed since it was planned (written again?)"
            return
        store.delete(e.path)
    except StoreDown:       # the store stopped answering: the run stops, not object after object
        raise
    except SlotctlError as err:
        e.action, e.error = FAILED, str(err)


def _put_back(e: Entry, aside: str) -> None:
    """The file set aside at ``aside`` back under ``e.path``, without replacing a file made there since."""
    try:
        os.link(aside, e.path)
    except FileExistsError:
        e.action, e.error = FAILED, (f"{e.path}: changed while it was being deleted, and a new file took its "
                                     f"name meanwhile; the older one is kept as {aside}")
        return
    except OSError:
        try:
            os.rename(aside, e.path)   # no hard links here: a rename onto the (still free) name
        except OSError as err:
            e.action, e.error = FAILED, f"{e.path}: could not be put back, kept as {aside}: {err.strerror or err}"
            return
        drop_note(aside)
        return
    os.unlink(aside)
    drop_note(aside)
