"""Tiny models of the other memory kinds (iSWA, recurrent, hybrids): :func:`make_kind_model`."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from slotctl.tinymodels.llama import make_model
from slotctl.tinymodels.vocab import _Vocabulary, _add_tokenizer, _build_vocabulary
from slotctl.tinymodels.write import _Tensors, _attention_keys, _common_keys, _ssm_keys, _write_gguf


#: the tiny models :func:`make_kind_model` makes, one per memory kind (two hybrids)
KINDS = ("llama", "gemma2", "mamba", "lfm2", "jamba", "lfm2-swa")

#: the memory each kind's model has in llama.cpp (``slotctl.model.info.ModelInfo.memory_kind``)
MEMORY_KINDS = {
    "llama": "kv",
    "gemma2": "iswa",
    "mamba": "recurrent",
    "lfm2": "hybrid",
    "jamba": "hybrid",
    "lfm2-swa": "hybrid_iswa",
}

#: ``attention.sliding_window`` of the gemma2 and lfm2-swa models: small, so that prompts of a few
#: dozen tokens reach past it
SLIDING_WINDOW = 16

#: default seed of each kind (lfm2-swa shares lfm2's weights: the two differ only by the window)
_KIND_SEEDS = {"llama": 1, "gemma2": 11, "mamba": 12, "lfm2": 13, "jamba": 14, "lfm2-swa": 13}


def make_kind_model(kind: str, path: str | os.PathLike[str], *, seed: int | None = None,
                    context_length: int = 4096, sliding_window: int | None = None) -> Path:
    """Write the tiny model of memory kind ``kind`` (one of :data:`KINDS`) to ``path``.

    Every model has random f32 weights from ``numpy.random.default_rng(seed)`` (each kind has its
    own default seed), the shared :func:`vocabulary` (so any of them can draft for any other), and
    loads and decodes in llama.cpp in a few milliseconds. Like :func:`make_model`, the same
    arguments give the same bytes and an up-to-date file is left untouched.

    ``llama``: plain KV cache; exactly :func:`make_models`'s target (2 layers, seed 1).
    ``gemma2``: iSWA; 4 layers, sliding-window attention on layers 0 and 2 (gemma2's default
    pattern), window :data:`SLIDING_WINDOW`, n_embd 128, 2 heads, 1 KV head of 64, output tied to
    ``token_embd``, gemma2's soft-capping (attention 50, final 30).
    ``mamba``: recurrent; 2 layers, n_embd 64, ``ssm.inner_size`` 128 (2 x n_embd, the only
    expansion llama.cpp supports), ``ssm.state_size`` 16, ``ssm.conv_kernel`` 4,
    ``ssm.time_step_rank`` 4.
    ``lfm2``: hybrid; 4 layers, short-convolution layers 0 and 2 (``attention.head_count_kv`` 0),
    attention layers 1 and 3 (1 KV head of 64), n_embd 128, ``shortconv.l_cache`` 3.
    ``jamba``: hybrid; 4 layers, mamba layers 0 and 2, attention layers 1 and 3 (1 KV head of 32),
    n_embd 64 and the ssm sizes of ``mamba``.
    ``lfm2-swa``: hybrid with SWA (``llama_memory_hybrid_iswa``): ``lfm2`` (the same weights) with
    ``attention.sliding_window`` :data:`SLIDING_WINDOW`, which makes every attention layer SWA: its
    base KV section has ``n_layer`` 0.

    ``sliding_window`` replaces :data:`SLIDING_WINDOW` (``gemma2`` and ``lfm2-swa`` only): the same
    weights with another window, as a model a file was not saved with.

    Tensors and keys are those ``load_hparams`` / ``load_tensors`` of llama.cpp require
    (``src/models/<arch>.cpp``, the same in b11434 and the tree llama-cpp-python 0.3.36 vendors).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if context_length < 1:
        raise ValueError(f"context_length must be positive, got {context_length}")
    seed = _KIND_SEEDS[kind] if seed is None else seed
    shapes = dict(_KIND_SHAPES.get(kind, {}))
    if sliding_window is not None:
        if shapes.get("window") is None:
            raise ValueError(f"{kind} has no sliding window")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        shapes["window"] = sliding_window
    if kind == "llama":
        return make_model(path, n_layer=2, seed=seed, context_length=context_length)
    arch = kind.removesuffix("-swa")
    vocab = _build_vocabulary()
    rng = np.random.default_rng(seed)

    def fill(writer: gguf.GGUFWriter) -> None:
        _KIND_WRITERS[arch](writer, vocab, rng, context_length=context_length, name=f"slotctl-tiny-{kind}",
                            **shapes)

    return _write_gguf(path, arch, fill)


