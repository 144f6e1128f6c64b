"""``slotctl demo``: the tool at work on a built-in default, with nothing to download.

With llama-cpp-python (``slotctl[llama]``) it makes the tiny models (``slotctl.tinymodels``: a 2-layer target
and a 1-layer draft sharing a vocabulary) and runs the real commands one after the other, showing each
command line: ``save`` a slot file from real target and draft contexts (a prompt, two context checkpoints,
the draft state), ``inspect`` it, ``validate`` it for the server it was saved for (it restores completely)
and for a server started with another draft model (the 2-layer target drafting for itself: the draft
state does not fit that draft context, so the server drops it and restores the rest), and ``restore`` it
with ``--compare`` against a slot that was never saved.

Without llama-cpp-python (the core install) it runs what needs no llama.cpp on the slot file a real
llama-server wrote (``slotctl.sample``): ``inspect`` it, ``validate`` it for the server that wrote it and
for one started with another KV cache type (refused, with the flag to change), and says how to get the
rest.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from slotctl.cli.common import handle_errors
from slotctl.cli.extras import llama_available, llama_hint
from slotctl.cli.options import JsonOpt, VerboseOpt
from slotctl.cli.output import Output
from slotctl.errors import ExitStatus

DEFAULT_DIR = Path("slotctl-demo")
#: server flags shared by every step of the full run: what a server would be started with
SERVER_FLAGS = ["-c", "512", "-np", "1", "-fa", "on", "--spec-type", "draft-simple"]


@dataclass(frozen=True)
class Step:
    name: str
    args: list[str]
    #: what the step shows, printed above its command line
    what: str
    expected_exit_code: int = 0
    #: for validate: the verdict of the (only) file
    expected_verdict: Optional[str] = None


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


@handle_errors
def demo(
    directory: Annotated[Path, typer.Option("--dir", help="Where to put the models and slot files the demo "
                                            "shows.", file_okay=False)] = DEFAULT_DIR,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run slotctl on a built-in sample: inspect and validate it; with llama-cpp-python also save and restore.

    With llama-cpp-python: makes a tiny 2-layer target and 1-layer draft (in a few seconds, nothing
    downloaded), saves a slot file from real contexts with them (the prompt, two context checkpoints,
    the draft state), inspects it, validates it for the server it was saved for (restores completely)
    and for a server started with another draft model (the 2-layer target: the draft state is dropped,
    the rest restores), and restores it with --compare against a slot that was never saved.

    Without it (the core install): inspects and validates the slot file a real llama-server wrote
    (shipped with slotctl), for its own server (restores completely) and for one started with -ctk/-ctv
    q8_0 (refused), and says what to install for save and restore.

    Exit codes: 0 every step behaved as said here; 1 a step did not; 2 usage or I/O error.
    """
    out = Output(json_mode=json_out, verbose=verbose)
    full = llama_available()
    doc: dict = {"mode": "full" if full else "core"}
    if full:
        steps, intro = _full_steps(directory, doc)
    else:
        steps, intro = _core_steps(directory, doc)
    if not json_out:
        out.print(Text(intro, style="bold"))
    results = []
    for step in steps:
        args = [*step.args, "--verbose"] if verbose else step.args
        r = {"step": step.name, "command": _cmdline(args), "what": step.what,
             "expected_exit_code": step.expected_exit_code}
        if json_out:
            code, output = _invoke_json(args)
            r["output"] = output
        else:
            out.print(Text(f"\n# {step.what}\n$ {_cmdline(args)}", style="bold cyan"))
            code, output = _invoke(args), None
            if step.expected_verdict is not None:  # what validate said, to check it against what the demo says
                _, output = _invoke_json(args, quiet=True)
        r["exit_code"] = code
        r["ok"] = code == step.expected_exit_code
        if step.expected_verdict is not None:
            r["expected_verdict"] = step.expected_verdict
            if isinstance(output, dict) and output.get("files"):
                r["verdict"] = output["files"][0].get("verdict")
                r["ok"] = r["ok"] and r["verdict"] == step.expected_verdict
        if not r["ok"] and not json_out:
            said = f", verdict {r.get('verdict')!r}" if step.expected_verdict is not None else ""
            expected = f", verdict {step.expected_verdict!r}" if step.expected_verdict is not None else ""
            out.error(f"{step.name}: exit code {code}{said}; this demo said exit code "
                      f"{step.expected_exit_code}{expected}")
        results.append(r)
    ok = all(r["ok"] for r in results)
    doc["steps"] = results
    doc["ok"] = ok
    if not full:
        doc["next"] = f"save, restore and the draft state need llama-cpp-python: {llama_hint()}"
    doc["exit_code"] = int(ExitStatus.OK if ok else ExitStatus.FAILED)
    if json_out:
        out.json(doc)
    else:
        out.print(Text(f"\n{'every step behaved as said above' if ok else 'a step did not behave as said above'}",
                       style="bold green" if ok else "bold red"))
        if not full:
            out.print(Text(doc["next"] + "; then slotctl demo shows them too.", style="yellow"))
    if not ok:
        raise typer.Exit(int(ExitStatus.FAILED))


