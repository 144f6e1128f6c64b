"""``restore --prove``: after a restore, the server's own counts for one request of the file's own prompt.

The proving request is ``POST /completion`` with the file's tokens as the prompt (token ids, sent as they
are: nothing added), ``n_predict`` 0, ``cache_prompt`` on, in the restored slot. The server answers with
``timings.cache_n`` (prompt tokens it reused from the slot) and ``timings.prompt_n`` (prompt tokens it
evaluated). Against them: what validate predicts for that request and that server
(:func:`slotctl.server.reuse.predict_reuse` with ``extends=False``: the saved prompt itself, nothing more;
the rule of b11434 or of a later server by ``/props`` ``build_info``, :func:`server_reads_checkpoints`).

The proof fails (exit 1) when the server evaluated more prompt tokens than predicted; it is undecided
(exit 3) when no prediction can be made for the file (media chunks, a memory that does not parse).

**A proof that does not spend what it proves.** Where the prediction for the proving request is that the
server evaluates more than the last token again (:func:`spends_restore`: a recurrent or hybrid state, an
SWA window, with no checkpoint b11434 keeps: the same rule of :mod:`slotctl.server.reuse` that predicts it),
sending it would make the server evaluate the prompt again and overwrite the restored state with one it
rebuilt: the restore it proves would be spent. Then it is not sent (verdict ``not_taken``, exit 0): the
prediction and why are said instead, with validate's prediction for a request that extends the prompt
(which reuses the restored state). ``spend=True`` sends it anyway.

What the proving request changes in the slot: the slot's tokens stay the file's (nothing generated);
the last prompt token is evaluated again (``[TAG_PROMPT_LOGITS]``: the server needs its logits), or more
when the server re-evaluates (the reason says why); a server that takes context checkpoints while it
evaluates a prompt (SWA, recurrent and hybrid models) may take one; the slot's statistics (its last
task) are those of the proving request.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from slotctl.errors import ExitStatus
from slotctl.live import http
from slotctl.server.flags import ServerFlags
from slotctl.server.reuse import reuse_for
from slotctl.validate.setup import Models, ServerSetup

#: the shape of a /completion answer the proof reads (llama-server b11434: ``server_task_result_cmpl_final``)
COMPLETION_SHAPE = {
    "id_slot": ("count", False, None),
    "timings": ("object", True, {"cache_n": ("count", True, None), "prompt_n": ("count", True, None),
                                 "prompt_ms": ("number", False, None)}),
}

#: the newest llama.cpp build whose server ignores a slot file's checkpoint appendix after a restore
LAST_BUILD_IGNORING_CHECKPOINTS = 11434


def server_reads_checkpoints(build_info: str | None) -> bool:
    """Whether the server restores a file's checkpoint appendix (``/props`` ``build_info``, ``bNNNN-...``).

    b11434 restores the target only (``load_slot``); the draft-state change ea736c1d5 on top of it reads
    the appendix too. A build number above b11434 is taken as that later server; an unknown build, or
    one up to b11434, as b11434 (the rule that predicts the least reuse).
    """
    m = re.match(r"b(\d+)", build_info or "")
    return bool(m) and int(m.group(1)) > LAST_BUILD_IGNORING_CHECKPOINTS


@dataclass
class Proof:
    """What the proving request found. ``verdict``: "proven" (the server evaluated no more than predicted),
    "reevaluated" (it evaluated more), "undecided" (no prediction). ``predicted_*``: for this request
    and this server's rule (``rule``); ``extending``: validate's prediction for a request that extends
    the saved prompt (its ``reuse`` object)."""

    n_prompt: int
    n_reused: int | None
    n_evaluated: int | None
    predicted_reused: int | None
    predicted_evaluated: int | None
    rule: str
    reason: str | None
    verdict: str
    ms: float
    prompt_ms: float | None = None
    extending: dict | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def exit_status(self) -> ExitStatus:
        return {"proven": ExitStatus.OK, "reevaluated": ExitStatus.FAILED,
                "not_taken": ExitStatus.OK}.get(self.verdict, ExitStatus.UNDECIDED)

    def summary(self, who: str = "the server") -> str:
        """One line: the verdict and the server's counts (or why the request was not sent)."""
        if self.verdict == "not_taken":
            return (f"not taken: the proving request would make {who} evaluate {self.predicted_evaluated:,} of the "
                    f"{self.n_prompt:,} prompt tokens again and spend the restore it proves")
        return (f"{self.verdict}: {who} reused {self.n_reused:,} and evaluated {self.n_evaluated:,} of "
                f"{self.n_prompt:,} prompt tokens")

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "n_prompt": self.n_prompt, "n_reused": self.n_reused,
                "n_evaluated": self.n_evaluated, "predicted_reused": self.predicted_reused,
                "predicted_evaluated": self.predicted_evaluated, "rule": self.rule, "reason": self.reason,
                "extending": self.extending, "ms": round(self.ms, 3),
                "prompt_ms": round(self.prompt_ms, 3) if self.prompt_ms is not None else None,
                "notes": list(self.notes)}


