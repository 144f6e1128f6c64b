"""``slotctl serve``: a prompt cache on disk and in S3 in front of a llama-server (:mod:`slotctl.serve`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from slotctl.cli import remote
from slotctl.cli.common import handle_errors
from slotctl.cli.options import ApiKeyOpt, ArgsCommand, flag_option
from slotctl.cli.output import Output
from slotctl.errors import UsageError
from slotctl.live import SLOT_FILE_TIMEOUT

_STYLE = {"restored": "green", "stored": "green", "up": "green", "down": "yellow", "refused": "yellow",
          "pruned": "yellow", "disconnect": "yellow", "upstream": "bold red", "error": "bold red"}
_LISTEN = re.compile(r"^(?P<host>[^:\s]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")


def register(app: typer.Typer) -> None:
    app.command("serve", cls=ArgsCommand)(serve)


def parse_listen(text: str) -> tuple[str, int]:
    m = _LISTEN.match(text)
    if not m or not 0 <= int(m.group("port")) <= 65535:
        raise UsageError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8081")
    return m.group("host").strip("[]"), int(m.group("port"))


@handle_errors
def serve(
    ctx: typer.Context,
    upstream: Annotated[str, typer.Option("--upstream", metavar="URL", help="The llama-server (or llama-swap) "
                                          "to serve, e.g. http://127.0.0.1:8080.")],
    slot_dir: Annotated[Path, typer.Option("--slot-dir", file_okay=False, metavar="DIR",
                                           help="The server's --slot-save-path as this machine sees it.")],
    store: Annotated[Optional[str], typer.Option("--store", metavar="DIR|s3://BUCKET/PREFIX/",
                                                 help="Where the states are kept: a directory or an s3:// prefix "
                                                      "(docs/store.md; default: --slot-dir itself).")] = None,
    listen: Annotated[str, typer.Option("--listen", metavar="HOST:PORT", help="Where serve listens (port 0: "
                                        "any free port, said on the first line).")] = "127.0.0.1:8081",
    max_size: Annotated[Optional[str], typer.Option("--max-size", metavar="SIZE", help="Keep the store under SIZE "
                                                    "(20G, 500M) by prune's rules, least recently used first.")] = None,
    min_gain: Annotated[int, typer.Option("--min-gain", min=1, metavar="N", help="Restore a stored state only "
                                          "when it keeps at least N prompt tokens more than the slot "
                                          "holds.")] = 16,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Do not use the catalog (the SQLite index of the "
                                           "stored states' tokens): read every stored state.")] = False,
    kv_unified: Annotated[bool, typer.Option("--kv-unified", "-kvu", help="The server runs with -kvu (not "
                                             "reported by the server): states are judged, and converted, for "
                                             "it.")] = False,
    cache_type_k: Annotated[Optional[str], flag_option("cache_type_k", help="The server's -ctk (not reported; "
                                                       "default f16).")] = None,
    cache_type_v: Annotated[Optional[str], flag_option("cache_type_v", help="The server's -ctv (not reported; "
                                                       "default f16).")] = None,
    api_key: ApiKeyOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.001, metavar="SECONDS", help="Give up on a save "
                                           "or restore after this many seconds.")] = SLOT_FILE_TIMEOUT,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON line per event on stdout "
                                           "(docs/json.md), the first saying where serve listens.")] = False,
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
    types never re-encoded) and judged again. GET /slotctl/stats: counters.
    SIGTERM or SIGINT: saves in progress finish, exit 0. Needs the [serve] extra (aiohttp). Details:
    docs/serve.md.

    Exit codes: 0 stopped by SIGTERM or SIGINT; 2 usage error (a missing directory, a bad --listen,
    the [serve] extra missing, the address in use).
    """
    host, port = parse_listen(listen)
    remote.check_slot_dir_and_store(slot_dir, store)
    size = None
    if max_size is not None:
        from slotctl.prune import parse_size

        size = parse_size(max_size)
    from slotctl.serve import main
    from slotctl.server.flags import ServerFlags

    given = remote.given_params(ctx) & {"kv_unified", "cache_type_k", "cache_type_v"}
    flags = ServerFlags(kv_unified=kv_unified, cache_type_k=cache_type_k or ServerFlags().cache_type_k,
                        cache_type_v=cache_type_v or ServerFlags().cache_type_v)
    out = Output(json_mode=json_out)

    def emit(event: str, message: str, details: dict) -> None:
        if json_out:
            out.json_line({"time": _now(), "event": event, "message": message, "details": details})
            return
        from rich.text import Text

        line = Text(f"{_now()} ")
        line.append(event, style=_STYLE.get(event, "bold"))
        line.append(f" {remote._plain(message)}")
        out.err.print(line)

    raise typer.Exit(main.serve(upstream, slot_dir, store, host=host, port=port, max_size=size, min_gain=min_gain,
                                api_key=api_key, timeout=timeout, catalog=not no_cache,
                                flags=flags, given=frozenset(given), emit=emit))


def _now() -> str:
    import time

    from slotctl.catalog import iso_time

    return iso_time(time.time())
