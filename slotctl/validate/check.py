"""One file against one server setup: its memory layers located and compared with the prediction
(:mod:`slotctl.validate.compare`), the server's structural rules, the real check's requests, and the
verdict (the package's docstring tells the whole story)."""

from __future__ import annotations

import dataclasses
import os
from contextlib import nullcontext
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Sequence

from slotctl.sources import open_input, raise_failure, remote_url
from slotctl.errors import FormatError, UsageError, error_entry
from slotctl.server.findings import (Finding, ServerRules, checkpoints_read, invalid_tokens_finding,
                                     media_extents, structural_findings)
from slotctl.format.blob import FLAGS_NONE, FLAGS_PARTIAL_ONLY
from slotctl.format import ggml
from slotctl.format.cut import Cut, Expected, Extended, locate_cut
from slotctl.model.info import ModelInfo
from slotctl.model.predict import Prediction
from slotctl.server import builds
from slotctl.server.checkpoints import may_load, rolls_back
from slotctl.server.restore import cut_payload_outcome
from slotctl.slotfile import (Blob, SlotFile, is_checkpoint_layer, parse_blob, parse_memory,
                              read_for_layout, read_slot_file)
from slotctl.validate.child import ChildProcess, LoadChecker
from slotctl.validate.compare import (
    _checkpoint_side,
    _draft_side,
    _issue,
    _Issue,
    _MemLayer,
    _sections_for,
    _Side,
    _target_side,
    compare_memory,
)
from slotctl.validate.report import (
    DRAFT,
    EFFECT_ABORTS,
    EFFECT_ABORTS_LATER,
    EFFECT_DROPPED,
    EFFECT_OK,
    EFFECT_CORRUPT,
    EFFECT_OTHER_MODEL,
    EFFECT_REFUSED,
    EFFECT_UNDECIDED,
    FITS,
    MISMATCH,
    TARGET,
    FileReport,
    LayerCheck,
    Report,
    Verdict,
)
from slotctl.validate.load import _real_check
from slotctl.validate.setup import Models, ServerSetup
from slotctl.validate.speculative import speculative_findings
from slotctl.validate.wording import (ROLLBACK_HARMLESS, _kind_words, _part_words, _want_part_words,
                                     kind_mismatch_words)


# -- the layers of a file -----------------------------------------------------------------------------------


def validate_file(path: str | os.PathLike, setup: ServerSetup, models: Models | None = None,
                  checker: LoadChecker | None = None, *, f: BinaryIO | None = None,
                  confirm_refusals: bool = False, check_content: bool = False) -> FileReport:
    """Validate one slot file against ``setup`` (see the module docstring).

    ``models``: the setup's :class:`Models` (made here when None). ``checker``: a :class:`LoadChecker`
    for the real check, or None to predict only. OSError when the file cannot be read. The file is opened
    once: every later read (another layout, media chunks, a cut payload, the real load's bytes) uses it.
    ``path`` may be an object in a store (``s3://``, :mod:`slotctl.sources`); ``f``: the file already open.
    ``confirm_refusals``: the real check loads the layers the prediction refuses too (bounded; see
    :func:`slotctl.validate.load._real_check`), else it never does. A stored state's name (:mod:`slotctl.seal`)
    says which model it was stored for: another than the setup's is ``other_model``; ``check_content``: every
    byte of such a file read once and checked against the checksum in its name (``corrupt`` when it differs).
    """
    url = remote_url(path)
    path = url or os.fspath(path)
    skipped = url is not None and checker is not None
    if skipped:   # the child loads layers from a local path: an object would be downloaded whole
        checker = None
    with (nullcontext(f) if f is not None else open_input(path)) as f:
        report = _validate_open(f, path, setup, models or Models(setup), checker, confirm_refusals, check_content)
        raise_failure(f)   # a store that failed mid-read: its error (exit 2), not damage
    if skipped:
        report.findings.append(Finding("file", "note", "load_not_run_remote",
                                       "the real load is not run for an object in a store (it would download "
                                       "the whole object): the prediction decides; cp it to a local file to "
                                       "load it", None))
    return report