def _full_steps(directory: Path, doc: dict) -> tuple[list[Step], str]:
    """save with the 1-layer draft, inspect, validate (own server; another draft model), restore --compare."""
    from slotctl.tinymodels import SAMPLE_PROMPT, make_models

    directory.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    models = make_models(directory)
    make_ms = round((time.perf_counter() - t) * 1000, 1)
    slot = str(directory / "sample-slot.bin")
    tgt, dft = str(models.target), str(models.draft)
    doc.update(models={"target": tgt, "draft": dft}, path=slot, make_models_ms=make_ms)
    steps = [
        Step("save", ["save", "-m", tgt, "-md", dft, *SERVER_FLAGS, "--prompt", SAMPLE_PROMPT,
                      "--checkpoint-at", "32", "--checkpoint-at", "64", "-o", slot, "--force"],
             "save a slot file from real target and draft contexts: the prompt, two checkpoints, the draft state"),
        Step("inspect", ["inspect", slot, "-m", tgt, "-md", dft], "every layer of the file"),
        Step("validate", ["validate", slot, "-m", tgt, "-md", dft, *SERVER_FLAGS],
             "will it restore into the server it was saved for? (it restores completely)",
             expected_verdict="restores"),
        Step("validate-other-draft", ["validate", slot, "-m", tgt, "-md", tgt, *SERVER_FLAGS],
             "and into a server started with another draft model (the 2-layer target)? Its draft context has "
             "another shape: the server drops the draft state and restores the rest",
             expected_exit_code=int(ExitStatus.FAILED), expected_verdict="restores_with_drops"),
        Step("restore", ["restore", slot, "-m", tgt, "-md", dft, *SERVER_FLAGS, "--continue", " And the", "-n", "16",
                         "--compare"],
             "restore it and continue with speculative decoding, beside a slot that was never saved"),
    ]
    return steps, f"tiny models: {tgt} (target, 2 layers) and {dft} (draft, 1 layer), made in {make_ms:.0f} ms"


def _core_steps(directory: Path, doc: dict) -> tuple[list[Step], str]:
    """inspect and validate the sample a real llama-server wrote: no llama.cpp needed."""
    from slotctl import sample

    directory.mkdir(parents=True, exist_ok=True)
    slot, model = (str(_copy(src, directory)) for src in (sample.SLOT_FILE, sample.MODEL))
    flags = list(sample.SERVER_FLAGS)
    doc.update(models={"target": model, "draft": None}, path=slot)
    steps = [
        Step("inspect", ["inspect", slot], "every layer of a slot file llama-server wrote (its tiny model, "
             f"{' '.join(flags)})"),
        Step("validate", ["validate", slot, "-m", model, *flags],
             "will it restore into the server that wrote it? (it restores completely)", expected_verdict="restores"),
        Step("validate-other-cache", ["validate", slot, "-m", model, *flags, "-ctk", "q8_0", "-ctv", "q8_0"],
             "and into a server started with a q8_0 KV cache? (refused: the file holds f16 K and V)",
             expected_exit_code=int(ExitStatus.FAILED), expected_verdict="refused"),
    ]
    return steps, ("llama-cpp-python is not installed: showing what needs no llama.cpp, on the slot file a real "
                   "llama-server wrote")


def _copy(src: Path, directory: Path) -> Path:
    """``src`` copied into ``directory`` (atomically; kept when it already holds the same bytes)."""
    import filecmp

    from slotctl.atomic import atomic_writer

    dst = directory / src.name
    if not (dst.is_file() and filecmp.cmp(src, dst, shallow=False)):
        with open(src, "rb") as f, atomic_writer(dst, overwrite=True) as w:
            w.write(f.read())
    return dst


def _cmdline(args: list[str]) -> str:
    return "slotctl " + " ".join(shlex.quote(a) for a in args)


def _invoke(args: list[str]) -> int:
    from slotctl.cli.app import app

    code = app(args=args, standalone_mode=False, prog_name="slotctl")
    return int(code or 0)


def _invoke_json(args: list[str], *, quiet: bool = False) -> tuple[int, object]:
    """Run a command with --json and return its exit code and its document (stdout captured; with ``quiet``
    stderr too: a second run, to read what the command said)."""
    buf = io.StringIO()
    silence = contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext()
    with contextlib.redirect_stdout(buf), silence:
        code = _invoke([*args, "--json"])
    text = buf.getvalue()
    try:
        return code, json.loads(text)
    except ValueError:
        return code, text
