"""``slotctl serve``: a prompt cache in front of a real llama-server b11434 (docs/serve.md).

serve runs as a process of its own (``python -m slotctl serve ... --json``: its signals and its event lines
are real), in front of real llama-server processes with a tiny model; the store is a directory or a real
SeaweedFS bucket. Every count of evaluated prompt tokens is the server's own ``timings.prompt_n``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import start_server
from llama_server import LlamaServer, free_port
from seaweed import BUCKET
from serving import ARGS, TURN1, TURN2_EXTRA, Serve, call, complete, serving, stream_begun
from slotctl.tinymodels import SAMPLE_PROMPT

server = pytest.mark.server


def left_after(directory: Path, pattern: str, timeout: float = 60) -> list[Path]:
    """What of ``pattern`` is in ``directory`` once none is, or ``timeout`` passed: serve counts a save
    (``saves``, ``saves_deduplicated``) before it removes the save's working file."""
    deadline = time.monotonic() + timeout
    while (left := list(directory.glob(pattern))) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def erase_all(srv: LlamaServer) -> None:
    for i in range(2):
        srv.erase(i)


# -- pass-through ----------------------------------------------------------------------------------------


@server
def test_every_endpoint_passes_through_unchanged(llama, tmp_path):
    with serving(llama, llama.save_dir) as s:
        for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                                   ("GET", "/props", None), ("POST", "/tokenize", {"content": "hello world"}),
                                   ("GET", "/no/such/endpoint", None), ("POST", "/detokenize", {"tokens": [1, 2]})):
            direct = call(llama.url, method, path, body)
            via = call(s.url, method, path, body)
            assert via[0] == direct[0], path
            assert via[2] == direct[2], path
            assert via[1].get("Content-Type") == direct[1].get("Content-Type"), path
        # a redirect or an error keeps its status; query strings reach the server as sent
        assert call(s.url, "GET", "/slots?fail_on_no_slot=1")[0] == call(llama.url, "GET", "/slots?fail_on_no_slot=1")[0]


@server
def test_a_completion_through_serve_is_the_servers_answer(llama, tmp_path):
    erase_all(llama)
    direct = complete(llama.url, SAMPLE_PROMPT, id_slot=0)
    erase_all(llama)
    with serving(llama, llama.save_dir, str(tmp_path)) as s:
        via = complete(s.url, SAMPLE_PROMPT)
        assert via["content"] == direct["content"]
        assert via["timings"]["prompt_n"] == direct["timings"]["prompt_n"]
        c = s.wait_for("saves", 1)
        assert c["cached"] == 1 and c["saves"] == 1
        # stored under the model's hash and the token prefix, once per content
        stored = sorted(p.name for p in tmp_path.glob("slot*.bin"))
        assert len(stored) == 1
        assert complete(s.url, SAMPLE_PROMPT)["content"] == direct["content"]   # the same tokens: stored once
        c = s.wait_for("saves_deduplicated", 1)
        assert c["saves_deduplicated"] == 1 and c["saves"] == 1
        assert len(list(tmp_path.glob("slot*.bin"))) == 1
        assert not left_after(llama.save_dir, "serve-slot*-incoming-*.bin")   # the working file is removed


@server
def test_streaming_passes_through_event_by_event(llama, tmp_path):
    erase_all(llama)
    direct = complete(llama.url, SAMPLE_PROMPT, n_predict=16)
    with serving(llama, llama.save_dir, str(tmp_path)) as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/completion", json.dumps({"prompt": SAMPLE_PROMPT, "n_predict": 16, "temperature": 0,
                                                         "stream": True}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
        conn.close()
        assert len(events) > 2 and events[-1]["stop"] is True
        assert "".join(e.get("content", "") for e in events) == direct["content"]
        # OpenAI-style streaming too: data lines, then [DONE]
        status, h, raw = call(s.url, "POST", "/v1/completions", {"prompt": SAMPLE_PROMPT, "max_tokens": 16,
                                                                 "temperature": 0, "stream": True})
        lines = [ln for ln in raw.decode().splitlines() if ln.startswith("data: ")]
        assert status == 200 and lines[-1] == "data: [DONE]"
        text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1])
        assert text == direct["content"]


@server
def test_chat_completions_are_cached(llama, tmp_path):
    messages = [{"role": "user", "content": SAMPLE_PROMPT}]
    erase_all(llama)
    status, _h, direct = call(llama.url, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 8,
                                                                          "temperature": 0})
    assert status == 200, direct
    erase_all(llama)
    with serving(llama, llama.save_dir, str(tmp_path)) as s:
        status, _h, via = call(s.url, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 8,
                                                                       "temperature": 0})
        assert status == 200
        assert json.loads(via)["choices"][0]["message"] == json.loads(direct)["choices"][0]["message"]
        assert s.wait_for("saves", 1)["cached"] == 1
        # the stored state begins with the tokens serve computed for the prompt (apply-template + tokenize)
        from slotctl.slotfile import open_slot_file

        (name,) = [p for p in tmp_path.glob("slot*.bin")]
        _st, _h, tpl = call(llama.url, "POST", "/apply-template", {"messages": messages})
        want = llama.post("/tokenize", {"content": json.loads(tpl)["prompt"], "add_special": True})[1]["tokens"]
        assert [int(t) for t in open_slot_file(name).tokens.tokens][:len(want)] == want


# -- bad input ---------------------------------------------------------------------------------------------


@server
def test_bad_input_goes_to_the_server_untouched(llama, tmp_path):
    with serving(llama, llama.save_dir, str(tmp_path)) as s:
        for raw in (b"{not json", b"[1, 2, 3]", b'"a string"', b"", b'{"prompt": {"a": 1}}',
                    b'{"prompt": "x", "id_slot": "zero", "n_predict": 1}', b'{"prompt": ["a", "b"], "n_predict": 1}'):
            direct = call(llama.url, "POST", "/completion", raw=raw)
            via = call(s.url, "POST", "/completion", raw=raw)
            assert via[0] == direct[0], raw
            if direct[0] != 200:
                assert via[2] == direct[2], raw
        # unknown fields reach the server as sent
        body = {"prompt": SAMPLE_PROMPT, "n_predict": 2, "temperature": 0, "no_such_field": [1, {"x": None}]}
        assert call(s.url, "POST", "/completion", body)[0] == call(llama.url, "POST", "/completion", body)[0]
        assert s.proc.poll() is None


@server
def test_upstream_down_is_a_502_with_a_json_error(tmp_path):
    class Down:
        url = f"http://127.0.0.1:{free_port()}"

    with serving(Down, tmp_path) as s:
        for path in ("/completion", "/health"):
            status, h, raw = call(s.url, "POST" if path == "/completion" else "GET", path,
                                  {"prompt": "x"} if path == "/completion" else None)
            assert status == 502 and h["Content-Type"].startswith("application/json")
            assert "does not answer" in json.loads(raw)["error"]["message"]
        assert s.stats()["upstream_errors"] == 2


