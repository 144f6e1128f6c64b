"""``slotctl prune DIR``: keep a slot directory under a budget, least recently used first."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from slotctl.cli.common import handle_errors, store_deadline
from slotctl.cli.command_line import ArgsCommand
from slotctl.cli.options import (
    StoreTimeoutOpt,
    DraftModelOpt,
    FileCatalogOpt,
    JsonOpt,
    ModelOpt,
    PruneMaxSizeOpt,
    SlotOpt,
    VerboseOpt,
)
from slotctl.cli.server_panel import with_server_flags
from slotctl.cli.output import Output, escape_text, human_bytes, style_of
from slotctl.server.flags import ServerFlags
from slotctl.errors import ExitStatus, UsageError, worst



def register(app: typer.Typer) -> None:
    app.command("prune", cls=ArgsCommand)(prune)


@handle_errors
@with_server_flags
def prune(
    ctx: typer.Context,
    directory: Annotated[Optional[Path], typer.Argument(help="The slot directory (a server's --slot-save-path; "
                                                        "default: the --slot-save-path of llama-server's "
                                                        "command line pasted among the arguments).",
                                                        file_okay=False)] = None,
    max_size: PruneMaxSizeOpt = None,
    older_than: Annotated[Optional[str], typer.Option("--older-than", metavar="AGE", help="Delete files not used "
                                                      "for AGE (7d, 12h, 30m, seconds).")] = None,
    keep: Annotated[Optional[int], typer.Option("--keep", min=0, help="Keep the N most recently used files "
                                                "(pinned ones besides).")] = None,
    pin: Annotated[Optional[list[str]], typer.Option("--pin", metavar="GLOB", help="Never delete files whose name "
                                                     "(or path) matches GLOB (repeatable).")] = None,
    broken: Annotated[bool, typer.Option("--broken", help="Delete only the files the server refuses or aborts on "
                                         "whatever its flags (damage in the file itself; with -m and the "
                                         "server's flags, as validate predicts it). A file refused only by the "
                                         "flags given is kept (--mismatched); undecided files are kept and "
                                         "counted: -m decides them.")] = False,
    mismatched: Annotated[bool, typer.Option("--mismatched", help="Delete the files refused only by the flags or "
                                             "model given (-np, -kvu, cache types, -c, -m): they restore in a "
                                             "server started as they were saved (slotctl convert fixes streams "
                                             "and cache types). Try it with --dry-run first.")] = False,
    useless: Annotated[bool, typer.Option("--useless", help="Delete the files the server restores but reuses none "
                                          "of (validate's predicted reuse for b11434 is 0).")] = False,
    grace: Annotated[float, typer.Option("--grace", metavar="SECONDS", min=0, help="Files modified less than "
                                         "this long ago are being written: never touched.")] = 60.0,
    temp_files: Annotated[bool, typer.Option("--temp-files", help="Also delete slotctl's temporary files "
                                             "(.NAME.slotctl-*.tmp; temporary keys under an s3:// prefix) that "
                                             "killed writes left: those untouched for --grace seconds and open "
                                             "in no other process. On its own, only those.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be deleted; delete nothing.")] = False,
    no_cache: FileCatalogOpt = False,
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    slot: SlotOpt = 0,
    timeout: StoreTimeoutOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
    flags: ServerFlags = ServerFlags(),
) -> None:
    """Delete slot files to keep a directory under a budget: --max-size, --older-than, --keep; or only the
    files a server refuses or aborts on whatever its flags (--broken), those refused only by the flags
    or model given (--mismatched), those it restores but reuses none of (--useless).

    Least recently used first: by access time where the filesystem keeps it (a server restoring a file
    reads it; slotctl's own reads do not count), else by modification time; the report says which.
    Never touched: --pin matches, slotctl's temporary files (unless --temp-files: those killed writes
    left), files modified in the last --grace seconds, files that are not slot files. Each deletion is one unlink, checked just before: killed at any
    moment, every file is either as it was or gone. Details: docs/directories.md.

    With --broken and without -m, a file whose verdict cannot be told without the model (undecided) is
    kept, and counted in one line: give -m with the server's model and flags to decide it. In the
    directory, the slot files are those that begin with the state magic and those named *.bin (an empty
    or overwritten .bin is one the server refuses).

    Exit codes: 0 done (the budget is met); 1 the directory is still over --max-size (pinned or busy
    files); 2 usage error, or a file that could not be deleted; 3 --broken without -m kept undecided
    files. A run reports the worst: 2, then 1, then 3.
    """
    from slotctl.prune import DEFAULT_GRACE, Policy, execute, parse_age, parse_size, plan

    store_deadline(timeout, directory)
    out = Output(json_mode=json_out, verbose=verbose)
    policy = Policy(max_size=parse_size(max_size) if max_size is not None else None,
                    older_than=parse_age(older_than) if older_than is not None else None,
                    keep=keep, pins=tuple(pin or ()), broken=broken, grace=grace if grace is not None else DEFAULT_GRACE,
                    temp=temp_files, mismatched=mismatched, useless=useless)
    verdicts = None
    if policy.judged:
        setup = None
        if model is not None:
            from slotctl.validate import ServerSetup

            from slotctl.server.flags import attn_rot_disable

            setup = ServerSetup.from_flags(flags, target=model, draft=draft_model, slot=slot,
                                           attn_rot_disable=attn_rot_disable())

        def verdicts(paths: list[str]) -> dict[str, tuple]:
            from slotctl.catalog import CUT_SHORT, Request, catalog

            with out.progress("judging", total=len(paths)) as update:
                judged = {}
                for i, row in enumerate(catalog(paths, Request(setup=setup, verbose=verbose), index=not no_cache), 1):
                    judged[row["path"]] = (CUT_SHORT if row.get("payload_cut") else row["verdict"], row.get("class"),
                                           row.get("remedy"))
                    update(i)
                return judged

    from slotctl.cli.command_line import pasted_slot_dir, remote_paths

    if directory is None:
        if pasted_slot_dir(ctx) is None:
            raise UsageError("give the slot directory (DIRECTORY), or llama-server's command line with its "
                             "--slot-save-path")
        directory = Path(pasted_slot_dir(ctx))
    p = plan(remote_paths(ctx, [directory])[0], policy, verdicts=verdicts, index=not no_cache)
    out.log(f"last use from {p.source}: {p.source_reason}")
    with out.progress("deleting", total=len(p.selected())) as update:
        done = [0]

        def step(_e) -> None:
            done[0] += 1
            update(done[0])

        execute(p, dry_run=dry_run, on_file=step, index=not no_cache)
    failed = [e for e in p.entries if e.action == "failed"]
    undecided = [e for e in p.entries if e.undecided]
    status = worst([e.exit_status for e in p.entries] + [ExitStatus.FAILED if p.over_budget else ExitStatus.OK])
    if json_out:
        out.json(report(p, dry_run=dry_run, exit_code=int(status)))
    else:
        render(out, p, dry_run=dry_run)
    for e in failed:
        out.error(e.error)
    if undecided:
        out.warn(f"{len(undecided)} undecided file(s) kept: without -m the server's verdict cannot be told "
                 "(they may restore); give -m with the server's model and flags to decide them")
    if p.over_budget:
        out.warn(f"still {human_bytes(p.size_after)}, over --max-size {human_bytes(policy.max_size)}: the rest is "
                 "pinned or being written")
    if status != ExitStatus.OK:
        raise typer.Exit(int(status))


def report(p, *, dry_run: bool, exit_code: int) -> dict:
    """The ``--json`` document (docs/json.md, prune)."""
    gone = [e for e in p.entries if e.action in ("deleted", "would_delete")]
    counts = {a: sum(e.action == a for e in p.entries)
              for a in ("deleted", "would_delete", "kept", "pinned", "skipped", "failed")}
    pol = p.policy
    return {
        "directory": p.directory,
        "dry_run": dry_run,
        "time_source": p.source,
        "time_source_reason": p.source_reason,
        "policy": {"max_size": pol.max_size, "older_than_seconds": pol.older_than, "keep": pol.keep,
                   "pins": list(pol.pins), "broken": pol.broken, "mismatched": pol.mismatched,
                   "useless": pol.useless, "grace_seconds": pol.grace, "temp_files": pol.temp},
        "files": [e.as_dict() for e in p.entries],
        "summary": {"files": len(p.entries), **counts, "undecided": sum(e.undecided for e in p.entries),
                    "freed": sum(e.size for e in gone),
                    "freed_disk": sum(e.disk_size for e in gone), "size_before": p.size_before,
                    "size_after": p.size_after, "over_budget": p.over_budget},
        "exit_code": exit_code,
    }


def render(out: Output, p, *, dry_run: bool) -> None:
    """What went (or would go) and why, then the totals; kept files only with their count (and the undecided
    ones --broken kept, by name). Lines wrap at the output's width."""
    out.print(Text(f"last use: {p.source} ({p.source_reason})", style="dim"))
    for e in p.entries:
        if e.action in ("kept",) and not e.undecided:
            continue
        line = Text(f"{e.action:<13}", style=style_of(e.action), overflow="fold")
        line.append(f"{human_bytes(e.size):>10}  ")
        line.append(escape_text(e.path, keep_newlines=False))
        line.append(f"  ({e.reason})", style="dim")
        out.print(line)
    gone = [e for e in p.entries if e.action in ("deleted", "would_delete")]
    kept = sum(e.action == "kept" for e in p.entries)
    verb = "would delete" if dry_run else "deleted"
    out.print(Text(f"{verb} {len(gone)} file(s), {'would free' if dry_run else 'freed'} "
                   f"{human_bytes(sum(e.size for e in gone))}; kept {kept}; directory "
                   f"{human_bytes(p.size_before)} -> {human_bytes(p.size_after)}", style="bold"))
