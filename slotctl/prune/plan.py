"""Which files of a slot directory (or objects under a prefix) ``slotctl prune`` deletes, and in which order,
decided from metadata alone (``os.lstat``, a prefix's listing; with ``--broken``, ``--mismatched`` and
``--useless``, the verdicts of :mod:`slotctl.catalog`): :func:`plan`. The going is
:mod:`slotctl.prune.delete`'s.

Least recently used first: the last use of a file is its access time where the filesystem keeps one
(the server reading a file to restore it updates it; slotctl's own reads do not,
:func:`slotctl.paths.open_regular`), or its modification time on a ``noatime`` mount; writing counts
as a use (the later of the two).

Never touched: files matching a ``--pin`` glob, slotctl's temporary files (``.NAME.slotctl-*.tmp``),
files modified in the last ``grace`` seconds (a server may be writing them), files that are not slot
files (no state magic), symbolic links and anything that is not a regular file.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

from slotctl.catalog import iso_time
from slotctl.errors import UsageError
from slotctl.format.magic import is_slot_entry
from slotctl.paths import DEFAULT_GRACE, being_written, is_temp_file
from slotctl.prune.aside import restore_set_aside

# actions
DELETE = "deleted"
WOULD_DELETE = "would_delete"
KEEP = "kept"
PINNED = "pinned"
SKIPPED = "skipped"
FAILED = "failed"

#: why ``--broken`` keeps a file that validate cannot decide without the model
UNDECIDED_REASON = ("undecided without -m: the server may restore it, refuse it or abort on it; give -m with the "
                    "server's model and flags to decide")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.I)
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.I)
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``20G``, ``500M``, ``1.5T``, ``4096`` (bytes; K/M/G/T/P are powers of 1024, as ``du -h`` shows them)."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"--max-size {text!r}: expected a size such as 20G, 500M or 4096 (bytes)")
    unit = m.group(2).lower()
    return int(float(m.group(1)) * (1024 ** ("kmgtp".index(unit) + 1) if unit else 1))


def parse_age(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``2w``, ``90`` (seconds)."""
    m = _AGE.match(text)
    if not m:
        raise UsageError(f"--older-than {text!r}: expected an age such as 7d, 12h, 30m or 90 (seconds)")
    return float(m.group(1)) * _AGE_UNITS[m.group(2).lower()]


def time_source(directory: str) -> tuple[str, str]:
    """("atime" or "mtime", why): whether the filesystem of ``directory`` keeps access times."""
    opts = _mount_options(os.path.realpath(directory))
    if opts is None:
        return "atime", "mount options unknown; access times assumed kept"
    if "noatime" in opts:
        return "mtime", "the filesystem is mounted noatime: access times are not kept"
    if "relatime" in opts:
        return "atime", "relatime mount: a read updates the access time once after each write and at most daily"
    return "atime", "access times kept (" + ("strictatime" if "strictatime" in opts else "default") + " mount)"


