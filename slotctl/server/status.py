"""The words a restore step's outcome is said in (:class:`Status`), apart from the steps themselves
(:mod:`slotctl.server.restore`) so that what only names them (validate's verdicts, ``ls`` from the catalog)
imports nothing heavier."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    """What one step of the restore did (:attr:`Outcome.status`); the words every command reports."""

    RESTORED = "restored"   # the step did what it is for
    ABSENT = "absent"       # nothing to do: the file holds no such layer
    IGNORED = "ignored"     # the layer is there and the server skips it (0 bytes consumed)
    DROPPED = "dropped"     # the layer is read (its bytes consumed) and not applied
    REFUSED = "refused"     # "Unable to restore slot: ..."; the slot is emptied
    ABORTS = "aborts"       # llama.cpp aborts the server process
