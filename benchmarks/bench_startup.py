"""Start-up: whole ``slotctl`` processes, each beside the stack it must use, pairs interleaved.

Three pairs (issue 23), each a slotctl command and the bare imports of what it needs:

- ``inspect FILE`` vs ``python -c "import numpy, typer, rich, construct"`` (goal: at most 1.3x);
- ``inspect --json FILE`` vs ``python -c "import numpy, typer, construct"`` (goal 1.3x: rich only where it
  draws);
- ``--help`` vs ``python -c "import typer"`` (goal 1.3x).

Each process is new (interpreter start-up, imports, work, exit), as an operator runs it. A run times each
pair back to back, the two in alternating order, so that a shared machine's load falls on both alike; the
ratio printed is the median over the runs of each pair's ratio (the median wall-clock times beside it).
Measure a regular install (``pip install .`` into a scratch venv, its compiled .pyc files), not an editable
one: ``python benchmarks/bench_startup.py --python /tmp/venv-startup/bin/python [--runs N] [--json]``.
The slot file is the sample a real llama-server wrote (slotctl/sample, 57 KiB: the time is start-up, not
reading). stdout is /dev/null: not a terminal, so ``inspect FILE`` lays its view out for 80 columns as plain
lines without importing rich (a script's ``inspect FILE | cat``; on a terminal rich draws it, with colours).

Figures (docs/design.md, "Imports and start-up"): 21 runs at a load average of 7 on 2 shared cores,
``inspect FILE`` 1.29x, ``inspect --json FILE`` 1.20x, ``--help`` 1.19x (all met; the clock is noisy under
load). Counted in instructions with callgrind (``PYTHONHASHSEED=0``, each command under ``valgrind
--tool=callgrind`` once its .pyc files exist): 687 M / 558 M = 1.23x, 687 M / 554 M = 1.24x, 285 M / 257 M
= 1.11x (before the plain view: ``inspect FILE`` 835 M, 1.50x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GOAL = 1.3

#: as an installed slotctl runs: from compiled .pyc files, whatever this shell says about bytecode
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def pairs(py: str, slot_file: str) -> dict[str, tuple[list[str], str, list[str]]]:
    """name -> (slotctl's command line, the baseline's name, the baseline's command line)."""
    def imports(mods: str) -> tuple[str, list[str]]:
        return f'python -c "import {mods}"', [py, "-c", f"import {mods}"]

    return {
        "inspect FILE": ([py, "-m", "slotctl", "inspect", slot_file], *imports("numpy, typer, rich, construct")),
        "inspect --json FILE": ([py, "-m", "slotctl", "inspect", "--json", slot_file],
                                *imports("numpy, typer, construct")),
        "--help": ([py, "-m", "slotctl", "--help"], *imports("typer")),
    }


def _time(cmd: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, cwd="/")
    elapsed = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit code {r.returncode}")
    return elapsed


def measure(py: str, slot_file: str, runs: int) -> list[dict]:
    table = pairs(py, slot_file)
    times = {name: ([], []) for name in table}
    for cmd, _, base in table.values():   # warm the page cache and the .pyc files
        _time(cmd), _time(base)
    for i in range(runs):
        for name, (cmd, _, base) in table.items():
            mine, theirs = times[name]
            if i % 2:
                theirs.append(_time(base))
                mine.append(_time(cmd))
            else:
                mine.append(_time(cmd))
                theirs.append(_time(base))
    rows = []
    for name, (cmd, base_name, _) in table.items():
        mine, theirs = times[name]
        x = statistics.median(a / b for a, b in zip(mine, theirs))
        rows.append({"command": f"slotctl {name}", "baseline": base_name,
                     "median_ms": round(statistics.median(mine) * 1000, 1),
                     "baseline_ms": round(statistics.median(theirs) * 1000, 1),
                     "x": round(x, 2), "goal": GOAL, "met": x <= GOAL})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter of the venv slotctl is installed in (default: this one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    slot_file = subprocess.run([args.python, "-c", "from slotctl.sample import SLOT_FILE; print(SLOT_FILE)"],
                               capture_output=True, text=True, check=True, cwd="/").stdout.strip()
    rows = measure(args.python, slot_file, args.runs)
    if args.json:
        print(json.dumps({"runs": args.runs, "python": args.python, "rows": rows}, indent=2))
        return
    print(f"{args.runs} runs, pairs interleaved; median wall-clock ms, and the median of the pairs' ratios")
    print(f"{'command':28} {'ms':>7}  {'baseline':46} {'ms':>7} {'ratio':>6}  goal")
    for r in rows:
        verdict = f"<= {r['goal']}x: " + ("met" if r["met"] else f"MISSED by {r['x'] / r['goal'] - 1:.0%}")
        print(f"{r['command']:28} {r['median_ms']:7.1f}  {r['baseline']:46} {r['baseline_ms']:7.1f} "
              f"{r['x']:6.2f}  {verdict}")


if __name__ == "__main__":
    main()
