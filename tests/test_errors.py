"""One error table: every failure leaves through slotctl.cli.errors, with the code, exit status and message
docs/exit-codes.md gives it; each row met as a person meets it (real processes for the pipe and Ctrl-C)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.cli.errors import TABLE, NoCommand, failure
from slotctl.errors import ExitStatus, FormatError, UsageError
from slotctl.sample import SLOT_FILE

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
runner = CliRunner()


def _doc_rows() -> list[tuple[str, str]]:
    """docs/exit-codes.md's table of failures: (code cell, exit cell) per row, in order."""
    text = (ROOT / "docs" / "exit-codes.md").read_text()
    section = text.split("## How a run fails", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (?!failure |---)(.+?) \| (.+?) \| (.+?) \|$", section, re.M)
    return [(code, status) for _what, code, status in rows]


def test_the_documented_table_is_the_codes():
    rows = _doc_rows()
    assert len(rows) == len(TABLE), rows
    for (code, status), row in zip(rows, TABLE):
        assert (f"`{row.code}`" in code) if row.code else code in ("its own", "`no_such_file`, `permission_denied`, "
                                                                   "`is_a_directory`, `no_space`, `io_error`"), row
        assert status == (str(int(row.status)) if row.status is not None else "its own (1 or 2)"), row
    doc = (ROOT / "docs" / "exit-codes.md").read_text()
    for status in ExitStatus:
        assert f"| {int(status)} | `{status.name}` |" in doc, status


@pytest.mark.parametrize("error, expected", [
    (FormatError("state header", 8, "magic 0x..."), ("damaged", 1, "state header at 0x8 (8): magic 0x...")),
    (UsageError("no slot files", code="no_slot_files"), ("no_slot_files", 2, "no slot files")),
    (BrokenPipeError(32, "Broken pipe"), ("closed_pipe", 141, "")),
    (FileNotFoundError(2, "No such file or directory", "x.bin"), ("no_such_file", 2, "x.bin: No such file or directory")),
    (KeyboardInterrupt(), ("interrupted", 130, "interrupted")),
    (typer.Abort(), ("aborted", 130, "aborted")),
    (typer.BadParameter("expected a number"), ("usage", 2, "expected a number")),
    (RuntimeError("boom"), ("internal_error", 2, "internal error: RuntimeError: boom (set SLOTCTL_DEBUG=1 for the "
                                                "traceback)")),
])
def test_each_failure_gets_its_row(error, expected):
    f = failure(error)
    assert (f.code, f.status, f.message) == expected


def test_llama_missing_names_the_command_and_what_to_install():
    e = ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp")
    f = failure(e, command="save")
    assert (f.code, f.status) == ("llama_missing", 2)
    assert f.message.startswith("save runs llama.cpp") and "pip install" in f.message
    other = ModuleNotFoundError("No module named 'nope'", name="nope")
    assert failure(other).code == "internal_error"  # a module slotctl needs and lacks is a bug, not a hint


def test_no_command_shows_the_help_and_exits_2():
    f = failure(NoCommand("Usage: slotctl ..."))
    assert (f.code, f.status, f.text) == ("usage", 2, "Usage: slotctl ...")
    r = subprocess.run([sys.executable, "-m", "slotctl"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("Usage: ") and "Exit codes:" in r.stderr


def test_a_bug_inside_a_command_is_one_line_and_a_json_document(monkeypatch):
    import slotctl.cli.inspect_cmd as inspect_cmd

    def boom(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(inspect_cmd, "render", boom)
    r = runner.invoke(app, ["inspect", str(SLOT_FILE)])
    assert r.exit_code == 2
    assert r.stderr.splitlines() == ["error: internal error: ZeroDivisionError: division by zero (set "
                                     "SLOTCTL_DEBUG=1 for the traceback)"]
    monkeypatch.setattr(inspect_cmd, "_inspect_one", boom)
    r = runner.invoke(app, ["inspect", str(SLOT_FILE), "--json"])
    assert r.exit_code == 2
    assert json.loads(r.stdout)["error"]["code"] == "internal_error"
    monkeypatch.setenv("SLOTCTL_DEBUG", "1")
    r = runner.invoke(app, ["inspect", str(SLOT_FILE), "--json"])
    assert isinstance(r.exception, ZeroDivisionError)  # the traceback, as SLOTCTL_DEBUG asks


def _many_files(tmp_path: Path) -> list[str]:
    """Enough slot files (distinct paths) that the output fills a pipe's buffer (64 KiB) many times over."""
    sources = sorted(DATA.glob("*.bin"))
    files = []
    for i in range(150):
        dest = tmp_path / f"slot-{i}.bin"
        try:
            os.link(sources[i % len(sources)], dest)
        except OSError:  # another file system
            shutil.copyfile(sources[i % len(sources)], dest)
        files.append(str(dest))
    return files


@pytest.mark.parametrize("extra", [[], ["--json"], ["--jsonl"]])
def test_a_closed_pipe_exits_quietly(tmp_path, extra):
    """``slotctl inspect F... | head -1``: no "damaged", no traceback, nothing on stderr: 141, as the shell
    reports ``cat`` killed by SIGPIPE (docs/exit-codes.md)."""
    p = subprocess.Popen([sys.executable, "-m", "slotctl", "inspect", *_many_files(tmp_path), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()
    _, err = p.communicate(timeout=120)
    assert first
    assert err == b""
    if extra == ["--json"]:  # one document written at the end, in one call: it may all be in before the close
        assert p.returncode in (0, ExitStatus.CLOSED_PIPE)
    else:
        assert p.returncode == ExitStatus.CLOSED_PIPE == 141, err


def _blocked_reading_stdin(pid: int, timeout: float = 60) -> None:
    """Wait until process ``pid`` sits in read(0, ...) (so that SIGINT reaches slotctl, not its start-up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            fields = Path(f"/proc/{pid}/syscall").read_text().split()
        except OSError:
            fields = []
        if fields[:2] == ["0", "0x0"]:
            return
        time.sleep(0.05)
    raise AssertionError("slotctl never blocked reading its standard input")


@pytest.mark.skipif(not Path("/proc/self/syscall").exists(), reason="needs /proc/PID/syscall")
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_ctrl_c_is_one_line_and_130(extra):
    # the child gets a default SIGINT: a suite run as a background job (nohup ... &) ignores it, and a child
    # inherits an ignored signal (Python then installs no KeyboardInterrupt handler)
    p = subprocess.Popen([sys.executable, "-m", "slotctl", "inspect", "-", *extra], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _blocked_reading_stdin(p.pid)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == ExitStatus.INTERRUPTED == 130
    assert err.splitlines() == ["error: interrupted"]
    if extra:
        assert json.loads(out) == {"error": {"code": "interrupted", "message": "interrupted"}, "exit_code": 130}
    else:
        assert out == ""


def test_exit_statuses_are_written_once():
    """130 and 141 are ExitStatus members, written nowhere else in slotctl."""
    seen = []
    for path in sorted((ROOT / "slotctl").rglob("*.py")):
        if path == ROOT / "slotctl" / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value in (130, 141):
                seen.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not seen, seen
