"""Helpers every command uses: error handling, files and prompts as given (whether llama-cpp-python is installed:
``slotctl.cli.extras``)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Iterator

import typer

from slotctl.cli.output import Output, escape_text
from slotctl.errors import Terminated, UsageError, worst


def handle_errors(fn):
    """Every failure inside the command leaves through the error table (``slotctl.cli.errors``): one line on
    stderr and its exit code (also under typer's CliRunner and the demo's in-process runs).

    With ``--json`` (or ``--jsonl``) the error is also a document on stdout:
    ``{"error": {"code", "message"}, "exit_code"}``.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            use_store(kwargs.values())
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except (Exception, KeyboardInterrupt, Terminated) as e:
            from slotctl.cli.errors import leave

            leave(e, json_mode=bool(kwargs.get("json_out")), jsonl=bool(kwargs.get("jsonl")),
                  command=fn.__name__.replace("_", "-"))

    return wrapper


def store_deadline(timeout: float | None, paths) -> bool:
    """Whether ``paths`` name an ``s3://`` object or prefix; if so, ``--timeout`` (when given) is the deadline
    of the whole command's requests to the store, from now (the store module is in: :func:`use_store`)."""
    from slotctl.sources import remote_url

    store = any(remote_url(p) for p in (paths if isinstance(paths, (list, tuple)) else [paths]) if p is not None)
    if store and timeout is not None:
        from slotctl.store.s3 import set_deadline

        set_deadline(timeout)
    return store


def use_store(values) -> None:
    """Import the object store (``slotctl.store.s3``: obstore) when a value names an ``s3://`` object:
    only then, so that local commands keep their start-up. Without obstore, a usage error naming the extra."""
    from slotctl.sources import remote_url

    def paths(v):
        if isinstance(v, (list, tuple)):
            for x in v:
                yield from paths(x)
        elif isinstance(v, (str, os.PathLike)):
            yield v

    if not any(remote_url(p) for v in values for p in paths(v)):
        return
    import importlib.util

    if importlib.util.find_spec("obstore") is None:
        raise UsageError("s3:// paths need obstore, which is not installed: pip install 'slotctl[s3]'",
                         code="store_missing")
    import slotctl.store.s3  # registers the s3 scheme with slotctl.sources

    slotctl.store.s3.start_run()    # a command run in-process after another (the demo, tests) starts afresh


def check_file(path) -> None:
    """A usage error (exit 2) for a path that is not a readable regular file (see :func:`check_readable`)."""
    from slotctl.paths import check_readable
    from slotctl.sources import remote_url

    if remote_url(path) is not None:   # an object in a store: its open says what is wrong with it
        return
    check_readable(path)


