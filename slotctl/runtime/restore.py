"""The server's slot restore executed in real contexts: what ``POST /slots/ID?action=restore`` does, in its order.

The steps and their rules are :mod:`slotctl.server.restore`'s; :func:`restore_slot` runs them on
:class:`~slotctl.runtime.slot.ServerContexts` and reports each (bytes, milliseconds, what became of it
and why):

1. **target** — ``llama_state_seq_load_file``: header, version, token words, and the target payload
   into the slot's sequence. This runtime's loader reads only its own state version
   (:data:`~slotctl.runtime.context.STATE_VERSION`, 3). A version-3 file goes through that loader
   exactly as the server's does; a file of another version (4, what current servers write; 2) is
   converted for this runtime when that is exact (:mod:`slotctl.format.convert`) and loaded as an
   in-memory blob (magic 0xaf143cd8, seq id, payload) with ``llama_state_seq_set_data_ext``, or
   refused with the reason. Any failure: "No available space in KV cache or invalid slot save file".
2. **tokens** — :func:`~slotctl.server.restore.check_tokens`. A refusal empties the slot in both
   contexts, as the server's ``prompt_clear`` does.
3. **checkpoints** — :func:`~slotctl.server.restore.load_slot_checkpoints`; the kept checkpoints' blobs
   are converted for this runtime here and only loaded when a later request needs them (one that cannot
   be converted is kept as it is, as the server keeps it: a rollback to it fails as the server aborts).
4. **draft** — :func:`~slotctl.server.restore.load_slot_draft` with this runtime's draft context (cleared
   first); the speculative state goes nowhere: this runtime drafts as draft-simple, which keeps none.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from slotctl.errors import ExitStatus, FormatError, SlotctlError, UsageError
from slotctl.format.blob import BLOB_HEADER_SIZE, blob_header
from slotctl.format.common import parse
from slotctl.format.convert import convert_blob, convert_payload
from slotctl.format.header import HEADER_FIXED_SIZE, STATE_SEQ_MAGIC, FixedHeader, StateHeader, header_size
from slotctl.format.memory import MemoryLayout
from slotctl.model.info import ModelInfo, read_model_info
from slotctl.model.predict import rotation_rule
from slotctl.runtime.context import STATE_VERSION, Context
from slotctl.runtime.slot import Checkpoint, ServerContexts
from slotctl.server.flags import DEFAULT_CTX_CHECKPOINTS
from slotctl.server.restore import (
    REFUSED,
    RESTORED,
    TARGET_ERROR,
    check_tokens,
    load_slot_checkpoints,
    load_slot_draft,
)
from slotctl.slotfile import Memory, decode_tokens, parse_memory





@dataclass
class Step:
    """One step of the restore: ``name`` ("target", "tokens", "checkpoints", "draft"), its ``status``
    ("restored", "absent", "ignored", "dropped", "refused"), the file ``bytes`` it consumed, the time
    it took, why it was not restored (``reason``) and step-specific ``details``."""

    name: str
    status: str
    bytes: int = 0
    ms: float = 0.0
    reason: str | None = None
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"step": self.name, "status": self.status, "bytes": self.bytes, "ms": round(self.ms, 3),
                "reason": self.reason, **self.details}


class RestoreRefused(SlotctlError):
    """The server would answer "Unable to restore slot: ...": ``message`` is the server's text,
    ``reason`` what llama.cpp or slotctl found, ``steps`` the steps run so far."""

    exit_status = ExitStatus.FAILED

    def __init__(self, message: str, reason: str | None = None, steps: list[Step] | None = None):
        self.message = message
        self.reason = reason
        self.steps = steps or []
        super().__init__(f"Unable to restore slot: {message}" + (f" ({reason})" if reason else ""))


@dataclass
class RestoredSlot:
    """A slot after a successful restore: the tokens it holds, its checkpoints (blobs in this
    runtime's state version), and the report of each step."""

    path: str
    slot: int
    version: int
    token_format: str
    tokens: list[int]
    checkpoints: list[Checkpoint]
    steps: list[Step]
    ms: float

    @property
    def n_bytes(self) -> int:
        """The server's ``n_read``: payload end + checkpoints + draft appendix."""
        return sum(s.bytes for s in self.steps)

    def step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)

    @property
    def draft_status(self) -> str:
        return self.step("draft").status


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _errors(ctx: Context, fallback: str) -> str:
    return "; ".join(ctx.last_errors) or fallback


