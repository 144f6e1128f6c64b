"""systemd: the ``NOTIFY_SOCKET`` protocol and the unit files shipped with slotctl (docs/fleet.md,
"Under systemd").

:func:`notify` sends one datagram of ``KEY=VALUE`` lines to the unix socket systemd names in
``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace), as sd_notify(3) does, with the standard
library's ``socket``; without ``NOTIFY_SOCKET`` it does nothing. A ``Type=notify`` service says ``READY=1``
once it works, ``STOPPING=1`` when it begins to stop, ``STATUS=...`` for ``systemctl status``; with
``WatchdogSec=`` systemd sets ``WATCHDOG_USEC`` and expects ``WATCHDOG=1`` at least that often
(:class:`Watchdog`: only while the process's own loop shows signs of life).

The units are package data (``slotctl/unattended/units/``), printed by ``slotctl unit NAME``
(:func:`unit_text`) for the install it runs from: ``ExecStart=`` names that install's interpreter by its
absolute path (a venv's or pipx's ``bin/python``, never resolved to the system's, which would lose the venv),
since systemd's default ``PATH`` holds no venv; ``User=`` the user given (:data:`DEFAULT_USER`), whom the unit's
own comment says how to make. :func:`notes` says what would keep such a unit from starting on this machine.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import threading
from importlib import resources

from slotctl.errors import UsageError

UNITS = {"keep": "slotctl-keep@.service", "serve": "slotctl-serve@.service"}
#: the user a unit runs as unless another is given: the one llama-server runs as in the layout the docs show
#: (its slot directory and a directory store under /var/lib/llama)
DEFAULT_USER = "llama"
#: what systemd (and useradd) take as a user name
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
#: the command that makes :data:`DEFAULT_USER`'s like, as the units' comments give it
USERADD = "sudo useradd --system --user-group --home-dir /var/lib/llama --create-home --shell /usr/sbin/nologin"


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


def interpreter() -> str:
    """This process's interpreter, by the absolute path it was started as (a venv's ``bin/python`` stays the
    venv's: its symbolic link is not followed). A usage error when Python does not say."""
    import sys

    if not sys.executable or not os.path.isabs(sys.executable):
        raise UsageError("the path of this Python is not known: the unit's ExecStart cannot name it")
    return sys.executable


def exec_word(path: str) -> str:
    """``path`` as the first word of an ``ExecStart=`` line: a specifier's ``%`` doubled, quoted when it
    holds a space. A path with a quote, a backslash, a ``$``, a control character or a line break is refused
    (systemd would read it otherwise)."""
    if any(c in path for c in "\"'$") or any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise UsageError(f"{path!r}: a path with quotes, backslashes, $ or control characters cannot be a unit's "
                         "ExecStart: install slotctl under a plain path (python3 -m venv /opt/slotctl)")
    word = path.replace("%", "%%")
    return f'"{word}"' if " " in word else word


def check_user(user: str) -> str:
    if not (_USER_NAME.fullmatch(user) or user.isdigit() and len(user) <= 10):
        raise UsageError(f"--user {user!r}: expected a user name (lower case letters, digits, _ and -) or a uid")
    return user


def unit_text(name: str, *, python: str | None = None, user: str = DEFAULT_USER) -> str:
    """The shipped unit file for ``name`` (``keep``, ``serve``), its ``ExecStart=`` running ``python`` (this
    process's interpreter unless given) and its ``User=`` ``user``."""
    if name not in UNITS:
        raise UsageError(f"unit {name!r}: expected one of: {', '.join(UNITS)}")
    text = resources.files("slotctl.unattended").joinpath("units", UNITS[name]).read_text(encoding="utf-8")
    return (text.replace("@PYTHON@", exec_word(python or interpreter()))
            .replace("@USER@", check_user(user)))


def notes(name: str, *, python: str | None = None, user: str = DEFAULT_USER) -> list[str]:
    """What would keep the unit of ``name`` from starting on this machine, one sentence each: the user
    missing (and how to make it), the user unable to read the install (a home directory of mode 0700, as
    Debian 12 makes them), serve's extra or the s3 extra missing from the install."""
    import importlib.util
    import pwd

    python = python or interpreter()
    out = []
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, ValueError):
        out.append(f"user {user} does not exist on this machine: make it with: {USERADD} {user} (or give "
                   "--user NAME, the user llama-server runs as)")
        entry = None
    if entry is not None and entry.pw_uid != 0:
        import slotctl

        groups = set(os.getgrouplist(entry.pw_name, entry.pw_gid))
        for path in (python, os.path.dirname(os.path.abspath(slotctl.__file__))):
            blocked = _unreachable(path, entry.pw_uid, groups)
            if blocked is not None:
                where, mode, owner = blocked
                out.append(f"user {entry.pw_name} cannot read {path}: {where} is {mode} (owner {owner}): install "
                           f"slotctl where it can (sudo python3 -m venv /opt/slotctl), or give --user {owner}")
                break
    if name == "serve" and importlib.util.find_spec("aiohttp") is None:
        out.append("this install has no [serve] extra (aiohttp): serve would not start: pip install "
                   "'slotctl[serve]' into it")
    if importlib.util.find_spec("obstore") is None:
        out.append(f"this install has no [s3] extra (obstore): {name} would not start with an s3:// store: pip "
                   "install 'slotctl[s3]' into it")
    return out


def _unreachable(path: str, uid: int, gids: set[int]) -> tuple[str, str, str] | None:
    """The first directory (or the file) on ``path``, or on what its symbolic links lead to, that the user
    ``uid`` of groups ``gids`` cannot pass (``x``) or read (``r``, the file itself): (it, its mode, its
    owner); None when every one can be."""
    import pwd

    def can(st: os.stat_result, bits: int) -> bool:
        if st.st_uid == uid:
            return (st.st_mode >> 6) & bits == bits
        if st.st_gid in gids:
            return (st.st_mode >> 3) & bits == bits
        return st.st_mode & bits == bits

    for p in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
        parts = p.split(os.sep)
        for i in range(1, len(parts) + 1):
            here = os.sep.join(parts[:i]) or os.sep
            try:
                st = os.stat(here)
            except OSError:
                return None     # not ours to judge: the ExecStart check (systemd-analyze) says it
            last = i == len(parts)
            need = (4 | (1 if stat.S_ISDIR(st.st_mode) else 0)) if last else 1
            if not can(st, need):
                try:
                    owner = pwd.getpwuid(st.st_uid).pw_name
                except KeyError:
                    owner = str(st.st_uid)
                return here, stat.filemode(st.st_mode), owner
    return None
