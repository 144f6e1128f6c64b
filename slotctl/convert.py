"""Rewriting a slot file so that a server started with other flags restores it (``slotctl convert``).

Three conversions, combinable:

* **state version** (``version``): the exact conversion of :mod:`slotctl.format.convert` (3 <-> 4: the
  rotation words; 2 <-> 3 only without cell ext), refused where it would not be exact.
* **KV streams** (``n_stream``): a KV cache writes one stream per server slot (``-np``), or one with
  ``-kvu``, and ``llama_kv_cache::state_read_sinfo`` refuses any other count ("n_stream mismatch").
  For a single slot (``seq_id`` != -1) it reads every stream that holds cells into the destination
  slot's own stream (``seq_to_stream[seq_id]``), whatever its index in the file; a single slot's save
  has cells in one stream at most. So the stream count is rewritten and empty streams (a ``u32 0``
  each) are dropped or added; the stream with cells keeps its index when it still exists, else
  becomes stream 0. Every KV section is rewritten: the base and SWA caches of an iSWA model, the
  attention cache of a hybrid, the KV sections of checkpoint blobs and of the draft's state (the draft
  context has the target's slots and ``-kvu``). Recurrent sections have no streams and one cell per
  slot whatever ``-np`` says: they are kept, and refused when they hold more than one cell (not a
  single slot's state; the loader would assert). Cells in more than one stream (a whole-context
  save) are refused.
* **cache types** (``type_k`` / ``type_v``, per context): every K or V record of a KV cache is
  dequantized and written in the new type with gguf-py's block formats (:mod:`slotctl.tensors`).
  Quantized caches hold rotated rows (the ``llama_kv_cache`` rule, :func:`slotctl.model.predict.rotations`):
  the source rotation (recorded in version 4, the model's rule in version 3) is undone and the
  target's applied, and version 4 records the new sizes. Lossy: the largest error per layer is
  measured against the source values (after undoing rotations). Recurrent state is f32 in every
  server and is kept.

A conversion is planned from the parse (:func:`plan_convert`, nothing read but metadata) as pieces of
the new file: byte ranges of the old one, bytes written here, and records to re-encode. The new file is
then streamed (:func:`write_converted`; re-encoded records in chunks of a few MiB) into an atomic
writer, parsed once more before it replaces anything, and only then renamed into place.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np

from slotctl.errors import FormatError, UsageError
from slotctl.format import ggml
from slotctl.format.header import HEADER_FIXED_SIZE, fixed_header
from slotctl.format.blob import BLOB_HEADER_SIZE
from slotctl.format.common import Span, coalesce
from slotctl.format.convert import (ConversionRefused, RotationRule, added_rotation, check_dropped_rotation,
                                    check_ext)
from slotctl.format.memory import MemoryLayout
from slotctl.rewrite import piece_size, write_pieces
from slotctl.format.records import check_rotation, row_elements
from slotctl.slotfile import Blob, Memory, SlotFile, is_checkpoint_layer, open_slot_file

_ROW_HEADER = struct.Struct("<iQ")      # type, row size
_ELEM_HEADER = struct.Struct("<iII")    # type, element size, n_embd
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class ModelNeeded(UsageError):
    """The conversion needs what only the model's GGUF says (-m, or -md for the draft)."""

    def __init__(self, part: str, at: int | None, expected: str):
        super().__init__(FormatError(part, at, expected).one_line())


@dataclass(frozen=True)
class Target:
    """What one context's memory becomes: ``n_stream`` KV streams, K/V cache types (ggml type ids);
    None keeps what the file has. ``rule``: the model's rotation rule (needed to rotate a cache that
    becomes quantized, or to undo a version-3 rotation)."""

    n_stream: int | None = None
    type_k: int | None = None
    type_v: int | None = None
    rule: RotationRule | None = None

    @property
    def changes(self) -> bool:
        return self.n_stream is not None or self.type_k is not None or self.type_v is not None


@dataclass(frozen=True)
class Request:
    """A conversion: ``version`` (None: keep), the target context's and the draft context's :class:`Target`."""

    version: int | None = None
    target: Target = Target()
    draft: Target = Target()


