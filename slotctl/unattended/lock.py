"""One keeper per server and store, and its journal of what it stored (docs/fleet.md, "One keeper").

A keeper holds a lock named after the server it keeps (:func:`server_key`) in the store it writes:

* a **directory** store: ``flock(LOCK_EX | LOCK_NB)`` on ``.slotctl-keep-KEY.lock`` in the store. The kernel
  releases it when the process ends, however it ends (SIGKILL included), so there is nothing to expire.
* an **``s3://``** store: a lease object ``.slotctl-keep-KEY.lease`` under the prefix, created with a
  conditional put (``If-None-Match: *``: only if absent) and renewed every :data:`RENEW` of ``ttl`` with a
  conditional put on its own ETag (``If-Match``). The lease says until when it holds (``expires``, the
  holder's clock). Another keeper refuses while ``expires`` is ahead of its clock; after it, it takes the
  lease over with a put conditional on the ETag it read, so of two that try at once one wins. The holder
  counts its own lease lost when it could not renew it within :data:`HOLD` of ``ttl`` from the moment the
  last document it wrote was made (its monotonic clock), however the store fails (an error, or no answer
  at all): a renewal that failed is tried again every :data:`RETRY` seconds at most, each try given up
  after :data:`RENEW` of the lease and the last at that deadline, so a store that stalls for less than
  ``HOLD - RENEW`` of the lease, whenever the stall begins, never costs it. It stops writing before anyone
  may take over. So a keeper killed with SIGKILL is taken over after the expiry and never before (the
  clocks of the two hosts are assumed to agree to well within ``(1 - HOLD) * ttl``).

  **One writer per store.** From the moment a process asks for the lease (:func:`acquire`), every write it
  makes under the prefix (a put, a delete, prune's deletes) goes through the lease's check
  (:meth:`Lease.write_until`, registered with :mod:`slotctl.store.guard`, so that keep and serve get it
  without a call of their own): no lease taken yet, or one lost, and nothing is written; the lease object's
  version (its ETag, by a ``HEAD``; its holder, by a ``GET`` when the ETag is not the one last written)
  shows a takeover, whatever the clocks say; and the write is signed to expire (``X-Amz-Expires``) when the
  hold ends, so a holder stalled after the check (SIGSTOP) and woken after a takeover has its write refused
  by the store.

The lock's refusal is :class:`Held` (exit 2, one line naming the holder). Beside the lock lives the
keeper's **journal**: for each slot, the ``/slots`` signature and name of the state last stored or restored
(:meth:`Lock.remember`); a keeper that starts again reads it (:meth:`Lock.known`) and does not save again a
slot whose state is already the store's. In a directory store the journal is ``.slotctl-keep-KEY.json``
(written atomically); in ``s3://`` it is part of the lease object.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import socket
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable

from slotctl.errors import SlotctlError, UsageError
from slotctl.live import is_loopback

#: seconds an ``s3://`` lease holds without a renewal (``keep --lease``)
DEFAULT_TTL = 60.0
#: the shortest lease accepted: a guarded write is signed to expire to the second (``X-Amz-Expires``), at the
#: end of the lease's hold (:data:`HOLD` of it), which must leave a second boundary ahead after a renewal
MIN_TTL = 2.0
#: the part of the lease after which a holder that could not renew counts it lost and stops writing
HOLD = 0.8
#: the part of the lease between two renewals, and the longest a try of one waits for the store
RENEW = 1 / 6
#: seconds between two tries of a renewal that failed, at most (a twentieth of the lease when shorter)
RETRY = 1.0
#: a lease or journal larger than this is not a keeper's: not parsed
MAX_LEASE_BYTES = 1 << 20


class Held(UsageError):
    """Another keeper holds the lock of this server and store (exit 2)."""

    code = "locked"


class Lost(SlotctlError):
    """This keeper's lease was not renewed in time or was taken over: it must stop writing (exit 2).
    ``code`` ``no_lease``: a write refused because the lease was not taken yet (or was released)."""

    code = "lease_lost"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


def server_key(url: str) -> str:
    """A short name for the server at ``url``: a hash of its identity (:func:`server_identity`). What
    follows a space (``URL (model NAME)``: a router's model, keep's) is part of the name."""
    return hashlib.sha256(server_identity(url).encode()).hexdigest()[:12]


def server_identity(url: str) -> str:
    """The server ``url`` names, written one way for every way of writing it, so that two processes of one
    server and store take one lock: the scheme; the host (a loopback or unspecified address, ``0.0.0.0`` and
    ``::`` included, and every form of one (``127.1``, ``0x7f.0.0.1``, ``2130706433``, ``::ffff:127.0.0.1``),
    or ``localhost``: this machine, qualified by its host name, so that keepers of two hosts, each beside its
    own ``127.0.0.1:8080``, may share one ``s3://`` store; another address in its canonical form; a name in
    lower case, without a trailing dot); the port, none for the scheme's own (80, 443); the path with
    percent-escapes decoded, ``.``, ``..`` and empty segments resolved, no trailing slash. A URL already in
    that form keeps the identity it had before this normalisation."""
    base, _, model = url.partition(" ")
    parts = urllib.parse.urlsplit(base.strip())
    scheme = parts.scheme.lower()
    port = parts.port
    if port == {"http": 80, "https": 443}.get(scheme):
        port = None
    ident = f"{scheme}://{_host_identity(parts.hostname or '')}:{port or ''}{_path_identity(parts.path)}"
    return ident + (f" {model}" if model else "")


def _host_identity(host: str) -> str:
    import ipaddress
    import re

    host = host.lower().rstrip(".")
    addr = None
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        if re.fullmatch(r"[0-9a-fx.]+", host) and re.search(r"[0-9]", host):
            try:    # the forms inet_aton (and so the system's resolver) takes: 127.1, 0x7f.1, 2130706433
                addr = ipaddress.IPv4Address(socket.inet_aton(host))
            except (OSError, ValueError):
                addr = None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr is not None:
        if addr.is_loopback or addr.is_unspecified:      # 0.0.0.0 and :: reach this machine too
            return "loopback@" + socket.gethostname()
        return str(addr)
    return "loopback@" + socket.gethostname() if is_loopback(host) else host


def _path_identity(path: str) -> str:
    out: list[str] = []
    for seg in urllib.parse.unquote(path).split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if out:
                out.pop()
            continue
        out.append(seg)
    return "".join("/" + seg for seg in out)


def _holder(server: str, expires: float | None = None) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "server": server, "since": time.time(),
            **({"expires": expires} if expires is not None else {})}


def _describe(holder: dict) -> str:
    from slotctl.catalog import iso_time

    pid, host = holder.get("pid"), holder.get("host")
    since = holder.get("since")
    when = f" since {iso_time(since)}" if isinstance(since, (int, float)) else ""
    return f"pid {pid} on {host}{when}" if pid is not None else "another process"


def _parse(raw: bytes) -> dict:
    """A lease or journal document; {} when it is not one (never trusted further than its shape)."""
    if len(raw) > MAX_LEASE_BYTES:
        return {}
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _journal_entries(doc: dict) -> dict[int, dict]:
    out = {}
    journal = doc.get("journal")
    if not isinstance(journal, dict):
        return out
    for slot, e in journal.items():
        if (isinstance(slot, str) and slot.isdigit() and len(slot) <= 4 and isinstance(e, dict)
                and isinstance(e.get("name"), str) and isinstance(e.get("model"), str)
                and isinstance(e.get("signature"), list)):
            out[int(slot)] = e
    return out


#: what each role that takes a lock is called in its refusal (``keep``: a keeper, ``serve``: a serve process)
ROLES = {"keep": ("keeper", "keeps this server with this store"),
         "serve": ("serve", "serves this server with this store")}


def _role(role: str) -> tuple[str, str]:
    if role not in ROLES:
        raise ValueError(f"lock role {role!r}: expected one of {', '.join(ROLES)}")
    return ROLES[role]


class Lock:
    """What both kinds of lock share: the journal (slot -> signature, model hash, name)."""

    path: str

    def __init__(self, server: str, role: str = "keep"):
        self.server = server
        self.role = role
        self.who, self.does = _role(role)
        self.journal: dict[int, dict] = {}

    def known(self, model: str, has: Callable[[str], bool]) -> dict[int, tuple]:
        """The signatures of the slots whose state, for the server's model ``model``, the journal names and
        the store still has (``has(name)``): a keeper starting again does not save those again."""
        return {slot: tuple(e["signature"]) for slot, e in self.journal.items()
                if e["model"] == model and has(e["name"])}

    def remember(self, slot: int, signature: tuple | None, model: str, name: str) -> None:
        if signature is None:
            return
        self.journal[slot] = {"signature": list(signature), "model": model, "name": name}
        self._write_journal()

    def _write_journal(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise :class:`Lost` when the lock no longer holds (a lease not renewed in time)."""

    def release(self) -> None:
        raise NotImplementedError


