"""A slot file opened lazily: where every layer starts and ends, and what it holds.

:func:`open_slot_file` parses the header and the token words eagerly, then locates the memory payload
(with a known :class:`~slotctl.format.memory.MemoryLayout`, or by trying the candidate layouts) and
the appendix chain behind it. Tensor bytes are never read: records hold :class:`~slotctl.format.common.Span`
objects, so the cost grows with cells and layers, not with bytes.

Damage does not stop the walk: what parsed is kept, the first error per layer is recorded in
``SlotFile.errors`` and the layers behind a broken one are left unknown.

A parsed file owns its open stream (as pyelftools' ``ELFFile`` does): every later read of its bytes (a
layer's tensor data, a media chunk, a trailing magic, a rebuild) goes through :meth:`SlotFile.read_at` or
``SlotFile.stream``, never through its name, so ``-`` (standard input), a file renamed or replaced
meanwhile, or a ranged remote object read the same bytes the parse located. The stream needs only
``read``, ``seek`` and ``tell`` (``fileno`` when it is a local file: then reads are ``pread``s and
:meth:`SlotFile.changed` can tell that the file changed under the command).
"""

from __future__ import annotations

import io
import os
import struct
import weakref
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import BinaryIO

import construct as cs
import numpy as np

from slotctl.errors import FormatError
from slotctl.format import appendix as apx
from slotctl.format import blob as blobfmt
from slotctl.format import tokens as tokfmt
from slotctl.format.appendix import CHECKPOINT_MIN_SIZE
from slotctl.format.common import (CHECKPOINT_COST, CheckError, FileBudget, Span, TrackingReader, hex32, parse,
                                   parse_bytes)
from slotctl.format.header import STATE_SEQ_MAGIC, StateHeader, header_size
from slotctl.format.magic import file_kind
from slotctl.format.memory import MemoryLayout, candidate_layouts
from slotctl.format.recurrent import records_fit, recurrent_head
from slotctl.paths import STDIN
from slotctl.format.ahead import prefetch
from slotctl.sources import input_size, open_input, raise_failure, ranged_view, remote_url

SCAN_CHUNK = 1 << 20
#: how far from the end of the file an appendix chain is looked for when the payload cannot be located
SCAN_WINDOW = 64 << 20


def checkpoint_layer(i: int, kind: str) -> str:
    """The name of checkpoint ``i``'s ``kind`` ("target" or "draft") layer, as findings, damage records
    (with " blob") and diffs name it: ``checkpoint 3 target``."""
    return f"checkpoint {i} {kind}"


def is_checkpoint_layer(name: str) -> bool:
    """Whether a layer's name (a finding's, a damage record's, a change's) is one of a checkpoint's."""
    return name.startswith("checkpoint ")


@dataclass
class Tokens:
    """The token words, decoded."""

    format: str                      # "packed" or "legacy"
    tokens: np.ndarray
    media: list = field(default_factory=list)   # [(start index, Span or bytes)]
    error: FormatError | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class Memory:
    """A parsed memory payload or blob body: its sections as construct Containers."""

    offset: int
    end: int
    layout: MemoryLayout
    sections: list
    section_spans: list = field(default_factory=list)   # Span of each section

    @property
    def size(self) -> int:
        return self.end - self.offset


def written_flags(mem: Memory) -> tuple[str | None, str | None, str | None, int | None]:
    """The server flags a memory was written with, as far as its bytes say: the K and V cache types and the
    flash-attention setting (``-ctk``, ``-ctv``, ``-fa`` "on"/"off": V rows transposed without it) of its
    first KV stream with cells, and its KV stream count (one per slot, or 1 with ``-kvu``). None where the
    bytes do not say: the types and ``-fa`` of a memory whose KV streams hold no cells (a stream without cells
    is its cell count alone: the save of a slot that holds nothing, b11434 ``llama_kv_cache::state_write``) or
    that has no KV section (a recurrent state), the V type of layers without V (MLA), the stream count without
    a KV section. Metadata only: no tensor byte is read."""
    from slotctl.format import ggml

    n_stream = next((len(sec.streams) for sec in mem.sections if sec.type == "kv"), None)
    for sec in mem.sections:
        if sec.type != "kv":
            continue
        st = next((s for s in sec.streams if s.cell_count), None)
        if st is None:
            continue
        d = st.data
        tk = ggml.type_name(d.k[0].type) if len(d.k) else None
        tv = ggml.type_name(d.v[0].type) if len(d.v) else None
        return tk, tv, "off" if d.v_trans else "on", n_stream
    return None, None, None, n_stream


