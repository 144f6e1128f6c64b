"""A memory layer of a file against what the model and flags predict, compared the way llama.cpp's loader
compares (``state_read_meta`` / ``state_read_data``): stream counts, cells, ``v_trans``, rotations, each
layer's record types and sizes. Each difference is an issue: a finding, with the remedy, and what the
server does with the layer (its effect).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from slotctl.format import ggml
from slotctl.format.memory import MemoryLayout, SectionLayout
from slotctl.model.info import ModelInfo
from slotctl.model.predict import Prediction, SectionPrediction
from slotctl.server import builds
from slotctl.server.findings import Finding
from slotctl.server.flags import MAX_PARALLEL
from slotctl.slotfile import Memory, checkpoint_layer, is_checkpoint_layer
from slotctl.validate.report import (
    LayerCheck,
    DRAFT,
    EFFECT_ABORTS_LATER,
    EFFECT_DROPPED,
    EFFECT_OK,
    EFFECT_REFUSED,
    TARGET,
)
from slotctl.validate.setup import ServerSetup
from slotctl.validate.wording import _layers_text, _plural

# -- the sides of a comparison ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Side:
    """How a memory layer and its context are named in messages, and the flags that change them."""

    layer: str          # Finding.layer
    what: str           # "the target memory"
    kind: str           # "target" / "draft": the context
    severity: str       # of a mismatch
    effect: str         # of a mismatch

    @property
    def context(self) -> str:
        return f"the {self.kind} context"

    @property
    def model_flag(self) -> str:
        return "-m" if self.kind == "target" else "-md"

    @property
    def model_word(self) -> str:
        return "model" if self.kind == "target" else "draft model"

    def type_flag(self, kv: str) -> str:
        return {("target", "K"): "-ctk", ("target", "V"): "-ctv",
                ("draft", "K"): "-ctkd", ("draft", "V"): "-ctvd"}[(self.kind, kv)]

    @property
    def main(self) -> bool:
        """The target payload or the SDFT draft state (not a checkpoint blob)."""
        return not is_checkpoint_layer(self.layer)

    def prefix(self, label: str) -> str:
        """What a message starts with to say where: nothing for a one-section target or draft state."""
        return "" if self.main and label == self.what else f"{label}: "


def _target_side() -> _Side:
    return _Side(TARGET, "the target memory", "target", "error", EFFECT_REFUSED)


def _draft_side() -> _Side:
    return _Side(DRAFT, "the draft state", "draft", "drop", EFFECT_DROPPED)


def _checkpoint_side(i: int, kind: str, build: str = builds.NEWEST) -> _Side:
    """A checkpoint's blob: a mismatch is an abort when the server goes back to it (the reading of 033df86b6,
    b11434's rules), a drop for b11669 (measured: :mod:`slotctl.server.builds`)."""
    if builds.get(build).aborts_on_bad_checkpoint:
        return _Side(checkpoint_layer(i, kind), f"checkpoint {i}'s {kind} blob", kind, "error", EFFECT_ABORTS_LATER)
    return _Side(checkpoint_layer(i, kind), f"checkpoint {i}'s {kind} blob", kind, "drop", EFFECT_DROPPED)


@dataclass
class _Issue:
    finding: Finding
    effect: str


def _issue(side: _Side, code: str, message: str, offset: int | None) -> _Issue:
    return _Issue(Finding(side.layer, side.severity, code, message, offset), side.effect)


# -- prediction vs file -----------------------------------------------------------------------------------


@dataclass
class _MemLayer:
    """A memory layer to compare and load: the target payload or a blob."""

    side: _Side
    check: LayerCheck
    span_offset: int            # where the bytes to load start (payload: after the header)
    span_size: int
    is_blob: bool               # the bytes start with a blob header (else one is made for the payload)
    flags: int
    memory: Memory | None       # parsed with the model's layout
    parsed_layout: MemoryLayout | None   # the layout that parsed the bytes (the model's, or another kind)
    prefix: bool = False        # the layer's end is unknown: loading a prefix of the bytes is a success
    no_load: str | None = None  # why the real check cannot load this layer
    issues: list[_Issue] = field(default_factory=list)


