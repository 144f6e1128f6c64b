"""Everything in slotctl that runs llama.cpp (through llama-cpp-python's low-level bindings).

- ``model``: ``Model``, a GGUF loaded on the CPU, with the server's tokenization; ``LlamaError``;
- ``context``: ``Context``, built from both the way the server builds its target and draft
  contexts: decoding, sequence edits, state blobs and state files; the state flags and version;
- ``generate``: ``generate_greedy``;
- ``log``: ``configure_logging``, where llama.cpp's log goes.

The names are importable from here too (and ``ContextSettings``, the context options, from
:mod:`slotctl.model.settings`). They load lazily: importing this package does not load the llama.cpp
library.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    "ContextSettings": "slotctl.model.settings",
    "LOAD_STEPS": "model",
    "LlamaError": "model",
    "Model": "model",
    "Progress": "model",  # slotctl.progress.Progress, re-exported
    "Context": "context",
    "STATE_BLOB_MAGIC": "context",
    "STATE_FILE_MAGIC": "context",
    "STATE_FLAGS_NONE": "context",
    "STATE_FLAGS_ON_DEVICE": "context",
    "STATE_FLAGS_PARTIAL_ONLY": "context",
    "STATE_VERSION": "context",
    "generate_greedy": "generate",
    "configure_logging": "log",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _MODULE_OF[name]
    return getattr(importlib.import_module(module if "." in module else f"{__name__}.{module}"), name)