@dataclass(frozen=True)
class Recode:
    """A record's tensor bytes (``span``) re-encoded from type ``src`` to ``dst``, rows of ``n_per_row``
    elements; the rotation ``rot_in`` undone and ``rot_out`` applied (None: unknown but equal, 0: none).
    ``where``: (part, section role, stream, layer, tensor) for the report."""

    span: Span
    src: int
    dst: int
    n_per_row: int
    rot_in: int | None
    rot_out: int | None
    where: tuple

    @property
    def n_rows(self) -> int:
        """Rows in the span; 0 for rows of 0 elements (a zero-width record holds no bytes to recode)."""
        row = ggml.BY_ID[self.src].row_size(self.n_per_row)
        return self.span.size // row if row else 0

    @property
    def size(self) -> int:
        return self.n_rows * ggml.BY_ID[self.dst].row_size(self.n_per_row)


Piece = Union[Span, bytes, Recode]


@dataclass
class Change:
    """One thing the conversion changes, for people and JSON."""

    part: str
    what: str
    old: object
    new: object
    section: str | None = None

    def as_dict(self) -> dict:
        return {"part": self.part, "section": self.section, "what": self.what, "from": self.old, "to": self.new}

    def describe(self) -> str:
        where = f"{self.part}" + (f" ({self.section})" if self.section else "")
        return f"{where}: {self.what} {self.old} -> {self.new}"


@dataclass
class LayerError:
    """The largest difference between a re-encoded record and its source, over its rows."""

    part: str
    section: str
    stream: int
    layer: int
    tensor: str
    old_type: str
    new_type: str
    max_abs_error: float = 0.0
    max_abs_value: float = 0.0

    def as_dict(self) -> dict:
        return {"part": self.part, "section": self.section, "stream": self.stream, "layer": self.layer,
                "tensor": self.tensor, "from": self.old_type, "to": self.new_type,
                "max_abs_error": self.max_abs_error, "max_abs_value": self.max_abs_value}


@dataclass
class Plan:
    path: str
    size: int
    version_in: int
    version_out: int
    pieces: list
    changes: list
    identity: tuple
    #: the parsed file the plan was made from: the copy reads its stream, never the name
    parsed: SlotFile | None = field(default=None, compare=False, repr=False)

    @property
    def output_size(self) -> int:
        return sum(piece_size(p) for p in self.pieces)


# -- planning ---------------------------------------------------------------------------------------------


def plan_convert(path: str | os.PathLike, req: Request, *, layout: MemoryLayout | None = None,
                 draft_layout: MemoryLayout | None = None) -> Plan:
    """Parse ``path`` and plan its conversion. FormatError when it does not parse, ConversionRefused
    (a FormatError) with the reason when it cannot be converted as asked."""
    path = os.fspath(path)
    sf = open_slot_file(path, layout=layout, draft_layout=draft_layout)
    identity = sf.identity
    if sf.errors or sf.target is None:
        raise sf.errors[0] if sf.errors else FormatError("target memory", sf.header_end,
                                                         "a memory payload of a known kind")
    vin = sf.version
    vout = req.version if req.version is not None else vin
    changes: list[Change] = []
    if vout != vin:
        changes.append(Change("state header", "state version", vin, vout))
    planner = _Planner(vin, vout, changes)
    pieces: list[Piece] = []
    if vout != vin:
        pieces.append(fixed_header(vout, len(sf.words)))
        pieces.append(Span(HEADER_FIXED_SIZE, sf.header_end - HEADER_FIXED_SIZE))
    else:
        pieces.append(Span(0, sf.header_end))
    pieces += planner.memory(sf.target, req.target, "target memory")
    pieces += _appendices(sf, req, planner)
    if sf.trailing is not None and sf.trailing.size:
        pieces.append(sf.trailing)
    return Plan(path, sf.size, vin, vout, coalesce(pieces), changes, identity, parsed=sf)


def _appendices(sf: SlotFile, req: Request, planner: "_Planner") -> list[Piece]:
    out: list[Piece] = []
    if sf.checkpoints is not None:
        out.append(Span(sf.sckp.offset, 12))   # magic, version, count
        for i, c in enumerate(sf.checkpoints):
            out.append(Span(c.tgt.span.offset - 24, 16))   # n_tokens, pos_min, pos_max
            out += _sized(planner.blob(c.tgt, req.target, f"checkpoint {i} target blob"))
            out += _sized(planner.blob(c.dft, req.draft, f"checkpoint {i} draft blob"))
            out += _sized([c.spec])
    if sf.sdft is not None:
        out.append(Span(sf.sdft.offset, 8))    # magic, version
        out += _sized(planner.blob(sf.draft, req.draft, "SDFT draft blob"))
        out += _sized([sf.draft_spec])
    return out