def compare_memory(mem: Memory, preds: Sequence[SectionPrediction], side: _Side,
                   setup: ServerSetup, model: ModelInfo) -> list[_Issue]:
    """What llama.cpp's loader would reject in ``mem``, restored into a context predicted by ``preds``
    (one per section of ``mem``), named in plain words with the remedy."""
    issues: list[_Issue] = []
    many = len(mem.sections) > 1
    for sl, sec, p, span in zip(mem.layout.sections, mem.sections, preds, mem.section_spans):
        label = f"{side.what} ({sl.describe()} section)" if many else side.what
        if sec.type == "kv":
            issues += _compare_kv(sec, p, sl, span.offset, label, side, setup, model)
        else:
            issues += _compare_recurrent(sec, p, span.offset, label, side, model)
    return issues


def _cells_remedy(p: SectionPrediction, cells: int, setup: ServerSetup) -> str:
    s = setup.settings
    if p.role == "swa":
        return "raise -c or -ub, or start the server with --swa-full"
    need = cells if s.kv_unified else cells * s.n_parallel
    remedy = f"raise -c to {need:,} or more"
    if s.n_parallel > 1 and not s.kv_unified:
        remedy += ", or lower -np"
    return remedy


def _compare_kv(sec, p: SectionPrediction, sl: SectionLayout, offset: int, label: str, side: _Side,
                setup: ServerSetup, model: ModelInfo) -> list[_Issue]:
    out: list[_Issue] = []
    s = setup.settings
    if sec.n_stream != p.n_stream:
        if not 1 <= sec.n_stream <= MAX_PARALLEL:   # no -np makes that many streams: the count is damaged
            remedy = f"no server is started with -np {sec.n_stream:,} (1 to {MAX_PARALLEL}): the count is damaged"
        elif p.n_stream == 1:
            remedy = (f"start the server with -np {sec.n_stream} and without -kvu" if s.kv_unified
                      else f"start the server with -np {sec.n_stream}")
        elif sec.n_stream == 1:
            remedy = "start the server with -kvu (one stream for all slots), or with -np 1"
        else:
            remedy = f"start the server with -np {sec.n_stream}"
        if sec.n_stream >= 1 and sum(st.cell_count > 0 for st in sec.streams) <= 1:   # a slot's save: convert rewrites it
            remedy += (f", or convert the file: slotctl convert FILE -o OUT -np {s.n_parallel}"
                       + (" -kvu" if s.kv_unified else ""))
        out.append(_issue(side, "n_stream_mismatch",
                          f"{label} has {_plural(sec.n_stream, 'KV stream')}, {side.context} "
                          f"{p.n_stream:,}: {remedy}", offset))
    streams = [st for st in sec.streams if st.cell_count > 0]
    big = max(streams, key=lambda st: st.cell_count, default=None)
    if big is not None and big.cell_count > p.cells_per_stream:
        cache = "SWA cache" if p.role == "swa" else "context"
        per = " per stream" if p.n_stream > 1 else ""
        out.append(_issue(side, "too_many_cells",
                          f"{side.prefix(label)}{big.cell_count:,} cells do not fit a {p.cells_per_stream:,}-cell "
                          f"{side.kind} {cache}{per}: {_cells_remedy(p, big.cell_count, setup)}", offset))
    if p.role == "swa" and p.window and model.swa_type == "standard":
        out += _swa_window_notes(streams, p.window, label, side, offset)
    seen: set[str] = set()
    for st in streams:
        for issue in _compare_kv_data(st.data, p, label, side, setup):
            if issue.finding.code not in seen:
                seen.add(issue.finding.code)
                out.append(issue)
    return out


def _swa_window_notes(streams, window: int, label: str, side: _Side, offset: int) -> list[_Issue]:
    """An SWA section holds the cells its window still sees when it is written: the last ``window``
    positions (``llama_kv_cache::state_write`` skips the cells ``is_masked_swa`` masks). Other counts
    mean another window, which the loader does not check: notes."""
    for st in streams:
        lo, hi = int(st.cells.pos_min), int(st.cells.pos_max)
        keep = min(window, hi + 1)
        where = f"{_plural(st.cell_count, 'cell')} (positions {lo}..{hi})"
        if st.cell_count > keep:
            msg = (f"{side.prefix(label)}the SWA cache holds {where}, more than the window of {window:,} the model "
                   "keeps: the file was saved with a larger sliding window; the server restores it and masks "
                   "the extra cells")
        elif st.cell_count < keep:
            then = ("on the next request goes back to a checkpoint or evaluates the prompt again" if side.main
                    else "and once it rolls back to this checkpoint the sliding-window layers see less than their "
                         "window: the continuation differs from that of a slot never saved")
            msg = (f"{side.prefix(label)}the SWA cache holds {where}, fewer than the {keep:,} the model's window "
                   f"of {window:,} keeps: the file was saved with a smaller sliding window; the server restores "
                   f"it, {then}")
        else:
            continue
        return [_Issue(Finding(side.layer, "note", "swa_window_mismatch", msg, offset), EFFECT_OK)]
    return []