@server
def test_a_store_down_means_uncached_not_failed(llama, tmp_path):
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "y", "AWS_REGION": "us-east-1", "HOME": str(tmp_path)}
    erase_all(llama)
    direct = complete(llama.url, SAMPLE_PROMPT)
    with serving(llama, llama.save_dir, "s3://nobucket/serve/", env=env) as s:
        assert s.events_named("identified")     # the model hashed (a thread of its own): the store is asked
        for _ in range(2):
            assert complete(s.url, SAMPLE_PROMPT)["content"] == direct["content"]
        # no lease (the store never answered): uncached, said once; nothing saved (it could not be stored)
        (off,) = s.events_named("cache")
        assert off["details"]["state"] == "off" and "no lease" in off["details"]["reason"]
        c = s.stats()
        assert c["cached"] == 2 and c["saves"] == 0 and c["restores"] == 0
        assert c["uncached"] + c["slot_hit"] == 2 and c["uncached"] >= 1
        assert not list(llama.save_dir.glob("serve-slot*-incoming-*.bin"))


@server
def test_a_client_that_goes_away_mid_stream_frees_the_slot(llama, tmp_path):
    with serving(llama, llama.save_dir, str(tmp_path)) as s:
        # large events (200 probabilities a token): the answer is far more than the sockets' buffers hold, so
        # the server is still generating (or its answer still on its way) when the client goes
        sock, _got = stream_begun(s.port, {"prompt": SAMPLE_PROMPT, "n_predict": 2000, "temperature": 0,
                                           "stream": True, "id_slot": 1, "ignore_eos": True, "n_probs": 200})
        sock.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            slots = llama.get("/slots")[1]
            if not slots[1]["is_processing"]:
                break
            time.sleep(0.1)
        assert not slots[1]["is_processing"], "the server still generates for a client that went away"
        assert s.wait_for("client_disconnects", 1)["client_disconnects"] == 1
        # the slot is serve's to give again
        assert complete(s.url, SAMPLE_PROMPT, id_slot=1)["id_slot"] == 1


@server
def test_requests_to_different_slots_run_in_parallel(llama, tmp_path):
    # The tiny model answers 400 tokens in about 0.1 s, so one pair of requests may finish before a poll of
    # /slots sees both at work. Pairs are sent until one is seen overlapping: serve holding the second
    # request back until the first is done would never show it, however many pairs.
    with serving(llama, llama.save_dir, str(tmp_path)) as s:
        seen_both = threading.Event()
        for attempt in range(8):
            results: dict = {}

            def run(i: int) -> None:
                results[i] = complete(s.url, f"{SAMPLE_PROMPT} {attempt} {i}", n_predict=400, ignore_eos=True)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                slots = llama.get("/slots")[1]
                if all(e["is_processing"] for e in slots):
                    seen_both.set()
            for t in threads:
                t.join()
            assert {results[0]["id_slot"], results[1]["id_slot"]} == {0, 1}
            if seen_both.is_set():
                break
        assert seen_both.is_set(), "the two requests never ran at the same time"


@server
def test_the_api_key_is_passed_on_and_never_logged(llama_server_bin, tiny_models, tmp_path):
    key = "sk-serve-secret-4242"
    (tmp_path / "slots").mkdir()
    srv = start_server(llama_server_bin, tiny_models.target, tmp_path, "keyed", args=ARGS,
                       slot_save_path=tmp_path / "slots", api_key=key)
    try:
        (tmp_path / "store").mkdir()
        with serving(srv, tmp_path / "slots", str(tmp_path / "store"), env={"LLAMA_API_KEY": ""}) as s:
            assert call(s.url, "POST", "/completion", {"prompt": "x", "n_predict": 1})[0] == 401
            status, _h, raw = call(s.url, "POST", "/completion", {"prompt": SAMPLE_PROMPT, "n_predict": 2},
                                   headers={"Authorization": f"Bearer {key}"})
            assert status == 200, raw
            assert s.wait_for("saves", 1)["saves"] == 1     # serve's own requests used the client's key
        assert key not in s.output()
    finally:
        srv.stop()


# -- the cache across a restart ------------------------------------------------------------------------------


def conversation(url: str, turns: list[str], **extra) -> list[dict]:
    out, prompt = [], ""
    for t in turns:
        prompt += t
        a = complete(url, prompt, n_predict=8, **extra)
        out.append(a)
        prompt += a["content"]
    return out


def alone(srv: LlamaServer, turns: list[str]) -> list[dict]:
    """A conversation's answers from the server alone, each turn in a slot that holds nothing (all erased
    after)."""
    out, prompt = [], ""
    for t in turns:
        erase_all(srv)
        prompt += t
        a = complete(srv.url, prompt, id_slot=0)
        out.append(a)
        prompt += a["content"]
    erase_all(srv)
    return out


