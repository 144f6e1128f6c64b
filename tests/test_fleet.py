"""Slots that outlive a server and move between servers: ``restore --prove``, ``migrate`` (docs/fleet.md).

Against real llama-server b11434 processes, module-scoped: ``one`` (``-c 512 -np 2``: two KV streams, 256
tokens a slot), ``three`` (``-c 1536 -np 3 -kvu``: one stream, 1536 tokens a slot), ``other`` (another
model) and ``kept`` (under ``--api-prefix``, killed and started again under ``slotctl keep``, which runs as a
process of its own so that its signals are real). Every proof is the server's own ``timings``.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import json_schemas
from conftest import DATA, default_signals
from keeping import ROOT, Keep, emptied, serving, slotctl, tokens_of
from seaweed import BUCKET, next_second
from slotctl.errors import ExitStatus
from slotctl.keeping.names import WORK_GLOBS, tokens_hash
from slotctl.slotfile import open_slot_file
from slotctl.tinymodels import SAMPLE_PROMPT

#: keep's working files in the server's --slot-save-path, whatever the process
INCOMING_GLOB = WORK_GLOBS[0]


def stored_name(slot: int, model: str, tokens: str) -> str:
    """A state's name as the previous release's keep wrote it (``slotN-MODEL-TOKENS.bin``): still read."""
    return f"slot{slot}-{model}-{tokens}.bin"

server = pytest.mark.server
OK, FAILED, USAGE = int(ExitStatus.OK), int(ExitStatus.FAILED), int(ExitStatus.USAGE)
TIMEOUT = ["--timeout", "60"]
#: a prompt longer than the 256 tokens a slot of ``one`` holds
LONG_PROMPT = " ".join([SAMPLE_PROMPT] * 3)


@pytest.fixture(scope="module")
def other(llama_server_bin, tiny_models, tmp_path_factory):
    """Another model (the 1-layer draft) with room enough."""
    with serving(llama_server_bin, tiny_models.draft, tmp_path_factory.mktemp("other"), "other",
                 ["-c", "512", "-np", "2", "-fa", "on"]) as srv:
        yield srv


def cached(srv, slot: int) -> int | None:
    """The slot's cached prompt tokens (GET /slots n_prompt_tokens)."""
    status, slots = srv.get("/slots")
    assert status == 200
    return next(s for s in slots if s["id"] == slot).get("n_prompt_tokens")


def counts(srv, slot: int, prompt) -> tuple[int, int]:
    """(cache_n, prompt_n) of a request of ``prompt`` (text or token ids) in ``slot``, one token generated."""
    answer = srv.completion(prompt, slot=slot, n_predict=1)
    return answer["timings"]["cache_n"], answer["timings"]["prompt_n"]


# -- restore --prove ---------------------------------------------------------------------------------------


@server
def test_prove_after_restore(one):
    one.completion(SAMPLE_PROMPT, slot=1, n_predict=8)
    one.save(1, "prove.bin")
    n = len(tokens_of(one.save_dir / "prove.bin"))
    one.erase(1)
    res = slotctl("restore", "--server", one.url, "--slot", "1", "prove.bin", "--prove", "--slot-dir", one.save_dir,
                  "--json", *TIMEOUT, code=OK)
    doc = json.loads(res.stdout)
    p = doc["proof"]
    assert doc["answer"]["n_restored"] == n and doc["exit_code"] == 0
    # the server's own counts: all but the last token reused (it evaluates the last again for its logits)
    assert (p["verdict"], p["n_prompt"], p["n_reused"], p["n_evaluated"]) == ("proven", n, n - 1, 1)
    assert (p["predicted_reused"], p["predicted_evaluated"], p["rule"]) == (n - 1, 1, "b11434")
    assert p["extending"]["n_reused"] == n     # validate's prediction for a request that extends the prompt
    # the proving request generated nothing the slot keeps: it still holds the file's tokens
    assert cached(one, 1) == n
    assert counts(one, 1, tokens_of(one.save_dir / "prove.bin")) == (n - 1, 1)

    res = slotctl("restore", "--server", one.url, "--slot", "1", "prove.bin", "--prove", "--slot-dir", one.save_dir,
                  code=OK)
    assert "proof proven" in " ".join(res.stdout.split()), res.stdout


@server
def test_prove_finds_a_slot_that_reuses_nothing(one):
    """The slot loses what was restored before the proof (erased by another client): the server evaluates the
    whole prompt, more than predicted, and the proof fails with the counts."""
    from slotctl.live import http
    from slotctl.live.prove import local_setup, prove

    one.completion(SAMPLE_PROMPT, slot=0, n_predict=4)
    one.save(0, "lost.bin")
    n = len(tokens_of(one.save_dir / "lost.bin"))
    assert one.restore(0, "lost.bin")[0] == 200
    one.erase(0)
    facts = http.server_facts(one.url, 0)
    setup, _ = local_setup(facts, 0)
    p = prove(one.url, 0, one.save_dir / "lost.bin", setup, build_info=facts.build_info, timeout=60)
    assert (p.verdict, p.n_reused, p.n_evaluated, p.predicted_evaluated) == ("reevaluated", 0, n, 1)
    assert p.exit_status == ExitStatus.FAILED and f"evaluated {n:,} of the {n:,}" in p.reason


def test_prove_needs_slot_dir_and_a_server(tmp_path):
    res = slotctl("restore", "--server", "http://127.0.0.1:9", "--slot", "0", "x.bin", "--prove", code=USAGE)
    assert "--prove needs --slot-dir" in res.stderr
    res = slotctl("restore", "--server", "http://127.0.0.1:9", "--slot", "0", "x.bin", "--prove", "--slot-dir",
                  tmp_path, code=USAGE)
    assert "x.bin" in res.stderr and "no such file" in res.stderr.lower()
    res = slotctl("restore", tmp_path / "x.bin", "-m", tmp_path / "m.gguf", "--prove", code=USAGE)
    assert "go with --server" in res.stderr


# -- migrate -----------------------------------------------------------------------------------------------


def migrate(src, slot, dst, to_slot, *more, code):
    res = slotctl("migrate", "--from", src.url, "--slot", slot, "--to", dst.url, "--to-slot", to_slot,
                  "--from-dir", src.save_dir, "--to-dir", dst.save_dir, "--json", *TIMEOUT, *more, code=code)
    return json.loads(res.stdout), res


def steps(doc) -> dict:
    return {s["step"]: s for s in doc["steps"]}


