"""``slotctl keep``: keep a running llama-server's slots across its restarts (:mod:`slotctl.fleet.keep`)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from slotctl.cli import remote
from slotctl.cli.common import handle_errors
from slotctl.cli.command_line import ArgsCommand
from slotctl.cli.options import ApiKeyOpt, ConfigOpt, RouterModelOpt, flag_option, store_option
from slotctl.cli.output import Output, style_of
from slotctl.errors import SlotctlError, UsageError
from slotctl.live import SLOT_FILE_TIMEOUT



def register(app: typer.Typer) -> None:
    app.command("keep", cls=ArgsCommand)(keep)


@handle_errors
def keep(
    ctx: typer.Context,
    server: Annotated[Optional[str], typer.Option("--server", metavar="URL", help="The llama-server's base URL, "
                                                  "e.g. http://127.0.0.1:8080 (or the configuration's).")] = None,
    slot_dir: Annotated[Optional[Path], typer.Option("--slot-dir", file_okay=False, metavar="DIR",
                                                     help="The server's --slot-save-path as this machine sees it.")] = None,
    store: Annotated[Optional[str], store_option("Where the states are kept: a directory or an s3:// prefix "
                                                 "(docs/store.md; default: --slot-dir itself).")] = None,
    every: Annotated[Optional[float], typer.Option("--every", min=0.05, max=86400.0, metavar="SECONDS",
                                                   help="Seconds between two looks at the server [default: 30].")] = None,
    min_tokens: Annotated[Optional[int], typer.Option("--min-tokens", min=1, max=1 << 24, metavar="N",
                                                      help="Save only slots whose last prompt had at least N tokens "
                                                           "[default: 1].")] = None,
    max_size: Annotated[Optional[str], typer.Option("--max-size", metavar="SIZE", help="Keep the store under SIZE "
                                                    "(20G, 500M) by prune's rules, least recently used first.")] = None,
    keep_newest: Annotated[Optional[int], typer.Option("--keep-newest", min=1, max=1 << 20, metavar="N",
                                                       help="Keep only the newest N states of each slot and model "
                                                            "(older ones deleted after each new state).")] = None,
    prove_restores: Annotated[Optional[bool], typer.Option("--prove/--no-prove", help="Prove each restore with "
                                                           "the server's own counts [default: --prove].")] = None,
    config: ConfigOpt = None,
    lease: Annotated[Optional[float], typer.Option("--lease", min=1.0, max=86400.0, metavar="SECONDS",
                                                   help="With an s3:// store: seconds the keeper's lease holds "
                                                        "without a renewal [default: 60].")] = None,
    listen: Annotated[Optional[str], typer.Option("--listen", metavar="HOST:PORT",
                                                  help="Serve /metrics, /livez, /readyz and the slots' page /ui "
                                                       "there (loopback unless a host is given).")] = None,
    save_all: Annotated[bool, typer.Option("--save-all", help="One pass, then exit: save every idle slot whose "
                                           "state the store does not have (llama-swap's cmdStop).")] = False,
    restore_all: Annotated[bool, typer.Option("--restore-all", help="One pass, then exit: restore (and prove) "
                                              "every empty slot from the store.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Restore a stored state even when validate says the "
                                        "server now running refuses it or aborts on it.")] = False,
    kv_unified: Annotated[bool, typer.Option("--kv-unified", "-kvu", help="The server runs with -kvu (not "
                                             "reported by the server; learnt from its saves, which win): stored "
                                             "states are converted for it.")] = False,
    cache_type_k: Annotated[Optional[str], flag_option("cache_type_k", help="The server's -ctk (not reported; "
                                                       "learnt from its saves, which win; default f16).")] = None,
    cache_type_v: Annotated[Optional[str], flag_option("cache_type_v", help="The server's -ctv (not reported; "
                                                       "learnt from its saves, which win; default f16).")] = None,
    allow_lossy: Annotated[bool, typer.Option("--allow-lossy", help="Re-encode a stored state's cache rows when "
                                              "the server's cache types changed (lossy).")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Do not use the catalog (the SQLite index of the "
                                           "store): judge again every stored state the server did not restore "
                                           "before.")] = False,
    router_model: RouterModelOpt = None,
    api_key: ApiKeyOpt = None,
    timeout: Annotated[Optional[float], typer.Option("--timeout", min=0.001, max=86400.0, metavar="SECONDS",
                                                     help="Give up on a request after this many seconds "
                                                          "[default: 600].")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON line per action on stdout "
                                           "(docs/json.md) instead of log lines on stderr.")] = False,
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
    from slotctl.cli.common import use_store
    from slotctl.fleet.keep import Keeper
    from slotctl.unattended import lock as locks
    from slotctl.unattended import systemd
    from slotctl.unattended.config import Config, load

    out = Output(json_mode=json_out)
    cfg = load(config) if config is not None else Config()
    server, slot_dir, store, api_key = cfg.fill("keep", server, slot_dir, store, api_key)
    if router_model is not None and server is not None:
        server = remote.server_url(server, router_model)
    k = cfg.keep

    def pick(flag, key, default):
        return flag if flag is not None else k.get(key, default)

    every, min_tokens = pick(every, "every", 30.0), pick(min_tokens, "min_tokens", 1)
    timeout, lease = pick(timeout, "timeout", SLOT_FILE_TIMEOUT), pick(lease, "lease", locks.DEFAULT_TTL)
    listen = pick(listen, "listen", None) or None
    max_size = max_size if max_size is not None else cfg.max_size
    keep_newest = keep_newest if keep_newest is not None else cfg.newest
    if prove_restores is None:
        prove_restores = cfg.proof != "never"
    if save_all and restore_all:
        raise UsageError("--save-all and --restore-all: give one")
    if server is None:
        raise UsageError("--server: no URL given (nor a server in --config)")
    if slot_dir is None:
        raise UsageError("--slot-dir: no directory given (nor slot_dir in --config)")
    remote.check_slot_dir_and_store(slot_dir, store)
    use_store([store])
    size = None
    if max_size is not None:
        from slotctl.prune import parse_size

        size = parse_size(max_size)

    metrics = None

    def emit(ev) -> None:
        doc = ev.as_dict()
        if metrics is not None:
            metrics.observe(doc)
            if ev.event in ("up", "restart", "stored", "pruned"):
                count_store()
        if json_out:
            out.json_line(doc)
            return
        line = Text(f"{doc['time']} ")
        line.append(ev.event, style=style_of(ev.event, "bold"))
        line.append(f" {remote._plain(ev.message)}")
        out.err.print(line)

    from slotctl.server.flags import ServerFlags

    given = remote.given_params(ctx) & {"kv_unified", "cache_type_k", "cache_type_v"}
    flags = ServerFlags(kv_unified=kv_unified, cache_type_k=cache_type_k or ServerFlags().cache_type_k,
                        cache_type_v=cache_type_v or ServerFlags().cache_type_v)
    keeper = Keeper(server, slot_dir, store, every=every, min_tokens=min_tokens, max_size=size, api_key=api_key,
                    timeout=timeout, emit=emit, retention=keep_newest, prove=prove_restores, force=force,
                    flags=flags, given=frozenset(given), allow_lossy=allow_lossy, catalog=not no_cache)

    def count_store() -> None:
        try:
            metrics.store_usage(*keeper.store.usage())
        except (SlotctlError, OSError) as e:
            metrics.store_failed(str(e))

    from slotctl.live import router

    model = router.model_for(keeper.url)   # one keeper per router's model and store
    held = locks.acquire(store if store is not None else slot_dir,
                         keeper.url + (f" (model {model})" if model else ""), ttl=lease)
    keeper.lock = held
    endpoint = watchdog = None
    try:
        if isinstance(held, locks.Lease):
            held.start(keeper.abandon)
        if listen is not None:
            from slotctl.unattended.metrics import Endpoint, KeepMetrics, StoreProbe

            metrics = KeepMetrics(keeper.url)
            keeper.on_look = metrics.look
            count_store()
            probe = StoreProbe(str(store if store is not None else slot_dir))
            from slotctl.fleet.ui import keeper_page

            endpoint = Endpoint(listen, metrics.registry.exposition,
                                lambda: metrics.ready(3 * keeper.every + keeper.timeout, probe),
                                lambda: _alive(keeper), ui=lambda: keeper_page(keeper)).start()
            if not json_out:
                out.err.print(f"metrics: {endpoint.url}/metrics, /livez, /readyz; the slots: {endpoint.url}/ui",
                              markup=False, highlight=False)
        wd = systemd.watchdog_seconds()
        if wd is not None:      # its pings begin after READY=1 (a ping before it would precede the ready)
            watchdog = systemd.Watchdog(lambda: _alive(keeper)[0], wd)
        def stopping(*_) -> None:
            systemd.notify("STOPPING=1")
            keeper.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stopping)
        if save_all or restore_all:
            if watchdog is not None:
                watchdog.start()
            code = keeper.once(restore=restore_all)
        else:
            systemd.notify("READY=1", f"STATUS=keeping {keeper.url} (store {keeper.store})")
            if watchdog is not None:
                watchdog.start()
            code = keeper.run()
    finally:
        if watchdog is not None:
            watchdog.stop()
        if endpoint is not None:
            endpoint.stop()
        held.release()
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
