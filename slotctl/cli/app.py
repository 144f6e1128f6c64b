"""The ``slotctl`` command: wires the command modules and turns known errors into one line and an exit code."""

from __future__ import annotations

import os
import sys

import typer

from slotctl import __version__
from slotctl.errors import ExitStatus, SlotctlError

app = typer.Typer(
    name="slotctl",
    help="Inspect, validate, save, restore and strip llama.cpp server slot files.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        print(f"slotctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Show the version and exit.")):
    """Inspect, validate, save, restore and strip llama.cpp server slot files.

    Exit codes: 0 ok; 1 the file is damaged, will not restore or loses a layer; 2 usage or I/O error.
    """


def _register() -> None:
    from slotctl.cli import convert_cmd, demo, inspect_cmd, live, restore, save, strip_draft, validate_cmd

    inspect_cmd.register(app)
    validate_cmd.register(app)
    save.register(app)
    restore.register(app)
    strip_draft.register(app)
    convert_cmd.register(app)
    live.register(app)  # commands that talk to a running llama-server
    demo.register(app)


_register()


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
