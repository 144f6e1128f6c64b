"""``slotctl serve``'s process: the cache and the proxy made, the event loop run until SIGTERM or SIGINT, in the
shell keep runs in too (:class:`slotctl.unattended.shell.Shell`: one serve per server and store, ``/metrics``,
``/livez`` and ``/readyz`` on an address of their own, systemd's ``NOTIFY_SOCKET`` protocol).

serve is in its clients' path, so nothing of the store's stops it: a store that does not answer (or stalls), a
lease it cannot take or renew (or that another serve took over), credentials the store refuses, all leave it
proxying, uncached (:meth:`slotctl.serve.cache.Cache.unusable`), saying so (a ``cache`` event, ``/readyz``,
``slotctl_serve_cache_available``); it writes nothing to the store while it holds no lease, tries the store
again in the background (:data:`AGAIN`) and takes the lease back when it can."""

from __future__ import annotations

import os
import time

from slotctl.errors import UsageError

#: seconds the event loop may go without a beat before ``/livez`` (and systemd's watchdog) says it is stuck:
#: every blocking step runs in a worker thread, so the loop itself never waits this long
LOOP_STUCK = 30.0
#: seconds between two beats of the event loop
BEAT = 1.0
#: seconds after which a store that stopped answering is asked again (one ``HEAD``, in the background;
#: ``SLOTCTL_STORE_AGAIN``: a test's shorter one)
AGAIN = float(os.environ.get("SLOTCTL_STORE_AGAIN") or 5.0)


