"""Converting memory payloads and blobs between state versions, exactly or not at all.

* 3 <-> 4: version 4 adds ``u32 n_rot_k; u32 n_rot_v`` after ``n_layer`` in every KV stream's DATA.
  4 -> 3 is exact only when every rotation is 0 (a rotated quantized cache means something else to a
  version-3 runtime); 3 -> 4 inserts zeros.
* 2 <-> 3: cell ext grows from 8 bytes (x, y) to 12 (x, y, tok). Identical for models without ext;
  with ext the token is unknown (2 -> 3) or lost (3 -> 2), so the conversion is refused.

The payload is located with the schemas (lazily: tensor bytes are not read) and then spliced, so the
tensor bytes are copied untouched.
"""

from __future__ import annotations

import io

from slotctl.errors import FormatError
from slotctl.format.blob import BLOB_HEADER_SIZE, BlobHeader
from slotctl.format.common import parse
from slotctl.format.memory import MemoryLayout


class ConversionRefused(FormatError):
    """The conversion would not be exact; ``expected`` says why."""


def _kv_data(sections):
    for sec in sections:
        if sec.type != "kv":
            continue
        for st in sec.streams:
            if st.data is not None:
                yield st.data


def _locate(data: bytes, layout: MemoryLayout, version: int, layer: str):
    f = io.BytesIO(data)
    sections = []
    for sec in layout.sections:
        sections.append(parse(sec.schema(), f, layer, size=len(data), version=version, lazy=True))
    if f.tell() != len(data):
        raise FormatError(layer, f.tell(), f"the end of the payload; {len(data) - f.tell():,} bytes are left over")
    return sections


def convert_payload(data: bytes, layout: MemoryLayout, src: int, dst: int, *, layer: str = "payload") -> bytes:
    """``data``, a ``state_write`` payload of state version ``src``, as version ``dst`` would write it."""
    if src == dst:
        return data
    if (src <= 2) != (dst <= 2) and any(s.type == "kv" and s.has_ext for s in layout.sections):
        raise ConversionRefused(layer, None, f"cells carry ext: version {src} and {dst} store it differently "
                                             "(x, y vs x, y, tok); the conversion would not be exact")
    if (src >= 4) == (dst >= 4):
        return data
    sections = _locate(data, layout, src, layer)
    out = bytearray()
    pos = 0
    for d in _kv_data(sections):
        at = d.rot_offset
        out += data[pos:at]
        if src >= 4:
            if d.n_rot_k or d.n_rot_v:
                raise ConversionRefused(layer, at, f"rotations of 0 for version {dst}, found K {d.n_rot_k} / "
                                                   f"V {d.n_rot_v}: a rotated quantized cache cannot be loaded "
                                                   f"by a version-{dst} runtime")
            pos = at + 8
        else:
            out += b"\0" * 8
            pos = at
    out += data[pos:]
    return bytes(out)


def convert_blob(blob: bytes, layout: MemoryLayout, src: int, dst: int, *, layer: str = "blob") -> bytes:
    """An in-memory blob (magic, seq id, payload) converted like :func:`convert_payload`."""
    parse(BlobHeader, io.BytesIO(blob), layer, size=len(blob))
    return blob[:BLOB_HEADER_SIZE] + convert_payload(blob[BLOB_HEADER_SIZE:], layout, src, dst, layer=layer)
