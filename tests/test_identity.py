"""A model's identity is its content, and a stored state is checked before it is restored (issue 36).

Against real llama-server processes (b11434; b11669 where a draft state matters) and a real SeaweedFS: the
*twin* of the tiny target (slotctl.tinymodels, another seed: the same architecture, shapes, vocabulary and
``/v1/models`` facts, other weights) never receives the target's stored state, by keep, serve, migrate or
``restore --prove``, and answers as itself (its greedy token ids are those of a twin server that never saw the
target's state); a model file replaced in place is noticed; a stored state with one bit flipped, or spliced from
two states, is never restored. keep and serve run as processes of their own; every answer is the server's own.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import start_server
from keeping import Keep, emptied, serving as slot_server, slotctl, tokens_of
from seaweed import BUCKET
from serving import TURN1, TURN2_EXTRA, serving
from slotctl.errors import ExitStatus
from slotctl.seal import parse_name
from slotctl.tinymodels import SAMPLE_PROMPT, make_model

server = pytest.mark.server
OK, FAILED = int(ExitStatus.OK), int(ExitStatus.FAILED)
ARGS = ["-c", "1024", "-np", "2", "-fa", "on"]
#: the twin's seed (the target's is 1)
TWIN_SEED = 7


@pytest.fixture(scope="module")
def twin_file(tmp_path_factory) -> Path:
    """The twin of the tiny target: 2 layers, the target's shapes and vocabulary, seed 7."""
    return make_model(tmp_path_factory.mktemp("twin") / "tiny-target.gguf", n_layer=2, seed=TWIN_SEED)


@pytest.fixture(scope="module")
def twin(llama_server_bin, twin_file, tmp_path_factory):
    """A server of the twin that never restores anything: the answers the twin gives of itself."""
    with slot_server(llama_server_bin, twin_file, tmp_path_factory.mktemp("twin-server"), "twin", ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def kept_target(llama_server_bin, tiny_models, tmp_path_factory):
    """A server of the tiny target for keep and serve (killed and started again)."""
    with slot_server(llama_server_bin, tiny_models.target, tmp_path_factory.mktemp("target-server"), "target", ARGS) as srv:
        yield srv


def greedy(srv, prompt, slot: int = 0, n: int = 12) -> list[int]:
    """The token ids a server generates greedily for ``prompt`` in ``slot`` (its own ``tokens``)."""
    answer = srv.completion(prompt, slot=slot, n_predict=n, temperature=0, return_tokens=True)
    return answer["tokens"]


def own_model(tmp: Path, source: Path) -> Path:
    """A model file of the test's own (it is replaced in place): a copy of ``source``, stamped an hour ago (a
    file changed moments ago is not kept in the digests' cache)."""
    path = tmp / "model.gguf"
    shutil.copyfile(source, path)
    old = time.time() - 3600
    os.utime(path, (old, old))
    return path


def replace_in_place(path: Path, source: Path) -> None:
    """``path`` replaced by a copy of ``source`` under the same name (a new file renamed over it, as a download
    tool does), stamped with the time it had: the same path, size and mtime, other bytes."""
    st = path.stat()
    tmp = path.with_suffix(".new")
    shutil.copyfile(source, tmp)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)


# -- keep ---------------------------------------------------------------------------------------------------


