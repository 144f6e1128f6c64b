"""The ``slotctl`` command: a lazy command group, one-line usage errors and one exit code per outcome.

Each command lives in its own module with a ``register(app)`` function. The group imports a module only
when its command runs (or its ``--help`` is asked for), so ``slotctl --help`` and ``slotctl inspect FILE``
import nothing a command they do not run needs (no llama.cpp, no HTTP, no ssl). A new command is one
line in :data:`COMMANDS`; ``tests/test_startup.py`` checks the summaries here against the commands.
Every failure leaves through the error table, ``slotctl.cli.errors``. Only typer's public API is used.
"""

from __future__ import annotations

import contextvars
import importlib
import sys
from typing import Any, NamedTuple

import typer
from typer.core import TyperCommand, TyperGroup

from slotctl import __version__
from slotctl.cli.help import HelpCommand, HelpGroup
from slotctl.cli.params import lighten


#: the heading of the commands that run llama.cpp
_LLAMA = "Run llama.cpp (the [llama] extra: llama-cpp-python)"


class CommandEntry(NamedTuple):
    #: the module whose ``register(app)`` adds the command
    module: str
    #: the one-line summary shown by ``slotctl --help`` (the first line of the command's own help)
    summary: str
    #: the heading it is listed under in ``slotctl --help``
    panel: str = "Slot files"


#: every command: name -> where it lives and how ``slotctl --help`` lists it (without importing it)
COMMANDS: dict[str, CommandEntry] = {
    "inspect": CommandEntry("slotctl.cli.inspect_cmd", "Show every layer of slot files: header, prompt, target "
                            "memory, checkpoints, draft state."),
    "validate": CommandEntry("slotctl.cli.validate_cmd", "Check that a llama-server started with these flags "
                             "restores each slot file completely."),
    "strip-draft": CommandEntry("slotctl.cli.strip_draft", "Remove the draft state (the SDFT appendix) from slot "
                                "files, leaving every other byte as it was."),
    "diff": CommandEntry("slotctl.cli.diff_cmd", "Compare two slot files: header, tokens, and each memory layer "
                         "section by section and stream by stream."),
    "convert": CommandEntry("slotctl.cli.convert_cmd", "Rewrite a slot file so that a server started with other "
                            "flags restores it."),
    "demo": CommandEntry("slotctl.cli.demo", "Run slotctl on a built-in sample: inspect and validate it; with "
                         "llama-cpp-python also save and restore."),
    "ls": CommandEntry("slotctl.cli.ls_cmd", "List slot files: size, age, state version, tokens, memory kind, "
                       "checkpoints, draft-state bytes, and the verdict of validate for each (what a server does "
                       "with it).", "Slot directories"),
    "prune": CommandEntry("slotctl.cli.prune_cmd", "Delete slot files to keep a directory under a budget: "
                          "--max-size, --older-than, --keep; or only the files a server refuses or aborts on "
                          "whatever its flags (--broken), those refused only by the flags or model given "
                          "(--mismatched), those it restores but reuses none of (--useless).", "Slot directories"),
    "cp": CommandEntry("slotctl.cli.cp_cmd", "Copy slot files: local to S3, S3 to local, S3 to S3 (server-side, "
                       "within a bucket or across).", "Slot directories"),
    "identify": CommandEntry("slotctl.cli.identify_cmd", "Which of the candidate models wrote this slot file "
                             "(and its draft state)?", _LLAMA),
    "save": CommandEntry("slotctl.cli.save", "Evaluate a prompt in a slot as llama-server would, and "
                         "write the slot file it would save.", _LLAMA),
    "restore": CommandEntry("slotctl.cli.restore", "Restore a slot file as llama-server does, step by step, "
                            "and optionally continue from it.", _LLAMA),
    "slots": CommandEntry("slotctl.cli.live", "List a running llama-server's slots: id, context size, "
                          "speculative decoding, busy, cached tokens.",
                          "A running llama-server"),
    "erase": CommandEntry("slotctl.cli.live", "Erase a slot of a running llama-server: it forgets its "
                          "cached prompt (POST /slots/N?action=erase).", "A running llama-server"),
    "migrate": CommandEntry("slotctl.cli.migrate_cmd", "Move a slot from one running llama-server to another: "
                            "save, check, convert, place, restore, prove.", "A running llama-server"),
    "keep": CommandEntry("slotctl.cli.keep_cmd", "Keep a running llama-server's slots across its restarts: save "
                         "idle slots, restore them after.", "A running llama-server"),
    "serve": CommandEntry("slotctl.cli.serve_cmd", "Serve a llama-server through a prompt cache on disk or in S3: "
                          "restore, request, save.", "A running llama-server"),
    "unit": CommandEntry("slotctl.cli.unit_cmd", "Print a systemd unit file shipped with slotctl: keep's or "
                         "serve's template, one instance per configuration file.", "A running llama-server"),
}



