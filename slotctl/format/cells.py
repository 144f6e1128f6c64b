"""Cell metadata records of KV and recurrent sections: ``i32 pos; u32 n_seq_id; [ext]; i32 seq_id[n_seq_id]``.

A single-sequence save writes cells of one size (n_seq_id 1 in a KV cache, 0 in a recurrent one), so
all cells are read in one call and viewed through a numpy structured dtype; cells of mixed sizes (a
whole-context save) fall back to a per-cell loop, bounded by the bytes that remain.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import construct as cs
import numpy as np

from slotctl.format.common import CheckError, _remaining

#: ``LLAMA_MAX_SEQ``: sequence ids are below it, and no cell has more of them
MAX_SEQ = 256
_ID_FORMATS = [f"<{k}i" for k in range(MAX_SEQ + 1)]


@dataclass
class Cells:
    pos: np.ndarray            # i32[n]
    n_seq_id: np.ndarray       # u32[n]
    ext: np.ndarray | None     # i32[n, ext_words] (x, y[, tok]) or None
    seq_ids: object            # i32[n, k] when every cell has k ids, else a list of n i32 arrays

    def __len__(self) -> int:
        return len(self.pos)

    @property
    def pos_min(self) -> int | None:
        return int(self.pos.min()) if len(self.pos) else None

    @property
    def pos_max(self) -> int | None:
        return int(self.pos.max()) if len(self.pos) else None

    def uniform_n_seq_id(self) -> int | None:
        if not len(self.n_seq_id):
            return None
        first = int(self.n_seq_id[0])
        return first if bool((self.n_seq_id == first).all()) else None


def _dtype(ext_words: int, n_seq: int) -> np.dtype:
    fields = [("pos", "<i4"), ("n_seq_id", "<u4")]
    if ext_words:
        fields.append(("ext", "<i4", (ext_words,)))
    if n_seq:
        fields.append(("seq", "<i4", (n_seq,)))
    return np.dtype(fields)


class CellArray(cs.Construct):
    """``count`` cells; ``ext_size`` (bytes, 0, 8 or 12) may be a context lambda."""

    def __init__(self, count, ext_size):
        super().__init__()
        self.count = count
        self.ext_size = ext_size

    def _parse(self, stream, context, path):
        n = cs.evaluate(self.count, context)
        ext_words = cs.evaluate(self.ext_size, context) // 4
        start = stream.tell()
        left = _remaining(stream)
        min_rec = 8 + 4 * ext_words
        if n * min_rec > left:
            raise CheckError(f"{n:,} cells of at least {min_rec} bytes, only {left:,} bytes remain", start)
        if n == 0:
            return Cells(np.zeros(0, "<i4"), np.zeros(0, "<u4"), None, [])
        first = stream.read(8)
        stream.seek(start)
        n_seq = struct.unpack_from("<I", first, 4)[0]
        dt = _dtype(ext_words, n_seq) if n_seq <= MAX_SEQ else None
        if dt is not None and n * dt.itemsize <= left:
            arr = np.frombuffer(cs.stream_read(stream, n * dt.itemsize, path), dtype=dt)
            if bool((arr["n_seq_id"] == n_seq).all()):
                seq = arr["seq"].copy() if n_seq else np.zeros((n, 0), "<i4")
                return Cells(arr["pos"].copy(), arr["n_seq_id"].copy(),
                             arr["ext"].copy() if ext_words else None, seq)
            stream.seek(start)
        return self._parse_mixed(stream, n, ext_words, path)

    def _parse_mixed(self, stream, n, ext_words, path):
        """Cells of different sizes, unpacked from buffered chunks (no per-field stream reads)."""
        pos = np.empty(n, "<i4")
        nsq = np.empty(n, "<u4")
        ext = np.empty((n, ext_words), "<i4") if ext_words else None
        seq_ids = []
        head = 8 + 4 * ext_words
        buf, at = b"", 0             # buffered bytes and the offset of buf[0] relative to the start
        base = stream.tell()

        def need(i, k):
            nonlocal buf, at
            if i + k > len(buf):
                left = _remaining(stream)
                if i + k - len(buf) > left:
                    raise CheckError(f"cell {len(seq_ids)}: {k:,} more bytes, only {left:,} remain", base + at + i)
                buf = buf[i:] + cs.stream_read(stream, max(k - (len(buf) - i), min(left, 1 << 16)), path)
                at += i
                return 0
            return i

        i = 0
        for c in range(n):
            i = need(i, head)
            p, k = struct.unpack_from("<iI", buf, i)
            if ext_words:
                ext[c] = struct.unpack_from(_ID_FORMATS[ext_words], buf, i + 8)
            i += head
            if k > MAX_SEQ:
                raise CheckError(f"cell {c}: at most {MAX_SEQ} sequence ids, found {k:,}", base + at + i - head + 4)
            i = need(i, 4 * k)
            pos[c], nsq[c] = p, k
            ids = struct.unpack_from(_ID_FORMATS[k], buf, i)
            if k and (min(ids) < 0 or max(ids) >= MAX_SEQ):
                raise CheckError(f"cell {c}: sequence ids in [0, {MAX_SEQ}), found {list(ids)}", base + at + i)
            seq_ids.append(np.array(ids, "<i4"))
            i += 4 * k
        # give back what was read ahead
        stream.seek(base + at + i)
        return Cells(pos, nsq, ext, seq_ids)

    def _build(self, obj: Cells, stream, context, path):
        n = cs.evaluate(self.count, context)
        ext_words = cs.evaluate(self.ext_size, context) // 4
        if len(obj) != n:
            raise cs.ConstructError(f"{len(obj)} cells given, the count says {n}", path=path)
        if ext_words and (obj.ext is None or obj.ext.shape != (n, ext_words)):
            raise cs.ConstructError(f"cells need {ext_words} ext words each", path=path)
        if isinstance(obj.seq_ids, np.ndarray) and obj.seq_ids.ndim == 2:
            arr = np.zeros(n, _dtype(ext_words, obj.seq_ids.shape[1]))
            arr["pos"], arr["n_seq_id"] = obj.pos, obj.n_seq_id
            if ext_words:
                arr["ext"] = obj.ext
            if obj.seq_ids.shape[1]:
                arr["seq"] = obj.seq_ids
            data = arr.tobytes()
            cs.stream_write(stream, data, len(data), path)
            return obj
        out = bytearray()
        for i in range(n):
            out += struct.pack("<iI", int(obj.pos[i]), int(obj.n_seq_id[i]))
            if ext_words:
                out += np.asarray(obj.ext[i], "<i4").tobytes()
            out += np.asarray(obj.seq_ids[i], "<i4").tobytes()
        cs.stream_write(stream, bytes(out), len(out), path)
        return obj

    def _sizeof(self, context, path):
        raise cs.SizeofError("cells have variable size", path=path)
