"""The draft context as llama-server b11434 builds it from its flags (slotctl.server.speculative.draft_context),
against the real server: ``-md`` without ``--spec-type`` loads the draft model and builds no drafter (the
server's ``/slots`` says ``speculative: false``, no token is drafted), so a file's draft state has nowhere to
go; with ``--spec-type`` it drafts. validate says the same of a file holding a draft state."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import DATA, start_server
from slotctl.cli.app import app
from slotctl.model.info import read_model_info
from slotctl.server.speculative import draft_context

pytestmark = pytest.mark.server
runner = CliRunner()
PROMPT = "what is the capital of france? paris is the capital of france. the river of paris is north of the city"
FLAGS = ("-c", "256", "-np", "1", "-fa", "on")


@pytest.mark.parametrize("spec", [(), ("--spec-type", "draft-simple"), ("--spec-type", "ngram-mod"),
                                  ("--spec-type", "none")])
def test_the_servers_draft_context_is_the_rules(llama_server_bin, tmp_path, spec):
    target, draft = DATA / "target.gguf", DATA / "draft.gguf"
    want = draft_context(spec[1] if spec else None, read_model_info(draft), read_model_info(target))
    srv = start_server(llama_server_bin, target, tmp_path, "srv", draft=draft, args=(*FLAGS, *spec),
                       slot_save_path=tmp_path)
    try:
        status, slots = srv.get("/slots")
        assert status == 200
        assert slots[0]["speculative"] is want.built, (spec, want, srv.log_tail())
        answer = srv.completion(PROMPT, slot=0, n_predict=16, temperature=0)
        drafted = answer.get("timings", {}).get("draft_n", 0)
        if not want.built:
            assert drafted == 0, answer["timings"]
        elif spec[1] == "draft-simple":
            assert drafted > 0, answer["timings"]
    finally:
        srv.stop()
    if not want.built:
        assert "--spec-type" in want.why or spec == ("--spec-type", "none")


def test_a_draft_state_is_dropped_by_a_server_given_md_alone(llama_server_bin, tmp_path):
    """A file saved with a draft state, restored by b11434 started with -md alone: the target restores (b11434
    reads no draft appendix; a server that does has no draft context to put it in) and the server drafts
    nothing; validate with the same flags says the draft state is dropped for want of a draft context and
    names --spec-type."""
    target, draft = DATA / "target.gguf", DATA / "draft.gguf"
    path = tmp_path / "with-draft.bin"
    res = runner.invoke(app, ["save", "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple",
                              "-p", PROMPT, "-o", str(path), *FLAGS])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["validate", str(path), "-m", str(target), "-md", str(draft), *FLAGS, "--no-load",
                              "--json"])
    (rep,) = json.loads(res.stdout)["files"]
    assert rep["verdict"] == "restores_with_drops"
    (f,) = [x for x in rep["findings"] if x["code"] == "no_draft_context"]
    assert "--spec-type" in f["message"] and "builds no drafter" in f["message"]
    assert {s["step"]: s["status"] for s in rep["steps"]}["draft"] == "dropped"
    srv = start_server(llama_server_bin, target, tmp_path, "srv", draft=draft, args=FLAGS, slot_save_path=tmp_path)
    try:
        status, answer = srv.restore(0, path.name)
        assert status == 200 and answer["n_restored"] > 0, answer
        assert srv.get("/slots")[1][0]["speculative"] is False
    finally:
        srv.stop()
    # with --spec-type the same file's draft state has a context to go to
    res = runner.invoke(app, ["validate", str(path), "-m", str(target), "-md", str(draft), "--spec-type",
                              "draft-simple", *FLAGS, "--no-load", "--json"])
    (rep,) = json.loads(res.stdout)["files"]
    assert rep["verdict"] == "restores" and {s["step"]: s["status"] for s in rep["steps"]}["draft"] == "restored"
