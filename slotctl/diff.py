"""What differs between two slot files (``slotctl diff``), layer by layer.

Header and token words (count, first differing index), then each memory layer (the target payload, each
checkpoint's target and draft blobs, the SDFT draft blob) section by section and stream by stream: cell
counts, positions, which cells hold different data, and per layer (record) the largest absolute
difference of K and V (r and s for recurrent sections) after dequantizing with gguf-py's block formats
(:mod:`slotctl.tensors`) and undoing llama.cpp's Hadamard rotation of quantized caches, so that an f16
cache and a q8_0 one of the same prompt compare as numbers.

Tensor data is read in bounded chunks of rows (``CHUNK`` bytes a side) with ``pread``s on each file's own
stream (never a memory map); the rest of each file is metadata, parsed as ``inspect`` parses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slotctl import tensors
from slotctl.errors import FormatError
from slotctl.format import ggml
from slotctl.format.records import check_rotation, row_elements
from slotctl.slotfile import Blob, Memory, SlotFile, checkpoint_layer

#: bytes of tensor rows read at a time from each file
CHUNK = 8 << 20
#: ranges of differing cells listed per stream (the count is always complete)
MAX_RANGES = 8


@dataclass
class Differences:
    """Named differences, in file order: ``(layer, message)``."""

    items: list[tuple[str, str]] = field(default_factory=list)

    def add(self, layer: str, message: str) -> None:
        self.items.append((layer, message))

    def as_list(self) -> list[dict]:
        return [{"layer": layer, "message": m} for layer, m in self.items]


def _pair(a, b) -> list:
    return [a, b]


def _first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    n = min(len(a), len(b))
    neq = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    if len(neq):
        return int(neq[0])
    return None if len(a) == len(b) else n


def _ranges(idx: np.ndarray, pos: np.ndarray) -> list[list[int]]:
    """Runs of consecutive cell indices, as [first position, last position], at most MAX_RANGES."""
    out: list[list[int]] = []
    if not len(idx):
        return out
    breaks = np.flatnonzero(np.diff(idx) != 1)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [len(idx) - 1]])
    for s, e in list(zip(starts, ends))[:MAX_RANGES]:
        out.append([int(pos[idx[s]]), int(pos[idx[e]])])
    return out


class _Unreadable(Exception):
    """A record whose rows cannot be read: the damage (or the change) is already a finding of its file."""


class _Rows:
    """Tensor rows of one parsed file, read through its own stream in bounded ``pread``s (never a memory
    map: a file that shrinks under a map kills the process with SIGBUS). Damage found while reading (a
    field that cannot hold whole rows, a file that changed under the diff) becomes a finding of the file:
    :meth:`damage` adds it to ``sf.errors``, as the parse adds what it finds."""

    def __init__(self, sf: SlotFile):
        self.sf = sf

    def damage(self, part: str, e: FormatError) -> None:
        if not any(x.one_line() == e.one_line() for x in self.sf.errors):
            self.sf.add_error(part, e)

    def read(self, offset: int, n: int, part: str = "file") -> bytes:
        """Exactly ``n`` bytes at ``offset``; a ``file_changed`` finding and :class:`_Unreadable` when the
        file ends first or is no longer the one that was parsed."""
        b = self.sf.read_at(offset, n)
        why = self.sf.changed()
        if len(b) != n or why:
            e = FormatError(part, offset, f"the {n:,} bytes that were there when the file was parsed; "
                                          + (why or "the file ends first"))
            e.code = "file_changed"
            self.damage(part, e)
            raise _Unreadable(e.one_line())
        return b

    def elements(self, rec, part: str) -> int:
        """Elements per row of ``rec`` (:func:`slotctl.format.records.row_elements`); a finding and
        :class:`_Unreadable` when its header cannot hold whole rows."""
        try:
            return row_elements(rec, part)
        except FormatError as e:
            self.damage(part, e)
            raise _Unreadable(e.one_line()) from None

    def rotation(self, n_rot: int, width: int, what: str, part: str, offset: int | None) -> int:
        try:
            return check_rotation(n_rot, width, what, part, offset)
        except FormatError as e:
            self.damage(part, e)
            raise _Unreadable(e.one_line()) from None

    def rows(self, rec, n_cells: int, c0: int, c1: int, part: str) -> np.ndarray:
        """Cells ``c0:c1`` of a record as raw rows ``[c1 - c0, row bytes]`` (``rec`` checked by
        :meth:`elements`)."""
        off = rec.data.offset
        if "row_size" in rec:
            rs = rec.row_size
            raw = np.frombuffer(self.read(off + c0 * rs, (c1 - c0) * rs, part), np.uint8)
            return raw.reshape(c1 - c0, rs)
        el, n_embd = rec.el_size, rec.n_embd          # element-major: n_embd rows of n_cells elements
        width = (c1 - c0) * el
        block = np.empty((n_embd, width), np.uint8)
        for i in range(n_embd):
            block[i] = np.frombuffer(self.read(off + (i * n_cells + c0) * el, width, part), np.uint8)
        block = block.reshape(n_embd, c1 - c0, el)
        return np.ascontiguousarray(block.transpose(1, 0, 2)).reshape(c1 - c0, n_embd * el)


def _row_bytes(rec) -> int:
    return rec.row_size if "row_size" in rec else rec.el_size * rec.n_embd


def _type_of(rec) -> str:
    return ggml.type_name(rec.type)


@dataclass
class _RecordResult:
    max_abs: float | None = 0.0
    equal: bool = True
    note: str | None = None
    #: some differing rows hold values that are not finite (inf, nan): no largest difference is given
    nonfinite: bool = False


@dataclass
class _Record:
    """One side of a record pair: its file's rows, the record, its stream's cell count, the rotation its
    stream records (and where), and the layer it belongs to (for findings)."""

    rows: _Rows
    rec: object
    n_cells: int
    rot: int
    rot_at: int | None
    what: str
    part: str


def _compare_record(a: _Record, b: _Record, n: int, cell_mask: np.ndarray) -> _RecordResult:
    """Records ``a`` / ``b`` over their first ``n`` cells; cells whose rows differ set ``cell_mask``. A side
    whose rows cannot be read (damage, or a file changed under the diff) is a finding of its file and
    leaves the record not compared."""
    try:
        with np.errstate(all="ignore"):   # garbage rows dequantize to inf and nan: values, not warnings
            return _compare_rows(a, b, n, cell_mask)
    except _Unreadable as e:
        return _RecordResult(None, False, False, f"unreadable ({e})")


def _checked(*sides: _Record) -> list[tuple[int, int]]:
    """(elements per row, rotation) of each side; every side is checked (each damaged one is a finding of
    its file) before :class:`_Unreadable` is raised for the first."""
    out, first = [], None
    for s in sides:
        try:
            width = s.rows.elements(s.rec, s.part)
            out.append((width, s.rows.rotation(s.rot, width, s.what, s.part, s.rot_at)))
        except _Unreadable as e:
            first = first or e
    if first is not None:
        raise first
    return out


def _compare_rows(a: _Record, b: _Record, n: int, cell_mask: np.ndarray) -> _RecordResult:
    ma, ra, na, mb, rb, nb = a.rows, a.rec, a.n_cells, b.rows, b.rec, b.n_cells
    res = _RecordResult()
    (ea, rot_a), (eb, rot_b) = _checked(a, b)
    if ea != eb:
        return _RecordResult(None, False, False, f"rows of {ea} and {eb} elements")
    same_form = (ra.type == rb.type and rot_a == rot_b and ("row_size" in ra) == ("row_size" in rb))
    if not same_form and not (tensors.can_read(ra.type) and tensors.can_read(rb.type)):
        return _RecordResult(None, False, False, f"{_type_of(ra)} or {_type_of(rb)} cannot be dequantized")
    step = tensors.rows_per_chunk(max(_row_bytes(ra), _row_bytes(rb)), CHUNK)
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        xa, xb = ma.rows(ra, na, c0, c1, a.part), mb.rows(rb, nb, c0, c1, b.part)
        if same_form:
            neq = (xa != xb).any(axis=1)
            if not neq.any():
                continue
            res.equal = False
            cell_mask[c0:c1] |= neq
            if not tensors.can_read(ra.type):
                res.max_abs = None
                continue
            sel = np.flatnonzero(neq)
            va = tensors.dequantize(xa[sel].tobytes(), ra.type, ea)
            vb = tensors.dequantize(xb[sel].tobytes(), rb.type, eb)
        else:
            va = tensors.rotate(tensors.dequantize(xa.tobytes(), ra.type, ea), rot_a)
            vb = tensors.rotate(tensors.dequantize(xb.tobytes(), rb.type, eb), rot_b)
        d = np.abs(va.astype(np.float64) - vb.astype(np.float64))
        finite = np.isfinite(d).all(axis=1) if d.shape[1] else np.ones(len(d), bool)
        per_row = np.where(finite, np.nan_to_num(d, nan=0.0, posinf=0.0).max(axis=1, initial=0.0), np.inf)
        if not same_form:
            neq = per_row > 0
            if neq.any():
                res.equal = False
                cell_mask[c0:c1] |= neq
        res.nonfinite = res.nonfinite or not finite.all()
        biggest = float(per_row[finite].max()) if finite.any() else 0.0
        if res.max_abs is not None:
            res.max_abs = max(res.max_abs, biggest)
    if res.nonfinite:
        res.max_abs = None   # JSON has no infinity; the words say why
    return res


def _kv_records(data) -> tuple[list, list, int, int, int | None]:
    if data is None:
        return [], [], 0, 0, None
    return list(data.k), list(data.v), (data.n_rot_k or 0) if "n_rot_k" in data else 0, \
        (data.n_rot_v or 0) if "n_rot_v" in data else 0, data.rot_offset if "n_rot_k" in data else None


def _streams(sec) -> list[tuple[int, object, tuple[list, list, int, int]]]:
    """(cell count, cells, (first records, second records, rotation of the first, of the second, offset
    of the first rotation field))."""
    if sec.type == "kv":
        return [(st.cell_count, st.cells, _kv_records(st.data)) for st in sec.streams]
    return [(sec.cell_count, sec.cells, (list(sec.r), list(sec.s), 0, 0, None))]


def _pair_streams(sa: list, sb: list) -> list[tuple[int, int]]:
    """Stream pairs: by index; when the counts differ and each file has one stream with cells (a save
    from another ``-np``), those two."""
    if len(sa) != len(sb):
        fa = [i for i, s in enumerate(sa) if s[0]]
        fb = [i for i, s in enumerate(sb) if s[0]]
        if len(fa) == 1 and len(fb) == 1:
            return [(fa[0], fb[0])]
    return [(i, i) for i in range(min(len(sa), len(sb)))]


def diff_memory(layer: str, a: Memory | None, b: Memory | None, ma: _Rows, mb: _Rows,
                diffs: Differences, part: str | None = None) -> dict | None:
    """One memory layer of each file, compared (None when neither has it). ``part``: the layer's name in
    the files' findings (``SlotFile.add_error``), when it is not ``layer``."""
    if a is None and b is None:
        return None
    if a is None or b is None:
        diffs.add(layer, f"only in {'B' if a is None else 'A'}")
        return {"kind": _pair(a.layout.kind if a else None, b.layout.kind if b else None), "equal": False,
                "sections": []}
    out = {"kind": _pair(a.layout.kind, b.layout.kind), "equal": True, "sections": []}
    if a.layout.kind != b.layout.kind:
        diffs.add(layer, f"memory kind {a.layout.kind} vs {b.layout.kind}")
        out["equal"] = False
    for si, (sa, sb, la, lb) in enumerate(zip(a.sections, b.sections, a.layout.sections, b.layout.sections)):
        where = f"{layer}, {la.role} section" if len(a.sections) > 1 else layer
        sec = {"index": si, "type": sa.type, "role": la.role, "equal": True, "streams": []}
        if sa.type != sb.type:
            diffs.add(where, f"section type {sa.type} vs {sb.type}")
            sec["equal"] = out["equal"] = False
            out["sections"].append(sec)
            continue
        streams_a, streams_b = _streams(sa), _streams(sb)
        if len(streams_a) != len(streams_b):
            diffs.add(where, f"{len(streams_a)} vs {len(streams_b)} streams")
            sec["equal"] = False
        sec["n_stream"] = _pair(len(streams_a), len(streams_b))
        for ia, ib in _pair_streams(streams_a, streams_b):
            st = _diff_stream(f"{where}, stream {ia}" + (f"/{ib}" if ia != ib else ""), streams_a[ia],
                              streams_b[ib], sa.type, ma, mb, diffs, part or layer)
            st["stream"] = _pair(ia, ib)
            sec["streams"].append(st)
            sec["equal"] = sec["equal"] and st["equal"]
        out["sections"].append(sec)
        out["equal"] = out["equal"] and sec["equal"]
    if len(a.sections) != len(b.sections):
        diffs.add(layer, f"{len(a.sections)} vs {len(b.sections)} sections")
        out["equal"] = False
    return out


