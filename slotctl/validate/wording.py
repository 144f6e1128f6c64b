"""How validate names layouts, layers and counts in its findings (the words, nothing else)."""

from __future__ import annotations

from typing import Sequence

from slotctl.format.memory import MemoryLayout
from slotctl.model.info import ModelInfo


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _layers_text(ids: Sequence[int]) -> str:
    """"layer 3", "layers 0 and 1", "layers 0, 1 and 2", "32 layers from layer 0"."""
    ids = [int(i) for i in ids]
    if len(ids) == 1:
        return f"layer {ids[0]}"
    if len(ids) > 6:
        return f"{len(ids)} layers from layer {ids[0]}"
    return "layers " + ", ".join(map(str, ids[:-1])) + f" and {ids[-1]}"


#: a memory kind in words (``MemoryLayout.kind``)
_KIND_WORDS = {
    "kv": "a plain KV cache",
    "iswa": "an iSWA cache (base and SWA KV)",
    "recurrent": "a recurrent state",
    "hybrid": "a hybrid memory (attention KV and recurrent state)",
    "hybrid_iswa": "a hybrid memory with SWA (base KV, SWA KV and recurrent state)",
    "none": "nothing (a model without memory)",
}


def _kind_words(layout: MemoryLayout) -> str:
    words = _KIND_WORDS.get(layout.kind, layout.kind)
    rec = [s for s in layout.sections if s.type == "recurrent"]
    if rec:
        words += f" with state for {_plural(rec[0].n_r, 'layer')}"
    if any(s.type == "kv" and s.has_ext for s in layout.sections):
        words += " (cells with M-RoPE positions)"
    return words


#: what the PARTIAL_ONLY part of each memory kind is (``MemoryLayout.partial``)
_PART_WORDS = {
    "iswa": "the SWA part of an iSWA cache",
    "hybrid": "the recurrent part of a hybrid memory",
    "hybrid_iswa": "the SWA and recurrent parts of a hybrid memory with SWA",
}


def _part_words(layout: MemoryLayout) -> str:
    """A checkpoint blob's layout in words: its sections, and which kinds write such a part."""
    kv = [s for s in layout.sections if s.type == "kv"]
    rec = [s for s in layout.sections if s.type == "recurrent"]
    state = f" with state for {_plural(rec[0].n_r, 'layer')}" if rec else ""
    if len(layout.sections) == 1 and kv:
        return "a KV cache alone (the SWA part of an iSWA cache, or a whole plain KV cache)"
    if len(layout.sections) == 1 and rec:
        return f"a recurrent state alone{state} (the recurrent part of a hybrid memory, or a recurrent model's state)"
    if len(kv) == 1 and rec:
        return (f"a KV cache and a recurrent state{state} (the SWA and recurrent parts of a hybrid memory with "
                "SWA, or a whole hybrid memory)")
    return _kind_words(layout)


def _want_part_words(info: ModelInfo) -> str:
    """What the model keeps in a checkpoint blob (its PARTIAL_ONLY part), in words."""
    layout = info.layout()
    if layout.kind not in _PART_WORDS:
        return _kind_words(layout)
    rec = [s for s in layout.sections if s.type == "recurrent"]
    state = f" (state for {_plural(rec[0].n_r, 'layer')})" if rec else ""
    return _PART_WORDS[layout.kind] + state


#: why a checkpoint blob that does not fit is only a note for a memory kind whose server never rolls back
#: (``check._weigh_rollback``); true only of a file that restores: :meth:`report.FileReport.ordered_findings`
#: drops it from the notes of a file the server refuses or aborts on
ROLLBACK_HARMLESS = ("harmless here: the file restores with it, and no request makes this server load it: its "
                     "memory starts at 0 (a plain KV cache, or SWA with --swa-full), so it goes back only to a "
                     "checkpoint of positions 0..1, for a request of one token (it would abort on this one: "
                     "\"checkpoint size mismatch\")")


#: what a finding says a model given does not fit the file it is given with, and what to do
ANOTHER_MODEL = "the file was saved with another model (give -m the one it was saved with)"


def kind_mismatch_words(layout: MemoryLayout, info: ModelInfo) -> str:
    """A target memory of another kind than the model's (``memory_kind_mismatch``)."""
    from pathlib import Path

    return (f"the target memory is {_kind_words(layout)}, but {Path(info.path).name} ({info.arch}) keeps "
            f"{_kind_words(info.layout())}: {ANOTHER_MODEL}")


def shape_mismatch_words(facts: Sequence[str], info: ModelInfo) -> str:
    """A target memory of the model's kind but another shape (:func:`slotctl.model.fit.shape_differences`)."""
    from pathlib import Path

    return f"the target memory does not have the shape of {Path(info.path).name} ({info.arch}): " \
           f"{'; '.join(facts)}: {ANOTHER_MODEL}"
