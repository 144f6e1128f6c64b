"""One table of every way a run fails: the error's code (``--json``), its exit status and its one line.

A command's own verdict (a damaged file, a refused restore: exit 1 or 3) is its output. Everything else that
ends a run (a usage error, an I/O error, a slotctl error, a closed pipe, Ctrl-C, a bug) is an exception,
and every one leaves through :func:`leave`: :data:`TABLE` says which code, exit status and message it gets,
the first row that matches wins. Where it is caught only decides how the process ends: inside a command
(``common.handle_errors``) as ``typer.Exit``, so that the demo running commands in-process reads the code;
around the command group (``app.LazyGroup.main``: parse errors) and the process (``app.main``) as
``sys.exit``. docs/exit-codes.md shows the table (tests/test_errors.py checks that the two agree).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Callable, NamedTuple, NoReturn

import typer

from slotctl.errors import ExitStatus, SlotctlError, Terminated, error_entry


class Failure(NamedTuple):
    """How a run ends: ``code`` for scripts (``{"error": {"code", "message"}}``), the exit status, the one
    line on stderr (``error: ...``; nothing when empty); ``text``, when set, is shown instead of the
    line (the help of ``slotctl`` run without a command)."""

    code: str
    status: int
    message: str
    text: str | None = None


class NoCommand(Exception):
    """``slotctl`` run without a command: its help is shown on stderr (exit 2)."""

    def __init__(self, help_text: str):
        super().__init__("no command given")
        self.help_text = help_text


def _is_closed_pipe(e: BaseException) -> bool:
    return isinstance(e, BrokenPipeError) or (isinstance(e, OSError) and e.errno == errno.EPIPE)


def _is_llama_missing(e: BaseException) -> bool:
    return isinstance(e, ModuleNotFoundError) and (e.name or "").partition(".")[0] == "llama_cpp"


def _llama_missing(command: str) -> str:
    from slotctl.cli.extras import llama_missing

    return llama_missing(command or "this command")


def _usage_line(e: BaseException, argv: list[str], command: str = "", path: str | None = None) -> str:
    from slotctl.cli.help import usage_error_line

    if isinstance(e, typer.BadParameter) or getattr(e, "ctx", None) is not None:
        return usage_error_line(e, argv)
    return e.format_message()


class Row(NamedTuple):
    """One row of the table: what it catches, and the failure it makes of it."""

    #: in words, for docs/exit-codes.md
    what: str
    #: the error code (``None``: the error's own, a :class:`~slotctl.errors.SlotctlError`'s ``error_code``)
    code: str | None
    #: the exit status (``None``: the error's own)
    status: ExitStatus | None
    matches: Callable[[BaseException], bool]
    #: the message, from the error, the command line and the command's name (and a file's path)
    message: Callable[[BaseException, list[str], str, str | None], str]


#: every way a run fails; the first row that matches an exception is its failure
TABLE: tuple[Row, ...] = (
    Row("`slotctl` without a command (its help is shown)", "usage", ExitStatus.USAGE,
        lambda e: isinstance(e, NoCommand), lambda e, argv, cmd, path: ""),
    Row("a slotctl error: a damaged layer, a missing or unreadable file, a model that is not a GGUF, a server "
        "that refused or cannot be reached, ... (its own code and exit status)", None, None,
        lambda e: isinstance(e, SlotctlError), lambda e, argv, cmd, path: str(e)),
    Row("the reader of the output went away (`slotctl inspect F | head -1`): nothing is printed", "closed_pipe",
        ExitStatus.CLOSED_PIPE, _is_closed_pipe, lambda e, argv, cmd, path: ""),
    Row("a command that runs llama.cpp without llama-cpp-python (what to install)", "llama_missing",
        ExitStatus.USAGE, _is_llama_missing, lambda e, argv, cmd, path: _llama_missing(cmd)),
    Row("an I/O error (`no_such_file`, `permission_denied`, `is_a_directory`, `no_space`, `io_error`)", None,
        ExitStatus.USAGE, lambda e: isinstance(e, OSError), lambda e, argv, cmd, path: error_entry(e, path).message),
    Row("interrupted (Ctrl-C, SIGINT)", "interrupted", ExitStatus.INTERRUPTED,
        lambda e: isinstance(e, KeyboardInterrupt), lambda e, argv, cmd, path: "interrupted"),
    Row("terminated (SIGTERM) while standard input is spooled (`inspect -`): the spool removed", "terminated",
        ExitStatus.TERMINATED, lambda e: isinstance(e, Terminated) and e.signum == ExitStatus.TERMINATED - 128,
        lambda e, argv, cmd, path: "terminated"),
    Row("hung up (SIGHUP) while standard input is spooled: the spool removed", "hangup", ExitStatus.HANGUP,
        lambda e: isinstance(e, Terminated), lambda e, argv, cmd, path: "hung up"),
    Row("aborted (end of input at a prompt)", "aborted", ExitStatus.INTERRUPTED,
        lambda e: isinstance(e, typer.Abort), lambda e, argv, cmd, path: "aborted"),
    Row("a usage error: unknown command or option, missing argument, bad value (naming the flag as typed)",
        "usage", ExitStatus.USAGE, lambda e: isinstance(e, typer.TyperException), _usage_line),
    Row("anything else is a bug: `internal error: TYPE: MESSAGE` (`SLOTCTL_DEBUG=1` shows the traceback)",
        "internal_error", ExitStatus.USAGE, lambda e: isinstance(e, Exception),
        lambda e, argv, cmd, path: f"internal error: {type(e).__name__}: {e} (set SLOTCTL_DEBUG=1 for the "
                                   "traceback)"),
)


def failure(e: BaseException, *, argv: list[str] | None = None, command: str = "",
            path: str | os.PathLike | None = None) -> Failure:
    """The failure the table makes of ``e``: the first row that matches. ``path``: the file the error
    belongs to, when a command over many files reports it as that file's entry."""
    for row in TABLE:
        if row.matches(e):
            entry = error_entry(e)
            code = row.code or (entry.code if entry is not None else "error")
            status = row.status if row.status is not None else getattr(e, "exit_status", ExitStatus.USAGE)
            if isinstance(e, typer.TyperException) and not isinstance(e, SlotctlError) and row.code == "usage":
                status = getattr(e, "exit_code", status) or status
            message = row.message(e, list(argv or ()), command, os.fspath(path) if path is not None else None)
            return Failure(code, int(status), message, e.help_text if isinstance(e, NoCommand) else None)
    raise e  # a BaseException no row takes (SystemExit, GeneratorExit): not a failure of slotctl's


