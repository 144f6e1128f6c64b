"""A completion request's body as serve reads it (docs/serve.md, "Limits"): within a bound, parsed off the event
loop, and sent on with the client's bytes.

- **Read within a bound** (:class:`Bodies`): a body of up to ``max_body`` bytes is read whole (each piece within
  the idle timeout: a client that stalls is cut off), while all the bodies read at once stay within
  :data:`BODIES_AT_ONCE` times that. A larger body, or one that would pass that sum, is not read: it goes to
  the server as it comes (:class:`Unread`, streamed: flow control holds it to a few buffers), uncached. So
  serve's memory does not grow with a body, and a body it does not read costs no other client anything.
- **Parsed off the event loop** (:func:`parse`, in a thread of its own): strict UTF-8 and JSON, an object, or
  nothing (malformed: more deeply nested than Python's parser goes, another encoding, an array): such a body
  goes to the server untouched and its answer comes back.
- **Cached only as sent** (:func:`cacheable`): ``cache_prompt`` absent or ``true`` and ``id_slot`` absent,
  null or a number; anything else (``"cache_prompt": "yes"``) is the server's to answer, untouched.
- **Sent on with the client's bytes** (:func:`with_slot`): ``id_slot`` and ``cache_prompt`` appended to the
  object as the client sent it (llama-server's JSON parser, nlohmann's, keeps the last of a key given twice):
  every other byte as sent, nothing serialised again.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

#: bodies read whole at once: at most this many times ``--max-body`` in all (beyond, they go unread)
BODIES_AT_ONCE = 4
#: JSON's whitespace (RFC 8259)
_WS = b" \t\n\r"

_parser: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """The parser's threads: two of their own, so that a large body parsed never holds a worker thread of
    serve's small requests."""
    global _parser
    if _parser is None:
        _parser = ThreadPoolExecutor(max_workers=2, thread_name_prefix="slotctl-parse")
    return _parser


class Stalled(Exception):
    """A client stopped sending its body for longer than the idle timeout."""


@dataclass
class Unread:
    """A body serve does not read (larger than ``--max-body``, or past the bodies read at once): what goes to the
    server (``data``: the pieces read so far, then the rest as it comes) and its ``length`` when the client said
    it (sent as its Content-Length; else chunked)."""

    data: object
    length: int | None
    why: str


class Bodies:
    """The bodies of completion requests read within ``max_body`` bytes each and :data:`BODIES_AT_ONCE` times
    that in all, each piece within ``idle_timeout`` seconds. Used on the event loop only."""

    def __init__(self, max_body: int, idle_timeout: float):
        self.max_body, self.idle_timeout = max_body, idle_timeout
        self.budget = BODIES_AT_ONCE * max_body
        #: bytes of the bodies read (or being read) now
        self.held = 0

    def _take(self, n: int) -> bool:
        if self.held + n > self.budget:
            return False
        self.held += n
        return True

    def give_back(self, n: int) -> None:
        self.held -= n

    async def read(self, request) -> tuple[bytearray | Unread, int]:
        """The body of ``request`` (an aiohttp request) whole, or :class:`Unread`; and the bytes it holds of the
        budget (:meth:`give_back` them once the request is done). :class:`Stalled` when the client stops
        sending."""
        content, n = request.content, request.content_length
        if n is not None and "chunked" not in request.headers.get("Transfer-Encoding", "").lower():
            if n > self.max_body:
                return Unread(content, n, f"a body of {n:,} bytes, over --max-body {self.max_body:,}"), 0
            if not self._take(n):
                return Unread(content, n, f"{self.held:,} bytes of bodies being read at once"), 0
            buf = bytearray()
            try:
                while len(buf) < n:
                    piece = await self._piece(content)
                    if not piece:
                        break       # shorter than said: aiohttp's parser says so before this; the server's to answer
                    buf += piece
            except BaseException:
                self.give_back(n)
                raise
            return buf, n
        buf, taken = bytearray(), 0
        try:
            while True:
                piece = await self._piece(content)
                if not piece:
                    return buf, taken
                if len(buf) + len(piece) > self.max_body or not self._take(len(piece)):
                    over = len(buf) + len(piece) > self.max_body
                    self.give_back(taken)
                    why = (f"a chunked body over --max-body {self.max_body:,}" if over
                           else f"{self.held:,} bytes of bodies being read at once")
                    return Unread(_rest(bytes(buf) + piece, content), None, why), 0
                taken += len(piece)
                buf += piece
        except BaseException:
            self.give_back(taken)
            raise

    async def _piece(self, content) -> bytes:
        try:
            return await asyncio.wait_for(content.readany(), self.idle_timeout)
        except asyncio.TimeoutError:
            raise Stalled(f"the client sent nothing of its body for {self.idle_timeout:g} s") from None


async def _rest(first: bytes, content):
    """``first``, then the rest of the body as it comes."""
    yield first
    while True:
        piece = await content.readany()
        if not piece:
            return
        yield piece


def _loads(raw) -> dict | None:
    try:
        body = json.loads(bytes(raw).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError, MemoryError):
        return None
    return body if isinstance(body, dict) else None


async def parse(raw) -> dict | None:
    """The body ``raw`` as a JSON object, parsed in a thread of its own; None when it is not one (malformed,
    nested deeper than Python's parser goes, not UTF-8, not an object)."""
    return await asyncio.get_running_loop().run_in_executor(_pool(), _loads, raw)


def cacheable(body: dict) -> bool:
    """Whether serve may give the request a slot and send it with ``cache_prompt: true``: the client's
    ``cache_prompt`` absent or ``true`` (anything else, ``"yes"`` too, is the server's to answer), its
    ``id_slot`` absent, null or a number."""
    if "cache_prompt" in body and body["cache_prompt"] is not True:
        return False
    v = body.get("id_slot")
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def with_slot(raw, body: dict, slot: int) -> bytes:
    """The client's body ``raw`` (a JSON object, ``body`` as parsed) with ``"id_slot": slot`` and
    ``"cache_prompt": true`` appended: llama-server keeps the last of a key given twice, so these are the ones
    it reads; every other byte as the client sent it."""
    end = len(raw.rstrip(_WS))
    if raw[end - 1:end] != b"}":
        raise ValueError("not a JSON object")
    return bytes(raw[:end - 1]) + (b", " if body else b"") + b'"id_slot": %d, "cache_prompt": true}' % slot
