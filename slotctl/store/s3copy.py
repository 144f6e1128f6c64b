"""Server-side copies of an object's bytes: a multipart upload whose parts are copies of a range
(``UploadPartCopy`` with ``x-amz-copy-source-range``), so nothing passes through this machine. strip-draft
rewrites an object to a prefix of itself (:func:`rewrite_prefix`); cp copies an object to another bucket of
the same endpoint (:func:`copy_object`; obstore copies within one bucket only, and has no ranged part
copy). These requests are signed here (AWS Signature V4, the standard library's ``hmac``), with the
endpoint and credentials of :class:`slotctl.store.s3.Config`.

Conditions: every part is copied from the version planned (``x-amz-copy-source-if-match``), and the
upload is completed only if the destination is still the version it was (``If-Match`` on
``CompleteMultipartUpload``, a rewrite in place) or nothing is there (``If-None-Match: *``, a copy that
replaces nothing); otherwise it is aborted. Until it completes the destination is untouched: a process
killed meanwhile leaves it as it was (and an incomplete upload that a lifecycle rule
``AbortIncompleteMultipartUpload`` removes).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import re
import urllib.parse

from slotctl.errors import UsageError

#: S3's bound on a part: at most 5 GiB (and at least 5 MiB except the last: parts of equal size above it)
MAX_PART = 5 << 30
#: seconds one request may take (a part copy is done by the store: large parts take a while)
TIMEOUT = 300


def parts_for(size: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of the part copies that make ``size`` bytes: as few as S3 allows (each at most
    :data:`MAX_PART`, 5 GiB, every one but the last at least 5 MiB). The one rule of every server-side copy:
    a copy within one bucket, to another bucket, an upload's temporary key to its name, a rewrite in place.
    ``MAX_PART`` is read at each call (a test sets it small to see several parts of a small object)."""
    if size <= 0:
        return []
    n = -(-size // MAX_PART)
    step = -(-size // n)
    return [(off, min(step, size - off)) for off in range(0, size, step)]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class Signed:
    """Signed requests to one bucket of one endpoint."""

    def __init__(self, config, bucket: str):
        self.c = config
        self.bucket = bucket
        if config.endpoint:
            u = urllib.parse.urlsplit(config.endpoint)
            self.scheme, self.host, self.base = u.scheme, u.netloc, (u.path.rstrip("/") + "/" + bucket)
        else:
            self.scheme, self.host, self.base = "https", f"{bucket}.s3.{config.region}.amazonaws.com", ""
        if self.scheme == "http" and not config.allow_http:
            raise UsageError(f"{config.endpoint}: plain http only when the endpoint says http:// or "
                             "AWS_ALLOW_HTTP=true", code="usage")

    def path(self, key: str) -> str:
        return self.base + "/" + urllib.parse.quote(key, safe="/~")

    def request(self, method: str, key: str, query: dict[str, str], headers: dict[str, str] | None = None,
                body: bytes = b"") -> tuple[int, dict, bytes]:
        import http.client

        now = _dt.datetime.now(_dt.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        hdrs = {k.lower(): v for k, v in (headers or {}).items()}
        hdrs.update({"host": self.host, "x-amz-date": amz_date, "x-amz-content-sha256": _sha(body)})
        if self.c.token:
            hdrs["x-amz-security-token"] = self.c.token
        path = self.path(key)
        q = "&".join(f"{urllib.parse.quote(k, safe='~')}={urllib.parse.quote(v, safe='~')}"
                     for k, v in sorted(query.items()))
        signed = ";".join(sorted(hdrs))
        canonical = "\n".join([method, path, q, "".join(f"{k}:{hdrs[k].strip()}\n" for k in sorted(hdrs)), signed,
                               hdrs["x-amz-content-sha256"]])
        scope = f"{day}/{self.c.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, _sha(canonical.encode())])
        key_ = _hmac(_hmac(_hmac(_hmac(("AWS4" + self.c.secret_key).encode(), day), self.c.region), "s3"),
                     "aws4_request")
        sig = hmac.new(key_, to_sign.encode(), hashlib.sha256).hexdigest()
        hdrs["authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.c.access_key}/{scope}, "
                                 f"SignedHeaders={signed}, Signature={sig}")
        conn_cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(self.host, timeout=TIMEOUT)
        try:
            conn.request(method, path + (f"?{q}" if q else ""), body=body or None, headers=hdrs)
            resp = conn.getresponse()
            data = resp.read(1 << 20)
            length = resp.getheader("content-length") or ""
            if length.isdigit() and len(data) < min(int(length), 1 << 20):   # read(n) returns a cut body short
                raise http.client.IncompleteRead(data)
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        except OSError as e:
            raise UsageError(f"s3://{self.bucket}/{key}: the store does not answer ({e.strerror or e})",
                             code="store_unreachable") from None
        except http.client.HTTPException:   # an answer cut short (IncompleteRead), or not HTTP at all
            raise UsageError(f"s3://{self.bucket}/{key}: the store's answer ended early (the connection closed "
                             "mid-body)", code="store_unreachable") from None
        finally:
            conn.close()


def _code(body: bytes) -> str:
    m = re.search(rb"<Code>([A-Za-z]+)</Code>", body)
    return m.group(1).decode() if m else ""


def rewrite_prefix(config, url: str, etag: str, keep: int) -> dict:
    """Replace the object at ``url`` (of ETag ``etag``) by its first ``keep`` bytes, server-side. Returns
    ``{"requests", "parts"}``; a usage error (``object_changed`` when it is no longer that version)."""
    return copy_object(config, url, etag, url, keep, if_match=etag)


def copy_object(config, src: str, etag: str | None, dst: str, size: int, *, if_match: str | None = None,
                if_none_match: bool = False) -> dict:
    """The first ``size`` bytes of the object at ``src`` (of ETag ``etag``: every part is copied from that
    version) written to ``dst``, in the same bucket or another of the same endpoint, server-side: a
    multipart upload at ``dst`` whose parts are ``UploadPartCopy``s, completed on condition that ``dst`` is
    still the version ``if_match`` (a rewrite in place), or that nothing is there (``if_none_match``: ``cp``
    without ``--overwrite``), or unconditionally; otherwise aborted, and ``dst`` left as it was. Returns
    ``{"requests", "parts"}``; a usage error (``object_changed``: ``src`` or ``dst`` changed; ``exists``:
    ``dst`` exists and ``if_none_match``)."""
    from slotctl.store.config import split_url

    if size <= 0:
        raise ValueError("a server-side copy of no bytes: S3 has no multipart upload of no part")
    sbucket, skey = split_url(src)
    bucket, key = split_url(dst)
    s = Signed(config, bucket)
    source = "/" + sbucket + "/" + urllib.parse.quote(skey, safe="/~")
    status, _, body = s.request("POST", key, {"uploads": ""})
    if status != 200:
        raise _fail(dst, status, body, "CreateMultipartUpload")
    m = re.search(rb"<UploadId>([^<]+)</UploadId>", body)
    if not m:
        raise UsageError(f"{dst}: the store did not start a multipart upload", code="store_error")
    upload = m.group(1).decode()
    requests, done = 1, False
    try:
        etags = []
        for n, (off, part) in enumerate(parts_for(size), 1):
            status, _, body = s.request("PUT", key, {"partNumber": str(n), "uploadId": upload},
                                        {"x-amz-copy-source": source,
                                         "x-amz-copy-source-range": f"bytes={off}-{off + part - 1}",
                                         **({"x-amz-copy-source-if-match": etag} if etag else {})})
            requests += 1
            pm = re.search(rb"<ETag>([^<]+)</ETag>", body)
            if status != 200 or not pm:
                raise _fail(src, status, body, f"UploadPartCopy {n}")
            etags.append(pm.group(1).decode().replace("&quot;", '"'))
        xml = ("<CompleteMultipartUpload>" + "".join(f"<Part><PartNumber>{i}</PartNumber><ETag>{t}</ETag></Part>"
                                                     for i, t in enumerate(etags, 1))
               + "</CompleteMultipartUpload>").encode()
        cond = {"if-match": if_match} if if_match else {"if-none-match": "*"} if if_none_match else {}
        status, _, body = s.request("POST", key, {"uploadId": upload}, {**cond, "content-type": "application/xml"},
                                    xml)
        requests += 1
        if status != 200 or b"<Error>" in body:
            raise _fail(dst, status, body, "CompleteMultipartUpload", exists=if_none_match)
        done = True
        return {"requests": requests, "parts": len(etags)}
    finally:
        if not done:
            try:
                s.request("DELETE", key, {"uploadId": upload})
            except UsageError:
                pass


def _fail(url: str, status: int, body: bytes, what: str, *, exists: bool = False) -> UsageError:
    code = _code(body)
    if exists and (status == 412 or code == "PreconditionFailed"):   # If-None-Match: * on the completion
        from slotctl.store.config import EXISTS

        return UsageError(f"{url}: {EXISTS}", code="exists")
    if status == 412 or code == "PreconditionFailed":
        return UsageError(f"{url}: the object changed since it was read (its ETag); left as it is",
                          code="object_changed")
    if status in (401, 403):
        return UsageError(f"{url}: the store refused the request ({what}: {code or status})", code="bad_credentials")
    if status == 404:
        return UsageError(f"{url}: no such object ({what})", code="no_such_file")
    return UsageError(f"{url}: {what} failed ({status}{' ' + code if code else ''})", code="store_error")

