"""The proxy of ``slotctl serve`` in front of one llama-server (or llama-server's router): its life and its
dispatch. This module changes when what serve keeps of its server, or where a request goes, changes.

Its life (:class:`Proxy`, :func:`run`): the aiohttp application, listening through serve's front
(:mod:`slotctl.serve.front`); the server's facts read at start and every few seconds, its ``-kvu``/``-ctk``/``-ctv``
learnt from a save when due, serve's view of the slots kept true (``GET /slots`` when a connection to the server
was made since it was last read, and once a second in the background; ``GET /health`` for a kept connection);
serve's own small requests (``GET /slots``, ``/health``, ``POST /tokenize``, ``/apply-template``, the slot's save)
through slotctl's one HTTP client (:mod:`slotctl.live.http`: no redirect followed, answers bounded and checked,
deadlines, the proxy environment, the key never logged), in worker threads, on connections kept open (one
:class:`slotctl.live.http.Pool`); its tasks, the saves in progress finished at exit.

Its dispatch (:meth:`Proxy.handle`): serve's own ``GET /slotctl/stats``; every other request passed on as it came
(:class:`slotctl.serve.relay.Relay`), but a completion request (:data:`slotctl.server.requests.COMPLETION_PATHS`)
of a client the server accepts, whose body is a JSON object serve may cache: that goes the cached path
(:class:`slotctl.serve.completion.Completions`), or to its model's proxy behind a router
(:class:`slotctl.serve.models.Models`). Only an upstream that does not answer is an error (502, JSON, in serve's
own words).
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from slotctl.live import http
from slotctl.serve import auth, target
from slotctl.serve.body import Bodies, Stalled, Unread, cacheable, parse
from slotctl.serve.cache import Cache
from slotctl.serve.completion import Completions
from slotctl.serve.front import FailureLog, Front, Limits, listening_socket, server_settings
from slotctl.serve.relay import Relay, unavailable
from slotctl.serve.slots import SlotView
from slotctl.server.requests import COMPLETION_PATHS

#: serve's own answer (everything else is the server's)
STATS_PATH = "/slotctl/stats"
#: seconds serve waits for its own small requests (/slots, /health, /tokenize, /apply-template)
SMALL_TIMEOUT = 30.0


class Proxy:
    """The proxy for ``cache``'s server. ``min_gain``: a stored state is restored only when it keeps at
    least this many more prompt tokens than the slot already holds. ``metrics``: serve's metrics
    (:class:`slotctl.unattended.metrics.ServeMetrics`, or None), told what each request did."""

    def __init__(self, cache: Cache, *, min_gain: int = 16, facts_every: float = 5.0, check_every: float = 1.0,
                 log=None, metrics=None, limits: Limits | None = None, failures: FailureLog | None = None):
        self.cache = cache
        self.metrics = metrics
        #: the router's model this proxy caches (None: the upstream is one model's server; a router's models each
        #: have a proxy of their own, :mod:`slotctl.serve.models`); its small requests name it
        self.model = cache.router_model
        #: the upstream is llama-server's router: every model's proxy (:class:`slotctl.serve.models.Models`)
        self.router = None
        self.base = cache.url
        self.min_gain = min_gain
        self.facts_every = facts_every
        self.check_every = check_every
        self.log = log or cache.log
        #: serve's limits on its clients; the front (set by :func:`run`) counts their connections;
        #: one line per kind of failure of the front
        self.limits = limits or Limits()
        self.front: Front | None = None
        self.failures = failures or FailureLog(self.log)
        #: completion bodies read within --max-body (docs/serve.md, "Limits")
        self.bodies = Bodies(self.limits.max_body, self.limits.idle_timeout)
        #: the keys the server accepts, as it answered (serve's own --api-key, and its clients')
        self.keys = auth.Keys(cache.api_key)
        #: serve's view of the slots (what each holds: every request goes through serve), and its choices
        self.view = SlotView(min_gain)
        #: serve's own small requests' connections, kept open (shared by its worker threads)
        self.pool = http.Pool()
        cache.pool = self.pool
        #: whether serve last said the server down (None: it said neither up nor down yet)
        self.said_down: bool | None = None
        self._learning = asyncio.Lock()   # held while the server's -kvu/-ctk/-ctv are learnt (:meth:`probe_when_due`)
        #: client traffic to the server and back
        self.relay = Relay(self.base, cache.counters, self.log)
        #: the cached path of its completion requests
        self.completions = Completions(self)
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    # -- its life --------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app) -> None:
        self.relay.open(self._connected)

    def _connected(self) -> None:
        self.view.connected()

    async def small(self, fn, *args, **kwargs):
        """One of serve's own requests to the server (``fn``, of :mod:`slotctl.live.http` or the cache) in a
        worker thread, on a connection of the pool; a connection it had to make counts as one the relay makes
        (:meth:`SlotView.connected`: it may be a restarted server's)."""
        made = self.pool.made
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        finally:
            if self.pool.made != made:
                self.view.connected()

    async def post(self, path: str, body: dict, key: str | None):
        """One of serve's own POSTs to the server (``/tokenize``, ``/apply-template``: :meth:`small`), its answer."""
        return await self.small(http.request, self.base, "POST", path, body, api_key=key, timeout=SMALL_TIMEOUT,
                                pool=self.pool, model=self.model)

    async def get_slots(self, key: str | None) -> list[dict]:
        """The server's ``GET /slots`` (:meth:`small`)."""
        return await self.small(http.get_slots, self.base, api_key=key, timeout=SMALL_TIMEOUT, pool=self.pool,
                                model=self.model)

    async def begin(self) -> None:
        """Once listening: the server's facts read (until then completions pass through uncached), then
        read again every ``facts_every`` seconds."""
        await self.refresh_facts()
        self.spawn(self._facts_loop())
        self.spawn(self._check_loop())

    async def _cleanup(self, _app) -> None:
        if self.router is not None:
            await self.router.cleanup()
        self._stop.set()
        for t in list(self._tasks):     # saves in progress finish: a state half stored is never left
            if not t.get_name().startswith("save"):
                t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.relay.close()
        self.pool.close()
        self.completions.close()

    def spawn(self, coro, name: str = "task") -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def refresh_facts(self, key: str | None = None) -> None:
        key = key if key is not None else self.keys.last
        try:
            await self.small(self.cache.refresh_facts, key)
        except http.RouterMode as e:
            if self.model is not None:      # a router that did not route by the model's name
                self.log("down", f"the server's facts cannot be read ({e}): requests pass through uncached")
            elif self.router is None:       # a router: a cache per model behind it
                from slotctl.serve.models import Models

                self.router = Models(self, type(self), SMALL_TIMEOUT)
                await self.router.begin(key)
            return
        except Exception as e:  # noqa: BLE001 - the server down or not a llama-server: pass through meanwhile
            if isinstance(e, http.ServerAuthError) and key is not None:
                self.keys.said(key, False)
            if self.cache.facts is not None or not self.said_down:
                self.log("down", f"the server's facts cannot be read ({e}): requests pass through uncached"
                         + ("; its first client whose key it accepts gives serve the key"
                            if isinstance(e, http.ServerAuthError) and self.keys.last is None else ""))
            self.said_down = True
            return
        self.router = None          # (a router once, one server now)
        if self.said_down is not False:
            self.keys.forget()      # a server back may accept other keys: each asked again
            f = self.cache.facts
            self.log("up", f"{f.url}: {f.total_slots} slot(s) of {f.n_ctx_slot} tokens, model {f.model_path}, "
                           f"{f.build_info}", total_slots=f.total_slots, model=self.cache.model)
            self.cache.learn_due = True     # a server back may have been started with other flags
            self.cache.server_restarted()   # ... or another model file: identified anew at the next facts
        if key is not None:
            self.keys.said(key, True)
        self.said_down = False
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
                    await self.small(self.cache.refresh_facts, key)
                except Exception:  # noqa: BLE001 - down again: the facts loop says so; learnt when it is back
                    return
            if not self.view.trusted and not await self.check_slots(key):
                return
            slot = self.view.for_probe()
            if slot is None:
                return
            try:
                await self.small(self.cache.probe, slot.id, key)
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
                await self.refresh_facts()

    async def _check_loop(self) -> None:
        """Every ``check_every`` seconds, off the request path: the slots read again (a change serve did not
        make: another client, a restart, fewer slots)."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.check_every)
            except asyncio.TimeoutError:
                pass
            if not self._stop.is_set() and self.cache.facts is not None:
                await self.check_slots(self.keys.last)

    async def check_slots(self, key: str | None) -> bool:
        """``GET /slots`` read against serve's view (:meth:`SlotView.apply`; a restart seen makes a save to learn
        the server's flags due); False when it cannot be read (the view is then lost: every slot taken as
        holding nothing; not when a key is wanted, a client's in the background: unknown)."""
        try:
            entries = await self.get_slots(key)
        except http.ServerAuthError:
            return False
        except Exception:  # noqa: BLE001 - the server down or restarting
            self.view.lose()
            return False
        if self.view.apply(entries):
            self.cache.learn_due = True     # a restarted server may run other flags
            self.cache.server_restarted()   # and another model file: identified anew at the next facts
            self.keys.forget()              # and accept other keys: each asked again
        return True

    async def health(self, key: str | None) -> None:
        """``GET /health``, for its connection (:meth:`small`): one kept alive shows the server is the one the
        view describes. Loading or down, or when it had to make a connection (a kept one was not there: the
        server may have restarted), the view is read again first."""
        if self.model is not None:      # a router's GET /health is its own: the model's is not asked
            self.view.distrust()
            return
        try:
            await self.small(http.get_health, self.base, api_key=key, timeout=SMALL_TIMEOUT, pool=self.pool)
        except Exception:  # noqa: BLE001 - loading or down: GET /slots says which
            self.view.distrust()

    async def same_server(self, form: str, key: str | None) -> bool:
        """Whether serve's view of the slots still holds once a request has gone to the server (a chat's
        ``/apply-template`` went; else ``GET /health``). One that had to make a connection may have reached a
        restarted server (or the server closed an idle one: cpp-httplib does after 5 s): the slots are read
        again first (``GET /slots``, :meth:`SlotView.apply`: a restart, or a slot changed by another client,
        takes the slots' text away)."""
        if form != "chat":
            await self.health(key)
        if not self.view.trusted:
            await self.check_slots(key)
        return self.view.trusted

    # -- every request ---------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if self.front is not None:
            self.front.begin(transport)     # not idle while it runs: never closed to make room
        try:
            return await self._handle(request)
        except (asyncio.CancelledError, web.HTTPException):
            raise
        except target.Leaves as e:
            self.cache.counters.add("passed_through")
            return web.json_response({"error": {"code": 400, "type": "invalid_request_error",
                                                "message": f"slotctl serve: {e}: not sent"}}, status=400)
        except Stalled as e:
            self.failures.note("body_stalled", f"{request.method} {request.path}: {e}: the connection is closed")
            if request.transport is not None:
                request.transport.close()
            raise web.HTTPRequestTimeout(text=json.dumps({"error": {"code": 408, "type": "timeout_error",
                                                                    "message": f"slotctl serve: {e}"}}),
                                         content_type="application/json") from None
        except Exception as e:  # noqa: BLE001 - a bug of serve's: one line, never a traceback
            self.log("error", f"{request.method} {request.path}: {type(e).__name__}: {e}")
            return unavailable(f"the request could not be handled ({type(e).__name__}; serve's log says more)")
        finally:
            if self.front is not None:
                self.front.end(transport)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        c = self.cache.counters
        c.add("requests")
        if request.method == "GET" and request.path == STATS_PATH:
            if self.router is not None:
                return web.json_response({"counters": c.as_dict(), "model": None, "models": self.router.stats(),
                                          "states": sum(m["states"] for m in self.router.stats().values())})
            return web.json_response({"counters": c.as_dict(), "model": self.cache.model,
                                      "states": len(self.cache.index.states) if self.cache.index else 0,
                                      "costs": self.cache.costs.known(), "cache": self.cache.unusable() or "on",
                                      "slots": self.view.ids()})
        relay = self.relay
        sent, route = relay.target(request)
        form = COMPLETION_PATHS.get(route) if request.method == "POST" else None
        if form is None:
            c.add("passed_through")
            return (await relay.forward(request, request.content if request.body_exists else None,
                                        relay.headers(request, stream=True))).response
        # nothing happens for a client the server would refuse: its request goes on untouched, unread
        accepted = await self.accepted(auth.client_key(request.headers))
        if not accepted:
            c.add("passed_through")
            self.outcome("passed_through")
            if accepted is False:
                c.add("unauthorized")
            return (await relay.forward(request, request.content, relay.headers(request, stream=True))).response
        raw, held = await self.bodies.read(request)
        try:
            if isinstance(raw, Unread):     # over --max-body: streamed to the server as it comes, uncached
                c.add("passed_through")
                self.outcome("passed_through")
                c.add("unread_bodies")
                return (await relay.forward(request, raw.data, relay.headers(request, length=raw.length))).response
            request["slotctl.body"] = raw
            return await self.completion(request, raw, form)
        finally:
            self.bodies.give_back(held)

    async def accepted(self, key: str) -> bool | None:
        """Whether the server accepts the client's ``key`` (:func:`slotctl.serve.auth.client_key`): serve's own
        ``--api-key`` as given, else as the server last said within a minute, else asked (``GET /props`` with it:
        no task queue, no sleeping server woken; a router's own ``/props``). None when the server does not say
        (down, loading)."""
        said = self.keys.known(key)
        if said is not None:
            return said
        ask = http.router_props if self.router is not None else http.get_props
        try:
            await asyncio.to_thread(ask, self.base, api_key=key, timeout=SMALL_TIMEOUT)
        except http.RouterMode:
            pass        # a router (found now) answered its /props with the key: accepted
        except http.ServerAuthError:
            self.keys.said(key, False)
            return False
        except Exception:  # noqa: BLE001 - down or loading: not known, the request goes on untouched
            return None
        self.keys.said(key, True)
        return True

    async def completion(self, request: web.Request, raw: bytes, form: str) -> web.StreamResponse:
        began = time.monotonic()
        body = await parse(raw)     # off the event loop; None: not a JSON object serve reads (the server's to answer)
        if self.router is not None:     # the upstream is a router: the proxy of the model the body names
            return await self.router.completion(request, raw, body, form)
        key = self.auth_key(request)
        if body is not None and self.cache.facts is None:
            await self.refresh_facts(key)   # not read yet (serve just started, the server was down, a key needed)
            if self.router is not None:      # the upstream is a router (found now)
                return await self.router.completion(request, raw, body, form)
        if body is None or self.cache.facts is None or not cacheable(body):
            return await self.through(request, raw)
        return await self.completions.handle(request, raw, body, form, key, began)

    async def through(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        self.cache.counters.add("passed_through")
        self.outcome("passed_through")
        return (await self.relay.forward(request, raw)).response

    def outcome(self, outcome: str) -> None:
        if outcome != "passed_through":
            self.cache.counters.add(outcome)
        if self.metrics is not None:
            self.metrics.outcome(outcome)

    def auth_key(self, request: web.Request) -> str:
        """The key for serve's own requests of a client's request (the server accepts it: :meth:`accepted`):
        ``--api-key``, else the client's own (as the server reads it; never logged)."""
        return self.cache.api_key or auth.client_key(request.headers)


async def run(proxy: Proxy, host: str, port: int, *, ready=None, stop: asyncio.Event | None = None,
              max_connections: int | None = None) -> None:
    """Serve until ``stop`` is set (SIGTERM, SIGINT): the clients' connections accepted by serve's front
    (:class:`slotctl.serve.front.Front`, at most ``max_connections`` at once: default the limits'), what asyncio
    and aiohttp would log themselves said once per kind (:class:`~slotctl.serve.front.FailureLog`).
    ``ready(host, port)`` once listening, then the server's facts are read (:meth:`Proxy.begin`)."""
    loop = asyncio.get_running_loop()
    failures = proxy.failures
    loop.set_exception_handler(failures.loop_exception)
    undo = failures.catch_logs()
    runner = web.AppRunner(proxy.app(), access_log=None, handle_signals=False,
                           **server_settings(proxy.limits.idle_timeout))
    await runner.setup()
    try:
        sock = listening_socket(host, port)
    except BaseException:
        await runner.cleanup()      # the client session made at start-up closed (the address in use, ...)
        undo()
        raise
    proxy.front = Front(sock, runner.server, failures=failures,
                        limit=max_connections if max_connections is not None else proxy.limits.max_connections,
                        idle_timeout=proxy.limits.idle_timeout)
    accepting = loop.create_task(proxy.front.serve(), name="accept")
    reaping = loop.create_task(proxy.front.reap(), name="idle")
    counting = loop.create_task(_say_counts(failures), name="failures")
    if ready is not None:
        ready(host, sock.getsockname()[1])
    stop = stop or asyncio.Event()
    try:
        await proxy.begin()
        await stop.wait()
    finally:
        accepting.cancel()
        reaping.cancel()
        counting.cancel()
        sock.close()
        await runner.cleanup()
        failures.say_counts()
        undo()


async def _say_counts(failures: FailureLog) -> None:
    while True:
        await asyncio.sleep(failures.every)
        failures.say_counts()
