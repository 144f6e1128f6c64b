"""systemd: the ``NOTIFY_SOCKET`` protocol and the unit files shipped with slotctl (docs/fleet.md,
"Under systemd").

:func:`notify` sends one datagram of ``KEY=VALUE`` lines to the unix socket systemd names in
``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace), as sd_notify(3) does, with the standard
library's ``socket``; without ``NOTIFY_SOCKET`` it does nothing. A ``Type=notify`` service says ``READY=1``
once it works, ``STOPPING=1`` when it begins to stop, ``STATUS=...`` for ``systemctl status``; with
``WatchdogSec=`` systemd sets ``WATCHDOG_USEC`` and expects ``WATCHDOG=1`` at least that often
(:class:`Watchdog`: only while the process's own loop shows signs of life).

The units are package data (``slotctl/unattended/units/``), printed by ``slotctl unit NAME``.
"""

from __future__ import annotations

import os
import socket
import threading
from importlib import resources

from slotctl.errors import UsageError

UNITS = {"keep": "slotctl-keep@.service", "serve": "slotctl-serve@.service"}


def notify(*lines: str) -> bool:
    """Send ``lines`` (``READY=1``, ...) to ``$NOTIFY_SOCKET``; False when there is none or it fails (a
    service manager that went away is no reason to stop working)."""
    where = os.environ.get("NOTIFY_SOCKET")
    if not where or not lines:
        return False
    address = "\0" + where[1:] if where.startswith("@") else where
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall("\n".join(lines).encode())
        return True
    except OSError:
        return False


def watchdog_seconds() -> float | None:
    """The watchdog's interval (``WATCHDOG_USEC``) when it is meant for this process (``WATCHDOG_PID``
    unset or ours), else None."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or len(usec) > 15 or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1e6


class Watchdog:
    """``WATCHDOG=1`` every half interval, on a daemon thread, while ``alive()`` says the work loop lives."""

    def __init__(self, alive, interval: float):
        self.alive, self.interval = alive, interval
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="slotctl-watchdog", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval / 2):
            if self.alive():
                notify("WATCHDOG=1")

    def start(self) -> "Watchdog":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


def unit_text(name: str) -> str:
    """The shipped unit file for ``name`` (``keep``, ``serve``)."""
    if name not in UNITS:
        raise UsageError(f"unit {name!r}: expected one of: {', '.join(UNITS)}")
    return resources.files("slotctl.unattended").joinpath("units", UNITS[name]).read_text(encoding="utf-8")