def _recurrent_overflow(mem: Memory) -> str | None:
    """llama.cpp asserts (aborting the process) on a recurrent section with more than one cell for one
    sequence when the context has several slots; such a state is refused before it reaches llama.cpp."""
    for sec in mem.sections:
        if sec.type == "recurrent" and sec.cell_count > 1:
            return f"the recurrent state holds {sec.cell_count} cells, a sequence has at most 1"
    return None


def prepare_blob(blob: bytes, layout: MemoryLayout | None, version: int, info: ModelInfo | None,
                 layer: str) -> tuple[bytes, str | None]:
    """A state blob of state version ``version`` as this runtime reads it: ``(blob, None)``, or
    ``(b"", reason)`` when the conversion would not be exact or the blob is not a ``layout`` state.

    Without a layout (no model to say it) the blob is passed on as it is when no conversion is needed.
    """
    if not blob or (layout is None and version == STATE_VERSION):
        return blob, None
    if layout is None:
        return b"", f"{layer}: no model to convert it from state version {version} with"
    try:
        if version != STATE_VERSION:
            blob = convert_blob(blob, layout, version, STATE_VERSION, rotations=rotation_rule(info) if info else None,
                                layer=layer)
        if any(s.type == "recurrent" for s in layout.sections):
            mem = parse_memory(io.BytesIO(blob), BLOB_HEADER_SIZE, len(blob), layout, STATE_VERSION, layer)
            bad = _recurrent_overflow(mem)
            if bad:
                return b"", f"{layer}: {bad}"
    except FormatError as e:
        return b"", e.one_line()
    return blob, None


def _read(f: BinaryIO, n: int) -> bytes | None:
    data = f.read(n)
    return data if len(data) == n else None


