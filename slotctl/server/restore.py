"""The server's restore of a slot file (``POST /slots/ID?action=restore``), one function per step.

llama-server restores a file in this order (b11434 ``SERVER_TASK_TYPE_SLOT_RESTORE`` in
tools/server/server-context.cpp, and the draft-state change ea736c1d5 on top of it):

1. :func:`check_state_header`: ``llama_state_seq_load_file`` reads the magic, the state version and the
   token count (``llama_context::state_seq_load_file``);
2. :func:`target_outcome`: the same call reads the target payload into the slot's sequence
   (``state_seq_read_data``); done in a real context by :mod:`slotctl.runtime.restore`, predicted by
   :mod:`slotctl.validate`;
3. :func:`check_tokens`: ``server_tokens::deserialize``, the slot context and ``server_tokens::validate``;
4. :func:`load_slot_checkpoints`: the SCKP appendix right after the payload, the newest
   ``--ctx-checkpoints`` kept;
5. :func:`load_slot_draft`: the SDFT appendix after the checkpoints: the draft context's state, then
   the speculative state (:func:`apply_speculative_state`).

Each returns an :class:`Outcome`: what became of the step (restored / absent / ignored / dropped /
refused / aborts), the bytes of the file it consumed, and the server's own message. The steps read the
file themselves (an open binary file, positioned by them), so that every command reading a slot file
the way the server does reads it through these functions: :mod:`slotctl.runtime.restore` executes them
with real contexts, :mod:`slotctl.validate` predicts them.

The checkpoint loader (``load_slot_checkpoints``, llama.cpp commit 033df86b6) is in neither source tree
slotctl reads (b11434 predates it); what it does here follows docs/format.md (section 6) and two independent
readings of that commit, said next to each rule.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Mapping, Sequence

import numpy as np

from slotctl.errors import FormatError
from slotctl.format import appendix as apx
from slotctl.format.common import Span
from slotctl.format.header import HEADER_FIXED_SIZE, STATE_SEQ_MAGIC, FixedHeader
from slotctl.server.checkpoints import keep_newest
from slotctl.server.flags import DEFAULT_CTX_CHECKPOINTS, SERVER_STATE_VERSION
from slotctl.server.status import Status  # noqa: F401 - its home is slotctl.server.status (light), named here too

# the members by their names, as the steps below and their callers write them
RESTORED, ABSENT, IGNORED, DROPPED, REFUSED, ABORTS = Status

#: what the server answers when ``llama_state_seq_load_file`` returns 0
TARGET_ERROR = "No available space in KV cache or invalid slot save file"


@dataclass(frozen=True)
class Outcome:
    """What one step of the restore did.

    ``step``: "state header", "target", "tokens", "checkpoints", "draft" or "speculative". ``status``: a
    :class:`Status`. ``bytes``: the bytes of the file the step consumed (the server's ``n_read`` adds
    them up). ``message``: the server's own words (its error answer, or its log line). ``reason``: what
    slotctl found, in its words. ``doubt``: why the sources do not settle the status (it is then the
    worst that can happen), or None.
    """

    step: str
    status: str
    bytes: int = 0
    message: str | None = None
    reason: str | None = None
    doubt: str | None = None

    @property
    def refused(self) -> bool:
        return self.status in (REFUSED, ABORTS)


# -- 1. the state header -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeaderOutcome(Outcome):
    """:func:`check_state_header`'s outcome, with what it read: ``version`` and ``n_words`` (None when the
    file ends first)."""

    version: int | None = None
    n_words: int | None = None


def check_state_header(f: BinaryIO, size: int, *, state_version: int = SERVER_STATE_VERSION) -> HeaderOutcome:
    """The first call of ``llama_state_seq_load_file`` (``llama_context::state_seq_load_file``, b11434
    src/llama-context.cpp): the magic and state version must be the loader's own, and the token count must
    fit in the file. ``state_version``: the loader's (``LLAMA_STATE_SEQ_VERSION``)."""
    f.seek(0)
    head = f.read(HEADER_FIXED_SIZE)
    if len(head) < HEADER_FIXED_SIZE:
        return HeaderOutcome("state header", REFUSED, message=TARGET_ERROR,
                             reason=f"the file ends at {size} bytes, inside the state header")
    h = FixedHeader.parse(head)
    magic, version, n_words = h.magic, h.version, h.n_words
    if magic != STATE_SEQ_MAGIC or version != state_version:
        return HeaderOutcome("state header", REFUSED, message=TARGET_ERROR, version=version, n_words=n_words,
                             reason=f"unknown (magic, version) for sequence state file: {magic:08x}, "
                                    f"{version:08x}")
    if n_words > (size - HEADER_FIXED_SIZE) // 4:
        return HeaderOutcome("state header", REFUSED, message=TARGET_ERROR, version=version, n_words=n_words,
                             reason=f"token count in sequence state file exceeds the file size! {n_words} > "
                                    f"{(size - HEADER_FIXED_SIZE) // 4}")
    return HeaderOutcome("state header", RESTORED, HEADER_FIXED_SIZE + 4 * n_words, version=version,
                         n_words=n_words)


