"""A model's identity is its content: the SHA-256 of every byte of its GGUF file (of each of its split files, in
order), computed once per file and kept, by the file's identity, in a cache that outlives the process.

What a server reports about its model (``/props`` ``model_path``, ``/v1/models`` meta) finds the file and is
checked against it (:meth:`ModelContent.disagrees`), never taken for its identity: two models of the same
architecture and shapes (a fine-tune, another quantisation, another seed) report the same facts, and only
their bytes tell them apart. The digest covers the whole file, metadata included: any change to the file is
another model (an edited chat template too: conservative, never wrong).

**Cost.** A real model is gigabytes: hashing reads every byte (a made-up 4.29 GB GGUF took 6.15 s, 0.70 GB/s,
on the shared 2-core machine slotctl is developed on, SHA-NI, load average 6: hashlib's SHA-256 alone ran at
0.84 GB/s there; found in the cache afterwards in 0.34 ms: docs/fleet.md). So a digest is made once
per file identity (device, inode, size, ``mtime_ns``, ``ctime_ns``: :func:`file_key`; a file replaced or
rewritten in place has another) and kept in :func:`cache_dir` (one small JSON file per model file, written
atomically), which survives restarts: keep, serve, validate and ls ask it with one ``stat`` per file. One
process hashes a file at a time (a lock file per identity: another waits and reads the answer). A file
changed less than :data:`RACY_SECONDS` before it was hashed is hashed, but its digest is not kept (it may
still change within its timestamps' granularity); a file that changes while it is hashed is refused.

Progress: ``progress(bytes done, bytes in all)`` (:mod:`slotctl.progress`), a bar on a terminal.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass

from slotctl.errors import UsageError
from slotctl.paths import cache_home, open_regular
from slotctl.progress import Progress

#: the digest's algorithm (hashlib's name): its hex digest is a model's identity
ALGORITHM = "sha256"
#: bytes read (and hashed) at a time
READ_CHUNK = 8 << 20
#: a file changed less than this long before it was hashed is not kept in the cache
RACY_SECONDS = 3.0
#: the cache's entries; an entry of another version is not read (the file is hashed again)
CACHE_VERSION = 1
#: llama.cpp's names of a split model's files (``llama_split_path``): PREFIX-00001-of-00003.gguf
_SPLIT = re.compile(r"(?P<prefix>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf")
#: how many characters of the digest name a model in a stored state's name and in what slotctl says
SHORT = 16


def cache_dir() -> str:
    """Where the digests are kept: ``models/`` under slotctl's cache directory (:func:`slotctl.paths.cache_home`)."""
    return os.path.join(cache_home(), "models")


