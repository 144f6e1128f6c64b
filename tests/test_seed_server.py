"""The harness of llama-server b11669 (tests/llama_server.py: Debian's package in a sid chroot, started in a
private mount namespace): the build it reports, the appendices it writes and the log lines it says on restore,
router mode, and nothing left mounted. docs/testing.md, "llama-server b11669"."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from conftest import start_server
from llama_server import SEED_BUILD, Chroot, LlamaServer, _mounts_under, seed_cache_dir

pytestmark = pytest.mark.server
PROMPT = "what is the capital of france? paris is the capital of france. the river of paris is north of the city"
FLAGS = ("-c", "512", "-np", "1", "-fa", "on")


def test_b11669_reports_its_build_and_shares_tmp(llama_server_b11669, tiny_models, tmp_path):
    """/props says the build the tests name it by; a model under /tmp is read and a slot file written there
    is the host's file; the chroot's own mounts never show in the host's namespace."""
    assert llama_server_b11669.build == SEED_BUILD
    srv = start_server(llama_server_b11669, tiny_models.target, tmp_path, "srv", args=FLAGS, slot_save_path=tmp_path)
    try:
        assert srv.build == SEED_BUILD
        status, props = srv.get("/props")
        assert status == 200 and props["build_info"] == "b11669-Debian", props.get("build_info")
        srv.completion(PROMPT, slot=0)
        answer = srv.save(0, "plain.bin")
        assert (tmp_path / "plain.bin").stat().st_size == answer["n_written"] > 0
        assert not _mounts_under(llama_server_b11669.root), "the chroot's mounts leaked into the host's namespace"
    finally:
        srv.stop()
    assert not _mounts_under(llama_server_b11669.root)


def test_b11669_appends_the_draft_state_and_restores_it(llama_server_b11669, tiny_models, tmp_path):
    """With a drafter, a save appends SDFT ("appended the draft state") after the payload and a restore logs
    "restored the draft state": the two lines of the seed's change, from the server itself."""
    srv = start_server(llama_server_b11669, tiny_models.target, tmp_path, "srv", draft=tiny_models.draft,
                       args=(*FLAGS, "--spec-type", "draft-simple"), slot_save_path=tmp_path)
    try:
        srv.completion(PROMPT, slot=0)
        srv.save(0, "with-draft.bin")
        assert re.search(r"appended the draft state \([0-9.]+ MiB\) to '.*with-draft\.bin'", srv.log_text())
        assert b"SDFT" in (tmp_path / "with-draft.bin").read_bytes()
        srv.erase(0)
        status, answer = srv.restore(0, "with-draft.bin")
        assert status == 200 and answer["n_restored"] > 0, answer
        assert re.search(r"restored the draft state \([0-9.]+ MiB\) from '.*with-draft\.bin'", srv.log_text())
    finally:
        srv.stop()


def test_b11669_router_mode(llama_server_b11669, tiny_models, tmp_path):
    """The router (no -m; --models-dir under /tmp) starts the model's own server inside the same chroot at the
    first request naming it, and routes a slot save by the body's model."""
    models, slots = tmp_path / "models", tmp_path / "slots"
    models.mkdir(), slots.mkdir()
    shutil.copy(tiny_models.target, models / "tiny.gguf")
    srv = start_server(llama_server_b11669, None, tmp_path, "router", slot_save_path=slots,
                       args=("--models-dir", models, "--models-max", "1", "-c", "256", "-np", "1"))
    try:
        status, answer = srv.post("/completion", {"model": "tiny", "prompt": PROMPT, "n_predict": 2, "id_slot": 0})
        assert status == 200, answer
        status, answer = srv.post("/slots/0?action=save", {"filename": "routed.bin", "model": "tiny"})
        assert status == 200 and answer["n_saved"] > 0 and (slots / "routed.bin").is_file(), answer
    finally:
        srv.stop()


def test_a_path_the_chroot_does_not_share_is_refused_before_starting(tmp_path):
    chroot = Chroot(seed_cache_dir() / "root", binds=("/tmp",))
    with pytest.raises(ValueError, match="would not be seen"):
        LlamaServer(chroot, Path("/var/lib/model.gguf"), log_path=tmp_path / "x.log")
