"""Live mode: commands that talk to a running llama-server.

``slotctl slots`` and ``slotctl erase`` live here; ``save``, ``restore`` and ``validate`` take ``--server URL``
and hand over to :func:`save_on_server`, :func:`restore_on_server` and :func:`learn_validate`.

Every request goes through :mod:`slotctl.server.http`: bounded by ``--timeout``, the API key from
``--api-key`` or ``LLAMA_API_KEY``; a refusal by the server exits 1, an unreachable server, a wrong key
or a usage error exits 2, always with one line on stderr.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

from slotctl.server import http as server_api
from slotctl.cli.common import handle_errors
from slotctl.cli.options import JsonOpt
from slotctl.cli.output import Output, escape_text, markup_safe
from slotctl.errors import UsageError

# -- options shared by every live command (save/restore --server reuse them) ------------------------------

ServerOpt = Annotated[str, typer.Option("--server", metavar="URL",
                                        help="The llama-server's base URL, e.g. http://127.0.0.1:8080.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option("--api-key", envvar=server_api.API_KEY_ENV, show_envvar=True,
                                                  help="The server's API key (sent as Authorization: Bearer).")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.001, metavar="SECONDS",
                                           help="Give up on a request after this many seconds.")]
ServerSlotOpt = Annotated[int, typer.Option("--slot", min=0, help="The slot id (0, 1, ...).")]

# ... and their forms for commands that also work without a server (save, restore, validate)

LiveServerOpt = Annotated[Optional[str], typer.Option("--server", metavar="URL",
                                                      help="Act through a running llama-server at this base URL "
                                                           "(live mode, docs/live.md).")]
#: save and restore: the server writes or reads the whole slot, and waits for a busy slot to be idle first
SLOT_FILE_TIMEOUT = 600.0
SlotFileTimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.001, metavar="SECONDS",
                                                   help="With --server: give up on a request after this many "
                                                        "seconds.")]
LiveTimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.001, metavar="SECONDS",
                                               help="With --server: give up on a request after this many seconds.")]
LiveApiKeyOpt = Annotated[Optional[str], typer.Option("--api-key", envvar=server_api.API_KEY_ENV, show_envvar=True,
                                                      help="With --server: the server's API key (sent as "
                                                           "Authorization: Bearer).")]
LocalModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", dir_okay=False,
                                                       help="The target model's GGUF (llama-server -m); needed "
                                                            "unless --server.")]

#: parameters save and restore take in live mode; any other one given is a usage error there
_LIVE_PARAMS = frozenset({"server", "api_key", "timeout", "slot", "json_out", "verbose", "name", "file"})
#: parameters that only live mode takes
_SERVER_ONLY = ("api_key", "timeout")


def register(app: typer.Typer) -> None:
    app.command("slots")(slots)
    app.command("erase")(erase)


# -- the command line as given ------------------------------------------------------------------------------


class RawArgsCommand(TyperCommand):
    """A typer command that also keeps each parameter's value as typed (``ctx.meta["slotctl.raw"]``).

    typer turns a ``Path`` argument into a ``pathlib.Path``, which drops a trailing ``/``, a leading ``./``
    and doubled slashes: ``restore --server URL x/`` would send ``x``. Live mode checks the name as typed.
    """

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        try:
            opts, _, _ = self.make_parser(ctx).parse_args(args=list(args))
            ctx.meta["slotctl.raw"] = dict(opts)
        except Exception:  # noqa: BLE001 - the real parse below reports whatever is wrong
            pass
        return super().parse_args(ctx, args)


def raw_value(ctx: typer.Context | None, name: str, default: Any = None) -> Any:
    """The value of parameter ``name`` as typed on the command line (see :class:`RawArgsCommand`)."""
    raw = ctx.meta.get("slotctl.raw") if ctx is not None else None
    if isinstance(raw, dict) and isinstance(raw.get(name), str):
        return raw[name]
    return default


def _source(ctx: typer.Context | None, name: str) -> str | None:
    """Where parameter ``name`` came from: "COMMANDLINE", "ENVIRONMENT", "DEFAULT", ... (None: no context)."""
    if ctx is None:
        return None
    src = ctx.get_parameter_source(name)
    return getattr(src, "name", None)


def given_params(ctx: typer.Context | None) -> set[str]:
    """The command's parameters given on the command line or by environment variable."""
    if ctx is None:
        return set()
    return {p.name for p in ctx.command.params if _source(ctx, p.name) in ("COMMANDLINE", "ENVIRONMENT")}


