"""The README's main job: ``slotctl demo`` on the built-in default, with and without llama-cpp-python."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import json_schemas
from slotctl.sample import SLOT_FILE

#: slotctl in a process that cannot import llama_cpp (as after the core install: find_spec finds nothing)
WITHOUT_LLAMA = ("import sys; sys.modules['llama_cpp'] = None; from slotctl.cli.app import app; "
                 "app(prog_name='slotctl')")


def _run(argv: list[str], *, llama: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "slotctl", *argv] if llama else [sys.executable, "-c", WITHOUT_LLAMA, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "120"})


def test_demo_runs_every_step_as_it_says(tmp_path):
    r = _run(["demo", "--dir", str(tmp_path), "--json"])
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    d = json.loads(r.stdout)
    assert d["mode"] == "full" and d["ok"] is True and d["exit_code"] == 0
    json_schemas.check("demo", d)
    for s in d["steps"]:   # each step's own document follows its command's schema
        json_schemas.check(s["command"].split()[1], s["output"])
    steps = {s["step"]: s for s in d["steps"]}
    assert [s["step"] for s in d["steps"]] == ["save", "inspect", "validate", "validate-other-draft", "restore"]
    # save uses the real 1-layer draft
    assert steps["save"]["command"].split("-md ")[1].split()[0] == d["models"]["draft"]
    insp = steps["inspect"]["output"]["files"][0]
    assert insp["state_version"] == 4 and len(insp["checkpoints"]) == 2
    assert insp["draft"]["memory"]["sections"][0]["n_layer"] == 1
    assert steps["validate"]["verdict"] == "restores"
    # another draft model (the 2-layer target): the draft state is dropped, the rest restores
    other = steps["validate-other-draft"]
    assert other["verdict"] == "restores_with_drops" and other["exit_code"] == 1
    found = other["output"]["files"][0]["findings"]
    assert any(f["code"] == "layer_count_mismatch" and f["layer"] == "draft" for f in found)
    assert "drops the draft state" in other["what"]
    rest = steps["restore"]["output"]
    assert rest["compare"]["agree"] is True
    assert (tmp_path / "sample-slot.bin").is_file()


def test_demo_narration_matches_what_it_runs(tmp_path):
    """The human run says what each step shows and ends by saying every step behaved so."""
    r = _run(["demo", "--dir", str(tmp_path)])
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # as read, whatever the width it was wrapped at
    save_line = text.split("$ slotctl save ")[1].split(" --prompt ")[0]
    assert save_line.split(" -md ")[1].split()[0].endswith("tiny-draft.gguf")  # the real 1-layer draft
    assert "the server drops the draft state and restores the rest" in text
    assert "restores, with layers dropped" in text  # what validate itself printed
    assert r.stdout.rstrip().endswith("every step behaved as said above")


def test_demo_without_llama_cpp_shows_the_server_written_sample(tmp_path):
    r = _run(["demo", "--dir", str(tmp_path), "--json"], llama=False)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["mode"] == "core" and d["ok"] is True
    json_schemas.check("demo", d)
    assert [(s["step"], s["exit_code"], s.get("verdict")) for s in d["steps"]] == [
        ("inspect", 0, None), ("validate", 0, "restores"), ("validate-other-cache", 1, "refused")]
    assert d["steps"][0]["output"]["files"][0]["prompt"]["n_tokens"] == 111  # what the server saved (n_saved 111)
    assert "pip install 'llama-cpp-python==" in d["next"]
    assert (tmp_path / "server-slot.bin").read_bytes() == SLOT_FILE.read_bytes()  # shown where the user can rerun
    h = _run(["demo", "--dir", str(tmp_path)], llama=False)
    assert h.returncode == 0, h.stderr
    assert "real load not run (llama-cpp-python is not installed: pip install" in h.stdout
    assert "then slotctl demo shows them too" in h.stdout


def test_commands_that_run_llama_cpp_say_what_to_install(tmp_path):
    for argv in (["save", "-m", str(tmp_path / "t.gguf"), "--prompt", "hi", "-o", str(tmp_path / "o.bin")],
                 ["restore", str(tmp_path / "x.bin"), "-m", str(tmp_path / "t.gguf")]):
        r = _run(argv, llama=False)
        assert r.returncode == 2
        assert r.stdout == ""
        (line,) = r.stderr.splitlines()
        assert line.startswith(f"error: {argv[0]} runs llama.cpp, and llama-cpp-python is not installed: "
                               "pip install 'llama-cpp-python==")


def test_live_mode_needs_no_llama_cpp(tmp_path):
    """save --server asks the running server: nothing of llama.cpp here (nothing listens on port 9)."""
    r = _run(["save", "--server", "http://127.0.0.1:9", "--slot", "0", "x.bin", "--timeout", "2"], llama=False)
    assert r.returncode == 2
    assert "llama-cpp-python" not in r.stderr and "127.0.0.1:9" in r.stderr
