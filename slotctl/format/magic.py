"""What a file is by its first bytes and its name, without a parser: the state and GGUF magics,
:func:`file_kind`, and which directory entries are slot files (:func:`is_slot_entry`). Light (no construct,
no numpy): a directory listing served from the catalog needs only this."""

from __future__ import annotations

#: ``LLAMA_STATE_SEQ_MAGIC`` ("ggsq"; bytes ``71 73 67 67``)
STATE_SEQ_MAGIC = 0x67677371
#: the first four bytes of a slot file (``STATE_SEQ_MAGIC`` little-endian)
STATE_MAGIC_BYTES = STATE_SEQ_MAGIC.to_bytes(4, "little")
#: the first four bytes of a GGUF model file
GGUF_MAGIC_BYTES = b"GGUF"


def file_kind(first_bytes: bytes) -> str:
    """What a file is by its first four bytes: ``"slot"`` (the state magic), ``"gguf"`` (a model) or ``"other"``."""
    head = bytes(first_bytes[:4])
    if head == STATE_MAGIC_BYTES:
        return "slot"
    if head == GGUF_MAGIC_BYTES:
        return "gguf"
    return "other"


#: the ending of a file name that makes a directory entry a slot file whatever its first bytes: the name
#: llama-server's documentation gives slot files (``"filename": "slot_save_file.bin"``) and slotctl too
SLOT_FILE_SUFFIX = ".bin"


def is_slot_entry(name: str, head: bytes | None) -> bool:
    """Whether a file found in a directory (or under an object-store prefix) is a slot file: one a command
    over a slot directory reads. ``name``: its name; ``head``: its first 4 bytes, None when it cannot be read.

    The rule (docs/directories.md): a file is a slot file when it begins with the state magic, or when its
    name ends in ``.bin`` (any case) and it is not a GGUF model. So an empty ``.bin`` (what a save that died
    leaves) or one whose first bytes are not the magic (a header overwritten, a file of zeros after a
    crash) is a slot file the server refuses, reported as broken, never passed over as "not a slot file".
    Any other file (a README, a JSON sidecar, a model) is not one. A file that cannot be read is kept: the
    command then says why it cannot be read.
    """
    if head is None:
        return True
    kind = file_kind(head)
    return kind == "slot" or (kind != "gguf" and name.lower().endswith(SLOT_FILE_SUFFIX))
