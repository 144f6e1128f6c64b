"""The real check: each memory layer of a file loaded into real contexts built like the server's (in
validate's child process, :mod:`slotctl.validate.child`), and what each result says that the prediction
did not."""

from __future__ import annotations

from typing import BinaryIO

from slotctl.model.predict import Prediction
from slotctl.server.findings import Finding
from slotctl.slotfile import SlotFile
from slotctl.validate.child import LoadChecker, _layout_dict
from slotctl.validate.compare import _Issue, _issue, _MemLayer
from slotctl.validate.report import (
    ABORTED,
    DRAFT,
    EFFECT_ABORTS,
    EFFECT_ABORTS_LATER,
    EFFECT_DROPPED,
    EFFECT_OK,
    EFFECT_REFUSED,
    FITS,
    MISMATCH,
    PARTIAL,
    REFUSED,
    SKIPPED,
    TARGET,
)
from slotctl.validate.setup import ServerSetup


#: the most bytes of one layer the real load hands its child (through the pipe, then into llama.cpp): with
#: the contexts, the real load of any file stays under 1 GiB (the child holds up to three copies of a layer
#: while it converts one between state versions) and ~10 s whatever its counts say; a larger
#: layer is not loaded, and the report says so (the prediction decides it)
LOAD_MAX_BYTES = 256 << 20


def _refusing(issues: list[_Issue]) -> list[_Issue]:
    """The issues that keep a layer, or the file, out of the slot (not notes)."""
    return [i for i in issues if i.finding.severity != "note"]


def _real_check(layers: list[_MemLayer], checker: LoadChecker, sf: SlotFile, f: BinaryIO, setup: ServerSetup,
                tpred: Prediction | None, dpred: Prediction | None,
                file_issues: list[_Issue] | None = None, confirm_refusals: bool = False) -> list[_Issue]:
    """Load each layer (results on the layers; its bytes read from ``f``, the open file); returns the
    findings about the file as a whole.

    Bounded: a layer the prediction already refuses (or drops), or of a file it refuses whole
    (``file_issues``: the state header, the token words), is never loaded (a load would repeat the refusal
    at the cost of its bytes: a sparse file's claimed gigabytes); nor is a layer of more than
    :data:`LOAD_MAX_BYTES`. Each such layer is "skipped", with the reason. ``confirm_refusals`` (a library
    caller's choice, never the CLI's): load the refused layers too, within the same byte bound, to see the real
    loader refuse them for the predicted reason (the test suite's check of the prediction)."""
    if not layers:
        return []
    file_refused = _refusing(file_issues or [])
    todo = []
    for ml in layers:
        if ml.no_load:
            ml.check.loaded, ml.check.reason = SKIPPED, ml.no_load
            continue
        refused = _refusing(ml.issues) or (file_refused if ml.side.main else [])
        if refused and not confirm_refusals:
            ml.check.loaded = SKIPPED
            ml.check.reason = (f"not loaded: the prediction already keeps it out ({refused[0].finding.code}), and a "
                               "load would only repeat that at the cost of its bytes")
            continue
        if ml.span_size > LOAD_MAX_BYTES:
            ml.check.loaded = SKIPPED
            ml.check.reason = (f"not loaded: {ml.span_size:,} bytes, more than the real load takes "
                               f"({LOAD_MAX_BYTES >> 20} MiB, so that it stays within 1 GiB and seconds); the "
                               "prediction alone decides")
            ml.issues.append(_Issue(Finding(ml.side.layer, "note", "load_skipped",
                                            f"{ml.side.what} was not loaded into a real context: {ml.check.reason}",
                                            ml.span_offset), EFFECT_OK))
            continue
        todo.append(ml)
    if not todo:      # nothing to load: no child is started, no model loaded
        return []
    ctx = checker.contexts()
    if ctx is None:
        for ml in todo:
            ml.check.loaded, ml.check.reason = SKIPPED, checker.failure
        return [_Issue(Finding("file", "note", "load_skipped", f"the real check did not run: {checker.failure}; "
                                                               "the prediction alone decides", None), EFFECT_OK)]
    out = []
    for key, pred in (("target", tpred), ("draft", dpred)):
        got = ctx.get(key)
        if pred is None or not got:
            continue
        if (got["n_ctx"], got["n_ctx_seq"]) != (pred.n_ctx, pred.n_ctx_seq):
            layer = TARGET if key == "target" else DRAFT
            out.append(_Issue(Finding(
                layer, "error", "prediction_disagrees",
                f"the {key} context llama.cpp built has {got['n_ctx']:,} cells ({got['n_ctx_seq']:,} per "
                f"sequence), slotctl predicted {pred.n_ctx:,} ({pred.n_ctx_seq:,}): a slotctl bug; the "
                "prediction of this file cannot be trusted", None), EFFECT_REFUSED))
    for ml in todo:
        if ml.side.kind == "draft" and not ctx.get("draft"):
            continue
        if sf.version != checker.runtime_version and ml.parsed_layout is None:
            ml.check.loaded = SKIPPED
            ml.check.reason = (f"a version-{sf.version} layer is converted to version {checker.runtime_version} "
                               "for this runtime, and one that does not parse cannot be converted")
            continue
        step = {"ctx": ml.side.kind, "path": sf.path, "offset": ml.span_offset, "size": ml.span_size,
                "blob": ml.is_blob, "version": sf.version, "layout": _layout_dict(ml.parsed_layout),
                "flags": ml.flags, "slot": setup.slot, "prefix": ml.prefix}
        res = checker.load(step, f)
        _judge(ml, res)
    return out


