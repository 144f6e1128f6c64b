"""Where kept states live: a directory of this machine or an ``s3://`` prefix (``keep --store``, ``serve
--store``, ``migrate --store``), behind one small interface (``has``, ``put``, ``names``, ``listing``,
``local``, ``prune``, ``where``); and a slot file a server has just saved, read back (:class:`Saved`).

Without ``--store``, keep's and serve's store is a directory of its own inside the slot directory
(:data:`DEFAULT_STORE`): llama-server saves a client's slot only as a plain file name there (no ``/``), so no
client's ``POST /slots/N?action=save`` reaches the stored states, their catalog or the lock.

Every write is whole or absent: a local file through :func:`slotctl.atomic.atomic_writer`, an object through
:mod:`slotctl.store.cp`'s upload (created only if absent, its size and MD5 checked).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotctl.errors import UsageError


#: the default store: a directory inside the slot directory, out of a client's slot save's reach
DEFAULT_STORE = ".slotctl-store"


class DirectoryStore:
    """A store that is a directory of this machine (``--store DIR``, or ``--slot-dir`` itself)."""

    def __init__(self, path: str | os.PathLike, slot_dir: Path):
        self.path = Path(path)
        self.same = self.path.resolve() == slot_dir.resolve()

    def __str__(self) -> str:
        return os.fspath(self.path)

    def where(self, name: str) -> str:
        return os.fspath(self.path / name)

    def again(self) -> None:
        """A new run of a long-running process (keep's tick): nothing to forget here."""

    def has(self, name: str) -> bool:
        return (self.path / name).exists()

    def named(self, prefix: str) -> list[str]:
        """The states whose names begin with ``prefix`` (one directory read; temporary files never)."""
        with os.scandir(self.path) as it:
            return [d.name for d in it if d.name.startswith(prefix) and d.name.endswith(".bin")]

    def put(self, local: Path, name: str, *, move: bool = True) -> None:
        """``local`` into the store as ``name``, atomically (never over a state of that name); with ``move``
        (keep's working file) ``local`` is gone after."""
        if move and self.same:
            if (self.path / name).exists():
                raise UsageError(f"{self.path / name}: exists in the store", code="exists")
            os.replace(local, self.path / name)
            from slotctl.atomic import fsync_dir

            fsync_dir(os.fspath(self.path))
            return
        copy_atomic(local, self.path / name)
        if move:
            os.unlink(local)

    def names(self, prefix: str) -> list[str]:
        """The states whose names start with ``prefix``, newest first (temporary files never)."""
        if not self.path.is_dir():
            return []       # the default store, not made yet: no state
        found = [p for p in self.path.iterdir() if p.name.startswith(prefix) and p.name.endswith(".bin")]
        return [p.name for p in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)]

    def listing(self, match) -> dict[str, tuple[str | None, int, int]]:
        """The states whose names ``match(name)``: name -> (identity for the catalog, changed_ns, size), one
        directory read (temporary files never)."""
        from slotctl.catalog import local_identity

        out = {}
        if not self.path.is_dir():
            return out      # the default store, not made yet: no state
        with os.scandir(self.path) as it:
            for d in it:
                if d.name.endswith(".bin") and match(d.name):
                    try:
                        st = d.stat()
                    except FileNotFoundError:
                        continue
                    out[d.name] = (local_identity(st), st.st_mtime_ns, st.st_size)
        return out

    def local(self, name: str, staging: Path) -> Path:
        """A local file holding the state ``name`` (the store's own file here)."""
        return self.path / name

    def sweep_temps(self, age: float, now: float, on_file) -> None:
        """The temporary files of atomic writes into the store (:func:`slotctl.atomic.private_name`) untouched
        for ``age`` seconds removed (a process killed during a copy left them); ``on_file(path, size)`` each."""
        from slotctl.paths import is_temp_file

        if self.same:
            return      # the slot directory itself: its leftovers are swept by their working names
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return
        for e in entries:
            if not is_temp_file(e.name):
                continue
            try:
                st = e.stat(follow_symlinks=False)
                if now - st.st_mtime < age or not e.is_file(follow_symlinks=False):
                    continue
                os.unlink(e.path)
            except OSError:
                continue
            on_file(Path(e.path), st.st_size)

    def identity(self, name: str) -> tuple[str, int] | None:
        """The state ``name``'s identity for the catalog (:func:`slotctl.catalog.local_identity`) and its
        mtime (ns); None when it cannot be stat'ed."""
        from slotctl.catalog import local_identity

        try:
            st = (self.path / name).stat()
        except OSError:
            return None
        return local_identity(st), st.st_mtime_ns

    def mtime(self, name: str) -> float:
        return (self.path / name).stat().st_mtime

    def delete(self, name: str) -> int:
        """Delete the state ``name`` (keep's retention); its size (0 when it was already gone)."""
        try:
            size = (self.path / name).stat().st_size
            os.unlink(self.path / name)
        except FileNotFoundError:
            return 0
        return size

    def usage(self) -> tuple[int, int]:
        """The store's states (``*.bin``, temporary files never): how many, and their bytes."""
        if not self.path.is_dir():
            return 0, 0     # the default store, not made yet: no state
        sizes = [e.stat().st_size for e in os.scandir(self.path) if e.name.endswith(".bin")
                 and not e.name.startswith(".") and e.is_file(follow_symlinks=False)]
        return len(sizes), sum(sizes)

    def reachable(self) -> None:
        """OSError unless the store's directory can be listed."""
        os.stat(self.path)
        os.listdir(self.path)

    def prune(self, max_size: int, pins: tuple[str, ...], on_file) -> None:
        """Hold the store under ``max_size`` by :mod:`slotctl.prune`'s rules (``pins`` never touched);
        ``on_file(path, size, action, reason)`` for each file deleted."""
        from slotctl import prune as pr

        # a store of its own is written by keep alone, through temporary files prune never touches: no grace
        policy = pr.Policy(max_size=max_size, pins=pins, **({} if self.same else {"grace": 0.0}))
        plan = pr.execute(pr.plan(os.fspath(self.path), policy), dry_run=False)
        for e in plan.selected():
            on_file(e.path, e.size, e.action, e.reason)


