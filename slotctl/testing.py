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

    from slotctl.testing import SAMPLE_PROMPT, make_models

    models = make_models(tmp_path)
    llm = llama_cpp.Llama(model_path=str(models.target), n_ctx=256, verbose=False)
    llm.eval(llm.tokenize(SAMPLE_PROMPT.encode()))
"""

from __future__ import annotations

import filecmp
import functools
import os
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

__all__ = ["KINDS", "MEMORY_KINDS", "SAMPLE_PROMPT", "SLIDING_WINDOW", "TinyModels", "make_kind_model", "make_model",
           "make_models", "vocabulary"]

#: A few sentences of English, 98 tokens (99 with BOS): one per word or punctuation mark.
SAMPLE_PROMPT = (
    "What is the capital of France? Paris is the capital of France, and it is also the "
    "largest city in the country. The river Seine runs through the middle of Paris from the "
    "east to the west. Every year many people come to the city to visit the Eiffel Tower, "
    "the old churches and the famous museums. In the evening the lights of the city shine on "
    "the water, and the streets are full of music. Paris is a beautiful city, and people from "
    "every country love it."
)

# Each word becomes one token in four forms: "word", "Word", "▁word" and "▁Word".
# Roughly in order of frequency, which is the order of their scores.
_WORDS = """
    the of and to a in is it you that he was for on are with as i his they be at one have
    this from or had by not but what some we can out other were all there when up use your
    how said an each she which do their time if will way about many then them would like so
    these her long make thing see him two has look more day could go come did no most
    people my over know water than call first who may down side been now find any new work
    part take get place made live where after back little only round man year years came
    show every good me give our under name very through just form great think say help low
    line turn much mean before move right old too same tell does set three want air well
    also play small end put home read hand large even land here must big high such follow
    why ask men change went light lights kind off need house try us again point mother
    world near build earth father head stand own page should country found answer school
    grow study still learn food sun four between state keep eye never last let thought
    city cities tree cross hard start might story saw far sea draw left late run runs
    while close night real life few north open seem together next white children begin
    got walk example paper group always music those both often until river car feet care
    second book carry took science eat room friend began idea fish mountain stop once base
    hear horse cut sure watch color face wood main enough girl young ready above ever red
    list though feel talk bird soon body dog family leave song door black short class wind
    question happen complete ship area half rock order fire south problem piece told knew
    pass since top whole king queen space heard best hour better true during hundred five
    remember step early hold west ground reach fast sing listen six table travel less
    morning ten simple toward war against slow center love person money serve road map
    rain cold voice power town fine certain fall lead dark machine note wait plan star box
    field rest able done drive stood front teach week final gave green quick ocean warm
    free minute strong mind behind clear fact street streets full stay wheel blue deep
    moon island foot system busy test boat common gold possible age dry laugh thousand ago
    ran check game shape yes hot bring sit fill east language among capital france paris
    french europe seine eiffel tower museum museums church churches bridge art visit
    famous beautiful evening largest middle shine history garden palace wine bread summer
    winter spring model token tokens slot slots cache server prompt draft target text
    hello
"""

#: tokenizer.ggml.token_type values
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = (
    gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.BYTE,
)
_SPACE = "\u2581"  # "▁", SentencePiece's visible space
_SPECIAL_TOKENS = (("<unk>", _UNKNOWN), ("<s>", _CONTROL), ("</s>", _CONTROL))
_UNK_ID, _BOS_ID, _EOS_ID = 0, 1, 2
#: single-character tokens: the visible space and every printable ASCII character but space
_CHARACTERS = _SPACE + string.ascii_letters + string.digits + string.punctuation


@dataclass(frozen=True)
class _Vocabulary:
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]


@functools.cache
def _build_vocabulary() -> _Vocabulary:
    """Lay out the vocabulary: special tokens, bytes, word pieces, then single characters.

    llama.cpp's SentencePiece tokenizer starts from characters and keeps merging the
    adjacent pair whose concatenation is a token, highest score first.  Two rules make
    every listed word come out as one token:

    * every prefix of length >= 2 of a word (lower case and capitalized) is a token, so
      the left end of a word can always grow by the next character until it is whole;
    * the pieces inside words outscore the ``▁``-joined forms, so the text between two
      spaces is merged completely before ``▁`` is joined to the whole word.

    Scores fall by one per token along pieces and characters; specials and bytes score 0
    (the tokenizer never merges into them).
    """
    words = _WORDS.split()
    inner: dict[str, None] = {}
    for word in words:
        for form in (word, word.capitalize()):
            for end in range(2, len(form) + 1):
                inner[form[:end]] = None
    joined = [_SPACE + form for word in words for form in (word, word.capitalize())]
    pieces = [*inner, *joined, *_CHARACTERS]

    tokens = [text for text, _ in _SPECIAL_TOKENS] + [f"<0x{b:02X}>" for b in range(256)]
    types = [kind for _, kind in _SPECIAL_TOKENS] + [_BYTE] * 256
    scores = [0.0] * len(tokens)
    tokens += pieces
    types += [_NORMAL] * len(pieces)
    scores += [-float(rank) for rank in range(len(pieces))]
    return _Vocabulary(tuple(tokens), tuple(scores), tuple(int(t) for t in types))


def vocabulary() -> list[str]:
    """Return the token texts shared by every model made here, indexed by token id.

    Ids 0, 1, 2 are ``<unk>``, ``<s>`` (BOS) and ``</s>`` (EOS); ids 3..258 are the byte
    tokens ``<0x00>``..``<0xFF>``; then come word pieces (``▁`` stands for a space) and
    single characters.
    """
    return list(_build_vocabulary().tokens)


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


def _add_tokenizer(writer: gguf.GGUFWriter, vocab: _Vocabulary) -> None:
    """The shared vocabulary, as llama.cpp's SentencePiece ("llama") tokenizer reads it."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_scores(list(vocab.scores))
    writer.add_token_types(list(vocab.types))
    writer.add_unk_token_id(_UNK_ID)
    writer.add_bos_token_id(_BOS_ID)
    writer.add_eos_token_id(_EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)


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


# -- models of the other memory kinds -------------------------------------------------------------------

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