@server
def test_a_returning_turn_is_restored_after_a_restart(fresh, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    turns = [TURN1, TURN2_EXTRA]
    reference = alone(fresh, turns)
    with serving(fresh, fresh.save_dir, str(store)) as s:
        first = complete(s.url, TURN1)
        assert first["content"] == reference[0]["content"]
        s.wait_for("saves", 1)
        fresh.kill_and_start_again()
        second = complete(s.url, TURN1 + first["content"] + TURN2_EXTRA)
        assert second["content"] == reference[1]["content"]
        c = s.stats()
        assert c["restores"] == 1, s.output()
        # the server's own count: only the new turn's tokens (and the last of the state) evaluated
        assert second["timings"]["prompt_n"] < reference[1]["timings"]["prompt_n"] // 4
        assert second["timings"]["cache_n"] >= first["timings"]["prompt_n"]
        assert s.events_named("restored")


@server
def test_a_returning_turn_after_a_restart_is_restored_by_the_verdict_made_when_its_state_was_stored(fresh, tmp_path):
    """A state is judged when it is stored, off the request path; the server's restart forgets no verdict (it
    reports no speculative types until its first task: the same setup as "none"): the returning turn after the
    restart is restored without its state judged again (the ``restored`` event's ``catalog``: not opened to
    judge it). Judged when the turn came, it cost that turn 0.3-0.7 s (validate's read, the model's GGUF read
    for the setup) of its time to first token, more than the prefill it spared on the tiny model."""
    store = tmp_path / "store"
    store.mkdir()
    with serving(fresh, fresh.save_dir, str(store)) as s:
        first = complete(s.url, TURN1)
        s.wait_for("saves", 1)
        fresh.kill_and_start_again()
        complete(s.url, TURN1 + first["content"] + TURN2_EXTRA)
        s.wait_for("saves", 2)
        (ev,) = s.events_named("restored")
        assert ev["details"].get("catalog") is True, s.output()


class Relay:
    """A TCP relay between serve and a server that notes the request line of every request serve sends
    (its method and path, in the order they went): what serve asked the server, and when."""

    def __init__(self, upstream: LlamaServer):
        self.target = ("127.0.0.1", int(upstream.url.rsplit(":", 1)[1]))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests: list[tuple[str, str]] = []
        self.connections = 0
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def paths(self, since: int = 0) -> list[str]:
        with self._lock:
            return [p.partition("?")[0] for _m, p in self.requests[since:]]

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            with self._lock:
                self.connections += 1
                self._open += [client, up]
            threading.Thread(target=self._pipe, args=(client, up, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if requests:
                    # aiohttp writes a request's line and headers in one write
                    line = chunk.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
                    if len(line) == 3 and line[2].startswith("HTTP/1."):
                        with self._lock:
                            self.requests.append((line[0], line[1]))
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def drop(self) -> None:
        """Every connection through the relay closed, as a server closes its idle keep-alive connections."""
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._open = []

    def close(self) -> None:
        self.listener.close()
        self.drop()


@server
def test_a_returning_turn_in_its_own_slot_goes_before_its_tokenize(fresh, tmp_path):
    """The shortcut (docs/serve.md): a returning turn whose text begins with the text serve last sent into
    its slot, no stored state longer, goes to that slot without /tokenize first (asked after the answer); the
    answer is the server's own, its prefix reused. A text that begins otherwise is tokenized first."""
    store = tmp_path / "store"
    store.mkdir()
    reference = alone(fresh, [TURN1, TURN2_EXTRA])
    relay = Relay(fresh)
    try:
        with serving(relay, fresh.save_dir, str(store)) as s:
            first = complete(s.url, TURN1)
            s.wait_for("saves", 1)
            mark = len(relay.requests)
            second = complete(s.url, TURN1 + first["content"] + TURN2_EXTRA)
            c = s.wait_for("saves", 2)
            asked = relay.paths(mark)
            assert c["matched_by_text"] == 1 and c["restores"] == 0, s.output()
            assert "/completion" in asked and "/tokenize" in asked, asked
            assert asked.index("/completion") < asked.index("/tokenize"), asked
            assert second["content"] == reference[1]["content"]
            assert second["timings"]["cache_n"] >= first["timings"]["prompt_n"]
            # serve's idle connections closed (as a server or the client's pool closes idle ones): its next
            # request makes a new one, as after a restart; /slots read again shows the same server, slots and
            # all, and the turn still goes by its text
            relay.drop()
            time.sleep(0.5)
            mark, conns = len(relay.requests), relay.connections
            complete(s.url, TURN1 + first["content"] + TURN2_EXTRA + second["content"] + TURN2_EXTRA)
            c = s.wait_for("saves", 3)
            asked = relay.paths(mark)
            assert relay.connections > conns
            assert c["matched_by_text"] == 2 and c["restores"] == 0, s.output()
            assert "/slots" in asked and asked.index("/completion") < asked.index("/tokenize"), asked
            # a text that does not begin with a slot's own: its tokens first
            mark = len(relay.requests)
            complete(s.url, TURN2_EXTRA + TURN1)
            s.wait_for("saves", 4)
            asked = relay.paths(mark)
            assert asked.index("/tokenize") < asked.index("/completion"), asked
            assert s.stats()["matched_by_text"] == 2
    finally:
        relay.close()


@server
def test_two_conversations_take_two_slots(fresh, tmp_path):
    """Two conversations through serve before a server of two slots, turns interleaved: the second takes the
    empty slot, not the first's (they share a BOS token and no more), so each returning turn finds its own
    slot: no restore, the server reusing each conversation's prefix."""
    store = tmp_path / "store"
    store.mkdir()
    other = "A different story altogether begins here, with other words. " + TURN1
    with serving(fresh, fresh.save_dir, str(store)) as s:
        a1 = complete(s.url, TURN1)
        s.wait_for("saves", 1)
        b1 = complete(s.url, other)
        s.wait_for("saves", 2)
        assert a1["id_slot"] != b1["id_slot"], (a1["id_slot"], b1["id_slot"])
        a2 = complete(s.url, TURN1 + a1["content"] + TURN2_EXTRA)
        b2 = complete(s.url, other + b1["content"] + TURN2_EXTRA)
        c = s.wait_for("saves", 4)
        assert c["restores"] == 0, s.output()
        assert (a2["id_slot"], b2["id_slot"]) == (a1["id_slot"], b1["id_slot"])
        assert a2["timings"]["cache_n"] >= a1["timings"]["prompt_n"] - 1, a2["timings"]
        assert b2["timings"]["cache_n"] >= b1["timings"]["prompt_n"] - 1, b2["timings"]


class Prefixed(LlamaServer):
    """A real llama-server that serves under a path (``--api-prefix``), as a llama-swap upstream's model is
    reached under ``/upstream/MODEL``: its URL includes the path."""

    PREFIX = "/upstream/tiny"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.PREFIX}"


@server
def test_an_upstream_under_a_path_is_served_and_cached(llama_server_bin, tiny_models, tmp_path):
    """serve before a server reached under a path (``--upstream http://HOST:PORT/upstream/tiny``, the shape of a
    llama-swap model's URL): a client's path goes under it (or is taken as it is when the client already gave
    it), and the cache works as before: a returning turn after a restart is restored."""
    (tmp_path / "slots").mkdir()
    (tmp_path / "store").mkdir()
    srv = Prefixed(llama_server_bin, tiny_models.target, args=[*ARGS, "--api-prefix", Prefixed.PREFIX],
                   slot_save_path=tmp_path / "slots", log_path=tmp_path / "prefixed.log")
    with srv:
        with serving(srv, tmp_path / "slots", str(tmp_path / "store")) as s:
            for path in ("/health", Prefixed.PREFIX + "/health"):
                status, _h, raw = call(s.url, "GET", path)
                assert status == 200 and json.loads(raw)["status"] == "ok", (path, status, raw)
            first = complete(s.url, TURN1)
            s.wait_for("saves", 1)
            srv.kill_and_start_again()
            p2 = TURN1 + first["content"] + TURN2_EXTRA
            second = complete(s.url, p2, path=Prefixed.PREFIX + "/completion")
            assert s.wait_for("saves", 2)["restores"] == 1, s.output()
        direct = complete(srv.url, p2, id_slot=1, cache_prompt=False)
    assert second["content"] == direct["content"]
    assert second["timings"]["prompt_n"] < direct["timings"]["prompt_n"] // 4


@server
def test_a_state_the_verdict_refuses_is_never_sent(fresh, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    with serving(fresh, fresh.save_dir, str(store)) as s:
        complete(s.url, TURN1)
        s.wait_for("saves", 1)
    (state,) = store.glob("slot*.bin")
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])      # its payload cut short: refused or aborts, not restores
    fresh.kill_and_start_again()
    with serving(fresh, fresh.save_dir, str(store)) as s:
        a = complete(s.url, TURN1 + TURN2_EXTRA)
        c = s.stats()
        # a restore sent is counted as done or failed: neither
        assert c["restores"] == 0 and c["restore_failures"] == 0, s.output()
        assert c["restores_refused_by_verdict"] >= 1, s.output()
        assert a["timings"]["cache_n"] == 0


@server
def test_two_serve_processes_share_one_s3_store(llama_server_bin, tiny_models, tmp_path, seaweed):
    """A conversation begun behind one serve continues behind another (another server) with its prefix
    restored from the S3 store."""
    env = {**seaweed.env(), "HOME": str(seaweed.dir)}
    store = f"s3://{BUCKET}/serve-{tmp_path.name}/"
    servers = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        servers.append(start_server(llama_server_bin, tiny_models.target, tmp_path, name, args=ARGS,
                                    slot_save_path=tmp_path / name))
    try:
        a, b = servers
        with serving(a, tmp_path / "a", store, env=env) as sa, serving(b, tmp_path / "b", store, env=env) as sb:
            first = complete(sa.url, TURN1)
            sa.wait_for("saves", 1)
            second = complete(sb.url, TURN1 + first["content"] + TURN2_EXTRA)
            assert sb.stats()["restores"] == 1, sb.output()
            direct = complete(b.url, TURN1 + first["content"] + TURN2_EXTRA, id_slot=1, cache_prompt=False)
            assert second["content"] == direct["content"]
            assert second["timings"]["prompt_n"] < direct["timings"]["prompt_n"] // 4
    finally:
        for srv in servers:
            srv.stop()


# -- states of another -np/-kvu, converted --------------------------------------------------------------------


@contextlib.contextmanager
def servers(llama_server_bin, tiny_models, tmp_path, **args):
    """Real llama-servers by name, each with ``--slot-save-path`` ``tmp_path/NAME``, stopped after."""
    started = []
    try:
        for name, a in args.items():
            (tmp_path / name).mkdir()
            started.append(start_server(llama_server_bin, tiny_models.target, tmp_path, name, args=a,
                                        slot_save_path=tmp_path / name))
        yield started
    finally:
        for srv in started:
            srv.stop()


def left_in(slot_dir: Path) -> list[str]:
    """What serve left in a server's slot directory (with an s3:// store: nothing once its saves are stored)."""
    return sorted(p.name for p in slot_dir.iterdir())


@server
def test_a_conversation_moves_between_servers_of_other_np_and_kvu(llama_server_bin, tiny_models, tmp_path, seaweed):
    """Serve A before a server of -np 2 (two KV streams), serve B before one of -np 3 -kvu (one stream), one
    SeaweedFS bucket: a conversation begun behind A continues behind B with its prefix restored (A's state
    converted for B), then behind A again (B's state converted back), each answer the server's own alone."""
    env = {**seaweed.env(), "HOME": str(seaweed.dir)}
    store = f"s3://{BUCKET}/serve-{tmp_path.name}/"
    b_args = ["-c", "1024", "-np", "3", "-kvu", "-fa", "on"]
    turn3 = " The end came, and with it a last word."
    with servers(llama_server_bin, tiny_models, tmp_path, a=ARGS, b=b_args) as (a, b):
        # the tiny model's prefill is cheaper than an S3 download: restored all the same (--restore-policy tokens)
        with serving(a, tmp_path / "a", store, "--restore-policy", "tokens", env=env) as sa, \
                serving(b, tmp_path / "b", store, "-kvu", "--restore-policy", "tokens", env=env) as sb:
            first = complete(sa.url, TURN1)
            sa.wait_for("saves", 1)
            p2 = TURN1 + first["content"] + TURN2_EXTRA
            second = complete(sb.url, p2)
            cb = sb.wait_for("saves", 1)
            assert cb["restores"] == 1 and cb["conversions"] == 1 and cb["conversion_failures"] == 0, sb.output()
            (ev,) = sb.events_named("restored")
            assert ev["details"]["converted"] and "stream" in " ".join(ev["details"]["converted"]), ev
            p3 = p2 + second["content"] + turn3
            time.sleep(2.5)     # serve A lists the store again at most every 2 s: B's state is there by then
            third = complete(sa.url, p3)
            ca = sa.wait_for("saves", 2)
            assert ca["restores"] == 1 and ca["conversions"] == 1 and ca["conversion_failures"] == 0, sa.output()
        # nothing left in either slot directory: the downloads and the converted files removed
        assert left_in(tmp_path / "a") == [] and left_in(tmp_path / "b") == []
        # each server alone, the slot holding nothing: the same greedy answers, the whole prompt evaluated
        alone_b = complete(b.url, p2, id_slot=0, cache_prompt=False)
        alone_a = complete(a.url, p3, id_slot=0, cache_prompt=False)
    assert second["content"] == alone_b["content"]
    assert third["content"] == alone_a["content"]
    # the servers' own counts: the restored prefix was reused
    assert second["timings"]["prompt_n"] < alone_b["timings"]["prompt_n"] // 4, (second["timings"], alone_b["timings"])
    assert third["timings"]["prompt_n"] < alone_a["timings"]["prompt_n"] // 4, (third["timings"], alone_a["timings"])
    assert second["timings"]["cache_n"] >= first["timings"]["prompt_n"]


# -- the server's -kvu, -ctk, -ctv learnt from its own saves -------------------------------------------------

#: two conversations that take a conversation's slot (-np 2), so that it comes back to a slot holding another's
OTHERS = (" ".join(["A different story, told for the second time, with other words in it."] * 6),
          " ".join(["Yet another tale: the third one, of ships and the sea and the long way home."] * 6))


def returning(url: str, s: Serve, saves: int = 0) -> tuple[dict, str, dict]:
    """A conversation's first turn, two other conversations (its slot given to another), then its second turn
    behind serve ``s``: (the first answer, the second turn's prompt, the second answer)."""
    first = complete(url, TURN1)
    s.wait_for("saves", saves + 1)
    for i, other in enumerate(OTHERS):
        complete(url, other)
        s.wait_for("saves", saves + 2 + i)
    prompt = TURN1 + first["content"] + TURN2_EXTRA
    return first, prompt, complete(url, prompt)


@server
def test_serve_learns_kvu_from_a_save_of_an_idle_slot(llama_server_bin, tiny_models, tmp_path):
    """A server of -np 2 -kvu (one KV stream for both slots), serve given no -kvu: at start-up serve saves a
    slot that holds nothing (its stream count alone), learns -kvu from it, and a conversation that comes back
    after two others took its slot is restored as it was saved (no conversion), the server reusing its prefix.
    Without it serve judged for two streams, converted the state into them, and the server refused it."""
    store = tmp_path / "store"
    store.mkdir()
    with servers(llama_server_bin, tiny_models, tmp_path, k=["-c", "1024", "-np", "2", "-kvu", "-fa", "on"]) as (k,):
        with serving(k, tmp_path / "k", str(store)) as s:
            (ev,) = s.events_named("learned")
            assert ev["details"]["source"] == "probe" and ev["details"]["n_stream"] == 1, ev
            assert ev["details"]["kv_unified"] is True and ev["details"]["cache_type_k"] is None, ev
            _first, prompt, second = returning(s.url, s)
            c = s.stats()
            assert c["restores"] == 1 and c["restore_failures"] == 0 and c["conversions"] == 0, s.output()
            (restored,) = s.events_named("restored")
            assert "converted" not in restored["details"], restored
            assert not s.events_named("warning", timeout=0)
        assert [n for n in left_in(tmp_path / "k") if "probe" in n] == []
        alone = complete(k.url, prompt, id_slot=0, cache_prompt=False)
    assert second["content"] == alone["content"]
    assert second["timings"]["prompt_n"] < alone["timings"]["prompt_n"] // 4, (second["timings"], alone["timings"])


@server
def test_serve_learns_cache_types_and_the_servers_flags_win_over_wrong_ones(llama_server_bin, tiny_models,
                                                                             tmp_path):
    """A server of -ctk q8_0 -ctv q8_0, serve given neither: the slots hold nothing at start-up (a save says
    no type), so serve learns the types from its first save after a request; a conversation that comes back
    is restored (before: judged for f16 caches, refused as a lossy conversion). A second serve given -kvu -ctk
    f16 -ctv f16, wrongly, finds every slot holding cells at start-up, learns from the save of the one holding
    the fewest, says each wrong flag once (a warning event) and uses the server's: a returning conversation is
    restored."""
    store = tmp_path / "store"
    store.mkdir()
    q8 = ["-c", "1024", "-np", "2", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
    with servers(llama_server_bin, tiny_models, tmp_path, q=q8) as (q,):
        with serving(q, tmp_path / "q", str(store)) as s:
            (probe,) = s.events_named("learned")
            assert probe["details"]["kv_unified"] is False and probe["details"]["n_stream"] == 2, probe
            assert probe["details"]["cache_type_k"] is None, probe
            _first, prompt, second = returning(s.url, s)
            learned = s.events_named("learned", 2)
            assert learned[1]["details"]["source"] == "save", learned
            assert (learned[1]["details"]["cache_type_k"], learned[1]["details"]["cache_type_v"]) == ("q8_0", "q8_0")
            c = s.stats()
            assert c["restores"] == 1 and c["restore_failures"] == 0, s.output()
            assert c["restores_refused_by_verdict"] == 0, s.output()
            assert not s.events_named("warning", timeout=0)
        alone = complete(q.url, prompt, id_slot=0, cache_prompt=False)
        assert second["content"] == alone["content"]
        assert second["timings"]["prompt_n"] < alone["timings"]["prompt_n"] // 4, (second["timings"], alone["timings"])

        complete(q.url, SAMPLE_PROMPT, id_slot=1)      # every slot holds cells: the start-up save says the types
        with serving(q, tmp_path / "q", str(store), "-kvu", "-ctk", "f16", "-ctv", "f16") as s:
            warned = s.events_named("warning", 3)
            assert {(w["details"]["flag"], w["details"]["given"], w["details"]["server"]) for w in warned} == {
                ("-kvu", True, False), ("-ctk", "f16", "q8_0"), ("-ctv", "f16", "q8_0")}, s.output()
            (ev,) = s.events_named("learned")
            assert ev["details"]["source"] == "probe" and ev["details"]["cache_type_k"] == "q8_0", ev
            back = OTHERS[0] + " And so it ended, far from the sea."
            again = complete(s.url, back)
            c = s.wait_for("saves", 1)
            assert c["restores"] == 1 and c["restore_failures"] == 0, s.output()
            assert len(s.events_named("warning")) == 3, s.output()     # said once, not at each save
        alone = complete(q.url, back, id_slot=0, cache_prompt=False)
    assert again["content"] == alone["content"]
    assert again["timings"]["prompt_n"] < alone["timings"]["prompt_n"] // 4, (again["timings"], alone["timings"])


@server
def test_serve_learns_again_when_the_server_restarts_with_other_flags(llama_server_bin, tiny_models, tmp_path):
    """The server (-np 2: two KV streams) killed and started again with -kvu on the same port, behind the same
    serve: serve sees the restart (GET /slots' task ids count from 0 again), saves an idle slot before it
    judges the returning conversation's state, learns -kvu, converts the state saved with two streams into
    one and restores it. Without it serve judged for the server it knew, sent the state as it was, and the
    server refused it."""
    store = tmp_path / "store"
    store.mkdir()
    with servers(llama_server_bin, tiny_models, tmp_path, r=ARGS) as (r,):
        with serving(r, tmp_path / "r", str(store)) as s:
            first = complete(s.url, TURN1)
            s.wait_for("saves", 1)
            r.args = ["-c", "1024", "-np", "2", "-kvu", "-fa", "on"]
            r.kill_and_start_again()
            prompt = TURN1 + first["content"] + TURN2_EXTRA
            second = complete(s.url, prompt)
            c = s.wait_for("saves", 2)
            assert c["restores"] == 1 and c["restore_failures"] == 0 and c["conversions"] == 1, s.output()
            # at start-up no -kvu, the types at the first save, -kvu from the save made after the restart
            learned = s.events_named("learned", 3)
            assert [(e["details"]["source"], e["details"]["kv_unified"]) for e in learned] == [
                ("probe", False), ("save", False), ("probe", True)], s.output()
        alone = complete(r.url, prompt, id_slot=0, cache_prompt=False)
    assert second["content"] == alone["content"]
    assert second["timings"]["prompt_n"] < alone["timings"]["prompt_n"] // 4, (second["timings"], alone["timings"])


@server
def test_a_state_convert_cannot_bring_over_is_never_sent(llama_server_bin, tiny_models, tmp_path, seaweed):
    """A state of a server with f16 caches, for a server of other -np whose K cache is q8_0: convert would
    re-encode it (lossy), so serve never converts nor sends it; and a state convert brings over to a slot too
    small for it: converted, judged again, refused, never sent."""
    env = {**seaweed.env(), "HOME": str(seaweed.dir)}
    store = f"s3://{BUCKET}/serve-{tmp_path.name}/"
    q8 = ["-c", "1024", "-np", "3", "-ctk", "q8_0", "-fa", "on"]
    small = ["-c", "768", "-np", "3", "-fa", "on"]        # 256 tokens per slot: the long state holds more
    long_store = store.rstrip("/") + "-long/"
    with servers(llama_server_bin, tiny_models, tmp_path, a=ARGS, q=q8, s=small) as (a, q, sm):
        with serving(a, tmp_path / "a", store, env=env) as sa:
            first = complete(sa.url, TURN1)
            sa.wait_for("saves", 1)
        with serving(a, tmp_path / "a", long_store, env=env) as sa:
            complete(sa.url, " ".join([SAMPLE_PROMPT] * 3))      # about 300 tokens
            sa.wait_for("saves", 1)
        with serving(q, tmp_path / "q", store, "-ctk", "q8_0", env=env) as sq:
            got = complete(sq.url, TURN1 + first["content"] + TURN2_EXTRA)
            c = sq.stats()
            assert c["restores"] == 0 and c["restore_failures"] == 0 and c["conversions"] == 0, sq.output()
            assert c["restores_refused_by_verdict"] >= 1, sq.output()
            refused = sq.events_named("refused")
            assert refused and "lossy" in refused[0]["message"], sq.output()
        assert got["timings"]["cache_n"] == 0
        alone = complete(q.url, TURN1 + first["content"] + TURN2_EXTRA, id_slot=0, cache_prompt=False)
        assert got["content"] == alone["content"]
        with serving(sm, tmp_path / "s", long_store, env=env) as ss:
            got = complete(ss.url, SAMPLE_PROMPT)      # a prefix of the stored state, fits the slot
            assert got["timings"]["cache_n"] == 0, ss.output()
            c = ss.stats()
            assert c["restores"] == 0 and c["restore_failures"] == 0, ss.output()
            assert c["conversions"] == 1 and c["restores_refused_by_verdict"] == 1, ss.output()
            refused = ss.events_named("refused")
            assert refused and "converted" in refused[0]["message"], ss.output()
        assert [n for n in left_in(tmp_path / "s") if "converted" in n or n.startswith(".")] == []


@server
def test_a_conversion_that_fails_leaves_the_request_uncached(llama_server_bin, tiny_models, tmp_path, seaweed):
    """Serve B may write no file of more than 64 KiB (RLIMIT_FSIZE): the download of a state of A (-np 2) into
    B's slot directory, to convert it for B (-np 3), fails; the request goes through uncached, the failure
    logged and counted, the answer the server's own."""
    env = {**seaweed.env(), "HOME": str(seaweed.dir)}
    store = f"s3://{BUCKET}/serve-{tmp_path.name}/"
    b_args = ["-c", "1536", "-np", "3", "-fa", "on"]
    with servers(llama_server_bin, tiny_models, tmp_path, a=ARGS, b=b_args) as (a, b):
        with serving(a, tmp_path / "a", store, env=env) as sa:
            first = complete(sa.url, TURN1)
            sa.wait_for("saves", 1)
        prompt = TURN1 + first["content"] + TURN2_EXTRA
        with serving(b, tmp_path / "b", store, env=env, max_file_size=64 << 10) as sb:
            got = complete(sb.url, prompt)
            c = sb.stats()
            assert c["conversion_failures"] == 1, sb.output()
            assert c["restores"] == 0 and c["conversions"] == 0 and c["restore_failures"] == 0, sb.output()
            errors = sb.events_named("error", where=lambda e: "not converted" in e["message"])
            assert errors and "uncached" in errors[0]["message"], sb.output()
        assert left_in(tmp_path / "b") == []
        alone = complete(b.url, prompt, id_slot=0, cache_prompt=False)
    assert got["content"] == alone["content"]
    assert got["timings"]["cache_n"] == 0 and got["timings"]["prompt_n"] == alone["timings"]["prompt_n"]


@server
def test_the_catalog_spares_reading_stored_states_again(llama, tmp_path):
    """A second serve over the same store knows the stored states' tokens from the catalog (beside the store):
    it reads none of them again; --no-cache reads them."""
    with serving(llama, llama.save_dir, str(tmp_path)) as s:
        complete(s.url, SAMPLE_PROMPT)
        s.wait_for("saves", 1)
    (state,) = tmp_path.glob("slot*.bin")
    old = time.time() - 3600
    os.utime(state, (old, old))        # older than the catalog's 3 s: its row is trusted
    from slotctl.catalog import INDEX_NAME

    assert (tmp_path / INDEX_NAME).exists()
    # the same request each time: the same state, stored once
    for extra, read in (((), 1), ((), 0), (("--no-cache",), 1)):
        with serving(llama, llama.save_dir, str(tmp_path), *extra) as s:
            complete(s.url, SAMPLE_PROMPT)
            (ev,) = s.events_named("indexed")
            assert ev["details"]["n"] == 1 and ev["details"]["read"] == read, ev
    assert len(list(tmp_path.glob("slot*.bin"))) == 1


#: a sitecustomize for a serve process: an audit hook writes every open of a file named ``slot*`` or ``*.gguf``
#: into the file ``$SLOTCTL_TEST_OPENS``, as ``parse`` when validate, the slot-file parser or convert's plan
#: opened it (a function of theirs on the stack) and ``read`` otherwise (a copy, the access time's one byte, the
#: model's GGUF read for the server's setup)
OPENS_HOOK = """
import os, sys

_log = open(os.environ["SLOTCTL_TEST_OPENS"], "a", buffering=1)
_PARSE = {"validate_file", "open_slot_file", "read_slot_file", "plan_for", "convert_for"}


def _hook(event, args):
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(args[0])
    if not os.path.basename(path).startswith("slot") and not path.endswith(".gguf"):
        return
    names, f = set(), sys._getframe(1)
    while f is not None:
        names.add(f.f_code.co_name)
        f = f.f_back
    _log.write(("parse" if names & _PARSE else "read") + "\\t" + os.path.basename(path) + "\\n")


sys.addaudithook(_hook)
"""


@server
def test_a_restarted_serve_takes_its_verdicts_from_the_catalog(llama, tmp_path):
    """serve keeps its verdicts in the store's catalog, per state identity and question: a serve process started
    again restores a state it judged before without opening it to judge it (the restore's own copy still reads
    it), and refuses a state it refused before without opening it at all; a state changed since (its identity)
    is judged again, and --no-cache judges every state. Every open of the state by each serve process is seen
    by an audit hook installed in it (a sitecustomize)."""
    store = tmp_path / "store"
    store.mkdir()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(OPENS_HOOK)
    opens = tmp_path / "opens.txt"
    env = {"SLOTCTL_TEST_OPENS": str(opens),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    erase_all(llama)
    with serving(llama, llama.save_dir, str(store)) as s:
        first = complete(s.url, TURN1)
        s.wait_for("saves", 1)
    (state,) = store.glob("slot*.bin")
    returning = TURN1 + first["content"] + TURN2_EXTRA

    def run(*extra: str) -> tuple[dict, list[dict], list[str]]:
        """One serve process asked the returning turn in an empty slot: its answer, its restored and refused
        events, how it opened the state (``parse`` / ``read``, in order); the states it stored removed after."""
        erase_all(llama)
        opens.write_text("")
        with serving(llama, llama.save_dir, str(store), *extra, env=env) as s:
            answer = complete(s.url, returning)
            with open(opens, "a") as f:     # what serve opens after: to judge the state the answer left
                f.write("answered\t-\n")
            s.wait_for("saves", 1)
            events = [e for e in s.events if e["event"] in ("restored", "refused")]
        for p in store.glob("slot*.bin"):
            if p != state:
                p.unlink()
        lines = opens.read_text().splitlines()
        # until the answer came: the state the answer left is judged once stored (its setup reads the model)
        lines = lines[:lines.index("answered\t-")]
        how = [line.split("\t")[0] for line in lines if line.endswith("\t" + state.name)]
        if any(line.endswith(".gguf") for line in lines):
            how.append("gguf")      # the server's setup made: it reads the model
        return answer, events, how

    def age(hours: float) -> None:      # changed long enough ago for the catalog's rows to be trusted
        t = time.time() - 3600 * hours
        os.utime(state, (t, t))

    age(1)
    # judged (opened by validate), restored, the verdict kept
    answer, (ev,), how = run()
    assert ev["event"] == "restored" and "catalog" not in ev["details"], ev
    assert "parse" in how and "gguf" in how and answer["timings"]["cache_n"] > 100, how
    # a serve started again: the verdict from the catalog, the state only copied for the restore, no GGUF read
    for _ in range(2):
        answer, (ev,), how = run()
        assert "parse" not in how and "gguf" not in how and "read" in how, how
        assert ev["event"] == "restored" and ev["details"].get("catalog") is True, ev
        assert answer["timings"]["cache_n"] > 100
    # --no-cache: judged again
    _answer, (ev,), how = run("--no-cache")
    assert ev["event"] == "restored" and "catalog" not in ev["details"] and "parse" in how, (ev, how)
    # the state changed (its identity: mtime, ctime): judged again, then trusted again
    age(2)
    _answer, (ev,), how = run()
    assert "catalog" not in ev["details"] and "parse" in how, (ev, how)
    _answer, (ev,), how = run()
    assert ev["details"]["catalog"] is True and "parse" not in how and "gguf" not in how, (ev, how)
    # cut short: judged again and refused (never sent); the next serve refuses it from the catalog, never opening it
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])
    age(1)
    answer, events, how = run()
    assert [e["event"] for e in events] == ["refused"] and "catalog" not in events[0]["details"], events
    assert "parse" in how and answer["timings"]["cache_n"] == 0
    answer, events, how = run()
    assert [e["event"] for e in events] == ["refused"] and events[0]["details"]["catalog"] is True, events
    assert events[0]["details"]["verdict"] != "restores" and "not read again" in events[0]["message"]
    assert how == [] and answer["timings"]["cache_n"] == 0, how


@server
def test_a_restarted_serve_takes_its_verdicts_from_the_catalog_of_an_s3_store(llama, tmp_path, seaweed):
    """With an s3:// store (the catalog under the cache directory, an object's identity its ETag and size from
    the listing, the download pinned to that ETag): a serve process started again restores the stored state
    from its kept verdict (details.catalog), as the serve that stored it judged it once stored."""
    import obstore

    client = seaweed.client()
    prefix = f"serve-verdicts-{tmp_path.name}/"
    store = f"s3://{BUCKET}/{prefix}"
    # SLOTCTL_RACY_SECONDS=0: a row of the object just put is trusted (under the rule of 3 s, after a wait)
    env = {**seaweed.env(), "HOME": str(seaweed.dir), "SLOTCTL_CACHE_DIR": str(tmp_path / "cache"),
           "SLOTCTL_RACY_SECONDS": "0"}
    erase_all(llama)
    with serving(llama, llama.save_dir, store, env=env) as s:
        first = complete(s.url, TURN1)
        s.wait_for("saves", 1)
    def states() -> list[str]:      # serve's states (the lease object beside them is not one)
        return [o["path"] for batch in obstore.list(client, prefix=prefix) for o in batch
                if o["path"].rpartition("/")[2].startswith("slot") and o["path"].endswith(".bin")]

    (kept,) = states()
    seen = []
    for _ in range(3):
        erase_all(llama)
        with serving(llama, llama.save_dir, store, env=env) as s:
            answer = complete(s.url, TURN1 + first["content"] + TURN2_EXTRA)
            s.wait_for("saves", 1)
            (ev,) = s.events_named("restored")
            seen.append(ev["details"].get("catalog", False))
            assert answer["timings"]["cache_n"] > 100, s.output()
        for path in states():     # only the first state stays: the one asked for
            if path != kept:
                obstore.delete(client, path)
    assert seen == [True, True, True], seen     # judged by the serve that stored it, when it stored it
    assert list((tmp_path / "cache" / "catalog").glob("*.sqlite"))


@pytest.mark.parametrize("own_store", [True, False], ids=["store-elsewhere", "store-is-slot-dir"])
def test_a_state_is_sent_only_with_the_identity_its_verdict_was_made_on(tmp_path, own_store):
    """Cache.restore sends a state only while the file the server would read has the identity the `restores`
    verdict was made on: a state changed since (here its mtime, as a writer's would) is neither copied into the
    slot directory nor restored (the check comes before any request: no server is asked, the URL is nobody's)."""
    import numpy as np

    from slotctl.catalog import local_identity
    from slotctl.errors import UsageError
    from slotctl.serve.cache import Cache
    from slotctl.serve.index import State

    slots = tmp_path / "slots"
    slots.mkdir()
    store = tmp_path / "store" if own_store else slots
    store.mkdir(exist_ok=True)
    name = "slot0-0000000000000000-0000003-0000000000000000-0000000000000000.bin"
    (store / name).write_bytes(b"\0" * 64)       # what it holds is not read: the identity is checked first
    judged_on = local_identity(os.stat(store / name))
    t = time.time() - 60
    os.utime(store / name, (t, t))
    cache = Cache("http://127.0.0.1:9", slots, str(store), catalog=False, timeout=1)     # --store given so
    state = State(name, np.array([1, 2, 3], dtype=np.int32), "kv", (store / name).stat().st_size)
    with pytest.raises(UsageError) as e:
        cache.restore(state.name, 0, identity=judged_on)
    assert e.value.code == "object_changed" and "changed since its verdict" in str(e.value)
    assert sorted(p.name for p in slots.iterdir()) == ([] if own_store else [name])


def test_usage_errors_are_one_line_and_exit_2(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        for args, words in (
                (["--slot-dir", str(tmp_path / "missing")], "not a directory"),
                (["--slot-dir", str(tmp_path), "--store", "ftp://x/"], "a directory or an s3://"),
                (["--slot-dir", str(tmp_path), "--listen", "nohost"], "expected HOST:PORT"),
                (["--slot-dir", str(tmp_path), "--max-size", "lots"], "expected a size"),
                (["--slot-dir", str(tmp_path), "--listen", f"127.0.0.1:{port}"], f"--listen 127.0.0.1:{port}")):
            r = subprocess.run([sys.executable, "-m", "slotctl", "serve", "--upstream", "http://127.0.0.1:9", *args],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 2, (args, r.stderr)
            assert words in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, \
                (args, r.stderr)
    finally:
        taken.close()


# -- the server dying mid-answer, the store's budget ------------------------------------------------------------

#: a context long enough for an answer far larger than the sockets' buffers between the server and the client
LONG_ARGS = ["-c", "8192", "-np", "2", "-fa", "on"]
#: an answer of thousands of tokens, each event carrying 50 probabilities: megabytes the server is still sending
LONG = {"prompt": SAMPLE_PROMPT, "n_predict": 3000, "ignore_eos": True, "temperature": 0, "n_probs": 50}


def dechunk(raw: bytes) -> tuple[bytes, bool]:
    """The body of a chunked HTTP answer as far as it came, and whether it ended with the last chunk."""
    body, rest = b"", raw
    while True:
        head, sep, rest2 = rest.partition(b"\r\n")
        if not sep:
            return body, False
        size = int(head.split(b";")[0], 16)
        if size == 0:
            return body, True
        if len(rest2) < size + 2:
            return body + rest2[:size], False
        body, rest = body + rest2[:size], rest2[size + 2:]


@server
def test_the_server_dying_mid_answer(llama_server_bin, tiny_models, tmp_path):
    """The server SIGKILLed while it answers, streaming and not: the client gets what the server sent, then the
    connection closed (never ended as if whole), or a 502 when no answer had begun; serve stays up and serves
    the next request once the server is back; nothing of the broken answers is saved."""
    (tmp_path / "slots").mkdir()
    store = tmp_path / "store"
    store.mkdir()
    srv = start_server(llama_server_bin, tiny_models.target, tmp_path, "dying", args=LONG_ARGS,
                       slot_save_path=tmp_path / "slots")
    try:
        with serving(srv, tmp_path / "slots", str(store)) as s:
            # streaming: a few events read, the server killed, the rest read to the end of the connection
            sock, got = stream_begun(s.port, dict(LONG, stream=True))
            srv.kill_and_start_again()
            while True:
                more = sock.recv(1 << 20)       # the end of the connection, within the socket's timeout
                if not more:
                    break
                got += more
            sock.close()
            head, _sep, raw = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
            events, ended = dechunk(raw)
            assert not ended, "an answer broken off was ended as if whole"
            sent = [json.loads(e[6:]) for e in events.split(b"\n\n")[:-1] if e.startswith(b"data: ")]
            assert len(sent) >= 3 and not any(e.get("stop") for e in sent)
            # an event may carry more than one token (the server holds back a token that ends inside a UTF-8
            # character), so the server's own answer, longer, begins with what the client got
            relayed = "".join(e["content"] for e in sent)
            reference = complete(srv.url, SAMPLE_PROMPT, n_predict=2 * len(sent) + 8, ignore_eos=True,
                                 cache_prompt=False)
            assert relayed and reference["content"].startswith(relayed)

            # not streaming: the server killed while it generates, before its answer began: a 502 in JSON
            for _attempt in range(3):
                result: dict = {}
                t = threading.Thread(target=lambda: result.update(r=call(s.url, "POST", "/completion", LONG)))
                t.start()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not any(e["is_processing"] for e in srv.get("/slots")[1]):
                    time.sleep(0.01)
                srv.kill_and_start_again()
                t.join(120)
                if result["r"][0] != 200:      # else the answer was whole before the kill: again
                    break
            status, headers, raw = result["r"]
            assert status == 502 and headers["Content-Type"].startswith("application/json"), (status, raw[:200])
            assert json.loads(raw)["error"]["code"] == 502
            assert s.proc.poll() is None
            c = s.stats()
            assert c["upstream_errors"] >= 2 and c["saves"] == 0 and c["save_failures"] == 0, c
            assert not list(store.glob("*.bin")) and not list((tmp_path / "slots").glob("serve-slot*"))

            # the next request, the server back: its answer, and its state the one stored
            direct = complete(srv.url, SAMPLE_PROMPT, cache_prompt=False)
            via = complete(s.url, SAMPLE_PROMPT)
            assert via["content"] == direct["content"]
            assert s.wait_for("saves", 1)["saves"] == 1
            from slotctl.slotfile import open_slot_file

            (state,) = store.glob("slot*.bin")
            with open_slot_file(state) as sf:
                assert sf.tokens.n_tokens == via["timings"]["prompt_n"] + via["timings"]["cache_n"] + 7
    finally:
        srv.stop()


@server
def test_the_store_is_held_under_max_size(llama, tmp_path):
    """--max-size: after each save the store is pruned to the budget, least recently used first (a state
    restored counts as used); a file named as serve's working files are (a save in progress) is pinned: never
    deleted, however old."""
    from slotctl.prune import time_source

    store = tmp_path / "store"
    store.mkdir()
    if time_source(str(store))[0] != "atime":
        pytest.skip("the filesystem keeps no access times: a restore cannot count as a use")
    prompts = [f"Part {k} of the story. {SAMPLE_PROMPT}" for k in range(3)]
    erase_all(llama)
    with serving(llama, llama.save_dir, str(store)) as s:     # one state's size, without a budget
        complete(s.url, "Part 9 of the story. " + SAMPLE_PROMPT)
        s.wait_for("saves", 1)
    (first,) = store.glob("slot*.bin")
    size = first.stat().st_size
    # a real slot file under a working file's name, used an hour ago: the least recently used of all, but pinned
    pinned = store / "serve-slot1-999-1-incoming.bin"
    first.rename(pinned)
    old = time.time() - 3600
    os.utime(pinned, (old, old))
    erase_all(llama)
    budget = int(size * 4.5)
    with serving(llama, llama.save_dir, str(store), "--max-size", str(budget)) as s:
        answers = []
        for k, p in enumerate(prompts):          # A, B, C: with the pinned file, 4 states' size
            answers.append(complete(s.url, p))
            s.wait_for("saves", k + 1)
            time.sleep(0.2)
        assert s.stats()["pruned"] == 0
        states = {p.name: p for p in store.glob("slot*.bin") if p != pinned}
        by_prompt = {}
        from slotctl.slotfile import open_slot_file

        for name, path in states.items():
            with open_slot_file(path) as sf:
                text = llama.post("/detokenize", {"tokens": [int(t) for t in sf.tokens.tokens[:8]]})[1]["content"]
            by_prompt[next(k for k in range(3) if f"Part {k} " in text)] = name
        a, b, c = (by_prompt[k] for k in range(3))
        # A comes back (its slot was given to C): restored, so used last; its new state stored: over the budget,
        # the least recently used goes: B
        again = complete(s.url, prompts[0] + answers[0]["content"] + TURN2_EXTRA)
        assert again["timings"]["cache_n"] > 100, s.output()
        c4 = s.wait_for("saves", 4)
        assert c4["restores"] == 1 and s.wait_for("pruned", 1)["pruned"] == 1, s.output()
        left = {p.name for p in store.glob("*.bin")}
        assert pinned.name in left and a in left and c in left and b not in left, (left, a, b, c)
        assert len(left) == 4
        assert sum(p.stat().st_size for p in store.glob("*.bin")) <= budget
        (ev,) = s.events_named("pruned")
        assert ev["details"]["path"].endswith(b)
