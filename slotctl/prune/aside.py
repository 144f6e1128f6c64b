"""A file set aside under a private name while prune checks it for the last time, and what a killed prune
left so put back (:func:`restore_set_aside`, before every plan of a directory).

The private name is ``.NAME.slotctl-prune-PID.tmp`` (:func:`slotctl.atomic.private_name`); a name too long for
it is cut, and its whole name kept in a note beside it, written durably before the rename.
"""

from __future__ import annotations

import os
import re

from slotctl.atomic import private_name

#: the private name a file is set aside under while it is checked for the last time
_ASIDE = re.compile(r"^\.(?P<name>.+)\.slotctl-prune-(?P<pid>\d+)\.tmp$")
#: a set-aside name whose NAME part was cut to fit (atomic.private_name): the whole name is in a note beside it
_CUT = re.compile(r"~[0-9a-f]{16}$")


def _aside_name(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, private_name(name, f"prune-{os.getpid()}"))


def _note_name(aside: str) -> str:
    """Where the whole name of a file set aside under a cut name is kept: ``.slotctl-prune-PID-HASH.name.tmp``
    beside it (HASH: the cut name's; short whatever the name; a temporary file to listings, not a set-aside
    one to :data:`_ASIDE`)."""
    directory, name = os.path.split(aside)
    m = _ASIDE.match(name)
    digest = _CUT.search(m.group("name")).group(0)[1:]
    return os.path.join(directory, f".slotctl-prune-{m.group('pid')}-{digest}.name.tmp")


def set_aside(path: str) -> str:
    """``path`` renamed to its private name (:func:`_aside_name`); when that name had to be cut (a name of
    231-255 bytes), its whole name written first, durably, to a note beside it, so that a prune killed
    before it puts the file back or deletes it leaves what :func:`restore_set_aside` needs."""
    aside = _aside_name(path)
    if _CUT.search(_ASIDE.match(os.path.basename(aside)).group("name")):
        from slotctl.atomic import fsync_dir

        with open(_note_name(aside), "wb") as f:
            f.write(os.fsencode(os.path.basename(path)))
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(os.path.dirname(path) or ".")
    try:
        os.rename(path, aside)
    except BaseException:
        drop_note(aside)
        raise
    return aside


def drop_note(aside: str) -> None:
    m = _ASIDE.match(os.path.basename(aside))
    if not m or not _CUT.search(m.group("name")):
        return
    try:
        os.unlink(_note_name(aside))
    except FileNotFoundError:
        pass



def restore_set_aside(directory: str) -> list[str]:
    """Put back the files a killed prune left under their private names in ``directory`` (where the name
    is free and the prune that set them aside is gone); the paths put back. A cut private name takes the
    whole name from its note (:func:`set_aside`), and only when the note's name gives that private name."""
    back = []
    try:
        with os.scandir(directory) as it:
            names = [d.name for d in it]
    except OSError:
        return back
    for name in names:
        m = _ASIDE.match(name)
        if not m or _alive(int(m.group("pid"))):
            continue
        src = os.path.join(directory, name)
        original = m.group("name")
        if _CUT.search(original):
            try:
                with open(_note_name(src), "rb") as f:
                    original = os.fsdecode(f.read(4096))
            except OSError:
                continue                  # no note: left under its private name, never guessed
            if private_name(original, f"prune-{m.group('pid')}") != name:
                continue
        dst = os.path.join(directory, original)
        try:
            os.link(src, dst)
            os.unlink(src)
        except OSError:
            continue
        drop_note(src)
        back.append(dst)
    return back


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
