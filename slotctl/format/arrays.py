"""Bulk fixed-size arrays, read in one call and viewed with numpy (construct costs ~20 us per element)."""

from __future__ import annotations

import construct as cs
import numpy as np

from slotctl.format.common import CheckError, _remaining, charge


class NumpyArray(cs.Construct):
    """``count`` little-endian items of numpy ``dtype``; parses to a read-only ndarray, builds from any sequence.

    ``cost``: the file budget (:class:`~slotctl.format.common.FileBudget`) charged per byte read."""

    def __init__(self, count, dtype, what: str, cost: int = 1):
        super().__init__()
        self.cost = cost      # budget bytes charged per byte read (what the items cost downstream)
        self.count = count
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.what = what

    def _parse(self, stream, context, path):
        n = cs.evaluate(self.count, context)
        need = n * self.dtype.itemsize
        start = stream.tell()
        left = _remaining(stream)
        if need > left:
            raise CheckError(f"{self.what}: {n:,} items need {need:,} bytes, only {left:,} remain", start)
        charge(context, need * self.cost, self.what, start)
        return np.frombuffer(cs.stream_read(stream, need, path), dtype=self.dtype)

    def _build(self, obj, stream, context, path):
        n = cs.evaluate(self.count, context)
        arr = np.asarray(obj, dtype=self.dtype)
        if arr.shape != (n,):
            raise cs.ConstructError(f"{self.what}: {arr.shape[0] if arr.ndim else 0} items given, {n} expected",
                                    path=path)
        cs.stream_write(stream, arr.tobytes(), n * self.dtype.itemsize, path)
        return obj

    def _sizeof(self, context, path):
        return cs.evaluate(self.count, context) * self.dtype.itemsize