def option_name(ctx: typer.Context | None, name: str) -> str:
    """How parameter ``name`` of the command is written: ``-o/--output``, ``--continue``, ``NAME``."""
    param = next((p for p in ctx.command.params if p.name == name), None) if ctx is not None else None
    if param is None:
        return name
    if param.param_type_name == "argument":
        return param.human_readable_name
    long = param.opts[0]
    short = min(param.opts, key=len)
    return f"{short}/{long}" if short != long else long


def refuse_local_options(ctx: typer.Context | None, command: str, why: str) -> None:
    """UsageError naming every option typed that live mode of ``command`` does not take."""
    if ctx is None:
        return
    local = [p.name for p in ctx.command.params
             if p.name not in _LIVE_PARAMS and _source(ctx, p.name) == "COMMANDLINE"]
    if local:
        names = ", ".join(option_name(ctx, n) for n in local)
        raise UsageError(f"{command} --server: {names} {'is' if len(local) == 1 else 'are'} for a local "
                         f"{command} only ({why})")


def require_local(ctx: typer.Context | None, command: str, **required: Any) -> None:
    """Local mode (no ``--server``): the options it needs are there and no live-only option was typed."""
    live_only = [n for n in _SERVER_ONLY if _source(ctx, n) == "COMMANDLINE"]
    if live_only:
        names = ", ".join(option_name(ctx, n) for n in live_only)
        raise UsageError(f"{names} {'goes' if len(live_only) == 1 else 'go'} with --server URL (live mode)")
    for name, value in required.items():
        if value is None:
            raise UsageError(f"missing option {option_name(ctx, name)} (or act through a running llama-server: "
                             f"{command} --server URL --slot N NAME)")


@handle_errors
def slots(
    server: ServerOpt,
    api_key: ApiKeyOpt = None,
    timeout: TimeoutOpt = server_api.DEFAULT_TIMEOUT,
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
            Text("busy", style="yellow") if busy else Text("idle", style="green"),
            _cell(s.get("n_prompt_tokens")),
            _cell(s.get("id_task")),
        )
    out.print(t)
    total = doc.get("total_slots")
    n = len(doc["slots"])
    out.print(Text(f"{n} slot(s)" + (f" of {total}" if isinstance(total, int) and total != n else "")
                   + f", {sum(1 for s in doc['slots'] if isinstance(s, dict) and s.get('is_processing'))} busy",
                   style="dim"))


def _plain(text: str) -> str:
    """Untrusted text for a rich ``Text`` (which reads no markup): control characters escaped only."""
    return escape_text(text, keep_newlines=False)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else markup_safe(str(v))


