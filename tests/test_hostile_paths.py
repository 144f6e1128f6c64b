"""Hostile paths: every command refuses what it must not open, in one escaped line, without hanging.

Each case runs the real CLI in a child process with a time limit: a FIFO that is opened for reading
blocks until a writer comes, so a regression shows as a timeout here, not as a stuck test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from slotctl.cli.output import Output, escape_text
from slotctl.errors import UsageError
from slotctl.inputs import expand_slot_paths
from slotctl.paths import check_readable, open_regular

from conftest import DATA

SLOT = DATA / "srv-np1.bin"
MODEL = DATA / "target.gguf"
#: every read path of every command that needs no llama.cpp; {} is the hostile path
COMMANDS = {
    "inspect": ["inspect", "{}"],
    "inspect -m": ["inspect", str(SLOT), "-m", "{}"],
    "inspect -md": ["inspect", str(SLOT), "-md", "{}"],
    "validate": ["validate", "{}", "--no-load"],
    "validate -m": ["validate", str(SLOT), "-m", "{}", "--no-load"],
    "strip-draft": ["strip-draft", "{}"],
    "strip-draft -m": ["strip-draft", str(SLOT), "-m", "{}", "--dry-run"],
    "validate --mmproj": ["validate", str(SLOT), "-m", str(MODEL), "--mmproj", "{}", "--no-load"],
    "restore": ["restore", "{}", "-m", str(MODEL)],
    "restore -m": ["restore", str(SLOT), "-m", "{}"],
    "save -m": ["save", "-m", "{}", "-p", "hi", "-o", str(Path(tempfile.gettempdir()) / "slotctl-never-written.bin")],
    "save -md": ["save", "-m", str(MODEL), "-md", "{}", "-p", "hi",
                 "-o", str(Path(tempfile.gettempdir()) / "slotctl-never-written.bin")],
    "ls": ["ls", "{}"],
    "diff": ["diff", "{}", str(SLOT)],
}


def run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "slotctl", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _args(cmd: str, path: Path) -> list[str]:
    return [a.replace("{}", str(path)) for a in COMMANDS[cmd]]


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "slot.fifo"
    os.mkfifo(p)
    return p


@pytest.fixture
def loop(tmp_path):
    a, b = tmp_path / "loop-a", tmp_path / "loop-b"
    a.symlink_to(b)
    b.symlink_to(a)
    return a


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_fifo_is_refused_not_waited_on(cmd, fifo):
    res = run(_args(cmd, fifo), timeout=30)   # a hang is a TimeoutExpired: the test fails
    line = _one_error_line(res)
    assert res.returncode == 2
    assert f"{fifo}: a FIFO, not a regular file" in line


#: the shared check is one function: devices and loops through one path of each kind of command
SOME = ["inspect", "inspect -m", "validate", "strip-draft", "restore -m", "save -md"]


@pytest.mark.parametrize("cmd", SOME)
def test_character_device_is_refused(cmd):
    res = run(_args(cmd, Path("/dev/zero")), timeout=30)
    assert res.returncode == 2
    assert "/dev/zero: a character device, not a regular file" in _one_error_line(res)


@pytest.mark.parametrize("cmd", SOME)
def test_symlink_loop_is_named(cmd, loop):
    res = run(_args(cmd, loop), timeout=30)
    assert res.returncode == 2
    assert f"{loop}: too many levels of symbolic links" in _one_error_line(res)


def test_hostile_path_stays_one_escaped_line(tmp_path):
    """A path holding ESC sequences and a newline is shown escaped, on the one error line."""
    bad = str(tmp_path / "x\033[2J\033[31my\nz.bin")
    for args in (["inspect", bad], ["strip-draft", bad], ["validate", bad, "--no-load"]):
        res = run(args)
        line = _one_error_line(res)
        assert res.returncode == 2
        assert "\033" not in res.stderr
        assert "x\\x1b[2J\\x1b[31my\\nz.bin: no such file or directory" in line


def test_output_messages_escape_control_characters(capsys):
    """warn, error and log each print one line; what they quote cannot move the cursor or add a line."""
    out = Output(verbose=True)
    hostile = "a\033]0;title\007b\rc\nd\te\u202ef[bold]g[/]"
    out.warn(hostile)
    out.error(hostile)
    out.log(hostile)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 3
    for ln in lines:
        assert not any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f for c in ln)
        assert "a\\x1b]0;title\\x07b\\x0dc\\nd\\te\\u202ef[bold]g[/]" in ln


def test_escape_text_keeps_printable_text():
    assert escape_text("héllo wörld 日本 [x]") == "héllo wörld 日本 [x]"
    assert escape_text("a\nb") == "a\nb"
    assert escape_text("a\nb", keep_newlines=False) == "a\\nb"


def test_check_readable_and_open_regular(tmp_path, fifo, loop):
    f = tmp_path / "f.bin"
    f.write_bytes(b"abc")
    assert check_readable(f).st_size == 3
    with open_regular(f) as fh:
        assert fh.read() == b"abc"
    for path, msg in ((fifo, "a FIFO, not a regular file"), (loop, "too many levels of symbolic links"),
                      (tmp_path, "is a directory"), (tmp_path / "nope", "no such file or directory"),
                      (Path("/dev/null"), "a character device, not a regular file")):
        with pytest.raises(UsageError, match=msg):
            check_readable(path)
        with pytest.raises(UsageError, match=msg):
            open_regular(path).close()


def test_directory_skips_fifos_and_devices(tmp_path, fifo):
    (tmp_path / "a.bin").write_bytes(SLOT.read_bytes())
    got = expand_slot_paths([tmp_path])
    assert got.files == [str(tmp_path / "a.bin")] and got.skipped == []   # the FIFO is neither read nor counted


#: every command that reads a directory's files, over a directory (``{}``) holding a symbolic link loop
DIRECTORY_COMMANDS = {
    "ls": ["ls", "{}", "--json"],
    "inspect": ["inspect", "{}", "--json"],
    "validate": ["validate", "{}", "--no-load", "--json"],
    "strip-draft": ["strip-draft", "{}", "--dry-run", "--grace", "0", "--json"],
    "cp": ["cp", "{}", "{out}", "--json"],
    "prune": ["prune", "{}", "--keep", "5", "--dry-run", "--json"],
}


@pytest.mark.parametrize("cmd", sorted(DIRECTORY_COMMANDS))
def test_a_symlink_loop_in_a_directory_is_passed_over_as_a_dangling_link(cmd, tmp_path):
    """``ln -s a D/b; ln -s b D/a``: the loop is no file to read, passed over as a FIFO and a dangling link
    are; the slot files beside it get their rows and the run exits 0 (it stopped ls, inspect, validate,
    strip-draft and cp: "D/b: Too many levels of symbolic links", exit 2, no rows)."""
    import json

    d, out = tmp_path / "D", tmp_path / "out"
    d.mkdir()
    out.mkdir()
    for name in ("one.bin", "two.bin"):
        (d / name).write_bytes(SLOT.read_bytes())
    (d / "b").symlink_to("a")
    (d / "a").symlink_to("b")
    (d / "gone.bin").symlink_to("nowhere.bin")
    os.mkfifo(d / "pipe.bin")
    res = run([a.replace("{}", str(d)).replace("{out}", str(out)) for a in DIRECTORY_COMMANDS[cmd]], timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    doc = json.loads(res.stdout)
    paths = sorted(f.get("source") or f["path"] for f in doc["files"])
    assert paths == [str(d / "one.bin"), str(d / "two.bin")], doc["files"]


def test_names_that_are_not_utf8_stay_apart_in_tables(tmp_path):
    """Two names whose bytes are not UTF-8 (0xfe, 0xff) looked identical on a terminal (each one replacement
    character); each byte is shown as \\xNN, in every command's table and message, and the JSON keeps them
    apart too."""
    import json

    d = tmp_path / "D"
    d.mkdir()
    raw = SLOT.read_bytes()
    for name in (b"\xfe.bin", b"\xff.bin", b"\xc3.bin", "é.bin".encode()):
        with open(os.path.join(os.fsencode(d), name), "wb") as f:
            f.write(raw)
    assert escape_text(os.fsdecode(b"a\xffb\xc3")) == "a\\xffb\\xc3" and escape_text("é") == "é"
    for args in (["ls", str(d)], ["validate", str(d), "--no-load"], ["inspect", str(d)],
                 ["strip-draft", str(d), "--dry-run", "--grace", "0"], ["prune", str(d), "--keep", "0", "--dry-run",
                                                                       "--grace", "0"]):
        res = run(args)
        assert res.returncode == 0, res.stderr
        assert "\ufffd" not in res.stdout + res.stderr
        for shown in ("\\xfe.bin", "\\xff.bin", "\\xc3.bin", "é.bin"):
            assert shown in res.stdout, (args, res.stdout)
    res = run(["ls", str(d), "--json"])
    names = sorted(f["name"] for f in json.loads(res.stdout)["files"])
    assert len(set(names)) == 4