class ObjectStore:
    """A store under an ``s3://bucket/prefix/`` (:mod:`slotctl.store.s3`, :mod:`slotctl.store.cp`: an
    object is created only if absent, complete or not at all, its size and MD5 checked)."""

    def __init__(self, url: str):
        from slotctl.store.config import split_url

        split_url(url)      # a usage error without a bucket
        self.url = url.rstrip("/") + "/"

    def __str__(self) -> str:
        return self.url

    def where(self, name: str) -> str:
        return self.url + name

    def again(self) -> None:
        """A new run of a long-running process (keep's tick): a store that stopped answering in the last one
        (which stopped that run) is tried again."""
        from slotctl.store.s3 import forget_down

        forget_down()

    def has(self, name: str) -> bool:
        from slotctl.store.s3 import S3_STORE

        return S3_STORE.stat(self.where(name)) is not None

    def named(self, prefix: str) -> list[str]:
        """The states whose names begin with ``prefix`` (one listing of the prefix)."""
        from slotctl.store.s3 import S3_STORE

        return [n for e in S3_STORE.list(self.url) if (n := e.path.rpartition("/")[2]).startswith(prefix)
                and n.endswith(".bin")]

    def put(self, local: Path, name: str, *, move: bool = True) -> None:
        self._copy(os.fspath(local), self.where(name))
        if move:
            os.unlink(local)

    def names(self, prefix: str) -> list[str]:
        from slotctl.store.s3 import S3_STORE

        found = [e for e in S3_STORE.list(self.url) if e.path.rpartition("/")[2].startswith(prefix)
                 and e.path.endswith(".bin")]
        return [e.path.rpartition("/")[2] for e in sorted(found, key=lambda e: e.mtime, reverse=True)]

    def listing(self, match) -> dict[str, tuple[str | None, int, int]]:
        """The states whose names ``match(name)``: name -> (identity for the catalog, changed_ns, size), one
        listing of the prefix."""
        from slotctl.catalog import object_identity
        from slotctl.sources import list_prefix

        out = {}
        for e in list_prefix(self.url) or ():
            name = e.path.rpartition("/")[2]
            if name.endswith(".bin") and match(name):
                out[name] = (object_identity(e.etag, e.size), int(e.mtime * 1e9), e.size)
        return out

    def mtime(self, name: str) -> float:
        from slotctl.store.s3 import S3_STORE

        entry = S3_STORE.stat(self.where(name))
        if entry is None:
            raise UsageError(f"{self.where(name)}: no such object", code="no_such_file")
        return entry.mtime

    def delete(self, name: str) -> int:
        from slotctl.store.s3 import S3_STORE

        entry = S3_STORE.stat(self.where(name))
        if entry is None:
            return 0
        S3_STORE.delete(self.where(name))
        return entry.size

    def usage(self) -> tuple[int, int]:
        from slotctl.store.s3 import S3_STORE

        found = [e for e in S3_STORE.list(self.url) if e.path.endswith(".bin")
                 and not e.path.rpartition("/")[2].startswith(".")]
        return len(found), sum(e.size for e in found)

    def reachable(self) -> None:
        """A UsageError unless the prefix can be listed."""
        self.usage()

    def identity(self, name: str) -> tuple[str, int] | None:
        """The object ``name``'s identity for the catalog (its ETag and size, as a listing and a download pinned
        to one ETag say it: :func:`slotctl.catalog.object_identity`; one HEAD) and its Last-Modified (ns); None
        when it is absent or has no ETag."""
        from slotctl.catalog import object_identity
        from slotctl.store.s3 import S3_STORE

        e = S3_STORE.stat(self.where(name))
        if e is None:
            return None
        ident = object_identity(e.etag, e.size)
        return (ident, int(e.mtime * 1e9)) if ident is not None else None

    def local(self, name: str, staging: Path, *, identity: str | None = None, checksum: str | None = None,
              as_name: str | None = None) -> Path:
        """The object ``name`` downloaded into ``staging`` (whole, or absent; as ``as_name`` when given).
        ``identity``: the object's identity a verdict was made on (:func:`slotctl.catalog.object_identity` of its
        ETag and size): the download, whose reads are pinned to one ETag, must have read that one, else the file
        is removed (:func:`changed_since`). ``checksum``: the state's checksum as its name says it
        (:mod:`slotctl.seal`): the downloaded bytes must have it, else the file is removed
        (:class:`~slotctl.seal.ChecksumMismatch`)."""
        dest = staging / (as_name or name)
        if not dest.exists():
            res = self._copy(self.where(name), os.fspath(dest))
            if identity is not None:
                from slotctl.catalog import object_identity

                if object_identity(res.etag, res.size or 0) != identity:
                    os.unlink(dest)
                    raise changed_since(self.where(name))
            if checksum is not None:
                from slotctl.seal import checksum_file, verify

                try:
                    verify(self.where(name), checksum, checksum_file(dest))
                except BaseException:
                    os.unlink(dest)
                    raise
        return dest

    @staticmethod
    def _copy(src: str, dst: str):
        from slotctl.store.cp import COPIED, copy_one

        res = copy_one(src, dst)
        if res.status != COPIED:
            raise UsageError(res.error["message"] if res.error else f"{src} -> {dst}: not copied",
                             code=res.error["code"] if res.error else "copy_failed")
        return res

    def prune(self, max_size: int, pins: tuple[str, ...], on_file) -> None:
        """Hold the store under ``max_size`` by :mod:`slotctl.prune`'s rules for a prefix (least recently
        modified first, each object checked by a HEAD before its DELETE; ``pins`` never touched);
        ``on_file(path, size, action, reason)`` for each object deleted. The objects are complete or absent
        (:meth:`put` creates them whole), so no grace."""
        from slotctl import prune as pr

        plan = pr.execute(pr.plan(self.url, pr.Policy(max_size=max_size, pins=pins, grace=0.0)), dry_run=False)
        for e in plan.selected():
            on_file(e.path, e.size, e.action, e.reason)


