"""Inspect a multi-GiB slot file: slotctl's time and peak memory beside one plain read of the file.

Builds a sparse slot file of a realistic shape (default: 32 layers, 8 KV heads of 128, f16, 40,000
cells, plus a checkpoint and a 1-layer draft state), so the tensor bytes cost no disk. Then:

* ``inspect``: ``slotctl inspect --json`` as a whole process, Python start-up included (time, peak RSS);
* ``read``: reading the whole file once in 8 MiB chunks.

It prints both and their ratio. Run: ``python benchmarks/bench_inspect.py [--cells N] [--layers N]``.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
import time

from slotctl.format.appendix import SCKP_MAGIC, SDFT_MAGIC
from slotctl.format.blob import BLOB_MAGIC
from slotctl.format.tokens import pack_tokens


def _kv_section(f, n_layer: int, cells: int, row: int, version: int = 4) -> None:
    """Write one single-stream KV section at the current position, seeking over tensor bytes."""
    f.write(struct.pack("<II", 1, cells))
    meta = bytearray()
    for p in range(cells):
        meta += struct.pack("<iIi", p, 1, 0)
    f.write(meta)
    f.write(struct.pack("<II", 0, n_layer))
    if version >= 4:
        f.write(struct.pack("<II", 0, 0))
    for _ in range(2 * n_layer):  # K records, then V records
        f.write(struct.pack("<iQ", 1, row))
        f.seek(cells * row, os.SEEK_CUR)


def build(path: str, *, layers: int, cells: int, row: int) -> int:
    words = pack_tokens(list(range(cells)))
    with open(path, "wb") as f:
        f.write(struct.pack("<III", 0x67677371, 4, len(words)))
        f.write(words.tobytes())
        _kv_section(f, layers, cells, row)
        # one checkpoint (a plain KV model: the partial blob is the whole state) and the draft appendix
        for magic, blob_layers in ((SCKP_MAGIC, layers), (SDFT_MAGIC, 1)):
            f.write(struct.pack("<II", magic, 1))
            if magic == SCKP_MAGIC:
                f.write(struct.pack("<Iqii", 1, cells, 0, cells - 1))
            at = f.tell()
            f.write(b"\0" * 8)  # blob length, patched below
            f.write(struct.pack("<Ii", BLOB_MAGIC, 0))
            _kv_section(f, blob_layers, cells, row)
            end = f.tell()
            f.seek(at)
            f.write(struct.pack("<Q", end - at - 8))
            f.seek(end)
            if magic == SCKP_MAGIC:
                f.write(struct.pack("<QQ", 0, 0))  # empty draft blob and speculative state
            else:
                f.write(struct.pack("<Q", 0))       # empty speculative state
        f.truncate()
        return f.tell()


def read_once(path: str) -> float:
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t


def inspect_child(path: str) -> tuple[float, int]:
    """``slotctl inspect --json FILE`` as a whole process (Python start-up and imports included): its wall
    time and peak RSS."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as installed: from .pyc
    cmd = [sys.executable, "-m", "slotctl", "inspect", "--json", path]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)  # writes the .pyc files
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, _, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t
    proc.returncode = 0  # reaped by wait4
    return elapsed, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--cells", type=int, default=40_000)
    ap.add_argument("--row", type=int, default=2048, help="bytes per K/V row (f16, 8 KV heads of 128)")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "big.bin")
        size = build(path, layers=args.layers, cells=args.cells, row=args.row)
        t_inspect, rss = inspect_child(path)
        t_read = read_once(path)
        print(f"file: {size / 2**30:.2f} GiB, {args.layers} layers, {args.cells:,} cells")
        print(f"inspect: {t_inspect:.3f} s, peak RSS {rss / 2**20:.0f} MiB")
        print(f"read the whole file once: {t_read:.3f} s ({size / 2**30 / t_read:.2f} GiB/s)")
        print(f"ratio read/inspect: {t_read / t_inspect:.1f}x; inspect peak RSS / file size: {rss / size:.4f}")


if __name__ == "__main__":
    main()
