"""``slotctl convert FILE -o OUT``: rewrite a slot file for a server started with other flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from slotctl.cli.common import check_file, handle_errors, shown, store_deadline
from slotctl.cli.options import ConvertStateVersionOpt, DraftModelOpt, JsonOpt, ModelOpt, StoreTimeoutOpt, flag_option
from slotctl.cli.output import Output, human_bytes, markup_safe
from slotctl.errors import ExitStatus, FormatError, UsageError
from slotctl.server.flags import flag_name

_TYPE_HELP = "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 (iq4_nl read only)"


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)


@handle_errors
def convert(
    file: Annotated[Path, typer.Argument(help="The slot file to convert (left as it is), or a directory or "
                                              "s3:// prefix: each of its slot files.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the converted file (a file "
                                         "or s3://bucket/key); for a directory or prefix, a directory or "
                                         "s3:// prefix (same names).")],
    state_version: ConvertStateVersionOpt = None,
    parallel: Annotated[Optional[int], flag_option("parallel", min=1, max=256,
                                                   help="For a server with this many slots (KV streams).")] = None,
    kv_unified: Annotated[bool, flag_option("kv_unified", help="For a server with one KV stream for all slots.")
                          ] = False,
    cache_type_k: Annotated[Optional[str], flag_option("cache_type_k",
                                                       help=f"K cache type to convert to: {_TYPE_HELP}.")] = None,
    cache_type_v: Annotated[Optional[str], flag_option("cache_type_v", help="V cache type to convert to.")] = None,
    spec_draft_type_k: Annotated[Optional[str], flag_option("spec_draft_type_k",
                                                            help="Draft K cache type to convert to.")] = None,
    spec_draft_type_v: Annotated[Optional[str], flag_option("spec_draft_type_v",
                                                            help="Draft V cache type to convert to.")] = None,
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT if it is an existing regular file (never "
                                        "a device, a FIFO or a socket).")] = False,
    follow_symlinks: Annotated[bool, typer.Option("--follow-symlinks", help="OUT may be a symbolic link: the "
                                                  "file it points to is written (refused otherwise).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would change; write nothing.")] = False,
    timeout: StoreTimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Rewrite a slot file so that a server started with other flags restores it.

    --state-version converts exactly or refuses. -np/-kvu rewrite the KV stream count the loader checks
    (exact). -ctk/-ctv/-ctkd/-ctvd re-encode the cache rows in another type, rotating quantized caches as
    llama.cpp does (lossy: the largest error per layer is reported). Checkpoints and the draft state are
    converted too. -m/-md name the memory layouts and give the head sizes that decide the rotations.
    The input is never changed; OUT is written atomically, and replaces only a regular file this user may
    write (--force), keeping its mode and owner. Details: docs/convert.md.

    A directory or an s3:// prefix converts each of its slot files into -o's directory or prefix (a
    server upgrade that changes the state version: the whole store in one command); s3:// objects are
    downloaded and uploaded (docs/store.md).

    Exit codes: 0 converted; 1 the file is damaged or cannot be converted as asked (the reason in one
    line); 2 usage or I/O error. Of many files, the worst.
    """
    from slotctl import convert as conv

    store_deadline(timeout, [file, output])
    out = Output(json_mode=json_out)
    from slotctl.inputs import is_container

    many = is_container(file)
    if not many:
        check_file(file)
    if parallel is None and not kv_unified and state_version is None and not any(
            (cache_type_k, cache_type_v, spec_draft_type_k, spec_draft_type_v)):
        raise UsageError("nothing to convert: give --state-version, -np/-kvu or a cache type")
    tinfo, dinfo = _info(model), _info(draft_model)
    n_stream = conv.stream_count(parallel, kv_unified)
    req = conv.Request(
        version=state_version,
        target=conv.Target(n_stream, conv.cache_type_id(cache_type_k, flag_name("cache_type_k")),
                           conv.cache_type_id(cache_type_v, flag_name("cache_type_v")), _rule(tinfo)),
        draft=conv.Target(n_stream, conv.cache_type_id(spec_draft_type_k, flag_name("spec_draft_type_k")),
                          conv.cache_type_id(spec_draft_type_v, flag_name("spec_draft_type_v")), _rule(dinfo)))
    layouts = dict(layout=tinfo.layout() if tinfo else None, draft_layout=dinfo.layout() if dinfo else None)
    from slotctl.store import convert as files

    opts = dict(force=force, follow_symlinks=follow_symlinks, dry_run=dry_run,
                bar=lambda: out.progress("converting", bytes_=True))
    if many:   # a directory or a prefix: each slot file into OUT/NAME
        return _convert_many(out, json_out, file, output, req, layouts, **opts)
    files.check_output(output, force=force, follow_symlinks=follow_symlinks, dry_run=dry_run)
    try:
        plan, errors = files.convert_file(file, output, req, layouts, **opts)
    except FormatError as e:
        _fail(out, json_out, file, output, files.failure_code(e), f"{shown(file)}: {e}")
    if json_out:
        out.json(files.file_doc(file, output, plan, errors, dry_run))
        return
    render(out, plan, errors, file, output, dry_run)


