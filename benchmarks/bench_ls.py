"""``slotctl ls`` on a directory of 10,000 slot files: time (cold and warm) and peak memory.

Makes a directory of sparse slot files of realistic shapes, so that the tensor bytes cost no disk:

* memory kinds: plain KV (llama-like 16, 32 and 80 layers; f16, q8_0 and f32 caches; V transposed for
  ``-fa off``), iSWA (gemma2-like base + SWA), recurrent (mamba-like) and hybrid (jamba-like);
* state versions 3 and 4; packed and (a few) legacy token words;
* most files a few thousand tokens, 5% of 40,000; the largest (80 layers, f32, 40,000 cells) are
  24.4 GiB apparent, none over 32 GiB;
* one file in eight with a checkpoint appendix and a draft state (SCKP + SDFT).

Each shape is checked once with slotctl's own parser (the tokens and the kind come out as written).
Then it times whole processes, each over the whole directory:

* ``baseline``: a Python process that opens every file and reads its first 4 KiB (the least any
  per-file tool does);
* ``ls``: ``slotctl ls DIR --jsonl`` (rows streamed), cold (page cache dropped, when this process may
  write /proc/sys/vm/drop_caches; else it says so) and warm;
* ``ls --json`` and ``ls --sort size``, warm;
* with the catalog (``SLOTCTL_CACHE_DIR`` a directory of the run's own): ``ls --jsonl`` a first time (every
  file read, every row written) and again (no file changed: no file read), and ``ls --json`` again; every
  other run with ``--no-cache``;

with peak RSS (the largest of the process and its workers), and ``ls --jsonl`` on a tenth of the files
to show memory flat in the number of files. It prints the disk the directory used and removes it.

Run: ``python benchmarks/bench_ls.py [--files 10000] [--dir PARENT] [--keep]``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

from slotctl.format.appendix import SCKP_MAGIC, SDFT_MAGIC
from slotctl.format.blob import BLOB_MAGIC
from slotctl.format.tokens import pack_tokens

STATE_MAGIC = 0x67677371
F32, F16, Q8_0 = 0, 1, 8

# (name, weight, kind, params): params of the KV part (n_layer, k row bytes, type, v_trans) and of
# the recurrent part (n_layer records, r row bytes, s row bytes)
SHAPES = [
    ("llama8b-f16", 40, "kv", dict(n_layer=32, row=2048, type=F16)),
    ("llama1b-f16", 20, "kv", dict(n_layer=16, row=1024, type=F16)),
    ("llama8b-q8", 10, "kv", dict(n_layer=32, row=1088, type=Q8_0, n_rot=64)),
    ("llama8b-fa-off", 8, "kv", dict(n_layer=32, row=2048, type=F16, v_trans=1)),
    ("gemma2-iswa", 10, "iswa", dict(n_layer=13, row=1024, type=F16)),
    ("mamba-small", 6, "recurrent", dict(n_rec=8, r_row=12288, s_row=65536)),
    ("lfm2-hybrid", 6, "hybrid", dict(n_layer=6, row=1024, type=F16, n_rec=6, r_row=6144, s_row=4096)),
]
HUGE = ("llama70b-f32", "kv", dict(n_layer=80, row=4096, type=F32))


def _cells(n: int, recurrent: bool = False) -> bytes:
    if recurrent:   # one cell, no sequence ids (a single-sequence save of a recurrent memory)
        return struct.pack("<iI", max(0, n - 1), 0)
    a = np.zeros((n, 3), "<i4")
    a[:, 0] = np.arange(n)
    a[:, 1] = 1
    return a.tobytes()


def _kv(f, n_layer: int, cells: int, row: int, type: int, version: int, v_trans: int = 0, n_rot: int = 0,
        swa: int | None = None) -> None:
    """One single-stream KV section, seeking over the tensor bytes."""
    n = cells if swa is None else min(cells, swa)
    f.write(struct.pack("<II", 1, n))
    f.write(_cells(n) if swa is None else _cells_from(cells - n, n))
    f.write(struct.pack("<II", v_trans, n_layer))
    if version >= 4:
        f.write(struct.pack("<II", n_rot, n_rot))
    for _ in range(n_layer):
        f.write(struct.pack("<iQ", type, row))
        f.seek(n * row, os.SEEK_CUR)
    el = {F32: 4, F16: 2}.get(type, 2)
    for _ in range(n_layer):
        if v_trans:
            f.write(struct.pack("<iII", type, el, row // el))
            f.seek(n * row, os.SEEK_CUR)
        else:
            f.write(struct.pack("<iQ", type, row))
            f.seek(n * row, os.SEEK_CUR)


def _cells_from(start: int, n: int) -> bytes:
    a = np.zeros((n, 3), "<i4")
    a[:, 0] = np.arange(start, start + n)
    a[:, 1] = 1
    return a.tobytes()


def _recurrent(f, n_rec: int, cells: int, r_row: int, s_row: int) -> None:
    f.write(struct.pack("<I", 1))
    f.write(_cells(cells, recurrent=True))
    f.write(struct.pack("<II", 0, n_rec))
    for row in [r_row] * n_rec + [s_row] * n_rec:
        f.write(struct.pack("<iQ", F32, row))
        f.seek(row, os.SEEK_CUR)


def _payload(f, kind: str, p: dict, cells: int, version: int) -> None:
    if kind == "kv":
        _kv(f, p["n_layer"], cells, p["row"], p["type"], version, p.get("v_trans", 0), p.get("n_rot", 0))
    elif kind == "iswa":
        _kv(f, p["n_layer"], cells, p["row"], p["type"], version)
        _kv(f, p["n_layer"], cells, p["row"], p["type"], version, swa=4096)
    elif kind == "recurrent":
        _recurrent(f, p["n_rec"], cells, p["r_row"], p["s_row"])
    else:  # hybrid: attention KV, then the recurrent layers
        _kv(f, p["n_layer"], cells, p["row"], p["type"], version)
        _recurrent(f, p["n_rec"], cells, p["r_row"], p["s_row"])


def _blob(f, write) -> None:
    at = f.tell()
    f.write(b"\0" * 8)
    f.write(struct.pack("<Ii", BLOB_MAGIC, 0))
    write()
    end = f.tell()
    f.seek(at)
    f.write(struct.pack("<Q", end - at - 8))
    f.seek(end)


def write_file(path: str, kind: str, p: dict, cells: int, version: int, *, legacy: bool, appendix: bool) -> int:
    toks = np.arange(cells, dtype="<i4") % 32000
    words = toks if legacy else pack_tokens(toks)
    with open(path, "wb") as f:
        f.write(struct.pack("<III", STATE_MAGIC, version, len(words)))
        f.write(np.asarray(words, "<i4").tobytes())
        _payload(f, kind, p, cells, version)
        if appendix and kind == "kv":
            f.write(struct.pack("<II", SCKP_MAGIC, 1))
            f.write(struct.pack("<Iqii", 1, cells, 0, cells - 1))
            _blob(f, lambda: _payload(f, kind, p, cells, version))
            f.write(struct.pack("<QQ", 0, 0))       # empty draft blob and speculative state
            f.write(struct.pack("<II", SDFT_MAGIC, 1))
            _blob(f, lambda: _kv(f, 1, cells, 256, F16, version))
            f.write(struct.pack("<Q", 0))
        f.truncate()
        return f.tell()


def plan(n: int, seed: int = 7) -> list[tuple]:
    rng = random.Random(seed)
    weights = [w for _, w, _, _ in SHAPES]
    out = []
    for i in range(n):
        if i % 500 == 250:
            name, kind, p = HUGE
        else:
            name, _, kind, p = rng.choices(SHAPES, weights)[0]
        cells = 40000 if rng.random() < 0.05 or name == HUGE[0] else rng.randint(800, 8000)
        version = 3 if rng.random() < 0.15 else 4
        legacy = rng.random() < 0.03
        # the checkpoint repeats the payload: not on the largest shape, which would pass 32 GiB
        appendix = version == 4 and kind == "kv" and name != HUGE[0] and rng.random() < 0.125
        out.append((f"slot-{i:05d}-{name}.bin", kind, p, cells, version, legacy, appendix))
    return out


def _make(args) -> int:
    d, items = args
    return sum(write_file(os.path.join(d, name), kind, p, cells, v, legacy=lg, appendix=ap)
               for name, kind, p, cells, v, lg, ap in items)


def make_dir(d: str, n: int) -> int:
    items = plan(n)
    from multiprocessing import Pool

    chunks = [items[i::2] for i in range(2)]
    with Pool(2) as pool:
        return sum(pool.map(_make, [(d, c) for c in chunks]))


def check_shapes(d: str) -> None:
    """Each shape as slotctl parses it: the kind and the token count as written."""
    from slotctl.slotfile import open_slot_file

    seen = set()
    for name, kind, p, cells, v, lg, ap in plan(len(os.listdir(d))):
        key = (kind, name.split("-", 2)[2], v, ap)
        if key in seen:
            continue
        seen.add(key)
        sf = open_slot_file(os.path.join(d, name))
        got = sf.target.layout.kind if sf.target else None
        if sf.damaged or got != kind or sf.tokens.n_tokens != cells or (sf.sdft is not None) != ap:
            raise SystemExit(f"{name}: parsed as {got}, {sf.tokens.n_tokens} tokens, errors {sf.errors}")


def disk_used(d: str) -> tuple[int, int]:
    apparent = used = 0
    with os.scandir(d) as it:
        for e in it:
            st = e.stat()
            apparent += st.st_size
            used += st.st_blocks * 512
    return apparent, used


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str]) -> tuple[float, int, int, float]:
    """Wall seconds, peak RSS in bytes (the process or its largest worker), exit code, and CPU seconds
    (user + system, the workers included: on a busy machine the wall time says little, the CPU time
    divided by the cores is the wall time of an idle one)."""
    print(f"  running {' '.join(os.path.basename(c) for c in cmd[:6])} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryFile() as errf:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errf,
                                env={**os.environ, "SLOTCTL_NO_PROGRESS": "1"})
        _, status, ru = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        secs = time.perf_counter() - t
        errf.seek(0)
        err = errf.read(1 << 16).decode(errors="replace")
    code = proc.returncode
    if code not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)}: exit {code}: {err.strip()[-500:]}")
    return secs, ru.ru_maxrss * 1024, code, ru.ru_utime + ru.ru_stime


BASELINE = ("import os,sys\nd=sys.argv[1]\nfor n in sorted(os.listdir(d)):\n"
            " f=open(os.path.join(d,n),'rb'); f.read(4096); f.close()\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--dir", default=None, help="Parent directory for the slot directory (default: TMPDIR).")
    ap.add_argument("--keep", action="store_true", help="Leave the directory in place.")
    a = ap.parse_args()
    import resource

    # a guard: this process holds no more than the names of the files (the children inherit it too)
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))
    parent = tempfile.mkdtemp(prefix="slotctl-bench-ls-", dir=a.dir)
    d = os.path.join(parent, "slots")
    small = os.path.join(parent, "tenth")
    os.makedirs(d)
    os.makedirs(small)
    try:
        t = time.perf_counter()
        make_dir(d, a.files)
        for name in sorted(os.listdir(d))[: max(1, a.files // 10)]:
            os.link(os.path.join(d, name), os.path.join(small, name))
        check_shapes(d)
        apparent, used = disk_used(d)
        sizes = [os.stat(os.path.join(d, n)).st_size for n in os.listdir(d)]
        print(f"{a.files:,} files made in {time.perf_counter() - t:.1f} s: apparent {apparent / 2**30:,.1f} GiB "
              f"(largest {max(sizes) / 2**30:.1f} GiB), disk used {used / 2**20:,.0f} MiB")
        py = sys.executable
        ls = [py, "-m", "slotctl", "ls", d]
        nc = ["--no-cache"]
        os.environ["SLOTCTL_CACHE_DIR"] = os.path.join(parent, "cache")   # the catalog: empty, this run's own
        time.sleep(3.5)     # a row made within 3 s of its file's last change is not trusted (docs/directories.md)
        results = []
        cold = drop_caches()
        base_cold = timed([py, "-c", BASELINE, d])
        drop_caches()
        ls_cold = timed([*ls, "--jsonl", *nc])
        base_warm = timed([py, "-c", BASELINE, d])
        ls_warm = timed([*ls, "--jsonl", *nc])
        ls_first = timed([*ls, "--jsonl"])            # the catalog empty: every file read, every row written
        ls_again = timed([*ls, "--jsonl"])            # every file unchanged: no file read
        again_json = timed([*ls, "--json"])
        json_warm = timed([*ls, "--json", *nc])
        sort_warm = timed([*ls, "--sort", "size", *nc])
        tenth = timed([py, "-m", "slotctl", "ls", small, "--jsonl", *nc])
        note = "" if cold else " (not cold: cannot write /proc/sys/vm/drop_caches; the page cache was warm)"
        results += [
            (f"baseline cold{note}", base_cold, None),
            (f"ls --jsonl cold{note}", ls_cold, base_cold[0]),
            ("baseline warm", base_warm, None),
            ("ls --jsonl warm --no-cache", ls_warm, base_warm[0]),
            ("ls --jsonl warm, the catalog empty (first)", ls_first, base_warm[0]),
            ("ls --jsonl warm, the catalog holding every row", ls_again, base_warm[0]),
            ("ls --json warm, the catalog holding every row", again_json, base_warm[0]),
            ("ls --json warm --no-cache", json_warm, base_warm[0]),
            ("ls --sort size warm (human) --no-cache", sort_warm, base_warm[0]),
            (f"ls --jsonl warm --no-cache, {len(os.listdir(small)):,} files", tenth, None),
        ]
        cores = os.cpu_count() or 1
        print(f"load average {os.getloadavg()[0]:.1f} on {cores} cores (other processes share them)")
        print(f"{'run':<48} {'wall s':>7} {'CPU s':>7} {'CPU/cores':>9} {'files/s':>8} {'peak RSS':>10} "
              f"{'vs baseline':>11}")
        for name, (secs, rss, _code, cpu), base in results:
            n = len(os.listdir(small)) if "files" in name.split(",")[-1] else a.files
            ratio = f"{secs / base:.1f}x" if base else "-"
            print(f"{name:<48} {secs:>7.2f} {cpu:>7.2f} {cpu / cores:>9.2f} {n / secs:>8,.0f} "
                  f"{rss / 2**20:>7.0f} MiB {ratio:>11}")
        print(f"memory: {ls_warm[1] / 2**20:.0f} MiB for {a.files:,} files, {tenth[1] / 2**20:.0f} MiB for a tenth")
    finally:
        if a.keep:
            print(f"kept {parent}")
        else:
            shutil.rmtree(parent, ignore_errors=True)
            print(f"removed {parent}")


if __name__ == "__main__":
    main()
