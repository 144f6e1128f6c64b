"""A restored slot against one that was never saved (``restore --compare``).

The same request is answered twice: by the slot restored from the file, and by fresh contexts that
evaluated the file's prompt from scratch, taking the checkpoints the file holds at the same points. The
server's promise is that a restored slot answers like the never-saved one: same text, same prompt tokens
evaluated, same drafted and accepted counts. :func:`compare_with_never_saved` says whether they agree,
the first difference, and what explains it where a rule of the server does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

from slotctl.runtime.restore import RestoredSlot
from slotctl.runtime.slot import ServerContexts, evaluate_prompt
from slotctl.runtime.speculative import Completion, ServerSlot, close_contexts, fresh_contexts
from slotctl.server.checkpoints import CheckpointPolicy

#: ``progress(label, total)``: a context manager giving ``update(done)`` (the CLI's progress bar)
ProgressFactory = Callable[[str, int], ContextManager[Callable[..., None]]]


@contextlib.contextmanager
def _no_progress(_label: str, _total: int):
    yield lambda *_a, **_k: None


@dataclass
class Comparison:
    """``checks``: (name, restored, fresh) for the text and the prompt, drafted and accepted counts;
    ``first``: the name of the first that differs (None: they agree); ``note``: the server's rule that
    explains it, when one does; ``fresh``: the never-saved slot's completion."""

    agree: bool
    first: str | None
    note: str | None
    checks: list[tuple[str, object, object]]
    fresh: Completion
    #: every difference is the server's documented behaviour (``note`` says which): exit 0
    explained: bool = False


def run_request(srv: ServerSlot, request: Sequence[int], n: int, progress: ProgressFactory | None = None,
                label: str = "") -> Completion:
    """Take ``request`` into the slot and generate ``n`` tokens, as the server answers a completion."""
    progress = progress or _no_progress
    with progress(f"{label}evaluating the continuation", max(1, len(request))) as update:
        comp = srv.begin(request, on_prompt=update)
    with progress(f"{label}generating", n) as update:
        srv.generate(comp, n, on_token=update)
    return comp


def compare_with_never_saved(sc: ServerContexts, restored: RestoredSlot, comp: Completion, request: Sequence[int],
                             n: int, *, n_draft_max: int, policy: CheckpointPolicy,
                             progress: ProgressFactory | None = None) -> Comparison:
    """Answer ``request`` in fresh contexts that never saw the file and compare with ``comp``, the restored
    slot's answer. The restored slot's contexts are closed first (their models serve the fresh ones)."""
    progress = progress or _no_progress
    n_swa = sc.n_swa
    tinfo = sc.target_info
    close_contexts(sc)  # the restored slot is done with; its models serve the fresh contexts
    fresh = fresh_contexts(sc)
    try:
        # a slot that was never saved: it evaluated the file's prompt and took the checkpoints the file
        # holds, at the same points
        with progress("fresh: evaluating the file's prompt", len(restored.tokens)) as update:
            fresh_cps = evaluate_prompt(fresh, restored.tokens, restored.slot,
                                        checkpoint_at=[c.n_tokens for c in restored.checkpoints],
                                        on_progress=update)
        never_saved = ServerSlot(fresh, restored.slot, restored.tokens, fresh_cps, n_draft_max=n_draft_max,
                                 policy=policy)
        fcomp = run_request(never_saved, request, n, progress, "fresh: ")
    finally:
        close_contexts(fresh)
    checks = [
        ("text", comp.text, fcomp.text),
        ("n_evaluated", comp.n_evaluated, fcomp.n_evaluated),
        ("n_drafted", comp.n_drafted, fcomp.n_drafted),
        ("n_accepted", comp.n_accepted, fcomp.n_accepted),
    ]
    first = note = None
    for name, r, f in checks:
        if r == f:
            continue
        why = _explain(name, comp, fcomp, restored, tinfo, n_swa, policy.n_ctx_checkpoints)
        if why is None:      # the first difference nothing explains decides
            first, note = name, None
            break
        if first is None:
            first, note = name, why
    return Comparison(first is None, first, note, checks, fcomp, explained=first is not None and note is not None)


def _explain(name: str, comp: Completion, fcomp: Completion, restored: RestoredSlot, tinfo, n_swa: int,
             n_ctx_checkpoints: int) -> str | None:
    """The server's documented behaviour that explains a difference (:func:`slotctl.server.reuse.
    explain_difference`), with validate's predicted reuse when the request extends the saved prompt."""
    from slotctl.server import builds
    from slotctl.server.checkpoints import rolls_back
    from slotctl.server.reuse import explain_difference, predict_reuse
    from slotctl.slotfile import open_slot_file

    kind = tinfo.layout().kind
    predicted = None
    if name == "n_evaluated" and comp.n_common == len(restored.tokens):
        read = restored.step("checkpoints").status != "ignored"
        with open_slot_file(restored.path, layout=tinfo.layout()) as sf:
            # the runtime's own rules (b11434's update_slots, the appendices read): what it did, predicted
            r = predict_reuse(sf, n_swa=n_swa, n_ctx_checkpoints=n_ctx_checkpoints, checkpoints_read=read,
                              build=builds.RUNTIME)
        predicted = r.n_reused if r is not None else None
    draft = restored.step("draft")
    return explain_difference(name, comp, fcomp, draft_status=draft.status, draft_reason=draft.reason,
                              rolls_back=rolls_back(kind, n_swa),
                              predicted=predicted)