def _compare_kv_data(d, p: SectionPrediction, label: str, side: _Side, setup: ServerSetup) -> list[_Issue]:
    out: list[_Issue] = []
    n_layer_at, v_trans_at = d.rot_offset - 4, d.rot_offset - 8
    if d.n_layer != p.n_layer:
        out.append(_issue(side, "layer_count_mismatch",
                          f"{label} has {_plural(d.n_layer, 'layer')}, {side.context} {p.n_layer:,}: the file "
                          f"was saved with another {side.model_word} (give {side.model_flag} the one it was "
                          "saved with)", n_layer_at))
        return out  # the records cannot be paired with the layers
    if bool(d.v_trans) != bool(p.v_trans):
        if d.v_trans:
            msg = (f"{side.kind} V is stored transposed in the file (saved with flash attention off) and not "
                   f"in {side.context} (flash attention on): start the server with -fa off")
        else:
            msg = (f"{side.kind} V is not stored transposed in the file (saved with flash attention on) but is "
                   f"in {side.context} (flash attention off): start the server with -fa on")
        out.append(_issue(side, "v_trans_mismatch", f"{side.prefix(label)}{msg}", v_trans_at))
    k_types_agree = all(ggml.type_name(k.type) == lp.k_type for k, lp in zip(d.k, p.layers))
    v_types_agree = all(ggml.type_name(v.type) == lp.v_type for v, lp in zip(d.v, p.layers))
    if p.n_rot_k is not None and d.n_rot_k is not None:
        for kv, got, want, agree, at in (("K", d.n_rot_k, p.n_rot_k, k_types_agree, d.rot_offset),
                                         ("V", d.n_rot_v, p.n_rot_v, v_types_agree, d.rot_offset + 4)):
            if got == want or not agree:
                continue  # a type mismatch explains it, and is the remedy
            if got == 0:
                why = ("the file was saved with LLAMA_ATTN_ROT_DISABLE set: start the server with "
                       "LLAMA_ATTN_ROT_DISABLE=1, or save the slot again")
            elif want == 0 and setup.attn_rot_disable:
                why = "the file was saved with rotation: start the server without LLAMA_ATTN_ROT_DISABLE"
            else:
                why = (f"the file was saved by a build or with a {side.model_word} that rotates this cache "
                       "differently (another head size)")
            out.append(_issue(side, f"{kv.lower()}_rotation_mismatch",
                              f"{side.prefix(label)}{side.kind} {kv} rotation is {got} in the file and {want} in "
                              f"{side.context}: {why}", at))
    out += _compare_records(d.k, [(lp.k_type, lp.k_row_size, lp.il) for lp in p.layers], "K", label, side)
    if p.layers and p.layers[0].v_type is not None:
        want_v = [(lp.v_type, lp.v_row_size if not p.v_trans else (lp.v_el_size, lp.n_embd_v_gqa), lp.il)
                  for lp in p.layers]
        out += _compare_records(d.v, want_v, "V", label, side)
    return out


def _convert_types_hint(side: _Side, kv: str, got: str, want: str) -> str:
    """The ``slotctl convert`` command that re-encodes a cache of type ``got`` as ``want`` (lossy)."""
    quantized = any(ggml.BY_NAME[t].block > 1 for t in (got, want) if t in ggml.BY_NAME)
    model = f" {side.model_flag} MODEL" if quantized else ""
    return f"slotctl convert FILE -o OUT {side.type_flag(kv)} {want}{model} (lossy, the error is reported)"


def _record_offset(rec) -> int | None:
    data = rec.data
    return data.offset - 12 if hasattr(data, "offset") else None


