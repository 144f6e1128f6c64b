"""A llama-server's slot, reproduced: its target and draft contexts, and slot files written as it writes them.

:class:`ServerContexts` builds the contexts a server started with the same flags would build (the draft
takes the target context's size, slots and flash-attention setting, and its own cache types).
:func:`evaluate_prompt` fills a slot, taking context checkpoints on the way as the server does
(PARTIAL_ONLY blobs of both contexts): where slotctl is told to (``checkpoint_at``), and, with a
:class:`CheckpointPolicy` whose ``server`` is set, where llama-server b11434 takes them itself
(:func:`process_prompt`, after ``update_slots`` in ``tools/server/server-context.cpp``).
:func:`write_slot_file` writes header, packed token record, target payload, SCKP and SDFT, in the state
version asked for, atomically.

Where b11434 takes a context checkpoint while it processes a prompt. Only when the target's memory
cannot be rolled back: ``common_context_can_seq_rm`` finds that it removes only whole sequences
(recurrent and hybrid memories), or the model has sliding-window layers (``llama_model_n_swa`` > 0, and
not ``--swa-full``); and ``--ctx-checkpoints`` (``-ctxcp``, 32) is not 0. The prompt is cut into batches
of at most ``n_batch`` tokens, and a batch also ends

* at the start of a user message (the request's ``message_delimiters``; the chat endpoint derives them
  from the chat template) when it is the last user message, or there is no checkpoint yet, or it lies
  more than ``--checkpoint-min-step`` (``-cms``, 8192) tokens past the last checkpoint;
* ``4 + n_ubatch`` and ``4`` tokens before the end of the prompt (each capped at ``n_batch``).

Before a batch is decoded, a checkpoint of the memory as it is (the batch not yet in it) is taken when
the batch starts a user message, or is near the end of the prompt (fewer than ``n_ubatch`` tokens are
left after it), or is the last batch; but not while the memory is empty, and only when there is no
checkpoint yet, or the batch starts the last user message, or is near the end, or starts more than
``-cms`` tokens past the last checkpoint. ``create_checkpoint`` then keeps at most ``-ctxcp`` of them
(:func:`add_checkpoint`). For a plain prompt of n tokens this gives a checkpoint at ``n - 4`` and, when
``n > 4 + n_ubatch``, one at ``n - 4 - n_ubatch``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import llama_cpp

from slotctl.progress import Progress
from slotctl.atomic import atomic_writer
from slotctl.format import appendix as apx
from slotctl.format.blob import BLOB_HEADER_SIZE
from slotctl.format.convert import convert_blob, convert_payload
from slotctl.format.tokens import pack_tokens
from slotctl.model.info import ModelInfo, read_model_info
from slotctl.model.predict import rotation_rule
from slotctl.server import builds
from slotctl.runtime.context import STATE_FLAGS_NONE, STATE_FLAGS_PARTIAL_ONLY, STATE_VERSION, Context
from slotctl.runtime.model import Model
from slotctl.model.settings import DRAFT_CACHE_TYPE_DEFAULT, ContextSettings
from slotctl.server.checkpoints import (
    CHECKPOINT_END_OFFSETS,
    SEQ_RM_FULL,
    Checkpoint,
    CheckpointPolicy,
    add_checkpoint,
    seq_rm_type,
)
from slotctl.slotfile import build_header



@dataclass
class ServerContexts:
    """Target and (optional) draft models and contexts, as ``llama-server -m T [-md D] <flags>`` builds them."""

    target_model: Model
    target: Context
    draft_model: Model | None = None
    draft: Context | None = None
    target_info: ModelInfo | None = None
    draft_info: ModelInfo | None = None
    _owned: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.target_info is None:
            self.target_info = read_model_info(self.target_model.path)
        if self.draft_model is not None and self.draft_info is None:
            self.draft_info = read_model_info(self.draft_model.path)

    @property
    def target_seq_rm(self) -> str:
        """:func:`seq_rm_type` of the target context."""
        return seq_rm_type(self.target_info.memory_kind)

    @property
    def draft_seq_rm(self) -> str | None:
        """:func:`seq_rm_type` of the draft context, None without one."""
        return seq_rm_type(self.draft_info.memory_kind) if self.draft is not None else None

    @property
    def n_swa(self) -> int:
        """The server's ``n_swa``: the target's sliding window (``llama_model_n_swa``), 0 with ``--swa-full``."""
        if self.target.settings.swa_full:
            return 0
        return int(llama_cpp.llama_model_n_swa(self.target_model.ptr))

    @property
    def needs_checkpoints(self) -> bool:
        """Whether b11434 takes context checkpoints for this target: its memory removes only whole
        sequences, or it has sliding-window layers (and no ``--swa-full``)."""
        return self.target_seq_rm == SEQ_RM_FULL or self.n_swa > 0

    @classmethod
    def open(cls, target_path: str | os.PathLike, settings: ContextSettings, *,
             draft_path: str | os.PathLike | None = None, draft_type_k: str = DRAFT_CACHE_TYPE_DEFAULT,
             draft_type_v: str = DRAFT_CACHE_TYPE_DEFAULT, on_progress: Progress | None = None) -> ServerContexts:
        """Load the models and build the contexts. ``on_progress(done, total)`` follows model loading."""
        target_info = read_model_info(target_path)
        draft_info = read_model_info(draft_path) if draft_path is not None else None
        tm = Model(target_path, on_progress=on_progress)
        try:
            tctx = Context(tm, settings)
            dm = dctx = None
            if draft_path is not None:
                dm = Model(draft_path, on_progress=on_progress)
                dctx = Context(dm, tctx.draft_settings(draft_type_k, draft_type_v))
        except BaseException:
            tm.close()
            raise
        return cls(tm, tctx, dm, dctx, target_info, draft_info, [m for m in (tm, dm) if m is not None])

    def close(self) -> None:
        for m in self._owned:
            m.close()
        self._owned.clear()

    def __enter__(self) -> ServerContexts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def contexts(self) -> list[Context]:
        return [c for c in (self.target, self.draft) if c is not None]


def evaluate_prompt(sc: ServerContexts, tokens: Sequence[int], slot: int, *,
                    checkpoint_at: Sequence[int] = (), on_progress: Progress | None = None,
                    policy: CheckpointPolicy | None = None) -> list[Checkpoint]:
    """Evaluate ``tokens`` into the empty sequence ``slot`` of the target (and draft) context.

    The prompt is split at each ``checkpoint_at`` position; when the slot holds exactly that many
    tokens a checkpoint is taken from both contexts with PARTIAL_ONLY, the way the server snapshots the
    part of the memory that cannot be rolled back. With a ``policy`` whose ``server`` is set, the prompt
    is also cut into batches and checkpointed where b11434 would (:func:`process_prompt`).
    ``on_progress(tokens done, total)``. Returns the checkpoints, oldest first.
    """
    policy = policy or CheckpointPolicy()
    policy = CheckpointPolicy(policy.server, policy.n_ctx_checkpoints, policy.min_step, policy.user_starts,
                              tuple(policy.at) + tuple(checkpoint_at))
    checkpoints: list[Checkpoint] = []
    process_prompt(sc, slot, list(tokens), 0, checkpoints, policy, task=0, on_progress=on_progress)
    return checkpoints


def process_prompt(sc: ServerContexts, slot: int, tokens: Sequence[int], n_past: int, checkpoints: list[Checkpoint],
                   policy: CheckpointPolicy, *, task: int = 0, on_progress: Progress | None = None,
                   decode_draft: Callable[[Sequence[int], int], None] | None = None) -> list[Checkpoint]:
    """Decode ``tokens[n_past:]`` into ``slot`` batch by batch, as ``update_slots`` processes a prompt,
    taking checkpoints before the batches ``policy`` says (see the module docstring) and adding them to
    ``checkpoints`` (:func:`add_checkpoint`). Each batch is decoded in the target context, then the same
    batch in the draft context (``decode_draft(batch, pos0)`` when given, as ``common_speculative_process``
    mirrors it). Returns the checkpoints taken.
    """
    tokens = list(tokens)
    n = len(tokens)
    n_batch = sc.target.n_batch
    n_ubatch = int(llama_cpp.llama_n_ubatch(sc.target.ptr))
    server = policy.server and policy.n_ctx_checkpoints > 0 and sc.needs_checkpoints
    users = set(policy.user_starts)
    last_user = max(policy.user_starts, default=-1)
    at = {p for p in policy.at if n_past < p < n}
    offsets = [min(n_batch, off) for off in (CHECKPOINT_END_OFFSETS[0] + n_ubatch, CHECKPOINT_END_OFFSETS[1])]
    total = (n - n_past) * len(sc.contexts())
    done = 0
    taken: list[Checkpoint] = []
    pos = n_past
    while pos < n:
        start = pos
        while pos < n and pos - start < n_batch:
            pos += 1
            if server and pos in users and (pos == last_user or not checkpoints
                                            or pos > checkpoints[-1].n_tokens + policy.min_step):
                break
            if server and any(n == pos + off for off in offsets):
                break
            if pos in at:
                break
        near_end = n < pos + n_ubatch
        do = server
        if pos != n and start not in users and not near_end:
            do = False  # an ordinary mid-prompt batch
        if do and sc.target.seq_pos_min(slot) < 0:
            do = False  # nothing to checkpoint yet
        do = do and (not checkpoints or start == last_user or near_end
                     or start > checkpoints[-1].n_tokens + policy.min_step)
        if do or start in at:
            cp = take_checkpoint(sc, slot, start)
            cp.task = task
            if do:
                add_checkpoint(checkpoints, cp, n_max=policy.n_ctx_checkpoints, min_step=policy.min_step)
            else:
                checkpoints[:] = [c for c in checkpoints if c.n_tokens != start] + [cp]
            taken.append(cp)
        batch = tokens[start:pos]
        base = done

        def step(k: int, _t: int, base=base) -> None:
            if on_progress:
                on_progress(base + k, total)

        sc.target.decode(batch, slot, start, on_progress=step)
        done += len(batch)
        if sc.draft is not None:
            if decode_draft is not None:
                decode_draft(batch, start)
            else:
                sc.draft.decode(batch, slot, start)
            done += len(batch)
            if on_progress:
                on_progress(done, total)
    return taken


def take_checkpoint(sc: ServerContexts, slot: int, n_tokens: int) -> Checkpoint:
    """The server's ``create_checkpoint``: the target's position range and PARTIAL_ONLY blobs of both contexts."""
    return Checkpoint(
        n_tokens=n_tokens,
        pos_min=sc.target.seq_pos_min(slot),
        pos_max=sc.target.seq_pos_max(slot),
        tgt=sc.target.state_seq_get(slot, STATE_FLAGS_PARTIAL_ONLY),
        dft=sc.draft.state_seq_get(slot, STATE_FLAGS_PARTIAL_ONLY) if sc.draft is not None else b"",
    )


@dataclass
class WrittenFile:
    path: str
    size: int
    version: int
    n_tokens: int
    payload_size: int
    sckp_size: int
    sdft_size: int


def write_slot_file(path: str | os.PathLike, sc: ServerContexts, slot: int, tokens: Sequence[int], *,
                    version: int = 4, checkpoints: Sequence[Checkpoint] = (), with_draft: bool = True,
                    overwrite: bool = False, build: str = builds.NEWEST) -> WrittenFile:
    """Write the slot file llama-server ``build`` (b11669: llama.cpp ea736c1d5's appendices) would write for
    ``slot``, atomically.

    Header and packed token record; the target payload (``state_write`` of the target context, flags 0);
    SCKP when there are checkpoints (their speculative state is empty); SDFT with the draft context's
    full state when there is a draft context (empty speculative state). Payload and blobs are converted
    from this runtime's state version to ``version`` (exact, or refused with the reason). A checkpoint's
    blob of a plain KV cache is written as the build's libllama writes a PARTIAL_ONLY state there
    (:data:`slotctl.server.builds.Build.partial_plain_kv`: the blob header alone for b11434 and b11669;
    llama-cpp-python 0.3.36 gives the whole cache).
    """
    header_only = builds.get(build).partial_plain_kv == "header"

    def partial(blob: bytes, layout) -> bytes:
        return blob[:BLOB_HEADER_SIZE] if header_only and blob and layout.kind == "kv" else blob

    words = pack_tokens(tokens)
    blob = sc.target.state_seq_get(slot, STATE_FLAGS_NONE)
    payload = blob[BLOB_HEADER_SIZE:]
    tinfo = sc.target_info or read_model_info(sc.target_model.path)
    t_rule = rotation_rule(tinfo)
    payload = convert_payload(payload, tinfo.layout(), STATE_VERSION, version, rotations=t_rule,
                              layer="target memory")
    dinfo = None
    if sc.draft is not None:
        dinfo = sc.draft_info or read_model_info(sc.draft_model.path)
    sckp = apx.build_sckp([
        dict(n_tokens=c.n_tokens, pos_min=c.pos_min, pos_max=c.pos_max,
             tgt=partial(convert_blob(c.tgt, tinfo.layout().partial(), STATE_VERSION, version, rotations=t_rule,
                                      layer="checkpoint target blob"), tinfo.layout()),
             dft=partial(convert_blob(c.dft, dinfo.layout().partial(), STATE_VERSION, version,
                                      rotations=rotation_rule(dinfo), layer="checkpoint draft blob"), dinfo.layout())
             if dinfo else c.dft,
             spec=c.spec) for c in checkpoints])
    sdft = b""
    if sc.draft is not None and with_draft:
        dblob = sc.draft.state_seq_get(slot, STATE_FLAGS_NONE)
        dblob = convert_blob(dblob, dinfo.layout(), STATE_VERSION, version, rotations=rotation_rule(dinfo),
                             layer="draft state")
        sdft = apx.build_sdft(dblob, b"")
    header = build_header(version, words)
    with atomic_writer(path, overwrite=overwrite) as f:
        for part in (header, payload, sckp, sdft):
            f.write(part)
    return WrittenFile(os.fspath(path), len(header) + len(payload) + len(sckp) + len(sdft), version, len(tokens),
                       len(payload), len(sckp), len(sdft))