def _validate_open(f: BinaryIO, path: str, setup: ServerSetup, models: Models,
                   checker: LoadChecker | None, confirm_refusals: bool = False,
                   check_content: bool = False) -> FileReport:
    tinfo, dinfo = models.target, models.draft
    rules = ServerRules(state_version=setup.state_version, mmproj=setup.mmproj, build=setup.build)
    report = FileReport(path)
    model_parse = False     # whether the target payload parsed with the model's layout
    if tinfo is None:
        sf = read_slot_file(f, path)
    else:   # another memory kind: the layers located as the file is
        sf, model_parse = read_for_layout(f, path, tinfo.layout(), dinfo.layout() if dinfo else None)
    report.size, report.version, report.slot_file = sf.size, sf.version, sf
    tpred = dpred = None
    if tinfo is not None and sf.version is not None:
        tpred, dpred = models.predictions(sf.version)

    issues: list[_Issue] = []
    cut = None
    if tinfo is not None and not model_parse and sf.version == setup.state_version:
        cut = _payload_cut(sf, tinfo, tpred, f)
    if cut is not None:
        sf, cut_error = cut[1], cut[2]
        model_parse = sf.target is not None
    layers = _memory_layers(sf, f, model_parse, tinfo, dinfo, issues, models.draft_context.why, setup.build)
    explained = {id(e) for e in _explained_errors(sf, layers)}
    if cut is not None:
        explained.add(id(cut_error))
    structural = dataclasses.replace(sf, errors=[e for e in sf.errors if id(e) not in explained])
    by_layer = {ml.side.layer: ml for ml in layers}
    for found in structural_findings(structural, n_ctx_checkpoints=setup.n_ctx_checkpoints, server=rules, f=f):
        if tinfo is None and found.layer == TARGET and found.code == "damaged" and sf.target is None:
            found = _undecided(found, sf.payload_cut)
        if found.code == "draft_dropped" and any(i.finding.code == "no_draft_context" for i in issues):
            continue    # dropped for want of a draft context already: one finding
        issue = _Issue(found, _structural_effect(found, setup))
        ml = by_layer.get(found.layer)
        (ml.issues if ml is not None else issues).append(issue)

    # prediction: what the loader checks, then anything else that keeps the layer out
    for ml in layers:
        pred, info = (tpred, tinfo) if ml.side.kind == "target" else (dpred, dinfo)
        if pred is not None and ml.memory is not None:
            ml.issues += compare_memory(ml.memory, _sections_for(ml.memory.layout, pred), ml.side, setup, info)
            ml.check.predicted = FITS
        if any(i.finding.severity != "note" for i in ml.issues):
            ml.check.predicted = MISMATCH
    if tpred is not None:
        issues += _token_issues(sf, tpred, tinfo, setup)
    if tinfo is not None and (sf.draft_spec is not None or sf.checkpoints):
        issues += [_Issue(sp, EFFECT_DROPPED if sp.severity == "drop" else EFFECT_OK)
                   for sp in speculative_findings(sf, f, tinfo, dinfo, models.draft_context.types)]

    if cut is not None:
        issues += _cut_issues(cut[0], layers[0] if layers and layers[0].side.layer == TARGET else None)

    # the real check
    if checker is not None and tinfo is not None:
        issues += _real_check(layers, checker, sf, f, setup, tpred, dpred, issues, confirm_refusals)

    kind = tinfo.layout().kind if tinfo is not None else (sf.target.layout.kind if sf.target else None)
    from slotctl.server.reuse import server_n_swa

    n_swa = server_n_swa(tinfo, swa_full=setup.settings.swa_full) if tinfo is not None else 0
    issues = _weigh_rollback(issues, kind, n_swa, sf, setup.build)
    for ml in layers:
        ml.issues = _weigh_rollback(ml.issues, kind, n_swa, sf, setup.build)
        issues += ml.issues
        worst = [i.effect for i in ml.issues if i.finding.severity != "note"]
        ml.check.effect = _worst_effect(worst)
        report.checks.append(ml.check)
    shared = _unified_cache_note(sf, setup, tpred)
    if shared is not None:
        issues.append(_Issue(shared, EFFECT_OK))
    issues += _seal_issues(path, f, setup, models, check_content)
    report.findings = [i.finding for i in issues]
    report.effects = [i.effect for i in issues if i.finding.severity != "note" or i.effect == EFFECT_UNDECIDED]
    report.verdict = _verdict(report.effects)
    report.uncertain = _doubts(issues, report.verdict)
    report.steps = _predict_steps(sf, report, setup)
    report.build = setup.build
    if sf.tokens is not None and sf.tokens.error is None:
        report.n_tokens = sf.tokens.n_tokens
    if report.verdict in ("restores", "restores_with_drops") and sf.target is not None:
        from slotctl.server.reuse import reuse_for

        r = reuse_for(sf, tinfo, swa_full=setup.settings.swa_full, n_ctx_checkpoints=setup.n_ctx_checkpoints,
                      build=setup.build)
        report.reuse = r.as_dict() if r is not None else None
    return report


