"""What llama.cpp does per architecture, as tables: which memory each builds, which rope type makes cells
carry ext, which reads which hyperparameters, and how each sets up sliding-window attention
(src/llama-arch.cpp, src/llama-model.cpp and src/models/<arch>.cpp of b11434). Read by
:mod:`slotctl.model.info`, which applies them to a GGUF."""

from __future__ import annotations

from dataclasses import dataclass

#: ``llm_arch_is_recurrent``: the whole model is one ``llama_memory_recurrent``
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

#: ``llm_arch_is_hybrid`` minus the architectures in :data:`UNSUPPORTED_ARCHS`: attention KV (plain or
#: iSWA) followed by a recurrent section (``llama_memory_hybrid`` / ``llama_memory_hybrid_iswa``)
HYBRID_ARCHS = frozenset({"jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe",
                          "nemotron_h", "nemotron_h_moe", "qwen3next", "qwen35", "qwen35moe"})

#: architectures ``llama_model::create_memory`` gives no memory (embedding and diffusion models):
#: their payload is empty
NO_MEMORY_ARCHS = frozenset({"bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert", "nomic-bert-moe",
                             "neo-bert", "eurobert", "wavtokenizer-dec", "modern-bert", "gemma-embedding",
                             "dream", "llada", "llada-moe", "rnd1", "clef"})

#: architectures whose memory this module does not model, with what their memory is
#: (``llama_model::create_memory`` and their ``load_arch_hparams``). slotctl reads no layout and predicts
#: nothing for them, so the rules of b11434 that concern only them are not written here either: the M-RoPE
#: cells (cell ext) of bailingmoe3 VL files (first two ``rope.dimension_sections`` set) and of dflash drafts
#: (any of the first four set), and the K rotation b11434 always applies to the caches of DeepSeek
#: lightning indexers (deepseek32, deepseek4, glm-dsa, dots3note: "always create Hadamard rotation tensors
#: for DeepSeek lightning indexers", whatever the cache type and ``LLAMA_ATTN_ROT_DISABLE``). Supporting one
#: of them means modelling its cache first (its sections, in ``slotctl.format.memory``), then these rules.
UNSUPPORTED_ARCHS = {
    "minimax-m3": "an MSA cache (llama_kv_cache_msa)",
    "glm-dsa": "a DSA cache (llama_kv_cache_dsa)",
    "deepseek32": "a DSA cache (llama_kv_cache_dsa)",
    "hy_v4": "a DSA cache (llama_kv_cache_dsa) unless the indexer is off",
    "dots3note": "a DSA cache with SWA (llama_kv_cache_dsa_iswa)",
    "deepseek4": "a DSV4 cache (llama_kv_cache_dsv4)",
    "dflash": "a draft-model cache whose kind depends on its target",
    "glm5-next": "an indexer hybrid (llama_memory_hybrid_idx)",
    "qwen4exp": "an indexer hybrid (llama_memory_hybrid_idx) with per-layer-embedding conv rows",
    "kimi-linear": "KDA recurrent layers",
    "kimi-k3": "KDA recurrent layers",
    "bailingmoe3": "KDA recurrent layers",
    "minimax-01": "linear-attention recurrent layers",
    "gemma3n": "layers that reuse other layers' KV (n_layer_kv_from_start)",
    "gemma4": "layers that reuse other layers' KV (n_layer_kv_from_start)",
    "gemma4-assistant": "a KV cache shared with its target context",
    "graniteswitch": "a router KV layer",
}

#: rope type M-RoPE / IM-RoPE (``llama_model_rope_type``): KV cells carry ext
#: (``llama_kv_cache::has_cell_ext``: ``n_pos_per_embd() > 1``)
MROPE_ARCHS = frozenset({"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe",
                         "clef", "qwen4exp", "qwen3tts"})
#: M-RoPE only when ``rope.dimension_sections`` has its first two sections non-zero
#: (``llama_hparams::use_mrope``; b11434 ``llama_model_rope_type``: glm4, glm4moe, hunyuan_vl; bailingmoe3
#: too, which :data:`UNSUPPORTED_ARCHS` lists)
MROPE_IF_SECTIONS_ARCHS = frozenset({"glm4", "glm4moe", "hunyuan_vl"})

