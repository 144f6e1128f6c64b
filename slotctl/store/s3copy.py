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

**Guarded writes** (:mod:`slotctl.store.guard`: a prefix whose lease this process asked for) are made here
too: a put is a multipart upload of the bytes (:func:`upload_parts`; invisible until it completes), a delete
one ``DELETE`` (:func:`delete_object`); the request that makes the write visible (the completion, the
delete) is signed in its query to expire at the second the guard answers (``X-Amz-Expires``, checked by the
store when the request arrives) and sent whole in one write to the socket, so that no part of it can wait in
this process while that second passes.
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
#: seconds a request signed to expire (a guarded write) must have left when it is signed: the store checks
#: the expiry when the request arrives, a round trip later
MIN_WINDOW = 0.25


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
                body: bytes = b"", *, expires: int | None = None) -> tuple[int, dict, bytes]:
        """One request, signed (AWS Signature V4) and sent whole in one write to the socket; its status,
        headers (lower case) and up to 1 MiB of its body. ``expires``: the whole second (Unix time) after which
        the store must refuse it: signed in the query (``X-Amz-Expires``, counted from ``X-Amz-Date``, this
        second), with every header sent; a usage error (``lease_expiring``) when less than
        :data:`MIN_WINDOW` is left."""
        import time

        now_s = time.time()
        now = _dt.datetime.fromtimestamp(int(now_s), _dt.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        scope = f"{day}/{self.c.region}/s3/aws4_request"
        hdrs = {k.lower(): v for k, v in (headers or {}).items()}
        hdrs["host"] = self.host
        query = dict(query)
        if expires is None:
            hdrs.update({"x-amz-date": amz_date, "x-amz-content-sha256": _sha(body)})
            if self.c.token:
                hdrs["x-amz-security-token"] = self.c.token
            payload = hdrs["x-amz-content-sha256"]
        else:
            left = expires - now_s
            if left < MIN_WINDOW or expires - int(now_s) < 1:
                raise UsageError(f"s3://{self.bucket}/{key}: the lease's hold ends in {max(left, 0.0):.2f} s: too "
                                 "soon for a write to reach the store (not sent)", code="lease_expiring")
            query.update({"X-Amz-Algorithm": "AWS4-HMAC-SHA256", "X-Amz-Credential": f"{self.c.access_key}/{scope}",
                          "X-Amz-Date": amz_date, "X-Amz-Expires": str(expires - int(now_s)),
                          "X-Amz-SignedHeaders": ";".join(sorted(hdrs))})
            if self.c.token:
                query["X-Amz-Security-Token"] = self.c.token
            payload = "UNSIGNED-PAYLOAD"
        path = self.path(key)
        q = "&".join(f"{urllib.parse.quote(k, safe='~')}={urllib.parse.quote(v, safe='~')}"
                     for k, v in sorted(query.items()))
        signed = ";".join(sorted(hdrs))
        canonical = "\n".join([method, path, q, "".join(f"{k}:{hdrs[k].strip()}\n" for k in sorted(hdrs)), signed,
                               payload])
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, _sha(canonical.encode())])
        key_ = _hmac(_hmac(_hmac(_hmac(("AWS4" + self.c.secret_key).encode(), day), self.c.region), "s3"),
                     "aws4_request")
        sig = hmac.new(key_, to_sign.encode(), hashlib.sha256).hexdigest()
        if expires is None:
            hdrs["authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.c.access_key}/{scope}, "
                                     f"SignedHeaders={signed}, Signature={sig}")
            target = path + (f"?{q}" if q else "")
        else:
            target = f"{path}?{q}&X-Amz-Signature={sig}"
        return self._send(method, key, target, hdrs, body)

    def _send(self, method: str, key: str, target: str, hdrs: dict[str, str], body: bytes) -> tuple[int, dict, bytes]:
        """The request line, headers and body in one ``sendall`` on a connection of its own, then the answer."""
        import http.client

        head = "".join([f"{method} {target} HTTP/1.1\r\n", *(f"{k}: {v}\r\n" for k, v in hdrs.items()),
                        f"content-length: {len(body)}\r\n", "connection: close\r\n\r\n"])
        conn_cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(self.host, timeout=TIMEOUT)
        try:
            conn.connect()
            conn.sock.sendall(head.encode("latin-1") + body)
            resp = http.client.HTTPResponse(conn.sock, method=method)
            try:
                resp.begin()
                data = resp.read(1 << 20)
                length = resp.getheader("content-length") or ""
                if length.isdigit() and len(data) < min(int(length), 1 << 20):   # read(n) returns a cut body short
                    raise http.client.IncompleteRead(data)
                return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
            finally:
                resp.close()
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
    from slotctl.store.guard import write_until

    if size <= 0:
        raise ValueError("a server-side copy of no bytes: S3 has no multipart upload of no part")
    sbucket, skey = split_url(src)
    bucket, key = split_url(dst)
    write_until(dst)        # a guarded prefix whose lease cannot be shown: nothing started
    s = Signed(config, bucket)
    source = "/" + sbucket + "/" + urllib.parse.quote(skey, safe="/~")
    upload = _create(s, dst, key)
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
        cond = {"if-match": if_match} if if_match else {"if-none-match": "*"} if if_none_match else {}
        _complete(s, dst, key, upload, etags, cond, exists=if_none_match)
        requests += 1
        done = True
        return {"requests": requests, "parts": len(etags)}
    finally:
        if not done:
            _abort(s, key, upload)


