"""Cell metadata records of KV and recurrent sections: ``i32 pos; u32 n_seq_id; [ext]; i32 seq_id[n_seq_id]``.

A single-sequence save writes cells of one size (n_seq_id 1 in a KV cache, 0 in a recurrent one), so
cells are read as runs of equal size, found at once with numpy; cells whose sizes repeat in a short
pattern (alternating, as hostile files and some whole-context saves have them) are found at once too;
only sizes without a pattern are walked cell by cell.

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

from slotctl.format.common import WALKED_CELL_COST, CheckError, _remaining, charge

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


def _dtype(ext_words: int, n_seq: int) -> np.dtype:
    fields = [("pos", "<i4"), ("n_seq_id", "<u4")]
    if ext_words:
        fields.append(("ext", "<i4", (ext_words,)))
    if n_seq:
        fields.append(("seq", "<i4", (n_seq,)))
    return np.dtype(fields)


#: the longest repeating pattern of cell sizes read as one (a whole-context save alternates a few sizes)
MAX_PERIOD = 8
#: cells walked one by one before the sizes are probed for a pattern again
WALK_STRETCH = 4096


def _starts(words: np.ndarray, most: int, fixed: int, at: int, done: int) -> tuple[np.ndarray, int, int]:
    """Where each whole cell in ``words`` starts (word indices; at most ``most`` cells), the words they take
    and how many of them were walked one by one. Where the sizes repeat, no Python step is made per cell:
    the next few cells are walked, the shortest period of their sizes (1: all equal; 2: alternating; up to
    :data:`MAX_PERIOD`) is checked against the rest of the chunk at once; where they do not,
    :data:`WALK_STRETCH` cells are walked and the sizes probed again behind them. The whole chunk is
    used: what its last cell leaves over is read again with the next chunk."""
    parts: list[np.ndarray] = []
    i = c = walked = 0
    n = len(words)
    while c < most and i + fixed <= n:
        view = words[i:]
        probe, used = _walk(view, min(most - c, 4 * MAX_PERIOD), fixed, at + 4 * i, done + c)
        if not len(probe):
            break
        found, took = _period(view, probe, used, most - c, fixed)
        if found is None:   # no pattern: walk a stretch cell by cell
            found, took = _walk(view, min(most - c, WALK_STRETCH), fixed, at + 4 * i, done + c)
            walked += len(found)
        parts.append(found + i)
        c += len(found)
        i += took
        if i + fixed > n or took == 0:
            break
        k = int(words[i + 1])
        if k <= MAX_SEQ and i + fixed + k > n:   # the next cell runs past the chunk: the next read has it
            break
    if not parts:
        return np.zeros(0, np.int64), 0, 0
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)), i, walked


def _period(words: np.ndarray, probe: np.ndarray, used: int, most: int, fixed: int) -> tuple[np.ndarray | None, int]:
    """The cells from the start of ``words`` while their sizes repeat the shortest period of the ``probe``
    cells' sizes, found at once with numpy (None when the probe's sizes have no period of at most
    :data:`MAX_PERIOD`, or when the pattern finds no more cells than the probe did)."""
    ks = words[probe + 1].astype(np.int64)
    period = next((p for p in range(1, MAX_PERIOD + 1) if len(ks) >= 2 * p
                   and bool((ks == np.resize(ks[:p], len(ks))).all())), None)
    if period is None or len(probe) == most:
        return (None, 0) if period is None else (probe, used)
    sizes = fixed + ks[:period]
    width = int(sizes.sum())
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    reps = len(words) // width
    block = words[:reps * width].reshape(reps, width)
    ok = (block[:, offs + 1] == ks[:period]).all(axis=1)
    good = reps if bool(ok.all()) else int(np.argmin(ok))
    starts = (np.arange(good, dtype=np.int64)[:, None] * width + offs).reshape(-1)[:most]
    if len(starts) <= len(probe):
        return probe, used
    last = int(starts[-1])
    return starts, last + fixed + int(words[last + 1])


def _walk(words: np.ndarray, most: int, fixed: int, at: int, done: int) -> tuple[np.ndarray, int]:
    """Where each whole cell in ``words`` starts (word indices, at most ``most`` cells) and the words they
    take; a cell with more than :data:`MAX_SEQ` ids is refused where it starts (``at``: the chunk's offset).
    The words become Python ints a window at a time, only as far as the cells walked reach."""
    end = len(words)
    step = max(64, most * (fixed + 2))
    w = words[:step].tolist()
    out: list[int] = []
    append = out.append
    i = c = 0
    while c < most and i + fixed <= end:
        if i + fixed > len(w):
            w += words[len(w):len(w) + max(step, i + fixed - len(w))].tolist()
        k = w[i + 1]
        if k > MAX_SEQ:
            raise CheckError(f"cell {done + c}: at most {MAX_SEQ} sequence ids, found {k:,}", at + 4 * i + 4)
        nxt = i + fixed + k
        if nxt > end:
            break
        append(i)
        i = nxt
        c += 1
    return np.asarray(out, np.int64), i


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
        # the candidate layouts tried on one payload read the same cells with other schemas (V or not):
        # the cells at one offset, of one count and ext size, are read once
        memo = (context.get("_params") or {}).get("cells_memo")
        key = ("cells", start, n, ext_words)
        if memo is not None and key in memo:
            hit, end = memo[key]
            if isinstance(hit, CheckError):
                raise hit
            stream.seek(end)
            return hit
        try:
            cells = self._parse_runs(stream, n, ext_words, budget, path, context)
        except CheckError as e:
            if memo is not None:
                memo[key] = (e, None)
            raise
        if memo is not None:
            memo[key] = (cells, stream.tell())
        return cells

    def _parse_runs(self, stream, n, ext_words, budget, path, context):
        """The cells, chunk by chunk (each read at most :data:`CHUNK_BYTES`), as 32-bit words (every field
        of a cell is one word): where each cell starts is found by :func:`_starts` (runs of one size, or
        of a repeating pattern of sizes, at once), then every field is gathered with numpy.

        The arrays are allocated once for ``n`` cells (bounded by ``limit``; pages are touched only as
        cells are read) and filled chunk by chunk, so the read buffers never pile up.
        """
        pos = np.empty(n, "<i4")
        nsq = np.empty(n, "<u4")
        ext = np.empty((n, ext_words), "<i4") if ext_words else None
        ids = []         # the sequence ids of the cells, in order, one flat i32 array per chunk
        done = 0
        at = stream.tell()
        fixed = 2 + ext_words    # words of a cell before its sequence ids
        k_most = 1               # the most sequence ids of a cell so far: sizes the next read
        while done < n:
            left = _remaining(stream)
            want = min(max(CHUNK_BYTES, 4 * (fixed + k_most)), left - left % 4, 4 * (n - done) * (fixed + k_most))
            raw = cs.stream_read(stream, max(want, 8), path) if left >= 8 else b""
            charge(context, len(raw), self.what, at)
            words = np.frombuffer(raw, "<u4")
            if len(words) < 2:
                raise CheckError(f"cell {done}: 8 bytes, the file ends first", at)
            k0 = int(words[1])
            r = min(n - done, len(words) // (fixed + k0)) if k0 <= MAX_SEQ else 0
            block = words[:r * (fixed + k0)].reshape(r, fixed + k0) if r else None
            if block is not None and bool((block[:, 1] == k0).all()):
                # cells of one size to the end of the chunk (every save of one sequence): views of the words
                starts, used = None, r * (fixed + k0)
                head, ks = block[:, :fixed], block[:, 1]
                flat = block[:, fixed:].reshape(-1).view("<i4")
            else:
                starts, used, walked = _starts(words, n - done, fixed, at, done)
                if walked:   # a cell walked one by one costs a Python step: bounded per file too
                    charge(context, walked * WALKED_CELL_COST, self.what, at)
                r = len(starts)
                if r == 0:
                    k = int(words[1])
                    if k > k_most and 4 * (fixed + k) <= left - left % 4:   # a read sized for smaller cells
                        k_most = k
                        stream.seek(at)
                        continue
                    raise CheckError(f"cell {done}: {4 * (fixed + k):,} bytes, only {4 * len(words):,} remain", at)
                head = words[starts[:, None] + np.arange(fixed)]
                ks = head[:, 1]
                if bool((ks == ks[0]).all()):   # one size: the ids are a block of columns
                    flat = words[starts[:, None] + fixed + np.arange(int(ks[0]))].reshape(-1).view("<i4")
                else:
                    excl = np.cumsum(ks, dtype=np.int64) - ks
                    flat = words[np.repeat(starts + fixed - excl, ks)
                                 + np.arange(int(ks.sum()), dtype=np.int64)].view("<i4")
            if budget["ids"] + len(flat) > MAX_SEQ_IDS:
                raise CheckError(f"cells holding at most {MAX_SEQ_IDS:,} sequence ids in all, more found", at)
            bad = (flat < 0) | (flat >= MAX_SEQ)
            if bool(bad.any()):
                first = int(np.flatnonzero(bad)[0])
                c = int(np.searchsorted(np.cumsum(ks), first, side="right"))
                cell_at = at + 4 * (int(starts[c]) if starts is not None else c * (fixed + k0))
                start = int(np.cumsum(ks)[c - 1]) if c else 0
                mine = flat[start:start + int(ks[c])]
                raise CheckError(f"cell {done + c}: sequence ids in [0, {MAX_SEQ}), found {mine.tolist()}",
                                 cell_at + 4 * fixed)
            budget["ids"] += len(flat)
            k_most = max(k_most, int(ks.max()) if len(ks) else 0)
            pos[done:done + r] = head[:, 0].view("<i4")
            nsq[done:done + r] = ks
            if ext_words:
                ext[done:done + r] = head[:, 2:fixed].view("<i4")
            ids.append(flat.copy())
            done += r
            at += 4 * used
            stream.seek(at)
        flat = np.concatenate(ids) if ids else np.zeros(0, "<i4")
        k0 = int(nsq[0])
        if len(flat) == n * k0 and bool((nsq == k0).all()):
            seq = flat.reshape(n, k0)
        else:
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
