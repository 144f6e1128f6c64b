"""Connections kept open between requests (``slotctl.live.transport.Pool``, what serve's own requests use):
against a real llama-server b11434, which closes a connection idle for 5 s and the 100th request's of one
(cpp-httplib's keep-alive), and against scripted servers for what a real one does not do on demand.

A request on a kept connection the server closed meanwhile is sent once more, on a new connection: never more,
and never a request whose connection was new. Without a pool nothing changes: one connection per request,
``Connection: close``.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import start_server
from slotctl.live import http
from slotctl.live.transport import Pool, normalize_url

server = pytest.mark.server
TIMEOUT = 20.0


def _kept(pool: Pool) -> list:
    """The connections ``pool`` keeps now (the test looks at them: none is taken from it)."""
    with pool._lock:
        return [c for conns in pool._idle.values() for c in conns]


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` seconds: waits for its end (a read of nothing),
    never for a fixed time."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if readable:
            return sock.recv(1, socket.MSG_PEEK) == b""
    return False


@pytest.fixture(scope="module")
def llama(llama_server_bin, tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keepalive")
    (tmp / "slots").mkdir()
    srv = start_server(llama_server_bin, tiny_models.target, tmp, "keepalive", args=["-c", "256", "-np", "1"],
                       slot_save_path=tmp / "slots")
    yield srv
    srv.stop()


@server
def test_a_pools_requests_share_one_connection(llama):
    pool = Pool()
    try:
        http.get_health(llama.url, timeout=TIMEOUT, pool=pool)
        (conn,) = _kept(pool)
        port = conn.sock.getsockname()[1]
        facts = http.server_facts(llama.url, timeout=TIMEOUT, pool=pool)     # /props, /slots, /v1/models
        answer = http.save_slot(llama.url, 0, "kept-alive.bin", timeout=TIMEOUT, pool=pool)   # a POST
        assert facts.total_slots == 1 and answer["filename"] == "kept-alive.bin"
        (conn,) = _kept(pool)
        assert conn.sock.getsockname()[1] == port
        assert (pool.made, pool.retried) == (1, 0)
    finally:
        pool.close()
    assert _kept(pool) == []


@server
def test_a_connection_the_server_closed_while_idle_is_sent_on_once_more(llama):
    """llama-server closes a connection idle for 5 s; the next request written on it finds it closed before
    it was read, and goes again on a new connection: a GET, then a POST (a slot save, which the server makes
    once)."""
    pool = Pool()
    try:
        http.get_slots(llama.url, timeout=TIMEOUT, pool=pool)
        for n, (act, check) in enumerate([
                (lambda: http.get_slots(llama.url, timeout=TIMEOUT, pool=pool), lambda got: got[0]["id"] == 0),
                (lambda: http.save_slot(llama.url, 0, "after-idle.bin", timeout=TIMEOUT, check=False, pool=pool),
                 lambda got: got["filename"] == "after-idle.bin" and got["n_written"] > 0)], start=1):
            (conn,) = _kept(pool)
            assert _closed_by_peer(conn.sock, 30), "the server kept an idle connection open for 30 s"
            assert check(act())
            assert (pool.made, pool.retried) == (1 + n, n)
        assert (llama.slot_save_path / "after-idle.bin").is_file()
        assert llama.proc.poll() is None
    finally:
        pool.close()


@server
def test_the_servers_last_request_of_a_connection_closes_it_without_a_retry(llama):
    """cpp-httplib answers the 100th request of a connection with ``Connection: close``: the pool does not keep
    that connection, so the next request goes on a new one at once (no retry)."""
    pool = Pool()
    try:
        for _ in range(150):
            assert http.get_health(llama.url, timeout=TIMEOUT, pool=pool) == {"status": "ok"}
        assert (pool.made, pool.retried) == (2, 0)
    finally:
        pool.close()


# -- scripted servers ------------------------------------------------------------------------------------


class Scripted:
    """An HTTP/1.1 server on 127.0.0.1 (connections kept open) that answers ``{"status": "ok"}`` to the first
    ``answered`` requests and closes the connection unanswered after reading every later one; ``seen`` holds
    each request as (connection number, method, path, headers)."""

    def __init__(self, answered: int, host: str = "127.0.0.1"):
        self.answered = answered
        self.seen: list[tuple[int, str, str, dict]] = []
        self.connections = 0
        script = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                script.connections += 1
                self.number = script.connections

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                script.seen.append((self.number, self.command, self.path, dict(self.headers)))
                if len(script.seen) > script.answered:
                    self.close_connection = True      # read, and closed without a byte of answer
                    return
                body = b'{"status": "ok"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _any

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer((host, 0), Handler)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def scripted():
    made = []

    def make(answered: int, host: str = "127.0.0.1") -> Scripted:
        made.append(Scripted(answered, host))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_request_is_sent_once_more_at_most(scripted):
    """A server that reads a request and closes the connection unanswered, on a kept connection and again on
    the new one: the request went twice, never a third time, and the error is the second connection's."""
    srv = scripted(answered=1)
    pool = Pool()
    try:
        http.get_health(srv.url, timeout=TIMEOUT, pool=pool)
        with pytest.raises(http.ServerDropped, match="closed the connection without answering"):
            http.get_health(srv.url, timeout=TIMEOUT, pool=pool)
        assert [(n, m, p) for n, m, p, _ in srv.seen] == [(1, "GET", "/health"), (1, "GET", "/health"),
                                                          (2, "GET", "/health")]
        assert (pool.made, pool.retried) == (2, 1)
    finally:
        pool.close()