def restore_slot(sc: ServerContexts, path: str | os.PathLike, slot: int, *,
                 n_ctx_checkpoints: int = DEFAULT_CTX_CHECKPOINTS) -> RestoredSlot:
    """Restore the slot file at ``path`` into sequence ``slot`` as the server does.

    Raises :class:`RestoreRefused` (after emptying the slot in both contexts) where the server answers
    with an error; a damaged or unusable checkpoint or draft layer is reported in its step instead.
    """
    path = os.fspath(path)
    if not 0 <= slot < sc.target.n_seq_max:
        raise UsageError(f"Invalid slot ID {slot}: the server has slots 0..{sc.target.n_seq_max - 1} (-np)")
    t_start = time.perf_counter()
    steps: list[Step] = []
    tinfo = sc.target_info or read_model_info(sc.target_model.path)
    dinfo = None
    if sc.draft is not None:
        dinfo = sc.draft_info or read_model_info(sc.draft_model.path)

    def refuse(step: Step, message: str, reason: str | None) -> RestoreRefused:
        step.status, step.reason = REFUSED, reason
        steps.append(step)
        for ctx in sc.contexts():  # the server's prompt_clear()
            ctx.seq_rm(slot, -1, -1)
        return RestoreRefused(message, reason, steps)

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        # 1. the target payload
        t0 = time.perf_counter()
        step = Step("target", RESTORED)
        head = _read(f, HEADER_FIXED_SIZE)
        fixed = FixedHeader.parse(head) if head else None
        magic, version = (fixed.magic, fixed.version) if fixed else (None, None)
        step.details = {"state_version": version, "converted_from": None}
        if head is not None and magic == STATE_SEQ_MAGIC and version != STATE_VERSION and version in (2, 4):
            try:
                f.seek(0)
                hdr = parse(StateHeader, f, "state header", size=size)
                words = hdr.words
                mem = parse_memory(f, header_size(hdr.n_words), size, tinfo.layout(), version)
                bad = _recurrent_overflow(mem)
                if bad:
                    raise FormatError("target memory", mem.offset, bad)
                f.seek(mem.offset)
                payload = f.read(mem.size)
                payload = convert_payload(payload, tinfo.layout(), version, STATE_VERSION,
                                          rotations=rotation_rule(tinfo), layer="target memory")
            except FormatError as e:
                step.ms = _ms(t0)
                raise refuse(step, TARGET_ERROR, f"state version {version} for this runtime's version "
                                                 f"{STATE_VERSION}: {e.one_line()}{_cut_note(f, size, tinfo, version)}"
                             ) from None
            blob = blob_header(slot) + payload
            n = sc.target.state_seq_set(blob, slot)
            if n != len(blob):
                step.ms = _ms(t0)
                raise refuse(step, TARGET_ERROR, _errors(sc.target, "the state does not fit the target context"))
            nread = mem.end
            step.details["converted_from"] = version
        else:
            if head is not None and magic == STATE_SEQ_MAGIC and version == STATE_VERSION:
                layout = tinfo.layout()
                if any(s.type == "recurrent" for s in layout.sections):
                    try:
                        f.seek(0)
                        hdr = parse(StateHeader, f, "state header", size=size)
                        mem = parse_memory(f, header_size(hdr.n_words), size, layout, version)
                        bad = _recurrent_overflow(mem)
                        if bad:
                            raise FormatError("target memory", mem.offset, bad)
                    except FormatError as e:
                        step.ms = _ms(t0)
                        raise refuse(step, TARGET_ERROR, e.one_line()) from None
            words, nread = sc.target.load_seq_file(path, slot)
            if not nread:
                step.ms = _ms(t0)
                raise refuse(step, TARGET_ERROR, _errors(sc.target, "llama.cpp did not load the file"))
            words = np.asarray(words, dtype=np.int32)
        step.bytes = nread
        step.ms = _ms(t0)
        steps.append(step)

        # 2. the tokens
        t0 = time.perf_counter()
        step = Step("tokens", RESTORED)
        tk = decode_tokens(words)
        step.details = {"format": tk.format, "n_tokens": tk.n_tokens, "n_ctx_slot": sc.target.n_ctx_slot}
        checked = check_tokens(tk, n_ctx_slot=sc.target.n_ctx_slot, n_vocab=sc.target_model.n_vocab,
                               has_mtmd=False)
        if checked.refused:
            raise refuse(step, checked.message, checked.reason)
        tokens = [int(t) for t in tk.tokens]
        step.ms = _ms(t0)
        steps.append(step)

        # 3. the checkpoints
        t0 = time.perf_counter()
        checkpoints, step = _load_checkpoints(f, nread, size, version, tinfo, dinfo, n_ctx_checkpoints)
        step.ms = _ms(t0)
        steps.append(step)

        # 4. the draft state
        t0 = time.perf_counter()
        step = _load_draft(sc, f, nread + step.bytes, size, slot, version, dinfo)
        step.ms = _ms(t0)
        steps.append(step)

    return RestoredSlot(path, slot, version, tk.format, tokens, checkpoints, steps, _ms(t_start))


def _cut_note(f: BinaryIO, size: int, tinfo: ModelInfo, version: int) -> str:
    """When the file ends inside the payload: b11434's loader reads on past the end and may abort
    (slotctl validate decides it, :mod:`slotctl.validate.check`, ``payload_cut``)."""
    from slotctl.format.cut import locate_cut

    try:
        f.seek(0)
        hdr = parse(StateHeader, f, "state header", size=size)
        cut = locate_cut(f, header_size(hdr.n_words), size, tinfo.layout(), version)
    except FormatError:
        return ""
    if cut is None:
        return ""
    return (f"; the file ends inside the payload's {cut.describe()}: llama-server b11434 reads past the end "
            "and refuses the file or aborts (GGML_ASSERT(nread <= state_size)); slotctl validate says which, or "
            "that the source does not settle it")


