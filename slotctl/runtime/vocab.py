"""A model's vocabulary alone (no weights): what ``inspect --model`` needs to show the prompt as text."""

from __future__ import annotations

import ctypes
import os
from typing import Sequence

import llama_cpp

from slotctl.errors import UsageError
from slotctl.runtime.log import capture_errors, configure_logging, ensure_backend


def detokenize(model_path: str | os.PathLike, tokens: Sequence[int], *, verbose: bool = False) -> str:
    """The text of ``tokens`` as llama.cpp renders it with the vocabulary of ``model_path``.

    Special tokens are rendered (``<s>``); a token outside the vocabulary is shown as ``<bad:ID>`` and a
    media position (-1) as ``<media>`` rather than passed to llama.cpp, which would abort on it.
    Loads the vocabulary only (``vocab_only``), so it costs no weights.
    """
    configure_logging(verbose)
    ensure_backend()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with capture_errors() as errors:
        model = llama_cpp.llama_model_load_from_file(os.fsencode(os.fspath(model_path)), params)
    if not model:
        raise UsageError(f"cannot load the vocabulary of {os.fspath(model_path)}"
                         + (f": {errors[-1]}" if errors else ""))
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        parts: list[str] = []
        run: list[int] = []

        def flush() -> None:
            if run:
                parts.append(_detokenize(vocab, run))
                run.clear()

        for t in tokens:
            t = int(t)
            if 0 <= t < n_vocab:
                run.append(t)
                continue
            flush()
            parts.append("<media>" if t == -1 else f"<bad:{t}>")
        flush()
        return "".join(parts)
    finally:
        llama_cpp.llama_model_free(model)


def _detokenize(vocab, tokens: list[int]) -> str:
    array = (llama_cpp.llama_token * len(tokens))(*tokens)
    capacity = max(64, 8 * len(tokens))
    while True:
        buf = ctypes.create_string_buffer(capacity)
        n = llama_cpp.llama_detokenize(vocab, array, len(tokens), buf, capacity, False, True)
        if n >= 0:
            return buf.raw[:n].decode("utf-8", errors="replace")
        capacity = -n
