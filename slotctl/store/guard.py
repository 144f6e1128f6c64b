"""One writer per store: the writes to an ``s3://`` prefix that a lease guards (docs/fleet.md, "One keeper per
server and store").

A process that holds a store's lease (:class:`slotctl.unattended.lock.Lease`: keep's, serve's) registers it
here for the store's prefix when it asks for it (:func:`guard`), and every write this process makes under that
prefix goes through :func:`write_until` first: a put (:func:`slotctl.store.s3copy.upload_parts`, through
``cp``'s upload and the fleet's stores), a server-side copy (:func:`slotctl.store.s3copy.copy_object`) and a
delete (:meth:`slotctl.store.s3.S3.delete`: prune's too). The guard answers the time (Unix seconds, whole)
by which the write must reach the store, or raises when the lease cannot be shown live (never taken, lost,
taken over: the lease object's version says). The write is then signed to expire at that time
(``X-Amz-Expires``): the store itself refuses it later, so a writer stalled after its check (SIGSTOP, a
pause of the whole machine) and woken after another took the lease over writes nothing. What makes an
object visible is always one small request sent whole (a ``DELETE``, a ``CompleteMultipartUpload``), so no
part of it waits in this process while its expiry passes.

Nothing is guarded unless a lease asked: ``cp`` and every command but keep and serve write as before.
"""

from __future__ import annotations

import threading
from typing import Callable

#: the guards: the lease's own URL -> (the prefix it guards, its check)
_GUARDS: dict[str, tuple[str, Callable[[str], float]]] = {}
_LOCK = threading.Lock()


def guard(key: str, prefix: str, check: Callable[[str], float]) -> None:
    """From now on, every write of this process under ``prefix`` (an ``s3://`` URL) asks ``check(url)`` first:
    the time (Unix seconds) by which the write must reach the store, or an exception (it is not written).
    ``key`` names the guard (a lease's URL): a guard of the same key replaces it."""
    with _LOCK:
        _GUARDS[key] = (prefix.rstrip("/") + "/", check)


def unguard(key: str) -> None:
    with _LOCK:
        _GUARDS.pop(key, None)


def write_until(url: str) -> int | None:
    """None when no lease guards ``url``; else the whole second (Unix time) by which a write to ``url`` must
    reach the store (the earliest of its guards', rounded down), or the guard's exception."""
    with _LOCK:
        checks = [check for prefix, check in _GUARDS.values() if url.startswith(prefix)]
    if not checks:
        return None
    import math

    return min(math.floor(check(url)) for check in checks)