# -- 2. the target payload -----------------------------------------------------------------------------------


def target_outcome(nread: int, reason: str | None = None) -> Outcome:
    """The second call of ``llama_state_seq_load_file``: ``nread`` is where the payload ended (the
    server's ``n_read``), 0 when ``state_seq_read_data`` failed (``reason``: llama.cpp's, or slotctl's,
    words for why)."""
    if not nread:
        return Outcome("target", REFUSED, message=TARGET_ERROR, reason=reason or "failed to restore sequence state")
    return Outcome("target", RESTORED, nread)


#: why the outcome of a payload cut short is not settled by the source (``Outcome.doubt``)
CUT_UNDEFINED = ("b11434's loader compares variables the file never filled (locals the source leaves "
                 "uninitialised: undefined behaviour), so whether it refuses the file or loads it and aborts "
                 "is the compiled build's, not the source's: the verdict is the worst that can happen")


def cut_payload_outcome(field: str, offset: int, *, fits: bool, settled: bool,
                        refuses: str | None = None, first: int | None = None) -> Outcome:
    """``llama_state_seq_load_file`` on a file that ends inside the payload (b11434, POSIX).

    ``llama_file::read_raw_unsafe`` clamps each read to the bytes left, so a field the end falls in gets
    the bytes the file holds and keeps the rest of what its variable held, a field after the end keeps
    all of it; ``llama_io_read_file::read`` counts every read in full. The loader goes on, checks what it
    has, and if every check passes the caller's ``GGML_ASSERT(nread <= state_size)`` kills the process
    (:mod:`slotctl.format.cut` walks the fields). So, with ``refuses`` (the bytes the file holds of a
    checked field fail the check whatever the rest held, :attr:`slotctl.format.cut.Cut.refuses`) or not
    ``fits`` (a check fails on bytes before the end): refused, for certain. Else with ``settled`` (no
    checked field at or after the end: the end falls in tensor data of the last record): aborts, for
    certain. Else the loader checks indeterminate values: aborts, the worst that can happen, with
    :data:`CUT_UNDEFINED` as the doubt (the x86-64 build of slotctl's tests keeps each local's value from
    the record before, and so aborts where the record before fits). On Windows ``read_raw`` throws at the
    end of the file instead: every cut is refused there.

    The loader's order comes first: ``first`` (the offset of a field the file holds whole whose check fails,
    ``refuses`` saying which) is where the loader refuses the file, for certain, whatever the end
    (``state_read_meta`` and ``state_read_data`` return false at the first check that fails; b11434 checks
    n_stream, each stream's cell count, each cell's n_seq_id, then n_layer, the cell count, v_trans, the
    rotations, and each record's type and row size as it reads them: :mod:`slotctl.format.cut`).
    """
    if first is not None:
        return Outcome("target", REFUSED, message=TARGET_ERROR, reason=(
            f"{refuses} at 0x{first:x}: the loader checks it before any check of what lies past the end of "
            f"the file (at 0x{offset:x}) and refuses the file there"))
    where = f"the file ends inside the target memory's {field} (at 0x{offset:x})"
    if refuses:
        return Outcome("target", REFUSED, message=TARGET_ERROR, reason=f"{where}: {refuses}: the loader refuses "
                                                                       "the file")
    if not fits:
        return Outcome("target", REFUSED, message=TARGET_ERROR, reason=(
            f"{where}; the loader refuses it first, for the mismatch above, in bytes the file holds"))
    if settled:
        return Outcome("target", ABORTS, message="GGML_ASSERT(nread <= state_size)", reason=(
            f"{where}: b11434's loader reads past the end without an error and checks nothing after it, so it "
            "loads the payload and then aborts on GGML_ASSERT(nread <= state_size): restoring this file "
            "crashes the server"))
    return Outcome("target", ABORTS, message="GGML_ASSERT(nread <= state_size)", doubt=CUT_UNDEFINED, reason=(
        f"{where}: b11434's loader reads past the end without an error and goes on checking variables the "
        "file never filled; when what they hold passes (in the x86-64 build slotctl's tests run, each keeps "
        "the value of the record before), it loads the payload and aborts on GGML_ASSERT(nread <= "
        "state_size), else it refuses the file. The worst, and the verdict: restoring this file crashes "
        "the server"))


