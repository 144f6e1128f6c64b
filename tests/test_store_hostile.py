"""Stores that stall, drip, truncate and reset (issue 27): a small TCP proxy written here, on 127.0.0.1 only,
in front of the real SeaweedFS (tests/seaweed.py). ``prune``, ``ls`` and ``cp`` over ``s3://`` each end in
bounded time with one error line and exit 2: ``--timeout`` is one deadline for the whole command, and a store
that stopped answering stops the run with one error instead of failing object after object.

The proxy lets the first ``after`` requests through (counted on the request lines the client sends), then
does to every later answer what its mode says: ``stall`` (nothing more, the connection held open), ``drip``
(a byte every 0.2 s), ``truncate`` (the first 200 bytes, then the connection closed) or ``reset`` (an RST).
Every socket and thread of it is closed at the end of its test.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import DATA
from seaweed import BUCKET
from test_store import put, seaweed  # noqa: F401 - the real S3 server (SeaweedFS), session-scoped

ROOT = Path(__file__).resolve().parents[1]
SLOT = DATA / "srv-np1.bin"


class Proxy:
    """A TCP proxy on 127.0.0.1 to ``upstream`` port; see the module docstring."""

    def __init__(self, upstream: int, mode: str = "pass", after: int = 0):
        self.upstream, self.mode, self.after = upstream, mode, after
        self.requests = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        self.closed = threading.Event()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            with self.lock:
                self.sockets += [client, up]
            threading.Thread(target=self._pipe, args=(client, up), daemon=True).start()

    def _pipe(self, client: socket.socket, up: socket.socket) -> None:
        broken = False
        sent = 0
        try:
            while not self.closed.is_set():
                ready, _, _ = select.select([client, up], [], [], 0.2)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is client:
                        with self.lock:
                            self.requests += data.count(b" HTTP/1.1\r\n")
                            broken = broken or (self.mode != "pass" and self.requests > self.after)
                        up.sendall(data)
                        continue
                    if not broken:
                        client.sendall(data)
                    elif self.mode == "stall":
                        continue                    # read from the store, never passed on
                    elif self.mode == "drip":
                        for i in range(len(data)):
                            if self.closed.is_set():
                                return
                            client.sendall(data[i:i + 1])
                            time.sleep(0.2)
                    elif self.mode == "truncate":
                        keep = max(0, 200 - sent)
                        client.sendall(data[:keep])
                        sent += keep
                        if sent >= 200:
                            client.shutdown(socket.SHUT_RDWR)
                            return
                    elif self.mode == "reset":
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        client.close()
                        return
        except OSError:
            return

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            for s in self.sockets:
                try:
                    s.close()
                except OSError:
                    pass


@pytest.fixture
def objects(seaweed):
    """Three slot objects under a prefix of their own, and the environment of a client of the store."""
    prefix = f"hostile-{time.monotonic_ns()}"
    for name in ("a.bin", "b.bin", "c.bin"):
        put(seaweed, f"{prefix}/{name}", SLOT.read_bytes())
    return seaweed, f"s3://{BUCKET}/{prefix}/"


def run_through(srv, proxy: Proxy, *args: str, limit: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(srv.env(), HOME=str(srv.dir), PYTHONPATH=str(ROOT), COLUMNS="200",
               AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "slotctl", *args], capture_output=True, text=True, env=env,
                         timeout=limit)
    return res, time.monotonic() - t0


def one_error(res: subprocess.CompletedProcess) -> str:
    lines = res.stderr.splitlines()
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    assert "internal error" not in lines[0]
    return lines[0]


#: the command's time: --timeout, and the start-up of a Python process on a loaded 2-core machine
TIMEOUT = 4
SLACK = 12


def commands(prefix: str, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "prune": ["prune", prefix, "--max-size", "0", "--grace", "0"],
        "ls": ["ls", prefix],
        "cp down": ["cp", prefix + "a.bin", str(tmp_path / "a.bin")],
        "cp up": ["cp", str(SLOT), prefix + "new.bin"],
    }


@pytest.mark.parametrize("mode", ["stall", "drip", "truncate", "reset"])
@pytest.mark.parametrize("command", ["prune", "ls", "cp down", "cp up"])
def test_a_hostile_store_ends_the_command_in_bounded_time(objects, tmp_path, mode, command):
    """Everything past the first request (the listing, or the first HEAD) goes wrong: one line, exit 2, within
    --timeout (and start-up); nothing deleted or half-written."""
    srv, prefix = objects
    args = commands(prefix, tmp_path)[command]
    proxy = Proxy(srv.s3_port, mode, after=1)
    try:
        res, took = run_through(srv, proxy, *args, "--timeout", str(TIMEOUT))
    finally:
        proxy.close()
    line = one_error(res)
    assert took < TIMEOUT + SLACK, (took, line)
    assert "store_unreachable" in line or "does not answer" in line or "no answer within" in line \
        or mode == "truncate", line
    if command == "cp down":
        assert not (tmp_path / "a.bin").exists()
    listing = subprocess.run([sys.executable, "-m", "slotctl", "ls", prefix, "--json"], capture_output=True,
                             text=True, env={**os.environ, **srv.env(), "HOME": str(srv.dir), "PYTHONPATH": str(ROOT)})
    import json

    names = sorted(Path(f["path"]).name for f in json.loads(listing.stdout)["files"])
    assert names[:3] == ["a.bin", "b.bin", "c.bin"], names     # a stalled prune deleted nothing it could not check
    assert "new.bin" not in names or json.loads(listing.stdout)["exit_code"] == 0


@pytest.mark.parametrize("mode", ["reset", "truncate"])
def test_a_store_that_dies_mid_prune_stops_it_with_one_error(objects, mode):
    """Without --timeout: the listing answers, then every request fails; prune stops at the first with one
    line (it went on object after object, one failure each)."""
    srv, prefix = objects
    proxy = Proxy(srv.s3_port, mode, after=1)
    try:
        res, took = run_through(srv, proxy, "prune", prefix, "--max-size", "0", "--grace", "0", "--json")
    finally:
        proxy.close()
    one_error(res)
    import json

    doc = json.loads(res.stdout)
    assert doc["error"]["code"] in ("store_unreachable", "store_error"), doc
    assert took < 60, took


def test_a_stalled_store_is_cut_off_at_the_deadline_not_per_object(objects):
    """prune with a stalled store and --timeout 4: one deadline for the whole run (it waited ~120 s per
    object), the error names it."""
    srv, prefix = objects
    proxy = Proxy(srv.s3_port, "stall", after=1)
    try:
        res, took = run_through(srv, proxy, "prune", prefix, "--max-size", "0", "--grace", "0", "--timeout", "4")
    finally:
        proxy.close()
    line = one_error(res)
    assert "no answer within --timeout 4 s" in line and took < 4 + SLACK, (took, line)


def test_through_a_proxy_that_passes_everything_the_commands_work(objects, tmp_path):
    """The proxy itself is sound: with nothing going wrong, ls and cp through it succeed."""
    srv, prefix = objects
    proxy = Proxy(srv.s3_port, "pass")
    try:
        res, _ = run_through(srv, proxy, "ls", prefix, "--timeout", "60")
        assert res.returncode == 0, res.stderr
        res, _ = run_through(srv, proxy, "cp", prefix + "a.bin", str(tmp_path / "a.bin"), "--timeout", "60")
        assert res.returncode == 0, res.stderr
    finally:
        proxy.close()
    assert (tmp_path / "a.bin").read_bytes() == SLOT.read_bytes()


def test_a_long_running_process_tries_the_store_again(objects, monkeypatch):
    """keep's store: a store that stopped answering stops that run (every request refused at once with the
    first error), and the next run (keep's next tick: ObjectStore.again) tries it again."""
    from slotctl.errors import StoreDown
    from slotctl.fleet.states import ObjectStore
    from slotctl.store.s3 import S3_STORE

    srv, prefix = objects
    proxy = Proxy(srv.s3_port, "pass")
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in {**srv.env(), "HOME": str(srv.dir), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}.items():
        monkeypatch.setenv(k, v)
    S3_STORE.reset()
    try:
        store = ObjectStore(prefix)
        assert store.has("a.bin")
        proxy.mode, proxy.after = "reset", proxy.requests
        with pytest.raises(StoreDown):
            store.has("b.bin")
        proxy.mode = "pass"
        t0 = time.monotonic()
        with pytest.raises(StoreDown):      # refused at once, without a request
            store.has("c.bin")
        assert time.monotonic() - t0 < 0.5
        store.again()
        assert store.has("c.bin")
    finally:
        proxy.close()
        S3_STORE.reset()


def test_every_request_of_the_store_goes_through_its_deadline():
    """Every obstore request in slotctl/store/s3.py is made through ``call`` (the deadline, the run-stopping
    error): one made directly would hang a command past --timeout (a LIST added later did, for ls)."""
    import re

    text = (ROOT / "slotctl" / "store" / "s3.py").read_text()
    direct = [m.group(0) for m in re.finditer(r"(?<!lambda: bytes\()obstore\.(get|head|put|copy|delete|list\w*)\(",
                                              text)]
    assert not direct, direct
