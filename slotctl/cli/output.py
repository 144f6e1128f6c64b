"""The one output object every command writes through.

Commands hand it data (dicts for ``--json``, rich renderables for people) and never print. Data goes to
stdout; warnings, errors and progress go to stderr. Text that comes from a slot file is untrusted and is
escaped before it reaches a terminal (control characters shown as ``\\xNN``, rich markup disabled).
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from rich.console import Console
from rich.markup import escape as _markup_escape

# C0 and C1 controls (not tab and newline), and the format characters that reorder or break a line
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape_char(c: str) -> str:
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def escape_text(text: str, *, keep_newlines: bool = True) -> str:
    """Untrusted text made safe for a terminal: control characters as ``\\xNN`` (as gguf_dump does).

    Bidirectional overrides and Unicode line separators become ``\\uNNNN``. Without ``keep_newlines``
    (one-line messages) newline and tab are escaped too.
    """
    out = _CONTROL.sub(lambda m: _escape_char(m.group()), str(text))
    if not keep_newlines:
        out = out.replace("\n", "\\n").replace("\t", "\\t")
    return out


def markup_safe(text: str, *, keep_newlines: bool = True) -> str:
    """Untrusted text escaped for the terminal and for rich markup."""
    return _markup_escape(escape_text(text, keep_newlines=keep_newlines))


def elide(text: str, limit: int = 600) -> str:
    """The start and end of a long text, with what was left out counted in the middle."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [… {len(text) - 2 * half:,} characters …] {text[-half:]}"


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}"
    return f"{n} B"  # pragma: no cover


class Output:
    """Human (rich) or JSON output; ``verbose`` lets llama.cpp's and slotctl's logs through to stderr."""

    def __init__(self, *, json_mode: bool = False, verbose: bool = False, stdout=None, stderr=None):
        self.json_mode = json_mode
        self.verbose = verbose
        self._stdout = stdout or sys.stdout
        self._stderr = stderr or sys.stderr
        self.console = Console(file=self._stdout, highlight=False, soft_wrap=False)
        self.err = Console(file=self._stderr, highlight=False, soft_wrap=True)

    # -- data -----------------------------------------------------------------------------------
    def json(self, data: Any) -> None:
        """One JSON document on stdout."""
        self._stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
        self._stdout.flush()

    def print(self, *renderables: Any) -> None:
        """Rich renderables on stdout (human mode)."""
        self.console.print(*renderables)

    # -- messages -------------------------------------------------------------------------------
    # Messages are one line each: whatever they quote (paths, file content, server text) is escaped,
    # control characters and newlines included, so nothing from outside moves the cursor or splits them.
    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/] {markup_safe(message, keep_newlines=False)}")

    def error(self, message: str) -> None:
        self.err.print(f"[bold red]error:[/] {markup_safe(message, keep_newlines=False)}")

    def log(self, message: str) -> None:
        """A progress note for people; only with --verbose."""
        if self.verbose:
            self.err.print(f"[dim]{markup_safe(message, keep_newlines=False)}[/]")

    # -- progress -------------------------------------------------------------------------------
    @property
    def interactive(self) -> bool:
        """Whether stderr is a terminal (progress bars are shown only then)."""
        if os.environ.get("SLOTCTL_NO_PROGRESS"):
            return False
        return self.err.is_terminal

    @contextmanager
    def progress(self, description: str, total: float | None = None, *, bytes_: bool = False) -> Iterator:
        """A rich progress bar on stderr when it is a terminal; on a pipe, a silent stand-in.

        Yields ``update(completed, total=None)``.
        """
        if not self.interactive:
            yield lambda completed, total=None: None
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn  # start-up

        columns = [TextColumn("{task.description}"), BarColumn()]
        if bytes_:
            columns.append(DownloadColumn())
        else:
            # total may become known only later (update(..., total=n)): show the count alone until then
            columns.append(TextColumn("{task.completed:.0f}" + ("" if total is None else "/{task.total:.0f}")))
        columns += [TimeRemainingColumn()]
        with Progress(*columns, console=self.err, transient=True) as p:
            task = p.add_task(description, total=total)

            def update(completed, total=None):
                p.update(task, completed=completed, **({"total": total} if total is not None else {}))

            yield update


def _json_default(o: Any):
    try:
        import numpy as np

        if isinstance(o, np.integer):
            return int(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(o, "_asdict"):
        return o._asdict()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
