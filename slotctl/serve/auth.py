"""Whose requests serve caches: a client the server accepts (docs/serve.md, "API keys").

Nothing happens for a client the server would refuse: before serve chooses a slot, restores or saves for a
request, the client's key must be one the server accepts (:class:`Keys`); a request without one passes to the
server untouched, and the server's ``401`` comes back. serve reads the key as llama-server b11434 does
(``server-http.cpp``, ``middleware_validate_api_key``: :func:`client_key`) and asks the server itself whether
it accepts it: serve's own ``--api-key`` is accepted as given; any other key (or none) is tried once on
``GET /props`` (answered without the server's task queue, never waking a sleeping server) and the answer kept
for a minute (:data:`KEPT`), a refusal too: a client that keeps sending a wrong key costs the server one such
request a minute, not one per request. A server seen restarting (back after serve found it down, or its
slots' task ids counting from 0 again: it may accept other keys) makes serve forget them all
(:meth:`Keys.forget`), and serve's own reads every few seconds find at once that the key they carry is
refused.

serve's own requests (the facts it reads every few seconds, ``GET /slots``) carry ``--api-key``, else the key
of the last client the server accepted (:attr:`Keys.last`): serve without a key of its own, behind a server
that wants one, does not take the server for down while its clients' requests succeed. Keys are never logged
and kept only in memory, by their SHA-256.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections import OrderedDict

#: seconds a server's answer about a key is kept
KEPT = 60.0
#: keys kept at most (the least recently asked forgotten first)
MAX_KEYS = 1024
#: the prefix llama-server strips from the Authorization header (case-sensitive, as it does)
BEARER = "Bearer "
#: what :func:`client_key` returns for a request without a key (sent as no header at all)
NO_KEY = ""


def client_key(headers) -> str:
    """The API key of a request with ``headers`` as llama-server reads it: the ``Authorization`` header (its
    ``Bearer `` prefix removed, exactly so spelled), else ``X-Api-Key``; :data:`NO_KEY` when neither is given."""
    key = headers.get("Authorization", "")
    if not key:
        key = headers.get("X-Api-Key", "")
    return key[len(BEARER):] if key.startswith(BEARER) else key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class Keys:
    """Which keys the server accepts, as it answered; ``own``: serve's ``--api-key`` (accepted as given). Safe
    from any thread."""

    def __init__(self, own: str | None = None, *, kept: float = KEPT, clock=time.monotonic):
        self.own, self.kept, self.clock = own or None, kept, clock
        self._lock = threading.Lock()
        #: SHA-256 of a key -> (accepted, when the server said so)
        self._said: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self._last: str | None = None

    @property
    def last(self) -> str | None:
        """The key serve's own requests carry: ``--api-key``, else the last client key the server accepted
        (None: none yet)."""
        with self._lock:
            return self.own or self._last

    def known(self, key: str) -> bool | None:
        """Whether the server accepts ``key`` (a client's: :func:`client_key`), as last said; None when not
        known (never asked, or asked more than :attr:`kept` seconds ago)."""
        if self.own is not None and key and hmac.compare_digest(key.encode("utf-8", "surrogateescape"),
                                                                self.own.encode("utf-8", "surrogateescape")):
            return True
        d = _digest(key)
        with self._lock:
            said = self._said.get(d)
            if said is None:
                return None
            if self.clock() - said[1] > self.kept:
                del self._said[d]
                return None
            self._said.move_to_end(d)
            if said[0] and key:
                self._last = key
            return said[0]

    def said(self, key: str, accepted: bool) -> None:
        """The server's answer about ``key``: accepted (a request with it answered) or refused (its 401)."""
        d = _digest(key)
        with self._lock:
            self._said[d] = (accepted, self.clock())
            self._said.move_to_end(d)
            while len(self._said) > MAX_KEYS:
                self._said.popitem(last=False)
            if accepted and key:
                self._last = key
            elif not accepted and self._last == key:
                self._last = None

    def forget(self) -> None:
        """Everything the server said forgotten (it restarted: its keys may be others)."""
        with self._lock:
            self._said.clear()
