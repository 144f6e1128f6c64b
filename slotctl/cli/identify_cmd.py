"""``slotctl identify FILE -m A.gguf [-m B.gguf ...]``: which model wrote this slot file?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from slotctl.cli.common import check_file, handle_errors, store_deadline
from slotctl.cli.extras import require_llama
from slotctl.cli.options import JsonOpt, StoreTimeoutOpt, VerboseOpt
from slotctl.cli.output import Output, markup_safe
from slotctl.errors import ExitStatus, UsageError


def register(app: typer.Typer) -> None:
    app.command("identify")(identify)


@handle_errors
def identify(
    file: Annotated[Path, typer.Argument(help="The slot file.")],
    models: Annotated[Optional[list[Path]], typer.Option("--model", "-m", dir_okay=False,
                                                         help="A candidate target model (repeat for more).")] = None,
    draft_models: Annotated[Optional[list[Path]], typer.Option("--draft-model", "-md", dir_okay=False,
                                                               help="A candidate draft model, compared with the "
                                                                    "file's draft state (repeat for more).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", "-n", min=1,
                                        help="Tokens of the prompt each candidate evaluates (all of them for "
                                             "recurrent and sliding-window-only memories).")] = 32,
    min_cosine: Annotated[float, typer.Option("--min-cosine", min=-1.0, max=1.0,
                                              help="The lowest per-layer cosine similarity of a match.")] = 0.99,
    timeout: StoreTimeoutOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Which of the candidate models wrote this slot file (and its draft state)?

    Each candidate evaluates the first tokens of the file's prompt in a real context with the file's cache
    types and flash-attention setting; the K/V rows of those positions are compared with the file's
    (dequantized, rotations undone): per layer the cosine similarity and the largest difference. A
    candidate matches when every layer's cosine is at least --min-cosine; the best match and its margin
    over the next candidate are reported. Details: docs/identify.md.

    Exit codes: 0 a candidate matches (for the target and, with -md, the draft); 1 none does, or the
    file is damaged; 2 usage error.
    """
    store_deadline(timeout, file)
    out = Output(json_mode=json_out, verbose=verbose)
    check_file(file)
    if not models and not draft_models:
        raise UsageError("give candidate models with -m (target) and/or -md (draft)")
    for m in [*(models or []), *(draft_models or [])]:
        check_file(m)
    require_llama("identify")
    from slotctl import identify as ident
    from slotctl.runtime.log import configure_logging

    configure_logging(verbose)
    results = []
    with out.progress("evaluating candidates", total=len(models or []) + len(draft_models or [])) as update:
        for draft, cands in ((False, models or []), (True, draft_models or [])):
            if cands:
                results.append(ident.identify(str(file), [str(c) for c in cands], draft=draft, n_tokens=tokens,
                                              min_cosine=min_cosine))
                update(sum(len(r.candidates) for r in results))
    code = ExitStatus.OK if all(r.best is not None for r in results) else ExitStatus.FAILED
    if json_out:
        out.json({"path": str(file), **{r.what: r.as_dict() for r in results}, "min_cosine": min_cosine,
                  "exit_code": int(code)})
    else:
        for r in results:
            render(out, r)
    if code != ExitStatus.OK:
        raise typer.Exit(int(code))


def render(out: Output, r) -> None:
    t = Table(show_edge=False, title=f"{r.what} state")
    for col in ("candidate", "match", "lowest cosine", "max |diff|", "tokens", "note"):
        t.add_column(col, justify="right" if col in ("lowest cosine", "max |diff|", "tokens") else "left",
                     overflow="fold")
    for c in r.candidates:
        ok = c.matches(r.min_cosine)
        t.add_row(markup_safe(c.path, keep_newlines=False), Text("yes" if ok else "no", style="bold green" if ok else "red"),
                  "-" if c.score is None else f"{c.score:.6f}",
                  "-" if c.max_abs_diff is None else f"{c.max_abs_diff:.3g}", str(c.n_tokens or "-"),
                  markup_safe(c.error or "", keep_newlines=False))
    out.print(t)
    b = r.best
    if b is None:
        out.print(Text(f"{r.what}: no candidate matches (every layer's cosine >= {r.min_cosine})", style="bold red"))
    else:
        margin = "" if r.margin is None else f", margin {r.margin:.6f} over the next candidate"
        out.print(Text(f"{r.what}: written by {b.path} (lowest layer cosine {b.score:.6f}{margin})", style="bold"))
