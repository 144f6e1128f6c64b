"""Building blocks shared by the layer schemas.

Parsing follows three rules (see docs/design.md):

* construct describes headers and records;
* bulk fixed-size arrays (cells, token words) are read in one call and viewed with numpy;
* tensor bytes are never read while inspecting: :class:`Payload` records where they are and
  seeks over them (``lazy=True``), or reads them when the caller needs the bytes (``lazy=False``).

Every length and count read from a file is checked against the bytes that remain before anything is
allocated or skipped, so a damaged file costs no more than its own size.

Errors: :func:`parse` turns any construct error into a one-line :class:`~slotctl.errors.FormatError`
that names the layer, the absolute offset and what was expected.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import construct as cs

from slotctl.errors import FormatError

#: the largest layer count any schema accepts (no model comes near; it bounds loops on damaged input)
MAX_LAYERS = 4096
#: the largest stream count (llama.cpp caps n_seq_max at 256)
MAX_STREAMS = 1024


#: what one file may make slotctl read and hold of its cells, token words and checkpoints, whatever its
#: size (bytes): a 2^24-cell target and as large a draft state fit, with room
MAX_FILE_BUDGET = 1 << 30
#: what any file may cost, however small (bytes)
BASE_FILE_BUDGET = 128 << 20
#: what a file may cost per byte it really has (its allocated blocks: a hole costs nothing on disk and must
#: cost nothing here either)
BUDGET_PER_BYTE = 4
#: what reading one checkpoint costs beyond its cells (its objects, its blobs' layout search), in budget bytes
CHECKPOINT_COST = 64 << 10
#: what one cell costs beyond its bytes when its size follows no pattern and it is walked with a Python step
#: (format.cells): the budget's 1 GiB then holds at most ~14M such cells, a few seconds of walking
WALKED_CELL_COST = 64


class FileBudget:
    """What one file may make slotctl read and hold, as a whole (docs/design.md, "Bounds"): the bytes of
    its cells and token words read, and a fixed cost per checkpoint, against
    ``min(MAX_FILE_BUDGET, BASE_FILE_BUDGET + BUDGET_PER_BYTE * the bytes the file really has)``.

    Each count is also checked against what its layer can hold; this bound is the sum's, so 65,536
    checkpoints of many cells each, or a token list in a sparse file, cost a finding, not gigabytes. The
    parse shares one budget per open stream (the walks of one command over one file: another layout, a
    second reading), so a command's whole reading of a file is bounded.
    """

    def __init__(self, size: int, allocated: int | None = None):
        real = size if allocated is None else min(size, allocated)
        self.limit = min(MAX_FILE_BUDGET, BASE_FILE_BUDGET + BUDGET_PER_BYTE * real)
        self.size, self.real = size, real
        self.used = 0
        self.seen: set = set()
        self.refused: dict = {}   # key -> why, of what was refused once

    @property
    def exhausted(self) -> bool:
        return self.used > self.limit

    def charge_once(self, key, n: int, what: str, offset: int | None) -> None:
        """:meth:`charge` the first time ``key`` is charged (a layer located again by another walk)."""
        if key not in self.seen:
            self.seen.add(key)
            self.charge(n, what, offset)

    def charge(self, n: int, what: str, offset: int | None) -> None:
        """Count ``n`` more bytes read or held for ``what``; a CheckError at ``offset`` past the limit."""
        self.used += n
        if self.used > self.limit:
            sparse = f" ({self.real:,} on disk)" if self.real < self.size else ""
            raise CheckError(f"{what}: the file's cells, token words and checkpoints within what a file of "
                             f"{self.size:,} bytes{sparse} can hold ({self.limit:,} bytes of them read at most); "
                             f"it needs more (counts that its bytes do not back)", offset)


def charge(context, n: int, what: str, offset: int | None) -> None:
    """Charge the parse's :class:`FileBudget` (parse parameter ``file_budget``), when it has one."""
    params = context.get("_params") if hasattr(context, "get") else None
    budget = params.get("file_budget") if params is not None else None
    if budget is not None:
        budget.charge(n, what, offset)


class CheckError(cs.ConstructError):
    """Raised by our own checks, with the absolute offset where the bad value starts."""

    def __init__(self, message: str, offset: int | None):
        super().__init__(message)
        self.offset = offset
        self.message = message