def _convert_many(out: Output, json_out: bool, src, dest, req, layouts: dict, **opts) -> None:
    """Every slot file of the directory or prefix ``src`` converted into ``dest``
    (:func:`slotctl.store.convert.convert_files`), each said as it is done; ``{"files": [...], "summary",
    "exit_code"}``."""
    from slotctl.store.convert import convert_files

    def said(doc: dict) -> None:
        if json_out:
            return
        if "error" in doc:
            out.error(doc["error"]["message"])
        else:
            out.print(f"{markup_safe(doc['path'])} -> {markup_safe(doc['output'])}: "
                      f"{'would write' if opts['dry_run'] else 'wrote'} {human_bytes(doc['output_size'])}"
                      f"{'' if doc['changes'] else ' (nothing changes)'}")

    many = convert_files(src, dest, req, layouts, on_file=said, **opts)
    counts, summary = many.counts, many.summary
    if json_out:
        out.json({"files": many.files, "summary": summary, "exit_code": many.exit_code})
    else:
        out.print(f"total: {counts['converted']} converted, {counts['refused']} refused, {counts['failed']} failed; "
                  f"{summary['skipped']} skipped (not slot files)")
    if many.exit_code:
        raise typer.Exit(many.exit_code)


def _fail(out: Output, json_out: bool, file: Path, output: Path, code: str, message: str) -> None:
    if json_out:
        out.json({"path": shown(file), "output": shown(output), "error": {"code": code, "message": message},
                  "exit_code": int(ExitStatus.FAILED)})
    else:
        out.error(message)
    raise typer.Exit(int(ExitStatus.FAILED))


def _info(path: Path | None):
    if path is None:
        return None
    from slotctl.model.info import read_model_info

    check_file(path)
    return read_model_info(path)


def _rule(info):
    if info is None:
        return None
    from slotctl.model.predict import rotation_rule

    return rotation_rule(info)


def render(out: Output, plan, errors, file: Path, output: Path, dry_run: bool) -> None:
    verb = "would write" if dry_run else "wrote"
    out.print(f"{markup_safe(shown(file), keep_newlines=False)} -> {markup_safe(shown(output), keep_newlines=False)}: {verb} {human_bytes(plan.output_size)} "
              f"(was {human_bytes(plan.size)})")
    for c in plan.changes:
        out.print(f"  {markup_safe(c.describe())}")
    if not plan.changes:
        out.print("  nothing changes: the file already has these settings")
    if errors:
        t = Table(show_edge=False, title="re-encoded records (largest error against the source values)")
        for col in ("part", "section", "layer", "tensor", "from", "to"):
            t.add_column(col)
        t.add_column("max |error|", justify="right")
        t.add_column("max |value|", justify="right")
        for e in errors:
            t.add_row(e.part, e.section, str(e.layer), e.tensor, e.old_type, e.new_type, f"{e.max_abs_error:.3g}",
                      f"{e.max_abs_value:.3g}")
        out.print(t)
