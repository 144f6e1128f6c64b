"""What the fleet view's stored states cost: ``slotctl slots`` with and without ``--store``, whole processes.

Starts a real llama-server b11434 (tests/llama_server.py: the suite's build) of the tiny target
(``-c 512 -np 2``), saves one slot, puts ``--states`` copies of it in a store directory under keep's names
for each slot, and times (best of ``--runs``):

* ``slotctl slots --server URL --server URL`` (the fleet view without a store: three requests per server);
* the same with ``--store DIR``: every state judged for the server (validate's verdict, no real load, and its
  predicted reuse), the server's model read once;

and, in one process, a first pass over the store and a second one (the judgements kept: only the listing).
Prints the times and their ratios.

Run: ``python benchmarks/bench_fleet_view.py [--states 20] [--runs 3]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from llama_server import LlamaServer, server_binary  # noqa: E402

from slotctl.tinymodels import SAMPLE_PROMPT, make_models  # noqa: E402


def best_of(runs: int, *args: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "slotctl", *args], capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t0)
        assert res.returncode == 0, res.stderr
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--states", type=int, default=20, help="states per slot")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    from slotctl.keeping.names import model_hash
    from slotctl.fleet.view import Target, fleet
    from slotctl.live import http

    with tempfile.TemporaryDirectory(prefix="bench-fleet-view-") as d:
        tmp = Path(d)
        models = make_models(tmp / "models")
        (tmp / "slots").mkdir()
        store = tmp / "store"
        store.mkdir()
        srv = LlamaServer(server_binary(), models.target, slot_save_path=tmp / "slots",
                          args=["-c", "512", "-np", "2", "-fa", "on"], log_path=tmp / "server.log").start()
        try:
            srv.completion(SAMPLE_PROMPT, slot=0, n_predict=2)
            srv.save(0, "state.bin")
            mh = model_hash(http.server_facts(srv.url))
            for slot in (0, 1):
                for i in range(a.states):
                    shutil.copy(tmp / "slots" / "state.bin", store / f"slot{slot}-{mh}-{i:016x}.bin")
            size = (tmp / "slots" / "state.bin").stat().st_size
            bare = best_of(a.runs, "slots", "--server", srv.url, "--server", srv.url, "--json")
            stored = best_of(a.runs, "slots", "--server", srv.url, "--store", str(store), "--json")
            targets = [Target(srv.url, store=str(store))]
            t0 = time.perf_counter()
            fleet(targets, 30)
            t1 = time.perf_counter()
            fleet(targets, 30)
            t2 = time.perf_counter()
        finally:
            srv.stop()
    n = 2 * a.states
    print(f"{n} states of {size:,} bytes (2 slots), load average {os.getloadavg()[0]:.1f}")
    print(f"slots, two servers, no store:   {bare:.2f} s")
    print(f"slots --store (every state judged): {stored:.2f} s ({stored / bare:.1f}x)")
    print(f"in one process: first pass {t1 - t0:.2f} s, second {t2 - t1:.3f} s "
          f"({(t1 - t0) / max(t2 - t1, 1e-6):.0f}x: the judgements kept)")


if __name__ == "__main__":
    main()