@server
def test_keep_never_gives_the_twin_replaced_in_place_the_targets_state(llama_server_bin, tiny_models, twin, tmp_path,
                                                                       monkeypatch):
    """The server restarts with its model file replaced in place by the twin (the same path, size, mtime and
    /v1/models facts): keep notices by the content, restores nothing, and the twin answers as itself. Started
    again with the target, keep restores the state it stored."""
    monkeypatch.setenv("SLOTCTL_CACHE_DIR", str(tmp_path / "cache"))
    model = own_model(tmp_path, tiny_models.target)
    (tmp_path / "slots").mkdir()
    srv = start_server(llama_server_bin, model, tmp_path, "kept", args=ARGS, slot_save_path=tmp_path / "slots")
    srv.save_dir = tmp_path / "slots"
    store = tmp_path / "store"
    store.mkdir()
    keep = Keep(srv, store, "--every", "0.3")
    try:
        identified = keep.wait_for("identified")
        target_digest = identified["details"]["model"]
        keep.wait_for("up")
        srv.completion(SAMPLE_PROMPT, slot=0, n_predict=6)
        stored = keep.wait_for("stored", 0)
        name = stored["details"]["name"]
        said = parse_name(name)
        assert said.sealed and said.model == target_digest[:16] and said.draft is None
        n = len(tokens_of(store / name))

        # the same path, size, mtime and facts; other weights
        srv.kill_and_start_again(between=lambda: replace_in_place(model, twin.model))
        again = keep.wait_for("identified")
        assert again["details"]["model"] != target_digest and not again["details"]["cached"]
        skipped = keep.wait_for("skipped", 0)
        assert "no state in the store" in skipped["message"], skipped
        assert not any(e["event"] == "restored" for e in keep.seen)
        _, slots = srv.get("/slots")
        assert not next(s for s in slots if s["id"] == 0).get("n_prompt_tokens")
        # the twin answers as itself: its greedy tokens are those of a twin server that never saw the state
        prompt = SAMPLE_PROMPT + " And the"
        emptied(twin)
        assert greedy(srv, prompt) == greedy(twin, prompt)
        # and its own state is stored under its own content's identity
        own = keep.wait_for("stored", 0)["details"]["name"]
        assert parse_name(own).model == again["details"]["model"][:16]

        # the target again: its own state restored, from the digests' cache (no hashing)
        srv.kill_and_start_again(between=lambda: replace_in_place(model, tiny_models.target))
        back = keep.wait_for("identified")
        assert back["details"]["model"] == target_digest
        restored = keep.wait_for("restored", 0)
        assert restored["details"]["name"] == name and restored["details"]["answer"]["n_restored"] == n
    finally:
        assert keep.stop() == 0
        srv.stop()


#: b11669 with a drafter: it saves and restores the draft model's state (SDFT)
DRAFT_ARGS = ["-c", "1024", "-np", "1", "-fa", "on", "--spec-type", "draft-simple"]
#: b11669's log line of a draft state restored (server-context.cpp load_slot_draft)
DRAFT_RESTORED = r"restored the draft state \([0-9.]+ MiB\) from"


@server
def test_keep_never_gives_a_same_shape_draft_model_the_draft_state(llama_server_b11669, tiny_models, tmp_path,
                                                                    monkeypatch):
    """b11669 saves the draft model's state with the target's (SDFT): keep -md names the draft model's content in
    the stored state's name. A server of the same target whose draft model is a twin of the draft (same shapes,
    other weights: b11669 restores the draft state into it, shown by a restore sent by hand) never gets the state
    from keep; the draft state would be the other draft model's."""
    from slotctl.model.content import model_content

    monkeypatch.setenv("SLOTCTL_CACHE_DIR", str(tmp_path / "cache"))
    draft_twin = make_model(tmp_path / "draft-twin.gguf", n_layer=1, seed=TWIN_SEED + 2)
    store = tmp_path / "store"
    store.mkdir()
    first, second = tmp_path / "slots-a", tmp_path / "slots-b"
    first.mkdir()
    second.mkdir()
    srv = start_server(llama_server_b11669, tiny_models.target, tmp_path, "draft", draft=tiny_models.draft,
                       args=DRAFT_ARGS, slot_save_path=first)
    srv.save_dir = first
    keep = Keep(srv, store, "--every", "0.3", "-md", str(tiny_models.draft))
    try:
        keep.wait_for("up")
        srv.completion(SAMPLE_PROMPT, slot=0, n_predict=6)
        name = keep.wait_for("stored", 0)["details"]["name"]
    finally:
        assert keep.stop() == 0
        srv.stop()
    said = parse_name(name)
    assert said.model == model_content(tiny_models.target).short
    assert said.draft == model_content(tiny_models.draft).short != model_content(draft_twin).short

    srv = start_server(llama_server_b11669, tiny_models.target, tmp_path, "draft-twin", draft=draft_twin,
                       args=DRAFT_ARGS, slot_save_path=second)
    srv.save_dir = second
    try:
        keep = Keep(srv, store, "--every", "0.3", "-md", str(draft_twin))
        try:
            skipped = keep.wait_for("skipped", 0)
            assert "no state in the store" in skipped["message"], skipped
        finally:
            assert keep.stop() == 0
        assert not any(e["event"] == "restored" for e in keep.seen)
        _, slots = srv.get("/slots")
        assert not slots[0].get("n_prompt_tokens")
        # what keep spared it: b11669 takes the state, the draft state included, into the twin draft model
        shutil.copyfile(store / name, second / name)
        status, answer = srv.restore(0, name)
        assert status == 200, answer
        srv.wait_for_log(DRAFT_RESTORED)
    finally:
        srv.stop()