def _sized(pieces: list[Piece]) -> list[Piece]:
    """``u64 length`` then the pieces."""
    pieces = [p for p in pieces if piece_size(p)]
    return [_U64.pack(sum(piece_size(p) for p in pieces)), *pieces]


class _Planner:
    def __init__(self, vin: int, vout: int, changes: list[Change]):
        self.vin, self.vout, self.changes = vin, vout, changes

    def _note(self, change: Change) -> None:
        key = ("checkpoint" if is_checkpoint_layer(change.part) else change.part,
               change.section, change.what, change.old, change.new)
        if not any(("checkpoint" if is_checkpoint_layer(c.part) else c.part, c.section, c.what,
                    c.old, c.new) == key for c in self.changes):
            self.changes.append(change)

    def blob(self, b: Blob, tgt: Target, part: str) -> list[Piece]:
        if b.span.size == 0:
            return []
        if b.header_only:   # a plain KV cache's PARTIAL_ONLY state: the blob header alone, nothing to convert
            return [b.span]
        if b.memory is None or b.seq_id is None:
            if tgt.changes or self.vin != self.vout:
                flag = "-md" if "draft" in part else "-m"
                raise ModelNeeded(part, b.span.offset, f"a blob whose memory layout is known (give {flag})")
            return [b.span]
        return [Span(b.span.offset, BLOB_HEADER_SIZE), *self.memory(b.memory, tgt, part)]

    def memory(self, mem: Memory, tgt: Target, part: str) -> list[Piece]:
        check_ext(mem.layout, self.vin, self.vout, part)
        out: list[Piece] = []
        for sl, sec, span in zip(mem.layout.sections, mem.sections, mem.section_spans):
            if sec.type == "recurrent":
                if tgt.n_stream is not None and sec.cell_count > 1:
                    raise ConversionRefused(part, span.offset, f"a single slot's recurrent state (at most 1 cell), "
                                                               f"found {sec.cell_count:,} cells: not a slot's save")
                out.append(span)
            else:
                out += self._kv(sl.role, sec, span, tgt, part)
        return out

    def _kv(self, role: str, sec, span: Span, tgt: Target, part: str) -> list[Piece]:
        n_in = sec.n_stream
        n_out = tgt.n_stream if tgt.n_stream is not None else n_in
        streams = []   # (index, pieces) of each stream in file order
        pos = span.offset + 4
        for s, st in enumerate(sec.streams):
            pieces, pos = self._stream(role, s, st, pos, tgt, part)
            streams.append((s, st.cell_count, pieces))
        out: list[Piece] = [_U32.pack(n_out)]
        if n_out == n_in:
            for _s, _n, pieces in streams:
                out += pieces
            return out
        full = [(s, pieces) for s, n, pieces in streams if n]
        if len(full) > 1:
            raise ConversionRefused(part, span.offset, f"cells in one KV stream, found them in streams "
                                                       f"{', '.join(str(s) for s, _ in full)} (a whole-context save, "
                                                       "not a slot's)")
        self._note(Change(part, "n_stream", n_in, n_out, role))
        slots = [[_U32.pack(0)] for _ in range(n_out)]
        if full:
            s, pieces = full[0]
            slots[s if s < n_out else 0] = pieces
        for pieces in slots:
            out += pieces
        return out

    def _stream(self, role: str, s: int, st, pos: int, tgt: Target, part: str) -> tuple[list[Piece], int]:
        if st.cell_count == 0:
            return [Span(pos, 4)], pos + 4
        d = st.data
        head_end = d.rot_offset          # cell_count, cells, v_trans, n_layer
        rec_start = d.rot_offset + (8 if self.vin >= 4 else 0)
        out: list[Piece] = [Span(pos, head_end - pos)]
        type_k = d.k[0].type if len(d.k) else None
        type_v = d.v[0].type if len(d.v) else None
        rot_k = self._rotations("key", type_k, tgt.type_k, d.n_rot_k, role, tgt, part, head_end, 0, type_v)
        rot_v = self._rotations("value", type_v, tgt.type_v, d.n_rot_v, role, tgt, part, head_end + 4, 1, type_k)
        if self.vout >= 4:
            out.append(_U32.pack(rot_k[2] or 0) + _U32.pack(rot_v[2] or 0))
        end = rec_start
        for tensor, recs, (t_in, t_out, _rec_rot, r_in, r_out), rot_at in (("K", d.k, rot_k, head_end),
                                                                            ("V", d.v, rot_v, head_end + 4)):
            for i, rec in enumerate(recs):
                data = rec.data
                end = data.end
                transposed = hasattr(rec, "el_size")
                if t_out == t_in:
                    out.append(Span(data.offset - 12, data.size + 12))
                    continue
                new = ggml.BY_ID[t_out]
                where = (part, role, s, i, tensor)
                n = row_elements(rec, part)      # the record's sizes hold whole rows of its type
                if transposed:
                    if new.block > 1:
                        raise ConversionRefused(part, data.offset - 12, f"V stored untransposed for a {new.name} "
                                                                        "cache (a quantized V cache needs flash "
                                                                        "attention; this file was saved with -fa off)")
                    out.append(_ELEM_HEADER.pack(t_out, new.block_bytes, rec.n_embd))
                    out.append(Recode(data, t_in, t_out, 1, 0, 0, where))
                    continue
                for r in (r_in, r_out):          # the file's rotation (or the one copied from it)
                    check_rotation(r or 0, n, tensor, part, rot_at if self.vin >= 4 else None)
                if n % new.block:
                    raise ConversionRefused(part, data.offset - 12, f"rows that split into {new.name} blocks of "
                                                                    f"{new.block}; a {tensor} row has {n} elements")
                out.append(_ROW_HEADER.pack(t_out, new.row_size(n)))
                out.append(Recode(data, t_in, t_out, n, r_in, r_out, where))
        return out, end

    def _rotations(self, what: str, t_in: int | None, t_new: int | None, recorded: int | None, role: str,
                   tgt: Target, part: str, at: int, i: int, t_other: int | None):
        """(type in, type out, rotation to record, data rotation in, data rotation out) of one cache."""
        if t_in is None:     # no records (MLA V): nothing stored, nothing rotated
            return None, None, 0, 0, 0
        t_out = t_in if t_new is None else t_new
        tin, tout = ggml.BY_ID.get(t_in), ggml.BY_ID.get(t_out)
        if t_out != t_in:
            self._note(Change(part, f"{'K' if i == 0 else 'V'} type", tin.name, tout.name, role))
            from slotctl import tensors

            if not tensors.can_read(t_in):
                raise ConversionRefused(part, at, f"a cache type gguf can read; {tin.name} it cannot")
            if not tensors.can_write(t_out):
                raise ConversionRefused(part, at, f"a cache type gguf can write; {tout.name} it cannot")

        def rule(t: int) -> int | None:
            if tgt.rule is None:
                return None
            ks = (t, t_other if t_other is not None else 0) if i == 0 else (t_other if t_other is not None else 0, t)
            return tgt.rule(role, *ks)[i]

        # the rotation the stored rows carry
        if self.vin >= 4:
            r_in = recorded
        elif not ggml.is_quantized(t_in):
            r_in = 0
        else:
            r_in = rule(t_in)
        if t_out == t_in:
            # rows kept as they are: the library's exact version rules
            if self.vin >= 4 and self.vout < 4:
                check_dropped_rotation(what, t_in, recorded, self.vout, rule(t_in), part, at)
                return t_in, t_out, None, r_in, r_in
            if self.vin < 4 and self.vout >= 4:
                return t_in, t_out, added_rotation(what, t_in, self.vout, rule(t_in), part, at), r_in, r_in
            return t_in, t_out, recorded, r_in, r_in
        if not ggml.is_quantized(t_out):
            r_out = 0
        elif tgt.rule is not None:
            r_out = rule(t_out)
        elif ggml.is_quantized(t_in):
            r_out = r_in       # the rule depends on the head size only: a quantized cache keeps its rotation
        else:
            r_out = None
        if r_out is None and (ggml.is_quantized(t_in) != ggml.is_quantized(t_out) or self.vout >= 4):
            raise ModelNeeded(part, at, f"the model's head sizes to rotate a {tout.name} {what} cache as "
                                              "llama.cpp does (give -m, or -md for the draft)")
        if ggml.is_quantized(t_in) and r_in is None and not ggml.is_quantized(t_out):
            raise ModelNeeded(part, at, f"the model's head sizes to undo the rotation of a {tin.name} "
                                              f"{what} cache (give -m, or -md for the draft)")
        if self.vout < 4 and r_out is not None:
            check_dropped_rotation(what, t_out, r_out, self.vout, rule(t_out), part, at)
        return t_in, t_out, r_out, r_in, r_out