# -- 3. the tokens -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaExtent:
    """What ``server_tokens::validate`` asks of a media chunk: its type is text (``text``), its token count
    (``mtmd_input_chunk_get_n_tokens``) and its position count (``mtmd_input_chunk_get_n_pos``)."""

    text: bool
    n_tokens: int
    n_pos: int


def media_extent(chunk) -> MediaExtent:
    """A parsed media chunk (:data:`slotctl.format.tokens.MediaChunk`) as b11434's mtmd counts it
    (tools/mtmd/mtmd.cpp): text, the text tokens; image, ``mtmd_image_tokens::n_tokens`` (``(nx + 1) * ny +
    2`` for HunyuanVL positions, else ``nx * ny`` times the batch's entries, merged by ``n_temporal_merge``)
    and positions ``max(nx, ny)`` for M-RoPE, else the token count; audio, its ``n_tokens`` both."""
    if chunk.type == 0:
        return MediaExtent(True, int(chunk.n_text_tokens), int(chunk.n_text_tokens))
    if chunk.type == 1 and chunk.image is not None:
        im = chunk.image
        if im.pos_type == 2:    # MTMD_POS_TYPE_HUNYUANVL
            n = ((im.nx + 1) * im.ny + 2) & 0xFFFFFFFF
        else:
            nz = int(im.batch.n)
            if im.n_temporal_merge > 1:
                nz = nz // im.n_temporal_merge + (1 if nz % im.n_temporal_merge else 0)
            n = (im.nx * im.ny * nz) & 0xFFFFFFFF      # uint32_t arithmetic
        n_pos = max(im.nx, im.ny) if im.pos_type == 1 else n   # MTMD_POS_TYPE_MROPE
        return MediaExtent(False, n, n_pos if n_pos < 2**31 else n_pos - 2**32)   # llama_pos is int32
    if chunk.type == 2 and chunk.audio is not None:
        n = int(chunk.audio.n_tokens)
        return MediaExtent(False, n, n if n < 2**31 else n - 2**32)
    return MediaExtent(False, 0, 0)


def chunk_extent(data: bytes) -> MediaExtent | None:
    """:func:`media_extent` of a media chunk's bytes, None when ``mtmd_input_chunk_load`` cannot read them
    (the server then refuses the file first: "Cannot load media chunk", :mod:`slotctl.server.findings`)."""
    from slotctl.format.common import parse_bytes
    from slotctl.format.tokens import MediaChunk

    try:
        return media_extent(parse_bytes(MediaChunk, bytes(data), "media chunk"))
    except FormatError:
        return None