def flip_bit(path: Path) -> int:
    """One bit flipped in the K data of the first KV layer of the slot file at ``path`` (a cell every request
    extending its prompt reuses), in place; the offset flipped."""
    from slotctl.slotfile import open_slot_file

    with open_slot_file(path) as sf:
        stream = next(st for st in sf.target.sections[0].streams if st.cell_count)
        k = stream.data.k[0].data
        at = k.offset + k.size // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x10]))
    return at


def spliced(first: bytes, second: bytes) -> bytes:
    """Two states of one size spliced: the first's first half, the second's rest (every layer parses)."""
    assert len(first) == len(second)
    return first[:len(first) // 2] + second[len(first) // 2:]


@server
def test_keep_never_restores_a_flipped_bit_or_a_splice_and_restores_the_intact_state(kept_target, tmp_path):
    """keep checks each stored state's bytes against the checksum in its name before the server reads them: a
    state with one bit flipped in its K data, or spliced from two states, is skipped (verdict corrupt, nothing
    sent) and the next candidate, intact, is restored."""
    srv = kept_target
    store = tmp_path / "store"
    store.mkdir()
    emptied(srv)
    keep = Keep(srv, store, "--every", "0.3")
    try:
        keep.wait_for("up")
        # two states of slot 0 of one token count (prompts of token ids: the files have one size)
        base = srv.tokenize(SAMPLE_PROMPT)
        other = base[:1] + list(reversed(base[1:]))
        srv.completion(other, slot=0, n_predict=4)
        older = keep.wait_for("stored", 0)["details"]["name"]
        srv.completion(base, slot=0, n_predict=4)
        newer = keep.wait_for("stored", 0)["details"]["name"]
    finally:
        assert keep.stop() == 0
    assert (store / older).stat().st_size == (store / newer).stat().st_size
    old = time.time() - 3600
    os.utime(store / older, (old, old))     # keep restores the newest first: the damaged one is tried first
    intact = (store / newer).read_bytes()
    for damage in ("flip", "splice"):
        if damage == "flip":
            flip_bit(store / newer)
        else:
            (store / newer).write_bytes(spliced(intact, (store / older).read_bytes()))
        # validate reads the content too: not the state stored
        doc = json.loads(slotctl("validate", store / newer, "-m", srv.model, *ARGS, "--json", code=FAILED).stdout)
        assert doc["files"][0]["verdict"] == "corrupt"
        srv.kill_and_start_again()
        keep = Keep(srv, store, "--every", "0.3")
        try:
            skipped = keep.wait_for("skipped", 0)
            assert skipped["details"] == {"name": newer, "verdict": "corrupt", "reason": "checksum"}, skipped
            restored = keep.wait_for("restored", 0)
            assert restored["details"]["name"] == older, restored
            assert keep.wait_for("proof", 0)["details"]["proof"]["verdict"] == "proven"
        finally:
            assert keep.stop() == 0
        assert not _restored_in_log(srv, newer)
        (store / newer).write_bytes(intact)
    assert json.loads(slotctl("validate", store / newer, "-m", srv.model, *ARGS, "--json", code=OK).stdout
                      )["files"][0]["verdict"] == "restores"


def _restored_in_log(srv, name: str) -> bool:
    """Whether the server's log says it restored a file of this name (b11434's slot restore log line names it)."""
    return any(name in line and "restore" in line.lower() for line in srv.log_text().splitlines())


# -- serve --------------------------------------------------------------------------------------------------


@server
def test_serve_never_gives_the_twin_the_targets_state(llama_server_bin, tiny_models, twin, tmp_path, monkeypatch):
    """The issue's case: the server restarts behind the same serve with its model file replaced in place by the
    twin (the same /v1/models facts, the same shapes): serve restores nothing of the target's, and every answer
    is the twin's own; once the twin's own conversation is stored, serve restores that one."""

    cache = tmp_path / "cache"
    model = own_model(tmp_path, tiny_models.target)
    (tmp_path / "slots").mkdir()
    srv = start_server(llama_server_bin, model, tmp_path, "served", args=ARGS, slot_save_path=tmp_path / "slots")
    store = tmp_path / "store"
    store.mkdir()
    try:
        with serving(srv, tmp_path / "slots", str(store), env={"SLOTCTL_CACHE_DIR": str(cache)}) as s:
            served = lambda prompt: greedy_via(s.url, prompt)     # noqa: E731
            first = s.events_named("identified")[0]["details"]["model"]
            served(TURN1)
            s.wait_for("saves", 1)
            (name,) = [p.name for p in store.glob("slot*.bin")]
            assert parse_name(name).model == first[:16]

            srv.kill_and_start_again(between=lambda: replace_in_place(model, twin.model))
            prompt = TURN1 + TURN2_EXTRA
            got = served(prompt)
            emptied(twin)
            assert got == greedy(twin, prompt, n=16)
            c = s.stats()
            assert c["restores"] == 0 and not s.events_named("restored", timeout=0), s.events
            assert s.events_named("identified", 2)[1]["details"]["model"] != first
            # the twin's own conversation, stored and restored for it after another restart
            s.wait_for("saves", 2)
            srv.kill_and_start_again()
            assert served(prompt + " The end.") == greedy(twin, prompt + " The end.", n=16)
            (restored,) = s.events_named("restored")
            assert parse_name(restored["details"]["name"]).model != first[:16]
    finally:
        srv.stop()


def greedy_via(url: str, prompt, n: int = 16) -> list[int]:
    """The token ids a greedy completion of ``prompt`` through serve at ``url`` generates."""
    import urllib.request

    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True}).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["tokens"]


