"""A catalog row's class, asked by ``ls`` and ``prune``'s selections (``--broken``, ``--mismatched``,
``--useless``): read from the row alone (its ``class``, :mod:`slotctl.validate.classes`; its verdict)."""

from __future__ import annotations


def broken_verdicts() -> tuple:
    """The verdicts of files a server refuses or aborts on (``ls --broken``, ``prune --broken``): validate's
    ``Verdict.broken``, read on first use (a listing served from the index never imports validate)."""
    global _BROKEN
    if _BROKEN is None:
        from slotctl.validate.words import Verdict

        _BROKEN = tuple(v for v in Verdict if v.broken)
    return _BROKEN


_BROKEN: tuple | None = None


def is_broken(row: dict) -> bool:
    """Whether the server refuses or aborts on the file of ``row`` whatever its flags: damage in the file
    itself (:mod:`slotctl.validate.classes`; a payload cut short: one or the other)."""
    if "class" in row:
        return row["class"] == "broken"
    return row["verdict"] in broken_verdicts() or row.get("payload_cut", False)


def is_mismatched(row: dict) -> bool:
    """Whether the file of ``row`` is refused only by the flags or the model given (it restores in a server
    started as it was saved): ``ls --mismatched``, ``prune --mismatched``."""
    return row.get("class") == "mismatch"


def is_useless(row: dict) -> bool:
    """Whether the server restores the file of ``row`` but reuses none of it: ``ls --useless``,
    ``prune --useless``."""
    return row.get("class") == "useless"


def is_undecided(row: dict) -> bool:
    """Whether what the server does with the file cannot be told without the model (and it is not cut short:
    that one is broken either way). ``ls --broken`` lists these too; ``prune --broken`` leaves them."""
    return row["verdict"] == "undecided" and not row.get("payload_cut", False)

