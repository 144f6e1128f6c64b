"""Layer 2: the memory payload, a concatenation of sections whose kinds the file does not name.

A :class:`MemoryLayout` lists the sections a memory kind writes; the GGUF says which layout applies
(:mod:`slotctl.model`), or, without it, :func:`candidate_layouts` lists the layouts worth trying.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

import construct as cs

from slotctl.format.kv import kv_section
from slotctl.format.recurrent import recurrent_section


@dataclass(frozen=True)
class SectionLayout:
    """One section of a payload.

    ``type``: "kv" or "recurrent"; ``role``: what the section holds ("kv", "base", "swa", "attention",
    "recurrent"). KV: ``has_ext`` (cell ext), ``v_records`` (False for MLA). Recurrent: ``n_r``/``n_s``,
    the number of r and s records (layers that carry recurrent state).
    """

    type: str
    role: str = "kv"
    has_ext: bool = False
    v_records: bool = True
    n_r: int = 0
    n_s: int = 0

    def schema(self) -> cs.Construct:
        return _schema(self)

    def describe(self) -> str:
        if self.type == "kv":
            extra = [x for x, on in (("ext", self.has_ext), ("no V", not self.v_records)) if on]
            return f"{self.role} KV" + (f" ({', '.join(extra)})" if extra else "")
        return f"recurrent ({self.n_r} r, {self.n_s} s records)"


@lru_cache(maxsize=None)
def _schema(s: SectionLayout) -> cs.Construct:
    if s.type == "kv":
        return kv_section(has_ext=s.has_ext, v_records=s.v_records)
    if s.type == "recurrent":
        return recurrent_section(n_r=s.n_r, n_s=s.n_s)
    raise ValueError(f"unknown section type {s.type!r}")


@dataclass(frozen=True)
class MemoryLayout:
    """A memory kind as the sections it writes, in order."""

    kind: str
    sections: tuple[SectionLayout, ...] = field(default_factory=tuple)

    def partial(self) -> "MemoryLayout":
        """The layout of a PARTIAL_ONLY blob: only what cannot be rolled back.

        iSWA: the SWA part; hybrid: the recurrent part; hybrid_iswa: the SWA and recurrent parts;
        plain KV and recurrent: everything.
        """
        if self.kind in ("iswa", "hybrid", "hybrid_iswa"):
            keep = tuple(s for s in self.sections if s.role in ("swa", "recurrent"))
            return replace(self, sections=keep)
        return self

    def describe(self) -> str:
        return f"{self.kind}: " + " + ".join(s.describe() for s in self.sections) if self.sections else self.kind


def plain_kv(has_ext: bool = False, v_records: bool = True) -> MemoryLayout:
    return MemoryLayout("kv", (SectionLayout("kv", "kv", has_ext, v_records),))


@lru_cache(maxsize=None)
def candidate_layouts(max_recurrent_layers: int = 8) -> tuple[MemoryLayout, ...]:
    """Layouts tried when no GGUF says which applies, most common first."""
    out = [plain_kv(False), plain_kv(True), plain_kv(False, v_records=False)]
    out.append(MemoryLayout("iswa", (SectionLayout("kv", "base"), SectionLayout("kv", "swa"))))
    out.append(MemoryLayout("iswa", (SectionLayout("kv", "base", True), SectionLayout("kv", "swa", True))))
    for k in range(1, max_recurrent_layers + 1):
        out.append(MemoryLayout("recurrent", (SectionLayout("recurrent", "recurrent", n_r=k, n_s=k),)))
    for k in range(1, max_recurrent_layers + 1):
        out.append(MemoryLayout("hybrid", (SectionLayout("kv", "attention"),
                                           SectionLayout("recurrent", "recurrent", n_r=k, n_s=k))))
    for k in range(1, max_recurrent_layers + 1):
        out.append(MemoryLayout("hybrid_iswa", (SectionLayout("kv", "base"), SectionLayout("kv", "swa"),
                                                SectionLayout("recurrent", "recurrent", n_r=k, n_s=k))))
    return tuple(out)
