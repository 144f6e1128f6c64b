"""Layer 1: the token words the server stores in the state header.

Current servers store ``server_tokens::serialize()``: a packed record starting with the word -1.
Anything else (no words, or a first word that is not -1) is the legacy plain token list.
"""

from __future__ import annotations

import construct as cs
import numpy as np
from construct import this

from slotctl.format.arrays import NumpyArray
from slotctl.format.cells import MAX_CELLS
from slotctl.format.common import CheckError, Counted, Expect, Payload, _remaining

TOKEN_NULL = -1
TOKEN_RECORD_VERSION = 1


class _Pad(cs.Construct):
    """The 0-3 bytes that round the record up to whole words; the server refuses 4 or more."""

    def _parse(self, stream, context, path):
        start = stream.tell()
        left = _remaining(stream)
        if left >= 4:
            raise CheckError(f"the end of the token record, found {left:,} more bytes (trailing data)", start)
        return cs.stream_read(stream, left, path)

    def _build(self, obj, stream, context, path):
        cs.stream_write(stream, obj, len(obj), path)
        return obj


MediaChunkRecord = cs.Struct(
    "length" / Counted(cs.Int32ul, "media chunk length", min_item_size=1),
    "data" / Payload(this.length, "media chunk"),
)

#: the packed token record, parsed from the bytes of the words
PackedTokens = cs.Struct(
    "marker" / Expect(cs.Int32sl, [TOKEN_NULL], "packed token record marker"),
    "version" / Expect(cs.Int32ul, [TOKEN_RECORD_VERSION], "token record version"),
    "n_tokens" / Counted(cs.Int32ul, "token count", limit=MAX_CELLS, min_item_size=4),
    "tokens" / NumpyArray(this.n_tokens, np.int32, "tokens"),
    "n_media" / Counted(cs.Int32ul, "media chunk count", min_item_size=8),
    "media_start" / NumpyArray(this.n_media, np.uint32, "media start indices"),
    "media" / cs.Array(this.n_media, MediaChunkRecord),
    "pad" / _Pad(),
)

# mtmd_input_chunk_save, serialization version 2 (tools/mtmd/mtmd.cpp). No pixel data is stored.
# the loader takes any bytes as an id (a std::string), UTF-8 or not
_String = cs.Prefixed(Counted(cs.Int64ul, "string length", min_item_size=1), cs.GreedyBytes)
_BatchEntry = cs.Struct("add_viewsep" / cs.Int8ul, "add_newline" / cs.Int8ul, "lead_pad" / cs.Int32sl,
                        "nx" / cs.Int32sl, "ny" / cs.Int32sl)
_Batch = cs.Struct("is_audio" / cs.Int8ul, "n" / Counted(cs.Int64ul, "batch entry count", min_item_size=14),
                   "entries" / cs.Array(this.n, _BatchEntry))
MEDIA_TYPES = {0: "text", 1: "image", 2: "audio"}
MediaChunk = cs.Struct(
    "version" / Expect(cs.Int64ul, [2], "media chunk serialization version"),
    "type" / Expect(cs.Int32ul, list(MEDIA_TYPES), "media chunk type"),
    "n_text_tokens" / Counted(cs.Int64ul, "text token count", min_item_size=4),
    "text_tokens" / NumpyArray(this.n_text_tokens, np.int32, "text tokens"),
    "has_image" / cs.Int8ul,
    "image" / cs.If(this.has_image != 0, cs.Struct(
        "nx" / cs.Int32ul, "ny" / cs.Int32ul,
        # mtmd_image_tokens::deserialize: below MTMD_POS_TYPE_COUNT (normal, mrope, hunyuanvl), else "invalid pos type"
        "pos_type" / Expect(cs.Int32ul, [0, 1, 2], "image position type"), "image_idx" / cs.Int32ul,
        "n_temporal_merge" / cs.Int32ul, "id" / _String, "batch" / _Batch)),
    "has_audio" / cs.Int8ul,
    "audio" / cs.If(this.has_audio != 0, cs.Struct("n_tokens" / cs.Int32ul, "id" / _String, "batch" / _Batch)),
    # mtmd_input_chunk::deserialize reads what it needs and never looks at the rest of the buffer
    "trailing" / cs.GreedyBytes,
)


def is_packed(words: np.ndarray) -> bool:
    """The server's own test: a packed record starts with the word -1."""
    return len(words) > 0 and int(words[0]) == TOKEN_NULL


def pack_tokens(tokens, media: list[tuple[int, bytes]] = ()) -> np.ndarray:
    """``server_tokens::serialize()``: the words a current server writes for ``tokens``.

    ``media`` holds ``(start index, mtmd chunk bytes)`` pairs in ascending order.
    """
    body = PackedTokens.build(dict(
        marker=TOKEN_NULL, version=TOKEN_RECORD_VERSION, n_tokens=len(tokens), tokens=list(tokens),
        n_media=len(media), media_start=[m[0] for m in media],
        media=[dict(length=len(m[1]), data=m[1]) for m in media],
        pad=b"",
    ))
    body += b"\0" * (-len(body) % 4)
    return np.frombuffer(body, dtype="<i4").copy()
