"""Slot files in S3-compatible object storage (``s3://bucket/key``), through obstore.

Importing this module registers the ``s3`` scheme with :mod:`slotctl.sources`, so that every command that
reads a slot file reads an object as well; the CLI imports it only when an ``s3://`` path is given (the
``[s3]`` extra: obstore), so local commands keep their start-up. Its configuration is :mod:`slotctl.store.config`.

Every failure is one line naming the object and what happened, exit 2 (:func:`store_error`); no message
holds a credential (:func:`_scrub`). A read is pinned to the ETag of the object's first read
(``If-Match``): an object replaced while it is read stops the command (``object_changed``).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from typing import Iterator, Sequence

import obstore
from obstore import exceptions as obx
from obstore.store import S3Store

from slotctl.errors import StoreDown, UsageError
from slotctl.store.config import EXISTS, Config, join_url, split_url
from slotctl.sources import HEAD_BYTES, TOTALS, Entry, RangedFile, register_store

#: bytes of first reads kept between a listing's check of each object's magic and the object's open
PEEK_CACHE = 64 << 20


# -- errors ----------------------------------------------------------------------------------------------

_S3_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_WORDS = {
    "NoSuchBucket": ("no_such_bucket", "no such bucket"),
    "NoSuchKey": ("no_such_file", "no such object"),
    "InvalidAccessKeyId": ("bad_credentials", "the store does not know this access key (AWS_ACCESS_KEY_ID)"),
    "SignatureDoesNotMatch": ("bad_credentials", "the store refused the signature: wrong secret key "
                                                 "(AWS_SECRET_ACCESS_KEY)"),
    "AccessDenied": ("permission_denied", "access denied"),
    "ExpiredToken": ("bad_credentials", "the session token has expired (AWS_SESSION_TOKEN)"),
    "InvalidToken": ("bad_credentials", "the session token is not valid (AWS_SESSION_TOKEN)"),
}


def _scrub(text: str, secrets: Sequence[str]) -> str:
    """``text`` without the credentials (no message slotctl makes holds one; this is the second guard)."""
    for s in secrets:
        if len(s) >= 6:   # a shorter value would mangle every word it occurs in (and is no real key)
            text = text.replace(s, "***")
    return re.sub(r"(X-Amz-(?:Credential|Signature|Security-Token)=)[^&\s]+", r"\1***", text)


def store_error(url: str, e: Exception, secrets: Sequence[str] = (), *, action: str = "") -> UsageError:
    """The one-line error (exit 2) for an obstore failure on ``url``; never a credential in it. A failure
    that says the store does not answer is a :class:`~slotctl.errors.StoreDown`: the run stops."""
    if isinstance(e, StoreDown):
        return e
    msg = str(e)
    m = _S3_CODE.search(msg)
    s3code = m.group(1) if m else None
    doing = f" ({action})" if action else ""
    if s3code in _WORDS:
        code, words = _WORDS[s3code]
    elif isinstance(e, (obx.NotFoundError, FileNotFoundError)):
        code, words = "no_such_file", "no such object"
    elif isinstance(e, obx.PreconditionError):
        code, words = "object_changed", "the object was replaced while it was read (its ETag changed)"
    elif isinstance(e, obx.AlreadyExistsError):
        code, words = "exists", EXISTS
    elif isinstance(e, (obx.PermissionDeniedError, obx.UnauthenticatedError)):
        code, words = "bad_credentials", "the store refused the credentials"
    else:
        first = _scrub(msg.split("\n", 1)[0], secrets).removeprefix("Generic S3 error: ")
        low = first.lower()
        if any(w in low for w in _CUT_SHORT):
            code, words = "store_unreachable", "the store's answer ended early (the connection closed mid-body)"
        elif any(w in low for w in ("connect", "timed out", "timeout", "connection", "dns", "error sending request",
                                    "broken pipe", "reset by peer")):
            code, words = "store_unreachable", f"the store does not answer ({_short(first)})"
        else:
            code, words = "store_error", _short(first)
    message = _scrub(f"{url}: {words}{doing}", secrets)
    if code == "store_unreachable":     # the store stopped answering: the run stops here, with this error
        return _stopped(message)
    return UsageError(message, code=code)


# -- one deadline for a whole command; a store that stopped answering stops the run ----------------------

#: the monotonic time by which a command must be done with its stores (``--timeout``: :func:`set_deadline`)
_deadline: float | None = None
_timeout: float | None = None
#: the first failure that said the store stopped answering: every later request is refused with it
_down: StoreDown | None = None
#: per thread, the seconds each request may take (a long-running process's work that must not wait on a store
#: that stalls: serve's request path, :func:`request_timeout`)
_per_request = threading.local()
#: calls still running in their threads when the deadline came (the process ends without waiting for them)
STUCK: list = []


def set_deadline(seconds: float | None) -> None:
    """Give the command ``seconds`` in all for its requests to stores, from now (None: no deadline; each
    request is still bounded by :data:`~slotctl.store.config.REQUEST_TIMEOUT`)."""
    global _deadline, _timeout
    _timeout = seconds
    _deadline = None if seconds is None else time.monotonic() + seconds


@contextlib.contextmanager
def request_timeout(seconds: float):
    """While the block runs, in this thread: each request to a store is given ``seconds`` from when it is made
    (besides the command's deadline). Past them the store counts as down (:func:`known_down`: every later
    request refused at once) until :func:`forget_down`, and the request is left to itself, as past a
    command's deadline."""
    before = getattr(_per_request, "seconds", None)
    _per_request.seconds = seconds
    try:
        yield
    finally:
        _per_request.seconds = before


