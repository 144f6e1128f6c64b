"""serve's front: where the clients connect, and what bounds them (docs/serve.md, "Limits").

serve accepts its clients' connections itself (:class:`Front`: its own accept loop on the listening socket,
each connection handed to aiohttp's server, ``loop.connect_accepted_socket``), so that it knows how many are
open and which are idle:

- **at most** ``max_connections`` **at once** (:func:`connection_limit`: fewer when the process's descriptor
  limit, ``RLIMIT_NOFILE``, cannot hold them and their relays to the server). At the limit, the connection
  idle the longest (no request in progress: a keep-alive connection between requests, or one that has not
  sent its request yet) is closed to make room; when every one is at work, the new one is answered ``503``
  and closed. Descriptors that run out all the same (``EMFILE``: another part of the process holds more than
  reserved) close the idle one the longest too, and accepting goes on.
- **idle time**: a connection without a request in progress is closed after ``idle_timeout`` seconds, by
  serve's own timer (:meth:`Front.reap`: one that never sends a request, or sends its headers that slowly,
  too; aiohttp before 3.14 closes only a connection idle between two requests) and by aiohttp's keep-alive
  timeout; **headers**: the request line and each header at most the server's own limits allow and no more
  (:func:`server_settings`).
- **one line per kind of failure** (:class:`FailureLog`): the first of each kind is said (a ``front`` event,
  ``details.code``), the later ones counted and said together once a minute (``details.count``). What asyncio
  and aiohttp would print themselves (a traceback per connection) goes through it too.

Only serve's modules of the request path import aiohttp (the ``[serve]`` extra): this one, :mod:`slotctl.serve.relay`,
:mod:`slotctl.serve.proxy`, :mod:`slotctl.serve.completion` and :mod:`slotctl.serve.models`.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Callable

#: descriptors kept for all but the clients' connections and their relays: the listening sockets, serve's own
#: requests to the server (a worker thread each), the store, the catalog, the metrics endpoint, the log
RESERVED_FDS = 128
#: what ``--max-connections`` is by default (the shipped unit's LimitNOFILE=65536 holds it twice over)
DEFAULT_MAX_CONNECTIONS = 4096
#: seconds a connection may stay without a request in progress (``--idle-timeout``'s default)
DEFAULT_IDLE_TIMEOUT = 30.0
#: a completion body read whole to cache the request, at most (``--max-body``'s default): a prompt of a million
#: tokens is about 4 MiB of JSON text
DEFAULT_MAX_BODY = 8 << 20
#: llama-server's own limits (b11434, cpp-httplib: CPPHTTPLIB_REQUEST_URI_MAX_LENGTH 8192,
#: CPPHTTPLIB_HEADER_MAX_LENGTH 8192, CPPHTTPLIB_HEADER_MAX_COUNT 100): serve refuses nothing the server takes
URI_MAX = 8192
HEADER_MAX = 8192
HEADERS_MAX = 128
#: seconds between the lines that count the failures of a kind said before
SAY_EVERY = 60.0
#: kinds of failure told apart (beyond, one kind: ``other``)
MAX_KINDS = 64
#: the accept errors that mean descriptors (or the memory behind them) ran out
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
#: the accept errors of one connection that went away before it was accepted: nothing to say
_GONE = (errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ECONNRESET)


@dataclass(frozen=True)
class Limits:
    """serve's limits on its clients (``--max-connections``, ``--idle-timeout``, ``--max-body``)."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    max_body: int = DEFAULT_MAX_BODY


def connection_limit(wanted: int) -> tuple[int, int]:
    """The clients' connections serve may hold at once: ``wanted``, or fewer when the descriptor limit cannot
    hold each with its relay to the server (two descriptors) beside :data:`RESERVED_FDS`. The soft limit is
    raised first as far as the hard one allows (systemd's LimitNOFILE= sets both). (limit, descriptors)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * wanted + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < need:
        up = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (up, hard))
            soft = up
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted, soft
    return max(1, min(wanted, (soft - RESERVED_FDS) // 2)), soft


def server_settings(idle_timeout: float) -> dict:
    """aiohttp's server settings for serve's front: the idle timeout (before a request and between two) and the
    request line and header limits of llama-server's own (a request the server takes is never refused)."""
    return {"keepalive_timeout": idle_timeout, "max_line_size": URI_MAX + 64, "max_field_size": HEADER_MAX,
            "max_headers": HEADERS_MAX}