def test_a_new_connection_closed_unanswered_is_never_sent_again(scripted):
    srv = scripted(answered=0)
    pool = Pool()
    try:
        with pytest.raises(http.ServerDropped):
            http.request(srv.url, "POST", "/completion", {"prompt": "x"}, timeout=TIMEOUT, pool=pool)
        assert [(n, m, p) for n, m, p, _ in srv.seen] == [(1, "POST", "/completion")]
        assert (pool.made, pool.retried) == (1, 0)
    finally:
        pool.close()


def test_without_a_pool_each_request_has_a_connection_of_its_own(scripted):
    srv = scripted(answered=3)
    pool = Pool()
    try:
        http.get_health(srv.url, timeout=TIMEOUT)
        http.get_health(srv.url, timeout=TIMEOUT)
        http.get_health(srv.url, timeout=TIMEOUT, pool=pool)
        assert [n for n, *_ in srv.seen] == [1, 2, 3]
        assert [h.get("Connection") for *_, h in srv.seen] == ["close", "close", None]
    finally:
        pool.close()


def test_a_pool_keeps_no_connection_made_through_a_proxy(scripted, monkeypatch):
    """Through a proxy (the environment's, for an address that is not loopback) every request has a connection
    of its own, pool or not: a kept tunnel would be the proxy's to close."""
    from scripted import Proxy, own_address

    srv = scripted(answered=2, host="0.0.0.0")
    public = f"http://{own_address()}:{srv.srv.server_address[1]}"
    proxy = Proxy()
    for k in [k for k in os.environ if "proxy" in k.lower()]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.port}")
    pool = Pool()
    try:
        http.get_health(public, timeout=TIMEOUT, pool=pool)
        http.get_health(public, timeout=TIMEOUT, pool=pool)
        assert len(proxy.seen) == 2 and [n for n, *_ in srv.seen] == [1, 2]
        assert _kept(pool) == [] and pool.made == 2
    finally:
        pool.close()
        proxy.close()


def test_a_pool_closed_closes_what_it_is_given_back(scripted):
    srv = scripted(answered=2)
    pool = Pool()
    http.get_health(srv.url, timeout=TIMEOUT, pool=pool)
    (conn,) = _kept(pool)
    pool.close()
    assert conn.sock is None and _kept(pool) == []
    http.get_health(srv.url, timeout=TIMEOUT, pool=pool)
    assert _kept(pool) == [] and normalize_url(srv.url) == srv.url
