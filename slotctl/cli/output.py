"""The one output object every command writes through.

Commands hand it data (dicts for ``--json``, rich renderables for people) and never print. Data goes to
stdout; warnings, errors and progress go to stderr. Text that comes from a slot file is untrusted and is
escaped before it reaches a terminal (control characters shown as ``\\xNN``, rich markup disabled).

rich is imported where something is drawn (the consoles are made on first use): ``--json`` never imports it.
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from slotctl.errors import escape_text  # noqa: F401 - its home is slotctl.errors; imported from here by the commands

if TYPE_CHECKING:   # annotations only: rich is imported where something is drawn
    from rich.table import Table
    from rich.text import Text

#: the width output is laid out for when stdout is not a terminal and ``COLUMNS`` does not say one: prose
#: and tables wrap there, a value longer than a line folds onto the next (never cut)
PIPE_WIDTH = 80
#: a width no line reaches: what a table is measured against to learn the width it needs
_UNBOUNDED = 1 << 20
#: the narrowest a column of text (a name, a path, a description) is folded to before a table is shown as
#: one ``column: value`` block per row instead
FOLD_WIDTH = 12

#: the one colour table: every word a command shows as a verdict, a status, a step's outcome or an event,
#: and its style. Green: as wanted; yellow: done with a loss, or worth a look; red: lost or refused (bold when
#: the whole file or run is); cyan: what a dry run would do; magenta: not decided; dim: nothing happened.
STYLES = {
    **dict.fromkeys(("restores", "restored", "ok", "fits", "copied", "stored", "proof", "proven", "stripped",
                     "pinned", "idle", "same", "learned", "up", "identified"), "green"),
    **dict.fromkeys(("restores_with_drops", "dropped", "drop", "ignored", "skipped", "down", "restart", "pruned",
                     "busy", "warning", "disconnect"), "yellow"),
    **dict.fromkeys(("mismatch", "partial", "deleted"), "red"),
    **dict.fromkeys(("refused", "failed", "error", "unreadable", "aborts", "aborted", "aborts_later", "reevaluated",
                     "differs", "upstream", "other_model", "corrupt", "unidentified"), "bold red"),
    **dict.fromkeys(("would_strip", "would_delete"), "cyan"),
    "undecided": "magenta",
    "not_taken": "yellow",     # a proof not sent
    **dict.fromkeys(("unchanged", "kept", "absent", "note"), "dim"),
    # a file's class (ls, validate.classes): "mismatch" there is a file for another setup, worth a look
    "broken": "bold red", "useless": "yellow", "class.mismatch": "yellow",
}


def style_of(word: str, default: str = "", *, bold: bool = False) -> str:
    """The style of ``word`` in :data:`STYLES` (``default`` for a word not in it); ``bold``: made bold."""
    style = STYLES.get(word, default)
    return f"bold {style}" if bold and style and not style.startswith("bold") else style


def markup_safe(text: str, *, keep_newlines: bool = True) -> str:
    """Untrusted text escaped for the terminal and for rich markup."""
    text = escape_text(text, keep_newlines=keep_newlines)
    if "[" not in text:     # rich's escape changes only "[" (its tags): rich.markup imported when it may
        return text
    from rich.markup import escape

    return escape(text)


def elide(text: str, limit: int = 600) -> str:
    """The start and end of a long text, with what was left out counted in the middle."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [… {len(text) - 2 * half:,} characters …] {text[-half:]}"


