"""The relay of client traffic: a request passed on to the server as it came, and its answer back as the server
sent it (aiohttp, server and client in one package: an answer is passed on chunk by chunk as it comes, SSE
included). This module changes when what goes upstream, or what comes back, changes.

Every request is passed on as it came (method, path and query under the upstream's prefix, headers but the
hop-by-hop ones, body) and its answer comes back as the server sent it (status, reason, headers, bytes: nothing
decompressed or re-encoded). What serve reads of an answer on its way (whether the server completed it, its
``timings``) is :mod:`slotctl.serve.relayed`'s; an upstream that does not answer is an error (502, JSON, in
serve's own words: :func:`unavailable`, :func:`why_not_answered`).
"""

from __future__ import annotations

import asyncio

from aiohttp import (ClientConnectionError, ClientConnectorError, ClientError, ClientSession, ClientTimeout,
                     ServerDisconnectedError, TCPConnector, TraceConfig, web)
from yarl import URL

from slotctl.serve import target
from slotctl.serve.relayed import Tail

#: headers of one connection only (RFC 9110 7.6.1), never passed on; Host and Content-Length are set anew
HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"))
#: seconds serve reads on from the server after the client went away at the end of an answer (its last bytes)
DRAIN = 10.0


class Relayed:
    """An answer passed on (:meth:`Relay.forward`): the response, whether the server completed it with status
    200 (``completed``: its slot holds the whole exchange, whether or not the client read it to its end), and
    the server's ``timings`` of it (:class:`slotctl.serve.relayed.Tail`)."""

    __slots__ = ("response", "completed", "timings")

    def __init__(self, response: web.StreamResponse, completed: bool = False, timings: dict | None = None):
        self.response, self.completed, self.timings = response, completed, timings


def unavailable(message: str, status: int = 502) -> web.Response:
    """serve's own error answer, in the server's shape."""
    return web.json_response({"error": {"code": status, "type": "unavailable_error",
                                        "message": f"slotctl serve: {message}"}}, status=status)


def why_not_answered(e: BaseException) -> str:
    """Why the server did not answer, in serve's words (never aiohttp's internals)."""
    if isinstance(e, ClientConnectorError):
        err = e.os_error
        if isinstance(err, ConnectionRefusedError):
            return "connection refused (is llama-server running there?)"
        if isinstance(err, (TimeoutError, asyncio.TimeoutError)):
            return "no connection within 10 s"
        return f"cannot connect ({err.strerror or type(err).__name__})" if isinstance(err, OSError) and err.strerror \
            else "cannot connect"
    if isinstance(e, ServerDisconnectedError):
        return "the server closed the connection without answering"
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "no answer in time"
    if isinstance(e, ClientConnectionError):
        return "the connection to the server failed"
    if isinstance(e, ClientError):
        return "not a valid HTTP answer"
    if isinstance(e, OSError):
        return f"cannot connect ({e.strerror})" if e.strerror else "cannot connect"
    return "the request to the server failed"


