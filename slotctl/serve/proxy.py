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
(:meth:`Proxy._save_then_release`). A request waits for the first slot that frees, as the server's own
deferred tasks do (:meth:`slotctl.serve.slots.SlotView.take`). Whatever fails in the cache, the request goes
on uncached, and a store that does not answer within the request's time (the prefill a restore would
spare: the server's time, never the store's) is left to itself and not asked again until it answers; only
an upstream that does not answer is an error (502, JSON, in serve's own words).

Only the relay of client traffic goes through aiohttp. serve's own small requests (``GET /slots``,
``/health``, ``POST /tokenize``, ``/apply-template``, the slot's save) go through slotctl's one HTTP client
(:mod:`slotctl.live.http`: no redirect followed, answers bounded and checked, deadlines, the proxy environment,
the key never logged), in worker threads, on connections kept open (one :class:`slotctl.live.http.Pool`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import numpy as np
from aiohttp import web

from slotctl.live import http
from slotctl.serve import auth, target
from slotctl.serve.body import Bodies, Stalled, Unread, cacheable, parse, with_slot
from slotctl.serve.cache import Cache, Gate, Prepared, StoreOff
from slotctl.serve.front import FailureLog, Front, Limits, listening_socket, server_settings
from slotctl.serve.index import as_tokens, common_prefix
from slotctl.serve.relay import Relay, Relayed, unavailable
from slotctl.serve.slots import EMPTY, REQUEST, SAVE, UNKNOWN, Slot, SlotView
from slotctl.server.requests import COMPLETION_PATHS, TOKENIZE_FLAGS, prompt_form

#: serve's own answer (everything else is the server's)
STATS_PATH = "/slotctl/stats"
#: seconds serve waits for its own small requests (/slots, /health, /tokenize, /apply-template)
SMALL_TIMEOUT = 30.0
#: tokens at the end of a prompt text that may be tokenized otherwise once more text follows it (the last
#: word, number or run of spaces: tokenizers split text into such pieces and merge only within one)
MARGIN = 8
#: seconds a request waits for the store's side of a restore (its lookup, verdict, download) from an ``s3://``
#: store at least: the prefill the restore would spare when longer (the server's time). A first verdict on a
#: state reads the model's GGUF (a few hundred ms with a small model, more on a loaded machine), which this
#: leaves room for; a store that stalls costs one request this much, and the next ones nothing (the store is
#: not asked again until it answers). A directory store is the machine's own disk: waited for
STORE_WAIT = 2.0
#: the same before the server's prefill speed is measured (serve's first requests): a request to the store that
#: takes longer than :data:`slotctl.serve.cache.STORE_STALL` makes it count as down whatever this is
STORE_WAIT_UNMEASURED = 10.0
#: seconds a returning turn sent by its text waits for the store's listing (else its tokens are asked for)
LISTING_WAIT = 0.25
#: worker threads for the store's side of requests (apart from serve's small requests, so that a store that
#: stalls never holds them up)
STORE_THREADS = 4


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
        #: serve's last small request made a connection of its own (a kept one was not there: the next
        #: small request may find the server restarted)
        self._fresh = True
        self._learning = asyncio.Lock()   # held while the server's -kvu/-ctk/-ctv are learnt (:meth:`probe_when_due`)
        #: client traffic to the server and back
        self.relay = Relay(self.base, cache.counters, self.log)
        self._store_threads = concurrent.futures.ThreadPoolExecutor(STORE_THREADS, "slotctl-serve-store")
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    # -- the application -------------------------------------------------------------------------------

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

    async def _small(self, fn, *args, **kwargs):
        """One of serve's own requests to the server (``fn``, of :mod:`slotctl.live.http` or the cache) in a
        worker thread, on a connection of the pool; a connection it had to make counts as one the relay makes
        (:meth:`SlotView.connected`: it may be a restarted server's)."""
        made = self.pool.made
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        finally:
            self._fresh = self.pool.made != made
            if self._fresh:
                self.view.connected()

    async def _on_store(self, fn, *args):
        """``fn(*args)``, work on the store's side (a lookup, a restore, a save stored), in a worker thread of its
        own pool: a store that stalls holds those threads, never the ones of serve's small requests."""
        return await asyncio.get_running_loop().run_in_executor(self._store_threads, fn, *args)

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
        await self.relay.close()
        self.pool.close()
        self._store_threads.shutdown(wait=False)

    def _spawn(self, coro, name: str = "task") -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _refresh_facts(self, key: str | None = None) -> None:
        key = key if key is not None else self.keys.last
        try:
            await self._small(self.cache.refresh_facts, key)
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
            if self.cache.facts is not None or not getattr(self, "_said_down", False):
                self.log("down", f"the server's facts cannot be read ({e}): requests pass through uncached"
                         + ("; its first client whose key it accepts gives serve the key"
                            if isinstance(e, http.ServerAuthError) and self.keys.last is None else ""))
            self._said_down = True
            return
        self.router = None          # (a router once, one server now)
        if getattr(self, "_said_down", True):
            self.keys.forget()      # a server back may accept other keys: each asked again
            f = self.cache.facts
            self.log("up", f"{f.url}: {f.total_slots} slot(s) of {f.n_ctx_slot} tokens, model {f.model_path}, "
                           f"{f.build_info}", total_slots=f.total_slots, model=self.cache.model)
            self.cache.learn_due = True     # a server back may have been started with other flags
            self.cache.server_restarted()   # ... or another model file: identified anew at the next facts
        if key is not None:
            self.keys.said(key, True)
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
                    await self._small(self.cache.refresh_facts, key)
                except Exception:  # noqa: BLE001 - down again: the facts loop says so; learnt when it is back
                    return
            if not self.view.trusted and not await self.check_slots(key):
                return
            slot = self.view.for_probe()
            if slot is None:
                return
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
            entries = await self._small(http.get_slots, self.base, api_key=key, timeout=SMALL_TIMEOUT, pool=self.pool,
                                        model=self.model)
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
            self._outcome("passed_through")
            if accepted is False:
                c.add("unauthorized")
            return (await relay.forward(request, request.content, relay.headers(request, stream=True))).response
        raw, held = await self.bodies.read(request)
        try:
            if isinstance(raw, Unread):     # over --max-body: streamed to the server as it comes, uncached
                c.add("passed_through")
                self._outcome("passed_through")
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

    # -- completions -----------------------------------------------------------------------------------

    async def completion(self, request: web.Request, raw: bytes, form: str) -> web.StreamResponse:
        began = time.monotonic()
        c = self.cache.counters
        body = await parse(raw)     # off the event loop; None: not a JSON object serve reads (the server's to answer)
        if self.router is not None:     # the upstream is a router: the proxy of the model the body names
            return await self.router.completion(request, raw, body, form)
        key = self._auth(request)
        if body is not None and self.cache.facts is None:
            await self._refresh_facts(key)   # not read yet (serve just started, the server was down, a key needed)
            if self.router is not None:      # the upstream is a router (found now)
                return await self.router.completion(request, raw, body, form)
        if body is None or self.cache.facts is None or not cacheable(body):
            return await self._through(request, raw)
        # serve's view of the slots is read again (GET /slots) only when a connection to the server was made
        # since it was last read (serve's first request, a restarted server): at the same time as the prompt's
        # tokens are asked for when that is known before; after, when asking for them took a new connection.
        # A prompt of tokens asks the server nothing: GET /health is asked instead, for its connection.
        check = None if self.view.trusted else asyncio.ensure_future(self.check_slots(key))
        text = slot = tokens = None
        waited = 0.0
        try:
            prompt = await self.prompt_of(body, form, key)
            text = prompt if isinstance(prompt, str) else None
            if text is not None and (check is None or await check):
                slot, waited = await self.by_text(text, body.get("id_slot"), form, key)   # no /tokenize first
            if slot is None:
                tokens = await self.tokens_of(prompt, key)
        except Exception as e:  # noqa: BLE001 - the cache never fails a request
            c.add("lookup_failures")
            self.log("error", f"{request.path}: the prompt's tokens cannot be had ({e}): passed through uncached")
        if slot is not None:
            return await self.send(request, body, slot, key, None, text, began, waited)
        if check is not None:
            await check
        if tokens is None or len(tokens) == 0:
            return await self._through(request, raw)
        if check is None and form != "chat" and prompt_form(body.get("prompt")) == "tokens":
            await self._health(key)
        if not self.view.trusted and not await self.check_slots(key):
            self.log("error", "GET /slots cannot be read: the request passes through uncached")
            return await self._through(request, raw)
        t0 = time.monotonic()
        slot = await self.view.take(tokens, body.get("id_slot"))    # the first slot that frees, as the server's
        waited = time.monotonic() - t0
        if slot is None:
            return await self._through(request, raw)
        return await self.send(request, body, slot, key, tokens, text, began, waited)

    async def _through(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        self.cache.counters.add("passed_through")
        self._outcome("passed_through")
        return (await self.relay.forward(request, raw)).response

    def _outcome(self, outcome: str) -> None:
        if outcome != "passed_through":
            self.cache.counters.add(outcome)
        if self.metrics is not None:
            self.metrics.outcome(outcome)

    async def send(self, request: web.Request, body: dict, slot: Slot, key: str | None, tokens: np.ndarray | None,
                   text: str | None, began: float, waited: float) -> web.StreamResponse:
        """The request sent into ``slot`` (held for it), the slot held until its save: prepared first
        (:meth:`_prepare`) when the prompt's ``tokens`` are known; None: a prompt ``text`` that begins with the
        slot's own (:meth:`by_text`), its tokens asked for once the answer was passed on. ``began``: when
        serve had the request; ``waited``: the seconds it waited for its slot (the server alone would have
        too), the rest of what passed until it goes is what serve added."""
        c = self.cache.counters
        c.add("cached")
        handed = False
        try:
            before, prompt_before = slot.tokens, slot.prompt
            if tokens is not None:
                prepared = await self._prepare(slot, tokens, key)
                if self.metrics is not None:
                    self.metrics.prompt(prepared.reused, len(tokens) - prepared.reused)
            else:
                c.add("matched_by_text")
                prepared = Prepared(0, "slot_hit")
            self._outcome(prepared.outcome)
            data = with_slot(request["slotctl.body"], body, slot.id)
            if self.metrics is not None:
                self.metrics.added_time_to_first_token(max(0.0, time.monotonic() - began - waited))
            relayed = await self.relay.forward(request, data, self.relay.headers(request))
            slot.used = time.monotonic()
            self._measured(relayed, prepared, slot)
            if relayed.completed:
                # the save is asked once the answer was passed on, not while its last bytes are on their way
                # (the save's worker thread then held them back by a few milliseconds, measured)
                slot.sig = UNKNOWN
                if tokens is not None:
                    slot.sent(tokens, text, tokens)
                    learnt = None
                else:       # its own text kept (its next turn finds the slot), its tokens asked for meanwhile
                    slot.sent(before, text, prompt_before)
                    learnt = asyncio.ensure_future(self._tokens_sent(slot, text, before, key))
                self.view.hold(slot, SAVE)
                self._spawn(self._save_then_release(slot, key, learnt), name=f"save-{slot.id}")
                handed = True
            else:
                slot.forget()     # a broken answer: what the slot holds is not known
            return relayed.response
        finally:
            if not handed:
                self.view.release(slot)

    async def _prepare(self, slot: Slot, tokens: np.ndarray, key: str | None) -> Prepared:
        """The restore for a request (:meth:`Cache.prepare`) when one could pay and the store can be used: its
        store side (an ``s3://`` store's) waited for no longer than the prefill the restore would spare (the
        server's time: at least :data:`STORE_WAIT`), then the request goes uncached and the store is left alone
        until that work ends (:meth:`Cache.stall_begins`)."""
        c = self.cache.counters
        held = self.view.held(slot, tokens)
        own = Prepared(held, "slot_hit" if held >= self.min_gain else "cold")
        if not self.view.may_restore(slot, tokens):
            return own
        if self.cache.learn_due:
            await self.probe_when_due(key, read_facts=True)  # the server's flags learnt before it is judged
        off = self.cache.unusable()
        self.cache.said_off()
        if off is not None:
            return own if own.outcome == "slot_hit" else Prepared(held, "uncached")
        spare = self.cache.costs.prefill_ms(len(tokens) - held)
        wait = STORE_WAIT_UNMEASURED if spare is None else max(STORE_WAIT, spare / 1000.0)
        if not self.cache.by_cost:
            wait = STORE_WAIT_UNMEASURED    # --restore-policy tokens: restored whatever the prefill costs
        if not self.cache.where_s3():
            wait = None     # the machine's own disk
        gate = Gate()
        work = asyncio.ensure_future(self._on_store(self.cache.prepare, slot, tokens, self.min_gain, key, gate))
        try:
            done, _ = await asyncio.wait({work}, timeout=wait)
            if not done and gate.give_up():
                self._stalled(work, wait)
                return Prepared(held, "uncached")
            return await work       # done, or the restore sent to the server: the server's time now
        except Exception as e:  # noqa: BLE001 - a restore that fails: the request goes uncached
            c.add("restore_failures")
            slot.tokens = EMPTY
            self.log("error", f"slot {slot.id}: no restore ({e}): the request goes uncached", slot=slot.id)
            return Prepared(0, "uncached")

    def _stalled(self, work: asyncio.Future, wait: float) -> None:
        """A request stopped waiting for the store's side of its restore after ``wait`` seconds: the store is not
        used until that work ends (said once, a ``cache`` event)."""
        self.cache.counters.add("lookup_failures")
        self.cache.stall_begins()
        self.log("error", f"the store did not answer within {wait * 1000:.0f} ms (the prefill a restore would spare, "
                          f"at least {STORE_WAIT:g} s): the request goes uncached", code="store_stalled")
        self.cache.said_off()

        def ended(_f) -> None:
            self.cache.stall_ends()
            if not _f.cancelled():
                _f.exception()      # retrieved: said already
            self.cache.said_off()

        work.add_done_callback(ended)

    def _measured(self, relayed: Relayed, prepared: Prepared, slot: Slot) -> None:
        """The server's timings of an answer taken (its prefill speed), and a restore-or-prefill choice's
        outcome said (an ``outcome`` event: what was predicted, what the server's timings and the restore
        measured)."""
        timings = relayed.timings
        self.cache.costs.prefilled(timings)
        pred = prepared.prediction
        if pred is None or not timings or not isinstance(timings.get("prompt_ms"), (int, float)):
            return
        restore_ms = (prepared.seconds or 0.0) * 1000.0
        measured = timings["prompt_ms"] + restore_ms
        chose = "restore" if prepared.outcome == "restored" else "prefill"
        predicted = pred.restore_ms if chose == "restore" else pred.prefill_ms
        self.log("outcome", f"slot {slot.id}: {'restored' if chose == 'restore' else 'prefill'}: predicted "
                            f"{predicted:.0f} ms, measured {measured:.0f} ms (the server's prompt "
                            f"{timings['prompt_ms']:.0f} ms for {timings.get('prompt_n', 0):.0f} tokens"
                            + (f", the restore {restore_ms:.0f} ms" if prepared.outcome == "restored" else "") + ")",
                 slot=slot.id, chose=chose, predicted_ms=round(predicted, 3),
                 measured_ms=round(measured, 3), prompt_n=timings.get("prompt_n"), prediction=pred.as_dict())
        if self.metrics is not None:
            self.metrics.predicted(chose, predicted / 1000.0, measured / 1000.0)

    async def _health(self, key: str | None) -> None:
        """``GET /health``, for its connection (:meth:`_small`): one kept alive shows the server is the one the
        view describes. Loading or down, or when it had to make a connection (a kept one was not there: the
        server may have restarted), the view is read again first."""
        if self.model is not None:      # a router's GET /health is its own: the model's is not asked
            self.view.distrust()
            return
        try:
            await self._small(http.get_health, self.base, api_key=key, timeout=SMALL_TIMEOUT, pool=self.pool)
        except Exception:  # noqa: BLE001 - loading or down: GET /slots says which
            self.view.distrust()

    async def _same_server(self, form: str, key: str | None) -> bool:
        """Whether serve's view of the slots still holds once a request has gone to the server (a chat's
        ``/apply-template`` went; else ``GET /health``). One that had to make a connection may have reached a
        restarted server (or the server closed an idle one: cpp-httplib does after 5 s): the slots are read
        again first (``GET /slots``, :meth:`SlotView.apply`: a restart, or a slot changed by another client,
        takes the slots' text away)."""
        if form != "chat":
            await self._health(key)
        if not self.view.trusted:
            await self.check_slots(key)
        return self.view.trusted

    async def by_text(self, text: str, want, form: str, key: str | None) -> tuple[Slot | None, float]:
        """The slot for a prompt ``text`` without asking the server for its tokens (held for it): the slot whose
        own prompt text (:attr:`Slot.text`) ``text`` begins with, the longest such (``want``'s alone when
        given: :meth:`SlotView.by_text`), waited for while its save runs, when no stored state could keep
        ``min_gain`` tokens more of the request than the slot holds (:meth:`Cache.may_beat`: such a state would
        begin with the slot's prompt tokens but their last :data:`MARGIN`, the tokens that more text may
        change). That is the choice :meth:`SlotView.choose` and :meth:`Cache.prepare` make from the prompt's
        tokens: the slot shares the most of it, and nothing is restored. None: the tokens are needed. With the
        seconds it waited for the slot's save."""
        waited = 0.0
        if self.view.by_text(text, want) is None or not await self._same_server(form, key):
            return None, waited
        if not self.cache.index_fresh() and self.cache.unusable() is None:
            # other serve processes' states, listed as prepare lists them (not waited for long: a store that
            # stalls sends the turn the long way, whose lookup gives up in the server's time)
            listing = asyncio.ensure_future(self._on_store(self.cache.sync_index))
            done, _ = await asyncio.wait({listing}, timeout=LISTING_WAIT)
            if not done or listing.exception() is not None:
                return None, waited
        for _ in range(4):
            s = self.view.by_text(text, want)       # again: other requests ran meanwhile
            if s is None or not self.view.trusted or self.cache.may_beat(s.prompt, s.tokens, self.min_gain, MARGIN):
                return None, waited
            if s.idle:
                self.view.hold(s, REQUEST)
                return s, waited
            t0 = time.monotonic()
            await self.view.idle_again(s)       # its save (the turn came the moment its answer did)
            waited += time.monotonic() - t0
        return None, waited

    def _auth(self, request: web.Request) -> str:
        """The key for serve's own requests of a client's request (the server accepts it: :meth:`accepted`):
        ``--api-key``, else the client's own (as the server reads it; never logged)."""
        return self.cache.api_key or auth.client_key(request.headers)

    async def prompt_of(self, body: dict, form: str, key: str | None):
        """The request's prompt as the server reads it: its ``prompt``, or a chat's ``messages`` through the
        server's ``/apply-template``; None for a chat serve does not cache (no messages, media)."""
        if form == "chat":
            if not isinstance(body.get("messages"), list) or self.cache.facts.mmproj:
                return None
            answer = await self._small(http.request, self.base, "POST", "/apply-template", body, api_key=key,
                                       timeout=SMALL_TIMEOUT, pool=self.pool, model=self.model)
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
                                   api_key=key, timeout=SMALL_TIMEOUT, pool=self.pool, model=self.model)
        toks = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise http.ServerAnswerError(f"POST {self.base}/tokenize: no token list in the answer")
        return as_tokens(toks)

    async def _save_then_release(self, slot: Slot, key: str | None, learnt: asyncio.Future | None = None) -> None:
        """After a whole answer (the slot held by its save meanwhile, :data:`SAVE`: the conversation's next turn
        waits for it): the slot saved by the server (asked at once, on a kept connection) and the file checked
        (in a worker thread), its ``/slots`` signature noted, then freed; the state is stored after (the slot's
        next request need not wait for the copy). With the store not to be used (:meth:`Cache.unusable`), no
        save is asked (it could not be stored). A request sent by its text (:meth:`by_text`) has its text's
        tokens asked for meanwhile (``learnt``): what the slot now holds, and the prompt tokens kept and
        evaluated for the metrics."""
        began = time.perf_counter()
        saved = None
        try:
            if self.cache.unusable() is None:
                work = self.cache.work_name(slot.id)
                try:
                    answer = await self._small(self.cache.save, slot.id, work, key)
                    self.cache.costs.saved(answer)
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
                    slot.sent(saved.tokens if saved is not None else prompt, slot.text, prompt)
            try:
                entries = await self._small(http.get_slots, self.base, api_key=key, timeout=SMALL_TIMEOUT,
                                            pool=self.pool, model=self.model)
                self.view.noted(slot, next((e for e in entries if e.get("id") == slot.id), None))
                if self.view.apply(entries):    # the other slots as the server shows them now: the view read
                    self.cache.learn_due = True
                    self.cache.server_restarted()
            except Exception:  # noqa: BLE001 - unknown: the next check finds the slot's tokens unknown
                slot.sig = UNKNOWN
        finally:
            self.view.release(slot)
        if saved is not None:
            try:
                await self._on_store(self.cache.store_saved, saved, began)
            except StoreOff as e:
                self.cache.counters.add("save_failures")
                self.log("error", f"slot {slot.id}: {e}", slot=slot.id, code="store_off")
            except Exception as e:  # noqa: BLE001 - the store down: the next restore misses it
                self.cache.counters.add("save_failures")
                self.log("error", f"slot {slot.id}: not stored: {e}", slot=slot.id)
            finally:
                self.cache.said_off()
            if self.metrics is not None:
                self.metrics.save_took(time.perf_counter() - began)

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
        if self.metrics is not None:
            reused = min(common_prefix(before, tokens), len(tokens) - 1)
            self.metrics.prompt(reused, len(tokens) - reused)
        return tokens


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
