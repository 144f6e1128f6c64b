"""``slotctl serve`` in front of llama-server's router: one cache per model behind it (docs/serve.md, "In front of
llama-server's router").

The proxy (:class:`slotctl.serve.proxy.Proxy`) that finds its upstream is a router (``GET /props`` says ``"role":
"router"``) hands every request to :class:`Models`. A completion naming a model (its body's ``"model"``: a name or
an alias the router lists, :func:`slotctl.live.router.resolve`) goes to that model's own proxy: its own cache
(:class:`slotctl.serve.cache.Cache`: the model's :class:`~slotctl.keeping.states.ServerStates`, its facts read
through the router by its name, its ``-kvu``/``-ctk``/``-ctv`` from its command line in the router's ``GET
/v1/models`` and then from its saves, its states named for its model, its index) and its own view of its slots;
every proxy shares the process's counters, store and client session. Everything else passes through as it came.

What the router does to its models decides the rest (b11669's router, measured; the rules read in b11549's
``server-models.cpp``):

- **A swap empties a model's slots.** The router unloads the least recently used idle model past
  ``--models-max``; loaded again, the model runs in a fresh server on a port the router picks anew. Before each
  request serve reads the router's ``GET /v1/models`` (the router's own answer: no model is asked or loaded): a
  model whose port is another than the one its view was read from runs in a new server, whose slots hold
  nothing, and the next turn of each conversation is restored into it from the store, as after a restart.
- **serve loads no model on its own.** Its reads of a model are GETs with ``autoload=false``, which never load
  one. A request for a model that is not loaded would make the router load it (when the router's
  ``models_autoload`` or the request's ``autoload`` say so: :func:`slotctl.live.router.autoloads`): serve then
  has the router load it first (:func:`slotctl.live.http.load_for`, with the client's own key and ``autoload``:
  the router refuses it where it would refuse the request), so that the state is restored before the request
  runs; a request the router would not load it for passes through as it came.
- **A model's saves reach it before the router can unload it.** The router unloads only an idle model (no
  request in flight: b11549's ``pick_victim``), and serve saves each answer's slot once the answer is passed on:
  a request that makes the router load a model waits, when the router is full and every model loaded is at work
  for serve (a request, or the save after its answer), until one of them is idle (:meth:`Models.room`): the
  router would wait for such a model's request to end anyway; serve's wait adds the save.
- **serve holds no model loaded.** The router's LRU order counts POSTs only (``proxy_post``: "update last usage
  for POST request only"); serve POSTs to a model (its ``/tokenize``, ``/apply-template``, the restore, the save,
  the save that learns its flags) only while a client's request for it is in hand, and reads (GETs) otherwise.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from slotctl.live import http, router
from slotctl.serve.cache import Cache
from slotctl.serve.slots import SlotView

#: a :class:`slotctl.serve.proxy.Proxy` (whose class is given: it makes this object, and is not imported here)
Proxy = Any

#: the statuses of a router's model that hold a place among ``--models-max``
RUNNING = ("loaded", "loading")


class _View(SlotView):
    """A model's view of its slots that says when a slot is given back (:meth:`Models.room` waits for it)."""

    def __init__(self, min_gain: int, on_release):
        super().__init__(min_gain)
        self._on_release = on_release

    def release(self, slot) -> None:
        super().release(slot)
        self._on_release()


