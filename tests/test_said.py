"""Answers that used to be silent, said in the human output and the JSON: a context llama.cpp rounds, the
fix for a state version the server does not load."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from slotctl.cli.app import app

from conftest import DATA

runner = CliRunner()
FILE = DATA / "srv-np1.bin"      # llama-server b11434 -c 256 -np 1 -fa on: 111 tokens, an f16 cache
MODEL = DATA / "target.gguf"


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_a_context_llama_cpp_rounds_up_is_said():
    r = run("validate", FILE, "-m", MODEL, "-c", "64", "--no-load")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == ("context: the flags ask for 64 cells, llama.cpp builds 256 (256 per stream: "
                                        "it rounds each up to a multiple of 256); a slot holds 256 tokens")
    doc = json.loads(run("validate", FILE, "-m", MODEL, "-c", "64", "--no-load", "--json").stdout)
    tc = doc["server"]["target_context"]
    assert (tc["n_ctx_requested"], tc["n_ctx"], doc["server"]["n_ctx_slot"]) == (64, 256, 256)
    # -np 2 without -kvu: each stream rounded on its own
    doc = json.loads(run("validate", FILE, "-m", MODEL, "-c", "300", "-np", "2", "--no-load", "--json").stdout)
    tc = doc["server"]["target_context"]
    assert (tc["n_ctx_requested"], tc["n_ctx"], tc["n_ctx_seq"]) == (300, 512, 256)
    r = run("validate", FILE, "-m", MODEL, "-c", "256", "--no-load")
    assert "context:" not in r.stdout       # nothing rounded, nothing said


def test_a_state_version_finding_names_the_fix_and_the_fix_works(tmp_path):
    r = run("validate", FILE, "--state-version", "3", "--json")
    assert r.exit_code == 1
    found = [f for f in json.loads(r.stdout)["files"][0]["findings"] if f["code"] == "version_mismatch"]
    assert len(found) == 1
    fix = "slotctl convert FILE -o OUT --state-version 3"
    assert fix in found[0]["message"]
    out = tmp_path / "v3.bin"
    r = run("convert", FILE, "-o", out, "--state-version", "3")
    assert r.exit_code == 0, r.output
    r = run("validate", out, "-m", MODEL, "--state-version", "3", "--no-load")
    assert r.exit_code == 0 and "restores completely" in r.stdout
