"""What a command's path arguments name, decided once: a local path or an object in a store
(:func:`slotctl.sources.remote_url`), one file or a container of them (a directory, an ``s3://`` prefix),
and the slot files they expand to.

Every command that takes FILE... (inspect, validate, ls, strip-draft, convert, cp) expands its arguments
here: a prefix is listed once (the listing says both that it is a prefix and what is under it), and a
directory read once. Which entries are slot files is :func:`slotctl.format.magic.is_slot_entry`'s rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from slotctl.paths import CATALOG_FILE, STDIN, directory_entries, directory_files
from slotctl.format.magic import is_slot_entry
from slotctl.sources import first_bytes, list_prefix, prefix_exists, remote_url, sub_prefixes


def is_container(p: str | os.PathLike) -> bool:
    """A directory, or an ``s3://`` prefix with objects under it: what a command reads many files from.
    Nothing at all under a URL is no container: it is taken as the object it names, whose open says "no
    such object". (A command that expands its arguments reads this from :attr:`Expansion.containers`
    instead: no second listing.)"""
    url = remote_url(p)
    if url is None:
        return os.path.isdir(p)
    return bool(list_prefix(url))


@dataclass
class Expansion:
    """The files a command over many slot files works on, and what it passed over.

    ``files``: each path given (as given, even when missing or unreadable: the command reports it as
    that file's error and goes on; ``-`` is standard input), then each directory's slot files
    (:func:`~slotctl.format.magic.is_slot_entry`). ``skipped``: the regular files in the directories that are not
    slot files (a README, a model, a JSON sidecar): they are only counted. ``links``: the symbolic links in
    the directories, when they are not followed (a command that rewrites files): only counted too.
    ``containers``: the paths given that are directories or prefixes (:func:`is_container`), as given.
    """

    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    #: the sub-prefixes of an ``s3://`` prefix given (its "subdirectories"): named, not read
    prefixes: list[str] = field(default_factory=list)


class Known(Protocol):
    """What a catalog knows of the files listed (:class:`slotctl.catalog.Known`): a file's first bytes
    without opening it when its identity has not changed, and what was read otherwise, kept."""

    def listed(self, entries: list) -> None: ...

    def head(self, path: str) -> bytes | None: ...

    def saw(self, path: str, head: bytes | None) -> None: ...


def expand_slot_paths(paths: Iterable[str | os.PathLike], *, follow_symlinks: bool = False,
                      known: Known | None = None) -> Expansion:
    """Each path given, and each directory's (or prefix's) slot files (not recursive, sorted; see
    :class:`Expansion`). A path that is missing or not a regular file is kept for the command to report.
    ``known``: the catalog's first bytes of unchanged files (a file it knows is not opened to tell whether it
    is a slot file; :func:`~slotctl.format.magic.is_slot_entry` decides on them as on bytes read)."""
    out = Expansion()
    seen: set[str] = set()

    def add(p: str, key: str | None = None) -> None:
        if key is None:
            key = p if p == STDIN or remote_url(p) else os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            out.files.append(p)

    def heads(paths: list[str]) -> list[bytes | None]:
        if known is None:
            return first_bytes(paths)
        got = [known.head(p) for p in paths]
        unknown = [i for i, h in enumerate(got) if h is None]
        for i, h in zip(unknown, first_bytes([paths[i] for i in unknown])):
            got[i] = h
            known.saw(paths[i], h)
        return got

    for raw in paths:
        p = os.fspath(raw)
        url = remote_url(p)
        if url is not None:
            entries = list_prefix(url)
            if entries is None:
                add(url)   # an object
                continue
            subs = sub_prefixes(url)
            if not entries and not subs and not (url.endswith("/") and prefix_exists(url)):
                add(url)   # nothing there at all: the command says "no such object" (as of a missing directory)
                continue
            out.containers.append(p)
            out.prefixes += subs     # a prefix that is there behaves as a directory: empty, it holds 0 files
            entries = [e for e in entries if e.path not in seen]
            if known is not None:
                known.listed(entries)
            for e, head in zip(entries, heads([e.path for e in entries])):
                if is_slot_entry(e.path.rstrip("/").rsplit("/", 1)[-1], head):
                    add(e.path)
                else:
                    out.skipped.append(e.path)
            continue
        if p != STDIN and os.path.isdir(p):
            out.containers.append(p)
            if not follow_symlinks:
                out.links += [os.path.join(p, n) for n in directory_files(p, True)
                              if os.path.islink(os.path.join(p, n))]
            real = os.path.realpath(p)
            # slotctl's own catalog of the directory (and its -wal, -shm) is not counted
            listed = [e for e in directory_entries(p, follow_symlinks) if not e.name.startswith(CATALOG_FILE)]
            # each file once, by its real path: a name that is no symbolic link is the directory's real path
            # and the name (no realpath per file)
            inside, real_inside = _joiner(p), _joiner(real)
            fulls = [inside + e.name for e in listed]
            keys = [os.path.realpath(full) if e.is_symlink() else real_inside + e.name for e, full in zip(listed, fulls)]
            for e, full, key, head in zip(listed, fulls, keys, heads(fulls)):
                if is_slot_entry(e.name, head):
                    add(full, key)
                elif key not in seen:
                    out.skipped.append(full)
        else:
            add(p)
    return out


def _joiner(directory: str) -> str:
    """What ``os.path.join(directory, name)`` puts before a plain ``name`` (no separator in it): joined by
    concatenation, once per directory instead of once per file."""
    return directory if directory.endswith(os.sep) else directory + os.sep
