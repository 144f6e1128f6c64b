"""Layers 4 and 5: the appendices a current server writes after the payload.

SCKP (context checkpoints) and SDFT (the draft model's live state, llama.cpp ea736c1d5). Each blob is
a ``u64 length`` followed by that many bytes; the lengths are checked against the bytes that remain.
"""

from __future__ import annotations

import construct as cs
from construct import this

from slotctl.format.common import Counted, Expect, Payload, hex32

SCKP_MAGIC = 0x504B4353  # "SCKP"
SCKP_VERSION = 1
SDFT_MAGIC = 0x54464453  # "SDFT"
SDFT_VERSION = 1
MAGICS = {SCKP_MAGIC: "SCKP", SDFT_MAGIC: "SDFT"}
SCKP_MAGIC_BYTES = SCKP_MAGIC.to_bytes(4, "little")
SDFT_MAGIC_BYTES = SDFT_MAGIC.to_bytes(4, "little")

#: the fields as they are before any check (what the server's loader reads, and what strip-draft writes):
#: an SCKP appendix's head, a checkpoint's positions, a blob's length. :data:`SckpAppendix` and
#: :data:`Checkpoint` parse them with the checks; every other read or write of these bytes goes through these
SckpHead = cs.Struct("magic" / cs.Int32ul, "version" / cs.Int32ul, "count" / cs.Int32ul)
CheckpointHead = cs.Struct("n_tokens" / cs.Int64sl, "pos_min" / cs.Int32sl, "pos_max" / cs.Int32sl)
BlobLength = cs.Int64ul


def _sized(what: str) -> cs.Struct:
    return cs.Struct("length" / BlobLength, "data" / Payload(this.length, what))


Checkpoint = cs.Struct(
    *CheckpointHead.subcons,
    "tgt" / _sized("checkpoint target blob"),
    "dft" / _sized("checkpoint draft blob"),
    "spec" / _sized("checkpoint speculative state"),
)

#: the most checkpoints slotctl reads in an SCKP appendix: slotctl's own bound (docs/design.md, "Bounds"),
#: not a server rule. A reading of upstream ``load_slot_checkpoints`` (llama.cpp 033df86b6,
#: tools/server/server-context.cpp; in neither sdist) finds no cap on the count: the loader reads every
#: checkpoint, each blob length checked against the bytes left, and keeps the newest ``--ctx-checkpoints``.
#: The cap of 1024 that PR #26004's description states, and a patched fork applies, is not in that commit.
#: A server writes at most its ``--ctx-checkpoints`` per slot (32 by default), far below this bound.
MAX_CHECKPOINTS = 1 << 16
#: smallest possible checkpoint: 16 bytes of positions and three empty blob lengths
CHECKPOINT_MIN_SIZE = CheckpointHead.sizeof() + 3 * BlobLength.sizeof()

SckpAppendix = cs.Struct(
    "magic" / Expect(cs.Int32ul, [SCKP_MAGIC], "SCKP magic", hex32),
    "version" / Expect(cs.Int32ul, [SCKP_VERSION], "SCKP version"),
    # the bytes first (a count the file cannot hold is a damaged appendix, which the server ignores), then
    # slotctl's own bound (a count it could hold but slotctl does not read)
    "count" / Counted(Counted(cs.Int32ul, "checkpoint count", min_item_size=CHECKPOINT_MIN_SIZE),
                      "checkpoint count", limit=MAX_CHECKPOINTS),
    "checkpoints" / cs.Array(this.count, Checkpoint),
)

SdftAppendix = cs.Struct(
    "magic" / Expect(cs.Int32ul, [SDFT_MAGIC], "SDFT magic", hex32),
    "version" / Expect(cs.Int32ul, [SDFT_VERSION], "SDFT version"),
    "dft" / _sized("draft state blob"),
    "spec" / _sized("speculative state"),
)


def build_sckp(checkpoints: list[dict]) -> bytes:
    """SCKP bytes for ``checkpoints`` (dicts with n_tokens, pos_min, pos_max, tgt, dft, spec as bytes).

    An empty list writes nothing, as the server does.
    """
    if not checkpoints:
        return b""
    return SckpAppendix.build(dict(
        magic=SCKP_MAGIC, version=SCKP_VERSION, count=len(checkpoints),
        checkpoints=[dict(n_tokens=c["n_tokens"], pos_min=c["pos_min"], pos_max=c["pos_max"],
                          tgt=dict(length=len(c["tgt"]), data=c["tgt"]),
                          dft=dict(length=len(c["dft"]), data=c["dft"]),
                          spec=dict(length=len(c["spec"]), data=c["spec"])) for c in checkpoints],
    ))


def build_sdft(dft: bytes, spec: bytes = b"") -> bytes:
    """SDFT bytes; nothing when both parts are empty, as the server does."""
    if not dft and not spec:
        return b""
    return SdftAppendix.build(dict(magic=SDFT_MAGIC, version=SDFT_VERSION,
                                   dft=dict(length=len(dft), data=dft), spec=dict(length=len(spec), data=spec)))
