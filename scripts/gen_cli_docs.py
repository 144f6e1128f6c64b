"""Write docs/cli.md from the commands' own ``--help`` (tests/test_docs.py checks it is current).

Run: ``python scripts/gen_cli_docs.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def render() -> str:
    import os

    os.environ["COLUMNS"] = "100"
    os.environ["TERMINAL_WIDTH"] = "100"
    os.environ["NO_COLOR"] = "1"
    from typer.testing import CliRunner

    from slotctl.cli.app import app

    runner = CliRunner()
    parts = ["# Command reference", "",
             "Generated from `--help` by `scripts/gen_cli_docs.py`; do not edit by hand.", ""]
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "100", "TERMINAL_WIDTH": "100"})
    parts += ["## slotctl", "", "```", top.stdout.rstrip(), "```", ""]
    for name in sorted(c.name for c in app.registered_commands):
        res = runner.invoke(app, [name, "--help"], env={"COLUMNS": "100", "TERMINAL_WIDTH": "100"})
        parts += [f"## slotctl {name}", "", "```", res.stdout.rstrip(), "```", ""]
    return "\n".join(line.rstrip() for line in "\n".join(parts).splitlines()) + "\n"


if __name__ == "__main__":
    DOC.write_text(render())
    sys.stdout.write(f"wrote {DOC}\n")
