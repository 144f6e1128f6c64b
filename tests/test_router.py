"""slotctl through llama-server's router mode (``--router-model``): a real b11434 router (``--models-dir``) with
a tiny model; the rule of what the router routes by is slotctl.live.router's (docs/fleet.md, router mode)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from keeping import Keep, child_env
from serving import TURN1, Router

server = pytest.mark.server


def slotctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slotctl", *args], capture_output=True, text=True, timeout=180,
                          env=child_env())


def call(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def status_of(router_url: str) -> str:
    _, answer = call(router_url, "GET", "/models")
    return next(m["status"]["value"] for m in answer["data"] if m["id"] == "tiny")


class RefusingSlotActions:
    """In front of the real router: every request passed on as it came, but slot actions (POST /slots/N) refused
    as a build that does not route them answers (HTTP 400, the router's own words for an unrouted request;
    llama.cpp #18703, #22373). A stand-in for another build's router, not for llama-server: what it passes on
    is the real router's answer."""

    def __init__(self, upstream: str):
        self.refused = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, status: int, raw: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _pass(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(n) if n else None
                if method == "POST" and self.path.startswith("/slots/"):
                    outer.refused += 1
                    return self._answer(400, json.dumps({"error": {
                        "code": 400, "message": "model name is missing from the request",
                        "type": "invalid_request_error"}}).encode())
                req = urllib.request.Request(upstream + self.path, data=data, method=method,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=120) as resp:
                        self._answer(resp.status, resp.read())
                except urllib.error.HTTPError as e:
                    self._answer(e.code, e.read())

            def do_GET(self):
                self._pass("GET")

            def do_POST(self):
                self._pass("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@server
def test_slots_save_and_restore_through_a_router_by_model_name(llama_server_bin, tiny_models, tmp_path):
    """Against a real b11434 router: without --router-model the one-line router_mode error names the option; with
    it, a model not loaded is said so and not loaded by the read; once loaded, slots, save and restore --prove
    go through the router by the model's name, the saved file byte-identical to one saved by the model's own
    server, the restore proven by the server's own counts; a router that refuses slot actions (a stand-in for
    other builds) gets them sent to the model's own server, found in the router's GET /models, said once."""
    router, slots, _store = Router.of_tiny(llama_server_bin, tiny_models, tmp_path)
    shim = None
    try:
        r = slotctl("slots", "--server", router.url)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r
        assert "router (router mode)" in r.stderr and "--router-model NAME" in r.stderr, r.stderr

        r = slotctl("slots", "--server", router.url, "--router-model", "nosuch")
        assert r.returncode == 2 and "the router has no model named 'nosuch' (GET /models: tiny)" in r.stderr, r
        # not loaded: said, exit 2, and the read did not load it
        r = slotctl("slots", "--server", router.url, "--router-model", "tiny")
        assert r.returncode == 2 and "'tiny' is not loaded" in r.stderr, r
        assert status_of(router.url) == "unloaded"
        r = slotctl("save", "--server", router.url, "--router-model", "tiny", "--slot", "1", "x.bin")
        assert r.returncode == 2 and "not loaded" in r.stderr, r
        assert status_of(router.url) == "unloaded" and not (slots / "x.bin").exists()

        status, answer = call(router.url, "POST", "/completion",
                              {"model": "tiny", "prompt": TURN1, "n_predict": 2, "id_slot": 1, "cache_prompt": True})
        assert status == 200, answer
        n_prompt = answer["timings"]["prompt_n"]

        r = slotctl("slots", "--server", router.url, "--router-model", "tiny", "--json")
        assert r.returncode == 0, r
        doc = json.loads(r.stdout)
        assert doc["total_slots"] == 2 and [s["id"] for s in doc["slots"]] == [0, 1], doc
        assert doc["slots"][1]["n_prompt_tokens"] >= n_prompt, doc["slots"][1]

        r = slotctl("save", "--server", router.url, "--router-model", "tiny", "--slot", "1", "via-router.bin",
                    "--json")
        assert r.returncode == 0, r
        assert json.loads(r.stdout)["answer"]["n_saved"] > 0, r.stdout
        from slotctl.live.http import router_models
        from slotctl.live.router import own_server_url

        own = own_server_url(router.url, "tiny", router_models(router.url))
        status, props = call(own, "GET", "/props")          # the lookup found the model's own server
        assert status == 200 and props["model_path"].endswith("tiny.gguf") and props["total_slots"] == 2, props
        r = slotctl("save", "--server", own, "--slot", "1", "own.bin")
        assert r.returncode == 0, r
        assert (slots / "via-router.bin").read_bytes() == (slots / "own.bin").read_bytes()

        r = slotctl("erase", "--server", router.url, "--router-model", "tiny", "--slot", "1")
        assert r.returncode == 0, r
        _, after = call(own, "GET", "/slots")
        assert after[1]["n_prompt_tokens"] == 0, after[1]          # erased through the router, by the model's name
        r = slotctl("restore", "--server", router.url, "--router-model", "tiny", "--slot", "1", "via-router.bin",
                    "--slot-dir", str(slots), "--prove", "--json")
        assert r.returncode == 0, r
        doc = json.loads(r.stdout)
        assert doc["answer"]["n_restored"] > 0, doc
        assert doc["proof"]["verdict"] == "proven", doc["proof"]
        # the proving request's own timings: every token reused but the last
        assert doc["proof"]["n_evaluated"] <= 1 and doc["proof"]["n_reused"] >= n_prompt - 1, doc["proof"]

        # a router that does not route slot actions: sent to the model's own server, said once
        shim = RefusingSlotActions(router.url)
        (slots / "via-router.bin").unlink()
        r = slotctl("save", "--server", shim.url, "--router-model", "tiny", "--slot", "1", "fallback.bin")
        assert r.returncode == 0, r
        assert shim.refused == 1 and (slots / "fallback.bin").read_bytes() == (slots / "own.bin").read_bytes()
        assert r.stderr.count(f"sent to the model's own server, {own} ('tiny': its port") == 1, r.stderr
        # a second action of one run (the restore, then its proof's) says it no more: one process, keep
        r = slotctl("restore", "--server", shim.url, "--router-model", "tiny", "--slot", "1", "fallback.bin")
        assert r.returncode == 0 and r.stderr.count("own server") == 1, r
    finally:
        if shim is not None:
            shim.stop()
        router.stop()


def wait_status(router_url: str, want: str) -> None:
    import time

    for _ in range(600):
        if status_of(router_url) == want:
            return
        time.sleep(0.1)
    raise AssertionError(f"tiny never became {want}: {status_of(router_url)}")


@server
def test_keep_across_a_router_unload_and_load_by_model_name(llama_server_bin, tiny_models, tmp_path):
    """keep --save-all through a real router, the model named in the configuration file's server entry; the
    router unloads the model and loads it again (its own server on a port picked anew); keep --restore-all
    through the router (--router-model) restores and proves the slot; slots --config lists it by the model."""
    router, slots, store = Router.of_tiny(llama_server_bin, tiny_models, tmp_path)
    try:
        config = tmp_path / "keep.toml"
        config.write_text(f'[[servers]]\nname = "r"\nurl = "{router.url}"\nmodel = "tiny"\nslot_dir = "{slots}"\n'
                          f'store = "{store}"\n')
        status, answer = call(router.url, "POST", "/completion",
                              {"model": "tiny", "prompt": TURN1, "n_predict": 2, "id_slot": 1, "cache_prompt": True})
        assert status == 200, answer
        r = slotctl("keep", "--config", str(config), "--save-all", "--json", "--timeout", "60")
        assert r.returncode == 0, r
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        stored = [e for e in lines if e["event"] == "stored"]
        assert [e["slot"] for e in stored] == [1], lines

        r = slotctl("slots", "--config", str(config), "--json")
        assert r.returncode == 0, r
        (doc,) = json.loads(r.stdout)["servers"]
        assert doc["error"] is None and doc["total_slots"] == 2, doc

        assert call(router.url, "POST", "/models/unload", {"model": "tiny"})[0] == 200
        wait_status(router.url, "unloaded")
        r = slotctl("keep", "--server", router.url, "--router-model", "tiny", "--slot-dir", str(slots), "--store",
                    str(store), "--restore-all", "--json", "--timeout", "60")
        assert r.returncode == 2 and "'tiny' is not loaded" in r.stdout, r     # down, as a server that is not there
        assert not [json.loads(x) for x in r.stdout.splitlines() if json.loads(x)["event"] == "restored"], r.stdout
        assert status_of(router.url) == "unloaded"          # keep's looks did not load it

        assert call(router.url, "POST", "/models/load", {"model": "tiny"})[0] == 200
        wait_status(router.url, "loaded")
        r = slotctl("keep", "--server", router.url, "--router-model", "tiny", "--slot-dir", str(slots), "--store",
                    str(store), "--restore-all", "--json", "--timeout", "60")
        assert r.returncode == 0, r
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        restored = next(e for e in lines if e["event"] == "restored" and e["slot"] == 1)["details"]
        assert restored["name"] == stored[0]["details"]["name"], lines
        proof = next(e for e in lines if e["event"] == "proof" and e["slot"] == 1)["details"]["proof"]
        assert (proof["verdict"], proof["n_reused"]) == ("proven", stored[0]["details"]["n_tokens"] - 1), proof
    finally:
        router.stop()


@server
def test_a_keeper_of_a_routers_model_follows_its_unloads_and_loads(llama_server_bin, tiny_models, tmp_path):
    """keep --router-model as a daemon: the model not loaded is down (and left unloaded); loaded by a request it
    is up and the slot is stored; unloaded and loaded again by the router (a new process on a new port), keep
    sees it come back and restores the slot, proven by the server's own counts."""
    from types import SimpleNamespace


    router, slots, store = Router.of_tiny(llama_server_bin, tiny_models, tmp_path)
    keep = None
    try:
        keep = Keep(SimpleNamespace(url=router.url, save_dir=slots), store, "--every", "0.3", "--router-model", "tiny")
        down = keep.wait_for("down")
        assert "'tiny' is not loaded" in down["message"], down
        assert status_of(router.url) == "unloaded"
        status, answer = call(router.url, "POST", "/completion",
                              {"model": "tiny", "prompt": TURN1, "n_predict": 2, "id_slot": 1, "cache_prompt": True})
        assert status == 200, answer
        keep.wait_for("restart")
        stored = keep.wait_for("stored", 1)["details"]

        assert call(router.url, "POST", "/models/unload", {"model": "tiny"})[0] == 200
        keep.wait_for("down")
        assert call(router.url, "POST", "/models/load", {"model": "tiny"})[0] == 200
        keep.wait_for("restart")
        restored = keep.wait_for("restored", 1)["details"]
        assert restored["name"] == stored["name"], keep.seen
        proof = keep.wait_for("proof", 1)["details"]["proof"]
        assert (proof["verdict"], proof["n_reused"]) == ("proven", stored["n_tokens"] - 1), proof
    finally:
        if keep is not None:
            assert keep.stop() == 0, keep.seen
        router.stop()
