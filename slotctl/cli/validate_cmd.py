"""``slotctl validate FILE...``: will a llama-server started with these flags restore each file, completely?"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from slotctl.cli import remote
from slotctl.cli.common import FileRun, NoteCounter, handle_errors, store_deadline
from slotctl.cli.extras import llama_available, llama_install
from slotctl.cli.command_line import ArgsCommand
from slotctl.cli.options import (
    DraftModelOpt,
    JudgeServerOpt,
    JsonlOpt,
    JsonOpt,
    LiveApiKeyOpt,
    LiveTimeoutOpt,
    ModelOpt,
    ServerBuildOpt,
    ServerStateVersionOpt,
    QuietOpt,
    SlotOpt,
    VerboseOpt,
)
from slotctl.cli.server_panel import with_server_flags
from slotctl.cli.output import Output, escape_text, human_bytes, style_of
from slotctl.errors import UsageError
from slotctl.server.builds import NEWEST as NEWEST_BUILD
from slotctl.server.flags import SERVER_STATE_VERSION, ServerFlags, attn_rot_disable
from slotctl.live import DEFAULT_TIMEOUT

_VERDICT_WORDS = {"restores": "restores completely", "restores_with_drops": "restores, with layers dropped",
                  "aborts": "the server aborts on it", "refused": "the server refuses it",
                  "unreadable": "unreadable", "undecided": "undecided without the model (give -m)",
                  "other_model": "stored for another model: never restored", "corrupt": "not the bytes stored: never "
                                                                                         "restored"}
_SUMMARY_WORDS = {"restores": "restoring completely", "restores_with_drops": "restoring with layers dropped",
                  "aborts": "making the server abort", "refused": "refused", "unreadable": "unreadable",
                  "undecided": "undecided without the model", "other_model": "stored for another model",
                  "corrupt": "not the bytes stored"}


def register(app: typer.Typer) -> None:
    app.command("validate", cls=ArgsCommand)(validate)


@handle_errors
@with_server_flags
def validate(
    ctx: typer.Context,
    files: Annotated[list[Path], typer.Argument(help="Slot files, directories (such as a server's "
                                                     "--slot-save-path: the files in them that begin with the "
                                                     "state magic), or - for standard input.")],
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    slot: SlotOpt = 0,
    mmproj: Annotated[Optional[Path], typer.Option("--mmproj", "-mm", dir_okay=False,
                                                   help="The server's multimodal projector: media chunks in the "
                                                        "prompt restore only with one (not loaded).")] = None,
    state_version: ServerStateVersionOpt = SERVER_STATE_VERSION,
    server_build: ServerBuildOpt = NEWEST_BUILD,
    load: Annotated[bool, typer.Option("--load/--no-load",
                                       help="With -m: also load every layer into real contexts built with these "
                                            "flags, in a child process (--no-load: predict only).")] = True,
    server: JudgeServerOpt = None,
    api_key: LiveApiKeyOpt = None,
    timeout: LiveTimeoutOpt = DEFAULT_TIMEOUT,
    json_out: JsonOpt = False,
    jsonl: JsonlOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    flags: ServerFlags = ServerFlags(),
) -> None:
    """Check that a llama-server started with these flags restores each slot file completely.

    Without -m: every layer parsed and the server's own rules checked. With -m (and -md): what the
    contexts hold, predicted from the GGUFs and the flags, compared layer by layer; then each layer is
    loaded into real contexts in a child process (needs llama-cpp-python; --no-load: predict only).
    Each finding is an error (refused or aborts), a drop (restored without a layer) or a note.
    With --server URL: for that running llama-server's model and flags (docs/live.md).

    Exit codes: 0 every file restores completely; 1 a file is refused, makes the server abort, loses
    a layer, or holds a checkpoint the server aborts on when it rolls back to it; 2 usage or I/O
    error; 3 without -m, what the server does with a file cannot be decided (undecided). Keys and finding codes: docs/validate.md.
    """
    from slotctl.paths import STDIN, stdin_copy
    from slotctl.inputs import expand_slot_paths
    from slotctl.validate import ServerSetup, validate_paths

    store = store_deadline(timeout if remote._source(ctx, "timeout") == "COMMANDLINE" else None, files)
    out = Output(json_mode=json_out, jsonl=jsonl, quiet=quiet, verbose=verbose)
    if mmproj is not None:
        from slotctl.paths import check_readable

        check_readable(mmproj, what="mmproj ")
    lv = remote.learn_from_server(ctx, out, "validate", server, api_key=api_key, timeout=timeout, flags=flags,
                                  model=model, draft_model=draft_model, slot=slot, mmproj=mmproj is not None,
                                  state_version=state_version, store=store)
    if lv is not None:
        model, draft_model, flags, slot = lv.model, lv.draft_model, lv.server_flags, lv.slot
        from slotctl.server.builds import from_build_info

        server_build, _why = from_build_info(lv.facts.build_info)
    setup = ServerSetup.from_flags(flags, target=model, draft=draft_model, slot=slot,
                                   mmproj=mmproj is not None if lv is None else lv.mmproj,
                                   state_version=state_version, attn_rot_disable=attn_rot_disable(),
                                   build=server_build)
    expansion = expand_slot_paths(files, follow_symlinks=True)
    run = FileRun(out, expansion, what="validate")
    paths = expansion.files
    load_skipped = None
    if load and model is not None and not llama_available():  # the core install: the prediction decides
        load = False
        load_skipped = f"llama-cpp-python is not installed: {llama_install()}"
        if out.json_mode:
            out.warn(f"real load skipped ({load_skipped}): the prediction from the GGUFs and the flags decides")

    def one_done(fr) -> None:
        if fr.path == stdin_path:
            fr.path = STDIN
        run.add(fr.as_dict())

    with contextlib.ExitStack() as stack:
        from slotctl.format.header import STDIN_HEAD

        stdin_path = stack.enter_context(stdin_copy(STDIN_HEAD)) if STDIN in paths else None
        if stdin_path is not None:
            paths = [stdin_path if p == STDIN else p for p in paths]
        _model_identities(out, setup, paths)
        with out.progress("validating", total=len(paths)) as update:
            report = validate_paths(paths, setup, real_check=load, verbose=verbose, check_content=True,
                                    on_file=lambda done, total, _p: update(done), on_report=one_done)
    doc = report.as_dict() if lv is None else lv.annotate(report.as_dict())
    summary = {**doc["summary"], "skipped": len(expansion.skipped)}
    if not out.json_mode:
        render(out, report, skipped=len(expansion.skipped), load_skipped=load_skipped, server=doc["server"])
    run.finish(summary, server=doc["server"])


def _model_identities(out: Output, setup, paths) -> None:
    """The models' content identities made before the files are judged, with a progress bar on a terminal (once
    per model file, kept: :mod:`slotctl.model.content`), when a file's name says which model it was stored for
    (:mod:`slotctl.seal`)."""
    import os

    from slotctl.seal import parse_name

    if setup.target is None or not any((s := parse_name(os.path.basename(os.fspath(p)))) and s.sealed for p in paths):
        return
    from slotctl.cli.output import hashing_progress
    from slotctl.model.content import model_content

    for m in (setup.target, setup.draft):
        if m is not None:
            model_content(m, progress=hashing_progress(out))


def render(out: Output, report, *, skipped: int = 0, load_skipped: str | None = None,
           server: dict | None = None) -> None:
    many = len(report.files) > 1
    said = context_rounding(server or {})
    if said:
        out.print(Text(said, style="dim"))
    notes = NoteCounter()
    for fr in report.files:
        if out.quiet and fr.verdict == "restores" and not _loses_tokens(fr):
            continue
        if fr.error is not None:   # not read at all: said on stderr too, as every command says it
            out.error(fr.error["message"])
        head = Text.assemble((escape_text(fr.path, keep_newlines=False), "bold"), "  ")
        head.append(_VERDICT_WORDS[fr.verdict], style=style_of(fr.verdict, bold=True))
        if fr.size is not None:
            head.append(f"  {fr.size:,} bytes", style="dim")
        if fr.version is not None:
            head.append(f", state version {fr.version}", style="dim")
        if fr.build is not None:
            head.append(f", for {fr.build}", style="dim")
        out.print(head)
        for why in fr.uncertain:
            line = Text("  not certain ", style="bold yellow")
            line.append(escape_text(why, keep_newlines=False))
            out.print(line)
        if fr.checks and any(c.predicted or c.loaded for c in fr.checks):
            out.table(_checks(fr.checks, fr.refused_or_aborts), keep=("offset", "bytes", "predicted", "loaded",
                                                                      "server"))
        shown = [f for f in fr.ordered_findings() if not (many and notes.add(f.as_dict(), fr.path))]
        for f, same in fold_findings(shown):
            line = Text("  ")
            line.append(f"{f.severity:<5}", style=style_of(f.severity))
            line.append(f" {f.layer}", style="bold")
            if f.offset is not None:
                line.append(f" @0x{f.offset:x}", style="dim")
            line.append(f" [{f.code}] ", style="dim")
            line.append(escape_text(f.message, keep_newlines=False))
            out.print(line)
            if same:
                out.print(_same_line(f, same, fr.verdict))
        r = fr.reuse
        if r is not None and r["n_tokens"]:
            line = Text("  reuse ", style="bold")
            line.append(f"a request extending the prompt finds {r['n_reused']:,} of its {r['n_tokens']:,} tokens "
                        "kept")
            if r["reason"]:
                line.append(f": {escape_text(r['reason'], keep_newlines=False)}")
            if r["b11434"]["n_reused"] != r["n_reused"]:
                line.append(f" (b11434: {r['b11434']['n_reused']:,}: "
                            f"{escape_text(r['b11434']['reason'] or '', keep_newlines=False)})")
            out.print(line)
    notes.render(out)
    if many or skipped:
        s = report.summary()
        parts = [f"{s[v]} {_SUMMARY_WORDS[v]}" for v in ("restores", "restores_with_drops", "undecided", "other_model",
                                                          "corrupt", "aborts", "refused", "unreadable") if s[v]]
        if skipped:
            parts.append(f"{skipped} skipped (not slot files)")
        out.print(Text(f"{s['files']} file(s): " + ", ".join(parts), style="bold"))
    if not report.real_check and report.setup.target is not None:
        why = f" ({load_skipped})" if load_skipped else " (--no-load)"
        out.print(Text(f"real load not run{why}: the prediction alone decides", style="dim"))


def context_rounding(server: dict) -> str | None:
    """The words for a target context llama.cpp built larger (or smaller) than the flags ask for, or None."""
    tc = server.get("target_context")
    if not tc or tc["n_ctx"] == tc["n_ctx_requested"]:
        return None
    slot = server.get("n_ctx_slot")
    return (f"context: the flags ask for {tc['n_ctx_requested']:,} cells, llama.cpp builds {tc['n_ctx']:,} "
            f"({tc['n_ctx_seq']:,} per stream: it rounds each up to a multiple of 256)"
            + (f"; a slot holds {slot:,} tokens" if slot is not None else ""))


def _loses_tokens(fr) -> bool:
    """A file that restores but whose slot keeps fewer of its tokens than it holds for a request extending
    its prompt (``-q`` shows it: the restore saves less than it seems)."""
    r = fr.reuse
    return r is not None and r["n_reused"] < r["n_tokens"]


#: what a finding adds when it is kept only because of a checkpoint's rollback (:data:`ROLLBACK_HARMLESS`, or
#: the words that replace it on a file the server refuses)
_ROLLBACK_CLAUSES = ("; harmless here:", "; not reached:")


def _remedy(a: str, b: str) -> str:
    """What two findings' messages end with alike, from a ``": "`` on (their remedy: "start the server with
    -kvu ..."), without the rollback clause; "" when they share none."""
    a, b = (min((m.split(c)[0] for c in _ROLLBACK_CLAUSES), key=len) for m in (a, b))
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    common = a[len(a) - n:]
    cut = common.find(": ")
    return common[cut:] if cut >= 0 and n - cut >= 24 else ""


