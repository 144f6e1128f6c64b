"""What a server would refuse, drop or silently ignore in a slot file, found from its structure alone.

Each :class:`Finding` has a severity: ``error`` (the server refuses the file), ``drop`` (the server
restores it but loses a layer), ``note`` (worth knowing; nothing is lost by a current server).
``inspect`` shows them as warnings; ``validate`` adds what only the models and contexts can tell.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from slotctl.slotfile import SlotFile

#: llama-server's default ``--ctx-checkpoints`` (b11434 common/common.h)
DEFAULT_CTX_CHECKPOINTS = 32


@dataclass(frozen=True)
class Finding:
    layer: str
    severity: str      # "error", "drop" or "note"
    code: str
    message: str
    offset: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def structural_findings(sf: SlotFile, *, runtime_version: int | None = None,
                        n_ctx_checkpoints: int = DEFAULT_CTX_CHECKPOINTS) -> list[Finding]:
    """Findings from the parsed layers (no models needed)."""
    out: list[Finding] = []
    for e in sf.errors:
        layer = e.layer.split(":")[0].split(" (")[0]
        if layer.startswith("SCKP") or layer.startswith("checkpoint"):
            out.append(Finding("checkpoints", "drop", "checkpoints_damaged",
                               f"{e.one_line()}: the server ignores the checkpoint appendix", e.offset))
        elif layer.startswith("SDFT"):
            out.append(Finding("draft", "drop", "draft_damaged",
                               f"{e.one_line()}: the server reports an invalid draft state and starts the draft empty",
                               e.offset))
        else:
            out.append(Finding(layer, "error", "damaged", e.one_line(), e.offset))
    if sf.version is None:
        return out
    if runtime_version is not None and sf.version != runtime_version:
        out.append(Finding("state header", "note", "version_mismatch",
                           f"state version {sf.version}: this llama-cpp-python reads only version {runtime_version}"
                           " (slotctl restore converts when that is exact)", 4))
    if sf.sckp or sf.sdft:
        names = " and ".join(n for n, a in (("checkpoints (SCKP)", sf.sckp), ("draft state (SDFT)", sf.sdft)) if a)
        out.append(Finding("appendix", "note", "appendix_needs_new_server",
                           f"the {names} need a server with the slot draft-state change; llama.cpp b11434 and "
                           "older restore the target and silently ignore them",
                           (sf.sckp or sf.sdft).offset))
    tk = sf.tokens
    if tk is not None and not tk.error:
        if tk.format == "legacy":
            out.append(Finding("token words", "note", "legacy_tokens",
                               "legacy plain token list (written by an older server); restores as text tokens", 12))
        if tk.media:
            out.append(Finding("token words", "note", "media",
                               f"{len(tk.media)} media chunk(s): the server restores them only with an mmproj "
                               "(\"Cannot restore media tokens without an mmproj\")", 12))
        if sf.target is not None:
            n_cells = _max_cells(sf)
            if n_cells is not None and tk.n_tokens and n_cells != tk.n_tokens and sf.target.layout.kind == "kv":
                out.append(Finding("target memory", "note", "cells_tokens_differ",
                                   f"the prompt has {tk.n_tokens:,} tokens, the target memory {n_cells:,} cells",
                                   sf.target.offset))
    if sf.checkpoints is not None and len(sf.checkpoints) > n_ctx_checkpoints:
        out.append(Finding("checkpoints", "drop", "too_many_checkpoints",
                           f"{len(sf.checkpoints)} checkpoints: a server keeps the last {n_ctx_checkpoints} "
                           "(--ctx-checkpoints) and drops the rest", sf.sckp.offset))
    if sf.sdft is not None and sf.draft is not None and sf.draft.span.size == 0:
        out.append(Finding("draft", "note", "draft_empty",
                           "the draft appendix holds only speculative state; the draft context starts empty",
                           sf.sdft.offset))
    if sf.trailing is not None and sf.trailing.size and not sf.errors:
        out.append(Finding("trailing bytes", "note", "trailing_bytes",
                           f"{sf.trailing.size:,} bytes after the last layer; the server ignores them",
                           sf.trailing.offset))
    return out


def _max_cells(sf: SlotFile) -> int | None:
    sec = sf.target.sections[0] if sf.target.sections else None
    if sec is None or sec.type != "kv":
        return None
    return sum(s.cell_count for s in sec.streams)


def file_warnings(sf: SlotFile, *, runtime_version: int | None = None) -> list[str]:
    """The non-error findings as warning lines (errors are reported separately)."""
    return [f.message for f in structural_findings(sf, runtime_version=runtime_version)
            if f.code != "damaged"]
