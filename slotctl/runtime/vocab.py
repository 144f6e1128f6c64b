"""A model's vocabulary alone (no weights): what ``inspect --model`` needs to show the prompt as text."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from slotctl.runtime.log import configure_logging
from slotctl.runtime.model import Model


def detokenize(model_path: str | os.PathLike, tokens: Sequence[int], *, verbose: bool = False) -> str:
    """The text of ``tokens`` as llama.cpp renders it with the vocabulary of ``model_path``.

    Special tokens are rendered (``<s>``); a token outside the vocabulary is shown as ``<bad:ID>`` and a
    media position (-1) as ``<media>`` rather than passed to llama.cpp, which would abort on it.
    Loads the vocabulary only (``vocab_only``), so it costs no weights.
    """
    configure_logging(verbose)
    ids = np.asarray(tokens, dtype=np.int64)
    with Model(model_path, vocab_only=True) as model:
        bad = np.flatnonzero((ids < 0) | (ids >= model.n_vocab))
        parts: list[str] = []
        start = 0
        for i in (*bad.tolist(), len(ids)):    # the valid runs between the ids llama.cpp must not see
            if i > start:
                parts.append(model.detokenize(ids[start:i]))
            if i < len(ids):
                t = int(ids[i])
                parts.append("<media>" if t == -1 else f"<bad:{t}>")
            start = i + 1
        return "".join(parts)
