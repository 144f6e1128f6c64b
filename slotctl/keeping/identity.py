"""Which model the server runs, told by its model file's content, and which stored states are that model's
(:class:`ModelIdentifier`, one per :class:`~slotctl.keeping.states.ServerStates`).

Its one reason to change: how the server's model is identified (its file hashed once per file identity, in a
thread of its own for serve, a file replaced while the server runs noticed) and what a stored state's name
must say to be the server's (:meth:`slotctl.live.identity.ServerModel.refusal`, the states found damaged).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from slotctl import seal
from slotctl.errors import UsageError
from slotctl.live import http
from slotctl.live.identity import ServerModel, Unidentified, identify
from slotctl.model.content import cached_content, file_key


class NotIdentified(UsageError):
    """The server's model is not identified by its content (yet, or at all), or a state is not its model's:
    nothing is stored for it or restored into it (:attr:`ModelIdentifier.unidentified` says why)."""

    def __init__(self, message: str, *, code: str = "model_unidentified"):
        super().__init__(message, code=code)


class ModelIdentifier:
    """The server's model as its content says, for the server whose facts it is given (:meth:`identify`).

    ``lock``: the one lock of the :class:`~slotctl.keeping.states.ServerStates` it belongs to (what is kept here
    is guarded by it). ``log(event, message, **details)`` gets the ``identified`` and ``unidentified`` events.
    ``draft_model``: the draft model's file (``-md``: no server reports it); ``background``: a model is hashed in
    a thread of its own (serve: requests go uncached meanwhile), else in the caller's (keep);
    ``progress(done, total)`` as it is hashed. ``on_identified(facts)``: called once a model hashed in the
    background is identified from ``facts`` (the caller takes them again)."""

    def __init__(self, lock, log: Callable, *, draft_model: str | os.PathLike | None = None,
                 background: bool = False, progress=None,
                 on_identified: Callable[[http.ServerFacts], None] | None = None):
        self._lock = lock
        self.log = log
        #: the server's model as its content says (:class:`slotctl.live.identity.ServerModel`; None: not
        #: identified, :attr:`unidentified` says why); ``model``: its short digest as the facts last taken said,
        #: the MODEL of its states' names (set by the owner when it takes the facts)
        self.server_model: ServerModel | None = None
        self.model: str | None = None
        self.unidentified: str | None = "the server's facts are not read yet"
        self.draft_model, self.background, self.progress = draft_model, background, progress
        self.on_identified = on_identified
        #: the model file's path and identities when it was identified; the file changed since, to other bytes,
        #: while the server has not been seen to restart (:meth:`server_restarted`)
        self._identified: tuple[str | None, tuple[str, ...]] | None = None
        self._stale = False
        self._hashing: threading.Thread | None = None
        self._said_unidentified: str | None = None
        #: the stored states whose bytes were found not to be the ones stored (their checksum): never offered again
        self._damaged: set[str] = set()

    def server_restarted(self) -> None:
        """The server was seen to start again (keep's restart, serve's view of the slots): its model is identified
        anew from its file at the next facts (a file replaced while it ran is the model it loads now)."""
        with self._lock:
            self._stale = False
            self._identified = None

    def identify(self, facts: http.ServerFacts, *, restarted: bool = False) -> str | None:
        """The short digest of the model the server ``facts`` describe runs, by its file's content
        (:func:`slotctl.live.identity.identify`: once per file identity, from the cache after); None while it is
        not identified (:attr:`unidentified` says why, an ``unidentified`` event once per reason).

        A server process's model is the one identified when it was first seen (or seen to restart): its file
        changed since to other bytes (replaced in place) leaves the model the server runs unknown, so nothing is
        stored or restored until the server is seen to start again (:meth:`server_restarted`; a file touched
        or its mode changed, the same bytes, changes nothing). In the background (serve) a model not in the
        cache is hashed in a thread of its own, meanwhile not identified."""
        if restarted:
            self.server_restarted()
        path = facts.model_path
        with self._lock:
            ident, known, stale, hashing = self.server_model, self._identified, self._stale, self._hashing
        if hashing is not None and hashing.is_alive():
            return None
        if stale:
            return None
        if ident is not None and known is not None and known[0] == path:
            if _current_keys(ident) == known[1]:
                return ident.short      # the same process, its file unchanged: one stat per file
            again = self._identified_now(facts, quiet=True)
            if again is not None and again.target.digest == ident.target.digest:
                with self._lock:
                    self._identified = (path, _recorded_keys(again))
                return ident.short      # touched, or its mode changed: the same bytes
            with self._lock:
                self.server_model, self._stale = None, True
            self._unidentified(f"the model file {path} changed since the server loaded it"
                               + (f" (its content is now model {again.short})" if again is not None else "")
                               + ": which model the server runs is not known until it is seen to start again; "
                                 "nothing is stored or restored meanwhile")
            return None
        if self.background and path and cached_content(path) is None:
            self._unidentified(f"the server's model {path} is being identified by its content (hashed once per "
                               f"file): requests go uncached meanwhile", event=False)
            t = threading.Thread(target=self._identify_behind, args=(facts,), name="slotctl-identify", daemon=True)
            with self._lock:
                self._hashing = t
            t.start()
            return None
        made = self._identified_now(facts)
        return made.short if made is not None else None

    def _identified_now(self, facts: http.ServerFacts, *, quiet: bool = False) -> ServerModel | None:
        """The model identified from ``facts`` (hashed here when the cache does not hold it), taken (unless
        ``quiet``: only asked); None when it cannot be (said)."""
        t0 = time.perf_counter()
        try:
            made = identify(facts.model_path, facts.model_meta, self.draft_model, progress=self.progress)
        except Unidentified as e:
            if not quiet:
                with self._lock:
                    self.server_model, self.model = None, None
                self._unidentified(str(e))
            return None
        if quiet:
            return made
        hashed = [c for c in (made.target, made.draft) if c is not None and not c.cached]
        with self._lock:
            self.server_model, self.unidentified = made, None
            self._identified = (facts.model_path, _recorded_keys(made))
            self._said_unidentified = None
        how = (f"hashed {sum(c.size for c in hashed) / 1e9:,.2f} GB in {time.perf_counter() - t0:.1f} s" if hashed
               else "from the cache")
        self.log("identified", f"the server's model {facts.model_path} is model {made.short} by its content ({how})"
                 + (f"; draft model {made.draft.short}" if made.draft is not None else ""),
                 model=made.target.digest, draft_model=made.draft.digest if made.draft is not None else None,
                 cached=not hashed, seconds=round(time.perf_counter() - t0, 3))
        return made

    def _identify_behind(self, facts: http.ServerFacts) -> None:
        """The background identification (serve): once the model is known, ``on_identified(facts)`` (the owner
        takes the facts again: ``model`` set there, and what a model change forgets)."""
        try:
            made = self._identified_now(facts)
        finally:
            with self._lock:
                self._hashing = None
        if made is not None and self.on_identified is not None:
            self.on_identified(facts)

    def _unidentified(self, why: str, *, event: bool = True) -> None:
        with self._lock:
            self.unidentified = why
            said, self._said_unidentified = self._said_unidentified, why
        if event and said != why:
            self.log("unidentified", why)

    def current(self, wait: float | None = None) -> ServerModel | None:
        """The server's model as identified now; ``wait``: seconds to wait first for a model being hashed in the
        background."""
        with self._lock:
            hashing = self._hashing
        if wait is not None and hashing is not None:
            hashing.join(wait)
        with self._lock:
            return self.server_model

    def refusal(self, name: str) -> str | None:
        """Why the stored state ``name`` is not for the server now running (another model, an unknown one, a draft
        state of another draft model: :meth:`slotctl.live.identity.ServerModel.refusal`; the server's model not
        identified; its bytes found damaged), or None when it is."""
        with self._lock:
            ident, damaged = self.server_model, name in self._damaged
        if damaged:
            return "its content is not the state that was stored (its checksum): never restored"
        if ident is None:
            return f"the server's model is not identified: {self.unidentified}"
        return ident.refusal(seal.parse_name(name))

    def takes(self, name: str) -> bool:
        """Whether the stored state ``name`` is this server's model's (:meth:`refusal` None)."""
        return self.refusal(name) is None

    def found_damaged(self, name: str) -> None:
        """The stored state ``name`` was found not to be the bytes stored: never offered again (:meth:`refusal`)."""
        with self._lock:
            self._damaged.add(name)

    def damaged(self) -> set[str]:
        """The stored states found damaged so far."""
        with self._lock:
            return set(self._damaged)

    def check_model(self, facts: http.ServerFacts | None) -> None:
        """:class:`NotIdentified` unless the server's model is identified and its file unchanged since (one
        ``stat`` per file): before a state is stored or restored (a file replaced meanwhile is noticed here, by
        ``facts``, the server's as last read, and its server's model is not known until it is seen to start
        again)."""
        with self._lock:
            ident, known = self.server_model, self._identified
        if ident is not None and known is not None and _current_keys(ident) == known[1]:
            return
        if ident is not None and facts is not None:
            self.identify(facts)
        with self._lock:
            if self.server_model is not None:
                return
        raise NotIdentified(f"the server's model is not identified: {self.unidentified}")


def _recorded_keys(ident: ServerModel) -> tuple[str, ...]:
    """The identities of the model files (target, then draft) as they were when their content was hashed."""
    return tuple(k for c in (ident.target, ident.draft) if c is not None for k in c.keys)


def _current_keys(ident: ServerModel) -> tuple[str, ...] | None:
    """The identities of the model files as they are now (one ``stat`` each); None when one is gone."""
    try:
        return tuple(file_key(os.stat(p)) for c in (ident.target, ident.draft) if c is not None for p in c.files)
    except OSError:
        return None