def fold_findings(findings: list) -> list[tuple]:
    """Each finding with the later ones that say the same of another layer (the same code and remedy), so
    that a remedy is said once: ``[(finding, [same, ...]), ...]`` in the order given."""
    groups: list[tuple] = []
    for f in findings:
        for first, same in groups:
            if f.code == first.code and _remedy(first.message, f.message):
                same.append(f)
                break
        else:
            groups.append((f, []))
    return groups


def _same_line(first, same: list, verdict: str) -> Text:
    """The layers where a finding's cause and remedy recur, on one line."""
    items = []
    for f in same:
        item = f.layer + (f" @0x{f.offset:x}" if f.offset is not None else "")
        if f.severity != first.severity:
            item += f" ({f.severity})"
        items.append(item)
    line = Text("        the same in ", style="dim")
    line.append(", ".join(items[:-1]) + (" and " if len(items) > 1 else "") + items[-1])
    stops = {"refused": "refuses", "aborts": "aborts on"}.get(verdict)
    if stops and all(f.layer.startswith("checkpoint ") or f.layer == "draft" for f in same):
        line.append(f": not reached, the server {stops} the file before it reads {'them' if len(same) > 1 else 'it'}",
                    style="dim")
    return line


def _checks(checks, stopped: bool = False) -> Table:
    """The layers' table; ``stopped``: the server refuses the file or aborts on it, so no layer is restored and
    none is shown as ``ok`` beside that verdict (``not restored``)."""
    t = Table(show_edge=False, box=None, padding=(0, 2))
    for col in ("layer", "offset", "bytes", "predicted", "loaded", "server"):
        t.add_column(col, justify="right" if col in ("offset", "bytes") else "left")
    for c in checks:
        t.add_row(c.layer, f"0x{c.offset:x}" if c.offset is not None else "-", human_bytes(c.size),
                  Text(c.predicted or "-", style=style_of(c.predicted, "dim")),
                  Text(c.loaded or "-", style=style_of(c.loaded, "dim")),
                  Text("not restored", style=style_of("absent")) if stopped and c.effect == "ok" else
                  Text(c.effect.replace("_", " "), style=style_of(c.effect)))
    return t
