"""Options shared by several commands, as ``Annotated`` aliases."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from typer.core import TyperCommand

from slotctl.format.ggml import CACHE_TYPE_NAMES

# -- the help panels options are grouped under (``rich_help_panel``); options without one come last --

#: the GGUFs a command reads (-m, -md, --mmproj)
MODEL_PANEL = "Model"
#: what the command prints and how (--json, --verbose, ...)
OUTPUT_PANEL = "Output"
#: llama-server's own flags, as the server takes them
SERVER_PANEL = "Server flags"

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (docs/json.md); a failure "
                                                     "is one too.", rich_help_panel=OUTPUT_PANEL)]
JsonlOpt = Annotated[bool, typer.Option("--jsonl", help="Print one JSON object per file, one per line, as each is "
                                                       "done, then a summary line (docs/json.md).",
                                        rich_help_panel=OUTPUT_PANEL)]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Show only the files that are not fine, and the "
                                                              "summary.", rich_help_panel=OUTPUT_PANEL)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Let logs and llama.cpp's own output through to "
                                          "stderr.", rich_help_panel=OUTPUT_PANEL)]
ModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", help="The target model's GGUF.",
                                                  dir_okay=False, rich_help_panel=MODEL_PANEL)]
DraftModelOpt = Annotated[Optional[Path], typer.Option("--draft-model", "-md", "--spec-draft-model", "--model-draft",
                                                       help="The draft model's GGUF.", dir_okay=False,
                                                       rich_help_panel=MODEL_PANEL)]


SlotOpt = Annotated[int, typer.Option("--slot", min=0, help="The slot (sequence id).")]


# -- the command line as typed ----------------------------------------------------------------------------


class ArgsCommand(TyperCommand):
    """A typer command that also keeps its command line as typed: each parameter's value
    (``ctx.meta["slotctl.raw"]``, see :func:`raw_value`) and the arguments (``ctx.meta["slotctl.args"]``,
    so that a usage error can name a flag as it was written).

    typer turns a ``Path`` argument into a ``pathlib.Path``, which drops a trailing ``/``, a leading ``./``
    and doubled slashes: ``restore --server URL x/`` would send ``x``. Live mode checks the name as typed.
    """

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        ctx.meta["slotctl.args"] = list(args)
        try:
            opts, _, _ = self.make_parser(ctx).parse_args(args=list(args))
            ctx.meta["slotctl.raw"] = dict(opts)
        except Exception:  # noqa: BLE001 - the real parse below reports whatever is wrong
            pass
        return super().parse_args(ctx, args)


def raw_value(ctx: typer.Context | None, name: str, default: Any = None) -> Any:
    """The value of parameter ``name`` as typed on the command line (see :class:`ArgsCommand`)."""
    raw = ctx.meta.get("slotctl.raw") if ctx is not None else None
    if isinstance(raw, dict) and isinstance(raw.get(name), str):
        return raw[name]
    return default


def typed_flag(ctx: typer.Context | None, spellings: tuple[str, ...]) -> str:
    """Which of ``spellings`` the command line used (the last one given wins, as for the value); the
    first spelling when it cannot tell."""
    args = ctx.meta.get("slotctl.args") if ctx is not None else None
    used = spellings[0]
    for arg in args or ():
        if arg == "--":
            break
        name = arg.split("=", 1)[0] if arg.startswith("--") else arg
        if name in spellings:
            used = name
    return used


# -- llama-server's flags (b11434 names), one group shown as a panel: save, restore, validate ---------------

_SERVER_OPTIONS: dict[str, tuple[type, dict]] = {
    "ctx_size": (int, dict(min=0, metavar="N", help="Context size in tokens over all slots; 0 = the model's "
                                                     "training context per slot, as the server picks.")),
    "parallel": (int, dict(min=1, max=256, metavar="N", help="Number of slots (n_seq_max).")),
    "kv_unified": (bool, dict(help="One KV cache stream shared by all slots.")),
    "kv_unified_per_slot": (int, dict(min=0, metavar="N", help="Context limit per slot (0 = unset); without -c "
                                                               "the cache holds -np x N.")),
    "cache_type_k": (str, dict(metavar="TYPE", help="K cache type: " + ", ".join(CACHE_TYPE_NAMES) + ".")),
    "cache_type_v": (str, dict(metavar="TYPE", help="V cache type.")),
    "spec_draft_type_k": (str, dict(metavar="TYPE", help="Draft K cache type (f16 whatever -ctk says).")),
    "spec_draft_type_v": (str, dict(metavar="TYPE", help="Draft V cache type (f16 whatever -ctv says).")),
    "flash_attn": (str, dict(metavar="[on|off|auto]", help="Flash attention (auto is on for the CPU).")),
    "batch_size": (int, dict(min=1, metavar="N", help="Logical batch size.")),
    "ubatch_size": (int, dict(min=1, metavar="N", help="Physical batch size.")),
    "swa_full": (bool, dict(help="Full-size SWA cache (off in the server).")),
    "ctx_checkpoints": (int, dict(min=0, metavar="N", help="Checkpoints the server keeps per slot; the oldest "
                                                           "beyond are dropped.")),
    "checkpoint_min_step": (int, dict(min=0, metavar="N", help="The server's least spacing of the checkpoints it "
                                                               "takes, in tokens.")),
    "spec_draft_n_max": (int, dict(min=0, metavar="N", help="Tokens the draft proposes per step (restore).")),
    "threads": (int, dict(min=0, metavar="N", help="CPU threads; 0 = every core. Speed only: nothing saved "
                                                   "depends on it.")),
}


def flag_option(field: str, **opts: Any) -> Any:
    """A typer option spelled as llama-server spells the :class:`~slotctl.server.flags.ServerFlags` field
    ``field`` (every spelling of :data:`~slotctl.server.flags.FLAGS`, the long one shown first): the server
    panel and a command that takes some of the same flags with another meaning (``convert``'s targets)."""
    from slotctl.server.flags import FLAGS

    spellings = FLAGS[field]
    long = spellings[1] if len(spellings) > 1 else spellings[0]
    return typer.Option(long, *[x for x in spellings if x != long], **opts)


def server_flag_params() -> list[inspect.Parameter]:
    """The group's parameters, one per :class:`~slotctl.server.flags.ServerFlags` field, defaulting to
    the server's defaults."""
    from slotctl.server.flags import ServerFlags

    defaults = ServerFlags()
    params = []
    for name, (kind, opts) in _SERVER_OPTIONS.items():
        option = flag_option(name, rich_help_panel=SERVER_PANEL, show_default=True, **opts)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, name),
                                        annotation=Annotated[kind, option]))
    return params


def with_server_flags(fn: Callable) -> Callable:
    """Give a command the server's flags as options (one panel in ``--help``) and call it with them as one
    :class:`~slotctl.server.flags.ServerFlags`, in its ``flags`` parameter. A value the server refuses is a
    usage error naming the flag as it was typed (``-ctk q8: expected one of f32, f16, ...``). Register the
    command with ``cls=ArgsCommand``, and give it a ``ctx: typer.Context`` parameter, by that name."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "flags"]
    extra = server_flag_params()
    names = [p.name for p in extra]
    visible = sig.replace(parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.default is not p.empty
                                      else p for p in own] + extra)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from slotctl.errors import UsageError
        from slotctl.server.flags import FLAGS, FlagError, ServerFlags

        values = {n: kwargs.pop(n) for n in names if n in kwargs}
        try:
            kwargs["flags"] = ServerFlags(**values)
        except FlagError as e:
            raise UsageError(e.as_typed(typed_flag(kwargs.get("ctx"), FLAGS[e.field]))) from None
        return fn(*args, **kwargs)

    wrapper.__signature__ = visible
    wrapper.__annotations__ = {p.name: p.annotation for p in visible.parameters.values()}
    return wrapper