def _mount_options(path: str) -> set[str] | None:
    """The options of the mount holding ``path`` (Linux /proc/self/mountinfo), or None."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best, opts = -1, None
    for line in lines:
        parts = line.split()
        if len(parts) < 6:
            continue
        point = parts[4].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, opts = len(point), set(parts[5].split(","))
    return opts


@dataclass(frozen=True)
class Policy:
    max_size: int | None = None
    older_than: float | None = None
    keep: int | None = None
    pins: tuple[str, ...] = ()
    broken: bool = False
    grace: float = DEFAULT_GRACE
    #: also delete the temporary files (objects) killed writes left (``--temp-files``)
    temp: bool = False
    #: delete the files refused only by the flags or model given (``--mismatched``)
    mismatched: bool = False
    #: delete the files the server restores but reuses none of (``--useless``)
    useless: bool = False

    @property
    def judged(self) -> bool:
        """The files are selected by what the server does with them (``--broken``, ``--mismatched``,
        ``--useless``), not by a budget."""
        return self.broken or self.mismatched or self.useless

    def __post_init__(self) -> None:
        budgets = [self.max_size, self.older_than, self.keep]
        if self.judged and any(b is not None for b in budgets):
            raise UsageError("--broken, --mismatched and --useless select files by what the server does with them: "
                             "give them without --max-size, --older-than and --keep")
        if not self.judged and not self.temp and all(b is None for b in budgets):
            raise UsageError("nothing to prune by: give --max-size, --older-than, --keep, --broken, --mismatched, "
                             "--useless or --temp-files")


@dataclass
class Entry:
    """A file of the directory and what prune does with it."""

    path: str
    size: int
    disk_size: int
    mtime: float
    atime: float
    ino: int
    used: float = 0.0
    #: an object's ETag (``s3://``: what it must still be when it is deleted)
    etag: str | None = None
    action: str = KEEP
    reason: str = ""
    verdict: str | None = None
    error: str | None = None
    #: the file's class (:mod:`slotctl.validate.classes`) when judged: broken, mismatch, useless, ok, undecided
    file_class: str | None = None
    #: a temporary file of slotctl's (``.NAME.slotctl-*.tmp``), not a slot file: outside every budget
    temp: bool = False

    @property
    def undecided(self) -> bool:
        """Kept by ``--broken`` because its verdict cannot be told without the model."""
        return self.action == KEEP and self.verdict == "undecided"

    @property
    def exit_status(self):
        from slotctl.errors import ExitStatus

        if self.action == FAILED:
            return ExitStatus.USAGE
        return ExitStatus.UNDECIDED if self.undecided else ExitStatus.OK

    def as_dict(self) -> dict:

        d = {"path": self.path, "size": self.size, "disk_size": self.disk_size, "mtime": iso_time(self.mtime),
             "atime": iso_time(self.atime), "last_used": iso_time(self.used), "action": self.action,
             "reason": self.reason, "verdict": self.verdict, "class": self.file_class, "temp": self.temp,
             "exit_code": int(self.exit_status)}
        if self.error:
            d["error"] = {"code": "delete_failed", "message": self.error}
        return d


@dataclass
class Plan:
    directory: str
    policy: Policy
    source: str
    source_reason: str
    entries: list[Entry] = field(default_factory=list)
    size_before: int = 0          # bytes of the slot files in the directory (temporary files excluded)

    def selected(self) -> list[Entry]:
        return [e for e in self.entries if e.action in (DELETE, WOULD_DELETE)]

    @property
    def freed(self) -> int:
        """Bytes of slot files deleted (or to be): what ``size_after`` subtracts (temporary files are not in
        ``size_before``)."""
        return sum(e.size for e in self.entries if e.action in (DELETE, WOULD_DELETE) and not e.temp)

    @property
    def size_after(self) -> int:
        return self.size_before - self.freed

    @property
    def over_budget(self) -> bool:
        return self.policy.max_size is not None and self.size_after > self.policy.max_size


def _scan(directory: str, now: float, policy: Policy, source: str, known=None) -> tuple[list[Entry], int]:
    from slotctl.sources import first_bytes

    entries, total = [], 0
    with os.scandir(directory) as it:
        dirents = sorted(it, key=lambda d: d.name)
    for d in dirents:
        try:
            st = d.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        e = Entry(d.path, st.st_size, st.st_blocks * 512, st.st_mtime, st.st_atime, st.st_ino)
        e.used = max(st.st_mtime, st.st_atime) if source == "atime" else st.st_mtime
        if is_temp_file(d.name):
            e.temp = True
            e.action, e.reason = _temp_action(d.name, st.st_mtime, policy, now)
        elif not is_slot_entry(d.name, _head(d.path, st, known, first_bytes)):
            e.action, e.reason = SKIPPED, "not a slot file (no state magic, not named *.bin)"
        else:
            total += st.st_size       # the budget is of slot files, busy and pinned ones included
            busy = being_written(st, policy.grace, now)
            if busy:
                e.action, e.reason = SKIPPED, busy
            elif any(fnmatch.fnmatch(d.name, g) or fnmatch.fnmatch(d.path, g) for g in policy.pins):
                e.action, e.reason = PINNED, "matches --pin"
        entries.append(e)
    return entries, total


def _head(path: str, st, known, first_bytes) -> bytes | None:
    """The first bytes of ``path`` (whether it is a slot file): from the catalog when its identity has not
    changed (``known``: :class:`slotctl.catalog.Known`), else read (and kept there)."""
    if known is None:
        return first_bytes([path])[0]
    head = known.head(path, st)
    if head is None:
        head = first_bytes([path])[0]
        known.saw(path, head)
    return head


def _temp_action(name: str, mtime: float, policy: Policy, now: float, *, what: str = "file") -> tuple[str, str]:
    """What prune does with one of slotctl's temporary files (objects): without ``--temp-files`` nothing;
    with it, delete one a killed write left (untouched for ``--grace`` seconds; locally, the deletion checks
    again that no process has it open, :func:`slotctl.prune.delete.delete_checked`). Never a file a prune set
    aside (or its note): those are put back (:func:`slotctl.prune.aside.restore_set_aside`), never deleted."""
    if not policy.temp:
        return SKIPPED, f"a slotctl temporary {what} (a write in progress, or one killed: --temp-files removes it)"
    if ".slotctl-prune-" in name:
        return SKIPPED, "set aside by a prune that is running, or kept beside a newer file of its name"
    busy = being_written(SimpleNamespace(st_mtime=mtime), policy.grace, now)
    if busy:
        return SKIPPED, busy
    return DELETE, f"a temporary {what} a killed write left, untouched for {_ago(now - mtime)} (--temp-files)"


#: why an object's last use is its last-modified time
OBJECT_TIME = ("an object store keeps no access time: last use is the object's Last-Modified (when it was "
               "written)")


def _scan_prefix(url: str, now: float, policy: Policy, known=None) -> tuple[list[Entry], int]:
    """The objects directly under the prefix ``url`` as :func:`_scan` sees a directory's files."""
    from slotctl.format.magic import file_kind
    from slotctl.sources import first_bytes, list_prefix, prefix_exists

    listed = list_prefix(url.rstrip("/") + "/") or []
    if not listed and not prefix_exists(url.rstrip("/") + "/"):
        # a store has no directories: a prefix is there when something is under it (an object, a sub-prefix, the
        # store's marker of an emptied prefix)
        raise UsageError(f"{url}: no such prefix (no object under it)", code="no_such_file")
    names = [o.path.rpartition("/")[2] for o in listed]
    slot = [not is_temp_file(n) for n in names]
    wanted = [o.path for o, ok in zip(listed, slot) if ok]
    if known is None:
        heads = first_bytes(wanted)
    else:          # the catalog's first bytes of the objects whose ETag has not changed; the rest read
        known.listed(listed)
        heads = [known.head(p) for p in wanted]
        unknown = [i for i, h in enumerate(heads) if h is None]
        for i, h in zip(unknown, first_bytes([wanted[i] for i in unknown])):
            heads[i] = h
            known.saw(wanted[i], h)
    it = iter(heads)
    entries, total = [], 0
    for o, name, ok in zip(listed, names, slot):
        e = Entry(o.path, o.size, o.size, o.mtime, o.mtime, 0, used=o.mtime, etag=o.etag)
        head = next(it) if ok else None
        if not ok:
            e.temp = True
            e.action, e.reason = _temp_action(name, o.mtime, policy, now, what="object")
        elif head is not None and file_kind(head) != "slot" and not name.endswith(".bin"):
            e.action, e.reason = SKIPPED, "not a slot file (no state magic, not named *.bin)"
        else:
            total += o.size
            busy = being_written(SimpleNamespace(st_mtime=o.mtime), policy.grace, now)
            if busy:
                e.action, e.reason = SKIPPED, busy
            elif any(fnmatch.fnmatch(name, g) or fnmatch.fnmatch(o.path, g) for g in policy.pins):
                e.action, e.reason = PINNED, "matches --pin"
        entries.append(e)
    return entries, total


