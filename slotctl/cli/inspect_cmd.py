"""``slotctl inspect PATH...``: every layer of slot files, for people (rich) or scripts (``--json``, ``--jsonl``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slotctl.cli.common import FileRun, NoteCounter, file_error, handle_errors, readable, store_deadline
from slotctl.cli.extras import llama_available, llama_install
from slotctl.cli.layout import Text
from slotctl.cli.options import (DraftModelOpt, JsonlOpt, JsonOpt, ModelOpt, QuietOpt, ServerBuildOpt, StoreTimeoutOpt,
                                 VerboseOpt)
from slotctl.cli.output import Output
from slotctl.describe import describe_file
from slotctl.errors import SlotctlError, UsageError
from slotctl.server.builds import NEWEST as NEWEST_BUILD
from slotctl.server.findings import Finding, file_findings
from slotctl.inputs import expand_slot_paths
from slotctl.slotfile import open_slot_file


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect)


@handle_errors
def inspect(
    files: Annotated[list[Path], typer.Argument(help="Slot files, directories (their slot files: those that begin "
                                                     "with the state magic), or - for standard input.")],
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    json_out: JsonOpt = False,
    jsonl: JsonlOpt = False,
    quiet: QuietOpt = False,
    tokens: Annotated[bool, typer.Option("--tokens", help="Include the token ids.")] = False,
    server_build: ServerBuildOpt = NEWEST_BUILD,
    timeout: StoreTimeoutOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Show every layer of slot files: header, prompt, target memory, checkpoints, draft state.

    Reads metadata only and seeks over tensor bytes. With --model the GGUF names the memory layout and
    the prompt is decoded; with --draft-model the draft blobs are dissected with the draft's layout.
    In a directory, only files that begin with the state magic are slot files; the others are counted
    as skipped.

    Exit codes: 0 parsed; 1 a file is damaged (what parsed is still shown, with the layer and offset
    where it broke) or does not fit --model (saved with another model); 2 usage or I/O error (a file that
    cannot be read; the others are still shown).
    """
    store_deadline(timeout, files)
    from slotctl.server.builds import get as get_build

    try:
        server_build = get_build(server_build).name
    except ValueError as e:
        raise UsageError(f"--server-build: {e}") from None
    out = Output(json_mode=json_out, jsonl=jsonl, quiet=quiet, verbose=verbose)
    target_info = draft_info = None
    if model is not None:
        from slotctl.model.info import read_model_info

        target_info = read_model_info(model)
    if draft_model is not None:
        from slotctl.model.info import read_model_info

        draft_info = read_model_info(draft_model)
    decode = model is not None and llama_available()   # slotctl's runtime: only for the prompt text of -m
    if model is not None and not decode:
        out.warn(f"the prompt text is not shown: decoding it needs llama-cpp-python ({llama_install()})")
    run = FileRun(out, expand_slot_paths(files, follow_symlinks=True), what="inspect")
    notes = NoteCounter()
    for path in run.expansion.files:
        try:
            with readable(path) as real:
                data = _inspect_one(real, path, target_info, draft_info, model if decode else None, tokens=tokens,
                                    verbose=verbose, build=server_build)
        except (SlotctlError, OSError) as e:
            data = file_error(path, e)
        run.add(data)
        if json_out or jsonl:
            continue
        if quiet and data["exit_code"] == 0:
            continue
        if data.get("error"):
            out.error(data["error"]["message"])
            continue
        if len(run.expansion.files) > 1:
            out.show(Text(""))
        render(out, data, notes=notes if len(run.expansion.files) > 1 else None)
    summary = {"files": run.n_files, "parsed": run.count(0), "damaged": run.count(1), "unreadable": run.count(2),
               "skipped": len(run.expansion.skipped)}
    if not (json_out or jsonl):
        notes.render(out)
        if len(run.expansion.files) > 1 or run.expansion.skipped:
            out.show(Text(f"{summary['files']} file(s): {summary['parsed']} parsed, {summary['damaged']} damaged, "
                          f"{summary['unreadable']} unreadable; {summary['skipped']} skipped (not slot files)",
                          style="bold"))
    run.finish(summary)


def render(out: Output, data: dict, **kwargs) -> None:
    """The human view of one file (:func:`slotctl.cli.inspect_view.render`, imported here: rich is loaded
    only where something is drawn, never for ``--json``)."""
    from slotctl.cli.inspect_view import render as view

    view(out, data, **kwargs)


