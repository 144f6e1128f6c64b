"""ggml tensor types as they appear in cache records: id, name, block size, bytes per block."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block: int
    block_bytes: int

    def row_size(self, n: int) -> int:
        """``ggml_row_size(type, n)``."""
        return self.block_bytes * n // self.block


_TYPES = [
    GGMLType(0, "f32", 1, 4),
    GGMLType(1, "f16", 1, 2),
    GGMLType(2, "q4_0", 32, 18),
    GGMLType(3, "q4_1", 32, 20),
    GGMLType(6, "q5_0", 32, 22),
    GGMLType(7, "q5_1", 32, 24),
    GGMLType(8, "q8_0", 32, 34),
    GGMLType(20, "iq4_nl", 32, 18),
    GGMLType(24, "i8", 1, 1),
    GGMLType(25, "i16", 1, 2),
    GGMLType(26, "i32", 1, 4),
    GGMLType(30, "bf16", 1, 2),
]

BY_ID: dict[int, GGMLType] = {t.id: t for t in _TYPES}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in _TYPES}

#: the cache types llama-server accepts for -ctk/-ctv (common/arg.cpp kv_cache_types)
CACHE_TYPE_NAMES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def cache_type(name: str) -> GGMLType:
    """The cache type named ``name`` as llama-server's ``kv_cache_type_from_str`` reads ``-ctk`` and its kin
    (b11434 common/arg.cpp): one of :data:`CACHE_TYPE_NAMES`, by its exact name; ValueError saying which
    names are allowed. The one check of a cache type: flags (:mod:`slotctl.server.flags`) and context
    settings (:mod:`slotctl.model.settings`) both use it."""
    if name not in CACHE_TYPE_NAMES:
        raise ValueError(f"expected one of {', '.join(CACHE_TYPE_NAMES)}")
    return BY_NAME[name]


def type_name(type_id: int) -> str:
    t = BY_ID.get(type_id)
    return t.name if t else f"type{type_id}"


def by_name(name: str) -> GGMLType:
    try:
        return BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(f"unknown ggml type {name!r}; expected one of {', '.join(CACHE_TYPE_NAMES)}") from None


def is_quantized(type_id: int) -> bool:
    t = BY_ID.get(type_id)
    return t is not None and t.block > 1