def plan(directory: str, policy: Policy, *, now: float | None = None,
         verdicts: Callable[[list[str]], dict[str, str]] | None = None, index: bool = True) -> Plan:
    """What prune would delete in ``directory`` (or under an ``s3://`` prefix). ``verdicts(paths) ->
    {path: (verdict, class, remedy)}`` judges the candidates for ``--broken``, ``--mismatched`` and
    ``--useless`` (:mod:`slotctl.catalog` rows, made by the caller). ``index``: whether a file is a slot
    file is taken from the catalog for a file whose identity has not changed (False: every file is opened;
    ``--no-cache``)."""
    from slotctl.catalog import Known
    from slotctl.sources import remote_url

    now = time.time() if now is None else now
    url = remote_url(directory)
    known = Known() if index else None
    try:
        if url is not None:
            directory = url
            source, why = "mtime", OBJECT_TIME
            entries, total = _scan_prefix(url, now, policy, known)
        else:
            if not os.path.isdir(directory):
                raise UsageError(f"{directory}: " + ("not a directory" if os.path.lexists(directory)
                                                     else "no such directory"), code="no_such_file")
            restore_set_aside(directory)   # what a killed prune left under a private name
            source, why = time_source(directory)
            entries, total = _scan(directory, now, policy, source, known)
        if known is not None:
            known.flush()
    finally:
        if known is not None:
            known.close()
    p = Plan(directory, policy, source, why, entries, total)
    cands = sorted((e for e in entries if e.action == KEEP), key=lambda e: (e.used, e.path))
    if policy.judged:
        judged = verdicts([e.path for e in cands]) if verdicts else {}
        for e in cands:
            e.verdict, e.file_class, remedy = judged.get(e.path, (None, None, None))
            _judged_action(e, policy, remedy)
        return p
    if policy.older_than is not None:
        for e in cands:
            if now - e.used > policy.older_than:
                e.action, e.reason = DELETE, f"last used {_ago(now - e.used)} ago (--older-than)"
    if policy.keep is not None:
        left = [e for e in cands if e.action == KEEP]
        for e in left[:max(0, len(left) - policy.keep)]:
            e.action, e.reason = DELETE, f"beyond the {policy.keep} most recently used (--keep)"
    if policy.max_size is not None:
        size = total - sum(e.size for e in cands if e.action == DELETE)
        for e in cands:
            if size <= policy.max_size:
                break
            if e.action == KEEP:
                e.action, e.reason = DELETE, "least recently used while over --max-size"
                size -= e.size
    for e in cands:
        if e.action == KEEP and not e.reason:
            e.reason = "within the budget"
    return p