# -- writing ----------------------------------------------------------------------------------------------


def write_converted(plan: Plan, dest: str | os.PathLike, *, overwrite: bool = False, follow_symlinks: bool = False,
                    layout: MemoryLayout | None = None, draft_layout: MemoryLayout | None = None,
                    progress: Callable[[int], None] | None = None) -> list[LayerError]:
    """Write the converted file to ``dest`` atomically; the errors of every re-encoded record.

    The new file is parsed before it replaces anything (with the layouts, when given); SourceChanged
    when the input changed during the copy. ``progress(bytes written)``. What ``dest`` may be (a regular
    file with ``overwrite``, a symbolic link with ``follow_symlinks``): :func:`~slotctl.atomic.check_destination`.
    """
    errors: dict[tuple, LayerError] = {}

    def check(dst) -> None:
        dst.flush()
        if dst.tell() != plan.output_size:   # pragma: no cover - a planning bug
            raise FormatError("output", dst.tell(), f"{plan.output_size:,} bytes as planned")
        _check_parses(dst, layout, draft_layout)

    write_pieces(plan.parsed, plan.pieces, dest, overwrite=overwrite, follow_symlinks=follow_symlinks,
                 progress=progress, write_other=lambda src, dst, r, tick: _recode(src, dst, r, errors, tick),
                 before_replace=check)
    return list(errors.values())


