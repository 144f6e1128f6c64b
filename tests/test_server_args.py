"""A llama-server command line pasted as it is: b11434's argument table, generated from its own source and
checked against it and against the real server's --help; the flags slotctl uses taken, the others ignored
with one note, an unknown flag refused."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.server.flags import FIELD_ARGS, FLAGS, SERVER_ARGS, server_arg
from tests.llama_server import llama_source_file

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
FILE = str(DATA / "srv-np1.bin")      # written by llama-server b11434 -np 1 with an f16 cache
MODEL = str(DATA / "target.gguf")
runner = CliRunner()


def run(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1", **(env or {})})


def _generator():
    spec = importlib.util.spec_from_file_location("gen_server_args", ROOT / "scripts" / "gen_server_args.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def arg_cpp() -> str:
    return llama_source_file("common/arg.cpp").read_text(encoding="utf-8")


# -- the table -------------------------------------------------------------------------------------------------


def test_generated_table_is_the_one_b11434s_source_gives(arg_cpp):
    gen = _generator()
    assert (ROOT / "slotctl" / "server" / "args_b11434.py").read_text() == gen.render(gen.parse_args_table(arg_cpp)), \
        "slotctl/server/args_b11434.py is stale: run python scripts/gen_server_args.py"


def test_table_reads_each_constructor_of_common_arg(arg_cpp):
    # the facts that decide a paste, read off the source text by hand for a few arguments of each kind
    assert server_arg("-ngl").values == 1 and server_arg("--n-gpu-layers") is server_arg("-ngl")
    assert server_arg("--metrics").values == 0
    assert server_arg("-no-kvu") is server_arg("-kvu") and server_arg("-kvu").values == 0
    assert server_arg("--control-vector-layer-range").values == 2
    assert server_arg("--ctx_size") is server_arg("-c")          # the server reads _ as - in a -- argument
    assert server_arg("-p") is None and server_arg("--prompt") is None   # excluded from the server
    assert server_arg("-np").env == "LLAMA_ARG_N_PARALLEL"
    assert server_arg("--chunks") is None                          # perplexity's, not the server's
    # every spelling of an argument the server takes appears in the source as a string literal
    for spelling in SERVER_ARGS:
        assert f'"{spelling}"' in arg_cpp


def test_the_flags_slotctl_uses_are_the_tables():
    for field, arg in FIELD_ARGS.items():
        assert set(FLAGS[field]) == set(arg.names)
    assert FLAGS["spec_draft_type_k"][0] == "-ctkd"    # the short spelling first


@pytest.mark.server
def test_table_agrees_with_the_real_servers_help(llama_server_bin):
    """Every spelling `llama-server --help` lists is in the table, with as many value hints as values."""
    out = subprocess.run([str(llama_server_bin), "--help"], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    listed: dict[str, int] = {}
    for line in out.stdout.splitlines():
        if not line.startswith("-") or line.startswith("-----"):
            continue
        # common_arg::to_string: "spellings value-hints", padded to column 40, or alone on a longer line
        head = line[:40].strip() if len(line) > 40 and line[37:40] == "   " else line.strip()
        *names, last = re.split(r",\s+", head)
        last_name, *hints = last.split(" ")
        for n in (*names, last_name):
            listed[n] = len(hints)
    assert len(listed) > 250
    assert set(listed) == set(SERVER_ARGS)
    for name, n in listed.items():
        # a switch shows no hint; a value may show a hint of several words ("{none,layer,row}", "[on|off]")
        assert (n == 0) == (SERVER_ARGS[name].values == 0), name


# -- pasted on the command line -------------------------------------------------------------------------------


def test_pasted_server_command_line_is_taken_with_one_note():
    r = run("validate", FILE, "-m", MODEL, "--no-load", "-ngl", "99", "--host", "0.0.0.0", "--port", "8080",
            "--slot-save-path", "/var/slots", "--spec-type", "ngram-simple", "--metrics", "-fa", "-1", "-c", "512")
    assert r.exit_code == 0, r.output
    notes = [line for line in r.stderr.splitlines() if line]
    # --spec-type matters (it decides whether -md builds a draft context) and --slot-save-path is the directory
    # ls and prune read when given none: neither is among the ignored
    assert notes == ["note: llama-server flags ignored (nothing a slot file holds depends on them): -ngl --host "
                     "--port --metrics"]
    assert "restores completely" in r.stdout


def test_a_used_flag_in_a_paste_decides_the_verdict():
    r = run("validate", FILE, "-m", MODEL, "--no-load", "--json", "-ngl", "99", "-ctk", "q8_0")
    assert r.exit_code == 1      # the file holds an f16 cache: a q8_0 server refuses it


def test_unknown_flag_is_still_an_error():
    r = run("validate", FILE, "--no-such-flag")
    assert r.exit_code == 2
    assert r.stderr.startswith("error: No such option: --no-such-flag")
    r = run("validate", FILE, "-p", "hello")      # llama.cpp has -p, but the server does not take it
    assert r.exit_code == 2 and "No such option: -p" in r.stderr


def test_values_are_taken_whatever_they_look_like():
    # -ngl's value begins with a dash; --override-kv's looks like nothing slotctl knows
    r = run("validate", FILE, "-ngl", "-1", "--override-kv", "a=int:1", "--no-load", "-m", MODEL)
    assert r.exit_code == 0, r.output
    r = run("validate", FILE, "-ngl")
    assert r.exit_code == 2 and r.stderr.strip() == "error: -ngl: expected a value (see: slotctl validate --help)"


def test_spellings_the_server_reads_negations_underscores_and_live_only_names():
    r = run("validate", FILE, "-m", MODEL, "--no-load", "--json", "--ctx_size", "1024", "-kvu", "-no-kvu",
            "--server-args", "--api-key secret --timeout 600")
    assert r.exit_code == 0, r.output
    settings = json.loads(r.stdout)["server"]["settings"]
    assert settings["n_ctx"] == 1024 and settings["kv_unified"] is False
    # pasted without --server, the server's own --api-key / --timeout are its flags, not live mode's
    assert "--api-key --timeout" in r.stderr
    r = run("validate", FILE, "--api-key", "secret")     # typed: live mode's, which needs --server
    assert r.exit_code == 2 and "--api-key goes with --server" in r.stderr


def test_server_args_text_and_file(tmp_path):
    script = tmp_path / "llama.sh"
    script.write_text("#!/bin/sh\n# the server\nLLAMA_ARG_N_PARALLEL=2 exec /opt/llama/bin/llama-server \\\n"
                      f"  -m '{MODEL}' -c 4096 \\\n  -ngl 99 --host \"0.0.0.0\"   # on every interface\n")
    r = run("validate", FILE, "--no-load", "--json", "--server-args", f"@{script}")
    assert r.exit_code == 1, r.output   # -np 2 without -kvu: two streams, the file has one
    doc = json.loads(r.stdout)
    assert doc["server"]["model"] == MODEL
    assert doc["server"]["settings"]["n_ctx"] == 4096 and doc["server"]["settings"]["n_parallel"] == 2
    assert "LLAMA_ARG_N_PARALLEL=2 (-np)" in r.stderr and "-ngl --host" in r.stderr
    r = run("validate", FILE, "--no-load", "--server-args", f"llama-server -m {MODEL} -np 2 -kvu --port 1")
    assert r.exit_code == 0, r.output
    r = run("validate", FILE, "--server-args", "-c 64 stray")
    assert r.exit_code == 2 and "--server-args: stray is neither a flag nor the value of one" in r.stderr
    r = run("validate", FILE, "--server-args", "-c 64 --bogus")
    assert r.exit_code == 2 and "--bogus is not a flag llama-server b11434 takes" in r.stderr


def test_environment_as_the_server_reads_it_and_the_command_line_wins():
    r = run("validate", FILE, "-m", MODEL, "--no-load", "--json",
            env={"LLAMA_ARG_CTX_SIZE": "2048", "LLAMA_ARG_NO_KV_UNIFIED": "1", "LLAMA_ARG_N_PARALLEL": "1"})
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["server"]["settings"]["n_ctx"] == 2048
    assert "LLAMA_ARG_CTX_SIZE=2048 (-c)" in r.stderr
    r = run("validate", FILE, "-m", MODEL, "--no-load", "--json", "-c", "1024", env={"LLAMA_ARG_CTX_SIZE": "2048"})
    assert json.loads(r.stdout)["server"]["settings"]["n_ctx"] == 1024 and "LLAMA_ARG_CTX_SIZE" not in r.stderr
    r = run("validate", FILE, env={"LLAMA_ARG_CTX_SIZE": "lots"})
    assert r.exit_code == 2 and "LLAMA_ARG_CTX_SIZE=lots" in r.stderr and "expected a number" in r.stderr


def test_in_server_args_a_flag_means_the_servers_flag(tmp_path):
    """prune --keep N keeps N files; the server's --keep N keeps prompt tokens. Pasted, it is the server's."""
    d = tmp_path / "slots"
    d.mkdir()
    for i in range(3):
        (d / f"s{i}.bin").write_bytes((DATA / "srv-np1.bin").read_bytes())
        os.utime(d / f"s{i}.bin", (1e9 + i, 1e9 + i))     # long idle: not being written
    r = run("prune", str(d), "--max-size", "10G", "--dry-run", "--json", "--server-args", "--keep 1 -c 512")
    assert r.exit_code == 0, r.output
    assert "ignored" in r.stderr and "--keep" in r.stderr      # the server's flag
    assert json.loads(r.stdout)["summary"]["would_delete"] == 0    # under the size budget: nothing to do
    r = run("prune", str(d), "--max-size", "10G", "--dry-run", "--json", "--keep", "1")
    assert json.loads(r.stdout)["summary"]["would_delete"] == 2    # prune's own --keep: the newest stays
