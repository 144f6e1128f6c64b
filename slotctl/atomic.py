"""Atomic file writes: a temporary file in the same directory, fsync, rename.

An interrupted write (an error, Ctrl-C, a kill) leaves the destination as it was: either the old file
or, once the rename happened, the complete new one. A killed process may leave its temporary file
(``.NAME.slotctl-*.tmp``) behind, never a half-written destination.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from slotctl.errors import UsageError

#: chunk size for streamed copies
COPY_CHUNK = 8 << 20


@contextmanager
def atomic_writer(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[BinaryIO]:
    """Yield a file to write; on a clean exit it replaces ``path`` atomically.

    Without ``overwrite`` an existing ``path`` is a usage error (checked before and at the rename).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not overwrite and os.path.exists(path):
        raise UsageError(f"{path}: exists (use --force to overwrite)")
    if not os.path.isdir(directory):
        raise UsageError(f"{directory}: no such directory")
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.slotctl-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            if not overwrite:
                raise UsageError(f"{path}: exists (use --force to overwrite)")
            # keep the mode of the file being replaced
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        fsync_dir(directory)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


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
