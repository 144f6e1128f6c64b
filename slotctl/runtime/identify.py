"""The state a candidate model computes for the first tokens of a prompt (``slotctl identify``).

A fresh context on the candidate, with the cache types and flash-attention setting the file was saved
with and one slot, evaluates ``tokens`` at positions 0, 1, ... of sequence 0; its state blob
(``llama_state_seq_get_data_ext``, flags 0, this runtime's state version) holds the K/V rows
:mod:`slotctl.identify` compares with the file's.
"""

from __future__ import annotations

import os
from typing import Sequence

from slotctl.model.settings import ContextSettings
from slotctl.runtime.context import STATE_FLAGS_NONE, STATE_VERSION, Context
from slotctl.runtime.model import Model

#: contexts are at least this large (llama.cpp pads to 256 cells anyway)
MIN_CTX = 256


def candidate_state(model_path: str | os.PathLike, tokens: Sequence[int], *, type_k: str = "f16",
                    type_v: str = "f16", flash_attn: str = "on") -> tuple[bytes, int]:
    """``(state blob, state version)`` of sequence 0 after ``tokens`` were evaluated from position 0.

    Raises :class:`~slotctl.runtime.model.LlamaError` when the model cannot be loaded or a context made,
    ValueError when a token is outside its vocabulary.
    """
    n = len(tokens)
    settings = ContextSettings(n_ctx=max(MIN_CTX, n), n_parallel=1, type_k=type_k, type_v=type_v,
                               flash_attn=flash_attn, n_batch=max(n, 1), n_ubatch=min(max(n, 1), 512))
    with Model(model_path) as model:
        model.check_tokens(tokens)
        with Context(model, settings) as ctx:
            ctx.decode(list(tokens), 0, 0)
            return ctx.state_seq_get(0, STATE_FLAGS_NONE), STATE_VERSION
