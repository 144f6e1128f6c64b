"""What a running llama-server says about its flags, turned into the flags to validate a file for it.

``validate --server URL`` validates for that server: its own model and flags where it reports them
(:class:`~slotctl.live.http.ServerFacts`), the flags given on the command line first, llama-server's
defaults for the rest, each with where it came from (:func:`learn_flags`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotctl.errors import UsageError
from slotctl.server.flags import ServerFlags, flag_name
from slotctl.live.http import ServerFacts

#: flags b11434 does not report (``/props``, ``/slots``): validated as given, or with the server's defaults
UNREPORTED = ("cache_type_k", "cache_type_v", "flash_attn", "spec_draft_type_k", "spec_draft_type_v", "batch_size",
              "ubatch_size", "swa_full", "ctx_checkpoints")


@dataclass
class LiveValidate:
    """The flags ``validate --server`` validates with, what the server said, and where each flag came from.

    ``server_flags``: the flags to validate with; ``flags``: the ones the server's facts decide, as shown
    (``-m``, ``-md``, ``-c``, ``-np``, ``-kvu``, ``--slot``, ``--mmproj``). ``sources`` maps each flag to ``"server"`` (learned from /props, /slots), ``"command line"`` (given:
    flags given win) or ``"default"`` (neither: slotctl's default, which is llama-server's).
    """

    facts: ServerFacts
    model: Path | None
    draft_model: Path | None
    server_flags: ServerFlags
    slot: int
    mmproj: bool
    learned: dict
    flags: dict
    sources: dict
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        f = self.facts
        return {"url": f.url, "build_info": f.build_info, "learned": self.learned, "flags": self.flags,
                "sources": self.sources, "notes": self.notes, "warnings": self.warnings}

    def annotate(self, doc: dict) -> dict:
        """``validate --json``'s document with this under ``server.live``."""
        doc.setdefault("server", {})["live"] = self.as_dict()
        return doc


