"""Layer 3: in-memory state blobs (``llama_state_seq_get_data_ext``).

``u32 0xaf143cd8; i32 source seq_id;`` then the same ``state_write`` bytes as a file payload.
Flags: PARTIAL_ONLY (= SWA_ONLY) 1 writes only what cannot be rolled back; ON_DEVICE 2.
"""

from __future__ import annotations

import construct as cs

from slotctl.format.common import Expect, hex32

BLOB_MAGIC = 0xAF143CD8
BLOB_HEADER_SIZE = 8

FLAGS_NONE = 0
FLAGS_PARTIAL_ONLY = 1
FLAGS_ON_DEVICE = 2

BlobHeader = cs.Struct(
    "magic" / Expect(cs.Int32ul, [BLOB_MAGIC], "state blob magic", hex32),
    "seq_id" / cs.Int32sl,
)


def blob_header(seq_id: int) -> bytes:
    return BlobHeader.build(dict(magic=BLOB_MAGIC, seq_id=seq_id))
