"""The one conversion step of ``migrate``, ``keep`` and ``serve``: a slot file made fit for a running server's
flags by :mod:`slotctl.convert` (its ``-np``/``-kvu`` KV streams, exact; its cache types, lossy, only when
allowed), planned from the file's metadata (:func:`plan_for`, nothing written) and written apart
(:func:`write_planned`), or both at once (:func:`convert_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slotctl.errors import ExitStatus, SlotctlError


class Refused(SlotctlError):
    """The state cannot be sent to the server as asked (it cannot be converted, the conversion would be lossy
    and is not allowed; migrate: another model, validate's verdict); nothing was sent."""

    exit_status = ExitStatus.FAILED
    code = "refused"

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        #: the figures of the step that refused (what a conversion would have changed)
        self.details = details


@dataclass
class Conversion:
    """A file made fit for a server's flags (:func:`convert_for`): ``path`` the file to send (the original
    when nothing changes), ``changes`` in words, ``details`` for a step's or an event's figures, ``checksum`` the
    hex SHA-256 of the file written (:mod:`slotctl.seal`: checked again before it is restored; None when
    nothing was written)."""

    path: Path
    changes: list[str]
    details: dict
    checksum: str | None = None


@dataclass
class Planned:
    """A conversion planned for a server's flags (:func:`plan`), nothing written yet: ``plan`` (None when
    nothing changes), the model's ``layout`` (None without the model), ``changes`` in words, ``lossy`` the
    changes among them that re-encode cache rows, ``details`` as :class:`Conversion`'s."""

    plan: object
    layout: object
    changes: list[str]
    details: dict

    @property
    def lossy(self) -> list[str]:
        return self.details["lossy"]

    def close(self) -> None:
        """The parse a plan keeps open (for :func:`write_planned`) closed: planned only."""
        if self.plan is not None:
            self.plan.parsed.close()


def plan(path, setup, *, who: str = "server") -> Planned:
    """The conversion of ``path`` (a local path or an ``s3://`` object: only its metadata is read) for the
    server of ``setup``, planned: its ``-np``/``-kvu`` streams and its cache types (``Planned.lossy``: the
    re-encodings, whoever allows them). :class:`Refused` when it cannot be converted; FormatError when the
    file does not parse."""
    from slotctl import convert as conv
    from slotctl.validate.setup import Models

    models = Models(setup)
    flags = setup.flags
    rule = layout = None
    if models.target is not None:
        from slotctl.model.predict import rotation_rule

        rule, layout = rotation_rule(models.target), models.target.layout()
    req = conv.Request(target=conv.Target(conv.stream_count(flags.parallel, flags.kv_unified),
                                          conv.cache_type_id(flags.cache_type_k, "-ctk"),
                                          conv.cache_type_id(flags.cache_type_v, "-ctv"), rule))
    try:
        made = conv.plan_convert(path, req, layout=layout)
    except conv.ConversionRefused as e:
        raise Refused(f"the file cannot be converted for the {who}: {e}") from None
    changes = [c.describe() for c in made.changes]
    lossy = [c.describe() for c in made.changes if c.what in ("K type", "V type")]
    details = {"changes": changes, "lossy": lossy, "converted": bool(made.changes)}
    if not made.changes:
        made.parsed.close()     # nothing to write: the parse is not kept open
        return Planned(None, layout, changes, details)
    return Planned(made, layout, changes, details)


def lossy_refusal(who: str, lossy: list[str], remedy: str) -> str:
    """Why a conversion that re-encodes cache rows (``lossy``) is not made: ``remedy`` says what allows it."""
    return f"the {who}'s cache types differ ({'; '.join(lossy)}): re-encoding is lossy, {remedy}"


def plan_for(path, setup, *, allow_lossy: bool, lossy_remedy: str, who: str = "server") -> Planned:
    """:func:`plan`, and :class:`Refused` too when the conversion would be lossy and not ``allow_lossy``
    (``lossy_remedy``: what the caller's command takes to allow it)."""
    planned = plan(path, setup, who=who)
    if planned.lossy and not allow_lossy:
        planned.close()
        raise Refused(lossy_refusal(who, planned.lossy, lossy_remedy), planned.details)
    return planned


def convert_for(path: Path, setup, dest: Path, *, allow_lossy: bool, lossy_remedy: str,
                who: str = "server") -> Conversion:
    """``path`` converted for the server of ``setup`` (:func:`plan_for`) into ``dest`` when anything changes.
    :class:`Refused` as :func:`plan_for`."""
    planned = plan_for(path, setup, allow_lossy=allow_lossy, lossy_remedy=lossy_remedy, who=who)
    return write_planned(planned, path, dest)


def write_planned(planned: Planned, path, dest: Path) -> Conversion:
    """A :class:`Planned` conversion of ``path`` written into ``dest`` (streamed, atomic:
    :func:`slotctl.convert.write_converted`), the plan's parse closed after, and its checksum made (the file
    read once more: :attr:`Conversion.checksum`); ``path`` itself when nothing changes."""
    from slotctl import convert as conv

    details = dict(planned.details)
    if planned.plan is None:
        return Conversion(Path(path), [], details)
    try:
        errors = conv.write_converted(planned.plan, dest, layout=planned.layout)
    finally:
        planned.close()     # the source read: not kept open (serve removes a download after)
    details["max_abs_error"] = max((e.max_abs_error for e in errors), default=None)
    from slotctl.seal import checksum_file

    return Conversion(Path(dest), planned.changes, details, checksum_file(dest))
