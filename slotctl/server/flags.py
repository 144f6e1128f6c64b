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
import re
from dataclasses import dataclass

from slotctl.errors import UsageError
from slotctl.format import ggml
from slotctl.model.settings import DRAFT_CACHE_TYPE_DEFAULT, ContextSettings
# the defaults of --ctx-checkpoints and --checkpoint-min-step live with the checkpoints they count (read here,
# and by findings and reuse without this module's tables and classes: inspect FILE needs them, not the flags)
from slotctl.server.checkpoints import DEFAULT_CHECKPOINT_MIN_STEP, DEFAULT_CTX_CHECKPOINTS  # noqa: F401

#: the state version of the servers that write SCKP and SDFT appendices (llama.cpp b11434 and later)
SERVER_STATE_VERSION = 4
#: ``--spec-draft-n-max`` default: tokens the draft proposes per step
DEFAULT_SPEC_DRAFT_N_MAX = 3
#: the most slots a server has (``LLAMA_MAX_SEQ``, src/llama-cparams.h)
MAX_PARALLEL = 256

#: ``-fa`` values as b11434's ``common_arg_utils::is_truthy`` / ``is_falsey`` / ``is_autoy`` read them
FLASH_ATTN_VALUES = {"on": "on", "enabled": "on", "true": "on", "1": "on",
                     "off": "off", "disabled": "off", "false": "off", "0": "off",
                     "auto": "auto", "-1": "auto"}

# -- llama-server's command line (b11434's own argument table, generated into slotctl.server.args_b11434) --


@dataclass(frozen=True)
class ServerArg:
    """One argument of llama-server b11434 (a ``common_arg`` of ``common/arg.cpp``): its spellings, its
    negated spellings (``-no-kvu``), how many values follow it (0, 1 or 2) and its environment variable."""

    names: tuple[str, ...]
    negated: tuple[str, ...]
    values: int
    env: str | None

    @property
    def name(self) -> str:
        """The spelling it is usually written as: the short one when there is one."""
        return short_first(self.names)[0]


def short_first(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(names, key=lambda n: n.startswith("--")))


def _server_args() -> dict[str, ServerArg]:
    """Every spelling llama-server takes, to its argument: b11434's (``common/arg.cpp``) and b11669's (its
    ``--help``: ``--spec-draft-*``, the router's ``--models-dir``, ``--cache-idle-slots``, ...), so that a
    command line of either build pastes. The server's rule (``common_params_parser_init``'s ``add_opt``): an
    argument set for ``LLAMA_EXAMPLE_SERVER`` or ``LLAMA_EXAMPLE_COMMON`` and not excluded from the server; a
    spelling declared twice means the last declaration (``arg_to_options``). A spelling both builds take is
    b11434's argument (the fields slotctl uses are spelt alike in both)."""
    return {**build_args("b11669"), **build_args("b11434")}


def build_args(build: str) -> dict[str, ServerArg]:
    """Every spelling llama-server ``build`` (b11434, b11669) takes, to its argument: its own table alone."""
    if build == "b11434":
        from slotctl.server.args_b11434 import ARGS
    elif build == "b11669":
        from slotctl.server.args_b11669 import ARGS
    else:
        raise ValueError(f"no argument table of {build}")
    table: dict[str, ServerArg] = {}
    for names, negated, values, env, examples, excludes in ARGS:
        if ("SERVER" in examples or "COMMON" in examples) and "SERVER" not in excludes:
            arg = ServerArg(names, negated, values, env)
            table.update({n: arg for n in names + negated})
    return table


def server_arg(spelling: str) -> ServerArg | None:
    """The argument llama-server reads ``spelling`` as (``--ctx_size`` as ``--ctx-size``: its parser turns
    ``_`` into ``-`` in a ``--`` argument), or None when the server refuses it ("invalid argument")."""
    if spelling.startswith("--"):
        spelling = spelling.replace("_", "-")
    return _tables()["SERVER_ARGS"].get(spelling)


