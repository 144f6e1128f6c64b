"""The llama-server options that decide how a slot's memory is laid out, as plain data.

Pure Python (no llama.cpp import), so the CLI can parse and check options before loading anything.
Field defaults are llama-server's (llama.cpp b11434, ``common/common.h`` and ``common/arg.cpp``),
with one exception: ``n_parallel``. A server started without ``-np`` picks "auto", which it turns
into 4 slots with a unified cache (``tools/server/server.cpp``); to mirror that, pass
``n_parallel=4, kv_unified=True``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from slotctl.format.ggml import BY_NAME, cache_type

#: ``--flash-attn`` values and the ``llama_flash_attn_type`` each maps to
FLASH_ATTN_TYPES = {"auto": -1, "off": 0, "on": 1}

#: the draft's cache type when ``-ctkd`` / ``-ctvd`` is not given (not the target's ``-ctk`` / ``-ctv``)
DRAFT_CACHE_TYPE_DEFAULT = "f16"


@dataclass(frozen=True)
class ContextSettings:
    """llama-server context options, named after their flags.

    ``n_ctx``: ``-c``; 0 means unset: the server then sizes the cache to ``n_parallel *
    kv_unified_per_slot`` when that is set, else to the model's training context for every
    stream (what ``--fit``, on by default, picks when memory allows; on a host short of memory
    the server may pick less). llama.cpp rounds the size up to a multiple of 256, and without a
    unified cache to ``n_parallel`` streams of a multiple of 256 each.
    ``n_parallel``: ``-np``, the number of slots (llama's ``n_seq_max``).
    ``kv_unified``: ``-kvu``, one cache stream shared by all slots instead of one per slot.
    ``kv_unified_per_slot``: ``--kv-unified-per-slot``, caps each slot's context (0 = unset).
    ``type_k`` / ``type_v``: ``-ctk`` / ``-ctv``, cache types by ggml name ("f16", "q8_0", ...).
    ``flash_attn``: ``-fa``, "on", "off" or "auto"; llama.cpp resolves "auto" to "on" where the
    device supports it (the CPU does), and to "on" for a quantized V cache.
    ``n_batch`` / ``n_ubatch``: ``-b`` / ``-ub``.
    ``swa_full``: ``--swa-full``; off in the server (llama.cpp's own default is on).
    ``n_outputs_max``: most outputs (logits rows) one decode may ask for, 0 = ``n_batch``; the
    server leaves the target at 0 and gives its draft ``n_parallel``.
    ``n_threads``: ``-t``, 0 = every core. Speed only; it changes nothing in a saved state.
    """

    n_ctx: int = 0
    n_parallel: int = 1
    kv_unified: bool = False
    kv_unified_per_slot: int = 0
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"
    n_batch: int = 2048
    n_ubatch: int = 512
    swa_full: bool = False
    n_outputs_max: int = 0
    n_threads: int = 0

    def __post_init__(self) -> None:
        for name in ("type_k", "type_v"):
            value = getattr(self, name).lower()
            try:
                cache_type(value)
            except ValueError as e:
                raise ValueError(f"{name}: unknown cache type {value!r}; {e}") from None
            object.__setattr__(self, name, value)
        if self.flash_attn not in FLASH_ATTN_TYPES:
            raise ValueError(f"flash_attn: expected one of {', '.join(FLASH_ATTN_TYPES)}, got {self.flash_attn!r}")
        for name in ("n_ctx", "kv_unified_per_slot", "n_outputs_max", "n_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        for name in ("n_parallel", "n_batch", "n_ubatch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if 0 < self.n_outputs_max < self.n_parallel:
            # llama.cpp reserves room for an output per sequence and asserts that it fits
            raise ValueError(f"n_outputs_max ({self.n_outputs_max}) must be 0 or at least "
                             f"n_parallel ({self.n_parallel})")

    @property
    def n_stream(self) -> int:
        """Cache streams: 1 with a unified cache, else one per slot (the ``n_stream`` of a saved state)."""
        return 1 if self.kv_unified else self.n_parallel

    @property
    def type_k_id(self) -> int:
        """ggml type id of the K cache."""
        return BY_NAME[self.type_k].id

    @property
    def type_v_id(self) -> int:
        """ggml type id of the V cache."""
        return BY_NAME[self.type_v].id

    @property
    def threads(self) -> int:
        """Threads to compute with."""
        return self.n_threads or os.cpu_count() or 1

    def context_size(self, n_ctx_train: int) -> int:
        """The ``n_ctx`` the server asks llama.cpp for, given the model's training context."""
        if self.n_ctx:
            return self.n_ctx
        if self.kv_unified_per_slot:
            return self.n_parallel * self.kv_unified_per_slot
        return n_ctx_train * self.n_stream

    def for_draft(self, n_ctx: int, type_k: str = DRAFT_CACHE_TYPE_DEFAULT,
                  type_v: str = DRAFT_CACHE_TYPE_DEFAULT) -> ContextSettings:
        """The draft context's settings, derived as llama-server derives them from the target's.

        ``n_ctx`` is the target context's actual size (``llama_n_ctx``), which the draft takes
        over; ``type_k`` / ``type_v`` are ``-ctkd`` / ``-ctvd``. Slots, unified cache, flash
        attention, batch sizes and threads are the target's; outputs are capped at one per slot
        (``common_base_params_to_speculative`` and ``common_speculative_init_result`` in b11434).
        """
        return dataclasses.replace(self, n_ctx=n_ctx, kv_unified_per_slot=0, type_k=type_k, type_v=type_v,
                                   n_outputs_max=self.n_parallel)
