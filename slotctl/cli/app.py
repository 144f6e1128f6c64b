"""The ``slotctl`` command: a lazy command group, one-line usage errors and one exit code per outcome.

Each command lives in its own module with a ``register(app)`` function. The group imports a module only
when its command runs (or its ``--help`` is asked for), so ``slotctl --help`` and ``slotctl inspect FILE``
import nothing a command they do not run needs (no llama.cpp, no HTTP, no ssl). A new command is one
line in :data:`COMMANDS`; ``tests/test_startup.py`` checks the summaries here against the commands.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, NamedTuple

import typer
from typer import _click as click
from typer.core import TyperCommand, TyperGroup

from slotctl import __version__
from slotctl.cli.help import HelpCommand, HelpGroup, usage_error_line
from slotctl.cli.params import lighten
from slotctl.errors import ExitStatus, SlotctlError


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
                          "--max-size, --older-than, --keep; or only the files a server would not restore "
                          "(--broken).", "Slot directories"),
    "cp": CommandEntry("slotctl.cli.cp_cmd", "Copy slot files: local to S3, S3 to local, S3 to S3 (server-side "
                       "within a bucket).", "Slot directories"),
    "identify": CommandEntry("slotctl.cli.identify_cmd", "Which of the candidate models wrote this slot file "
                             "(and its draft state)?", "Run llama.cpp (pip install 'slotctl[llama]')"),
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
}


def load_command(name: str) -> click.Command:
    """The click command ``name``, built from its module (imported now)."""
    from typer.main import get_command_from_info

    entry = COMMANDS[name]
    holder = typer.Typer()
    importlib.import_module(entry.module).register(holder)
    for info in holder.registered_commands:
        if info.name == name:
            info.cls = _with_help(info.cls if isinstance(info.cls, type) else TyperCommand)
            return lighten(get_command_from_info(info, pretty_exceptions_short=True, rich_markup_mode=None))
    raise LookupError(f"{entry.module}.register adds no command {name!r}")  # a bug in COMMANDS


def _with_help(cls: type) -> type:
    """``cls`` with slotctl's help layout (plain text: option names never cut, flags without a metavar)."""
    return cls if issubclass(cls, HelpCommand) else type(cls.__name__, (HelpCommand, cls), {})


class LazyGroup(HelpGroup, TyperGroup):
    """Commands imported when they run; usage errors as one ``error:`` line (exit 2)."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        lighten(self)  # here, not in __init__: typer appends the completion options after building the group
        return super().make_context(*args, **kwargs)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        if self.summaries_only:  # the group's own help and completion: no import
            entry = COMMANDS[cmd_name]
            return TyperCommand(name=cmd_name, help=entry.summary, rich_help_panel=entry.panel)
        return load_command(cmd_name)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode: bool = True, **extra: Any):
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode:  # the demo runs commands in-process and reads their exit codes
            return super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:
            print(e.ctx.get_help() if e.ctx else "", file=sys.stderr)
            sys.exit(int(ExitStatus.USAGE))
        except click.exceptions.UsageError as e:  # also BadParameter, NoSuchOption, MissingParameter
            _fail(argv, usage_error_line(e, argv), int(ExitStatus.USAGE))
        except click.exceptions.ClickException as e:
            _fail(argv, e.format_message(), e.exit_code)
        except typer.Abort:
            print("error: aborted", file=sys.stderr)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(argv: list[str], message: str, exit_code: int):
    """A failure before the command ran: one ``error:`` line; with ``--json``/``--jsonl`` also the error
    document on stdout (docs/json.md), so a script reading stdout always gets one."""
    print(f"error: {message}", file=sys.stderr)
    if "--json" in argv or "--jsonl" in argv:
        import json

        doc = {"error": {"code": "usage", "message": message}, "exit_code": exit_code}
        print(json.dumps(doc, indent=None if "--jsonl" in argv else 2))
    sys.exit(exit_code)


app = typer.Typer(
    name="slotctl",
    cls=LazyGroup,
    no_args_is_help=True,
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
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Show the version and exit.")):
    """Inspect, validate, save, restore and strip llama.cpp server slot files.

    Only save, restore, validate's real load and the demo's full tour run llama.cpp (llama-cpp-python,
    the [llama] extra); every other command needs only the core install.

    Exit codes: 0 ok; 1 the file is damaged, will not restore or loses a layer; 2 usage or I/O error.
    """


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one line on stderr and a documented exit code for every known failure.

    Set ``SLOTCTL_DEBUG=1`` to see the traceback of an unexpected error.
    """
    try:
        app(args=argv, standalone_mode=True)
    except SystemExit:
        raise
    except SlotctlError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(int(e.exit_status))
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # the reader went away (``slotctl inspect F | head``): not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
    except Exception as e:  # an unexpected error is a bug: say so in one line
        if os.environ.get("SLOTCTL_DEBUG"):
            raise
        print(f"error: internal error: {type(e).__name__}: {e} (set SLOTCTL_DEBUG=1 for the traceback)",
              file=sys.stderr)
        sys.exit(int(ExitStatus.USAGE))