#: architectures that read ``ssm.group_count`` (it widens the conv state, ``llama_hparams::n_embd_r``)
SSM_GROUP_ARCHS = frozenset({"mamba2", "falcon-h1", "granitehybrid", "nemotron_h", "nemotron_h_moe",
                             "qwen3next", "qwen35", "qwen35moe", "plamo2"})
#: RWKV: r = token shift, s = wkv state
RWKV_ARCHS = frozenset({"rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
#: short-convolution layers: r = the last ``l_cache - 1`` inputs
SHORTCONV_ARCHS = frozenset({"lfm2", "lfm2moe"})
#: hybrids whose recurrent layers are those with ``head_count_kv`` 0 (their ``load_arch_hparams``)
RECR_BY_NO_KV_HEADS_ARCHS = frozenset({"jamba", "lfm2", "lfm2moe", "granitehybrid", "plamo2"})
#: hybrids whose recurrent layers come from ``attention.recurrent_layers`` or
#: ``full_attention_interval`` (default 4)
RECR_BY_INTERVAL_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe"})
NEMOTRON_H_ARCHS = frozenset({"nemotron_h", "nemotron_h_moe"})

# SWA types (``llama_swa_type``, src/llama-hparams.h)
SWA_STANDARD = "standard"
SWA_CHUNKED = "chunked"
SWA_SYMMETRIC = "symmetric"


@dataclass(frozen=True)
class _SwaRule:
    """How one architecture's ``load_arch_hparams`` sets up sliding-window attention.

    ``pattern``: the default ``sliding_window_pattern`` (layer ``il`` is SWA when ``il % n < n - 1``,
    or with ``dense_first`` when ``il % n != 0``; 0 makes every layer SWA); None: the GGUF must give
    the pattern as a per-layer bool array. ``window``: the default window when the GGUF has none
    (None: the key is required). ``fixed_window``: the window llama.cpp uses whatever the GGUF says.
    ``when``: "always"; "positive" (only when the GGUF's window is > 0); "present_nonzero" (on unless
    the GGUF sets the window to 0); "n_layer_64" (only for 64-layer models). ``attention_layers``: the
    SWA layers are the attention layers of a hybrid (lfm2).
    """

    type: str = SWA_STANDARD
    pattern: int | None = None
    dense_first: bool = False
    window: int | None = None
    fixed_window: int | None = None
    when: str = "always"
    attention_layers: bool = False


#: ``load_arch_hparams`` of every architecture with sliding-window layers (src/models/<arch>.cpp).
#: Architectures not listed here ignore ``attention.sliding_window`` (llama; phi3 turns it off).
SWA_RULES: dict[str, _SwaRule] = {
    "gemma2": _SwaRule(pattern=2, window=4096),
    "gemma3": _SwaRule(pattern=6, when="positive"),
    "cohere2": _SwaRule(pattern=4),
    "cohere2moe": _SwaRule(pattern=4, dense_first=True),
    "gpt-oss": _SwaRule(pattern=2),
    "llama4": _SwaRule(type=SWA_CHUNKED, pattern=4, fixed_window=8192, when="present_nonzero"),
    "exaone4": _SwaRule(pattern=4, window=4096, when="n_layer_64"),
    "exaone-moe": _SwaRule(pattern=4),
    "olmo2": _SwaRule(pattern=4, when="positive"),
    "afmoe": _SwaRule(pattern=4, when="positive"),
    "smallthinker": _SwaRule(pattern=4, dense_first=True, fixed_window=4096, when="positive"),
    "plamo3": _SwaRule(pattern=8, when="positive"),
    "laguna": _SwaRule(pattern=4, dense_first=True, when="positive"),
    "mellum": _SwaRule(pattern=4, when="positive"),
    "muse-glimmer": _SwaRule(pattern=4),
    "granite_swa": _SwaRule(),
    "mimo2": _SwaRule(),
    "step35": _SwaRule(),
    "maple": _SwaRule(),
    "spark2_5": _SwaRule(),
    "lfm2": _SwaRule(when="positive", attention_layers=True),
}