class FailureLog:
    """One line per kind of failure (``code``): the first said at once (``log("front", message, code=...,
    count=1)``), the later ones counted and said together at most every :data:`SAY_EVERY` seconds
    (:meth:`say_counts`, which serve calls on a timer and at exit). Safe from any thread."""

    def __init__(self, log: Callable[..., None], every: float = SAY_EVERY):
        self.log, self.every = log, every
        self._lock = threading.Lock()
        #: code -> [occurrences not said yet, all occurrences, the last message]
        self._kinds: dict[str, list] = {}

    def note(self, code: str, message: str) -> None:
        with self._lock:
            if code not in self._kinds and len(self._kinds) >= MAX_KINDS:
                code = "other"
            kind = self._kinds.get(code)
            first = kind is None
            if first:
                self._kinds[code] = [0, 1, message]
            else:
                kind[0] += 1
                kind[1] += 1
                kind[2] = message
        if first:
            self.log("front", f"{message} (said once; more of this kind are counted: a line a minute)", code=code,
                     count=1)

    def say_counts(self) -> None:
        """The failures noted since their kind was last said, one line per kind."""
        with self._lock:
            due = [(code, k[0], k[1], k[2]) for code, k in self._kinds.items() if k[0]]
            for code, *_ in due:
                self._kinds[code][0] = 0
        for code, n, total, message in due:
            self.log("front", f"{n:,} more: {message} ({total:,} since serve started)", code=code, count=n)

    def counts(self) -> dict[str, int]:
        """Every kind noted and how many times."""
        with self._lock:
            return {code: k[1] for code, k in self._kinds.items()}

    def loop_exception(self, _loop, context: dict) -> None:
        """asyncio's exception handler: one line per kind (the exception's class), never a traceback."""
        e = context.get("exception")
        what = str(context.get("message") or "an error in the event loop").splitlines()[0][:200]
        self.note(f"event_loop:{type(e).__name__}" if e is not None else "event_loop",
                  f"{what}: {type(e).__name__}: {e}" if e is not None else what)

    def catch_logs(self) -> Callable[[], None]:
        """asyncio's and aiohttp's own log records (warnings and errors: a traceback each, on stderr when no
        handler is set) noted here instead, one line per kind; the undo."""
        handler = _Noted(self)
        loggers = [logging.getLogger(name) for name in ("asyncio", "aiohttp")]
        before = [(lg.propagate, lg.level) for lg in loggers]
        for lg in loggers:
            lg.addHandler(handler)
            lg.propagate = False
            if lg.level == logging.NOTSET or lg.level > logging.WARNING:
                lg.setLevel(logging.WARNING)

        def undo() -> None:
            for lg, (propagate, level) in zip(loggers, before):
                lg.removeHandler(handler)
                lg.propagate, lg.level = propagate, level

        return undo


class _Noted(logging.Handler):
    def __init__(self, failures: FailureLog):
        super().__init__(logging.WARNING)
        self.failures = failures

    def emit(self, record: logging.LogRecord) -> None:
        try:
            what = record.getMessage().splitlines()[0][:200] if record.msg else record.name
            e = record.exc_info[1] if record.exc_info else None
            code = f"{record.name}:{type(e).__name__}" if e is not None else f"{record.name}:{what[:40]}"
            self.failures.note(code, f"{what}: {type(e).__name__}: {e}" if e is not None else what)
        except Exception:  # noqa: BLE001 - a log line must never fail what logged it
            pass


#: serve's own answer to a connection it cannot take (every one at work): the server's error shape
BUSY = json.dumps({"error": {"code": 503, "type": "unavailable_error",
                             "message": "slotctl serve: too many connections at once; try again"}}).encode()


