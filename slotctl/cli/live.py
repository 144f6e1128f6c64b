"""Live mode: commands that talk to a running llama-server (``slotctl slots``, ``slotctl erase``).

``save``, ``restore`` and ``validate`` take ``--server URL`` too, through :mod:`slotctl.cli.remote`. Every
request goes through :mod:`slotctl.live.http`: bounded by ``--timeout``, the API key from ``--api-key`` or
``LLAMA_API_KEY``; a refusal by the server exits 1, an unreachable server, a wrong key or a usage error
exits 2, always with one line on stderr.
"""

from __future__ import annotations

import typer
from rich.table import Table
from rich.text import Text

from slotctl.cli.common import handle_errors
from slotctl.cli.options import ApiKeyOpt, JsonOpt, ServerOpt, ServerSlotOpt, TimeoutOpt
from slotctl.cli.output import Output, style_of
from slotctl.cli.remote import _cell, _plain
from slotctl.live import DEFAULT_TIMEOUT
from slotctl.live import http as server_api


def register(app: typer.Typer) -> None:
    app.command("slots")(slots)
    app.command("erase")(erase)


@handle_errors
def slots(
    server: ServerOpt,
    api_key: ApiKeyOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    json_out: JsonOpt = False,
) -> None:
    """List a running llama-server's slots: id, context size, speculative decoding, busy, cached tokens.

    Reads GET /slots and GET /props. With --json: {server, model, total_slots, props, slots}, where slots
    and props are the server's answers as they came.

    Exit codes: 0 listed; 1 the server refused (e.g. started with --no-slots); 2 unreachable, wrong API
    key, usage error.
    """
    out = Output(json_mode=json_out)
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
    url = server_api.normalize_url(server)
    answer = server_api.erase_slot(url, slot, api_key=api_key, timeout=timeout)
    if json_out:
        out.json({"server": url, "slot": slot, "answer": answer, "exit_code": 0})
        return
    n = answer.get("n_erased") if isinstance(answer, dict) else None
    out.print(f"slot {slot}: erased" + (f" {n:,} cached token(s)" if isinstance(n, int) else ""))


