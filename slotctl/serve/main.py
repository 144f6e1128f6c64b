"""``slotctl serve``'s process: the cache and the proxy made, the event loop run until SIGTERM or SIGINT, in the
shell keep runs in too (:class:`slotctl.unattended.shell.Shell`: one serve per server and store, ``/metrics``,
``/livez`` and ``/readyz`` on an address of their own, systemd's ``NOTIFY_SOCKET`` protocol)."""

from __future__ import annotations

import os
import time

from slotctl.errors import UsageError

#: seconds the event loop may go without a beat before ``/livez`` (and systemd's watchdog) says it is stuck:
#: every blocking step runs in a worker thread, so the loop itself never waits this long
LOOP_STUCK = 30.0
#: seconds between two beats of the event loop
BEAT = 1.0
#: seconds after which a store that stopped answering is tried again (``SLOTCTL_STORE_AGAIN``: a test's shorter one)
AGAIN = float(os.environ.get("SLOTCTL_STORE_AGAIN") or 10.0)


def serve(upstream: str, slot_dir: str | os.PathLike, store: str | None, *, host: str, port: int,
          max_size: int | None, min_gain: int, api_key: str | None, timeout: float, catalog: bool = True,
          flags=None, given: frozenset[str] = frozenset(), emit, metrics_listen: str | None = None,
          lease: float | None = None) -> int:
    """Run the proxy (see :mod:`slotctl.serve.proxy`); ``emit(event, message, details)`` gets every event,
    the first one ``listening`` with the address; ``flags`` / ``given``: the server's flags it does not report
    (``-kvu``, ``-ctk``, ``-ctv``, :class:`~slotctl.serve.cache.Cache`). 0 once stopped by SIGTERM or SIGINT;
    2 when the lock (an ``s3://`` store's lease) was lost."""
    try:
        import aiohttp  # noqa: F401 - the [serve] extra
    except ImportError:
        raise UsageError("slotctl serve needs the [serve] extra: pip install 'slotctl[serve]' (aiohttp)",
                         code="missing_extra") from None
    import asyncio

    from slotctl.live.http import redact
    from slotctl.serve.cache import Cache
    from slotctl.serve.proxy import Proxy, run
    from slotctl.unattended.shell import Shell, count_store

    metrics = None

    def log(event: str, message: str, **details) -> None:
        if metrics is not None:
            metrics.observe(event, details)
            if event in ("stored", "pruned"):
                count_store(metrics, cache.store)
        emit(event, message, details)

    cache = Cache(upstream, slot_dir, store, api_key=api_key, max_size=max_size, timeout=timeout, catalog=catalog,
                  log=log, flags=flags, given=given)
    where = os.fspath(store if store is not None else slot_dir)
    # the store does not answer: serve serves all the same (uncached while the store fails), and takes the lease
    # once the store answers (a serve already holding it then: this one stops, exit 2)
    shell = Shell("serve", where, cache.url, ttl=lease, log=log)
    shell.lock(wait_for_store=True)
    beat = [time.monotonic()]

    def alive() -> tuple[bool, str]:
        if shell.lost:
            return False, f"the lock is lost: {shell.lost[0]}"
        age = time.monotonic() - beat[0]
        return age <= LOOP_STUCK, f"the event loop's last beat {age:.1f} s ago (limit {LOOP_STUCK:g} s)"

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        shell.on_signals(stop.set, loop=loop)

        def on_lost(_e: Exception) -> None:
            loop.call_soon_threadsafe(lambda: (shell.stopping(), stop.set()))

        shell.keep_lease(on_lost)
        # each request given a slot counted: the prompt tokens predicted reused and evaluated (Cache.prepare's)
        proxy = Proxy(cache, min_gain=min_gain, log=log, on_prompt=metrics.prompt if metrics is not None else None)

        async def beating() -> None:
            tried = time.monotonic()
            while not stop.is_set():
                beat[0] = time.monotonic()
                if beat[0] - tried >= AGAIN:
                    # a store that stopped answering refuses every later request at once (slotctl.store.s3):
                    # the next request tries it again, as keep does at each look
                    cache.store.again()
                    tried = beat[0]
                try:
                    await asyncio.wait_for(stop.wait(), BEAT)
                except asyncio.TimeoutError:
                    pass

        beats = loop.create_task(beating())

        def ready(h: str, p: int) -> None:
            endpoint = shell.endpoint
            extra = {"metrics": endpoint.url} if endpoint is not None else {}
            log("listening", f"serving {redact(cache.url)} on http://{h}:{p}: slot dir {cache.slot_dir}, store "
                             f"{cache.store}" + (f"; metrics on {endpoint.url}/metrics, /livez, /readyz"
                                                 if endpoint is not None else ""),
                listen=f"{h}:{p}", port=p, upstream=redact(cache.url), store=str(cache.store), **extra)
            if shell.held is None:
                log("error", f"{shell.unlocked}: serve runs without its lease (a second serve of this server and "
                             f"store is not refused meanwhile); it takes the lease once the store answers",
                    code=getattr(shell.unlocked, "code", "store_error"))
                shell.take_later(on_lost)
            shell.ready(f"serving {redact(cache.url)} on http://{h}:{p} (store {cache.store})")

        try:
            await run(proxy, host, port, ready=ready, stop=stop)
        except OSError as e:
            raise UsageError(f"--listen {host}:{port}: {e.strerror or e}", code="listen_failed") from None
        finally:
            beats.cancel()
        if shell.lost:
            log("error", str(shell.lost[0]), code=getattr(shell.lost[0], "code", "lease_lost"))
            log("stop", "stopped: the lock is lost (another serve may be writing)", counters=cache.counters.as_dict())
        else:
            log("stop", "stopped", counters=cache.counters.as_dict())

    with shell:
        if metrics_listen:
            from slotctl.unattended.metrics import ServeMetrics, StoreProbe

            metrics = ServeMetrics(redact(cache.url), cache.counters)
            count_store(metrics, cache.store)
            probe = StoreProbe(where)
            shell.serve_metrics(metrics_listen, metrics.exposition, lambda: metrics.ready(probe), alive,
                                option="--metrics-listen")
        shell.arm_watchdog(lambda: alive()[0])
        asyncio.run(main())
    return 2 if shell.lost else 0