def invalid_token_indices(tokens: Sequence[int] | np.ndarray, n_vocab: int,
                          media: "Mapping[int, MediaExtent | None] | Sequence[int]" = ()) -> np.ndarray:
    """Indices of the tokens ``server_tokens::validate`` rejects (b11434 tools/server/server-common.cpp),
    the one token-validity rule of slotctl.

    A token must be in ``[0, n_vocab)``, except ``LLAMA_TOKEN_NULL`` (-1) words that are a media chunk's:
    at a -1 word the server looks for a chunk starting there (``find_chunk``; none: rejected), and the chunk
    must not be text, must have n_tokens > 0 and n_pos > 0, must fit in the tokens left, and exactly its
    n_tokens words from its start must be -1 (``media``: start index -> :class:`MediaExtent`); the scan
    then goes on after them, so a -1 word beyond the chunk needs a chunk of its own. Every chunk must be met
    so (``n_media == map_idx_to_media.size()``): a start that is not a -1 word, or lies inside another
    chunk, is rejected. A start given without its extent (None, or a plain sequence of starts) takes the
    whole run of -1 words from it (the chunk could not be read: the chunk loader refuses it first).
    """
    toks = np.asarray(tokens, dtype=np.int64)
    n = len(toks)
    extents = dict(media) if isinstance(media, Mapping) else {int(s): None for s in media}
    bad = (toks < 0) | (toks >= n_vocab)
    null = toks == -1
    bad[null] = False
    starts = sorted(s for s in extents if s < n)
    # the runs of -1 words, each walked as the server walks it: chunk by chunk
    edges = np.flatnonzero(np.diff(np.concatenate(([0], null.view(np.int8), [0]))))
    met = set()
    k = 0
    for run_start, run_end in zip(edges[0::2].tolist(), edges[1::2].tolist()):
        i = run_start
        while i < run_end:
            ext = extents.get(i, False)
            if ext is False:    # no chunk here: this word and those up to the next chunk start are rejected
                while k < len(starts) and starts[k] <= i:
                    k += 1
                nxt = min(starts[k], run_end) if k < len(starts) else run_end
                bad[i:nxt] = True
                i = nxt
                continue
            met.add(i)
            if ext is None:
                i = run_end
                continue
            if ext.text or ext.n_tokens == 0 or ext.n_pos <= 0 or ext.n_tokens > n - i or i + ext.n_tokens > run_end:
                bad[i] = True
                i += 1
                continue
            i += ext.n_tokens
    for s in starts:
        if s not in met:
            bad[s] = True
    return np.flatnonzero(bad)


def check_tokens(tokens, *, n_ctx_slot: int, n_vocab: int, has_mtmd: bool) -> Outcome:
    """The server's checks of the restored prompt, in its order (``SERVER_TASK_TYPE_SLOT_RESTORE``):
    ``server_tokens::deserialize`` (``tokens``: the token words as :func:`slotctl.slotfile.decode_tokens`
    reads them; ``has_mtmd``: the server has a multimodal projector), "Restored prompt does not fit in the
    slot context" (more tokens than ``n_ctx_slot``), then "Invalid tokens in slot save file"
    (:func:`invalid_token_indices`)."""
    if tokens.error is not None:
        return Outcome("tokens", REFUSED, message=str(tokens.error.expected), reason=tokens.error.one_line())
    if tokens.media and not has_mtmd:
        return Outcome("tokens", REFUSED, message="Cannot restore media tokens without an mmproj",
                       reason=f"{len(tokens.media)} media chunk(s)")
    n = tokens.n_tokens
    if n > n_ctx_slot:
        return Outcome("tokens", REFUSED, message="Restored prompt does not fit in the slot context",
                       reason=f"{n} tokens, the slot holds {n_ctx_slot}")
    bad = invalid_token_indices(tokens.tokens, n_vocab, {
        int(s): chunk_extent(c) if isinstance(c, (bytes, bytearray, memoryview)) else None for s, c in tokens.media})
    if len(bad):
        i = int(bad[0])
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return Outcome("tokens", REFUSED, message="Invalid tokens in slot save file",
                       reason=f"token {int(tokens.tokens[i])} at index {i}{more} is outside the vocabulary "
                              f"(0..{n_vocab - 1})")
    return Outcome("tokens", RESTORED)


# -- reading appendices as the server reads them -------------------------------------------------------------


def _read(f: BinaryIO, n: int) -> bytes | None:
    """``ckpt_read``: exactly ``n`` bytes, or None when the file ends first."""
    data = f.read(n)
    return data if len(data) == n else None


def _read_span(f: BinaryIO, end: int) -> Span | None:
    """``ckpt_read_buf``: u64 length, then that many bytes, the length checked against the bytes left before
    ``end`` (nothing is allocated for it); the bytes are skipped and returned as a :class:`Span`."""
    raw = _read(f, 8)
    if raw is None:
        return None
    n = apx.BlobLength.parse(raw)
    here = f.tell()
    if n > end - here:
        return None
    f.seek(here + n)
    return Span(here, n)


# -- 4. the checkpoints --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointEntry:
    """One checkpoint of an SCKP appendix: positions, and where its three blobs are in the file."""

    n_tokens: int
    pos_min: int
    pos_max: int
    tgt: Span
    dft: Span
    spec: Span


