"""Slot files in S3-compatible object storage (``s3://bucket/key``), through obstore.

Importing this module registers the ``s3`` scheme with :mod:`slotctl.sources`, so that every command that
reads a slot file reads an object as well; the CLI imports it only when an ``s3://`` path is given (the
``[s3]`` extra: obstore), so local commands keep their start-up.

Configuration is every S3 tool's (docs/store.md): ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``),
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` (or
``AWS_DEFAULT_REGION``), ``AWS_PROFILE`` with ``~/.aws/config`` and ``~/.aws/credentials`` (or
``AWS_CONFIG_FILE`` and ``AWS_SHARED_CREDENTIALS_FILE``); the environment wins over the files. Plain http
only when the endpoint says ``http://`` or ``AWS_ALLOW_HTTP=true``. Without credentials a command stops
with ``no_credentials`` (slotctl never asks an instance-metadata endpoint); ``AWS_SKIP_SIGNATURE=true``
reads public buckets unsigned.

Every failure is one line naming the object and what happened, exit 2 (:func:`store_error`); no message
holds a credential (:func:`_scrub`). A read is pinned to the ETag of the object's first read
(``If-Match``): an object replaced while it is read stops the command (``object_changed``).
"""

from __future__ import annotations

import configparser
import os
import re
import threading
from datetime import timedelta
from typing import Sequence

import obstore
from obstore import exceptions as obx
from obstore.store import S3Store

from slotctl.errors import UsageError
from slotctl.sources import HEAD_BYTES, Entry, RangedFile, register_store

