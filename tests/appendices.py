"""Slot files with appendices, built from real server files (tests/data) as the seed change's server appends
them: the target's and the draft's state blobs taken from real payloads, checkpoints (SCKP) and the draft state
(SDFT), with what strip-draft must write of each (tests/test_strip_draft.py, test_long_names.py,
test_races.py). To test with blobs taken from real contexts, change TARGET_SRC / DRAFT_SRC or the two functions
below; the tests only use what :func:`build_file` returns."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from slotctl.format.appendix import build_sckp, build_sdft
from slotctl.format.blob import blob_header

DATA = Path(__file__).parent / "data"

#: the slot file every test file starts with (header, tokens, target payload)
TARGET_SRC = DATA / "srv-np1.bin"
#: the file whose payload plays the draft context's state
DRAFT_SRC = DATA / "srv-draft.bin"
SPEC_STATE = b"speculative state: opaque to slotctl"


def real_payload(path: Path) -> bytes:
    """The memory payload of a b11434 server file: everything after the token words (no appendix)."""
    raw = path.read_bytes()
    (n_words,) = struct.unpack_from("<I", raw, 8)
    return raw[12 + 4 * n_words:]


def state_blob(path: Path) -> bytes:
    """An in-memory state blob (layer 3) holding the payload of ``path``."""
    return blob_header(0) + real_payload(path)


def checkpoint_entries(target: Path = TARGET_SRC) -> list[dict]:
    """Two checkpoints of the context saved in ``target``: target, draft and speculative blobs, as
    ``build_sckp`` takes them."""
    tgt, dft = state_blob(target), state_blob(DRAFT_SRC)
    return [dict(n_tokens=8, pos_min=0, pos_max=7, tgt=tgt, dft=dft, spec=SPEC_STATE),
            dict(n_tokens=16, pos_min=0, pos_max=15, tgt=tgt, dft=b"", spec=b"")]


def draft_state() -> tuple[bytes, bytes]:
    """The SDFT appendix's (draft blob, speculative state)."""
    return state_blob(DRAFT_SRC), SPEC_STATE


@dataclass
class Built:
    path: Path
    original: bytes
    #: what strip-draft must write
    stripped: bytes
    #: what strip-draft --checkpoints must write
    stripped_ckpt: bytes
    checkpoints: list[dict]


def build_file(path: Path, *, base: Path = TARGET_SRC, checkpoints: list[dict] | None = None,
               draft: bool = True, trailing: bytes = b"") -> Built:
    """``base`` + SCKP(``checkpoints``) + SDFT (when ``draft``) + ``trailing``, and the expected results."""
    head = base.read_bytes()
    cps = checkpoint_entries(base) if checkpoints is None else checkpoints
    sckp = build_sckp(cps)
    sdft = build_sdft(*draft_state()) if draft else b""
    data = head + sckp + sdft + trailing
    path.write_bytes(data)
    no_draft = [dict(c, dft=b"", spec=b"") for c in cps]
    return Built(path, data, head + sckp + trailing, head + build_sckp(no_draft) + trailing, cps)
