"""The process around a long-running command's work (``keep``'s loop, ``serve``'s proxy): one shell for both
(docs/fleet.md, "Running unattended").

What it holds, from start to exit: the lock of the server and store (:mod:`slotctl.unattended.lock`: a
``flock`` in a directory store, a lease object in ``s3://``, renewed on a thread of its own, the work told
when it is lost; with ``wait_for_store`` an ``s3://`` store that does not answer at start leaves the process
running without its lease, which is taken once the store answers), the metrics endpoint (``/metrics``,
``/livez``, ``/readyz``, and a ``/ui`` page when given: :class:`slotctl.unattended.metrics.Endpoint`, the store
probed for ``/readyz``), systemd's notify protocol (``READY=1`` once working, ``STOPPING=1`` at SIGTERM or
SIGINT, the watchdog's ``WATCHDOG=1`` while the work shows signs of life: :mod:`slotctl.unattended.systemd`),
and on exit, whatever happens, the watchdog and endpoint stopped and the lock released.

The work is the command's: it says what it is (``role``, its lock's), where it stores (``store``), what it
keeps (``server``: the normalized URL, and for a router the model), how to say an event (``log``) and whether
it lives (``alive``).
"""

from __future__ import annotations

import os
import threading
from typing import Callable

from slotctl.errors import SlotctlError
from slotctl.unattended import lock as locks
from slotctl.unattended import systemd


class Shell:
    """The shell of one long-running process (see the module docstring): use it as a context manager (its
    exit stops what it started and releases the lock)."""

    def __init__(self, role: str, store: str | os.PathLike, server: str, *, ttl: float | None = None,
                 log: Callable[..., None] | None = None):
        self.role, self.where, self.server = role, os.fspath(store), server
        self.ttl = ttl or locks.DEFAULT_TTL
        self.log = log or (lambda event, message, **details: None)
        #: the lock held (None: not taken yet, the store did not answer: :meth:`lock`)
        self.held: locks.Lock | None = None
        #: why the lock could not be taken at start (``wait_for_store``)
        self.unlocked: Exception | None = None
        #: the lock lost (a lease not renewed in time, another holder): the work stops
        self.lost: list[Exception] = []
        self.endpoint = None
        self.watchdog: systemd.Watchdog | None = None
        self._quit = threading.Event()

    # -- the lock --------------------------------------------------------------------------------------

    def lock(self, *, wait_for_store: bool = False) -> locks.Lock | None:
        """The lock of the server and store taken for the role (:func:`slotctl.unattended.lock.acquire`);
        another holder is :class:`~slotctl.unattended.lock.Held` (exit 2). ``wait_for_store``: an ``s3://``
        store that does not answer leaves it untaken (None; :attr:`unlocked` says why): the process works
        meanwhile and takes it once the store answers (:meth:`take_later`)."""
        try:
            self.held = locks.acquire(self.where, self.server, ttl=self.ttl, role=self.role)
        except locks.Held:
            raise
        except SlotctlError as e:
            if not (wait_for_store and self.where.startswith("s3://")):
                raise
            self.held, self.unlocked = None, e
        return self.held

    def keep_lease(self, on_lost: Callable[[Exception], None]) -> None:
        """A lease renewed on a thread of its own until it is released; ``on_lost(e)`` when it is lost (the
        lost lock is noted first: :attr:`lost`). Nothing to renew for a directory's lock."""
        if isinstance(self.held, locks.Lease):
            self.held.start(self._losing(on_lost))

    def _losing(self, on_lost: Callable[[Exception], None]) -> Callable[[Exception], None]:
        def lost(e: Exception) -> None:
            self.lost.append(e)
            on_lost(e)

        return lost

    def take_later(self, on_lost: Callable[[Exception], None], on_taken: Callable[[], None] | None = None) -> None:
        """The lease not taken at start (:meth:`lock`), or lost (serve takes it back): tried every third of it on
        a daemon thread until it is taken (a ``locked`` event, ``on_taken()``, then renewed as usual) or the
        process stops; another holder by then is the lock lost (``on_lost``)."""
        losing = self._losing(on_lost)

        def take() -> None:
            while not self._quit.wait(self.ttl / 3):
                try:
                    got = locks.acquire(self.where, self.server, ttl=self.ttl, role=self.role)
                except locks.Held as e:
                    losing(e)
                    return
                except SlotctlError:
                    continue
                self.held = got
                self.log("locked", f"{got.path}: the lease is taken", path=got.path)
                if on_taken is not None:
                    on_taken()
                got.start(losing)
                return

        threading.Thread(target=take, name="slotctl-lease-take", daemon=True).start()

    # -- health and systemd ----------------------------------------------------------------------------

    def serve_metrics(self, listen: str, exposition: Callable[[], str], ready: Callable[[], tuple[bool, list[str]]],
                      alive: Callable[[], tuple[bool, str]], *, option: str = "--listen",
                      ui: Callable[[], str] | None = None):
        """``/metrics``, ``/livez``, ``/readyz`` (and ``/ui``) served on ``listen`` from now on
        (:class:`slotctl.unattended.metrics.Endpoint`; ``option``: the flag that gave the address, for its
        error); the endpoint."""
        from slotctl.unattended.metrics import Endpoint

        self.endpoint = Endpoint(listen, exposition, ready, alive, ui=ui, option=option).start()
        return self.endpoint

    def arm_watchdog(self, alive: Callable[[], bool]) -> None:
        """systemd's watchdog (``WatchdogSec=``: ``WATCHDOG_USEC``) made, pinged while ``alive()``; its pings
        begin with :meth:`ready` (a ping before ``READY=1`` would precede it)."""
        seconds = systemd.watchdog_seconds()
        if seconds is not None:
            self.watchdog = systemd.Watchdog(alive, seconds)

    def start_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.start()

    def ready(self, status: str) -> None:
        """``READY=1`` (and ``STATUS=status``) said to systemd, the watchdog's pings begun."""
        systemd.notify("READY=1", f"STATUS={status}")
        self.start_watchdog()

    @staticmethod
    def stopping() -> None:
        """``STOPPING=1`` said to systemd."""
        systemd.notify("STOPPING=1")

    def on_signals(self, stop: Callable[[], None], loop=None) -> None:
        """SIGTERM and SIGINT: ``STOPPING=1``, then ``stop()`` (in the process's main thread; ``loop``: an
        asyncio loop whose handler it is). Without a loop ``stop`` runs in a signal handler, between two
        bytecodes of the main thread: it must take no lock that thread may hold (a ``threading.Event`` it waits
        on among them: :mod:`slotctl.unattended.stopping`)."""
        import signal

        def stopping(*_args) -> None:
            self.stopping()
            stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            if loop is not None:
                loop.add_signal_handler(sig, stopping)
            else:
                signal.signal(sig, stopping)

    # -- exit ------------------------------------------------------------------------------------------

    def __enter__(self) -> "Shell":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def close(self) -> None:
        """The watchdog and the endpoint stopped, the lease no longer taken, the lock released."""
        self._quit.set()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.endpoint is not None:
            self.endpoint.stop()
        if self.held is not None:
            self.held.release()


def count_store(metrics, store) -> None:
    """The store's states counted into ``metrics`` (its objects and bytes: ``metrics.store_usage``); a store
    that does not answer is said to the metrics when they take it (``store_failed``), else counted at the next
    state (``/readyz`` says why the store fails)."""
    try:
        metrics.store_usage(*store.usage())
    except Exception as e:  # noqa: BLE001 - a count that fails never stops the work
        failed = getattr(metrics, "store_failed", None)
        if failed is not None:
            failed(str(e))
