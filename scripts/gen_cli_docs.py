"""Write docs/cli.md, the command reference, from the commands themselves (tests/test_docs.py checks it).

The same rows as ``slotctl COMMAND --help`` (slotctl/cli/help.py), as markdown tables.
Run: ``python scripts/gen_cli_docs.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def render() -> str:
    from typer.main import get_command

    from slotctl.cli.app import COMMANDS, app, load_command
    from slotctl.cli.help import markdown

    group = get_command(app)
    ctx = group.make_context("slotctl", ["--help"], resilient_parsing=True)
    commands = []
    for name in COMMANDS:
        cmd = load_command(name)
        commands.append((name, cmd, cmd.make_context(name, [], parent=ctx, resilient_parsing=True)))
    return markdown(group, ctx, commands)


if __name__ == "__main__":
    DOC.write_text(render())
    sys.stdout.write(f"wrote {DOC}\n")
