"""``slotctl save``: evaluate a prompt as llama-server would and write the slot file it would write."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from slotctl.cli import live
from slotctl.cli.common import handle_errors, require_llama, runtime_state_version
from slotctl.cli.options import (
    BatchOpt,
    CacheTypeKOpt,
    CacheTypeVOpt,
    CtxCheckpointsOpt,
    CtxSizeOpt,
    DraftCacheTypeKOpt,
    DraftCacheTypeVOpt,
    DraftModelOpt,
    DraftNMaxOpt,
    FlashAttnOpt,
    JsonOpt,
    KvUnifiedOpt,
    ParallelOpt,
    SlotOpt,
    SwaFullOpt,
    ThreadsOpt,
    UBatchOpt,
    VerboseOpt,
    context_settings,
)
from slotctl.cli.output import Output
from slotctl.errors import ExitStatus, SlotctlError, UsageError

#: state versions ``save`` writes: 4 (current llama-server) and 3 (this llama-cpp-python)
STATE_VERSIONS = (3, 4)


class PromptRefused(SlotctlError):
    """The server would refuse the prompt (its message)."""

    exit_status = ExitStatus.FAILED


def register(app: typer.Typer) -> None:
    app.command("save")(save)


def user_starts(model, tokens: list[int], delimiters: list[str]) -> list[int]:
    """Where user messages start in ``tokens``, as b11434 finds a request's message spans
    (``common_chat_msg_delimiters::split``): each delimiter is tokenized without BOS and with special
    tokens parsed, and every position where its tokens occur starts a span (the first delimiter that
    matches there names its role)."""
    if not delimiters:
        return []
    seqs = [model.tokenize(d, add_special=False, parse_special=True) for d in delimiters]
    starts = []
    for i in range(len(tokens)):
        if any(seq and tokens[i:i + len(seq)] == seq for seq in seqs):
            starts.append(i)
    return starts


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt text from --prompt, --prompt-file F or --prompt-file - (stdin), exactly as given."""
    if (prompt is None) == (prompt_file is None):
        raise UsageError("give the prompt with exactly one of --prompt TEXT and --prompt-file FILE (- for stdin)")
    if prompt is not None:
        return prompt
    if str(prompt_file) == "-":
        return typer.get_text_stream("stdin").read()
    try:
        return prompt_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{prompt_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None


@handle_errors
def save(
    ctx: typer.Context,
    name: Annotated[Optional[str], typer.Argument(metavar="NAME", show_default=False,
                                                  help="With --server: the file name the server writes in its "
                                                       "--slot-save-path.")] = None,
    model: live.LocalModelOpt = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="The slot file to write (needed unless "
                                                   "--server).", dir_okay=False)] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt text.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", "-f", help="Read the prompt from a "
                                                        "UTF-8 file, or from stdin with -.", dir_okay=False,
                                                        allow_dash=True)] = None,
    draft_model: DraftModelOpt = None,
    state_version: Annotated[int, typer.Option("--state-version", help="4: what current llama-server reads; "
                                               "3: what this llama-cpp-python reads.")] = 4,
    checkpoint_at: Annotated[Optional[list[int]], typer.Option("--checkpoint-at", help="Take a context "
                                                               "checkpoint when the prompt reaches N tokens "
                                                               "(repeatable; written as an SCKP appendix).")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option("--checkpoint-every", min=1, help="Take a context "
                                                            "checkpoint every N tokens of the prompt.")] = None,
    server_checkpoints: Annotated[bool, typer.Option("--server-checkpoints/--no-server-checkpoints",
                                                     help="Take the checkpoints llama-server (b11434) takes for "
                                                     "this prompt: 4 and 4 + n_ubatch tokens before its end and "
                                                     "at user messages (--user-delimiter), for models whose "
                                                     "memory cannot be rolled back (SWA, recurrent, hybrid; a "
                                                     "plain KV model gets none). On by default, as in the "
                                                     "server; --no-server-checkpoints keeps only --checkpoint-at "
                                                     "and --checkpoint-every.")] = True,
    user_delimiter: Annotated[Optional[list[str]], typer.Option("--user-delimiter", help="Text that starts a user "
                                                                "message in the prompt (the request's "
                                                                "message_delimiters, role user; repeatable); "
                                                                "implies --server-checkpoints.")] = None,
    ctx_checkpoints: CtxCheckpointsOpt = 32,
    checkpoint_min_step: Annotated[int, typer.Option("--checkpoint-min-step", "-cms", min=0, help="The server's "
                                                     "least spacing of checkpoints in tokens (default 8192; "
                                                     "--server-checkpoints only).")] = 8192,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    slot: SlotOpt = 0,
    ctx_size: CtxSizeOpt = 0,
    parallel: ParallelOpt = 1,
    kv_unified: KvUnifiedOpt = False,
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    draft_cache_type_k: DraftCacheTypeKOpt = "f16",
    draft_cache_type_v: DraftCacheTypeVOpt = "f16",
    flash_attn: FlashAttnOpt = "auto",
    batch_size: BatchOpt = 2048,
    ubatch_size: UBatchOpt = 512,
    swa_full: SwaFullOpt = False,
    threads: ThreadsOpt = 0,
    spec_draft_n_max: DraftNMaxOpt = 3,
    server: live.LiveServerOpt = None,
    api_key: live.LiveApiKeyOpt = None,
    timeout: live.SlotFileTimeoutOpt = live.SLOT_FILE_TIMEOUT,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Evaluate a prompt in a slot as llama-server would, and write the slot file it would save.

    Takes the flags the server is started with (-m, -md, -c, -np, -kvu, -ctk/-ctv, -ctkd/-ctvd, -fa;
    the draft context gets the target's size, slots and flash attention). The file holds the header,
    the packed token record, the target payload, an SCKP appendix with the context checkpoints
    (PARTIAL_ONLY blobs of both contexts) taken at each --checkpoint-at, every --checkpoint-every
    tokens, and (unless --no-server-checkpoints) where llama-server would take them itself: for models
    whose memory cannot be rolled back, near the end of the prompt and at user messages (--user-delimiter); and with -md the SDFT appendix with the draft context's state. Written atomically; an
    existing file is kept unless --force.
    --spec-draft-n-max is accepted for symmetry with restore and has no effect here.

    With --server URL --slot N NAME instead: a running llama-server saves its slot N to NAME in its
    --slot-save-path (POST /slots/N?action=save) and its answer is shown (--json: as it came); the
    local options do not apply (docs/live.md).

    Exit codes: 0 written; 1 the server would refuse the prompt (it does not fit the slot); 2 usage
    or I/O error (existing output without --force, unreadable model or prompt).
    """
    out = Output(json_mode=json_out, verbose=verbose)
    if server is not None:  # live mode: docs/live.md
        return live.save_on_server(ctx, out, server, name, slot=slot, api_key=api_key, timeout=timeout,
                                   json_out=json_out)
    if name is not None:
        raise UsageError(f"NAME ({name!r}) is a file name in a server's --slot-save-path and goes with --server "
                         "URL; a local save writes -o FILE")
    live.require_local(ctx, "save", model=model, output=output)
    require_llama("save")
    if state_version not in STATE_VERSIONS:
        raise UsageError(f"--state-version: {state_version} is not one of {', '.join(map(str, STATE_VERSIONS))}")
    text = read_prompt(prompt, prompt_file)
    if not text:
        raise UsageError("empty prompt: the server evaluates nothing for it")
    if not force and os.path.exists(output):
        raise UsageError(f"{output}: exists (use --force to overwrite)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(output))):
        raise UsageError(f"{os.path.dirname(os.path.abspath(output))}: no such directory")
    for path in (model, draft_model):
        if path is not None and not Path(path).is_file():
            raise UsageError(f"{path}: no such file")
    settings = context_settings(ctx_size=ctx_size, parallel=parallel, kv_unified=kv_unified,
                                cache_type_k=cache_type_k, cache_type_v=cache_type_v, flash_attn=flash_attn,
                                batch_size=batch_size, ubatch_size=ubatch_size, swa_full=swa_full)
    settings = dataclasses.replace(settings, n_threads=threads)
    if slot >= parallel:
        raise UsageError(f"--slot {slot}: the server has slots 0..{parallel - 1} (-np {parallel})")

    if user_delimiter is not None and any(not d for d in user_delimiter):
        raise UsageError("--user-delimiter: an empty delimiter matches everywhere; give the text that starts "
                         "a user message")
    server_checkpoints = server_checkpoints or bool(user_delimiter)

    from slotctl.runtime.log import configure_logging
    from slotctl.runtime.slot import CheckpointPolicy, ServerContexts, evaluate_prompt, write_slot_file

    configure_logging(verbose)
    t0 = time.perf_counter()
    try:
        with out.progress("loading models", total=1000) as update:
            sc = ServerContexts.open(model, settings, draft_path=draft_model, draft_type_k=draft_cache_type_k,
                                     draft_type_v=draft_cache_type_v, on_progress=lambda d, t: update(d, t))
    except ValueError as e:
        raise UsageError(str(e)) from None
    with sc:
        t_load = time.perf_counter() - t0
        tokens = sc.target_model.tokenize(text)
        n_ctx = sc.target.n_ctx_slot
        if len(tokens) >= n_ctx:
            raise PromptRefused(f"request ({len(tokens)} tokens) exceeds the available context size ({n_ctx} "
                                "tokens), try increasing it")
        at = sorted(set(checkpoint_at or []))
        bad = [n for n in at if not 0 < n < len(tokens)]
        if bad:
            raise UsageError(f"--checkpoint-at {bad[0]}: a checkpoint is taken inside the prompt, at 1.."
                             f"{len(tokens) - 1} tokens (the prompt has {len(tokens)})")
        if checkpoint_every is not None:
            at = sorted(set(at) | set(range(checkpoint_every, len(tokens), checkpoint_every)))
        starts = user_starts(sc.target_model, tokens, user_delimiter or [])
        policy = CheckpointPolicy(server=server_checkpoints, n_ctx_checkpoints=ctx_checkpoints,
                                  min_step=checkpoint_min_step, user_starts=tuple(starts), at=tuple(at))
        t0 = time.perf_counter()
        with out.progress("evaluating", total=len(tokens) * len(sc.contexts())) as update:
            checkpoints = evaluate_prompt(sc, tokens, slot, policy=policy, on_progress=update)
        t_eval = time.perf_counter() - t0
        t0 = time.perf_counter()
        written = write_slot_file(output, sc, slot, tokens, version=state_version, checkpoints=checkpoints,
                                  overwrite=force)
        t_write = time.perf_counter() - t0
        prompt_text = sc.target_model.detokenize(tokens)
        tinfo, dinfo = sc.target_info, sc.draft_info
        layout = tinfo.layout()
        draft_layout = dinfo.layout() if dinfo is not None else None

    from slotctl.describe import describe_file
    from slotctl.findings import file_warnings
    from slotctl.slotfile import open_slot_file

    sf = open_slot_file(output, layout=layout, draft_layout=draft_layout)
    rt = runtime_state_version()
    described = describe_file(sf, text=prompt_text, runtime_version=rt, info=tinfo, draft_info=dinfo)
    described["warnings"] = file_warnings(sf, runtime_version=rt)
    timings = {"load_ms": round(t_load * 1000, 3), "evaluate_ms": round(t_eval * 1000, 3),
               "write_ms": round(t_write * 1000, 3)}
    if json_out:
        out.json({
            "path": written.path,
            "slot": slot,
            "state_version": written.version,
            "n_tokens": written.n_tokens,
            "size": written.size,
            "payload_size": written.payload_size,
            "sckp_size": written.sckp_size,
            "sdft_size": written.sdft_size,
            "checkpoints": [c.n_tokens for c in checkpoints],
            "user_starts": starts,
            "draft": draft_model is not None,
            "timings": timings,
            "file": described,
        })
        return
    from slotctl.cli.inspect_cmd import render

    render(out, sf, described)
    out.print(Text(f"wrote {written.size:,} bytes, {written.n_tokens:,} tokens from slot {slot}, state version "
                   f"{written.version}; model load {timings['load_ms']:,.0f} ms, evaluate "
                   f"{timings['evaluate_ms']:,.0f} ms, write {timings['write_ms']:,.0f} ms", style="bold"))