@dataclass(frozen=True)
class CheckpointsOutcome(Outcome):
    """:func:`load_slot_checkpoints`'s outcome: ``count`` checkpoints in the appendix, ``kept`` the ones the
    slot keeps (the newest ``--ctx-checkpoints``)."""

    count: int = 0
    kept: tuple[CheckpointEntry, ...] = field(default=())


def load_slot_checkpoints(f: BinaryIO, offset: int, size: int, *,
                          n_ctx_checkpoints: int = DEFAULT_CTX_CHECKPOINTS) -> CheckpointsOutcome:
    """``load_slot_checkpoints`` (llama.cpp commit 033df86b6, tools/server/server-context.cpp; not in
    either source tree slotctl reads): the SCKP appendix at ``offset``, where the payload ends.

    No SCKP magic there: absent, 0 bytes. A damaged appendix (another version, a checkpoint cut short, a
    length beyond the file) or a checkpoint with an empty target blob makes it ignore the whole appendix,
    not fatal: 0 bytes consumed, no checkpoints ("invalid context checkpoint appendix - ignored"), so the
    draft loader then looks for SDFT right after the payload, finds "SCKP", and the draft starts empty
    (silently). Otherwise the whole appendix is consumed and the newest ``n_ctx_checkpoints`` kept
    (:func:`~slotctl.server.checkpoints.keep_newest`), whatever their blobs hold: the loader checks only
    lengths. The count has no cap of its own: each checkpoint's lengths are checked against the bytes left
    (the cap of 1024 in PR #26004's description and a patched fork is not in 033df86b6 as read).

    These rules are readings of that upstream code, which neither sdist holds, not our sources. A count
    above :data:`~slotctl.format.appendix.MAX_CHECKPOINTS` is beyond what slotctl reads (its own bound,
    never reached by a server, which writes at most its ``--ctx-checkpoints``): :class:`FormatError`.
    """
    f.seek(offset)
    magic = _read(f, 4)
    if magic != apx.SCKP_MAGIC_BYTES:
        return CheckpointsOutcome("checkpoints", ABSENT)
    damaged = None
    entries: list[CheckpointEntry] = []
    raw = _read(f, apx.SckpHead.sizeof() - 4)
    if raw is None:
        damaged = "truncated header"
    else:
        head = apx.SckpHead.parse(magic + raw)
        ver, count = head.version, head.count
        if ver != apx.SCKP_VERSION:
            damaged = f"version {ver}, expected {apx.SCKP_VERSION}"
        elif count * apx.CHECKPOINT_MIN_SIZE > size - f.tell():
            damaged = f"{count:,} checkpoints do not fit in the {size - f.tell():,} bytes left"
        elif count > apx.MAX_CHECKPOINTS:
            raise FormatError("SCKP appendix", offset + 8, f"a checkpoint count slotctl reads (at most "
                              f"{apx.MAX_CHECKPOINTS:,}, its own bound), found {count:,}")
        else:
            for i in range(count):
                fixed = _read(f, apx.CheckpointHead.sizeof())
                spans = [] if fixed is None else [_read_span(f, size) for _ in range(3)]
                if fixed is None or any(s is None for s in spans):
                    damaged = f"checkpoint {i} of {count} is truncated or has a length beyond the file"
                    break
                if spans[0].size == 0:
                    damaged = f"checkpoint {i} has an empty target blob"
                    break
                c = apx.CheckpointHead.parse(fixed)
                entries.append(CheckpointEntry(c.n_tokens, c.pos_min, c.pos_max, *spans))
    if damaged:
        return CheckpointsOutcome("checkpoints", IGNORED, message="invalid context checkpoint appendix - ignored",
                                  reason=f"invalid checkpoints appendix: {damaged}")
    kept = keep_newest(entries, n_ctx_checkpoints)
    reason = None
    if len(entries) > len(kept):
        reason = f"kept the last {len(kept)} of {len(entries)} (--ctx-checkpoints {n_ctx_checkpoints})"
    return CheckpointsOutcome("checkpoints", RESTORED, f.tell() - offset, reason=reason, count=len(entries),
                              kept=tuple(kept))


# -- 5. the draft state --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftOutcome(Outcome):
    """:func:`load_slot_draft`'s outcome: where the draft context's state (``dft``) and the speculative
    state (``spec``) are in the file (None when the appendix was not read), and what became of the
    speculative state (``speculative``)."""

    dft: Span | None = None
    spec: Span | None = None
    speculative: Outcome | None = None


