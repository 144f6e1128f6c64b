"""The llama-architecture tiny models: :func:`make_model`, and the target/draft pair :func:`make_models`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from slotctl.tinymodels.vocab import _Vocabulary, _add_tokenizer, _build_vocabulary
from slotctl.tinymodels.write import _attention_keys, _common_keys, _write_gguf


def make_model(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 2,
    n_head_kv: int = 1,
    head_dim: int = 64,
    n_ff: int = 256,
    seed: int = 0,
    context_length: int = 4096,
    name: str = "slotctl-tiny",
) -> Path:
    """Write a tiny llama-architecture GGUF model to ``path`` and return the path.

    The weights are f32, drawn from ``numpy.random.default_rng(seed)``; the same arguments
    always give the same bytes.  When ``path`` already holds exactly those bytes the file
    is left untouched (same inode and mtime), so a model can be made again cheaply, even
    while a server has it open; otherwise it is replaced atomically.

    Args:
        path: where to write the ``.gguf`` file; its directory must exist.
        n_layer: number of transformer blocks.
        n_embd: width of the residual stream.
        n_head: attention (query) heads.
        n_head_kv: key/value heads; must divide ``n_head`` (grouped-query attention).
        head_dim: size of one head, for keys, values and RoPE alike; must be even.
        n_ff: hidden width of the SwiGLU feed-forward block.
        seed: seed of the weights; the vocabulary does not depend on it.
        context_length: ``llama.context_length``, the training context the model claims.
        name: ``general.name``.

    Scales follow fan-in (``1/sqrt(n_in)``) so that activations stay of order one: logits
    spread a few units apart, greedy decoding is stable, nothing overflows in f16 or
    quantized caches, and attention depends on the cached keys and values.
    """
    sizes = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                 head_dim=head_dim, n_ff=n_ff, context_length=context_length)
    for key, value in sizes.items():
        if value < 1:
            raise ValueError(f"{key} must be positive, got {value}")
    if n_head % n_head_kv:
        raise ValueError(f"n_head_kv ({n_head_kv}) must divide n_head ({n_head})")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")

    vocab = _build_vocabulary()

    def fill(writer: gguf.GGUFWriter) -> None:
        _add_metadata(writer, vocab, name=name, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                      n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff,
                      context_length=context_length)
        _add_weights(writer, np.random.default_rng(seed), n_vocab=len(vocab.tokens),
                     n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                     head_dim=head_dim, n_ff=n_ff)

    return _write_gguf(path, "llama", fill)


@dataclass(frozen=True)
class TinyModels:
    """A target model and a draft model for it, made by :func:`make_models`."""

    #: ``tiny-target.gguf``: 2 layers, seed 1, default shapes
    target: Path
    #: ``tiny-draft.gguf``: 1 layer, seed 2, default shapes, the target's vocabulary
    draft: Path


def make_models(directory: str | os.PathLike[str]) -> TinyModels:
    """Make the standard target/draft pair in ``directory`` (created if missing).

    Files that already hold the right bytes are reused as they are (see :func:`make_model`).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return TinyModels(
        target=make_model(directory / "tiny-target.gguf", n_layer=2, seed=1),
        draft=make_model(directory / "tiny-draft.gguf", n_layer=1, seed=2),
    )


def _add_metadata(
    writer: gguf.GGUFWriter, vocab: _Vocabulary, *, name: str, n_layer: int, n_embd: int,
    n_head: int, n_head_kv: int, head_dim: int, n_ff: int, context_length: int,
) -> None:
    """Add the hyperparameters and the tokenizer, as llama.cpp reads them for ``llama``."""
    _common_keys(writer, vocab, name=name, n_layer=n_layer, n_embd=n_embd, context_length=context_length,
                 eps=1e-5)
    _attention_keys(writer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    _add_tokenizer(writer, vocab)


def _add_weights(
    writer: gguf.GGUFWriter, rng: np.random.Generator, *, n_vocab: int, n_layer: int,
    n_embd: int, n_head: int, n_head_kv: int, head_dim: int, n_ff: int,
) -> None:
    """Add every tensor of a llama model, drawing the matrices from ``rng`` in a fixed order.

    numpy shapes are (rows, columns) = (n_out, n_in); GGUF stores them reversed, which is
    the ``{n_in, n_out}`` llama.cpp expects.
    """

    def name(tensor: gguf.MODEL_TENSOR, block: int | None = None) -> str:
        return gguf.TENSOR_NAMES[tensor].format(bid=block) + ".weight"

    def matrix(n_out: int, n_in: int, std: float | None = None) -> np.ndarray:
        """Normal entries, with standard deviation ``1/sqrt(n_in)`` unless given."""
        if std is None:
            std = 1.0 / np.sqrt(n_in)
        return (rng.standard_normal((n_out, n_in)) * std).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    T = gguf.MODEL_TENSOR
    n_q, n_kv = n_head * head_dim, n_head_kv * head_dim
    # embedding rows are looked up, not multiplied: unit variance, like the layer outputs
    writer.add_tensor(name(T.TOKEN_EMBD), matrix(n_vocab, n_embd, std=1.0))
    writer.add_tensor(name(T.OUTPUT_NORM), ones(n_embd))
    # logits with a standard deviation of about 2: clear winners for greedy decoding
    writer.add_tensor(name(T.OUTPUT), matrix(n_vocab, n_embd, std=2.0 / np.sqrt(n_embd)))
    for block in range(n_layer):
        writer.add_tensor(name(T.ATTN_NORM, block), ones(n_embd))
        writer.add_tensor(name(T.ATTN_Q, block), matrix(n_q, n_embd))
        writer.add_tensor(name(T.ATTN_K, block), matrix(n_kv, n_embd))
        writer.add_tensor(name(T.ATTN_V, block), matrix(n_kv, n_embd))
        writer.add_tensor(name(T.ATTN_OUT, block), matrix(n_embd, n_q))
        writer.add_tensor(name(T.FFN_NORM, block), ones(n_embd))
        writer.add_tensor(name(T.FFN_GATE, block), matrix(n_ff, n_embd))
        writer.add_tensor(name(T.FFN_UP, block), matrix(n_ff, n_embd))
        writer.add_tensor(name(T.FFN_DOWN, block), matrix(n_embd, n_ff))