#: seconds to wait for a connection, and for one request as a whole (a part of an upload included)
CONNECT_TIMEOUT = 5
REQUEST_TIMEOUT = 120
#: retries of a request that failed in a way worth retrying (obstore's backoff), and their time in all
MAX_RETRIES = 2
RETRY_TIMEOUT = 15
#: the user metadata key slotctl writes when it copies an object (``x-amz-meta-slotctl-last-used``)
LAST_USED_KEY = "slotctl-last-used"
#: bytes of first reads kept between a listing's check of each object's magic and the object's open
PEEK_CACHE = 64 << 20


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key); a usage error without a bucket."""
    rest = url.partition("://")[2]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise UsageError(f"{url}: no bucket (expected s3://BUCKET/KEY)", code="usage")
    return bucket, key


def join_url(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


# -- configuration -------------------------------------------------------------------------------------


def _profile_files() -> tuple[dict, dict]:
    """The sections of ``~/.aws/credentials`` and ``~/.aws/config`` for ``AWS_PROFILE`` (or ``default``)."""
    env = os.environ
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = os.path.expanduser("~")
    cred_path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")
    conf_path = env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")

    def section(path: str, name: str) -> dict:
        cp = configparser.RawConfigParser()
        try:
            cp.read(path, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError):
            raise UsageError(f"{path}: not an AWS configuration file this can read", code="bad_config") from None
        return dict(cp.items(name)) if cp.has_section(name) else {}

    creds = section(cred_path, profile)
    conf = section(conf_path, profile if profile == "default" else f"profile {profile}")
    if profile != "default" and not creds and not conf and "AWS_PROFILE" in env:
        raise UsageError(f"AWS_PROFILE={profile}: no such profile in {cred_path} or {conf_path}",
                         code="no_credentials")
    return creds, conf


class Config:
    """The settings of one S3 endpoint, as the environment and the AWS files give them."""

    def __init__(self):
        env = os.environ
        creds, conf = _profile_files()

        def pick(env_names: Sequence[str], file_key: str) -> str | None:
            for n in env_names:
                if env.get(n):
                    return env[n]
            return creds.get(file_key) or conf.get(file_key) or None

        self.access_key = pick(("AWS_ACCESS_KEY_ID",), "aws_access_key_id")
        self.secret_key = pick(("AWS_SECRET_ACCESS_KEY",), "aws_secret_access_key")
        self.token = pick(("AWS_SESSION_TOKEN",), "aws_session_token")
        self.region = pick(("AWS_REGION", "AWS_DEFAULT_REGION"), "region") or "us-east-1"
        self.endpoint = pick(("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"), "endpoint_url")
        self.unsigned = env.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true")
        self.allow_http = env.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true")
        if self.endpoint is not None:
            if self.endpoint.startswith("http://"):
                self.allow_http = True
            elif not self.endpoint.startswith("https://"):
                raise UsageError(f"AWS_ENDPOINT_URL={self.endpoint}: expected an http:// or https:// URL",
                                 code="usage")

    def secrets(self) -> list[str]:
        return [s for s in (self.access_key, self.secret_key, self.token) if s]

    def check(self, url: str) -> None:
        if self.unsigned:
            return
        if not self.access_key or not self.secret_key:
            raise UsageError(f"{url}: no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                             "AWS_PROFILE with ~/.aws/credentials; AWS_SKIP_SIGNATURE=true for a public bucket)",
                             code="no_credentials")

    def store(self, bucket: str) -> S3Store:
        config: dict = {"region": self.region}
        if self.endpoint:
            config["endpoint"] = self.endpoint
            config["virtual_hosted_style_request"] = False
        if self.unsigned:
            config["skip_signature"] = True
        else:
            config["access_key_id"] = self.access_key
            config["secret_access_key"] = self.secret_key
            if self.token:
                config["session_token"] = self.token
        return S3Store(bucket, config=config,
                       client_options={"allow_http": self.allow_http, "connect_timeout": f"{CONNECT_TIMEOUT}s",
                                       "timeout": f"{REQUEST_TIMEOUT}s"},
                       retry_config={"max_retries": MAX_RETRIES, "retry_timeout": timedelta(seconds=RETRY_TIMEOUT),
                                     "backoff": {"init_backoff": timedelta(milliseconds=100),
                                                 "max_backoff": timedelta(seconds=2), "base": 2}})


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
    """The one-line error (exit 2) for an obstore failure on ``url``; never a credential in it."""
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
        code, words = "exists", "exists (use --overwrite to replace it)"
    elif isinstance(e, (obx.PermissionDeniedError, obx.UnauthenticatedError)):
        code, words = "bad_credentials", "the store refused the credentials"
    else:
        first = _scrub(msg.split("\n", 1)[0], secrets).removeprefix("Generic S3 error: ")
        low = first.lower()
        if any(w in low for w in ("connect", "timed out", "timeout", "connection", "dns", "error sending request",
                                  "broken pipe", "reset by peer")):
            code, words = "store_unreachable", f"the store does not answer ({_short(first)})"
        else:
            code, words = "store_error", _short(first)
    return UsageError(_scrub(f"{url}: {words}{doing}", secrets), code=code)


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

    def bucket(self, url: str) -> tuple[S3Store, str]:
        bucket, key = split_url(url)
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                self.config.check(url)
                store = self._stores[bucket] = self.config.store(bucket)
        return store, key

    def peek(self, urls: Sequence[str], n: int) -> list[bytes | None]:
        """The first ``n`` bytes of each object, read concurrently; each first read is kept (up to
        :data:`PEEK_CACHE` bytes in all) for the object's next :meth:`open`, which then costs no request."""
        from concurrent.futures import ThreadPoolExecutor

        def one(url: str) -> bytes | None:
            try:
                r = self.open(url)
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
            meta = obstore.head(store, key)
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
            res = obstore.list_with_delimiter(store, prefix or None)
            for meta in res["objects"]:
                if meta["path"] == prefix:
                    continue
                out.append(Entry(join_url(bucket, meta["path"]), meta["size"], _mtime(meta), meta.get("e_tag")))
        except Exception as e:  # noqa: BLE001
            raise self.error(url, e, "LIST") from None
        if not out and not res.get("common_prefixes"):
            self._check_bucket(store, url)
        return sorted(out, key=lambda en: en.path)

    def _check_bucket(self, store: S3Store, url: str) -> None:
        """An empty listing of a bucket that does not exist is an error (a missing prefix is just empty)."""
        try:
            obstore.list_with_delimiter(store, None)
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
            res = obstore.get(self.store, self.key, options={"range": (0, HEAD_BYTES)})
            data = bytes(res.bytes())
            meta = res.meta
        except (obx.NotFoundError, FileNotFoundError) as e:
            raise self.s3.error(self.name, e) from None
        except Exception as e:  # noqa: BLE001 - an empty object answers a range with 416
            if "416" not in str(e) and "InvalidRange" not in str(e):
                raise self.s3.error(self.name, e, "GET") from None
            try:
                meta, data = obstore.head(self.store, self.key), b""
            except Exception as e2:  # noqa: BLE001
                raise self.s3.error(self.name, e2, "HEAD") from None
        self.requests += 1
        self.bytes_read += len(data)
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
            return bytes(obstore.get(self.store, self.key, options=options).bytes())
        except Exception as e:  # noqa: BLE001
            raise self.s3.error(self.name, e, f"GET bytes {offset}-{offset + n - 1}") from None


#: the one ``s3`` scheme of this process
S3_STORE = S3()
register_store("s3", S3_STORE)
