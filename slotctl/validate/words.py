"""The words validate says what the server does in: a layer's :class:`Effect`, a file's :class:`Verdict`, a
layer's :class:`Load`, taking the words they share with a restore step's ``Status`` from it
(:mod:`slotctl.server.status`). Apart from the results (:mod:`slotctl.validate.report`) so that what only
names them (``ls`` served from the catalog) imports nothing heavier."""

from __future__ import annotations

from enum import StrEnum

from slotctl.server.status import Status


class Effect(StrEnum):
    """What a layer's problems make the server do (:attr:`LayerCheck.effect`), worst last; the words shared
    with the restore's steps are :class:`~slotctl.server.status.Status`'s."""

    OK = "ok"
    DROPPED = Status.DROPPED.value          # restored without this layer
    ABORTS_LATER = "aborts_later"           # restored; aborts when the server rolls back to this checkpoint
    REFUSED = Status.REFUSED.value          # "Unable to restore slot"
    ABORTS = Status.ABORTS.value            # llama.cpp aborts the server while restoring
    UNDECIDED = "undecided"                 # what the server does cannot be told without the model
    OTHER_MODEL = "other_model"             # restored, but stored for another model (its name's model identity)
    CORRUPT = "corrupt"                     # restored, but not the bytes stored (its name's checksum)


class Verdict(StrEnum):
    """What the server does with a whole file (:attr:`FileReport.verdict`), from best to worst."""

    RESTORES = "restores"
    RESTORES_WITH_DROPS = "restores_with_drops"
    UNDECIDED = Effect.UNDECIDED.value
    #: the server restores it, but it was stored for another model than the one given (or a draft state for
    #: another draft model): its answers would be neither model's (a stored state's name: :mod:`slotctl.seal`)
    OTHER_MODEL = Effect.OTHER_MODEL.value
    #: the server restores it, but its bytes are not the ones stored (its name's checksum): damaged since
    CORRUPT = Effect.CORRUPT.value
    ABORTS = Status.ABORTS.value
    REFUSED = Status.REFUSED.value
    UNREADABLE = "unreadable"

    @property
    def broken(self) -> bool:
        """The server refuses the file or aborts on it, it cannot be read, or its bytes are not the ones stored
        (``ls --broken``, ``prune --broken``)."""
        return self in (Verdict.ABORTS, Verdict.REFUSED, Verdict.UNREADABLE, Verdict.CORRUPT)


class Load(StrEnum):
    """What the prediction and the real load say of a layer (:attr:`LayerCheck.predicted`, ``.loaded``)."""

    FITS = "fits"
    MISMATCH = "mismatch"
    REFUSED = Status.REFUSED.value   # llama.cpp's loader refused it
    PARTIAL = "partial"
    ABORTED = "aborted"
    SKIPPED = "skipped"


#: finding severities, worst first: the order findings are shown in
SEVERITIES = ("error", "drop", "note")

#: ``FileReport.verdict`` values, from best to worst
VERDICTS = tuple(Verdict)
