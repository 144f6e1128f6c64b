"""The speculative state a server keeps beside its draft context: what it is, and when it is applied.

A slot file carries it twice: as the second blob of the SDFT appendix (``data_spec``, the live state) and
in each checkpoint of the SCKP appendix (``spec``). It is what ``common_speculative_get_state`` returns
(b11434 common/speculative.cpp), and only one speculative decoder keeps any:
``common_speculative_impl_draft_eagle3``, and only for a recurrent or hybrid target
(``need_boundary_stash``): the deferred boundary's position and hidden row, ``i32 pos`` followed by
``f32[n_embd_dec]``, ``n_embd_dec`` being the draft model's embedding length. Its ``set_state`` checks
the size only: a state of any other size is silently ignored, one of the right size is applied whatever
its values (a row of NaN or infinities included: the drafts made from it are garbage the target then
rejects); every other decoder (draft-simple, ngram, ...) ignores every state.

Which decoder a server runs is not in the file; the draft model says it: an ``eagle3`` GGUF drafts as
eagle3. Without one, the state is opaque bytes of a known size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

EAGLE3 = "eagle3"
OPAQUE = "opaque"

#: target memory kinds for which eagle3 keeps a state (``llama_model_is_recurrent || llama_model_is_hybrid``)
_STASHING_TARGETS = frozenset({"recurrent", "hybrid", "hybrid_iswa"})


def decoder_kind(draft_info) -> str | None:
    """The speculative decoder a draft model makes the server run, as far as its state goes: "eagle3" for
    an eagle3 draft (``common_speculative_impl_draft_eagle3``), None for any other (they keep no state)."""
    return EAGLE3 if draft_info is not None and draft_info.arch == EAGLE3 else None


def keeps_state(kind: str | None, target_info) -> bool:
    """Whether the decoder keeps (and so applies) a speculative state for this target: eagle3, for a
    recurrent or hybrid target only (``need_boundary_stash``)."""
    return kind == EAGLE3 and target_info is not None and target_info.memory_kind in _STASHING_TARGETS


def expected_size(kind: str | None, draft_info) -> int | None:
    """The size of a state the decoder takes: eagle3, 4 + 4 x the draft's ``n_embd``; None for others."""
    if kind != EAGLE3 or draft_info is None:
        return None
    return 4 + 4 * draft_info.n_embd


@dataclass(frozen=True)
class SpeculativeState:
    """One speculative state as slotctl reads it. ``kind``: "eagle3" (parsed) or "opaque"; ``size``: its
    bytes; eagle3: ``pos`` (the deferred boundary's position), ``n_embd`` (floats in the row) and
    ``expected_size`` (what the draft model's ``set_state`` takes); ``error``: why ``set_state`` ignores
    it (not an i32 and f32 values, or another size); ``non_finite``: values of the row that are not
    finite, which ``set_state`` applies all the same (it checks the size only)."""

    kind: str
    size: int
    pos: int | None = None
    n_embd: int | None = None
    expected_size: int | None = None
    error: str | None = None
    non_finite: int = 0

    def as_dict(self) -> dict:
        return {"kind": self.kind, "size": self.size, "pos": self.pos, "n_embd": self.n_embd,
                "expected_size": self.expected_size, "error": self.error}


def parse_state(data: bytes, kind: str | None, draft_info=None) -> SpeculativeState:
    """Parse ``data`` as the state of decoder ``kind`` (:func:`decoder_kind`); any other kind is opaque."""
    if kind != EAGLE3:
        return SpeculativeState(OPAQUE, len(data))
    want = expected_size(kind, draft_info)
    if len(data) < 4 or (len(data) - 4) % 4:
        return SpeculativeState(EAGLE3, len(data), expected_size=want,
                                error=f"{len(data):,} bytes: not an i32 position followed by f32 values")
    (pos,) = struct.unpack_from("<i", data)
    n = (len(data) - 4) // 4
    error = None
    if want is not None and len(data) != want:
        error = f"{n:,} values, the draft model's embedding has {draft_info.n_embd:,}"
    bad = int(np.count_nonzero(~np.isfinite(np.frombuffer(data, dtype="<f4", offset=4))))
    return SpeculativeState(EAGLE3, len(data), pos=pos, n_embd=n, expected_size=want, error=error, non_finite=bad)


def describe_state(size: int, target_info=None, draft_info=None) -> dict | None:
    """A speculative state for ``inspect``: None when empty; else its ``kind`` (what the draft model makes
    of it: "eagle3", or "opaque" bytes), ``size``, ``expected_size`` (eagle3: what ``set_state`` takes) and
    ``applied`` (whether a server with these models applies it; None without a draft model)."""
    if not size:
        return None
    kind = decoder_kind(draft_info)
    want = expected_size(kind, draft_info)
    applied = None
    if draft_info is not None and target_info is not None:
        applied = keeps_state(kind, target_info) and (want is None or size == want)
    return {"kind": kind or OPAQUE, "size": size, "expected_size": want, "applied": applied}