@server
def test_serve_never_restores_a_flipped_bit_of_an_s3_state(kept_target, seaweed, tmp_path):
    """serve with an s3:// store (SeaweedFS): a stored state with one bit flipped in its K data is never sent
    (a ``refused`` event, verdict corrupt, reason checksum); the request goes uncached and its answer is the
    server's own; the state is not offered again."""
    import obstore

    srv = kept_target
    emptied(srv)
    env = {**seaweed.env(), "HOME": str(seaweed.dir), "SLOTCTL_CACHE_DIR": str(tmp_path / "cache")}
    prefix = f"identity-{tmp_path.name}"
    # --restore-policy tokens: the tiny model's prefill is cheaper than an S3 download (the cost policy would not
    # restore, nor look at the state)
    with serving(srv, srv.save_dir, f"s3://{BUCKET}/{prefix}/", "--restore-policy", "tokens", env=env) as s:
        s.events_named("identified")
        greedy_via(s.url, TURN1)
        name = s.events_named("stored")[0]["details"]["name"]
        client = seaweed.client()
        local = tmp_path / name
        local.write_bytes(bytes(obstore.get(client, f"{prefix}/{name}").bytes()))
        flip_bit(local)
        obstore.put(client, f"{prefix}/{name}", local.read_bytes())

        srv.kill_and_start_again()
        prompt = TURN1 + TURN2_EXTRA
        got = greedy_via(s.url, prompt)
        (refused,) = s.events_named("refused")
        assert refused["details"]["name"] == name and refused["details"]["verdict"] == "corrupt"
        assert refused["details"]["reason"] == "checksum", refused
        assert s.stats()["restores"] == 0
        assert not _restored_in_log(srv, name)
        emptied(srv)
        assert got == greedy(srv, prompt, n=16)


