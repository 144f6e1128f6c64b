"""The command line as typed: a command class that keeps it (:class:`ArgsCommand`), and what is read from it
(:func:`raw_value`, :func:`typed_flag`, :func:`remote_paths`, :func:`pasted_slot_dir`)."""

from __future__ import annotations

import os
from typing import Any

import typer
from typer.core import TyperCommand

from slotctl.cli.server_args import SERVER_ARGS_PARAM, server_command_line


class ArgsCommand(TyperCommand):
    """A typer command that also keeps its command line as typed: each parameter's value
    (``ctx.meta["slotctl.raw"]``, see :func:`raw_value`) and the arguments (``ctx.meta["slotctl.args"]``,
    so that a usage error can name a flag as it was written).

    typer turns a ``Path`` argument into a ``pathlib.Path``, which drops a trailing ``/``, a leading ``./``
    and doubled slashes: ``restore --server URL x/`` would send ``x``. Live mode checks the name as typed.

    A command with the server's flags (:func:`slotctl.cli.server_panel.with_server_flags`) also takes
    llama-server's command line as it is: see :func:`slotctl.cli.server_args.server_command_line`.
    """

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        _refuse_repeated(self, ctx, args)
        if any(p.name == SERVER_ARGS_PARAM for p in self.params):
            args, ctx.meta["slotctl.ignored_flags"], ctx.meta["slotctl.server_env"] = \
                server_command_line(self, ctx, list(args))
        ctx.meta["slotctl.args"] = list(args)
        try:
            opts, _, _ = self.make_parser(ctx).parse_args(args=list(args))
            ctx.meta["slotctl.raw"] = dict(opts)
        except Exception:  # noqa: BLE001 - the real parse below reports whatever is wrong
            pass
        return super().parse_args(ctx, args)


#: options naming one server: given twice, the first would be dropped silently (click keeps the last)
ONE_SERVER_OPTIONS = ("--server", "--from", "--to")


def _refuse_repeated(command, ctx, args: list[str]) -> None:
    """A usage error when an option naming one server (:data:`ONE_SERVER_OPTIONS`) is given more than once to
    a command that takes one (a command taking several declares the option ``multiple``)."""
    words = args[:args.index("--")] if "--" in args else args
    for p in command.get_params(ctx):
        if p.param_type_name != "option" or getattr(p, "multiple", False):
            continue
        for name in (o for o in p.opts if o in ONE_SERVER_OPTIONS):
            given = [w.partition("=")[2] if "=" in w else None for w in words
                     if w == name or w.startswith(name + "=")]
            if len(given) > 1:
                raise typer.BadParameter(f"{name} given {len(given)} times: this command acts on one server "
                                         f"(the first would be dropped); give {name} once", ctx=ctx)

def remote_paths(ctx: typer.Context | None, paths) -> list[str]:
    """``paths`` (typer's ``Path`` values) as strings, each ``s3://`` one as typed: ``Path`` drops the trailing
    ``/`` that makes ``s3://bucket/prefix/`` a prefix (a directory: empty, it holds 0 files)."""
    from slotctl.sources import remote_url

    typed = [remote_url(a) for a in (ctx.meta.get("slotctl.args") or ()) if remote_url(a)] if ctx is not None else []
    out = []
    for p in paths:
        url = remote_url(p)
        if url is None:
            out.append(os.fspath(p))
            continue
        out.append(next((t for t in typed if t.rstrip("/") == url.rstrip("/")), url))
    return out


def pasted_slot_dir(ctx: typer.Context | None) -> str | None:
    """The ``--slot-save-path`` of the server's command line pasted among the arguments, if any."""
    return ctx.meta.get("slotctl.slot_save_path") if ctx is not None else None


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