def read_slot_draft(f: BinaryIO, offset: int, size: int) -> DraftOutcome:
    """The framing half of ``load_slot_draft`` (draft-state change ea736c1d5): the SDFT appendix at ``offset`` (payload end +
    checkpoint bytes). No complete SDFT magic: absent, 0 bytes (the draft starts empty). Another version,
    or a blob cut short: "invalid draft state in '...' - ignored", 0 bytes. Else the spans of both blobs,
    with every byte of the appendix consumed (status restored, pending :func:`load_slot_draft`)."""
    if offset > size:
        return DraftOutcome("draft", ABSENT)
    f.seek(offset)
    raw = _read(f, 4)
    if raw != apx.SDFT_MAGIC_BYTES:
        return DraftOutcome("draft", ABSENT, reason="the file holds no draft state: the draft starts empty")
    raw = _read(f, 4)
    ver = struct.unpack("<I", raw)[0] if raw else None
    dft = spec = None
    if ver == apx.SDFT_VERSION:
        dft = _read_span(f, size)
        spec = _read_span(f, size) if dft is not None else None
    if dft is None or spec is None:
        what = f"version {ver}, expected {apx.SDFT_VERSION}" if ver not in (None, apx.SDFT_VERSION) else "truncated"
        return DraftOutcome("draft", IGNORED, message="invalid draft state - ignored",
                            reason=f"invalid draft state ({what}) - ignored; the draft starts empty")
    return DraftOutcome("draft", RESTORED, f.tell() - offset, dft=dft, spec=spec)


def load_slot_draft(f: BinaryIO, offset: int, size: int, *, has_draft_context: bool,
                    set_draft: Callable[[Span], str | None],
                    set_speculative: Callable[[Span], Outcome] | None = None) -> DraftOutcome:
    """``load_slot_draft`` (draft-state change ea736c1d5, tools/server/server-context.cpp): the slot's draft sequence is
    first cleared (the caller's job), then :func:`read_slot_draft`. A non-empty draft blob goes to the draft
    context: ``set_draft(span)`` restores it and returns None, or says why the draft context did not take
    it; without a draft context, or when it does not take it, the draft is cleared and the state "does not
    match the draft context - dropped", its bytes consumed. Then, unless dropped, a non-empty speculative
    state is set (even with an empty draft blob): ``set_speculative(span)`` (default
    :func:`apply_speculative_state` with no speculative decoder that keeps one).
    Never set after a drop: load_slot_draft (llama.cpp ea736c1d5) returns before it.
    """
    out = read_slot_draft(f, offset, size)
    if out.status != RESTORED:
        return out
    if out.dft.size:
        why = "no draft model (-md) to restore it into" if not has_draft_context else set_draft(out.dft)
        if why:
            return DraftOutcome("draft", DROPPED, out.bytes, message="draft state does not match the draft context"
                                " - dropped", reason=f"draft state does not match the draft context - dropped: "
                                                     f"{why}", dft=out.dft, spec=out.spec)
    spec = None
    if out.spec.size:
        spec = (set_speculative or (lambda span: apply_speculative_state(span, keeps=False)))(out.spec)
    return DraftOutcome("draft", RESTORED, out.bytes, message="restored the draft state", dft=out.dft,
                        spec=out.spec, speculative=spec)


def apply_speculative_state(span: Span, *, keeps: bool, expected_size: int | None = None) -> Outcome:
    """``common_speculative_set_state`` (b11434 common/speculative.cpp): each speculative decoder of the
    server is offered the state. Only eagle3 keeps one, for recurrent or hybrid targets (``keeps``:
    :func:`slotctl.server.speculative.keeps_state`), and its ``set_state`` silently ignores a state of
    another size than ``expected_size``; every other decoder (draft-simple, ngram, ...) ignores it."""
    if not keeps:
        return Outcome("speculative", IGNORED, 0, reason=f"{span.size:,} bytes of speculative state; no speculative "
                                                         "decoder of this server keeps one")
    if expected_size is not None and span.size != expected_size:
        return Outcome("speculative", IGNORED, 0, reason=f"eagle3 state of {span.size:,} bytes, expected "
                                                         f"{expected_size:,}: ignored")
    return Outcome("speculative", RESTORED, 0)