class Relay:
    """Client traffic to the server at ``base`` and back, on one client session (:meth:`open`; a router's models'
    proxies share their front's: :mod:`slotctl.serve.models`). ``counters``: serve's counters (an upstream that
    does not answer, a client that went away); ``log``: serve's events."""

    def __init__(self, base: str, counters, log):
        self.base = base
        self.counters = counters
        self.log = log
        self.session: ClientSession | None = None

    def open(self, on_connection) -> None:
        """The client session made, adding nothing the client did not send (aiohttp adds User-Agent, Accept,
        Accept-Encoding); ``on_connection()`` called for each connection it makes to the server."""
        async def made(*_args) -> None:
            on_connection()

        trace = TraceConfig()
        trace.on_connection_create_end.append(made)
        self.session = ClientSession(connector=TCPConnector(limit=0), auto_decompress=False,
                                     timeout=ClientTimeout(total=None, sock_connect=10), trace_configs=[trace],
                                     skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))

    async def close(self) -> None:
        await self.session.close()

    def target(self, request: web.Request) -> tuple[URL, str]:
        """Where ``request`` goes upstream (its path put under the upstream's prefix, normalised:
        :func:`slotctl.serve.target.under_prefix`, :class:`~slotctl.serve.target.Leaves` when it would leave it)
        and the route it names there."""
        base = URL(self.base)
        path, route = target.under_prefix(base.path.rstrip("/"), request.raw_path)
        return URL(str(base.origin()) + path, encoded=True), route

    @staticmethod
    def headers(request: web.Request, *, stream: bool = False, length: int | None = None) -> list[tuple[str, str]]:
        """The client's headers but the hop-by-hop ones; ``stream``: its body sent as it comes, with the
        Content-Length it gave (``length``: this one), else chunked."""
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        if stream and length is None and request.body_exists and request.content_length is not None \
                and "chunked" not in request.headers.get("Transfer-Encoding", "").lower():
            length = request.content_length
        if length is not None:
            headers.append(("Content-Length", str(length)))
        return headers

    async def forward(self, request: web.Request, data, headers=None) -> Relayed:
        """``request`` sent upstream with the body ``data`` (bytes or a stream) and the answer streamed back
        (:class:`Relayed`). A client that goes away before the answer's end: serve reads on, for at most
        :data:`DRAIN` seconds, only when what it passed on already ends the server's work
        (:meth:`slotctl.serve.relayed.Tail.final`: the client closed after the last event, as the ``openai`` SDK
        does); else it closes its request to the server, which stops the task and frees the slot."""
        try:
            up = await self.session.request(request.method, self.target(request)[0],
                                            headers=headers if headers is not None else self.headers(request),
                                            data=data, allow_redirects=False)
        except (ClientError, OSError, asyncio.TimeoutError) as e:
            self.counters.add("upstream_errors")
            why = why_not_answered(e)
            self.log("upstream", f"{request.method} {request.path}: the server does not answer: {why}")
            return Relayed(unavailable(f"the server {self.base} does not answer: {why}"))
        whole = False
        tail = Tail(up.headers.get("Content-Type"))
        resp = web.StreamResponse(status=up.status, reason=up.reason)
        try:
            for k, v in up.headers.items():
                if k.lower() not in HOP_BY_HOP:
                    resp.headers.add(k, v)
            if up.content_length is not None and "chunked" not in up.headers.get("Transfer-Encoding", "").lower():
                resp.content_length = up.content_length
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                tail.feed(chunk)
                await resp.write(chunk)
            await resp.write_eof()
            whole = True
            return Relayed(resp, up.status == 200, tail.timings())
        except ConnectionResetError:
            if up.status == 200 and tail.final() and await _drain(up, tail):
                whole = True    # the server's work is done, and the slot holds it: saved as any other
                return Relayed(resp, True, tail.timings())
            # the client went away: the answer is left unfinished (aiohttp's own end of it fails quietly)
            self.counters.add("client_disconnects")
            self.log("disconnect", f"{request.method} {request.path}: the client went away: the request to the "
                                   f"server is closed")
            return Relayed(resp)
        except (ClientError, asyncio.TimeoutError) as e:
            # the server went away mid-answer: the client's connection is closed, never ended as if whole
            self.counters.add("upstream_errors")
            self.log("upstream", f"{request.method} {request.path}: the server's answer broke off: "
                                 f"{why_not_answered(e)}")
            if request.transport is not None:
                request.transport.close()
            return Relayed(resp)
        finally:
            if whole:
                up.release()
            else:
                up.close()      # the server sees the connection close and stops the task: the slot is freed


async def _drain(up, tail: Tail) -> bool:
    """The rest of an answer the client stopped reading after its last event, read (and kept in ``tail``) to its
    end within :data:`DRAIN` seconds; False when it did not end."""
    async def rest() -> None:
        async for chunk in up.content.iter_any():
            tail.feed(chunk)

    try:
        await asyncio.wait_for(rest(), DRAIN)
    except (ClientError, asyncio.TimeoutError):
        return False
    return True
