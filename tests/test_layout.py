"""The plain layout of slotctl.cli.layout (a pipe: no rich imported) prints what rich prints, byte for byte.

Every comparison runs the same renderable through :meth:`Output.show` twice on a pipe of a given width
(``COLUMNS``): once as it is (plain lines wherever the plain layout knows the shape) and once with the
plain layout refused (rich draws everything). Where the plain layout answers, the bytes must be rich's;
where it does not, rich draws, so the output is rich's by construction (and the tests check the plain
layout does answer for the shapes inspect draws on a pipe of 80 columns)."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest

from slotctl.cli import layout
from slotctl.cli.layout import Group, Panel, Table, Text
from slotctl.cli.output import Output

DATA = Path(__file__).parent / "data"
WIDTHS = (1, 5, 12, 20, 33, 40, 57, 64, 72, 80, 81, 100, 132, 200)


def _outputs(monkeypatch, width: int, show) -> tuple[str, str, int]:
    """(the output as it is, rich's output, how many renderables were laid out plainly) of ``show(out)``."""
    monkeypatch.setenv("COLUMNS", str(width))
    plain_calls = []
    real = layout.plain_lines

    def counting(node, w):
        got = real(node, w)
        plain_calls.append(got is not None)
        return got

    monkeypatch.setattr(layout, "plain_lines", counting)
    mine = io.StringIO()
    show(Output(stdout=mine))
    monkeypatch.setattr(Output, "plain_width", lambda self: None)    # rich draws everything
    theirs = io.StringIO()
    show(Output(stdout=theirs))
    monkeypatch.undo()
    return mine.getvalue(), theirs.getvalue(), sum(plain_calls)


def _files():
    files = sorted(DATA.glob("*.bin")) + sorted((DATA / "kinds").glob("*.bin")) + sorted(
        (DATA / "adversarial").glob("*.bin"))
    assert len(files) >= 15
    return files


def _models():
    return {p.stem.removeprefix("srv-"): p for p in (DATA / "kinds").glob("*.gguf")}


def _described(path: Path, model: Path | None):
    from slotctl.cli.inspect_cmd import _inspect_one
    from slotctl.model.info import read_model_info

    info = read_model_info(str(model)) if model else None
    draft = read_model_info(str(DATA / "draft.gguf")) if model and "draft" in path.name else None
    return _inspect_one(str(path), str(path), info, draft, None, tokens=False, verbose=False)


def test_inspect_on_a_pipe_is_richs_output_byte_for_byte(monkeypatch):
    """Every slot file of the tests (with and without its model) at 14 widths: inspect's view on a pipe is
    rich's, and at 80 columns no renderable of a readable file is left to rich."""
    from slotctl.cli.inspect_view import render

    models = _models()
    compared = 0
    for path in _files():
        model = DATA / "target.gguf" if path.parent == DATA else models.get(path.stem.removeprefix("srv-"))
        for m in {None, model}:
            try:
                d = _described(path, m)
            except Exception:      # a file this model does not describe: its own tests say how it is refused
                continue
            for width in WIDTHS:
                mine, theirs, plain = _outputs(monkeypatch, width, lambda out: render(out, d))
                assert mine == theirs, (path, m, width)
                compared += 1
                if width == 80 and not d.get("error"):
                    assert plain, (path, m)
    assert compared >= 15 * len(WIDTHS)


def test_sample_at_80_is_all_plain(monkeypatch):
    """The file the start-up benchmark inspects: every renderable laid out plainly (no rich at all)."""
    from slotctl.cli.inspect_view import render
    from slotctl.sample import SLOT_FILE

    d = _described(Path(SLOT_FILE), None)
    calls = []
    real = layout.plain_lines
    monkeypatch.setattr(layout, "plain_lines", lambda node, w: calls.append(real(node, w)) or calls[-1])
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    render(Output(stdout=out), d)
    assert calls and all(c is not None for c in calls)
    assert "╭─ target memory ─" in out.getvalue() and "byte map" in out.getvalue()


def _word(rng: random.Random) -> str:
    n = rng.choice((1, 2, 3, 5, 8, 13, 30, 90))
    alphabet = "abcxyz0123,.-_()/%" + (rng.choice(("[", ":", "é", "漢", "\t", "\x1b")) if rng.random() < 0.02 else "")
    return "".join(rng.choice(alphabet) for _ in range(n))


def _text(rng: random.Random, lines: int = 3) -> str:
    out = []
    for _ in range(rng.randint(1, lines)):
        words = [_word(rng) for _ in range(rng.randint(0, 12))]
        seps = [rng.choice((" ", " ", " ", "  ", "   ")) for _ in words]
        lead = rng.choice(("", "", " ", "  "))
        tail = rng.choice(("", "", " ", "   "))
        out.append(lead + "".join(w + s for w, s in zip(words, seps)).rstrip() + tail)
    return "\n".join(out)


def _table(rng: random.Random, boxed: bool) -> Table:
    ncols = rng.randint(1, 6)
    names = [f"c{i}" + rng.choice(("", "_long_header", " x")) for i in range(ncols)]
    t = Table(names, right=[n for n in names if rng.random() < 0.5], boxed=boxed,
              title=_text(rng, 2) if boxed and rng.random() < 0.7 else None,
              keep=None if rng.random() < 0.3 else [n for n in names if rng.random() < 0.5])
    for _ in range(rng.randint(0, 4)):
        t.add_row(*(_text(rng, 2) if rng.random() < 0.2 else _word(rng) for _ in names))
    return t


def _node(rng: random.Random, depth: int = 0):
    kind = rng.choice(("text", "table", "panel", "group") if depth < 2 else ("text", "bare"))
    if kind == "text":
        return Text(_text(rng), (_word(rng), "bold"), style=rng.choice(("", "dim")))
    if kind in ("table", "bare"):
        return _table(rng, boxed=kind == "table" and depth == 0)
    children = [_node(rng, depth + 1) for _ in range(rng.randint(1, 4))]
    children = [c if not (isinstance(c, Table) and c.boxed) else _table(rng, boxed=False) for c in children]
    if kind == "panel":
        return Panel(rng.choice(("prompt", "target memory", "draft state (SDFT), seq 0, speculative state 1.0 KiB",
                                 _word(rng))), *children)
    return Group(*children)


@pytest.mark.parametrize("seed", range(4))
def test_random_renderables_are_richs_output_byte_for_byte(monkeypatch, seed):
    """Made-up texts (long words, runs of spaces, several lines, leading and trailing spaces; now and then a
    markup bracket, an emoji colon, a wide or control character), tables (multi-line cells, long titles,
    either alignment) and panels nested in groups, at every width of WIDTHS: the same bytes as rich."""
    rng = random.Random(seed)
    plain = 0
    for _ in range(50):
        node = _node(rng)
        for width in WIDTHS:
            mine, theirs, n = _outputs(monkeypatch, width, lambda out: out.show(node))
            assert mine == theirs, (seed, width)
            plain += n
    assert plain > 0.25 * 50 * len(WIDTHS)    # the plain layout did answer (not all left to rich)


def test_what_rich_reads_is_left_to_rich():
    """Markup, emoji codes, wide and control characters, tables wider than the line: None (rich draws)."""
    assert layout.plain_lines(Text("a\tb"), 80) is None
    assert layout.plain_lines(Text("漢字"), 80) is None
    t = Table(["a"])
    t.add_row("[bold]x[/]")
    assert layout.plain_lines(t, 80) is None
    t = Table(["a"])
    t.add_row(":smile:")
    assert layout.plain_lines(t, 80) is None
    t = Table(["x" * 50, "y" * 50])
    assert layout.plain_lines(t, 80) is None
    assert layout.plain_lines(Text("[bold]x"), 80) == ["[bold]x"]     # a Text is taken as it is


@pytest.mark.parametrize("width", ["40", "80", "132"])
def test_inspect_directories_as_a_process_is_richs_output(width):
    """``slotctl inspect`` of the tests' directories (many files: blank lines between them, notes counted at
    the end, the summary, damaged files) as a whole process on a pipe: stdout and stderr are what rich writes
    (``TTY_COMPATIBLE=0``: rich takes stdout for no terminal and the plain layout leaves everything to it)."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "slotctl", "inspect", str(DATA), str(DATA / "kinds"), str(DATA / "adversarial")]
    env = {k: v for k, v in os.environ.items() if k not in ("TTY_COMPATIBLE", "FORCE_COLOR")} | {"COLUMNS": width}
    mine = subprocess.run(cmd, capture_output=True, env=env, timeout=300)
    theirs = subprocess.run(cmd, capture_output=True, env=env | {"TTY_COMPATIBLE": "0"}, timeout=300)
    assert mine.returncode == theirs.returncode == 1      # the adversarial files are damaged
    assert mine.stdout == theirs.stdout
    assert mine.stderr == theirs.stderr
    assert b"file(s):" in mine.stdout and mine.stdout.count(b"byte map") >= 15
