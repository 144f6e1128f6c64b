"""The long adversarial run (not part of CI): mutated real slot files through every command, for a while.

The same mutations and contract as ``tests/test_properties.py`` (``tests/mutate.py``), drawn at random
(seeded, so a finding can be replayed), over every layer of each source file, with the slower commands
too (``inspect -m``, ``validate -m``, ...). A finding (an exception, an
undocumented exit code, a message that is not one line, a timeout or a memory bound broken) is printed
with its seed and mutation and the file is kept in ``--keep``.

Every command runs in this process (typer's CliRunner), not one process per run; what no mutant changes is
built once (each typer command, the group, and with ``--identify`` the state a candidate model computes for a
prompt: see :func:`_cache_what_no_mutant_changes`). Without ``--fast`` every local command runs on each
mutant: inspect, inspect -m, validate, validate -m (--no-load), strip-draft --dry-run with and without -m,
strip-draft --checkpoints in place, convert to q8_0 and to state version 3, diff with and without -m, ls -m.
``--identify`` adds ``identify`` (real llama-cpp-python contexts, two candidates for the target and two for
the draft state); ``--store`` starts a SeaweedFS (tests/seaweed.py, on 127.0.0.1) and runs mutants as an
``s3://`` object too: inspect, validate, ls of its prefix, cp down (``--store-every N``: every Nth mutant).
Memory (tracemalloc, which slows Python several times) is measured on every command, or with
``--measure-every N`` on every command of every Nth mutant; ``--fast`` runs only the quick commands and
measures the first only.

Run: ``python fuzz/fuzz_slotfiles.py --seconds 600 [--seed N] [--keep DIR] [--identify] [--store] [--fast]
[--mutants N] [--store-every N] [--measure-every N]``. Prints the number of files and command runs, the exit
codes seen per command, the seconds spent per command, the slowest command (with its mutant) and the largest
peak allocation, the process's peak RSS, and the rate. docs/testing.md has the long run of issue 27.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import mutate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", default="fuzz-findings")
    ap.add_argument("--identify", action="store_true", help="identify -m too (llama-cpp-python)")
    ap.add_argument("--store", action="store_true", help="each mutant as an s3:// object too (SeaweedFS)")
    ap.add_argument("--fast", action="store_true", help="the quick commands only; memory on the first")
    ap.add_argument("--mutants", type=int, default=0, help="stop after this many mutants (0: --seconds only)")
    ap.add_argument("--report-every", type=float, default=300, help="seconds between progress lines")
    ap.add_argument("--store-every", type=int, default=1,
                    help="with --store: every Nth mutant (the 1st, N+1th, ...) also goes through the store commands")
    ap.add_argument("--measure-every", type=int, default=0,
                    help="memory (tracemalloc) on every command of every Nth mutant (the 1st, N+1th, ...); "
                         "default: every mutant, or with --fast the first command of each")
    args = ap.parse_args()
    _cache_what_no_mutant_changes(args.identify)
    store_url, put, stop = _store(args.store)
    rng = random.Random(args.seed)
    sources = mutate.sources()
    files = runs = 0
    codes: collections.Counter = collections.Counter()
    per_layer: collections.Counter = collections.Counter()
    slowest = (0.0, "")
    seconds: collections.Counter = collections.Counter()
    current: tuple = ()     # the mutant being run: (source, layer, mutations)
    biggest = (0, "")
    findings = []
    original_check = mutate.check_command
    measure_now = None      # None: as check_file asks; True/False: every command of this mutant, or none
    store_runs = measured = 0

    def counting(cmd, *, measure=True):
        nonlocal runs, slowest, biggest
        code, secs, peak = original_check(cmd, measure=measure if measure_now is None else measure_now)
        runs += 1
        codes[(_label(cmd), code)] += 1
        seconds[_label(cmd)] += secs
        if secs > slowest[0] and files > 1:     # the first mutant's commands import their modules
            slowest = (secs, " ".join(cmd[:1] + cmd[2:]) + f" on mutant {files - 1} {current}")
        if peak > biggest[0]:
            biggest = (peak, " ".join(cmd[:1] + cmd[2:]))
        return code, secs, peak

    mutate.check_command = counting
    t0 = time.monotonic()
    end = t0 + args.seconds
    said = t0
    with tempfile.TemporaryDirectory() as d:
        while time.monotonic() < end and not (args.mutants and files >= args.mutants):
            if time.monotonic() - said > args.report_every:
                said = time.monotonic()
                print(f"... {files:,} files, {runs:,} runs ({store_runs:,} mutants through the store, "
                      f"{measured:,} measured), {len(findings)} findings, {files / (said - t0):.1f} files/s, "
                      f"{runs / (said - t0):.1f} runs/s, peak RSS {_peak_rss_mib():.0f} MiB", flush=True)
            src = rng.choice(sources)
            layer, off, size = rng.choice(src.layers)
            muts = []
            data = src.data
            for _ in range(rng.choice((1, 1, 1, 2, 3))):
                kind = rng.choice(mutate.KINDS)
                pos = off + rng.randrange(max(1, size))
                arg = rng.choice(mutate.EXTREMES) if rng.random() < 0.3 else rng.getrandbits(64)
                muts.append((kind, pos, arg))
                data = mutate.apply(data, kind, pos, arg)
            through_store = store_url is not None and files % max(1, args.store_every) == 0
            if args.measure_every:
                measure_now = files % args.measure_every == 0
                measured += measure_now
            files += 1
            store_runs += through_store
            per_layer[(src.name, layer)] += 1
            current = (src.name, layer, muts)
            try:
                if through_store:
                    put(data)
                mutate.check_file(data, src, Path(d), full=not args.fast, identify=args.identify,
                                  store=store_url if through_store else None)
            except Exception:   # noqa: BLE001 - every failure is a finding
                os.makedirs(args.keep, exist_ok=True)
                keep = Path(args.keep) / f"finding-{len(findings)}.bin"
                keep.write_bytes(data)
                findings.append((src.name, layer, muts, traceback.format_exc(limit=3)))
                print(f"FINDING {len(findings)}: {src.name} {layer} {muts} -> {keep}\n{findings[-1][3]}", flush=True)
    stop()
    took = time.monotonic() - t0
    print(f"files: {files:,}; command runs: {runs:,}; seed {args.seed}; {took:.0f} s: {files / took:.1f} files/s, "
          f"{runs / took:.1f} runs/s" + (" (identify)" if args.identify else "")
          + (f" (store: {store_runs:,} mutants)" if args.store else "")
          + (f" (memory measured on {measured:,} mutants)" if args.measure_every else ""))
    print("files per (source, layer): " + ", ".join(f"{s}/{l}: {n}" for (s, l), n in sorted(per_layer.items())))
    print("exit codes: " + ", ".join(f"{c} {code}: {n}" for (c, code), n in sorted(codes.items())))
    print("seconds per command: " + ", ".join(f"{c} {t:.0f}" for c, t in seconds.most_common()))
    print(f"slowest command (after the first mutant): {slowest[0]:.2f} s ({slowest[1]}); largest peak allocation: "
          f"{biggest[0] / 2**20:.1f} MiB ({biggest[1]})")
    print(f"peak RSS of the process: {_peak_rss_mib():.0f} MiB")
    print(f"findings: {len(findings)}")
    sys.exit(1 if findings else 0)


def _label(cmd: list[str]) -> str:
    """A command as counted: its name, ``-m`` when it was given a model, ``s3`` when it read the store."""
    return cmd[0] + (" -m" if "-m" in cmd else "") + (" s3" if any(a.startswith("s3://") for a in cmd) else "")


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cache_what_no_mutant_changes(identify: bool) -> None:
    """Keep across runs what no mutant changes, so that a run costs what its command does with the file:

    - each command as typer builds it from its function (``slotctl.cli.app.load_command``: about 60 ms of
      signature reading a run, a third of a run's time), and the group CliRunner builds from the app; the
      group still parses every argument, and the command's own code runs as it does for a user;
    - with ``identify``, the state a candidate model computes for a prompt (``candidate_state``: a real
      llama-cpp-python context decoding the tokens, 0.1 to 0.4 s), keyed by everything it is computed from
      (model, tokens, cache types, flash attention); a mutant whose tokens changed gets its own. What identify
      does with the file, its rows and the comparison, runs every time.
    """
    import functools

    import typer.testing

    import slotctl.cli.app as cli_app

    cli_app.load_command = functools.cache(cli_app.load_command)
    # CliRunner.invoke builds the click group from the Typer app on every call: once is enough
    typer.testing._get_command = functools.cache(typer.testing._get_command)
    if not identify:
        return
    import slotctl.runtime.identify as rid

    compute = rid.candidate_state
    states: dict = {}

    def candidate_state(model_path, tokens, *, type_k="f16", type_v="f16", flash_attn="on"):
        key = (os.fspath(model_path), tuple(tokens), type_k, type_v, flash_attn)
        if key not in states:
            if len(states) >= 64:      # a few hundred KB each; the intact prompts are the ones met again
                states.clear()
            states[key] = compute(model_path, tokens, type_k=type_k, type_v=type_v, flash_attn=flash_attn)
        return states[key]

    rid.candidate_state = candidate_state


def _store(wanted: bool):
    """(the object's URL, put(data), stop()) of a SeaweedFS started for the run; (None, ..) without."""
    if not wanted:
        return None, None, lambda: None
    import shutil

    from seaweed import BUCKET, Seaweed, weed_binary

    from slotctl.store.s3 import S3_STORE

    work = Path(tempfile.mkdtemp(prefix="fuzz-seaweed-"))
    srv = Seaweed(work, weed_binary())
    srv.start()
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        del os.environ[k]
    os.environ.update(srv.env(), HOME=str(work))
    S3_STORE.reset()
    client = srv.client()
    import obstore

    def put(data: bytes) -> None:
        obstore.put(client, "fuzz/mutated.bin", data)
        S3_STORE.reset()     # nothing read before (a first read kept, a store marked down) carries over

    def stop() -> None:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)

    return f"s3://{BUCKET}/fuzz/mutated.bin", put, stop


if __name__ == "__main__":
    main()
