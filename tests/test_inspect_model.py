"""``inspect -m`` with another model's GGUF: "saved with another model", and which facts differ, as
``validate`` says it; every stderr line names its file. Real llama-server b11434 files (tests/data)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from slotctl.cli.app import app

from conftest import DATA

runner = CliRunner()
KINDS = DATA / "kinds"
NP1 = DATA / "srv-np1.bin"          # llama, 2 layers, plain KV cache


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1"})


def _findings(*args) -> list[dict]:
    return json.loads(run(*args, "--json").stdout)["files"][0]["findings"]


def test_a_model_of_another_memory_kind_is_named_as_validate_names_it():
    r = run("inspect", NP1, "-m", KINDS / "jamba.gguf")
    assert r.exit_code == 1
    assert r.stderr.splitlines() == [
        f"error: {NP1}: the target memory is a plain KV cache, but jamba.gguf (jamba) keeps a hybrid memory "
        "(attention KV and recurrent state) with state for 2 layers: the file was saved with another model "
        "(give -m the one it was saved with)"]
    assert "layout not determined" not in r.stdout and "found 0" not in r.output
    assert "kind: kv" in r.stdout          # the layers as the file is
    # one judgement: the words and code validate gives for the same file and model
    mine = [f for f in _findings("inspect", NP1, "-m", KINDS / "jamba.gguf") if f["severity"] == "error"]
    theirs = [f for f in _findings("validate", NP1, "-m", KINDS / "jamba.gguf", "--no-load")
              if f["severity"] == "error"]
    assert [(f["code"], f["message"]) for f in mine] == [(f["code"], f["message"]) for f in theirs]


def test_a_model_of_the_same_kind_and_another_shape_says_which_facts_differ():
    r = run("inspect", NP1, "-m", DATA / "draft.gguf")       # 1 layer
    assert r.exit_code == 1
    assert "KV: 2 layers in the file, 1 in the model: the file was saved with another model" in r.stderr
    # a hybrid file read with a plain model's layout leaves bytes over: shown as the file is, not as trailing
    found = _findings("inspect", KINDS / "srv-jamba.bin", "-m", DATA / "target.gguf")
    assert [f["code"] for f in found] == ["memory_kind_mismatch"]
    assert "is a hybrid memory" in found[0]["message"]


def test_the_model_a_file_was_saved_with_fits():
    r = run("inspect", NP1, "-m", DATA / "target.gguf")
    assert r.exit_code == 0 and r.stderr == ""
    r = run("inspect", KINDS / "srv-mamba.bin", "-m", KINDS / "mamba.gguf")
    assert r.exit_code == 0 and "another model" not in r.output


def test_every_stderr_line_names_its_file(tmp_path):
    damaged = tmp_path / "cut.bin"
    damaged.write_bytes(NP1.read_bytes()[:5000])
    missing = tmp_path / "nope.bin"
    r = run("inspect", NP1, damaged, missing, KINDS / "srv-mamba.bin", "-m", DATA / "target.gguf")
    assert r.exit_code == 2
    lines = r.stderr.splitlines()
    assert len(lines) >= 3
    named = (str(NP1), str(damaged), str(missing), str(KINDS / "srv-mamba.bin"))
    for line in lines:
        assert any(f" {p}: " in line for p in named), line
    assert any(str(damaged) in line for line in lines) and any(str(missing) in line for line in lines)
    assert any("srv-mamba.bin: the target memory is a recurrent state" in line for line in lines)
