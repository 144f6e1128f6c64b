"""Small (and sparse) hostile files through whole slotctl processes: wall time and peak resident memory.

The files: tests/data/adversarial's cut-*.bin (issue 27's), nlayer-*.bin and slow-validate.bin , the family of
tests/test_adversarial.py (counts near each cap, cuts after each header), and issue 24's sparse file: srv-np1.bin
followed by 64 checkpoints whose target blobs each claim 2^24 KV cells over a hole (571 GB, a few KB on disk).
Each runs ``validate -m``, ``inspect -m``, ``ls -m`` and ``diff`` (against srv-np1.bin) with
tests/data/target.gguf, as its own process (``os.wait4``'s rusage: the process's own peak RSS), from a
neutral working directory. The bound of issue 27: 1 s and 256 MiB each; python -c pass is printed as the floor.

Run: ``python benchmarks/bench_adversarial.py [--only NAME-SUBSTRING]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

DATA = ROOT / "tests" / "data"
MODEL = DATA / "target.gguf"
ADVERSARIAL = DATA / "adversarial"


def run(args: list[str], cwd: str) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds, peak RSS in MiB, exit code) of one whole process (GNU time's figures: the
    process's own peak, not the forking parent's)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = Path(cwd) / "time.out"
    proc = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", str(out), sys.executable, *args], cwd=cwd,
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, user, sys_, kib = out.read_text().split("\n")[-2].split()
    return float(wall), float(user) + float(sys_), int(kib) // 1024, proc.returncode


def sparse_checkpoints(path: Path, count: int = 64, cells: int = 1 << 24) -> Path:
    """srv-np1.bin, then an SCKP appendix of ``count`` checkpoints, each a target blob whose KV section claims
    ``cells`` cells (and their K/V data) over a hole (tests/test_bounds.py's maker)."""
    from test_bounds import _sparse_checkpoints

    return _sparse_checkpoints(path, count, cells * (12 + 512) + 64, cells)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    from test_adversarial import FAMILY

    with tempfile.TemporaryDirectory() as d:
        files = sorted(ADVERSARIAL.glob("cut-*.bin")) + sorted(ADVERSARIAL.glob("nlayer-*.bin"))
        files += [ADVERSARIAL / "slow-validate.bin"] if (ADVERSARIAL / "slow-validate.bin").exists() else []
        for name, (data, _, _) in sorted(FAMILY.items()):
            p = Path(d) / f"{name}.bin"
            p.write_bytes(data)
            files.append(p)
        files.append(sparse_checkpoints(Path(d) / "sparse-64x2^24.bin"))
        files = [f for f in files if a.only in f.name]
        floor = run(["-c", "pass"], d)
        start = run(["-m", "slotctl", "--help"], d)
        print(f"python -c pass: {floor[0]:.2f} s ({floor[1]:.2f} s CPU), {floor[2]} MiB; slotctl --help: "
              f"{start[0]:.2f} s ({start[1]:.2f} s CPU), {start[2]} MiB")
        print("each command: wall s / CPU s / peak MiB")
        print(f"{'file':32} {'bytes':>12} {'on disk':>9}  " + "  ".join(f"{c:>19}" for c in
                                                                     ("validate -m", "inspect -m", "ls -m", "diff")))
        worst = (0.0, 0.0, 0)
        for f in files:
            st = f.stat()
            cells = []
            for cmd in (["validate", str(f), "-m", str(MODEL), "-c", "256", "--json"],
                        ["inspect", str(f), "-m", str(MODEL), "--json"],
                        ["ls", str(f), "-m", str(MODEL), "-c", "256", "--json"],
                        ["diff", str(f), str(DATA / "srv-np1.bin"), "-m", str(MODEL), "--json"]):
                s, cpu, mib, rc = run(["-m", "slotctl", *cmd], d)
                worst = (max(worst[0], s), max(worst[1], cpu), max(worst[2], mib))
                cells.append(f"{s:5.2f} {cpu:5.2f} {mib:4d}")
            print(f"{f.name:32} {st.st_size:>12,} {st.st_blocks * 512:>9,}  " + "  ".join(f"{c:>19}" for c in cells))
        print(f"worst: {worst[0]:.2f} s wall, {worst[1]:.2f} s CPU, {worst[2]} MiB")


if __name__ == "__main__":
    main()
