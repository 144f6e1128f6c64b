"""``slotctl inspect FILE``: every layer of a slot file, for people (rich) or scripts (``--json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slotctl.cli.common import (check_file, handle_errors, llama_available, llama_install,
                                runtime_state_version)
from slotctl.cli.options import DraftModelOpt, JsonOpt, ModelOpt, VerboseOpt
from slotctl.cli.inspect_view import render
from slotctl.cli.output import Output
from slotctl.describe import describe_file
from slotctl.errors import ExitStatus
from slotctl.slotfile import open_slot_file
from slotctl.server.findings import file_warnings


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect)


@handle_errors
def inspect(
    file: Annotated[Path, typer.Argument(help="The slot file.", dir_okay=False)],
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    json_out: JsonOpt = False,
    tokens: Annotated[bool, typer.Option("--tokens", help="Include the token ids.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Show every layer of a slot file: header, prompt, target memory, checkpoints, draft state.

    Reads metadata only and seeks over tensor bytes. With --model the GGUF names the memory layout and
    the prompt is decoded; with --draft-model the draft blobs are dissected with the draft's layout.

    Exit codes: 0 parsed; 1 damaged (what parsed is still shown, with the layer and offset where it
    broke); 2 usage or I/O error.
    """
    out = Output(json_mode=json_out, verbose=verbose)
    check_file(file)
    layout = draft_layout = None
    target_info = draft_info = None
    if model is not None:
        from slotctl.model.info import read_model_info

        target_info = read_model_info(model)
        layout = target_info.layout()
    if draft_model is not None:
        from slotctl.model.info import read_model_info

        draft_info = read_model_info(draft_model)
        draft_layout = draft_info.layout()
    sf = open_slot_file(file, layout=layout, draft_layout=draft_layout)
    text = rt = None
    if model is not None and llama_available():  # slotctl's runtime: only when -m asks for the prompt text
        rt = runtime_state_version()
        if sf.tokens is not None and not sf.tokens.error:
            from slotctl.runtime.vocab import detokenize

            text = detokenize(model, sf.tokens.tokens, verbose=verbose)
    elif model is not None:
        out.warn(f"the prompt text is not shown: decoding it needs llama-cpp-python ({llama_install()})")
    data = describe_file(sf, tokens=tokens, text=text, runtime_version=rt, info=target_info, draft_info=draft_info)
    data["warnings"] = file_warnings(sf, runtime_version=rt)
    if target_info is not None and sf.tokens is not None and not sf.tokens.error:
        from slotctl.server.restore import invalid_token_indices

        toks = sf.tokens.tokens
        bad = toks[invalid_token_indices(toks, target_info.n_vocab, [start for start, _ in sf.tokens.media])]
        if len(bad):
            data["warnings"].append(f"{len(bad):,} token(s) outside this model's vocabulary (first: {int(bad[0])}, "
                                    f"n_vocab {target_info.n_vocab:,}): the server refuses the file "
                                    "(\"Invalid tokens in slot save file\")")
    data["reuse"] = _reuse(sf, target_info, data)
    if json_out:
        out.json(data)
    else:
        render(out, sf, data)
    if sf.damaged:
        raise typer.Exit(int(ExitStatus.FAILED))


def _reuse(sf, target_info, data: dict) -> dict | None:
    """The tokens a restored slot keeps for a request extending the saved prompt (with the server's
    defaults: ``--ctx-checkpoints`` 32, no ``--swa-full``), and a warning when it is fewer than all."""
    from slotctl.server.findings import checkpoints_ignored
    from slotctl.server.flags import DEFAULT_CTX_CHECKPOINTS
    from slotctl.server.reuse import predict_reuse, server_n_swa

    if sf.damaged and sf.target is None:
        return None
    n_swa = server_n_swa(target_info) if target_info is not None else None
    r = predict_reuse(sf, n_swa=n_swa, n_ctx_checkpoints=DEFAULT_CTX_CHECKPOINTS,
                      checkpoints_read=checkpoints_ignored(sf) is None and not sf.damaged)
    if r is None:
        return None
    if r.n_reused < r.n_tokens:
        data["warnings"].append(f"a restored slot keeps {r.n_reused:,} of its {r.n_tokens:,} tokens for a request "
                                f"extending the prompt: {r.reason}")
    elif r.n_reused_b11434 < r.n_tokens:
        data["warnings"].append(f"llama.cpp b11434 keeps {r.n_reused_b11434:,} of {r.n_tokens:,} tokens for a request "
                                f"extending the prompt: {r.reason_b11434}")
    return r.as_dict()
