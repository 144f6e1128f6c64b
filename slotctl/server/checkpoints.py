"""The server's context checkpoints: what one is, how many it keeps, where it takes them, which one it goes
back to (llama.cpp b11434 ``tools/server/server-context.cpp``; the SCKP appendix that carries them in a slot
file is read by :func:`slotctl.server.restore.load_slot_checkpoints`).

:mod:`slotctl.runtime` takes and restores checkpoints in real contexts by these rules; ``validate`` and
``save`` predict and place them by the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

#: ``--ctx-checkpoints`` (``-ctxcp``) default: checkpoints kept per slot (b11434 ``common_params::n_ctx_checkpoints``)
DEFAULT_CTX_CHECKPOINTS = 32
#: ``--checkpoint-min-step`` (``-cms``) default: least spacing of checkpoints, in tokens
DEFAULT_CHECKPOINT_MIN_STEP = 8192

#: ``checkpoint_offsets`` of ``update_slots``: a batch ends this many tokens before the end of the prompt
#: (the first is added to ``n_ubatch``)
CHECKPOINT_END_OFFSETS = (4, 4)

# ``common_context_seq_rm_type``: what ``llama_memory_seq_rm`` can remove
SEQ_RM_PART = "part"    # any range of positions (KV caches, iSWA included)
SEQ_RM_FULL = "full"    # whole sequences only (recurrent and hybrid memories)
SEQ_RM_NO = "no"        # no memory


@dataclass
class Checkpoint:
    """A context checkpoint as the server keeps it: PARTIAL_ONLY blobs taken at ``n_tokens`` tokens.

    ``task``: the request that made it (``id_task``; -1: restored from a file), which
    :func:`add_checkpoint`'s eviction rule looks at.
    """

    n_tokens: int
    pos_min: int
    pos_max: int
    tgt: bytes
    dft: bytes = b""
    spec: bytes = b""
    task: int = -1


def seq_rm_type(memory_kind: str) -> str:
    """What b11434's ``common_context_can_seq_rm`` finds for a context of this memory kind.

    The server decodes two tokens and asks ``llama_memory_seq_rm`` to remove the second: KV caches
    (plain and iSWA) can ("part"); a recurrent state holds no per-token history and refuses unless the
    context keeps snapshots (``n_rs_seq``, 0 for the contexts of a draft-simple server), so recurrent and
    hybrid memories can only drop whole sequences ("full"); no memory: "no".
    """
    if memory_kind in ("recurrent", "hybrid", "hybrid_iswa"):
        return SEQ_RM_FULL
    if memory_kind == "none":
        return SEQ_RM_NO
    return SEQ_RM_PART


def add_checkpoint(checkpoints: list, new, *, n_max: int = DEFAULT_CTX_CHECKPOINTS,
                   min_step: int = DEFAULT_CHECKPOINT_MIN_STEP) -> None:
    """Append ``new`` to ``checkpoints`` as b11434's ``create_checkpoint`` does (tools/server/server-context.cpp;
    ``n_tokens`` and ``task`` attributes are all it looks at).

    While the list is full (``len + 1 >= n_max``, checked again at every step of the walk, so the erasing
    stops as soon as there is room), a checkpoint of another task within ``min_step`` tokens of the one kept
    before it is erased; then the oldest go until there is room; a checkpoint at the same ``n_tokens`` is
    superseded. (n_max 4, min_step 8, [0, 2, 4, 6] then 200: 2 and 4 are erased, then the list has room:
    [0, 6, 200].)
    """
    kept, last = list(checkpoints), -1
    i = 0
    while len(kept) + 1 >= n_max and i < len(kept):
        cp = kept[i]
        if cp.task != new.task and last >= 0 and cp.n_tokens <= last + min_step:
            del kept[i]
            continue
        last = cp.n_tokens
        i += 1
    while kept and len(kept) >= n_max:
        kept.pop(0)
    kept = [cp for cp in kept if cp.n_tokens != new.n_tokens]
    checkpoints[:] = kept + [new]


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where checkpoints are taken while a prompt is processed.

    ``server``: where llama-server b11434 takes them (the module docstring), with its ``-ctxcp``
    (``n_ctx_checkpoints``) and ``-cms`` (``min_step``) and the token positions where the request's user
    messages start (``user_starts``, its message spans). ``at``: positions slotctl is told to checkpoint
    at besides (``save --checkpoint-at`` / ``--checkpoint-every``), for any model and regardless of
    ``-ctxcp``.
    """

    server: bool = False
    n_ctx_checkpoints: int = DEFAULT_CTX_CHECKPOINTS
    min_step: int = DEFAULT_CHECKPOINT_MIN_STEP
    user_starts: tuple[int, ...] = ()
    at: tuple[int, ...] = ()


