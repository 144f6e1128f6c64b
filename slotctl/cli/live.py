"""Live mode: commands that talk to a running llama-server (``slotctl slots``, ``slotctl erase``).

``save``, ``restore`` and ``validate`` take ``--server URL`` too, through :mod:`slotctl.cli.remote`. Every
request goes through :mod:`slotctl.live.http`: bounded by ``--timeout``, the API key from ``--api-key`` or
``LLAMA_API_KEY``; a refusal by the server exits 1, an unreachable server, a wrong key or a usage error
exits 2, always with one line on stderr.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from slotctl.cli import remote
from slotctl.cli.common import handle_errors
from slotctl.cli.command_line import ArgsCommand
from slotctl.cli.options import (ApiKeyOpt, ConfigOpt, JsonOpt, RouterModelOpt, ServerOpt, ServerSlotOpt, TimeoutOpt,
                                 store_option)
from slotctl.cli.output import Output, style_of
from slotctl.cli.remote import _cell, _plain
from slotctl.errors import UsageError
from slotctl.live import DEFAULT_TIMEOUT
from slotctl.live import http as server_api


def register(app: typer.Typer) -> None:
    app.command("slots", cls=ArgsCommand)(slots)
    app.command("erase", cls=ArgsCommand)(erase)


@handle_errors
def slots(
    server: Annotated[Optional[list[str]], typer.Option("--server", metavar="URL", help="A llama-server's base URL, "
                                                        "e.g. http://127.0.0.1:8080; repeat it for several "
                                                        "servers (one table).")] = None,
    store: Annotated[Optional[str], store_option("The store of the servers given with --server (a directory or an "
                                                 "s3:// prefix, keep's names): each slot's stored states and "
                                                 "the predicted reuse of the best.")] = None,
    config: ConfigOpt = None,
    router_model: RouterModelOpt = None,
    watch: Annotated[Optional[float], typer.Option("--watch", min=0.1, max=86400.0, metavar="SECONDS",
                                                   help="Read again every SECONDS: redrawn in place on a terminal, "
                                                        "the rows alone on a pipe; Ctrl-C stops.")] = None,
    api_key: ApiKeyOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    json_out: JsonOpt = False,
) -> None:
    """List a running llama-server's slots: id, context size, speculative decoding, busy, cached tokens.

    Reads GET /slots and GET /props. With --json: {server, model, total_slots, props, slots}, where slots
    and props are the server's answers as they came. Several servers (--server repeated, or --config), or
    a --store: one table of every server's slots (model, slot, tokens, idle or busy, last saved, the
    states stored for the slot and the server's model, from --store or each server's store in --config,
    and the predicted reuse of the best of them: validate's verdict and prediction for the server now
    running); --json: {servers: [...], exit_code}; --watch redraws it. A router's entry in --config
    without a model: one entry per model of the router, loaded or not (not loaded: the states the
    store holds for it, not judged; never loaded by the look).

    Exit codes: 0 listed; 1 the server refused (e.g. started with --no-slots); 2 unreachable, wrong API
    key, usage error (with several servers: the worst, every server still shown).
    """
    out = Output(json_mode=json_out)
    servers = list(server or [])
    if router_model is not None:
        if len(servers) != 1:
            raise UsageError("--router-model goes with one --server URL, the router (in --config: a server entry's "
                             "model)")
        servers = [remote.server_url(servers[0], router_model)]
    if config is None and watch is None and store is None and len(servers) == 1:
        return _one_server(out, servers[0], api_key, timeout, json_out)
    from slotctl.cli.common import use_store
    from slotctl.fleet.view import Target

    if store is not None:
        use_store([store])
    targets = [Target(u, store=store, api_key=api_key) for u in servers]
    if config is not None:
        from slotctl.unattended.config import load

        cfg = load(config)
        targets += [Target(e.url, e.name, e.store or store, e.api_key() or api_key, e.model) for e in cfg.servers]
        use_store([e.store for e in cfg.servers])
    if not targets:
        raise UsageError("--server: no URL given (nor [[servers]] in --config)")
    if watch is None:
        raise typer.Exit(_fleet_once(out, targets, timeout, json_out))
    _watch(out, targets, timeout, json_out, watch)


def _fleet_once(out: Output, targets, timeout: float, json_out: bool, *, rows_only: bool = False,
                line: bool = False) -> int:
    from slotctl.errors import worst
    from slotctl.fleet.view import fleet

    docs = fleet(targets, timeout)
    code = int(worst(d["exit_code"] for d in docs))
    servers = [{k: v for k, v in d.items() if k != "exit_code"} for d in docs]
    if json_out:
        (out.json_line if line else out.json)({"servers": servers, "exit_code": code})
    elif rows_only:
        from slotctl.fleet.view import rows

        out._stdout.write("".join("\t".join(map(_plain, row)) + "\n" for row in rows(servers)))
    else:
        render_fleet(out, servers)
    if not json_out:
        for d in servers:
            if d["error"] is not None:
                out.err.print(Text(f"{_plain(d['name'] or d['server'])}: {_plain(d['error']['message'])}"))
    return code


def render_fleet(out: Output, servers: list[dict]) -> None:
    from slotctl.fleet.view import COLUMNS, rows, summary

    t = Table(show_edge=False)
    for col in COLUMNS:
        t.add_column(col, justify="right" if col in ("slot", "tokens", "stored", "best reuse") else "left")
    for row in rows(servers):
        style = {"busy": "yellow", "idle": "green", "error": "bold red"}.get(row[4], "dim")    # a router's model not loaded
        t.add_row(*map(_plain, row[:4]), Text(row[4], style=style), *map(_plain, row[5:]))
    out.table(t, keep=("slot", "tokens", "state", "last saved", "stored", "best reuse"))
    out.print(Text(summary(servers), style="dim"))


def _watch(out: Output, targets, timeout: float, json_out: bool, every: float) -> None:
    """Redraw in place on a terminal (the cursor home, the screen cleared below); the rows alone (or one JSON
    line) per refresh on a pipe. Ctrl-C stops with exit 0."""
    import sys
    import time

    tty = out.console.is_terminal and not json_out
    try:
        while True:
            if tty:
                with out.console.capture() as cap:
                    _fleet_once(out, targets, timeout, json_out)
                sys.stdout.write("\x1b[H\x1b[J" + cap.get())
                sys.stdout.flush()
            else:
                _fleet_once(out, targets, timeout, json_out, rows_only=True, line=True)
                out._stdout.flush()
            time.sleep(every)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _one_server(out: Output, server: str, api_key, timeout: float, json_out: bool) -> None:
    url = server_api.normalize_url(server)
    slot_list = server_api.get_slots(url, api_key=api_key, timeout=timeout)
    props = server_api.get_props(url, api_key=api_key, timeout=timeout)
    if not isinstance(props, dict):
        props = {}
    doc = {
        "server": url,
        "model": props.get("model_path"),
        "total_slots": props.get("total_slots", len(slot_list)),
        "props": props,
        "slots": slot_list,
        "exit_code": 0,
    }
    if json_out:
        out.json(doc)
        return
    render_slots(out, doc)


def render_slots(out: Output, doc: dict) -> None:
    props = doc["props"]
    head = Text.assemble((_plain(doc["server"]), "bold"))
    if doc["model"]:
        head.append(f"  model {_plain(str(doc['model']))}")
    if props.get("build_info"):
        head.append(f"  ({_plain(str(props['build_info']))})", style="dim")
    out.print(head)
    t = Table(show_edge=False)
    for col, just in (("slot", "right"), ("n_ctx", "right"), ("speculative", "left"), ("state", "left"),
                      ("cached tokens", "right"), ("task", "right")):
        t.add_column(col, justify=just)
    for s in doc["slots"]:
        if not isinstance(s, dict):
            continue
        busy = s.get("is_processing")
        t.add_row(
            _cell(s.get("id")),
            _cell(s.get("n_ctx")),
            "yes" if s.get("speculative") else "no",
            Text("busy", style=style_of("busy")) if busy else Text("idle", style=style_of("idle")),
            _cell(s.get("n_prompt_tokens")),
            _cell(s.get("id_task")),
        )
    out.print(t)
    total = doc.get("total_slots")
    n = len(doc["slots"])
    out.print(Text(f"{n} slot(s)" + (f" of {total}" if isinstance(total, int) and total != n else "")
                   + f", {sum(1 for s in doc['slots'] if isinstance(s, dict) and s.get('is_processing'))} busy",
                   style="dim"))




@handle_errors
def erase(
    server: ServerOpt,
    slot: ServerSlotOpt,
    router_model: RouterModelOpt = None,
    api_key: ApiKeyOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    json_out: JsonOpt = False,
) -> None:
    """Erase a slot of a running llama-server: it forgets its cached prompt (POST /slots/N?action=erase).

    A busy slot is erased when its current request ends; --timeout bounds the wait. With --json: the
    server's answer, {id_slot, n_erased}.

    Exit codes: 0 erased; 1 the server refused (invalid slot id, no --slot-save-path: the server allows
    slot actions only then); 2 unreachable, wrong API key, usage error.
    """
    out = Output(json_mode=json_out)
    url = remote.server_url(server, router_model)
    answer = server_api.erase_slot(url, slot, api_key=api_key, timeout=timeout)
    if json_out:
        out.json({"server": url, "slot": slot, "answer": answer, "exit_code": 0})
        return
    n = answer.get("n_erased") if isinstance(answer, dict) else None
    out.print(f"slot {slot}: erased" + (f" {n:,} cached token(s)" if isinstance(n, int) else ""))


