"""Which model wrote a slot file (``slotctl identify``): its K/V rows against the rows a candidate computes.

Shapes cannot tell two models of the same architecture apart (a fine-tune, another quantization of the
same weights, two tiny models of equal shape): the loader checks none of it. What does tell them apart is
what the model computed. A cell's K and V rows at position ``p`` depend only on the tokens ``0..p``, so a
candidate that evaluates the first tokens of the file's prompt (:mod:`slotctl.runtime.identify`, in a
real context with the file's cache types and flash-attention setting) must produce the very rows the file
holds for those positions, if it is the model that wrote it.

This module compares the two: rows of the same positions, dequantized and with the rotation of quantized
caches undone (:mod:`slotctl.tensors`), per layer the cosine similarity (over all compared rows) and the
largest absolute difference. A candidate *matches* when every compared layer's cosine is at least
``min_cosine``; its score is its lowest layer cosine. Recurrent sections hold the state after the whole
prompt: they are compared when the candidate evaluated every token (then the positions agree).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np

from slotctl.format import ggml
from slotctl.format.common import Span
from slotctl.format.convert import RotationRule
from slotctl.format.memory import MemoryLayout
from slotctl.slotfile import Memory, parse_blob

#: the lowest layer cosine of a matching candidate: the same model with the same flags gives 1.0 up to
#: floating-point noise, another model of the same shape ~0
DEFAULT_MIN_COSINE = 0.99
#: tokens a candidate evaluates by default
DEFAULT_TOKENS = 32


@dataclass
class LayerComparison:
    section: str
    layer: int
    tensor: str          # "K", "V" (KV sections), "r", "s" (recurrent)
    n_rows: int
    cosine: float
    max_abs_diff: float

    def as_dict(self) -> dict:
        return {"section": self.section, "layer": self.layer, "tensor": self.tensor, "n_rows": self.n_rows,
                "cosine": self.cosine, "max_abs_diff": self.max_abs_diff}


@dataclass
class Candidate:
    """One candidate model against the file: ``layers`` compared, or ``error`` why it could not be."""

    path: str
    layers: list[LayerComparison] = field(default_factory=list)
    error: str | None = None
    n_tokens: int = 0

    @property
    def score(self) -> float | None:
        """The lowest layer cosine (None when nothing was compared)."""
        return min((c.cosine for c in self.layers), default=None)

    @property
    def max_abs_diff(self) -> float | None:
        return max((c.max_abs_diff for c in self.layers), default=None)

    def matches(self, min_cosine: float) -> bool:
        return self.score is not None and self.score >= min_cosine

    def as_dict(self, min_cosine: float) -> dict:
        return {"path": self.path, "matches": self.matches(min_cosine), "score": self.score,
                "max_abs_diff": self.max_abs_diff, "n_tokens": self.n_tokens,
                "layers": [c.as_dict() for c in self.layers], "error": self.error}


def rows_by_position(f, mem: Memory, version: int, rule: RotationRule | None, *,
                     below: int | None = None) -> dict:
    """Every record of ``mem`` as ``{(section index, role, record index, tensor): (positions, rows)}``;
    rows float32 ``[cells, n]``, dequantized, the rotation of a quantized cache undone (recorded in
    version 4, from ``rule`` in version 3; rows of a version-3 quantized cache without a rule stay
    rotated). Only the first stream with cells of a KV section is read (a slot's state). ``below``: only
    the cells before the last one at a position below it are read (the rows are stored in cell order)."""
    from slotctl import tensors
    from slotctl.format.records import row_elements

    out: dict = {}
    for si, (sl, sec) in enumerate(zip(mem.layout.sections, mem.sections)):
        if sec.type == "kv":
            st = next((s for s in sec.streams if s.cell_count), None)
            if st is None:
                continue
            d = st.data
            pos = np.asarray(st.cells.pos, dtype=np.int64)
            k = _prefix(pos, below)
            pos = pos[:k]
            tk = d.k[0].type if len(d.k) else 0
            tv = d.v[0].type if len(d.v) else 0
            if version >= 4:
                rot_k, rot_v = d.n_rot_k, d.n_rot_v
            elif rule is not None:
                rot_k, rot_v = rule(sl.role, tk, tv)
            else:
                rot_k = rot_v = 0
            for tensor, recs, rot in (("K", d.k, rot_k), ("V", d.v, rot_v)):
                for i, rec in enumerate(recs):
                    where = f"{sl.role} {tensor} record {i}"
                    if hasattr(rec, "el_size"):   # V element-major: [n_embd][cells]
                        if not row_elements(rec, "memory"):
                            continue            # no rows to compare
                        raw = _read(f, rec.data)
                        _readable(rec.type, where)
                        if len(raw) % (rec.el_size * rec.n_embd):
                            raise Incomparable(f"{where}: {len(raw):,} bytes are not {rec.n_embd:,} rows of "
                                               f"{rec.el_size}-byte {ggml.type_name(rec.type)} elements")
                        rows = _finite(tensors.dequantize(raw, rec.type, 1).reshape(rec.n_embd, -1).T[:k], where)
                    else:
                        n = row_elements(rec, "memory")
                        if not n:
                            continue            # zero-width rows (lfm2's short convolutions): nothing to compare
                        rows = _rows(_read(f, rec.data, k * rec.row_size), rec.type, n, rot, where)
                    out[(si, sl.role, i, tensor)] = (pos, rows)
        else:
            if not sec.cell_count:
                continue
            pos = np.asarray(sec.cells.pos, dtype=np.int64)
            for tensor, recs in (("r", sec.r), ("s", sec.s)):
                for i, rec in enumerate(recs):
                    if hasattr(rec, "el_size"):
                        continue
                    n = row_elements(rec, "memory")
                    if not n:         # zero-width rows (lfm2's s): nothing to compare
                        continue
                    out[(si, sl.role, i, tensor)] = (pos, _rows(_read(f, rec.data), rec.type, n, 0,
                                                                f"{sl.role} {tensor} record {i}"))
    return out


class Incomparable(ValueError):
    """Rows of a file that cannot be turned into numbers as they claim (a rotation group wider than the row,
    bytes that are not whole rows, a type without numbers, values that are not finite): the candidate's
    reason. A width that is no whole blocks is format.records.row_elements' FormatError."""


def _readable(type_id: int, where: str) -> None:
    from slotctl import tensors

    if type_id not in ggml.BY_ID or not tensors.can_read(type_id):
        raise Incomparable(f"{where}: rows of type {type_id} cannot be read as numbers")


def _rows(raw: bytes, type_id: int, n: int, rot: int, where: str):
    """``raw``, whole rows of ``n`` elements of ``type_id`` (their width checked by
    :func:`slotctl.format.records.row_elements`), as float32 ``[rows, n]`` with the rotation ``rot`` undone;
    :class:`Incomparable` when the record's own fields do not allow it, or a value is not finite."""
    from slotctl import tensors

    _readable(type_id, where)
    row_size = ggml.BY_ID[type_id].row_size(n)
    if len(raw) % row_size:
        raise Incomparable(f"{where}: {len(raw):,} bytes are not whole rows of {row_size:,}")
    if rot and (rot & (rot - 1) or n % rot):
        raise Incomparable(f"{where}: the rotation recorded ({rot:,}) does not split rows of {n:,} elements into "
                           f"groups of a power of two")
    return _finite(tensors.rotate(tensors.dequantize(raw, type_id, n), rot), where)


def _finite(rows, where: str):
    """``rows``, or :class:`Incomparable` when a value is NaN or infinite (no cosine says anything then)."""
    if not np.isfinite(rows).all():
        raise Incomparable(f"{where}: rows holding values that are not finite (NaN or infinity)")
    return rows


def _prefix(pos: np.ndarray, below: int | None) -> int:
    """How many leading cells to read so that every cell at a position below ``below`` is read."""
    if below is None:
        return len(pos)
    hit = np.nonzero(pos < below)[0]
    return int(hit[-1]) + 1 if len(hit) else 0


def _read(f, data, size: int | None = None) -> bytes:
    if not isinstance(data, Span):
        return data if size is None else data[:size]
    return Span(data.offset, data.size if size is None else min(size, data.size)).read(f)


def compare(file_rows: dict, cand_rows: dict) -> list[LayerComparison]:
    """Per record present on both sides, the rows of the positions both hold."""
    out = []
    for key, (pos_a, a) in file_rows.items():
        if key not in cand_rows:
            continue
        pos_b, b = cand_rows[key]
        if a.shape[1] != b.shape[1]:
            continue
        common, ia, ib = np.intersect1d(pos_a, pos_b, return_indices=True)
        if not len(common):
            continue
        x, y = a[ia].astype(np.float64), b[ib].astype(np.float64)
        norm = np.linalg.norm(x) * np.linalg.norm(y)
        cos = float(np.sum(x * y) / norm) if norm else (1.0 if not np.any(x) and not np.any(y) else 0.0)
        _si, role, i, tensor = key
        out.append(LayerComparison(role, i, tensor, len(common), cos, float(np.max(np.abs(x - y)))))
    return out


def blob_memory(blob: bytes, layout: MemoryLayout, version: int, layer: str) -> tuple[io.BytesIO, Memory]:
    """An in-memory state blob (``state_seq_get``) parsed with ``layout``; raises its FormatError."""
    f = io.BytesIO(blob)
    b = parse_blob(f, Span(0, len(blob)), layout, version, layer)
    if b.error is not None:
        raise b.error
    return f, b.memory


def flags_of(mem: Memory) -> tuple[str, str, str]:
    """The K and V cache types and the flash-attention setting a memory was written with:
    (type_k, type_v, "on"/"off"); f16 where a memory holds no KV rows (:func:`slotctl.slotfile.memory_flags`)."""
    from slotctl.slotfile import memory_flags

    return memory_flags(mem)[:3]


def _shape_error(info, mem: Memory) -> str | None:
    """What in ``mem`` another model wrote: a KV layer count or row width the model ``info`` does not have."""
    from slotctl.model.fit import shape_differences

    return next(iter(shape_differences(info, mem)), None)


def best(candidates: list[Candidate], min_cosine: float) -> tuple[Candidate | None, float | None]:
    """The matching candidate with the highest score and its margin over the next best score (None
    when it is the only one scored)."""
    scored = sorted((c for c in candidates if c.score is not None), key=lambda c: c.score, reverse=True)
    if not scored or not scored[0].matches(min_cosine):
        return None, None
    margin = scored[0].score - scored[1].score if len(scored) > 1 else None
    return scored[0], margin


@dataclass
class Identification:
    """The candidates for one state of a file (``what``: "target" or "draft") and the best match."""

    what: str
    candidates: list[Candidate]
    min_cosine: float

    @property
    def best(self) -> Candidate | None:
        return best(self.candidates, self.min_cosine)[0]

    @property
    def margin(self) -> float | None:
        return best(self.candidates, self.min_cosine)[1]

    def as_dict(self) -> dict:
        b = self.best
        return {"candidates": [c.as_dict(self.min_cosine) for c in self.candidates],
                "best": b.path if b else None, "margin": self.margin}


def identify(path: str, models: list[str], *, draft: bool = False, n_tokens: int = DEFAULT_TOKENS,
             min_cosine: float = DEFAULT_MIN_COSINE) -> Identification:
    """Compare the target state (or with ``draft`` the SDFT draft state) of the slot file at ``path``
    with what each of ``models`` computes for the first ``n_tokens`` tokens of its prompt (all of them
    when the memory keeps no KV cache of the first positions: recurrent or sliding-window only)."""
    return Identification("draft" if draft else "target",
                          [_candidate(path, m, draft, n_tokens) for m in models], min_cosine)


def _candidate(path: str, model: str, draft: bool, n_tokens: int) -> Candidate:
    from slotctl.errors import SlotctlError
    from slotctl.model.info import read_model_info
    from slotctl.slotfile import open_slot_file

    cand = Candidate(model)
    try:
        info = read_model_info(model)
        layout = info.layout()
    except SlotctlError as e:
        cand.error = str(e)
        return cand
    with open_slot_file(path, **({"draft_layout": layout} if draft else {"layout": layout})) as sf:
        return _judge(cand, sf, info, layout, draft, n_tokens, model)


def _judge(cand: Candidate, sf, info, layout, draft: bool, n_tokens: int, model: str) -> Candidate:
    """:func:`_candidate` on the file ``sf`` parsed with the candidate's ``layout``."""
    from slotctl.errors import SlotctlError
    from slotctl.model.predict import rotation_rule

    mem = (sf.draft.memory if sf.draft else None) if draft else sf.target
    if mem is None or (sf.errors and not draft):
        err = sf.draft.error if draft and sf.draft else (sf.errors[0] if sf.errors else None)
        cand.error = (f"the file's {'draft state' if draft else 'memory'} does not have this model's shape"
                      + (f" ({err})" if err else "") if (err or sf.draft) else "the file holds no draft state")
        return cand
    shape = _shape_error(info, mem)
    if shape:
        cand.error = f"the file's {'draft state' if draft else 'memory'} does not have this model's shape ({shape})"
        return cand
    if sf.tokens is None or sf.tokens.error:
        cand.error = "the file's token words cannot be read"
        return cand
    tokens = [int(t) for t in sf.tokens.tokens]
    early = any(sl.type == "kv" and sl.role != "swa" for sl in layout.sections)
    n = min(n_tokens, len(tokens)) if early else len(tokens)
    tokens = tokens[:n]
    if not tokens or any(t < 0 for t in tokens):
        cand.error = "the prompt's first tokens are media or missing: nothing to evaluate"
        return cand
    cand.n_tokens = n
    type_k, type_v, fa = flags_of(mem)
    rule = rotation_rule(info)
    try:
        from slotctl.runtime.identify import candidate_state

        blob, version = candidate_state(model, tokens, type_k=type_k, type_v=type_v, flash_attn=fa)
        cf, cmem = blob_memory(blob, layout, version, "candidate state")
    except (SlotctlError, ValueError, OSError) as e:
        cand.error = f"cannot evaluate the prompt: {e}"
        return cand
    try:
        mine = rows_by_position(sf.stream, mem, sf.version, rule, below=n)
    except Incomparable as e:
        cand.error = f"the file's rows cannot be compared: {e}"
        return cand
    except SlotctlError as e:      # a record whose sizes hold no whole rows (format.records.row_elements)
        cand.error = f"the file's rows cannot be read: {e}"
        return cand
    try:
        theirs = rows_by_position(cf, cmem, version, rule)
    except (Incomparable, SlotctlError) as e:
        cand.error = f"the candidate's rows cannot be compared: {e}"
        return cand
    cand.layers = compare(mine, theirs)
    if not cand.layers:
        cand.error = "no rows at the same positions to compare"
    return cand
