"""Converting memory payloads and blobs between state versions, exactly or not at all.

* 3 <-> 4: version 4 adds ``u32 n_rot_k; u32 n_rot_v`` after ``n_layer`` in every KV stream's DATA.
  Both versions rotate a quantized cache with a Hadamard matrix by the same rule
  (``llama_kv_cache``'s constructor: K by the largest power of two times 64 that divides the K head
  size, V by 64, each only when the cache type is quantized and the head size a multiple of 64);
  version 4 merely records the sizes. So:

  - 4 -> 3 drops the eight bytes; it is exact when each recorded rotation is the one a version-3
    runtime applies: 0 for an unquantized cache, the rule's size for a quantized one. A quantized
    cache recorded without rotation (saved with ``LLAMA_ATTN_ROT_DISABLE``) is refused unless the
    model's rule (``rotations``) says it gets none.
  - 3 -> 4 inserts the rotations the version-3 runtime applied: zeros for unquantized caches; for a
    quantized one the model's rule, so ``rotations`` is required there.
* 2 <-> 3: cell ext grows from 8 bytes (x, y) to 12 (x, y, tok). Identical for models without ext;
  with ext the token is unknown (2 -> 3) or lost (3 -> 2), so the conversion is refused.

The payload is located with the schemas (lazily: tensor bytes are not read) and then spliced, so the
tensor bytes are copied untouched.
"""

from __future__ import annotations

import io
import struct
from typing import Callable, Tuple

from slotctl.errors import FormatError
from slotctl.format import ggml
from slotctl.format.blob import BLOB_HEADER_SIZE, BlobHeader
from slotctl.format.common import parse
from slotctl.format.memory import MemoryLayout


class ConversionRefused(FormatError):
    """The conversion would not be exact; ``expected`` says why."""


def _kv_data(sections, layout: MemoryLayout):
    for sec, sl in zip(sections, layout.sections):
        if sec.type != "kv":
            continue
        for st in sec.streams:
            if st.data is not None:
                yield sl.role, st.data


def _locate(data: bytes, layout: MemoryLayout, version: int, layer: str):
    f = io.BytesIO(data)
    sections = []
    for sec in layout.sections:
        sections.append(parse(sec.schema(), f, layer, size=len(data), version=version, lazy=True))
    if f.tell() != len(data):
        raise FormatError(layer, f.tell(), f"the end of the payload; {len(data) - f.tell():,} bytes are left over")
    return sections


#: ``(section role, K type id, V type id) -> (n_rot_k, n_rot_v)``: the rotations llama.cpp applies to a
#: cache of the model (:func:`slotctl.model.predict.rotation_rule` makes one from a GGUF)
RotationRule = Callable[[str, int, int], Tuple[int, int]]


def _types(d) -> tuple[int, int]:
    k = d.k[0].type if len(d.k) else 0
    v = d.v[0].type if len(d.v) else 0
    return k, v


def check_ext(layout: MemoryLayout, src: int, dst: int, layer: str) -> None:
    """Refuse a conversion between versions that store cell ext differently when the cells carry it."""
    if (src <= 2) != (dst <= 2) and any(s.type == "kv" and s.has_ext for s in layout.sections):
        raise ConversionRefused(layer, None, f"cells carry ext: version {src} and {dst} store it differently "
                                             "(x, y vs x, y, tok); the conversion would not be exact")


def check_dropped_rotation(what: str, type_id: int, rot: int, dst: int, want: int | None, layer: str,
                           at: int | None) -> None:
    """Refuse dropping a version-4 rotation ``rot`` of a ``what`` ("key"/"value") cache of ``type_id`` when
    a version-``dst`` runtime would not rotate it the same way; ``want``: the model's rule, when known."""
    if not ggml.is_quantized(type_id):
        if rot:
            raise ConversionRefused(layer, at, f"no {what} rotation for a {ggml.type_name(type_id)} cache, found {rot}")
        return
    if want is not None:
        if rot != want:
            raise ConversionRefused(layer, at, f"a {what} rotation of {want} (what a version-{dst} runtime applies to "
                                               f"this {ggml.type_name(type_id)} cache), found {rot}")
    elif rot == 0:
        raise ConversionRefused(layer, at, f"a {what} rotation for a {ggml.type_name(type_id)} cache, found none "
                                           "(rotation was disabled when it was saved; a version-"
                                           f"{dst} runtime would rotate it); give the model to check the head size")


def added_rotation(what: str, type_id: int, dst: int, want: int | None, layer: str, at: int | None) -> int:
    """The rotation a version-4 record gives a ``what`` cache of ``type_id`` that a version-3 runtime
    rotated by the model's rule (``want``, needed for a quantized cache)."""
    if not ggml.is_quantized(type_id):
        return 0
    if want is None:
        raise ConversionRefused(layer, at, f"the model's head sizes to record the rotation of a "
                                           f"{ggml.type_name(type_id)} {what} cache (give the model)")
    return want


def convert_payload(data: bytes, layout: MemoryLayout, src: int, dst: int, *,
                    rotations: RotationRule | None = None, layer: str = "payload") -> bytes:
    """``data``, a ``state_write`` payload of state version ``src``, as version ``dst`` would write it.

    ``rotations``: the model's rotation rule, needed only where a quantized cache's rotation must be
    derived (3 -> 4) or checked (4 -> 3 with a recorded rotation of 0).
    Raises :class:`ConversionRefused` with the reason when the result would not be exact.
    """
    if src == dst:
        return data
    check_ext(layout, src, dst, layer)
    if (src >= 4) == (dst >= 4):
        return data
    sections = _locate(data, layout, src, layer)
    out = bytearray()
    pos = 0
    for role, d in _kv_data(sections, layout):
        at = d.rot_offset
        type_k, type_v = _types(d)
        out += data[pos:at]
        rule = (lambda i, role=role, type_k=type_k, type_v=type_v: rotations(role, type_k, type_v)[i]) \
            if rotations is not None else None
        if src >= 4:
            for i, (what, t, rot) in enumerate((("key", type_k, d.n_rot_k), ("value", type_v, d.n_rot_v))):
                check_dropped_rotation(what, t, rot, dst, rule(i) if rule else None, layer, at + 4 * i)
            pos = at + 8
        else:
            out += struct.pack("<II", *(added_rotation(what, t, dst, rule(i) if rule else None, layer, at)
                                        for i, (what, t) in enumerate((("key", type_k), ("value", type_v)))))
            pos = at
    out += data[pos:]
    return bytes(out)


def convert_blob(blob: bytes, layout: MemoryLayout, src: int, dst: int, *,
                 rotations: RotationRule | None = None, layer: str = "blob") -> bytes:
    """An in-memory blob (magic, seq id, payload) converted like :func:`convert_payload`."""
    if not blob:
        return blob
    parse(BlobHeader, io.BytesIO(blob), layer, size=len(blob))
    return blob[:BLOB_HEADER_SIZE] + convert_payload(blob[BLOB_HEADER_SIZE:], layout, src, dst,
                                                     rotations=rotations, layer=layer)
