"""Expanding the FILE... arguments of commands that take many slot files or a server's slot directory."""

from __future__ import annotations

import os
from typing import Iterable

from slotctl.errors import UsageError


def is_temp_file(name: str) -> bool:
    """Whether ``name`` is a temporary file of :func:`~slotctl.atomic.atomic_writer` (``.NAME.slotctl-*.tmp``)."""
    return name.startswith(".") and ".slotctl-" in name and name.endswith(".tmp")


def expand_paths(paths: Iterable[str | os.PathLike], *, follow_symlinks: bool = False) -> list[str]:
    """Each file as given; each directory's regular files (not recursive, sorted).

    Temporary files of slotctl's atomic writes are skipped. Symbolic links inside a directory are skipped
    unless ``follow_symlinks`` (a command that only reads may follow them; one that rewrites files must
    not). A path given twice (or a file also found in a given directory) is listed once. A missing path,
    or one that is neither a file nor a directory, is a usage error.
    """
    out: list[str] = []
    seen: set[str] = set()

    def add(p: str) -> None:
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            out.append(p)

    for raw in paths:
        p = os.fspath(raw)
        if os.path.isdir(p):
            with os.scandir(p) as it:
                names = sorted(e.name for e in it
                               if e.is_file(follow_symlinks=follow_symlinks) and not is_temp_file(e.name))
            for name in names:
                add(os.path.join(p, name))
        elif os.path.isfile(p):
            add(p)
        elif os.path.lexists(p):
            raise UsageError(f"{p}: not a regular file or a directory")
        else:
            raise UsageError(f"{p}: no such file or directory")
    return out
