"""Tiny deterministic llama models for tests, demos and benchmarks.

slotctl reads and writes the slot files of a running llama-server, so its tests need real
models that llama.cpp loads and runs in milliseconds.  This module writes them with the
``gguf`` package: llama-architecture GGUF files with random but seeded f32 weights and a
small English SentencePiece-style vocabulary.

The default shapes are those of the models slot-file vectors are made with: n_embd 128,
2 attention heads, 1 KV head, head size 64 (so quantized KV caches get a Hadamard
rotation).  :func:`make_models` writes a 2-layer *target* and a 1-layer *draft*; every model
made here shares :func:`vocabulary`, so any of them can draft for any other (the target
can draft for itself).

The vocabulary (``tokenizer.ggml.model = "llama"``) holds ``<unk>``, ``<s>``, ``</s>``, the
256 byte-fallback tokens ``<0x00>``..``<0xFF>``, a few hundred common English words and
the pieces that build them, and every printable ASCII character.  Each listed word is one
token, in lower case or capitalized, at the start of the text or after a space
(``▁word``).  Any other text still tokenizes, into word pieces, characters and bytes, and
detokenizes back to exactly the same text (but for the character ``▁`` itself, which
SentencePiece reads as a space): ``tokenizer.ggml.add_space_prefix`` is false, so no space
is invented in front of the first word.  BOS is added by default.

:func:`make_kind_model` writes one model of each memory kind llama.cpp has (:data:`KINDS`): the llama
target (plain KV cache), ``gemma2`` (sliding-window attention: iSWA), ``mamba`` (recurrent), ``lfm2`` and
``jamba`` (hybrids of attention and short-convolution or Mamba layers), and ``lfm2-swa`` (a hybrid with
sliding-window attention), all on the same vocabulary (docs/kinds.md).

Example::

    from slotctl.tinymodels import SAMPLE_PROMPT, make_models

    models = make_models(tmp_path)
    llm = llama_cpp.Llama(model_path=str(models.target), n_ctx=256, verbose=False)
    llm.eval(llm.tokenize(SAMPLE_PROMPT.encode()))
"""

from __future__ import annotations

from slotctl.tinymodels.kinds import KINDS, MEMORY_KINDS, SLIDING_WINDOW, make_kind_model
from slotctl.tinymodels.llama import TinyModels, make_model, make_models
from slotctl.tinymodels.vocab import SAMPLE_PROMPT, vocabulary

__all__ = ["KINDS", "MEMORY_KINDS", "SAMPLE_PROMPT", "SLIDING_WINDOW", "TinyModels", "make_kind_model", "make_model",
           "make_models", "vocabulary"]
