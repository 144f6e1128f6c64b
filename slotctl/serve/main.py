"""``slotctl serve``'s process: the cache and the proxy made, the event loop run until SIGTERM or SIGINT."""

from __future__ import annotations

import os

from slotctl.errors import UsageError


def serve(upstream: str, slot_dir: str | os.PathLike, store: str | None, *, host: str, port: int,
          max_size: int | None, min_gain: int, api_key: str | None, timeout: float, catalog: bool = True,
          flags=None, given: frozenset[str] = frozenset(), emit) -> int:
    """Run the proxy (see :mod:`slotctl.serve.proxy`); ``emit(event, message, details)`` gets every event,
    the first one ``listening`` with the address; ``flags`` / ``given``: the server's flags it does not report
    (``-kvu``, ``-ctk``, ``-ctv``, :class:`~slotctl.serve.cache.Cache`). 0 once stopped by SIGTERM or SIGINT."""
    try:
        import aiohttp  # noqa: F401 - the [serve] extra
    except ImportError:
        raise UsageError("slotctl serve needs the [serve] extra: pip install 'slotctl[serve]' (aiohttp)",
                         code="missing_extra") from None
    import asyncio
    import signal

    from slotctl.live.http import redact
    from slotctl.serve.cache import Cache
    from slotctl.serve.proxy import Proxy, run

    def log(event: str, message: str, **details) -> None:
        emit(event, message, details)

    cache = Cache(upstream, slot_dir, store, api_key=api_key, max_size=max_size, timeout=timeout, catalog=catalog,
                  log=log, flags=flags, given=given)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        proxy = Proxy(cache, min_gain=min_gain, log=log)

        def ready(h: str, p: int) -> None:
            log("listening", f"serving {redact(cache.url)} on http://{h}:{p}: slot dir {cache.slot_dir}, store "
                             f"{cache.store}", listen=f"{h}:{p}", port=p, upstream=redact(cache.url),
                store=str(cache.store))

        try:
            await run(proxy, host, port, ready=ready, stop=stop)
        except OSError as e:
            raise UsageError(f"--listen {host}:{port}: {e.strerror or e}", code="listen_failed") from None
        log("stop", "stopped", counters=cache.counters.as_dict())

    asyncio.run(main())
    return 0
