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
    """
    import shutil
    import tempfile   # here: tempfile (random, hashlib) and shutil cost every command's start-up

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
                shutil.copyfileobj(src, f, 1 << 20)
        yield tmp
    finally:
        os.unlink(tmp)


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
    with os.scandir(p) as it:
        return sorted(e.name for e in it if _is_file(e, follow_symlinks) and not is_temp_file(e.name))


def _is_file(e: os.DirEntry, follow_symlinks: bool) -> bool:
    try:
        return e.is_file(follow_symlinks=follow_symlinks)
    except OSError:       # ELOOP, EACCES, ENAMETOOLONG on the link's target: not a file this command can read
        return False