class Front:
    """The accept loop of the listening socket ``sock`` (bound, listening), each connection handed to aiohttp's
    ``server`` (the protocol factory: ``web.AppRunner.server``); at most ``limit`` open at once (see the module
    docstring). :meth:`serve` and :meth:`reap` run until cancelled; :meth:`begin` and :meth:`end` mark a
    connection's request in progress (the proxy's handler runs between them); ``idle_timeout``: seconds a
    connection may stay without one (None: no timer of serve's own)."""

    def __init__(self, sock: socket.socket, server, *, limit: int, failures: FailureLog,
                 idle_timeout: float | None = None):
        self.sock, self.server, self.limit, self.failures = sock, server, limit, failures
        self.idle_timeout = idle_timeout
        sock.setblocking(False)
        #: the open connections (transports) and when each was last at work (accepted, or its last request
        #: ended: the loop's clock), the one idle the longest first: a request's end moves its own last
        self._open: dict[asyncio.BaseTransport, float] = {}
        #: requests in progress per connection (pipelined requests run one after the other: at most 1 in practice)
        self._busy: dict[asyncio.BaseTransport, int] = {}
        self.closed_idle = 0
        self.timed_out = 0
        self.refused = 0

    @property
    def open(self) -> int:
        self._forget_closed()
        return len(self._open)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _addr = await loop.sock_accept(self.sock)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                if e.errno in _GONE:
                    continue
                if e.errno in _OUT_OF:
                    self.failures.note("descriptors", f"a connection cannot be accepted: {e.strerror} (the "
                                                      f"process's descriptors ran out): the connection idle the "
                                                      f"longest is closed")
                    if not self._close_idle():
                        await asyncio.sleep(0.05)   # every one at work: one frees as its request ends
                    continue
                self.failures.note(f"accept:{errno.errorcode.get(e.errno, e.errno)}",
                                   f"a connection cannot be accepted: {e.strerror or e}")
                await asyncio.sleep(0.05)
                continue
            if len(self._open) >= self.limit:
                self._forget_closed()
                if len(self._open) >= self.limit and not self._close_idle():
                    self._refuse(conn)
                    continue
            try:
                conn.setblocking(False)
                transport, _protocol = await loop.connect_accepted_socket(self.server, conn)
            except OSError as e:
                conn.close()
                self.failures.note("handover", f"a connection accepted cannot be served: {e.strerror or e}")
                continue
            self._open[transport] = loop.time()

    async def reap(self) -> None:
        """Close, every quarter of the idle timeout, the connections without a request in progress whose last
        one ended (or that were accepted) ``idle_timeout`` seconds ago or more."""
        if self.idle_timeout is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(self.idle_timeout / 4, 0.05))
            self._forget_closed()
            now = loop.time()
            for t, since in list(self._open.items()):
                if now - since < self.idle_timeout:
                    break       # the rest were at work later (the dict is in that order)
                if not self._busy.get(t):
                    t.close()
                    del self._open[t]
                    self.timed_out += 1

    def _forget_closed(self) -> None:
        for t in [t for t in self._open if t.is_closing()]:
            del self._open[t]
            self._busy.pop(t, None)

    def _close_idle(self) -> bool:
        """The connection idle the longest closed (none at work: False)."""
        for t in self._open:
            if not self._busy.get(t) and not t.is_closing():
                t.close()
                del self._open[t]
                self.closed_idle += 1
                self.failures.note("connections_full", f"{self.limit:,} connections open, serve's limit "
                                                       f"(--max-connections): the one idle the longest is closed "
                                                       f"to take a new one")
                return True
        return False

    def _refuse(self, conn: socket.socket) -> None:
        self.refused += 1
        self.failures.note("connections_busy", f"{self.limit:,} connections open, each with a request in progress "
                                               f"(--max-connections): a new one is answered 503 and closed")
        try:
            conn.setblocking(False)
            conn.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                      + f"Content-Length: {len(BUSY)}\r\n\r\n".encode() + BUSY)
        except OSError:
            pass
        finally:
            conn.close()

    def begin(self, transport) -> None:
        """A request of the connection ``transport`` begins: it is not idle until :meth:`end`."""
        if transport is not None:
            self._busy[transport] = self._busy.get(transport, 0) + 1

    def end(self, transport) -> None:
        """A request of ``transport`` ended: the connection counts as idle from now (the last to be closed)."""
        if transport is None:
            return
        n = self._busy.get(transport, 0) - 1
        if n > 0:
            self._busy[transport] = n
            return
        self._busy.pop(transport, None)
        if transport in self._open:
            del self._open[transport]
            if not transport.is_closing():
                self._open[transport] = asyncio.get_running_loop().time()


def listening_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """The listening socket of serve's proxy (IPv6 when ``host`` is an IPv6 address); OSError as bind raises it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog, reuse_port=False)
