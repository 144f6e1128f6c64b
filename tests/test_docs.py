"""The docs do not drift from the code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cli_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (ROOT / "docs" / "cli.md").read_text() == mod.render(), \
        "docs/cli.md is stale: run python scripts/gen_cli_docs.py"


def test_readme_quick_start_matches_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"```sh\n(.+?)\n```", readme)
    assert commands[0] == "pip install . && slotctl demo"
    test_cmd = commands[1]
    assert test_cmd.replace("pip ", "python3 -m pip ").replace("python -m pytest", "python3 -m pytest") in ci
