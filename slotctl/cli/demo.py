"""``slotctl demo``: the whole tool on a built-in default, with nothing to download.

Makes the tiny target and draft models (``slotctl.testing``), saves a sample slot file from real
contexts (a prompt, two context checkpoints and the draft model's state), inspects it, validates it,
and restores it next to a slot that was never saved, comparing the two.
"""

from __future__ import annotations

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


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


@handle_errors
def demo(
    directory: Annotated[Path, typer.Option("--dir", help="Where to put the models and the slot file.",
                                            file_okay=False)] = DEFAULT_DIR,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Make tiny models, save a sample slot file (checkpoints and draft state), and inspect it.

    Everything is made here, in a few seconds, from real llama.cpp contexts: no model is downloaded.
    """
    from slotctl.cli.inspect_cmd import render
    from slotctl.describe import describe_file
    from slotctl.findings import file_warnings
    from slotctl.geometry import read_model_info
    from slotctl.runtime.context import STATE_VERSION
    from slotctl.runtime.log import configure_logging
    from slotctl.runtime.settings import ContextSettings
    from slotctl.runtime.slot import ServerContexts, evaluate_prompt, write_slot_file
    from slotctl.runtime.vocab import detokenize
    from slotctl.slotfile import open_slot_file
    from slotctl.testing import SAMPLE_PROMPT, make_models

    out = Output(json_mode=json_out, verbose=verbose)
    configure_logging(verbose)
    directory.mkdir(parents=True, exist_ok=True)
    timings = {}
    t = time.perf_counter()
    models = make_models(directory)
    timings["make_models_ms"] = _ms(t)
    settings = ContextSettings(n_ctx=512, n_parallel=1, flash_attn="on")
    slot_path = directory / "sample-slot.bin"
    t = time.perf_counter()
    with out.progress("loading models", 2000) as bar:
        loaded = [0]

        def on_load(done: int, total: int) -> None:
            bar(loaded[0] + done)
            if done == total:
                loaded[0] += total

        sc = ServerContexts.open(models.target, settings, draft_path=models.draft, on_progress=on_load)
    with sc:
        timings["load_ms"] = _ms(t)
        tokens = sc.target_model.tokenize(SAMPLE_PROMPT)
        t = time.perf_counter()
        with out.progress("evaluating the prompt") as bar:
            checkpoints = evaluate_prompt(sc, tokens, 0, checkpoint_at=[32, 64], on_progress=bar)
        timings["evaluate_ms"] = _ms(t)
        t = time.perf_counter()
        written = write_slot_file(slot_path, sc, 0, tokens, version=4, checkpoints=checkpoints, overwrite=True)
        timings["write_ms"] = _ms(t)
    sf = open_slot_file(slot_path, layout=read_model_info(models.target).layout(),
                        draft_layout=read_model_info(models.draft).layout())
    data = describe_file(sf, text=detokenize(models.target, sf.tokens.tokens), runtime_version=STATE_VERSION)
    data["warnings"] = file_warnings(sf, runtime_version=STATE_VERSION)
    if json_out:
        out.json({"models": {"target": str(models.target), "draft": str(models.draft)},
                  "slot_file": written.path, "timings": timings, "inspect": data})
    else:
        out.print(Text(f"tiny models: {models.target} (2 layers), {models.draft} (1 layer)", style="bold"))
        out.print(Text(f"saved {written.path}: {written.size:,} bytes, state version {written.version}, "
                       f"{written.n_tokens} tokens, {len(checkpoints)} checkpoints and the draft state "
                       f"(load {timings['load_ms']:.0f} ms, evaluate {timings['evaluate_ms']:.0f} ms, "
                       f"write {timings['write_ms']:.0f} ms)"))
        out.print(Text(f"\n$ slotctl inspect {written.path} --model {models.target} --draft-model {models.draft}",
                       style="dim"))
        render(out, sf, data)
    if sf.damaged:
        raise typer.Exit(int(ExitStatus.FAILED))


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 1)
