"""Helpers every command uses: error handling, model-info loading, the runtime's state version."""

from __future__ import annotations

import functools
import os

import typer

from slotctl.cli.output import Output
from slotctl.errors import ExitStatus, SlotctlError


def handle_errors(fn):
    """Known errors become one line on stderr and their exit code (also under typer's CliRunner)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SlotctlError as e:
            Output().error(str(e))
            raise typer.Exit(int(e.exit_status)) from None
        except OSError as e:
            Output().error(f"{e.filename or ''}: {e.strerror or e}".lstrip(": "))
            raise typer.Exit(int(ExitStatus.USAGE)) from None

    return wrapper


def runtime_state_version() -> int | None:
    """The state version this llama-cpp-python reads and writes, or None when it cannot be imported."""
    try:
        from slotctl.runtime.context import STATE_VERSION

        return STATE_VERSION
    except Exception:  # noqa: BLE001 - a broken runtime must not stop inspection
        return None


def check_file(path) -> None:
    """A usage error (exit 2) for a path that is not a readable regular file (see :func:`check_readable`)."""
    from slotctl.paths import check_readable

    check_readable(path)
