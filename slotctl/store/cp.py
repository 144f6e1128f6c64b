"""``slotctl cp``: slot files between local paths and object storage (local to S3, S3 to local, S3 to S3).

Each file's structure is read first (metadata only, as ``inspect`` reads it): a file the server refuses or
aborts on whatever its flags (the caller's ``refuses``: validate's class ``broken``) is refused unless
``force``; damage the server passes over (trailing bytes, an appendix b11434 never reads) is copied. Nothing is overwritten unless ``overwrite`` (an object is created with ``If-None-Match: *``;
a local file through :func:`~slotctl.atomic.atomic_writer`). After the copy the size is checked, and the
MD5 where the store's ETag is one. Killed at any moment, no half-written object or file is visible:
uploads complete atomically (one PUT, or a multipart upload that exists only once completed), local
files are renamed into place. See docs/store.md ("cp").
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Iterable

from slotctl.atomic import COPY_CHUNK, atomic_writer
from slotctl.errors import ExitStatus, SlotctlError, StoreDown, UsageError, error_entry
from slotctl.progress import Progress
from slotctl.slotfile import read_slot_file
from slotctl.sources import open_input, remote_url

COPIED = "copied"
REFUSED = "refused"
FAILED = "failed"


@dataclass
class CopyResult:
    source: str
    path: str                    # the destination
    size: int | None = None
    status: str = FAILED
    method: str | None = None    # put, multipart, multipart+copy, server_copy, stream, download, local_copy
    checksum: str | None = None  # "md5" when the store's ETag was checked against the bytes
    error: dict | None = None
    exit_code: int = 0
    damaged: bool = False
    #: the ETag an object source's reads were pinned to (If-Match): the bytes copied are that object's
    etag: str | None = None

    def as_dict(self) -> dict:
        d = {"source": self.source, "path": self.path, "size": self.size, "status": self.status,
             "method": self.method, "checksum": self.checksum, "damaged": self.damaged,
             "exit_code": self.exit_code}
        if self.error is not None:
            d["error"] = self.error
        return d


def destination(src: str, dst: str, many: bool) -> str:
    """Where ``src`` goes: ``dst`` itself, or ``dst/NAME`` when ``dst`` is a prefix (ends with ``/``), a local
    directory, or there are many sources (then it must be one of those)."""
    name = src.rstrip("/").rpartition("/")[2]
    url = remote_url(dst)
    if url is not None:
        if url.endswith("/") or url.count("/") == 2:   # s3://bucket/ or s3://bucket
            return url.rstrip("/") + "/" + name
        if many:
            raise UsageError(f"{dst}: many files go to a prefix (end it with /) or a directory", code="usage")
        return url
    if os.path.isdir(dst):
        return os.path.join(dst, name)
    if many or dst.endswith("/"):
        raise UsageError(f"{dst}: no such directory", code="no_such_file")
    return dst


def copy_files(sources: Iterable[str], dst: str, *, overwrite: bool = False, force: bool = False,
               progress: Progress | None = None, many: bool | None = None, refuses=None) -> list[CopyResult]:
    """Copy each of ``sources`` to ``dst`` (see the module docstring); one result per file, the others are
    still copied when one fails. ``refuses(path, f)``: why a file is not copied (the server refuses it or
    aborts on it whatever its flags: the CLI asks validate), None to copy it; without it, a file whose
    structure is damaged is refused."""
    sources = list(sources)
    many = len(sources) > 1 if many is None else many
    out = []
    for src in sources:
        target = None
        try:
            target = destination(src, dst, many)
            out.append(copy_one(src, target, overwrite=overwrite, force=force, progress=progress, refuses=refuses))
        except StoreDown:       # the store stopped answering: the run stops, not file after file
            raise
        except (SlotctlError, OSError) as e:
            out.append(_failed(src, target or dst, e))
    return out


def _failed(src: str, dst: str, e: Exception) -> CopyResult:
    err = error_entry(e, None if isinstance(e, OSError) and e.filename else src)
    return CopyResult(src, dst, error=err.as_dict(), exit_code=err.exit_status)


def copy_one(src: str, dst: str, *, overwrite: bool = False, force: bool = False,
             progress: Progress | None = None, refuses=None) -> CopyResult:
    src = remote_url(src) or src
    res = CopyResult(src, dst)
    writer = None
    if remote_url(src) or remote_url(dst):   # the store (obstore) only for s3:// paths
        from slotctl.store.s3 import S3_STORE, Writer

        writer = Writer(S3_STORE)
    if remote_url(src) is None and remote_url(dst) is None and os.path.exists(dst) and \
            os.path.samefile(src, dst):
        raise UsageError(f"{src} and {dst} are the same file", code="usage")
    if src == dst:
        raise UsageError(f"{src}: source and destination are the same object", code="usage")
    with open_input(src) as f:
        sf = read_slot_file(f, src)    # the structure, metadata only (raises a store's own failure)
        res.size, res.damaged, res.etag = sf.size, sf.damaged, getattr(f, "etag", None)
        why = None
        if not force:
            if refuses is not None:
                why = refuses(src, f)
            elif sf.damaged:
                why = sf.errors[0].one_line()
        if why is not None:
            res.status, res.exit_code = REFUSED, int(ExitStatus.FAILED)
            res.error = {"code": "damaged", "message": f"{src}: {why} (not copied; --force copies it)"}
            return res
        if remote_url(dst) is not None:
            if remote_url(src) is not None and sf.size > 0:   # server-side, within a bucket or across
                got = writer.copy(src, dst, overwrite=overwrite, etag=getattr(f, "etag", None), size=sf.size)
                if writer.size_of(dst) != sf.size:
                    raise UsageError(f"{dst}: the copy does not have {sf.size:,} bytes", code="size_mismatch")
            else:
                chunks = writer.chunks(f, progress) if remote_url(src) else _file_chunks(f, sf.size)
                got = writer.upload(chunks, sf.size, dst, overwrite=overwrite,
                                    progress=None if remote_url(src) else progress)
                if remote_url(src):
                    got["method"] = "stream"
        else:
            got = _to_local(f, src, sf.size, dst, overwrite=overwrite, writer=writer, progress=progress)
    res.method, res.checksum = got["method"], got["checksum"]
    res.status = COPIED
    return res


def _file_chunks(f, size: int):
    f.seek(0)
    done = 0
    while done < size:
        data = f.read(min(COPY_CHUNK, size - done))
        if not data:
            raise OSError(5, f"{getattr(f, 'name', '')}: the file ended at {done:,} bytes of {size:,}")
        done += len(data)
        yield data


class _Md5s:
    """MD5 per part of ``part`` bytes (:class:`~slotctl.store.s3.PartMd5s`), and of the whole: what an
    ETag may be."""

    def __init__(self, part: int):
        from slotctl.store.s3 import PartMd5s

        self.whole = hashlib.md5()
        self.parts = PartMd5s(part)

    def update(self, data: bytes) -> None:
        self.whole.update(data)
        self.parts.update(data)

    def matches(self, etag: str | None) -> bool:
        from slotctl.store.s3 import expected_etag

        if not etag:
            return False
        tag = etag.strip('"')
        return tag in (self.whole.hexdigest(), expected_etag(self.parts.digests(), multipart=True))


def _part_size(size: int) -> int:
    """The part size slotctl's own uploads use (so a download can check their multipart ETag)."""
    from slotctl.store.s3 import part_size

    return part_size(size)


def _to_local(f, src: str, size: int, dst: str, *, overwrite: bool, writer, progress) -> dict:
    """``src`` (an object or a local file, open as ``f``) written to the local ``dst`` atomically."""
    if not overwrite and os.path.lexists(dst):
        raise UsageError(f"{dst}: exists (use --overwrite to replace it)", code="exists")
    md5 = _Md5s(_part_size(size)) if remote_url(src) else None
    chunks = writer.chunks(f, None) if remote_url(src) else _file_chunks(f, size)
    done = 0
    with atomic_writer(dst, overwrite=overwrite) as w:
        for data in chunks:
            w.write(data)
            if md5 is not None:
                md5.update(data)
            done += len(data)
            if progress:
                progress(done, size)
    if os.path.getsize(dst) != size:   # pragma: no cover - atomic_writer wrote what it was given
        raise UsageError(f"{dst}: {os.path.getsize(dst):,} bytes written, {size:,} expected", code="size_mismatch")
    if remote_url(src):
        return {"method": "download", "checksum": "md5" if md5.matches(getattr(f, "etag", None)) else None}
    return {"method": "local_copy", "checksum": None}
