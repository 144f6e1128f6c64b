"""What kind of trouble a file is in for a server (``ls``, ``prune``, ``cp``): a class on top of validate's
verdict, so that an act deletes or refuses only what it should.

* ``broken``: damage in the file itself. The server refuses it or aborts on it **whatever its flags**: judged
  again for a server started with the flags the file was written with (its KV stream count, cache types and
  flash attention, a context it fits in, a projector when it holds media, its state version), it is still
  refused or aborted on, and it is no other model's file; or its payload is cut short. ``ls --broken`` and
  ``prune --broken`` (and ``cp``, which refuses these only) act on this class.
* ``mismatch``: refused only by the flags or the model given: the file restores in a server started as it
  was saved; or a stored state of another model than the one given (``other_model``: its name's model identity,
  :mod:`slotctl.seal`). A stored state whose bytes are not the ones stored (``corrupt``) is ``broken``. Its remedy is the first refusal's own (``slotctl convert ... -np N``, ``-c``, ``-m``: validate's
  words); deleted only when asked for by ``prune --mismatched``.
* ``useless``: the server restores it but will reuse none of it: validate's predicted reuse for a request that
  extends the prompt is 0 (gemma2 at b11434: its SWA cache holds only the window and b11434 keeps no
  checkpoint of a file, :mod:`slotctl.server.reuse`).
* ``ok``: it restores and the server reuses some of it; ``undecided``: the verdict cannot be told (no model).

The verdicts are validate's (:func:`slotctl.validate.check.validate_file`); this module only asks it twice.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum

from slotctl.validate.report import FileReport, Verdict
from slotctl.validate.setup import Models, ServerSetup

#: the smallest context step llama.cpp sizes a KV cache in (n_ctx is rounded up to it)
_CTX_PAD = 256


class FileClass(StrEnum):
    OK = "ok"
    BROKEN = "broken"
    MISMATCH = "mismatch"
    USELESS = "useless"
    UNDECIDED = "undecided"


@dataclasses.dataclass(frozen=True)
class Standing:
    """A file's class and, for a mismatch or a useless file, what to do about it (``remedy``)."""

    file_class: FileClass
    remedy: str | None = None


def own_setup(report: FileReport, setup: ServerSetup) -> ServerSetup | None:
    """``setup`` with the flags the file of ``report`` was written with (the same models): what a server
    started as it was saved would be; None when the file's memory did not parse, or when its bytes name flags
    no server is started with (a KV stream count of 0 or past ``-np``'s range: no such server saved it)."""
    from slotctl.server.flags import FlagError
    from slotctl.slotfile import memory_flags

    sf = report.slot_file
    if sf is None or sf.target is None:
        return None
    type_k, type_v, fa, n_stream = memory_flags(sf.target)
    n_tokens = sf.tokens.n_tokens if sf.tokens is not None and sf.tokens.error is None else 0
    cells = max(n_tokens + 1, 1)
    per_slot = -(-cells // _CTX_PAD) * _CTX_PAD
    try:
        flags = setup.flags.replace(parallel=n_stream, kv_unified=False, kv_unified_per_slot=0,
                                    cache_type_k=type_k, cache_type_v=type_v, flash_attn=fa,
                                    ctx_size=max(setup.flags.ctx_size, per_slot * n_stream))
    except FlagError:
        return None
    media = bool(sf.tokens is not None and sf.tokens.error is None and sf.tokens.media)
    return dataclasses.replace(ServerSetup.from_flags(flags, target=setup.target, draft=setup.draft, slot=0,
                                                      mmproj=setup.mmproj or media,
                                                      attn_rot_disable=setup.attn_rot_disable),
                               state_version=sf.version if sf.version in (2, 3, 4) else setup.state_version)


def _first_error(report: FileReport) -> str | None:
    first = next((f for f in report.ordered_findings() if f.severity == "error"), None)
    return f"{first.layer}: {first.message}" if first is not None else None


def classify(report: FileReport, setup: ServerSetup) -> Standing:
    """The class of the file of ``report`` (judged by validate for ``setup``), see the module docstring."""
    from slotctl.validate.check import validate_file

    sf = report.slot_file
    if report.verdict == Verdict.OTHER_MODEL:
        return Standing(FileClass.MISMATCH, f"{_first_error(report)} (give -m the model it was stored for)")
    if report.verdict == Verdict.CORRUPT:
        return Standing(FileClass.BROKEN)
    if report.refused_or_aborts:
        if report.verdict == Verdict.UNREADABLE or sf is None or sf.payload_cut or sf.target is None:
            return Standing(FileClass.BROKEN)
        own = own_setup(report, setup)
        again = None
        if own is not None:
            try:
                again = validate_file(sf.path, own, Models(own))
            except Exception:       # noqa: BLE001 - flags no server takes: the first judgement stands
                again = None
        if again is not None and not again.refused_or_aborts:
            return Standing(FileClass.MISMATCH, _first_error(report))
        other = _another_model(sf, setup)
        if other is not None:
            return Standing(FileClass.MISMATCH, f"{other}: the file was saved with another model (give -m the one "
                                                "it was saved with)")
        return Standing(FileClass.BROKEN)
    if report.verdict == Verdict.UNDECIDED:
        return Standing(FileClass.UNDECIDED)
    reuse = report.reuse
    if isinstance(reuse, dict) and reuse.get("n_tokens"):
        b = reuse.get("b11434") or {}
        if b.get("n_reused") == 0:
            return Standing(FileClass.USELESS, b.get("reason") or reuse.get("reason"))
    return Standing(FileClass.OK)


def _another_model(sf, setup: ServerSetup) -> str | None:
    """What in the file another model wrote, when its structure alone is sound (no model: it parses and
    the server's structural rules pass) and its shape is not the model's (:mod:`slotctl.model.fit`)."""
    if setup.target is None:
        return None
    from slotctl.model.fit import shape_differences
    from slotctl.validate.check import validate_file

    models = Models(setup)
    diffs = shape_differences(models.target, sf.target)
    if not diffs:
        return None
    bare = dataclasses.replace(ServerSetup(), state_version=sf.version if sf.version in (2, 3, 4) else 4)
    alone = validate_file(sf.path, bare, Models(bare))
    if alone.refused_or_aborts:
        return None
    return diffs[0]
