"""The speculative states of a file (SDFT ``data_spec``, each checkpoint's ``spec``) against the decoder the
draft model makes the server run (:mod:`slotctl.server.speculative`)."""

from __future__ import annotations

from typing import BinaryIO

from slotctl.server.findings import Finding
from slotctl.server.speculative import decoder_kind, expected_size, keeps_state, parse_state
from slotctl.slotfile import SlotFile


def speculative_findings(sf: SlotFile, f: BinaryIO, tinfo, dinfo, types: tuple[str, ...] | None = None) -> list[Finding]:
    """What becomes of each non-empty speculative state: ignored by a decoder that keeps none (a note), or,
    for eagle3 with a recurrent or hybrid target, applied when its size is the draft model's, whatever its
    values (``set_state`` checks the size only: a row that is not finite is applied, a note), and a state
    of another size silently dropped by ``set_state`` (a drop for the live state, a note for a
    checkpoint's, which only a rollback would load). Without a target model nothing is said (the decoder
    is unknown). ``types``: the server's speculative types (:func:`slotctl.server.speculative.server_spec_types`;
    eagle3 only with "draft-eagle3")."""
    if tinfo is None:
        return []
    kind = decoder_kind(dinfo, types)
    keeps = keeps_state(kind, tinfo)
    want = expected_size(kind, dinfo)
    states = [(i, c.spec) for i, c in enumerate(sf.checkpoints or ())]
    if sf.draft_spec is not None and sf.draft_spec.size:
        states.append((None, sf.draft_spec))
    out: list[Finding] = []
    for i, span in states:
        if not span.size:
            continue
        layer = "draft" if i is None else f"checkpoint {i} speculative"
        if not keeps:
            who = ("no draft context" if dinfo is None
                   else f"its drafter ({', '.join(types or ()) or dinfo.arch}) keeps none" if kind is None
                   else f"eagle3 keeps one only for recurrent or hybrid targets, {tinfo.arch} is {tinfo.memory_kind}")
            out.append(Finding(layer, "note", "speculative_state_ignored",
                               f"{span.size:,} bytes of speculative state: the server ignores them ({who})",
                               span.offset))
            continue
        st = parse_state(span.read(f), kind, dinfo)
        if not st.error and st.non_finite:
            out.append(Finding(layer, "note", "speculative_state_not_finite",
                               f"eagle3 speculative state of {st.size:,} bytes whose row holds {st.non_finite:,} "
                               "values that are not finite: common_speculative_set_state checks the size only and "
                               "applies it, and the draft's next proposals start from that row (the target "
                               "still verifies each one)", span.offset))
        if st.error:
            severity = "drop" if i is None else "note"
            out.append(Finding(layer, severity, "speculative_state_mismatch",
                               f"eagle3 speculative state of {st.size:,} bytes, the draft model's takes {want:,} "
                               f"({st.error}): common_speculative_set_state ignores it", span.offset))
    return out
