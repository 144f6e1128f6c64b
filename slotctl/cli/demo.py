"""``slotctl demo``: the whole tool on a built-in default, with nothing to download.

Makes the tiny models (``slotctl.testing``), then runs the real commands one after the other, showing
each command line: ``save`` a sample slot file from real contexts (a prompt, two context checkpoints and
the draft state), ``inspect`` it, ``validate`` it for the server it was saved for and for one started with
another draft model, and ``restore`` it with ``--compare`` against a slot that was never saved.

The draft model is the target itself, as llama.cpp's own slot test does, so that drafts are accepted and
the restored slot's draft can be seen to behave like a fresh one; the 1-layer draft shows what happens
when a file meets another draft model.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from slotctl.cli.common import handle_errors
from slotctl.cli.options import JsonOpt, VerboseOpt
from slotctl.cli.output import Output
from slotctl.errors import ExitStatus

DEFAULT_DIR = Path("slotctl-demo")
#: server flags shared by every step: what a server would be started with
SERVER_FLAGS = ["-c", "512", "-np", "1", "-fa", "on"]


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


@handle_errors
def demo(
    directory: Annotated[Path, typer.Option("--dir", help="Where to put the models and the slot file.",
                                            file_okay=False)] = DEFAULT_DIR,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Make tiny models and run save, inspect, validate and restore --compare on a sample slot file.

    Everything is made here, in a few seconds, from real llama.cpp contexts: no model is downloaded.
    Exit code 0 when every step behaved as expected (the file validates for its own server, the other
    draft model is reported as dropping the draft state, the restored slot continues like a fresh one).
    """
    from slotctl.testing import SAMPLE_PROMPT, make_models

    out = Output(json_mode=json_out, verbose=verbose)
    directory.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    models = make_models(directory)
    make_ms = round((time.perf_counter() - t) * 1000, 1)
    slot = str(directory / "sample-slot.bin")
    tgt, dft = str(models.target), str(models.draft)
    steps = [
        ("save", ["save", "-m", tgt, "-md", tgt, *SERVER_FLAGS, "--prompt", SAMPLE_PROMPT,
                  "--checkpoint-at", "32", "--checkpoint-at", "64", "-o", slot, "--force"], 0,
         "save a slot file from real contexts: the prompt, two checkpoints, the draft state"),
        ("inspect", ["inspect", slot, "-m", tgt, "-md", tgt], 0, "every layer of the file"),
        ("validate", ["validate", slot, "-m", tgt, "-md", tgt, *SERVER_FLAGS], 0,
         "will it restore into the server it was saved for?"),
        ("validate-other-draft", ["validate", slot, "-m", tgt, "-md", dft, *SERVER_FLAGS], 1,
         "and into a server started with another (1-layer) draft model?"),
        ("restore", ["restore", slot, "-m", tgt, "-md", tgt, *SERVER_FLAGS, "--continue", " And the", "-n", "16",
                     "--compare"], 0,
         "restore it and continue, beside a slot that was never saved"),
    ]
    if not json_out:
        out.print(Text(f"tiny models: {tgt} (2 layers), {dft} (1 layer), made in {make_ms:.0f} ms", style="bold"))
    results = []
    for name, args, expected, what in steps:
        if verbose:
            args = [*args, "--verbose"]
        if json_out:
            code, doc = _invoke_json(args)
            results.append({"step": name, "command": _cmdline(args), "exit_code": code, "expected_exit_code": expected,
                            "ok": code == expected, "output": doc})
        else:
            out.print(Text(f"\n# {what}\n$ {_cmdline(args)}", style="bold cyan"))
            code = _invoke(args)
            results.append({"step": name, "exit_code": code, "expected_exit_code": expected, "ok": code == expected})
            if code != expected:
                out.error(f"{name}: exit code {code}, expected {expected}")
    ok = all(r["ok"] for r in results)
    if json_out:
        out.json({"models": {"target": tgt, "draft": dft}, "slot_file": slot, "make_models_ms": make_ms,
                  "steps": results, "ok": ok})
    else:
        out.print(Text(f"\n{'every step behaved as expected' if ok else 'a step did not behave as expected'}",
                       style="bold green" if ok else "bold red"))
    if not ok:
        raise typer.Exit(int(ExitStatus.FAILED))


def _cmdline(args: list[str]) -> str:
    return "slotctl " + " ".join(shlex.quote(a) for a in args)


def _invoke(args: list[str]) -> int:
    from slotctl.cli.app import app

    code = app(args=args, standalone_mode=False, prog_name="slotctl")
    return int(code or 0)


def _invoke_json(args: list[str]) -> tuple[int, object]:
    """Run a command with --json and return its exit code and its document (stdout captured)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = _invoke([*args, "--json"])
    text = buf.getvalue()
    try:
        return code, json.loads(text)
    except ValueError:
        return code, text
