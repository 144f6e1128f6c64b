"""The names of kept states and of the working files, one scheme for keep and serve.

A stored state is ``slotN-MODEL-NTOKENS-TOKENS.bin`` (:func:`state_name`): the slot it was saved from (keep
gives it back to that slot after a restart; serve restores it into any), a hash of the model as the server
reports it (:func:`model_hash`: a state is offered only to a server running the model that made it), its
token count (seven digits at least: names of one slot and model sort by length) and a hash of its tokens (one
state stored once). The previous release's names are still read (:func:`parse_name`): keep's
``slotN-MODEL-TOKENS.bin`` (by keep, the fleet view and serve) and serve's ``serve-MODEL-NTOKENS-TOKENS.bin``
(by serve, which gave no slot).

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

import numpy as np

#: the /v1/models meta keys that tell two models apart (llama_model_n_vocab, n_embd, n_params, size, n_ctx_train)
IDENTITY_KEYS = ("n_vocab", "n_embd", "n_params", "size", "n_ctx_train")

#: a stored state's name (:func:`state_name`)
STATE_NAME = "slot{slot}-{model}-{n:07d}-{tokens}.bin"
#: the names this scheme reads: this release's, then keep's and serve's of the previous one
_NEW = re.compile(r"slot(\d{1,9})-([0-9a-zA-Z]+)-(\d{7,})-([0-9a-f]{16})\.bin")
_OLD_KEEP = re.compile(r"slot(\d{1,9})-([0-9a-zA-Z]+)-(.+)\.bin")
_OLD_SERVE = re.compile(r"serve-([0-9a-zA-Z]+)-(\d+)-([0-9a-f]+)\.bin")

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


def model_hash(facts) -> str:
    """A short hash of the model as the server reports it (``/v1/models`` meta; the model's file name when
    the server does not answer it): part of each stored state's name, so a state is offered only to a server
    running the model that made it. ``facts``: :class:`slotctl.live.http.ServerFacts`."""
    meta = facts.model_meta or {}
    ident = [meta.get(k) for k in IDENTITY_KEYS]
    if all(v is None for v in ident):
        ident = [os.path.basename(facts.model_path or "")]
    return hashlib.sha256(repr(ident).encode()).hexdigest()[:8]


def server_identity(facts) -> dict:
    """What tells this server process's model and shape apart from another's (keep's restart, the view)."""
    meta = facts.model_meta or {}
    return {"model_path": facts.model_path, "build_info": facts.build_info, "total_slots": facts.total_slots,
            "n_ctx_slot": facts.n_ctx_slot, **{k: meta.get(k) for k in IDENTITY_KEYS}}


def tokens_hash(tokens) -> str:
    """A short hash of a slot's tokens (as little-endian int32)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()[:16]


def state_name(slot: int, model: str, tokens) -> str:
    """The name a state of ``tokens`` saved from ``slot`` of a server running the model ``model``
    (:func:`model_hash`) is stored under."""
    return STATE_NAME.format(slot=slot, model=model, n=len(tokens), tokens=tokens_hash(tokens))


def slot_prefix(slot: int, model: str) -> str:
    """What the names of ``slot``'s states for ``model`` begin with (this scheme's and keep's old one)."""
    return f"slot{slot}-{model}-"


@dataclass(frozen=True)
class StateName:
    """What a state's name says: the slot it was saved from (None: serve's old names), the model's hash, its
    token count (None: keep's old names) and its tokens' hash (as the name has it)."""

    slot: int | None
    model: str
    n_tokens: int | None
    tokens: str


def parse_name(name: str) -> StateName | None:
    """What the stored state's ``name`` says (:class:`StateName`); None for a name of no scheme read."""
    if m := _NEW.fullmatch(name):
        return StateName(int(m[1]), m[2], int(m[3]), m[4])
    if m := _OLD_SERVE.fullmatch(name):
        return StateName(None, m[1], int(m[2]), m[3])
    if m := _OLD_KEEP.fullmatch(name):
        return StateName(int(m[1]), m[2], None, m[3])
    return None


def of_model(name: str, model: str) -> bool:
    """Whether ``name`` is a stored state of the model ``model`` (:func:`model_hash`), of any slot."""
    said = parse_name(name)
    return said is not None and said.model == model


def work_name(role: str, slot: int, what: str, nonce: str | None = None) -> str:
    """A working name of this process's own for ``what`` (:data:`WORKS`) of ``slot``; its nonce is this machine's
    tag (:func:`host_tag`) and 8 random bytes."""
    import secrets

    if role not in ROLES or what not in WORKS:
        raise ValueError(f"working file {role!r}/{what!r}: expected one of {ROLES} and {WORKS}")
    return WORK_NAME.format(role=role, slot=slot, what=what, pid=os.getpid(),
                            nonce=nonce or host_tag() + secrets.token_hex(8))


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
