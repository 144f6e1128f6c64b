"""The names of kept states and of the working files, one scheme for keep and serve.

A stored state is ``slotN-MODEL-NTOKENS-TOKENS.bin`` (:func:`state_name`): the slot it was saved from (keep
gives it back to that slot after a restart; serve restores it into any), a hash of the model as the server
reports it (:func:`model_hash`: a state is offered only to a server running the model that made it), its
token count (seven digits at least: names of one slot and model sort by length) and a hash of its tokens (one
state stored once). The previous release's names are still read (:func:`parse_name`): keep's
``slotN-MODEL-TOKENS.bin`` (by keep, the fleet view and serve) and serve's ``serve-MODEL-NTOKENS-TOKENS.bin``
(by serve, which gave no slot).

A working file is what a process has the server save into its ``--slot-save-path`` before it checks and
stores it (or reads it to learn the server's flags, or converts a state into it to restore):
``ROLE-slotN-WHAT-PID-NONCE.bin`` (:func:`work_name`), private to the process (its pid and a random word:
two processes of one server never share one), never touched by prune (:data:`WORK_GLOBS`), and removed by
the next keep to start once its process is gone (:func:`work_owner`).
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
#: the server's flags from), converted (a stored state converted for the server, to restore)
WORK_NAME = "{role}-slot{slot}-{what}-{pid}-{nonce}.bin"
WORKS = ("incoming", "probe", "converted")
#: every process's working files, whatever its role or pid (prune's pins: never touched)
WORK_GLOBS = tuple(f"{role}-slot*.bin" for role in ROLES)
_WORK = re.compile(r"(keep|serve)-slot\d+-(?:incoming|probe|converted)-(\d+)-[0-9a-f]+\.bin")


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
    """A working name of this process's own for ``what`` (:data:`WORKS`) of ``slot``."""
    import secrets

    if role not in ROLES or what not in WORKS:
        raise ValueError(f"working file {role!r}/{what!r}: expected one of {ROLES} and {WORKS}")
    return WORK_NAME.format(role=role, slot=slot, what=what, pid=os.getpid(), nonce=nonce or secrets.token_hex(4))


def own_works(role: str) -> str:
    """The glob of this process's own working files (``role``'s)."""
    return f"{role}-slot*-*-{os.getpid()}-*.bin"


def work_owner(name: str) -> tuple[str, int] | None:
    """The role and pid of the process whose working file ``name`` is; None for any other name."""
    m = _WORK.fullmatch(name)
    return (m[1], int(m[2])) if m else None
