"""The transport to a llama-server: one HTTP request, with every guarantee slotctl gives about the wire written here
once (docs/live.md, "What slotctl trusts"). Standard library only (``http.client``, imported when a request is
made: the CLI's options read this package's defaults without it).

* **no redirect is followed** (:class:`~slotctl.live.errors.ServerRedirect`, exit 2): the API key goes only
  to the URL given, and a POST never turns into a GET somewhere else;
* **the answer is bounded**: at most :data:`~slotctl.live.answers.MAX_ANSWER_BYTES` are read (its values and
  depth are bounded before it is parsed: :mod:`slotctl.live.answers`);
* **a deadline bounds the whole request**: connecting, a proxy's CONNECT, sending and reading together, not
  each read (a server or proxy that drips one byte at a time is cut off when the time is up); a GET in
  flight is cut off at once when the process stops (:func:`cut_off_reads`);
* **the proxy environment is obeyed**: requests to loopback addresses never go through a proxy; others go
  through the one ``http_proxy``/``https_proxy``/``no_proxy`` name, as urllib would, with the user and
  password of its URL as ``Proxy-Authorization`` (to the proxy only); its HTTP 407 is
  :class:`~slotctl.live.errors.ProxyRefused` (exit 2);
* **the key is never logged**: the API key (``--api-key``, else ``LLAMA_API_KEY``) goes in ``Authorization:
  Bearer`` to the URL given and nowhere else, and no message names it; a password in a URL is shown as
  ``***`` (:func:`redact`) and never sent.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, NamedTuple

from slotctl.errors import UsageError
from slotctl.live import API_KEY_ENV, is_loopback
from slotctl.live.answers import MAX_ANSWER_BYTES
from slotctl.live.errors import (CutOff, ProxyRefused, ServerAnswerError, ServerDropped, ServerRedirect,
                                 ServerUnreachable)


# -- addresses ---------------------------------------------------------------------------------------


def redact(url: str) -> str:
    """``url`` with its secrets shown as ``***``: the password of its user part (``http://user:PASSWORD@host``),
    a user part without a password (``http://TOKEN@host``), every value of its query (``?token=SECRET``)
    and its fragment: what is printed and put in JSON wherever a URL given or configured appears (a usage
    error that refuses the URL included)."""
    text = str(url)
    head, q, rest = text.partition("?")
    if not q:
        head, q, rest = text.partition("#")
    head = _USER_ONLY.sub(r"\1***@", _PASSWORD.sub(r"\1***@", head))
    if not q:
        return head
    if q == "#":
        return f"{head}#***" if rest else f"{head}#"
    query, hashmark, fragment = rest.partition("#")
    query = re.sub(r"=[^&;]*", "=***", query)
    query = re.sub(r"(^|[&;])([^=&;]+)(?=[&;]|$)", r"\1***", query)   # a bare value (``?SECRET``)
    return f"{head}?{query}" + ("#***" if fragment else hashmark)


_PASSWORD = re.compile(r"((?:^|//)[^/?#@:]*:)[^/?#@]*@")
_USER_ONLY = re.compile(r"((?:^|//))[^/?#@:]+@")


def normalize_url(url: str) -> str:
    """The server's base URL: ``http://`` added when no scheme is given, no trailing slash, a password
    shown as ``***`` (:func:`redact`; it is never sent: llama-server takes an API key, ``--api-key``).

    A path is kept (a server started with ``--api-prefix /x`` answers under ``http://host:port/x``).
    UsageError for an empty URL, a scheme other than http/https, no host, a bad port, a query or fragment.
    """
    raw = (url or "").strip()
    shown = redact(raw)
    if not raw:
        raise UsageError("--server: no URL given (for example http://127.0.0.1:8080)")
    if "://" not in raw:
        raw = "http://" + raw
    try:
        parts = urllib.parse.urlsplit(raw)
        port = parts.port
    except ValueError as e:
        raise UsageError(f"--server {shown!r}: {redact(str(e))}") from None
    if parts.scheme not in ("http", "https"):
        raise UsageError(f"--server {shown!r}: only http:// and https:// URLs are supported")
    if not parts.hostname:
        raise UsageError(f"--server {shown!r}: no host name")
    if parts.query or parts.fragment:
        raise UsageError(f"--server {shown!r}: give the server's base URL, without a query or fragment")
    if port == 0:
        raise UsageError(f"--server {shown!r}: port 0 is not a port a server listens on")
    return redact(urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", "")))


@dataclass(frozen=True)
class _Route:
    """How a request reaches the server: directly, or through the proxy the environment names."""

    host: str
    port: int
    https: bool
    path: str
    #: the proxy's host and port, or None (direct)
    proxy: tuple[str, int] | None = None
    #: ``Proxy-Authorization`` for the proxy (Basic, from the user and password in its URL), or None
    proxy_auth: str | None = None

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def proxy_name(self) -> str:
        return f"{self.proxy[0]}:{self.proxy[1]}" if self.proxy else ""


def _route(base: str) -> _Route:
    """The route to the server at ``base``: loopback addresses directly; others through the proxy the
    environment names (``http_proxy``, ``https_proxy``, ``no_proxy``), as urllib would. The proxy's
    user and password (``http://user:pass@proxy:3128``) become its ``Proxy-Authorization`` header."""
    import base64
    import urllib.request

    parts = urllib.parse.urlsplit(base)
    host = parts.hostname or ""
    https = parts.scheme == "https"
    route = _Route(host, parts.port or (443 if https else 80), https, parts.path)
    if is_loopback(host):
        return route
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(host):
        return route
    pp = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
    try:
        pport = pp.port or (443 if pp.scheme == "https" else 80)
    except ValueError:
        raise UsageError(f"proxy {redact(proxy)!r}: not a valid port") from None
    auth = None
    if pp.username is not None:
        pair = f"{urllib.parse.unquote(pp.username)}:{urllib.parse.unquote(pp.password or '')}"
        auth = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    return _Route(host, route.port, https, parts.path, (pp.hostname or "", pport), auth)



def _proxy_refused(route: _Route, status: int, reason: str) -> ProxyRefused:
    hint = (" (give its user and password in the proxy URL, e.g. https_proxy=http://USER:PASSWORD@HOST:PORT)"
            if status == 407 and not route.proxy_auth else " (the user and password in the proxy URL were refused)"
            if status == 407 else "")
    return ProxyRefused(f"the proxy at {route.proxy_name} refused: HTTP {status} "
                        f"{_printable(reason)}{hint}".rstrip())


def _printable(text: str, limit: int = 120) -> str:
    return "".join(c if c.isprintable() else " " for c in text[:limit]).strip()


#: the most bytes of a proxy's answer to CONNECT read before its blank line
MAX_CONNECT_ANSWER = 64 << 10


def _tunnel(route: _Route, timeout: float, sockets: list):
    """A TLS connection to the server through ``route``'s proxy: CONNECT (with ``Proxy-Authorization``),
    the proxy's answer read to its blank line (bounded), then TLS verified for the server's host name.

    Every socket is added to ``sockets`` as it is made, so that the whole-request deadline shuts down
    whichever phase is blocked: a proxy that drips its answer is cut off like a server that drips its own.
    """
    import socket
    import ssl

    sock = socket.create_connection(route.proxy, timeout=timeout)
    sockets.append(sock)
    head = f"CONNECT {route.authority} HTTP/1.1\r\nHost: {route.authority}\r\n"
    if route.proxy_auth:
        head += f"Proxy-Authorization: {route.proxy_auth}\r\n"
    sock.sendall((head + "\r\n").encode("latin-1"))
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionResetError("the proxy closed the connection during CONNECT")
        answer += chunk
        if len(answer) > MAX_CONNECT_ANSWER:
            raise ProxyRefused(f"the proxy at {route.proxy_name} answered CONNECT with more than "
                               f"{MAX_CONNECT_ANSWER >> 10} KiB of headers")
    line = answer.split(b"\r\n", 1)[0].decode("latin-1")
    words = line.split(" ", 2)
    if len(words) < 2 or not words[0].startswith("HTTP/") or not words[1].isdigit():
        raise ProxyRefused(f"the proxy at {route.proxy_name} answered CONNECT with {_printable(line)!r}, "
                           f"not HTTP")
    status = int(words[1])
    if status != 200:
        raise _proxy_refused(route, status, words[2] if len(words) > 2 else "")
    if answer.index(b"\r\n\r\n") + 4 != len(answer):
        raise ProxyRefused(f"the proxy at {route.proxy_name} sent bytes after its CONNECT answer")
    tls = ssl.create_default_context().wrap_socket(sock, server_hostname=route.host)
    sockets.append(tls)
    return tls


def _connection(route: _Route, timeout: float, sockets: list):
    """An open ``http.client`` connection for ``route`` and the request target prefix (every socket it
    makes in ``sockets``, for the deadline)."""
    import http.client

    if route.proxy and route.https:
        conn = http.client.HTTPSConnection(route.host, route.port, timeout=timeout)
        conn.sock = _tunnel(route, timeout, sockets)
        return conn, route.path
    if route.proxy:
        conn = http.client.HTTPConnection(*route.proxy, timeout=timeout)
        target = f"http://{route.authority}{route.path}"
    else:
        cls = http.client.HTTPSConnection if route.https else http.client.HTTPConnection
        conn = cls(route.host, route.port, timeout=timeout)
        target = route.path
    conn.connect()   # each attempt bounded by the socket's timeout, the whole by the deadline
    sockets.append(conn.sock)
    return conn, target


def _api_key(api_key: str | None) -> str | None:
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    return api_key


# -- one request ---------------------------------------------------------------------------------------


#: every GET in flight: (its "stopped" event, its cut-off) (:func:`cut_off_reads`)
_READS: set = set()
#: connections made to each server (its normalized URL), pooled or not (:func:`connections_made`)
_MADE: dict[str, int] = {}


def connections_made(base: str) -> int:
    """How many connections this process has made to the server at ``base`` (a URL :func:`normalize_url` made):
    a request that had to make one may have reached a restarted server (serve's view of the slots reads
    ``GET /slots`` again)."""
    return _MADE.get(base, 0)


def cut_off_reads() -> None:
    """Cut off every GET in flight now (safe from a signal handler): a process stopping (``keep`` on
    SIGTERM) does not wait out a server that drips its answer. Slot actions (save, restore) are not cut:
    the server goes on with them whatever the client does."""
    for stopped, cut in list(_READS):
        stopped.set()
        cut()


def check_timeout(timeout: float) -> None:
    """UsageError unless ``timeout`` is a positive number of seconds."""
    if not timeout or timeout <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {timeout}")


class Answer(NamedTuple):
    """What the server answered: its HTTP status and body (at most :data:`MAX_ANSWER_BYTES` + 1 bytes read)."""

    status: int
    raw: bytes


# -- connections kept open ---------------------------------------------------------------------------------

#: the most idle connections a :class:`Pool` keeps to one server
MAX_IDLE = 8
#: what a request on a kept connection the server has closed raises: its reset on the first write, or its close
#: before a byte of an answer (``http.client.RemoteDisconnected`` is a ``ConnectionResetError``)
_CLOSED = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class Pool:
    """Connections to servers kept open between requests (HTTP keep-alive), for a process that makes many small
    requests (serve's own, from its worker threads: one pool shared by them; thread-safe). Give it to
    :func:`send` (or to a request of :mod:`slotctl.live.http`, ``pool=``), and close it when done.

    A connection is kept only where that is safe: made directly (never through a proxy: its tunnel and
    credentials are another party's), its answer read to its end within the deadline, and the server not
    closing it (``Connection: close``: llama-server says so on the 100th request of a connection). A request
    on a kept connection the server has closed meanwhile (a stale keep-alive: llama-server closes a connection
    idle for 5 s, and a request written in between finds it closed before it was read) is sent once more, on
    a new connection, within the same deadline: :attr:`retried` counts them. A request on a new connection is
    never sent twice.
    """

    def __init__(self, max_idle: int = MAX_IDLE):
        import threading

        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: dict[tuple, list] = {}
        self._closed = False
        #: connections made through the pool (one made anew after the others closed may be a restarted server's)
        self.made = 0
        #: requests sent again on a new connection because their kept one had been closed by the server
        self.retried = 0

    @staticmethod
    def _key(route: _Route) -> tuple:
        return route.host, route.port, route.https

    def take(self, route: _Route):
        """A kept connection to ``route``'s server (the most recently used), or None."""
        with self._lock:
            idle = self._idle.get(self._key(route))
            return idle.pop() if idle else None

    def keep(self, route: _Route, conn) -> None:
        """``conn`` (its answer read to its end) kept for the next request to ``route``'s server, or closed."""
        with self._lock:
            idle = self._idle.setdefault(self._key(route), [])
            if not self._closed and len(idle) < self.max_idle:
                idle.append(conn)
                return
        conn.close()

    def counted(self, *, made: int = 0, retried: int = 0) -> None:
        with self._lock:
            self.made += made
            self.retried += retried

    def close(self) -> None:
        """Every kept connection closed; connections given back later are closed too."""
        with self._lock:
            self._closed = True
            idle = [c for conns in self._idle.values() for c in conns]
            self._idle.clear()
        for conn in idle:
            conn.close()


def send(base: str, method: str, path: str, data: bytes | None = None, *, query: dict[str, str] | None = None,
         api_key: str | None = None, timeout: float, pool: Pool | None = None) -> Answer:
    """Send one request to the server at ``base`` (a URL :func:`normalize_url` made) and return its status and
    body, within the guarantees of this module: ``path`` starts with ``/`` (with ``query``, its query); ``data``
    is a JSON body; ``api_key`` (default: ``LLAMA_API_KEY``) goes in ``Authorization: Bearer``; ``timeout``
    bounds the whole request; ``pool``: the connections kept open to take one from and give it back to
    (:class:`Pool`; None: a connection of its own, closed after the answer). A redirect is
    :class:`~slotctl.live.errors.ServerRedirect`, a proxy's 407 :class:`~slotctl.live.errors.ProxyRefused`, an
    answer over the byte bound :class:`~slotctl.live.errors.ServerAnswerError`, no answer
    :class:`~slotctl.live.errors.ServerUnreachable` (:class:`~slotctl.live.errors.ServerDropped` when the
    request went and the connection closed unanswered, :class:`~slotctl.live.errors.CutOff` when the process is
    stopping). Any other status is the caller's.
    """
    import http.client
    import socket
    import threading

    check_timeout(timeout)
    target = path
    if query:
        target += "?" + urllib.parse.urlencode(query)
    what = f"{method} {base}{path}"
    try:
        route = _route(base)
    except ValueError as e:
        raise UsageError(f"{what}: {redact(str(e))}") from None
    pooled = pool is not None and route.proxy is None
    headers = {"Accept": "application/json"} if pooled else {"Accept": "application/json", "Connection": "close"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    key = _api_key(api_key)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if route.proxy and not route.https and route.proxy_auth:
        headers["Proxy-Authorization"] = route.proxy_auth
    expired = threading.Event()
    sockets: list = []   # every socket made, kept: http.client hands its socket to the response and forgets it
    #: held by the cut-off while it shuts the sockets down, and for good by a request that keeps its connection
    #: (never waited for: the cut-off also runs in a signal handler, :func:`cut_off_reads`)
    own = threading.Lock()

    def cut_off() -> None:
        """The time is up: shut the sockets down under whatever phase is blocked on them."""
        if not own.acquire(blocking=False):   # the request is keeping its connection: done, not cut
            return
        try:
            expired.set()
            for sock in sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        finally:
            own.release()

    timer = threading.Timer(timeout, cut_off)
    timer.daemon = True
    timer.start()
    stopped = threading.Event()
    if method == "GET":
        _READS.add((stopped, cut_off))
    conn = None
    kept = False
    sent = False
    try:
        conn = pool.take(route) if pooled else None
        while True:
            reused = conn is not None
            try:
                if reused:
                    conn.sock.settimeout(timeout)
                    sockets.append(conn.sock)
                    prefix = route.path
                else:
                    conn, prefix = _connection(route, timeout, sockets)   # a proxy's CONNECT included
                    _MADE[base] = _MADE.get(base, 0) + 1
                    if pool is not None:
                        pool.counted(made=1)
                if expired.is_set():
                    raise TimeoutError
                conn.request(method, prefix + target, body=data, headers=headers)
                sent = True
                resp = conn.getresponse()
                break
            except _CLOSED:
                if not reused or expired.is_set() or stopped.is_set():
                    raise
                # a kept connection the server closed before it read the request: sent once more, on a new one
                conn.close()
                conn, sent = None, False
                pool.counted(retried=1)
        status, location = resp.status, resp.getheader("Location")
        reason = resp.reason or ""
        raw = resp.read(MAX_ANSWER_BYTES + 1)
        if expired.is_set():
            raise TimeoutError
        if pooled and resp.isclosed() and not resp.will_close and conn.sock is not None \
                and own.acquire(blocking=False):   # never released: a cut-off from now on leaves it alone
            kept = not expired.is_set()
    except ProxyRefused as e:
        raise ProxyRefused(f"{what}: {e}") from None
    except BaseException as e:
        if stopped.is_set():
            raise CutOff(f"{what}: cut off: stopping") from None
        if expired.is_set() or isinstance(e, (TimeoutError, socket.timeout)):
            raise ServerUnreachable(f"{what}: no answer within {timeout:g} s (--timeout bounds the "
                                    f"whole request{', the proxy included' if route.proxy else ''})"
                                    f"{_busy_hint(path)}") from None
        if isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError)) and sent:
            # the request went out and the connection closed with no answer: what a server that died while
            # handling it leaves (a restore it aborts on: GGML_ASSERT), not a sign of another program
            raise ServerDropped(f"{what}: the server closed the connection without answering: it may have "
                                "crashed (see whether it still runs, and its log)") from None
        if isinstance(e, http.client.HTTPException):   # garbage instead of HTTP, or an answer cut short
            raise ServerUnreachable(f"{what}: not a valid HTTP answer ({type(e).__name__}): "
                                    f"is this a llama-server?") from None
        if isinstance(e, OSError):
            via = f" (through the proxy at {route.proxy_name})" if route.proxy else ""
            raise ServerUnreachable(f"{what}: {_reason(e, timeout)}{via}") from None
        raise
    finally:
        timer.cancel()
        _READS.discard((stopped, cut_off))
        if kept:
            pool.keep(route, conn)
        else:
            if conn is not None:
                conn.close()
            for sock in sockets:
                try:
                    sock.close()
                except OSError:
                    pass
    if status == 407 and route.proxy:   # the proxy's answer, not the server's
        raise ProxyRefused(f"{what}: {_proxy_refused(route, status, reason)}")
    if 300 <= status < 400:
        to = f" to {_printable(location, 300)}" if location else ""
        raise ServerRedirect(f"{what}: the server answered HTTP {status}, a redirect{to}, which is not followed "
                             f"(the API key goes only to the URL given): give the server's own URL",
                             status=status, location=location)
    if len(raw) > MAX_ANSWER_BYTES:
        raise ServerAnswerError(f"{what}: unexpected answer: larger than {MAX_ANSWER_BYTES >> 20} MiB (is this a "
                                f"llama-server?)")
    return Answer(status, raw)


def _reason(reason: Any, timeout: float) -> str:
    import socket

    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout:g} s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused: is llama-server running there?"
    if isinstance(reason, socket.gaierror):
        return f"unknown host ({reason.strerror or reason})"
    if isinstance(reason, ConnectionResetError):
        return "the connection was reset by the server"
    if isinstance(reason, OSError) and reason.strerror:
        return f"cannot connect: {reason.strerror}"
    return f"cannot connect: {reason}"


def _busy_hint(path: str) -> str:
    if path.startswith("/slots/"):
        return " (the server waits until a busy slot is idle before it saves, restores or erases it)"
    return ""