#: the layers whose refusal or abort the server meets first: a certain one there settles the verdict
_FIRST_LAYERS = ("state header", "token words", TARGET, "file")


def _unified_cache_note(sf: SlotFile, setup: ServerSetup, tpred: Prediction | None) -> Finding | None:
    """With -kvu and more than one slot the slots share one cache: a file's cells fit it as judged (empty of
    other slots' cells); the server refuses the file when the other slots hold more than the rest
    (``llama_kv_cache`` ``find_slot``: "failed to find N available cells"; measured on b11669, issue 35)."""
    s = setup.settings
    if tpred is None or not s.kv_unified or s.n_parallel < 2 or sf.target is None or not sf.target.sections:
        return None
    sec = sf.target.sections[0]
    if getattr(sec, "streams", None) is None:
        return None
    cells = sum(st.cell_count for st in sec.streams)
    if not cells:
        return None
    room = tpred.n_ctx - cells
    return Finding(TARGET, "note", "unified_cache_shared",
                   f"with -kvu the {s.n_parallel} slots share one cache of {tpred.n_ctx:,} cells: this file's "
                   f"{cells:,} cells fit it judged empty of the other slots' cells; the server refuses the file "
                   f"(\"failed to find {cells:,} available cells\") when the other slots hold more than {room:,} "
                   "cells at the restore", sf.target.offset)


def _doubts(issues: list[_Issue], verdict: str) -> list[str]:
    """Why ``verdict`` is not settled by the sources (each finding's ``doubt``, once each); none when a
    finding that is certain refuses the file, or makes the server abort, at a step the server meets
    before any doubtful one (the header, the tokens, the target memory)."""
    effect = {"refused": EFFECT_REFUSED, "aborts": EFFECT_ABORTS}.get(verdict)
    if effect is not None and any(i.effect == effect and i.finding.doubt is None and i.finding.severity != "note"
                                  and i.finding.layer in _FIRST_LAYERS for i in issues):
        return []
    return list(dict.fromkeys(i.finding.doubt for i in issues if i.finding.doubt))


def _predict_steps(sf: SlotFile, report: FileReport, setup: ServerSetup) -> list[dict]:
    """What each step of the server's restore does with the file, in the words ``slotctl restore`` reports
    them (``step``, ``status``; checkpoints: ``count`` and ``kept``): target (``llama_state_seq_load_file``),
    tokens (the server's checks), checkpoints (``load_slot_checkpoints``), draft (``load_slot_draft``)."""
    errs = [f for f in report.findings if f.severity != "note"]
    head = {"state header", TARGET, "file"}
    if report.verdict in ("aborts", "undecided", "unreadable") and not any(
            f.layer == "token words" for f in errs):
        return [{"step": "target", "status": report.verdict}]
    if any(f.layer in head for f in errs if f.code != "prediction_disagrees") and report.verdict == "refused":
        return [{"step": "target", "status": "refused"}]
    steps = [{"step": "target", "status": "restored"}]
    if report.verdict == "refused":
        return steps + [{"step": "tokens", "status": "refused"}]
    steps.append({"step": "tokens", "status": "restored"})
    codes = {f.code for f in report.findings}
    rules = builds.get(setup.build)
    if not rules.reads_checkpoints:     # b11434: the target and the tokens only
        return steps + [{"step": "checkpoints", "status": "ignored" if sf.sckp else "absent", "count": 0, "kept": 0},
                        {"step": "draft", "status": "ignored" if sf.sdft else "absent"}]
    ignored = not checkpoints_read(sf)
    if ignored:
        steps.append({"step": "checkpoints", "status": "ignored", "count": 0, "kept": 0})
    elif sf.checkpoints is None:
        steps.append({"step": "checkpoints", "status": "absent", "count": 0, "kept": 0})
    else:
        n = len(sf.checkpoints)
        steps.append({"step": "checkpoints", "status": "restored", "count": n,
                      "kept": min(n, setup.n_ctx_checkpoints)})
    if ignored or sf.sdft is None:
        status = "ignored" if "draft_damaged" in codes and not ignored else "absent"
    elif codes & {"no_draft_context", "draft_dropped"} or any(
            c.layer == DRAFT and c.effect in (EFFECT_DROPPED, EFFECT_REFUSED) for c in report.checks):
        status = "dropped"
    else:
        status = "restored"
    steps.append({"step": "draft", "status": status})
    return steps