def memory_flags(mem: Memory) -> tuple[str, str, str, int]:
    """:func:`written_flags` with llama-server's defaults where the bytes do not say: f16, "on" and 1 (a
    memory without KV rows), the K type for the V type of layers without V. ``identify`` and validate's file
    classes read it."""
    tk, tv, fa, n_stream = written_flags(mem)
    tk = tk or "f16"
    return tk, tv or tk, fa or "on", n_stream or 1


@dataclass
class Blob:
    """An in-memory state blob inside an appendix."""

    span: Span
    seq_id: int | None = None
    memory: Memory | None = None
    error: FormatError | None = None
    candidates: list = field(default_factory=list)   # layouts that fit, when no layout was given
    #: the blob header alone (8 bytes): a plain KV cache's PARTIAL_ONLY state as libllama b11434 and later
    #: write it (a checkpoint's blob; llama-cpp-python 0.3.36 writes the whole cache there)
    header_only: bool = False


@dataclass
class CheckpointEntry:
    n_tokens: int
    pos_min: int
    pos_max: int
    tgt: Blob
    dft: Blob
    spec: Span


@dataclass
class Appendix:
    name: str               # "SCKP" or "SDFT"
    offset: int
    end: int
    parsed: object          # the construct Container (lazy spans inside)

    @property
    def size(self) -> int:
        return self.end - self.offset


#: the most one :meth:`SlotFile.read_at` call reads at once (larger reads are made of such pieces)
READ_CHUNK = 8 << 20


_BUDGETS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def budget_for(f) -> FileBudget | None:
    """The :class:`~slotctl.format.common.FileBudget` of the open stream ``f``: one per stream, shared by
    every walk of it (another layout, a second reading by the same command), sized by the bytes the file
    really has (its allocated blocks, for a local file; its size, for others)."""
    try:
        b = _BUDGETS.get(f)
    except TypeError:   # a stream without weak references: no shared budget
        return None
    if b is None:
        try:
            st = os.fstat(f.fileno())
            size, allocated = st.st_size, getattr(st, "st_blocks", None)
            allocated = allocated * 512 if allocated is not None else None
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            here = f.tell()
            size, allocated = f.seek(0, os.SEEK_END), None
            f.seek(here)
        b = _BUDGETS[f] = FileBudget(size, allocated)
    return b