# -- migrate, restore --prove, validate, ls -------------------------------------------------------------------


@server
def test_migrate_refuses_the_twin_before_touching_it(kept_target, twin, tmp_path):
    """The twin reports the source's model facts (/v1/models agrees): migrate tells them apart by the model files'
    content, and refuses at the destination step; nothing reaches the twin."""
    emptied(kept_target)
    emptied(twin)
    kept_target.completion(SAMPLE_PROMPT, slot=0, n_predict=4)
    _, before = twin.get("/slots")
    res = slotctl("migrate", "--from", kept_target.url, "--slot", 0, "--to", twin.url, "--from-dir",
                  kept_target.save_dir, "--to-dir", twin.save_dir, "--json", code=FAILED)
    doc = json.loads(res.stdout)
    steps = {s["step"]: s for s in doc["steps"]}
    assert steps["source"]["status"] == "ok" and steps["destination"]["status"] == "refused"
    assert "another model than the source, by their content" in steps["destination"]["message"]
    assert steps["source"]["details"]["model_digest"] != steps["destination"]["details"]["model_digest"]
    assert all(steps[s]["status"] == "skipped" for s in ("save", "place", "restore", "prove"))
    _, after = twin.get("/slots")
    assert [s.get("n_prompt_tokens") for s in after] == [s.get("n_prompt_tokens") for s in before]
    assert list(twin.save_dir.iterdir()) == []


@server
def test_migrate_checks_the_states_checksum_on_its_way(kept_target, llama_server_bin, tiny_models, tmp_path):
    """Between servers of one model: the saved file's checksum is made at the fetch step and the file placed in
    --to-dir (through a store too) is checked against it before the destination restores it."""
    (tmp_path / "slots").mkdir()
    dst = start_server(llama_server_bin, tiny_models.target, tmp_path, "dst", args=ARGS,
                       slot_save_path=tmp_path / "slots")
    dst.save_dir = tmp_path / "slots"
    try:
        kept_target.completion(SAMPLE_PROMPT, slot=0, n_predict=4)
        store = tmp_path / "store"
        store.mkdir()
        doc = json.loads(slotctl("migrate", "--from", kept_target.url, "--slot", 0, "--to", dst.url, "--from-dir",
                                 kept_target.save_dir, "--to-dir", dst.save_dir, "--store", store, "--json",
                                 code=OK).stdout)
        steps = {s["step"]: s for s in doc["steps"]}
        made = steps["fetch"]["details"]["checksum"]
        assert steps["store"]["details"]["checksum"] == made
        assert "checked" in steps["store"]["message"]
        assert doc["proof"]["verdict"] == "proven"
    finally:
        dst.stop()


def stored_by_keep(srv, tmp_path: Path) -> tuple[Path, str]:
    """A state of ``srv``'s slot 0 (SAMPLE_PROMPT) stored by keep in a store of its own: (the store, its name)."""
    store = tmp_path / "store"
    store.mkdir()
    emptied(srv)
    keep = Keep(srv, store, "--every", "0.3")
    try:
        srv.completion(SAMPLE_PROMPT, slot=0, n_predict=4)
        return store, keep.wait_for("stored", 0)["details"]["name"]
    finally:
        assert keep.stop() == 0