class DirectoryLock(Lock):
    """``flock`` on ``DIR/.slotctl-keep-KEY.lock``; the journal in ``DIR/.slotctl-keep-KEY.json``."""

    def __init__(self, directory: str | os.PathLike, server: str, role: str = "keep"):
        super().__init__(server, role)
        key = server_key(server)
        self.path = os.path.join(os.fspath(directory), f".slotctl-{role}-{key}.lock")
        self.journal_path = os.path.join(os.fspath(directory), f".slotctl-{role}-{key}.json")
        self.fd: int | None = None

    def acquire(self) -> "DirectoryLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UsageError(f"{self.path}: cannot open the keeper's lock: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse(os.pread(fd, MAX_LEASE_BYTES, 0))
            os.close(fd)
            raise Held(f"{self.server}: another {self.who} {self.does} ({_describe(holder)}; "
                       f"lock {self.path})") from None
        body = json.dumps(_holder(self.server)).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, body, 0)
        self.fd = fd
        try:
            with open(self.journal_path, "rb") as f:
                self.journal = _journal_entries(_parse(f.read(MAX_LEASE_BYTES + 1)))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise UsageError(f"{self.journal_path}: {e.strerror}") from None
        return self

    def _write_journal(self) -> None:
        from slotctl.atomic import atomic_writer

        with atomic_writer(self.journal_path, overwrite=True) as out:
            out.write(json.dumps({"server": self.server, "journal": {str(k): v for k, v in self.journal.items()}})
                      .encode())

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)      # the kernel drops the flock; the file stays (another may have it open)
            self.fd = None


