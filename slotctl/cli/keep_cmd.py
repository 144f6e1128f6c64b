"""``slotctl keep``: keep a running llama-server's slots across its restarts (:mod:`slotctl.fleet.keep`)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from slotctl.cli import remote
from slotctl.cli.common import handle_errors
from slotctl.cli.options import ApiKeyOpt, ServerOpt, TimeoutOpt, store_option
from slotctl.live import SLOT_FILE_TIMEOUT
from slotctl.cli.output import Output, style_of
from slotctl.errors import UsageError



def register(app: typer.Typer) -> None:
    app.command("keep")(keep)


@handle_errors
def keep(
    server: ServerOpt,
    slot_dir: Annotated[Path, typer.Option("--slot-dir", file_okay=False, metavar="DIR",
                                           help="The server's --slot-save-path as this machine sees it.")],
    store: Annotated[Optional[str], store_option("Where the states are kept: a directory or an s3:// prefix "
                                                 "(docs/store.md; default: --slot-dir itself).")] = None,
    every: Annotated[float, typer.Option("--every", min=0.05, metavar="SECONDS", help="Seconds between two looks "
                                         "at the server.")] = 30.0,
    min_tokens: Annotated[int, typer.Option("--min-tokens", min=1, metavar="N", help="Save only slots whose last "
                                            "prompt had at least N tokens.")] = 1,
    max_size: Annotated[Optional[str], typer.Option("--max-size", metavar="SIZE", help="Keep the store under SIZE "
                                                    "(20G, 500M) by prune's rules, least recently used first "
                                                    "(a directory store only).")] = None,
    api_key: ApiKeyOpt = None,
    timeout: TimeoutOpt = SLOT_FILE_TIMEOUT,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON line per action on stdout "
                                           "(docs/json.md) instead of log lines on stderr.")] = False,
) -> None:
    """Keep a running llama-server's slots across its restarts: save idle slots, restore them after.

    A foreground process (for systemd or a container). Every --every seconds: each idle slot whose
    last task changed is saved by the server, checked, and copied into the store (one file per state,
    named by slot, model and a hash of its tokens); the store is kept under --max-size by prune's
    rules; when the server comes back after being down, or runs another model, every empty slot gets
    the newest state that validates for it, restored and proven (restore --prove). One log line per
    action; --json: one JSON line each. SIGTERM or SIGINT: a last save of the changed slots, exit 0.
    Details: docs/fleet.md.

    Exit codes: 0 stopped by SIGTERM or SIGINT; 2 usage error (a missing directory, a bad --max-size).
    """
    from slotctl.fleet.keep import Keeper

    out = Output(json_mode=json_out)
    if not slot_dir.is_dir():
        raise UsageError(f"--slot-dir {slot_dir}: not a directory")
    if store is not None and "://" in store and not store.startswith("s3://"):
        raise UsageError(f"--store {store}: a directory or an s3://BUCKET/PREFIX/")
    if store is not None and "://" not in store and not Path(store).is_dir():
        raise UsageError(f"--store {store}: not a directory")
    size = None
    if max_size is not None:
        from slotctl.prune import parse_size

        size = parse_size(max_size)

    def emit(ev) -> None:
        if json_out:
            out.json_line(ev.as_dict())
            return
        line = Text(f"{ev.as_dict()['time']} ")
        line.append(ev.event, style=style_of(ev.event, "bold"))
        line.append(f" {remote._plain(ev.message)}")
        out.err.print(line)

    keeper = Keeper(server, slot_dir, store, every=every, min_tokens=min_tokens, max_size=size, api_key=api_key,
                    timeout=timeout, emit=emit)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: keeper.stop())
    raise typer.Exit(keeper.run())
