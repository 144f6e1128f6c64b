"""The slot file names llama-server accepts: ``fs_validate_filename`` (common/common.cpp, b11434)."""

from __future__ import annotations

from slotctl.errors import UsageError

#: code points llama-server refuses besides control characters: look-alikes of separators and oddities
_FORBIDDEN_LOOKALIKES = {
    0xFF0E: "a full-width full stop",
    0x2215: "a division slash (looks like '/')",
    0x2216: "a set minus (looks like '\\')",
    0xFFFD: "the replacement character",
    0xFEFF: "a byte order mark",
}
_FORBIDDEN_ASCII = ':*?"<>|'
MAX_FILENAME_BYTES = 255


def check_filename(name: str) -> str:
    """Check a slot file name as llama-server b11434 does (``fs_validate_filename`` in common/common.cpp).

    The server saves and restores only plain file names inside its ``--slot-save-path`` folder and
    answers "Invalid filename" to anything else; this says why. Rules: 1 to 255 bytes of valid UTF-8;
    no control character (U+0000-U+001F, U+007F, U+0080-U+009F); none of ``: * ? " < > |``; no ``/`` or
    ``\\`` (no folders); no U+FF0E, U+2215, U+2216, U+FFFD, U+FEFF, no surrogate; no leading or trailing
    space, no trailing ``.``; no ``..`` anywhere; not ``.``.

    Returns ``name``; raises UsageError naming the first rule broken.
    """
    if isinstance(name, bytes):
        try:
            name = name.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"invalid slot file name {name!r}: not valid UTF-8") from None
    if not isinstance(name, str):
        raise UsageError(f"invalid slot file name {name!r}: not a string")

    def bad(reason: str) -> UsageError:
        return UsageError(f"invalid slot file name {name!r}: {reason} (llama-server accepts only a plain "
                          f"file name inside its --slot-save-path folder)")

    if not name:
        raise bad("it is empty")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise bad("not valid UTF-8 (it holds a lone surrogate)") from None
    if len(encoded) > MAX_FILENAME_BYTES:
        raise bad(f"{len(encoded)} bytes long, at most {MAX_FILENAME_BYTES} are allowed")
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F:
            raise bad(f"it contains the control character U+{c:04X}")
        if c in _FORBIDDEN_LOOKALIKES:
            raise bad(f"it contains U+{c:04X}, {_FORBIDDEN_LOOKALIKES[c]}")
        if 0xD800 <= c <= 0xDFFF:  # pragma: no cover - caught by the UTF-8 encoding above
            raise bad(f"it contains the surrogate U+{c:04X}")
        if ch in _FORBIDDEN_ASCII:
            raise bad(f"it contains {ch!r}")
        if ch in "/\\":
            raise bad(f"it contains the path separator {ch!r}: folders are not allowed")
    if name[0] == " ":
        raise bad("it starts with a space")
    if name[-1] == " ":
        raise bad("it ends with a space")
    if name[-1] == ".":
        raise bad("it ends with '.'")
    if ".." in name:
        raise bad("it contains '..'")
    return name