def _judge(ml: _MemLayer, res: dict) -> None:
    """Record a load result on its layer, and what it says that the prediction did not."""
    check, side = ml.check, ml.side
    status = res["status"]
    check.loaded = status
    check.loader_messages = list(res.get("errors") or [])
    check.reason = res.get("reason")
    if status == SKIPPED:
        ml.issues.append(_Issue(Finding(side.layer, "note", "load_skipped",
                                        f"{side.what} was not loaded into a real context: {check.reason}; the "
                                        "prediction alone decides", ml.span_offset), EFFECT_OK))
        return
    why = "; ".join(check.loader_messages) or "llama.cpp said nothing"
    if status == ABORTED:
        what = "the server crashes restoring this file" if side.kind == "target" and side.layer == TARGET \
            else ("the server aborts when it rolls back to this checkpoint" if not side.main
                  else "the server aborts restoring the draft state")
        effect = EFFECT_ABORTS if side.main else EFFECT_ABORTS_LATER
        ml.issues.append(_Issue(Finding(side.layer, "error", "load_aborted",
                                        f"llama.cpp aborted loading {side.what} into {side.context} ({why}): {what}",
                                        ml.span_offset), effect))
        if check.predicted == FITS:
            ml.issues.append(_disagree(ml, f"llama.cpp aborted, slotctl predicted that {side.what} fits"))
        return
    loaded_fits = status == FITS
    if not loaded_fits and status == REFUSED and check.predicted == MISMATCH:
        expected = _loader_reasons(ml)
        if expected and not any(r in why for r in expected):
            ml.issues.append(_disagree(ml, f"llama.cpp refused {side.what} for another reason ({why}) than "
                                           "slotctl predicted (" + ", ".join(sorted(expected)) + ")"))
        return
    if check.predicted is None:
        if not loaded_fits:
            ml.issues.append(_issue(side, "load_refused",
                                    f"llama.cpp refused {side.what} in {side.context} built with these flags: {why}",
                                    ml.span_offset))
        return
    if loaded_fits and check.predicted == MISMATCH:
        ml.issues.append(_disagree(ml, f"llama.cpp loaded {side.what} into {side.context}, slotctl predicted "
                                       "a mismatch"))
    elif not loaded_fits and check.predicted == FITS:
        if status == PARTIAL:
            said = (f"llama.cpp read {res['consumed']:,} of its {res['expected']:,} bytes (the server needs all "
                    "of them)")
        else:
            said = f"llama.cpp refused it ({why})"
        ml.issues.append(_disagree(ml, f"slotctl predicted that {side.what} fits {side.context}, {said}"))


#: what llama.cpp's loader (state version 3, this runtime) logs for each mismatch the prediction names
LOADER_REASONS = {
    "n_stream_mismatch": ("n_stream mismatch",),
    "too_many_cells": ("not enough cells",),
    "recurrent_cells": ("not enough cells",),
    "invalid_cell": ("invalid seq_id-agnostic kv cell",),
    "layer_count_mismatch": ("mismatched layer count",),
    "v_trans_mismatch": ("incompatible V transposition",),
    "k_rotation_mismatch": ("incompatible key rotation",),
    "v_rotation_mismatch": ("incompatible value rotation",),
    "k_type_mismatch": ("mismatched key type",),
    "k_row_size_mismatch": ("mismatched key row size",),
    "v_type_mismatch": ("mismatched value type",),
    "v_row_size_mismatch": ("mismatched value row size", "mismatched value element size",
                            "mismatched GQA embedding size"),
    "r_type_mismatch": ("mismatched r type",),
    "r_row_size_mismatch": ("mismatched r row size",),
    "s_type_mismatch": ("mismatched s type",),
    "s_row_size_mismatch": ("mismatched s row size",),
    "s_trans_mismatch": ("incompatible s transposition",),
}


def _loader_reasons(ml: _MemLayer) -> set[str]:
    """What llama.cpp may say refusing this layer, given the mismatches predicted for it; empty when a
    predicted problem (another memory kind, damage) could make it say anything."""
    reasons: set[str] = set()
    for i in ml.issues:
        if i.finding.severity == "note":
            continue
        known = LOADER_REASONS.get(i.finding.code)
        if known is None:
            return set()
        reasons.update(known)
    return reasons


def _disagree(ml: _MemLayer, message: str) -> _Issue:
    effect = EFFECT_ABORTS_LATER if not ml.side.main else ml.side.effect
    if ml.side.kind == "draft" and ml.side.main:
        effect = EFFECT_DROPPED
    return _Issue(Finding(ml.side.layer, "error", "prediction_disagrees", message, ml.span_offset), effect)
