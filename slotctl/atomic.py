"""Atomic file writes: a temporary file in the same directory, fsync, rename.

An interrupted write (an error, Ctrl-C, a kill) leaves the destination as it was: either the old file
or, once the rename happened, the complete new one. A killed process may leave its temporary file
(``.NAME.slotctl-*.tmp``) behind, never a half-written destination.

What a write may replace (:func:`check_destination`): nothing, or a regular file. A directory, a device
node, a FIFO or a socket is refused (renaming over ``/dev/null`` would replace it); a symbolic link is
refused unless the caller follows it explicitly, and then its target is what is replaced. A regular
file is replaced only by a process that may write it (the check ``open(O_WRONLY)`` makes, as a truncate
in place would), and keeps its mode, owner and group: when the owner cannot be kept the write is refused.
Errors name the destination, never the temporary file.
"""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from slotctl.errors import UsageError

#: chunk size for streamed copies
COPY_CHUNK = 8 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


#: the longest name of a directory entry, in bytes (Linux's NAME_MAX, and most filesystems' own limit)
NAME_MAX = 255
#: hex digits of the hash that stands for the cut part of a long name
_HASH_DIGITS = 16


def private_name(name: str, tag: str) -> str:
    """The private name slotctl gives a file of its own beside the file ``name``: ``.NAME.slotctl-TAG.tmp``
    (the form listings skip, :func:`slotctl.paths.is_temp_file`), never longer than :data:`NAME_MAX` bytes.

    A name of 231-255 bytes (a server saves whatever name a client sends) would pass the limit once the
    marks are added ("File name too long"): then NAME is cut, at a character boundary, and followed by
    ``~`` and 16 hex digits of the SHA-256 of the whole name, so two long names that share their first
    bytes still get names of their own. The one rule of every private name: atomic writes' temporary files,
    ``prune``'s files set aside, an object store's temporary keys."""
    tail = f".slotctl-{tag}.tmp"
    whole = f".{name}{tail}"
    raw = os.fsencode(whole)
    if len(raw) <= NAME_MAX:
        return whole
    import hashlib   # here: only long names pay for it

    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:_HASH_DIGITS]
    room = NAME_MAX - len(os.fsencode(tail)) - 2 - _HASH_DIGITS     # the leading "." and the "~"
    cut = os.fsencode(name)[:max(0, room)]
    while cut and (cut[-1] & 0xC0) == 0x80:     # a UTF-8 character cut in its middle: drop its pieces
        cut = cut[:-1]
    if cut and cut[-1] >= 0xC0:
        cut = cut[:-1]
    return f".{os.fsdecode(cut)}~{digest}{tail}"


def check_destination(path: str | os.PathLike, *, overwrite: bool, follow_symlinks: bool = False,
                      option: str = "--force") -> str:
    """The path a write to ``path`` replaces (its target when it is a followed symbolic link), or a
    one-line UsageError: its directory missing, something other than a regular file there, an existing
    file without ``overwrite`` (``option`` names the flag that allows it), a symbolic link without
    ``follow_symlinks``."""
    path = os.fspath(path)
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        lst = None
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None
    if lst is not None and stat.S_ISLNK(lst.st_mode):
        if not follow_symlinks:
            raise UsageError(f"{path}: a symbolic link (to {os.readlink(path)}); --follow-symlinks writes the file "
                             f"it points to, or remove the link", code="not_a_regular_file")
        target = os.path.realpath(path)
        return check_destination(target, overwrite=overwrite, option=option) if target != path else target
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{directory}: no such directory", code="no_such_file")
    if lst is None:
        return path
    if not stat.S_ISREG(lst.st_mode):
        raise UsageError(f"{path}: {_kind(lst.st_mode)}; only a regular file is ever replaced",
                         code="is_a_directory" if stat.S_ISDIR(lst.st_mode) else "not_a_regular_file")
    if not overwrite:
        raise UsageError(f"{path}: exists (use {option} to overwrite)", code="exists")
    _check_writable(path)
    return path


def _check_writable(path: str) -> None:
    """UsageError unless this process may write the regular file ``path`` (opened, never truncated)."""
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except PermissionError:
        raise UsageError(f"{path}: permission denied (this user may not write it, so it is not replaced either)",
                         code="permission_denied") from None
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{path}: {_kind(os.fstat(fd).st_mode)}; only a regular file is ever replaced",
                             code="not_a_regular_file")
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: str | os.PathLike, *, overwrite: bool = False,
                  follow_symlinks: bool = False) -> Iterator[BinaryIO]:
    """Yield a file to write; on a clean exit it replaces ``path`` atomically.

    ``path`` is checked by :func:`check_destination` before the temporary file is made and again just
    before the rename (a FIFO or a symbolic link put there meanwhile is not replaced). Without
    ``overwrite`` an existing ``path`` is a usage error. An I/O error names ``path`` (a full disk, a
    refused rename), never the temporary file.
    """
    path = check_destination(path, overwrite=overwrite, follow_symlinks=follow_symlinks)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = make_private(directory, os.path.basename(path))
    except OSError as e:
        raise _named(e, path, "cannot create a temporary file beside it") from None
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                yield f
                f.flush()
                os.fsync(f.fileno())
                check_destination(path, overwrite=overwrite)
                _keep_metadata(path, f.fileno())
            except OSError as e:
                if e.errno is None or e.filename not in (None, tmp):
                    raise   # not the write's own error (the source ended early, ...)
                raise _named(e, path) from None
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise _named(e, path, "cannot rename the new file over it") from None
        fsync_dir(directory)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def make_private(directory: str, name: str) -> tuple[int, str]:
    """A new file (mode 0600, opened for writing) under a private name beside ``name`` in ``directory``
    (:func:`private_name` with a random tag: ``.NAME.slotctl-RANDOM.tmp``, at most 255 bytes
    whatever the length of ``name``): its descriptor and path."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.path.join(directory, private_name(name, os.urandom(4).hex()))
        try:
            return os.open(tmp, flags, 0o600), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", os.path.join(directory, name))


def _named(e: OSError, path: str, doing: str = "") -> OSError:
    """``e`` naming ``path`` (with what was being done) instead of a temporary file or nothing."""
    reason = e.strerror or str(e)
    return OSError(e.errno or errno.EIO, f"{doing}: {reason}" if doing else reason, path)


def _keep_metadata(path: str, fd: int) -> None:
    """Give the new file the mode, owner and group of the regular file at ``path`` it replaces (a new file:
    0666 less the umask). UsageError when the owner or group cannot be kept (not root, another's file)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        os.fchmod(fd, 0o666 & ~_umask())
        return
    mine = os.fstat(fd)
    if (mine.st_uid, mine.st_gid) != (st.st_uid, st.st_gid):
        try:
            os.fchown(fd, st.st_uid, st.st_gid)
        except PermissionError:
            raise UsageError(f"{path}: owned by uid {st.st_uid} gid {st.st_gid}; replacing it would give it this "
                             f"user's uid {mine.st_uid} gid {mine.st_gid}: run as its owner (or root)",
                             code="permission_denied") from None
    os.fchmod(fd, st.st_mode & 0o7777)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_range(src: BinaryIO, dst: BinaryIO, offset: int, size: int, progress=None) -> None:
    """Copy ``size`` bytes from ``offset`` of ``src`` in large chunks; ``progress(done)`` after each."""
    src.seek(offset)
    done = 0
    while done < size:
        chunk = src.read(min(COPY_CHUNK, size - done))
        if not chunk:
            raise OSError(f"unexpected end of file at {offset + done}")
        dst.write(chunk)
        done += len(chunk)
        if progress:
            progress(done)
