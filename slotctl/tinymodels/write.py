"""Writing a GGUF atomically, drawing seeded tensors, and the hyperparameter keys the tiny models share."""

from __future__ import annotations

import filecmp
import os
import tempfile
from pathlib import Path

import gguf
import numpy as np

from slotctl.tinymodels.vocab import _Vocabulary


def _write_gguf(path: str | os.PathLike[str], arch: str, fill) -> Path:
    """Write a GGUF of architecture ``arch`` whose keys and tensors ``fill(writer)`` adds.

    Written to a temporary file next to ``path`` first; ``path`` is replaced atomically only when
    its bytes differ, so an up-to-date file keeps its inode and mtime.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.chmod(0o644)  # mkstemp makes it private; a model is for anyone to read
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if not (path.is_file() and filecmp.cmp(tmp, path, shallow=False)):
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # still there if the file was up to date, or on error
    return path


class _Tensors:
    """Adds tensors to a writer, drawing random ones from ``rng`` in call order.

    numpy shapes are (rows, columns) = (n_out, n_in); GGUF stores them reversed, which is the
    ``{n_in, n_out}`` llama.cpp expects.
    """

    def __init__(self, writer: gguf.GGUFWriter, rng: np.random.Generator):
        self.writer = writer
        self.rng = rng

    def add(self, tensor: gguf.MODEL_TENSOR, data: np.ndarray, block: int | None = None,
            suffix: str = ".weight") -> None:
        name = gguf.TENSOR_NAMES[tensor].format(bid=block) + suffix
        self.writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))

    def matrix(self, n_out: int, n_in: int, std: float | None = None) -> np.ndarray:
        """Normal entries, with standard deviation ``1/sqrt(n_in)`` unless given."""
        if std is None:
            std = 1.0 / np.sqrt(n_in)
        return (self.rng.standard_normal((n_out, n_in)) * std).astype(np.float32)

    @staticmethod
    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def embeddings_and_output(self, n_vocab: int, n_embd: int, norm: gguf.MODEL_TENSOR) -> None:
        """Token embeddings, the final norm (``norm``: its tensor differs by architecture) and the output."""
        self.add(gguf.MODEL_TENSOR.TOKEN_EMBD, self.matrix(n_vocab, n_embd, std=1.0))
        self.add(norm, self.ones(n_embd))
        self.add(gguf.MODEL_TENSOR.OUTPUT, self.matrix(n_vocab, n_embd, std=2.0 / np.sqrt(n_embd)))

    def ffn(self, block: int, n_embd: int, n_ff: int) -> None:
        """SwiGLU feed-forward weights (gate, up, down) of one block."""
        T = gguf.MODEL_TENSOR
        self.add(T.FFN_GATE, self.matrix(n_ff, n_embd), block)
        self.add(T.FFN_UP, self.matrix(n_ff, n_embd), block)
        self.add(T.FFN_DOWN, self.matrix(n_embd, n_ff), block)

    def attention(self, block: int, n_embd: int, n_q: int, n_kv: int) -> None:
        """Q, K, V and output projections of one attention block."""
        T = gguf.MODEL_TENSOR
        self.add(T.ATTN_Q, self.matrix(n_q, n_embd), block)
        self.add(T.ATTN_K, self.matrix(n_kv, n_embd), block)
        self.add(T.ATTN_V, self.matrix(n_kv, n_embd), block)
        self.add(T.ATTN_OUT, self.matrix(n_embd, n_q), block)

    def mamba(self, block: int, n_embd: int, d_inner: int, d_state: int, d_conv: int, dt_rank: int,
              norms: bool) -> None:
        """A Mamba (S6) block as ``llama_model_mamba`` / ``llama_model_jamba::load_arch_tensors`` read it.

        ``ssm_a`` holds A itself (-exp(A_log), as the converters store it): -1 .. -d_state for every
        channel; the time step starts between 0.001 and 0.1 (``ssm_dt`` bias = inverse softplus);
        D is 1. ``norms``: jamba's RMS norms of dt, B and C.
        """
        T = gguf.MODEL_TENSOR
        self.add(T.SSM_IN, self.matrix(2 * d_inner, n_embd), block)
        self.add(T.SSM_CONV1D, self.matrix(d_inner, d_conv), block)
        self.add(T.SSM_CONV1D, self.rng.standard_normal(d_inner) * 0.1, block, ".bias")
        self.add(T.SSM_X, self.matrix(dt_rank + 2 * d_state, d_inner), block)
        if norms:
            self.add(T.SSM_DT_NORM, self.ones(dt_rank), block)
        self.add(T.SSM_DT, self.matrix(d_inner, dt_rank), block)
        dt = np.exp(self.rng.uniform(np.log(1e-3), np.log(1e-1), d_inner))
        self.add(T.SSM_DT, np.log(np.expm1(dt)), block, ".bias")
        if norms:
            self.add(T.SSM_B_NORM, self.ones(d_state), block)
            self.add(T.SSM_C_NORM, self.ones(d_state), block)
        self.add(T.SSM_A, -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1)), block, "")
        self.add(T.SSM_D, self.ones(d_inner), block, "")
        self.add(T.SSM_OUT, self.matrix(n_embd, d_inner), block)


def _common_keys(writer: gguf.GGUFWriter, vocab: _Vocabulary, *, name: str, n_layer: int, n_embd: int,
                 context_length: int, eps: float) -> None:
    """The keys every tiny model has: name, file type, sizes, block count, RMS norm epsilon."""
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_layer_norm_rms_eps(eps)


def _attention_keys(writer: gguf.GGUFWriter, *, n_ff: int, n_head: int, n_head_kv: int | list[int],
                    head_dim: int) -> None:
    """The feed-forward and attention keys of models with attention blocks (``head_count_kv`` may be per layer)."""
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def _ssm_keys(writer: gguf.GGUFWriter, *, d_inner: int, d_state: int, d_conv: int, dt_rank: int) -> None:
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