def _payload_cut(sf: SlotFile, tinfo: ModelInfo, tpred: Prediction | None,
                 f: BinaryIO) -> tuple[Cut, SlotFile, FormatError] | None:
    """When the file ends inside the target payload (read with the model's layout): where, in b11434's
    loader's fields (:func:`slotctl.format.cut.locate_cut`), the file with the payload completed as the
    loader sees it when every variable the file did not fill holds what the context expects (its best
    case: a mismatch left is one the file's own bytes make), and the parse error the cut explains."""
    err = next((e for e in sf.errors if e.part == "target memory"), None)
    if err is None or sf.header_end is None or sf.version is None or sf.target is not None:
        return None
    layout = tinfo.layout()
    cut = locate_cut(f, sf.header_end, sf.size, layout, sf.version,
                     _expected(tpred) if tpred is not None else None)
    if cut is None:
        return None
    target = None
    if cut.completion is not None and tpred is not None:
        ext = Extended(f, sf.size, cut.completion)
        try:
            target = parse_memory(ext, sf.header_end, ext.end, layout, sf.version)
        except FormatError:
            target = None
    return cut, dataclasses.replace(sf, target=target), err


def _expected(pred: Prediction) -> Expected:
    """What the loader's context holds for each field :func:`~slotctl.format.cut.locate_cut` completes."""

    def expected(key: str, section: int, record: int | None) -> int | None:
        if section >= len(pred.sections):
            return None
        sp = pred.sections[section]
        whole = {"n_stream": sp.n_stream, "cell_count": sp.cells_per_stream, "v_trans": sp.v_trans,
                 "n_layer": sp.n_layer, "n_rot_k": sp.n_rot_k, "n_rot_v": sp.n_rot_v, "s_trans": 0}
        if key in whole:
            return whole[key]
        if record is None or record >= len(sp.layers):
            return None
        lp = sp.layers[record]
        k_type = ggml.BY_NAME[lp.k_type].id
        v_type = ggml.BY_NAME[lp.v_type].id if lp.v_type else None
        return {"k_type": k_type, "k_row_size": lp.k_row_size, "v_type": v_type, "v_row_size": lp.v_row_size,
                "v_el_size": lp.v_el_size, "n_embd_v_gqa": lp.n_embd_v_gqa,
                "r_type": k_type, "r_row_size": lp.k_row_size, "s_type": v_type, "s_row_size": lp.v_row_size,
                }.get(key)

    return expected


def _cut_issues(cut: Cut, target: _MemLayer | None) -> list[_Issue]:
    """What b11434 does with a file whose target payload its loader reads past the end of
    (:func:`slotctl.server.restore.cut_payload_outcome`), as a finding on the target memory. A check the
    file's own bytes fail, met in the loader's order before any check of what the file never filled,
    decides: refused, for certain (the finding is named for that check). Else the checks before the end (and
    of the bytes the file holds of the field the end falls in) are the comparison's issues already. Not
    certain, and then the worst, when the loader checks what the file never filled."""
    if target is None:
        return []
    if not cut.before_end:
        target.no_load = ("the file ends inside the payload; this runtime's loader reads a buffer and stops at "
                          "its end, b11434's file loader reads on past it: not comparable")
    if cut.before_end:
        got = cut_payload_outcome(cut.describe(), cut.offset, fits=False, settled=True, refuses=cut.refuses,
                                  first=cut.at)
        return [_Issue(Finding(TARGET, "error", cut.code or "payload_cut", got.reason, cut.at), EFFECT_REFUSED)]
    blocking = any(i.finding.severity != "note" for i in target.issues)
    unparsed = cut.refuses is None and target.memory is None    # the completion did not parse: not settled
    got = cut_payload_outcome(cut.describe(), cut.offset, fits=not blocking, settled=cut.settled and not unparsed,
                              refuses=cut.refuses)
    finding = Finding(TARGET, "error", "payload_cut", got.reason, cut.offset, doubt=got.doubt)
    if got.status == "aborts":
        return [_Issue(finding, EFFECT_ABORTS)]
    if blocking:     # the mismatch refuses it already
        return [_Issue(dataclasses.replace(finding, severity="note"), EFFECT_OK)]
    return [_Issue(finding, EFFECT_REFUSED)]