@server
def test_migrate_between_servers_with_other_np_and_kvu(one, three):
    one.completion(SAMPLE_PROMPT, slot=1, n_predict=8)
    kept_dir = three.save_dir.parent / "kept-moved"
    kept_dir.mkdir()
    doc, _ = migrate(one, 1, three, 2, "--name", "moved.bin", "-kvu", "--store", kept_dir, code=OK)
    st = steps(doc)
    assert [s["status"] for s in doc["steps"]] == ["ok"] * 10, doc["steps"]
    assert st["check"]["details"]["converted"] and any("n_stream 2 -> 1" in c for c in st["check"]["details"]["changes"])
    # the working files are gone after success (the source's save, the copy placed); the store keeps its copy
    placed = three.save_dir / "moved.bin"
    assert sorted(st["cleanup"]["details"]["removed"]) == sorted([str(one.save_dir / "moved.bin"), str(placed)])
    assert not placed.exists() and not (one.save_dir / "moved.bin").exists()
    stored = kept_dir / "moved.bin"
    assert open_slot_file(stored).target.sections[0].n_stream == 1
    tokens = tokens_of(stored)
    n = len(tokens)
    assert doc["proof"]["verdict"] == "proven" and (doc["proof"]["n_reused"], doc["proof"]["n_evaluated"]) == (n - 1, 1)
    # the destination's own timings: a request extending the prompt evaluates only the new tokens there,
    # where a fresh slot of the same server evaluates all of them
    more = tokens + three.tokenize(" The river Seine", add_special=False)
    assert counts(three, 2, more) == (n, len(more) - n)
    three.erase(0)
    assert counts(three, 0, more) == (0, len(more))
    # the source slot is as it was
    assert cached(one, 1) == n


@server
def test_migrate_refuses_another_model_before_touching_it(one, other):
    one.completion(SAMPLE_PROMPT, slot=1, n_predict=2)
    before = sorted(os.listdir(other.save_dir))
    doc, res = migrate(one, 1, other, 0, "--name", "foreign.bin", code=FAILED)
    st = steps(doc)
    assert st["destination"]["status"] == "refused" and "another model" in st["destination"]["message"]
    assert all(st[s]["status"] == "skipped" for s in ("save", "fetch", "check", "store", "place", "restore", "prove",
                                                       "cleanup"))
    assert sorted(os.listdir(other.save_dir)) == before and cached(other, 0) in (None, 0)
    assert "another model" in res.stderr


@server
def test_migrate_refuses_a_lossy_cache_type_change_without_allow_lossy(one, three):
    """A destination said to run a q8_0 K cache (-ctk: b11434 does not report it): the f16 rows would be
    re-encoded, which loses precision, so only --allow-lossy does it; nothing reaches the destination."""
    one.completion(SAMPLE_PROMPT, slot=1, n_predict=2)
    before = sorted(os.listdir(three.save_dir))
    doc, _ = migrate(one, 1, three, 1, "--name", "lossy.bin", "-kvu", "-ctk", "q8_0", code=FAILED)
    st = steps(doc)
    assert st["check"]["status"] == "refused" and "--allow-lossy" in st["check"]["message"], st["check"]
    assert any("K type f16 -> q8_0" in c for c in st["check"]["details"]["lossy"])
    assert st["place"]["status"] == "skipped" and sorted(os.listdir(three.save_dir)) == before
    # the same for people: one row per step on stdout, the refusal in one line on stderr
    res = slotctl("migrate", "--from", one.url, "--slot", "1", "--to", three.url, "--to-slot", "1", "--from-dir",
                  one.save_dir, "--to-dir", three.save_dir, "--name", "lossy2.bin", "-kvu", "-ctk", "q8_0",
                  code=FAILED)
    cells = [[w for w in line.split() if w != "│"] for line in res.stdout.splitlines()[1:]]
    rows = {c[0]: c[1] for c in cells if len(c) > 1 and c[0] in ("source", "destination", "save", "fetch", "check",
                                                                   "store", "place", "restore", "prove", "cleanup")}
    assert rows == {"source": "ok", "destination": "ok", "save": "ok", "fetch": "ok", "check": "refused",
                    "store": "skipped", "place": "skipped", "restore": "skipped", "prove": "skipped",
                    "cleanup": "skipped"}, res.stdout
    assert res.stderr.strip().startswith("error: migrate: check: ") and "--allow-lossy" in res.stderr


@server
def test_migrate_refuses_a_context_too_small(one, three):
    three.completion(LONG_PROMPT, slot=0, n_predict=2)
    n = cached(three, 0)
    assert n > 256
    before = sorted(os.listdir(one.save_dir))
    doc, _ = migrate(three, 0, one, 0, "--name", "long.bin", code=FAILED)
    st = steps(doc)
    assert st["check"]["status"] == "refused", doc["steps"]
    assert "would not restore" in st["check"]["message"] and "256" in st["check"]["message"]
    assert st["place"]["status"] == st["restore"]["status"] == "skipped"
    assert sorted(os.listdir(one.save_dir)) == before
    assert cached(three, 0) == n


