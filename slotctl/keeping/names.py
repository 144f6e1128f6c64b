"""The names of the working files a process has the server save, and what tells one server process from another.

A stored state's name (``slotN-MODEL-NTOKENS-TOKENS-SUM.bin``: the model's content identity and the state's
checksum in it) is :mod:`slotctl.seal`'s, read by validate and ls too; the names of earlier releases are read
there as well.

A working file is what a process has the server save into its ``--slot-save-path`` before it checks and
stores it (or reads it to learn the server's flags, converts a state into it, or places a stored state there
to restore it): ``ROLE-slotN-WHAT-PID-NONCE.bin`` (:func:`work_name`), private to the process (its pid, and a
nonce of its machine's tag and a random word: two processes of one server never share one, and no one else
guesses it), never touched by prune (:data:`WORK_GLOBS`), and removed by the next keep or serve of its role
to start once its process is gone (:func:`leftover`: the working file, the temporary file of an atomic write
to it, a staging directory), at once when the name says its process ran on this machine.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

#: the /v1/models meta keys a server reports of its model (llama_model_n_vocab, n_embd, n_params, size,
#: n_ctx_train): part of what tells one server process from another (:func:`server_identity`), never the model's
#: identity (:mod:`slotctl.live.identity`: its content)
IDENTITY_KEYS = ("n_vocab", "n_embd", "n_params", "size", "n_ctx_train")

#: the roles that have the server save working files (their lock roles: slotctl.unattended.lock.ROLES)
ROLES = ("keep", "serve")
#: a working file's name (:func:`work_name`); ``what``: incoming (a save to store), probe (a save to learn
#: the server's flags from), converted (a stored state converted for the server, to restore), placed (a stored
#: state copied or downloaded into the slot directory, to restore)
WORK_NAME = "{role}-slot{slot}-{what}-{pid}-{nonce}.bin"
WORKS = ("incoming", "probe", "converted", "placed")
#: every process's working files, whatever its role or pid (prune's pins: never touched)
WORK_GLOBS = tuple(f"{role}-slot*.bin" for role in ROLES)
_WORK = re.compile(r"(keep|serve)-slot\d+-(?:incoming|probe|converted|placed)-(\d+)-([0-9a-f]+)\.bin")
#: what a killed process may leave of a working file: the file, an atomic write's temporary file
#: (:func:`slotctl.atomic.private_name`), a staging directory
_LEFT = re.compile(r"(?:\.((?:keep|serve)-slot\d+-(?:converted|placed)-\d+-[0-9a-f]+\.bin)\.slotctl-[^./]+\.tmp"
                   r"|\.(keep|serve)-slot\d+-staging-(\d+)-([0-9a-f]+))")
#: hex digits of a machine's tag at the head of a working name's nonce
HOST_DIGITS = 8


def server_identity(facts) -> dict:
    """What tells this server process's model and shape apart from another's (keep's restart, the view)."""
    meta = facts.model_meta or {}
    return {"model_path": facts.model_path, "build_info": facts.build_info, "total_slots": facts.total_slots,
            "n_ctx_slot": facts.n_ctx_slot, **{k: meta.get(k) for k in IDENTITY_KEYS}}


def work_name(role: str, slot: int, what: str, nonce: str | None = None) -> str:
    """A working name of this process's own for ``what`` (:data:`WORKS`) of ``slot``; its nonce is this machine's
    tag (:func:`host_tag`) and 8 random bytes."""
    import secrets

    if role not in ROLES or what not in WORKS:
        raise ValueError(f"working file {role!r}/{what!r}: expected one of {ROLES} and {WORKS}")
    return WORK_NAME.format(role=role, slot=slot, what=what, pid=os.getpid(),
                            nonce=nonce or host_tag() + secrets.token_hex(8))


def discard(path: str | os.PathLike) -> None:
    """A working file removed (gone already: nothing to do)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def staging_name(role: str, slot: int) -> str:
    """The name of a directory of this process's own in the slot directory, where a stored state is downloaded
    to be converted: ``.ROLE-slotN-staging-PID-NONCE`` (swept as a working file is: :func:`leftover`)."""
    import secrets

    if role not in ROLES:
        raise ValueError(f"staging directory {role!r}: expected one of {ROLES}")
    return f".{role}-slot{slot}-staging-{os.getpid()}-{host_tag()}{secrets.token_hex(8)}"


def host_tag() -> str:
    """This machine's tag in working names: a hash of its host name (a container's own), so that a process
    knows whether a working file's pid is one of this machine's."""
    import socket

    global _HOST
    if _HOST is None:
        _HOST = hashlib.sha256(socket.gethostname().encode("utf-8", "surrogateescape")).hexdigest()[:HOST_DIGITS]
    return _HOST


_HOST: str | None = None


def own_works(role: str) -> str:
    """The glob of this process's own working files (``role``'s)."""
    return f"{role}-slot*-*-{os.getpid()}-*.bin"


def work_owner(name: str) -> tuple[str, int] | None:
    """The role and pid of the process whose working file ``name`` is; None for any other name."""
    m = _WORK.fullmatch(name)
    return (m[1], int(m[2])) if m else None


@dataclass(frozen=True)
class Leftover:
    """What a directory entry is of a process's working files (:func:`leftover`): its role and pid, the tag of
    the machine it ran on (None: a name of the previous release, which has none), and whether it is a staging
    directory."""

    role: str
    pid: int
    host: str | None
    directory: bool = False


def leftover(name: str) -> Leftover | None:
    """Whose working file, atomic write's temporary file or staging directory the entry ``name`` is; None for
    any other name."""
    m = _WORK.fullmatch(name)
    if m is None and (t := _LEFT.fullmatch(name)) is not None:
        if t[1] is not None:
            m = _WORK.fullmatch(t[1])
        else:
            return Leftover(t[2], int(t[3]), _host_of(t[4]), True)
    if m is None:
        return None
    return Leftover(m[1], int(m[2]), _host_of(m[3]))


def _host_of(nonce: str) -> str | None:
    return nonce[:HOST_DIGITS] if len(nonce) > 2 * HOST_DIGITS else None