def _memory_layers(sf: SlotFile, f: BinaryIO, model_parse: bool, tinfo: ModelInfo | None,
                   dinfo: ModelInfo | None, issues: list[_Issue], no_draft: str | None = None,
                   build: str = builds.NEWEST) -> list[_MemLayer]:
    """The memory layers of ``sf`` to check, each parsed with its model's layout when there is a model
    (``model_parse``: the target payload was; else it is of another kind, or there is no model)."""
    out: list[_MemLayer] = []
    if sf.version is None:
        return out
    tside = _target_side()
    located = sf.target
    if located is not None:
        # parsed with the model's layout, or with the layout of another kind
        mem = located if model_parse else None
        ml = _MemLayer(tside, LayerCheck(TARGET, located.offset, located.size, "target"),
                       located.offset, located.size, False, FLAGS_NONE, mem, located.layout)
        if tinfo is not None and mem is None:
            ml.issues.append(_issue(tside, "memory_kind_mismatch", kind_mismatch_words(located.layout, tinfo),
                                    located.offset))
        out.append(ml)
    elif sf.header_end is not None:
        # the payload does not parse: llama.cpp is given the rest of the file, as the server gives it
        out.append(_MemLayer(tside, LayerCheck(TARGET, sf.header_end, sf.size - sf.header_end, "target"),
                             sf.header_end, sf.size - sf.header_end, False, FLAGS_NONE, None, None,
                             prefix=True))
    if not checkpoints_read(sf) or not builds.get(build).reads_checkpoints:
        return out    # the server reads neither the checkpoints nor the draft state behind them
    with nullcontext(f):
        for i, c in enumerate(sf.checkpoints or ()):
            for kind, blob, info in (("target", c.tgt, tinfo), ("draft", c.dft, dinfo)):
                if blob.span.size == 0:
                    continue
                side = _checkpoint_side(i, kind, build)
                if kind == "draft" and info is None and tinfo is not None:
                    continue  # the server has no draft context: load_dft ignores the blob
                out.append(_blob_layer(f, sf, blob, side, info, FLAGS_PARTIAL_ONLY, partial=True, build=build))
        if sf.draft is not None and sf.draft.span.size:
            side = _draft_side()
            if tinfo is not None and dinfo is None:
                why = (no_draft if no_draft and not no_draft.startswith("no draft model")
                       else "the server has no draft model; give -md (and --spec-type) to check it against one")
                issues.append(_issue(side, "no_draft_context",
                                     f"the file holds a draft state ({sf.draft.span.size:,} bytes) and the server "
                                     f"has no draft context: it drops it (\"does not match the draft context\"): "
                                     f"{why}", sf.draft.span.offset))
            else:
                out.append(_blob_layer(f, sf, sf.draft, side, dinfo, FLAGS_NONE, partial=False))
    return out


def _blob_layer(f, sf: SlotFile, blob: Blob, side: _Side, info: ModelInfo | None, flags: int,
                partial: bool, build: str = builds.NEWEST) -> _MemLayer:
    check = LayerCheck(side.layer, blob.span.offset, blob.span.size, side.kind)
    ml = _MemLayer(side, check, blob.span.offset, blob.span.size, True, flags, None, None)
    if info is None:
        ml.parsed_layout = blob.memory.layout if blob.memory else None
        return ml
    want = info.layout().partial() if partial else info.layout()
    if partial and want.kind == "kv" and builds.get(build).partial_plain_kv == "header":
        return _header_only_layer(f, sf, blob, side, ml, build)
    mine = blob if blob.memory is not None and blob.memory.layout == want \
        else parse_blob(f, blob.span, want, sf.version, side.layer)
    if mine.memory is not None and mine.error is None:
        ml.memory, ml.parsed_layout = mine.memory, want
        return ml
    # the model's layout does not parse it: which kind of memory is it?
    other = parse_blob(f, blob.span, None, sf.version, side.layer, partial=partial)
    if other.header_only:
        ml.issues.append(_issue(side, "memory_kind_mismatch",
                                f"{side.what} is the blob header alone (a plain KV cache's PARTIAL_ONLY state), but "
                                f"{Path(info.path).name} ({info.arch}) keeps {_want_part_words(info)} there: the "
                                f"file was saved with another {side.model_word} (give {side.model_flag} the one it "
                                "was saved with)", blob.span.offset))
        ml.no_load = HEADER_ONLY_NOT_LOADED
        ml.check.predicted = MISMATCH
    elif other.memory is not None or other.candidates:
        ml.parsed_layout = other.memory.layout if other.memory else None
        words = _part_words if partial else _kind_words
        got = " or ".join(sorted({words(c) for c in ([other.memory.layout] if other.memory
                                                      else other.candidates)}))
        keeps = _want_part_words(info) if partial else _kind_words(info.layout())
        ml.issues.append(_issue(side, "memory_kind_mismatch",
                                f"{side.what} is {got}, but {Path(info.path).name} ({info.arch}) keeps "
                                f"{keeps} there: the file was saved with another "
                                f"{side.model_word} (give {side.model_flag} the one it was saved with)",
                                blob.span.offset))
    return ml