def _diff_stream(where: str, sa, sb, kind: str, ma: _Rows, mb: _Rows, diffs: Differences, part: str) -> dict:
    (na, cells_a, (ka, va, rka, rva, at_a)), (nb, cells_b, (kb, vb, rkb, rvb, at_b)) = sa, sb
    n = min(na, nb)
    out: dict = {"cell_count": _pair(na, nb), "equal": True}
    if na != nb:
        diffs.add(where, f"{na:,} vs {nb:,} cells (the first {n:,} compared)")
        out["equal"] = False
    pa, pb = np.asarray(cells_a.pos), np.asarray(cells_b.pos)
    first_pos = _first_difference(pa[:n], pb[:n])
    out["positions_equal"] = first_pos is None
    out["first_position_difference"] = first_pos
    if first_pos is not None:
        diffs.add(where, f"cell {first_pos:,}: position {int(pa[first_pos])} vs {int(pb[first_pos])}")
        out["equal"] = False
    out["pos_min"] = _pair(int(pa.min()) if na else None, int(pb.min()) if nb else None)
    out["pos_max"] = _pair(int(pa.max()) if na else None, int(pb.max()) if nb else None)
    names = ("k", "v") if kind == "kv" else ("r", "s")
    if kind == "kv":
        out["n_rot_k"], out["n_rot_v"] = _pair(rka, rkb), _pair(rva, rvb)
        for what, x, y in (("K rotation", rka, rkb), ("V rotation", rva, rvb)):
            if x != y:
                diffs.add(where, f"{what} {x} vs {y} (undone before comparing values)")
    mask = np.zeros(n, bool)
    layers = []
    for recs_a, recs_b, name, rot_a, rot_b, delta in ((ka, kb, names[0], rka, rkb, 0),
                                                      (va, vb, names[1], rva, rvb, 4)):
        if len(recs_a) != len(recs_b):
            diffs.add(where, f"{len(recs_a)} vs {len(recs_b)} {name.upper()} records")
            out["equal"] = False
        for li, (ra, rb) in enumerate(zip(recs_a, recs_b)):
            while len(layers) <= li:
                layers.append({"layer": len(layers)})
            row = layers[li]
            row[f"{name}_type"] = _pair(_type_of(ra), _type_of(rb))
            what = name.upper()
            r = _compare_record(_Record(ma, ra, na, rot_a, None if at_a is None else at_a + delta, what, part),
                                _Record(mb, rb, nb, rot_b, None if at_b is None else at_b + delta, what, part),
                                n, mask)
            row[f"{name}_equal"] = r.equal
            row[f"{name}_max_abs_diff"] = r.max_abs
            if ra.type != rb.type:
                diffs.add(where, f"layer {li}: {name.upper()} type {_type_of(ra)} vs {_type_of(rb)}"
                          + (f", values differ by at most {r.max_abs:.6g}" if r.max_abs is not None else ""))
            elif not r.equal:
                diffs.add(where, f"layer {li}: {name.upper()} differs by at most "
                          + (f"{r.max_abs:.6g}" if r.max_abs is not None else
                             "? (values that are not finite: inf or nan)" if r.nonfinite else f"? ({r.note})"))
            if r.note and ra.type == rb.type:
                diffs.add(where, f"layer {li}: {name.upper()} not compared: {r.note}")
            out["equal"] = out["equal"] and r.equal
    idx = np.flatnonzero(mask)
    out["differing_cells"] = int(len(idx))
    out["differing_ranges"] = _ranges(idx, pa[:n]) if n else []
    out["layers"] = layers
    return out


