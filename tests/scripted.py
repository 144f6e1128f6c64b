"""Scripted HTTP servers on 127.0.0.1 for live mode's tests (tests/test_hostile_server.py, test_live_hardened.py,
test_unbounded.py, test_keep_alive.py): a few lines of ``http.server`` answering what a case scripts (the fixture
``serve`` in conftest.py starts them), a real HTTP and CONNECT proxy written with ``socket``, and what a good
llama-server answers."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

GOOD_PROPS = {"total_slots": 2, "model_path": "/models/m.gguf", "build_info": "b11434",
              "default_generation_settings": {"n_ctx": 4096}}
GOOD_SLOTS = [{"id": 0, "n_ctx": 4096, "speculative": False, "is_processing": False},
              {"id": 1, "n_ctx": 4096, "speculative": False, "is_processing": False}]


class Script:
    """What a hostile server answers: ``answer(handler)`` writes the whole response."""

    def __init__(self, answer):
        self.answer = answer
        self.seen: list[tuple[str, str, dict]] = []


def handler(script: Script):
    class H(BaseHTTPRequestHandler):
        def _any(self):
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            script.seen.append((self.command, self.path, dict(self.headers)))
            try:
                script.answer(self)
            except (BrokenPipeError, ConnectionResetError):
                pass

        do_GET = do_POST = _any

        def log_message(self, *a):
            pass

    return H


def send_json(h: BaseHTTPRequestHandler, obj, status: int = 200) -> None:
    body = json.dumps(obj).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def by_path(routes: dict):
    """An answer that looks up the path (without the query) in ``routes``: (status, JSON) pairs."""

    def answer(h):
        status, obj = routes.get(h.path.split("?")[0], (404, {"error": {"code": 404, "message": "File Not Found"}}))
        send_json(h, obj, status)

    return answer


def one_error_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def drip_body(h):
    """Headers at once, then one byte of the body every 0.2 s, for a long time."""
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", "100000")
    h.end_headers()
    for _ in range(600):
        h.wfile.write(b" ")
        h.wfile.flush()
        time.sleep(0.2)


#: server text with a terminal's control sequences in it
HOSTILE = "boom\x1b[2J\x1b]0;pwned\x07\rline\nnext"


class Proxy:
    """A real HTTP proxy on 127.0.0.1 (sockets, threads): plain requests forwarded, CONNECT tunnelled.

    ``user``/``password``: the credentials it wants (407 without them); ``drip``: seconds between the
    bytes of its answer to CONNECT (a proxy that never finishes answering). ``seen``: each request's
    first line and its Proxy-Authorization header.
    """

    def __init__(self, *, user: str | None = None, password: str | None = None, drip: float | None = None):
        self.want = (f"Basic {base64.b64encode(f'{user}:{password}'.encode()).decode()}" if user else None)
        self.drip = drip
        self.seen: list[tuple[str, str | None]] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            head, rest = head.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            self.seen.append((lines[0], headers.get("proxy-authorization")))
            if self.want and headers.get("proxy-authorization") != self.want:
                conn.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic "
                             b"realm=\"p\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            method, target, _ = lines[0].split(" ", 2)
            if method == "CONNECT":
                if self.drip is not None:
                    for byte in b"HTTP/1.1 200 Connection established\r\n":
                        conn.sendall(bytes([byte]))
                        time.sleep(self.drip)
                    return
                host, port = target.rsplit(":", 1)
                up = socket.create_connection((host, int(port)))
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                self._pipe(conn, up)
                return
            # a plain request: forward it to the origin named in the absolute target
            hostport = target.split("://", 1)[1].split("/", 1)[0]
            path = "/" + target.split("://", 1)[1].split("/", 1)[1] if "/" in target.split("://", 1)[1] else "/"
            host, port = hostport.rsplit(":", 1)
            up = socket.create_connection((host, int(port)))
            kept = [ln for ln in lines[1:] if not ln.lower().startswith("proxy-authorization")]
            up.sendall(f"{method} {path} HTTP/1.1\r\n".encode() + "\r\n".join(kept).encode() + b"\r\n\r\n" + rest)
            self._pipe(conn, up)
        except OSError:
            pass
        finally:
            conn.close()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        def one_way(src, dst):
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        t = threading.Thread(target=one_way, args=(b, a), daemon=True)
        t.start()
        one_way(a, b)
        t.join(5)


def own_address() -> str:
    """An address of this machine that is not loopback (slotctl sends only those through a proxy)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))   # no packet is sent: it picks the outgoing interface
        addr = s.getsockname()[0]
    except OSError:
        addr = ""
    finally:
        s.close()
    if not addr or addr.startswith("127."):
        pytest.skip("this machine has no address besides loopback")
    return addr
