"""How many prompt tokens a restored slot keeps for a request that extends the saved prompt.

The server's rule (b11434 ``server_context::update_slots``, the prompt-cache branch): the request's common
prefix with the slot's tokens is ``n_past`` (for an extending request, every saved token), the position
after it ``pos_next``, and ``pos_min_thold = max(0, pos_next - n_swa)`` (``n_swa``: the model's sliding
window, 0 with ``--swa-full`` or without SWA). When the slot's memory starts at or after that threshold
(``llama_memory_seq_pos_min >= pos_min_thold``: the memory cannot serve the positions the new tokens
attend to), the server looks for the newest context checkpoint with ``pos_max <= pos_next`` and
``pos_min < pos_min_thold`` (or ``pos_min == 0``); it goes back to that checkpoint
(``n_past = min(pos_next', n_tokens of the checkpoint)``, ``pos_next' = min(pos_next, max(pos_min + 1,
pos_max))``), or, with none, evaluates the whole prompt again.

What the restored memory's ``pos_min`` is follows from the file: a plain KV cache starts at its first
cell (0); an iSWA cache at its SWA section's first cell (a slot file holds only the window there, so it
starts exactly at the threshold: the server always needs a checkpoint); a recurrent state at its one
cell (the last position, below the threshold of an extending request); a hybrid memory at the larger of
its parts'. b11434 ignores the checkpoint appendix (it restores the target only), so it never has a
checkpoint to go back to after a restore; a server that reads them (b11669) keeps the newest
``--ctx-checkpoints`` of the file's.

The rules differ by build (:mod:`slotctl.server.builds`): b11669, measured, keeps every token of a restored
iSWA slot (its SWA cache holding only the window) for a request that extends its whole prompt
(``timings.cache_n`` is the file's token count), and all but the last for the saved prompt itself, where
b11434's threshold sends both back to a checkpoint or to the start;
and a checkpoint whose target blob does not load makes b11669 evaluate the whole prompt again ("failed to load
context checkpoint restored from a slot file"). ``n_reused`` is the prediction for the build judged
(``build``), ``n_reused_b11434`` b11434's.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotctl.server import builds
from slotctl.server.checkpoints import DEFAULT_CTX_CHECKPOINTS, keep_newest, pos_min_threshold, rollback_checkpoint
from slotctl.slotfile import SlotFile


@dataclass
class Reuse:
    """The prediction: ``n_reused`` of the file's ``n_tokens`` kept (the server's ``cache_n``; the rest of
    the request is evaluated: ``prompt_n``), ``checkpoint`` the ``n_tokens`` of the checkpoint gone back to,
    ``reason`` why fewer than all; the same for b11434 (``n_reused_b11434``, ``reason_b11434``)."""

    n_tokens: int
    n_reused: int
    checkpoint: int | None
    reason: str | None
    n_reused_b11434: int
    reason_b11434: str | None
    #: what a request that diverges from the saved prompt keeps, in words
    divergence: str | None = None
    #: the build ``n_reused`` is predicted for (:mod:`slotctl.server.builds`)
    build: str = builds.NEWEST

    def as_dict(self) -> dict:
        return {"build": self.build, "n_tokens": self.n_tokens, "n_reused": self.n_reused,
                "checkpoint": self.checkpoint, "reason": self.reason, "divergence": self.divergence,
                "b11434": {"n_reused": self.n_reused_b11434, "reason": self.reason_b11434}}


def _kv_pos_min(sec) -> int | None:
    mins = [st.cells.pos_min for st in sec.streams if st.cell_count]
    return min(mins) if mins else None


def memory_pos_min(sf: SlotFile) -> tuple[int | None, str]:
    """``llama_memory_seq_pos_min`` of the restored slot, and which part decides it (in words)."""
    mem = sf.target
    parts = []
    for sl, sec in zip(mem.layout.sections, mem.sections):
        if sl.type == "kv":
            if sl.role == "base" and any(s.role == "swa" for s in mem.layout.sections):
                continue     # the base cache is a superset of the SWA cache (llama_kv_cache_iswa::seq_pos_min)
            parts.append((_kv_pos_min(sec), "the SWA cache" if sl.role == "swa" else "the KV cache"))
        else:
            parts.append((int(sec.cells.pos_min) if sec.cell_count else None, "the recurrent state"))
    if not parts or any(p is None for p, _ in parts):
        return None, "the memory"
    return max(parts, key=lambda p: p[0])


def predict_reuse(sf: SlotFile, *, n_swa: int | None, n_ctx_checkpoints: int,
                  checkpoints_read: bool = True, extends: bool = True, build: str = builds.NEWEST) -> Reuse | None:
    """The prediction for ``sf`` (its target memory parsed), or None when it cannot be made (no parsed
    memory or tokens, media chunks). ``n_swa``: the server's (None: the window the file's SWA section was
    saved with). ``checkpoints_read``: the server of ea736c1d5 reads the file's checkpoint appendix (False:
    it ignores it, damaged or with an empty target blob).

    ``extends``: the request extends the saved prompt (validate's question). False: the request is the
    saved prompt itself and nothing more (``restore --prove``'s proving request): b11434's
    ``update_slots`` then lowers the threshold by one (``has_new_tokens`` false: the last position must be
    evaluated again, so a memory starting at it needs a checkpoint too) and, when every token matched,
    evaluates the last one again for its logits (``[TAG_PROMPT_LOGITS]``: ``n_past--``)."""
    rules = builds.get(build)
    r = _predict(sf, n_swa, n_ctx_checkpoints, checkpoints_read and rules.reads_checkpoints, 0 if extends else 1,
                 rules)
    if r is not None:
        r.build = rules.name
    return r if extends else _same_prompt(r)


def _predict(sf: SlotFile, n_swa: int | None, n_ctx_checkpoints: int, checkpoints_read: bool,
             thold_shift: int, rules: builds.Build) -> Reuse | None:
    """:func:`predict_reuse` with the threshold lowered by ``thold_shift`` (1: no new tokens)."""
    tk = sf.tokens
    if sf.target is None or tk is None or tk.error is not None or tk.media:
        return None
    n = tk.n_tokens
    pos_min, part = memory_pos_min(sf)
    if n == 0:
        return Reuse(0, 0, None, None, 0, None)
    if pos_min is None:
        why = ("the restored memory holds no cells for the slot's tokens: the server aborts on the next request "
               "(\"pos_min == -1, but n_past > 0\")")
        return Reuse(n, 0, None, why, 0, why)
    if n_swa is None:
        n_swa = _file_window(sf)
    kind = sf.target.layout.kind
    kept = keep_newest(list(sf.checkpoints or []), n_ctx_checkpoints) if checkpoints_read else []
    divergence = _divergence(kind, n_swa, [c.n_tokens for c in kept])
    pos_next = n
    thold = pos_min_threshold(pos_next, n_swa, has_new_tokens=not thold_shift)
    if pos_min < thold:
        return Reuse(n, n, None, None, n, None, divergence)
    held = _held(kind, part, pos_min, n, n_swa)
    b_reason = (f"{held}; b11434 ignores the file's checkpoint appendix (it restores the target only): it "
                "evaluates the whole prompt again") if sf.checkpoints else (
        f"{held}, and the file holds no checkpoint to go back to: the server evaluates the whole prompt again")
    if rules.swa_window_serves and part == "the SWA cache":
        # measured on b11669: an SWA cache holding the window serves the whole prompt extended or repeated
        return Reuse(n, n, None, None, 0, b_reason, divergence)
    found = rollback_checkpoint(kept, pos_next, thold)
    none_early = (f"and no checkpoint of the file is early enough (one with pos_min below {thold:,}): the server "
                  "evaluates the whole prompt again")
    if found is not None and _unloadable(found) and not rules.aborts_on_bad_checkpoint:
        n_reused, cp = 0, found.n_tokens
        reason = (f"{held}: the server goes back to the checkpoint at {found.n_tokens:,} tokens, whose target blob "
                  "does not load (\"failed to load context checkpoint restored from a slot file\"), and evaluates "
                  "the whole prompt again")
    elif found is not None:
        back = min(pos_next, max(found.pos_min + 1, found.pos_max))
        n_reused, cp = min(back, found.n_tokens), found.n_tokens
        reason = (f"{held}: the server goes back to the checkpoint at {found.n_tokens:,} tokens and evaluates the "
                  f"{n - n_reused:,} after it again")
    elif sf.checkpoints and not checkpoints_read:
        n_reused, cp = 0, None
        reason = f"{held}, and the server ignores the file's checkpoint appendix: it evaluates the whole prompt again"
    elif not kept:
        n_reused, cp = 0, None
        reason = f"{held}, and the file holds no checkpoint to go back to: the server evaluates the whole prompt again"
    else:
        n_reused, cp = 0, None
        reason = f"{held}, {none_early}"
    if not sf.checkpoints:
        b_reason = reason
    return Reuse(n, n_reused, cp, reason, 0, b_reason, divergence)


def diverging_reuse(sf: SlotFile, common: int, *, n_swa: int | None, n_ctx_checkpoints: int = DEFAULT_CTX_CHECKPOINTS,
                    checkpoints_read: bool = True, build: str = builds.NEWEST) -> int | None:
    """How many prompt tokens a slot restored from ``sf`` keeps for a request that shares the saved prompt's
    first ``common`` tokens and then differs (``update_slots``: ``n_past`` is the common prefix, the threshold
    ``pos_next - n_swa``): a memory that starts before the threshold keeps them (a plain KV cache drops the
    positions after them); one that does not goes back to the newest of the file's checkpoints kept
    (:func:`keep_newest`) that ends by the divergence and starts before the threshold, or evaluates the whole
    prompt again (b11434 reads no checkpoint: always so). The same for b11434 and b11669 (measured:
    tests/test_b11669.py); None when no prediction can be made (as :func:`predict_reuse`)."""
    rules = builds.get(build)
    tk = sf.tokens
    if sf.target is None or tk is None or tk.error is not None or tk.media:
        return None
    common = max(0, min(common, tk.n_tokens))
    pos_min, _part = memory_pos_min(sf)
    if common == 0 or pos_min is None:
        return 0
    if n_swa is None:
        n_swa = _file_window(sf)
    thold = pos_min_threshold(common, n_swa, has_new_tokens=True)
    if pos_min < thold:
        return common
    kept = keep_newest(list(sf.checkpoints or []), n_ctx_checkpoints) \
        if checkpoints_read and rules.reads_checkpoints else []
    found = rollback_checkpoint(kept, common, thold)
    if found is None or (_unloadable(found) and not rules.aborts_on_bad_checkpoint):
        return 0
    return min(min(common, max(found.pos_min + 1, found.pos_max)), found.n_tokens)


def _unloadable(cp) -> bool:
    """A checkpoint whose target blob slotctl could not read as a state (damaged, or of another memory)."""
    tgt = getattr(cp, "tgt", None)
    return tgt is not None and getattr(tgt, "error", None) is not None


def _same_prompt(r: Reuse | None) -> Reuse | None:
    """``r`` for a request that is the saved prompt itself: b11434 keeps at most ``n - 1`` tokens and
    evaluates the last one again, for the logits of the next token (``[TAG_PROMPT_LOGITS]``)."""
    if r is None:
        return None
    last = ("the request is the saved prompt itself: the server evaluates its last token again for the logits "
            "([TAG_PROMPT_LOGITS])")
    n = r.n_tokens
    if r.n_reused >= n:
        r.n_reused, r.reason = n - 1, r.reason or last
    if r.n_reused_b11434 >= n:
        r.n_reused_b11434, r.reason_b11434 = n - 1, r.reason_b11434 or last
    return r


def server_n_swa(info, *, swa_full: bool = False) -> int:
    """The server's ``n_swa`` for a model (:class:`~slotctl.model.info.ModelInfo`): its sliding window
    (``llama_model_n_swa``), 0 without sliding-window layers or with ``--swa-full``."""
    if swa_full or not info.swa_type:
        return 0
    return info.sliding_window or 0


def _divergence(kind: str, n_swa: int, checkpoints: list[int]) -> str:
    """What a request that diverges from the saved prompt after k tokens keeps (``update_slots``)."""
    if kind == "kv" and not n_swa:
        return "a request that diverges after k tokens keeps those k: the positions after them are removed"
    what = {"recurrent": "a recurrent state holds only its last position",
            "hybrid": "the recurrent part holds only its last position",
            "hybrid_iswa": "the recurrent part holds only its last position",
            "iswa": f"the SWA cache holds only the last {n_swa:,} positions"}.get(kind, "the memory cannot drop positions")
    if not checkpoints:
        return (f"{what}: a request that diverges from the saved prompt needs a checkpoint to go back to, and "
                "the file holds none: the server evaluates the whole prompt again")
    at = ", ".join(f"{c:,}" for c in checkpoints)
    return (f"{what}: a request that diverges from the saved prompt goes back to the newest of the file's "
            f"checkpoints (at {at} tokens) early enough for the divergence, or with none evaluates the whole "
            "prompt again; b11434 ignores the file's checkpoints and always evaluates it again")


def _file_window(sf: SlotFile) -> int:
    """The sliding window the file's SWA section was saved with (its cell count), 0 without one."""
    for sl, sec in zip(sf.target.layout.sections, sf.target.sections):
        if sl.role == "swa":
            return max((st.cell_count for st in sec.streams), default=0)
    return 0


def _held(kind: str, part: str, pos_min: int, n: int, n_swa: int) -> str:
    if part == "the SWA cache":
        return (f"the file's SWA cache holds only the window (positions {pos_min:,}..{n - 1:,}; a slot file keeps "
                f"no masked cells), and a request after {n:,} tokens needs positions from {max(0, n - n_swa):,}")
    if part == "the recurrent state":
        return (f"the recurrent state is at position {pos_min:,} and cannot serve the positions a request after "
                f"{n:,} tokens needs")
    return f"{part} of the restored slot starts at position {pos_min:,}"


def explain_difference(check: str, restored, fresh, *, draft_status: str, draft_reason: str | None,
                       rolls_back: bool, predicted: int | None) -> str | None:
    """Why a continuation from a restored slot differs from one in a slot never saved, when the server's
    own documented behaviour explains it; None when nothing does (``restore --compare`` then fails).

    ``check``: "text", "n_evaluated", "n_drafted" or "n_accepted"; ``restored`` / ``fresh``: the two
    continuations (``n_reused``, ``n_common``, ``checkpoint``); ``draft_status`` / ``draft_reason``: the
    restore's draft step; ``rolls_back``: the memory cannot drop positions (SWA, recurrent) so a restored
    slot goes back to a checkpoint where a never-saved one does not; ``predicted``: :func:`predict_reuse`'s
    ``n_reused`` for this file when the request extends the saved prompt, else None.
    """
    if check == "text":
        return None     # greedy verification keeps the target's choice: the text never legitimately differs
    if check == "n_evaluated":
        if not rolls_back or restored.n_reused >= fresh.n_reused:
            return None
        if predicted is not None and restored.n_reused != predicted:
            return None     # a count no rule predicts
        where = (f"goes back to the checkpoint at {restored.checkpoint:,} tokens" if restored.checkpoint is not None
                 else "evaluates the whole prompt again (no checkpoint early enough)")
        return (f"the restored slot kept {restored.n_reused:,} of the request's tokens, the never-saved one "
                f"{fresh.n_reused:,}: a slot file holds only what the memory still needs (an SWA cache's window, a "
                f"recurrent state's last position), so the restored slot {where}; llama-server does the same"
                + (" (as validate predicts)" if predicted is not None else ""))
    if draft_status in ("absent", "dropped", "ignored"):
        why = {"absent": "the file holds no draft state", "dropped": "its draft state was dropped",
               "ignored": "its draft state was ignored"}[draft_status]
        return (f"{why}{': ' + draft_reason if draft_reason and draft_status != 'absent' else ''}; the restored "
                "slot drafts from an empty draft context until it fills again, so fewer drafts are accepted: "
                "llama-server does the same")
    return None


def reuse_for(sf: SlotFile, info, *, swa_full: bool = False, n_ctx_checkpoints: int | None = None,
              reads_checkpoints: bool = True, extends: bool = True, build: str = builds.NEWEST) -> Reuse | None:
    """:func:`predict_reuse` for a server running the model ``info`` (None: not known, the window the file
    was saved with): its SWA window (:func:`server_n_swa`, ``swa_full`` its ``--swa-full``), its
    ``--ctx-checkpoints`` (default the server's), and whether it reads the file's checkpoints
    (:func:`slotctl.server.findings.checkpoints_read`; ``reads_checkpoints`` False: a server that ignores
    them whatever the file). What inspect, validate and ``restore --prove`` predict, written once."""
    from slotctl.server.findings import checkpoints_read

    n_swa = server_n_swa(info, swa_full=swa_full) if info is not None else None
    return predict_reuse(sf, n_swa=n_swa,
                         n_ctx_checkpoints=DEFAULT_CTX_CHECKPOINTS if n_ctx_checkpoints is None else n_ctx_checkpoints,
                         checkpoints_read=reads_checkpoints and checkpoints_read(sf), extends=extends, build=build)


def request_reuse(kind: str, n_swa: int, n_file: int, common: int, n_request: int,
                  extending: int | None) -> int:
    """How many of a request's ``n_request`` prompt tokens a slot holding a state of ``n_file`` tokens
    (memory ``kind``, the server's ``n_swa``) keeps when the two share their first ``common`` tokens
    (b11434 ``update_slots``: ``n_past`` is the common prefix).

    A request that extends the whole state (``common == n_file < n_request``) keeps ``extending``
    (:func:`predict_reuse`'s ``n_reused`` for it: all of it for a plain KV cache; None: no prediction,
    nothing). Otherwise a plain KV cache (no sliding window) drops the positions after the common prefix
    and keeps it, less the last token when the prefix is the whole request (``[TAG_PROMPT_LOGITS]``: its
    logits are needed); a memory that cannot drop positions (SWA, recurrent, hybrid) goes back to a
    checkpoint, which b11434 never has after a restore: nothing is kept."""
    common = max(0, min(common, n_file, n_request))
    if common == 0:
        return 0
    if common == n_file and n_file < n_request:
        return min(extending or 0, common)
    if kind == "kv" and not n_swa:
        return min(common, n_request - 1)
    return 0
