"""``slotctl serve``: a conversation that moves to a server of other ``-np``/``-kvu``, against one that moves
to a server of the same flags and against the server alone.

Real llama-server b11434 processes (tests/llama_server.py: the suite's build), a model of slotctl.tinymodels:
server A (``-np 2``), server S (``-np 2``: A's layout) and server K (``-np 4 -kvu``: one KV stream where A
writes two), each behind its own ``slotctl serve`` process, the three sharing one store (a SeaweedFS bucket,
tests/seaweed.py, or a directory). ``--rounds`` times: two conversations of about ``--repeat`` x 100 tokens
begin behind A (its state stored); the second turn of one is sent to S (its state restored as it is), of the
other to K (converted for K first, then restored); then each second turn straight to its server, the slot
holding nothing (``cache_prompt`` false). Printed: the second turns' wall time, the server's own
``timings.prompt_n``, serve's conversion (download, rewrite, verdict) and restore times from its ``restored``
events, the state's size, and whether every answer is the server's own.

Run: ``python benchmarks/bench_serve_convert.py [--repeat 40] [--rounds 3] [--store s3|dir]``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serve import Serve, post  # noqa: E402
from llama_server import LlamaServer, server_binary  # noqa: E402

from slotctl.tinymodels import SAMPLE_PROMPT  # noqa: E402
from slotctl.tinymodels.llama import make_model  # noqa: E402

ARGS = {"a": ["-c", "16384", "-np", "2", "-fa", "on"],
        "s": ["-c", "16384", "-np", "2", "-fa", "on"],
        "k": ["-c", "8192", "-np", "4", "-kvu", "-fa", "on"]}


def restored(serve: Serve, start: int) -> dict | None:
    """The ``restored`` event among ``serve``'s events from ``start`` on, with its restore's milliseconds."""
    for ev in serve.events[start:]:
        if ev["event"] == "restored":
            m = re.search(r"tokens in (\d+) ms", ev["message"])
            return {**ev["details"], "restore_ms": int(m.group(1)) if m else None}
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=40, help="the first turn: SAMPLE_PROMPT this many times")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--predict", type=int, default=16)
    ap.add_argument("--store", choices=("s3", "dir"), default="s3")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    binary = server_binary()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        tmp = Path(tmp)
        model = make_model(tmp / "bench.gguf", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                           n_ff=512, context_length=16384, name="slotctl-bench-serve-convert")
        weed, env = None, {}
        if a.store == "s3":
            from seaweed import BUCKET, Seaweed, weed_binary

            (tmp / "seaweed").mkdir()
            weed = Seaweed(tmp / "seaweed", weed_binary())
            weed.start()
            env = {**weed.env(), "HOME": str(tmp / "seaweed")}
            store = f"s3://{BUCKET}/bench-convert/"
        else:
            (tmp / "store").mkdir()
            store = str(tmp / "store")
        servers, serves = {}, {}
        try:
            for name, args in ARGS.items():
                (tmp / name).mkdir()
                servers[name] = LlamaServer(binary, model, args=args, slot_save_path=tmp / name,
                                            log_path=tmp / f"{name}.log").start(timeout=300)
                extra = ["-kvu"] if "-kvu" in args else []
                serves[name] = Serve(servers[name].url, tmp / name, store, env=env, extra=extra)
            rows = {"s": [], "k": []}
            for r in range(a.rounds):
                prompts = {}
                for name in ("s", "k"):
                    p = f"Conversation {r} {name}. " + " ".join([SAMPLE_PROMPT] * a.repeat)
                    _s, first = post(serves["a"].url, "/completion", {"prompt": p, "n_predict": a.predict,
                                                                       "temperature": 0})
                    prompts[name] = p + first["content"] + " And then, what came after?"
                serves["a"].idle()
                for name in ("s", "k"):
                    start = len(serves[name].events)
                    body = {"prompt": prompts[name], "n_predict": a.predict, "temperature": 0}
                    secs, second = post(serves[name].url, "/completion", body)
                    serves[name].idle()
                    ev = restored(serves[name], start)
                    alone_s, alone = post(servers[name].url, "/completion",
                                          dict(body, id_slot=3 if name == "k" else 1, cache_prompt=False))
                    rows[name].append({"ms": secs * 1000, "prompt_n": second["timings"]["prompt_n"],
                                       "alone_ms": alone_s * 1000, "alone_prompt_n": alone["timings"]["prompt_n"],
                                       "same": second["content"] == alone["content"],
                                       "convert_ms": (ev or {}).get("convert_ms"),
                                       "restore_ms": (ev or {}).get("restore_ms"),
                                       "n_restored": (ev or {}).get("n_restored")})
            sizes = [e["details"]["size"] for e in serves["a"].events if e["event"] == "stored"]
            print(f"a conversation of about {a.repeat * 100:,} tokens begun behind serve A (-np 2), its second turn "
                  f"behind serve S (-np 2) or K (-np 4 -kvu), store {a.store}; {a.rounds} rounds; state "
                  f"{statistics.median(sizes) / 1e6:.1f} MB at the median")
            for name, label in (("s", "S: same layout, restored as stored"), ("k", "K: converted, then restored")):
                rs = rows[name]

                def med(key: str, rs=rs) -> float:
                    vals = [x[key] for x in rs if x[key] is not None]
                    return statistics.median(vals) if vals else float("nan")

                print(f"{label}: second turn {med('ms'):.0f} ms through serve (alone {med('alone_ms'):.0f} ms), "
                      f"prompt_n {med('prompt_n'):.0f} (alone {med('alone_prompt_n'):.0f}), conversion "
                      f"{med('convert_ms'):.0f} ms, restore {med('restore_ms'):.0f} ms, n_restored "
                      f"{med('n_restored'):.0f}; answers identical {sum(x['same'] for x in rs)}/{len(rs)}")
            st = serves["k"].stats()
            print(f"serve K: {st['restores']} restores, {st['conversions']} conversions, "
                  f"{st['conversion_failures']} conversion failures")
        finally:
            for s in serves.values():
                s.stop()
            for srv in servers.values():
                srv.stop()
            if weed is not None:
                weed.stop()


if __name__ == "__main__":
    main()
