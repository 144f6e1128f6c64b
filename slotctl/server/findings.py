"""What a server would refuse, drop or silently ignore in a slot file, found from its structure alone.

Each :class:`Finding` has a severity: ``error`` (the server refuses the file, or aborts on it), ``drop``
(the server restores it but loses a layer), ``note`` (worth knowing; nothing is lost by a current server).
``inspect`` shows them as warnings; ``validate`` applies the server's own rules too (:class:`ServerRules`)
and adds what only the models and contexts can tell (:mod:`slotctl.validate`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import BinaryIO

import numpy as np

from slotctl.errors import FormatError
from slotctl.format import tokens as tokfmt
from slotctl.format.common import parse_bytes
from slotctl.server import builds
from slotctl.server.checkpoints import DEFAULT_CTX_CHECKPOINTS
from slotctl.slotfile import SlotFile, checkpoint_layer, is_checkpoint_layer, torn_magic



#: why a verdict that rests on the checkpoint loader is not certain (``Finding.doubt``)
READING_033DF86B6 = ("the checkpoint appendix is judged by a reading of upstream load_slot_checkpoints "
                     "(llama.cpp 033df86b6), code that neither sdist holds")


@dataclass(frozen=True)
class Finding:
    """One thing found in a file. ``doubt``: why what the finding says the server does is not settled by
    the sources slotctl reads (undefined behaviour in b11434's loader, or a reading of code neither sdist
    holds), or None; it makes the file's verdict uncertain (``certain: false``) and is not one of the
    finding's JSON keys."""

    layer: str
    severity: str      # "error", "drop" or "note"
    code: str
    message: str
    offset: int | None = None
    doubt: str | None = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "doubt"}


@dataclass(frozen=True)
class ServerRules:
    """The rules of the server a file is restored by, for :func:`structural_findings` (``validate``).

    ``state_version``: the only state version the server's loader accepts (llama.cpp compares it
    exactly). ``mmproj``: the server has a multimodal projector (``--mmproj``), without which a prompt
    with media chunks is refused.

    With rules, findings follow the server of llama.cpp ea736c1d5 (``load_slot_draft``) and
    b11434's ``common_prompt_checkpoint::load_tgt``: the checkpoint appendix loader checks framing and
    lengths only, so a checkpoint blob that is damaged inside is kept, and the server aborts
    (``GGML_ABORT("checkpoint size mismatch")``) when it rolls back to it: an ``error`` on the layer
    ``checkpoint N target`` / ``checkpoint N draft``, not a drop. Cells the loader rejects whatever the
    context (``state_read_meta``) are named: ``invalid_cell``, ``recurrent_cells``.
    """

    state_version: int | None = 4
    mmproj: bool = False
    #: the build judged for (:mod:`slotctl.server.builds`): b11669's checkpoint rules are measured (no doubt;
    #: a damaged checkpoint blob is dropped, never an abort)
    build: str = builds.NEWEST