def pipe_width() -> int:
    """The width of stdout when it is not a terminal: ``COLUMNS`` when it is a positive number, else 80."""
    value = os.environ.get("COLUMNS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else PIPE_WIDTH


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
    """Human (rich) or JSON output; ``verbose`` lets llama.cpp's and slotctl's logs through to stderr.

    ``jsonl``: documents are written one per line (``--jsonl``; :meth:`json` then writes one line too).
    ``quiet``: commands over many files show only the files that are not fine, and the summary.
    On a terminal, rich lays out for its width; on a pipe for :func:`pipe_width` (``COLUMNS``, else 80):
    no line of stdout is longer, and no value is cut (a value longer than a line folds onto the next).
    Messages on stderr are one line each on a pipe (grep finds them whole).
    """

    def __init__(self, *, json_mode: bool = False, jsonl: bool = False, quiet: bool = False, verbose: bool = False,
                 stdout=None, stderr=None):
        self.json_mode = json_mode or jsonl
        self.jsonl = jsonl
        self.quiet = quiet
        self.verbose = verbose
        self._stdout = stdout or sys.stdout
        self._stderr = stderr or sys.stderr

    @cached_property
    def console(self):
        """The rich console of stdout (made on first use: ``--json`` never draws)."""
        console = Console(file=self._stdout, highlight=False, soft_wrap=False)
        if not console.is_terminal:
            console = Console(file=self._stdout, highlight=False, soft_wrap=False, width=pipe_width())
        return console

    @cached_property
    def err(self):
        """The rich console of stderr (made on first use)."""
        err = Console(file=self._stderr, highlight=False)
        # a message is one line on a pipe (grep finds it whole); a terminal gets it wrapped between words
        err.soft_wrap = not err.is_terminal
        return err

    # -- data -----------------------------------------------------------------------------------
    def json(self, data: Any) -> None:
        """One JSON document on stdout (one line with ``jsonl``)."""
        if self.jsonl:
            self.json_line(data)
            return
        _write_json(self._stdout, data, indent=2)

    def json_line(self, data: Any) -> None:
        """One JSON object on one line of stdout, flushed (``--jsonl`` streams them as they come)."""
        try:     # plain JSON values (an ls row): json's own encoder, made once (the same text)
            text = _plain_json().encode(data)
        except TypeError:      # an array or another value of slotctl's (_json_default): written as it defers them
            _write_json(self._stdout, data, indent=None)
            return
        self._stdout.write(text + "\n")
        self._stdout.flush()

    def json_error(self, code: str, message: str, exit_code: int) -> None:
        """The document of a command that failed as a whole: ``{"error": {"code", "message"}, "exit_code"}``."""
        self.json({"error": {"code": code, "message": message}, "exit_code": int(exit_code)})

    def print(self, *renderables: Any) -> None:
        """Rich renderables on stdout (human mode)."""
        self.console.print(*renderables)

    @property
    def plain(self) -> bool:
        """Whether stdout shows no styles (a pipe or a file, colours not forced): what a renderable prints
        there is its plain text, and :meth:`lines` may write it without rich's per-line work."""
        console = self.console
        return not console.is_terminal and console.color_system is None

    def plain_width(self) -> int | None:
        """The width of stdout when rich would draw no styles there (:attr:`plain`: a pipe or a file), learned
        without making rich's console when it is not made yet; None when stdout is a terminal, or rich
        would read the environment (``TTY_COMPATIBLE``, ``FORCE_COLOR``, Jupyter) or the encoding (not
        UTF-8: rich draws boxes in ASCII) in a way this does not follow."""
        if "console" in self.__dict__:
            return self.console.width if self.plain else None
        if "TTY_COMPATIBLE" in os.environ or "FORCE_COLOR" in os.environ or sys.platform == "win32":
            return None
        import builtins

        if hasattr(builtins, "get_ipython"):
            return None
        stdout = self._stdout
        if not (getattr(stdout, "encoding", "utf-8") or "utf-8").lower().startswith("utf"):
            return None
        isatty = getattr(stdout, "isatty", None)
        try:
            if isatty is not None and isatty():
                return None
        except ValueError:      # a closed file: rich takes it for no terminal
            pass
        return pipe_width()

    def show(self, node) -> None:
        """A renderable of :mod:`slotctl.cli.layout` on stdout: where stdout shows no styles, its plain lines
        written without rich (the same bytes rich prints); else, or for a shape the plain layout leaves to
        rich, drawn by rich (a boxed table as :meth:`table` shows it, its ``keep`` columns whole)."""
        from slotctl.cli import layout

        width = self.plain_width()
        if width is not None:
            lines = layout.plain_lines(node, width)
            if lines is not None:
                self.lines(lines)
                return
        drawn = rich_renderable(node)
        if isinstance(node, layout.Table) and node.boxed:
            self.table(drawn, keep=node.columns if node.keep is None else node.keep)
        else:
            self.print(drawn)

    def lines(self, lines: Iterable[str]) -> None:
        """Plain lines straight to stdout (only where :attr:`plain`: each already laid out for the width,
        escaped, no wider than it), written in blocks."""
        write, block = self._stdout.write, []
        for line in lines:
            block.append(line)
            if len(block) >= 4096:
                write("\n".join(block) + "\n")
                block = []
        if block:
            write("\n".join(block) + "\n")
        self._stdout.flush()

    def wrapped(self, text: str, indent: int) -> list[str]:
        """The plain lines :meth:`indented` prints for ``text`` (no styles)."""
        from rich.text import Text

        pad = " " * indent
        out = []
        for line in Text(text).wrap(self.console, max(1, self.console.width - indent), overflow="fold"):
            line.rstrip()
            out.append(pad + line.plain)
        return out

    def indented(self, text: Text | str, indent: int) -> None:
        """``text`` wrapped at the output's width less ``indent``, every line indented (a word longer than a
        line folds: nothing is cut)."""
        from rich.text import Text

        text = text if isinstance(text, Text) else Text(str(text))
        for line in text.wrap(self.console, max(1, self.console.width - indent), overflow="fold"):
            line.rstrip()
            self.print(Text(" " * indent) + line)

    def words(self, numbers: Sequence[int], *, indent: int = 0) -> None:
        """Many numbers (a prompt's token ids, a list or an array) as plain lines that fit the output's
        width, as many to a line as the widest leaves room for, written straight to stdout a block at a time:
        no per-number rich work and no string of the whole list, so a prompt of millions of tokens takes
        seconds and little memory (a number longer than a line stands alone: nothing is cut)."""
        import numpy as np

        ids = np.asarray(numbers)
        if not len(ids):
            return
        longest = max(len(str(int(ids.min()))), len(str(int(ids.max()))))
        per = max(1, (max(1, self.console.width - indent) + 1) // (longest + 1))
        pad = " " * indent
        block = per * 4096
        for at in range(0, len(ids), block):
            strs = list(map(str, ids[at:at + block].tolist()))
            self._stdout.write("".join(pad + " ".join(strs[i:i + per]) + "\n" for i in range(0, len(strs), per)))
        self._stdout.flush()

    def table(self, table: Table, keep: Iterable[str] = ()) -> None:
        """A table whose ``keep`` columns (numbers, offsets, verdicts, paths) are never wrapped or cut.

        The other columns wrap (folding a word longer than the column). When even that does not fit the
        terminal, each row is shown as ``column: value`` lines instead, so no value is ever cut.
        """
        from rich.measure import Measurement
        from rich.text import Text

        keep_whole(table, keep, self.console)
        # the width the table needs when the other columns fold down to FOLD_WIDTH cells, measured without
        # the terminal's limit (rich clamps a measurement to the width it is given)
        folding = [c for c in table.columns if not c.no_wrap]
        for col in folding:
            col.max_width = FOLD_WIDTH
        need = Measurement.get(self.console, self.console.options.update_width(_UNBOUNDED), table).minimum
        for col in folding:
            col.max_width = None
        if need <= self.console.width:
            self.print(table)
            return
        if table.title:
            self.print(table.title if isinstance(table.title, Text) else Text(str(table.title)))
        for row in zip(*[list(c.cells) for c in table.columns]):
            self._record(list(zip(table.columns, row)))

    def _record(self, cells: list) -> None:
        """One table row as ``column: value`` items (:meth:`record`)."""
        from rich.text import Text

        items = []
        for col, cell in cells:
            value = cell if isinstance(cell, Text) else self.console.render_str(str(cell), style="")
            items.append((str(col.header), value))
        self.record(items)

    def record(self, items: Iterable[tuple[str, Text | str]], *, indent: int = 0, hang: int = 2) -> None:
        """``name: value`` items packed into lines of the output's width: the first line indented by
        ``indent``, the others by ``indent + hang``.

        An item is never split between lines unless it is longer than a line by itself: then it has lines
        of its own, folded at the width (wrapped, never cut)."""
        from rich.text import Text

        width = self.console.width
        line = Text(" " * indent, overflow="fold")
        for name, value in items:
            value = value if isinstance(value, Text) else Text(str(value))
            value = Text(" ").join(value.split("\n"))   # a cell of several lines, on one
            item = Text.assemble((f"{name}: ", "bold"), value) if name else value
            if line.plain.strip() and line.cell_len + 2 + item.cell_len > width:
                self.print(line)
                line = Text(" " * (indent + hang), overflow="fold")
            elif line.plain.strip():
                line.append("  ")
            line.append_text(item)
        if line.plain.strip():
            self.print(line)

    # -- messages -------------------------------------------------------------------------------
    # Messages are one line each: whatever they quote (paths, file content, server text) is escaped,
    # control characters and newlines included, so nothing from outside moves the cursor or splits them.
    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/] {markup_safe(message, keep_newlines=False)}")

    def note(self, message: str) -> None:
        """Something the user should know that is neither wrong nor data (a flag ignored, a value read from
        the environment): one line on stderr."""
        self.err.print(f"[dim]note:[/] {markup_safe(message, keep_newlines=False)}")

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
        if self.jsonl and self.console.is_terminal:
            return False    # lines stream to the same terminal as they come: a bar between them would tear
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


def rich_renderable(node):
    """rich's renderable of a :mod:`slotctl.cli.layout` renderable (a boxed table's ``keep`` is applied by
    :meth:`Output.table`; a bare one's here)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from slotctl.cli import layout

    if isinstance(node, layout.Text):
        return Text.assemble(*node.spans, style=node.style)
    if isinstance(node, layout.Table):
        t = (Table(title=node.title, title_justify="left", show_edge=False) if node.boxed
             else Table(show_edge=False, box=None, padding=(0, 1)))
        for c in node.columns:
            t.add_column(c, justify="right" if c in node.right else "left")
        for row in node.rows:
            t.add_row(*row)
        return t if node.boxed else keep_whole(t, node.keep)
    if isinstance(node, layout.Panel):
        return Panel(Group(*map(rich_renderable, node.children)), title=node.title, title_align="left",
                     expand=False)
    if isinstance(node, layout.Group):
        return Group(*map(rich_renderable, node.children))
    raise TypeError(f"not a renderable of slotctl.cli.layout: {type(node).__name__}")


def keep_whole(table: Table, keep: Iterable[str] | None = None, console: Console | None = None) -> Table:
    """Mark the ``keep`` columns of ``table`` (all when None) as never wrapped or cut: each is as wide as its
    widest cell or header. The other columns fold. For a table nested in a panel (the panel is what wraps)."""
    console = console or _measuring_console()
    names = None if keep is None else set(keep)
    for col in table.columns:
        if names is None or col.header in names:
            col.no_wrap = True
            col.min_width = max([_cell_width(console, c) for c in col.cells] + [_cell_width(console, col.header)])
        else:
            col.overflow = "fold"
    return table


def _cell_width(console: Console, cell: Any) -> int:
    """The widest line of a table cell, in terminal cells (markup and emoji codes read as the table will read
    them; not highlighted: a highlighter adds styles, never width, and compiles its patterns on first use)."""
    from rich.text import Text

    text = cell if isinstance(cell, Text) else console.render_str(str(cell), highlight=False)
    return max((Text(line).cell_len for line in text.plain.split("\n")), default=0)


_PLAIN_JSON = None


def _plain_json():
    """The encoder of documents that hold only JSON's own values: json.dumps's defaults (it raises TypeError on
    anything else, which is then written by :func:`_write_json`); made once, with the first such document
    (``json`` is imported only where a document is written)."""
    global _PLAIN_JSON
    if _PLAIN_JSON is None:
        import json

        _PLAIN_JSON = json.JSONEncoder()
    return _PLAIN_JSON

#: arrays longer than this are written in blocks, compact, instead of one JSON value per line
_LONG_ARRAY = 4096


def _write_json(stream, data: Any, *, indent: int | None) -> None:
    """``data`` as JSON and a newline, flushed; a long integer array (a prompt's tokens) is written in
    blocks where its mark stands, compact on one line, so a document of millions of tokens never exists as
    one string or one list of Python ints."""
    import json   # only where a document is written: the human view never needs it

    arrays: list = []
    # the mark of an array: its index between NULs and a nonce no text from a file can know, so a prompt
    # that spells a mark stays text (json.dumps quotes the NULs as \u0000)
    nonce = os.urandom(8).hex()
    text = json.dumps(data, indent=indent, default=_deferring(arrays, nonce))
    if not arrays:
        stream.write(text + "\n")
    else:
        mark = re.compile(r'"\\u0000slotctl-array-' + nonce + r'-(\d+)\\u0000"')
        for i, piece in enumerate(mark.split(text)):
            if i % 2 == 0:
                stream.write(piece)
            else:
                _write_array(stream, arrays[int(piece)])
        stream.write("\n")
    stream.flush()


def _deferring(arrays: list, nonce: str):
    """A ``default`` for json.dumps that leaves a mark for each long integer array (kept in ``arrays``)."""
    def default(o: Any):
        kind = getattr(getattr(o, "dtype", None), "kind", None)
        if kind in ("i", "u") and getattr(o, "ndim", 0) == 1 and len(o) > _LONG_ARRAY:
            arrays.append(o)
            return f"\x00slotctl-array-{nonce}-{len(arrays) - 1}\x00"
        return _json_default(o)
    return default


def _write_array(stream, a) -> None:
    """``[n, n, ...]`` of an integer array, a block of 64 Ki values at a time (never the whole text at once)."""
    stream.write("[")
    for at in range(0, len(a), 1 << 16):
        stream.write(("," if at else "") + ",".join(map(str, a[at:at + (1 << 16)].tolist())))
    stream.write("]")


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


def Console(**kwargs):
    """rich's console, but a reader that went away (``slotctl inspect F | head -1``) is an error for slotctl's
    error table (``closed_pipe``, slotctl.cli.errors) to end the run with: rich itself would exit 1, which
    reads as "damaged". (A function: rich is imported when a console is first made.)"""
    global _CONSOLE
    if _CONSOLE is None:
        from rich.console import Console as RichConsole

        class _Console(RichConsole):
            def on_broken_pipe(self) -> None:
                import errno

                raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

        _CONSOLE = _Console
    return _CONSOLE(**kwargs)


_CONSOLE = None
_MEASURING = None


def _measuring_console():
    """A console that only reads cells (:func:`keep_whole` of a table nested in a panel), made once: markup and
    emoji codes as every console reads them; it never prints."""
    global _MEASURING
    if _MEASURING is None:
        _MEASURING = Console()
    return _MEASURING


def hashing_progress(out: Output):
    """The progress of a model's hashing (once per model file: :mod:`slotctl.model.content`) as a bar on stderr
    when it is a terminal, drawn from the first call to the last byte; None on a pipe (the ``identified`` event
    says what it took)."""
    if not out.interactive:
        return None
    bar: list = []

    def update(done: int, total: int) -> None:
        if not bar:
            cm = out.progress("hashing the model (once per file)", total, bytes_=True)
            bar.append((cm, cm.__enter__()))
        bar[0][1](done, total)
        if done >= total:
            bar.pop()[0].__exit__(None, None, None)

    return update