def open_store(store: str | os.PathLike | None, slot_dir: Path, *, create: bool = False):
    """The store for ``--store``: an ``s3://`` prefix, a directory, or (None) :data:`DEFAULT_STORE` inside
    ``slot_dir``, made when ``create`` (keep and serve write there; a reader only looks) with the slot
    directory's permissions."""
    if store is not None and os.fspath(store).startswith("s3://"):
        return ObjectStore(os.fspath(store))
    if store is None:
        store = Path(slot_dir) / DEFAULT_STORE
        if create and not store.is_dir():
            try:
                store.mkdir(mode=Path(slot_dir).stat().st_mode & 0o777)
            except FileExistsError:
                if not store.is_dir():
                    raise UsageError(f"{store}: not a directory: the default store cannot be made (give "
                                     f"--store)") from None
            except OSError as e:
                raise UsageError(f"{store}: the default store cannot be made: {e.strerror} (give --store)") from None
    return DirectoryStore(store, slot_dir)


def legacy_states(slot_dir: Path) -> int:
    """How many stored states the slot directory itself holds (the default store of slotctl before
    :data:`DEFAULT_STORE`): they are not used, a client's slot save may have written any of them."""
    from slotctl.seal import parse_name

    try:
        with os.scandir(slot_dir) as it:
            return sum(1 for e in it if e.name.endswith(".bin") and parse_name(e.name) is not None)
    except OSError:
        return 0


def copy_atomic(src: str | os.PathLike, dest: str | os.PathLike, *, identity: str | None = None,
                checksum: str | None = None) -> str | None:
    """``src`` copied to ``dest`` through :func:`slotctl.atomic.atomic_writer` (never a torn ``dest``).
    ``identity``: the file's identity a verdict was made on (:func:`slotctl.catalog.local_identity`): the
    file opened must have it before the copy and still after it, else nothing is copied
    (:func:`changed_since`). ``checksum``: the state's checksum as its name says it (:mod:`slotctl.seal`): the
    bytes copied are hashed as they are copied and must have it, else nothing is copied
    (:class:`~slotctl.seal.ChecksumMismatch`). The hex SHA-256 of the bytes copied when ``checksum`` is given."""
    from slotctl.atomic import atomic_writer, copy_range
    from slotctl.catalog import local_identity
    from slotctl.paths import open_regular

    with open_regular(os.fspath(src)) as f:
        st = os.fstat(f.fileno())
        if identity is not None and local_identity(st) != identity:
            raise changed_since(src)
        with atomic_writer(dest) as out:
            got = None
            if checksum is None:
                copy_range(f, out, 0, st.st_size)
            else:
                got = _copy_hashed(f, out, st.st_size)
            if identity is not None and local_identity(os.fstat(f.fileno())) != identity:
                raise changed_since(src)      # inside the writer: dest is not made
            if checksum is not None:
                from slotctl.seal import verify

                verify(src, checksum, got)    # inside the writer: dest is not made
        return got