def _load_checkpoints(f: BinaryIO, offset: int, size: int, version: int, tinfo: ModelInfo,
                      dinfo: ModelInfo | None, n_keep: int) -> tuple[list[Checkpoint], Step]:
    """:func:`slotctl.server.restore.load_slot_checkpoints`, then each kept checkpoint's blobs read and
    converted for this runtime (a checkpoint that cannot be is dropped, with the reason)."""
    got = load_slot_checkpoints(f, offset, size, n_ctx_checkpoints=n_keep)
    step = Step("checkpoints", got.status, got.bytes, reason=got.reason,
                details={"count": got.count, "kept": 0, "checkpoints": []})
    if got.status != RESTORED:
        return [], step
    out, notes = [], [got.reason] if got.reason else []
    t_layout = tinfo.layout().partial()
    d_layout = dinfo.layout().partial() if dinfo else None
    for i, cp in enumerate(got.kept):
        tgt, why = _prepare_partial(cp.tgt.read(f), t_layout, version, tinfo, f"checkpoint {i} target blob")
        dft = b""
        if not why and cp.dft.size:
            dft, why = _prepare_partial(cp.dft.read(f), d_layout, version, dinfo, f"checkpoint {i} draft blob")
            if why and d_layout is None:
                why, dft = None, b""  # no draft context: the draft half is never loaded
        if why:
            # the server's loader checks only lengths and keeps it; a rollback to it aborts the server
            # (GGML_ABORT "checkpoint size mismatch"), as loading the unconverted bytes fails here
            notes.append(f"kept as the server keeps it, though a rollback to it aborts: {why}")
            tgt, dft = cp.tgt.read(f), cp.dft.read(f)
        out.append(Checkpoint(cp.n_tokens, cp.pos_min, cp.pos_max, tgt, dft, cp.spec.read(f)))
    step.details.update(kept=len(out), checkpoints=[{"n_tokens": c.n_tokens, "pos_min": c.pos_min,
                                                     "pos_max": c.pos_max} for c in out])
    step.reason = "; ".join(notes) or None
    return out, step


def _prepare_partial(blob: bytes, layout: MemoryLayout | None, version: int, info: ModelInfo | None,
                     layer: str) -> tuple[bytes, str | None]:
    """:func:`prepare_blob` for a checkpoint's PARTIAL_ONLY blob: the blob header alone is a plain KV cache's
    state as libllama b11434 and later write it (kept as it is: :func:`slotctl.runtime.speculative` reads
    nothing of it, as that libllama does)."""
    if len(blob) == BLOB_HEADER_SIZE and layout is not None and layout.kind == "kv":
        return blob, None
    return prepare_blob(blob, layout, version, info, layer)


def _load_draft(sc: ServerContexts, f: BinaryIO, offset: int, size: int, slot: int, version: int,
                dinfo: ModelInfo | None) -> Step:
    """:func:`slotctl.server.restore.load_slot_draft` in this runtime's draft context (its speculative decoding
    is draft-simple, which keeps no speculative state)."""
    if sc.draft is not None:
        sc.draft.seq_rm(slot, -1, -1)

    def set_draft(span) -> str | None:
        blob, why = prepare_blob(span.read(f), dinfo.layout() if dinfo else None, version, dinfo, "draft state")
        if not why:
            n = sc.draft.state_seq_set(blob, slot)
            if n != len(blob):
                why = _errors(sc.draft, "the draft context did not take it")
        if why:
            sc.draft.seq_rm(slot, -1, -1)
        return why

    got = load_slot_draft(f, offset, size, has_draft_context=sc.draft is not None, set_draft=set_draft)
    step = Step("draft", got.status, got.bytes, reason=got.reason,
                details={"draft_size": got.dft.size if got.dft else 0, "spec_size": got.spec.size if got.spec else 0,
                         "positions": None, "speculative": got.speculative.status if got.speculative else None})
    if got.status == RESTORED and got.dft.size:
        step.details["positions"] = [sc.draft.seq_pos_min(slot), sc.draft.seq_pos_max(slot)]
    return step