def structural_findings(sf: SlotFile, *, n_ctx_checkpoints: int = DEFAULT_CTX_CHECKPOINTS,
                        server: ServerRules | None = None, f: BinaryIO | None = None,
                        build: str | None = None) -> list[Finding]:
    """Findings from the parsed layers (no models needed); with ``server``, its rules too. ``f``: the file,
    open (the few bytes read again come from it; without it the file is opened for them). ``build``: the
    build judged for (default the server's, else :data:`slotctl.server.builds.NEWEST`).

    They are about what a server does with the file; what slotctl's own llama-cpp-python can load is
    said only where it loads the file (``restore``, validate's real check).
    """
    rules = builds.get(build or (server.build if server is not None else builds.NEWEST))
    reading = None if rules.measured else READING_033DF86B6
    out: list[Finding] = []
    for e in sf.errors:
        layer = e.part or e.layer       # the slot file's layer the walk recorded it for
        if not rules.reads_checkpoints and (layer.startswith(("SCKP", "SDFT")) or is_checkpoint_layer(layer)):
            continue    # a build that reads no appendix (b11434): appendix_needs_new_server says it is ignored
        if server is not None and is_checkpoint_layer(layer):
            out.append(checkpoint_blob_finding(layer.removesuffix(" blob"), e.one_line(), e.offset, rules.name))
        elif layer.startswith("SCKP") and e.expected.startswith("checkpoint count of at most"):
            out.append(Finding("checkpoints", "note", "checkpoints_unread",
                               f"{e.one_line()}: more checkpoints than slotctl reads (its own bound; a server "
                               "writes at most its --ctx-checkpoints); the server's loader has no such cap: "
                               "it reads them and keeps the newest --ctx-checkpoints, unchecked here", e.offset,
                               doubt=f"{reading or 'measured on ' + rules.name}, and the checkpoints were not read"))
        elif layer.startswith("SCKP") or is_checkpoint_layer(layer):
            behind = (", and any draft state behind it (the draft loader looks for SDFT right after the "
                      "payload)") if server is not None else ""
            out.append(Finding("checkpoints", "drop", "checkpoints_damaged",
                               f"{e.one_line()}: the server ignores the checkpoint appendix (\"invalid context "
                               f"checkpoint appendix - ignored\") and reads none of it{behind}", e.offset,
                               doubt=reading))
        elif layer.startswith("SDFT draft blob"):
            # load_slot_draft (llama.cpp ea736c1d5): the appendix is well framed, llama_state_seq_set_data_ext refuses the blob
            out.append(Finding("draft", "drop", "draft_dropped",
                               f"{e.one_line()}: the draft blob is no state llama.cpp loads; the server drops it "
                               "(\"draft state ... does not match the draft context - dropped\"), counts its bytes "
                               "as read, and the draft starts empty", e.offset))
        elif layer.startswith("SDFT"):
            out.append(Finding("draft", "drop", "draft_damaged",
                               f"{e.one_line()}: the server reports an invalid draft state (\"invalid draft state ... - "
                               "ignored\"), reads none of it, and starts the draft empty",
                               e.offset))
        else:
            out.append(Finding(layer, "error", e.error_code, e.one_line(), e.offset))
    if sf.version is None:
        return out
    if server is not None and server.state_version is not None and sf.version != server.state_version:
        out.append(Finding("state header", "error", "version_mismatch",
                           f"state version {sf.version}: a server of state version {server.state_version} loads no "
                           "other (\"unknown (magic, version)\"); a server of state version "
                           f"{sf.version} restores it, or convert the file: slotctl convert FILE -o OUT "
                           f"--state-version {server.state_version} (exact, or refused; -m MODEL for a quantized "
                           "cache)", 4))
    lacks = [(n, a) for n, a, has in (("checkpoints (SCKP) need a server with the checkpoint change (PR #26004, "
                                       "llama.cpp 033df86b6)", sf.sckp, rules.reads_checkpoints),
                                      ("draft state (SDFT) needs one with the draft-state change (llama.cpp "
                                       "ea736c1d5)", sf.sdft, rules.reads_draft_state)) if a and not has]
    if lacks:
        # SCKP: the checkpoint change (PR #26004, llama.cpp 033df86b6); SDFT: the draft-state change
        # (ea736c1d5) on top of it. b11434 predates both: it restores the target and reads no appendix.
        # Said only when the build judged for lacks the change (b11669 has both).
        names = " and ".join(n for n, _ in lacks)
        out.append(Finding("appendix", "note", "appendix_needs_new_server",
                           f"the {names}; llama.cpp {rules.name} (the build judged for) restores the target and "
                           f"silently ignores {'them' if len(lacks) > 1 else 'it'}",
                           lacks[0][1].offset, doubt=reading if sf.sckp else None))
    tk = sf.tokens
    if tk is not None and not tk.error:
        if tk.format == "legacy":
            out.append(Finding("token words", "note", "legacy_tokens",
                               "legacy plain token list (written by an older server); restores as text tokens", 12))
        if tk.media and server is not None and not server.mmproj:
            out.append(Finding("token words", "error", "media_without_mmproj",
                               f"{len(tk.media)} media chunk(s) and the server has no mmproj: it refuses the file "
                               "(\"Cannot restore media tokens without an mmproj\"): start it with --mmproj", 12))
        elif tk.media and server is not None:
            out += _media_findings(sf, f)
        elif tk.media:
            out.append(Finding("token words", "note", "media",
                               f"{len(tk.media)} media chunk(s): the server restores them only with an mmproj "
                               "(\"Cannot restore media tokens without an mmproj\")", 12))
        if sf.target is not None:
            n_cells = _max_cells(sf)
            if n_cells is not None and tk.n_tokens and n_cells != tk.n_tokens and sf.target.layout.kind == "kv":
                out.append(Finding("target memory", "note", "cells_tokens_differ",
                                   f"the prompt has {tk.n_tokens:,} tokens, the target memory {n_cells:,} cells",
                                   sf.target.offset))
    empty = checkpoints_ignored(sf) if rules.reads_checkpoints else None
    if not rules.reads_checkpoints:
        pass
    elif empty is not None:
        out.append(Finding("checkpoints", "drop", "checkpoints_ignored",
                           f"checkpoint {empty} has an empty target blob: the server ignores the whole checkpoint "
                           "appendix (\"invalid context checkpoint appendix - ignored\") and reads none of it",
                           sf.sckp.offset, doubt=reading))
        if sf.sdft is not None:
            out.append(Finding("draft", "drop", "draft_unreachable",
                               "the draft state behind the ignored checkpoint appendix is never read: the server looks "
                               "for it right after the payload, finds the checkpoint appendix there, and starts the "
                               "draft empty (silently)", sf.sdft.offset, doubt=reading))
    elif sf.checkpoints is not None and len(sf.checkpoints) > n_ctx_checkpoints:
        out.append(Finding("checkpoints", "drop", "too_many_checkpoints",
                           f"{len(sf.checkpoints)} checkpoints: a server keeps the last {n_ctx_checkpoints} "
                           "(--ctx-checkpoints) and drops the rest", sf.sckp.offset, doubt=reading))
    if sf.sdft is not None and sf.draft is not None and sf.draft.span.size == 0 and rules.reads_draft_state:
        out.append(Finding("draft", "note", "draft_empty",
                           "the draft appendix holds only speculative state; the draft context starts empty",
                           sf.sdft.offset))
    if sf.trailing is not None and sf.trailing.size and not sf.errors:
        tail = _head(sf, 4, f)
        if torn_magic(tail):
            # load_slot_draft (llama.cpp ea736c1d5): `if (!ckpt_read(ifs, &magic, ...) || magic != SLOT_DRAFT_MAGIC) return 0;`
            out.append(Finding("appendix", "note", "torn_appendix_magic",
                               f"the file ends {len(tail)} byte(s) into an appendix magic ({_printable(tail)}), what "
                               "a torn append leaves: the server reads no complete magic there and restores the "
                               "rest without it (no draft state, nothing dropped)", sf.trailing.offset))
        else:
            out.append(Finding("trailing bytes", "note", "trailing_bytes",
                               f"{sf.trailing.size:,} bytes after the last layer; the server ignores them",
                               sf.trailing.offset))
    if server is not None:
        out += _cell_findings(sf)
    return out


