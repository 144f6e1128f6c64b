"""Every memory kind against a real llama-server b11434: its files for SWA, recurrent and hybrid models inspect
and validate cleanly, and files slotctl saves for them restore in it and continue like a never-saved slot.

One server per kind (module-scoped), `-c 256 -np 1 -fa on`, the tiny models of ``slotctl.tinymodels``.
b11434 writes no checkpoint appendix and ignores one it finds (docs/kinds.md).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.tinymodels import KINDS, MEMORY_KINDS, SAMPLE_PROMPT, make_kind_model
from conftest import start_server
from llama_server import N_PREDICT, SUFFIX

pytestmark = pytest.mark.server
runner = CliRunner()
FLAGS = ["-c", "256", "-np", "1", "-fa", "on"]
#: kinds whose restored slot keeps only the sliding window: with no checkpoint (b11434 reads none from the
#: file) the server evaluates the whole prompt again on the next request (docs/kinds.md)
SWA_KINDS = {"gemma2", "lfm2-swa"}


def cli(*args):
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert "Traceback" not in res.output
    return res


@pytest.fixture(scope="module", params=KINDS)
def kind_server(request, llama_server_bin, tmp_path_factory):
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"kind-{kind}")
    model = make_kind_model(kind, tmp / f"{kind}.gguf")
    save_dir = tmp / "slots"
    save_dir.mkdir()
    srv = start_server(llama_server_bin, model, tmp, kind, args=FLAGS, slot_save_path=save_dir)
    try:
        yield kind, model, srv, save_dir
    finally:
        srv.stop()


def test_server_file_inspects_and_validates_cleanly(kind_server):
    kind, model, srv, save_dir = kind_server
    answer = srv.completion(SAMPLE_PROMPT, slot=0, n_predict=N_PREDICT)
    saved = srv.save(0, "server.bin")
    path = save_dir / "server.bin"
    for extra in ([], ["-m", model]):
        res = cli("inspect", path, "--json", *extra)
        assert res.exit_code == 0, res.output
        d = json.loads(res.stdout)["files"][0]
        assert d["state_version"] == 4 and d["prompt"]["format"] == "packed"
        assert d["prompt"]["n_tokens"] == saved["n_saved"]
        assert d["target"]["memory"]["kind"] == MEMORY_KINDS[kind]
        assert d["checkpoints"] == [] and d["draft"] is None and not d["damaged"]
    assert saved["n_saved"] == answer["tokens_evaluated"] + N_PREDICT - 1
    res = cli("validate", path, "-m", model, *FLAGS, "--json")
    d = json.loads(res.stdout)
    assert res.exit_code == 0, res.output
    assert d["files"][0]["verdict"] == "restores"
    assert not [f for f in d["files"][0]["findings"] if f["severity"] != "note"]


def test_slotctl_file_restores_and_continues_like_a_never_saved_slot(kind_server):
    kind, model, srv, save_dir = kind_server
    # the reference: the second turn in a slot that never held anything
    status, _ = srv.erase(0)
    assert status == 200
    reference = srv.completion(SAMPLE_PROMPT + SUFFIX, slot=0, n_predict=N_PREDICT, return_tokens=True)
    assert reference["timings"]["cache_n"] == 0
    # slotctl saves the prompt with the server's checkpoints (an SCKP appendix b11434 ignores)
    res = cli("save", "-m", model, *FLAGS, "--prompt", SAMPLE_PROMPT, "-o", save_dir / "slotctl.bin", "--json")
    assert res.exit_code == 0, res.output
    written = json.loads(res.stdout)
    status, ans = srv.restore(0, "slotctl.bin")
    assert status == 200, ans
    assert ans["n_restored"] == written["n_tokens"]
    turn = srv.completion(SAMPLE_PROMPT + SUFFIX, slot=0, n_predict=N_PREDICT, return_tokens=True)
    assert turn["tokens"] == reference["tokens"]
    n_all = len(srv.tokenize(SAMPLE_PROMPT + SUFFIX))
    if kind in SWA_KINDS:
        assert turn["timings"]["prompt_n"] == n_all  # the window alone cannot be extended: all again
    else:
        assert turn["timings"]["prompt_n"] == n_all - written["n_tokens"]  # only the new tokens


def test_prove_predicts_the_servers_own_counts(kind_server):
    """restore --prove's prediction for the file's own prompt is the server's count for every memory kind: a
    plain cache evaluates the last token again, a memory holding only the last position or the window (no
    checkpoint to go back to in b11434) the whole prompt."""
    kind, model, srv, save_dir = kind_server
    srv.completion(SAMPLE_PROMPT, slot=0, n_predict=N_PREDICT)
    n = srv.save(0, "prove.bin")["n_saved"]
    assert srv.erase(0)[0] == 200
    # --prove-anyway: the proof is sent even where it spends the restore (the kinds b11434 keeps no checkpoint
    # of), so that every kind's prediction meets the server's own counts
    res = cli("restore", "--server", srv.url, "--slot", "0", "prove.bin", "--prove", "--prove-anyway",
              "--slot-dir", save_dir, "--json")
    assert res.exit_code == 0, res.output
    p = json.loads(res.stdout)["proof"]
    assert p["verdict"] == "proven" and p["n_prompt"] == n
    assert (p["n_reused"], p["n_evaluated"]) == (p["predicted_reused"], p["predicted_evaluated"]), p
    assert p["n_evaluated"] == (1 if MEMORY_KINDS[kind] == "kv" else n), p