#: why validate's real load skips a PARTIAL_ONLY blob of a plain KV cache
HEADER_ONLY_NOT_LOADED = ("a PARTIAL_ONLY blob of a plain KV cache: libllama b11434 and later write and read the "
                          "blob header alone there (8 bytes), this runtime's llama.cpp (llama-cpp-python 0.3.36) the "
                          "whole cache: not comparable")


def _header_only_layer(f, sf: SlotFile, blob: Blob, side: _Side, ml: _MemLayer, build: str) -> _MemLayer:
    """A checkpoint blob of a context whose memory is a plain KV cache, for a build whose libllama writes the
    blob header alone for its PARTIAL_ONLY state and reads exactly those 8 bytes back (b11434, b11669): the
    blob fits when it is that header; a blob of the whole cache (what llama-cpp-python 0.3.36 writes) reads
    short (8 of its bytes), which b11669 drops for a draft blob on restore and fails to load for a target
    blob when it goes back to the checkpoint."""
    ml.no_load = HEADER_ONLY_NOT_LOADED
    mine = blob if blob.header_only else parse_blob(f, blob.span, None, sf.version, side.layer, partial=True)
    if mine.header_only:
        ml.check.predicted = FITS
        return ml
    ml.check.predicted = MISMATCH
    ml.issues.append(_issue(side, "partial_blob_whole_cache",
                            f"{side.what} holds {blob.span.size:,} bytes where llama-server {build}'s context reads "
                            "the blob header alone (8 bytes: libllama b11434 and later write a plain KV cache's "
                            "PARTIAL_ONLY state so; llama-cpp-python 0.3.36 writes the whole cache): the sizes "
                            "differ", blob.span.offset))
    return ml


def _explained_errors(sf: SlotFile, layers: list[_MemLayer]) -> list[FormatError]:
    """Parse errors that are memory-kind mismatches, reported as such rather than as damage."""
    explained_layers = {ml.side.layer for ml in layers
                        if any(i.finding.code == "memory_kind_mismatch" for i in ml.issues)}
    out = []
    for e in sf.errors:
        name = e.part or e.layer
        name = {"SDFT draft blob": DRAFT}.get(name, name.removesuffix(" blob"))
        if name in explained_layers:
            out.append(e)
    return out


def _undecided(f: Finding, cut: bool) -> Finding:
    """Without the model the payload's end is known only when exactly one layout ends where the file or an
    appendix does: otherwise what the server does (restore, refuse, abort) depends on the model. When no
    known layout even fits within the file, the payload is cut short: refused or aborts, never restored."""
    what = ("no known layout fits within the file: the payload is cut short, so the server refuses this file "
            "or aborts on it (which depends on the model and flags)" if cut else
            "without the model slotctl cannot tell where the target memory ends, so whether the server "
            "restores this file, refuses it or aborts on it is not decided here")
    return Finding(TARGET, "note", "undecided",
                   f"{f.message.removesuffix(' (give --model to name the layout)')}: {what}; give -m (and the "
                   "server's flags)", f.offset)


def _structural_effect(f: Finding, setup: ServerSetup) -> str:
    if f.code == "undecided":
        return EFFECT_UNDECIDED
    if f.severity == "note":
        return EFFECT_OK
    if f.severity == "drop":
        return EFFECT_DROPPED
    if is_checkpoint_layer(f.layer):
        return EFFECT_ABORTS_LATER
    if f.code == "recurrent_cells" and f.layer == TARGET and setup.target is not None \
            and setup.settings.n_parallel > 1:
        return EFFECT_ABORTS
    return EFFECT_REFUSED


def _weigh_rollback(issues: list[_Issue], kind: str | None, n_swa: int, sf: SlotFile,
                    build: str = builds.NEWEST) -> list[_Issue]:
    """A checkpoint blob that does not fit is kept (the appendix loader checks only lengths) and the file
    restores; the hazard is the rollback to it (``GGML_ABORT("checkpoint size mismatch")``): an error
    where some request makes the server load that checkpoint (:func:`slotctl.server.checkpoints.may_load`),
    a note where none does. b11669 (measured) never aborts there: a draft blob is dropped on restore, a
    target blob fails to load where a request goes back to it and the prompt is evaluated again (a drop
    where some request does, a note where none does)."""
    if not builds.get(build).aborts_on_bad_checkpoint:
        return [_weigh_dropped(i, kind, n_swa, sf) for i in issues]
    out = []
    for i in issues:
        if i.effect != EFFECT_ABORTS_LATER or i.finding.severity == "note":
            out.append(i)
            continue
        cp = _checkpoint_of(sf, i.finding.layer)
        if kind is None or cp is None or may_load(kind, n_swa, cp.pos_min, cp.pos_max):
            edge = kind is not None and cp is not None and not rolls_back(kind, n_swa)
            why = ("the file restores with it; the server aborts (GGML_ABORT(\"checkpoint size mismatch\")) when "
                   + ("a request of one token, the slot's first, makes it go back to this checkpoint (positions "
                      f"{cp.pos_min}..{cp.pos_max}: the only rollback a memory that starts at 0 makes)" if edge
                      else "a request makes it roll back to this checkpoint")
                   + ("" if kind else " (give -m: a plain KV cache rolls back to few checkpoints)"))
            f = dataclasses.replace(i.finding, message=f"{i.finding.message}; {why}")
        else:
            f = dataclasses.replace(i.finding, severity="note", message=f"{i.finding.message}; {ROLLBACK_HARMLESS}")
        out.append(_Issue(f, i.effect))
    return out


