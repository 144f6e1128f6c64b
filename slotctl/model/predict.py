"""What a model and the context settings predict a slot file's memory payload to look like.

:func:`predict` adds the server's context flags (:class:`~slotctl.model.settings.ContextSettings`, the very
settings :mod:`slotctl.runtime` builds its contexts from, ``-c 0`` and ``-fa auto`` resolved as llama.cpp
resolves them) to a :class:`~slotctl.model.info.ModelInfo` and returns, per section, the stream count, the
cells each stream holds, ``v_trans``, the version-4 rotations and every layer's record types and sizes, as
the loader (``state_read_data``) will check them. Sources as in :mod:`slotctl.model.info`.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotctl.errors import UsageError
from slotctl.format import ggml
from slotctl.model.archs import SWA_SYMMETRIC
from slotctl.model.info import CTX_PAD, LLAMA_MAX_SEQ, ROT_MIN, VERSIONS, ModelInfo
from slotctl.model.settings import ContextSettings


# --- the context ------------------------------------------------------------------------------------


def flash_attn_enabled(model: ModelInfo, s: ContextSettings) -> bool:
    """Whether the context runs with flash attention, which decides ``v_trans`` (``llama_init_from_model``
    and the ``llama_context`` constructor, src/llama-context.cpp).

    ``-fa off``: off. ``-fa on``: on. ``-fa auto``: on where the device supports it, which the CPU does;
    the KV cache is made before "auto" is resolved, with ``v_trans = !flash_attn`` where anything but
    "off" counts as on, so "auto" always writes ``v_trans = 0``. grok models force it off whatever
    ``-fa`` says. (A quantized V cache turns "auto" into "on" and is refused with "off": see
    :func:`_validate`.)
    """
    return s.flash_attn != "off" and model.arch != "grok"


@dataclass(frozen=True)
class LayerPrediction:
    """The record header(s) one layer writes in a section; fields a record does not hold are None.

    KV sections: ``k_type`` / ``k_row_size`` (bytes) for K; V with ``v_trans`` 0: ``v_type`` /
    ``v_row_size``; V with ``v_trans`` 1: ``v_type``, ``v_el_size`` (bytes per element) and
    ``n_embd_v_gqa``; MLA layers: no V at all. Recurrent sections: the r record in ``k_type`` /
    ``k_row_size``, the s record in ``v_type`` / ``v_row_size``. ``il``: the model layer.
    """

    k_type: str
    k_row_size: int
    v_type: str | None
    v_row_size: int | None
    v_el_size: int | None
    n_embd_v_gqa: int | None
    il: int


@dataclass(frozen=True)
class SectionPrediction:
    """One section as the context will write it and its loader will check it.

    ``type``/``role`` as in :class:`~slotctl.format.memory.SectionLayout`. ``n_stream``: the stream
    count written (recurrent sections have no stream word: 1). ``cells_per_stream``: the cells each
    stream has, the most a stream of a file may hold for this context to load it ("not enough cells
    in kv cache"); recurrent: the cell count of the memory (``max(1, n_seq_max)``). ``v_trans``:
    None for recurrent sections. ``n_rot_k`` / ``n_rot_v``: version 4 KV sections only, else None.
    ``n_layer``: the layer count the section writes (KV: layers in this cache; recurrent: the model's
    ``n_layer``). ``window``: SWA sections only, the most cells a single-sequence save writes (cells
    the window masks are skipped by ``llama_kv_cache::state_write``).
    """

    type: str
    role: str
    n_stream: int
    cells_per_stream: int
    v_trans: int | None
    n_rot_k: int | None
    n_rot_v: int | None
    n_layer: int
    layers: tuple[LayerPrediction, ...]
    window: int | None


@dataclass(frozen=True)
class Prediction:
    """The memory layout a model and settings give.

    ``n_ctx``: the context size after llama.cpp's rounding (``llama_n_ctx``; a draft context is given
    this size, see :meth:`~slotctl.runtime.settings.ContextSettings.for_draft`); ``n_ctx_seq``: cells of
    context per sequence (``llama_n_ctx_seq``, the capacity of each KV stream). ``n_ctx_slot``: the
    server's slot context, ``n_ctx_seq`` capped at the training context and at
    ``--kv-unified-per-slot`` (``server_context::n_ctx_slot``; a restored prompt longer than it is
    refused). ``flash_attn``: flash attention as resolved (:func:`flash_attn_enabled`).
    ``attn_rot_disable``: the version-4 rotations were predicted as with ``LLAMA_ATTN_ROT_DISABLE``.
    """

    model: ModelInfo
    settings: ContextSettings
    version: int
    sections: tuple[SectionPrediction, ...]
    n_ctx: int
    n_ctx_seq: int
    flash_attn: bool = True
    attn_rot_disable: bool = False

    @property
    def n_ctx_slot(self) -> int:
        limits = [self.n_ctx_seq, self.model.n_ctx_train]
        if self.settings.kv_unified_per_slot:
            limits.append(self.settings.kv_unified_per_slot)
        return min(limits)

    @property
    def n_stream(self) -> int:
        """KV streams: 1 with a unified cache, else one per slot."""
        return self.settings.n_stream


def _pad(x: int, n: int) -> int:
    """``GGML_PAD``: round up to a multiple of ``n``."""
    return (x + n - 1) // n * n


def requested_n_ctx(model: ModelInfo, s: ContextSettings) -> int:
    """The ``n_ctx`` the server asks llama.cpp for (:meth:`ContextSettings.context_size`: ``-c``, or
    when it is 0 the training context for every stream, or ``-np x --kv-unified-per-slot``)."""
    return s.context_size(model.n_ctx_train)


def context_sizes(model: ModelInfo, s: ContextSettings) -> tuple[int, int]:
    """(``n_ctx``, ``n_ctx_seq``) as the ``llama_context`` constructor sets them (src/llama-context.cpp).

    The requested ``n_ctx`` (:func:`requested_n_ctx`) is rounded up to a multiple of 256. With a
    unified cache ``n_ctx_seq = n_ctx``; otherwise ``n_ctx_seq = n_ctx / n_seq_max`` rounded up to a
    multiple of 256, and ``n_ctx`` becomes ``n_ctx_seq * n_seq_max`` (up or down).
    """
    n_ctx = requested_n_ctx(model, s)
    if n_ctx == 0:
        raise UsageError("n_ctx is 0 and the model gives no training context (context_length); set -c")
    n_ctx = _pad(n_ctx, CTX_PAD)
    if s.kv_unified:
        return n_ctx, n_ctx
    n_ctx_seq = _pad(n_ctx // s.n_parallel, CTX_PAD)
    return n_ctx_seq * s.n_parallel, n_ctx_seq


def _effective_ubatch(model: ModelInfo, s: ContextSettings) -> int:
    """``cparams.n_ubatch``: at most ``n_batch``, which a causal model caps at the requested ``n_ctx``
    (before rounding) (``llama_context`` constructor)."""
    n_ctx = requested_n_ctx(model, s)
    n_batch = min(n_ctx, s.n_batch) if model.causal_attn else s.n_batch
    return min(n_batch, s.n_ubatch or n_batch)


def swa_cells(model: ModelInfo, s: ContextSettings, n_ctx_seq: int) -> int:
    """Cells per stream of the SWA cache (``llama_kv_cache_iswa`` constructor, src/llama-kv-cache-iswa.cpp).

    ``min(n_ctx_seq, window x (n_seq_max if unified else 1) + n_ubatch)`` rounded up to a multiple of
    256; with ``swa_full`` the base cache's size, ``n_ctx_seq``.
    """
    if s.swa_full:
        return n_ctx_seq
    per_stream = model.sliding_window * (s.n_parallel if s.kv_unified else 1) + _effective_ubatch(model, s)
    return _pad(min(n_ctx_seq, per_stream), CTX_PAD)


def swa_window(model: ModelInfo) -> int:
    """Most cells of one sequence an SWA cache keeps unmasked (``llama_hparams::is_masked_swa``):
    the window for standard and chunked SWA, half of it plus one for symmetric SWA."""
    if model.swa_type == SWA_SYMMETRIC:
        return model.sliding_window // 2 + 1
    return model.sliding_window


def rotations(model: ModelInfo, layers: tuple[int, ...], tk: ggml.GGMLType, tv: ggml.GGMLType,
              disable: bool) -> tuple[int, int]:
    """(``n_rot_k``, ``n_rot_v``) of one KV cache (``llama_kv_cache`` constructor, src/llama-kv-cache.cpp).

    A quantized K cache gets a Hadamard rotation when every layer of the cache has the same K head size
    and layer 0's K head size is a multiple of 64: 64, doubled while the head size is a multiple of
    twice it (head size 64 -> 64, 128 -> 128, 192 -> 64, 256 -> 256). A quantized V cache gets 64 under
    the same conditions on the V head size; MLA caches (no V) get none for V. Unquantized caches, and
    any cache when ``LLAMA_ATTN_ROT_DISABLE`` is set, get 0. (b11434 also always rotates K in the caches of
    DeepSeek lightning indexers, architectures slotctl does not model: :data:`slotctl.model.archs.UNSUPPORTED_ARCHS`.)
    """
    if not layers:
        return 0, 0

    def common(sizes: set[int]) -> int:
        return sizes.pop() if len(sizes) == 1 else -1

    head_k_all = common({model.head_size_k(il) for il in layers})
    head_v_all = 0 if model.mla else common({model.head_size_v(il) for il in layers})
    n_rot_k = n_rot_v = 0
    rot_k = not disable and head_k_all > 0 and tk.block > 1 and model.head_size_k(0) % ROT_MIN == 0
    if rot_k:
        n_rot_k = ROT_MIN
        while head_k_all > 0 and head_k_all % (2 * n_rot_k) == 0:
            n_rot_k *= 2
    if not disable and head_v_all > 0 and tv.block > 1 and model.head_size_v(0) % ROT_MIN == 0:
        n_rot_v = ROT_MIN
    return n_rot_k, n_rot_v


def _validate(model: ModelInfo, s: ContextSettings, version: int) -> tuple[ggml.GGMLType, ggml.GGMLType, bool]:
    """Check the settings as ``llama_init_from_model`` and the ``llama_context`` constructor do
    (:class:`ContextSettings` has already checked the names and signs of its values).

    Returns the K and V types and whether flash attention is on (:func:`flash_attn_enabled`).
    """
    if version not in VERSIONS:
        raise UsageError(f"state version {version} is not one of {', '.join(map(str, VERSIONS))}")
    if not 1 <= s.n_parallel <= LLAMA_MAX_SEQ:
        raise UsageError(f"-np {s.n_parallel}: the number of slots must be between 1 and {LLAMA_MAX_SEQ}")
    tk, tv = ggml.cache_type(s.type_k), ggml.cache_type(s.type_v)   # ContextSettings checked the names
    flash_attn = flash_attn_enabled(model, s)
    if model.mla and tk.id != tv.id:
        raise UsageError(f"{model.arch} models (MLA) need the same K and V cache types; got -ctk {tk.name} "
                         f"-ctv {tv.name}")
    if tv.block > 1 and not flash_attn:
        why = " (grok models run without flash attention)" if s.flash_attn != "off" else ""
        raise UsageError(f"a quantized V cache (-ctv {tv.name}) requires flash attention: -fa on{why}")
    for t, flag, head, gqa in ((tk, "-ctk", model.head_size_k, model.n_embd_k_gqa),
                               (tv, "-ctv", model.head_size_v, model.n_embd_v_gqa)):
        if t.block == 1:
            continue
        if flash_attn:
            # llama_init_from_model: flash attention needs whole blocks in every head
            what, bad = "head size", [(il, head(il)) for il in range(model.n_layer) if head(il) % t.block]
        else:
            # only K gets here (a quantized V needs flash attention): ggml_row_size needs whole blocks
            what, bad = "row size", [(il, gqa(il)) for il in model.kv_layers() if gqa(il) % t.block]
        if bad:
            il, n = bad[0]
            raise UsageError(f"{flag} {t.name}: its blocks of {t.block} do not divide the {what} {n} of "
                             f"layer {il}; use another cache type")
    return tk, tv, flash_attn


def _kv_section(model: ModelInfo, role: str, n_stream: int, cells: int, v_trans: bool,
                tk: ggml.GGMLType, tv: ggml.GGMLType, attn_rot_disable: bool, version: int,
                window: int | None) -> SectionPrediction:
    """One KV cache (``llama_kv_cache::state_write_data``): K rows of ``ggml_row_size(type_k,
    n_embd_k_gqa)``, then V rows, or V element-major with ``ggml_type_size(type_v)`` and
    ``n_embd_v_gqa`` when transposed; no V for MLA."""
    ids = model.kv_layers(role)
    layers = []
    for il in ids:
        v_type = v_row = v_el = v_gqa = None
        if not model.mla:
            v_type = tv.name
            if v_trans:
                v_el, v_gqa = tv.block_bytes, model.n_embd_v_gqa(il)
            else:
                v_row = tv.row_size(model.n_embd_v_gqa(il))
        layers.append(LayerPrediction(tk.name, tk.row_size(model.n_embd_k_gqa(il)), v_type, v_row, v_el, v_gqa, il))
    n_rot_k = n_rot_v = None
    if version >= 4:
        n_rot_k, n_rot_v = rotations(model, ids, tk, tv, attn_rot_disable)
    return SectionPrediction("kv", role, n_stream, cells, int(v_trans), n_rot_k, n_rot_v, len(ids),
                             tuple(layers), window)


def _recurrent_section(model: ModelInfo, s: ContextSettings) -> SectionPrediction:
    """The recurrent memory (``llama_memory_recurrent``): ``max(1, n_seq_max)`` cells, f32 r and s rows
    of ``n_embd_r`` and ``n_embd_s`` elements for each recurrent layer, ``n_layer`` written as the
    model's ``n_layer`` (``create_memory`` passes GGML_TYPE_F32 for both)."""
    f32 = ggml.BY_NAME["f32"]
    layers = tuple(LayerPrediction("f32", f32.row_size(model.n_embd_r), "f32", f32.row_size(model.n_embd_s),
                                   None, None, il) for il in model.recurrent_layer_ids())
    return SectionPrediction("recurrent", "recurrent", 1, max(1, s.n_parallel), None, None, None,
                             model.n_layer, layers, None)