def _judged_action(e: Entry, policy: Policy, remedy: str | None) -> None:
    """What ``--broken``, ``--mismatched`` and ``--useless`` do with a file of class ``e.file_class``."""
    fix = f": {remedy}" if remedy else ""
    if e.file_class == "broken":
        if policy.broken:
            e.action, e.reason = DELETE, (f"the server refuses it or aborts on it whatever its flags: damage in the "
                                          f"file itself ({e.verdict})")
        else:
            e.reason = f"broken ({e.verdict}): --broken deletes it"
    elif e.file_class == "mismatch":
        if policy.mismatched:
            e.action, e.reason = DELETE, f"refused only by the flags or model given (--mismatched){fix}"
        else:
            e.reason = (f"refused only by the flags or model given, not broken: it restores in a server started as "
                        f"it was saved; --mismatched deletes it{fix}")
    elif e.file_class == "useless":
        if policy.useless:
            e.action, e.reason = DELETE, f"restores, but the server reuses none of it (--useless){fix}"
        else:
            e.reason = f"restores, but the server reuses none of it: --useless deletes it{fix}"
    elif e.file_class == "undecided" or e.verdict == "undecided":     # it may restore: never deleted on a guess
        e.reason = UNDECIDED_REASON
    else:
        e.reason = "restores" if e.verdict is None else e.verdict


def _ago(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f}{unit}"
    return f"{seconds:.0f}s"
