"""``slotctl strip-draft FILE...``: remove the draft state from slot files, in place and atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from slotctl.cli.common import FileRun, handle_errors, store_deadline
from slotctl.cli.options import DraftModelOpt, JsonlOpt, JsonOpt, ModelOpt, QuietOpt, StoreTimeoutOpt
from slotctl.cli.output import Output, human_bytes, markup_safe, style_of
from slotctl.errors import UsageError
from slotctl.inputs import expand_slot_paths
from slotctl.sources import is_remote
from slotctl.paths import DEFAULT_GRACE
from slotctl.strip import COPY, REFUSED, STRIPPED, UNCHANGED, UNREADABLE, WOULD_STRIP, FileResult, strip_files



def register(app: typer.Typer) -> None:
    app.command("strip-draft")(strip_draft)


@handle_errors
def strip_draft(
    paths: Annotated[list[Path], typer.Argument(help="Slot files, or directories (such as a server's "
                                                     "--slot-save-path): the files in them that begin with the "
                                                     "state magic.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the stripped file here "
                                                   "instead of in place (one input file only).")] = None,
    checkpoints: Annotated[bool, typer.Option("--checkpoints", help="Also empty the draft and speculative "
                                              "blobs inside each context checkpoint.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be removed; write nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Let -o overwrite an existing regular file (never a "
                                        "device, a FIFO or a socket).")] = False,
    follow_symlinks: Annotated[bool, typer.Option("--follow-symlinks", help="Let -o write through a symbolic "
                                                  "link: the file it points to is written (refused "
                                                  "otherwise).")] = False,
    grace: Annotated[float, typer.Option("--grace", metavar="SECONDS", min=0, help="Refuse files modified less "
                                         "than this many seconds ago: a server may still be writing them.")
                     ] = DEFAULT_GRACE,
    all_links: Annotated[bool, typer.Option("--all-links", help="A file with other names (hard links) is cut "
                                            "in place, changing every name; without it such a file is "
                                            "copied and only the name given is stripped.")] = False,
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    timeout: StoreTimeoutOpt = None,
    json_out: JsonOpt = False,
    jsonl: JsonlOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Remove the draft state (the SDFT appendix) from slot files, leaving every other byte as it was.

    In place and atomic: when the draft state ends the file (the usual case) it is cut off with one
    truncate, needing no free space; otherwise (--checkpoints, -o) the file is copied without it and
    renamed over the old one, after checking the free space the copy needs. Killed at any moment, each
    file is either the old one or the stripped one. A file without draft state is not rewritten. A file
    whose draft state is damaged is repaired by removing it; any other damage is refused and the file
    left as it was; the other files are still processed. --dry-run reports the whole draft cost,
    checkpoints included. --model and --draft-model name the memory layouts
    when the file alone does not tell them. Details: docs/strip-draft.md.

    A file that cannot be read (missing, no permission) is an entry of its own (status unreadable);
    the other files are still processed.

    Exit codes: 0 every file stripped or without draft state; 1 a file was refused; 2 usage error,
    or a file that could not be read or written.
    """
    store_deadline(timeout, paths)
    out = Output(json_mode=json_out, jsonl=jsonl, quiet=quiet)
    expansion = expand_slot_paths(paths)
    run = FileRun(out, expansion, what="strip")
    layouts = dict(layout=_layout(model), draft_layout=_layout(draft_model))
    objects = [p for p in expansion.files if is_remote(p)]
    if objects and output is not None:
        raise UsageError(f"-o: an object ({objects[0]}) is stripped in place, server-side (docs/store.md)")
    local = [p for p in expansion.files if not is_remote(p)]
    with out.progress("stripping", bytes_=True) as update:
        done = strip_files(local, output=output, checkpoints=checkpoints, dry_run=dry_run, force=force,
                           progress=update, grace=grace, all_links=all_links, follow_symlinks=follow_symlinks,
                           **layouts) if local else []
    if objects:   # s3://: a server-side rewrite to the bytes before the draft state (docs/store.md)
        from slotctl.store.strip import strip_object

        by_path = dict(zip(local, done))
        by_path.update((p, strip_object(p, dry_run=dry_run, checkpoints=checkpoints, **layouts)) for p in objects)
        results = [by_path[p] for p in expansion.files]
    else:
        results = done
    for r in results:
        run.add(r.as_dict())
        if r.repaired:
            out.warn(f"{r.path}: damaged draft state ({r.repaired}); "
                     f"{'it would be' if dry_run else 'it was'} removed, the layers before it parsed cleanly")
        if r.error:
            out.error(r.error)
        elif r.other_links and output is None and r.method == COPY and not all_links:
            out.warn(f"{r.path}: has {r.other_links} other name(s) (hard links); "
                     f"{'it would be' if dry_run else 'it was'} copied, so they keep the draft state "
                     f"(--all-links cuts the file itself, for every name)")
    left = [] if dry_run else [r for r in results if r.checkpoint_draft_size]   # --dry-run: in the total line
    if len(left) == 1:
        out.warn(f"{left[0].path}: its checkpoints hold {left[0].checkpoint_draft_size:,} bytes of draft state; "
                 "--checkpoints removes them too")
    elif left:
        out.warn(f"({len(left)} files) their checkpoints hold {sum(r.checkpoint_draft_size for r in left):,} bytes "
                 "of draft state in all; --checkpoints removes them too")
    total = sum(r.bytes_freed for r in results)
    summary = {"files": len(results), ("would_strip" if dry_run else "stripped"):
               sum(r.status in (STRIPPED, WOULD_STRIP) for r in results),
               "unchanged": sum(r.status == UNCHANGED for r in results),
               "refused": sum(r.status == REFUSED for r in results),
               "unreadable": sum(r.status == UNREADABLE for r in results),
               "skipped": len(expansion.skipped), "bytes_freed": total,
               "checkpoint_draft_size": sum(r.checkpoint_draft_size for r in results)}
    if not out.json_mode:
        render(out, results, total, dry_run=dry_run)
    run.finish(summary)