#: the flags slotctl uses, by :class:`ServerFlags` field: the spelling of b11434's argument that sets it
_FIELD_SPELLINGS = {
    "ctx_size": "--ctx-size",
    "parallel": "--parallel",
    "kv_unified": "--kv-unified",
    "kv_unified_per_slot": "--kv-unified-per-slot",
    "cache_type_k": "--cache-type-k",
    "cache_type_v": "--cache-type-v",
    "spec_draft_type_k": "--spec-draft-type-k",
    "spec_draft_type_v": "--spec-draft-type-v",
    "flash_attn": "--flash-attn",
    "batch_size": "--batch-size",
    "ubatch_size": "--ubatch-size",
    "swa_full": "--swa-full",
    "ctx_checkpoints": "--ctx-checkpoints",
    "checkpoint_min_step": "--checkpoint-min-step",
    "spec_draft_n_max": "--spec-draft-n-max",
    "spec_type": "--spec-type",
    "threads": "--threads",
}

_TABLES: dict[str, dict] = {}


def _tables() -> dict[str, dict]:
    """The tables read from b11434's argument table, made on first use (a command that takes no server flag,
    ``inspect FILE``, never reads the 357 arguments):

    * ``SERVER_ARGS``: every spelling llama-server b11434 takes, to its argument;
    * ``FIELD_ARGS``: the flags slotctl uses, by :class:`ServerFlags` field, to their argument;
    * ``FLAGS``: every spelling of each of those, the short one first;
    * ``NEGATED_FLAGS``: the negated spellings of those that have one (``-no-kvu``, ``--no-kv-unified``).
    """
    if not _TABLES:
        args = _server_args()
        fields = {field: args[spelling] for field, spelling in _FIELD_SPELLINGS.items()}
        _TABLES.update(
            SERVER_ARGS=args, FIELD_ARGS=fields,
            FLAGS={field: short_first(arg.names) for field, arg in fields.items()},
            NEGATED_FLAGS={field: short_first(arg.negated) for field, arg in fields.items() if arg.negated})
    return _TABLES


def __getattr__(name: str):
    """``SERVER_ARGS``, ``FIELD_ARGS``, ``FLAGS`` and ``NEGATED_FLAGS`` (:func:`_tables`), made when first
    imported."""
    if name in ("SERVER_ARGS", "FIELD_ARGS", "FLAGS", "NEGATED_FLAGS"):
        return _tables()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_environment(environ: dict | None = None) -> dict[str, tuple[str, object]]:
    """The :class:`ServerFlags` fields the server would take from its environment (``LLAMA_ARG_CTX_SIZE=64``
    is ``-c 64``; ``LLAMA_ARG_NO_KV_UNIFIED`` set is ``-no-kvu``), as ``{field: (variable, value)}``, read
    as ``common_params_parse_ex`` reads them: numbers by ``std::stoi``, switches by ``is_truthy`` /
    ``is_falsey``. A value the server cannot read is a :class:`UsageError` naming the variable."""
    env = os.environ if environ is None else environ
    found: dict[str, tuple[str, object]] = {}
    for field, arg in _tables()["FIELD_ARGS"].items():
        if arg.env is None:
            continue
        var, value = arg.env, env.get(arg.env)
        neg = arg.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
        if arg.negated and neg in env:  # get_value_from_env: the LLAMA_ARG_NO_ variant first, as "0"
            var, value = neg, "0"
        if value is None:
            continue
        kind = type(getattr(ServerFlags(), field))
        if kind is bool:
            if value in _TRUTHY:
                found[field] = (var, True)
            elif value in _FALSEY:
                if arg.negated:  # handler_bool; a switch without a negation (--swa-full) ignores a falsey value
                    found[field] = (var, False)
            elif arg.negated:
                raise UsageError(f"{_shown(var, value)}: expected on, off, true, false, 1 or 0 (llama-server reads it as "
                                 f"{flag_name(field)})")
        elif kind is int:
            found[field] = (var, _stoi(value, var, flag_name(field)))
        else:
            found[field] = (var, value)
    return found


#: ``common_arg_utils::is_truthy`` / ``is_falsey`` (compared exactly)
_TRUTHY = {"on", "enabled", "true", "1"}
_FALSEY = {"off", "disabled", "false", "0"}


#: ``std::stoi`` reads an ``int``: the server's numeric flags hold 32 bits, and a value outside them makes
#: it throw ``std::out_of_range``: the server does not start ("error while handling argument")
INT_MAX = 2**31 - 1
_LEADING_INT = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)")


