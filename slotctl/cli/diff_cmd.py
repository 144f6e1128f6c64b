"""``slotctl diff A B``: what differs between two slot files, layer by layer, and by how much."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from slotctl.cli.common import check_file, handle_errors, store_deadline
from slotctl.cli.extras import llama_available, llama_install
from slotctl.cli.options import DraftModelOpt, JsonOpt, ModelOpt, StoreTimeoutOpt, VerboseOpt
from slotctl.cli.output import Output, escape_text
from slotctl.errors import ExitStatus

#: tokens decoded on each side of the first difference (with -m)
CONTEXT_TOKENS = 12


def register(app: typer.Typer) -> None:
    app.command("diff")(diff)


@handle_errors
def diff(
    a: Annotated[Path, typer.Argument(help="The first slot file (A).", dir_okay=False)],
    b: Annotated[Path, typer.Argument(help="The second slot file (B).", dir_okay=False)],
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    json_out: JsonOpt = False,
    timeout: StoreTimeoutOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Compare two slot files: header, tokens, and each memory layer section by section and stream by stream.

    Token words: the counts and the first differing index (with -m, the text around it). Memory (the
    target payload, each checkpoint's blobs, the draft state): cell counts, positions, which cells hold
    different data, and per layer the largest absolute difference of K and V (r and s) after
    dequantizing (gguf-py's block formats) and undoing the rotation of quantized caches, so an f16 and a
    q8_0 file of one prompt compare as numbers. Tensor data is read in bounded chunks. -m / -md name the
    memory layouts (and decode the text). Details: docs/diff.md.

    Exit codes: 0 equal; 1 different, or a file is damaged (what parsed is compared); 2 usage or I/O error.
    """
    from slotctl.diff import diff_files
    from slotctl.slotfile import open_slot_file

    store_deadline(timeout, [a, b])
    out = Output(json_mode=json_out, verbose=verbose)
    check_file(a)
    check_file(b)
    layout = draft_layout = None
    if model is not None:
        from slotctl.model.info import read_model_info

        layout = read_model_info(model).layout()
    if draft_model is not None:
        from slotctl.model.info import read_model_info

        draft_layout = read_model_info(draft_model).layout()
    with open_slot_file(a, layout=layout, draft_layout=draft_layout) as sa, \
            open_slot_file(b, layout=layout, draft_layout=draft_layout) as sb:
        doc = diff_files(sa, sb)
        first = doc["tokens"]["first_difference"] if doc["tokens"] else None
        if model is not None and first is not None and not (sa.tokens.error or sb.tokens.error):
            if llama_available():
                doc["tokens"]["text"] = _text_around(model, sa, sb, first, verbose)
            else:
                out.warn(f"the text is not shown: decoding it needs llama-cpp-python ({llama_install()})")
    status = ExitStatus.OK if doc["equal"] else ExitStatus.FAILED
    doc["exit_code"] = int(status)
    if json_out:
        out.json(doc)
    else:
        render(out, doc)
    if status != ExitStatus.OK:
        raise typer.Exit(int(status))


def _text_around(model: Path, sa, sb, at: int, verbose: bool) -> dict:
    """The decoded text before the first differing token (shared) and after it on each side."""
    from slotctl.runtime.vocab import detokenize

    start = max(0, at - CONTEXT_TOKENS)
    return {"before": detokenize(model, sa.tokens.tokens[start:at], verbose=verbose),
            "a": detokenize(model, sa.tokens.tokens[at:at + CONTEXT_TOKENS], verbose=verbose),
            "b": detokenize(model, sb.tokens.tokens[at:at + CONTEXT_TOKENS], verbose=verbose)}


def render(out: Output, doc: dict) -> None:
    """The differences in words; lines wrap at the output's width (a long path folds, whole)."""
    for side in ("a", "b"):
        s = doc[side]
        out.print(Text.assemble((f"{side.upper()}: ", "bold"), escape_text(s["path"], keep_newlines=False),
                                f"  {s['size']:,} bytes, state version {s['state_version']}"))
    tk = doc["tokens"]
    if tk and tk.get("text"):
        t = tk["text"]
        out.print(Text(f"first differing token: {tk['first_difference']:,}", style="bold"))
        for label, value in (("  before", t["before"]), ("  A", t["a"]), ("  B", t["b"])):
            out.print(Text.assemble((f"{label}: ", "dim"), escape_text(value, keep_newlines=False)))
    if doc["equal"]:
        out.print(Text("equal: every layer holds the same data", style="bold green"))
        return
    for d in doc["differences"]:
        out.print(Text.assemble((d["layer"], "bold"), ": ", escape_text(d["message"], keep_newlines=False)))
    cells = [st for sec in (doc["target"] or {}).get("sections", []) for st in sec["streams"]]
    for st in cells:
        if st["differing_cells"]:
            ranges = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in st["differing_ranges"])
            out.print(Text(f"target stream {st['stream'][0]}: {st['differing_cells']:,} of "
                           f"{min(st['cell_count']):,} cells differ (positions {ranges})", style="dim"))
    out.print(Text(f"different: {len(doc['differences'])} difference(s)", style="bold yellow"))