def predict(model: ModelInfo, settings: ContextSettings, version: int = 4, *,
            attn_rot_disable: bool = False) -> Prediction:
    """The memory a context built with ``settings`` writes for ``model`` in state version ``version``.

    ``settings`` are the server's flags, as :class:`~slotctl.runtime.context.Context` builds a context
    from them: ``-c 0`` and ``-fa auto`` are resolved here as llama.cpp and the server resolve them
    (:func:`context_sizes`, :func:`flash_attn_enabled`). For a draft context pass the target's
    ``settings.for_draft(target_prediction.n_ctx, ctkd, ctvd)``, as the server builds it.
    ``attn_rot_disable``: predict the rotations of a server run with ``LLAMA_ATTN_ROT_DISABLE`` set.

    KV streams: 1 with a unified cache, else ``n_seq_max`` (``llama_kv_cache`` constructor). Cells per
    stream: ``n_ctx_seq`` (:func:`context_sizes`) for plain, base and attention caches;
    :func:`swa_cells` for SWA caches. ``v_trans`` = flash attention off. Rotations:
    :func:`rotations`, per cache. Raises :class:`UsageError` for settings llama.cpp refuses
    (:func:`_validate`) and for models whose memory this module does not model.
    """
    model.require_supported()
    tk, tv, flash_attn = _validate(model, settings, version)
    n_ctx, n_ctx_seq = context_sizes(model, settings)
    n_stream = settings.n_stream
    v_trans = not flash_attn

    def kv(role: str) -> SectionPrediction:
        if role == "swa":
            return _kv_section(model, role, n_stream, swa_cells(model, settings, n_ctx_seq), v_trans, tk, tv,
                               attn_rot_disable, version, swa_window(model))
        return _kv_section(model, role, n_stream, n_ctx_seq, v_trans, tk, tv, attn_rot_disable, version, None)

    sections = tuple(kv(sec.role) if sec.type == "kv" else _recurrent_section(model, settings)
                     for sec in model.layout().sections)
    return Prediction(model, settings, version, sections, n_ctx, n_ctx_seq, flash_attn, attn_rot_disable)


def rotation_rule(model: ModelInfo, *, disable: bool = False):
    """The model's rotation rule for :func:`slotctl.format.convert.convert_payload`:
    ``(section role, K type id, V type id) -> (n_rot_k, n_rot_v)``."""

    def rule(role: str, type_k: int, type_v: int) -> tuple[int, int]:
        return rotations(model, model.kv_layers(role), ggml.BY_ID[type_k], ggml.BY_ID[type_v], disable)

    return rule
