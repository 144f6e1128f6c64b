"""``slotctl cp SRC... DST``: slot files between local paths and object storage, checked and atomic."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from slotctl.cli.common import FileRun, handle_errors, store_deadline
from slotctl.cli.options import JsonlOpt, JsonOpt, QuietOpt, StoreTimeoutOpt
from slotctl.cli.output import Output, human_bytes, markup_safe, style_of



def register(app: typer.Typer) -> None:
    app.command("cp")(cp)


@handle_errors
def cp(
    paths: Annotated[list[str], typer.Argument(metavar="SRC... DST", help="Slot files, directories or s3:// "
                                               "prefixes to copy (a directory or prefix: its slot files), then "
                                               "the destination: a file, a directory, s3://bucket/key, or "
                                               "s3://bucket/prefix/ (ending with /).")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing destination (without it an "
                                            "object is created only if none is there: If-None-Match: *).")
                         ] = False,
    force: Annotated[bool, typer.Option("--force", help="Copy a file the server refuses or aborts on whatever "
                                        "its flags (refused otherwise).")] = False,
    timeout: StoreTimeoutOpt = None,
    json_out: JsonOpt = False,
    jsonl: JsonlOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Copy slot files: local to S3, S3 to local, S3 to S3 (server-side, within a bucket or across).

    Each file's structure is read first (metadata only): a file the server refuses or aborts on whatever
    its flags is refused unless --force (trailing bytes it ignores are copied). An
    existing destination is never replaced unless --overwrite. Large files go up in parts (8 MiB) with
    a progress bar. After the copy the size is checked, and the MD5 where the store's ETag is one.
    Killed at any moment, no half-written object or file is visible. s3:// configuration: docs/store.md.

    Exit codes: 0 every file copied; 1 a file was refused (broken); 2 usage or I/O error (a store
    error, an existing destination, a size or checksum that does not match).
    """
    from slotctl.errors import UsageError
    from slotctl.store.cp import COPIED, FAILED, REFUSED, copy_files
    from slotctl.inputs import expand_slot_paths

    store_deadline(timeout, paths)
    out = Output(json_mode=json_out, jsonl=jsonl, quiet=quiet)
    if len(paths) < 2:
        raise UsageError("give the files to copy and then the destination: slotctl cp SRC... DST", code="usage")
    sources, dst = paths[:-1], paths[-1]
    expansion = expand_slot_paths(sources, follow_symlinks=True)
    run = FileRun(out, expansion, what="copy")
    many = len(expansion.files) > 1 or len(expansion.files) != len(sources)
    with out.progress("copying", bytes_=True) as update:
        results = copy_files(expansion.files, dst, overwrite=overwrite, force=force, many=many,
                             progress=lambda done, total: update(done, total=total), refuses=_refuses)
    for r in results:
        run.add(r.as_dict())
        if r.error and not out.json_mode:
            out.error(r.error["message"])
    summary = {"files": len(results), "copied": sum(r.status == COPIED for r in results),
               "refused": sum(r.status == REFUSED for r in results),
               "failed": sum(r.status == FAILED for r in results), "skipped": len(expansion.skipped),
               "bytes": sum(r.size or 0 for r in results if r.status == COPIED)}
    if not out.json_mode:
        render(out, results, summary)
    run.finish(summary)


def _refuses(path: str, f) -> str | None:
    """Why cp does not copy ``path`` (open as ``f``): the server refuses it or aborts on it whatever its flags
    (validate's class ``broken``, judged on the structure and the default server's rules); None to copy."""
    from slotctl.validate import Models, ServerSetup, validate_file
    from slotctl.validate.classes import FileClass, classify

    setup = ServerSetup()
    report = validate_file(path, setup, Models(setup), f=f)
    if classify(report, setup).file_class != FileClass.BROKEN:
        return None
    first = next((x for x in report.ordered_findings() if x.severity == "error"), None)
    return ("the server refuses it or aborts on it whatever its flags"
            + (f": {first.layer}: {first.message}" if first is not None else f" ({report.verdict})"))


def render(out: Output, results, summary: dict) -> None:
    t = Table(show_edge=False)
    for col in ("source", "destination", "bytes", "status", "how", "checked"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    for r in results:
        if out.quiet and r.status == "copied":
            continue
        t.add_row(markup_safe(r.source), markup_safe(r.path), human_bytes(r.size),
                  Text(r.status, style=style_of(r.status)), r.method or "-",
                  ("size, md5" if r.checksum == "md5" else "size") if r.status == "copied" else "-")
    if t.row_count:
        out.table(t, keep=("bytes", "status", "how", "checked"))
    out.print(Text(f"total: {summary['copied']} copied ({human_bytes(summary['bytes'])}), {summary['refused']} "
                   f"refused, {summary['failed']} failed", style="bold"))
