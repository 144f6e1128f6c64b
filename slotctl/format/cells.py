"""Cell metadata records of KV and recurrent sections: ``i32 pos; u32 n_seq_id; [ext]; i32 seq_id[n_seq_id]``.

A single-sequence save writes cells of one size (n_seq_id 1 in a KV cache, 0 in a recurrent one), so
cells are read as runs of equal size, each run in one call viewed through a numpy structured dtype;
cells of mixed sizes (a whole-context save) are runs too, as short as they come.

Bounds (docs/design.md, "Bounds"): a count is checked against what the layer can hold before anything
is read or allocated, not only against the bytes left in the file. A KV section holds at most
:data:`MAX_CELLS` cells over all its streams (16,777,216: more than the longest context any model is
trained for, 10M tokens); a recurrent section one cell per sequence, at most :data:`MAX_SEQ`. Cells are read in chunks of
at most :data:`CHUNK_BYTES`, and the sequence ids kept are at most :data:`MAX_SEQ_IDS` words, so a damaged
count in a large sparse file costs an error, not memory or time.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import construct as cs
import numpy as np

from slotctl.format.common import CheckError, _remaining

#: ``LLAMA_MAX_SEQ``: sequence ids are below it, and no cell has more of them
MAX_SEQ = 256
#: the most cells a KV section holds over all its streams (2^24 = 16,777,216 tokens of context)
MAX_CELLS = 1 << 24
#: the most sequence ids kept for one section (4 bytes each)
MAX_SEQ_IDS = 1 << 26
#: the largest read while parsing cells
CHUNK_BYTES = 8 << 20


class Ragged:
    """The sequence ids of cells of different sizes: one flat array and where each cell's ids start."""

    def __init__(self, flat: np.ndarray, starts: np.ndarray):
        self.flat, self.starts = flat, starts   # starts has len(cells) + 1 entries

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.flat[self.starts[i]:self.starts[i + 1]]


@dataclass
class Cells:
    pos: np.ndarray            # i32[n]
    n_seq_id: np.ndarray       # u32[n]
    ext: np.ndarray | None     # i32[n, ext_words] (x, y[, tok]) or None
    seq_ids: object            # i32[n, k] when every cell has k ids, else a Ragged (or list) of n i32 arrays

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


def _budget(context) -> dict:
    """Cells and sequence ids read so far in this parse (one section), shared by its streams."""
    params = context.get("_params")
    if params is None:
        return {"cells": 0, "ids": 0}
    b = params.get("_cell_budget")
    if b is None:
        b = params["_cell_budget"] = {"cells": 0, "ids": 0}
    return b


class CellArray(cs.Construct):
    """``count`` cells; ``ext_size`` (bytes, 0, 8 or 12) may be a context lambda.

    ``limit``: the most cells the section holds (:data:`MAX_CELLS` for KV, shared by all streams of one
    parse; :data:`MAX_SEQ` for recurrent memory).
    """

    def __init__(self, count, ext_size, limit: int = MAX_CELLS, what: str = "KV cells"):
        super().__init__()
        self.count = count
        self.ext_size = ext_size
        self.limit = limit
        self.what = what

    def _parse(self, stream, context, path):
        n = cs.evaluate(self.count, context)
        ext_words = cs.evaluate(self.ext_size, context) // 4
        start = stream.tell()
        left = _remaining(stream)
        budget = _budget(context)
        if budget["cells"] + n > self.limit:
            before = f" ({budget['cells']:,} in earlier streams)" if budget["cells"] else ""
            raise CheckError(f"{self.what}: a cell count of at most {self.limit - budget['cells']:,}{before}, "
                             f"found {n:,} (more than the layer can hold)", start - 4)
        min_rec = 8 + 4 * ext_words
        if n * min_rec > left:
            raise CheckError(f"{n:,} cells of at least {min_rec} bytes, only {left:,} bytes remain", start)
        budget["cells"] += n
        if n == 0:
            return Cells(np.zeros(0, "<i4"), np.zeros(0, "<u4"), None, np.zeros((0, 0), "<i4"))
        return self._parse_runs(stream, n, ext_words, budget, path)

    def _parse_runs(self, stream, n, ext_words, budget, path):
        """Runs of cells with the same number of sequence ids, each read in one call (at most CHUNK_BYTES).

        The arrays are allocated once for ``n`` cells (bounded by ``limit``; pages are touched only as
        cells are read) and filled run by run, so the read buffers never pile up.
        """
        pos = np.empty(n, "<i4")
        nsq = np.empty(n, "<u4")
        ext = np.empty((n, ext_words), "<i4") if ext_words else None
        seq_parts = []   # (k, i32[r, k]) per run
        done = 0
        want = 64        # cells asked for in the next read: grows while runs fill it, shrinks when they break
        at = stream.tell()
        while done < n:
            head = stream.read(8)
            if len(head) < 8:
                raise CheckError(f"cell {done}: 8 bytes, the file ends first", at)
            k = int(np.frombuffer(head, "<u4", 1, 4)[0])
            if k > MAX_SEQ:
                raise CheckError(f"cell {done}: at most {MAX_SEQ} sequence ids, found {k:,}", at + 4)
            dt = _dtype(ext_words, k)
            stream.seek(at)
            left = _remaining(stream)
            m = min(n - done, want, max(1, CHUNK_BYTES // dt.itemsize), left // dt.itemsize)
            if m == 0:
                raise CheckError(f"cell {done}: {dt.itemsize:,} bytes, only {left:,} remain", at)
            arr = np.frombuffer(cs.stream_read(stream, m * dt.itemsize, path), dtype=dt)
            same = arr["n_seq_id"] == k
            r = m if bool(same.all()) else int(np.argmin(same))
            arr = arr[:r]
            if budget["ids"] + r * k > MAX_SEQ_IDS:
                raise CheckError(f"cells holding at most {MAX_SEQ_IDS:,} sequence ids in all, more found", at)
            if k:
                seq = arr["seq"]
                bad = (seq < 0) | (seq >= MAX_SEQ)
                if bool(bad.any()):
                    c = int(np.flatnonzero(bad.any(axis=1))[0])
                    raise CheckError(f"cell {done + c}: sequence ids in [0, {MAX_SEQ}), found {seq[c].tolist()}",
                                     at + c * dt.itemsize + 8 + 4 * ext_words)
                seq_parts.append((k, seq.copy()))
            else:
                seq_parts.append((0, None))
            budget["ids"] += r * k
            pos[done:done + r] = arr["pos"]
            nsq[done:done + r] = k
            if ext_words:
                ext[done:done + r] = arr["ext"]
            done += r
            at += r * dt.itemsize
            stream.seek(at)
            want = min(want * 4, 1 << 24) if r == m else 64
        ks = {k for k, _ in seq_parts}
        if len(ks) == 1:
            k = ks.pop()
            seq = np.concatenate([a for _, a in seq_parts]) if k else np.zeros((n, 0), "<i4")
        else:
            flat = np.concatenate([a.reshape(-1) for k, a in seq_parts if k] or [np.zeros(0, "<i4")])
            starts = np.zeros(n + 1, np.int64)
            np.cumsum(nsq, out=starts[1:])
            seq = Ragged(flat, starts)
        return Cells(pos, nsq, ext, seq)

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
