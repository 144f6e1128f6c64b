"""The server's slot restore as a library: what ``POST /slots/ID?action=restore`` does, in its order.

llama-server (the draft-state change ea736c1d5, on top of b11434) restores a slot file in four steps; :func:`restore_slot` runs
them on :class:`~slotctl.runtime.slot.ServerContexts` and reports each (bytes, milliseconds, what became
of it and why):

1. **target** — ``llama_state_seq_load_file``: header, version, token words, and the target payload
   into the slot's sequence. This runtime's loader reads only its own state version
   (:data:`~slotctl.runtime.context.STATE_VERSION`, 3). A version-3 file goes through that loader
   exactly as the server's does; a file of another version (4, what current servers write; 2) is
   converted for this runtime when that is exact (:mod:`slotctl.format.convert`) and loaded as an
   in-memory blob (magic 0xaf143cd8, seq id, payload) with ``llama_state_seq_set_data_ext``, or
   refused with the reason. Any failure: "No available space in KV cache or invalid slot save file".
2. **tokens** — the token words as the server reads them (packed record or legacy list); the restored
   prompt must fit the slot ("Restored prompt does not fit in the slot context") and every token be
   in the vocabulary ("Invalid tokens in slot save file"). A refusal empties the slot in both
   contexts, as the server's ``prompt_clear`` does.
3. **checkpoints** — the SCKP appendix right after the payload. A damaged appendix is ignored, not
   fatal; at most the last ``n_ctx_checkpoints`` (32) are kept. Their blobs are only loaded when a
   later request needs them; they are converted for this runtime here.
4. **draft** — the SDFT appendix after the checkpoints. The slot is first cleared in the draft
   context; no SDFT: the draft starts empty; wrong version or truncated: "invalid draft state ...
   ignored"; a draft blob the draft context does not take (or no draft context at all): the draft is
   cleared and the state "does not match the draft context - dropped", with llama.cpp's reason.

The checkpoint loader (``load_slot_checkpoints``, upstream llama.cpp 033df86b6) is not in either source
tree (b11434 predates it); its behaviour here follows a reading of that upstream code (docs/format.md,
section 6): a damaged appendix reads as 0 bytes, so the draft loader then finds no SDFT magic where it
looks and the draft starts empty.
"""

from __future__ import annotations

import io
import os
import struct
import time
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from slotctl.errors import ExitStatus, FormatError, SlotctlError, UsageError
from slotctl.format import appendix as apx
from slotctl.format.blob import BLOB_HEADER_SIZE, blob_header
from slotctl.format.common import parse
from slotctl.format.convert import convert_blob, convert_payload
from slotctl.format.header import HEADER_FIXED_SIZE, STATE_SEQ_MAGIC, StateHeader, header_size
from slotctl.format.memory import MemoryLayout
from slotctl.model.info import ModelInfo, read_model_info
from slotctl.model.predict import rotation_rule
from slotctl.runtime.context import STATE_VERSION, Context
from slotctl.runtime.slot import Checkpoint, ServerContexts
from slotctl.slotfile import Memory, decode_tokens, parse_memory

#: llama-server's default ``--ctx-checkpoints``
DEFAULT_CTX_CHECKPOINTS = 32

#: what the server answers when the target payload does not load
TARGET_ERROR = "No available space in KV cache or invalid slot save file"

# step statuses
RESTORED = "restored"
ABSENT = "absent"
IGNORED = "ignored"
DROPPED = "dropped"
REFUSED = "refused"


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


def _read_buf(f: BinaryIO, end: int) -> bytes | None:
    """``ckpt_read_buf``: u64 length + bytes, the length checked against the bytes left."""
    raw = _read(f, 8)
    if raw is None:
        return None
    (n,) = struct.unpack("<Q", raw)
    if n > end - f.tell():
        return None
    return _read(f, n)


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
        magic, version, _n = struct.unpack("<III", head) if head else (None, None, None)
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
                                                 f"{STATE_VERSION}: {e.one_line()}") from None
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
        n_vocab = sc.target_model.n_vocab
        if tk.error:
            raise refuse(step, str(tk.error.expected), tk.error.one_line())
        if tk.media:
            raise refuse(step, "Cannot restore media tokens without an mmproj", f"{len(tk.media)} media chunk(s)")
        if tk.n_tokens > sc.target.n_ctx_slot:
            raise refuse(step, "Restored prompt does not fit in the slot context",
                         f"{tk.n_tokens} tokens, the slot holds {sc.target.n_ctx_slot}")
        bad = np.flatnonzero((tk.tokens < 0) | (tk.tokens >= n_vocab))
        if len(bad):
            i = int(bad[0])
            raise refuse(step, "Invalid tokens in slot save file",
                         f"token {int(tk.tokens[i])} at index {i} is outside the vocabulary (0..{n_vocab - 1})")
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


