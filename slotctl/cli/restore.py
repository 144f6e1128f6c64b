"""``slotctl restore``: restore a slot file as llama-server does, then optionally go on from it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from slotctl.cli import remote
from slotctl.cli.common import check_file, handle_errors, read_prompt
from slotctl.cli.extras import require_llama
from slotctl.cli.command_line import ArgsCommand
from slotctl.cli.options import (RouterModelOpt, DraftModelOpt, ForceSendOpt, JsonOpt, LiveApiKeyOpt, LiveServerOpt,
                                 LiveTimeoutOpt, LocalModelOpt, ProveAnywayOpt, ProveOpt, SlotDirOpt, SlotOpt,
                                 VerboseOpt)
from slotctl.cli.server_panel import with_server_flags
from slotctl.live import SLOT_FILE_TIMEOUT
from slotctl.cli.output import Output, elide, escape_text, markup_safe, style_of
from slotctl.errors import ExitStatus, UsageError
from slotctl.server.flags import ServerFlags, check_slot

#: ``-n`` when the continuation is asked for without it
DEFAULT_N_PREDICT = 16



def register(app: typer.Typer) -> None:
    app.command("restore", cls=ArgsCommand)(restore)


@handle_errors
@with_server_flags
def restore(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="The slot file (with --server: its name in the server's "
                                         "--slot-save-path).")],
    model: LocalModelOpt = None,
    draft_model: DraftModelOpt = None,
    continue_text: Annotated[Optional[str], typer.Option("--continue", help="Go on from the restored state: "
                                                         "the saved text followed by TEXT, as a new request.")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Send this whole prompt as the new "
                                                  "request instead (it may diverge from the saved prompt: the "
                                                  "server then goes back to a checkpoint).")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", "-f", help="Read that prompt from a UTF-8 "
                                                        "file, or from stdin with -.", dir_okay=False,
                                                        allow_dash=True)] = None,
    n_predict: Annotated[Optional[int], typer.Option("--n-predict", "-n", min=0, help="Tokens to generate "
                                                     f"greedily after the continuation (default {DEFAULT_N_PREDICT})."
                                                     )] = None,
    compare: Annotated[bool, typer.Option("--compare", help="Also run the continuation in fresh contexts that "
                                          "evaluate the file's prompt from scratch; exit 1 unless text, prompt "
                                          "tokens evaluated, drafted and accepted counts all agree.")] = False,
    slot: SlotOpt = 0,
    server: LiveServerOpt = None,
    prove: ProveOpt = False,
    slot_dir: SlotDirOpt = None,
    force: ForceSendOpt = False,
    prove_anyway: ProveAnywayOpt = False,
    router_model: RouterModelOpt = None,
    api_key: LiveApiKeyOpt = None,
    timeout: LiveTimeoutOpt = SLOT_FILE_TIMEOUT,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
    flags: ServerFlags = ServerFlags(),
) -> None:
    """Restore a slot file as llama-server does, step by step, and optionally continue from it.

    Takes the server's flags. Each layer in the server's order (target memory, token checks,
    checkpoints, draft state): restored, absent, ignored or dropped, and why. --continue TEXT / -n N
    then go on from it (with -md by speculative decoding); --prompt sends a new prompt, rolled back to
    a checkpoint as the server does; --compare runs a slot that was never saved beside it.
    With --server URL --slot N NAME: a running llama-server restores NAME (docs/live.md); with --slot-dir
    DIR the file is read there and validated for that server first, and not sent when the server would
    refuse it or abort on it (--force sends it); with --prove it then sends the file's own prompt (nothing
    generated) and checks the server's own counts against validate's predicted reuse, unless that request
    would make the server evaluate the prompt again (--prove-anyway: docs/fleet.md). Details:
    docs/save-restore.md.

    Exit codes: 0 restored (a dropped draft state is reported, not fatal) and with --compare all
    agreed (with --prove: the server evaluated no more than predicted, or the proof was not taken); 1
    the server would refuse the file or the request (with --server --slot-dir: not sent), --compare
    found a difference, or --prove: the server evaluated more prompt tokens than predicted; 2 usage or
    I/O error, or the server dropped the connection (it may have crashed); 3 --prove cannot predict.
    """
    out = Output(json_mode=json_out, verbose=verbose)
    if server is not None:  # live mode: docs/live.md
        return remote.restore_on_server(ctx, out, server, str(file), slot=slot, api_key=api_key, timeout=timeout, router_model=router_model,
                                        json_out=json_out, prove=prove, slot_dir=slot_dir, force=force,
                                        prove_anyway=prove_anyway)
    remote.require_local(ctx, "restore", model=model)
    from slotctl.sources import remote_url

    if remote_url(file) is not None:   # real contexts read a local file (docs/store.md)
        raise UsageError(f"{remote_url(file)}: restore reads a local slot file into real contexts: copy the object "
                         "down first (slotctl cp URL DIR/)")
    if prove or slot_dir is not None or force or prove_anyway:
        raise UsageError("--prove, --prove-anyway, --slot-dir and --force go with --server URL (a running "
                         "llama-server restores the file)")
    require_llama("restore")
    check_file(file)
    for path in (model, draft_model):
        if path is not None:
            check_file(path)
    settings = flags.context_settings()
    check_slot(slot, flags.parallel)
    if prompt is not None or prompt_file is not None:
        if continue_text is not None:
            raise UsageError("give either --continue TEXT (appended to the saved prompt) or --prompt / "
                             "--prompt-file (a whole new prompt), not both")
        prompt = read_prompt(prompt, prompt_file)
        if not prompt:
            raise UsageError("empty prompt: the server releases the slot without evaluating anything")
    go_on = continue_text is not None or prompt is not None or n_predict is not None or compare
    n = DEFAULT_N_PREDICT if n_predict is None else n_predict

    from slotctl.runtime.context import STATE_VERSION
    from slotctl.runtime.log import configure_logging
    from slotctl.runtime.restore import RestoreRefused, restore_slot
    from slotctl.runtime.slot import ServerContexts

    configure_logging(verbose)
    from slotctl.server.speculative import runtime_draft_model

    draft_model, no_draft = runtime_draft_model(flags.spec_type, model, draft_model)
    if no_draft:
        out.note(no_draft)
    report: dict = {"path": str(file), "slot": slot, "state_version": None, "runtime_state_version": STATE_VERSION,
                    "size": os.path.getsize(file), "ok": False, "n_tokens": None, "token_format": None,
                    "bytes_read": None,
                    "steps": [], "draft_status": None, "timings": {}, "continuation": None, "compare": None}
    timings = report["timings"]
    t0 = time.perf_counter()
    with out.progress("loading models", total=1000) as update:
        sc = ServerContexts.open(model, settings, draft_path=draft_model, draft_type_k=flags.spec_draft_type_k,
                                 draft_type_v=flags.spec_draft_type_v, on_progress=lambda d, t: update(d, t))
    timings["load_ms"] = _ms(t0)
    status = ExitStatus.OK
    with sc:
        try:
            restored = restore_slot(sc, file, slot, n_ctx_checkpoints=flags.ctx_checkpoints)
        except RestoreRefused as e:
            report.update(error={"code": e.error_code, "message": str(e)}, steps=[s.as_dict() for s in e.steps])
            if e.steps:
                report["state_version"] = e.steps[0].details.get("state_version")
            _emit(out, report, json_out, ExitStatus.FAILED)
            out.error(str(e))
            raise typer.Exit(int(ExitStatus.FAILED)) from None
        timings["restore_ms"] = round(restored.ms, 3)
        report.update(ok=True, state_version=restored.version, n_tokens=len(restored.tokens),
                      token_format=restored.token_format, bytes_read=restored.n_bytes,
                      steps=[s.as_dict() for s in restored.steps], draft_status=restored.draft_status)
        try:
            if go_on:
                status = _continue(out, sc, restored, report, continue_text, prompt, n, flags.spec_draft_n_max,
                                   compare, flags.ctx_checkpoints)
        except _Refused as e:
            report.update(ok=False, error={"code": "request_refused", "message": str(e)})
            _emit(out, report, json_out, ExitStatus.FAILED)
            out.error(str(e))
            raise typer.Exit(int(ExitStatus.FAILED)) from None
    _emit(out, report, json_out, status)
    if report["compare"] is not None and not report["compare"]["agree"] and not report["compare"]["explained"]:
        out.error(f"compare: {report['compare']['difference']}")
    if status != ExitStatus.OK:
        raise typer.Exit(int(status))


class _Refused(Exception):
    """The server would refuse the continuation request."""


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 3)


def _continue(out: Output, sc, restored, report: dict, text: str | None, prompt: str | None, n: int,
              n_draft_max: int, compare: bool, ctx_checkpoints: int) -> ExitStatus:
    from slotctl.runtime.compare import compare_with_never_saved, run_request
    from slotctl.runtime.speculative import RequestRefused, ServerSlot, request_tokens
    from slotctl.server.checkpoints import CheckpointPolicy

    timings = report["timings"]
    # while it processes the request's prompt, the server takes checkpoints of its own
    policy = CheckpointPolicy(server=True, n_ctx_checkpoints=ctx_checkpoints)
    srv = ServerSlot(sc, restored.slot, restored.tokens, restored.checkpoints, n_draft_max=n_draft_max,
                     policy=policy)
    if prompt is not None:
        request = sc.target_model.tokenize(prompt)
    else:
        request = request_tokens(sc.target_model, restored.tokens, text or "")
    try:
        comp = run_request(srv, request, n, out.progress)
    except RequestRefused as e:
        raise _Refused(str(e)) from None
    timings["prompt_ms"] = round(comp.prompt_ms, 3)
    timings["generate_ms"] = round(comp.generate_ms, 3)
    report["continuation"] = {"continue_text": text if prompt is None else None, "prompt": prompt,
                              "n_predict": n, **_round(comp.as_dict())}
    report["continuation"]["n_slot_tokens"] = len(restored.tokens)
    report["continuation"]["reuse_reason"] = reuse_reason(report["continuation"])
    if not compare:
        return ExitStatus.OK
    t0 = time.perf_counter()
    try:
        cmp = compare_with_never_saved(sc, restored, comp, request, n, n_draft_max=n_draft_max, policy=policy,
                                       progress=out.progress)
    except RequestRefused as e:
        raise _Refused(f"fresh contexts: {e}") from None
    timings["compare_ms"] = _ms(t0)
    report["compare"] = {
        "agree": cmp.agree,
        "explained": cmp.explained,
        "difference": _difference(cmp.first, comp, cmp.fresh, restored) if cmp.first else None,
        "note": cmp.note,
        "checks": [{"check": name, "restored": r, "fresh": f, "equal": r == f} for name, r, f in cmp.checks],
        "fresh": _round(cmp.fresh.as_dict()),
    }
    return ExitStatus.OK if cmp.agree or cmp.explained else ExitStatus.FAILED


def _round(d: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


def _difference(name: str, r, f, restored) -> str:
    """The first difference in words, with what the restore did to the draft when that explains it."""
    if name == "text":
        return (f"generated text differs: {elide(r.text, 120)!r} after restore, {elide(f.text, 120)!r} fresh")
    if name == "n_evaluated":
        return f"prompt tokens evaluated: {r.n_evaluated} after restore, {f.n_evaluated} fresh"
    msg = (f"draft accepted {r.n_accepted} of {r.n_drafted} after restore, {f.n_accepted} of {f.n_drafted} fresh")
    draft = restored.step("draft")
    if draft.status == "absent":
        msg += ": the file holds no draft state"
    elif draft.status in ("dropped", "ignored"):
        msg += f": {draft.reason}"
    return msg


# -- output ---------------------------------------------------------------------------------------

def _emit(out: Output, report: dict, json_out: bool, status: int) -> None:
    report["exit_code"] = int(status)
    if json_out:
        out.json(report)
    else:
        render(out, report)


def render(out: Output, r: dict) -> None:
    """The human view of the restore report."""
    head = Text.assemble((markup_safe(r["path"], keep_newlines=False), "bold"), f" into slot {r['slot']}")
    if r["state_version"] is not None:
        head.append(f", state version {r['state_version']}")
        if r["state_version"] != r["runtime_state_version"]:
            head.append(f" (this runtime reads {r['runtime_state_version']})")
    if r["n_tokens"] is not None:
        head.append(f", {r['n_tokens']:,} tokens ({r['token_format']}), {r['bytes_read']:,} bytes read")
    out.print(head)
    t = Table(show_edge=False)
    for c in ("step", "status", "bytes", "ms", "note"):
        t.add_column(c, justify="right" if c in ("bytes", "ms") else "left")
    for s in r["steps"]:
        t.add_row(s["step"], Text(s["status"], style=style_of(s["status"])), f"{s['bytes']:,}",
                  f"{s['ms']:.1f}", markup_safe(_note(s)))
    out.table(t, keep=("step", "status", "bytes", "ms"))   # the note folds; no value is cut
    for s in r["steps"]:
        if s["status"] in ("dropped", "ignored") and s["reason"]:
            out.warn(f"{s['step']}: {s['reason']}")
    tm = r["timings"]
    if tm:
        out.print(Text(", ".join(f"{k.removesuffix('_ms').replace('_', ' ')} {v:,.1f} ms" for k, v in tm.items()),
                       style="dim"))
    c = r["continuation"]
    if c is not None:
        out.print(_completion_panel("continuation", c))
    cmp = r["compare"]
    if cmp is not None:
        out.table(_compare_table(cmp), keep=("check", ""))   # the texts fold, whole
        if cmp["agree"]:
            out.print(Text("restored and fresh agree: a restored slot answers like one never saved", style="green"))
        elif cmp.get("note"):
            out.print(Text(f"{cmp['difference']}: expected. {cmp['note']}", style="yellow"))


def _note(s: dict) -> str:
    if s["reason"]:
        return s["reason"]
    if s["step"] == "target" and s.get("converted_from"):
        return f"converted from state version {s['converted_from']}"
    if s["step"] == "tokens":
        return f"{s['n_tokens']:,} tokens ({s['format']}), slot n_ctx {s['n_ctx_slot']:,}"
    if s["step"] == "checkpoints" and s["status"] == "restored":
        return f"{s['kept']} checkpoint(s)"
    if s["step"] == "draft" and s["status"] == "restored":
        pos = s.get("positions")
        return f"draft context holds positions {pos[0]}..{pos[1]}" if pos else "empty draft state"
    return ""


def reuse_reason(c: dict) -> str:
    """Why a request reused and evaluated the tokens it did (b11434 ``update_slots``), from its counts."""
    held, new = c["n_common"], c["n_prompt"] - c["n_common"]
    if c["n_reevaluated"]:
        how = (f"the memory went back to the checkpoint at {c['checkpoint']:,} tokens" if c["checkpoint"] is not None
               else "no checkpoint was early enough, so the server started over")
        return (f"the slot held the request's first {held:,} tokens, but its memory cannot stay at that position "
                f"(an SWA window or a recurrent state): {how}, and {c['n_reevaluated']:,} of them "
                f"{'was' if c['n_reevaluated'] == 1 else 'were'} evaluated again, with the {new:,} new ones")
    if new == 0 and c["n_evaluated"]:
        return (f"the slot held the whole request ({held:,} tokens): the server evaluates its last token again, "
                "for the logits of the next one")
    if held == 0:
        return "the request begins with none of the slot's tokens: it is evaluated whole"
    slot = c.get("n_slot_tokens")
    parts = ""
    if slot is not None and held < slot:
        parts = (f"; it parts from the slot's {slot:,} tokens there: "
                 + ("the slot's text and the continuation, tokenized again as a client sends them, give other "
                    "tokens from that point (a tokenizer merges across the join, generated tokens read back "
                    "differently)" if c.get("continue_text") is not None else "the prompt differs there"))
    return (f"the slot held the request's first {held:,} tokens (its common prefix with the slot's tokens){parts}; "
            f"the {c['n_evaluated']:,} after them are evaluated")


def _completion_panel(title: str, c: dict) -> Panel:
    lines = [f"prompt: {c['n_prompt']:,} tokens, {c['n_reused']:,} reused, {c['n_evaluated']:,} evaluated"
             + (f" (the draft context held {c['n_draft_reused']:,})" if c["n_draft_reused"] is not None else "")
             + (f", from the checkpoint at {c['checkpoint']:,} tokens" if c["checkpoint"] is not None else ""),
             f"why: {reuse_reason(c)}"]
    lines.append(f"generated: {c['n_generated']:,} tokens (stop: {c['stop']})")
    if c["speculative"]:
        lines.append(f"speculative: drafted {c['n_drafted']:,}, accepted {c['n_accepted']:,} in "
                     f"{c['n_verify_steps']:,} verification step(s) (up to {c['n_draft_max']} per step)"
                     + (f"; {c['n_replayed']:,} token(s) replayed after speculative checkpoint restores"
                        if c["n_replayed"] else ""))
    # the generated text whole, wrapped at the width (a word longer than a line folds): never cut
    body = [Text("\n".join(lines)), Text(escape_text(c["text"]), style="italic", overflow="fold")]
    return Panel(Group(*body), title=title, title_align="left")


def _compare_table(cmp: dict) -> Table:
    t = Table(title="compare: restored vs never saved", title_justify="left", show_edge=False)
    for col in ("check", "restored", "fresh", ""):
        t.add_column(col)
    for ch in cmp["checks"]:
        fmt = (lambda v: Text(escape_text(v), overflow="fold")) if ch["check"] == "text" else str
        t.add_row(ch["check"], fmt(ch["restored"]), fmt(ch["fresh"]),
                  Text("same", style=style_of("same")) if ch["equal"] else Text("differs", style=style_of("differs")))
    return t