def _layout(model: Path | None):
    """The memory layout the GGUF ``model`` predicts, or None."""
    if model is None:
        return None
    from slotctl.model.info import read_model_info

    return read_model_info(model).layout()


def render(out: Output, results: list[FileResult], total: int, *, dry_run: bool) -> None:
    """One table row per file, then the total."""
    t = Table(show_edge=False)
    t.add_column("path")
    t.add_column("status")
    for c in ("before", "after", "freed"):
        t.add_column(c, justify="right")
    t.add_column("removed")
    for r in results:
        if out.quiet and r.status not in (REFUSED, UNREADABLE):
            continue
        t.add_row(markup_safe(r.path, keep_newlines=False), Text(r.status.replace("_", " "), style=style_of(r.status)), human_bytes(r.size_before),
                  human_bytes(r.size_after), human_bytes(r.bytes_freed) if r.size_after is not None else "-",
                  ", ".join(r.removed) or "-")
    if t.row_count:
        out.table(t, keep=("status", "before", "after", "freed"))   # a long path folds, whole
    statuses = (WOULD_STRIP if dry_run else STRIPPED, UNCHANGED, REFUSED, UNREADABLE)
    counts = {s: sum(r.status == s for r in results) for s in statuses}
    if not counts[UNREADABLE]:
        del counts[UNREADABLE]
    freed = "would be freed" if dry_run else "freed"
    said = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in counts.items())
    out.print(Text(f"total: {said}; {human_bytes(total)} {freed}",
                   style="bold"))
    draft = sum(r.draft_size or 0 for r in results)
    in_ckpts = sum(r.checkpoint_draft_size for r in results)
    if dry_run and draft:
        line = f"draft state in all: {human_bytes(draft)} ({draft:,} bytes)"
        if in_ckpts:
            line += (f"; {human_bytes(in_ckpts)} of it in checkpoints stays unless --checkpoints is given "
                     f"(which copies the file instead of cutting it)")
        out.print(Text(line))
