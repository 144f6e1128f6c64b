"""The names of the working files a process has the server save, and what tells one server process from another.

A stored state's name (``slotN-MODEL-NTOKENS-TOKENS-SUM.bin``: the model's content identity and the state's
checksum in it) is :mod:`slotctl.seal`'s, read by validate and ls too; the names of earlier releases are read
there as well.

A working file is what a process has the server save into its ``--slot-save-path`` before it checks and
stores it (or reads it to learn the server's flags, or converts a state into it to restore):
``ROLE-slotN-WHAT-PID-NONCE.bin`` (:func:`work_name`), private to the process (its pid and a random word:
two processes of one server never share one), never touched by prune (:data:`WORK_GLOBS`), and removed by
the next keep to start once its process is gone (:func:`work_owner`).
"""

from __future__ import annotations

import os
import re

#: the /v1/models meta keys a server reports of its model (llama_model_n_vocab, n_embd, n_params, size,
#: n_ctx_train): part of what tells one server process from another (:func:`server_identity`), never the model's
#: identity (:mod:`slotctl.live.identity`: its content)
IDENTITY_KEYS = ("n_vocab", "n_embd", "n_params", "size", "n_ctx_train")

#: the roles that have the server save working files (their lock roles: slotctl.unattended.lock.ROLES)
ROLES = ("keep", "serve")
#: a working file's name (:func:`work_name`); ``what``: incoming (a save to store), probe (a save to learn
#: the server's flags from), converted (a stored state converted for the server, to restore)
WORK_NAME = "{role}-slot{slot}-{what}-{pid}-{nonce}.bin"
WORKS = ("incoming", "probe", "converted")
#: every process's working files, whatever its role or pid (prune's pins: never touched)
WORK_GLOBS = tuple(f"{role}-slot*.bin" for role in ROLES)
_WORK = re.compile(r"(keep|serve)-slot\d+-(?:incoming|probe|converted)-(\d+)-[0-9a-f]+\.bin")


def server_identity(facts) -> dict:
    """What tells this server process's model and shape apart from another's (keep's restart, the view)."""
    meta = facts.model_meta or {}
    return {"model_path": facts.model_path, "build_info": facts.build_info, "total_slots": facts.total_slots,
            "n_ctx_slot": facts.n_ctx_slot, **{k: meta.get(k) for k in IDENTITY_KEYS}}


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