def _load_checkpoints(f: BinaryIO, offset: int, size: int, version: int, tinfo: ModelInfo,
                      dinfo: ModelInfo | None, n_keep: int) -> tuple[list[Checkpoint], Step]:
    step = Step("checkpoints", ABSENT, details={"count": 0, "kept": 0, "checkpoints": []})
    f.seek(offset)
    raw = _read(f, 4)
    if raw is None or struct.unpack("<I", raw)[0] != apx.SCKP_MAGIC:
        return [], step
    entries = []
    damaged = None
    raw = _read(f, 8)
    if raw is None:
        damaged = "truncated header"
    else:
        ver, count = struct.unpack("<II", raw)
        if ver != apx.SCKP_VERSION:
            damaged = f"version {ver}, expected {apx.SCKP_VERSION}"
        else:
            for i in range(count):
                fixed = _read(f, 16)
                bufs = [] if fixed is None else [_read_buf(f, size) for _ in range(3)]
                if fixed is None or any(b is None for b in bufs):
                    damaged = f"checkpoint {i} of {count} is truncated or has a length beyond the file"
                    break
                n_tokens, pos_min, pos_max = struct.unpack("<qii", fixed)
                entries.append(Checkpoint(n_tokens, pos_min, pos_max, *bufs))
    if damaged:
        step.status, step.reason = IGNORED, f"invalid checkpoints appendix: {damaged}"
        return [], step
    step.bytes = f.tell() - offset
    step.details["count"] = len(entries)
    kept = entries[-n_keep:] if n_keep > 0 else []
    out, notes = [], []
    t_layout = tinfo.layout().partial()
    d_layout = dinfo.layout().partial() if dinfo else None
    for i, cp in enumerate(kept):
        tgt, why = prepare_blob(cp.tgt, t_layout, version, tinfo, f"checkpoint {i} target blob")
        dft = b""
        if not why and cp.dft:
            dft, why = prepare_blob(cp.dft, d_layout, version, dinfo, f"checkpoint {i} draft blob")
            if why and d_layout is None:
                why, dft = None, b""  # no draft context: the draft half is never loaded
        if why:
            notes.append(f"dropped: {why}")
            continue
        out.append(Checkpoint(cp.n_tokens, cp.pos_min, cp.pos_max, tgt, dft, cp.spec))
    step.status = RESTORED
    step.details.update(kept=len(out), checkpoints=[{"n_tokens": c.n_tokens, "pos_min": c.pos_min,
                                                     "pos_max": c.pos_max} for c in out])
    if len(entries) > len(kept):
        notes.insert(0, f"kept the last {len(kept)} of {len(entries)} (--ctx-checkpoints {n_keep})")
    if notes:
        step.reason = "; ".join(notes)
    return out, step


def _load_draft(sc: ServerContexts, f: BinaryIO, offset: int, size: int, slot: int, version: int,
                dinfo: ModelInfo | None) -> Step:
    step = Step("draft", ABSENT, details={"draft_bytes": 0, "spec_bytes": 0, "positions": None})
    if sc.draft is not None:
        sc.draft.seq_rm(slot, -1, -1)
    if offset > size:
        return step
    f.seek(offset)
    raw = _read(f, 4)
    if raw is None or struct.unpack("<I", raw)[0] != apx.SDFT_MAGIC:
        step.reason = "the file holds no draft state: the draft starts empty"
        return step
    raw = _read(f, 4)
    ver = struct.unpack("<I", raw)[0] if raw else None
    data_dft = data_spec = None
    if ver == apx.SDFT_VERSION:
        data_dft = _read_buf(f, size)
        data_spec = _read_buf(f, size) if data_dft is not None else None
    if data_dft is None or data_spec is None:
        what = f"version {ver}, expected {apx.SDFT_VERSION}" if ver not in (None, apx.SDFT_VERSION) else "truncated"
        step.status, step.reason = IGNORED, f"invalid draft state ({what}) - ignored; the draft starts empty"
        return step
    step.bytes = f.tell() - offset
    step.details.update(draft_bytes=len(data_dft), spec_bytes=len(data_spec))
    if data_dft:
        why = None
        if sc.draft is None:
            why = "no draft model (-md) to restore it into"
        else:
            blob, why = prepare_blob(data_dft, dinfo.layout() if dinfo else None, version, dinfo, "draft state")
            if not why:
                n = sc.draft.state_seq_set(blob, slot)
                if n != len(blob):
                    why = _errors(sc.draft, "the draft context did not take it")
        if why:
            if sc.draft is not None:
                sc.draft.seq_rm(slot, -1, -1)
            step.status, step.reason = DROPPED, f"draft state does not match the draft context - dropped: {why}"
            return step
        step.details["positions"] = [sc.draft.seq_pos_min(slot), sc.draft.seq_pos_max(slot)]
    # a speculative state goes to common_speculative_set_state, which draft-simple ignores: it keeps none
    step.status = RESTORED
    return step
