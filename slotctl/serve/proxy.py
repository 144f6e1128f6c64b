"""The HTTP side of ``slotctl serve``: a reverse proxy in front of one llama-server (aiohttp, server and
client in one package: a response is passed on chunk by chunk as it comes, SSE included).

Every request is passed on as it came (method, path and query, headers but the hop-by-hop ones, body) and
its answer comes back as the server sent it (status, reason, headers, bytes: nothing decompressed or
re-encoded). A completion request (:data:`slotctl.server.requests.COMPLETION_PATHS`) whose body is a JSON
object is given a slot first (:meth:`Proxy.choose`, from serve's own view of what each slot holds:
``GET /slots`` is asked only when a connection to the server was made since it was last asked, and once a
second in the background), the stored state that pays restored into it (:meth:`Proxy.prepare`), and goes
with ``id_slot`` and ``cache_prompt``; after a whole answer, the slot is saved into the store before
another request may use it (:meth:`Proxy._save_then_release`). Whatever
fails in the cache, the request goes on uncached; only an upstream that does not answer is an error
(502, JSON).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np
from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, TraceConfig, web
from yarl import URL

from slotctl.serve.cache import RESTORABLE, Cache, ConversionFailed
from slotctl.serve.index import as_tokens, common_prefix
from slotctl.server.requests import COMPLETION_PATHS, TOKENIZE_FLAGS, prompt_form

#: headers of one connection only (RFC 9110 7.6.1), never passed on; Host and Content-Length are set anew
HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"))
#: serve's own answer (everything else is the server's)
STATS_PATH = "/slotctl/stats"
#: a completion request's body is read whole (to find its prompt) up to this; the rest are streamed
MAX_BODY = 256 << 20
#: seconds serve waits for its own small requests (/slots, /tokenize, /apply-template)
SMALL_TIMEOUT = 30.0
#: the slots' state as serve last left it is unknown (a request it sent that was not saved)
UNKNOWN = ("unknown",)
EMPTY = np.zeros(0, dtype=np.int32)
#: tokens at the end of a prompt text that may be tokenized otherwise once more text follows it (the last
#: word, number or run of spaces: tokenizers split text into such pieces and merge only within one)
MARGIN = 8


@dataclass
class Slot:
    """One slot of the server as serve knows it: the tokens it holds (the last prompt, or the state saved or
    restored), the ``/slots`` signature then (a change serve did not make: the tokens are unknown), when it
    was last used, and the requests holding or waiting for it. ``text`` and ``prompt``: the prompt text serve
    last sent into the slot and the server's tokens of it, while the slot holds what that request left
    (any other change of ``tokens`` forgets them)."""

    id: int
    _tokens: np.ndarray = field(default_factory=lambda: EMPTY)
    sig: tuple | None = None
    used: float = 0.0
    pending: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    text: str | None = None
    prompt: np.ndarray = field(default_factory=lambda: EMPTY)

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens

    @tokens.setter
    def tokens(self, tokens: np.ndarray) -> None:
        self._tokens, self.text, self.prompt = tokens, None, EMPTY

    def sent(self, tokens: np.ndarray, text: str | None, prompt: np.ndarray) -> None:
        """The slot holds ``tokens`` after serve sent it the prompt ``text`` (whose tokens are ``prompt``)."""
        self._tokens, self.text, self.prompt = tokens, text, prompt


def signature(entry: dict) -> tuple | None:
    """A slot's state as ``GET /slots`` shows it (its last task and its prompt's length); None for a slot
    that has run no task since the server started."""
    if "id_task" not in entry:
        return None
    return entry.get("id_task"), entry.get("n_prompt_tokens")


def _holds(slot: Slot) -> int:
    """The tokens ``slot`` holds as far as serve knows: ``GET /slots``' count (none for a slot that has run no
    task), else what serve put there."""
    if slot.sig is None:
        return 0
    if len(slot.sig) == 2 and isinstance(slot.sig[1], int):
        return slot.sig[1]
    return len(slot.tokens)


class UpstreamDown(Exception):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class Proxy:
    """The proxy for ``cache``'s server. ``min_gain``: a stored state is restored only when it keeps at
    least this many more prompt tokens than the slot already holds."""

    def __init__(self, cache: Cache, *, min_gain: int = 16, facts_every: float = 5.0, check_every: float = 1.0,
                 log=None, on_prompt=None):
        self.cache = cache
        #: ``on_prompt(reused, evaluated)`` once per request given a slot: the prompt tokens :meth:`prepare`
        #: predicts the server reuses (the restored state's, else the slot's own prefix; 0 when the restore
        #: failed) and evaluates (serve's metrics)
        self.on_prompt = on_prompt
        self.base = cache.url
        self.min_gain = min_gain
        self.facts_every = facts_every
        self.check_every = check_every
        self.log = log or cache.log
        self.slots: dict[int, Slot] = {}
        # serve's view of the slots (what each holds: every request goes through serve) is trusted while every
        # connection to the server was made before the last GET /slots (``view_gen``): a server restarted
        # since has closed them all, and serve's next request opens a new one (``gen`` counts them)
        self.gen = 0
        self.view_gen = -1
        self._busy: set[int] = set()      # slots the last GET /slots saw at work for another client
        self._top_task = -1               # the highest task id GET /slots showed: lower later, a new server
        self._learning = asyncio.Lock()   # held while the server's -kvu/-ctk/-ctv are learnt (:meth:`learn_flags`)
        self.session: ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    # -- the application -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app) -> None:
        # nothing added that the client did not send (aiohttp adds User-Agent, Accept, Accept-Encoding)
        trace = TraceConfig()
        trace.on_connection_create_end.append(self._connected)
        self.session = ClientSession(connector=TCPConnector(limit=0), auto_decompress=False,
                                     timeout=ClientTimeout(total=None, sock_connect=10), trace_configs=[trace],
                                     skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))

    async def _connected(self, *_args) -> None:
        self.gen += 1

    async def begin(self) -> None:
        """Once listening: the server's facts read (until then completions pass through uncached), then
        read again every ``facts_every`` seconds."""
        await self._refresh_facts()
        self._spawn(self._facts_loop())
        self._spawn(self._check_loop())

    async def _cleanup(self, _app) -> None:
        self._stop.set()
        for t in list(self._tasks):     # saves in progress finish: a state half stored is never left
            if not t.get_name().startswith("save"):
                t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.session.close()

    def _spawn(self, coro, name: str = "task") -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _refresh_facts(self, key: str | None = None) -> None:
        try:
            await asyncio.to_thread(self.cache.refresh_facts, key)
        except Exception as e:  # noqa: BLE001 - the server down or not a llama-server: pass through meanwhile
            if self.cache.facts is not None or not getattr(self, "_said_down", False):
                self.log("down", f"the server's facts cannot be read ({e}): requests pass through uncached")
            self._said_down = True
            return
        if getattr(self, "_said_down", True):
            f = self.cache.facts
            self.log("up", f"{f.url}: {f.total_slots} slot(s) of {f.n_ctx_slot} tokens, model {f.model_path}, "
                           f"{f.build_info}", total_slots=f.total_slots, model=self.cache.model)
            self.cache.learn_due = True     # a server back may have been started with other flags
        self._said_down = False
        await self.learn_flags(key)

    async def learn_flags(self, key: str | None, read_facts: bool = False) -> None:
        """When due (the facts first read or changed, the server back or restarted): the server's ``-kvu``,
        ``-ctk``, ``-ctv`` learnt from a save of one of its slots (:meth:`Cache.probe`), held by serve meanwhile
        (no request of serve's uses it): the free slot that holds the fewest tokens (a slot that holds nothing
        saves its stream count alone; one that holds cells, its cache types too). ``read_facts``: the facts read
        again first (a restart seen in ``GET /slots``: its slot context may be another). No slot free: tried
        again at the next facts read or request that may restore (serve's own saves teach the same meanwhile)."""
        async with self._learning:
            if not self.cache.learn_due or self.cache.facts is None:
                return
            if read_facts:
                try:
                    await asyncio.to_thread(self.cache.refresh_facts, key)
                except Exception:  # noqa: BLE001 - down again: the facts loop says so; learnt when it is back
                    return
            if self.view_gen != self.gen and not await self.check_slots(key):
                return
            free = [s for s in self.slots.values() if not s.lock.locked() and s.pending == 0 and s.id not in self._busy]
            if not free:
                return
            slot = min(free, key=lambda s: (_holds(s), s.id))
            slot.pending += 1
            await slot.lock.acquire()
            try:
                await asyncio.to_thread(self.cache.probe, slot.id, key)
            except Exception as e:  # noqa: BLE001 - not learnt: judged with the flags given, as before
                self.log("error", f"slot {slot.id}: the server's -kvu/-ctk/-ctv cannot be learnt from a save ({e}): "
                                  f"states are judged with the flags given (llama-server's defaults for the rest)",
                         slot=slot.id)
            finally:
                self._release(slot)

    async def _facts_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.facts_every)
            except asyncio.TimeoutError:
                await self._refresh_facts()

    async def _check_loop(self) -> None:
        """Every ``check_every`` seconds, off the request path: the slots read again (a change serve did not
        make: another client, a restart)."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.check_every)
            except asyncio.TimeoutError:
                pass
            if not self._stop.is_set() and self.cache.facts is not None:
                await self.check_slots(self.cache.api_key)

    async def check_slots(self, key: str | None) -> bool:
        """``GET /slots`` read against serve's view (:meth:`_apply`); False when it cannot be read (the view is
        then lost: every slot taken as holding nothing)."""
        try:
            entries = await self._get("/slots", key)
        except UpstreamDown as e:
            if e.status not in (401, 403):     # refused for want of a key (a client's, in the background): unknown
                self._lose_view()
            return False
        except Exception:  # noqa: BLE001 - the server down or restarting
            self._lose_view()
            return False
        self._apply(entries if isinstance(entries, list) else [])
        return True

    def _lose_view(self) -> None:
        self.view_gen = -1
        for s in self.slots.values():
            s.tokens, s.sig = EMPTY, UNKNOWN

    def _apply(self, entries: list) -> None:
        """What ``GET /slots`` shows: a slot serve neither holds nor waits for whose signature is not the one
        serve noted after its last request holds what serve did not put there (another client; a restarted
        server: no task yet, or task ids counting from 0 again): taken as holding nothing."""
        gen = self.gen      # every connection made until now answers for the server this answer describes
        entries = [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), int)
                   and not isinstance(e.get("id"), bool)]
        tasks = [e["id_task"] for e in entries if isinstance(e.get("id_task"), int)]
        top = max(tasks, default=-1)
        if top < self._top_task:
            for s in self.slots.values():
                if not s.lock.locked() and s.pending == 0:
                    s.tokens, s.sig = EMPTY, UNKNOWN
            self.cache.learn_due = True     # a restarted server may run other flags
        self._top_task = top
        busy = set()
        for entry in entries:
            s = self.slots.setdefault(entry["id"], Slot(entry["id"]))
            if not s.lock.locked() and s.pending == 0 and signature(entry) != s.sig:
                s.tokens, s.sig = EMPTY, signature(entry)
            if entry.get("is_processing") and not s.lock.locked():
                busy.add(s.id)
        self._busy = busy
        self.view_gen = gen if self.slots else -1

    # -- every request ---------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._handle(request)
        except (asyncio.CancelledError, web.HTTPException):
            raise
        except Exception as e:  # noqa: BLE001 - a bug of serve's: one line, never a traceback
            self.log("error", f"{request.method} {request.path}: {type(e).__name__}: {e}")
            raise web.HTTPBadGateway(text=json.dumps({"error": {"code": 502, "type": "unavailable_error",
                                                                "message": f"slotctl serve: {e}"}}),
                                     content_type="application/json") from None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        c = self.cache.counters
        c.add("requests")
        if request.method == "GET" and request.path == STATS_PATH:
            return web.json_response({"counters": c.as_dict(), "model": self.cache.model,
                                      "states": len(self.cache.index.states) if self.cache.index else 0})
        form = COMPLETION_PATHS.get(self._route(request.path)) if request.method == "POST" else None
        if form is None:
            c.add("passed_through")
            return (await self.forward(request, request.content if request.body_exists else None))[0]
        raw = await request.read()
        return await self.completion(request, raw, form)

    def _route(self, path: str) -> str:
        """``path`` without the upstream's own prefix (``--api-prefix``) when the client used it."""
        prefix = URL(self.base).path.rstrip("/")
        return path[len(prefix):] if prefix and path.startswith(prefix + "/") else path

    def _target(self, request: web.Request) -> URL:
        prefix = URL(self.base).path.rstrip("/")
        path = request.raw_path
        if prefix and (path == prefix or path.startswith(prefix + "/")):
            path = path[len(prefix):]
        return URL(self.base.rstrip("/") + path, encoded=True)

    @staticmethod
    def _headers(request: web.Request) -> list[tuple[str, str]]:
        return [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]

    async def forward(self, request: web.Request, data, headers=None) -> tuple[web.StreamResponse, bool]:
        """``request`` sent upstream with the body ``data`` (bytes or a stream) and the answer streamed back.
        (the response, whether it came whole with status 200)."""
        try:
            up = await self.session.request(request.method, self._target(request),
                                            headers=headers if headers is not None else self._headers(request),
                                            data=data, allow_redirects=False)
        except (ClientError, OSError, asyncio.TimeoutError) as e:
            self.cache.counters.add("upstream_errors")
            self.log("upstream", f"{request.method} {request.path}: the server does not answer: {e}")
            return web.json_response({"error": {"code": 502, "type": "unavailable_error",
                                                "message": f"slotctl serve: the server {self.base} does not "
                                                           f"answer: {e or type(e).__name__}"}}, status=502), False
        whole = False
        resp = web.StreamResponse(status=up.status, reason=up.reason)
        try:
            for k, v in up.headers.items():
                if k.lower() not in HOP_BY_HOP:
                    resp.headers.add(k, v)
            if up.content_length is not None and "chunked" not in up.headers.get("Transfer-Encoding", "").lower():
                resp.content_length = up.content_length
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            whole = True
            return resp, up.status == 200
        except ConnectionResetError:
            # the client went away: the answer is left unfinished (aiohttp's own end of it fails quietly)
            self.cache.counters.add("client_disconnects")
            self.log("disconnect", f"{request.method} {request.path}: the client went away: the request to the "
                                   f"server is closed")
            return resp, False
        except (ClientError, asyncio.TimeoutError) as e:
            # the server went away mid-answer: the client's connection is closed, never ended as if whole
            self.cache.counters.add("upstream_errors")
            self.log("upstream", f"{request.method} {request.path}: the server's answer broke off: {e}")
            if request.transport is not None:
                request.transport.close()
            return resp, False
        finally:
            if whole:
                up.release()
            else:
                up.close()      # the server sees the connection close and stops the task: the slot is freed

    # -- completions -----------------------------------------------------------------------------------

    async def completion(self, request: web.Request, raw: bytes, form: str) -> web.StreamResponse:
        c = self.cache.counters
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        key = self._auth(request)
        if isinstance(body, dict) and self.cache.facts is None:
            await self._refresh_facts(key)   # not read yet (serve just started, the server was down, a key needed)
        if (not isinstance(body, dict) or self.cache.facts is None or body.get("cache_prompt") is False
                or not self._slot_id_ok(body.get("id_slot"))):
            c.add("passed_through")
            return (await self.forward(request, raw))[0]
        # serve's view of the slots is read again (GET /slots) only when a connection to the server was made
        # since it was last read (serve's first request, a restarted server): at the same time as the prompt's
        # tokens are asked for when that is known before; after, when asking for them took a new connection.
        # A prompt of tokens asks the server nothing: GET /health is asked instead, for its connection.
        check = None if self.view_gen == self.gen else asyncio.ensure_future(self.check_slots(key))
        text = slot = tokens = None
        try:
            prompt = await self.prompt_of(raw, body, form, key)
            text = prompt if isinstance(prompt, str) else None
            if text is not None and (check is None or await check):
                slot = await self.by_text(text, body.get("id_slot"), form, key)    # no /tokenize before the request
            if slot is None:
                tokens = await self.tokens_of(prompt, key)
        except Exception as e:  # noqa: BLE001 - the cache never fails a request
            c.add("lookup_failures")
            self.log("error", f"{request.path}: the prompt's tokens cannot be had ({e}): passed through uncached")
        if slot is not None:
            return await self.send(request, body, slot, key, None, text)
        if check is not None:
            await check
        if tokens is None or len(tokens) == 0:
            c.add("passed_through")
            return (await self.forward(request, raw))[0]
        if check is None and form != "chat" and prompt_form(body.get("prompt")) == "tokens":
            try:
                await self._get("/health", key)
            except Exception:  # noqa: BLE001 - loading or down: GET /slots below says which
                self.view_gen = -1
        if self.view_gen != self.gen and not await self.check_slots(key):
            self.log("error", "GET /slots cannot be read: the request passes through uncached")
            c.add("passed_through")
            return (await self.forward(request, raw))[0]
        slot = self.choose(tokens, body.get("id_slot"))
        if slot is None:
            c.add("passed_through")
            return (await self.forward(request, raw))[0]
        return await self.send(request, body, slot, key, tokens, text)

    async def send(self, request: web.Request, body: dict, slot: Slot, key: str | None, tokens: np.ndarray | None,
                   text: str | None) -> web.StreamResponse:
        """The request sent into ``slot`` (its ``pending`` counted), the slot held until its save: prepared
        first (:meth:`prepare`) when the prompt's ``tokens`` are known; None: a prompt ``text`` that begins
        with the slot's own (:meth:`by_text`), its tokens asked for once the answer was passed on."""
        c = self.cache.counters
        c.add("cached")
        handed = False
        try:
            await slot.lock.acquire()
        except BaseException:
            slot.pending -= 1
            raise
        try:
            before = slot.tokens
            if tokens is not None:
                reused = 0
                if self.cache.learn_due and self.may_restore(slot, tokens):
                    await self.learn_flags(key, read_facts=True)  # the server's flags learnt before it is judged
                try:
                    if self.may_restore(slot, tokens):      # looked up, judged and restored in a worker thread
                        reused = await asyncio.to_thread(self.prepare, slot, tokens, key)
                    else:
                        reused = self.prepare(slot, tokens, key)     # nothing to look up: at once, on the event loop
                except Exception as e:  # noqa: BLE001 - a restore that fails: the request goes uncached
                    c.add("restore_failures")
                    slot.tokens = EMPTY
                    self.log("error", f"slot {slot.id}: no restore ({e}): the request goes uncached", slot=slot.id)
                if self.on_prompt is not None:
                    self.on_prompt(reused, len(tokens) - reused)
            else:
                c.add("matched_by_text")
            data = json.dumps(dict(body, id_slot=slot.id, cache_prompt=True)).encode()
            resp, ok = await self.forward(request, data, self._headers(request))
            slot.used = time.monotonic()
            if ok:
                # the save is asked once the answer was passed on, not while its last bytes are on their way
                # (the save's worker thread then held them back by a few milliseconds, measured)
                slot.sig = UNKNOWN
                if tokens is not None:
                    slot.sent(tokens, text, tokens)
                    self._spawn(self._save_then_release(slot, key), name=f"save-{slot.id}")
                else:
                    slot.tokens = EMPTY
                    self._spawn(self._save_then_release(slot, key, text, before), name=f"save-{slot.id}")
                handed = True
            else:
                slot.tokens, slot.sig = EMPTY, UNKNOWN     # a broken answer: what the slot holds is not known
            return resp
        finally:
            if not handed:
                self._release(slot)

    async def _same_server(self, form: str, key: str | None) -> bool:
        """Whether serve's view of the slots still holds once a request has gone to the server on its
        connection (a chat's ``/apply-template`` went; else ``GET /health``). A connection made anew may be a
        restarted server's (or the server closed an idle one: cpp-httplib does after a few seconds): the
        slots are read again first (``GET /slots``, :meth:`_apply`: a restart, or a slot changed by another
        client, takes the slots' text away)."""
        if form != "chat":
            try:
                await self._get("/health", key)
            except Exception:  # noqa: BLE001 - loading or down: GET /slots says which
                self.view_gen = -1
        if self.view_gen != self.gen:
            await self.check_slots(key)
        return self.view_gen == self.gen

    async def by_text(self, text: str, want, form: str, key: str | None) -> Slot | None:
        """The slot for a prompt ``text`` without asking the server for its tokens (its ``pending`` counted):
        the idle slot whose own prompt text (:attr:`Slot.text`) ``text`` begins with, the longest such
        (``want``'s alone when given), when no stored state could keep ``min_gain`` tokens more of the request
        than the slot holds (:meth:`Cache.may_beat`: such a state would begin with the slot's prompt tokens but
        their last :data:`MARGIN`, the tokens that more text may change). That is the choice :meth:`choose` and
        :meth:`prepare` make from the prompt's tokens: the slot shares the most of it, and nothing is
        restored. None: the tokens are needed."""
        if self._by_text(text, want) is None or not await self._same_server(form, key):
            return None
        if not self.cache.index_fresh():
            try:        # other serve processes' states, listed as prepare lists them
                await asyncio.to_thread(self.cache.sync_index)
            except Exception:  # noqa: BLE001 - the store down: prepare says so, and goes uncached
                return None
        s = self._by_text(text, want)       # again: other requests ran meanwhile
        if s is None or self.view_gen != self.gen or self.cache.may_beat(s.prompt, s.tokens, self.min_gain, MARGIN):
            return None
        s.pending += 1
        return s

    def _by_text(self, text: str, want) -> Slot | None:
        if isinstance(want, int) and want >= 0:
            pool = [self.slots[want]] if want in self.slots else []
        else:
            pool = list(self.slots.values())
        fits = [s for s in pool if s.text is not None and s.pending == 0 and s.id not in self._busy
                and text.startswith(s.text)]
        return max(fits, key=lambda s: len(s.text), default=None)

    @staticmethod
    def _slot_id_ok(v) -> bool:
        return v is None or (isinstance(v, int) and not isinstance(v, bool))

    def _auth(self, request: web.Request) -> str | None:
        """The key for serve's own requests: ``--api-key``, else the client's bearer token (never kept)."""
        if self.cache.api_key:
            return self.cache.api_key
        h = request.headers.get("Authorization", "")
        return h[7:].strip() if h[:7].lower() == "bearer " else None

    async def _post(self, path: str, body, key: str | None, raw: bytes | None = None, timeout: float = SMALL_TIMEOUT):
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.session.post(URL(self.base + path), data=data, headers=headers,
                                     timeout=ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                raise UpstreamDown(f"POST {path}: HTTP {r.status}")
            return await r.json(content_type=None)

    async def _get(self, path: str, key: str | None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.session.get(URL(self.base + path), headers=headers,
                                    timeout=ClientTimeout(total=SMALL_TIMEOUT)) as r:
            if r.status != 200:
                raise UpstreamDown(f"GET {path}: HTTP {r.status}", r.status)
            return await r.json(content_type=None)

    async def prompt_of(self, raw: bytes, body: dict, form: str, key: str | None):
        """The request's prompt as the server reads it: its ``prompt``, or a chat's ``messages`` through the
        server's ``/apply-template``; None for a chat serve does not cache (no messages, media)."""
        if form == "chat":
            if not isinstance(body.get("messages"), list) or self.cache.facts.mmproj:
                return None
            return (await self._post("/apply-template", None, key, raw=raw)).get("prompt")
        return body.get("prompt")

    async def tokens_of(self, prompt, key: str | None) -> np.ndarray | None:
        """A prompt (:meth:`prompt_of`) as the server tokenizes it: its own token ids, or the server's
        ``/tokenize`` of its text; None when it is no one prompt serve can tokenize (several prompts)."""
        how = prompt_form(prompt)
        if how == "tokens":
            return as_tokens(prompt)
        if how != "text":
            return None
        answer = await self._post("/tokenize", {"content": prompt, **TOKENIZE_FLAGS}, key)
        toks = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise UpstreamDown("POST /tokenize: no token list in the answer")
        return as_tokens(toks)

    def choose(self, tokens: np.ndarray, want) -> Slot | None:
        """The slot for a request (its ``pending`` counted), from serve's view of the slots: ``want`` when given
        (not -1); else the idle slot whose tokens share the longest prefix with ``tokens``, else the least
        recently used (also when the longest shares fewer than ``min_gain`` tokens). None when serve knows no
        slot, or ``want`` is not one of them (the server's answer)."""
        if not self.slots:
            return None
        if isinstance(want, int) and want >= 0:
            s = self.slots.get(want)
            if s is None:
                return None      # a slot the server does not have: its own answer
        else:
            free = [s for s in self.slots.values() if s.pending == 0 and s.id not in self._busy]
            pool = free or list(self.slots.values())
            best = max(pool, key=lambda s: (common_prefix(s.tokens, tokens), -s.used))
            if common_prefix(best.tokens, tokens) < self.min_gain:
                # sharing less than --min-gain (a BOS token, a chat template's first line) is no reason to
                # take a conversation's slot: the least recently used (an empty one first) is taken instead
                best = min(pool, key=lambda s: (s.pending, s.used))
            s = best
        s.pending += 1
        return s

    def _release(self, slot: Slot) -> None:
        slot.pending -= 1
        slot.lock.release()

    def may_restore(self, slot: Slot, tokens: np.ndarray) -> bool:
        """Whether a stored state could keep ``min_gain`` tokens more of ``tokens`` than ``slot`` holds: not when
        fewer than that are not in the slot (then :meth:`prepare` looks nothing up)."""
        return len(tokens) - min(common_prefix(slot.tokens, tokens), len(tokens) - 1) >= self.min_gain

    def prepare(self, slot: Slot, tokens: np.ndarray, key: str | None = None) -> int:
        """In a worker thread, with the slot held: restore the stored state that keeps the most of the
        prompt, when its verdict for this slot is ``restores`` and it keeps at least ``min_gain`` tokens
        more than the slot holds. A state another server's ``-np``/``-kvu`` made is converted for this one
        first (:meth:`Cache.converted`) and the converted file judged the same way; a conversion that fails
        leaves the request uncached. The prompt tokens the server is predicted to reuse: the restored
        state's (its ``restored`` event's ``reuse``), else what the slot already holds of the prompt."""
        c = self.cache.counters
        held = min(common_prefix(slot.tokens, tokens), len(tokens) - 1)
        if not self.may_restore(slot, tokens):
            return held
        try:
            found = self.cache.lookup(tokens)
        except Exception as e:  # noqa: BLE001 - the store down: uncached
            c.add("lookup_failures")
            self.log("error", f"the store cannot be read ({e}): the request goes uncached")
            return held
        for state, common in found:
            if common - held < self.min_gain:
                break
            judged = self.cache.judge(state, slot.id)
            if judged.verdict not in RESTORABLE and not judged.convert:
                self._refused(state, slot, judged)
                continue
            gain = self.cache.reuse(judged, state, common, len(tokens))
            if gain - held < self.min_gain:
                continue
            if judged.verdict in RESTORABLE:
                return self._restore(slot, state, gain, held, len(tokens), key, judged=judged)
            t0 = time.perf_counter()
            try:
                with self.cache.converted(state, slot.id) as (placed, sent):
                    if sent.verdict not in RESTORABLE:
                        self._refused(state, slot, sent)
                        continue
                    gain = self.cache.reuse(sent, state, common, len(tokens))
                    if gain - held < self.min_gain:
                        continue
                    return self._restore(slot, state, gain, held, len(tokens), key, placed, sent.convert,
                                         (time.perf_counter() - t0) * 1000, judged=sent)
            except ConversionFailed as e:
                c.add("conversion_failures")
                self.log("error", f"slot {slot.id}: no restore ({e}): the request goes uncached", slot=slot.id,
                         name=state.name)
                return held
        return held

    def _refused(self, state, slot: Slot, judged) -> None:
        self.cache.counters.add("restores_refused_by_verdict")
        self.log("refused", f"{state.name}: not restored into slot {slot.id}: validate says {judged.verdict}"
                            + (f" ({judged.reason})" if judged.reason else "")
                            + (" (unchanged since serve judged it: the catalog's row, not read again)"
                               if judged.catalog else ""),
                 slot=slot.id, name=state.name, verdict=judged.verdict, **({"catalog": True} if judged.catalog else {}))

    def _restore(self, slot: Slot, state, gain: int, held: int, n_request: int, key: str | None,
                 placed: str | None = None, changes: list[str] | None = None, convert_ms: float = 0.0, *,
                 judged) -> int:
        """``state`` restored into ``slot`` (``judged``: its verdict, ``restores``: sent only while the state has
        the identity it was made on); ``gain``, the prompt tokens the request is predicted to keep."""
        c = self.cache.counters
        slot.tokens = EMPTY         # whatever happens now, the slot's old tokens are gone
        t0 = time.perf_counter()
        answer = self.cache.restore(state, slot.id, key, placed, identity=None if placed else judged.identity)
        slot.tokens = state.tokens
        c.add("restores")
        c.add("restored_tokens", gain)
        how = f" converted ({'; '.join(changes)}, {convert_ms:.0f} ms)" if changes else ""
        extra = {"converted": changes, "convert_ms": round(convert_ms, 3)} if changes else {}
        if judged.catalog:
            extra["catalog"] = True     # the verdict from the catalog: the state not opened to judge it
        self.log("restored", f"{state.name}{how} restored into slot {slot.id}: {answer.get('n_restored', 0):,} "
                             f"tokens in {(time.perf_counter() - t0) * 1000:.0f} ms; the request keeps "
                             f"{gain:,} of its {n_request:,} (the slot held {held:,})",
                 slot=slot.id, name=state.name, n_restored=answer.get("n_restored"), reuse=gain, held=held, seconds=round(time.perf_counter() - t0, 6), **extra)
        return gain

    async def _save_then_release(self, slot: Slot, key: str | None, text: str | None = None,
                                 before: np.ndarray | None = None) -> None:
        """After a whole answer: the slot saved by the server (asked at once, on serve's own connection) and
        the file checked (in a worker thread), its ``/slots`` signature noted, then freed; the state is stored
        after (the slot's next request need not wait for the copy). A request sent by its ``text``
        (:meth:`by_text`; ``before``: what the slot held then) has the text's tokens asked for meanwhile:
        what the slot now holds, and the prompt tokens kept and evaluated for the metrics."""
        saved = None
        try:
            work = self.cache.work_name(slot.id)
            learnt = asyncio.ensure_future(self._learn(slot, text, before, key)) if before is not None else None
            try:
                answer = await self._post(f"/slots/{slot.id}?action=save", {"filename": work}, key,
                                          timeout=self.cache.timeout)
                saved = await asyncio.to_thread(self.cache.checked, slot.id, work, answer)
            except Exception as e:  # noqa: BLE001 - a save that fails costs the next restore, nothing more
                self.cache.discard(work)
                self.cache.counters.add("save_failures")
                self.log("error", f"slot {slot.id}: not saved: {e}", slot=slot.id)
            if learnt is None:          # the prompt's tokens known before: what the slot holds, saved
                if saved is not None:
                    slot.sent(saved.tokens, slot.text, slot.prompt)
            else:
                prompt = await learnt
                if prompt is None:
                    slot.tokens = saved.tokens if saved is not None else EMPTY
                else:
                    slot.sent(saved.tokens if saved is not None else prompt, text, prompt)
            try:
                entries = await self._get("/slots", key)
                entry = next((e for e in entries if isinstance(e, dict) and e.get("id") == slot.id), None)
                slot.sig = signature(entry) if entry is not None else UNKNOWN
                if entry is not None and isinstance(entry.get("id_task"), int):
                    self._top_task = max(self._top_task, entry["id_task"])
            except Exception:  # noqa: BLE001 - unknown: the next check finds the slot's tokens unknown
                slot.sig = UNKNOWN
        finally:
            self._release(slot)
        if saved is not None:
            try:
                await asyncio.to_thread(self.cache.store_saved, saved)
            except Exception as e:  # noqa: BLE001 - the store down: the next restore misses it
                self.cache.counters.add("save_failures")
                self.log("error", f"slot {slot.id}: not stored: {e}", slot=slot.id)


    async def _learn(self, slot: Slot, text: str, before: np.ndarray, key: str | None) -> np.ndarray | None:
        """The server's tokens of a prompt ``text`` sent by :meth:`by_text` into ``slot``, which held ``before``
        (the metrics told what the server kept of it); None when they cannot be had (the slot's text is then
        forgotten: its next request asks for its tokens first)."""
        try:
            tokens = await self.tokens_of(text, key)
        except Exception as e:  # noqa: BLE001 - costs the next request its shortcut, nothing more
            tokens = None
            self.log("error", f"slot {slot.id}: the prompt's tokens cannot be had ({e})", slot=slot.id)
        if tokens is None or len(tokens) == 0:
            self.cache.counters.add("lookup_failures")
            return None
        if self.on_prompt is not None:
            reused = min(common_prefix(before, tokens), len(tokens) - 1)
            self.on_prompt(reused, len(tokens) - reused)
        return tokens


async def run(proxy: Proxy, host: str, port: int, *, ready=None, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (SIGTERM, SIGINT). ``ready(host, port)`` once listening, then the server's
    facts are read (:meth:`Proxy.begin`)."""
    runner = web.AppRunner(proxy.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()      # the client session made at start-up closed (the address in use, ...)
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    if ready is not None:
        ready(host, bound)
    await proxy.begin()
    stop = stop or asyncio.Event()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