class Lease(Lock):
    """The lease object ``PREFIX/.slotctl-keep-KEY.lease`` of an ``s3://`` store (module docstring)."""

    def __init__(self, prefix: str, server: str, ttl: float = DEFAULT_TTL, *, clock=time.time, role: str = "keep"):
        super().__init__(server, role)
        if not ttl >= MIN_TTL:
            raise UsageError(f"--lease {ttl:g}: an s3:// lease holds at least {MIN_TTL:g} s (a write is signed to "
                             f"expire, to the second, when {HOLD:g} of it has passed)")
        self.prefix = prefix.rstrip("/") + "/"
        self.url = prefix.rstrip("/") + "/" + f".slotctl-{role}-{server_key(server)}.lease"
        self.path = self.url
        self.ttl = float(ttl)
        self.clock = clock
        self.etag: str | None = None
        #: this holder's ``since`` (its clock when it asked for the lease): with its pid and host, its documents'
        self.since: float | None = None
        #: monotonic time of the last successful write of the lease
        self.renewed: float | None = None
        self.lost: str | None = None
        #: the last renewal's failure (said when the lease is counted lost)
        self.failure: str | None = None
        self._io = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the store ------------------------------------------------------------------------------------

    def _stores(self):
        from slotctl.store.config import split_url
        from slotctl.store.s3 import S3_STORE

        store, key = S3_STORE.bucket(self.url)
        cond = getattr(self, "_cond", None)
        if cond is None:
            cond = self._cond = S3_STORE.config.store(split_url(self.url)[0], conditional_put="etag")
        return store, cond, key

    def _error(self, e: Exception, action: str) -> UsageError:
        from slotctl.store.s3 import S3_STORE

        return S3_STORE.error(self.url, e, action)

    def _body(self, since: float) -> bytes:
        doc = {**_holder(self.server, self.clock() + self.ttl), "since": since, "ttl": self.ttl,
               "journal": {str(k): v for k, v in self.journal.items()}}
        return json.dumps(doc).encode()

    def _call(self, deadline: float, action: str, fn, *args, **kwargs):
        """An obstore request on the lease through the store's one home (:func:`slotctl.store.s3.call_by`):
        done by ``deadline`` (monotonic) or :class:`~slotctl.errors.StoreDown` (the request is left to itself),
        whatever the command's deadline or a store known down."""
        from slotctl.store.s3 import call_by

        return call_by(deadline, f"the lease's {self.ttl:g} s", self.url, action, fn, *args, **kwargs)

    def _read(self, deadline: float) -> tuple[dict, str | None] | None:
        import obstore
        from obstore import exceptions as obx

        store, _, key = self._stores()
        try:
            res = self._call(deadline, "GET", obstore.get, store, key)
            raw = bytes(self._call(deadline, "GET", res.bytes))
            return _parse(raw), res.meta.get("e_tag")
        except (obx.NotFoundError, FileNotFoundError):
            return None
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "GET") from None

    def _put(self, body: bytes, etag: str | None, deadline: float) -> str | None:
        """Create the lease (``etag`` None: only if absent) or replace it (only if its ETag is ``etag``), by
        ``deadline``; the new ETag. :class:`Held` when the condition fails."""
        import obstore
        from obstore import exceptions as obx

        store, cond, key = self._stores()
        try:
            if etag is None:
                res = self._call(deadline, "PUT", obstore.put, store, key, body, mode="create", use_multipart=False)
            else:
                res = self._call(deadline, "PUT", obstore.put, cond, key, body, mode={"e_tag": etag},
                                 use_multipart=False)
        except (obx.AlreadyExistsError, obx.PreconditionError):
            raise Held(f"{self.server}: another {self.who} took the lease {self.url} first") from None
        except Exception as e:  # noqa: BLE001
            if "412" in str(e) or "PreconditionFailed" in str(e):
                raise Held(f"{self.server}: another {self.who} took the lease {self.url} first") from None
            raise self._error(e, "PUT") from None
        return res.get("e_tag")

    # -- holding ----------------------------------------------------------------------------------------

    def acquire(self) -> "Lease":
        """Take the lease: create it, or take it over once the holder's ``expires`` has passed. :class:`Held`
        (exit 2) while another keeper's lease holds."""
        from slotctl.catalog import iso_time

        self.since = self.clock()
        deadline = time.monotonic() + self.ttl      # taking the lease: its requests within one lease
        got = self._read(deadline)
        made = time.monotonic()      # the document's expires counts from no earlier than this
        if got is None:
            self.etag = self._put(self._body(self.since), None, deadline)
        else:
            doc, etag = got
            expires = doc.get("expires")
            now = self.clock()
            if isinstance(expires, (int, float)) and expires > now and doc.get("released") is not True:
                raise Held(f"{self.server}: another {self.who} {self.does} "
                           f"({_describe(doc)}; its lease {self.url} holds until {iso_time(expires)}, "
                           f"{expires - now:.0f} s from now)")
            self.journal = _journal_entries(doc)
            made = time.monotonic()
            self.etag = self._put(self._body(self.since), etag, deadline)
        self.renewed = made
        return self

    def deadline(self) -> float:
        """The monotonic time by which the lease must be renewed, or counted lost: :data:`HOLD` of the lease
        after the last renewal's document was made (its ``expires`` counts from then), so the holder stops
        writing before anyone may take over, with the rest of the lease to spare (clock skew, the time
        stopping takes)."""
        return (self.renewed if self.renewed is not None else -math.inf) + HOLD * self.ttl

    def renew(self) -> None:
        """Write the lease again (a new ``expires``, the journal), on condition that it is still ours. The
        request goes through the store's one home and is given up (StoreDown) :data:`RENEW` of the lease from
        now or at :meth:`deadline`, whichever is first, so a stalled store holds a renewal no longer than the
        lease holds and leaves time for another try; then :class:`Lost` once the deadline has passed."""
        with self._io:
            self.check()
            made = time.monotonic()
            deadline = min(made + self.ttl * RENEW, self.deadline())
            try:
                try:
                    self.etag = self._put(self._body(self.since), self.etag, deadline)
                except Held:
                    self.etag = self._landed_late(deadline)
                    self.etag = self._put(self._body(self.since), self.etag, deadline)
            except Held:
                self.lost = f"{self.url}: another {self.who} took the lease over: this {self.who} stops writing"
                raise Lost(self.lost) from None
            except SlotctlError as e:
                self.failure = str(e)
                self.check()
                raise
            self.renewed, self.failure = made, None

    def _landed_late(self, deadline: float) -> str:
        """The lease's ETag when the lease is still this keeper's though not of the ETag it knows: a renewal
        given up at its deadline reached the store after all (it holds this process's ``pid``, ``host`` and
        ``since``, not released). :class:`Held` when another keeper's lease is there."""
        got = self._read(deadline)
        if got is not None and got[1]:
            doc, etag = got
            if self._ours(doc):
                return etag
        raise Held(f"{self.server}: another {self.who} took the lease {self.url}")

    def check(self) -> None:
        if self.lost:
            raise Lost(self.lost)
        if time.monotonic() >= self.deadline():
            why = f": {self.failure}" if self.failure else ""
            self.lost = (f"{self.url}: the lease was not renewed within {HOLD * self.ttl:g} s of its {self.ttl:g} "
                         f"(the store did not answer{why}): this {self.who} stops writing")
            raise Lost(self.lost)

    def _write_journal(self) -> None:
        self.renew()

    # -- one writer per store ---------------------------------------------------------------------------

    def write_until(self, url: str) -> float:
        """The check every write under the prefix goes through (:mod:`slotctl.store.guard`): the time (Unix
        seconds) by which the write must reach the store, the end of the lease's hold (its :meth:`deadline`
        on this host's clock); :class:`Lost` when the lease is not this process's to show: never taken, given
        up, not renewed in time, or taken over, which the lease object's version says (a ``HEAD``: its ETag
        is the one last written, or a ``GET`` finds this process's document, a renewal that landed but is
        not known yet); a store that does not answer within the hold: the error, nothing written."""
        if self.lost:
            raise Lost(f"{url}: not written: {self.lost}")
        if self.etag is None or self.renewed is None:
            raise Lost(f"{url}: not written: this {self.who} does not hold the lease {self.url} "
                       f"({'not taken yet' if self.renewed is None else 'released'})", code="no_lease")
        self.check()
        import obstore
        from obstore import exceptions as obx

        store, _, key = self._stores()
        known = self.etag
        try:
            meta = self._call(self.deadline(), "HEAD", obstore.head, store, key)
        except (obx.NotFoundError, FileNotFoundError):
            meta = {}
        except SlotctlError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "HEAD") from None
        if meta.get("e_tag") != known:
            got = self._read(self.deadline())
            if got is None or not self._ours(got[0]):
                self.lost = (f"{self.url}: another {self.who} took the lease over (its version changed): this "
                             f"{self.who} stops writing")
                raise Lost(self.lost)
        self.check()
        return time.time() + (self.deadline() - time.monotonic())

    def _ours(self, doc: dict) -> bool:
        """Whether a lease document is this process's own, still held (not released)."""
        return ((doc.get("pid"), doc.get("host"), doc.get("since")) == (os.getpid(), socket.gethostname(), self.since)
                and not doc.get("released"))

    def guard_writes(self) -> "Lease":
        """From now on, this process's writes under the prefix go through :meth:`write_until`."""
        from slotctl.store.guard import guard

        guard(self.url, self.prefix, self.write_until)
        return self

    def start(self, on_lost: Callable[[Exception], None]) -> None:
        """Renew every :data:`RENEW` of the lease on a thread until :meth:`release`; after a failure, again
        within :data:`RETRY` seconds (a twentieth of the lease when that is shorter) while the lease holds,
        so a renewal is tried as often as the store lets it before the :meth:`deadline`, never first at it;
        ``on_lost(error)`` once when the lease is lost (taken over, or not renewed by its deadline)."""

        def loop() -> None:
            while True:
                pause = self.ttl * RENEW if self.failure is None else min(RETRY, self.ttl / 20)
                if self._stop.wait(min(pause, max(0.0, self.deadline() - time.monotonic()))):
                    return
                try:
                    self.renew()
                except Lost as e:
                    on_lost(e)
                    return
                except SlotctlError:
                    try:
                        self.check()
                    except Lost as e:
                        on_lost(e)
                        return

        self._thread = threading.Thread(target=loop, name="slotctl-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing; mark the lease released (conditionally: only if it is still ours), so the next
        keeper need not wait for its expiry."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, self.deadline() - time.monotonic()))
        if self.lost or self.etag is None or self._thread is not None and self._thread.is_alive():
            return
        with self._io:
            doc = json.loads(self._body(self.since))
            doc.update(released=True, expires=self.clock())
            try:
                self._put(json.dumps(doc).encode(), self.etag,
                          min(time.monotonic() + self.ttl * RENEW, self.deadline()))
            except SlotctlError:
                pass     # it expires by itself
            self.etag = None
        self.unguard()

    def unguard(self) -> None:
        """This process's writes under the prefix are no longer this lease's to check (it was released)."""
        from slotctl.store.guard import unguard

        unguard(self.url)


def acquire(store: str | os.PathLike, server: str, *, ttl: float = DEFAULT_TTL, role: str = "keep") -> Lock:
    """The lock of ``server`` (a normalized URL) in ``store`` (a directory or an ``s3://`` prefix), held by
    ``role`` (``keep`` or ``serve``: each has its own, so a keep and a serve of one server may share a store)."""
    s = os.fspath(store)
    if s.startswith("s3://"):
        # its writes are guarded from now on: until the lease is taken (the store down: serve runs without
        # it, and takes it later) nothing is written under the prefix
        return Lease(s, server, ttl, role=role).guard_writes().acquire()
    if not Path(s).is_dir():
        raise UsageError(f"{s}: not a directory")
    return DirectoryLock(s, server, role).acquire()
