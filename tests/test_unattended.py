"""Running unattended (docs/fleet.md): one keeper per server and store, the configuration file, metrics and
health, systemd's notify protocol, the unit files.

Every keeper here is a real ``slotctl keep`` process (its signals, its lock and its sockets are real); the
stores are directories and a real SeaweedFS (tests/seaweed.py); the servers real llama-server b11434.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from llama_server import free_port
from seaweed import BUCKET
from test_fleet import Keep, kept, slotctl  # noqa: F401 - the keep process helper, the server under keep
from test_store import seaweed  # noqa: F401 - the real S3 server (SeaweedFS), session-scoped
from slotctl.tinymodels import SAMPLE_PROMPT

ROOT = Path(__file__).resolve().parents[1]
server = pytest.mark.server


def _env(extra: dict | None = None, drop_aws: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not (drop_aws and k.startswith("AWS_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def keep_proc(url: str, slot_dir: Path, *more: str, env: dict | None = None) -> subprocess.Popen:
    """``slotctl keep --json`` as a process of its own."""
    return subprocess.Popen([sys.executable, "-m", "slotctl", "keep", "--server", url, "--slot-dir", str(slot_dir),
                             "--json", "--timeout", "5", *more], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env or _env())


def first_line(proc: subprocess.Popen, timeout: float = 60) -> dict:
    """The first JSON line of a keep process (its ``start`` event), or the failure it exited with."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise AssertionError(f"keep said nothing within {timeout} s")
    line = proc.stdout.readline()
    assert line, f"keep exited with {proc.wait(5)}: {proc.stderr.read()}"
    return json.loads(line)


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(30)
    finally:
        proc.stdout.close()
        proc.stderr.close()


# -- one keeper per server and store ----------------------------------------------------------------------


def test_a_second_keeper_of_a_server_and_directory_store_is_refused(tmp_path):
    """flock in the store: the second keep exits 2 with one line naming the first; a keep killed with
    SIGKILL leaves nothing held (the kernel drops the lock), so the next one starts at once."""
    url = f"http://127.0.0.1:{free_port()}"      # nothing listens: keep runs, its looks say "down"
    a = keep_proc(url, tmp_path, "--every", "0.2")
    try:
        assert first_line(a)["event"] == "start"
        b = subprocess.run([sys.executable, "-m", "slotctl", "keep", "--server", url, "--slot-dir", str(tmp_path)],
                           capture_output=True, text=True, env=_env(), timeout=60)
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
                            "--json"], capture_output=True, text=True, env=_env(), timeout=60)
        assert b.returncode == 2 and json.loads(b.stdout)["error"]["code"] == "locked", b
    finally:
        stop(a, signal.SIGKILL)
    c = keep_proc(url, tmp_path, "--every", "0.2")
    try:
        assert first_line(c)["event"] == "start"
    finally:
        assert stop(c) == 0


def _lease(seaweed, prefix: str) -> tuple[str, dict]:
    import obstore

    client = seaweed.client()
    found = [m["path"] for m in obstore.list(client, prefix=prefix).collect() if m["path"].endswith(".lease")]
    assert len(found) == 1, found
    return found[0], json.loads(bytes(obstore.get(client, found[0]).bytes()))


def test_an_s3_lease_is_refused_while_it_holds_and_taken_over_after_its_expiry(seaweed, tmp_path):
    """A keeper killed with SIGKILL: its lease is refused to the next until its expiry, never before, and
    taken over after it; the journal it wrote passes to the next."""
    env = _env({**seaweed.env(), "HOME": str(seaweed.dir)}, drop_aws=True)
    store = f"s3://{BUCKET}/lease-{tmp_path.name}/"
    url = f"http://127.0.0.1:{free_port()}"
    args = ("--store", store, "--every", "0.2", "--lease", "6")
    a = keep_proc(url, tmp_path, *args, env=env)
    assert first_line(a)["event"] == "start"
    key, doc = _lease(seaweed, f"lease-{tmp_path.name}/")
    assert doc["pid"] == a.pid and doc["ttl"] == 6
    stop(a, signal.SIGKILL)
    killed = time.time()
    _, doc = _lease(seaweed, f"lease-{tmp_path.name}/")
    expires = doc["expires"]
    assert expires > killed
    refused = 0
    while time.time() < expires - 1.5:      # before the expiry (with a margin for the process's start-up)
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
        _, doc = _lease(seaweed, f"lease-{tmp_path.name}/")
        assert doc["pid"] == c.pid and doc["expires"] > time.time()
    finally:
        assert stop(c) == 0
    # stopped cleanly: the lease is marked released, the next keeper need not wait
    _, doc = _lease(seaweed, f"lease-{tmp_path.name}/")
    assert doc["released"] is True
    d = keep_proc(url, tmp_path, *args, env=env)
    try:
        assert first_line(d)["event"] == "start"
    finally:
        assert stop(d) == 0


def test_a_keeper_whose_lease_was_taken_over_stops_writing(seaweed, tmp_path):
    """A keeper frozen (SIGSTOP) past its lease's expiry finds, when it runs again, that another took it
    over: it stops at once without a last save, exit 2, an error line lease_lost."""
    env = _env({**seaweed.env(), "HOME": str(seaweed.dir)}, drop_aws=True)
    store = f"s3://{BUCKET}/taken-{tmp_path.name}/"
    url = f"http://127.0.0.1:{free_port()}"
    args = ("--store", store, "--every", "0.2", "--lease", "3")
    a = keep_proc(url, tmp_path, *args, env=env)
    assert first_line(a)["event"] == "start"
    a.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3.5)
        b = keep_proc(url, tmp_path, *args, env=env)
        assert first_line(b)["event"] == "start"
    finally:
        a.send_signal(signal.SIGCONT)
    try:
        assert a.wait(30) == 2
        events = [json.loads(x) for x in a.stdout.read().splitlines()]
        errors = [e for e in events if e["event"] == "error"]
        assert errors and errors[-1]["details"]["error"]["code"] == "lease_lost", events
        assert events[-1]["event"] == "stop" and "without a last save" in events[-1]["message"]
        _, doc = _lease(seaweed, f"taken-{tmp_path.name}/")
        assert doc["pid"] == b.pid        # the frozen keeper wrote nothing over the new holder's lease
    finally:
        stop(a)
        assert stop(b) == 0


@server
def test_a_keeper_started_again_does_not_save_what_the_store_has(kept, tmp_path):
    """The journal: a keep stopped and started again against the same server and store does not ask the
    server to save a slot whose state the store already has; a new task is saved as before."""
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
    keep = Keep(kept, store, "--every", "0.2")
    try:
        keep.wait_for("up")
        time.sleep(2)       # ten looks
        kept.completion(SAMPLE_PROMPT + " The journal goes on", slot=0, n_predict=3)
        again = keep.wait_for("stored", 0)["details"]
        assert again["name"] != stored["name"]
    finally:
        assert keep.stop() == 0
    # one save of slot 0 in the second run: the new task's (the state the store had was not saved again)
    assert [e["event"] for e in keep.seen if e["slot"] == 0] == ["saved", "stored"], keep.seen
