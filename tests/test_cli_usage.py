"""Usage errors, help and completion, as a person at a terminal meets them."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import COMMANDS, app
from slotctl.sample import MODEL, SLOT_FILE

runner = CliRunner()
#: slotctl as the shell's completion calls it
COMPLETE = [sys.executable, "-c", "from slotctl.cli.app import app; app(prog_name='slotctl')"]


def run(*args: str, columns: int = 80):
    return runner.invoke(app, list(args), env={"COLUMNS": str(columns), "NO_COLOR": "1"})


@pytest.mark.parametrize("args, line", [
    (["validate", "x", "-c", "abc"], "error: -c abc: expected a whole number (see: slotctl validate --help)"),
    (["validate", "x", "--ctx-size=-3"], "error: --ctx-size -3: expected 0 or more (see: slotctl validate --help)"),
    (["validate", "x", "--parallel", "300"], "error: --parallel 300: expected 256 or less "
                                             "(see: slotctl validate --help)"),
    (["validate", "x", "-np", "0"], "error: -np 0: expected 1 or more (see: slotctl validate --help)"),
    (["validate"], "error: missing argument FILES... (see: slotctl validate --help)"),
    (["inspect", "--jsno", "x"], "error: No such option: --jsno (Possible options: --json, --jsonl) "
                                 "(see: slotctl inspect --help)"),
    (["restore", "--json", "true", str(SLOT_FILE)], "error: Got unexpected extra argument(s) "
                                                    f"({SLOT_FILE}) (see: slotctl restore --help)"),
    (["nope"], "error: No such command 'nope' (see: slotctl --help)"),
])
def test_usage_error_is_one_line_naming_the_flag_as_typed(args, line):
    r = run(*args)
    assert r.exit_code == 2
    if "--json" in args:   # a script reading stdout gets the error document (docs/json.md)
        assert json.loads(r.stdout) == {"error": {"code": "usage", "message": line.removeprefix("error: ")},
                                        "exit_code": 2}
    else:
        assert r.stdout == ""
    assert r.stderr.splitlines() == [line]


def test_usage_error_in_a_real_process_is_one_line():
    r = subprocess.run([sys.executable, "-m", "slotctl", "validate", str(SLOT_FILE), "-np", "300"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "60"})
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: -np 300: expected 256 or less")


@pytest.mark.parametrize("columns", [60, 80, 200])
def test_help_never_cuts_an_option_name_and_shows_no_bool_metavar(columns):
    for name in COMMANDS:
        r = run(name, "--help", columns=columns)
        assert r.exit_code == 0, r.output
        assert "<bool>" not in r.stdout and "…" not in r.stdout
        cmd_opts = [o for p in _params(name) for o in (*p.opts, *getattr(p, "secondary_opts", []))]
        words = set(r.stdout.replace(",", " ").split())
        for opt in cmd_opts:
            assert opt in words, f"{name} --help at {columns} columns: {opt} is not shown whole"


def test_help_groups_options_in_panels():
    r = run("inspect", "--help")
    lines = r.stdout.splitlines()
    assert "Model:" in lines and "Output:" in lines
    model = lines[lines.index("Model:") + 1:]
    assert model[0].split()[:2] == ["-m,", "--model"]
    output = lines[lines.index("Output:") + 1:]
    assert output[0].split()[0] == "--json"
    assert output[0].split()[1] == "Print"  # a flag: no metavar between the name and its help


def test_root_help_lists_every_command_under_a_heading():
    r = run("--help")
    assert r.exit_code == 0
    for name, entry in COMMANDS.items():
        assert any(line.split()[:1] == [name] for line in r.stdout.splitlines()), name
    assert "--show-completion" in r.stdout and "--install-completion" in r.stdout


def test_shell_completion_script_and_completions():
    # with shellingham installed typer's --show-completion is a flag that detects the shell from the parent
    # processes: run from bash, as a person would (a test process whose parent has gone, reparented to init,
    # has no shell above it: "Shell  not supported", exit 1); "; exit $?" keeps bash from exec'ing the command
    p = subprocess.run(["bash", "-c", shlex.join(COMPLETE) + " --show-completion; exit $?"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "_SLOTCTL_COMPLETE" in p.stdout.upper(), p.stderr
    env = {**os.environ, "_SLOTCTL_COMPLETE": "complete_bash", "COMP_WORDS": "slotctl validate --spec-draft",
           "COMP_CWORD": "2"}
    p = subprocess.run(COMPLETE, capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0
    assert {"--spec-draft-model", "--spec-draft-type-k", "--spec-draft-type-v"} <= set(p.stdout.split())
    env.update(COMP_WORDS="slotctl ins", COMP_CWORD="1")
    p = subprocess.run(COMPLETE, capture_output=True, text=True, env=env, timeout=60)
    assert p.stdout.split() == ["inspect"]


def test_plain_conversion_checks_what_typer_checks(tmp_path):
    """Paths are still checked (dir_okay=False), lists still collect, flags still take no value."""
    r = run("inspect", str(tmp_path), "--json")
    assert r.exit_code == 2 and r.stderr.startswith("error: ")
    r = run("validate", str(SLOT_FILE), str(SLOT_FILE), "-m", str(MODEL), "-c", "256", "-fa", "on", "--no-load",
            "--json")
    assert r.exit_code == 0, r.output
    assert '"verdict": "restores"' in r.stdout


def _params(name):
    from slotctl.cli.app import load_command

    return [p for p in load_command(name).params if p.param_type_name == "option"]


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version(flag):
    from slotctl import __version__

    r = run(flag)
    assert r.exit_code == 0 and r.stdout == f"slotctl {__version__}\n"


@pytest.mark.parametrize("typed, near", [("insp", "inspect"), ("valdate", "validate"), ("strip", "strip-draft"),
                                         ("restor", "restore"), ("prun", "prune")])
def test_a_mistyped_command_suggests_the_nearest(typed, near):
    r = run(typed, "x")
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [f"error: No such command '{typed}'; did you mean {near}? (see: slotctl --help)"]


def test_top_level_help_lists_every_exit_code_and_one_heading_per_kind():
    r = run("--help", columns=200)
    text = " ".join(r.stdout.split())
    for words in ("0 ok", "1 the file is damaged", "2 usage or I/O error", "3 undecided", "130 interrupted",
                  "141 the reader of the output went away"):
        assert words in text, words
    headings = [line for line in r.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert len(headings) == len(set(headings)), headings
    assert [h for h in headings if h.startswith("Run llama.cpp")] == ["Run llama.cpp (the [llama] extra: "
                                                                      "llama-cpp-python):"]
    llama = r.stdout.split("Run llama.cpp")[1].split("\n\n")[0]
    names = {line.split()[0] for line in llama.splitlines()[1:] if line.startswith("  ") and line[2] != " "}
    assert names == {"identify", "save", "restore"}


def _complete(words: str) -> list[str]:
    """What bash completion offers for the command line ``words`` (the last word being completed)."""
    cword = len(words.split()) - (0 if words.endswith(" ") else 1)
    env = {**os.environ, "_SLOTCTL_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    p = subprocess.run(COMPLETE, capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_completion_offers_the_values_the_server_takes():
    from slotctl.format.ggml import CACHE_TYPE_NAMES

    assert _complete("slotctl validate x -fa ") == ["on", "off", "auto"]
    assert _complete("slotctl validate x --flash-attn a") == ["auto"]
    for flag in ("-ctk", "-ctv", "-ctkd", "-ctvd", "--cache-type-k-draft"):
        assert _complete(f"slotctl validate x {flag} ") == list(CACHE_TYPE_NAMES), flag
    assert _complete("slotctl save -ctk q8") == ["q8_0"]
    assert _complete("slotctl restore -ctvd bf") == ["bf16"]


def test_plain_paths_are_checked_as_typer_checks_them(tmp_path):
    r = run("inspect", str(SLOT_FILE), "-m", str(tmp_path))
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [f"error: -m {tmp_path}: file '{tmp_path}' is a directory "
                                     "(see: slotctl inspect --help)"]
    r = run("prune", str(SLOT_FILE), "--dry-run")
    assert r.exit_code == 2 and f"dir '{SLOT_FILE}' is a file" in r.stderr