def _weigh_dropped(i: _Issue, kind: str | None, n_swa: int, sf: SlotFile) -> _Issue:
    """b11669's rule for one issue of a checkpoint blob (see :func:`_weigh_rollback`)."""
    f = i.finding
    cp = _checkpoint_of(sf, f.layer) if is_checkpoint_layer(f.layer) else None
    if cp is None or f.severity == "note" or i.effect != EFFECT_DROPPED:
        return i
    if f.layer.endswith("draft"):
        if "does not match the draft context - dropped" in f.message:
            return i
        return _Issue(dataclasses.replace(f, message=f"{f.message}: the server drops this draft blob when it restores "
                                          "the file (\"draft context checkpoint data ... does not match the draft "
                                          "context - dropped\") and keeps the checkpoint without it"), i.effect)
    if kind is not None and not may_load(kind, n_swa, cp.pos_min, cp.pos_max):
        return _Issue(dataclasses.replace(f, severity="note", message=f"{f.message}; {ROLLBACK_HARMLESS}"), EFFECT_OK)
    return _Issue(dataclasses.replace(f, message=f"{f.message}; the file restores with it, and a request that goes "
                                      "back to this checkpoint fails to load it (\"failed to load context checkpoint "
                                      "restored from a slot file\"): the server evaluates the whole prompt again"),
                  i.effect)


def _checkpoint_of(sf: SlotFile, layer: str):
    """The checkpoint a layer named "checkpoint N target|draft|speculative" belongs to, or None."""
    parts = layer.split()
    if len(parts) >= 2 and parts[0] == "checkpoint" and parts[1].isdigit() and sf.checkpoints:
        n = int(parts[1])
        return sf.checkpoints[n] if n < len(sf.checkpoints) else None
    return None


def _seal_issues(path: str, f: BinaryIO, setup: ServerSetup, models: Models, check_content: bool) -> list[_Issue]:
    """What a stored state's name (:mod:`slotctl.seal`: the model's content identity, the draft model's for a
    draft state, its checksum) says against the setup: the target model given another (``other_model``), the
    draft context's model another, or not known when it was stored; with ``check_content``, bytes other than
    the ones stored (``corrupt``). None for any other name (which model wrote it is not recorded)."""
    from slotctl.seal import UNKNOWN_DRAFT, checksum, parse_name

    said = parse_name(path.rpartition("/")[2])
    if said is None or not said.sealed:
        return []
    out = []
    if setup.target is not None:
        from slotctl.model.content import model_content

        target = model_content(setup.target)
        if said.model != target.short:
            out.append(_Issue(Finding("file", "error", "other_model",
                                      f"stored for model {said.model} (its name), and -m is model {target.short} by "
                                      f"its content: restored, it would answer as neither", None), EFFECT_OTHER_MODEL))
        if said.draft is not None and models.draft_context.built and setup.draft is not None:
            draft = model_content(setup.draft)
            if said.draft == UNKNOWN_DRAFT:
                why = "its draft state is of a draft model that was not known when it was stored"
            elif said.draft != draft.short:
                why = f"its draft state is of draft model {said.draft}, and -md is model {draft.short}"
            else:
                why = None
            if why is not None:
                out.append(_Issue(Finding("file", "error", "other_draft_model", why, None), EFFECT_OTHER_MODEL))
    if check_content:
        got = checksum(f)
        if not got.startswith(said.checksum):
            out.append(_Issue(Finding("file", "error", "checksum_mismatch",
                                      f"its bytes are not the state that was stored (checksum {got[:16]}, stored as "
                                      f"{said.checksum}): damaged since", None), EFFECT_CORRUPT))
    return out