def load_command(name: str):
    """The command ``name`` (typer's ``TyperCommand``), built from its module (imported now)."""
    entry = COMMANDS[name]
    holder = typer.Typer()
    importlib.import_module(entry.module).register(holder)
    for info in holder.registered_commands:
        if info.name == name:
            info.cls = _with_help(info.cls if isinstance(info.cls, type) else TyperCommand)
            # an app of this one command: typer.main.get_command (public) makes it the command itself
            one = typer.Typer(add_completion=False, pretty_exceptions_short=True, rich_markup_mode=None)
            one.registered_commands.append(info)
            return lighten(typer.main.get_command(one), info.callback)
    raise LookupError(f"{entry.module}.register adds no command {name!r}")  # a bug in COMMANDS


def _with_help(cls: type) -> type:
    """``cls`` with slotctl's help layout (plain text: option names never cut, flags without a metavar) and
    the name of the running command kept (:func:`running_command`)."""
    return cls if issubclass(cls, HelpCommand) else type(cls.__name__, (_Running, HelpCommand, cls), {})


#: the command running now (its name)
_RUNNING: contextvars.ContextVar[str | None] = contextvars.ContextVar("slotctl_running", default=None)


def running_command() -> str | None:
    """The name of the slotctl command running now (``inspect``, ...), or None between commands (the tests
    check each ``--json`` document against the schema of the command that printed it)."""
    return _RUNNING.get()


class _Running:
    def invoke(self, ctx):
        token = _RUNNING.set(ctx.info_name)
        try:
            return super().invoke(ctx)
        finally:
            _RUNNING.reset(token)


class LazyGroup(HelpGroup, TyperGroup):
    """Commands imported when they run; every failure outside a command leaves through the error table
    (``slotctl.cli.errors``): a usage error as one ``error:`` line (exit 2)."""

    def make_context(self, *args: Any, **kwargs: Any):
        lighten(self)  # here, not in __init__: typer appends the completion options after building the group
        return super().make_context(*args, **kwargs)

    def list_commands(self, ctx) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx, cmd_name: str):
        if cmd_name not in COMMANDS:
            return None
        if self.summaries_only:  # the group's own help and completion: no import
            entry = COMMANDS[cmd_name]
            return TyperCommand(name=cmd_name, help=entry.summary, rich_help_panel=entry.panel)
        return load_command(cmd_name)

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not args and not ctx.resilient_parsing:
            from slotctl.cli.errors import NoCommand

            raise NoCommand(ctx.get_help())
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args: list[str]):
        """A command by its name; a mistyped one is a usage error naming the nearest ones
        (``slotctl insp``: did you mean inspect?)."""
        if args and args[0] not in COMMANDS and not ctx.resilient_parsing:
            ctx.fail(f"No such command {args[0]!r}{suggestion(args[0])}")
        return super().resolve_command(ctx, args)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode: bool = True, **extra: Any):
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode:  # the demo runs commands in-process and reads their exit codes
            return super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001 - every failure leaves through the table
            from slotctl.cli.errors import json_flags, leave

            json_mode, jsonl = json_flags(argv)
            leave(e, json_mode=json_mode, jsonl=jsonl, argv=argv, inside=False)
        sys.exit(rv if isinstance(rv, int) else 0)


def suggestion(typed: str) -> str:
    """``; did you mean inspect?`` for a mistyped command: the commands it begins, else the nearest by
    spelling (difflib); empty when none is near."""
    import difflib   # only for a command mistyped: difflib brings shutil and more to every start-up

    near = [c for c in COMMANDS if c.startswith(typed)] if typed else []
    near = near or difflib.get_close_matches(typed, list(COMMANDS), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(near[:3])}?" if near else ""


app = typer.Typer(
    name="slotctl",
    cls=LazyGroup,
    no_args_is_help=False,  # LazyGroup.parse_args shows the help (exit 2), through the error table
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)


def _version(value: bool):
    if value:
        print(f"slotctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                       help="Show the version and exit.")):
    """Inspect, validate, save, restore and strip llama.cpp server slot files.

    Only save, restore, identify, validate's real load and the demo's full tour run llama.cpp
    (llama-cpp-python, the [llama] extra); every other command needs only the core install.

    Exit codes: 0 ok; 1 the file is damaged, will not restore or loses a layer; 2 usage or I/O error; 3
    undecided (validate without -m cannot tell: give -m). A run over many files exits with the worst: 2,
    then 1, then 3. 130 interrupted; 141 the reader of the output went away (docs/exit-codes.md).
    """


def main(argv: list[str] | None = None) -> None:
    """Console entry point: every failure (one line on stderr and a documented exit code) leaves through the
    error table, ``slotctl.cli.errors``, the last flush of stdout included (a reader that went away).

    Set ``SLOTCTL_DEBUG=1`` to see the traceback of an unexpected error.
    """
    code: Any = 0
    try:
        app(args=argv, standalone_mode=True)
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # noqa: BLE001 - every failure leaves through the table
        from slotctl.cli.errors import leave

        leave(e, inside=False)
    try:
        sys.stdout.flush()
    except BrokenPipeError as e:
        from slotctl.cli.errors import leave

        leave(e, inside=False)
    store = sys.modules.get("slotctl.store.s3")
    if store is not None and any(t.is_alive() for t in store.STUCK):
        # requests to a store left to themselves at --timeout: the process ends now, not when they do
        import os

        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)
    sys.exit(code)