def _blob_memory(b: Blob | None) -> Memory | None:
    return b.memory if b is not None else None


def diff_files(a: SlotFile, b: SlotFile) -> dict:
    """The whole comparison (the ``--json`` document of ``slotctl diff`` without ``exit_code``)."""
    diffs = Differences()
    ma, mb = _Rows(a), _Rows(b)
    head = {"size": _pair(a.size, b.size), "state_version": _pair(a.version, b.version)}
    if a.version != b.version:
        diffs.add("state header", f"state version {a.version} vs {b.version}")
    ta, tb = a.tokens, b.tokens
    tokens = None
    if ta is not None and tb is not None:
        first = _first_difference(ta.tokens, tb.tokens)
        tokens = {"format": _pair(ta.format, tb.format), "n_tokens": _pair(ta.n_tokens, tb.n_tokens),
                  "first_difference": first, "equal": first is None and ta.format == tb.format,
                  "n_media": _pair(len(ta.media), len(tb.media))}
        if first is not None:
            if first < min(ta.n_tokens, tb.n_tokens):
                diffs.add("token words", f"{ta.n_tokens:,} vs {tb.n_tokens:,} tokens; the first difference is at "
                                         f"token {first:,} ({int(ta.tokens[first])} vs {int(tb.tokens[first])})")
            else:
                diffs.add("token words", f"{ta.n_tokens:,} vs {tb.n_tokens:,} tokens; one is a prefix of the other")
        if ta.format != tb.format:
            diffs.add("token words", f"token record {ta.format} vs {tb.format}")
    target = diff_memory("target memory", a.target, b.target, ma, mb, diffs)
    cps_a, cps_b = a.checkpoints or [], b.checkpoints or []
    checkpoints = []
    if len(cps_a) != len(cps_b):
        diffs.add("checkpoints", f"{len(cps_a)} vs {len(cps_b)} checkpoints")
    for i, (ca, cb) in enumerate(zip(cps_a, cps_b)):
        c = {"index": i, "n_tokens": _pair(ca.n_tokens, cb.n_tokens), "pos_min": _pair(ca.pos_min, cb.pos_min),
             "pos_max": _pair(ca.pos_max, cb.pos_max)}
        if (ca.n_tokens, ca.pos_min, ca.pos_max) != (cb.n_tokens, cb.pos_min, cb.pos_max):
            diffs.add(f"checkpoint {i}", f"at {ca.n_tokens} tokens [{ca.pos_min}, {ca.pos_max}] vs "
                                         f"{cb.n_tokens} tokens [{cb.pos_min}, {cb.pos_max}]")
        c["target"] = diff_memory(checkpoint_layer(i, "target"), _blob_memory(ca.tgt), _blob_memory(cb.tgt), ma, mb,
                                  diffs, checkpoint_layer(i, "target") + " blob")
        c["draft"] = diff_memory(checkpoint_layer(i, "draft"), _blob_memory(ca.dft), _blob_memory(cb.dft), ma, mb,
                                 diffs, checkpoint_layer(i, "draft") + " blob")
        c["spec_equal"] = _span_equal(ma, ca.spec, mb, cb.spec, f"checkpoint {i}")
        if not c["spec_equal"]:
            diffs.add(f"checkpoint {i}", "speculative state differs")
        c["equal"] = all(x is None or x["equal"] for x in (c["target"], c["draft"])) and c["spec_equal"] \
            and c["n_tokens"][0] == c["n_tokens"][1]
        checkpoints.append(c)
    draft = diff_memory("draft state", _blob_memory(a.draft), _blob_memory(b.draft), ma, mb, diffs, "SDFT draft blob")
    if draft is not None:
        draft["spec_equal"] = _span_equal(ma, a.draft_spec, mb, b.draft_spec, "SDFT appendix")
        if not draft["spec_equal"]:
            diffs.add("draft state", "speculative state differs")
    for rows in (ma, mb):   # a file rewritten in place under the diff, even where no read ran short
        why = rows.sf.changed()
        if why:
            e = FormatError("file", None, f"the file that was parsed; {why}")
            e.code = "file_changed"
            rows.damage("file", e)
    for side, sf in (("A", a), ("B", b)):
        for e in sf.errors:
            diffs.add(f"{side} damaged", e.one_line())
    return {
        "a": _side(a),
        "b": _side(b),
        "equal": not diffs.items,
        "header": head,
        "tokens": tokens,
        "target": target,
        "n_checkpoints": _pair(len(cps_a), len(cps_b)),
        "checkpoints": checkpoints,
        "draft": draft,
        "differences": diffs.as_list(),
    }


def _span_equal(ma: _Rows, sa, mb: _Rows, sb, part: str) -> bool:
    if sa is None or sb is None:
        return sa is None and sb is None
    if sa.size != sb.size:
        return False
    try:
        for o in range(0, sa.size, CHUNK):
            n = min(CHUNK, sa.size - o)
            if ma.read(sa.offset + o, n, part) != mb.read(sb.offset + o, n, part):
                return False
    except _Unreadable:
        return False
    return True


def _side(sf: SlotFile) -> dict:
    """One file of the pair, its damage as findings (the same keys as every command's findings)."""
    return {"path": sf.path, "size": sf.size, "state_version": sf.version, "damaged": sf.damaged,
            "findings": [{"code": e.error_code, "severity": "error", "layer": e.part or e.layer,
                          "offset": e.offset, "message": e.one_line()} for e in sf.errors]}
