"""llama-server's flags and defaults that decide what a slot file restores into, as one value: :class:`ServerFlags`.

Names are b11434's (``common/arg.cpp``): each field is the long flag without its dashes, and :data:`FLAGS`
gives every spelling the server takes, the short one first. Defaults are the server's (``common/common.h``),
with one exception, ``-np``: a server started without it picks "auto", 4 slots with a unified cache
(``tools/server/server.cpp``); slotctl defaults to 1 slot, the common case of a saved slot file, so pass
``-np 4 -kvu`` to mirror "auto".

Checks follow the server's own parsers: cache types are read as ``kv_cache_type_from_str`` reads them
(exact names from ``kv_cache_types``), ``-fa`` as ``is_truthy`` / ``is_falsey`` / ``is_autoy`` read it,
``-np 0`` is refused. A bad value is a :class:`FlagError` naming the flag and the allowed values.

Also here: the environment switches the server reads (``LLAMA_ATTN_ROT_DISABLE``) and the state version of
the servers that write SCKP and SDFT appendices.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from slotctl.errors import UsageError
from slotctl.format import ggml
from slotctl.model.settings import DRAFT_CACHE_TYPE_DEFAULT, ContextSettings

#: the state version of the servers that write SCKP and SDFT appendices (llama.cpp b11434 and later)
SERVER_STATE_VERSION = 4
#: ``--ctx-checkpoints`` (``-ctxcp``) default: checkpoints kept per slot (b11434 ``common_params::n_ctx_checkpoints``)
DEFAULT_CTX_CHECKPOINTS = 32
#: ``--checkpoint-min-step`` (``-cms``) default: least spacing of checkpoints, in tokens
DEFAULT_CHECKPOINT_MIN_STEP = 8192
#: ``--spec-draft-n-max`` default: tokens the draft proposes per step
DEFAULT_SPEC_DRAFT_N_MAX = 3
#: the most slots a server has (``LLAMA_MAX_SEQ``, src/llama-cparams.h)
MAX_PARALLEL = 256

#: ``-fa`` values as b11434's ``common_arg_utils::is_truthy`` / ``is_falsey`` / ``is_autoy`` read them
FLASH_ATTN_VALUES = {"on": "on", "enabled": "on", "true": "on", "1": "on",
                     "off": "off", "disabled": "off", "false": "off", "0": "off",
                     "auto": "auto", "-1": "auto"}

#: every spelling of each flag llama-server b11434 takes, the short one first (``common/arg.cpp``)
FLAGS: dict[str, tuple[str, ...]] = {
    "ctx_size": ("-c", "--ctx-size"),
    "parallel": ("-np", "--parallel"),
    "kv_unified": ("-kvu", "--kv-unified"),
    "kv_unified_per_slot": ("--kv-unified-per-slot",),
    "cache_type_k": ("-ctk", "--cache-type-k"),
    "cache_type_v": ("-ctv", "--cache-type-v"),
    "spec_draft_type_k": ("-ctkd", "--spec-draft-type-k", "--cache-type-k-draft"),
    "spec_draft_type_v": ("-ctvd", "--spec-draft-type-v", "--cache-type-v-draft"),
    "flash_attn": ("-fa", "--flash-attn"),
    "batch_size": ("-b", "--batch-size"),
    "ubatch_size": ("-ub", "--ubatch-size"),
    "swa_full": ("--swa-full",),
    "ctx_checkpoints": ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"),
    "checkpoint_min_step": ("-cms", "--checkpoint-min-step"),
    "spec_draft_n_max": ("--spec-draft-n-max",),
    "threads": ("-t", "--threads"),
}


def flag_name(field: str) -> str:
    """The flag a field is usually written as (its short form)."""
    return FLAGS[field][0]


class FlagError(UsageError):
    """A server flag with a value the server refuses: ``field`` (a :class:`ServerFlags` field), ``value`` as
    given, ``expected`` what the server takes. The message names the flag's short form;
    :meth:`as_typed` names it as the user wrote it."""

    def __init__(self, field: str, value: object, expected: str):
        self.field, self.value, self.expected = field, value, expected
        super().__init__(self.as_typed(flag_name(field)))

    def as_typed(self, flag: str) -> str:
        return f"{flag} {self.value}: {self.expected}"


def cache_type(value: str, field: str) -> str:
    """A ``-ctk`` / ``-ctv`` / ``-ctkd`` / ``-ctvd`` value as ``kv_cache_type_from_str`` reads it: one of
    ``kv_cache_types``, by its exact ggml name."""
    try:
        return ggml.cache_type(value).name
    except ValueError as e:
        raise FlagError(field, value, str(e)) from None


def flash_attn_value(value: str) -> str:
    """``-fa`` as the server reads it: "on", "off" or "auto" (and their other spellings)."""
    try:
        return FLASH_ATTN_VALUES[value]
    except KeyError:
        raise FlagError("flash_attn", value, "expected on, off or auto") from None


_CONTEXT = ContextSettings()


@dataclass(frozen=True)
class ServerFlags:
    """The flags of a llama-server that decide what a slot file restores into (see the module docstring).

    ``ctx_size``: ``-c``, 0 = the model's training context per slot. ``parallel``: ``-np``, the slots.
    ``kv_unified``: ``-kvu``. ``kv_unified_per_slot``: ``--kv-unified-per-slot`` (0 = unset).
    ``cache_type_k`` / ``cache_type_v``: ``-ctk`` / ``-ctv``. ``spec_draft_type_k`` / ``spec_draft_type_v``:
    ``-ctkd`` / ``-ctvd``, the draft's (f16 whatever ``-ctk`` says). ``flash_attn``: ``-fa``.
    ``batch_size`` / ``ubatch_size``: ``-b`` / ``-ub``. ``swa_full``: ``--swa-full``. ``ctx_checkpoints``:
    ``-ctxcp``. ``checkpoint_min_step``: ``-cms``. ``spec_draft_n_max``: ``--spec-draft-n-max``.
    ``threads``: ``-t``, 0 = every core (speed only).
    """

    # the flags that build the target context default to the context's own defaults, written once in
    # slotctl.model.settings.ContextSettings (the server's values, not llama.cpp's library defaults)
    ctx_size: int = _CONTEXT.n_ctx
    parallel: int = _CONTEXT.n_parallel
    kv_unified: bool = _CONTEXT.kv_unified
    kv_unified_per_slot: int = _CONTEXT.kv_unified_per_slot
    cache_type_k: str = _CONTEXT.type_k
    cache_type_v: str = _CONTEXT.type_v
    spec_draft_type_k: str = DRAFT_CACHE_TYPE_DEFAULT
    spec_draft_type_v: str = DRAFT_CACHE_TYPE_DEFAULT
    flash_attn: str = _CONTEXT.flash_attn
    batch_size: int = _CONTEXT.n_batch
    ubatch_size: int = _CONTEXT.n_ubatch
    swa_full: bool = _CONTEXT.swa_full
    ctx_checkpoints: int = DEFAULT_CTX_CHECKPOINTS
    checkpoint_min_step: int = DEFAULT_CHECKPOINT_MIN_STEP
    spec_draft_n_max: int = DEFAULT_SPEC_DRAFT_N_MAX
    threads: int = _CONTEXT.n_threads

    def __post_init__(self) -> None:
        for name in ("cache_type_k", "cache_type_v", "spec_draft_type_k", "spec_draft_type_v"):
            cache_type(getattr(self, name), name)
        object.__setattr__(self, "flash_attn", flash_attn_value(self.flash_attn))
        if not 1 <= self.parallel <= MAX_PARALLEL:
            raise FlagError("parallel", self.parallel, f"expected a number of slots from 1 to {MAX_PARALLEL}")
        for name in ("ctx_size", "kv_unified_per_slot", "ctx_checkpoints", "checkpoint_min_step",
                     "spec_draft_n_max", "threads"):
            if getattr(self, name) < 0:
                raise FlagError(name, getattr(self, name), "expected 0 or more")
        for name in ("batch_size", "ubatch_size"):
            if getattr(self, name) < 1:
                raise FlagError(name, getattr(self, name), "expected 1 or more")

    def context_settings(self) -> ContextSettings:
        """The target context's options, as the server builds its context from these flags."""
        return ContextSettings(n_ctx=self.ctx_size, n_parallel=self.parallel, kv_unified=self.kv_unified,
                               kv_unified_per_slot=self.kv_unified_per_slot, type_k=self.cache_type_k,
                               type_v=self.cache_type_v, flash_attn=self.flash_attn, n_batch=self.batch_size,
                               n_ubatch=self.ubatch_size, swa_full=self.swa_full, n_threads=self.threads)

    @property
    def draft_types(self) -> tuple[str, str]:
        """The draft context's (K, V) cache types."""
        return self.spec_draft_type_k, self.spec_draft_type_v

    def replace(self, **changes) -> ServerFlags:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_settings(cls, settings: ContextSettings, **more) -> ServerFlags:
        """The flags a context built with ``settings`` comes from (``more``: the other fields)."""
        return cls(ctx_size=settings.n_ctx, parallel=settings.n_parallel, kv_unified=settings.kv_unified,
                   kv_unified_per_slot=settings.kv_unified_per_slot, cache_type_k=settings.type_k,
                   cache_type_v=settings.type_v, flash_attn=settings.flash_attn, batch_size=settings.n_batch,
                   ubatch_size=settings.n_ubatch, swa_full=settings.swa_full, threads=settings.n_threads, **more)


def check_slot(slot: int, parallel: int) -> None:
    """The server's "Invalid slot ID": a slot outside ``0..-np - 1``."""
    if not 0 <= slot < parallel:
        raise UsageError(f"--slot {slot}: the server has slots 0..{parallel - 1} (-np {parallel})")


def env_switch(name: str, environ: dict | None = None) -> bool:
    """An environment switch read as llama.cpp reads it (``atoi``: leading blanks and a sign, then digits;
    non-zero is on)."""
    value = (os.environ if environ is None else environ).get(name, "").strip()
    digits = value[1:] if value[:1] in "+-" else value
    n = ""
    for ch in digits:
        if not ch.isdigit():
            break
        n += ch
    return bool(n) and int(n) != 0


def attn_rot_disable(environ: dict | None = None) -> bool:
    """Whether the server runs with ``LLAMA_ATTN_ROT_DISABLE`` set (``llama_kv_cache`` constructor): no
    Hadamard rotation of quantized caches, so version-4 files record zero rotations."""
    return env_switch("LLAMA_ATTN_ROT_DISABLE", environ)
