"""Helpers every command uses: error handling, the runtime's state version, files and prompts as given."""

from __future__ import annotations

import functools
from pathlib import Path

import typer

from slotctl.cli.output import Output
from slotctl.errors import ExitStatus, SlotctlError, UsageError


def handle_errors(fn):
    """Known errors become one line on stderr and their exit code (also under typer's CliRunner)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SlotctlError as e:
            Output().error(str(e))
            raise typer.Exit(int(e.exit_status)) from None
        except ModuleNotFoundError as e:
            if (e.name or "").partition(".")[0] != "llama_cpp":
                raise
            Output().error(llama_missing(fn.__name__.replace("_", "-")))
            raise typer.Exit(int(ExitStatus.USAGE)) from None
        except OSError as e:
            Output().error(f"{e.filename or ''}: {e.strerror or e}".lstrip(": "))
            raise typer.Exit(int(ExitStatus.USAGE)) from None

    return wrapper


def llama_available() -> bool:
    """Whether llama-cpp-python is installed (found without importing it: importing loads llama.cpp)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_install() -> str:
    """The pip command that adds llama-cpp-python, pinned as slotctl's ``[llama]`` extra pins it."""
    req = "llama-cpp-python"
    try:
        import importlib.metadata

        for r in importlib.metadata.requires("slotctl") or []:
            spec = r.partition(";")[0]  # the [llama] extra's pin (or, in older metadata, a plain dependency)
            if spec.strip().startswith("llama-cpp-python"):
                req = spec.strip()
                break
    except Exception:  # noqa: BLE001 - not installed as a distribution (PYTHONPATH): the bare name
        pass
    return f"pip install '{req}'"


def require_llama(what: str) -> None:
    """A usage error (exit 2) naming what to install when llama-cpp-python is missing."""
    if not llama_available():
        raise SlotctlError(llama_missing(what))


def llama_missing(what: str) -> str:
    return f"{what} runs llama.cpp, and llama-cpp-python is not installed: {llama_hint()}"


def llama_hint() -> str:
    """How to install llama-cpp-python and what that takes."""
    return f"{llama_install()} (slotctl's [llama] extra; it compiles llama.cpp: a C/C++ compiler and a few minutes)"


def runtime_state_version() -> int | None:
    """The state version this llama-cpp-python reads and writes, or None when it is not installed."""
    if not llama_available():
        return None
    try:
        from slotctl.runtime.context import STATE_VERSION

        return STATE_VERSION
    except Exception:  # noqa: BLE001 - a broken runtime must not stop inspection
        return None


def check_file(path) -> None:
    """A usage error (exit 2) for a path that is not a readable regular file (see :func:`check_readable`)."""
    from slotctl.paths import check_readable

    check_readable(path)


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt text from --prompt, --prompt-file F or --prompt-file - (stdin), exactly as given."""
    if (prompt is None) == (prompt_file is None):
        raise UsageError("give the prompt with exactly one of --prompt TEXT and --prompt-file FILE (- for stdin)")
    if prompt is not None:
        return prompt
    if str(prompt_file) == "-":
        return typer.get_text_stream("stdin").read()
    try:
        return prompt_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{prompt_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
