"""``slotctl serve``: a prompt cache on disk and in S3 in front of a llama-server (:mod:`slotctl.serve`)."""

from __future__ import annotations

import typer

from slotctl.cli.common import handle_errors
from slotctl.cli.command_line import ArgsCommand
from slotctl.cli.options import (
    ApiKeyOpt, ConfigOpt, EventsJsonOpt, IdleTimeoutOpt, KeptSlotDirOpt, KeptStoreOpt, KeptTimeoutOpt, LeaseOpt,
    MaxBodyOpt, MaxConnectionsOpt, MetricsListenOpt, MinGainOpt, RestorePolicyOpt, ServeListenOpt,
    ServerDraftModelOpt, StoreBudgetOpt, StoreCatalogOpt, UnreportedCtkOpt, UnreportedCtvOpt, UnreportedKvuOpt,
    UpstreamOpt,
)
from slotctl.cli.output import Output, hashing_progress
from slotctl.errors import UsageError
from slotctl.live import SLOT_FILE_TIMEOUT


def register(app: typer.Typer) -> None:
    app.command("serve", cls=ArgsCommand)(serve)


@handle_errors
def serve(
    ctx: typer.Context,
    upstream: UpstreamOpt = None,
    slot_dir: KeptSlotDirOpt = None,
    store: KeptStoreOpt = None,
    listen: ServeListenOpt = None,
    max_size: StoreBudgetOpt = None,
    min_gain: MinGainOpt = None,
    restore_policy: RestorePolicyOpt = None,
    no_cache: StoreCatalogOpt = False,
    config: ConfigOpt = None,
    metrics_listen: MetricsListenOpt = None,
    lease: LeaseOpt = None,
    max_connections: MaxConnectionsOpt = None,
    idle_timeout: IdleTimeoutOpt = None,
    max_body: MaxBodyOpt = None,
    kv_unified: UnreportedKvuOpt = False,
    cache_type_k: UnreportedCtkOpt = None,
    cache_type_v: UnreportedCtvOpt = None,
    draft_model: ServerDraftModelOpt = None,
    api_key: ApiKeyOpt = None,
    timeout: KeptTimeoutOpt = None,
    json_out: EventsJsonOpt = False,
) -> None:
    """Serve a llama-server through a prompt cache on disk or in S3: restore, request, save.

    A reverse proxy: every request passes through unchanged (streaming included). A completion
    request (/completion, /v1/completions, /v1/chat/completions) is tokenized as the server does it,
    given a slot (its id_slot, else the idle slot sharing the longest prefix, else the least recently
    used), and the stored state sharing the longest prefix is restored first when validate says the
    server restores it and it keeps more of the prompt than the slot holds. After the answer the slot
    is saved into the store (once per content), kept under --max-size. The cache never fails a
    request: what fails in it is logged and the request goes uncached. A state stored by a server of
    other -np or -kvu (another serve sharing the store) is converted for this one first (exact; cache
    types never re-encoded) and judged again. In front of llama-server's router (started without
    -m): one cache per model behind it, by each request's "model", each model's prompts restored
    into the fresh server the router starts after a swap; a model is loaded only for a request the
    router would load it for. GET /slotctl/stats: counters. One log line per
    event; --json: one JSON line each, the first saying where serve listens.
    Behind --api-key (serve's or the server's), nothing is done for a client the server refuses: its
    request goes on untouched. Limits: --max-connections, --idle-timeout, --max-body (a larger body goes
    through unread, uncached). SIGTERM or SIGINT: saves in progress finish, exit 0. Needs the [serve] extra (aiohttp). Details:
    docs/serve.md.

    Running unattended: --config FILE (the TOML file keep reads, its [serve] table; flags override
    it); --metrics-listen HOST:PORT serves /metrics, /livez, /readyz on an address of their own; one
    serve per server and store (a second is refused); under systemd (Type=notify): READY=1,
    WATCHDOG=1, STOPPING=1.

    Exit codes: 0 stopped by SIGTERM or SIGINT; 2 usage error (a missing directory, a bad --listen,
    the [serve] or [s3] extra missing, the address in use, a bad configuration file, another serve
    serving this server with this store). A store that fails or stalls, or a lease lost, does not
    stop serve: it goes on uncached and says so.
    """
    from slotctl.cli import running
    from slotctl.unattended.lock import DEFAULT_TTL
    from slotctl.unattended.metrics import parse_listen

    run = running.settings("serve", config, upstream, slot_dir, store, api_key)
    if run.url is not None and run.model is not None:
        from slotctl.live.http import normalize_url

        raise UsageError(f"serve: {normalize_url(run.url)}'s server entry names a router's model ({run.model!r}): one "
                         f"serve fronts every model of a router (each request's \"model\" names which): give it the "
                         f"router's entry without a model (docs/serve.md, in front of llama-server's router)")
    listen, min_gain = run.pick(listen, "listen", "127.0.0.1:8081"), run.pick(min_gain, "min_gain", 16)
    from slotctl.unattended.config import RESTORE_POLICIES

    restore_policy = run.pick(restore_policy, "restore_policy", "cost")
    if restore_policy not in RESTORE_POLICIES:
        raise UsageError(f"--restore-policy {restore_policy!r}: expected {' or '.join(RESTORE_POLICIES)}")
    timeout, lease = run.pick(timeout, "timeout", SLOT_FILE_TIMEOUT), run.pick(lease, "lease", DEFAULT_TTL)
    metrics_listen = run.pick(metrics_listen, "metrics_listen", None) or None
    run.require("--upstream")
    from slotctl.cli.common import use_store

    use_store([run.store])      # an s3:// store from the configuration file needs the [s3] extra too
    host, port = parse_listen(listen)
    if metrics_listen is not None:
        parse_listen(metrics_listen, "--metrics-listen")
    size = run.budget(max_size)
    from slotctl.prune import parse_size
    from slotctl.serve.front import DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_BODY, DEFAULT_MAX_CONNECTIONS, Limits

    limits = Limits(max_connections=run.pick(max_connections, "max_connections", DEFAULT_MAX_CONNECTIONS),
                    idle_timeout=float(run.pick(idle_timeout, "idle_timeout", DEFAULT_IDLE_TIMEOUT)),
                    max_body=_body_size(run.pick(max_body, "max_body", None), parse_size, DEFAULT_MAX_BODY))
    from slotctl.serve import main

    flags, given = running.unreported_flags(ctx, kv_unified, cache_type_k, cache_type_v)
    out = Output(json_mode=json_out)

    def emit(event: str, message: str, details: dict) -> None:
        if json_out:
            out.json_line({"time": _now(), "event": event, "message": message, "details": details})
        else:
            running.event_line(out, _now(), event, message)

    raise typer.Exit(main.serve(run.url, run.slot_dir, run.store, host=host, port=port, max_size=size,
                                min_gain=min_gain, restore_policy=restore_policy, api_key=run.api_key, timeout=timeout,
                                catalog=not no_cache, emit=emit, flags=flags, given=given,
                                metrics_listen=metrics_listen, lease=lease, draft_model=draft_model,
                                progress=hashing_progress(out), limits=limits))


def _body_size(given: str | None, parse_size, default: int) -> int:
    """``--max-body`` in bytes (at least 1 KiB: a completion's JSON around its prompt)."""
    if given is None:
        return default
    n = parse_size(given)
    if n < 1024:
        raise UsageError(f"--max-body {given}: expected at least 1K (a completion's body)")
    return n


def _now() -> str:
    import time

    from slotctl.catalog import iso_time

    return iso_time(time.time())
