"""Answers that used to be silent, said in the human output and the JSON: a context llama.cpp rounds, the
fix for a state version the server does not load."""

from __future__ import annotations

import json

import pytest
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


# -- restore: why the request reused what it did -----------------------------------------------------------


def test_restore_says_why_it_reused_and_evaluated_what_it_did():
    base = ("restore", FILE, "-m", MODEL, "-c", "256", "-fa", "on", "-n", "1")
    r = run(*base, "--continue", " and", "--json")
    assert r.exit_code == 0, r.output
    c = json.loads(r.stdout)["continuation"]
    # the case: 104 of the slot's 111 tokens reused. Its text read back and tokenized again with the
    # continuation parts from the slot's tokens after 104 (the generated ".4.4.4." tokenizes otherwise)
    assert c["n_slot_tokens"] == 111 and c["n_reused"] == c["n_common"] == 104
    assert c["n_evaluated"] == c["n_prompt"] - 104 > 0
    assert c["reuse_reason"].startswith("the slot held the request's first 104 tokens (its common prefix with the "
                                        "slot's tokens); it parts from the slot's 111 tokens there: the slot's text "
                                        "and the continuation, tokenized again")
    assert c["reuse_reason"].endswith(f"the {c['n_evaluated']} after them are evaluated")
    r = run(*base, "--continue", " and")
    flat = " ".join(r.stdout.replace("\u2502", " ").split())      # the panel's borders out
    assert "prompt: 114 tokens, 104 reused, 10 evaluated why: the slot held the request's first 104 tokens" in flat


# -- live mode: what the server does without saying --------------------------------------------------------


@pytest.mark.server
def test_save_server_says_it_overwrites_and_a_refused_restore_points_to_validate(llama_server_bin, tiny_models,
                                                                                 tmp_path):
    from conftest import start_server

    slots = tmp_path / "slots"
    slots.mkdir()
    srv = start_server(llama_server_bin, tiny_models.target, tmp_path, "said", args=["-c", "512", "-np", "2",
                                                                                    "-fa", "on"],
                       slot_save_path=slots)
    try:
        srv.completion("hello there, general", slot=1, n_predict=2)
        r = run("save", "--server", srv.url, "--slot", "1", "mine.bin")
        assert r.exit_code == 0, r.output
        flat = " ".join(r.stdout.split())
        assert "an existing one is replaced" in flat and "a local save keeps it unless --force" in flat
        doc = json.loads(run("save", "--server", srv.url, "--slot", "1", "mine.bin", "--json").stdout)
        assert "an existing one is replaced" in doc["note"]
        # a file of another model and -np: the server answers 400; the error says which command tells why
        (slots / "foreign.bin").write_bytes(FILE.read_bytes())
        r = run("restore", "--server", srv.url, "--slot", "0", "foreign.bin")
        assert r.exit_code == 1
        line = r.stderr.strip()
        assert "HTTP 400" in line and line.endswith(
            f"ask why: slotctl validate --server {srv.url} DIR/foreign.bin (DIR: the server's --slot-save-path as "
            "this machine sees it)")
        doc = json.loads(run("restore", "--server", srv.url, "--slot", "0", "foreign.bin", "--json").stdout)
        assert f"slotctl validate --server {srv.url} DIR/foreign.bin" in doc["error"]["message"]
        # and the command it points to does tell why
        r = run("validate", "--server", srv.url, slots / "foreign.bin", "--no-load")
        assert r.exit_code == 1 and "error" in r.stdout
    finally:
        srv.stop()