def local_setup(facts: http.ServerFacts, slot: int, flags: ServerFlags | None = None,
                given: frozenset[str] = frozenset()) -> tuple[ServerSetup, list[str]]:
    """The :class:`ServerSetup` to predict with for the server ``facts`` describe: what it reports
    (:func:`slotctl.live.learn.learn_flags`: ``-np``, the slot context, its model when ``/props``
    ``model_path`` is a file on this machine), ``flags`` for the fields named in ``given`` (what it does not
    report: ``-kvu``, cache types), llama-server's defaults for the rest. When the model is not on this
    machine, the file's structure and its own sliding window decide (said in the notes). The rules are those
    of the server's build (``/props`` ``build_info``: :func:`slotctl.server.builds.from_build_info`)."""
    from slotctl.errors import UsageError
    from slotctl.live.learn import learn_flags
    from slotctl.server.builds import from_build_info
    from slotctl.server.flags import SERVER_STATE_VERSION

    build = from_build_info(facts.build_info)[0]
    flags = flags or ServerFlags()
    try:
        lv = learn_flags(facts, flags, given=set(given), model=None, draft_model=None, slot=slot,
                         mmproj=facts.mmproj, state_version=SERVER_STATE_VERSION)
    except UsageError as e:   # the server's model is not on this machine: structure and the file decide
        parallel = facts.total_slots or flags.parallel
        n_stream = 1 if flags.kv_unified else parallel
        flags = flags.replace(parallel=parallel, ctx_size=(facts.n_ctx_slot or 0) * n_stream or flags.ctx_size)
        return ServerSetup.from_flags(flags, slot=slot, mmproj=facts.mmproj, build=build), [str(e)]
    return (ServerSetup.from_flags(lv.server_flags, target=lv.model, slot=slot, mmproj=lv.mmproj, build=build),
            lv.notes + lv.warnings)


def learnt_from(facts: http.ServerFacts) -> tuple:
    """What :func:`local_setup` learns a slot's setup from, of the server's facts (not the answers as they came:
    ``/slots`` changes with every task): equal for two servers whose setups it makes equal."""
    f = facts
    return (f.url, f.model_path, f.total_slots, f.n_ctx_slot, f.n_ctx_from, f.speculative, drafters(f),
            f.build_info, f.mmproj, sorted((f.model_meta or {}).items()))


def drafters(facts: http.ServerFacts) -> str | None:
    """The server's speculative types as far as they tell a setup apart: None when no slot has run a task yet
    (b11434 reports none then) and when they name no drafter ("none": the server drafts nothing, as llama-server
    does by default). A restarted server reports no types until its first task: read as they came, they changed
    twice with every restart (to nothing, then back), and each change forgot every verdict and setup, so the
    first returning turns after a restart judged their states again (the model's GGUF read) in the request path."""
    types = facts.speculative_types
    if types is None or all(t.strip() in ("", "none") for t in types.split(",")):
        return None
    return types


def local_setup_key(facts: http.ServerFacts, slot: int, flags: ServerFlags | None = None,
                    given: frozenset[str] = frozenset()) -> str:
    """:func:`local_setup`'s inputs as text, without making the setup (which reads the model's GGUF): the
    facts it learns from (:func:`learnt_from`), the slot, the flags given for the fields named in ``given``,
    and the identity of the model file when it is on this machine (device, inode, size, times). Equal texts
    make equal setups (with one slotctl version: the caller's key says which): a verdict kept for a setup
    (keep's, serve's, :func:`slotctl.catalog.verdict_key`) is asked for by this."""
    model = None
    if facts.model_path:
        try:
            st = os.stat(facts.model_path)
            model = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        except OSError:
            pass
    return repr((learnt_from(facts), slot, repr(flags or ServerFlags()), sorted(given), model))


def predict_proof(path: str | os.PathLike, setup: ServerSetup, *, reads_checkpoints: bool):
    """validate's report of ``path`` for ``setup`` (no real load) and the prediction for the proving
    request (a :class:`~slotctl.server.reuse.Reuse`, or None when none can be made)."""
    from slotctl.validate.check import validate_file

    models = Models(setup)
    report = validate_file(path, setup, models)
    sf = report.slot_file
    if sf is None or sf.target is None:
        return report, None
    r = reuse_for(sf, models.target, swa_full=setup.settings.swa_full, n_ctx_checkpoints=setup.n_ctx_checkpoints,
                  reads_checkpoints=reads_checkpoints, extends=False, build=setup.build)
    return report, r