@server
def test_restore_prove_never_sends_another_models_or_a_damaged_state(kept_target, twin, tmp_path):
    """``restore --server --slot-dir --prove`` of a stored state (its name records its model and checksum): into
    the twin, refused before anything is sent (exit 1, other_model, --force or not); with a bit flipped, refused
    (checksum_mismatch); intact, into its own model's server, restored and proven."""
    store, name = stored_by_keep(kept_target, tmp_path)
    emptied(twin)
    shutil.copyfile(store / name, twin.save_dir / name)
    for more in ((), ("--force",)):
        res = slotctl("restore", "--server", twin.url, "--slot", 0, name, "--slot-dir", twin.save_dir, "--prove",
                      *more, "--json", code=FAILED)
        err = json.loads(res.stdout)["error"]
        assert err["code"] == "other_model" and "another model" in err["message"], err
    _, slots = twin.get("/slots")
    assert not slots[0].get("n_prompt_tokens")
    assert not _restored_in_log(twin, name)

    own = kept_target.save_dir / name
    shutil.copyfile(store / name, own)
    flip_bit(own)
    res = slotctl("restore", "--server", kept_target.url, "--slot", 0, name, "--slot-dir", kept_target.save_dir,
                  "--prove", "--json", code=FAILED)
    assert json.loads(res.stdout)["error"]["code"] == "checksum_mismatch"
    shutil.copyfile(store / name, own)
    doc = json.loads(slotctl("restore", "--server", kept_target.url, "--slot", 0, name, "--slot-dir",
                             kept_target.save_dir, "--prove", "--json", code=OK).stdout)
    assert doc["proof"]["verdict"] == "proven"


@server
def test_validate_and_ls_never_call_another_models_state_restores(kept_target, twin, tmp_path):
    """validate and ls with -m the twin: a stored state of the target is other_model (exit 1; ls's class
    mismatch, with the remedy), with -m the target restores; a state with a flipped bit is corrupt (validate
    reads its bytes); ls says the build each verdict is for."""
    store, name = stored_by_keep(kept_target, tmp_path)
    state = store / name
    doc = json.loads(slotctl("validate", state, "-m", twin.model, *ARGS, "--json", code=FAILED).stdout)
    (f,) = doc["files"]
    assert f["verdict"] == "other_model" and doc["summary"]["other_model"] == 1
    assert [x["code"] for x in f["findings"] if x["severity"] == "error"] == ["other_model"]
    assert json.loads(slotctl("validate", state, "-m", kept_target.model, *ARGS, "--json", code=OK).stdout
                      )["files"][0]["verdict"] == "restores"
    rows = json.loads(slotctl("ls", store, "-m", twin.model, *ARGS, "--json", code=FAILED).stdout)["files"]
    (row,) = [r for r in rows if r["name"] == name]
    assert row["verdict"] == "other_model" and row["class"] == "mismatch" and "-m" in row["remedy"]
    assert row["build"] == "b11669"      # no --server, no --server-build: the newest build's rules
    rows = json.loads(slotctl("ls", store, "-m", twin.model, *ARGS, "--server-build", "b11434", "--json",
                              code=FAILED).stdout)["files"]
    assert {r["build"] for r in rows} == {"b11434"}
    assert json.loads(slotctl("ls", "--server", kept_target.url, store, "--json", code=OK).stdout
                      )["files"][0]["build"] == "b11434"
    assert json.loads(slotctl("ls", "--server", twin.url, store, "--json", code=FAILED).stdout
                      )["files"][0]["verdict"] == "other_model"
    flip_bit(state)
    doc = json.loads(slotctl("validate", state, "-m", kept_target.model, *ARGS, "--json", code=FAILED).stdout)
    assert doc["files"][0]["verdict"] == "corrupt" and doc["summary"]["corrupt"] == 1