@handle_errors
def erase(
    server: ServerOpt,
    slot: ServerSlotOpt,
    api_key: ApiKeyOpt = None,
    timeout: TimeoutOpt = server_api.DEFAULT_TIMEOUT,
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
        out.json(answer)
        return
    n = answer.get("n_erased") if isinstance(answer, dict) else None
    out.print(f"slot {slot}: erased" + (f" {n:,} cached token(s)" if isinstance(n, int) else ""))


# -- save / restore --server ----------------------------------------------------------------------------------

#: what each key of a slot action's answer means (llama-server b11434)
_ANSWER_KEYS = {
    "id_slot": "the slot",
    "filename": "the file, in the server's --slot-save-path",
    "n_saved": "tokens saved (the packed token record)",
    "n_written": "bytes written (the whole file)",
    "n_restored": "tokens restored",
    "n_read": "bytes read (to the end of the target payload)",
    "n_erased": "cached tokens erased",
    "timings.save_ms": "milliseconds the server took to write",
    "timings.restore_ms": "milliseconds the server took to read",
}


def save_on_server(ctx: typer.Context | None, out: Output, server: str, name: str | None, *, slot: int,
                   api_key: str | None, timeout: float, json_out: bool) -> None:
    """``slotctl save --server URL --slot N NAME``: the server writes slot N to NAME in its --slot-save-path."""
    refuse_local_options(ctx, "save", "the server saves the slot as it holds it, into its --slot-save-path")
    if name is None:
        raise UsageError("save --server: give the file name, NAME, as in `slotctl save --server URL --slot N "
                         "NAME` (the server writes it into its --slot-save-path)")
    url = server_api.normalize_url(server)
    answer = server_api.save_slot(url, slot, name, api_key=api_key, timeout=timeout)
    _answer(out, answer, json_out, url, f"slot {slot} saved to {name}")


def restore_on_server(ctx: typer.Context | None, out: Output, server: str, name: str, *, slot: int,
                      api_key: str | None, timeout: float, json_out: bool) -> None:
    """``slotctl restore --server URL --slot N NAME``: the server restores NAME from its --slot-save-path.

    NAME is taken as typed (:func:`raw_value`), not as the ``Path`` typer made of it.
    """
    refuse_local_options(ctx, "restore", "the server restores the file with its own model and flags")
    name = raw_value(ctx, "file", name)
    url = server_api.normalize_url(server)
    answer = server_api.restore_slot(url, slot, name, api_key=api_key, timeout=timeout)
    _answer(out, answer, json_out, url, f"{name} restored into slot {slot}")


def _answer(out: Output, answer: Any, json_out: bool, url: str, head: str) -> None:
    if json_out:
        out.json(answer)
        return
    out.print(Text.assemble((_plain(url), "bold"), "  ", _plain(head)))
    if not isinstance(answer, dict):
        out.print(markup_safe(str(answer)))
        return
    t = Table(show_edge=False)
    for col, just in (("key", "left"), ("value", "right"), ("meaning", "left")):
        t.add_column(col, justify=just)
    for key, value in _flatten(answer):
        t.add_row(markup_safe(key), _cell(value), Text(_ANSWER_KEYS.get(key, ""), style="dim"))
    out.print(t)


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    rows = []
    for k, v in d.items():
        if isinstance(v, dict):
            rows += _flatten(v, f"{prefix}{k}.")
        else:
            rows.append((f"{prefix}{k}", v))
    return rows


# -- validate --server ------------------------------------------------------------------------------------------


@dataclass
class LiveValidate:
    """The flags ``validate --server`` validates with, what the server said, and where each flag came from.

    ``sources`` maps each flag to ``"server"`` (learned from /props, /slots), ``"command line"`` (given:
    flags given win) or ``"default"`` (neither: slotctl's default, which is llama-server's).
    """

    facts: server_api.ServerFacts
    model: Path | None
    draft_model: Path | None
    ctx_size: int
    parallel: int
    kv_unified: bool
    slot: int
    mmproj: bool
    learned: dict
    flags: dict
    sources: dict
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        f = self.facts
        return {"url": f.url, "build_info": f.build_info, "learned": self.learned, "flags": self.flags,
                "sources": self.sources, "notes": self.notes, "warnings": self.warnings}

    def annotate(self, doc: dict) -> dict:
        """``validate --json``'s document with this under ``server.live``."""
        doc.setdefault("server", {})["live"] = self.as_dict()
        return doc


def learn_validate(ctx: typer.Context | None, server: str, *, api_key: str | None, timeout: float, model: Path | None,
                   draft_model: Path | None, ctx_size: int, parallel: int, kv_unified: bool, slot: int,
                   mmproj: bool, unreported: dict[str, Any]) -> LiveValidate:
    """The flags to validate with for the server at ``server``: its own where it says them, given ones first.

    Learned: ``-m`` (``/props`` ``model_path``, used when that file exists on this machine), ``-np``
    (``total_slots``), ``-c`` (the slot's ``n_ctx`` from ``/slots``, times ``-np`` unless ``-kvu``), whether it
    has a multimodal projector (``modalities``), and whether the slot decodes speculatively (``/slots``).
    Not reported by b11434, so taken as given (or defaulted), each said in a note: the draft model,
    ``-kvu``, and the flags in ``unreported`` (flag -> (parameter name, value): ``{"-ctk": ("cache_type_k",
    "f16"), ...}``). UsageError when the server's model is not on this machine and no ``-m`` is given.
    """
    given = given_params(ctx)
    facts = server_api.server_facts(server, slot, api_key=api_key, timeout=timeout)
    notes = list(facts.notes)
    warnings: list[str] = []
    sources: dict[str, str] = {}
    learned = {"model": facts.model_path, "total_slots": facts.total_slots, "n_ctx_slot": facts.n_ctx_slot,
               "n_ctx_from": facts.n_ctx_from, "speculative": facts.speculative,
               "speculative_types": facts.speculative_types, "mmproj": facts.mmproj,
               "model_meta": facts.model_meta}

    # -np
    if "parallel" in given:
        sources["parallel"] = "command line"
        if facts.total_slots is not None and facts.total_slots != parallel:
            notes.append(f"the server has {facts.total_slots} slot(s); validated for -np {parallel} as given")
    elif facts.total_slots is not None and facts.total_slots > 0:
        parallel, sources["parallel"] = facts.total_slots, "server"
    else:
        sources["parallel"] = "default"
        notes.append(f"/props has no total_slots: validated for -np {parallel}")
    if facts.total_slots and slot >= facts.total_slots and "parallel" not in given:
        raise UsageError(f"--slot {slot}: the server at {facts.url} has {facts.total_slots} slot(s), "
                         f"0..{facts.total_slots - 1}")

    # -kvu: not reported
    sources["kv_unified"] = "command line" if "kv_unified" in given else "default"
    if "kv_unified" not in given and parallel > 1:
        notes.append("the server does not report whether its cache is unified (-kvu): validated without; a "
                     "server started without -np runs 4 slots with a unified cache, pass -kvu for one")

    # -c
    n_stream = 1 if kv_unified else parallel
    if "ctx_size" in given:
        sources["ctx_size"] = "command line"
        if facts.n_ctx_slot is not None and ctx_size and ctx_size // n_stream != facts.n_ctx_slot:
            notes.append(f"the server's slots hold {facts.n_ctx_slot:,} tokens (GET {facts.n_ctx_from}); "
                         f"validated with -c {ctx_size} as given")
    elif facts.n_ctx_slot is not None and facts.n_ctx_slot > 0:
        ctx_size, sources["ctx_size"] = facts.n_ctx_slot * n_stream, "server"
    else:
        sources["ctx_size"] = "default"
        notes.append(f"the server did not say its slot context: validated with -c {ctx_size}")

    # --mmproj: only whether there is one matters
    if "mmproj" in given:
        sources["mmproj"] = "command line"
    else:
        mmproj, sources["mmproj"] = facts.mmproj, "server"

    # -m
    if "model" in given and model is not None:
        sources["model"] = "command line"
        if facts.model_path and os.path.abspath(os.fspath(model)) != os.path.abspath(facts.model_path):
            notes.append(f"the server runs {facts.model_path}; validated with -m {model} as given")
    elif facts.model_path is None:
        raise UsageError(f"the server at {facts.url} does not say its model path (GET /props model_path): give "
                         f"its GGUF with -m")
    elif os.path.isfile(facts.model_path):
        model, sources["model"] = Path(facts.model_path), "server"
    else:
        raise UsageError(f"the server's model {facts.model_path} (GET /props model_path, a path on the server's "
                         f"machine) is not a file here: give a copy of the same GGUF with -m")
    warnings += _model_identity(model, facts.model_meta)

    # -md: b11434 names no draft model anywhere
    if draft_model is not None:
        sources["draft_model"] = "command line"
        if facts.speculative is False:
            notes.append(f"GET /slots says slot {slot} does not decode speculatively (no draft model), yet -md was "
                         f"given: validated with it as asked")
        else:
            notes.append("the server does not name its draft model (b11434's /props and /slots do not): the "
                         "draft state is checked against -md as given")
    else:
        sources["draft_model"] = "unknown"
        if facts.speculative:
            types = f", speculative.types {facts.speculative_types}" if facts.speculative_types else ""
            notes.append(f"slot {slot} decodes speculatively (GET /slots{types}), but the server does not name "
                         f"its draft model (b11434's /props and /slots do not): the draft state (SDFT appendix, "
                         f"draft checkpoint blobs) is checked only with -md")

    # what the server never reports
    if unreported:
        parts = [f"{flag} {_flag_value(value)}" + (" (given)" if name in given else "")
                 for flag, (name, value) in unreported.items()]
        notes.append("not reported by the server, validated with: " + ", ".join(parts)
                     + " (llama-server's defaults unless given: give the server's own flags if it runs others)")
        for name, _value in unreported.values():
            sources[name] = "command line" if name in given else "default"

    flags = {"model": os.fspath(model) if model is not None else None,
             "draft_model": os.fspath(draft_model) if draft_model is not None else None,
             "ctx_size": ctx_size, "parallel": parallel, "kv_unified": kv_unified, "slot": slot, "mmproj": mmproj}
    return LiveValidate(facts=facts, model=model, draft_model=draft_model, ctx_size=ctx_size, parallel=parallel,
                        kv_unified=kv_unified, slot=slot, mmproj=mmproj, learned=learned, flags=flags,
                        sources=sources, notes=notes, warnings=warnings)


def _flag_value(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def _model_identity(model: Path | None, meta: dict | None) -> list[str]:
    """Warnings when the local GGUF is not the server's model (GET /v1/models ``meta``)."""
    if model is None or not isinstance(meta, dict):
        return []
    from slotctl.model.info import read_model_info

    try:
        info = read_model_info(model)
    except Exception:  # noqa: BLE001 - an unreadable model is reported by validate itself
        return []
    mine_all = {"n_vocab": info.n_vocab, "n_embd": info.n_embd, "n_ctx_train": info.n_ctx_train}
    try:  # parameters and tensor bytes: llama_model_n_params and llama_model_size on the server
        import gguf

        tensors = gguf.GGUFReader(os.fspath(model), "r").tensors
        mine_all["n_params"] = sum(int(t.n_elements) for t in tensors)
        mine_all["size"] = sum(int(t.n_bytes) for t in tensors)
    except Exception:  # noqa: BLE001 - the header fields above still tell most models apart
        pass
    diffs = []
    for key, mine in mine_all.items():
        theirs = meta.get(key)
        if isinstance(theirs, int) and not isinstance(theirs, bool) and theirs != mine:
            diffs.append(f"{key} {mine:,} here, {theirs:,} on the server")
    if not diffs:
        return []
    return [f"-m {model} is not the server's model ({'; '.join(diffs)}, GET /v1/models): the verdicts are for "
            f"this model, not the server's"]


def render_live(out: Output, lv: LiveValidate) -> None:
    """The lines ``validate --server`` prints before its verdicts: the server and the flags used, notes.

    Warnings go to stderr in both modes; with ``--json`` nothing else is printed (it is all in ``server.live``).
    """
    for w in lv.warnings:
        out.warn(w)
    if out.json_mode:
        return
    f = lv.facts
    head = Text.assemble((_plain(f.url), "bold"))
    if f.build_info:
        head.append(f"  ({_plain(f.build_info)})", style="dim")
    out.print(head)
    flags = [f"-m {lv.model}" if lv.model is not None else None,
             f"-md {lv.draft_model}" if lv.draft_model is not None else None,
             f"-c {lv.ctx_size}", f"-np {lv.parallel}", "-kvu" if lv.kv_unified else None,
             f"--slot {lv.slot}", "--mmproj (the server has one)" if lv.mmproj else None]
    line = Text("  validating for ")
    line.append(_plain(" ".join(x for x in flags if x)), style="bold")
    learned = [k for k, v in lv.sources.items() if v == "server"]
    if learned:
        line.append(f"  (from the server: {', '.join(learned)})", style="dim")
    out.print(line)
    for n in lv.notes:
        out.print(Text(f"  note: {n}", style="dim"))
