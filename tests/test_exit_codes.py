"""One precedence for exit codes in every command (docs/exit-codes.md): a run reports the worst of what it
met, a usage or I/O error (2) first, then a file that is damaged or does not fit (1), then one that cannot
be decided without the model (3). Each command runs over mixed inputs made from a real server's file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slotctl.cli.app import COMMANDS
from slotctl.errors import ExitStatus, worst

DATA = Path(__file__).parent / "data"
MODEL = DATA / "target.gguf"
#: commands that take no slot file to judge: demo runs its own; slots and erase speak to a running server,
#: migrate moves a slot between two, keep watches one (tests/test_live.py, tests/test_fleet.py and
#: tests/test_store.py cover their exit codes)
NO_FILE_INPUTS = {"demo", "slots", "erase", "migrate", "keep", "unit", "serve"}


def slotctl(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "slotctl", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A restoring file (b11434's own), one the server refuses (state version 3: converted exactly from it),
    one undecided without -m (bytes after the payload that are no appendix), an empty .bin (a save that
    died), and a path that does not exist."""
    d = tmp_path_factory.mktemp("mixed")
    ok = d / "ok.bin"
    shutil.copyfile(DATA / "srv-np1.bin", ok)
    v3 = d / "old-v3.bin"
    r = slotctl("convert", ok, "-o", v3, "--state-version", "3", "-m", MODEL)
    assert r.returncode == 0, r.stderr
    tail = d / "garbage-tail.bin"
    tail.write_bytes(ok.read_bytes() + bytes(range(256)) * 2)
    empty = d / "empty.bin"
    empty.write_bytes(b"")
    return {"ok": ok, "refused": v3, "undecided": tail, "empty": empty, "missing": d / "nope.bin"}


def test_worst_is_2_then_1_then_3():
    assert worst([]) == worst([0, 0]) == ExitStatus.OK
    assert worst([0, 3]) == 3 and worst([3, 1]) == 1 and worst([1, 3, 2, 0]) == 2 and worst([3, 3]) == 3


# (command, its arguments with input names in braces, expected exit code)
CASES = [
    ("validate", ["{refused}", "{undecided}"], 1),          # the case: it exited 3
    ("validate", ["{undecided}", "{ok}"], 3),
    ("validate", ["{undecided}", "{refused}", "{missing}"], 2),
    ("validate", ["{undecided}", "{empty}"], 1),
    ("ls", ["{refused}", "{undecided}"], 1),
    ("ls", ["{undecided}", "{ok}"], 3),
    ("ls", ["{ok}", "{missing}", "{undecided}", "{refused}"], 2),
    ("inspect", ["{undecided}", "{ok}"], 1),                # inspect: the memory cannot be located: damaged
    ("inspect", ["{missing}", "{empty}", "{ok}"], 2),
    ("strip-draft", ["--dry-run", "{ok}", "{empty}"], 1),
    ("strip-draft", ["--dry-run", "{empty}", "{missing}", "{ok}"], 2),
    ("diff", ["{ok}", "{empty}"], 1),
    ("diff", ["{missing}", "{empty}"], 2),
    ("convert", ["{empty}", "-o", "{out}", "--state-version", "3"], 1),
    ("convert", ["{missing}", "-o", "{out}", "--state-version", "3"], 2),
    ("identify", ["{empty}", "-m", str(MODEL)], 1),
    ("identify", ["{missing}", "-m", str(MODEL)], 2),
    ("restore", ["{empty}", "-m", str(MODEL)], 1),
    ("restore", ["{missing}", "-m", str(MODEL)], 2),
    ("save", ["-m", "{missing}", "--prompt", "hi", "-o", "{out}"], 2),
    ("cp", ["{empty}", "{ok}", "{outdir}"], 1),
    ("cp", ["{missing}", "{empty}", "{ok}", "{outdir}"], 2),
    ("prune", ["--broken", "--dry-run", "{dir}"], 3),        # the undecided file kept: -m decides it
    ("prune", ["--broken", "--dry-run", "{dir}", "-m", str(MODEL)], 0),
]


def test_every_command_with_file_inputs_is_run_over_mixed_inputs():
    assert set(COMMANDS) - NO_FILE_INPUTS == {c for c, _, _ in CASES}


@pytest.mark.parametrize("command,args,expected", CASES, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_a_run_reports_the_worst(inputs, tmp_path, command, args, expected):
    names = {k: str(v) for k, v in inputs.items()}
    if command == "prune":   # a directory of its own: prune deletes (here --dry-run: it would delete)
        d = tmp_path / "slots"
        d.mkdir()
        for k in ("ok", "refused", "undecided", "empty"):
            shutil.copyfile(inputs[k], d / inputs[k].name)
            os.utime(d / inputs[k].name, (time.time() - 3600,) * 2)
        names["dir"] = str(d)
    for run in ("human", "json"):      # each run writes its outputs afresh (cp, convert, save)
        names["out"] = str(tmp_path / f"out-{run}.bin")
        names["outdir"] = str(tmp_path / f"copies-{run}") + os.sep
        os.makedirs(names["outdir"], exist_ok=True)
        argv = [a.format(**names) for a in args] + (["--json"] if run == "json" else [])
        r = slotctl(command, *argv)
        assert r.returncode == expected, (argv, r.stdout[-2000:], r.stderr[-2000:])
        assert "Traceback" not in r.stderr
        if run == "json":
            assert json.loads(r.stdout)["exit_code"] == expected
