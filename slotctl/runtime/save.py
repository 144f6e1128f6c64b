"""A save as llama-server makes one, in real contexts (``slotctl save``): the server's contexts opened, the
prompt refused as the server would refuse it, evaluated with its checkpoint policy, and the slot file
written as it writes it. The command only checks its options and shows the result."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

from slotctl.errors import ExitStatus, SlotctlError, UsageError
from slotctl.progress import Progress
from slotctl.server.flags import ServerFlags

#: state versions a save writes: 4 (current llama-server) and 3 (this llama-cpp-python)
STATE_VERSIONS = (3, 4)


class PromptRefused(SlotctlError):
    """The server would refuse the prompt (its message)."""

    exit_status = ExitStatus.FAILED


#: ``bar(label, total)``: a context that yields the :data:`~slotctl.progress.Progress` of one long step (the
#: CLI's progress bar); by default nothing is shown
Bar = Callable[[str, int], ContextManager[Progress]]


@contextlib.contextmanager
def _no_bar(label: str, total: int):
    yield lambda done, total=None: None


@dataclass
class Saved:
    """What :func:`save_prompt` did: the file written (``written``: path, version, sizes), the checkpoints
    taken, where user messages start, the prompt as the model detokenizes it, the models' facts, and the
    time of each phase (ms)."""

    written: Any
    checkpoints: list
    user_starts: list[int]
    prompt_text: str
    target_info: Any
    draft_info: Any
    timings: dict = field(default_factory=dict)


def save_prompt(model: str | os.PathLike, text: str, output: str | os.PathLike, flags: ServerFlags, *,
                slot: int = 0, draft_model: str | os.PathLike | None = None, state_version: int = 4,
                checkpoint_at: Sequence[int] = (), checkpoint_every: int | None = None,
                user_delimiter: Sequence[str] = (), server_checkpoints: bool = False, overwrite: bool = False,
                verbose: bool = False, bar: Bar = _no_bar, build: str | None = None) -> Saved:
    """Evaluate ``text`` in slot ``slot`` of contexts made as a server of ``flags`` makes them, and write the
    slot file it would save to ``output``. ``server_checkpoints``: take checkpoints as the server does (also
    when ``user_delimiter`` is given); ``checkpoint_at``/``checkpoint_every``: at these prompt positions too.
    :class:`PromptRefused` when the server would refuse the prompt; UsageError for a model llama.cpp refuses
    or positions that do not fit. ``build``: the llama-server build the file is written as (its checkpoints'
    PARTIAL_ONLY blobs: :func:`slotctl.runtime.slot.write_slot_file`; default the newest known)."""
    from slotctl.runtime.log import configure_logging
    from slotctl.runtime.slot import ServerContexts, evaluate_prompt, write_slot_file
    from slotctl.server.checkpoints import CheckpointPolicy, requested_positions, user_starts
    from slotctl.server.requests import request_refusal

    configure_logging(verbose)
    server_checkpoints = server_checkpoints or bool(user_delimiter)
    t0 = time.perf_counter()
    try:
        with bar("loading models", 1000) as update:
            sc = ServerContexts.open(model, flags.context_settings(), draft_path=draft_model,
                                     draft_type_k=flags.spec_draft_type_k, draft_type_v=flags.spec_draft_type_v,
                                     on_progress=lambda d, t: update(d, t))
    except ValueError as e:
        raise UsageError(str(e)) from None
    with sc:
        t_load = time.perf_counter() - t0
        tokens = sc.target_model.tokenize(text)
        refusal = request_refusal(len(tokens), sc.target.n_ctx_slot)
        if refusal:
            raise PromptRefused(refusal)
        try:
            at = requested_positions(list(checkpoint_at), checkpoint_every, len(tokens))
        except ValueError as e:
            raise UsageError(str(e)) from None
        tm = sc.target_model
        starts = user_starts(lambda d: tm.tokenize(d, add_special=False, parse_special=True), tokens,
                             list(user_delimiter))
        policy = CheckpointPolicy(server=server_checkpoints, n_ctx_checkpoints=flags.ctx_checkpoints,
                                  min_step=flags.checkpoint_min_step, user_starts=tuple(starts), at=tuple(at))
        t0 = time.perf_counter()
        with bar("evaluating", len(tokens) * len(sc.contexts())) as update:
            checkpoints = evaluate_prompt(sc, tokens, slot, policy=policy, on_progress=update)
        t_eval = time.perf_counter() - t0
        t0 = time.perf_counter()
        written = write_slot_file(output, sc, slot, tokens, version=state_version, checkpoints=checkpoints,
                                  overwrite=overwrite, **({"build": build} if build else {}))
        t_write = time.perf_counter() - t0
        return Saved(written, checkpoints, starts, sc.target_model.detokenize(tokens), sc.target_info,
                     sc.draft_info, {"load_ms": round(t_load * 1000, 3), "evaluate_ms": round(t_eval * 1000, 3),
                                     "write_ms": round(t_write * 1000, 3)})
