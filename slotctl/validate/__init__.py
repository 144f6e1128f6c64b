"""Will a llama-server restore this slot file, completely? (``slotctl validate``)

Three checks, each adding :class:`~slotctl.server.findings.Finding` objects to a :class:`FileReport`:

1. **Structure** (always): every layer as ``inspect`` parses it, plus the server's own rules
   (:func:`slotctl.server.findings.structural_findings` with :class:`~slotctl.server.findings.ServerRules`).
2. **Prediction** (with ``-m``, and ``-md`` for the draft): :func:`slotctl.model.predict.predict` says what
   the contexts of a server started with the given flags hold, and each memory layer of the file is
   compared with it the way llama.cpp's loader compares (``state_read_meta`` / ``state_read_data``):
   the target payload with the target context, each checkpoint's target and draft blobs (PARTIAL_ONLY)
   with the target and draft contexts, the SDFT draft blob with the draft context. The tokens are
   checked as the server checks them after restoring the target.
3. **Real check** (with ``-m``, unless turned off): each memory layer is loaded into real contexts
   built with those flags, in a child process (:class:`~slotctl.validate.child.LoadChecker` over a
   :class:`~slotctl.validate.child.ChildProcess`), so that an abort inside llama.cpp becomes a finding. A version-4 layer is converted to this runtime's version 3
   first (:func:`slotctl.format.convert.convert_payload`); when that is refused the layer is not loaded and the
   prediction alone decides. Prediction and load must agree; where they do not, the disagreement is a
   finding of its own (``prediction_disagrees``).

What a finding costs depends on the layer (llama.cpp ea736c1d5's ``load_slot_draft`` and
``common_prompt_checkpoint::load_tgt`` in b11434):

* state header, token words, target memory: the server refuses the file ("Unable to restore slot");
* the SDFT draft state: the server restores the file and drops the draft state (the draft starts empty);
* a damaged SCKP appendix: the server ignores every checkpoint;
* a checkpoint blob that does not fit its context: the server keeps it (the appendix loader only checks
  lengths) and **aborts** (``GGML_ABORT("checkpoint size mismatch")``) when it rolls back to it.

Each checked layer has a :class:`LayerCheck` saying what the prediction and the load found and what the
server does (its ``effect``); the file's ``verdict`` follows from the effects (:data:`VERDICTS`).

Modules: ``setup`` (the server: models, flags, predictions), ``check`` (one file: layers, verdict),
``compare`` (a layer against its prediction), ``load`` (the real check's results judged), ``wording`` (how layouts and layers are named),
``speculative`` (speculative states), ``report`` (results), ``child`` (the real check's parent side) and
``worker`` (the child process, the only part that imports llama.cpp, through :mod:`slotctl.runtime`).
"""

from __future__ import annotations

#: each name and the module it is imported from on first use (PEP 562): ``slotctl.validate.words`` and the
#: other modules can be imported without the checks (``ls`` served from the catalog needs only the words)
_NAMES = {
    **dict.fromkeys(("validate_file", "validate_paths"), "check"),
    **dict.fromkeys(("ChildProcess", "LoadChecker"), "child"),
    **dict.fromkeys(("FileReport", "LayerCheck", "Report"), "report"),
    **dict.fromkeys(("VERDICTS", "Effect", "Load", "Verdict"), "words"),
    **dict.fromkeys(("Models", "ServerSetup"), "setup"),
}


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = ["VERDICTS", "ChildProcess", "Effect", "FileReport", "LayerCheck", "Load", "LoadChecker", "Models", "Report",
           "ServerSetup", "Verdict", "validate_file", "validate_paths"]