_SSM = dict(d_inner=128, d_state=16, d_conv=4, dt_rank=4)
_KIND_SHAPES: dict[str, dict] = {
    "gemma2": dict(n_layer=4, n_embd=128, n_head=2, n_head_kv=1, head_dim=64, n_ff=256, window=SLIDING_WINDOW),
    "mamba": dict(n_layer=2, n_embd=64, **_SSM),
    "lfm2": dict(n_embd=128, n_head=2, head_dim=64, n_ff=256, n_head_kv=(0, 1, 0, 1), l_cache=3, window=None),
    "jamba": dict(n_embd=64, n_head=2, head_dim=32, n_ff=128, n_head_kv=(0, 1, 0, 1), **_SSM),
    "lfm2-swa": dict(n_embd=128, n_head=2, head_dim=64, n_ff=256, n_head_kv=(0, 1, 0, 1), l_cache=3,
                     window=SLIDING_WINDOW),
}


def _write_gemma2(writer: gguf.GGUFWriter, vocab: _Vocabulary, rng: np.random.Generator, *, name: str,
                  context_length: int, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int,
                  n_ff: int, window: int) -> None:
    """gemma2 (``llama_model_gemma2``): iSWA with the default pattern 2 (layers 0, 2, ... slide)."""
    _common_keys(writer, vocab, name=name, n_layer=n_layer, n_embd=n_embd, context_length=context_length,
                 eps=1e-6)
    _attention_keys(writer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim)
    writer.add_sliding_window(window)
    writer.add_attn_logit_softcapping(50.0)
    writer.add_final_logit_softcapping(30.0)
    _add_tokenizer(writer, vocab)

    T, t = gguf.MODEL_TENSOR, _Tensors(writer, rng)
    # The output is token_embd itself (gemma2 has no output tensor), so the current token's own
    # embedding, which the residual stream carries, would win every greedy step and the model would
    # repeat one token forever. The final norm's weights are random signs instead of ones: the
    # residual's own-token part then adds nothing on average to its logit. Embeddings of std 0.2 give
    # logits of std ~2 (the graph scales the input by sqrt(n_embd); the norms undo the scale).
    t.add(T.TOKEN_EMBD, t.matrix(len(vocab.tokens), n_embd, std=0.2))
    t.add(T.OUTPUT_NORM, np.where(rng.random(n_embd) < 0.5, -1.0, 1.0))
    for block in range(n_layer):
        t.add(T.ATTN_NORM, t.ones(n_embd), block)
        t.attention(block, n_embd, n_head * head_dim, n_head_kv * head_dim)
        t.add(T.ATTN_POST_NORM, t.ones(n_embd), block)
        t.add(T.FFN_NORM, t.ones(n_embd), block)
        t.ffn(block, n_embd, n_ff)
        t.add(T.FFN_POST_NORM, t.ones(n_embd), block)


def _write_mamba(writer: gguf.GGUFWriter, vocab: _Vocabulary, rng: np.random.Generator, *, name: str,
                 context_length: int, n_layer: int, n_embd: int, d_inner: int, d_state: int, d_conv: int,
                 dt_rank: int) -> None:
    """mamba (``llama_model_mamba``): every block is an S6 block, no attention, no feed-forward."""
    _common_keys(writer, vocab, name=name, n_layer=n_layer, n_embd=n_embd, context_length=context_length,
                 eps=1e-5)
    _ssm_keys(writer, d_inner=d_inner, d_state=d_state, d_conv=d_conv, dt_rank=dt_rank)
    _add_tokenizer(writer, vocab)

    T, t = gguf.MODEL_TENSOR, _Tensors(writer, rng)
    t.embeddings_and_output(len(vocab.tokens), n_embd, norm=T.OUTPUT_NORM)
    for block in range(n_layer):
        t.add(T.ATTN_NORM, t.ones(n_embd), block)
        t.mamba(block, n_embd, d_inner, d_state, d_conv, dt_rank, norms=False)