def learn_flags(facts: ServerFacts, flags: ServerFlags, *, given: set[str], model: Path | None,
                draft_model: Path | None, slot: int, mmproj: bool, state_version: int) -> LiveValidate:
    """The flags to validate with for the server ``facts`` describe: its own where it says them, the ones in
    ``given`` (parameter names given on the command line) first.

    Learned: ``-m`` (``/props`` ``model_path``, used when that file exists on this machine), ``-np``
    (``total_slots``), ``-c`` (the slot's ``n_ctx`` from ``/slots``, times ``-np`` unless ``-kvu``), whether it
    has a multimodal projector (``modalities``), and whether the slot decodes speculatively (``/slots``).
    Not reported by b11434, so taken as given (or defaulted), each said in a note: the draft model,
    ``-kvu``, the flags of :data:`UNREPORTED` and ``--state-version``. UsageError when the server's model is
    not on this machine and no ``-m`` is given.
    """
    ctx_size, parallel, kv_unified = flags.ctx_size, flags.parallel, flags.kv_unified
    notes = list(facts.notes)
    warnings: list[str] = []
    sources: dict[str, str] = {}
    learned = {"model": facts.model_path, "total_slots": facts.total_slots, "n_ctx_slot": facts.n_ctx_slot,
               "n_ctx_from": facts.n_ctx_from, "speculative": facts.speculative,
               "speculative_types": facts.speculative_types, "mmproj": facts.mmproj,
               "model_meta": facts.model_meta}

    # -np
    if "parallel" in given:
        sources["parallel"] = "command line"
        if facts.total_slots is not None and facts.total_slots != parallel:
            notes.append(f"the server has {facts.total_slots} slot(s); validated for -np {parallel} as given")
    elif facts.total_slots is not None and facts.total_slots > 0:
        parallel, sources["parallel"] = facts.total_slots, "server"
    else:
        sources["parallel"] = "default"
        notes.append(f"/props has no total_slots: validated for -np {parallel}")
    if facts.total_slots and slot >= facts.total_slots and "parallel" not in given:
        raise UsageError(f"--slot {slot}: the server at {facts.url} has {facts.total_slots} slot(s), "
                         f"0..{facts.total_slots - 1}")

    # -kvu: not reported
    sources["kv_unified"] = "command line" if "kv_unified" in given else "default"
    if "kv_unified" not in given and parallel > 1:
        notes.append("the server does not report whether its cache is unified (-kvu): validated without; a "
                     "server started without -np runs 4 slots with a unified cache, pass -kvu for one")

    # -c
    n_stream = 1 if kv_unified else parallel
    if "ctx_size" in given:
        sources["ctx_size"] = "command line"
        if facts.n_ctx_slot is not None and ctx_size and ctx_size // n_stream != facts.n_ctx_slot:
            notes.append(f"the server's slots hold {facts.n_ctx_slot:,} tokens (GET {facts.n_ctx_from}); "
                         f"validated with -c {ctx_size} as given")
    elif facts.n_ctx_slot is not None and facts.n_ctx_slot > 0:
        ctx_size, sources["ctx_size"] = facts.n_ctx_slot * n_stream, "server"
    else:
        sources["ctx_size"] = "default"
        notes.append(f"the server did not say its slot context: validated with -c {ctx_size}")

    # --mmproj: only whether there is one matters
    if "mmproj" in given:
        sources["mmproj"] = "command line"
    else:
        mmproj, sources["mmproj"] = facts.mmproj, "server"

    # -m
    if "model" in given and model is not None:
        sources["model"] = "command line"
        if facts.model_path and os.path.abspath(os.fspath(model)) != os.path.abspath(facts.model_path):
            notes.append(f"the server runs {facts.model_path}; validated with -m {model} as given")
    elif facts.model_path is None:
        raise UsageError(f"the server at {facts.url} does not say its model path (GET /props model_path): give "
                         f"its GGUF with -m")
    elif os.path.isfile(facts.model_path):
        model, sources["model"] = Path(facts.model_path), "server"
    else:
        raise UsageError(f"the server's model {facts.model_path} (GET /props model_path, a path on the server's "
                         f"machine) is not a file here: give a copy of the same GGUF with -m")
    warnings += _model_identity(model, facts.model_meta)

    # -md: b11434 names no draft model anywhere
    if draft_model is not None:
        sources["draft_model"] = "command line"
        if facts.speculative is False:
            notes.append(f"GET /slots says slot {slot} does not decode speculatively (no draft model), yet -md was "
                         f"given: validated with it as asked")
        else:
            notes.append("the server does not name its draft model (b11434's /props and /slots do not): the "
                         "draft state is checked against -md as given")
    else:
        sources["draft_model"] = "unknown"
        if facts.speculative:
            types = f", speculative.types {facts.speculative_types}" if facts.speculative_types else ""
            notes.append(f"slot {slot} decodes speculatively (GET /slots{types}), but the server does not name "
                         f"its draft model (b11434's /props and /slots do not): the draft state (SDFT appendix, "
                         f"draft checkpoint blobs) is checked only with -md")

    # --spec-type: with -md, whether the server has a draft context at all (b11434 builds none for -md alone:
    # slotctl.server.speculative.draft_context); /slots says whether a slot speculates, and its types once it
    # ran a task
    spec_type = flags.spec_type
    if "spec_type" in given:
        sources["spec_type"] = "command line"
    elif facts.speculative_types:
        named = [t for t in facts.speculative_types.split(",") if t and t != "none"]
        from slotctl.server.speculative import SPEC_TYPE_NAMES

        if all(t in SPEC_TYPE_NAMES for t in named):
            spec_type, sources["spec_type"] = (",".join(named) or "none"), "server"
        else:
            sources["spec_type"] = "default"
            notes.append(f"the server's speculative types ({facts.speculative_types}) are not b11434's: validated "
                         "without --spec-type")
    elif facts.speculative and draft_model is not None:
        spec_type, sources["spec_type"] = "draft-simple", "server"
        notes.append(f"slot {slot} decodes speculatively (GET /slots) with a draft model: validated with a draft "
                     "context (--spec-type draft-simple; give --spec-type if the server runs another drafter)")
    else:
        sources["spec_type"] = "default"

    # what the server never reports
    unreported = {flag_name(name): (name, getattr(flags, name)) for name in UNREPORTED}
    unreported["--state-version"] = ("state_version", state_version)
    parts = [f"{flag} {_flag_value(value)}" + (" (given)" if name in given else "")
             for flag, (name, value) in unreported.items()]
    notes.append("not reported by the server, validated with: " + ", ".join(parts)
                 + " (llama-server's defaults unless given: give the server's own flags if it runs others)")
    for name, _value in unreported.values():
        sources[name] = "command line" if name in given else "default"

    shown = {"model": os.fspath(model) if model is not None else None,
             "draft_model": os.fspath(draft_model) if draft_model is not None else None,
             "ctx_size": ctx_size, "parallel": parallel, "kv_unified": kv_unified, "slot": slot, "mmproj": mmproj}
    return LiveValidate(facts=facts, model=model, draft_model=draft_model,
                        server_flags=flags.replace(ctx_size=ctx_size, parallel=parallel, spec_type=spec_type),
                        slot=slot, mmproj=mmproj,
                        learned=learned, flags=shown, sources=sources, notes=notes, warnings=warnings)


def _flag_value(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def _model_identity(model: Path | None, meta: dict | None) -> list[str]:
    """Warnings when the local GGUF is not the server's model (GET /v1/models ``meta``)."""
    if model is None or not isinstance(meta, dict):
        return []
    from slotctl.model.info import read_model_info

    try:
        info = read_model_info(model)
    except Exception:  # noqa: BLE001 - an unreadable model is reported by validate itself
        return []
    mine_all = {"n_vocab": info.n_vocab, "n_embd": info.n_embd, "n_ctx_train": info.n_ctx_train}
    try:  # parameters and tensor bytes: llama_model_n_params and llama_model_size on the server
        import gguf

        tensors = gguf.GGUFReader(os.fspath(model), "r").tensors
        mine_all["n_params"] = sum(int(t.n_elements) for t in tensors)
        mine_all["size"] = sum(int(t.n_bytes) for t in tensors)
    except Exception:  # noqa: BLE001 - the header fields above still tell most models apart
        pass
    diffs = []
    for key, mine in mine_all.items():
        theirs = meta.get(key)
        if isinstance(theirs, int) and not isinstance(theirs, bool) and theirs != mine:
            diffs.append(f"{key} {mine:,} here, {theirs:,} on the server")
    if not diffs:
        return []
    return [f"-m {model} is not the server's model ({'; '.join(diffs)}, GET /v1/models): the verdicts are for "
            f"this model, not the server's"]


