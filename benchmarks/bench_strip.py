"""strip-draft of a 10 GiB slot file whose SDFT appendix ends it, against truncate(1) and cp(1).

Builds the sparse file of ``bench_inspect.py`` (default: 32 layers, 40,000 cells, f16 rows of 2 KiB: a
5 GiB payload, a 5 GiB checkpoint, and a 1-layer draft state of 157 MiB as the SDFT appendix), so it
costs almost no disk. Then times whole processes, each on a fresh copy of the file:

* ``strip-draft``: ``slotctl strip-draft FILE`` (cuts the SDFT appendix off in place);
* ``truncate``: ``truncate -s SIZE FILE``, the physical limit of removing a tail;
* ``cp``: ``cp --sparse=never FILE COPY``, what copying the file costs when its bytes are real (the
  holes are written out, as a real file's data would be: about 10 GB of disk for a moment);
* ``python -c pass``: the interpreter's start-up, which every slotctl command pays;
* with ``--copy``: ``slotctl strip-draft FILE -o OUT``, the streamed copy (what every strip cost before;
  it writes the whole file, holes included: about 10 GB of disk for a while).

Prints the median of ``--repeat`` runs and the ratios. Run: ``python benchmarks/bench_strip.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_inspect import build  # noqa: E402  (the same realistic file)

from slotctl.slotfile import open_slot_file  # noqa: E402


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "SLOTCTL_NO_PROGRESS": "1"})
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--cells", type=int, default=40_000)
    ap.add_argument("--row", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--copy", action="store_true", help="also time the streamed copy (strip-draft -o)")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    slotctl = [sys.executable, "-m", "slotctl"]
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "big.bin")
        size = build(path, layers=args.layers, cells=args.cells, row=args.row)
        sf = open_slot_file(path)
        assert not sf.errors and sf.sdft is not None and sf.sdft.end == size, "the SDFT appendix must end the file"
        cut = sf.sdft.offset
        work = os.path.join(d, "work.bin")

        def fresh() -> str:
            build(work, layers=args.layers, cells=args.cells, row=args.row)
            return work

        runs: dict[str, list[float]] = {k: [] for k in ("python -c pass", "truncate", "strip-draft", "cp")}
        if args.copy:
            runs["strip-draft -o (copy)"] = []
        for _ in range(args.repeat):
            runs["python -c pass"].append(timed([sys.executable, "-c", "pass"]))
            runs["truncate"].append(timed(["truncate", "-s", str(cut), fresh()]))
            runs["strip-draft"].append(timed([*slotctl, "strip-draft", "--grace", "0", fresh()]))
            assert os.path.getsize(work) == cut
            fresh()
            runs["cp"].append(timed(["cp", "--sparse=never", work, os.path.join(d, "copy.bin")]))
            os.unlink(os.path.join(d, "copy.bin"))
            if args.copy:
                out = os.path.join(d, "out.bin")
                runs["strip-draft -o (copy)"].append(timed([*slotctl, "strip-draft", "--grace", "0", fresh(), "-o", out]))
                os.unlink(out)
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"file: {size / 2**30:.2f} GiB; SDFT appendix {(size - cut) / 2**20:.1f} MiB at the end")
        for k, v in med.items():
            print(f"{k:>24}: {v:8.3f} s (median of {args.repeat})")
        print(f"ratio strip-draft / truncate:        {med['strip-draft'] / med['truncate']:.1f}x")
        print(f"ratio strip-draft / python -c pass:  {med['strip-draft'] / med['python -c pass']:.1f}x")
        print(f"ratio cp / strip-draft:              {med['cp'] / med['strip-draft']:.1f}x")
        if args.copy:
            print(f"ratio streamed copy / strip-draft:   {med['strip-draft -o (copy)'] / med['strip-draft']:.1f}x")


if __name__ == "__main__":
    main()
