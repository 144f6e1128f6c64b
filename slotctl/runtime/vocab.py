"""A model's vocabulary alone (no weights): what ``inspect --model`` needs to show the prompt as text."""

from __future__ import annotations

import os
from typing import Sequence

from slotctl.runtime.log import configure_logging
from slotctl.runtime.model import Model


def detokenize(model_path: str | os.PathLike, tokens: Sequence[int], *, verbose: bool = False) -> str:
    """The text of ``tokens`` as llama.cpp renders it with the vocabulary of ``model_path``.

    Special tokens are rendered (``<s>``); a token outside the vocabulary is shown as ``<bad:ID>`` and a
    media position (-1) as ``<media>`` rather than passed to llama.cpp, which would abort on it.
    Loads the vocabulary only (``vocab_only``), so it costs no weights.
    """
    configure_logging(verbose)
    with Model(model_path, vocab_only=True) as model:
        parts: list[str] = []
        run: list[int] = []

        def flush() -> None:
            if run:
                parts.append(model.detokenize(run))
                run.clear()

        for t in tokens:
            t = int(t)
            if 0 <= t < model.n_vocab:
                run.append(t)
                continue
            flush()
            parts.append("<media>" if t == -1 else f"<bad:{t}>")
        flush()
        return "".join(parts)