def checkpoint_blob_finding(layer: str, what: str, offset: int | None, build: str) -> Finding:
    """A checkpoint blob (``layer``: "checkpoint N target" / "checkpoint N draft") that is no state the
    server's context loads (``what``: why), as the build judged for treats it. b11669 (measured) drops a
    draft blob on restore ("draft context checkpoint data ... does not match the draft context - dropped")
    and keeps the checkpoint; it keeps a target blob unchecked, and a request going back to that checkpoint
    fails to load it ("failed to load context checkpoint restored from a slot file") and evaluates the whole
    prompt again. The reading of 033df86b6 (the loader checks only lengths; a rollback aborts): an error."""
    rules = builds.get(build)
    if rules.aborts_on_bad_checkpoint:
        return Finding(layer, "error", "checkpoint_blob_damaged",
                       f"{what}: no state llama.cpp loads; the checkpoint appendix loader checks only lengths, so "
                       "the server keeps this checkpoint", offset, doubt=None if rules.measured else READING_033DF86B6)
    if layer.endswith("draft"):
        return Finding(layer, "drop", "checkpoint_draft_dropped",
                       f"{what}: the server drops this draft blob when it restores the file (\"draft context "
                       "checkpoint data ... does not match the draft context - dropped\") and keeps the checkpoint "
                       "without it", offset)
    return Finding(layer, "drop", "checkpoint_blob_damaged",
                   f"{what}: no state the target context loads; the server keeps the checkpoint unchecked", offset)