def _create(s: Signed, url: str, key: str) -> str:
    """``CreateMultipartUpload`` at ``key``: the upload's id."""
    status, _, body = s.request("POST", key, {"uploads": ""})
    if status != 200:
        raise _fail(url, status, body, "CreateMultipartUpload")
    m = re.search(rb"<UploadId>([^<]+)</UploadId>", body)
    if not m:
        raise UsageError(f"{url}: the store did not start a multipart upload", code="store_error")
    return m.group(1).decode()


def _complete(s: Signed, url: str, key: str, upload: str, etags: list[str], cond: dict[str, str], *,
              exists: bool) -> str | None:
    """``CompleteMultipartUpload`` of ``upload`` (its parts' ETags, in order), on the conditions ``cond``;
    in a guarded prefix signed to expire when the guard says (asked now, just before); the object's
    ETag."""
    from slotctl.store.guard import write_until

    xml = ("<CompleteMultipartUpload>" + "".join(f"<Part><PartNumber>{i}</PartNumber><ETag>{t}</ETag></Part>"
                                                 for i, t in enumerate(etags, 1))
           + "</CompleteMultipartUpload>").encode()
    status, _, body = s.request("POST", key, {"uploadId": upload}, {**cond, "content-type": "application/xml"},
                                xml, expires=write_until(url))
    if status != 200 or b"<Error>" in body:
        raise _fail(url, status, body, "CompleteMultipartUpload", exists=exists)
    m = re.search(rb"<ETag>([^<]+)</ETag>", body)
    return m.group(1).decode().replace("&quot;", '"') if m else None


def _abort(s: Signed, key: str, upload: str) -> None:
    """An upload that did not complete, aborted (its parts dropped): never visible, whatever happens here."""
    try:
        s.request("DELETE", key, {"uploadId": upload})
    except UsageError:
        pass


def upload_parts(config, url: str, chunks, size: int, part: int, *, if_none_match: bool) -> dict:
    """``size`` bytes from ``chunks`` written to ``url`` as a multipart upload of parts of ``part`` bytes (the
    last shorter; one part for a small object), made visible by its completion (``If-None-Match: *`` with
    ``if_none_match``), which a guarded prefix's lease signs to expire (:mod:`slotctl.store.guard`); parts
    that reach the store later are never an object. Returns ``{"requests", "parts", "etag"}``; a usage error
    (``exists``, the guard's own, the store's)."""
    from slotctl.store.config import split_url
    from slotctl.store.guard import write_until

    bucket, key = split_url(url)
    write_until(url)        # a lease that cannot be shown: nothing sent
    s = Signed(config, bucket)
    upload = _create(s, url, key)
    requests, done, etags = 1, False, []
    try:
        def send(data: bytes) -> None:
            n = len(etags) + 1
            status, headers, body = s.request("PUT", key, {"partNumber": str(n), "uploadId": upload}, body=data)
            if status != 200 or not headers.get("etag"):
                raise _fail(url, status, body, f"UploadPart {n}")
            etags.append(headers["etag"])

        pending, sent = bytearray(), 0
        for data in chunks:
            pending += data
            while len(pending) > part:      # every part but the last of ``part`` bytes
                send(bytes(pending[:part]))
                sent += part
                del pending[:part]
        if pending or not etags:
            send(bytes(pending))
            sent += len(pending)
        requests += len(etags)
        if sent != size:
            raise UsageError(f"{url}: {sent:,} bytes read to send, {size:,} expected", code="size_mismatch")
        etag = _complete(s, url, key, upload, etags, {"if-none-match": "*"} if if_none_match else {},
                         exists=if_none_match)
        requests += 1
        done = True
        return {"requests": requests, "parts": len(etags), "etag": etag}
    finally:
        if not done:
            _abort(s, key, upload)


def delete_object(config, url: str) -> None:
    """DELETE the object at ``url``, one request signed here; in a guarded prefix signed to expire when the
    guard says (asked now, just before). An object already gone is no error (S3's DELETE is idempotent)."""
    from slotctl.store.config import split_url
    from slotctl.store.guard import write_until

    bucket, key = split_url(url)
    expires = write_until(url)
    status, _, body = Signed(config, bucket).request("DELETE", key, {}, expires=expires)
    if status not in (200, 204, 404):
        raise _fail(url, status, body, "DELETE")


def _fail(url: str, status: int, body: bytes, what: str, *, exists: bool = False) -> UsageError:
    code = _code(body)
    if exists and (status == 412 or code == "PreconditionFailed"):   # If-None-Match: * on the completion
        from slotctl.store.config import EXISTS

        return UsageError(f"{url}: {EXISTS}", code="exists")
    if status == 412 or code == "PreconditionFailed":
        return UsageError(f"{url}: the object changed since it was read (its ETag); left as it is",
                          code="object_changed")
    if status == 403 and b"expired" in body.lower():
        # a guarded write that reached the store after the second it was signed to expire at (the lease's hold)
        return UsageError(f"{url}: not written: the store refused it, it came after the lease's hold ended ({what})",
                          code="lease_lost")
    if status in (401, 403):
        return UsageError(f"{url}: the store refused the request ({what}: {code or status})", code="bad_credentials")
    if status == 404:
        return UsageError(f"{url}: no such object ({what})", code="no_such_file")
    return UsageError(f"{url}: {what} failed ({status}{' ' + code if code else ''})", code="store_error")