def _worst_effect(effects: Iterable[str]) -> str:
    order = [EFFECT_OK, EFFECT_DROPPED, EFFECT_ABORTS_LATER, EFFECT_REFUSED, EFFECT_ABORTS]
    return max(effects, key=order.index, default=EFFECT_OK)


def _verdict(effects: list[str]) -> Verdict:
    """The target decides first: a refused or aborting target leaves nothing else to restore. Then what is
    restored but is not the state stored, or not the model's."""
    if EFFECT_ABORTS in effects:
        return Verdict.ABORTS
    if EFFECT_REFUSED in effects:
        return Verdict.REFUSED
    if EFFECT_CORRUPT in effects:
        return Verdict.CORRUPT
    if EFFECT_OTHER_MODEL in effects:
        return Verdict.OTHER_MODEL
    if EFFECT_UNDECIDED in effects:
        return Verdict.UNDECIDED
    if EFFECT_DROPPED in effects:
        return Verdict.RESTORES_WITH_DROPS
    return Verdict.RESTORES


def _token_issues(sf: SlotFile, tpred: Prediction, tinfo: ModelInfo, setup: ServerSetup) -> list[_Issue]:
    """The checks the server makes after restoring the target (b11434 ``SERVER_TASK_TYPE_SLOT_RESTORE``)."""
    tk = sf.tokens
    if tk is None or tk.error is not None:
        return []
    side = _Side("token words", "the prompt", "target", "error", EFFECT_REFUSED)
    out: list[_Issue] = []
    n = tk.n_tokens
    if n > tpred.n_ctx_slot:
        s = setup.settings
        if tpred.n_ctx_slot == tinfo.n_ctx_train and tpred.n_ctx_seq > tinfo.n_ctx_train:
            remedy = (f"the model's training context ({tinfo.n_ctx_train:,} tokens) caps the slot: the file was "
                      "saved with another model")
        elif s.kv_unified_per_slot and tpred.n_ctx_slot == s.kv_unified_per_slot:
            remedy = f"raise --kv-unified-per-slot to {n:,} or more"
        else:
            need = n if s.kv_unified else n * s.n_parallel
            remedy = f"raise -c to {need:,} or more" + (", or lower -np" if s.n_parallel > 1 and not s.kv_unified
                                                        else "")
        out.append(_issue(side, "prompt_too_long",
                          f"the prompt has {n:,} tokens, the slot context {tpred.n_ctx_slot:,} (\"Restored prompt "
                          f"does not fit in the slot context\"): {remedy}", 12))
    bad = invalid_tokens_finding(tk.tokens, tinfo.n_vocab, media_extents(sf), Path(tinfo.path).name)
    if bad is not None:
        out.append(_Issue(bad, EFFECT_REFUSED))
    return out


# -- many files -------------------------------------------------------------------------------------------


def validate_paths(paths: Sequence[str | os.PathLike], setup: ServerSetup, *, real_check: bool = True,
                   verbose: bool = False, on_file: Callable[[int, int, str], None] | None = None,
                   on_report: Callable[[FileReport], None] | None = None,
                   child: ChildProcess | None = None, confirm_refusals: bool = False,
                   check_content: bool = False) -> Report:
    """Validate every file of ``paths`` (directories expanded to their slot files) against ``setup``.

    The real check runs when there is a target model and ``real_check``: one child process for all
    files (a new one after an abort). ``on_file(done, total, path)`` is called before each file,
    ``on_report(report)`` after it. A file that cannot be read is an "unreadable" report; the others
    are still validated. ``child``: a :class:`ChildProcess` to run the real check in (left open),
    instead of a new one. ``confirm_refusals``, ``check_content``: see :func:`validate_file`.
    """
    from slotctl.inputs import expand_slot_paths

    files = expand_slot_paths(paths, follow_symlinks=True).files
    models = Models(setup)
    own = checker = None
    if real_check and setup.target is not None:
        own = checker = LoadChecker(setup, verbose=verbose, child=child)
    reports = []
    try:
        for i, p in enumerate(files):
            if on_file:
                on_file(i, len(files), p)
            try:
                reports.append(validate_file(p, setup, models, checker, confirm_refusals=confirm_refusals,
                                             check_content=check_content))
            except (OSError, UsageError) as e:
                err = error_entry(e, p)
                r = FileReport(p, verdict=Verdict.UNREADABLE, error=err.as_dict())
                r.findings.append(Finding("file", "error", "unreadable", err.message, None))
                reports.append(r)
            if on_report:
                on_report(reports[-1])
    finally:
        if own is not None:
            own.close()
    server = models.describe()
    return Report(reports, setup, server, checker is not None)