class _DyingAtRestore(http.server.BaseHTTPRequestHandler):
    """Forwards every request to ``upstream``, but drops the connection on a slot restore: a destination
    that goes away mid-migrate."""

    upstream = ""

    def _forward(self):
        if "action=restore" in self.path:
            self.close_connection = True
            self.connection.close()
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
        req = urllib.request.Request(self.upstream + self.path, data=body, method=self.command,
                                     headers={"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=60) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    do_GET = do_POST = _forward

    def log_message(self, *a):
        pass


@server
def test_a_destination_gone_mid_migrate_leaves_the_source_slot(one, three):
    one.completion(SAMPLE_PROMPT, slot=0, n_predict=3)
    n = cached(one, 0)
    handler = type("H", (_DyingAtRestore,), {"upstream": three.url})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        res = slotctl("migrate", "--from", one.url, "--slot", "0", "--to", f"http://127.0.0.1:{proxy.server_port}",
                      "--to-slot", "1", "--from-dir", one.save_dir, "--to-dir", three.save_dir, "--name", "gone.bin",
                      "-kvu", "--json", *TIMEOUT, code=USAGE)
    finally:
        proxy.shutdown()
    st = steps(json.loads(res.stdout))
    assert st["place"]["status"] == "ok" and st["restore"]["status"] == "failed", st
    assert st["prove"]["status"] == "skipped"
    # the file placed is whole (written atomically) and the source slot is as it was
    assert len(tokens_of(three.save_dir / "gone.bin")) == n and cached(one, 0) == n
    assert counts(one, 0, tokens_of(one.save_dir / "gone.bin")) == (n - 1, 1)


# -- keep --------------------------------------------------------------------------------------------------


@server
def test_keep_brings_a_slot_back_after_the_server_is_killed(kept, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    keep = Keep(kept, store, "--every", "0.3")
    try:
        keep.wait_for("up")
        kept.completion(SAMPLE_PROMPT, slot=0, n_predict=6)
        stored = keep.wait_for("stored", 0)
        tokens = tokens_of(Path(stored["details"]["path"]))
        n = len(tokens)
        assert stored["details"]["n_tokens"] == n and stored["details"]["name"].startswith("slot0-")
        assert not list(kept.save_dir.glob(INCOMING_GLOB))

        kept.kill_and_start_again()
        keep.wait_for("restart")
        assert keep.wait_for("restored", 0)["details"]["answer"]["n_restored"] == n
        proof = keep.wait_for("proof", 0)["details"]["proof"]
        assert (proof["verdict"], proof["n_reused"], proof["n_evaluated"]) == ("proven", n - 1, 1)
        # the restarted server's own timings: a request extending the prompt evaluates only the new tokens
        more = tokens + kept.tokenize(" The river Seine", add_special=False)
        assert counts(kept, 0, more) == (n, len(more) - n)
        # slot 1 was empty before the kill: nothing to restore there
        assert cached(kept, 1) is None
    finally:
        assert keep.stop() == 0
    assert keep.seen and keep.wait_for("stop")["event"] == "stop"


@server
def test_keep_stopped_by_sigterm_saves_the_changed_slots_and_exits_0(kept, tmp_path):
    emptied(kept)
    store = tmp_path / "store"
    store.mkdir()
    keep = Keep(kept, store, "--every", "600")     # one look at the start, then only the last save
    keep.wait_for("up")
    kept.completion(SAMPLE_PROMPT + " The tower", slot=1, n_predict=2)
    assert keep.stop(signal.SIGTERM) == 0
    stored = keep.wait_for("stored", 1, timeout=60)
    assert keep.wait_for("stop", timeout=60)
    assert len(tokens_of(Path(stored["details"]["path"]))) == stored["details"]["n_tokens"]


@server
def test_keep_killed_mid_copy_leaves_the_store_consistent(kept, tmp_path):
    emptied(kept)
    store = tmp_path / "store"
    store.mkdir()
    for attempt in range(3):
        keep = Keep(kept, store, "--every", "0.2")
        keep.wait_for("up")
        kept.completion(LONG_PROMPT + f" {attempt}", slot=1, n_predict=2)
        keep.wait_for("saved", 1)      # the server answered: keep is checking or copying the file now
        keep.stop(signal.SIGKILL)
    # every file of the store is whole: a state under its final name, or a temporary file prune and ls skip
    for p in store.iterdir():
        if p.name.startswith("."):
            # a temporary file, or the keeper's lock and journal (slotctl.unattended.lock)
            assert (".slotctl-" in p.name and p.name.endswith(".tmp")
                    or re.fullmatch(r"\.slotctl-keep-[0-9a-f]{12}\.(lock|json)", p.name)), p.name
            continue
        sf = open_slot_file(p)
        assert not sf.errors, (p.name, sf.errors)
        # named by slot, model and the hash of the tokens it holds
        assert re.fullmatch(rf"slot\d+-[0-9a-f]{{8}}-\d{{7}}-{tokens_hash(sf.tokens.tokens)}\.bin", p.name), p.name
    res = slotctl("ls", store, "--json", code=OK)
    assert all(row["verdict"] != "unreadable" for row in json.loads(res.stdout)["files"])
    # a keep started again stores the slot's state (nothing it stored was lost or torn)
    keep = Keep(kept, store, "--every", "0.2")
    try:
        keep.wait_for("up")
        kept.completion(LONG_PROMPT + " again", slot=1, n_predict=2)
        ev = keep.wait_for("stored", 1)
        assert open_slot_file(Path(ev["details"]["path"])).errors == []
    finally:
        assert keep.stop() == 0


@server
def test_two_keepers_of_one_server_never_share_a_working_file(kept, tmp_path):
    """Two keep processes on one server, each with its own store (the lock refuses two on one store): both
    have the server save into its one --slot-save-path, each under its own name, none renames or reads the
    other's, nothing half-written is skipped as damaged, and no working file stays."""
    emptied(kept)
    stores = [tmp_path / "store-a", tmp_path / "store-b"]
    for store in stores:
        store.mkdir()
    keepers = [Keep(kept, store, "--every", "0.1") for store in stores]
    try:
        for k in keepers:
            k.wait_for("up")
        for i in range(4):
            kept.completion(SAMPLE_PROMPT + f" round {i}", slot=i % 2, n_predict=2)
            for k in keepers:       # each keeper saved this state and stored it (or found it stored)
                k.wait_for("saved", i % 2)
    finally:
        codes = [k.stop() for k in keepers]
    assert codes == [0, 0]
    for k in keepers:
        k.wait_for("stop", timeout=60)      # every line read
        bad = [e for e in k.seen if e["event"] == "error" or "not stored" in e["message"]]   # none half-written
        assert not bad, bad
    pids = {str(k.proc.pid) for k in keepers}
    assert not [p for p in kept.save_dir.glob(INCOMING_GLOB) if p.name.split("-")[3] in pids]
    for store in stores:
        states = [p for p in store.iterdir() if p.name.endswith(".bin")]
        assert states
        for p in states:
            assert not open_slot_file(p).errors, p.name


@server
def test_keep_holds_the_store_under_max_size(kept, tmp_path):
    emptied(kept)
    store = tmp_path / "store"
    store.mkdir()
    keep = Keep(kept, store, "--every", "0.2", "--max-size", "200K")
    try:
        keep.wait_for("up")
        kept.completion(SAMPLE_PROMPT + " one", slot=1, n_predict=2)
        keep.wait_for("stored", 1)
        kept.completion(LONG_PROMPT + " two", slot=1, n_predict=2)
        newest = keep.wait_for("stored", 1)["details"]
        pruned = keep.wait_for("pruned")["details"]
        assert pruned["action"] == "deleted" and pruned["path"] != newest["path"]
        states = [p for p in store.iterdir() if not p.name.startswith(".")]
        assert Path(newest["path"]) in states and not Path(pruned["path"]).exists()
        assert sum(p.stat().st_size for p in states) <= 200 << 10
    finally:
        assert keep.stop() == 0


@server
def test_keep_with_an_s3_store(kept, seaweed, monkeypatch):
    emptied(kept)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(seaweed.env(), HOME=str(seaweed.dir))
    store = f"s3://{BUCKET}/keep/"
    keep = Keep(kept, store, "--every", "0.3", env=env)
    try:
        keep.wait_for("up")
        kept.completion(SAMPLE_PROMPT + " The bridge", slot=0, n_predict=3)
        stored = keep.wait_for("stored", 0)["details"]
        assert stored["path"] == store + stored["name"]
        kept.kill_and_start_again()
        keep.wait_for("restart")
        restored = keep.wait_for("restored", 0)["details"]
        assert restored["name"] == stored["name"] and restored["answer"]["n_restored"] == stored["n_tokens"]
        proof = keep.wait_for("proof", 0)["details"]["proof"]
        assert (proof["verdict"], proof["n_reused"]) == ("proven", stored["n_tokens"] - 1)
        assert not (kept.save_dir / stored["name"]).exists()    # the copy the server restored from is gone
    finally:
        assert keep.stop() == 0
    # the object in the store is a whole slot file (read back through the store)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from slotctl.store.s3 import S3_STORE

    S3_STORE.reset()
    try:
        doc = json.loads(slotctl("ls", store, "--json", code=OK).stdout)
    finally:
        S3_STORE.reset()
    row = next(r for r in doc["files"] if r["path"] == stored["path"])
    assert row["n_tokens"] == stored["n_tokens"] and row["size"] == stored["size"]


def test_keep_log_lines_while_the_server_is_down(tmp_path):
    """Without --json: one line per action on stderr, nothing on stdout; down is said once; SIGTERM exits 0."""
    from llama_server import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "slotctl", "keep", "--server", f"http://127.0.0.1:{free_port()}",
                             "--slot-dir", str(tmp_path), "--every", "0.1", "--timeout", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=default_signals)
    # SIGTERM once keep has said it is down (its handler installed): a fixed sleep raced a loaded machine's
    # start-up (killed by the signal's default action, exit -15)
    head = []
    while not any(" down " in f" {line} " for line in head):
        line = proc.stderr.readline()
        assert line, ("keep ended early", head)
        head.append(line)
    time.sleep(1)       # more looks while down: still said once
    proc.send_signal(signal.SIGTERM)
    out, rest = proc.communicate(timeout=30)
    err = "".join(head) + rest
    assert proc.returncode == 0 and out == "", (out, err)
    events = [line.split()[1] for line in err.splitlines()]
    assert events[0] == "start" and events.count("down") == 1 and events[-1] == "stop", err
    assert "connection refused" in err


def test_keep_usage_errors(tmp_path):
    res = slotctl("keep", "--server", "http://127.0.0.1:9", "--slot-dir", tmp_path / "nope", code=USAGE)
    assert "not a directory" in res.stderr
    res = slotctl("keep", "--server", "http://127.0.0.1:9", "--slot-dir", tmp_path, "--max-size", "lots",
                  code=USAGE)
    assert "--max-size" in res.stderr


@server
def test_migrate_through_an_s3_store(one, three, seaweed, monkeypatch):
    """--store s3://...: the converted file goes through the object store and stays there; the destination
    restores the store's copy, proven."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in {**seaweed.env(), "HOME": str(seaweed.dir)}.items():
        monkeypatch.setenv(k, v)
    from slotctl.store.s3 import S3_STORE

    S3_STORE.reset()
    try:
        one.completion(SAMPLE_PROMPT + " The store", slot=0, n_predict=3)
        store = f"s3://{BUCKET}/migrate/"
        doc, _ = migrate(one, 0, three, 0, "--name", "via-s3.bin", "-kvu", "--store", store, code=OK)
        st = steps(doc)
        assert [s["status"] for s in doc["steps"]] == ["ok"] * 10, doc["steps"]
        assert st["store"]["details"]["where"] == store + "via-s3.bin"
        assert doc["proof"]["verdict"] == "proven"
        row = json.loads(slotctl("ls", store, "--json", code=OK).stdout)["files"][0]
        assert not (three.save_dir / "via-s3.bin").exists()     # the working copy removed, the object kept
        assert row["path"] == store + "via-s3.bin" and row["size"] == st["place"]["details"]["size"]
        assert row["n_tokens"] == doc["proof"]["n_prompt"]
    finally:
        S3_STORE.reset()


def test_an_s3_store_is_held_under_max_size_by_prunes_rules(seaweed, monkeypatch):
    """keep's budget on an ``s3://`` store: prune's rules for a prefix (least recently modified first, pins
    never touched), against the real SeaweedFS; the objects kept are whole."""
    from slotctl.keeping.store import ObjectStore
    from slotctl.store.s3 import S3_STORE

    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in {**seaweed.env(), "HOME": str(seaweed.dir)}.items():
        monkeypatch.setenv(k, v)
    S3_STORE.reset()
    import obstore

    data = (DATA / "srv-np1.bin").read_bytes()
    names = ["slot0-a.bin", "slot0-b.bin", "slot0-c.bin", "keep-slot0-incoming-7-0a0b0c0d.bin"]
    for name in names:      # Last-Modified has a resolution of a second
        obstore.put(seaweed.client(), f"budget/{name}", data)
        next_second()
    store = ObjectStore(f"s3://{BUCKET}/budget/")
    gone = []
    store.prune(2 * len(data) + 1, (INCOMING_GLOB,), lambda path, size, action, reason: gone.append(
        (path.rpartition("/")[2], action)))
    assert gone == [("slot0-a.bin", "deleted"), ("slot0-b.bin", "deleted")]
    left = sorted(o["path"].rpartition("/")[2] for o in obstore.list(seaweed.client(), "budget/").collect())
    assert left == ["keep-slot0-incoming-7-0a0b0c0d.bin", "slot0-c.bin"]
    assert bytes(obstore.get(seaweed.client(), "budget/slot0-c.bin").bytes()) == data
    S3_STORE.reset()


def test_keep_removes_the_working_files_of_keepers_that_are_gone(tmp_path):
    """A keep SIGKILLed mid-save leaves its private working file; a keep starting removes those of processes that
    are gone and untouched for an hour, and nothing else (a live keeper's, a recent one, any other file)."""
    from slotctl.fleet.keep import ORPHAN_AGE, Keeper

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - ORPHAN_AGE - 60
    names = {"gone-old": f"keep-slot0-incoming-{dead.pid}-0a0b0c0d.bin", "gone-new": f"keep-slot1-incoming-{dead.pid}-1a1b1c1d.bin",
             "alive": f"keep-slot0-incoming-{os.getppid()}-2a2b2c2d.bin", "other": "slot0-x.bin"}
    for key, name in names.items():
        (tmp_path / name).write_bytes(b"x")
        if key != "gone-new":
            os.utime(tmp_path / name, (old, old))
    seen = []
    Keeper("http://127.0.0.1:9", tmp_path, emit=seen.append).sweep()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for k, n in names.items() if k != "gone-old")
    assert [e.event for e in seen] == ["pruned"] and names["gone-old"] in seen[0].message


# -- acts obey verdicts (issue 24) -------------------------------------------------------------------------


def _cut(src: Path, dest: Path, n: int = 100) -> None:
    """``dest``: ``src`` with its last ``n`` bytes cut (a payload cut short: b11434 dies on it)."""
    data = src.read_bytes()
    dest.write_bytes(data[:-n])


def _alive(srv) -> bool:
    status, _ = srv.get("/health")
    return status == 200 and srv.proc.poll() is None


def _restores_logged(srv, name: str) -> bool:
    """Whether the server's log shows a restore of ``name`` (what reaches it is what it logs)."""
    return name in srv.log_text()


@server
def test_restore_server_never_sends_a_file_validate_says_it_aborts_on(one):
    one.completion(SAMPLE_PROMPT, slot=0, n_predict=4)
    one.save(0, "whole.bin")
    _cut(one.save_dir / "whole.bin", one.save_dir / "cut100.bin")
    doc = json.loads(slotctl("validate", "--server", one.url, one.save_dir / "cut100.bin", "--json", *TIMEOUT).stdout)
    assert doc["files"][0]["verdict"] == "aborts", doc["files"][0]
    for more in ([], ["--prove"]):
        res = slotctl("restore", "--server", one.url, "--slot", "0", "cut100.bin", "--slot-dir", one.save_dir,
                      *more, "--json", *TIMEOUT, code=FAILED)
        err = json.loads(res.stdout)["error"]
        assert err["code"] == "not_sent" and "aborts" in err["message"] and "--force" in err["message"], err
    assert _alive(one) and not _restores_logged(one, "cut100.bin")
    # an intact file is judged and sent; the JSON says nothing was forced
    res = slotctl("restore", "--server", one.url, "--slot", "0", "whole.bin", "--slot-dir", one.save_dir, "--json",
                  *TIMEOUT, code=OK)
    assert "note" not in json.loads(res.stdout)
    # without --slot-dir the file cannot be read: it is sent, and the output says it was not judged
    res = slotctl("restore", "--server", one.url, "--slot", "0", "whole.bin", "--json", *TIMEOUT, code=OK)
    assert json.loads(res.stdout)["note"].startswith("not judged: give --slot-dir")
    # --force is for a local restore's refusal only with --server
    res = slotctl("restore", one.save_dir / "whole.bin", "-m", one.save_dir / "whole.bin", "--force", code=USAGE)
    assert "go with --server" in res.stderr


@server
def test_a_server_that_drops_the_connection_at_a_restore_may_have_crashed(llama_server_bin, tiny_models, tmp_path):
    """--force sends the cut file to a server of its own: b11434 dies on it (GGML_ASSERT), and slotctl says
    the server may have crashed, not that it may not be a llama-server."""
    with serving(llama_server_bin, tiny_models.target, tmp_path, "doomed", ["-c", "512", "-np", "1"]) as srv:
        srv.completion(SAMPLE_PROMPT, slot=0, n_predict=4)
        srv.save(0, "whole.bin")
        _cut(srv.save_dir / "whole.bin", srv.save_dir / "cut100.bin")
        res = slotctl("restore", "--server", srv.url, "--slot", "0", "cut100.bin", "--slot-dir", srv.save_dir,
                      "--force", *TIMEOUT, code=USAGE)
        line = " ".join(res.stderr.split())
        assert "closed the connection without answering: it may have crashed" in line, res.stderr
        assert "is this a llama-server" not in line
        srv.proc.wait(timeout=30)
        assert srv.proc.poll() is not None and "GGML_ASSERT" in srv.log_text()


@server
def test_migrate_never_sends_a_file_validate_says_the_destination_aborts_on(one, monkeypatch):
    """The file the source saved is cut by 100 bytes on its way (the source's answer says the size it has):
    the check step judges it for the destination, refuses it, and nothing reaches the destination."""
    from slotctl.live import http as live_http

    real_save = live_http.save_slot

    def save_then_cut(url, slot, filename, **kw):
        answer = real_save(url, slot, filename, **kw)
        path = one.save_dir / filename
        _cut(path, path)
        return dict(answer, n_written=answer["n_written"] - 100)

    monkeypatch.setattr(live_http, "save_slot", save_then_cut)
    one.completion(SAMPLE_PROMPT, slot=1, n_predict=3)
    # to a destination of the source's own flags: no conversion, the cut decides (to ``three``, -kvu, the
    # loader refuses the stream count first, before it reads far enough to die)
    before = sorted(os.listdir(one.save_dir))
    doc, res = migrate(one, 1, one, 0, "--name", "cut-on-the-way.bin", code=FAILED)
    st = steps(doc)
    assert st["check"]["status"] == "refused" and "aborts" in st["check"]["message"], \
        [(s["step"], s["status"], s["message"]) for s in doc["steps"]]
    assert "--force" in st["check"]["message"]
    assert all(st[s]["status"] == "skipped" for s in ("place", "restore", "prove", "cleanup"))
    assert set(os.listdir(one.save_dir)) == {*before, "cut-on-the-way.bin"} and _alive(one)
    assert not _restores_logged(one, "cut-on-the-way.bin")


@server
def test_migrate_to_slot_defaults_to_a_slot_the_destination_has(three, one):
    """The source's slot 2 does not exist on a destination of two slots: an idle slot of the destination
    is taken (it was slot 2 before, and the server refused it)."""
    three.completion(SAMPLE_PROMPT + " The default", slot=2, n_predict=2)
    one.erase(0), one.erase(1)
    res = slotctl("migrate", "--from", three.url, "--slot", "2", "--to", one.url, "--from-dir", three.save_dir,
                  "--to-dir", one.save_dir, "--name", "default-slot.bin", "--json", *TIMEOUT, code=OK)
    doc = json.loads(res.stdout)
    assert doc["to"]["slot"] in (0, 1) and steps(doc)["destination"]["details"]["slot_given"] is False
    assert doc["proof"]["verdict"] == "proven"
    assert cached(one, doc["to"]["slot"]) == doc["proof"]["n_prompt"]


@server
def test_keep_never_restores_a_stored_state_validate_says_the_server_aborts_on(kept, tmp_path):
    from slotctl.keeping.names import model_hash
    from slotctl.live import http as live_http

    kept.completion(SAMPLE_PROMPT, slot=0, n_predict=3)
    kept.save(0, "keep-whole.bin")
    store = tmp_path / "store"
    store.mkdir()
    name = stored_name(0, model_hash(live_http.server_facts(kept.url)), "cut100")
    _cut(kept.save_dir / "keep-whole.bin", store / name)
    kept.erase(0), kept.erase(1)
    keep = Keep(kept, store, "--every", "0.3")
    try:
        skipped = keep.wait_for("skipped", 0)
        assert name in skipped["message"] and "not restored" in skipped["message"], skipped
        assert "aborts" in skipped["message"] and "--force" in skipped["message"]
        assert skipped["details"]["verdict"] == "aborts"
    finally:
        assert keep.stop() == 0
    assert not any(e["event"] == "restored" for e in keep.seen)
    assert _alive(kept) and not _restores_logged(kept, name)


#: paths opened in this process while a test watches (an audit hook: every open(), os.open() included; a hook
#: cannot be removed, so it only records while ``_WATCHING`` is set)
_OPENED: list[str] = []
_WATCHING: list[bool] = []
_HOOKED: list[bool] = []


def _audit(event: str, args) -> None:
    if _WATCHING and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


def _restore_pass(srv, store, facts, **kw) -> tuple[list, list[str]]:
    """One restore pass of slot 0 by a new Keeper (a new process's view, the catalog on disk): its events,
    checked against the schema, and every path the process opened meanwhile."""
    from slotctl.fleet.keep import Keeper

    if not _HOOKED:    # a hook cannot be removed: added once, it records only while _WATCHING is set
        sys.addaudithook(_audit)
        _HOOKED.append(True)
    seen: list = []
    k = Keeper(srv.url, srv.save_dir, store, emit=seen.append, prove=False, timeout=60, **kw)
    k.facts = facts
    _OPENED.clear()
    _WATCHING.append(True)
    try:
        k.restore(0)
    finally:
        _WATCHING.clear()
    for e in seen:
        json_schemas.check("keep", e.as_dict(), "line")
    return seen, list(_OPENED)


@server
def test_keep_does_not_read_again_a_stored_state_it_found_the_server_refuses(kept, tmp_path):
    """The catalog in keep: a stored state whose verdict for the server now running is not `restores` is
    judged once; at the next restore pass (the same server, the same file) its skipped line comes from the
    catalog's row (details.catalog) and the file is not opened at all, while the older state that restores
    is read and restored each time. A new keep process finds the row too; a file changed since, or
    --no-cache, is read again."""
    from slotctl.catalog import INDEX_NAME
    from slotctl.keeping.names import model_hash
    from slotctl.live import http as live_http

    kept.completion(SAMPLE_PROMPT, slot=0, n_predict=3)
    kept.save(0, "keep-whole-catalog.bin")
    store = tmp_path / "store"
    store.mkdir()
    model = model_hash(live_http.server_facts(kept.url))
    good, bad = stored_name(0, model, "whole"), stored_name(0, model, "cut100")
    (store / good).write_bytes((kept.save_dir / "keep-whole-catalog.bin").read_bytes())
    _cut(kept.save_dir / "keep-whole-catalog.bin", store / bad)
    now = time.time()
    os.utime(store / good, (now - 7200, now - 7200))
    os.utime(store / bad, (now - 3600, now - 3600))     # the newest: tried first; changed long enough ago
    facts = live_http.server_facts(kept.url)

    def restore_pass(**kw) -> tuple[list, list[str]]:
        seen, opened = _restore_pass(kept, store, facts, **kw)
        return seen, [p for p in opened if os.path.basename(p) == bad]

    # judged: read (convert's plan, validate), refused, and its line kept in the store's catalog
    seen, opened = restore_pass()
    (skipped,) = [e for e in seen if e.event == "skipped"]
    assert skipped.details["verdict"] == "aborts" and "catalog" not in skipped.details, skipped
    assert opened, "the refused state was not read the first time"
    assert [e.details["name"] for e in seen if e.event == "restored"] == [good]
    assert (store / INDEX_NAME).exists()
    # the next pass: the same line from the catalog, the file never opened; the good one restored again
    for _ in range(2):
        seen, opened = restore_pass()
        (again,) = [e for e in seen if e.event == "skipped"]
        assert again.details == dict(skipped.details, catalog=True), again.details
        assert again.message.startswith(skipped.message) and "catalog" in again.message
        assert opened == [], opened
        assert [e.details["name"] for e in seen if e.event == "restored"] == [good]
    assert not _restores_logged(kept, bad)
    # --no-cache: judged again, read again
    seen, opened = restore_pass(catalog=False)
    (nc,) = [e for e in seen if e.event == "skipped"]
    assert "catalog" not in nc.details and opened
    # the file changed (its identity): read again, then trusted again once old enough
    os.utime(store / bad, (now - 1800, now - 1800))
    seen, opened = restore_pass()
    (changed,) = [e for e in seen if e.event == "skipped"]
    assert "catalog" not in changed.details and opened
    seen, opened = restore_pass()
    assert [e.details.get("catalog") for e in seen if e.event == "skipped"] == [True] and opened == []


def _on_seaweed(seaweed, monkeypatch, tmp_path) -> None:
    """This process's store is the test's SeaweedFS (its credentials only), the catalog's cache directory the
    test's own."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOME", str(seaweed.dir))
    monkeypatch.setenv("SLOTCTL_CACHE_DIR", str(tmp_path / "cache"))


@server
def test_keep_does_not_download_again_an_s3_state_the_server_refuses(kept, three, seaweed, monkeypatch, tmp_path):
    """The catalog in keep with an s3:// store (its index under the cache directory, an object's identity from
    one HEAD): an intact state too long for the server's slots (validate: refused) is downloaded and judged
    once; the next pass says the same line from the catalog and downloads nothing."""
    import obstore

    from slotctl.keeping.names import model_hash
    from slotctl.live import http as live_http
    from slotctl.store.s3 import S3_STORE

    _on_seaweed(seaweed, monkeypatch, tmp_path)
    # a state of about 690 tokens, made by the server whose unified cache holds it, for kept's 512-token slots
    three.completion(" ".join([SAMPLE_PROMPT] * 7), slot=0, n_predict=2)
    three.save(0, "long-catalog.bin")
    facts = live_http.server_facts(kept.url)
    bad = stored_name(0, model_hash(facts), "toolong")
    obstore.put(seaweed.client(), f"keep-catalog/{bad}", (three.save_dir / "long-catalog.bin").read_bytes())
    store = f"s3://{BUCKET}/keep-catalog/"
    # an object's Last-Modified is when it was put: under the rule of 3 s its row would not be trusted yet
    monkeypatch.setenv("SLOTCTL_RACY_SECONDS", "0")
    S3_STORE.reset()
    try:
        lines = []
        for _ in range(3):
            seen, opened = _restore_pass(kept, store, facts)
            lines.append(([e for e in seen if e.event == "skipped" and e.details.get("name") == bad],
                          [p for p in opened if bad in os.path.basename(p)]))
    finally:
        S3_STORE.reset()
    (first,), opened = lines[0]
    assert first.details["verdict"] == "refused" and "catalog" not in first.details, first
    assert opened, "the state was not downloaded the first time"
    for (again,), opened in lines[1:]:
        assert again.details == dict(first.details, catalog=True) and opened == [], (again, opened)
    assert list((tmp_path / "cache" / "catalog").glob("*.sqlite"))     # the prefix's index, not in the bucket


@server
def test_keep_remembers_a_damaged_s3_state_instead_of_an_error_at_every_pass(kept, seaweed, monkeypatch, tmp_path):
    """A damaged state in an s3:// store (cut short: b11434 aborts on it), which cp refuses to download, is
    judged where it is (validate reads the object by ranges) and skipped with its verdict, not an error; its
    line is kept in the catalog, so the next passes say it again reading none of the object's bytes (only its
    HEAD). An older intact state of the same slot is still restored."""
    import obstore

    from slotctl import sources
    from slotctl.keeping.names import model_hash
    from slotctl.live import http as live_http
    from slotctl.store.s3 import S3_STORE

    _on_seaweed(seaweed, monkeypatch, tmp_path)
    kept.completion(SAMPLE_PROMPT, slot=0, n_predict=3)
    kept.save(0, "keep-whole-damaged.bin")
    whole = (kept.save_dir / "keep-whole-damaged.bin").read_bytes()
    facts = live_http.server_facts(kept.url)
    good, bad = stored_name(0, model_hash(facts), "whole"), stored_name(0, model_hash(facts), "cut100")
    prefix = f"keep-damaged-{tmp_path.name}"
    obstore.put(seaweed.client(), f"{prefix}/{good}", whole)
    next_second()       # Last-Modified has second precision: the damaged state is the newest, tried first
    obstore.put(seaweed.client(), f"{prefix}/{bad}", whole[:-100])
    store = f"s3://{BUCKET}/{prefix}/"
    monkeypatch.setenv("SLOTCTL_RACY_SECONDS", "0")     # a row of an object just put trusted (3 s: a wait)
    S3_STORE.reset()
    passes = []
    try:
        for _ in range(3):
            before = sources.TOTALS["bytes"]
            seen, _opened = _restore_pass(kept, store, facts)
            passes.append((seen, sources.TOTALS["bytes"] - before))
    finally:
        S3_STORE.reset()
    for seen, _read in passes:
        assert [e for e in seen if e.event == "error"] == [], seen
        assert [e.details["name"] for e in seen if e.event == "restored"] == [good], seen
    (first,) = [e for e in passes[0][0] if e.event == "skipped"]
    assert first.details["name"] == bad and first.details["verdict"] == "aborts" and "catalog" not in first.details
    for seen, _read in passes[1:]:
        (again,) = [e for e in seen if e.event == "skipped"]
        assert again.details == dict(first.details, catalog=True), again.details
    # the later passes read the intact state's bytes (its download) and none of the damaged one's
    reads = [read for _seen, read in passes]
    assert reads[1] == reads[2] < reads[0], reads
    assert not _restores_logged(kept, bad)


def test_a_download_is_kept_only_when_its_etag_is_the_one_judged(seaweed, monkeypatch, tmp_path):
    """ObjectStore.local(identity=...) (serve's restore of an s3:// state): the download's reads are pinned to
    one ETag, which must be the identity the verdict was made on; an object replaced since is not kept
    (object_changed, nothing left in the staging directory), the object as judged is."""
    import obstore

    from slotctl.catalog import object_identity
    from slotctl.errors import UsageError
    from slotctl.keeping.store import ObjectStore
    from slotctl.store.s3 import S3_STORE

    _on_seaweed(seaweed, monkeypatch, tmp_path)
    prefix = f"identity-{tmp_path.name}"
    store = ObjectStore(f"s3://{BUCKET}/{prefix}/")
    first, second = (DATA / "srv-np1.bin").read_bytes(), (DATA / "srv-kvq8.bin").read_bytes()
    S3_STORE.reset()
    try:
        obstore.put(seaweed.client(), f"{prefix}/s.bin", first)
        e = S3_STORE.stat(store.where("s.bin"))
        judged = object_identity(e.etag, e.size)
        obstore.put(seaweed.client(), f"{prefix}/s.bin", second)       # replaced after the verdict
        S3_STORE.reset()
        staging = tmp_path / "staging"
        staging.mkdir()
        with pytest.raises(UsageError) as err:
            store.local("s.bin", staging, identity=judged)
        assert err.value.code == "object_changed" and list(staging.iterdir()) == []
        e = S3_STORE.stat(store.where("s.bin"))
        got = store.local("s.bin", staging, identity=object_identity(e.etag, e.size))
        assert got.read_bytes() == second
    finally:
        S3_STORE.reset()


@server
def test_keep_says_when_the_stores_catalog_cannot_be_used(kept, tmp_path):
    """An index keep cannot use as it is is a `catalog` line (details.path, the index), never silence: a real
    file of garbage and an index of another version are rebuilt (then used: the refusal is said from the
    catalog on the next pass), a directory in the index's place is not used (every pass judges the state)."""
    import sqlite3

    from slotctl.catalog import INDEX_NAME
    from slotctl.keeping.names import model_hash
    from slotctl.live import http as live_http

    kept.completion(SAMPLE_PROMPT, slot=0, n_predict=3)
    kept.save(0, "keep-whole-silence.bin")
    store = tmp_path / "store"
    store.mkdir()
    facts = live_http.server_facts(kept.url)
    bad = stored_name(0, model_hash(facts), "cut100")
    _cut(kept.save_dir / "keep-whole-silence.bin", store / bad)
    old = time.time() - 3600
    os.utime(store / bad, (old, old))
    index = store / INDEX_NAME

    def catalog_lines(seen) -> list:
        lines = [e for e in seen if e.event == "catalog"]
        assert all(e.slot is None and e.details == {"path": str(index)} for e in lines), lines
        return lines

    def from_catalog(seen) -> list:
        return [e.details.get("catalog", False) for e in seen if e.event == "skipped" and e.details.get("name") == bad]

    # the store's index is a file of garbage: rebuilt, said once; the refusal kept in the new one
    index.write_bytes(b"this is not an SQLite database, " * 200)
    seen, opened = _restore_pass(kept, store, facts)
    (line,) = catalog_lines(seen)
    assert "rebuilt" in line.message and str(index) in line.message, line
    assert from_catalog(seen) == [False]
    assert [p for p in opened if p.endswith(".gguf")], "the server's setup (its GGUF) was not read to judge"
    seen, opened = _restore_pass(kept, store, facts)
    assert catalog_lines(seen) == [] and from_catalog(seen) == [True]
    # every state of the pass known to the catalog: no setup made, the model's GGUF not read
    assert [p for p in opened if p.endswith(".gguf")] == [], opened
    # another version (an older slotctl's layout): rebuilt, said; the state judged again
    con = sqlite3.connect(index)
    con.execute("PRAGMA user_version=1")
    con.commit()
    con.close()
    seen, _opened = _restore_pass(kept, store, facts)
    (line,) = catalog_lines(seen)
    assert "rebuilt" in line.message and "version 1" in line.message, line
    assert from_catalog(seen) == [False]
    # a directory where the index goes: not used, said at each keep's first look; every state judged
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{index}{suffix}"):
            os.unlink(f"{index}{suffix}")
    index.mkdir()
    for _ in range(2):
        seen, _opened = _restore_pass(kept, store, facts)
        (line,) = catalog_lines(seen)
        assert "not used" in line.message, line
        assert from_catalog(seen) == [False]


# -- a proof that does not spend what it proves (issue 24) ------------------------------------------------


@server
def test_a_recurrent_state_restored_by_keep_is_reused_by_the_next_extending_request(llama_server_bin, tmp_path):
    """mamba at b11434: the proving request (the saved prompt itself) would make the server evaluate the
    whole prompt again (a recurrent state holds its last position only, and b11434 keeps no checkpoint of a
    restored file), so keep does not send it; the next request that extends the prompt then reuses every
    saved token (the server's own counts)."""
    from slotctl.tinymodels import make_kind_model

    model = make_kind_model("mamba", tmp_path / "mamba.gguf")
    with serving(llama_server_bin, model, tmp_path, "mamba", ["-c", "512", "-np", "1"]) as srv:
        store = tmp_path / "store"
        store.mkdir()
        keep = Keep(srv, store, "--every", "0.3")
        try:
            keep.wait_for("up")
            srv.completion(SAMPLE_PROMPT, slot=0, n_predict=6)
            stored = keep.wait_for("stored", 0)
            tokens = tokens_of(Path(stored["details"]["path"]))
            n = len(tokens)
            srv.kill_and_start_again()
            keep.wait_for("restart")
            assert keep.wait_for("restored", 0)["details"]["answer"]["n_restored"] == n
            proof = keep.wait_for("proof", 0)
            p = proof["details"]["proof"]
            assert (p["verdict"], p["n_reused"], p["n_evaluated"]) == ("not_taken", None, None), p
            assert (p["predicted_reused"], p["predicted_evaluated"]) == (0, n) and "recurrent" in p["reason"]
            assert p["extending"]["b11434"]["n_reused"] == n and "not taken" in proof["message"]
            more = tokens + srv.tokenize(" The river Seine", add_special=False)
            assert counts(srv, 0, more) == (n, len(more) - n)
        finally:
            assert keep.stop() == 0

        # restore --prove: the same policy; --prove-anyway sends it, and the server's counts are the prediction's
        (srv.save_dir / "again.bin").write_bytes(Path(stored["details"]["path"]).read_bytes())
        srv.erase(0)
        res = slotctl("restore", "--server", srv.url, "--slot", "0", "again.bin", "--prove", "--slot-dir",
                      srv.save_dir, "--json", *TIMEOUT, code=OK)
        p = json.loads(res.stdout)["proof"]
        assert p["verdict"] == "not_taken" and "--prove-anyway sends it" in p["notes"]
        assert counts(srv, 0, more) == (n, len(more) - n)
        res = slotctl("restore", "--server", srv.url, "--slot", "0", "again.bin", "--prove", "--prove-anyway",
                      "--slot-dir", srv.save_dir, "--json", *TIMEOUT, code=OK)
        p = json.loads(res.stdout)["proof"]
        assert (p["verdict"], p["n_reused"], p["n_evaluated"], p["predicted_evaluated"]) == ("proven", 0, n, n)
        res = slotctl("restore", "--server", srv.url, "--slot", "0", "again.bin", "--prove", "--slot-dir",
                      srv.save_dir, *TIMEOUT, code=OK)
        assert "proof not taken" in " ".join(res.stdout.split()), res.stdout


@server
def test_cp_copies_a_file_with_trailing_bytes_the_server_restores(one, tmp_path):
    """A file b11434 saved, with bytes after it that look like a damaged checkpoint appendix (b11434 reads
    the target only and never looks at them): cp copies it (it refused every damaged structure before), and
    the server restores the copy; a file the server refuses whatever its flags is still refused, its remedy an
    option cp has."""
    import struct

    one.completion(SAMPLE_PROMPT, slot=0, n_predict=3)
    one.save(0, "tail-src.bin")
    n = len(tokens_of(one.save_dir / "tail-src.bin"))
    src = tmp_path / "tail.bin"
    src.write_bytes((one.save_dir / "tail-src.bin").read_bytes() + b"SCKP" + struct.pack("<I", 1) + b"\xff" * 20)
    assert open_slot_file(src).damaged
    doc = json.loads(slotctl("cp", src, one.save_dir / "tail-copy.bin", "--json", code=OK).stdout)
    assert doc["files"][0]["status"] == "copied" and doc["files"][0]["damaged"] is True
    status, answer = one.restore(0, "tail-copy.bin")
    assert status == 200 and answer["n_restored"] == n
    half = tmp_path / "half.bin"
    raw = src.read_bytes()
    half.write_bytes(raw[:len(raw) // 2])
    res = slotctl("cp", half, tmp_path / "half-copy.bin", "--json", code=FAILED)
    err = json.loads(res.stdout)["files"][0]["error"]["message"]
    assert "whatever its flags" in err and "--force copies it" in err and not (tmp_path / "half-copy.bin").exists()
    slotctl("cp", half, tmp_path / "half-copy.bin", "--force", code=OK)


@server
def test_keep_learns_kvu_from_the_servers_save_and_restores_after_a_restart(llama_server_bin, tiny_models, tmp_path):
    """A server of -np 2 -kvu (one KV stream), keep given no -kvu: at start keep saves an idle slot (it holds
    nothing: the stream count alone) and learns -kvu; the server killed and started again, the state keep
    stored (one stream) is restored as it is and proven. Without it keep judged for two streams, converted the
    state into two, and the server refused the restore."""
    with serving(llama_server_bin, tiny_models.target, tmp_path, "kvu",
                 ["-c", "1024", "-np", "2", "-kvu", "-fa", "on"]) as srv:
        store = tmp_path / "store"
        store.mkdir()
        keep = Keep(srv, store, "--every", "0.3")
        try:
            learned = keep.wait_for("learned")
            assert (learned["details"]["source"], learned["details"]["n_stream"]) == ("probe", 1), learned
            assert learned["details"]["kv_unified"] is True, learned
            srv.completion(SAMPLE_PROMPT, slot=0, n_predict=6)
            n = keep.wait_for("stored", 0)["details"]["n_tokens"]
            srv.kill_and_start_again()
            keep.wait_for("restart")
            assert keep.wait_for("restored", 0)["details"]["answer"]["n_restored"] == n
            assert keep.wait_for("proof", 0)["details"]["proof"]["verdict"] == "proven"
        finally:
            assert keep.stop() == 0
        events = [e["event"] for e in keep.seen]
        assert "converted" not in events and "warning" not in events and "error" not in events, keep.seen
        assert not list(srv.save_dir.glob(INCOMING_GLOB))


@server
def test_keep_converts_a_state_saved_before_the_servers_np_changed(kept, tmp_path):
    """A state of one KV stream (saved at -np 1, made here by slotctl convert from the server's own file) in
    the store of a server now at -np 2: keep converts it as migrate does (exact), restores it and the server
    reuses it."""
    from slotctl.keeping.names import model_hash
    from slotctl.live import http as live_http

    kept.completion(SAMPLE_PROMPT + " The convert", slot=1, n_predict=3)
    kept.save(1, "keep-np2.bin")
    tokens = tokens_of(kept.save_dir / "keep-np2.bin")
    n = len(tokens)
    store = tmp_path / "store"
    store.mkdir()
    name = stored_name(1, model_hash(live_http.server_facts(kept.url)), "np1")
    slotctl("convert", kept.save_dir / "keep-np2.bin", "-o", store / name, "-np", "1", code=OK)
    assert open_slot_file(store / name).target.sections[0].n_stream == 1
    kept.erase(0), kept.erase(1)
    keep = Keep(kept, store, "--every", "0.3")
    try:
        converted = keep.wait_for("converted", 1)
        assert any("n_stream 1 -> 2" in c for c in converted["details"]["changes"]), converted
        assert keep.wait_for("restored", 1)["details"]["answer"]["n_restored"] == n
        assert keep.wait_for("proof", 1)["details"]["proof"]["verdict"] == "proven"
    finally:
        assert keep.stop() == 0
    more = tokens + kept.tokenize(" The river Seine", add_special=False)
    assert counts(kept, 1, more) == (n, len(more) - n)
    assert open_slot_file(store / name).target.sections[0].n_stream == 1     # the store's state is left as it was
