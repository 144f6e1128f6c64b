"""Running unattended (docs/fleet.md): one keeper per server and store, the configuration file, metrics and
health, systemd's notify protocol, the unit files.

Every keeper here is a real ``slotctl keep`` process (its signals, its lock and its sockets are real); the
stores are directories and a real SeaweedFS (tests/seaweed.py); the servers real llama-server b11434.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import json_schemas

from conftest import default_signals
from keeping import (Keep, child_env, documented, emptied, families, first_line, keep_proc, lease_of, samples, scrape,
                     slotctl, stop, tokens_of, value, wait_until)
from llama_server import free_port
from seaweed import BUCKET
from slotctl.tinymodels import SAMPLE_PROMPT

server = pytest.mark.server


# -- one keeper per server and store ----------------------------------------------------------------------


def test_a_second_keeper_of_a_server_and_directory_store_is_refused(tmp_path):
    """flock in the store: the second keep exits 2 with one line naming the first; a keep killed with
    SIGKILL leaves nothing held (the kernel drops the lock), so the next one starts at once."""
    url = f"http://127.0.0.1:{free_port()}"      # nothing listens: keep runs, its looks say "down"
    a = keep_proc(url, tmp_path, "--every", "0.2")
    try:
        assert first_line(a)["event"] == "start"
        b = subprocess.run([sys.executable, "-m", "slotctl", "keep", "--server", url, "--slot-dir", str(tmp_path)],
                           capture_output=True, text=True, env=child_env(), timeout=60)
        assert b.returncode == 2 and b.stdout == "", b
        lines = b.stderr.strip().splitlines()
        assert len(lines) == 1 and "another keeper keeps this server with this store" in lines[0], b.stderr
        assert f"pid {a.pid}" in lines[0]
        # the same store for another server: no conflict
        other = keep_proc(f"http://127.0.0.1:{free_port()}", tmp_path, "--every", "0.2")
        assert first_line(other)["event"] == "start"
        assert stop(other) == 0
        # --json: the refusal is a JSON document too
        b = subprocess.run([sys.executable, "-m", "slotctl", "keep", "--server", url, "--slot-dir", str(tmp_path),
                            "--json"], capture_output=True, text=True, env=child_env(), timeout=60)
        assert b.returncode == 2 and json.loads(b.stdout)["error"]["code"] == "locked", b
    finally:
        stop(a, signal.SIGKILL)
    c = keep_proc(url, tmp_path, "--every", "0.2")
    try:
        assert first_line(c)["event"] == "start"
    finally:
        assert stop(c) == 0


def test_the_servers_url_is_normalised_before_it_names_the_lock(tmp_path):
    """Every way of writing one server's URL names one lock: a second keep of 127.0.0.1:PORT written as
    127.1, 0.0.0.0, [::1], 0x7f.1, localhost. with a path of /./ or //, or its default port spelt out for
    another server, is refused (before, 0.0.0.0, 127.1 and /./ each let a second keeper run); another
    server's URL is not; and a serve of 127.0.0.1 refuses a second written as 0.0.0.0/./."""
    from slotctl.unattended.lock import server_key

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    same = [f"http://127.1:{port}", f"http://0.0.0.0:{port}/./", f"http://[::1]:{port}", f"http://0x7f.1:{port}//",
            f"http://localhost.:{port}/a/..", f"http://[::ffff:127.0.0.1]:{port}", f"http://2130706433:{port}/%2E/"]
    assert {server_key(u) for u in same} == {server_key(url)}
    assert server_key("http://Example.COM.:80/x/./y/") == server_key("http://example.com/x/y") != \
        server_key("http://example.com:8080/x/y")
    assert server_key(f"http://127.0.0.2:{port + 1}") != server_key(url)
    a = keep_proc(url, tmp_path, "--every", "0.2")
    try:
        assert first_line(a)["event"] == "start"
        for other in same:
            b = subprocess.run([sys.executable, "-m", "slotctl", "keep", "--server", other, "--slot-dir",
                                str(tmp_path)], capture_output=True, text=True, env=child_env(), timeout=60)
            assert b.returncode == 2 and "another keeper keeps this server" in b.stderr, (other, b.stderr)
    finally:
        assert stop(a) == 0
    serve = [sys.executable, "-m", "slotctl", "serve", "--slot-dir", str(tmp_path), "--listen", "127.0.0.1:0",
             "--json"]
    s = subprocess.Popen([*serve, "--upstream", url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env(), preexec_fn=default_signals)
    try:
        assert json.loads(s.stdout.readline())["event"] == "listening"
        b = subprocess.run([*serve, "--upstream", f"http://0.0.0.0:{port}/./"], capture_output=True, text=True,
                           env=child_env(), timeout=60)
        assert b.returncode == 2 and json.loads(b.stdout)["error"]["code"] == "locked", b
    finally:
        assert stop(s) == 0


def test_an_s3_lease_is_refused_while_it_holds_and_taken_over_after_its_expiry(seaweed, tmp_path):
    """A keeper killed with SIGKILL: its lease is refused to the next until its expiry, never before, and
    taken over after it; the journal it wrote passes to the next."""
    env = child_env({**seaweed.env(), "HOME": str(seaweed.dir)}, drop_aws=True)
    store = f"s3://{BUCKET}/lease-{tmp_path.name}/"
    url = f"http://127.0.0.1:{free_port()}"
    # A lease of 15 s and a margin of 7 s: a keeper started later than 7 s before the expiry could, on a loaded
    # machine (load 12 seen), read the lease after it expired, take it over and run on (the run would time out)
    args = ("--store", store, "--every", "0.2", "--lease", "15")
    a = keep_proc(url, tmp_path, *args, env=env)
    assert first_line(a)["event"] == "start"
    key, doc = lease_of(seaweed, f"lease-{tmp_path.name}/")
    assert doc["pid"] == a.pid and doc["ttl"] == 15
    stop(a, signal.SIGKILL)
    killed = time.time()
    _, doc = lease_of(seaweed, f"lease-{tmp_path.name}/")
    expires = doc["expires"]
    assert expires > killed
    refused = 0
    while time.time() < expires - 7:        # before the expiry (with a margin for the process's start-up)
        b = subprocess.run([sys.executable, "-m", "slotctl", "keep", "--server", url, "--slot-dir", str(tmp_path),
                            *args], capture_output=True, text=True, env=env, timeout=60)
        if time.time() < expires:
            assert b.returncode == 2, (b, time.time() - expires)
            assert "its lease" in b.stderr and "holds until" in b.stderr and f"pid {a.pid}" in b.stderr, b.stderr
            assert len(b.stderr.strip().splitlines()) == 1
            refused += 1
    assert refused >= 1
    time.sleep(max(0.0, expires - time.time()) + 0.2)
    c = keep_proc(url, tmp_path, *args, env=env)
    try:
        assert first_line(c)["event"] == "start"
        _, doc = lease_of(seaweed, f"lease-{tmp_path.name}/")
        assert doc["pid"] == c.pid and doc["expires"] > time.time()
    finally:
        assert stop(c) == 0
    # stopped cleanly: the lease is marked released, the next keeper need not wait
    _, doc = lease_of(seaweed, f"lease-{tmp_path.name}/")
    assert doc["released"] is True
    d = keep_proc(url, tmp_path, *args, env=env)
    try:
        assert first_line(d)["event"] == "start"
    finally:
        assert stop(d) == 0


def test_a_keeper_whose_lease_was_taken_over_stops_writing(seaweed, tmp_path):
    """A keeper frozen (SIGSTOP) past its lease's expiry finds, when it runs again, that another took it
    over: it stops at once without a last save, exit 2, an error line lease_lost."""
    env = child_env({**seaweed.env(), "HOME": str(seaweed.dir)}, drop_aws=True)
    store = f"s3://{BUCKET}/taken-{tmp_path.name}/"
    url = f"http://127.0.0.1:{free_port()}"
    args = ("--store", store, "--every", "0.2", "--lease", "3")
    a = keep_proc(url, tmp_path, *args, env=env)
    assert first_line(a)["event"] == "start"
    a.send_signal(signal.SIGSTOP)
    try:
        # the next keeper is refused while the frozen one's lease holds, and takes it over once it expired
        deadline = time.monotonic() + 60
        while True:
            b = keep_proc(url, tmp_path, *args, env=env)
            said = first_line(b)
            if said.get("event") == "start":
                break
            assert said["error"]["code"] == "locked" and time.monotonic() < deadline, said
            assert stop(b) == 2
    finally:
        a.send_signal(signal.SIGCONT)
    try:
        assert a.wait(30) == 2
        events = [json.loads(x) for x in a.stdout.read().splitlines()]
        errors = [e for e in events if e["event"] == "error"]
        assert errors and errors[-1]["details"]["error"]["code"] == "lease_lost", events
        assert events[-1]["event"] == "stop" and "without a last save" in events[-1]["message"]
        _, doc = lease_of(seaweed, f"taken-{tmp_path.name}/")
        assert doc["pid"] == b.pid        # the frozen keeper wrote nothing over the new holder's lease
    finally:
        stop(a)
        assert stop(b) == 0


@server
def test_a_keeper_started_again_does_not_save_what_the_store_has(kept, tmp_path):
    """The journal: a keep stopped and started again against the same server and store does not ask the
    server to save a slot whose state the store already has; a new task is saved as before."""
    emptied(kept)
    store = tmp_path / "store"
    store.mkdir()
    keep = Keep(kept, store, "--every", "0.2")
    try:
        keep.wait_for("up")
        kept.completion(SAMPLE_PROMPT + " The journal", slot=0, n_predict=3)
        stored = keep.wait_for("stored", 0)["details"]
    finally:
        assert keep.stop() == 0
    journal = [p for p in store.iterdir() if p.name.endswith(".json")]
    assert len(journal) == 1 and json.loads(journal[0].read_text())["journal"]["0"]["name"] == stored["name"]
    port = free_port()
    keep = Keep(kept, store, "--every", "0.2", "--listen", f"127.0.0.1:{port}")
    try:
        keep.wait_for("up")
        # ten looks at the server (its metrics count them): none saves the state the store has
        wait_until(lambda: value(samples(scrape(f"http://127.0.0.1:{port}")[2]), "slotctl_keep_looks_total",
                                 server=kept.url, outcome="up") >= 10)
        kept.completion(SAMPLE_PROMPT + " The journal goes on", slot=0, n_predict=3)
        again = keep.wait_for("stored", 0)["details"]
        assert again["name"] != stored["name"]
    finally:
        assert keep.stop() == 0
    # one save of slot 0 in the second run: the new task's (the state the store had was not saved again); its
    # learned line says what that save taught of the server's flags (the cache types: keep's start-up save was
    # of slot 1, which holds nothing)
    assert [e["event"] for e in keep.seen if e["slot"] == 0 and e["event"] != "learned"] == ["saved", "stored"], \
        keep.seen


# -- the configuration file --------------------------------------------------------------------------------

BAD_CONFIGS = [
    ("[keep]\nevery = 'often'\n", "keep.every: expected seconds from 0.05 to 86400, got 'often'"),
    ("[keep]\nevery = 0\n", "keep.every: expected seconds from 0.05 to 86400, got 0"),
    ("[keep]\nmin_tokens = 2.5\n", "keep.min_tokens: expected an integer from 1 to 16,777,216, got 2.5"),
    ("[keep]\nevry = 3\n", "keep.evry: unknown key (expected one of: server, every, min_tokens, timeout, lease, "
                           "listen)"),
    ("[keep]\nlisten = 'here'\n", "keep.listen: expected HOST:PORT, got 'here'"),
    # an s3:// lease's writes are signed to expire to the second at 0.8 of it: 2 s at least
    ("[keep]\nlease = 1.5\n", "keep.lease: expected seconds from 2 to 86400, got 1.5"),
    ("[[servers]]\nslot_dir = '/x'\n", "servers[0].url: expected the server's URL (http://HOST:PORT)"),
    ("[[servers]]\nurl = 'http://a'\nstore = 'ftp://x/'\n",
     "servers[0].store: expected a directory or s3://BUCKET/PREFIX/, got 'ftp://x/'"),
    ("[[servers]]\nurl = 'http://a'\napi_key_env = 'my key'\n",
     "servers[0].api_key_env: expected the name of an environment variable, got 'my key'"),
    ("servers = 3\n", "servers: expected an array of tables ([[servers]]), got 3"),
    ("[[servers]]\nurl = 'http://a'\nmodel = ''\n", "servers[0].model: expected a string (not empty), got ''"),
    ("[[servers]]\nurl = 'http://a'\nmodel = \"x\\u0007\"\n",
     "servers[0].model: expected the model's name, as the router's GET /models lists it, got 'x\\x07'"),
    ("[budget]\nmax_size = 'lots'\n", "budget.max_size: expected a size such as 20G or 500M, got 'lots'"),
    ("[retention]\nnewest = 0\n", "retention.newest: expected an integer from 1 to 1,048,576, got 0"),
    ("[proof]\npolicy = 'sometimes'\n", 'proof.policy: expected "always" or "never", got \'sometimes\''),
    ("[surprise]\n", "surprise: unknown key (expected one of: servers, keep, serve, budget, retention, proof)"),
    ("[keep\n", "not TOML: Expected ']' at the end of a table declaration (at line 1, column 6)"),
    ("[keep]\nevery = " + "9" * 500_000 + "\n", "line 2: a number of 500,000 digits: expected at most 24"),
    ("[keep]\nevery = " + "9" * 5_000_000 + "\n", "more than 1,048,576 bytes: expected a configuration file of at most that"),
    ("[[servers]]\nurl = 'http://a'\nname = 'x'\n[[servers]]\nurl = 'http://b'\nname = 'y'\n",
     "keep.server: expected the name of one of the 2 [[servers]] (x, y)"),
]


@pytest.mark.parametrize("text,message", BAD_CONFIGS, ids=[m.split(":")[0] for _, m in BAD_CONFIGS])
def test_a_bad_configuration_is_one_line_naming_the_key(tmp_path, text, message):
    cfg = tmp_path / "keep.toml"
    cfg.write_text(text)
    res = subprocess.run([sys.executable, "-m", "slotctl", "keep", "--config", str(cfg), "--slot-dir", str(tmp_path)],
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert res.returncode == 2 and res.stdout == "", res
    assert res.stderr.strip().splitlines() == [f"error: {cfg}: {message}"], res.stderr


def test_the_configuration_drives_keep_and_flags_override_it(tmp_path):
    """The server, its slot directory and the settings from the file; --every given on the command line
    wins over the file's."""
    store = tmp_path / "store"
    store.mkdir()
    url = f"http://127.0.0.1:{free_port()}"
    cfg = tmp_path / "keep.toml"
    cfg.write_text(f"[[servers]]\nname = 'tiny'\nurl = '{url}'\nslot_dir = '{tmp_path}'\nstore = '{store}'\n"
                   f"[keep]\nevery = 600\nmin_tokens = 8\n[budget]\nmax_size = '1G'\n[retention]\nnewest = 2\n")
    proc = subprocess.Popen([sys.executable, "-m", "slotctl", "keep", "--config", str(cfg), "--every", "0.25",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            preexec_fn=default_signals)
    try:
        start = first_line(proc)
        assert start["event"] == "start" and start["details"] == {"every": 0.25, "store": str(store)}, start
        assert url in start["message"]
        # the lock is in the configured store
        assert [p.name for p in store.iterdir() if p.name.endswith(".lock")]
    finally:
        assert stop(proc) == 0


# -- metrics and health --------------------------------------------------------------------------------------


class Answering:
    """A stand-in for a llama-server started with --api-key, asked without one: /health answers (it is
    public), /props is 401; each look of keep is then an error with a code (the metrics count them)."""

    def __init__(self):
        import http.server
        import threading

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                ok = self.path == "/health"
                body = (b'{"status": "ok"}' if ok else
                        b'{"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}')
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_metrics_count_errors_and_readyz_says_why_not(tmp_path):
    """A server down, then one whose answers do not check: /livez 200 throughout, /readyz 503 with the
    reason, errors counted by code, looks by outcome; the port is loopback when only a port is given."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    down = f"http://127.0.0.1:{free_port()}"
    proc = keep_proc(down, tmp_path, "--every", "0.2", "--listen", str(port))
    try:
        first_line(proc)
        ss = wait_until(lambda: (lambda s: s if value(s, "slotctl_keep_looks_total", server=down,
                                                     outcome="down") >= 3 else None)(samples(scrape(base)[2])))
        assert value(ss, "slotctl_keep_server_up", server=down) == 0
        assert value(ss, "slotctl_keep_looks_total", server=down, outcome="up") == 0
        status, ctype, body = scrape(base, "/readyz")
        assert status == 503 and "server: down at the last look" in body and "store: reachable" in body
        status, _, body = scrape(base, "/livez")
        assert status == 200, body
        assert scrape(base, "/nothing")[0] == 404
        status, ctype, text = scrape(base)
        assert ctype == "text/plain; version=0.0.4; charset=utf-8"
        # every family typed as docs/fleet.md's table says (a counter's TYPE line names it with _total), and
        # the build's: this slotctl's version, keep's role
        assert families(text) == documented("fleet.md")
        import platform

        from slotctl import __version__

        ss = samples(text)
        assert value(ss, "slotctl_build_info", version=__version__, python=platform.python_version(),
                     role="keep") == 1
        assert re.search(r"^# TYPE slotctl_keep_looks_total counter$", text, re.M), text
    finally:
        assert stop(proc) == 0
    fake = Answering()
    proc = keep_proc(fake.url, tmp_path, "--every", "0.2", "--listen", f"127.0.0.1:{port}")
    try:
        first_line(proc)
        wait_until(lambda: value(samples(scrape(base)[2]), "slotctl_keep_errors_total", server=fake.url,
                                 code="server_auth") >= 2)
    finally:
        assert stop(proc) == 0
        fake.close()


@server
def test_metrics_equal_what_keep_did(kept, tmp_path):
    """Scraped and parsed with prometheus_client: saves, stored bytes, the store's objects and bytes,
    restores, proofs and the prompt tokens of the proofs equal keep's own events; readyz 200 while the
    server is up; the last-success timestamps are set."""
    emptied(kept)
    store = tmp_path / "store"
    store.mkdir()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    keep = Keep(kept, store, "--every", "0.3", "--listen", f"127.0.0.1:{port}")
    url = kept.url
    try:
        keep.wait_for("up")
        kept.completion(SAMPLE_PROMPT + " The metrics", slot=0, n_predict=3)
        stored = keep.wait_for("stored", 0)["details"]
        ss = samples(scrape(base)[2])
        assert value(ss, "slotctl_keep_saves_total", server=url, slot=0, outcome="stored") == 1
        assert value(ss, "slotctl_keep_stored_bytes_total", server=url, slot=0) == stored["size"]
        assert value(ss, "slotctl_keep_store_objects", server=url) == 1
        assert value(ss, "slotctl_keep_store_bytes", server=url) == Path(stored["path"]).stat().st_size
        assert value(ss, "slotctl_keep_server_up", server=url) == 1
        assert value(ss, "slotctl_keep_last_success_timestamp_seconds", server=url, action="save") > time.time() - 60
        assert scrape(base, "/readyz")[0] == 200
        kept.kill_and_start_again()
        keep.wait_for("restart")
        restored = keep.wait_for("restored", 0)
        proof = keep.wait_for("proof", 0)["details"]["proof"]
        ss = wait_until(lambda: (lambda s: s if value(s, "slotctl_keep_proofs_total", server=url, slot=0,
                                                      verdict=proof["verdict"]) else None)(samples(scrape(base)[2])))
        assert value(ss, "slotctl_keep_restores_total", server=url, slot=0, outcome="restored") == 1
        assert restored["details"]["name"] == stored["name"]
        assert value(ss, "slotctl_keep_proofs_total", server=url, slot=0, verdict=proof["verdict"]) == 1
        for name, key, source in (("reused", "n_reused", "measured"), ("reused", "predicted_reused", "predicted"),
                                  ("evaluated", "n_evaluated", "measured"),
                                  ("evaluated", "predicted_evaluated", "predicted")):
            assert value(ss, f"slotctl_keep_prompt_tokens_{name}_total", server=url, slot=0,
                         source=source) == proof[key], (name, source)
        assert value(ss, "slotctl_keep_last_success_timestamp_seconds", server=url, action="proof") > 0
        assert value(ss, "slotctl_keep_looks_total", server=url, outcome="up") >= 2
    finally:
        assert keep.stop() == 0
    every = [e for e in keep.seen if e["event"] == "stored"]
    assert len(every) == 1


# -- systemd --------------------------------------------------------------------------------------------------


def test_keep_speaks_systemds_notify_protocol(tmp_path):
    """A unix datagram socket the test binds as NOTIFY_SOCKET: READY=1 (with a STATUS), WATCHDOG=1 every
    half WATCHDOG_USEC while the loop lives, STOPPING=1 on SIGTERM, exit 0."""
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(30)
    url = f"http://127.0.0.1:{free_port()}"
    # a ping every 10 ms: the first datagram is READY=1 only if the pings begin after it
    proc = keep_proc(url, tmp_path, "--every", "0.2",
                     env=child_env({"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "20000"}))
    got: list[str] = []
    try:
        while got.count("WATCHDOG=1") < 3:
            got += sock.recv(4096).decode().split("\n")
        assert got[0] == "READY=1" and got[1].startswith("STATUS=keeping ") and url in got[1], got
        proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in got:
            got += sock.recv(4096).decode().split("\n")
        assert proc.wait(30) == 0
    finally:
        stop(proc)
        sock.close()
    # the order: ready first, then the pings, stopping last of what was said before the exit
    assert got.index("READY=1") < got.index("WATCHDOG=1") < got.index("STOPPING=1")


def test_the_watchdog_of_another_process_is_not_answered_and_an_abstract_socket_works(tmp_path):
    name = f"slotctl-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(60)     # keep's start-up until READY=1 (5 s was within reach of a loaded machine's)
    proc = keep_proc(f"http://127.0.0.1:{free_port()}", tmp_path, "--every", "0.2",
                     env=child_env({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}))
    try:
        assert sock.recv(4096).decode().split("\n")[0] == "READY=1"
        time.sleep(1.0)     # five watchdog intervals: nothing, the watchdog is another process's
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(4096)
    finally:
        assert stop(proc) == 0
        sock.close()


def test_the_shipped_unit_is_printed_and_systemd_accepts_it(tmp_path):
    """The unit of the install slotctl runs from (its ExecStart: this Python; tests/test_units.py runs one of
    a fresh venv as systemd would); a bad name or --user is one line, exit 2."""
    import shutil

    res = slotctl("unit", "keep", code=0)
    text = res.stdout
    for line in ("Type=notify", "WatchdogSec=", "NotifyAccess=main", "KillSignal=SIGTERM", "User=llama\n",
                 f"ExecStart={sys.executable} -m slotctl keep --config /etc/slotctl/%i.toml\n",
                 "CacheDirectory=slotctl\n", "Environment=SLOTCTL_CACHE_DIR=%C/slotctl\n", "LimitNOFILE=65536\n"):
        assert line in text, line
    from slotctl.unattended.systemd import unit_text

    assert text == unit_text("keep", python=sys.executable)
    assert "@" not in text.replace("slotctl-keep@", "").replace("%i", "")   # every placeholder filled
    assert "expected one of: keep" in slotctl("unit", "nothing", code=2).stderr
    assert "--user 'a;b': expected a user name" in slotctl("unit", "keep", "--user", "a;b", code=2).stderr
    doc = json.loads(slotctl("unit", "serve", "--json", "--user", "root", code=0).stdout)
    assert doc["python"] == sys.executable and doc["user"] == "root" and "User=root\n" in doc["text"]
    json_schemas.check("unit", doc)
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "slotctl-keep@test.service"
    unit.write_text(text)
    res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr == "", res


# -- keep --save-all, --restore-all, --keep-newest -------------------------------------------------------------


def keep_once(srv, store: Path, *more: str) -> tuple[int, list[dict]]:
    res = subprocess.run([sys.executable, "-m", "slotctl", "keep", "--server", srv.url, "--slot-dir",
                          str(srv.save_dir), "--store", str(store), "--json", "--timeout", "60", *more],
                         capture_output=True, text=True, env=child_env(), timeout=300)
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    for line in lines:
        json_schemas.check("keep", line, "line")
    return res.returncode, lines


@server
def test_save_all_then_restore_all_after_a_restart(kept, tmp_path):
    """--save-all (llama-swap's cmdStop): one pass storing every slot with a task, exit 0; a second pass
    stores nothing again (the journal); the server killed and started again, --restore-all restores and
    proves it, exit 0."""
    store = tmp_path / "store"
    store.mkdir()
    kept.completion(SAMPLE_PROMPT + " Save all", slot=1, n_predict=3)
    code, lines = keep_once(kept, store, "--save-all")
    assert code == 0, lines
    stored = [e for e in lines if e["event"] == "stored"]
    assert 1 in [e["slot"] for e in stored] and lines[-1]["event"] == "stop"
    code, again = keep_once(kept, store, "--save-all")
    assert code == 0 and not [e for e in again if e["event"] in ("saved", "stored")], again
    kept.kill_and_start_again()
    code, lines = keep_once(kept, store, "--restore-all")
    assert code == 0, lines
    mine = next(e for e in stored if e["slot"] == 1)["details"]
    restored = next(e for e in lines if e["event"] == "restored" and e["slot"] == 1)["details"]
    assert restored["name"] == mine["name"]
    proof = next(e for e in lines if e["event"] == "proof" and e["slot"] == 1)["details"]["proof"]
    assert (proof["verdict"], proof["n_reused"]) == ("proven", mine["n_tokens"] - 1)
    assert slotctl("keep", "--server", kept.url, "--slot-dir", tmp_path, "--save-all", "--restore-all",
                   code=2).stderr.strip() == "error: --save-all and --restore-all: give one"


@server
def test_keep_newest_keeps_the_newest_states_of_a_slot(kept, tmp_path):
    emptied(kept)
    store = tmp_path / "store"
    store.mkdir()
    keep = Keep(kept, store, "--every", "0.2", "--keep-newest", "1")
    try:
        keep.wait_for("up")
        kept.completion(SAMPLE_PROMPT + " first", slot=1, n_predict=2)
        first = keep.wait_for("stored", 1)["details"]
        kept.completion(SAMPLE_PROMPT + " second", slot=1, n_predict=2)
        second = keep.wait_for("stored", 1)["details"]
        pruned = keep.wait_for("pruned")["details"]
        assert pruned["path"] == first["path"] and pruned["size"] == first["size"]
        states = sorted(p.name for p in store.iterdir() if p.name.startswith("slot1-"))
        assert states == [second["name"]]
    finally:
        assert keep.stop() == 0


# -- the fleet view --------------------------------------------------------------------------------------------


def stored_by_keep(srv, tmp_path: Path, words: str, *, slot: int) -> tuple[Path, list[dict]]:
    """A store (``tmp_path/store``) that keep --save-all filled after a request in ``slot``; keep's lines."""
    store = tmp_path / "store"
    store.mkdir()
    srv.completion(SAMPLE_PROMPT + words, slot=slot, n_predict=2)
    code, lines = keep_once(srv, store, "--save-all")
    assert code == 0, lines
    return store, lines


@server
def test_slots_shows_every_servers_slots_in_one_table(one, three, tmp_path):
    """Two real servers (-np 2 and -np 3), one of them with a store keep --save-all wrote: one document with
    both servers' slots, the tokens of the slot used, its stored states (a whole one and a copy cut short,
    newer) and when the newest was saved, each judged for the server; the best is the whole one, and its
    predicted reuse is what the server itself then keeps (timings.cache_n of a request extending the saved
    prompt, after the state is restored into another slot); a server down is a row with its error and exit
    2, the others still shown."""
    store, lines = stored_by_keep(one, tmp_path, " The fleet", slot=1)
    saved = next(e for e in lines if e["event"] == "saved" and e["slot"] == 1)["details"]["answer"]
    whole = next(e for e in lines if e["event"] == "stored" and e["slot"] == 1)["details"]["name"]
    data = (store / whole).read_bytes()
    # the same slot, model and tokens, named by the checksum of its own bytes: a state of the slot too
    cut = whole.rsplit("-", 1)[0] + "-" + hashlib.sha256(data[:-100]).hexdigest()[:16] + ".bin"
    (store / cut).write_bytes(data[:-100])
    os.utime(store / cut, (time.time() + 5, time.time() + 5))    # the newest
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(f"[[servers]]\nname = 'one'\nurl = '{one.url}'\nstore = '{store}'\n"
                   f"[[servers]]\nname = 'three'\nurl = '{three.url}'\n")
    doc = json.loads(slotctl("slots", "--config", cfg, "--json", code=0).stdout)
    json_schemas.check("slots", doc)
    a, b = doc["servers"]
    assert (a["name"], b["name"]) == ("one", "three") and [len(a["slots"]), len(b["slots"])] == [2, 3]
    row = a["slots"][1]
    assert row["n_tokens"] == saved["n_saved"] and row["busy"] is False
    assert row["stored_states"] == 2 and row["last_saved"] == row["states"][0]["saved"]
    newest, older = row["states"]
    assert (newest["name"], older["name"]) == (cut, whole)
    assert newest["verdict"] not in ("restores", "restores_with_drops") and newest["n_reused"] is None
    assert newest["reason"].startswith("validate says the server")
    assert older["verdict"] == "restores" and older["n_tokens"] == saved["n_saved"]
    assert row["best"] == {"name": whole, "n_tokens": older["n_tokens"], "n_reused": older["n_reused"],
                           "reason": older["reason"]}
    assert all(s["stored_states"] is None and s["states"] == [] and s["best"] is None for s in b["slots"])
    # the states of slot 1 are not slot 0's
    assert a["slots"][0]["stored_states"] == 0 and a["slots"][0]["best"] is None
    # the prediction against the server's own count: the best state restored into slot 0, then a request
    # that extends its prompt
    shutil.copy(store / whole, one.save_dir / "fleet-best.bin")
    status, answer = one.restore(0, "fleet-best.bin")
    assert status == 200, answer
    tokens = tokens_of(store / whole)
    timings = one.completion(tokens + tokens[1:9], slot=0, n_predict=1)["timings"]
    assert timings["cache_n"] == row["best"]["n_reused"], (timings, row["best"])
    # the table: the best's reuse of its tokens; a slot without states '-'
    res = slotctl("slots", "--config", cfg, code=0)
    assert "best reuse" in res.stdout
    n = f"{row['best']['n_tokens']:,}"
    assert f"{row['best']['n_reused']:,} of {n}" in res.stdout, res.stdout
    # --store for servers given with --server (the same store: `three` runs the same model, so slot 1's
    # states are offered to its slot 1 too, judged for three)
    doc = json.loads(slotctl("slots", "--server", one.url, "--server", three.url, "--store", store, "--json",
                             code=0).stdout)
    json_schemas.check("slots", doc)
    assert [d["store"] for d in doc["servers"]] == [str(store)] * 2
    assert doc["servers"][0]["slots"][1]["best"]["name"] == whole
    assert doc["servers"][1]["slots"][1]["stored_states"] == 2
    # a long-running process keeps the judgements of the states the store holds, and forgets a pruned one
    from slotctl.fleet.view import stored_states
    from slotctl.keeping.states import ServerStates
    from slotctl.live import http

    kept_here = ServerStates(one.url, None, str(store))
    kept_here.set_facts(http.server_facts(one.url))
    assert len(stored_states(kept_here, 1)) == 2 and kept_here.held() == 2
    (store / cut).unlink()
    assert [s["name"] for s in stored_states(kept_here, 1)] == [whole]
    assert kept_here.held() == 1
    # repeated --server: both servers (before, the last one only)
    doc = json.loads(slotctl("slots", "--server", one.url, "--server", three.url, "--json", code=0).stdout)
    assert [d["server"] for d in doc["servers"]] == [one.url, three.url]
    # a server down: its row says so, exit 2, the others shown
    down = f"http://127.0.0.1:{free_port()}"
    res = slotctl("slots", "--server", one.url, "--server", down, code=2)
    table, _, total = res.stdout.rstrip("\n").rpartition("\n")
    assert re.findall(r"\b(idle|error)\b", table) == ["idle", "idle", "error"], res.stdout
    assert total == "2 server(s), 2 slot(s), 0 busy, 1 with an error"
    assert f"{down}: GET {down}/props: connection refused" in res.stderr
    doc = json.loads(slotctl("slots", "--server", one.url, "--server", down, "--json", code=2).stdout)
    json_schemas.check("slots", doc)
    assert doc["servers"][1]["error"]["code"] == "server_unreachable"


@server
def test_a_state_asked_for_while_it_is_judged_is_read_once(one, tmp_path, monkeypatch):
    """Two threads judge one stored state at once (serve's save judging the state it stored while a returning
    turn, after a router's swap, asks for it): validate reads it once, and both have that verdict."""
    from concurrent.futures import ThreadPoolExecutor

    from slotctl.keeping import judging, states
    from slotctl.live import http

    store, lines = stored_by_keep(one, tmp_path, " Judged once", slot=0)
    name = next(e for e in lines if e["event"] == "stored" and e["slot"] == 0)["details"]["name"]
    reads, real = [], judging.judge_file

    def read(*args, **kwargs):
        reads.append(args[0])
        time.sleep(0.5)         # long enough for the other thread to ask meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(judging, "judge_file", read)
    here = states.ServerStates(one.url, None, str(store), catalog=False)
    here.set_facts(http.server_facts(one.url))
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda slot: here.judge(name, slot), [0, 1]))
    assert reads == [here.store.where(name)]
    assert [g.verdict for g in got] == ["restores"] * 2 and got[0].identity == got[1].identity
    assert here.judging._judging == {}      # nothing left behind for a state no longer asked for


@server
def test_slots_watch_prints_rows_on_a_pipe_and_redraws_on_a_terminal(one, three, tmp_path):
    """--watch with --store: each pass's rows on a pipe (the eight columns, the stored state's predicted
    reuse in each), the table redrawn on a terminal."""
    import pty
    import select

    store, lines = stored_by_keep(one, tmp_path, " Watch", slot=1)
    n = next(e for e in lines if e["event"] == "stored" and e["slot"] == 1)["details"]["n_tokens"]
    args = [sys.executable, "-m", "slotctl", "slots", "--server", one.url, "--server", three.url, "--store", store,
            "--watch", "0.2"]
    args = [str(a) for a in args]
    # the child gets a default SIGINT (a suite run as a background job ignores it, and a child inherits that)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            preexec_fn=default_signals)
    lines = []
    try:
        while len(lines) < 15:      # three refreshes of 5 rows
            lines.append(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        proc.stdout.close()
        proc.stderr.close()
    rows = [line.rstrip("\n").split("\t") for line in lines]
    assert all(len(r) == 8 for r in rows) and not any("\x1b" in line for line in lines), lines
    assert [r[0] for r in rows[:5]] == [one.url] * 2 + [three.url] * 3
    assert [r[2] for r in rows[:5]] == ["0", "1", "0", "1", "2"] and rows[:5] == rows[5:10]
    assert rows[1][6] == "1" and rows[1][7] == f"{n:,} of {n:,}", rows[1]      # one's slot 1: its state, all kept
    # a terminal: the cursor home and the screen cleared before each table
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=slave, stderr=slave, env=child_env({"COLUMNS": "160", "TERM": "xterm"}),
                            preexec_fn=default_signals)
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 60
        while out.count(b"\x1b[H\x1b[J") < 3 and time.monotonic() < deadline:
            if select.select([master], [], [], 1)[0]:
                out += os.read(master, 65536)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        os.close(master)
    assert out.count(b"\x1b[H\x1b[J") >= 3
    assert out.count(b"last saved") >= 3 and b"2 server(s), 5 slot(s)" in out


@server
def test_slots_judges_the_states_of_an_s3_store_as_validate_does(one, seaweed, tmp_path):
    """--store s3://: the states keep --save-all stored in a real SeaweedFS, judged for the server (read
    through the store): each state's verdict, tokens and predicted reuse equal
    `validate --server`'s for the same object (the b11434 rule: the server's build)."""
    env = child_env({**seaweed.env(), "HOME": str(seaweed.dir)}, drop_aws=True)
    store = f"s3://{BUCKET}/fleet-view/"
    one.completion(SAMPLE_PROMPT + " The bucket", slot=0, n_predict=2)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "slotctl", *map(str, args)], capture_output=True, text=True,
                              env=env, timeout=300)

    res = run("keep", "--server", one.url, "--slot-dir", one.save_dir, "--store", store, "--save-all", "--json",
              "--timeout", "60")
    assert res.returncode == 0, res.stderr
    stored = [json.loads(x)["details"] for x in res.stdout.splitlines() if json.loads(x)["event"] == "stored"]
    mine = next(d for d in stored if d["name"].startswith("slot0-"))
    res = run("slots", "--server", one.url, "--store", store, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    json_schemas.check("slots", doc)
    row = doc["servers"][0]["slots"][0]
    assert [s["name"] for s in row["states"]] == [mine["name"]] and row["stored_states"] == 1
    state = row["states"][0]
    res = run("validate", "--server", one.url, store + mine["name"], "--json")
    assert res.returncode == 0, res.stderr
    v = json.loads(res.stdout)["files"][0]
    assert (state["verdict"], state["n_tokens"]) == (v["verdict"], v["n_tokens"]) == ("restores", mine["n_tokens"])
    assert state["n_reused"] == v["reuse"]["b11434"]["n_reused"] == row["best"]["n_reused"]
    assert row["best"]["name"] == mine["name"]


@server
def test_slots_predicts_what_a_sliding_window_server_keeps(llama_server_bin, tmp_path):
    """A real server of an SWA model (gemma2's kind): its state's predicted reuse (b11434 keeps no
    checkpoint after a restore, and a slot file holds only the window) says why fewer, and equals the
    server's own cache_n for a request extending the saved prompt after the state is restored."""
    from conftest import start_server
    from slotctl.tinymodels import make_kind_model

    model = make_kind_model("gemma2", tmp_path / "gemma2.gguf")
    (tmp_path / "slots").mkdir()
    store = tmp_path / "store"
    store.mkdir()
    srv = start_server(llama_server_bin, model, tmp_path, "gemma2", args=["-c", "512", "-np", "1", "-fa", "on"],
                       slot_save_path=tmp_path / "slots")
    srv.save_dir = tmp_path / "slots"
    try:
        srv.completion(SAMPLE_PROMPT, slot=0, n_predict=2)
        code, lines = keep_once(srv, store, "--save-all")
        assert code == 0, lines
        name = next(e for e in lines if e["event"] == "stored")["details"]["name"]
        doc = json.loads(slotctl("slots", "--server", srv.url, "--store", store, "--json", code=0).stdout)
        json_schemas.check("slots", doc)
        best = doc["servers"][0]["slots"][0]["best"]
        assert best["name"] == name and best["n_reused"] < best["n_tokens"] and best["reason"], best
        status, _ = srv.erase(0)
        assert status == 200
        shutil.copy(store / name, srv.save_dir / "swa-best.bin")
        status, answer = srv.restore(0, "swa-best.bin")
        assert status == 200, answer
        tokens = tokens_of(store / name)
        timings = srv.completion(tokens + tokens[1:9], slot=0, n_predict=1)["timings"]
        assert timings["cache_n"] == best["n_reused"], (timings, best)
    finally:
        srv.stop()
