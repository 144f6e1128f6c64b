"""What a stored state carries so that it is trusted before it is restored: the identity of the model that wrote
it and a checksum of its content, both in its name (a stored state's file stays byte for byte the server's own,
so that the server restores it; its name travels with it through every copy, every store and every tool).

A stored state is ``slotN-MODEL-NTOKENS-TOKENS-SUM.bin`` (:func:`state_name`):

- ``slotN``: the slot it was saved from;
- ``MODEL``: the first 16 hex digits of the SHA-256 of the target model's GGUF content
  (:func:`slotctl.model.content.model_content`: a model's identity is its content, never its name or shapes),
  followed, for a state that carries a draft state (an ``SDFT`` appendix or checkpoint draft blobs), by ``x`` and
  the draft model's 16 (:data:`UNKNOWN_DRAFT`, all zeros, when the server's draft model is not known: such a
  draft state is restored by no server);
- ``NTOKENS``: its token count (seven digits at least: names of one slot and model sort by length);
- ``TOKENS``: the first 16 hex digits of the SHA-256 of its tokens (little-endian int32): one state of a slot's
  tokens is stored once (:func:`stored_prefix`);
- ``SUM``: the first 16 hex digits of the SHA-256 of the file's bytes (:func:`checksum`), written when it is
  stored and with every conversion, checked before every restore (:func:`verify`): a state whose bytes are not
  the ones stored (a flipped bit, a file spliced from two) is never sent.

The names of earlier releases (keep's ``slotN-MODEL-TOKENS.bin``, serve's ``serve-MODEL-NTOKENS-TOKENS.bin``,
and ``slotN-MODEL-NTOKENS-TOKENS.bin`` whose MODEL hashed what the server reported of its model) are still read
(:func:`parse_name`) but carry neither: their model is unknown (:attr:`StateName.sealed` False), and nothing
restores them.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from slotctl.errors import ExitStatus, SlotctlError
from slotctl.progress import Progress

#: hex digits of a digest a name keeps (64 bits: two models, two token lists, two contents do not share one)
SHORT = 16
#: the draft part of a name when the server's draft model is not known (no digest is all zeros)
UNKNOWN_DRAFT = "0" * SHORT
#: bytes read at a time to checksum a file
READ_CHUNK = 8 << 20

#: a stored state's name (:func:`state_name`)
STATE_NAME = "slot{slot}-{model}-{n:07d}-{tokens}-{sum}.bin"
_SEALED = re.compile(r"slot(\d{1,9})-([0-9a-f]{16})(?:x([0-9a-f]{16}))?-(\d{7,})-([0-9a-f]{16})-([0-9a-f]{16})\.bin")
#: the names of earlier releases: model hashed from what the server reported, no checksum
_UNSEALED = re.compile(r"slot(\d{1,9})-([0-9a-zA-Z]+)-(\d{7,})-([0-9a-f]{16})\.bin")
_OLD_KEEP = re.compile(r"slot(\d{1,9})-([0-9a-zA-Z]+)-(.+)\.bin")
_OLD_SERVE = re.compile(r"serve-([0-9a-zA-Z]+)-(\d+)-([0-9a-f]+)\.bin")


class ChecksumMismatch(SlotctlError):
    """A stored state's bytes are not the ones its name's checksum was made of: never sent."""

    exit_status = ExitStatus.FAILED
    code = "checksum_mismatch"


def tokens_hash(tokens) -> str:
    """The first 16 hex digits of the SHA-256 of a slot's tokens (as little-endian int32)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()[:SHORT]


def model_part(target: str, draft: str | None = None) -> str:
    """A name's MODEL: the target's short digest, and ``x`` and the draft's for a state that carries a draft
    state (``draft``: its short digest, or :data:`UNKNOWN_DRAFT`)."""
    return target if draft is None else f"{target}x{draft}"