def known_down() -> StoreDown | None:
    """The failure that said the store stopped answering, while every request to it is refused at once
    (None: it is tried)."""
    return _down


def start_run() -> None:
    """A command starts: no deadline yet (``--timeout`` sets one) and the store not known to be down."""
    forget_down()
    set_deadline(None)


def forget_down() -> None:
    """Try the store again: a long-running process (``keep``) starts each of its runs afresh."""
    global _down
    _down = None


def _stopped(message: str) -> StoreDown:
    global _down
    if _down is None:
        _down = StoreDown(message)
    return _down


def call(url: str, action: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, an obstore request on ``url``, within the command's deadline: past it, the
    run stops (:class:`~slotctl.errors.StoreDown`, ``no answer within --timeout``) and the request is left
    to itself (a thread of its own: obstore's calls cannot be interrupted). A store already known to be
    down refuses at once, with the first error; a request that says the store does not answer
    (``store_unreachable``, from a request slotctl signs itself: :mod:`slotctl.store.s3copy`) stops the run
    too. Other failures are raised as they are (the caller says what they mean)."""
    if _down is not None:
        raise _down
    deadline, within = _deadline, f"--timeout {_timeout:g} s" if _timeout is not None else ""
    per = getattr(_per_request, "seconds", None)
    if per is not None and (deadline is None or time.monotonic() + per < deadline):
        deadline, within = time.monotonic() + per, f"{per:g} s"
    try:
        if deadline is None:
            return fn(*args, **kwargs)
        done, value = _until(deadline, action, fn, args, kwargs)
    except StoreDown:
        raise
    except UsageError as e:
        if e.code == "store_unreachable":
            raise _stopped(str(e)) from None
        raise
    if not done:
        raise _stopped(f"{url}: no answer within {within} ({action}): the run stops" if within.startswith("--")
                       else f"{url}: no answer within {within} ({action}): the store counts as down")
    return value


def call_by(deadline: float, within: str, url: str, action: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a request on ``url`` that must be done by a time of its own (``deadline``,
    monotonic), whatever the command's: a keeper's lease, renewed before it lapses
    (:mod:`slotctl.unattended.lock`). Past it, :class:`~slotctl.errors.StoreDown` (``no answer within
    WITHIN``), not the run's: a store known to be down does not refuse it, and its deadline stops no other
    request. Other failures are raised as they are."""
    done, value = _until(deadline, action, fn, args, kwargs)
    if not done:
        raise StoreDown(f"{url}: no answer within {within} ({action})")
    return value


def _until(deadline: float, action: str, fn, args, kwargs) -> tuple[bool, object]:
    """``(True, fn(*args, **kwargs))`` when it returns by ``deadline`` (monotonic); ``(False, None)`` when it
    is still running then: it is left to itself in a thread of its own (:data:`STUCK`: the process ends
    without waiting for it). Its exception is raised here."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False, None
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name=f"slotctl-store-{action}")
    t.start()
    t.join(remaining)
    if t.is_alive():
        STUCK[:] = [s for s in STUCK if s.is_alive()] + [t]    # a long-running process keeps the live ones only
        return False, None
    if "error" in box:
        raise box["error"]
    return True, box["value"]


#: obstore's (reqwest's, hyper's) words for a response body that ended before its length: a dropped
#: connection mid-read, the store's to answer again, never the object's damage
_CUT_SHORT = ("body error", "error decoding response body", "unexpected eof", "incompletemessage",
              "end of file before message length reached")


def _short(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= 300 else text[:297] + "..."


# -- the store -------------------------------------------------------------------------------------------


def _mtime(meta: dict) -> float:
    return meta["last_modified"].timestamp()


class S3:
    """The ``s3`` scheme: stores per bucket, made on first use from one :class:`Config`."""

    def __init__(self):
        self._config: Config | None = None
        self._stores: dict[str, S3Store] = {}
        #: first reads made by :meth:`peek`, each used by the next :meth:`open` of its object
        self._heads: dict[str, tuple[dict, bytes]] = {}
        self._head_bytes = 0
        self._lock = threading.Lock()

    @property
    def config(self) -> Config:
        if self._config is None:
            self._config = Config()
        return self._config

    def reset(self) -> None:
        """Forget the configuration, the stores and the first reads kept (the environment changed: tests)."""
        self._config = None
        self._stores.clear()
        self._heads.clear()
        self._head_bytes = 0
        forget_down()
        set_deadline(None)

    def bucket(self, url: str) -> tuple[S3Store, str]:
        bucket, key = split_url(url)
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                self.config.check(url)
                try:
                    store = self._stores[bucket] = self.config.store(bucket)
                except Exception as e:  # noqa: BLE001 - a configuration obstore refuses (a malformed endpoint)
                    raise store_error(url, e, self.config.secrets(), action="configuration") from None
        return store, key

    def peek(self, urls: Sequence[str], n: int) -> list[bytes | None]:
        """The first ``n`` bytes of each object, read concurrently; each first read is kept (up to
        :data:`PEEK_CACHE` bytes in all) for the object's next :meth:`open`, which then costs no request."""
        from concurrent.futures import ThreadPoolExecutor

        def one(url: str) -> bytes | None:
            try:
                r = self.open(url)
            except StoreDown:
                raise
            except UsageError:
                return None
            with self._lock:
                data = r.first_block()
                if data is not None and self._head_bytes + len(data) <= PEEK_CACHE:
                    self._heads[url] = (r.meta(), data)
                    self._head_bytes += len(data)
            return (data or b"")[:n]

        with ThreadPoolExecutor(min(16, max(1, len(urls)))) as pool:
            return list(pool.map(one, urls))

    def take_head(self, url: str) -> tuple[dict, bytes] | None:
        with self._lock:
            got = self._heads.pop(url, None)
            if got is not None:
                self._head_bytes -= len(got[1])
            return got

    def error(self, url: str, e: Exception, action: str = "") -> UsageError:
        return store_error(url, e, self._config.secrets() if self._config else (), action=action)

    # -- sources.Store
    def open(self, url: str) -> "ObjectReader":
        store, key = self.bucket(url)
        if not key or key.endswith("/"):
            raise UsageError(f"{url}: a prefix, not an object", code="is_a_directory")
        return ObjectReader(self, store, key, url)

    def stat(self, url: str) -> Entry | None:
        store, key = self.bucket(url)
        if not key or key.endswith("/"):
            return None
        try:
            meta = call(url, "HEAD", obstore.head, store, key)
        except (obx.NotFoundError, FileNotFoundError):
            return None
        except Exception as e:  # noqa: BLE001 - every obstore failure: one line
            raise self.error(url, e, "HEAD") from None
        return Entry(url, meta["size"], _mtime(meta), meta.get("e_tag"), None)

    def list(self, url: str) -> list[Entry]:
        store, key = self.bucket(url)
        bucket = split_url(url)[0]
        prefix = key if not key or key.endswith("/") else key + "/"
        out: list[Entry] = []
        try:
            res = call(url, "LIST", obstore.list_with_delimiter, store, prefix or None)
            for meta in res["objects"]:
                if meta["path"] == prefix or meta["path"] + "/" == prefix:
                    continue     # the prefix's own marker (SeaweedFS keeps one for an emptied "directory")
                out.append(Entry(join_url(bucket, meta["path"]), meta["size"], _mtime(meta), meta.get("e_tag")))
        except Exception as e:  # noqa: BLE001
            raise self.error(url, e, "LIST") from None
        if not out and not res.get("common_prefixes"):
            self._check_bucket(store, url)
        return sorted(out, key=lambda en: en.path)

    def prefix_exists(self, url: str) -> bool:
        """Whether anything is under ``url`` taken as a prefix: an object, a sub-prefix, or the marker a store
        keeps for an emptied "directory" (SeaweedFS): a prefix that is there, even with no slot file in it."""
        store, key = self.bucket(url)
        prefix = key if not key or key.endswith("/") else key + "/"
        if not prefix:
            return True      # the bucket itself
        try:
            res = call(url, "LIST", obstore.list_with_delimiter, store, prefix.rstrip("/"))
        except Exception as e:  # noqa: BLE001
            raise self.error(url, e, "LIST") from None
        if any(m["path"] in (prefix, prefix.rstrip("/")) for m in res["objects"]):
            return True
        return any(p.rstrip("/") + "/" == prefix for p in res.get("common_prefixes") or ())

    def prefixes(self, url: str) -> list[str]:
        """The sub-prefixes directly under ``url`` taken as a prefix (``s3://b/p/sub/``), sorted: what a
        directory's subdirectories are (``ls`` names them; no command reads into them)."""
        store, key = self.bucket(url)
        bucket = split_url(url)[0]
        prefix = key if not key or key.endswith("/") else key + "/"
        try:
            res = call(url, "LIST", obstore.list_with_delimiter, store, prefix or None)
        except Exception as e:  # noqa: BLE001
            raise self.error(url, e, "LIST") from None
        return sorted(join_url(bucket, p.rstrip("/") + "/") for p in res.get("common_prefixes") or ()
                      if p.rstrip("/") + "/" != prefix)

    def delete(self, url: str) -> None:
        """DELETE the object (prune); one that is already gone is no error (S3's DELETE is idempotent). Under a
        prefix a lease guards, the request is signed here to expire when the lease's hold ends
        (:func:`slotctl.store.s3copy.delete_object`, :mod:`slotctl.store.guard`)."""
        from slotctl.store.guard import write_until

        store, key = self.bucket(url)
        if write_until(url) is not None:
            from slotctl.store.s3copy import delete_object

            call(url, "DELETE", delete_object, self.config, url)
            return
        try:
            call(url, "DELETE", obstore.delete, store, key)
        except (obx.NotFoundError, FileNotFoundError):
            return
        except Exception as e:  # noqa: BLE001
            raise self.error(url, e, "DELETE") from None

    def _check_bucket(self, store: S3Store, url: str) -> None:
        """An empty listing of a bucket that does not exist is an error (a missing prefix is just empty)."""
        try:
            call(url, "LIST", obstore.list_with_delimiter, store, None)
        except Exception as e:  # noqa: BLE001
            raise self.error(url, e, "LIST") from None


class ObjectReader(RangedFile):
    """One object, read in ranges pinned to the ETag of its first read (``If-Match``)."""

    def __init__(self, s3: S3, store: S3Store, key: str, url: str):
        super().__init__()
        self.s3, self.store, self.key, self.name = s3, store, key, url
        self.etag: str | None = None
        self.mtime: float | None = None
        self.used: float | None = None
        kept = s3.take_head(url)
        if kept is not None:
            self._set(kept[0], kept[1])
        else:
            self._first()

    def meta(self) -> dict:
        return {"size": self.size, "e_tag": self.etag, "mtime": self.mtime, "used": self.used}

    def first_block(self) -> bytes | None:
        return self._blocks[0][1] if self._blocks and self._blocks[0][0] == 0 else (b"" if not self.size else None)

    def _set(self, meta: dict, data: bytes) -> None:
        self.size, self.etag, self.mtime, self.used = meta["size"], meta["e_tag"], meta["mtime"], meta["used"]
        if data:
            self._keep(0, data)

    def _first(self) -> None:
        """The first read: the object's size, ETag and last-modified time with its first bytes."""
        try:
            res = call(self.name, "GET", obstore.get, self.store, self.key, options={"range": (0, HEAD_BYTES)})
            data = bytes(call(self.name, "GET", res.bytes))
            meta = res.meta
        except (obx.NotFoundError, FileNotFoundError) as e:
            raise self.s3.error(self.name, e) from None
        except Exception as e:  # noqa: BLE001 - an empty object answers a range with 416
            if "416" not in str(e) and "InvalidRange" not in str(e):
                raise self.s3.error(self.name, e, "GET") from None
            try:
                meta, data = call(self.name, "HEAD", obstore.head, self.store, self.key), b""
            except Exception as e2:  # noqa: BLE001
                raise self.s3.error(self.name, e2, "HEAD") from None
        for k, v in (("batches", 1), ("requests", 1), ("bytes", len(data))):
            TOTALS[k] += v
        self._set({"size": meta["size"], "e_tag": meta.get("e_tag"), "mtime": _mtime(meta), "used": None}, data)

    def fetch(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        ranges = list(ranges)
        if not ranges:
            return []
        if len(ranges) == 1:
            return [self._get(*ranges[0])]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(16, len(ranges))) as pool:
            return list(pool.map(lambda r: self._get(*r), ranges))

    def _get(self, offset: int, n: int) -> bytes:
        if n <= 0:
            return b""
        options: dict = {"range": (offset, offset + n)}
        if self.etag:
            options["if_match"] = self.etag
        try:
            return call(self.name, f"GET bytes {offset}-{offset + n - 1}",
                        lambda: bytes(obstore.get(self.store, self.key, options=options).bytes()))
        except Exception as e:  # noqa: BLE001
            raise self.s3.error(self.name, e, f"GET bytes {offset}-{offset + n - 1}") from None




# -- writes: cp ------------------------------------------------------------------------------------------

#: the part size of multipart uploads (S3 allows 5 MiB to 5 GiB, at most 10,000 parts: 8 MiB parts carry
#: objects up to 78 GiB; larger files take larger parts, see :func:`part_size`)
PART_SIZE = 8 << 20
#: files up to this size are sent in one PUT (held in memory once); larger ones in parts
SINGLE_PUT_MAX = 16 << 20
#: parts in flight at once
UPLOAD_CONCURRENCY = 4


def part_size(size: int) -> int:
    """The part size for an upload of ``size`` bytes: :data:`PART_SIZE`, or larger to stay under 10,000 parts."""
    p = PART_SIZE
    while size > p * 10_000:
        p *= 2
    return p


def expected_etag(md5s: Sequence[bytes], *, multipart: bool) -> str:
    """The ETag S3 gives an unencrypted object from its parts' MD5 digests: the MD5 of the content for one
    PUT, ``md5(md5(part 1) + ... + md5(part N))-N`` for a multipart upload."""
    import hashlib

    if not multipart:
        return md5s[0].hex()
    return f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"


class PartMd5s:
    """The MD5 of each ``part`` bytes of a stream fed in pieces of any size (what a multipart ETag is made
    of): the upload's (:class:`_Parts`) and a download's check (:mod:`slotctl.store.cp`) alike."""

    def __init__(self, part: int):
        import hashlib

        self.part, self._md5 = part, hashlib.md5
        self._done: list[bytes] = []
        self._h, self._n = hashlib.md5(), 0

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view):
            take = min(len(view), self.part - self._n)
            self._h.update(view[:take])
            self._n += take
            view = view[take:]
            if self._n == self.part:
                self._done.append(self._h.digest())
                self._h, self._n = self._md5(), 0

    def digests(self) -> list[bytes]:
        """Every part's digest so far, the last (short, or the only, empty one) included."""
        return self._done + ([self._h.digest()] if self._n or not self._done else [])


class _Parts:
    """The chunks of a source as the upload reads them, their MD5 per part, and the progress callback."""

    def __init__(self, chunks, part: int, progress=None, total: int = 0):
        self._chunks, self.part, self.progress, self.total = chunks, part, progress, total
        self._md5s = PartMd5s(part)
        self.done = 0

    @property
    def md5s(self) -> list[bytes]:
        return self._md5s.digests()

    def __iter__(self):
        for data in self._chunks:
            self._md5s.update(data)
            self.done += len(data)
            if self.progress:
                self.progress(self.done, self.total)
            yield data


def _checksum(etag: str | None, md5s: Sequence[bytes], multipart: bool) -> str | None:
    """"md5" when the store's ETag is the MD5 this upload predicts (checked); None when the ETag is not an
    MD5 (encrypted objects, other stores): the size alone was checked. A different MD5 is an error."""
    if not etag:
        return None
    tag = etag.strip('"')
    if not re.fullmatch(r"[0-9a-f]{32}(-[0-9]+)?", tag) or ("-" in tag) != multipart:
        return None
    if tag != expected_etag(md5s, multipart=multipart):
        raise UsageError(f"the store's checksum (ETag {tag}) is not that of the bytes sent "
                         f"({expected_etag(md5s, multipart=multipart)})", code="checksum_mismatch")
    return "md5"


def temp_key(key: str) -> str:
    """A temporary name beside ``key`` (``dir/.NAME.slotctl-RANDOM.tmp``: listings skip it, as they skip the
    temporary files of local atomic writes)."""
    import secrets

    from slotctl.atomic import private_name

    head, _, name = key.rpartition("/")
    return f"{head + '/' if head else ''}{private_name(name, secrets.token_hex(6))}"


class Writer:
    """Uploads and copies for ``cp``, over :data:`S3_STORE`'s stores and configuration."""

    def __init__(self, s3: S3):
        self.s3 = s3
        self._copy_stores: dict[str, S3Store] = {}

    def _copy_store(self, bucket: str) -> S3Store:
        """A store of ``bucket`` whose copies are conditional (``copy_if_not_exists``: a multipart upload whose
        part is a server-side copy, completed with ``If-None-Match: *``)."""
        store = self._copy_stores.get(bucket)
        if store is None:
            store = self.s3.config.store(bucket, copy_if_not_exists="multipart")
            self._copy_stores[bucket] = store
        return store

    def exists(self, url: str) -> bool:
        return self.s3.stat(url) is not None

    def _refuse_existing(self, url: str, overwrite: bool) -> None:
        """Without ``overwrite``, refuse ``url`` when an object is there (before any byte is sent; the write
        itself is conditional too, for a writer that comes between)."""
        if not overwrite and self.exists(url):
            raise UsageError(f"{url}: {EXISTS}", code="exists")

    def upload(self, chunks, size: int, url: str, *, overwrite: bool, progress=None) -> dict:
        """Write ``size`` bytes from ``chunks`` to ``url``; never visible half-written.

        Up to :data:`SINGLE_PUT_MAX`: one PUT (``If-None-Match: *`` without ``overwrite``). Larger: a multipart
        upload (invisible until it completes); without ``overwrite`` to a temporary key, then copied
        server-side to ``url`` on condition that nothing is there, and the temporary key deleted. Under a
        prefix a lease guards (:mod:`slotctl.store.guard`: keep's and serve's stores), whatever the size: a
        multipart upload at ``url`` whose completion is signed to expire when the lease's hold ends.
        Returns ``{"method", "checksum", "etag"}``; the size and ETag are checked against what was sent.
        """
        from slotctl.store.guard import write_until

        store, key = self.s3.bucket(url)
        self._refuse_existing(url, overwrite)
        if write_until(url) is not None:
            return self._guarded_upload(store, key, chunks, size, url, overwrite=overwrite, progress=progress)
        multipart = size > SINGLE_PUT_MAX
        parts = _Parts(chunks, part_size(size) if multipart else max(size, 1), progress, size)
        target = key if (overwrite or not multipart) else temp_key(key)
        try:
            if multipart:
                res = call(url, "PUT", obstore.put, store, target, iter(parts), use_multipart=True, chunk_size=parts.part,
                                  max_concurrency=UPLOAD_CONCURRENCY)
            else:
                res = call(url, "PUT", obstore.put, store, target, b"".join(parts), mode="overwrite" if overwrite else "create",
                                  use_multipart=False)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self.s3.error(url, e, "PUT") from None
        del res
        checksum = self._verify(store, target, url, size, parts.md5s, multipart)
        method = "multipart" if multipart else "put"
        if target != key:
            bucket = split_url(url)[0]
            try:
                self._copy_within(bucket, target, url, size, overwrite=False)
                self._verify(store, key, url, size, parts.md5s, multipart, md5=False)
            finally:
                try:
                    call(url, "DELETE", obstore.delete, store, target)
                except Exception:  # noqa: BLE001 - a temporary key left behind is named by listings as such
                    pass
            method = "multipart+copy"
        return {"method": method, "checksum": checksum}

    def _guarded_upload(self, store, key: str, chunks, size: int, url: str, *, overwrite: bool, progress) -> dict:
        """An upload under a prefix a lease guards (:mod:`slotctl.store.guard`): a multipart upload of the bytes
        at ``url`` itself, visible only once its completion, signed to expire when the lease's hold ends,
        reaches the store (:func:`slotctl.store.s3copy.upload_parts`); its size and MD5s checked as any."""
        from slotctl.store.s3copy import upload_parts

        parts = _Parts(chunks, part_size(size), progress, size)
        call(url, "PUT", upload_parts, self.s3.config, url, iter(parts), size, parts.part,
             if_none_match=not overwrite)
        return {"method": "multipart", "checksum": self._verify(store, key, url, size, parts.md5s, True)}

    def _copy_within(self, bucket: str, skey: str, dst: str, size: int, *, overwrite: bool,
                     etag: str | None = None) -> None:
        """``size`` bytes of ``skey`` copied to ``dst`` in the same bucket, server-side, in parts of at most
        5 GiB (:func:`slotctl.store.s3copy.parts_for`: S3's bound on one copy part, which obstore's copy,
        one ``CopyObject`` or one ``UploadPartCopy``, would pass), pinned to ``etag`` (else to the source's
        ETag now); without ``overwrite`` completed only if nothing is at ``dst``."""
        from slotctl.store.s3copy import copy_object

        src = join_url(bucket, skey)
        if etag is None:
            entry = self.s3.stat(src)
            etag = entry.etag if entry is not None else None
        call(dst, "COPY", copy_object, self.s3.config, src, etag, dst, size, if_none_match=not overwrite)

    def _verify(self, store, key: str, url: str, size: int, md5s, multipart: bool, *, md5: bool = True) -> str | None:
        """The object's size checked against ``size``; with ``md5``, its ETag against the parts' MD5s."""
        try:
            meta = call(url, "HEAD", obstore.head, store, key)
        except Exception as e:  # noqa: BLE001
            raise self.s3.error(url, e, "HEAD") from None
        if meta["size"] != size:
            raise UsageError(f"{url}: the store holds {meta['size']:,} bytes, {size:,} were sent", code="size_mismatch")
        if not md5:
            return None
        try:
            return _checksum(meta.get("e_tag"), md5s, multipart)
        except UsageError as e:
            raise UsageError(f"{url}: {e}", code=e.code) from None

    def copy(self, src: str, dst: str, *, overwrite: bool, etag: str | None = None, size: int | None = None) -> dict:
        """A server-side copy (nothing passes through this machine); conditional without ``overwrite``.
        Within one bucket or to another of the endpoint a multipart upload of part copies of at most 5 GiB
        (:func:`slotctl.store.s3copy.copy_object`: ``size`` bytes, pinned to the source's ``etag``); obstore's
        copy (one part) only when the size is not known or 0."""
        sb, skey = split_url(src)
        if sb != split_url(dst)[0]:
            from slotctl.store.s3copy import copy_object

            self._refuse_existing(dst, overwrite)
            call(dst, "COPY", copy_object, self.s3.config, src, etag, dst, size, if_none_match=not overwrite)
            return {"method": "server_copy", "checksum": None}
        from slotctl.store.guard import write_until

        if not size and write_until(dst) is not None:     # a guarded prefix: the copies signed here only
            entry = self.s3.stat(src)
            size = entry.size if entry is not None else 0
            if not size:
                return self.upload(iter(()), 0, dst, overwrite=overwrite)
        if size:
            self._refuse_existing(dst, overwrite)
            self._copy_within(sb, skey, dst, size, overwrite=overwrite, etag=etag)
            return {"method": "server_copy", "checksum": None}
        store, dkey = self.s3.bucket(dst)
        try:
            if overwrite:
                call(dst, "COPY", obstore.copy, store, skey, dkey, overwrite=True)
            else:
                call(dst, "COPY", obstore.copy, self._copy_store(sb), skey, dkey, overwrite=False)
        except Exception as e:  # noqa: BLE001
            raise self.s3.error(dst, e, "COPY") from None
        return {"method": "server_copy", "checksum": None}

    def size_of(self, url: str) -> int | None:
        entry = self.s3.stat(url)
        return entry.size if entry is not None else None

    def chunks(self, reader: "ObjectReader", progress=None):
        """The bytes of an object being read, in order, pinned to its ETag; ``progress(done, total)``."""
        options: dict = {"if_match": reader.etag} if reader.etag else {}
        done = 0
        try:
            res = call(reader.name, "GET", obstore.get, reader.store, reader.key, options=options)
            stream = iter(res.stream(min_chunk_size=PART_SIZE))
            while (chunk := call(reader.name, "GET", next, stream, None)) is not None:
                data = bytes(chunk)
                done += len(data)
                if progress:
                    progress(done, reader.size)
                yield data
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self.s3.error(reader.name, e, "GET") from None
        if done != reader.size:
            raise UsageError(f"{reader.name}: {done:,} bytes read, the object has {reader.size:,}", code="size_mismatch")


# -- whole objects as local files: commands that rewrite every byte (convert) ---------------------------


@contextlib.contextmanager
def local_copy(url: str) -> Iterator[str]:
    """The object at ``url`` downloaded (pinned to its ETag) to a temporary local file, removed after: for a
    command that reads every byte anyway (convert rewrites the whole file)."""
    import tempfile

    reader = S3_STORE.open(url)
    fd, tmp = tempfile.mkstemp(prefix="slotctl-s3-", suffix=".bin")
    try:
        with os.fdopen(fd, "wb") as out:
            for data in Writer(S3_STORE).chunks(reader):
                out.write(data)
        yield tmp
    finally:
        reader.close()
        os.unlink(tmp)


def upload_file(path: str, url: str, *, overwrite: bool, progress=None) -> dict:
    """The local file ``path`` uploaded to ``url`` as ``cp`` uploads (conditional unless ``overwrite``)."""
    size = os.path.getsize(path)

    def chunks():
        with open(path, "rb") as f:
            while True:
                data = f.read(PART_SIZE)
                if not data:
                    return
                yield data

    return Writer(S3_STORE).upload(chunks(), size, url, overwrite=overwrite, progress=progress)


#: the one ``s3`` scheme of this process
S3_STORE = S3()
register_store("s3", S3_STORE)
