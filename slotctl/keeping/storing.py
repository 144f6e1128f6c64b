"""A checked save named by its content and stored once (:func:`named`, :func:`put_saved`), what
:class:`~slotctl.keeping.states.ServerStates` does with each save keep or serve has the server make.

Its one reason to change: how a save becomes a stored state (its name, :func:`slotctl.seal.state_name`; the one
write into the store, never over a state of its slot, model and tokens).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from slotctl import seal
from slotctl.errors import SlotctlError
from slotctl.keeping.store import Saved
from slotctl.live.identity import ServerModel


def named(saved: Saved, model: ServerModel | None) -> Saved:
    """``saved`` (a checked save of ``saved.slot``) named as a stored state of the server's ``model``
    (:func:`slotctl.seal.state_name`: the model's content identity, and the draft model's for a state that carries
    a draft state, and its checksum), or as it is (``name`` None) while the model is not identified."""
    if model is None or saved.checksum is None or saved.slot is None:
        return saved
    tokens = saved.tokens if saved.tokens is not None else ()
    return dataclasses.replace(saved, name=seal.state_name(saved.slot, model.short, tokens, saved.checksum,
                                                           model.draft_part(saved.draft)))


def put_saved(store, saved: Saved, *, damaged: set[str] = frozenset(),
              before_write: Callable[[], None] | None = None) -> bool:
    """A named save (``saved.path``, the working file) stored in ``store`` under its name, once: False when a
    state of its slot, model and tokens is in the store already (whatever its checksum, unless it is among the
    states found ``damaged``: written by another process meanwhile, too); a directory store on the slot
    directory's file system takes a hard link, nothing copied, else a copy through a temporary file; an
    ``s3://`` store an object created only if absent. ``before_write()`` first (the lock's check: raises when
    the lock is lost). The working file stays: the caller's to remove."""
    name, path = saved.name, saved.path
    said = seal.parse_name(name)
    prefix = name[:-len(f"{said.checksum}.bin")]
    if set(store.named(prefix)) - damaged:
        return False
    if before_write is not None:
        before_write()
    where = store.where(name)
    if not where.startswith("s3://"):
        try:
            os.link(path, where)          # never over a state of that name
        except FileExistsError:
            return False
        except OSError:
            pass        # another file system: copied below
        else:
            from slotctl.atomic import fsync_dir

            fsync_dir(os.path.dirname(where))
            return True
    try:
        store.put(path, name, move=False)
    except SlotctlError as e:
        if getattr(e, "code", None) != "exists":
            raise
        return False        # stored by another process between the look and the copy
    return True