def _check_parses(dst, layout: MemoryLayout | None, draft_layout: MemoryLayout | None) -> None:
    """Parse the written temporary file (through /proc where there is one) before it replaces anything."""
    fd_path = f"/proc/self/fd/{dst.fileno()}"
    if not os.path.exists(fd_path):   # pragma: no cover - systems without /proc
        return
    with open_slot_file(fd_path, layout=layout, draft_layout=draft_layout) as check:
        if check.errors:   # pragma: no cover - a planning bug; nothing is replaced
            raise FormatError("converted file", None, f"a file that parses; {check.errors[0]}")


def _recode(src, dst, r: Recode, errors: dict, tick) -> None:
    from slotctl import tensors

    t_in, t_out = ggml.BY_ID[r.src], ggml.BY_ID[r.dst]
    row_in = t_in.row_size(r.n_per_row)
    part, role, stream, layer, tensor = r.where
    err = errors.setdefault(r.where, LayerError(part, role, stream, layer, tensor, t_in.name, t_out.name))
    rotate = r.rot_in != r.rot_out
    # measure in the model's space when the rotation is known, else in the stored space
    measure = r.rot_in if r.rot_in is not None else 0
    step = tensors.rows_per_chunk(row_in)
    src.seek(r.span.offset)
    written = 0
    for first in range(0, r.n_rows, step):
        n = min(step, r.n_rows - first)
        raw = src.read(n * row_in)
        if len(raw) != n * row_in:
            raise FormatError(part, src.tell(), f"{n * row_in:,} bytes of {tensor} rows, the file ends first")
        with np.errstate(all="ignore"):   # a damaged cache holds inf and nan: written as they are, never measured
            values = tensors.dequantize(raw, r.src, r.n_per_row)
            true = tensors.rotate(values, measure)
            stored = tensors.rotate(true, r.rot_out or 0) if rotate else values
            out = tensors.quantize(stored, r.dst)
            dst.write(out)
            written += len(out)
            back = tensors.dequantize(out, r.dst, r.n_per_row)
            back_true = tensors.rotate(back, r.rot_out or 0) if rotate else tensors.rotate(back, measure)
            finite = np.isfinite(true) & np.isfinite(back_true)
            if finite.any():
                err.max_abs_error = max(err.max_abs_error, float(np.max(np.abs(back_true - true)[finite])))
                err.max_abs_value = max(err.max_abs_value, float(np.max(np.abs(true)[finite])))
        tick(written)


# -- requests from flags ----------------------------------------------------------------------------------


def cache_type_id(name: str | None, flag: str) -> int | None:
    """The ggml type id of a cache type name given to ``flag``; None for None."""
    if name is None:
        return None
    try:
        return ggml.cache_type(name).id     # the one check of a cache type, as the server reads -ctk
    except ValueError as e:
        raise UsageError(f"{flag} {name}: {e}") from None


def stream_count(n_parallel: int | None, kv_unified: bool) -> int | None:
    """KV streams a server with ``-np n_parallel`` (and ``-kvu``) writes; None when neither is given."""
    if kv_unified:
        return 1
    return n_parallel