def json_flags(argv: list[str]) -> tuple[bool, bool]:
    """Whether the command line asks for ``--json`` and for ``--jsonl`` (before a ``--``)."""
    args = argv[:argv.index("--")] if "--" in argv else argv
    return "--json" in args or "--jsonl" in args, "--jsonl" in args


def leave(e: BaseException, *, json_mode: bool = False, jsonl: bool = False, argv: list[str] | None = None,
          command: str = "", inside: bool = True) -> NoReturn:
    """End the run for ``e`` as the table says: the line on stderr, with ``--json``/``--jsonl`` the error
    document on stdout, the exit status. ``inside`` a command the run ends with ``typer.Exit`` (the command
    group returns the code), else with ``sys.exit``. A bug re-raises under ``SLOTCTL_DEBUG=1``."""
    f = failure(e, argv=argv, command=command)
    if f.code == "internal_error" and os.environ.get("SLOTCTL_DEBUG"):
        raise e
    show(f, json_mode=json_mode, jsonl=jsonl)
    if inside:
        raise typer.Exit(f.status) from None
    sys.exit(f.status)


def show(f: Failure, *, json_mode: bool = False, jsonl: bool = False) -> None:
    """What a failure prints: its line on stderr (escaped), its document on stdout in JSON modes; for a
    closed pipe nothing, and stdout pointed at /dev/null so that the interpreter's last flush is silent."""
    if f.code == "closed_pipe":
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # not a real file (a test's captured stdout)
            pass
        return
    if f.text is not None:
        print(f.text, file=sys.stderr)
        return
    from slotctl.cli.output import Output

    out = Output(json_mode=json_mode, jsonl=jsonl)
    out.error(f.message)
    if out.json_mode:
        out.json_error(f.code, f.message, f.status)