def media_extents(sf: SlotFile, f: BinaryIO | None = None) -> dict:
    """Each media chunk of the token words, by its start index: what ``server_tokens::validate`` asks of it
    (:class:`slotctl.server.restore.MediaExtent`), None for a chunk the server's chunk loader cannot read."""
    from slotctl.server.restore import chunk_extent

    out = {}
    if sf.tokens is None or not sf.tokens.media:
        return out
    with _opened(sf, f) as f:
        for start, chunk in sf.tokens.media:
            out[int(start)] = chunk_extent(chunk.read(f) if hasattr(chunk, "read") else bytes(chunk))
    return out


def invalid_tokens_finding(tokens, n_vocab: int, media=(), model_name: str = "the model") -> Finding | None:
    """The one finding for tokens ``server_tokens::validate`` rejects (b11434; the rule:
    :func:`slotctl.server.restore.invalid_token_indices`; ``media``: :func:`media_extents`, or the chunks'
    start indices alone): code ``invalid_tokens``, the server refuses the file ("Invalid tokens in slot save
    file"). None when every token is valid. Read by inspect and validate."""
    from slotctl.server.restore import invalid_token_indices

    toks = np.asarray(tokens)
    idx = invalid_token_indices(toks, n_vocab, media)
    if not len(idx):
        return None
    first = int(idx[0])
    more = f" (and {len(idx) - 1:,} more token{'s' if len(idx) > 2 else ''})" if len(idx) > 1 else ""
    if int(toks[first]) == -1:
        return Finding("token words", "error", "invalid_tokens",
                       f"the -1 word at index {first}{more} is no media chunk's as the server counts them (a chunk "
                       "starts there, is not text, has tokens and positions, and exactly its token count of -1 "
                       "words follow; every chunk is met so) (\"Invalid tokens in slot save file\"): the server "
                       "refuses the file", 12)
    return Finding("token words", "error", "invalid_tokens",
                   f"token {int(toks[first])} at index {first}{more} is outside the vocabulary of {model_name} "
                   f"[0, {n_vocab:,}) (\"Invalid tokens in slot save file\"): the server refuses the file; it was "
                   "saved with another model", 12)


def checkpoints_read(sf: SlotFile) -> bool:
    """Whether the server keeps this file's checkpoints (or it has none to keep): the parsed-file form of
    :func:`slotctl.server.restore.load_slot_checkpoints`' rule, which every command reads here. The
    appendix is ignored whole when its framing is damaged (another version, too many checkpoints, one cut
    short or with a length beyond the file: an error recorded for the "SCKP appendix" layer) or a
    checkpoint has an empty target blob (:func:`checkpoints_ignored`); a blob llama.cpp would not load is
    still kept, since the loader checks only lengths."""
    if checkpoints_ignored(sf) is not None:
        return False
    return not any((e.part or e.layer).startswith("SCKP") for e in sf.errors)


def checkpoints_ignored(sf: SlotFile) -> int | None:
    """The first checkpoint with an empty target blob, for which the server ignores the whole appendix.

    From two readings of upstream ``load_slot_checkpoints`` (llama.cpp commit 033df86b6, in neither
    sdist): an empty ``data_tgt`` makes it return 0 ("invalid context checkpoint appendix - ignored"),
    so nothing of the appendix is kept and the draft loader then looks for SDFT where SCKP starts.
    """
    for i, c in enumerate(sf.checkpoints or ()):
        if c.tgt.span.size == 0:
            return i
    return None


def _head(sf: SlotFile, n: int, f: BinaryIO | None = None) -> bytes:
    with _opened(sf, f) as f:
        f.seek(sf.trailing.offset)
        return f.read(min(n, sf.trailing.size))


def _opened(sf: SlotFile, f: BinaryIO | None):
    """``f`` when the caller gives a stream, else the stream the file was parsed from (never its name)."""
    return nullcontext(f if f is not None else sf.stream)


def _printable(b: bytes) -> str:
    return '"' + "".join(chr(c) if 32 <= c < 127 and c != 34 else f"\\x{c:02x}" for c in b) + '"'


