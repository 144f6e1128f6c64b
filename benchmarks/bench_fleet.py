"""``slotctl migrate`` of a slot file of a few hundred MB, and the prompt tokens a restarted server evaluates
with and without ``slotctl keep``.

Makes a model of slotctl.tinymodels with a wide KV cache (default 16 layers, 8 KV heads of 64: 32 KiB of f16
K and V per token) and a small residual stream (so that evaluating a long prompt stays cheap), starts two
real llama-server b11434 processes (tests/llama_server.py: the suite's build) and:

* ``migrate``: evaluates a prompt of about ``--tokens`` tokens in slot 0 of a ``-np 1`` server and runs
  ``slotctl migrate`` (a whole process) to slot 1 of a ``-np 2`` server (converted from 1 KV stream to 2),
  proven there; prints the file's size, the command's time and each step's;
* ``restart``: kills the destination with SIGKILL and starts it again on the same port, first without keep,
  then under ``slotctl keep``; each time sends the prompt extended by a few tokens and prints the server's own
  ``timings`` (``prompt_n`` evaluated, ``cache_n`` reused, ``prompt_ms``).

Run: ``python benchmarks/bench_fleet.py [--tokens 8000] [--dir PARENT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from llama_server import LlamaServer, server_binary  # noqa: E402

from slotctl.tinymodels import SAMPLE_PROMPT  # noqa: E402
from slotctl.tinymodels.llama import make_model  # noqa: E402


def slotctl(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "slotctl", *args], capture_output=True, text=True, env=env)
    return time.perf_counter() - t0, res


def extended(srv: LlamaServer, tokens: list[int]) -> dict:
    more = tokens + srv.tokenize(" The river Seine runs through Paris.", add_special=False)
    status, answer = srv.post("/completion", {"prompt": more, "n_predict": 1, "id_slot": 1, "cache_prompt": True,
                                              "temperature": 0}, timeout=3600)
    assert status == 200, answer
    t = answer["timings"]
    return {"n_prompt": len(more), "prompt_n": t["prompt_n"], "cache_n": t["cache_n"], "prompt_ms": t["prompt_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    binary = server_binary()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        tmp = Path(tmp)
        model = make_model(tmp / "wide.gguf", n_layer=16, n_embd=128, n_head=8, n_head_kv=8, head_dim=64,
                           n_ff=256, context_length=32768, name="slotctl-bench-wide")
        dirs = {n: tmp / n for n in ("a", "b", "store")}
        for d in dirs.values():
            d.mkdir()
        ctx = a.tokens + 512
        src = LlamaServer(binary, model, args=["-c", str(ctx), "-np", "1", "-fa", "on"], slot_save_path=dirs["a"],
                     log_path=tmp / "a.log").start(timeout=300)
        dst = LlamaServer(binary, model, args=["-c", str(2 * ctx), "-np", "2", "-fa", "on"], slot_save_path=dirs["b"],
                     log_path=tmp / "b.log").start(timeout=300)
        try:
            words = SAMPLE_PROMPT.split()
            text, n = SAMPLE_PROMPT, len(src.tokenize(SAMPLE_PROMPT))
            reps = max(1, a.tokens // n)
            text = " ".join([SAMPLE_PROMPT] * reps)
            t0 = time.perf_counter()
            status, answer = src.post("/completion", {"prompt": text, "n_predict": 1, "id_slot": 0,
                                                      "cache_prompt": True, "temperature": 0}, timeout=3600)
            assert status == 200, answer
            print(f"prompt evaluated on the source: {len(src.tokenize(text)):,} tokens in "
                  f"{time.perf_counter() - t0:.1f} s ({len(words)} words x {reps})")
            secs, res = slotctl("migrate", "--from", src.url, "--slot", "0", "--to", dst.url, "--to-slot", "1",
                                "--from-dir", str(dirs["a"]), "--to-dir", str(dirs["b"]), "--name", "big.bin",
                                "--json")
            doc = json.loads(res.stdout)
            size = (dirs["b"] / "big.bin").stat().st_size
            print(f"migrate: exit {res.returncode}, {size / 2**20:,.1f} MiB, {secs:.2f} s (whole process)")
            for s in doc["steps"]:
                print(f"  {s['step']:<12} {s['status']:<8} {s['ms'] or 0:>10,.1f} ms  {s['message']}")
            tokens = [int(t) for t in __import__("slotctl.slotfile", fromlist=["x"]).open_slot_file(
                dirs["b"] / "big.bin").tokens.tokens]

            dst.kill_and_start_again(300)
            print("restart without keep:", extended(dst, tokens))

            env = dict(os.environ, PYTHONPATH=str(ROOT))
            keep = subprocess.Popen([sys.executable, "-m", "slotctl", "keep", "--server", dst.url, "--slot-dir",
                                     str(dirs["b"]), "--store", str(dirs["store"]), "--every", "0.5", "--json"],
                                    stdout=subprocess.PIPE, text=True, env=env)
            stored = None
            for raw in keep.stdout:
                ev = json.loads(raw)
                if ev["event"] == "stored" and ev["slot"] == 1:
                    stored = ev
                    break
            print(f"keep stored slot 1: {stored['details']['size'] / 2**20:,.1f} MiB")
            dst.kill_and_start_again(300)
            t_back = time.perf_counter()
            for raw in keep.stdout:
                ev = json.loads(raw)
                if ev["event"] == "proof" and ev["slot"] == 1:
                    p = ev["details"]["proof"]
                    print(f"keep restored and proved slot 1 {time.perf_counter() - t_back:.2f} s after the server "
                          f"answered: {p['verdict']}, {p['n_reused']:,} reused, {p['n_evaluated']:,} evaluated")
                    break
            print("restart with keep:", extended(dst, tokens))
            keep.send_signal(signal.SIGTERM)
            print(f"keep exit code after SIGTERM: {keep.wait(timeout=120)}")
        finally:
            src.stop()
            dst.stop()


if __name__ == "__main__":
    main()
