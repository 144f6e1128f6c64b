"""``slotctl convert FILE -o OUT``: rewrite a slot file for a server started with other flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from slotctl.cli.common import check_file, handle_errors, local_input, local_output, shown
from slotctl.cli.options import ConvertStateVersionOpt, DraftModelOpt, JsonOpt, ModelOpt, flag_option
from slotctl.cli.output import Output, human_bytes, markup_safe
from slotctl.atomic import check_destination
from slotctl.sources import is_remote
from slotctl.errors import ExitStatus, FormatError, UsageError, error_entry
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
    opts = dict(force=force, follow_symlinks=follow_symlinks, dry_run=dry_run)
    if many:   # a directory or a prefix: each slot file into OUT/NAME
        return _convert_many(out, json_out, file, output, req, layouts, **opts)
    _check_output(output, force=force, follow_symlinks=follow_symlinks, dry_run=dry_run)
    try:
        plan, errors = _convert_one(out, file, output, req, layouts, **opts)
    except FormatError as e:
        _fail(out, json_out, file, output, "refused" if isinstance(e, conv.ConversionRefused) else "damaged",
              f"{shown(file)}: {e}")
    if json_out:
        out.json(_doc(file, output, plan, errors, dry_run))
        return
    render(out, plan, errors, file, output, dry_run)


def _check_output(output, *, force: bool, follow_symlinks: bool, dry_run: bool) -> None:
    if dry_run:
        return
    if not is_remote(output):   # a device, FIFO, socket or unfollowed symbolic link is refused first
        check_destination(output, overwrite=force, follow_symlinks=follow_symlinks)
    elif not force:   # an object: refused at once when one is there (and at the upload)
        from slotctl.store.s3 import S3_STORE

        if S3_STORE.stat(shown(output)) is not None:
            raise UsageError(f"{shown(output)}: exists (use --force to overwrite)", code="exists")


def _convert_one(out: Output, file, output, req, layouts: dict, *, force: bool, follow_symlinks: bool,
                 dry_run: bool):
    """Plan and (unless ``dry_run``) write one conversion; (plan, re-encoding errors). FormatError when the
    file is damaged or cannot be converted as asked."""
    from slotctl import convert as conv

    remote_out = is_remote(output)
    # s3://: the object downloaded first, OUT uploaded after (convert rewrites every byte: docs/store.md)
    with local_input(file) as real, local_output(output, overwrite=force) as real_out:
        plan = conv.plan_convert(real, req, **layouts)
        errors = []
        if not dry_run:
            with out.progress("converting", bytes_=True) as update:
                errors = conv.write_converted(plan, real_out, overwrite=force and not remote_out,
                                              follow_symlinks=follow_symlinks, progress=update, **layouts)
    return plan, errors


def _doc(file, output, plan, errors, dry_run: bool) -> dict:
    worst = max((e.max_abs_error for e in errors), default=None)
    return {"path": shown(file), "output": shown(output), "size": plan.size, "output_size": plan.output_size,
            "source_state_version": plan.version_in, "state_version": plan.version_out,
            "changes": [c.as_dict() for c in plan.changes], "layers": [e.as_dict() for e in errors],
            "max_abs_error": worst, "dry_run": dry_run, "exit_code": 0}


def _convert_many(out: Output, json_out: bool, src, dest, req, layouts: dict, **opts) -> None:
    """Every slot file of the directory or prefix ``src`` converted into the directory or prefix ``dest``
    (same names); the others still converted when one fails. ``{"files": [...], "summary", "exit_code"}``."""
    from slotctl import convert as conv
    from slotctl.errors import SlotctlError
    from slotctl.inputs import expand_slot_paths

    if not is_remote(dest) and not os.path.isdir(dest):
        raise UsageError(f"-o {dest}: converting a directory or prefix needs an existing directory or an "
                         "s3:// prefix", code="no_such_file")
    expansion = expand_slot_paths([src], follow_symlinks=False)
    files, counts = [], {"converted": 0, "refused": 0, "failed": 0}
    for p in expansion.files:
        name = p.rstrip("/").rpartition("/")[2]
        target = (shown(dest).rstrip("/") + "/" + name) if is_remote(dest) else os.path.join(dest, name)
        try:
            _check_output(target, **opts)
            plan, errors = _convert_one(out, p, target, req, layouts, **opts)
            doc = _doc(p, target, plan, errors, opts["dry_run"])
            counts["converted"] += 1
            if not json_out:
                out.print(f"{markup_safe(shown(p))} -> {markup_safe(target)}: "
                          f"{'would write' if opts['dry_run'] else 'wrote'} {human_bytes(plan.output_size)}"
                          f"{'' if plan.changes else ' (nothing changes)'}")
        except FormatError as e:
            code = "refused" if isinstance(e, conv.ConversionRefused) else "damaged"
            doc = {"path": shown(p), "output": target, "error": {"code": code, "message": f"{shown(p)}: {e}"},
                   "exit_code": int(ExitStatus.FAILED)}
            counts["refused"] += 1
        except (SlotctlError, OSError) as e:
            doc = {"path": shown(p), "output": target, "error": error_entry(e, shown(p)).as_dict(),
                   "exit_code": int(ExitStatus.USAGE)}
            counts["failed"] += 1
        if "error" in doc and not json_out:
            out.error(doc["error"]["message"])
        files.append(doc)
    exit_code = max((d["exit_code"] for d in files), default=0)
    summary = {"files": len(files), **counts, "skipped": len(expansion.skipped)}
    if json_out:
        out.json({"files": files, "summary": summary, "exit_code": exit_code})
    else:
        out.print(f"total: {counts['converted']} converted, {counts['refused']} refused, {counts['failed']} failed; "
                  f"{summary['skipped']} skipped (not slot files)")
    if exit_code:
        raise typer.Exit(exit_code)


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