def _memories(sf: SlotFile):
    """(layer name, Memory, what a bad cell makes the server do) of every parsed memory layer."""
    if sf.target is not None:
        yield "target memory", sf.target, "error"
    for i, c in enumerate(sf.checkpoints or ()):
        for kind, b in (("target", c.tgt), ("draft", c.dft)):
            if b.memory is not None:
                yield checkpoint_layer(i, kind), b.memory, "error"
    if sf.draft is not None and sf.draft.memory is not None:
        yield "draft", sf.draft.memory, "drop"


def _cell_findings(sf: SlotFile) -> list[Finding]:
    """Cells llama.cpp's single-sequence loader rejects whatever the context (``state_read_meta``).

    A KV cell lists exactly one sequence id ("invalid seq_id-agnostic kv cell"), a recurrent cell none;
    a sequence's recurrent state is at most one cell: with more, the loader finds "not enough cells" in
    a one-slot context and fails an assertion (GGML_ASSERT, the process aborts) with more slots.
    """
    out: list[Finding] = []
    for layer, mem, severity in _memories(sf):
        for sec, span in zip(mem.sections, mem.section_spans):
            if sec.type == "kv":
                cells_list = [st.cells for st in sec.streams if st.cell_count]
                want = 1
            else:
                cells_list = [sec.cells] if sec.cell_count else []
                want = 0
                if sec.cell_count > 1:
                    out.append(Finding(layer, severity, "recurrent_cells",
                                       f"the recurrent state holds {sec.cell_count:,} cells; a slot's is at most 1: "
                                       "llama.cpp refuses it with one slot (\"not enough cells\") and aborts "
                                       "(GGML_ASSERT) with more", span.offset))
            for cells in cells_list:
                bad = np.flatnonzero(np.asarray(cells.n_seq_id) != want)
                if len(bad):
                    i = int(bad[0])
                    out.append(Finding(layer, severity, "invalid_cell",
                                       f"cell {i} lists {int(cells.n_seq_id[i])} sequence ids, a single-slot save "
                                       f"{want} ({len(bad):,} such cells): llama.cpp refuses it (\"invalid "
                                       "seq_id-agnostic kv cell\")", span.offset))
                    break
    return out


def _media_findings(sf: SlotFile, f: BinaryIO | None = None) -> list[Finding]:
    """Media chunks the server's ``mtmd_input_chunk_load`` cannot read ("Cannot load media chunk")."""
    out: list[Finding] = []
    with _opened(sf, f) as f:
        for start, chunk in sf.tokens.media:
            data = chunk.read(f) if hasattr(chunk, "read") else bytes(chunk)
            where = f"media chunk at token {start}"
            try:
                chunk = parse_bytes(tokfmt.MediaChunk, data, where)
            except FormatError as e:
                out.append(_media_refused(e.one_line()))
                break
            # mtmd_input_chunk::deserialize (b11434 tools/mtmd/mtmd.cpp): a chunk whose type names a payload
            # it does not carry is refused; bytes after the payload are never read
            missing = {1: ("image", chunk.has_image), 2: ("audio", chunk.has_audio)}.get(chunk.type)
            if missing and not missing[1]:
                out.append(_media_refused(f"{where}: type {missing[0]} but no {missing[0]} tokens "
                                          f"(\"type is {missing[0].upper()} but tokens_{missing[0]} is missing\")"))
                break
            if chunk.trailing:
                out.append(Finding("token words", "note", "media_trailing_bytes",
                                   f"{where}: {len(chunk.trailing):,} bytes after its payload, which the "
                                   "server's chunk loader never reads", 12))
    return out


def _media_refused(why: str) -> Finding:
    return Finding("token words", "error", "media_damaged",
                   f"{why}: the server refuses the file (\"Cannot load media chunk from server tokens state\")", 12)


def _max_cells(sf: SlotFile) -> int | None:
    sec = sf.target.sections[0] if sf.target.sections else None
    if sec is None or sec.type != "kv":
        return None
    return sum(s.cell_count for s in sec.streams)


def file_findings(sf: SlotFile, build: str = builds.NEWEST) -> list[Finding]:
    """What ``inspect`` reports for the build judged for: the notes of the walk through the layers, then the
    structural findings."""
    return [Finding("file", "note", "walk_note", w) for w in sf.warnings] + structural_findings(sf, build=build)