def spends_restore(n_tokens: int, predicted_reused: int) -> bool:
    """Whether the proving request (the saved prompt itself) makes the server evaluate more than its last
    token again, by the prediction of :func:`slotctl.server.reuse.predict_reuse` (``extends=False``) for the
    server's rule: then it spends the restored state it would prove."""
    return n_tokens - predicted_reused > 1


def prove(url: str, slot: int, path: str | os.PathLike, setup: ServerSetup, *, build_info: str | None,
          api_key: str | None = None, timeout: float = http.DEFAULT_TIMEOUT, spend: bool = False) -> Proof:
    """Send the proving request for the file at ``path`` (the file the server just restored into ``slot``)
    and judge the server's counts against the prediction (see the module docstring); not sent, verdict
    ``not_taken``, where it would spend the restore (:func:`spends_restore`) and not ``spend``.

    The server's errors propagate (:mod:`slotctl.live.http`); an answer without ``timings.cache_n`` /
    ``prompt_n`` is ServerAnswerError (exit 2).
    """
    reads = server_reads_checkpoints(build_info)
    rule = "ea736c1d5" if reads else "b11434"
    report, r = predict_proof(path, setup, reads_checkpoints=reads)
    sf = report.slot_file
    tokens = [int(t) for t in sf.tokens.tokens] if sf is not None and sf.tokens is not None else []
    if not tokens or (sf.tokens.error is not None) or sf.tokens.media:
        why = ("the file holds media chunks: its prompt cannot be sent as tokens" if tokens and sf.tokens.media
               else "the file holds no prompt tokens to send")
        return Proof(len(tokens), 0, 0, None, None, rule, why, "undecided", 0.0)
    extending = report.reuse
    if r is not None and not spend:
        predicted = r.n_reused if reads else r.n_reused_b11434
        if spends_restore(len(tokens), predicted):
            why = r.reason if reads else r.reason_b11434
            ext = ""
            if extending:
                n_ext = extending["n_reused"] if reads else extending["b11434"]["n_reused"]
                ext = (f"; a request that extends the prompt is predicted to reuse {n_ext:,} of its "
                       f"{extending['n_tokens']:,} saved tokens")
            return Proof(len(tokens), None, None, predicted, len(tokens) - predicted, rule,
                         f"not sent: the proving request (the saved prompt itself) would make the server evaluate "
                         f"{len(tokens) - predicted:,} of the {len(tokens):,} tokens again ({why}), replacing the "
                         f"restored state with one it rebuilds: the proof would spend the restore it proves{ext}",
                         "not_taken", 0.0, None, extending)
    base = http.normalize_url(url)
    what = f"POST {base}/completion"
    body = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": True, "temperature": 0}
    t0 = time.perf_counter()
    answer = http.completion(base, body, api_key=api_key, timeout=timeout)
    ms = (time.perf_counter() - t0) * 1000
    http.check_shape(what, answer, COMPLETION_SHAPE)
    if "id_slot" in answer and answer["id_slot"] != slot:
        raise http.ServerAnswerError(f"{what}: unexpected answer: id_slot should be {slot}, got {answer['id_slot']}")
    tm = answer["timings"]
    n_reused, n_evaluated = tm["cache_n"], tm["prompt_n"]
    if r is None:
        return Proof(len(tokens), n_reused, n_evaluated, None, None, rule,
                     "no prediction for this file (its memory does not parse)", "undecided", ms,
                     tm.get("prompt_ms"), extending)
    predicted = r.n_reused if reads else r.n_reused_b11434
    reason = r.reason if reads else r.reason_b11434
    verdict = "proven" if n_evaluated <= len(tokens) - predicted else "reevaluated"
    notes = []
    if verdict == "reevaluated":
        reason = (f"the server evaluated {n_evaluated:,} of the {len(tokens):,} prompt tokens where "
                  f"{len(tokens) - predicted:,} were predicted" + (f" ({reason})" if reason else "")
                  + ": no rule slotctl knows explains it (another build, other flags than the server reports, "
                    "or the slot was used between the restore and the proof)")
    elif n_reused > predicted:
        notes.append(f"the server reused {n_reused - predicted:,} token(s) more than predicted")
    return Proof(len(tokens), n_reused, n_evaluated, predicted, len(tokens) - predicted, rule, reason, verdict, ms,
                 tm.get("prompt_ms"), extending, notes)
