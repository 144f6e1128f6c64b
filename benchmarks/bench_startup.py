"""Start-up: whole ``slotctl`` processes beside ``python -c pass`` and ``python -c "import numpy"``.

Each command runs as a new process (interpreter start-up, imports, work, exit), as an operator runs it,
``--runs`` times in turn with the baselines so that a busy machine slows them alike; the median wall-clock
time of each is printed with its ratio to both baselines, and the median CPU time (user + system, steadier
on a busy machine) with its ratio to numpy's. The targets (issue 15): ``inspect FILE`` (no -m) at most 2x
``python -c "import numpy"``, ``--help`` at most 4x ``python -c pass``.

Run: ``python benchmarks/bench_startup.py [--runs N] [--json]``. slotctl runs as ``python -m slotctl`` (the
console script adds nothing measurable); the slot file is the sample a real llama-server wrote
(slotctl/sample, 57 KiB: the time is start-up, not reading).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from slotctl.sample import MODEL, SLOT_FILE

PY = sys.executable
BASELINES = {
    "python -c pass": [PY, "-c", "pass"],
    'python -c "import numpy"': [PY, "-c", "import numpy"],
}
COMMANDS = {
    "slotctl --help": [PY, "-m", "slotctl", "--help"],
    "slotctl inspect FILE": [PY, "-m", "slotctl", "inspect", str(SLOT_FILE)],
    "slotctl inspect FILE --json": [PY, "-m", "slotctl", "inspect", str(SLOT_FILE), "--json"],
    "slotctl validate FILE": [PY, "-m", "slotctl", "validate", str(SLOT_FILE), "-c", "256", "-fa", "on"],
    "slotctl validate FILE -m T --no-load": [PY, "-m", "slotctl", "validate", str(SLOT_FILE), "-m", str(MODEL),
                                             "-c", "256", "-fa", "on", "--no-load"],
    "slotctl strip-draft --dry-run FILE": [PY, "-m", "slotctl", "strip-draft", "--dry-run", "--grace", "0", str(SLOT_FILE)],
}
#: the commands issue 15 sets a target for: (the baseline, at most how many times its wall-clock time)
TARGETS = {"slotctl --help": ("python -c pass", 4.0), "slotctl inspect FILE": ('python -c "import numpy"', 2.0)}


#: as an installed slotctl runs: from compiled .pyc files (pip compiles them at install; the first run here
#: writes them), whatever this shell says about bytecode
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _time(cmd: list[str]) -> tuple[float, float]:
    """Wall-clock and CPU (user + system) seconds of one process."""
    c0, t = os.times(), time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    elapsed, c1 = time.perf_counter() - t, os.times()
    if r.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)}: exit code {r.returncode}")
    return elapsed, (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)


def measure(runs: int) -> dict[str, tuple[float, float]]:
    """Median wall-clock and median CPU seconds of each command."""
    every = {**BASELINES, **COMMANDS}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in every}
    for cmd in every.values():  # warm the page cache and write the .pyc files
        _time(cmd)
    for _ in range(runs):
        for name, cmd in every.items():
            times[name].append(_time(cmd))
    return {name: (statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts))
            for name, ts in times.items()}


def _target(name: str, wall: float, med: dict[str, tuple[float, float]]) -> dict | None:
    """The command's target, its ratio to the target's baseline and whether it is met (None: no target)."""
    if name not in TARGETS:
        return None
    baseline, times = TARGETS[name]
    x = round(wall / med[baseline][0], 2)
    return {"baseline": baseline, "times": times, "x": x, "met": x <= times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    med = measure(args.runs)
    pass_w, pass_c = med["python -c pass"]
    numpy_w, numpy_c = med['python -c "import numpy"']
    rows = [{"command": name, "median_ms": round(w * 1000, 1), "x_pass": round(w / pass_w, 2),
             "x_numpy": round(w / numpy_w, 2), "cpu_ms": round(c * 1000, 1), "cpu_x_numpy": round(c / numpy_c, 2),
             "target": _target(name, w, med)} for name, (w, c) in med.items()]
    if args.json:
        print(json.dumps({"runs": args.runs, "rows": rows}, indent=2))
        return
    print(f"median of {args.runs} runs each, whole processes; wall clock, and CPU (user + system) beside it")
    print(f"{'command':38} {'ms':>7} {'x pass':>7} {'x numpy':>8} {'cpu ms':>7} {'x numpy':>8}  target")
    for r in rows:
        target = r["target"]
        verdict = "" if target is None else (f"<= {target['times']}x {target['baseline']}: "
                                             + ("met" if target["met"] else "MISSED") + f" ({target['x']}x)")
        print(f"{r['command']:38} {r['median_ms']:7.1f} {r['x_pass']:7.2f} {r['x_numpy']:8.2f} {r['cpu_ms']:7.1f} "
              f"{r['cpu_x_numpy']:8.2f}  {verdict}")


if __name__ == "__main__":
    main()