def keep_newest(entries: list, n_ctx_checkpoints: int) -> list:
    """The checkpoints a restored slot keeps: the newest ``n_ctx_checkpoints`` (``-ctxcp``), none with 0.

    Follows two independent readings of ``load_slot_checkpoints`` (llama.cpp commit 033df86b6,
    tools/server/server-context.cpp; not in either source tree slotctl reads)."""
    return entries[-n_ctx_checkpoints:] if n_ctx_checkpoints > 0 else []


def pos_min_threshold(pos_next: int, n_swa: int, has_new_tokens: bool) -> int:
    """``pos_min_thold`` of b11434's ``update_slots`` (SLOT_STATE_STARTED): the largest ``pos_min`` a
    checkpoint may have to be of use; the server searches its checkpoints when the slot's memory starts at
    or after it (``llama_memory_seq_pos_min >= pos_min_thold``). ``n_swa``: the server's (0 with
    ``--swa-full`` or without sliding-window layers); ``has_new_tokens``: the request goes beyond the
    reused prefix (else the last position must be evaluated again: one lower)."""
    return max(0, pos_next - n_swa - (0 if has_new_tokens else 1))


def rolls_back(kind: str | None, n_swa: int) -> bool:
    """Whether ordinary requests make the server go back to a checkpoint: its memory starts after 0 (a
    recurrent state holds its last position only; an SWA cache with ``n_swa`` > 0 its window). A plain
    KV cache, and an iSWA one with ``--swa-full`` (``n_swa`` 0: its SWA cache holds every position),
    start at 0 and roll back only at the edge :func:`may_load` names."""
    return kind in ("recurrent", "hybrid", "hybrid_iswa") or (kind == "iswa" and n_swa > 0)


def may_load(kind: str | None, n_swa: int, pos_min: int, pos_max: int) -> bool:
    """Whether some request makes the server load (``load_tgt`` / ``load_dft``) a checkpoint spanning
    ``pos_min..pos_max``. Always where it :func:`rolls_back`; else the memory starts at 0, which is at or
    after :func:`pos_min_threshold` only when that is 0: a request of one token equal to the slot's first
    (``n_past`` 1, no new tokens), and then the newest checkpoint with ``pos_max <= 1`` and ``pos_min``
    0 is loaded (``save --checkpoint-at 1`` makes one)."""
    return rolls_back(kind, n_swa) or (pos_min == 0 and pos_max <= 1)


def rollback_checkpoint(checkpoints: Sequence, pos_next: int, pos_min_thold: int):
    """The checkpoint a slot goes back to when its memory no longer holds what the reused prompt needs
    (``update_slots``, SLOT_STATE_STARTED, b11434): the newest one that ends at or before ``pos_next`` and
    starts before ``pos_min_thold`` (or at 0); None: start over."""
    for cp in reversed(checkpoints):
        if cp.pos_max > pos_next:
            continue
        if cp.pos_min < pos_min_thold or cp.pos_min == 0:
            return cp
    return None


def user_starts(tokenize: Callable[[str], list[int]], tokens: Sequence[int], delimiters: Sequence[str]) -> list[int]:
    """Where user messages start in ``tokens``, as b11434 finds a request's message spans
    (``common_chat_msg_delimiters::split``): each delimiter is tokenized without BOS and with special
    tokens parsed (``tokenize``), and every position where its tokens occur starts a span."""
    if not delimiters:
        return []
    seqs = [tokenize(d) for d in delimiters]
    tokens = list(tokens)
    starts = []
    for i in range(len(tokens)):
        if any(seq and tokens[i:i + len(seq)] == seq for seq in seqs):
            starts.append(i)
    return starts


def requested_positions(at: Sequence[int], every: int | None, n_tokens: int) -> list[int]:
    """The positions slotctl is told to take checkpoints at (``save --checkpoint-at`` / ``--checkpoint-every``):
    inside the prompt, 1..``n_tokens - 1``; ValueError naming the first one outside."""
    out = sorted(set(at))
    bad = [n for n in out if not 0 < n < n_tokens]
    if bad:
        raise ValueError(f"--checkpoint-at {bad[0]}: a checkpoint is taken inside the prompt, at 1.."
                         f"{n_tokens - 1} tokens (the prompt has {n_tokens})")
    if every is not None:
        out = sorted(set(out) | set(range(every, n_tokens, every)))
    return out
