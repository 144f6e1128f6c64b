"""The HTTP side of ``slotctl serve``: a reverse proxy in front of one llama-server (aiohttp, server and
client in one package: a response is passed on chunk by chunk as it comes, SSE included).

Every request is passed on as it came (method, path and query, headers but the hop-by-hop ones, body) and
its answer comes back as the server sent it (status, reason, headers, bytes: nothing decompressed or
re-encoded). A completion request (:data:`slotctl.server.requests.COMPLETION_PATHS`) whose body is a JSON
object is given a slot first (:meth:`slotctl.serve.slots.SlotView.choose`, from serve's own view of what
each slot holds: ``GET /slots`` is asked only when a connection to the server was made since it was last
asked, and once a second in the background), the stored state that pays restored into it
(:meth:`slotctl.serve.cache.Cache.prepare`), and goes with ``id_slot`` and ``cache_prompt``; after a whole
answer, the slot is saved into the store before another request may use it
(:meth:`Proxy._save_then_release`). Whatever fails in the cache, the request goes on uncached; only an
upstream that does not answer is an error (502, JSON).

Only the relay of client traffic goes through aiohttp. serve's own small requests (``GET /slots``,
``/health``, ``POST /tokenize``, ``/apply-template``, the slot's save) go through slotctl's one HTTP client
(:mod:`slotctl.live.http`: no redirect followed, answers bounded and checked, deadlines, the proxy environment,
the key never logged), in worker threads.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, TraceConfig, web
from yarl import URL

from slotctl.live import http
from slotctl.serve.cache import Cache
from slotctl.serve.index import as_tokens, common_prefix
from slotctl.serve.slots import EMPTY, UNKNOWN, Slot, SlotView
from slotctl.server.requests import COMPLETION_PATHS, TOKENIZE_FLAGS, prompt_form

#: headers of one connection only (RFC 9110 7.6.1), never passed on; Host and Content-Length are set anew
HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"))
#: serve's own answer (everything else is the server's)
STATS_PATH = "/slotctl/stats"
#: a completion request's body is read whole (to find its prompt) up to this; the rest are streamed
MAX_BODY = 256 << 20
#: seconds serve waits for its own small requests (/slots, /health, /tokenize, /apply-template)
SMALL_TIMEOUT = 30.0
#: tokens at the end of a prompt text that may be tokenized otherwise once more text follows it (the last
#: word, number or run of spaces: tokenizers split text into such pieces and merge only within one)
MARGIN = 8


class Proxy:
    """The proxy for ``cache``'s server. ``min_gain``: a stored state is restored only when it keeps at
    least this many more prompt tokens than the slot already holds."""

    def __init__(self, cache: Cache, *, min_gain: int = 16, facts_every: float = 5.0, check_every: float = 1.0,
                 log=None, on_prompt=None):
        self.cache = cache
        #: the router's model this proxy caches (None: the upstream is one model's server; a router's models each
        #: have a proxy of their own, :mod:`slotctl.serve.models`); its small requests name it
        self.model = cache.router_model
        #: the upstream is llama-server's router: every model's proxy (:class:`slotctl.serve.models.Models`)
        self.router = None
        #: ``on_prompt(reused, evaluated)`` once per request given a slot: the prompt tokens :meth:`prepare`
        #: predicts the server reuses (the restored state's, else the slot's own prefix; 0 when the restore
        #: failed) and evaluates (serve's metrics)
        self.on_prompt = on_prompt
        self.base = cache.url
        self.min_gain = min_gain
        self.facts_every = facts_every
        self.check_every = check_every
        self.log = log or cache.log
        #: serve's view of the slots (what each holds: every request goes through serve), and its choices
        self.view = SlotView(min_gain)
        #: serve's last small request made a connection of its own (the client keeps none alive: the next would too)
        self._fresh = True
        self._learning = asyncio.Lock()   # held while the server's -kvu/-ctk/-ctv are learnt (:meth:`probe_when_due`)
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
        self.view.connected()

    async def _small(self, fn, *args, **kwargs):
        """One of serve's own requests to the server (``fn``, of :mod:`slotctl.live.http` or the cache) in a
        worker thread; a connection it had to make counts as one the relay makes (:meth:`SlotView.connected`:
        it may be a restarted server's)."""
        made = http.connections_made(self.base)
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        finally:
            self._fresh = http.connections_made(self.base) != made
            if self._fresh:
                self.view.connected()

    async def begin(self) -> None:
        """Once listening: the server's facts read (until then completions pass through uncached), then
        read again every ``facts_every`` seconds."""
        await self._refresh_facts()
        self._spawn(self._facts_loop())
        self._spawn(self._check_loop())

    async def _cleanup(self, _app) -> None:
        if self.router is not None:
            await self.router.cleanup()
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
        except http.RouterMode as e:
            if self.model is not None:      # a router that did not route by the model's name
                self.log("down", f"the server's facts cannot be read ({e}): requests pass through uncached")
            elif self.router is None:       # a router: a cache per model behind it
                from slotctl.serve.models import Models

                self.router = Models(self, type(self), SMALL_TIMEOUT)
                await self.router.begin(key)
            return
        except Exception as e:  # noqa: BLE001 - the server down or not a llama-server: pass through meanwhile
            if self.cache.facts is not None or not getattr(self, "_said_down", False):
                self.log("down", f"the server's facts cannot be read ({e}): requests pass through uncached")
            self._said_down = True
            return
        self.router = None          # (a router once, one server now)
        if getattr(self, "_said_down", True):
            f = self.cache.facts
            self.log("up", f"{f.url}: {f.total_slots} slot(s) of {f.n_ctx_slot} tokens, model {f.model_path}, "
                           f"{f.build_info}", total_slots=f.total_slots, model=self.cache.model)
            self.cache.learn_due = True     # a server back may have been started with other flags
        self._said_down = False
        await self.probe_when_due(key)

    async def probe_when_due(self, key: str | None, read_facts: bool = False) -> None:
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
            if not self.view.trusted and not await self.check_slots(key):
                return
            slot = self.view.for_probe()
            if slot is None:
                return
            await slot.lock.acquire()
            try:
                await self._small(self.cache.probe, slot.id, key)
            except Exception as e:  # noqa: BLE001 - not learnt: judged with the flags given, as before
                self.log("error", f"slot {slot.id}: the server's -kvu/-ctk/-ctv cannot be learnt from a save ({e}): "
                                  f"states are judged with the flags given (llama-server's defaults for the rest)",
                         slot=slot.id)
            finally:
                self.view.release(slot)

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
        """``GET /slots`` read against serve's view (:meth:`SlotView.apply`; a restart seen makes a save to learn
        the server's flags due); False when it cannot be read (the view is then lost: every slot taken as
        holding nothing; not when a key is wanted, a client's in the background: unknown)."""
        try:
            entries = await self._small(http.get_slots, self.base, api_key=key, timeout=SMALL_TIMEOUT, model=self.model)
        except http.ServerAuthError:
            return False
        except Exception:  # noqa: BLE001 - the server down or restarting
            self.view.lose()
            return False
        if self.view.apply(entries):
            self.cache.learn_due = True     # a restarted server may run other flags
        return True

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
            if self.router is not None:
                return web.json_response({"counters": c.as_dict(), "model": None, "models": self.router.stats(),
                                          "states": sum(m["states"] for m in self.router.stats().values())})
            return web.json_response({"counters": c.as_dict(), "model": self.cache.model,
                                      "states": len(self.cache.index.states) if self.cache.index else 0})
        if self.router is not None:
            return await self.router.handle(request)
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
            if self.router is not None:      # the upstream is a router (found now)
                return await self.router.handle(request)
        if (not isinstance(body, dict) or self.cache.facts is None or body.get("cache_prompt") is False
                or not self._slot_id_ok(body.get("id_slot"))):
            c.add("passed_through")
            return (await self.forward(request, raw))[0]
        # serve's view of the slots is read again (GET /slots) only when a connection to the server was made
        # since it was last read (serve's first request, a restarted server): at the same time as the prompt's
        # tokens are asked for when that is known before; after, when asking for them took a new connection.
        # A prompt of tokens asks the server nothing: GET /health is asked instead, for its connection.
        check = None if self.view.trusted else asyncio.ensure_future(self.check_slots(key))
        text = slot = tokens = None
        try:
            prompt = await self.prompt_of(body, form, key)
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
            await self._health(key)
        if not self.view.trusted and not await self.check_slots(key):
            self.log("error", "GET /slots cannot be read: the request passes through uncached")
            c.add("passed_through")
            return (await self.forward(request, raw))[0]
        slot = self.view.choose(tokens, body.get("id_slot"))
        if slot is None:
            c.add("passed_through")
            return (await self.forward(request, raw))[0]
        return await self.send(request, body, slot, key, tokens, text)

    async def send(self, request: web.Request, body: dict, slot: Slot, key: str | None, tokens: np.ndarray | None,
                   text: str | None) -> web.StreamResponse:
        """The request sent into ``slot`` (its ``pending`` counted), the slot held until its save: prepared
        first (:meth:`Cache.prepare`) when the prompt's ``tokens`` are known; None: a prompt ``text`` that
        begins with the slot's own (:meth:`by_text`), its tokens asked for once the answer was passed on."""
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
                if self.cache.learn_due and self.view.may_restore(slot, tokens):
                    await self.probe_when_due(key, read_facts=True)  # the server's flags learnt before it is judged
                try:
                    if self.view.may_restore(slot, tokens):     # looked up, judged and restored in a worker thread
                        reused = await asyncio.to_thread(self.cache.prepare, slot, tokens, self.min_gain, key)
                    else:
                        reused = self.view.held(slot, tokens)   # nothing to look up
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
                slot.forget()     # a broken answer: what the slot holds is not known
            return resp
        finally:
            if not handed:
                self.view.release(slot)

    async def _health(self, key: str | None) -> None:
        """``GET /health``, for its connection (:meth:`_small`): one kept alive shows the server is the one the
        view describes. Loading or down, or when serve's last small request had to make a connection of its
        own (then this one would too, and tell nothing: ``GET /slots`` is read instead), the view is read
        again first."""
        if self._fresh or self.model is not None:    # a router's GET /health is its own: the model's is not asked
            self.view.distrust()
            return
        try:
            await self._small(http.get_health, self.base, api_key=key, timeout=SMALL_TIMEOUT)
        except Exception:  # noqa: BLE001 - loading or down: GET /slots says which
            self.view.distrust()

    async def _same_server(self, form: str, key: str | None) -> bool:
        """Whether serve's view of the slots still holds once a request has gone to the server (a chat's
        ``/apply-template`` went; else ``GET /health``). One that had to make a connection may have reached a
        restarted server (or the server closed an idle one: cpp-httplib does after a few seconds): the slots
        are read again first (``GET /slots``, :meth:`SlotView.apply`: a restart, or a slot changed by another
        client, takes the slots' text away)."""
        if form != "chat":
            await self._health(key)
        if not self.view.trusted:
            await self.check_slots(key)
        return self.view.trusted

    async def by_text(self, text: str, want, form: str, key: str | None) -> Slot | None:
        """The slot for a prompt ``text`` without asking the server for its tokens (its ``pending`` counted):
        the idle slot whose own prompt text (:attr:`Slot.text`) ``text`` begins with, the longest such
        (``want``'s alone when given: :meth:`SlotView.by_text`), when no stored state could keep ``min_gain``
        tokens more of the request than the slot holds (:meth:`Cache.may_beat`: such a state would begin with
        the slot's prompt tokens but their last :data:`MARGIN`, the tokens that more text may change). That is
        the choice :meth:`SlotView.choose` and :meth:`Cache.prepare` make from the prompt's tokens: the slot
        shares the most of it, and nothing is restored. None: the tokens are needed."""
        if self.view.by_text(text, want) is None or not await self._same_server(form, key):
            return None
        if not self.cache.index_fresh():
            try:        # other serve processes' states, listed as prepare lists them
                await asyncio.to_thread(self.cache.sync_index)
            except Exception:  # noqa: BLE001 - the store down: prepare says so, and goes uncached
                return None
        s = self.view.by_text(text, want)       # again: other requests ran meanwhile
        if s is None or not self.view.trusted or self.cache.may_beat(s.prompt, s.tokens, self.min_gain, MARGIN):
            return None
        s.pending += 1
        return s

    @staticmethod
    def _slot_id_ok(v) -> bool:
        return v is None or (isinstance(v, int) and not isinstance(v, bool))

    def _auth(self, request: web.Request) -> str | None:
        """The key for serve's own requests: ``--api-key``, else the client's bearer token (never kept)."""
        if self.cache.api_key:
            return self.cache.api_key
        h = request.headers.get("Authorization", "")
        return h[7:].strip() if h[:7].lower() == "bearer " else None

    async def prompt_of(self, body: dict, form: str, key: str | None):
        """The request's prompt as the server reads it: its ``prompt``, or a chat's ``messages`` through the
        server's ``/apply-template``; None for a chat serve does not cache (no messages, media)."""
        if form == "chat":
            if not isinstance(body.get("messages"), list) or self.cache.facts.mmproj:
                return None
            answer = await self._small(http.request, self.base, "POST", "/apply-template", body, api_key=key,
                                       timeout=SMALL_TIMEOUT, model=self.model)
            return answer.get("prompt") if isinstance(answer, dict) else None
        return body.get("prompt")

    async def tokens_of(self, prompt, key: str | None) -> np.ndarray | None:
        """A prompt (:meth:`prompt_of`) as the server tokenizes it: its own token ids, or the server's
        ``/tokenize`` of its text; None when it is no one prompt serve can tokenize (several prompts)."""
        how = prompt_form(prompt)
        if how == "tokens":
            return as_tokens(prompt)
        if how != "text":
            return None
        answer = await self._small(http.request, self.base, "POST", "/tokenize", {"content": prompt, **TOKENIZE_FLAGS},
                                   api_key=key, timeout=SMALL_TIMEOUT, model=self.model)
        toks = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise http.ServerAnswerError(f"POST {self.base}/tokenize: no token list in the answer")
        return as_tokens(toks)

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
            learnt = asyncio.ensure_future(self._tokens_sent(slot, text, before, key)) if before is not None else None
            try:
                answer = await self._small(self.cache.save, slot.id, work, key)
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
                entries = await self._small(http.get_slots, self.base, api_key=key, timeout=SMALL_TIMEOUT,
                                            model=self.model)
                self.view.noted(slot, next((e for e in entries if e.get("id") == slot.id), None))
                if self.view.apply(entries):    # the other slots as the server shows them now: the view read
                    self.cache.learn_due = True
            except Exception:  # noqa: BLE001 - unknown: the next check finds the slot's tokens unknown
                slot.sig = UNKNOWN
        finally:
            self.view.release(slot)
        if saved is not None:
            try:
                await asyncio.to_thread(self.cache.store_saved, saved)
            except Exception as e:  # noqa: BLE001 - the store down: the next restore misses it
                self.cache.counters.add("save_failures")
                self.log("error", f"slot {slot.id}: not stored: {e}", slot=slot.id)


    async def _tokens_sent(self, slot: Slot, text: str, before: np.ndarray, key: str | None) -> np.ndarray | None:
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
