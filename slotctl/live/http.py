"""A small HTTP client for a running llama-server: its slots, properties and slot-file actions.

Standard library only (``urllib``). Every request has a timeout, and every failure becomes a
:class:`~slotctl.errors.SlotctlError` with one line that says what happened:

* :class:`ServerUnreachable` (exit 2): nothing answers at the address, the connection broke, the
  answer took longer than the timeout, or what answered is not a llama-server;
* :class:`ServerAuthError` (exit 2): the server wants an API key (``--api-key``) and did not get the right one;
* :class:`ServerRefused` (exit 1): the server answered and refused the operation (slot actions without
  ``--slot-save-path``, an invalid slot id, a file that does not restore, the model still loading, ...).
  ``status``, ``error_type`` and ``message`` hold what the server said.

Endpoints (llama.cpp b11434, ``tools/server``): ``GET /health``, ``GET /props``, ``GET /slots``,
``POST /slots/{id}?action=save|restore|erase`` (body ``{"filename": NAME}`` for save and restore; NAME is a
plain file name inside the server's ``--slot-save-path``, see :func:`slotctl.server.filenames.check_filename`), ``POST /completion``.
An API key is sent as ``Authorization: Bearer KEY``. Requests to loopback addresses never go through a proxy;
others go through the one the environment names, with the user and password of its URL as
``Proxy-Authorization`` (to the proxy only, never printed); its HTTP 407 is :class:`ProxyRefused` (exit 2).
A password in a URL is shown as ``***`` (:func:`redact`) and never sent.

A hostile or broken server cannot mislead or hold a command (docs/live.md, "What slotctl trusts"):

* **redirects are never followed** (:class:`ServerRedirect`, exit 2): the API key goes only to the URL
  given, and a POST never turns into a GET somewhere else;
* **the timeout bounds the whole request**: connecting, a proxy's CONNECT, sending and reading together,
  not each read (a server or proxy that drips one byte at a time is cut off when the time is up);
* **an answer is bounded in bytes, values and depth before it is parsed** (:func:`parse_answer`:
  64 MiB, :data:`MAX_ANSWER_ITEMS`, :data:`MAX_ANSWER_DEPTH`; ``/slots`` at most ``MAX_PARALLEL`` entries);
* **every answer used is checked against its shape** (:data:`SHAPES`, :class:`ServerAnswerError`, exit 2):
  ``null``, ``[]``, ``{}`` or a wrong type where an object with typed fields is expected says what was
  wrong instead of passing for success.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from slotctl.errors import ExitStatus, SlotctlError, UsageError
from slotctl.live import API_KEY_ENV, DEFAULT_TIMEOUT  # live mode's defaults, read by the CLI's options too
from slotctl.live import is_loopback
from slotctl.live import router
from slotctl.live.router import ROUTER_NO_MODEL
from slotctl.server.filenames import check_filename
from slotctl.server.flags import MAX_PARALLEL

__all__ = [
    "DEFAULT_TIMEOUT", "MAX_ANSWER_DEPTH", "MAX_ANSWER_ITEMS", "ProxyRefused", "ServerAnswerError",
    "ServerAuthError", "ServerError", "ServerRedirect", "ServerRefused", "ServerUnreachable",
    "ServerFacts", "check_filename", "check_slot", "completion", "erase_slot", "get_health", "get_models",
    "get_props", "get_slots", "normalize_url", "parse_answer", "redact", "request", "restore_slot", "save_slot",
    "server_facts",
]

#: at most this many bytes of an answer are read (a slot listing of 256 slots is far smaller); what its parse
#: holds is a small multiple of it (:func:`parse_answer`)
MAX_ANSWER_BYTES = 16 << 20


class ServerError(SlotctlError):
    """Base of every error talking to a server."""


class ServerUnreachable(ServerError):
    """No usable answer: connection refused or reset, unknown host, timeout, not a llama-server."""

    exit_status = ExitStatus.USAGE


class CutOff(ServerUnreachable):
    """A read cut off because the process is stopping (:func:`cut_off_reads`), not for anything the server did."""


class ServerAnswerError(ServerUnreachable):
    """The server answered, but not with what a llama-server answers there (a wrong shape or type)."""


class ServerDropped(ServerUnreachable):
    """The request was sent and the server closed the connection without an answer: it may have crashed."""

    code = "connection_dropped"


class ServerRedirect(ServerUnreachable):
    """The server answered with a redirect (HTTP 3xx); slotctl never follows one."""

    def __init__(self, message: str, *, status: int, location: str | None):
        self.status = status
        self.location = location
        super().__init__(message)


class ServerAuthError(ServerError):
    """The server wants an API key and was sent none or a wrong one (HTTP 401 or 403)."""

    exit_status = ExitStatus.USAGE

    def __init__(self, message: str, *, status: int, error_type: str | None = None):
        self.status = status
        self.error_type = error_type
        super().__init__(message)


class ServerRefused(ServerError):
    """The server answered with an error: it refused the operation.

    ``status`` is the HTTP status, ``error_type`` the server's ``error.type`` (``invalid_request_error``,
    ``not_supported_error``, ``unavailable_error``, ``server_error``, ...), ``message`` its ``error.message``,
    ``body`` the parsed answer (or None).
    """

    exit_status = ExitStatus.FAILED

    def __init__(self, line: str, *, status: int, message: str, error_type: str | None = None, body: Any = None):
        self.status = status
        self.message = message
        self.error_type = error_type
        self.body = body
        super().__init__(line)


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


class ProxyRefused(ServerUnreachable):
    """The proxy between slotctl and the server refused the request (HTTP 407: it wants credentials)."""


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


# -- requests ----------------------------------------------------------------------------------------


#: every GET in flight: (its "stopped" event, its cut-off) (:func:`cut_off_reads`)
_READS: set = set()


#: connections made to each server (its normalized URL), counted (:func:`connections_made`)
_MADE: dict[str, int] = {}


def connections_made(url: str) -> int:
    """How many connections this process has made to the server at ``url``: a request that had to make one
    may have reached a restarted server (serve's view of the slots reads ``GET /slots`` again)."""
    return _MADE.get(normalize_url(url), 0)


def cut_off_reads() -> None:
    """Cut off every GET in flight now (safe from a signal handler): a process stopping (``keep`` on
    SIGTERM) does not wait out a server that drips its answer. Slot actions (save, restore) are not cut:
    the server goes on with them whatever the client does."""
    for stopped, cut in list(_READS):
        stopped.set()
        cut()


def request(url: str, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
            api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Send one request to the server at ``url`` and return its parsed JSON answer.

    ``path`` starts with ``/``; ``body`` (for POST) is sent as JSON; ``api_key`` (default: the
    ``LLAMA_API_KEY`` environment variable) goes in ``Authorization: Bearer``, to this URL only: a
    redirect is reported (:class:`ServerRedirect`), never followed. ``timeout`` bounds the whole request,
    connection, sending and reading together. Raises :class:`ServerUnreachable`, :class:`ServerAuthError`
    or :class:`ServerRefused` as described in the module docstring.
    """
    import http.client
    import socket
    import threading

    if not timeout or timeout <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {timeout}")
    base = normalize_url(url)
    model = router.wanted(base, path)   # a router's model, named as the router routes (slotctl.live.router)
    if model is not None:
        query, body = router.routed(model, method, query, body)
    target = path
    if query:
        target += "?" + urllib.parse.urlencode(query)
    data = None
    headers = {"Accept": "application/json", "Connection": "close"}
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    key = _api_key(api_key)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    what = f"{method} {base}{path}"
    try:
        route = _route(base)
    except ValueError as e:
        raise UsageError(f"{what}: {redact(str(e))}") from None
    if route.proxy and not route.https and route.proxy_auth:
        headers["Proxy-Authorization"] = route.proxy_auth
    expired = threading.Event()
    sockets: list = []   # every socket made, kept: http.client hands its socket to the response and forgets it

    def cut_off() -> None:
        """The time is up: shut the sockets down under whatever phase is blocked on them."""
        expired.set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, cut_off)
    timer.daemon = True
    timer.start()
    stopped = threading.Event()
    if method == "GET":
        _READS.add((stopped, cut_off))
    conn = None
    sent = False
    try:
        conn, prefix = _connection(route, timeout, sockets)   # a proxy's CONNECT included
        _MADE[base] = _MADE.get(base, 0) + 1
        if expired.is_set():
            raise TimeoutError
        conn.request(method, prefix + target, body=data, headers=headers)
        sent = True
        resp = conn.getresponse()
        status, location = resp.status, resp.getheader("Location")
        reason = resp.reason or ""
        raw = resp.read(MAX_ANSWER_BYTES + 1)
        if expired.is_set():
            raise TimeoutError
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
    if status >= 400:
        try:
            _raise_http_error(what, status, raw)
        except ServerError as e:
            said = getattr(e, "message", "")
            if model is not None and router.unrouted(status, said, path):
                # the router did not route the slot action by its body's model: the model's own server, now
                own = router.own_server_url(base, model, router_models(base, api_key=api_key, timeout=timeout))
                router.say_fallback(base, model, own, f"HTTP {status}: {said or 'no such route'}")
                plain = {k: v for k, v in (query or {}).items() if k not in ("model", "autoload")}
                if isinstance(body, dict):
                    body = {k: v for k, v in body.items() if k != "model"}
                return request(own, method, path, body, query=plain, api_key=api_key, timeout=timeout)
            if model is not None and status == 400 and said == router.not_found(model):
                names = ", ".join(_escaped(m["name"]) for m in router_models(base, api_key=api_key, timeout=timeout))
                raise UsageError(f"{what}: the router has no model named {_escaped(model)!r} (GET /models: "
                                 f"{names or 'none'})") from None
            if model is not None and status == 400 and said == router.ROUTER_NOT_LOADED:
                raise RouterModelNotLoaded(f"{what}: the router's model {model!r} is not loaded, and no request "
                                           f"is made to load it (load it with POST {base}/models/load, or send it "
                                           f"a request) (docs/fleet.md, router mode)") from None
            # b11434's router, asked without a "model": its own words (server-models.cpp, router_validate_model)
            if isinstance(e, ServerRefused) and status == 400 and said == ROUTER_NO_MODEL and path != "/models":
                raise RouterMode(f"{what}: {router_message(url, api_key=api_key, timeout=timeout)}") from None
            raise
    if not 200 <= status < 300:
        raise ServerUnreachable(f"{what}: unexpected HTTP {status}")
    try:
        answer = parse_answer(raw, what)
    except ValueError:
        raise ServerUnreachable(f"{what}: answered HTTP {status} with something that is not JSON "
                                f"({_snippet(raw)}): is this a llama-server?") from None
    return router.answer_for(model, path, answer) if model is not None else answer


#: the most values (objects, lists, strings, numbers...), escapes (``\\n``, ``\\u00e9``) and the deepest nesting an
#: answer may have: a llama-server's answers (256 slots at most, /props, a completion with its probabilities)
#: are far below
MAX_ANSWER_ITEMS = 250_000
MAX_ANSWER_ESCAPES = 250_000
MAX_ANSWER_DEPTH = 64

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def parse_answer(raw: bytes, what: str) -> Any:
    """The JSON answer ``raw`` (at most :data:`MAX_ANSWER_BYTES`), bounded in values, escapes and depth
    before it is parsed (ServerAnswerError past :data:`MAX_ANSWER_ITEMS`, :data:`MAX_ANSWER_ESCAPES` or
    :data:`MAX_ANSWER_DEPTH`): 64 MiB of ``[{},...]`` made 1.7 GB of objects, 62 MiB of ``"\\u00e9..."``
    1.4 GB of pieces of one string, and deep nesting a RecursionError. ValueError when it is not JSON.

    Every count is made on the bytes (``bytes.count``, a C-speed regular expression) before anything of
    their size is made: the strings (each a quote pair) are counted before they are emptied, so the
    emptied copy has at most as many pieces as the bound; only the brackets, at most twice the bound,
    are walked for the depth. What the parse then holds is bounded by the byte cap (measured in
    tests/test_live_hardened.py: peak under 10 x :data:`MAX_ANSWER_BYTES`, the width of a Python string
    of 4-byte characters included).
    """
    def refuse(why: str) -> ServerAnswerError:
        return ServerAnswerError(f"{what}: unexpected answer: {why} (is this a llama-server?)")

    escapes = raw.count(b"\\")
    if escapes > MAX_ANSWER_ESCAPES:
        raise refuse(f"more than {MAX_ANSWER_ESCAPES:,} escaped characters")
    if raw.count(b'"') // 2 > MAX_ANSWER_ITEMS:
        raise refuse(f"more than {MAX_ANSWER_ITEMS:,} strings")
    bare = _JSON_STRING.sub(b'""', raw)
    opens = bare.count(b"[") + bare.count(b"{")
    items = bare.count(b",") + opens + 1
    if items > MAX_ANSWER_ITEMS:
        raise refuse(f"more than {MAX_ANSWER_ITEMS:,} values")
    brackets = bare.translate(None, _NOT_BRACKETS)
    del bare
    if len(brackets) <= 2 * opens:   # more closing than opening brackets: not JSON, json says where
        depth = deepest = 0
        for c in brackets:
            depth += 1 if c in (0x5B, 0x7B) else -1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_ANSWER_DEPTH:
                    raise refuse(f"nested deeper than {MAX_ANSWER_DEPTH} levels")
    try:
        return json.loads(raw)
    except RecursionError:   # pragma: no cover - the depth bound is far below the interpreter's
        raise refuse("nested too deep") from None


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


def _snippet(raw: bytes, limit: int = 80) -> str:
    text = raw[:limit].decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    return repr(text + ("…" if len(raw) > limit else ""))


def _raise_http_error(what: str, status: int, raw: bytes) -> None:
    body: Any = None
    message = ""
    error_type = None
    try:
        body = parse_answer(raw, what) if raw else None
    except (ValueError, ServerAnswerError):
        body = None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            message = str(err.get("message") or "")
            error_type = err.get("type")
        elif isinstance(err, str):
            message = err
    if not message:
        message = _snippet(raw).strip("'\"") if raw else ""
    said = f": {message}" if message else ""
    if status in (401, 403):
        raise ServerAuthError(
            f"{what}: HTTP {status}{said} (give the server's key with --api-key or {API_KEY_ENV})",
            status=status, error_type=error_type)
    if status == 404:
        # llama-server answers an unknown route with 404 "File Not Found": a wrong URL, or another server
        raise ServerUnreachable(f"{what}: HTTP 404{said or ' Not Found'}: no llama-server endpoint at this URL "
                                f"(give the server's base URL, e.g. http://127.0.0.1:8080)")
    if body is None and not (400 <= status < 600):
        raise ServerUnreachable(f"{what}: unexpected HTTP {status}")
    raise ServerRefused(f"{what}: the server refused (HTTP {status}){said}",
                        status=status, message=message, error_type=error_type, body=body)


# -- the shapes of the answers used ---------------------------------------------------------------------

#: kinds of values: a test and how it is named in an error
_KINDS = {
    "object": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "count": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a count (an integer >= 0)"),
    "positive": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"),
    "slots": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_PARALLEL,
              f"a number of slots, 1 to {MAX_PARALLEL}"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, "a number >= 0"),
}

#: what each endpoint's answer must hold, as llama-server b11434 writes it (tools/server): key -> (kind,
#: required, shape of an object value). Only what slotctl uses is checked; other keys may be anything.
SHAPES: dict[str, dict] = {
    "/health": {"status": ("str", True, None)},
    "/props": {
        "total_slots": ("slots", True, None),
        "model_path": ("str", False, None),
        "build_info": ("str", False, None),
        "modalities": ("object", False, None),
        "default_generation_settings": ("object", False, {"n_ctx": ("count", False, None)}),
    },
    "/slots[]": {
        "id": ("count", True, None),
        "n_ctx": ("count", False, None),
        "speculative": ("bool", False, None),
        "is_processing": ("bool", False, None),
        "n_prompt_tokens": ("count", False, None),
        "params": ("object", False, None),
    },
    "save": {"id_slot": ("count", True, None), "filename": ("str", True, None), "n_saved": ("count", True, None),
             "n_written": ("count", True, None), "timings": ("object", False, {"save_ms": ("number", False, None)})},
    "restore": {"id_slot": ("count", True, None), "filename": ("str", True, None),
                "n_restored": ("count", True, None), "n_read": ("count", True, None),
                "timings": ("object", False, {"restore_ms": ("number", False, None)})},
    "erase": {"id_slot": ("count", True, None), "n_erased": ("count", True, None)},
}


def _show(v: Any, limit: int = 60) -> str:
    text = json.dumps(v, ensure_ascii=True)
    return text if len(text) <= limit else text[:limit] + "…"


def check_shape(what: str, answer: Any, shape: dict, where: str = "") -> Any:
    """``answer`` when it is an object holding ``shape`` (see :data:`SHAPES`); else ServerAnswerError."""

    def wrong(key: str, want: str, got: Any) -> ServerAnswerError:
        return ServerAnswerError(f"{what}: unexpected answer: {key} should be {want}, got {_show(got)} "
                                 f"(is this a llama-server?)")

    if not isinstance(answer, dict):
        raise wrong(where or "the answer", "an object", answer)
    for key, (kind, required, inner) in shape.items():
        name = f"{where}.{key}" if where else key
        if key not in answer:
            if required:
                raise ServerAnswerError(f"{what}: unexpected answer: {name} is missing (is this a llama-server?)")
            continue
        test, desc = _KINDS[kind]
        if not test(answer[key]):
            raise wrong(name, desc, answer[key])
        if inner:
            check_shape(what, answer[key], inner, name)
    return answer


# -- endpoints ---------------------------------------------------------------------------------------


def get_health(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """``GET /health``: ``{"status": "ok"}`` once the model is loaded; ServerRefused (503) while loading."""
    return check_shape(f"GET {normalize_url(url)}/health", request(url, "GET", "/health", api_key=api_key,
                                                                    timeout=timeout), SHAPES["/health"])


class RouterModelNotLoaded(ServerUnreachable):
    """The router's model (``--router-model``) is not loaded, and slotctl never makes a router load one (exit 2)."""

    code = "router_model_not_loaded"


class RouterMode(ServerUnreachable):
    """The URL is llama-server's router (router mode): no one model's server to use (exit 2)."""

    code = "router_mode"


def get_props(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """``GET /props``: model path, ``total_slots``, ``default_generation_settings.n_ctx``, build info, ...

    Checked against ``SHAPES["/props"]`` (ServerAnswerError, exit 2): an object with a positive
    ``total_slots``. A router (``"role": "router"``) is :class:`RouterMode`, naming its models' own servers.
    """
    answer = request(url, "GET", "/props", api_key=api_key, timeout=timeout)
    if isinstance(answer, dict) and answer.get("role") == "router":
        raise RouterMode(router_message(url, api_key=api_key, timeout=timeout))
    return check_shape(f"GET {normalize_url(url)}/props", answer, SHAPES["/props"])


def router_models(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[dict]:
    """A router's models (``GET /models``): each one's ``name``, ``status`` (``loaded``, ``unloaded``, ...) and,
    while it runs, ``url``: the model's own server, which b11434's router starts on ``127.0.0.1`` and a port
    it chooses anew at each load (the ``--port`` of its command line)."""
    answer = request(url, "GET", "/models", api_key=api_key, timeout=timeout)
    data = answer.get("data") if isinstance(answer, dict) else None
    out = []
    for m in data[:MAX_PARALLEL] if isinstance(data, list) else ():
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            continue
        status = m.get("status") if isinstance(m.get("status"), dict) else {}
        args = status.get("args") if isinstance(status.get("args"), list) else []
        port = None
        for flag, value in zip(args, args[1:]):
            if flag == "--port" and isinstance(value, str) and value.isdigit() and 0 < int(value) < 65536:
                port = int(value)
        state = status.get("value") if isinstance(status.get("value"), str) else "unknown"
        out.append({"name": m["id"], "status": state,
                    "url": f"http://127.0.0.1:{port}" if port and state == "loaded" else None})
    return out


def _escaped(text: str) -> str:
    """A server's text with its control characters escaped (never cut)."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def router_message(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> str:
    """The one line said when a command is pointed at a router: where each model's own server is."""
    base = normalize_url(url)
    try:
        models = router_models(url, api_key=api_key, timeout=timeout)
        shown = ", ".join(_escaped(f"{m['name']} {m['url']} ({m['status']})" if m["url"] else
                                   f"{m['name']} ({m['status']}: no server of its own now)")
                          for m in models) or "none"
    except ServerError as e:
        shown = f"not known (GET /models: {e})"
    model = router.model_for(base)
    if model is not None:   # named, and not routed by it: another build's router
        return (f"{base} is llama-server's router (router mode) and did not route the request by the model named "
                f"({model!r}, in ?model= and the body's \"model\"): point --server at the model's own server, on "
                f"the router's machine (its port changes at each load); models: {shown} (docs/fleet.md, router mode)")
    return (f"{base} is llama-server's router (router mode): it answers for no one model, and b11434's router "
            f"routes a slot action only by the \"model\" of its JSON body (never ?model=): name the model with "
            f"--router-model NAME (a server entry's model in --config), or point --server at the model's own "
            f"server, on the router's machine (its port changes at each load); models: {shown} "
            f"(docs/fleet.md, router mode)")


def get_slots(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> list:
    """``GET /slots``: one object per slot (``id``, ``n_ctx``, ``speculative``, ``is_processing``, ...).

    ServerRefused (HTTP 501) when the server runs with ``--no-slots``.
    """
    answer = request(url, "GET", "/slots", api_key=api_key, timeout=timeout)
    what = f"GET {normalize_url(url)}/slots"
    if not isinstance(answer, list) or not answer:
        raise ServerAnswerError(f"{what}: unexpected answer: should be a list of one object per slot, got "
                                f"{_show(answer)} (is this a llama-server?)")
    if len(answer) > MAX_PARALLEL:
        raise ServerAnswerError(f"{what}: unexpected answer: {len(answer):,} slots, where a llama-server has "
                                f"at most {MAX_PARALLEL} (LLAMA_MAX_SEQ; is this a llama-server?)")
    for i, entry in enumerate(answer):
        check_shape(what, entry, SHAPES["/slots[]"], f"[{i}]")
    return answer


def get_models(url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """``GET /v1/models``: ``data[0].meta`` holds ``n_vocab``, ``n_ctx_train``, ``n_embd``, ``n_params``, ``size``."""
    return request(url, "GET", "/v1/models", api_key=api_key, timeout=timeout)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class ServerFacts:
    """What a running llama-server says about itself that decides which slot files it restores.

    From ``GET /props``: ``model_path`` (a path on the server's machine), ``total_slots`` (``-np``),
    ``build_info``, ``mmproj`` (``modalities``: vision or audio input means a multimodal projector).
    From ``GET /slots`` (the entry of ``slot``): ``n_ctx_slot`` (the slot's context in tokens; from
    ``/props`` ``default_generation_settings.n_ctx`` when ``/slots`` is disabled, see ``n_ctx_from``),
    ``speculative`` (the slot decodes speculatively; None when ``/slots`` is disabled) and
    ``speculative_types`` (``params["speculative.types"]``, e.g. ``"none,draft-simple"``; present only once
    the slot has run a task, else None).
    From ``GET /v1/models``: ``model_meta`` (``n_vocab``, ``n_ctx_train``, ``n_embd``, ``n_params``,
    ``size``; None when the server does not answer it). ``props`` / ``slots``: the answers as they came.

    llama-server b11434 does not report its draft model, its cache types (``-ctk``/``-ctv``/``-ctkd``/
    ``-ctvd``), flash attention, batch sizes, ``--swa-full`` or whether its cache is unified (``-kvu``).
    """

    url: str
    model_path: str | None
    total_slots: int | None
    n_ctx_slot: int | None
    n_ctx_from: str | None
    speculative: bool | None
    speculative_types: str | None
    build_info: str | None
    mmproj: bool
    model_meta: dict | None
    props: dict
    slots: list | None
    notes: tuple[str, ...] = field(default=())


def server_facts(url: str, slot: int = 0, *, api_key: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> ServerFacts:
    """Read ``GET /props``, ``GET /slots`` and ``GET /v1/models`` (see :class:`ServerFacts`).

    ``/props`` must answer (its errors propagate); a server started with ``--no-slots`` (``/slots``
    refused) or one without ``/v1/models`` is described from ``/props`` alone, with a note.
    """
    base = normalize_url(url)
    props = get_props(base, api_key=api_key, timeout=timeout)
    if not isinstance(props, dict):
        raise ServerUnreachable(f"GET {base}/props: expected an object, got {type(props).__name__}: "
                                f"is this a llama-server?")
    notes = []
    slots: list | None
    try:
        slots = get_slots(base, api_key=api_key, timeout=timeout)
    except ServerRefused as e:
        slots = None
        notes.append(f"GET /slots refused ({e.message or f'HTTP {e.status}'}): the slot's context is taken "
                     f"from /props, and whether it decodes speculatively is not known")
    entry = None
    if slots is not None:
        entry = next((s for s in slots if isinstance(s, dict) and s.get("id") == slot), None)
    dgs = props.get("default_generation_settings")
    n_ctx_props = _int(dgs.get("n_ctx")) if isinstance(dgs, dict) else None
    if entry is not None and _int(entry.get("n_ctx")) is not None:
        n_ctx_slot, n_ctx_from = _int(entry.get("n_ctx")), "/slots"
    elif n_ctx_props is not None:
        n_ctx_slot, n_ctx_from = n_ctx_props, "/props"
    else:
        n_ctx_slot, n_ctx_from = None, None
    speculative = bool(entry.get("speculative")) if entry is not None and "speculative" in entry else None
    params = entry.get("params") if entry is not None else None
    spec_types = params.get("speculative.types") if isinstance(params, dict) else None
    meta = None
    try:
        models = get_models(base, api_key=api_key, timeout=timeout)
        data = models.get("data") if isinstance(models, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("meta"), dict):
            meta = data[0]["meta"]
    except (ServerRefused, ServerUnreachable):
        notes.append("GET /v1/models did not answer: the model's identity is not checked")
    modalities = props.get("modalities")
    mmproj = isinstance(modalities, dict) and bool(modalities.get("vision") or modalities.get("audio")
                                                   or modalities.get("video"))
    model_path = props.get("model_path")
    return ServerFacts(
        url=base,
        model_path=model_path if isinstance(model_path, str) and model_path else None,
        total_slots=_int(props.get("total_slots")),
        n_ctx_slot=n_ctx_slot,
        n_ctx_from=n_ctx_from,
        speculative=speculative,
        speculative_types=spec_types if isinstance(spec_types, str) else None,
        build_info=props.get("build_info") if isinstance(props.get("build_info"), str) else None,
        mmproj=mmproj,
        model_meta=meta,
        props=props,
        slots=slots,
        notes=tuple(notes),
    )


def check_slot(url: str, slot: int, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> int:
    """UsageError unless the server has slot ``slot``; returns the server's number of slots (``GET /props``).

    llama-server itself takes any id modulo its number of slots (``get_slot_by_id``): on a 2-slot server
    ``/slots/7?action=erase`` erases slot 1 and answers ``"id_slot": 7``. This check keeps a wrong id from
    touching another slot.
    """
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise UsageError(f"--slot must be a slot id (0, 1, ...), got {slot!r}")
    props = get_props(url, api_key=api_key, timeout=timeout)   # its shape holds a positive total_slots
    total = props["total_slots"]
    if slot >= total:
        raise UsageError(f"--slot {slot}: the server at {normalize_url(url)} has {total} slot(s), "
                         f"0..{total - 1} (llama-server would quietly take slot {slot} as slot {slot % total})")
    return total


def _slot_action(url: str, slot: int, action: str, body: Any, api_key: str | None, timeout: float,
                 check: bool) -> Any:
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise UsageError(f"--slot must be a slot id (0, 1, ...), got {slot!r}")
    if check:
        check_slot(url, slot, api_key=api_key, timeout=timeout)
    answer = request(url, "POST", f"/slots/{slot}", body, query={"action": action}, api_key=api_key,
                     timeout=timeout)
    what = f"POST {normalize_url(url)}/slots/{slot}?action={action}"
    check_shape(what, answer, SHAPES[action])
    if answer["id_slot"] != slot:
        raise ServerAnswerError(f"{what}: unexpected answer: id_slot should be {slot}, got {_show(answer['id_slot'])}")
    if "filename" in (body or {}) and answer["filename"] != body["filename"]:
        raise ServerAnswerError(f"{what}: unexpected answer: filename should be {_show(body['filename'])}, "
                                f"got {_show(answer['filename'])}")
    return answer


def save_slot(url: str, slot: int, filename: str, *, api_key: str | None = None,
              timeout: float = DEFAULT_TIMEOUT, check: bool = True) -> Any:
    """``POST /slots/{slot}?action=save``: the server writes ``--slot-save-path``/``filename``.

    Answer: ``{id_slot, filename, n_saved, n_written, timings: {save_ms}}``. The name is checked first
    (:func:`check_filename`, UsageError) so that a name the server would refuse never leaves this host.
    With ``check`` (the default) the slot id is checked first too (:func:`check_slot`).
    """
    check_filename(filename)
    return _slot_action(url, slot, "save", {"filename": filename}, api_key, timeout, check)


def restore_slot(url: str, slot: int, filename: str, *, api_key: str | None = None,
              timeout: float = DEFAULT_TIMEOUT, check: bool = True) -> Any:
    """``POST /slots/{slot}?action=restore`` of ``--slot-save-path``/``filename``.

    Answer: ``{id_slot, filename, n_restored, n_read, timings: {restore_ms}}``; a file that does not load
    is ServerRefused (HTTP 400, "Unable to restore slot: ...").
    """
    check_filename(filename)
    return _slot_action(url, slot, "restore", {"filename": filename}, api_key, timeout, check)


def erase_slot(url: str, slot: int, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
               check: bool = True) -> Any:
    """``POST /slots/{slot}?action=erase``: the slot forgets its cached prompt. Answer: ``{id_slot, n_erased}``."""
    return _slot_action(url, slot, "erase", {}, api_key, timeout, check)


def completion(url: str, body: dict, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """``POST /completion`` (not streamed): ``content``, ``tokens``, ``timings``, ``id_slot``, ..."""
    return request(url, "POST", "/completion", dict(body, stream=False), api_key=api_key, timeout=timeout)
