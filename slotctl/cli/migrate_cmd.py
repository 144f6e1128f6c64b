"""``slotctl migrate``: move a slot from one running llama-server to another (:mod:`slotctl.fleet.migrate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from slotctl.cli import remote
from slotctl.cli.common import handle_errors
from slotctl.cli.command_line import ArgsCommand
from slotctl.cli.options import ApiKeyOpt, JsonOpt, TimeoutOpt, flag_option, store_option
from slotctl.live import SLOT_FILE_TIMEOUT
from slotctl.cli.output import Output, style_of
from slotctl.format.ggml import CACHE_TYPE_NAMES



def register(app: typer.Typer) -> None:
    app.command("migrate", cls=ArgsCommand)(migrate)


@handle_errors
def migrate(
    ctx: typer.Context,
    from_url: Annotated[str, typer.Option("--from", metavar="URL", help="The source llama-server's base URL.")],
    slot: Annotated[int, typer.Option("--slot", min=0, help="The source's slot.")],
    to_url: Annotated[str, typer.Option("--to", metavar="URL", help="The destination llama-server's base URL.")],
    from_dir: Annotated[Path, typer.Option("--from-dir", file_okay=False, metavar="DIR",
                                           help="The source's --slot-save-path as this machine sees it.")],
    to_dir: Annotated[Path, typer.Option("--to-dir", file_okay=False, metavar="DIR",
                                         help="The destination's --slot-save-path as this machine sees it.")],
    to_slot: Annotated[Optional[int], typer.Option("--to-slot", min=0, help="The destination's slot (default: "
                                                   "the source's when the destination has it, else an idle "
                                                   "one of the destination).")] = None,
    name: Annotated[Optional[str], typer.Option("--name", help="The file name to save and place under (default "
                                                "migrate-slotN-TIME-PID.bin).")] = None,
    store: Annotated[Optional[str], store_option("Also keep the (converted) file there, and place the store's "
                                                 "copy (docs/store.md).")] = None,
    kv_unified: Annotated[bool, typer.Option("--kv-unified", "-kvu", help="The destination runs with -kvu (not "
                                             "reported by the server).")] = False,
    cache_type_k: Annotated[Optional[str], flag_option("cache_type_k", help="The destination's -ctk (not reported; "
                                                       f"default f16): {', '.join(CACHE_TYPE_NAMES)}.")] = None,
    cache_type_v: Annotated[Optional[str], flag_option("cache_type_v", help="The destination's -ctv (not reported; "
                                                       "default f16).")] = None,
    allow_lossy: Annotated[bool, typer.Option("--allow-lossy", help="Re-encode the cache rows when the "
                                              "destination's cache types differ (lossy; measured).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Send the file even when validate says the destination "
                                        "refuses it or aborts on it.")] = False,
    draft_model: Annotated[Optional[Path], typer.Option(
        "--draft-model", "-md", dir_okay=False, metavar="GGUF",
        help="The draft model both servers run (no server reports it): a state that carries a draft state moves "
             "only with it.")] = None,
    api_key: ApiKeyOpt = None,
    to_api_key: Annotated[Optional[str], typer.Option("--to-api-key", help="The destination's API key (default: "
                                                      "--api-key).")] = None,
    timeout: TimeoutOpt = SLOT_FILE_TIMEOUT,
    json_out: JsonOpt = False,
) -> None:
    """Move a slot from one running llama-server to another: save, check, convert, place, restore, prove.

    Saves the source's slot, reads the file in --from-dir, refuses it before touching the destination
    when it cannot work there (another model, by /v1/models and by the content of the model files the
    servers name, read on this machine; a context too small; flags validate says the server refuses),
    converts it for the destination's -np/-kvu (exact) and cache types (lossy, only
    with --allow-lossy), writes it into --to-dir atomically, restores it into the destination's slot and
    proves it (the file's own prompt, the server's own counts, as restore --prove), then removes its
    working files (the store keeps its copy). A file validate says the destination refuses or aborts on
    is never sent unless --force. The source's slot is never changed. One line per step; --json: one
    document with each step's outcome. Details: docs/fleet.md.

    Exit codes: 0 migrated and proven; 1 refused (nothing sent to the destination), the destination
    refused the file, or the proof found more prompt tokens evaluated than predicted; 2 usage error, a
    server unreachable or an I/O error (the step that failed says which); 3 the proof cannot predict.
    """
    from slotctl.cli.output import hashing_progress
    from slotctl.fleet.migrate import migrate as run
    from slotctl.server.flags import ServerFlags

    out = Output(json_mode=json_out)
    given = remote.given_params(ctx) & {"kv_unified", "cache_type_k", "cache_type_v"}
    flags = ServerFlags(kv_unified=kv_unified, cache_type_k=cache_type_k or ServerFlags().cache_type_k,
                        cache_type_v=cache_type_v or ServerFlags().cache_type_v)
    m = run(from_url, slot, to_url, to_slot, from_dir=from_dir, to_dir=to_dir,
            name=name, store=store, dst_flags=flags, given=frozenset(given), allow_lossy=allow_lossy, api_key=api_key,
            to_api_key=to_api_key, timeout=timeout, force=force, draft_model=draft_model,
            hashing=hashing_progress(out))
    doc = m.as_dict()
    if json_out:
        out.json(doc)
    else:
        render(out, doc)
    failed = next((s for s in doc["steps"] if s["status"] in ("refused", "failed")), None)
    if failed is not None:
        out.error(f"migrate: {failed['step']}: {failed['message']}")
    if doc["exit_code"]:
        raise typer.Exit(doc["exit_code"])


def render(out: Output, doc: dict) -> None:
    src, dst = doc["from"], doc["to"]
    out.print(Text.assemble((remote._plain(f"{src['server']} slot {src['slot']}"), "bold"), " -> ",
                            (remote._plain(f"{dst['server']} slot {dst['slot']}"), "bold"),
                            f"  ({remote._plain(doc['name'])})"))
    t = Table(show_edge=False)
    for col, just in (("step", "left"), ("status", "left"), ("ms", "right"), ("what happened", "left")):
        t.add_column(col, justify=just)
    for s in doc["steps"]:
        t.add_row(s["step"], Text(s["status"], style=style_of(s["status"])),
                  f"{s['ms']:,.1f}" if s["ms"] is not None else "-", remote._plain(s["message"] or ""))
    out.print(t)
    if doc["proof"] is not None:
        remote.render_proof(out, doc["proof"], indent="")