def file_key(st: os.stat_result) -> str:
    """A file's identity for the cache: device, inode, size, ``mtime_ns`` and ``ctime_ns`` (a rewrite in place
    changes the times, a replacement the inode: either is another model until its bytes say otherwise)."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


@dataclass(frozen=True)
class ModelContent:
    """A model's identity (:func:`model_content`): ``digest`` (the hex SHA-256 of its bytes, every split file in
    order), the ``files`` read and their ``keys`` (:func:`file_key`) when read, their ``size`` in bytes, its
    tensors' element count and bytes (``n_params``, ``tensor_bytes``: what llama-server reports in
    ``/v1/models`` meta as ``n_params`` and ``size``), how long the hashing took (``seconds``; 0 for a digest
    from the cache, ``cached``)."""

    digest: str
    files: tuple[str, ...]
    keys: tuple[str, ...]
    size: int
    n_params: int
    tensor_bytes: int
    seconds: float = 0.0
    cached: bool = False

    @property
    def short(self) -> str:
        """The first :data:`SHORT` hex digits: how a stored state's name and slotctl's messages name the model."""
        return self.digest[:SHORT]

    @property
    def path(self) -> str:
        return self.files[0]

    def disagrees(self, meta: dict | None) -> str | None:
        """Why this file is not the model a server describes in ``/v1/models`` meta (``meta``: its ``n_params``
        and ``size``, the sums of the model's tensors), or None when they agree or it says neither."""
        meta = meta or {}
        diffs = [f"{what} {mine:,} in the file, {meta[key]:,} in the server's answer"
                 for key, what, mine in (("n_params", "parameters", self.n_params),
                                         ("size", "tensor bytes", self.tensor_bytes))
                 if isinstance(meta.get(key), int) and not isinstance(meta.get(key), bool) and meta[key] != mine]
        return "; ".join(diffs) or None

    def as_dict(self) -> dict:
        return {"digest": self.digest, "files": list(self.files), "size": self.size, "n_params": self.n_params,
                "tensor_bytes": self.tensor_bytes, "seconds": round(self.seconds, 3), "cached": self.cached}


def split_files(path: str) -> list[str]:
    """The files of the model whose first file is ``path``: itself, or every split file of a model saved in
    splits (llama.cpp loads PREFIX-0000I-of-0000N.gguf for I in 2..N when the first says ``split.count`` N)."""
    m = _SPLIT.fullmatch(os.path.basename(path))
    if m is None or int(m["i"]) != 1 or int(m["n"]) < 2:
        return [path]
    count = _split_count(path)
    if count is None or count < 2:
        return [path]
    head = os.path.join(os.path.dirname(path), m["prefix"])
    return [f"{head}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def _split_count(path: str) -> int | None:
    fields = _reader(path).fields
    f = fields.get("split.count")
    if f is None or not f.data:
        return None
    return int(f.parts[f.data[0]][0])


def _reader(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises whatever numpy or struct raise on a damaged file
        raise UsageError(f"not a GGUF file: {path} (damaged header: {' '.join(str(e).split())})",
                         code="not_a_model") from None


def _tensor_sums(path: str) -> tuple[int, int]:
    """The element count and bytes of the tensors of one GGUF file."""
    tensors = _reader(path).tensors
    return sum(int(t.n_elements) for t in tensors), sum(int(t.n_bytes) for t in tensors)


def model_content(path: str | os.PathLike, *, progress: Progress | None = None, use_cache: bool = True) -> ModelContent:
    """The identity of the model at ``path`` (a GGUF file, the first of its splits): from the cache when every
    file has the identity its digest was made for, else hashed (``progress(done, total)`` as the bytes are
    read) and kept. :class:`UsageError` (one line) when a file cannot be read, is not a GGUF, or changes while it
    is hashed."""
    path = os.fspath(path)
    if use_cache:       # one stat per file: the model file is not opened
        found = cached_content(path)
        if found is not None:
            return found
    path = _checked(path)
    files = split_files(path)
    keys = [_key(p) for p in files]
    with _hashing_lock(_entry_path(keys[0])):
        if use_cache:       # another process may have hashed it while this one waited
            found = cached_content(path)
            if found is not None:
                return found
        made = _hash(files, keys, progress)
        if use_cache:
            _keep(_entry_path(keys[0]), made)
    return made


def cached_content(path: str | os.PathLike) -> ModelContent | None:
    """The model's identity from the cache alone (one ``stat`` per file, nothing hashed); None when the cache
    does not hold a digest for its files as they are now, or cannot be read (a damaged entry is taken as none:
    the model is hashed again)."""
    path = os.fspath(path)
    try:
        first = _key(path)
        with open(_entry_path(first), "rb") as f:
            data = json.loads(f.read(1 << 16))
    except (OSError, ValueError, UsageError):
        return None
    if not (isinstance(data, dict) and data.get("version") == CACHE_VERSION and data.get("algorithm") == ALGORITHM
            and isinstance(data.get("digest"), str) and re.fullmatch(r"[0-9a-f]{64}", data["digest"])
            and _strings(data.get("files")) and _strings(data.get("keys"))
            and len(data["files"]) == len(data["keys"]) >= 1 and data["keys"][0] == first
            and all(isinstance(data.get(k), int) and not isinstance(data.get(k), bool)
                    for k in ("size", "n_params", "tensor_bytes"))):
        return None
    files = [path, *(os.path.join(os.path.dirname(path), os.path.basename(p)) for p in data["files"][1:])]
    try:
        if [first, *(_key(p) for p in files[1:])] != data["keys"]:
            return None
    except UsageError:
        return None
    return ModelContent(data["digest"], tuple(files), tuple(data["keys"]), data["size"], data["n_params"],
                        data["tensor_bytes"], 0.0, True)


def _strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _checked(path: str) -> str:
    try:
        with open_regular(path, what="model ") as f:
            magic = f.read(4)
    except OSError as e:
        raise UsageError(f"cannot read model {path}: {e.strerror or e}", code="unreadable") from None
    if magic != b"GGUF":
        raise UsageError(f"not a GGUF file: {path}", code="not_a_model")
    return path


def _key(path: str) -> str:
    try:
        return file_key(os.stat(path))
    except OSError as e:
        raise UsageError(f"cannot read model {path}: {e.strerror or e}", code="unreadable") from None


def _entry_path(key: str) -> str:
    return os.path.join(cache_dir(), hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _keep(entry: str, made: ModelContent) -> None:
    """``made`` written into the cache (atomically), unless a file changed too recently to be sure of (its
    identity may not change with a write in the same timestamp tick); a cache that cannot be written is not
    used (the model is hashed again next time)."""
    from slotctl.atomic import atomic_writer

    now = time.time()
    for p in made.files:
        try:
            st = os.stat(p)
        except OSError:
            return
        if now - max(st.st_mtime, st.st_ctime) < RACY_SECONDS:
            return
    data = {"version": CACHE_VERSION, "algorithm": ALGORITHM, "files": list(made.files), "keys": list(made.keys),
            "digest": made.digest, "size": made.size, "n_params": made.n_params, "tensor_bytes": made.tensor_bytes,
            "seconds": round(made.seconds, 3), "made": now}
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        with atomic_writer(entry, overwrite=True) as f:
            f.write(json.dumps(data).encode())
    except (OSError, UsageError):
        pass


class _hashing_lock:
    """An exclusive lock on ``ENTRY.lock`` while a file is hashed (one process hashes one model at a time; the
    others wait and read its digest from the cache); no lock when the cache directory cannot be written."""

    def __init__(self, entry: str):
        self.path = entry[:-len(".json")] + ".lock"
        self.fd: int | None = None

    def __enter__(self):
        import fcntl

        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            if self.fd is not None:
                os.close(self.fd)
            self.fd = None
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)       # the lock goes with the descriptor


def _hash(files: list[str], keys: list[str], progress: Progress | None) -> ModelContent:
    """Every byte of ``files`` hashed in order; each file must keep its identity (``keys``) while it is read."""
    t0 = time.perf_counter()
    h = hashlib.new(ALGORITHM)
    sizes = [int(k.split(":")[2]) for k in keys]
    total, done = sum(sizes), 0
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    n_params = tensor_bytes = 0
    for path, key in zip(files, keys):
        with open_regular(path, what="model ") as f:
            fd = f.fileno()
            if file_key(os.fstat(fd)) != key:
                raise _changed(path)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                h.update(view[:n])      # hashlib lets other threads run while it hashes a large buffer
                done += n
                if progress is not None:
                    progress(done, total)
            if file_key(os.fstat(fd)) != key:
                raise _changed(path)
        p, b = _tensor_sums(path)
        n_params, tensor_bytes = n_params + p, tensor_bytes + b
    return ModelContent(h.hexdigest(), tuple(files), tuple(keys), done, n_params, tensor_bytes,
                        time.perf_counter() - t0, False)


def _changed(path: str) -> UsageError:
    return UsageError(f"model {path}: changed while it was read (being written?): its identity is not known",
                      code="model_changed")
