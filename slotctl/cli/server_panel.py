"""llama-server's flags as one panel of options (``--help``'s "Server flags"): the command given them as one
:class:`~slotctl.server.flags.ServerFlags` (:func:`with_server_flags`), the flags llama-server would take from
its environment read as it reads them, and one note for the flags that change nothing here. The options
themselves are :data:`slotctl.cli.options.SERVER_OPTIONS`."""

from __future__ import annotations

import functools
import inspect
from typing import Annotated, Callable, Optional

import typer

from slotctl.cli.command_line import typed_flag
from slotctl.cli.options import SERVER_OPTIONS, SERVER_PANEL, flag_option
from slotctl.cli.server_args import SERVER_ARGS_PARAM


def server_flag_params() -> list[inspect.Parameter]:
    """The group's parameters, one per :class:`~slotctl.server.flags.ServerFlags` field, defaulting to
    the server's defaults."""
    from slotctl.server.flags import ServerFlags

    defaults = ServerFlags()
    params = []
    for name, (kind, opts) in SERVER_OPTIONS.items():
        option = flag_option(name, rich_help_panel=SERVER_PANEL, show_default=True, **opts)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, name),
                                        annotation=Annotated[kind, option]))
    option = typer.Option("--server-args", metavar="'ARGS'|@FILE", rich_help_panel=SERVER_PANEL,
                          help="llama-server's command line as one argument, or @FILE to read it from a file (a "
                               "script, a unit file's command): quoted as a shell quotes, NAME=value words first "
                               "are its environment. Any flag b11434 takes is also accepted directly: the ones "
                               "above are used, the others ignored with one note naming them.")
    params.append(inspect.Parameter(SERVER_ARGS_PARAM, inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation=Annotated[Optional[str], option]))
    return params


def with_server_flags(fn: Callable) -> Callable:
    """Give a command the server's flags as options (one panel in ``--help``) and call it with them as one
    :class:`~slotctl.server.flags.ServerFlags`, in its ``flags`` parameter. A value the server refuses is a
    usage error naming the flag as it was typed (``-ctk q8: expected one of f32, f16, ...``). Register the
    command with ``cls=ArgsCommand`` (:mod:`slotctl.cli.command_line`), and give it a ``ctx: typer.Context``
    parameter, by that name."""
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

        ctx = kwargs.get("ctx")
        kwargs.pop(SERVER_ARGS_PARAM, None)  # spliced into the command line by ArgsCommand
        values = {n: kwargs.pop(n) for n in names if n in kwargs}
        meta = ctx.meta if ctx is not None else {}
        from_env = {}
        if kwargs.get("server") is None:  # live mode learns the running server's flags instead
            from_env = _environment_flags(ctx, values, meta.get("slotctl.server_env", {}))
        try:
            kwargs["flags"] = ServerFlags(**values)
        except FlagError as e:
            flag = e.as_typed(typed_flag(ctx, FLAGS[e.field]))
            raise UsageError(f"{from_env[e.field]}: {flag}" if e.field in from_env else flag) from None
        _note_server_flags(kwargs, meta.get("slotctl.ignored_flags", []), from_env)
        return fn(*args, **kwargs)

    wrapper.__signature__ = visible
    wrapper.__annotations__ = {p.name: p.annotation for p in visible.parameters.values()}
    return wrapper


def _environment_flags(ctx, values: dict, assigned: dict[str, str]) -> dict[str, str]:
    """The server flags not given on the command line that llama-server would take from its environment
    (``LLAMA_ARG_CTX_SIZE``): slotctl's own, plus ``assigned`` (``--server-args 'LLAMA_ARG_...=v ...'``),
    which win. Sets them in ``values``; returns ``{field: "VARIABLE=value"}`` for the note."""
    import os

    from slotctl.server.flags import from_environment

    found = from_environment({**os.environ, **assigned})
    given = {p.name for p in (ctx.command.params if ctx is not None else ())
             if getattr(ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"}
    said = {}
    for field, (var, value) in found.items():
        if field in given or field not in values:
            continue
        values[field] = value
        text = ({**os.environ, **assigned}).get(var, "")
        said[field] = f"{var}={text}" if len(text) <= 64 else f"{var} ({len(text):,} characters)"
    return said


def _note_server_flags(kwargs: dict, ignored: list[str], from_env: dict[str, str]) -> None:
    """One note on stderr for the server flags that change nothing here, one for those read from the
    environment."""
    if not ignored and not from_env:
        return
    from slotctl.cli.output import Output
    from slotctl.server.flags import flag_name

    out = Output(json_mode=bool(kwargs.get("json_out")) or bool(kwargs.get("jsonl")))
    if from_env:
        out.note("server flags from the environment, as llama-server reads them: "
                 + ", ".join(f"{v} ({flag_name(f)})" for f, v in from_env.items()))
    if ignored:
        out.note(f"llama-server flag{'s' if len(ignored) > 1 else ''} ignored (nothing a slot file holds depends "
                 f"on {'them' if len(ignored) > 1 else 'it'}): " + " ".join(ignored))