def stream_identity(f) -> tuple | None:
    """(device, inode, size, modification time in ns) of an open local file; None for other streams."""
    try:
        st = os.fstat(f.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    return stat_identity(st)


def stat_identity(st: os.stat_result) -> tuple:
    """What tells that a file is still the one that was parsed: (device, inode, size, modification time in
    ns), from its stat."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class SlotFile:
    path: str
    size: int
    version: int | None = None
    header_end: int | None = None
    words: np.ndarray | None = None
    tokens: Tokens | None = None
    target: Memory | None = None
    target_candidates: list = field(default_factory=list)
    checkpoints: list[CheckpointEntry] | None = None
    sckp: Appendix | None = None
    sdft: Appendix | None = None
    draft: Blob | None = None
    draft_spec: Span | None = None
    trailing: Span | None = None
    #: located without a model: no known layout parses within the file (the payload is cut short)
    payload_cut: bool = False
    errors: list[FormatError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: the open stream the file was parsed from (see the module docstring); closed by :meth:`close` when
    #: :func:`open_slot_file` opened it, left to the caller when :func:`read_slot_file` was given it
    stream: BinaryIO | None = field(default=None, repr=False, compare=False)
    #: :func:`stream_identity` of the stream when it was parsed
    identity: tuple | None = field(default=None, repr=False, compare=False)
    owns_stream: bool = field(default=False, repr=False, compare=False)

    @property
    def damaged(self) -> bool:
        return bool(self.errors)

    def read_at(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` of the parsed stream (fewer at its end), read in pieces of at
        most :data:`READ_CHUNK` bytes: a ``pread`` on a local file (the stream's position is left alone)."""
        if self.stream is None:
            raise ValueError(f"{self.path}: the slot file is closed")
        n = max(0, min(n, self.size - offset))
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            fd = None
        parts, done = [], 0
        while done < n:
            want = min(READ_CHUNK, n - done)
            if fd is not None:
                b = os.pread(fd, want, offset + done)
            else:
                self.stream.seek(offset + done)
                b = self.stream.read(want)
            if not b:
                break
            parts.append(b)
            done += len(b)
        return b"".join(parts)

    def changed(self) -> str | None:
        """Why the file is no longer the one that was parsed (its size, its modification time, or its name
        now naming another file), or None when it is the same (or when a stream cannot tell)."""
        if self.identity is None or self.stream is None:
            return None
        now = stream_identity(self.stream)
        if now is None:
            return None
        if now[2] != self.identity[2]:
            return f"its size changed from {self.identity[2]:,} to {now[2]:,} bytes while it was read"
        if now[3] != self.identity[3]:
            return "it was written to while it was read (its modification time changed)"
        if self.path != STDIN:
            try:
                st = os.stat(self.path)
            except OSError:
                return None   # removed: what was read is still the file that was parsed
            if (st.st_dev, st.st_ino) != self.identity[:2]:
                return "its name now names another file (it was replaced while it was read)"
        return None

    def close(self) -> None:
        """Close the stream when this object opened it."""
        if self.owns_stream and self.stream is not None:
            self.stream.close()
        self.stream = None

    def __del__(self) -> None:   # a file dropped without close(): its stream goes with it, quietly
        if self.owns_stream and self.stream is not None:
            self.stream.close()

    def __enter__(self) -> "SlotFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_error(self, part: str, e: FormatError) -> None:
        """Record ``e`` as damage of the layer ``part`` ("state header", "token words", "target memory",
        "SCKP appendix", "SDFT appendix", "checkpoint N target blob", "checkpoint N draft blob",
        "SDFT draft blob"): readers of ``errors`` compare ``e.part``, never parse ``e.layer``."""
        e.part = part
        self.errors.append(e)

    @property
    def payload_end(self) -> int | None:
        return self.target.end if self.target else None

    def layers(self) -> list[tuple[str, int, int]]:
        """(name, offset, size) of each layer found, in file order."""
        out = []
        if self.header_end is not None:
            out.append(("state header", 0, 12))
            out.append(("token words", 12, self.header_end - 12))
        if self.target:
            out.append(("target memory", self.target.offset, self.target.size))
        if self.sckp:
            out.append(("SCKP appendix", self.sckp.offset, self.sckp.size))
        if self.sdft:
            out.append(("SDFT appendix", self.sdft.offset, self.sdft.size))
        if self.trailing and self.trailing.size:
            name = "unparsed bytes" if self.errors else "trailing bytes"
            out.append((name, self.trailing.offset, self.trailing.size))
        return out


def parse_memory(f: BinaryIO, offset: int, end: int, layout: MemoryLayout, version: int,
                 layer: str = "target memory", lazy: bool = True, memo: dict | None = None) -> Memory:
    """Parse the sections of ``layout`` from ``offset``; the reader cannot go past ``end``.

    ``memo``: sections already parsed (or failed) at an offset with the same schema, shared by the
    candidate layouts tried on one payload, most of which begin with the same KV section.
    """
    budget = budget_for(f)
    f.seek(offset)
    reader = TrackingReader(f, end)
    sections, spans = [], []
    for sec in layout.sections:
        what = _section_layer(layer, sec) if len(layout.sections) > 1 else layer
        at = reader.tell()
        key = _memo_key(at, sec)
        hit = memo.get(key) if memo is not None else None
        if hit is None and memo is not None and sec.type == "kv" and not sec.v_records and lazy:
            hit = _without_v(memo.get(_memo_key(at, replace(sec, v_records=True))))
        if hit is None and memo is not None and sec.type == "recurrent":
            head = memo.get((at, "recurrent head"))
            if head is None:
                try:
                    head = parse(recurrent_head, reader, what, version=version, lazy=lazy)
                except FormatError as e:
                    head = e
                memo[(at, "recurrent head")] = head
                reader.seek(at)
            if isinstance(head, FormatError):
                hit = head
            elif not records_fit(sec.n_r, sec.n_s, head.n_layer):
                hit = FormatError(what, at, f"a recurrent section of {sec.n_r} r and {sec.n_s} s records, but its "
                                            f"layer count is {head.n_layer}")
        if hit is None:
            try:
                hit = (parse(sec.schema(), reader, what, version=version, lazy=lazy, cells_memo=memo,
                             file_budget=budget), reader.tell())
            except FormatError as e:
                hit = e
            if memo is not None:
                memo[key] = hit
        if isinstance(hit, FormatError):
            raise hit
        sections.append(hit[0])
        reader.seek(hit[1])
        spans.append(Span(at, hit[1] - at))
    return Memory(offset, reader.tell(), layout, sections, spans)


def _memo_key(at: int, sec) -> tuple:
    """What a section parsed at ``at`` is remembered by among the candidate layouts of one payload."""
    return (at, sec.type, sec.has_ext, sec.v_records, sec.n_r, sec.n_s)


@lru_cache(maxsize=256)
def _section_layer(layer: str, sec) -> str:
    return f"{layer} ({sec.describe()})"


def _without_v(hit):
    """A one-stream KV section parsed with V records, as the same bytes parse without them (a layout of no V:
    the same cells, data header and K records, ending where the V records begin); None when it cannot be
    told from that parse (it failed, or it has several streams: the next stream would start elsewhere)."""
    if not isinstance(hit, tuple) or hit[0].n_stream != 1:
        return None
    sec, end = hit
    stream = sec.streams[0]
    data = stream.data
    if data is not None and len(data.k):
        if not isinstance(data.k[-1].data, Span):
            return None
        end = data.k[-1].data.end
    if data is not None:
        data = cs.Container(data)
        data.v = cs.ListContainer()
    return cs.Container(sec, streams=cs.ListContainer([cs.Container(stream, data=data)])), end


def _known_to_fail(memo: dict, offset: int, layout: MemoryLayout) -> bool:
    """Whether the sections already parsed at their offsets (``memo``) show that ``layout`` cannot parse from
    ``offset``: a section of it failed there, or a recurrent head there has another layer count. Saves
    the candidates that share a failed section a parse each."""
    at = offset
    for sec in layout.sections:
        hit = memo.get(_memo_key(at, sec))
        if hit is None:
            if sec.type == "recurrent":
                head = memo.get((at, "recurrent head"))
                return isinstance(head, FormatError) or (head is not None
                                                         and not records_fit(sec.n_r, sec.n_s, head.n_layer))
            return False
        if isinstance(hit, FormatError):
            return True
        at = hit[1]
    return False


def parse_blob(f: BinaryIO, span: Span, layout: MemoryLayout | None, version: int, layer: str, *,
               partial: bool = False) -> Blob:
    """Dissect an in-memory blob at ``span``; without a layout, the candidates that fill it exactly.

    ``partial``: a PARTIAL_ONLY blob (a checkpoint's): the blob header alone is a plain KV cache's state as
    libllama b11434 and later write it (``header_only``), read so when the layout is a plain KV cache or
    not known."""
    b = Blob(span)
    if span.size == 0:
        return b
    f.seek(span.offset)
    try:
        hdr = parse(blobfmt.BlobHeader, TrackingReader(f, span.end), layer)
    except FormatError as e:
        b.error = e
        return b
    b.seq_id = hdr.seq_id
    body = span.offset + blobfmt.BLOB_HEADER_SIZE
    if partial and span.size == blobfmt.BLOB_HEADER_SIZE and (layout is None or layout.kind == "kv"):
        b.header_only = True
        return b
    if layout is not None:
        try:
            m = parse_memory(f, body, span.end, layout, version, layer)
        except FormatError as e:
            b.error = e
            return b
        if m.end != span.end:
            b.error = FormatError(layer, m.end, f"the end of the blob at 0x{span.end:x}, "
                                                f"{span.end - m.end:,} bytes are left over")
        b.memory = m
        return b
    fits = [m for m in _try_layouts(f, body, span.end, version, layer) if m.end == span.end]
    if not fits:
        fits = [m for m in _try_layouts(f, body, span.end, version, layer, ext=True) if m.end == span.end]
    fits = _distinct(fits)
    b.candidates = [m.layout for m in fits]
    if len(fits) == 1:
        b.memory = fits[0]
    elif not fits:
        b.error = FormatError(layer, body, "a memory payload of a known kind that fills the blob; none fits")
    return b


def _try_layouts(f: BinaryIO, offset: int, end: int, version: int, layer: str, *, ext: bool = False) -> list[Memory]:
    """The candidate layouts (with cell ext or without) that parse from ``offset``.

    Cells with ext are tried only when no layout without fits: a file without ext read as one with ext
    parses far into the cells before it fails, and ext belongs to few models (M-RoPE, n-gram heads).
    """
    out = []
    memo: dict = {}
    for cand in candidate_layouts():
        if any(s.has_ext for s in cand.sections) != ext or _known_to_fail(memo, offset, cand):
            continue
        try:
            out.append(parse_memory(f, offset, end, cand, version, layer, memo=memo))
        except FormatError:
            continue
    return out


def _empty_kv(sec) -> bool:
    return sec.type == "kv" and all(st.cell_count == 0 for st in sec.streams)


def _distinct(fits: list[Memory]) -> list[Memory]:
    """``fits`` without layouts that read the same bytes the same way as an earlier one.

    A KV section whose streams hold no cells has no cells and no records, so whether its cells would carry
    ext or its layers V does not show: such layouts are one reading of the file, not an ambiguity.
    """
    out: list[Memory] = []
    for m in fits:
        same = any(o.end == m.end and len(o.sections) == len(m.sections)
                   and all(a.role == b.role and a.type == b.type and (a == b or (_empty_kv(x) and _empty_kv(y)))
                           for a, b, x, y in zip(o.layout.sections, m.layout.sections, o.sections, m.sections))
                   for o in out)
        if not same:
            out.append(m)
    return out


def torn_magic(tail: bytes) -> bool:
    """Whether ``tail`` (the bytes after the last layer) is 1-3 bytes of an appendix magic."""
    return 0 < len(tail) < 4 and any(struct.pack("<I", m).startswith(tail) for m in apx.MAGICS)


def _read_u32(f: BinaryIO, offset: int) -> int | None:
    f.seek(offset)
    b = f.read(4)
    return struct.unpack("<I", b)[0] if len(b) == 4 else None


def _parse_chain(f: BinaryIO, offset: int, size: int) -> tuple[Appendix | None, Appendix | None, int, FormatError | None]:
    """Parse SCKP then SDFT (each optional) from ``offset``.

    Returns (sckp, sdft, end of what parsed, error). An unknown word where an appendix could start ends
    the chain: the rest is trailing bytes.
    """
    sckp = sdft = None
    pos = offset
    magic = _read_u32(f, pos)
    if magic == apx.SCKP_MAGIC:
        count = _read_u32(f, pos + 8)
        budget = budget_for(f)
        # each checkpoint costs its objects and its blobs' reading: a count the bytes and slotctl's bound
        # allow (the schema says what they do not) is charged before any is read
        if budget is not None and count is not None and count * CHECKPOINT_MIN_SIZE <= size - pos \
                and count <= apx.MAX_CHECKPOINTS:
            key = ("SCKP", pos)
            if key not in budget.seen:   # charged once; a refusal is remembered for the next walk
                room = max(0, budget.limit - budget.used) // CHECKPOINT_COST
                try:
                    budget.charge_once(key, count * CHECKPOINT_COST, "checkpoint count", pos + 8)
                except CheckError:
                    budget.refused[key] = _over_budget(room, count, budget)
            if key in budget.refused:
                err = FormatError("SCKP appendix", pos + 8, budget.refused[key])
                err.part = "SCKP appendix"
                return None, None, pos, err
        f.seek(pos)
        r = TrackingReader(f, size)
        try:
            parsed = parse(apx.SckpAppendix, r, "SCKP appendix", lazy=True)
        except FormatError as e:
            e.part = "SCKP appendix"
            return None, None, pos, e
        sckp = Appendix("SCKP", pos, r.tell(), parsed)
        pos = r.tell()
        magic = _read_u32(f, pos)
    if magic == apx.SDFT_MAGIC:
        f.seek(pos)
        r = TrackingReader(f, size)
        try:
            parsed = parse(apx.SdftAppendix, r, "SDFT appendix", lazy=True)
        except FormatError as e:
            e.part = "SDFT appendix"
            return sckp, None, pos, e
        sdft = Appendix("SDFT", pos, r.tell(), parsed)
        pos = r.tell()
    return sckp, sdft, pos, None


def _over_budget(most: int, count: int, budget: FileBudget) -> str:
    """What a checkpoint count beyond the file's budget is told (findings read it as slotctl's own bound)."""
    disk = f" ({budget.real:,} on disk)" if budget.real < budget.size else ""
    return (f"checkpoint count of at most {most:,} in a file of {budget.size:,} bytes{disk} (slotctl reads at most "
            f"{budget.limit:,} bytes' worth of cells, token words and checkpoints in one file), found {count:,}")


def _chain_fits(f: BinaryIO, offset: int, size: int) -> bool:
    """Whether a valid appendix chain (or nothing) runs from ``offset`` exactly to the end of the file."""
    if offset == size or _torn_to_end(f, offset, size):
        return True
    sckp, sdft, end, err = _parse_chain(f, offset, size)
    return err is None and (sckp or sdft) is not None and (end == size or _torn_to_end(f, end, size))


def _torn_to_end(f: BinaryIO, offset: int, size: int) -> bool:
    if not 0 < size - offset < 4:
        return False
    f.seek(offset)
    return torn_magic(f.read(size - offset))


def _starts_appendix(f: BinaryIO, offset: int) -> bool:
    return _read_u32(f, offset) in apx.MAGICS


def open_slot_file(path: str | os.PathLike, *, layout: MemoryLayout | None = None,
                   draft_layout: MemoryLayout | None = None) -> SlotFile:
    """Parse every layer of the slot file at ``path`` that can be found (see the module docstring).

    The returned file holds ``path`` open (its :attr:`SlotFile.stream`) until :meth:`SlotFile.close` (or
    the end of a ``with`` block over it, or its collection)."""
    path = os.fspath(path)
    f = open_input(path)   # a FIFO or a device is refused, never read; s3:// read in ranges
    try:
        sf = read_slot_file(f, remote_url(path) or path, layout=layout, draft_layout=draft_layout)
    except BaseException:
        f.close()
        raise
    sf.owns_stream = True
    return sf


def read_slot_file(f: BinaryIO, path: str | os.PathLike, *, layout: MemoryLayout | None = None,
                   draft_layout: MemoryLayout | None = None) -> SlotFile:
    """:func:`open_slot_file` on a stream the caller holds open (``path``: its name, as shown), so that a
    command that reads a file more than once (another layout, its media chunks, a layer's bytes) opens it
    once. ``f`` needs ``read``, ``seek`` and ``tell`` (a local file or a
    :class:`~slotctl.sources.RangedFile`); it stays the caller's to close."""
    identity = stream_identity(f)
    size = identity[2] if identity is not None else input_size(f)
    view = ranged_view(f, size)   # the record headers the head predicts, fetched in one batch (format.ahead)
    if view is not None:
        prefetch(view)
    sf = SlotFile(os.fspath(path), size, stream=f, identity=identity)
    f.seek(0)
    _walk(f, sf, layout, draft_layout)
    raise_failure(f)   # a store that failed mid-read: its error, not damage
    return sf


def read_for_layout(f: BinaryIO, path: str | os.PathLike, layout: MemoryLayout,
                    draft_layout: MemoryLayout | None = None) -> tuple[SlotFile, bool]:
    """The file parsed with a model's layouts (:func:`read_slot_file`); when its target memory does not parse
    so but does as the file is — memory of another kind: the file was saved with another model — parsed as
    it is. Returns the file and whether its target memory parsed with ``layout``."""
    sf = read_slot_file(f, path, layout=layout, draft_layout=draft_layout)
    if sf.target is not None or sf.header_end is None:
        return sf, sf.target is not None
    generic = read_slot_file(f, path)
    return (generic if generic.target is not None else sf), False


def open_for_layout(path: str | os.PathLike, layout: MemoryLayout,
                    draft_layout: MemoryLayout | None = None) -> tuple[SlotFile, bool]:
    """:func:`read_for_layout` of the file at ``path``, held open as :func:`open_slot_file` holds it."""
    path = os.fspath(path)
    f = open_input(path)
    try:
        sf, parsed = read_for_layout(f, remote_url(path) or path, layout, draft_layout)
    except BaseException:
        f.close()
        raise
    sf.owns_stream = True
    return sf, parsed


def _walk(f: BinaryIO, sf: SlotFile, layout: MemoryLayout | None, draft_layout: MemoryLayout | None) -> None:
    size = sf.size
    try:
        hdr = parse(StateHeader, TrackingReader(f, size), "state header", file_budget=budget_for(f))
    except FormatError as e:
        f.seek(0)
        if file_kind(f.read(4)) == "gguf":
            e = FormatError("state header", 0, "this is a GGUF model, not a slot file (a slot file begins with "
                            f"the state magic {hex32(STATE_SEQ_MAGIC)}, a model with \"GGUF\")")
            e.code = "gguf_model"
        sf.add_error("state header", e)
        return
    sf.version = hdr.version
    sf.words = hdr.words
    sf.header_end = header_size(hdr.n_words)
    sf.tokens = decode_tokens(hdr.words)
    if sf.tokens.error:
        sf.add_error("token words", sf.tokens.error)

    # layer 2: the payload
    start = sf.header_end
    if layout is not None:
        try:
            sf.target = parse_memory(f, start, size, layout, sf.version)
        except FormatError as e:
            sf.add_error("target memory", e)
            _scan_appendices(f, sf, start)
            return
    else:
        fits = _try_layouts(f, start, size, sf.version, "target memory")
        strict = [m for m in fits if _chain_fits(f, m.end, size)]
        if not strict:
            fits += _try_layouts(f, start, size, sf.version, "target memory", ext=True)
            strict = [m for m in fits if _chain_fits(f, m.end, size)]
        loose = _distinct(strict or [m for m in fits if _starts_appendix(f, m.end)])
        sf.target_candidates = [m.layout for m in loose]
        sf.payload_cut = not fits
        if len(loose) == 1:
            sf.target = loose[0]
            if not strict:
                sf.warnings.append("the payload layout was chosen because it ends where an appendix magic "
                                   "starts; that appendix is damaged")
        else:
            if not loose:
                msg = ("a memory payload of a known kind ending at the end of the file or at an appendix; "
                       "none fits (give --model to name the layout)")
            else:
                kinds = ", ".join(sorted({m.layout.describe() for m in loose}))
                msg = f"one memory layout, but {len(loose)} fit: {kinds} (give --model to tell them apart)"
            sf.add_error("target memory", FormatError("target memory", start, msg))
            _scan_appendices(f, sf, start)
            return

    _read_appendices(f, sf, sf.target.end, draft_layout)


def _read_appendices(f: BinaryIO, sf: SlotFile, offset: int, draft_layout: MemoryLayout | None) -> None:
    size = sf.size
    sckp, sdft, end, err = _parse_chain(f, offset, size)
    sf.sckp, sf.sdft = sckp, sdft
    if err is not None:
        sf.add_error(err.part, err)
        # behind a damaged appendix nothing can be located
        sf.trailing = Span(end, size - end)
    elif end < size:
        sf.trailing = Span(end, size - end)   # a torn appendix magic included (findings name it)
    version = sf.version
    tgt_partial = sf.target.layout.partial() if sf.target else None
    dft_partial = draft_layout.partial() if draft_layout else None
    if sckp is not None:
        sf.checkpoints = []
        budget = budget_for(f)
        for i, c in enumerate(sckp.parsed.checkpoints):
            if budget is not None and budget.exhausted:   # the file's budget is spent: nothing more is read
                e = FormatError("SCKP appendix", c.tgt.data.offset - 32,
                                _over_budget(i, len(sckp.parsed.checkpoints), budget) + f"; checkpoints from {i:,} on "
                                "are not read")
                sf.add_error("SCKP appendix", e)
                break
            tgt = parse_blob(f, c.tgt.data, tgt_partial, version, f"{checkpoint_layer(i, 'target')} blob",
                             partial=True)
            dft = parse_blob(f, c.dft.data, dft_partial, version, f"{checkpoint_layer(i, 'draft')} blob",
                             partial=True)
            for kind, b in (("target", tgt), ("draft", dft)):
                if b.error:
                    sf.add_error(f"{checkpoint_layer(i, kind)} blob", b.error)
            sf.checkpoints.append(CheckpointEntry(c.n_tokens, c.pos_min, c.pos_max, tgt, dft, c.spec.data))
    if sdft is not None:
        sf.draft = parse_blob(f, sdft.parsed.dft.data, draft_layout, version, "SDFT draft blob")
        sf.draft_spec = sdft.parsed.spec.data
        if sf.draft.error:
            sf.add_error("SDFT draft blob", sf.draft.error)


def _scan_appendices(f: BinaryIO, sf: SlotFile, start: int) -> None:
    """Find an appendix chain that parses to the end of the file, when the payload could not be located.

    Bounded: only the last :data:`SCAN_WINDOW` bytes are read (an appendix chain is the end of the file,
    and its magics start it), so a damaged payload in a large file costs at most that much reading.
    """
    size = sf.size
    magics = [struct.pack("<I", m) for m in apx.MAGICS]
    pos = max(start, size - SCAN_WINDOW)
    while pos < size:
        f.seek(pos)
        chunk = f.read(SCAN_CHUNK + 3)
        if not chunk:
            break
        for m in magics:
            i = chunk.find(m)
            while i != -1 and i < SCAN_CHUNK:
                if _chain_fits(f, pos + i, size):
                    sckp, sdft, _end, _err = _parse_chain(f, pos + i, size)
                    sf.sckp, sf.sdft = sckp, sdft
                    if sdft is not None:
                        sf.draft = parse_blob(f, sdft.parsed.dft.data, None, sf.version or 4, "SDFT draft blob")
                        sf.draft_spec = sdft.parsed.spec.data
                    sf.warnings.append(f"found an appendix chain at 0x{pos + i:x} by scanning")
                    return
                i = chunk.find(m, i + 1)
        pos += SCAN_CHUNK


def decode_tokens(words: np.ndarray) -> Tokens:
    """The token words as the server reads them: packed record, or legacy plain list."""
    if not tokfmt.is_packed(words):
        return Tokens("legacy", words)
    data = words.tobytes()
    try:
        rec = parse_bytes(tokfmt.PackedTokens, data, "token words", base=12)
    except FormatError as e:
        return Tokens("packed", np.zeros(0, np.int32), error=e)
    media = list(zip((int(s) for s in rec.media_start), (m.data for m in rec.media)))
    return Tokens("packed", rec.tokens, media)


# -- building -------------------------------------------------------------------------------------

def build_memory(f: BinaryIO, mem: Memory, version: int) -> bytes:
    """The bytes of ``mem`` rebuilt from its schemas (tensor bytes read from ``f``)."""
    full = parse_memory(f, mem.offset, mem.end, mem.layout, version, lazy=False)
    return b"".join(sec.schema().build(parsed, version=version)
                    for sec, parsed in zip(mem.layout.sections, full.sections))


def build_blob(f: BinaryIO, b: Blob, version: int) -> bytes:
    """A blob rebuilt from its dissection, or its raw bytes when it could not be dissected."""
    if b.memory is None or b.seq_id is None:
        return b.span.read(f)
    return blobfmt.blob_header(b.seq_id) + build_memory(f, b.memory, version)


def build_header(version: int, words) -> bytes:
    return StateHeader.build(dict(magic=STATE_SEQ_MAGIC, version=version, n_words=len(words), words=words))


def rebuild(sf: SlotFile) -> bytes:
    """The whole file rebuilt layer by layer from the schemas: equal to the file when parsing is right.

    Reads every tensor byte: for tests and small files.
    """
    if sf.damaged or sf.target is None:
        raise FormatError("file", None, "a file that parsed without errors")
    f = sf.stream
    parts = [build_header(sf.version, sf.words), build_memory(f, sf.target, sf.version)]
    if sf.checkpoints is not None:
        parts.append(apx.build_sckp([
            dict(n_tokens=c.n_tokens, pos_min=c.pos_min, pos_max=c.pos_max,
                 tgt=build_blob(f, c.tgt, sf.version), dft=build_blob(f, c.dft, sf.version),
                 spec=c.spec.read(f)) for c in sf.checkpoints]))
    if sf.sdft is not None:
        parts.append(apx.build_sdft(build_blob(f, sf.draft, sf.version), sf.draft_spec.read(f)))
    if sf.trailing is not None and sf.trailing.size:
        parts.append(sf.trailing.read(f))
    return b"".join(parts)
