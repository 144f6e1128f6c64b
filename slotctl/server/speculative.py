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

Which decoder a server runs is not in the file; the server's flags say it (``--spec-type``, and for a
draft GGUF without it the types b11434 infers from the GGUF: :func:`server_spec_types`); whether it builds
a draft context at all is :func:`draft_context`. An eagle3 GGUF drafts as eagle3 only with
``--spec-type draft-eagle3``. Without a decoder that keeps one, the state is opaque bytes of a known size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

EAGLE3 = "eagle3"
OPAQUE = "opaque"

#: target memory kinds for which eagle3 keeps a state (``llama_model_is_recurrent || llama_model_is_hybrid``)
_STASHING_TARGETS = frozenset({"recurrent", "hybrid", "hybrid_iswa"})


#: ``common_speculative_type_from_name_map`` (b11434 common/speculative.cpp): the names ``--spec-type`` takes
SPEC_TYPE_NAMES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark",
                   "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
#: the types that draft with a draft context (``add_config_if_enabled(..., params.draft.ctx_dft != nullptr)``)
DRAFT_TYPES = frozenset({"draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark"})


def parse_spec_types(value: str) -> tuple[str, ...]:
    """A ``--spec-type`` value as ``common_speculative_types_from_names`` reads it: a comma-separated list of
    :data:`SPEC_TYPE_NAMES`; "none" anywhere makes it ("none",). ValueError naming an unknown one ("unknown
    speculative type: X", the server does not start)."""
    out = []
    for name in value.split(","):
        if name not in SPEC_TYPE_NAMES:
            raise ValueError(f"unknown speculative type: {name} (expected a comma-separated list of "
                             f"{', '.join(SPEC_TYPE_NAMES)})")
        if name == "none":
            return ("none",)
        out.append(name)
    return tuple(out)


def server_spec_types(spec_type: str | None, draft_info) -> tuple[str, ...]:
    """``params.speculative.types`` as b11434 leaves it (common/arg.cpp): ("none",) by default
    (common/common.h), to which ``--spec-type`` appends its types (``spec_type``; None: not given); when
    the list is still the default and a draft GGUF is given, the types inferred from it
    (``common_speculative_types_from_gguf``: :attr:`ModelInfo.spec_types_gguf`, MTP heads, dflash and
    dspark) replace it."""
    types = ("none",) + (parse_spec_types(spec_type) if spec_type is not None else ())
    if types == ("none",) and draft_info is not None and draft_info.spec_types_gguf:
        types = tuple(draft_info.spec_types_gguf)
    return types


@dataclass(frozen=True)
class DraftContext:
    """Whether the server builds a draft context (``built``) and of what: ``mtp`` (an MTP context, of the
    draft model or, without one, of the target), the speculative ``types`` it runs, and ``why`` when it
    builds none."""

    built: bool
    types: tuple[str, ...]
    mtp: bool = False
    why: str | None = None


def draft_context(spec_type: str | None, draft_info, target_info) -> DraftContext:
    """The draft context b11434's server builds (tools/server/server-context.cpp ``load_model``): with a
    draft model (``-md``) or a "draft-mtp" type it creates one (``common_speculative_init_from_params``: of
    the draft model, or an MTP context of the target), then keeps it only if ``common_speculative_init``
    builds some speculative implementation (any type but "none"; the draft-* ones need that context),
    else it sets ``ctx_dft`` to null: ``-md`` without ``--spec-type`` (the default list is ("none",) and
    only MTP heads, dflash and dspark are inferred from the GGUF) loads the draft model and drafts
    nothing, so no draft state is saved and one in a file is dropped. A target whose memory cannot remove
    a sequence's tail (no memory) gets no speculative decoding either."""
    types = server_spec_types(spec_type, draft_info)
    mtp = "draft-mtp" in types
    if draft_info is None and not mtp:
        return DraftContext(False, types, why="no draft model (-md)")
    if target_info is not None and target_info.memory_kind == "none":
        return DraftContext(False, types, mtp, why="the target has no memory: the server runs no speculative "
                                                   "decoding")
    if all(t == "none" for t in types):
        return DraftContext(False, types, mtp, why=(
            "-md without --spec-type: b11434 loads the draft model and builds no drafter (the default "
            "speculative types are none; only MTP heads, dflash and dspark are inferred from the GGUF), so "
            "the server has no draft context: give --spec-type draft-simple (or the drafter it runs)"))
    return DraftContext(True, types, mtp)


def runtime_draft_model(spec_type: str | None, target_path, draft_path):
    """The draft model slotctl's runtime (``save``, ``restore``) builds a draft context of, as the server
    would (:func:`draft_context`): ``(path or None, why)``; ``why`` says why a given ``-md`` builds none. An
    MTP context is not reproduced by the runtime: :class:`UsageError`."""
    from slotctl.errors import UsageError
    from slotctl.model.info import read_model_info

    if draft_path is None and spec_type is None:
        return None, None
    dinfo = read_model_info(draft_path) if draft_path is not None else None
    got = draft_context(spec_type, dinfo, read_model_info(target_path))
    if got.built and got.mtp:
        raise UsageError("the server would build an MTP draft context (draft-mtp): slotctl's runtime does not "
                         "build MTP contexts; validate predicts them")
    if not got.built:
        return None, got.why if draft_path is not None else None
    return draft_path, None


def decoder_kind(draft_info, types: tuple[str, ...] | None = None) -> str | None:
    """The speculative decoder the server runs, as far as its state goes: "eagle3" when ``types`` (the
    server's: :func:`server_spec_types`) include "draft-eagle3" and there is a draft model
    (``common_speculative_impl_draft_eagle3``), None for any other (they keep no state). Without the types
    (a command given no server flags), an eagle3 GGUF is taken to draft as eagle3."""
    if draft_info is None:
        return None
    if types is None:
        return EAGLE3 if draft_info.arch == EAGLE3 else None
    return EAGLE3 if "draft-eagle3" in types else None


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