def _shown(var: str, value: str) -> str:
    """``VAR=value`` for a message, a value of absurd length named by its length instead."""
    return f"{var}={value}" if len(value) <= 64 else f"{var} ({len(value):,} characters)"


def _stoi(value: str, var: str, flag: str) -> int:
    """``std::stoi`` of the variable ``var`` (read as ``flag``): leading blanks, a sign and digits; what
    follows them is ignored; no digits is an error, and so is a value outside ``int`` (``std::out_of_range``:
    decided on the count of digits first, so a number of millions of digits costs nothing)."""
    shown = _shown(var, value)
    m = _LEADING_INT.match(value)
    if m is None:
        raise UsageError(f"{shown}: expected a number (llama-server reads it as {flag})")
    sign, digits = m.groups()
    digits = digits.lstrip("0") or "0"
    if len(digits) > 10 or not -INT_MAX - 1 <= int(sign + digits) <= INT_MAX:
        raise UsageError(f"{shown}: out of range: llama-server reads {flag} as a 32-bit int (std::stoi) and "
                         f"does not start with it")
    return int(sign + digits)


def flag_name(field: str) -> str:
    """The flag a field is usually written as (its short form)."""
    return _tables()["FLAGS"][field][0]


class FlagError(UsageError):
    """A server flag with a value the server refuses: ``field`` (a :class:`ServerFlags` field), ``value`` as
    given, ``expected`` what the server takes. The message names the flag's short form;
    :meth:`as_typed` names it as the user wrote it."""

    def __init__(self, field: str, value: object, expected: str):
        self.field, self.value, self.expected = field, value, expected
        super().__init__(self.as_typed(flag_name(field)))

    def as_typed(self, flag: str) -> str:
        shown = str(self.value)
        return f"{flag} {shown if len(shown) <= 64 else f'({len(shown):,} characters)'}: {self.expected}"


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


def flag_values(field: str) -> tuple[str, ...]:
    """The values the flag of ``field`` takes, by the names the server prints (what shell completion
    offers): the cache types for ``-ctk``/``-ctv``/``-ctkd``/``-ctvd`` (those :func:`cache_type` accepts), on,
    off and auto for ``-fa`` (:data:`FLASH_ATTN_VALUES`); none for the other flags."""
    if field in ("cache_type_k", "cache_type_v", "spec_draft_type_k", "spec_draft_type_v"):
        return tuple(ggml.CACHE_TYPE_NAMES)
    if field == "flash_attn":
        return tuple(dict.fromkeys(FLASH_ATTN_VALUES.values()))
    return ()


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
    ``spec_type``: ``--spec-type`` (None: not given), which with ``-md`` decides whether the server builds a
    draft context at all (:func:`slotctl.server.speculative.draft_context`). ``threads``: ``-t``, 0 = every
    core (speed only).
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
    #: ``--spec-type`` as given (None: not given; the server's default list is "none", and a draft GGUF's
    #: inferred types apply: :func:`slotctl.server.speculative.server_spec_types`)
    spec_type: str | None = None
    threads: int = _CONTEXT.n_threads

    def __post_init__(self) -> None:
        if self.spec_type is not None:
            from slotctl.server.speculative import parse_spec_types

            try:
                parse_spec_types(self.spec_type)
            except ValueError as e:
                raise FlagError("spec_type", self.spec_type, str(e)) from None
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
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if type(value) is int and value > INT_MAX:
                raise FlagError(f.name, value, f"expected {INT_MAX:,} or less (llama-server reads it as a 32-bit "
                                               f"int, std::stoi, and does not start)")

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
    m = _LEADING_INT.match((os.environ if environ is None else environ).get(name, ""))
    return m is not None and m.group(2).strip("0") != ""   # any digit but 0: non-zero (or out of range: UB in atoi)


def attn_rot_disable(environ: dict | None = None) -> bool:
    """Whether the server runs with ``LLAMA_ATTN_ROT_DISABLE`` set (``llama_kv_cache`` constructor): no
    Hadamard rotation of quantized caches, so version-4 files record zero rotations."""
    return env_switch("LLAMA_ATTN_ROT_DISABLE", environ)