def stored_prefix(slot: int, target: str, tokens, draft: str | None = None) -> str:
    """What the names of ``slot``'s states of ``tokens`` for the model begin with, whatever their checksum: one
    of them stored is the state stored (a save of the same tokens is not stored again)."""
    return f"slot{slot}-{model_part(target, draft)}-{len(tokens):07d}-{tokens_hash(tokens)}-"


def state_name(slot: int, target: str, tokens, checksum_: str, draft: str | None = None) -> str:
    """The name a state of ``tokens`` saved from ``slot`` is stored under: ``target`` (and ``draft``, for a state
    that carries a draft state) the models' short digests, ``checksum_`` its content's (:func:`checksum`)."""
    return STATE_NAME.format(slot=slot, model=model_part(target, draft), n=len(tokens), tokens=tokens_hash(tokens),
                             sum=checksum_[:SHORT])


def slot_prefix(slot: int, target: str) -> str:
    """What the names of ``slot``'s states of the target model ``target`` begin with (with or without a draft)."""
    return f"slot{slot}-{target}"


@dataclass(frozen=True)
class StateName:
    """What a stored state's name says: the slot it was saved from (None: serve's old names), the model (this
    release's: the target's short digest; an earlier one's: a hash of what the server reported), its token count
    (None: keep's old names), its tokens' hash (as the name has it), the draft model's short digest (a state
    that carries a draft state; :data:`UNKNOWN_DRAFT`: not known when it was stored) and its content's
    checksum (None: an earlier release's name, which carries none)."""

    slot: int | None
    model: str
    n_tokens: int | None
    tokens: str
    draft: str | None = None
    checksum: str | None = None

    @property
    def sealed(self) -> bool:
        """The name carries the model's content identity and the state's checksum (this release's)."""
        return self.checksum is not None


def parse_name(name: str) -> StateName | None:
    """What the stored state's ``name`` says (:class:`StateName`); None for a name of no scheme read."""
    if m := _SEALED.fullmatch(name):
        return StateName(int(m[1]), m[2], int(m[4]), m[5], m[3], m[6])
    if m := _UNSEALED.fullmatch(name):
        return StateName(int(m[1]), m[2], int(m[3]), m[4])
    if m := _OLD_SERVE.fullmatch(name):
        return StateName(None, m[1], int(m[2]), m[3])
    if m := _OLD_KEEP.fullmatch(name):
        return StateName(int(m[1]), m[2], None, m[3])
    return None


def checksum(f: BinaryIO, progress: Progress | None = None) -> str:
    """The hex SHA-256 of the whole of the open file ``f`` (read from its start, whatever its position;
    ``progress(done, total)``)."""
    h = hashlib.sha256()
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    f.seek(0)
    try:
        total = os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        total = 0
    done = 0
    readinto = getattr(f, "readinto", None)
    while True:
        if readinto is not None:
            n = readinto(buf)
            chunk = view[:n] if n else b""
        else:       # an object in a store read by ranges
            chunk = f.read(READ_CHUNK)
            n = len(chunk)
        if not n:
            break
        h.update(chunk)
        done += n
        if progress is not None:
            progress(done, total)
    return h.hexdigest()


def checksum_file(path: str | os.PathLike, progress: Progress | None = None) -> str:
    """:func:`checksum` of the regular file at ``path``."""
    from slotctl.paths import open_regular

    with open_regular(path, what="slot file ") as f:
        return checksum(f, progress)


def verify(where: str | os.PathLike, expected: str, got: str) -> None:
    """:class:`ChecksumMismatch` unless the checksum ``got`` of the state at ``where`` begins with ``expected``
    (a name's :data:`SHORT` digits, or a whole one)."""
    if not got.startswith(expected[:SHORT]) or len(expected) < SHORT:
        raise ChecksumMismatch(f"{os.fspath(where)}: its content is not the state that was stored (checksum "
                               f"{got[:SHORT]}, stored as {expected[:SHORT]}): damaged since, never restored")
