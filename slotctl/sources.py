"""Where a slot file's bytes come from: a local path, or an object in a store (``s3://bucket/key``).

A command takes ``s3://bucket/key`` wherever it takes a slot file and ``s3://bucket/prefix/`` wherever it
takes a directory. The layers that read files (``slotfile``, ``validate``, ``catalog``) see a small
stream interface defined here, below them: :class:`RangedFile`, a read-only, seekable file object over
a ``fetch(ranges)`` function, with a block cache and :meth:`RangedFile.read_ranges` (many ranges in one
batch: one round trip). The object store itself lives above (``slotctl.store.s3``) and registers
itself here with :func:`register_store` when it is imported: imports point down, and a local command
never imports it (the CLI imports it only when an ``s3://`` path is given).

``pathlib`` turns ``s3://b/k`` into ``s3:/b/k``: :func:`remote_url` accepts both spellings, so a path
typed through a ``Path`` option still names the object.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from typing import BinaryIO, Protocol, Sequence

from slotctl.errors import UsageError
from slotctl.paths import open_regular

#: the schemes an object store can register
SCHEMES = ("s3",)
_URL = re.compile(r"^(?P<scheme>[a-z0-9]+):/{1,2}(?P<rest>.*)$", re.S)

#: what the first read of a remote object fetches: the state header, the token words of a short prompt,
#: the first section's header and the first records, in one request
HEAD_BYTES = 64 << 10
#: the least a later read fetches (a record header is tens of bytes; the next one is often near)
READAHEAD = 16 << 10
#: the bytes a reader keeps cached (oldest blocks dropped first)
CACHE_BYTES = 16 << 20


#: what every :class:`RangedFile` of this process fetched: batches (round trips), requests, bytes (the
#: benchmarks and the tests read it)
TOTALS = {"batches": 0, "requests": 0, "bytes": 0}


def remote_url(path: str | os.PathLike) -> str | None:
    """``scheme://rest`` when ``path`` names an object in a store (``s3://b/k``, or ``s3:/b/k`` as pathlib
    spells it), else None (a local path)."""
    p = os.fspath(path)
    if isinstance(p, bytes):
        return None
    m = _URL.match(p)
    if m is None or m["scheme"] not in SCHEMES:
        return None
    return f"{m['scheme']}://{m['rest']}"


def is_remote(path: str | os.PathLike) -> bool:
    return remote_url(path) is not None


def shown(path: str | os.PathLike) -> str:
    """``path`` as a command shows it: an ``s3://`` URL as typed (pathlib makes ``s3://`` into ``s3:/``)."""
    return remote_url(path) or os.fspath(path)


@dataclass(frozen=True)
class Entry:
    """An object (or file) as a listing or a stat sees it: its URL, size, last-modified time (POSIX seconds),
    ETag (None locally) and last-used time (``atime`` locally; None for an object: a store keeps none)."""

    path: str
    size: int
    mtime: float
    etag: str | None = None
    used: float | None = None


class Store(Protocol):
    """What an object store provides to the reading layers (``slotctl.store.s3.S3``)."""

    def open(self, url: str) -> "RangedFile": ...

    def stat(self, url: str) -> Entry | None: ...

    def list(self, url: str) -> list[Entry]: ...

    def peek(self, urls: Sequence[str], n: int) -> list[bytes | None]: ...

    def delete(self, url: str) -> None: ...


_STORES: dict[str, Store] = {}


def register_store(scheme: str, store: Store) -> None:
    """Make ``scheme://`` paths readable through ``store`` (called by the store module on import)."""
    _STORES[scheme] = store


def store_for(url: str) -> Store:
    """The store registered for ``url``'s scheme, or a usage error naming what is missing."""
    scheme = url.partition("://")[0]
    store = _STORES.get(scheme)
    if store is None:
        raise UsageError(f"{url}: {scheme}:// paths need slotctl's object store (slotctl.store.s3, the [s3] "
                         "extra: pip install 'slotctl[s3]')", code="store_missing")
    return store