def serve(upstream: str, slot_dir: str | os.PathLike, store: str | None, *, host: str, port: int,
          max_size: int | None, min_gain: int, api_key: str | None, timeout: float, catalog: bool = True,
          restore_policy: str = "cost",
          flags=None, given: frozenset[str] = frozenset(), emit, metrics_listen: str | None = None,
          lease: float | None = None, draft_model=None, progress=None, limits=None) -> int:
    """Run the proxy (see :mod:`slotctl.serve.proxy`); ``emit(event, message, details)`` gets every event,
    the first one ``listening`` with the address; ``flags`` / ``given``: the server's flags it does not report
    (``-kvu``, ``-ctk``, ``-ctv``, :class:`~slotctl.serve.cache.Cache`); ``draft_model``: its draft model's file
    (``-md``: no server reports it); ``progress(done, total)``: the model's hashing (once per file);
    ``limits``: on the clients (:class:`slotctl.serve.front.Limits`). 0 once stopped by SIGTERM or SIGINT (a
    lease lost does not stop serve: it goes on uncached)."""
    try:
        import aiohttp  # noqa: F401 - the [serve] extra
    except ImportError:
        raise UsageError("slotctl serve needs the [serve] extra: pip install 'slotctl[serve]' (aiohttp)",
                         code="missing_extra") from None
    import asyncio

    from slotctl.live.http import redact
    from slotctl.serve.cache import Cache
    from slotctl.serve.front import FailureLog, Limits, connection_limit
    from slotctl.serve.proxy import Proxy, run
    from slotctl.unattended.metrics import StoreProbe
    from slotctl.unattended.shell import Shell, count_store

    from slotctl.keeping.store import legacy_states

    metrics = None

    def log(event: str, message: str, **details) -> None:
        if metrics is not None:
            metrics.observe(event, details)
            if event in ("stored", "pruned"):
                count_store(metrics, cache.store)
        emit(event, message, details)

    limits = limits or Limits()
    # the clients' connections the descriptor limit holds (each with its relay to the server)
    max_connections, nofile = connection_limit(limits.max_connections)
    failures = FailureLog(log)
    cache = Cache(upstream, slot_dir, store, api_key=api_key, max_size=max_size, timeout=timeout, catalog=catalog,
                  log=log, flags=flags, given=given, restore_policy=restore_policy, draft_model=draft_model,
                  progress=progress)
    where = str(cache.store)       # the lock lives in the store (the default one: inside the slot directory)
    probe = StoreProbe(where)
    # the store does not answer: serve serves all the same (uncached while it holds no lease), and takes the lease
    # once the store answers
    shell = Shell("serve", where, cache.url, ttl=lease, log=log)
    shell.lock(wait_for_store=True)
    beat = [time.monotonic()]

    def lease_lost(e: Exception) -> None:
        """The lease lost (not renewed in time, taken over), or not taken back yet: uncached, taken back when
        the store lets it (said once per loss)."""
        shell.lost.clear()          # not serve's end: /livez stays up
        shell.held = None
        if cache.lease_off is None:
            cache.lease_off = f"no lease ({e})"
            log("error", f"{e}: serve goes on uncached and takes the lease back when it can",
                code=getattr(e, "code", "lease_lost"))
            cache.said_off()
        shell.take_later(lease_lost, lease_taken)

    def lease_taken() -> None:
        cache.lease_off = None
        cache.said_off()

    def alive() -> tuple[bool, str]:
        age = time.monotonic() - beat[0]
        return age <= LOOP_STUCK, f"the event loop's last beat {age:.1f} s ago (limit {LOOP_STUCK:g} s)"

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        shell.on_signals(stop.set, loop=loop)
        shell.keep_lease(lease_lost)
        proxy = Proxy(cache, min_gain=min_gain, log=log, metrics=metrics, limits=limits, failures=failures)

        async def beating() -> None:
            tried = time.monotonic()
            while not stop.is_set():
                beat[0] = time.monotonic()
                if beat[0] - tried >= AGAIN and cache.where_s3():
                    from slotctl.store.s3 import known_down

                    if known_down() is not None:
                        # a store that stopped answering is refused at once by every request; asked again here
                        # (one HEAD, in a thread: StoreProbe), and used again once it answers
                        tried = beat[0]
                        await asyncio.to_thread(probe)
                cache.said_off()
                try:
                    await asyncio.wait_for(stop.wait(), BEAT)
                except asyncio.TimeoutError:
                    pass

        beats: list[asyncio.Task] = []

        def ready(h: str, p: int) -> None:
            endpoint = shell.endpoint
            extra = {"metrics": endpoint.url} if endpoint is not None else {}
            log("listening", f"serving {redact(cache.url)} on http://{h}:{p}: slot dir {cache.slot_dir}, store "
                             f"{cache.store}" + (f"; metrics on {endpoint.url}/metrics, /livez, /readyz"
                                                 if endpoint is not None else ""),
                listen=f"{h}:{p}", port=p, upstream=redact(cache.url), store=str(cache.store),
                max_connections=max_connections, **extra)
            sweep(cache, log)       # before the first request is served (the accept loop waits for this)
            if store is None and (n := legacy_states(cache.slot_dir)):
                log("warning", f"{cache.slot_dir}: {n:,} stored state(s) in the slot directory itself (an earlier "
                               f"release's default store) are not used: the store is now {cache.store}, out of a "
                               f"client's slot save's reach (move them there to use them, if no client could "
                               f"have written them; or give --store)", n=n, path=os.fspath(cache.slot_dir))
            if max_connections < limits.max_connections:
                log("warning", f"--max-connections {limits.max_connections:,}: the descriptor limit ({nofile:,}, "
                               f"RLIMIT_NOFILE) holds {max_connections:,} clients' connections with their relays "
                               f"to the server: serve takes that many at once (raise LimitNOFILE, or ulimit -n)",
                    max_connections=max_connections, nofile=nofile)
            if shell.held is None:
                cache.lease_off = f"no lease ({shell.unlocked})"
                log("error", f"{shell.unlocked}: serve runs without its lease, uncached (a second serve of this "
                             f"server and store is not refused meanwhile); it takes the lease once the store answers",
                    code=getattr(shell.unlocked, "code", "store_error"))
                cache.said_off()
                shell.take_later(lease_lost, lease_taken)
            shell.ready(f"serving {redact(cache.url)} on http://{h}:{p} (store {cache.store})")
            beats.append(loop.create_task(beating()))       # its events after the first, listening

        try:
            await run(proxy, host, port, ready=ready, stop=stop, max_connections=max_connections)
        except OSError as e:
            raise UsageError(f"--listen {host}:{port}: {e.strerror or e}", code="listen_failed") from None
        finally:
            for b in beats:
                b.cancel()
        log("stop", "stopped", counters=cache.counters.as_dict())

    with shell:
        if metrics_listen:
            from slotctl.unattended.metrics import ServeMetrics

            metrics = ServeMetrics(redact(cache.url), cache.counters, cache.unusable)
            count_store(metrics, cache.store)
            shell.serve_metrics(metrics_listen, metrics.exposition, lambda: metrics.ready(probe), alive,
                                option="--metrics-listen")
        shell.arm_watchdog(lambda: alive()[0])
        asyncio.run(main())
    return 0


def sweep(cache, log) -> None:
    """What serve processes that are gone left in the slot directory (and the store's temporary files of
    copies untouched for an hour) removed at start, each said (:meth:`ServerStates.sweep`)."""
    def swept(path, pid: int, size: int) -> None:
        log("pruned", f"{path}: deleted (" + (f"left by serve process {pid}, which is gone" if pid else
                                             "a temporary file of a copy into the store, untouched for an hour")
            + f"), {size:,} bytes", path=os.fspath(path), size=size)

    try:
        cache.sweep(swept)
    except OSError as e:
        log("error", f"{cache.slot_dir}: the working files of serve processes that are gone cannot be swept: "
                     f"{e.strerror or e}")
