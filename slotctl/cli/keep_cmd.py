"""``slotctl keep``: keep a running llama-server's slots across its restarts (:mod:`slotctl.fleet.keep`)."""

from __future__ import annotations

import typer

from slotctl.cli import remote
from slotctl.cli.common import handle_errors
from slotctl.cli.command_line import ArgsCommand
from slotctl.cli.options import (
    AllowLossyOpt, ApiKeyOpt, ConfigOpt, EventsJsonOpt, EveryOpt, ForceRestoreOpt, KeepListenOpt,
    KeepNewestOpt, KeepServerOpt, KeptSlotDirOpt, KeptStoreOpt, KeptTimeoutOpt, LeaseOpt, MinTokensOpt,
    ProveRestoresOpt, RestoreAllOpt, RouterModelOpt, SaveAllOpt, ServerDraftModelOpt, StoreBudgetOpt, StoreCatalogOpt,
    UnreportedCtkOpt, UnreportedCtvOpt, UnreportedKvuOpt,
)
from slotctl.cli.output import Output, hashing_progress
from slotctl.errors import UsageError
from slotctl.live import SLOT_FILE_TIMEOUT


def register(app: typer.Typer) -> None:
    app.command("keep", cls=ArgsCommand)(keep)


@handle_errors
def keep(
    ctx: typer.Context,
    server: KeepServerOpt = None,
    slot_dir: KeptSlotDirOpt = None,
    store: KeptStoreOpt = None,
    every: EveryOpt = None,
    min_tokens: MinTokensOpt = None,
    max_size: StoreBudgetOpt = None,
    keep_newest: KeepNewestOpt = None,
    prove_restores: ProveRestoresOpt = None,
    config: ConfigOpt = None,
    lease: LeaseOpt = None,
    listen: KeepListenOpt = None,
    save_all: SaveAllOpt = False,
    restore_all: RestoreAllOpt = False,
    force: ForceRestoreOpt = False,
    kv_unified: UnreportedKvuOpt = False,
    cache_type_k: UnreportedCtkOpt = None,
    cache_type_v: UnreportedCtvOpt = None,
    allow_lossy: AllowLossyOpt = False,
    no_cache: StoreCatalogOpt = False,
    draft_model: ServerDraftModelOpt = None,
    router_model: RouterModelOpt = None,
    api_key: ApiKeyOpt = None,
    timeout: KeptTimeoutOpt = None,
    json_out: EventsJsonOpt = False,
) -> None:
    """Keep a running llama-server's slots across its restarts: save idle slots, restore them after.

    A foreground process (for systemd or a container). Every --every seconds: each idle slot whose
    last task changed is saved by the server, checked, and copied into the store (one file per state,
    named by slot, model and a hash of its tokens); the store is kept under --max-size by prune's
    rules; when the server comes back after being down, or runs another model, every empty slot gets
    the newest state that validates for it (one the server would refuse or abort on is skipped, saying
    why, unless --force), converted first when the server's -np, -kvu or cache types changed since it
    was saved (as migrate converts: lossy re-encoding only with --allow-lossy), restored and proven
    (restore --prove's policy). One keeper per
    server and store: a second one is refused (a flock in a directory store, a lease object in
    s3://). One log line per action; --json: one JSON line each. SIGTERM or SIGINT: a last save of
    the changed slots, exit 0. Under systemd (Type=notify): READY=1, WATCHDOG=1, STOPPING=1.
    Details: docs/fleet.md.

    --save-all (or --restore-all): one pass under the same lock, then exit.

    Exit codes: 0 stopped by SIGTERM or SIGINT (--save-all, --restore-all: done); 2 usage error (a missing directory, a bad --max-size,
    a bad configuration file, another keeper keeping this server with this store, the lease lost).
    """
    from slotctl.cli import running
    from slotctl.cli.common import use_store
    from slotctl.fleet.keep import Keeper
    from slotctl.unattended.lock import DEFAULT_TTL
    from slotctl.unattended.shell import Shell, count_store

    out = Output(json_mode=json_out)
    run = running.settings("keep", config, server, slot_dir, store, api_key)
    router_model = router_model if router_model is not None else run.model     # the flag over the file's entry
    if router_model is not None and run.url is not None:
        run.url = remote.server_url(run.url, router_model)
    every, min_tokens = run.pick(every, "every", 30.0), run.pick(min_tokens, "min_tokens", 1)
    timeout, lease = run.pick(timeout, "timeout", SLOT_FILE_TIMEOUT), run.pick(lease, "lease", DEFAULT_TTL)
    listen = run.pick(listen, "listen", None) or None
    keep_newest = keep_newest if keep_newest is not None else run.newest
    if prove_restores is None:
        prove_restores = run.proof != "never"
    if save_all and restore_all:
        raise UsageError("--save-all and --restore-all: give one")
    run.require("--server")
    use_store([run.store])
    size = run.budget(max_size)
    metrics = None

    def emit(ev) -> None:
        doc = ev.as_dict()
        if metrics is not None:
            metrics.observe(doc)
            if ev.event in ("up", "restart", "stored", "pruned"):
                count_store(metrics, keeper.store)
        if json_out:
            out.json_line(doc)
        else:
            running.event_line(out, doc["time"], ev.event, ev.message)

    flags, given = running.unreported_flags(ctx, kv_unified, cache_type_k, cache_type_v)
    keeper = Keeper(run.url, run.slot_dir, run.store, every=every, min_tokens=min_tokens, max_size=size,
                    api_key=run.api_key, timeout=timeout, emit=emit, retention=keep_newest, prove=prove_restores,
                    force=force, flags=flags, given=given, allow_lossy=allow_lossy, catalog=not no_cache,
                    draft_model=draft_model, progress=hashing_progress(out))
    from slotctl.live import router

    model = router.model_for(keeper.url)   # one keeper per router's model and store
    where = str(keeper.store)      # the lock lives in the store (the default one: inside the slot directory)
    shell = Shell("keep", where, keeper.url + (f" (model {model})" if model else ""), ttl=lease)
    keeper.lock = shell.lock()
    with shell:
        shell.keep_lease(keeper.abandon)
        if listen is not None:
            from slotctl.fleet.ui import keeper_page
            from slotctl.unattended.metrics import KeepMetrics, StoreProbe

            metrics = KeepMetrics(keeper.url)
            keeper.on_look = metrics.look
            count_store(metrics, keeper.store)
            probe = StoreProbe(str(where))
            endpoint = shell.serve_metrics(listen, metrics.registry.exposition,
                                           lambda: metrics.ready(3 * keeper.every + keeper.timeout, probe),
                                           lambda: _alive(keeper), ui=lambda: keeper_page(keeper))
            if not json_out:
                out.err.print(f"metrics: {endpoint.url}/metrics, /livez, /readyz; the slots: {endpoint.url}/ui",
                              markup=False, highlight=False)
        shell.arm_watchdog(lambda: _alive(keeper)[0])
        shell.on_signals(keeper.stop)
        if save_all or restore_all:
            shell.start_watchdog()
            code = keeper.once(restore=restore_all)
        else:
            shell.ready(f"keeping {keeper.url} (store {keeper.store})")
            code = keeper.run()
    raise typer.Exit(code)


def _alive(keeper) -> tuple[bool, str]:
    """The loop lives when its last sign of life (a look, an event) is more recent than a look, a wait and
    every request of a look could take together."""
    import time

    age = time.monotonic() - keeper.beat
    limit = keeper.every + 4 * keeper.timeout + 60
    if keeper.lost is not None:
        return False, f"the lock is lost: {keeper.lost}"
    return age <= limit, f"the loop's last sign of life {age:.1f} s ago (limit {limit:g} s)"
