"""Errors and exit codes shared by the library and the CLI."""

from __future__ import annotations

import enum
import errno
import os
import re
from typing import NamedTuple


class ExitStatus(enum.IntEnum):
    """Every exit code slotctl returns (documented in docs/exit-codes.md)."""

    OK = 0
    #: the file is damaged, will not restore, or a layer would be dropped
    FAILED = 1
    #: usage error, unreadable or unwritable path, missing model
    USAGE = 2
    #: ``validate`` without a model cannot tell what the server does with a file (``undecided``)
    UNDECIDED = 3
    #: the terminal hung up (SIGHUP) while standard input was spooled: 128 + SIGHUP, as a shell reports it
    HANGUP = 129
    #: interrupted (Ctrl-C: 128 + SIGINT, as a shell reports it)
    INTERRUPTED = 130
    #: terminated (SIGTERM) while standard input was spooled: 128 + SIGTERM, as a shell reports it
    TERMINATED = 143
    #: the reader of the output went away (``slotctl inspect F | head -1``: 128 + SIGPIPE, as for ``cat``)
    CLOSED_PIPE = 141


#: which exit code a run over many things reports: a usage or I/O error first, then one that failed,
#: then one undecided (docs/exit-codes.md)
PRECEDENCE = (ExitStatus.USAGE, ExitStatus.FAILED, ExitStatus.UNDECIDED)


def worst(codes) -> ExitStatus:
    """The exit code of a run whose parts exited with ``codes``: 2, then 1, then 3, else 0 (:data:`PRECEDENCE`).

    Not the highest: 3 (undecided) ranks below 1 (failed), so a broken file is never hidden by one that
    could not be decided."""
    seen = {int(c) for c in codes}
    return next((c for c in PRECEDENCE if int(c) in seen), ExitStatus.OK)


class SlotctlError(Exception):
    """Base of every error slotctl reports as one line.

    ``code`` names the error for scripts (``--json``: ``{"error": {"code", "message"}}``): a class may
    set it, an instance may override it; else it is the class name in snake_case without ``Error``.
    """

    exit_status = ExitStatus.USAGE
    code: str | None = None

    @property
    def error_code(self) -> str:
        return self.code or snake_case(type(self).__name__.removesuffix("Error"))


class FormatError(SlotctlError):
    """The bytes of a layer are not what the format says they must be.

    ``layer`` names the layer ("state header", "token words", "target memory",
    "SCKP appendix", ...), ``offset`` is the absolute byte offset in the file where
    the problem was found, ``expected`` says what should have been there. ``part``: the
    layer of the slot file the error belongs to, as a name code can compare ("target memory",
    "checkpoint 2 draft blob", "SDFT appendix", ...), set where the file's walk records it
    (:meth:`slotctl.slotfile.SlotFile.add_error`); ``layer`` is for people and may be nested.
    """

    exit_status = ExitStatus.FAILED
    code = "damaged"

    def __init__(self, layer: str, offset: int | None, expected: str):
        self.layer = layer
        self.offset = offset
        self.expected = expected
        self.part: str | None = None
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = f" at 0x{self.offset:x} ({self.offset})" if self.offset is not None else ""
        return f"{self.layer}{where}: {self.expected}"

    def within(self, layer: str, base: int = 0) -> "FormatError":
        """The same error seen from an enclosing layer starting at ``base``."""
        off = None if self.offset is None else self.offset + base
        e = FormatError(f"{layer}: {self.layer}" if layer else self.layer, off, self.expected)
        e.part = self.part
        return e


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived while slotctl held something to clean up (the spool of standard input:
    :func:`slotctl.paths.stdin_copy`); raised by its handler, so that every ``finally`` runs on the way out.
    A BaseException, as KeyboardInterrupt: no per-file ``except Exception`` takes it for a file's error."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class UsageError(SlotctlError):
    """A usage or I/O error (exit 2); ``code`` says which when a script may care (``no_such_file``)."""

    exit_status = ExitStatus.USAGE

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class StoreDown(UsageError):
    """An object store stopped answering, or the command's ``--timeout`` passed (``store_unreachable``):
    the run stops with this one error. Every loop over files or objects that reports a file's error and
    goes on lets this one through (re-raises it), and every later request to the store is refused at once
    with it (:func:`slotctl.store.s3.call`)."""

    code = "store_unreachable"

    def __init__(self, message: str):
        super().__init__(message, code="store_unreachable")


def snake_case(name: str) -> str:
    """``ServerUnreachable`` -> ``server_unreachable``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def os_error_code(e: OSError) -> str:
    """The ``--json`` error code of an I/O error."""
    return {errno.ENOENT: "no_such_file", errno.EACCES: "permission_denied", errno.EISDIR: "is_a_directory",
            errno.ENOSPC: "no_space"}.get(e.errno, "io_error")


class ErrorEntry(NamedTuple):
    """One thing's failure in a run over many (a file, a copy, a step): its ``code`` for scripts, its one
    line, its exit status. :meth:`as_dict` is the ``error`` object of docs/json.md."""

    code: str
    message: str
    exit_status: int

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message}


def error_entry(e: BaseException, path: str | os.PathLike | None = None) -> ErrorEntry | None:
    """The failure of one file (``path``, when the caller knows which: else the error's own file name) for
    a slotctl error or an I/O error; None for anything else. Every per-file failure is made here, and the
    error table (``slotctl.cli.errors``) takes its rows for these two from it: one code per cause (an
    ``OSError``: :func:`os_error_code`), one wording (``PATH: strerror``)."""
    if isinstance(e, SlotctlError):
        return ErrorEntry(e.error_code, str(e), int(e.exit_status))
    if isinstance(e, OSError):
        where = os.fspath(path) if path is not None else (e.filename or "")
        return ErrorEntry(os_error_code(e), f"{where}: {e.strerror or e}".lstrip(": "), int(ExitStatus.USAGE))
    return None


# -- untrusted text shown (a terminal, the /ui page) ------------------------------------------------------

# C0 and C1 controls (not tab and newline), the format characters that reorder or break a line, and lone
# surrogates: the bytes of a file name that are not UTF-8 (os.fsdecode's surrogateescape gives byte B as
# U+DC00+B), which a terminal would show as one replacement character whatever the byte
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape_char(c: str) -> str:
    n = ord(c)
    if 0xDC80 <= n <= 0xDCFF:    # a byte of a name that is not UTF-8: shown as that byte, \xNN
        n -= 0xDC00
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def escape_text(text: str, *, keep_newlines: bool = True) -> str:
    """Untrusted text made safe for a terminal: control characters as ``\\xNN`` (as gguf_dump does), and
    the bytes of a name that are not UTF-8 as ``\\xNN`` too (two such names never look alike).

    Bidirectional overrides and Unicode line separators become ``\\uNNNN``. Without ``keep_newlines``
    (one-line messages) newline and tab are escaped too.
    """
    out = _CONTROL.sub(lambda m: _escape_char(m.group()), str(text))
    if not keep_newlines:
        out = out.replace("\n", "\\n").replace("\t", "\\t")
    return out
