"""A llama-server's slot, reproduced: its target and draft contexts, and slot files written as it writes them.

:class:`ServerContexts` builds the contexts a server started with the same flags would build (the draft
takes the target context's size, slots and flash-attention setting, and its own cache types).
:func:`evaluate_prompt` fills a slot, taking context checkpoints on the way as the server does
(PARTIAL_ONLY blobs of both contexts). :func:`write_slot_file` writes header, packed token record,
target payload, SCKP and SDFT, in the state version asked for, atomically.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

from slotctl.atomic import atomic_writer
from slotctl.format import appendix as apx
from slotctl.format.blob import BLOB_HEADER_SIZE
from slotctl.format.convert import convert_blob, convert_payload
from slotctl.format.tokens import pack_tokens
from slotctl.geometry import ModelInfo, read_model_info, rotation_rule
from slotctl.runtime.context import STATE_FLAGS_NONE, STATE_FLAGS_PARTIAL_ONLY, STATE_VERSION, Context
from slotctl.runtime.model import Model
from slotctl.runtime.settings import DRAFT_CACHE_TYPE_DEFAULT, ContextSettings
from slotctl.slotfile import build_header

Progress = Callable[[int, int], None]


@dataclass
class Checkpoint:
    """A context checkpoint as the server keeps it: PARTIAL_ONLY blobs taken at ``n_tokens`` tokens."""

    n_tokens: int
    pos_min: int
    pos_max: int
    tgt: bytes
    dft: bytes = b""
    spec: bytes = b""


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
                    checkpoint_at: Sequence[int] = (), on_progress: Progress | None = None) -> list[Checkpoint]:
    """Evaluate ``tokens`` into sequence ``slot`` of the target (and draft) context.

    The prompt is split at each ``checkpoint_at`` position; when the slot holds exactly that many
    tokens a checkpoint is taken from both contexts with PARTIAL_ONLY, the way the server snapshots the
    part of the memory that cannot be rolled back. ``on_progress(tokens done, total)``.
    """
    tokens = list(tokens)
    stops = sorted({n for n in checkpoint_at if 0 < n < len(tokens)}) + [len(tokens)]
    total = len(tokens) * len(sc.contexts())
    done = 0
    checkpoints = []
    start = 0
    for stop in stops:
        for ctx in sc.contexts():
            base = done

            def step(n: int, _t: int, base=base) -> None:
                if on_progress:
                    on_progress(base + n, total)

            ctx.decode(tokens[start:stop], slot, start, on_progress=step)
            done += stop - start
        if stop < len(tokens):
            checkpoints.append(take_checkpoint(sc, slot, stop))
        start = stop
    return checkpoints


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
                    overwrite: bool = False) -> WrittenFile:
    """Write the slot file the server of the seed change would write for ``slot``, atomically.

    Header and packed token record; the target payload (``state_write`` of the target context, flags 0);
    SCKP when there are checkpoints (their speculative state is empty); SDFT with the draft context's
    full state when there is a draft context (empty speculative state). Payload and blobs are converted
    from this runtime's state version to ``version`` (exact, or refused with the reason).
    """
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
             tgt=convert_blob(c.tgt, tinfo.layout().partial(), STATE_VERSION, version, rotations=t_rule,
                              layer="checkpoint target blob"),
             dft=convert_blob(c.dft, dinfo.layout().partial(), STATE_VERSION, version,
                              rotations=rotation_rule(dinfo), layer="checkpoint draft blob") if dinfo else c.dft,
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
