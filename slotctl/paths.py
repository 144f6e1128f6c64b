"""What a command may open, and expanding the FILE... arguments of commands that take many files.

:func:`check_readable` is the one check of a path every command reads (slot files, ``-m``/``-md``
models, ``restore``'s inputs): a regular file, or a usage error in one line. FIFOs, character and block
devices and sockets are refused before they are opened (reading a FIFO blocks until a writer comes;
reading ``/dev/zero`` never ends), and a symbolic link loop is named as one. :func:`open_regular` opens
without blocking and checks what it opened, so a path swapped for a FIFO after the check cannot hang it,
and without updating the file's access time where the system allows it.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from contextlib import contextmanager
from typing import BinaryIO, Callable, Iterator

from slotctl.errors import UsageError

#: the name of the catalog slotctl keeps beside a directory's slot files (``slotctl.catalog.Index``) and its
#: ``-wal`` and ``-shm``: no command counts them among the directory's files
CATALOG_FILE = ".slotctl-catalog.sqlite"


def cache_home() -> str:
    """slotctl's cache directory: ``$SLOTCTL_CACHE_DIR``, else ``$XDG_CACHE_HOME/slotctl``, else
    ``~/.cache/slotctl`` (the catalogs of what ls only reads, the models' digests: :mod:`slotctl.model.content`)."""
    if os.environ.get("SLOTCTL_CACHE_DIR"):
        return os.path.expanduser(os.environ["SLOTCTL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "slotctl")


#: seconds since the last modification under which a file counts as being written (``prune``,
#: ``strip-draft``: a server saving a slot writes the file from its start to its end)
DEFAULT_GRACE = 60.0


def being_written(st: os.stat_result, grace: float, now: float) -> str | None:
    """Why the file of ``st`` may still be being written (modified less than ``grace`` seconds before
    ``now``, or stamped in the future), or None. The one rule of ``prune`` and ``strip-draft``."""
    age = now - st.st_mtime
    if age < grace:
        return f"modified {max(0.0, age):.0f} s ago, within --grace {grace:g} s (being written?)"
    return None


def is_temp_file(name: str) -> bool:
    """Whether ``name`` is a temporary file of :func:`~slotctl.atomic.atomic_writer` (``.NAME.slotctl-*.tmp``)."""
    return name.startswith(".") and ".slotctl-" in name and name.endswith(".tmp")


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def stat_error(p: str, e: OSError, what: str = "") -> UsageError:
    """The one-line usage error for a path that cannot be stat'ed or opened."""
    reason = {errno.ENOENT: "no such file or directory", errno.ELOOP: "too many levels of symbolic links",
              errno.EACCES: "permission denied", errno.ENOTDIR: "not a directory (a component of the path)",
              errno.ENAMETOOLONG: "file name too long"}.get(e.errno, e.strerror or str(e))
    code = {errno.ENOENT: "no_such_file", errno.EACCES: "permission_denied"}.get(e.errno, "unreadable")
    return UsageError(f"{what}{p}: {reason}", code=code)


def check_readable(path: str | os.PathLike, *, what: str = "") -> os.stat_result:
    """The stat of ``path`` when it is a regular file this process may read; else a one-line UsageError.

    ``what`` prefixes the message ("model " gives "model x.gguf: a FIFO, not a regular file").
    """
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise stat_error(p, e, what) from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{what}{p}: is a directory", code="is_a_directory")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what}{p}: {_kind(st.st_mode)}, not a regular file", code="not_a_regular_file")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{what}{p}: permission denied", code="permission_denied")
    return st


def open_regular(path: str | os.PathLike, *, what: str = "") -> BinaryIO:
    """``path`` opened for reading (binary, buffered), refused unless it is a regular file.

    Opened with ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a writer) and checked with
    ``fstat`` on what was opened, so the check and the read concern the same file.
    """
    p = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = _open_noatime(p, flags)
    except OSError as e:
        raise stat_error(p, e, what) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UsageError(f"{what}{p}: is a directory", code="is_a_directory")
        if not stat.S_ISREG(mode):
            raise UsageError(f"{what}{p}: {_kind(mode)}, not a regular file", code="not_a_regular_file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int, *, what: str = "") -> bytes:
    """The whole of the small file ``path`` (``--server-args @FILE``), refused in one line unless it is a
    regular file of at most ``limit`` bytes: opened without blocking (:func:`open_regular`: a FIFO or
    ``/dev/zero`` is refused before a byte is read), its size checked before it is read, and never more
    than ``limit`` + 1 bytes read (a file that grows while it is read is refused too)."""
    with open_regular(path, what=what) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise UsageError(f"{what}{os.fspath(path)}: {max(size, len(data)):,} bytes, more than the "
                         f"{limit:,} this takes", code="too_large")
    return data


def _open_noatime(p: str, flags: int) -> int:
    """``os.open`` without updating the access time where the system allows it: slotctl's reads are not
    uses of a file (``prune`` orders files by when a server last read them). ``O_NOATIME`` is refused
    for files of other owners; those are opened normally."""
    noatime = getattr(os, "O_NOATIME", 0)
    if noatime:
        try:
            return os.open(p, flags | noatime)
        except PermissionError:
            pass
    return os.open(p, flags)


STDIN = "-"


@contextmanager
def stdin_copy(head: tuple[int, Callable[[bytes], bool]] | None = None) -> Iterator[str]:
    """Standard input copied to a temporary file, for ``-`` (a slot file is read with seeks); removed after.

    ``head``: ``(n, ok)``: the first ``n`` bytes are read first, and the rest only when ``ok(first bytes)``;
    else the copy holds those bytes alone (the parse then says what they are), and standard input is
    read no further: a model or any other stream piped in by mistake costs ``n`` bytes, not its length.

    The copy is bounded (:func:`stdin_limit`: past it, a one-line ``too_large`` error, exit 2) and removed
    on every way out: the end of the block, an error, Ctrl-C (SIGINT), and SIGTERM or SIGHUP, which raise
    :class:`~slotctl.errors.Terminated` while the copy exists (exit 143 or 129) where they would kill the
    process and leave it behind.
    """
    import tempfile   # here: tempfile (random, hashlib) and shutil cost every command's start-up

    limit = stdin_limit()
    with _terminating():
        fd, tmp = tempfile.mkstemp(prefix="slotctl-stdin-", suffix=".bin")
        try:
            with os.fdopen(fd, "wb") as f:
                src = sys.stdin.buffer
                if head is not None:
                    first = _read_up_to(src, head[0])
                    f.write(first)
                    if not head[1](first):
                        src = None
                if src is not None:
                    done = f.tell()
                    while True:
                        chunk = src.read(1 << 20)
                        if not chunk:
                            break
                        done += len(chunk)
                        if done > limit:
                            raise UsageError(f"standard input: more than {limit:,} bytes, the most spooled "
                                             f"for - (SLOTCTL_STDIN_MAX, leaving 1 GiB of the temporary "
                                             f"directory free): give the file's path instead", code="too_large")
                        f.write(chunk)
            yield tmp
        finally:
            os.unlink(tmp)


#: the most bytes of standard input spooled for ``-`` by default (``SLOTCTL_STDIN_MAX`` replaces it)
STDIN_MAX_BYTES = 64 << 30
#: bytes of the temporary directory's file system the spool leaves free
STDIN_KEEP_FREE = 1 << 30


def stdin_limit() -> int:
    """The most bytes of standard input spooled: ``SLOTCTL_STDIN_MAX`` (bytes) or :data:`STDIN_MAX_BYTES`,
    and never so much that less than :data:`STDIN_KEEP_FREE` of the temporary directory's file system
    would be left."""
    import tempfile

    value = os.environ.get("SLOTCTL_STDIN_MAX", "")
    if value:
        if not value.isdigit() or len(value) > 20:
            raise UsageError(f"SLOTCTL_STDIN_MAX={value[:40]}: expected a number of bytes")
        limit = int(value)
    else:
        limit = STDIN_MAX_BYTES
    try:
        st = os.statvfs(tempfile.gettempdir())
        limit = min(limit, max(0, st.f_bavail * st.f_frsize - STDIN_KEEP_FREE))
    except OSError:
        pass
    return limit


@contextmanager
def _terminating() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`~slotctl.errors.Terminated` for the time of the block (where the
    process has their default action, in the main thread), so that cleanup runs; the handlers are put back."""
    import signal
    import threading

    from slotctl.errors import Terminated

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    old = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _read_up_to(src: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes of ``src`` (fewer only at its end: a pipe returns what it has)."""
    parts, got = [], 0
    while got < n:
        b = src.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def directory_files(p: str, follow_symlinks: bool) -> list[str]:
    """The names of the regular files directly in directory ``p``, sorted, without slotctl's temporary files;
    symbolic links only with ``follow_symlinks``. An entry that cannot be stat'ed (a symbolic link loop:
    ``ELOOP``; one whose target is gone or denied) is passed over as a dangling link is: it is no file to read,
    and it does not stop the others."""
    return [e.name for e in directory_entries(p, follow_symlinks)]


def directory_entries(p: str, follow_symlinks: bool) -> list[os.DirEntry]:
    """:func:`directory_files` as the ``os.DirEntry`` of each (sorted by name): whether each is a symbolic
    link, and its stat once asked, cost no second look-up."""
    with os.scandir(p) as it:
        return sorted((e for e in it if _is_file(e, follow_symlinks) and not is_temp_file(e.name)),
                      key=lambda e: e.name)


def _is_file(e: os.DirEntry, follow_symlinks: bool) -> bool:
    try:
        return e.is_file(follow_symlinks=follow_symlinks)
    except OSError:       # ELOOP, EACCES, ENAMETOOLONG on the link's target: not a file this command can read
        return False