class TrackingReader(io.RawIOBase):
    """A read-only view of a binary stream that remembers where the last read started.

    construct reports *what* failed but not *where*; the start of the last read is the offset of the
    field that was being read when the stream ran short. ``size`` is fixed when the view is made, so
    length checks cost no system call.
    """

    def __init__(self, raw: BinaryIO, size: int | None = None):
        super().__init__()
        self.raw = raw
        if size is None:
            cur = raw.tell()
            size = raw.seek(0, os.SEEK_END)
            raw.seek(cur)
        self.size = size
        self.last_read_start = raw.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        self.last_read_start = self.raw.tell()
        return self.raw.read(n)

    def readinto(self, b) -> int:  # pragma: no cover - construct uses read()
        self.last_read_start = self.raw.tell()
        return self.raw.readinto(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def remaining(self) -> int:
        return self.size - self.raw.tell()

    _fd: int | None = -1   # -1: not yet looked up; None: the stream has no descriptor

    def pread(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` (fewer at the end), counted as a read that started there: a ``pread`` on a
        local file's descriptor (no seek, no refill of the buffer; the stream's position is left for the
        caller to set), else a seek and a read."""
        self.last_read_start = offset
        fd = self._fd
        if fd == -1:
            try:
                fd = self.raw.fileno() if isinstance(self.raw, (io.BufferedReader, io.FileIO)) else None
            except (OSError, ValueError, io.UnsupportedOperation):
                fd = None
            self._fd = fd
        if fd is not None:
            return os.pread(fd, n, offset)
        self.raw.seek(offset)
        return self.raw.read(n)


def _remaining(stream) -> int:
    if isinstance(stream, TrackingReader):
        return stream.remaining()
    cur = stream.tell()
    end = stream.seek(0, os.SEEK_END)
    stream.seek(cur)
    return end - cur


def _lazy(context) -> bool:
    params = context.get("_params") or {}
    return bool(params.get("lazy", False))


@dataclass(frozen=True)
class Span:
    """Bytes of a file that were located but not read: ``size`` bytes at absolute ``offset``."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size

    def read(self, f: BinaryIO) -> bytes:
        f.seek(self.offset)
        data = f.read(self.size)
        if len(data) != self.size:
            raise FormatError("payload", self.offset, f"{self.size} bytes, the file ends first")
        return data


def coalesce(pieces) -> list:
    """A file's pieces (``Span``s of an existing file, ``bytes`` to write, anything else passed through as
    it is) with empty spans and bytes dropped, neighbouring bytes joined and contiguous spans merged."""
    out: list = []
    for p in pieces:
        size = p.size if isinstance(p, Span) else len(p) if isinstance(p, bytes) else None
        if size == 0:
            continue
        last = out[-1] if out else None
        if isinstance(p, Span) and isinstance(last, Span) and last.end == p.offset:
            out[-1] = Span(last.offset, last.size + p.size)
        elif isinstance(p, bytes) and isinstance(last, bytes):
            out[-1] = last + p
        else:
            out.append(p)
    return out


class Payload(cs.Construct):
    """Opaque bytes whose length comes from elsewhere (``length``: an int or a context lambda).

    Parsing checks the length against the bytes left in the stream first. With ``lazy=True`` in the
    parse parameters it returns a :class:`Span` and seeks over the bytes; otherwise it returns them.
    Building takes ``bytes`` of exactly that length.
    """

    def __init__(self, length, what: str = "tensor data"):
        super().__init__()
        self.length = length
        self.what = what

    def _parse(self, stream, context, path):
        n = cs.evaluate(self.length, context)
        start = stream.tell()
        left = _remaining(stream)
        if n < 0 or n > left:
            raise CheckError(f"{self.what} of {n:,} bytes, but only {left:,} bytes remain in the file", start)
        if _lazy(context):
            stream.seek(n, os.SEEK_CUR)
            return Span(start, n)
        return cs.stream_read(stream, n, path)

    def _build(self, obj, stream, context, path):
        n = cs.evaluate(self.length, context)
        if isinstance(obj, Span):
            raise cs.ConstructError(f"{self.what}: cannot build from a lazy span; parse with lazy=False", path=path)
        if len(obj) != n:
            raise cs.ConstructError(f"{self.what}: {len(obj)} bytes given, the header says {n}", path=path)
        cs.stream_write(stream, obj, n, path)
        return obj

    def _sizeof(self, context, path):
        return cs.evaluate(self.length, context)


class Counted(cs.Subconstruct):
    """An unsigned count that must not exceed ``limit`` (int or lambda) — guards loops and arrays.

    ``limit`` may also depend on the bytes remaining: pass ``min_item_size`` to require
    ``count * min_item_size <= remaining``.
    """

    def __init__(self, subcon, what: str, limit=None, min_item_size: int = 0, minimum: int = 0):
        super().__init__(subcon)
        self.what = what
        self.limit = limit
        self.min_item_size = min_item_size
        self.minimum = minimum

    def _parse(self, stream, context, path):
        start = stream.tell()
        value = self.subcon._parsereport(stream, context, path)
        if value < self.minimum:
            raise CheckError(f"{self.what} of at least {self.minimum:,}, found {value:,}", start)
        limit = cs.evaluate(self.limit, context) if self.limit is not None else None
        if limit is not None and value > limit:
            raise CheckError(f"{self.what} of at most {limit:,}, found {value:,}", start)
        if self.min_item_size:
            left = _remaining(stream)
            if value * self.min_item_size > left:
                raise CheckError(
                    f"{self.what} {value:,} needs at least {value * self.min_item_size:,} bytes,"
                    f" only {left:,} remain",
                    start,
                )
        return value

    def _build(self, obj, stream, context, path):
        return self.subcon._build(obj, stream, context, path)


class Expect(cs.Subconstruct):
    """A field that must hold one of ``allowed`` values; says what was expected when it does not."""

    def __init__(self, subcon, allowed, what: str, fmt: Callable[[int], str] = str):
        super().__init__(subcon)
        self.allowed = tuple(allowed)
        self.what = what
        self.fmt = fmt

    def _parse(self, stream, context, path):
        start = stream.tell()
        value = self.subcon._parsereport(stream, context, path)
        if value not in self.allowed:
            want = " or ".join(self.fmt(a) for a in self.allowed)
            raise CheckError(f"{self.what} {want}, found {self.fmt(value)}", start)
        return value

    def _build(self, obj, stream, context, path):
        return self.subcon._build(obj, stream, context, path)


def hex32(v: int) -> str:
    return f"0x{v & 0xFFFFFFFF:08x}"


def strip_private(obj: Any) -> Any:
    """A parsed Container as plain dicts and lists, without construct's ``_`` keys."""
    if isinstance(obj, dict):
        return {k: strip_private(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [strip_private(v) for v in obj]
    return obj


def parse(schema: cs.Construct, f: BinaryIO, layer: str, *, size: int | None = None, **params) -> Any:
    """Parse ``schema`` at the current position of ``f``; any failure becomes a one-line FormatError.

    The offset in the error is absolute: that of the field that broke (for our own checks) or of the
    read that ran out of bytes (for short reads).
    """
    reader = f if isinstance(f, TrackingReader) else TrackingReader(f, size)
    start = reader.tell()
    try:
        return schema.parse_stream(reader, **params)
    except CheckError as e:
        raise FormatError(layer, e.offset, e.message) from None
    except cs.StreamError as e:
        off = reader.last_read_start
        left = reader.size - off
        where = _field_name(e)
        raise FormatError(layer, off, f"{where}, but the file ends {left:,} bytes later") from None
    except cs.ConstructError as e:
        off = reader.last_read_start if reader.last_read_start >= start else start
        raise FormatError(layer, off, _first_line(e)) from None


def parse_bytes(schema: cs.Construct, data: bytes, layer: str, base: int = 0, **params) -> Any:
    """Parse an in-memory buffer; offsets in errors are ``base`` + position in the buffer."""
    try:
        return parse(schema, io.BytesIO(data), layer, size=len(data), **params)
    except FormatError as e:
        raise FormatError(e.layer, None if e.offset is None else e.offset + base, e.expected) from None


def build(schema: cs.Construct, obj: Any, layer: str, **params) -> bytes:
    try:
        return schema.build(obj, **params)
    except cs.ConstructError as e:
        raise FormatError(layer, None, f"cannot build: {_first_line(e)}") from None


def _field_name(e: cs.ConstructError) -> str:
    path = getattr(e, "path", None) or ""
    parts = [p.strip() for p in str(path).split("->") if p.strip() and p.strip() != "(parsing)"]
    field = parts[-1] if parts else "a field"
    return f"expected {field}"


def _first_line(e: Exception) -> str:
    msg = str(e).strip()
    # construct prefixes messages with "Error in path ..." on a second line
    lines = [ln for ln in msg.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if not ln.startswith("Error in path"):
            return ln
    return lines[0] if lines else type(e).__name__