def _inspect_one(real: str, path: str, target_info, draft_info, model, *, tokens: bool, verbose: bool,
                 build: str = NEWEST_BUILD):
    """The file at ``real`` (shown as ``path``) parsed and described (its JSON object), its findings and reuse
    for the llama-server ``build``; with ``model``, the prompt decoded with its vocabulary."""
    another = None
    if target_info is None:
        sf = open_slot_file(real, draft_layout=draft_info.layout() if draft_info else None)
    else:
        sf, another = _with_model(real, target_info, draft_info)
    with sf:
        sf.path = path
        text = None
        if model is not None and another is None and sf.tokens is not None and not sf.tokens.error:
            from slotctl.runtime.vocab import detokenize

            text = detokenize(model, sf.tokens.tokens, verbose=verbose)
        found = file_findings(sf, build)
        if another is not None:
            found.insert(0, another)
        if target_info is not None and another is None and sf.tokens is not None and not sf.tokens.error:
            from slotctl.server.findings import invalid_tokens_finding, media_extents

            bad = invalid_tokens_finding(sf.tokens.tokens, target_info.n_vocab, media_extents(sf),
                                         Path(target_info.path).name)
            if bad is not None:
                found.append(bad)
        reuse = _reuse(sf, target_info, found, build)
        data = describe_file(sf, tokens=tokens, text=text, info=target_info if another is None else None,
                             draft_info=draft_info, findings=found)
        data["reuse"] = reuse
        data["build"] = build
        if any(f.severity == "error" for f in found):   # does not fit the model given: 1, as in validate
            data["exit_code"] = max(data["exit_code"], 1)
        return data


def _with_model(real: str, target_info, draft_info):
    """The file parsed with the model's layout, and the finding that it was saved with another model (None
    when it was not), as validate judges it: memory of another kind (then the layers as the file is), or of
    the model's kind with other layer counts or row widths."""
    from slotctl.model.fit import shape_differences
    from slotctl.slotfile import open_for_layout
    from slotctl.validate.wording import kind_mismatch_words, shape_mismatch_words

    sf, model_parse = open_for_layout(real, target_info.layout(), draft_info.layout() if draft_info else None)
    facts = shape_differences(target_info, sf.target) if model_parse else []
    if sf.target is None:
        return sf, None       # damaged, or no payload: the structure's findings say it
    if not model_parse:
        return sf, Finding("target memory", "error", "memory_kind_mismatch",
                           kind_mismatch_words(sf.target.layout, target_info), sf.target.offset)
    if facts:
        generic = open_slot_file(real)
        if generic.target is not None and generic.target.layout.kind != target_info.layout().kind:
            sf.close()   # memory of another kind that the model's layout also happened to read: as the file is
            return generic, Finding("target memory", "error", "memory_kind_mismatch",
                                    kind_mismatch_words(generic.target.layout, target_info), generic.target.offset)
        generic.close()
        return sf, Finding("target memory", "error", "model_shape_mismatch",
                           shape_mismatch_words(facts, target_info), sf.target.offset)
    return sf, None


def _reuse(sf, target_info, found: list, build: str = NEWEST_BUILD) -> dict | None:
    """The tokens a restored slot keeps for a request extending the saved prompt (with the server's
    defaults: ``--ctx-checkpoints`` 32, no ``--swa-full``), and a note in ``found`` when it is fewer than all."""
    from slotctl.server.reuse import reuse_for

    if sf.damaged and sf.target is None:
        return None
    r = reuse_for(sf, target_info, build=build)   # the server's defaults: --ctx-checkpoints 32, no --swa-full
    if r is None:
        return None
    if r.n_reused < r.n_tokens:
        found.append(Finding("target memory", "note", "partial_reuse",
                             f"a restored slot keeps {r.n_reused:,} of its {r.n_tokens:,} tokens for a request "
                             f"extending the prompt: {r.reason}"))
    elif r.n_reused_b11434 < r.n_tokens:
        found.append(Finding("target memory", "note", "partial_reuse_b11434",
                             f"llama.cpp b11434 keeps {r.n_reused_b11434:,} of {r.n_tokens:,} tokens for a request "
                             f"extending the prompt: {r.reason_b11434}"))
    return r.as_dict()
