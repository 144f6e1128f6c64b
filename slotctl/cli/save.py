"""``slotctl save``: evaluate a prompt as llama-server would and write the slot file it would write."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from slotctl.cli import remote
from slotctl.cli.common import handle_errors, read_prompt
from slotctl.cli.extras import require_llama
from slotctl.cli.command_line import ArgsCommand
from slotctl.cli.options import (RouterModelOpt, DraftModelOpt, JsonOpt, LiveApiKeyOpt, LiveServerOpt, LiveTimeoutOpt,
                                 LocalModelOpt, SaveStateVersionOpt, ServerBuildOpt, SlotOpt, VerboseOpt)
from slotctl.cli.server_panel import with_server_flags
from slotctl.live import SLOT_FILE_TIMEOUT
from slotctl.cli.output import Output
from slotctl.errors import UsageError
from slotctl.paths import check_readable
from slotctl.runtime.save import STATE_VERSIONS
from slotctl.server.builds import NEWEST as NEWEST_BUILD
from slotctl.server.flags import SERVER_STATE_VERSION, ServerFlags, check_slot


def register(app: typer.Typer) -> None:
    app.command("save", cls=ArgsCommand)(save)


@handle_errors
@with_server_flags
def save(
    ctx: typer.Context,
    name: Annotated[Optional[str], typer.Argument(metavar="NAME", show_default=False,
                                                  help="With --server: the file name the server writes in its "
                                                       "--slot-save-path.")] = None,
    model: LocalModelOpt = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="The slot file to write (needed unless "
                                                   "--server).", dir_okay=False)] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt text.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", "-f", help="Read the prompt from a "
                                                        "UTF-8 file, or from stdin with -.", dir_okay=False,
                                                        allow_dash=True)] = None,
    draft_model: DraftModelOpt = None,
    state_version: SaveStateVersionOpt = SERVER_STATE_VERSION,
    server_build: ServerBuildOpt = NEWEST_BUILD,
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
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    slot: SlotOpt = 0,
    server: LiveServerOpt = None,
    router_model: RouterModelOpt = None,
    api_key: LiveApiKeyOpt = None,
    timeout: LiveTimeoutOpt = SLOT_FILE_TIMEOUT,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
    flags: ServerFlags = ServerFlags(),
) -> None:
    """Evaluate a prompt in a slot as llama-server would, and write the slot file it would save.

    Takes the server's flags. The file holds the prompt's tokens, the target memory, the context
    checkpoints (at --checkpoint-at / --checkpoint-every, and where the server takes them itself) and,
    with -md, the draft state. Written atomically; an existing file is kept unless --force.
    With --server URL --slot N NAME: a running llama-server saves its slot N to NAME (docs/live.md).
    Details: docs/save-restore.md.

    Exit codes: 0 written; 1 the server would refuse the prompt (it does not fit the slot); 2 usage
    or I/O error.
    """
    out = Output(json_mode=json_out, verbose=verbose)
    if server is not None:  # live mode: docs/live.md
        return remote.save_on_server(ctx, out, server, name, slot=slot, api_key=api_key, timeout=timeout, router_model=router_model,
                                   json_out=json_out)
    if name is not None:
        raise UsageError(f"NAME ({name!r}) is a file name in a server's --slot-save-path and goes with --server "
                         "URL; a local save writes -o FILE")
    remote.require_local(ctx, "save", model=model, output=output)
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
    for path, what in ((model, "model "), (draft_model, "draft model ")):
        if path is not None:
            check_readable(path, what=what)   # missing, a FIFO, a device, a symlink loop: one line
    from slotctl.server.builds import get as get_build

    try:
        server_build = get_build(server_build).name
    except ValueError as e:
        raise UsageError(f"--server-build: {e}") from None
    flags.context_settings()   # settings llama.cpp would refuse: a usage error before the models load
    check_slot(slot, flags.parallel)

    if user_delimiter is not None and any(not d for d in user_delimiter):
        raise UsageError("--user-delimiter: an empty delimiter matches everywhere; give the text that starts "
                         "a user message")

    from slotctl.runtime.save import save_prompt

    from slotctl.server.speculative import runtime_draft_model

    draft_model, no_draft = runtime_draft_model(flags.spec_type, model, draft_model)
    if no_draft:
        out.note(no_draft)
    done = save_prompt(model, text, output, flags, slot=slot, draft_model=draft_model, state_version=state_version,
                       checkpoint_at=checkpoint_at or (), checkpoint_every=checkpoint_every,
                       user_delimiter=user_delimiter or (), server_checkpoints=server_checkpoints, overwrite=force,
                       verbose=verbose, bar=out.progress, build=server_build)
    written, checkpoints, starts, timings = done.written, done.checkpoints, done.user_starts, done.timings
    tinfo, dinfo = done.target_info, done.draft_info

    from slotctl.describe import describe_file
    from slotctl.server.findings import file_findings
    from slotctl.slotfile import open_slot_file

    with open_slot_file(output, layout=tinfo.layout(), draft_layout=dinfo.layout() if dinfo is not None else None) as sf:
        described = describe_file(sf, text=done.prompt_text, info=tinfo, draft_info=dinfo,
                                  findings=file_findings(sf, server_build))
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
            "checkpoints": [{"n_tokens": c.n_tokens} for c in checkpoints],
            "user_starts": starts,
            "draft_model": os.fspath(draft_model) if draft_model is not None else None,
            "timings": timings,
            "file": described,
            "exit_code": 0,
        })
        return
    from slotctl.cli.inspect_view import render

    render(out, described)
    out.print(Text(f"wrote {written.size:,} bytes, {written.n_tokens:,} tokens from slot {slot}, state version "
                   f"{written.version}; model load {timings['load_ms']:,.0f} ms, evaluate "
                   f"{timings['evaluate_ms']:,.0f} ms, write {timings['write_ms']:,.0f} ms", style="bold"))