def _write_lfm2(writer: gguf.GGUFWriter, vocab: _Vocabulary, rng: np.random.Generator, *, name: str,
                context_length: int, n_embd: int, n_head: int, head_dim: int, n_ff: int,
                n_head_kv: tuple[int, ...], l_cache: int, window: int | None) -> None:
    """lfm2 (``llama_model_lfm2``): short-convolution blocks where ``head_count_kv`` is 0, attention
    blocks (with Q/K norms) elsewhere, a SwiGLU feed-forward in every block; with a sliding window,
    every attention block slides."""
    _common_keys(writer, vocab, name=name, n_layer=len(n_head_kv), n_embd=n_embd,
                 context_length=context_length, eps=1e-5)
    _attention_keys(writer, n_ff=n_ff, n_head=n_head, n_head_kv=list(n_head_kv), head_dim=head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_shortconv_l_cache(l_cache)
    if window is not None:
        writer.add_sliding_window(window)
    _add_tokenizer(writer, vocab)

    T, t = gguf.MODEL_TENSOR, _Tensors(writer, rng)
    # lfm2's final norm is LLM_TENSOR_OUTPUT_NORM_LFM2, stored as token_embd_norm
    t.embeddings_and_output(len(vocab.tokens), n_embd, norm=T.TOKEN_EMBD_NORM)
    for block, kv_heads in enumerate(n_head_kv):
        t.add(T.ATTN_NORM, t.ones(n_embd), block)
        if kv_heads == 0:
            t.add(T.SHORTCONV_CONV, t.matrix(n_embd, l_cache), block)
            t.add(T.SHORTCONV_INPROJ, t.matrix(3 * n_embd, n_embd), block)
            t.add(T.SHORTCONV_OUTPROJ, t.matrix(n_embd, n_embd), block)
        else:
            t.add(T.ATTN_Q_NORM, t.ones(head_dim), block)
            t.add(T.ATTN_K_NORM, t.ones(head_dim), block)
            t.attention(block, n_embd, n_head * head_dim, kv_heads * head_dim)
        t.add(T.FFN_NORM, t.ones(n_embd), block)
        t.ffn(block, n_embd, n_ff)


def _write_jamba(writer: gguf.GGUFWriter, vocab: _Vocabulary, rng: np.random.Generator, *, name: str,
                 context_length: int, n_embd: int, n_head: int, head_dim: int, n_ff: int,
                 n_head_kv: tuple[int, ...], d_inner: int, d_state: int, d_conv: int, dt_rank: int) -> None:
    """jamba (``llama_model_jamba``): Mamba blocks where ``head_count_kv`` is 0 (with jamba's dt, B and C
    norms), attention blocks (no positional encoding) elsewhere, a dense SwiGLU feed-forward in every
    block."""
    _common_keys(writer, vocab, name=name, n_layer=len(n_head_kv), n_embd=n_embd,
                 context_length=context_length, eps=1e-6)
    _attention_keys(writer, n_ff=n_ff, n_head=n_head, n_head_kv=list(n_head_kv), head_dim=head_dim)
    _ssm_keys(writer, d_inner=d_inner, d_state=d_state, d_conv=d_conv, dt_rank=dt_rank)
    _add_tokenizer(writer, vocab)

    T, t = gguf.MODEL_TENSOR, _Tensors(writer, rng)
    t.embeddings_and_output(len(vocab.tokens), n_embd, norm=T.OUTPUT_NORM)
    for block, kv_heads in enumerate(n_head_kv):
        t.add(T.ATTN_NORM, t.ones(n_embd), block)
        if kv_heads == 0:
            t.mamba(block, n_embd, d_inner, d_state, d_conv, dt_rank, norms=True)
        else:
            t.attention(block, n_embd, n_head * head_dim, kv_heads * head_dim)
        t.add(T.FFN_NORM, t.ones(n_embd), block)
        t.ffn(block, n_embd, n_ff)


_KIND_WRITERS = {"gemma2": _write_gemma2, "mamba": _write_mamba, "lfm2": _write_lfm2, "jamba": _write_jamba}