class RangedFile(io.RawIOBase):
    """A read-only, seekable file over ``fetch``: reads are served from cached blocks, a miss fetches at
    least :data:`READAHEAD` bytes from where it starts (the first read :data:`HEAD_BYTES`).

    A subclass gives :meth:`fetch` (the bytes of each ``(offset, size)`` range, in one round trip) and sets
    ``size`` and ``name``. What is fetched is counted in :data:`TOTALS` (tests and benchmarks).
    """

    size: int = 0
    name: str = ""
    #: the first error a fetch raised (see :func:`raise_failure`)
    failure: Exception | None = None

    def __init__(self):
        super().__init__()
        self._pos = 0
        self._blocks: list[tuple[int, bytes]] = []   # (offset, bytes), oldest first
        self._cached = 0

    # -- what a subclass provides
    def fetch(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- the cache
    def _lookup(self, offset: int, n: int) -> bytes | None:
        for start, data in reversed(self._blocks):
            if start <= offset and offset + n <= start + len(data):
                return data[offset - start:offset - start + n]
        return None

    def _keep(self, offset: int, data: bytes) -> None:
        self._blocks.append((offset, data))
        self._cached += len(data)
        while self._cached > CACHE_BYTES and len(self._blocks) > 1:
            _, old = self._blocks.pop(0)
            self._cached -= len(old)

    def _fetch_counted(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        TOTALS["batches"] += 1
        try:
            out = self.fetch(ranges)
        except Exception as e:
            # kept: a parser (construct) turns any exception of a read into a short read, that is into damage;
            # :func:`raise_failure` raises the store's own error after the walk
            self.failure = e
            raise
        n = sum(len(b) for b in out)
        TOTALS["requests"] += len(ranges)
        TOTALS["bytes"] += n
        return out

    def warm(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Fetch ``ranges`` in one batch and keep them for the reads that follow."""
        self.read_ranges(ranges)

    def read_ranges(self, ranges: Sequence[tuple[int, int]], *, keep: bool = True) -> list[bytes]:
        """The bytes of each ``(offset, size)`` range (short at the end of the object), the missing ones
        fetched in one batch; ``keep``: cache them for later reads."""
        out: list[bytes | None] = []
        missing: list[int] = []
        for i, (off, n) in enumerate(ranges):
            n = max(0, min(n, self.size - off))
            hit = self._lookup(off, n) if n else b""
            out.append(hit)
            if hit is None:
                missing.append(i)
        if missing:
            want = [(ranges[i][0], max(0, min(ranges[i][1], self.size - ranges[i][0]))) for i in missing]
            for i, data in zip(missing, self._fetch_counted(want)):
                out[i] = data
                if keep:
                    self._keep(ranges[i][0], data)
        return out  # type: ignore[return-value]

    # -- io.RawIOBase
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(22, "negative seek position")
        self._pos = base + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self._pos
        n = max(0, min(n, self.size - self._pos))
        if n == 0:
            return b""
        data = self._lookup(self._pos, n)
        if data is None:
            want = n if n >= READAHEAD else min(max(READAHEAD, n), self.size - self._pos)
            if not self._blocks and self._pos == 0:
                want = max(want, min(HEAD_BYTES, self.size))
            block = self._fetch_counted([(self._pos, want)])[0]
            if len(block) < n:
                raise OSError(5, f"{self.name}: the object ended at {self._pos + len(block):,} bytes, "
                                 f"{self.size:,} were announced")
            if want <= CACHE_BYTES:
                self._keep(self._pos, block)
            data = block[:n]
        self._pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.name}: an object in a store has no file descriptor")


class LocalRanges:
    """What :func:`slotctl.format.ahead.prefetch` needs of a local file: its ``size``, :meth:`read_ranges`
    (``pread``s) and :meth:`warm`, which hands a batch of ranges to the kernel at once
    (``posix_fadvise(WILLNEED)``: the reads start together, in the background, and the walk's own reads
    then find the pages in the cache). So a file's record headers cost about one wait on a cold disk
    instead of one per header: the two-read metadata rule, locally."""

    def __init__(self, f: BinaryIO, size: int | None = None):
        self.fd = f.fileno()
        self.size = os.fstat(self.fd).st_size if size is None else size

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return [os.pread(self.fd, n, off) if n > 0 else b"" for off, n in ranges]

    def warm(self, ranges: Sequence[tuple[int, int]]) -> None:
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        for off, n in ranges:
            try:
                advise(self.fd, off, n, os.POSIX_FADV_WILLNEED)
            except OSError:   # a filesystem that takes no advice: the walk reads as it would have
                return


def ranged_view(f: BinaryIO, size: int | None = None):
    """``f`` as :func:`slotctl.format.ahead.prefetch` reads it: a :class:`RangedFile` as it is, a local file
    through :class:`LocalRanges` (``size``: its size, when the caller has it already); None for a stream
    that has neither (standard input's copy is a local file; a stream in memory has nothing to gain)."""
    if isinstance(f, RangedFile):
        return f
    try:
        return LocalRanges(f, size)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def open_input(path: str | os.PathLike, *, what: str = "") -> BinaryIO:
    """``path`` opened for reading: a regular local file (:func:`~slotctl.paths.open_regular`) or an object
    of a registered store."""
    url = remote_url(path)
    if url is None:
        return open_regular(path, what=what)
    return store_for(url).open(url)  # type: ignore[return-value]


def raise_failure(f: BinaryIO) -> None:
    """Raise the error a :class:`RangedFile`'s store gave while it was read, if any: an object that could
    not be read is an I/O error (exit 2), never a damaged file, whatever a parser made of the short read."""
    failure = getattr(f, "failure", None)
    if failure is not None:
        raise failure


def input_size(f: BinaryIO) -> int:
    """The size of an open input: a :class:`RangedFile`'s object size, or the local file's ``fstat``."""
    if isinstance(f, RangedFile):
        return f.size
    return os.fstat(f.fileno()).st_size


def first_bytes(paths: Sequence[str], n: int = 4) -> list[bytes | None]:
    """The first ``n`` bytes of each path (None: it cannot be read; the command that opens it says why).
    Objects in a store are read concurrently, and what was read serves their next open."""
    out: list[bytes | None] = [None] * len(paths)
    remote: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        url = remote_url(p)
        if url is not None:
            remote.setdefault(url.partition("://")[0], []).append(i)
            continue
        try:
            with open_regular(p) as f:
                out[i] = f.read(n)
        except (OSError, UsageError):
            pass
    for scheme, idx in remote.items():
        urls = [remote_url(paths[i]) for i in idx]
        for i, head in zip(idx, store_for(urls[0]).peek(urls, n)):  # type: ignore[arg-type]
            out[i] = head
    return out


def sub_prefixes(url: str) -> list[str]:
    """The prefixes directly under ``url`` (``s3://b/p/sub/``), when its store lists them; else none."""
    lister = getattr(store_for(url), "prefixes", None)
    return lister(url) if lister is not None else []


def prefix_exists(url: str) -> bool:
    """Whether ``url`` taken as a prefix is there (something under it, a sub-prefix, or the store's marker of an
    emptied prefix), when its store tells; a store has no directories, so nothing at all under it is none."""
    exists = getattr(store_for(url), "prefix_exists", None)
    return exists(url) if exists is not None else False


def list_prefix(url: str) -> list[Entry] | None:
    """The objects directly under ``url`` taken as a prefix (``s3://b/p`` and ``s3://b/p/`` alike), sorted by
    key; None when ``url`` names an object itself."""
    store = store_for(url)
    if not url.endswith("/") and store.stat(url) is not None:
        return None
    return store.list(url)