#: the most bytes of a prompt read from a file or standard input (2^24 tokens, the most a context holds, are
#: about 64 MiB of text)
PROMPT_MAX_BYTES = 256 << 20


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt text from --prompt, --prompt-file F or --prompt-file - (stdin), exactly as given."""
    if (prompt is None) == (prompt_file is None):
        raise UsageError("give the prompt with exactly one of --prompt TEXT and --prompt-file FILE (- for stdin)")
    if prompt is not None:
        return prompt
    if str(prompt_file) == "-":     # bounded: a stream that never ends is refused at the cap
        raw = sys.stdin.buffer.read(PROMPT_MAX_BYTES + 1)
        if len(raw) > PROMPT_MAX_BYTES:
            raise UsageError(f"--prompt-file -: more than {PROMPT_MAX_BYTES:,} bytes", code="too_large")
        where = "standard input"
    else:     # a regular file of at most the cap (a FIFO or a device is refused unread)
        from slotctl.paths import read_bounded

        raw, where = read_bounded(prompt_file, PROMPT_MAX_BYTES, what="--prompt-file "), str(prompt_file)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None


@contextlib.contextmanager
def readable(path: str | os.PathLike) -> Iterator[str]:
    """The path to read for ``path``: ``-`` is standard input, copied to a temporary file for the time of
    the block; any other path must be a regular file this process may read (else a one-line UsageError)."""
    from slotctl.paths import STDIN, check_readable, stdin_copy
    from slotctl.sources import remote_url

    p = os.fspath(path)
    url = remote_url(p)
    if url is not None:   # an object in a store: read in ranges where it is
        yield url
        return
    if p == STDIN:
        from slotctl.format.header import STDIN_HEAD

        with stdin_copy(STDIN_HEAD) as tmp:
            yield tmp
        return
    check_readable(p)
    yield p


def shown(path) -> str:
    """``path`` as a command shows it (:func:`slotctl.sources.shown`; sources imported only when called)."""
    from slotctl.sources import shown as shown_path

    return shown_path(path)


def file_error(path: str | os.PathLike, e: Exception) -> dict:
    """The entry of a file that could not be read at all, in a command over many files."""
    from slotctl.cli.errors import failure
    from slotctl.errors import StoreDown

    if isinstance(e, StoreDown):    # the store stopped answering: the run stops with this one error
        raise e
    f = failure(e, path=path)
    return {"path": os.fspath(path), "exit_code": f.status, "error": {"code": f.code, "message": f.message}}


class FileRun:
    """A command over many files: the per-file objects, streamed with ``--jsonl``; the document at the end.

    ``--json``: ``{"files": [...], "summary": {...}, "exit_code"}``; ``--jsonl``: one per-file object per
    line as each is added, then ``{"summary": {...}, "exit_code"}`` (docs/json.md). The exit code is the
    worst of the files' (:func:`slotctl.errors.worst`: 2, then 1, then 3).
    """

    def __init__(self, out: Output, expansion, *, what: str):
        self.out = out
        self.expansion = expansion
        self.files: list[dict] = []
        if not expansion.files:
            skipped, links = len(expansion.skipped), len(expansion.links)
            said = [f"{skipped} file(s) skipped: they are not slot files"] if skipped else []
            if links:
                said.append(f"{links} symbolic link(s) not followed: a command that rewrites files follows "
                            f"no link in a directory; name the files themselves")
            raise UsageError(f"no slot files to {what} ({'; '.join(said) or 'the directories given are empty'})",
                             code="no_slot_files")

    @property
    def n_files(self) -> int:
        return len(self.files)

    def add(self, entry: dict) -> None:
        self.files.append(entry)
        if self.out.jsonl:
            self.out.json_line(entry)

    def count(self, exit_code: int) -> int:
        return sum(f["exit_code"] == exit_code for f in self.files)

    @property
    def exit_code(self) -> int:
        return int(worst(f["exit_code"] for f in self.files))

    def finish(self, summary: dict, **extra) -> None:
        """Print the document (JSON modes) and exit with the run's exit code."""
        if self.out.jsonl:
            self.out.json_line({"summary": summary, **extra, "exit_code": self.exit_code})
        elif self.out.json_mode:
            self.out.json({**extra, "files": self.files, "summary": summary, "exit_code": self.exit_code})
        if self.exit_code:
            raise typer.Exit(self.exit_code)


class NoteCounter:
    """Notes of a run over many files, shown once each at the end, with the number of files that had them."""

    def __init__(self):
        self._notes: dict[tuple[str, str], list[str]] = {}

    def add(self, finding: dict, path: str = "") -> bool:
        """Keep ``finding`` for the end when it is a note (True); other severities are not kept."""
        if finding["severity"] != "note":
            return False
        self._notes.setdefault((finding["code"], finding["message"]), []).append(path)
        return True

    def render(self, out: Output) -> None:
        """The notes, on stdout with the rest of the findings (not as warnings on stderr: they are the
        files' findings, and said once)."""
        from slotctl.cli.layout import Text   # plain on a pipe: rich only where it draws styles

        for (_code, message), paths in self._notes.items():
            if len(paths) == 1:
                who = f"{paths[0]}: " if paths[0] else ""
            else:
                who = f"({len(paths)} files) "
            out.show(Text(("note ", "dim"), (who, "bold"), escape_text(message, keep_newlines=False)))
