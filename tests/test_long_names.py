"""Names of 231-255 bytes: a server saves whatever name a client sends (up to NAME_MAX, 255 bytes), and
slotctl's private names beside such a file (prune's set-aside name, atomic writes' temporary files,
strip-draft --checkpoints, convert -o) must fit too: ``atomic.private_name`` cuts and hashes. Real files,
real directories, the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import DATA
from slotctl.cli.app import app
from slotctl.atomic import NAME_MAX, private_name
from slotctl.paths import is_temp_file
from slotctl.slotfile import open_slot_file
from appendices import build_file

runner = CliRunner()
SLOT = DATA / "srv-np1.bin"
#: a name of 250 bytes, as a server saves it
LONG = "s" * 246 + ".bin"


def cli(*args):
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert "Traceback" not in res.output, res.output
    return res


def old(path: Path, seconds: float = 3600) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def leftovers(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if is_temp_file(n))


@pytest.mark.parametrize("name", ["a.bin", "s" * 230 + ".bin", LONG, "s" * 251 + ".bin",
                                  "é" * 125 + ".bin", os.fsdecode(b"\xff" * 250 + b".bin")])
def test_private_names_always_fit_and_stay_apart(name):
    for tag in ("prune-4194304", "0123456789ab", "a1b2c3d4"):
        p = private_name(name, tag)
        assert len(os.fsencode(p)) <= NAME_MAX and is_temp_file(p) and p.endswith(f".slotctl-{tag}.tmp")
        if len(os.fsencode(f".{name}.slotctl-{tag}.tmp")) <= NAME_MAX:
            assert p == f".{name}.slotctl-{tag}.tmp"        # short names keep the form listings know
        else:
            other = private_name(name[:-5] + "X.bin", tag)   # the same first bytes, another name
            assert other != p
            os.fsencode(p).decode("utf-8", "surrogateescape")


def test_prune_deletes_a_file_of_a_250_byte_name(tmp_path):
    """It was marked failed on every run ("File name too long": `.NAME.slotctl-prune-PID.tmp` passed 255)."""
    f = tmp_path / LONG
    shutil.copyfile(SLOT, f)
    old(f)
    res = cli("prune", tmp_path, "--keep", "0", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(e["path"], e["action"]) for e in doc["files"]] == [(str(f), "deleted")]
    assert os.listdir(tmp_path) == []


def test_a_killed_prune_of_a_long_name_is_put_back_by_the_next(tmp_path):
    """A prune killed while a long-named file is set aside under its cut private name: the next prune puts it
    back under its whole name (kept in a note beside it), and leaves nothing of its own behind."""
    f = tmp_path / LONG
    shutil.copyfile(SLOT, f)
    old(f)
    code = ("import os, signal, sys\n"
            "from slotctl import prune\n"
            "real = os.rename\n"
            "def rename(a, b):\n"
            "    real(a, b)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "os.rename = rename\n"
            "from slotctl.cli.app import main\n"
            f"sys.argv = ['slotctl', 'prune', {str(tmp_path)!r}, '--keep', '0']\n"
            "main()\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert res.returncode == -9, res.stderr
    left = sorted(os.listdir(tmp_path))
    assert LONG not in left and len(left) == 2 and all(is_temp_file(n) for n in left), left  # aside + note
    res = cli("prune", tmp_path, "--keep", "1", "--json")
    assert res.exit_code == 0, res.output
    assert os.listdir(tmp_path) == [LONG] and f.read_bytes() == SLOT.read_bytes()


def test_strip_draft_checkpoints_beside_and_of_a_250_byte_name(tmp_path):
    b = build_file(tmp_path / LONG)
    res = cli("strip-draft", b.path, "--checkpoints", "--grace", "0", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["files"][0]["status"] == "stripped"
    assert b.path.read_bytes() == b.stripped_ckpt and leftovers(tmp_path) == []


def test_convert_to_a_250_byte_name_and_in_place(tmp_path):
    out = tmp_path / LONG
    res = cli("convert", SLOT, "-o", out, "--state-version", "3")
    assert res.exit_code == 0, res.output
    assert open_slot_file(out).version == 3 and leftovers(tmp_path) == []
    res = cli("convert", out, "-o", out, "--state-version", "4", "--force")
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == SLOT.read_bytes() and leftovers(tmp_path) == []