def _copy_hashed(src, dst, size: int) -> str:
    """``size`` bytes of ``src`` from its start copied to ``dst``, hashed as they go: their hex SHA-256."""
    import hashlib

    from slotctl.seal import READ_CHUNK

    h = hashlib.sha256()
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    src.seek(0)
    done = 0
    while done < size:
        n = src.readinto(view[:min(READ_CHUNK, size - done)])
        if not n:
            raise OSError(f"unexpected end of file at {done}")
        h.update(view[:n])
        dst.write(view[:n])
        done += n
    return h.hexdigest()


def changed_since(where: str | os.PathLike) -> UsageError:
    """The error of a state whose identity is no longer the one its verdict was made on: never sent."""
    return UsageError(f"{os.fspath(where)}: changed since its verdict was made (not sent; it is judged again)",
                      code="object_changed")


@dataclass(frozen=True)
class Saved:
    """A slot file a server has just saved, read back (keep, migrate, serve): its size, tokens, state version,
    whether its prompt holds media and its target memory's kind; ``damage``: the first layer that does not
    parse, ``mismatch``: the token count or size differ from the server's answer (each None when not so);
    ``flags``: what its target memory says of the server's flags (:func:`slotctl.slotfile.written_flags`,
    read by :func:`slotctl.server.saved.saved_flags`; None when it did not parse). Once checked for a slot
    (:meth:`slotctl.keeping.states.ServerStates.checked`): the ``slot`` saved, its working file (``path``) and
    the ``name`` it is stored under."""

    size: int
    n_tokens: int
    version: int | None
    tokens: Any
    damage: str | None
    mismatch: str | None
    media: bool = False
    kind: str | None = None
    flags: tuple | None = None
    slot: int | None = None
    path: Path | None = None
    name: str | None = None
    #: the hex SHA-256 of the file's bytes (what its stored name's checksum is made of: :mod:`slotctl.seal`)
    checksum: str | None = None
    #: it carries a draft state (an SDFT appendix, or checkpoint draft blobs): its name records the draft model
    draft: bool = False

    @property
    def problem(self) -> str | None:
        """Why it is not the file the server's answer describes (its damage first), else None."""
        return self.damage or self.mismatch

    @property
    def damaged(self) -> bool:
        return self.damage is not None


def read_saved(path: str | os.PathLike, answer: dict) -> Saved:
    """The file at ``path`` against the server's answer to its save (``n_saved`` tokens, ``n_written`` bytes),
    with its checksum (every byte read once: :func:`slotctl.seal.checksum`) and whether it carries a draft
    state."""
    from slotctl.seal import checksum
    from slotctl.slotfile import open_slot_file, written_flags

    with open_slot_file(path) as sf:
        digest = checksum(sf.stream)
        n = sf.tokens.n_tokens if sf.tokens is not None else 0
        mismatch = None
        if n != answer["n_saved"] or sf.size != answer["n_written"]:
            mismatch = (f"{n:,} tokens in {sf.size:,} bytes where the server saved {answer['n_saved']:,} in "
                        f"{answer['n_written']:,}")
        return Saved(sf.size, n, sf.version, sf.tokens.tokens if sf.tokens is not None else None,
                     str(sf.errors[0]) if sf.errors else None, mismatch,
                     bool(sf.tokens is not None and sf.tokens.media),
                     sf.target.layout.kind if sf.target is not None else None,
                     written_flags(sf.target) if sf.target is not None else None, path=Path(path),
                     checksum=digest, draft=carries_draft(sf))


def carries_draft(sf) -> bool:
    """Whether the parsed slot file ``sf`` carries a draft model's state: an SDFT appendix's draft blob, or a
    checkpoint's draft blob, holding more than its header (what the draft model's content decides; the
    speculative state beside it, an n-gram drafter's too, is the tokens')."""
    from slotctl.format.blob import BLOB_HEADER_SIZE

    if sf.sdft is not None and sf.draft is not None and sf.draft.span.size > BLOB_HEADER_SIZE:
        return True
    return any(c.dft.span.size > BLOB_HEADER_SIZE for c in sf.checkpoints or ())