class Models:
    """Every model behind the router ``front`` fronts (see the module docstring): one proxy per model (``make``:
    the class of ``front``, :class:`slotctl.serve.proxy.Proxy`), made at the first request naming it; ``timeout``:
    seconds serve waits for its own small requests."""

    def __init__(self, front: Proxy, make, timeout: float):
        self.front = front
        self.make, self.timeout = make, timeout
        self.base = front.base
        self.proxies: dict[str, Proxy] = {}
        #: each model's command line (its --port left out) its proxy's flags were read from
        self._args: dict[str, list[str]] = {}
        #: the port of the model's server each proxy's view describes (None: none read yet)
        self.ports: dict[str, int | None] = {}
        #: the router's models as last listed (:func:`slotctl.live.router.parse_models`) and its own /props
        self.listed: list[dict] = []
        self.props: dict = {}
        #: serve's requests for each model in hand (from their arrival to their answer)
        self.working: dict[str, int] = {}
        #: done when serve's work for a model may have ended (a request answered, a slot given back); then anew
        self._changed: asyncio.Future | None = None
        #: proxies made for a model's earlier command line (their saves in progress finish at exit)
        self._retired: list[Proxy] = []

    # -- the router ------------------------------------------------------------------------------------

    async def begin(self, key: str | None) -> None:
        """The router's models and ``/props`` read, said once (``up``)."""
        try:
            await self.read(key, props=True)
        except Exception as e:  # noqa: BLE001 - read again at each request
            self.front.log("error", f"{self.base} is llama-server's router, and its models cannot be read ({e}): "
                                    f"read again at each request")
            return
        most = self.props.get("max_instances")
        shown = ", ".join(f"{m['name']} ({m['status']})" for m in self.listed) or "none yet"
        self.front.log("up", f"{self.base} is llama-server's router ({self.props.get('build_info')}, --models-max "
                             f"{most}): a cache per model, by the request's \"model\": {shown}",
                       total_slots=None, model=None, models=[m["name"] for m in self.listed])

    async def read(self, key: str | None, *, props: bool = False) -> list[dict]:
        """The router's models read again, and with ``props`` its own ``/props`` (``--models-max``, whether it
        loads a model for a request): the router's own answers, no model asked."""
        self.listed = await asyncio.to_thread(http.router_models, self.base, api_key=key, timeout=self.timeout)
        if props:
            got = await asyncio.to_thread(http.router_props, self.base, api_key=key, timeout=self.timeout)
            if got is not None:
                self.props = got
        return self.listed

    def stats(self) -> dict:
        """Each model's proxy as ``GET /slotctl/stats`` shows it: its status, the hash of its model in the states'
        names, the states indexed."""
        status = {m["name"]: m["status"] for m in self.listed}
        return {name: {"status": status.get(name), "model": p.cache.model, "port": self.ports.get(name),
                       "states": len(p.cache.index.states) if p.cache.index else 0}
                for name, p in self.proxies.items()}

    async def cleanup(self) -> None:
        """At exit: every model's saves in progress finished (a state half stored is never left), the rest
        cancelled."""
        tasks = [t for p in [*self.proxies.values(), *self._retired] for t in p._tasks]
        for t in tasks:
            if not t.get_name().startswith("save"):
                t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- every request ---------------------------------------------------------------------------------

    async def completion(self, request: web.Request, raw: bytes, body: dict | None, form: str) -> web.StreamResponse:
        """A completion request to the router (its body ``raw`` read within serve's limits and parsed as
        ``body``): sent through the proxy of the model it names, that model's server made ready first
        (:meth:`ready`); else passed through as it came."""
        front = self.front
        name = body.get("model") if isinstance(body, dict) else None
        proxy = await self.ready(name, request) if isinstance(name, str) else None
        if proxy is None:
            return await front.through(request, raw)
        self.working[proxy.model] = self.working.get(proxy.model, 0) + 1
        try:
            return await proxy.completion(request, raw, form)
        finally:
            self.working[proxy.model] -= 1
            self._notify()

    async def ready(self, name: str, request: web.Request) -> Proxy | None:
        """The proxy of the model a request names, its model's server the one its view describes: loaded now,
        or loaded for this request (:meth:`load`). None: the request passes through as it came (the router does
        not list the model, would not load it for the request, or does not answer)."""
        key = self.front.auth_key(request)
        try:
            entry = router.resolve(await self.read(key), name)
        except Exception:  # noqa: BLE001 - the router down or refusing: its own answer to the request
            return None
        if entry is None:
            return None         # the router's own answer: not found
        proxy = self._proxy(entry)
        self.working[proxy.model] = self.working.get(proxy.model, 0) + 1     # at work for serve from now
        try:
            if entry["status"] != "loaded":
                entry = await self.load(entry, request, key)
                if entry is None:
                    return None
            if self.ports.get(proxy.model) != entry["port"]:
                await self._new_server(proxy, entry, key)
        finally:
            self.working[proxy.model] -= 1
            self._notify()
        return proxy

    async def load(self, entry: dict, request: web.Request, key: str | None) -> dict | None:
        """``entry``'s model loaded by the router for ``request``, when the router would load it for the request
        alone (its ``autoload``); once there is room for it (:meth:`room`). Its entry as the router lists it
        loaded; None when it is not."""
        try:
            await self.read(key, props=True)        # the router's rules now (it may have restarted)
        except Exception:  # noqa: BLE001 - its own answer to the request follows
            return None
        if not router.autoloads(self.props, dict(request.query)):
            return None
        await self.room(entry["name"])
        h = request.headers.get("Authorization", "")
        own = h[7:].strip() if h[:7].lower() == "bearer " else ""      # the client's own key (none: "")
        try:
            await asyncio.to_thread(http.load_for, self.base, entry["name"], api_key=own,
                                    autoload=request.query.get("autoload"), timeout=self.front.cache.timeout)
            entry = router.resolve(await self.read(key), entry["name"])
        except Exception as e:  # noqa: BLE001 - the router refused (its own answer to the request follows)
            self.front.log("error", f"{entry['name']}: the router did not load it for the request ({e}): the request "
                                    f"passes through uncached", router_model=entry["name"])
            return None
        return entry if entry is not None and entry["port"] is not None else None

    async def room(self, name: str) -> None:
        """Until the router can load ``name`` without unloading a model serve is at work for: at once when it has
        room (fewer models loaded than ``--models-max``, or no limit) or one of its loaded models is idle for
        serve (the router unloads an idle one, the least recently used); else when one of them is (its request
        answered and its slot saved: :class:`_View` and :meth:`handle` say so)."""
        most = self.props.get("max_instances")
        if not isinstance(most, int) or isinstance(most, bool) or most <= 0:
            return
        while not self._has_room(name, most):
            if self._changed is None or self._changed.done():
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)

    def _has_room(self, name: str, most: int) -> bool:
        running = [m["name"] for m in self.listed if m["status"] in RUNNING and m["name"] != name]
        return len(running) < most or any(not self._busy(n) for n in running)

    def _busy(self, name: str) -> bool:
        """Whether serve is at work for model ``name``: a request of it in hand, or one of its slots held (a
        request in it, or the save after its answer)."""
        p = self.proxies.get(name)
        return self.working.get(name, 0) > 0 or (p is not None and any(
            s.holder is not None for s in p.view.slots.values()))

    def _notify(self) -> None:
        """Serve's work for a model may have ended: every :meth:`room` waiting looks again."""
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    async def _new_server(self, proxy: Proxy, entry: dict, key: str | None) -> None:
        """The model's server is another than the one its view was read from (a first look, or loaded again
        by the router: a new port): its slots hold nothing; its facts read again (its flags learnt when due)."""
        name, old = proxy.model, self.ports.get(proxy.model)
        proxy.view.lose()
        proxy.view.top_task = -1            # a fresh server counts its tasks from 0: no restart to learn flags from
        self.ports[name] = entry["port"]
        await proxy.refresh_facts(key)
        f = proxy.cache.facts
        if f is None or proxy.said_down is not False:
            self.ports[name] = None         # its facts not read: read at its next request
        else:
            self.front.log("loaded", f"{name}: {'loaded again by the router' if old is not None else 'loaded'} (its "
                                     f"server on 127.0.0.1:{entry['port']}): {f.total_slots} slot(s) of "
                                     f"{f.n_ctx_slot} tokens, model {f.model_path}"
                                     + (": its slots hold nothing; conversations are restored from the store"
                                        if old is not None else ""),
                           router_model=name, port=entry["port"], total_slots=f.total_slots, model=proxy.cache.model)

    def _proxy(self, entry: dict) -> Proxy:
        """The model's proxy (made at the first request naming it, or anew when its command line changed: its
        flags are read from it)."""
        name = entry["name"]
        args = _without_port(entry["args"])
        p = self.proxies.get(name)
        if p is not None and self._args.get(name) == args:
            return p
        f = self.front
        flags, given = router.command_line_flags(entry["args"])
        cache = Cache(f.cache.url, f.cache.slot_dir, f.cache.store, api_key=f.cache.api_key,
                      max_size=f.cache.max_size, timeout=f.cache.timeout, catalog=f.cache.use_catalog,
                      log=self._log_of(name), flags=flags, given=given, router_model=name, counters=f.cache.counters,
                      restore_policy="cost" if f.cache.by_cost else "tokens")
        p = self.make(cache, min_gain=f.min_gain, metrics=f.metrics, limits=f.limits, failures=f.failures)
        p.relay.session = f.relay.session
        p.view = _View(f.min_gain, self._notify)
        if name in self.proxies:
            self._retired.append(self.proxies[name])
        self.proxies[name], self._args[name] = p, args
        self.ports.pop(name, None)
        return p

    def _log_of(self, name: str):
        """A model's events: said by the process's log, named for the model (``router_model``); its server's
        facts not read is ``unloaded`` (the router's other models are up)."""
        def log(event: str, message: str, **details) -> None:
            if event == "up":
                return          # said as "loaded"
            self.front.log("unloaded" if event == "down" else event, f"{name}: {message}", router_model=name,
                           **details)

        return log


def _without_port(args: list[str]) -> list[str]:
    """A model's command line without its ``--port`` (picked anew at each load)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--port":
            skip = True
            continue
        out.append(a)
    return out
