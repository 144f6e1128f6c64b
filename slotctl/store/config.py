"""An S3 endpoint as the environment and the AWS files configure it, its URLs (``s3://BUCKET/KEY``), and the
word for an object a write would replace. Below :mod:`slotctl.store.s3` (reading and writing through obstore)
and :mod:`slotctl.store.s3copy` (server-side copies), which both read it.

Configuration is every S3 tool's (docs/store.md): ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``),
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` (or
``AWS_DEFAULT_REGION``), ``AWS_PROFILE`` with ``~/.aws/config`` and ``~/.aws/credentials`` (or
``AWS_CONFIG_FILE`` and ``AWS_SHARED_CREDENTIALS_FILE``); the environment wins over the files. Plain http
only when the endpoint says ``http://`` or ``AWS_ALLOW_HTTP=true``. Without credentials a command stops
with ``no_credentials`` (slotctl never asks an instance-metadata endpoint); ``AWS_SKIP_SIGNATURE=true``
reads public buckets unsigned.
"""

from __future__ import annotations

import configparser
import os
from datetime import timedelta
from typing import Sequence

from obstore.store import S3Store

from slotctl.errors import UsageError

#: seconds to wait for a connection, and for one request as a whole (a part of an upload included)
CONNECT_TIMEOUT = 5
REQUEST_TIMEOUT = 120
#: retries of a request that failed in a way worth retrying (obstore's backoff), and their time in all
MAX_RETRIES = 2
RETRY_TIMEOUT = 15

#: what a copy or an upload that would replace an object is told (``exists``)
EXISTS = "exists (use --overwrite to replace it)"


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


#: the most bytes of an AWS configuration or credentials file read (a FIFO or device is refused unread)
CONFIG_MAX_BYTES = 1 << 20


def _profile_files() -> tuple[dict, dict]:
    """The sections of ``~/.aws/credentials`` and ``~/.aws/config`` for ``AWS_PROFILE`` (or ``default``)."""
    env = os.environ
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = os.path.expanduser("~")
    cred_path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")
    conf_path = env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")

    def section(path: str, name: str) -> dict:
        from slotctl.paths import read_bounded

        cp = configparser.RawConfigParser()
        if not os.path.lexists(path):       # as configparser's read: a file that is not there is no section
            return {}
        try:    # bounded before it is read whole: a FIFO hung, /dev/zero was a MemoryError
            cp.read_string(read_bounded(path, CONFIG_MAX_BYTES, what="AWS configuration file ").decode("utf-8"),
                           source=path)
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
            bad = not self.endpoint.startswith(("http://", "https://"))
            try:   # a URL obstore cannot use makes it panic, not raise: refused here
                import urllib.parse

                u = urllib.parse.urlsplit(self.endpoint)
                bad = bad or not u.hostname
                u.port  # noqa: B018 - raises for a port that is not a number
            except ValueError:
                bad = True
            if bad:
                raise UsageError(f"AWS_ENDPOINT_URL={self.endpoint}: expected an http:// or https:// URL "
                                 "(http://HOST:PORT)", code="usage")

    def secrets(self) -> list[str]:
        return [s for s in (self.access_key, self.secret_key, self.token) if s]

    def check(self, url: str) -> None:
        if self.unsigned:
            return
        if not self.access_key or not self.secret_key:
            raise UsageError(f"{url}: no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                             "AWS_PROFILE with ~/.aws/credentials; AWS_SKIP_SIGNATURE=true for a public bucket)",
                             code="no_credentials")

    def store(self, bucket: str, **extra) -> S3Store:
        config: dict = {"region": self.region, **extra}
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
