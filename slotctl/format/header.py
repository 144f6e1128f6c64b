"""Layer 0: the sequence-state file header written by ``llama_state_seq_save_file``.

``u32 magic; u32 version; u32 n_words; i32 words[n_words]``, then the memory payload.
"""

from __future__ import annotations

import construct as cs
import numpy as np
from construct import this

from slotctl.format import SUPPORTED_VERSIONS
from slotctl.format.arrays import NumpyArray
from slotctl.format.cells import MAX_CELLS
from slotctl.format.common import Counted, Expect, hex32
# the magics and file_kind: their home is slotctl.format.magic (light: a directory listing needs only them)
from slotctl.format.magic import STATE_SEQ_MAGIC

#: the header's fixed part, its fields as they are before any check (what a loader reads first, and what
#: slotctl writes): :data:`StateHeader` parses it with the checks; every other read or write of these bytes
#: goes through this
FixedHeader = cs.Struct("magic" / cs.Int32ul, "version" / cs.Int32ul, "n_words" / cs.Int32ul)
HEADER_FIXED_SIZE = FixedHeader.sizeof()
#: the most token words a slot holds: one per cell of the largest context, plus 1 Mi words of media records
MAX_TOKEN_WORDS = MAX_CELLS + (1 << 20)

StateHeader = cs.Struct(
    "magic" / Expect(cs.Int32ul, [STATE_SEQ_MAGIC], "state file magic", hex32),
    "version" / Expect(cs.Int32ul, SUPPORTED_VERSIONS, "state version"),
    "n_words" / Counted(cs.Int32ul, "token word count", limit=MAX_TOKEN_WORDS, min_item_size=4),
    # a token word costs more than its 4 bytes downstream (decoded, checked, shown): 32 bytes of the budget
    "words" / NumpyArray(this.n_words, np.int32, "token words", cost=8),
)


def plausible_header(first: bytes) -> bool:
    """Whether the first :data:`HEADER_FIXED_SIZE` bytes of a stream may begin a slot file: the state magic,
    a state version slotctl reads and a token word count within :data:`MAX_TOKEN_WORDS` (standard input is
    read further only then: :func:`slotctl.paths.stdin_copy`)."""
    if len(first) < HEADER_FIXED_SIZE:
        return False
    h = FixedHeader.parse(first)
    return h.magic == STATE_SEQ_MAGIC and h.version in SUPPORTED_VERSIONS and h.n_words <= MAX_TOKEN_WORDS


#: what :func:`slotctl.paths.stdin_copy` checks before it copies the rest of standard input
STDIN_HEAD = (HEADER_FIXED_SIZE, plausible_header)


def header_size(n_words: int) -> int:
    return HEADER_FIXED_SIZE + 4 * n_words


def fixed_header(version: int, n_words: int) -> bytes:
    """The first :data:`HEADER_FIXED_SIZE` bytes of a slot file: magic, version, token word count."""
    return FixedHeader.build(dict(magic=STATE_SEQ_MAGIC, version=version, n_words=n_words))