def _compare_records(recs, want: list[tuple], kv: str, label: str, side: _Side) -> list[_Issue]:
    """K or V records against the predicted (type, row size or (el_size, n_embd), layer) of each layer."""
    out: list[_Issue] = []
    type_bad = [(r, w) for r, w in zip(recs, want) if ggml.type_name(r.type) != w[0]]
    if type_bad:
        r, (wt, _, _) = type_bad[0]
        got = ggml.type_name(r.type)
        where = _layers_text([w[2] for _, w in type_bad])
        out.append(_issue(side, f"{kv.lower()}_type_mismatch",
                          f"{side.prefix(label)}{side.kind} {kv} cache is {got} in the file and {wt} in the context "
                          f"({where}): start the server with {side.type_flag(kv)} {got}, or convert the file: "
                          f"{_convert_types_hint(side, kv, got, wt)}", _record_offset(r)))
        return out
    size_bad = []
    for r, (wt, wsize, il) in zip(recs, want):
        got = r.row_size if "row_size" in r else (r.el_size, r.n_embd)
        if isinstance(got, tuple) != isinstance(wsize, tuple):
            continue  # V transposed on one side only: v_trans_mismatch says it
        if got != wsize:
            size_bad.append((r, got, wsize, il))
    if size_bad:
        r, got, wsize, il = size_bad[0]
        more = f" ({_layers_text([b[3] for b in size_bad])})" if len(size_bad) > 1 else ""
        if isinstance(got, tuple):
            what = (f"{side.kind} V rows of layer {il} hold {got[1]:,} elements of {got[0]} bytes in the file and "
                    f"{wsize[1]:,} of {wsize[0]} bytes in the context")
        else:
            what = (f"{side.kind} {kv} rows of layer {il} are {got:,} bytes in the file and {wsize:,} in the "
                    f"context ({ggml.type_name(r.type)})")
        out.append(_issue(side, f"{kv.lower()}_row_size_mismatch",
                          f"{side.prefix(label)}{what}{more}: the file was saved with another {side.model_word} "
                          f"(another head size or KV head count; give {side.model_flag} the one it was saved with)",
                          _record_offset(r)))
    return out


def _compare_recurrent(sec, p: SectionPrediction, offset: int, label: str, side: _Side,
                       model: ModelInfo) -> list[_Issue]:
    out: list[_Issue] = []
    if sec.n_layer != p.n_layer:
        out.append(_issue(side, "layer_count_mismatch",
                          f"{label}: the recurrent state covers {_plural(sec.n_layer, 'layer')}, {side.context} "
                          f"{p.n_layer:,}: the file was saved with another {side.model_word} (give "
                          f"{side.model_flag} the one it was saved with)", offset))
        return out
    if sec.s_trans:
        out.append(_issue(side, "s_trans_mismatch",
                          f"{label}: the s state is stored transposed in the file and not in {side.context}: "
                          "the file was saved by another build of llama.cpp", offset))
    for name, recs, want in (("r", sec.r, [(lp.k_type, lp.k_row_size, lp.il) for lp in p.layers]),
                             ("s", sec.s, [(lp.v_type, lp.v_row_size, lp.il) for lp in p.layers])):
        for r, (wt, wsize, il) in zip(recs, want):
            got_t = ggml.type_name(r.type)
            if got_t != wt:
                out.append(_issue(side, f"{name}_type_mismatch",
                                  f"{label}: {name} rows of layer {il} are {got_t} in the file and {wt} in "
                                  f"{side.context}: the file was saved by another build of llama.cpp",
                                  _record_offset(r)))
                break
            got = r.row_size if "row_size" in r else r.el_size * r.n_embd
            if got != wsize:
                rule = model.n_embd_r_rule if name == "r" else model.n_embd_s_rule
                what = _RECURRENT_ROWS.get(model.arch, _RECURRENT_ROWS_MAMBA)[name]
                width = f"; {Path(model.path).name}: {rule} elements of {wt}" if rule else ""
                out.append(_issue(side, f"{name}_row_size_mismatch",
                                  f"{label}: {name} rows ({what}) of layer {il} are {got:,} bytes in the file and "
                                  f"{wsize:,} in {side.context}{width}: the file was saved with another "
                                  f"{side.model_word} (give {side.model_flag} the one it was saved with)",
                                  _record_offset(r)))
                break
    return out


#: what a recurrent layer's r and s rows hold (``llama_memory_recurrent``: per layer one row of r, one of s)
_RECURRENT_ROWS_MAMBA = {"r": "the convolution state", "s": "the SSM state"}
_RECURRENT_ROWS = {
    **{a: {"r": "the token-shift state", "s": "the WKV state"} for a in ("rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7")},
    **{a: {"r": "the short convolution's last inputs", "s": "an SSM state, empty without ssm keys"}
       for a in ("lfm2", "lfm2moe")},
}


def _sections_for(layout: MemoryLayout, pred: Prediction) -> list[SectionPrediction]:
    """The predicted sections of ``layout`` (the model's full layout or its PARTIAL_ONLY part)."""
    by_role = {p.role: p for p in pred.sections}
    return [by_role[s.role] for s in layout.sections]
