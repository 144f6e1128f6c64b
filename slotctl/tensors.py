"""Cache rows as numbers: ggml block formats read and written with gguf-py's quantization code, and the
Hadamard rotation llama.cpp applies to quantized caches.

Nothing here parses a file: callers hand in the raw bytes of a record (or of a chunk of its rows) and the
ggml type id. gguf (``gguf.quants``) is imported when first needed.

The rotation (b11434 ``llama_kv_cache`` constructor and ``llm_graph_context::build_attn``): when a cache
is quantized, every K row is stored as ``H_n @ x`` in consecutive groups of ``n = n_rot_k`` elements (and
V likewise with ``n_rot_v``), ``H_n`` being the orthonormal Walsh-Hadamard matrix of order ``n``
(``ggml_gen_hadamard``: Sylvester's construction scaled by ``1/sqrt(n)``). ``H_n`` is symmetric and its
own inverse, so the same product undoes it. Unquantized caches store ``x`` as it is.
"""

from __future__ import annotations

import functools

import numpy as np

from slotctl.format import ggml


def _quant_type(type_id: int):
    import gguf

    return gguf.GGMLQuantizationType(type_id)


@functools.lru_cache(maxsize=None)
def can_read(type_id: int) -> bool:
    """Whether rows of this ggml type can be turned into numbers."""
    if type_id in (0, 1):
        return True
    import gguf.quants as q

    try:
        qt = _quant_type(type_id)
    except ValueError:
        return False
    return qt in q._type_traits  # noqa: SLF001 - gguf keeps its type table there


@functools.lru_cache(maxsize=None)
def can_write(type_id: int) -> bool:
    """Whether numbers can be written in this ggml type (gguf implements its quantization)."""
    if type_id in (0, 1):
        return True
    if not can_read(type_id):
        return False
    import gguf.quants as q

    try:
        q.quantize(np.zeros((1, ggml.BY_ID[type_id].block), np.float32), _quant_type(type_id))
    except (NotImplementedError, KeyError):
        return False
    return True


def _traits(type_id: int):
    """gguf's quantization class of ``type_id`` (its block functions run on all blocks at once, where
    ``gguf.quants.quantize`` goes 16 rows at a time)."""
    import gguf.quants as q

    traits = q._type_traits[_quant_type(type_id)]  # noqa: SLF001 - gguf keeps its type table there
    traits.init_grid()
    return traits


def dequantize(raw, type_id: int, n_per_row: int) -> np.ndarray:
    """``raw`` bytes holding whole rows of ``n_per_row`` elements of type ``type_id``, as float32
    ``[rows, n_per_row]``."""
    t = ggml.BY_ID[type_id]
    buf = np.frombuffer(raw, dtype=np.uint8)
    row_bytes = t.row_size(n_per_row)
    rows = buf.reshape(-1, row_bytes)
    if type_id == 0:
        return rows.view("<f4").astype(np.float32)
    if type_id == 1:
        return rows.view("<f2").astype(np.float32)
    traits = _traits(type_id)
    blocks = rows.reshape(-1, t.block_bytes)
    return np.asarray(traits.dequantize_blocks(blocks), dtype=np.float32).reshape(-1, n_per_row)


def quantize(values: np.ndarray, type_id: int) -> bytes:
    """float32 rows ``[rows, n]`` written in type ``type_id`` (``n`` a multiple of its block)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if type_id == 0:
        return values.astype("<f4").tobytes()
    if type_id == 1:
        return values.astype("<f2").tobytes()
    t = ggml.BY_ID[type_id]
    if values.shape[-1] % t.block:
        raise ValueError(f"rows of {values.shape[-1]} elements do not split into {t.name} blocks of {t.block}")
    blocks = np.asarray(_traits(type_id).quantize_blocks(values.reshape(-1, t.block)), dtype=np.uint8)
    return blocks.tobytes()


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of order ``n`` (a power of two), as ``ggml_gen_hadamard``."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power of two, got {n}")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotate(values: np.ndarray, n: int) -> np.ndarray:
    """Each consecutive group of ``n`` elements of every row multiplied by ``H_n`` (its own inverse);
    ``n`` = 0 returns ``values`` unchanged."""
    if not n:
        return values
    rows, width = values.shape
    if width % n:
        raise ValueError(f"rows of {width} elements do not split into rotation groups of {n}")
    return (values.reshape(-1, n) @ hadamard(n)).reshape(rows, width)


def rows_per_chunk(row_bytes: int, budget: int = 8 << 20) -> int:
    """How many rows of ``row_bytes`` to convert at once so a chunk stays near ``budget`` bytes."""
    return max(1, budget // max(1, row_bytes))
