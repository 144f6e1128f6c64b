"""``slotctl serve`` against the server alone: interleaved multi-turn conversations across a server restart.

A real llama-server b11434 (tests/llama_server.py: the suite's build), a model of slotctl.tinymodels, ``-np 2``:
``--conversations`` conversations (default 16, more than the 2 slots) of ``--turns`` turns each, sent round
by round (turn 1 of every conversation, then turn 2 of every one, ...), each turn extending its own
conversation by a new user line and the previous answer (greedy, ``--predict`` tokens). After round
``--kill-after`` the server is SIGKILLed and started again on the same port. The whole run is made twice
with the same model and flags, each on a server started anew: once straight to the server (its RAM prompt
cache, ``--cache-ram``, is on by default: it serves returning turns until the restart), once through
``slotctl serve`` (a whole process, a directory store). Printed side by side: the prompt tokens the server
evaluated (its own ``timings.prompt_n``) on returning turns before and after the restart, the wall time of
the run, and whether every answer is identical; then per round, each returning turn's floor: the prompt
tokens its conversation's last slot (the last prompt's tokens and the tokens generated for its answer) does
not begin with, which no cache of that slot can spare (``--start-repeat`` makes the first turn longer).

serve's overhead (``--overhead`` pairs; ``--only-overhead`` measures it alone): two copies of one
conversation, one sent straight to the server in one slot, one through serve (which keeps it in the other
slot); each request extends its copy by the same few words (new tokens to tokenize and evaluate, a prefix
the slot already holds: no restore) and generates one token; straight and through serve alternately, which
goes first alternating too, serve's save of each answer waited for outside the timed request: the median of
the differences, and the load average.

``--s3``: two serve processes over one SeaweedFS bucket (tests/seaweed.py), each before its own server: a
conversation begun behind one continues behind the other, its prefix restored from the bucket.

``--only-cases``: issue 33's cases, side by side with the server alone in one run (each case on a server
started anew, straight, then through serve on another server started anew): the head-of-line case (``-np 2``;
A, 600 tokens, and B, 30, running; C, 30 tokens whose prompt shares A's, sent 0.4 s later: C's time); a
back-to-back agent loop (a 2,000-token conversation, each turn sent the moment its answer came: the prompt
tokens evaluated per turn); ``--chats`` streamed chats through the official ``openai`` SDK (the states
serve saved of them).

``--router``: serve in front of llama-server b11669's router (issue 34; tests/llama_server.py's sid chroot): two
models of different sizes in its ``--models-dir``, ``--models-max 1``, ``--conversations`` conversations with each
model interleaved so that every turn swaps models (the router unloads one model for the other); the whole run twice,
each on a router started anew, once straight to the router, once through one ``slotctl serve`` for the whole router.
Printed side by side: the prompt tokens each model's server evaluated (its ``timings.prompt_n``) on returning turns,
whether every answer is identical, and the time to first token of returning turns (streamed; the model's load is in
both: the router loads the model for the request, or serve has it load it before its restore), with the load
average.

``--ttft``: time to first token of a returning turn after a restart (issue 33), side by side in one run: a
model made in code (``--ttft-shape LAYERS EMBD FF``, f32, default 24 layers at n_embd 1024, n_ff 2816, 16 heads
of 64, 4 KV heads: 1.1 GB; ``8 256 512``: the tiny model), a conversation of about ``--ttft-tokens`` tokens
(2,000) answered (``--predict`` tokens) by two servers started anew (``-np 2``, ``-c`` to fit), one straight, one
behind serve (a directory store; ``--s3``: an ``s3://`` bucket of SeaweedFS); then ``--repeats`` times: both
servers SIGKILLed and started again, the returning turn (the conversation, its answer, a few new words)
streamed to each (which goes first alternating): its time to first token, the prompt tokens the server
evaluated (its ``timings``), the load average when it was sent, whether the answers are identical, and what
serve chose (its ``outcome`` event: restore or prefill, predicted and measured); the medians and their ratio.

Run: ``python benchmarks/bench_serve.py [--conversations 16] [--turns 4] [--overhead 40] [--s3] [--out FILE]
[--start-repeat 6] [--only-overhead] [--only-cases] [--chats 100] [--router] [--ttft [--ttft-shape 24 1024 2816]
[--ttft-tokens 2000] [--repeats 3]]``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from llama_server import LlamaServer, seed_server, server_binary  # noqa: E402

from slotctl.tinymodels import SAMPLE_PROMPT  # noqa: E402
from slotctl.tinymodels.llama import make_model  # noqa: E402

TOPICS = ["river", "mountain", "library", "harbor", "garden", "engine", "forest", "market", "bridge", "castle",
          "desert", "island", "museum", "orchard", "station", "village", "glacier", "canyon", "theater", "valley"]


def post(url: str, path: str, body: dict, timeout: float = 600) -> tuple[float, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    t0 = time.perf_counter()
    with opener.open(req, timeout=timeout) as r:
        raw = r.read()
    return time.perf_counter() - t0, json.loads(raw)


class Serve:
    def __init__(self, upstream: str, slot_dir: Path, store: str, env: dict | None = None, log: Path | None = None,
                 extra: list[str] | None = None):
        cmd = [sys.executable, "-m", "slotctl", "serve", "--upstream", upstream, "--slot-dir", str(slot_dir),
               "--store", store, "--listen", "127.0.0.1:0", "--json", *(extra or ())]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log or os.devnull, "w"), text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
        self.events: list[dict] = []
        q: queue.Queue = queue.Queue()

        def read() -> None:
            for line in self.proc.stdout:
                ev = json.loads(line)
                ev["received"] = time.perf_counter()
                self.events.append(ev)
                q.put(ev)

        threading.Thread(target=read, daemon=True).start()
        first = q.get(timeout=120)
        self.url = f"http://127.0.0.1:{first['details']['port']}"
        while not any(e["event"] in ("up", "down") for e in self.events):
            time.sleep(0.01)

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/slotctl/stats", timeout=30) as r:
            return json.loads(r.read())["counters"]

    def idle(self, timeout: float = 60) -> None:
        """Until no save is pending (every answer's slot saved)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            c = self.stats()
            if c["saves"] + c["saves_deduplicated"] + c["save_failures"] >= c["cached"] - c["client_disconnects"]:
                return
            time.sleep(0.02)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


def conversation_start(i: int, repeat: int = 2) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return f"Conversation {i} about the {topic}. " + " ".join([SAMPLE_PROMPT] * repeat) + f" Now, about the {topic}:"


def run(url: str, srv: LlamaServer, a, label: str, serve: Serve | None = None) -> dict:
    prompts = [conversation_start(i, a.start_repeat) for i in range(a.conversations)]
    before: list[tuple | None] = [None] * a.conversations
    rows = []
    t0 = time.perf_counter()
    for turn in range(a.turns):
        if turn == a.kill_after:
            srv.kill_and_start_again(300)
        for i in range(a.conversations):
            if turn:
                prompts[i] += f" Question {turn}: and what of the {TOPICS[(i + turn) % len(TOPICS)]} after that?"
            secs, ans = post(url, "/completion", {"prompt": prompts[i], "n_predict": a.predict, "temperature": 0,
                                                  "return_tokens": True})
            rows.append({"conv": i, "turn": turn, "secs": secs, "content": ans["content"], "slot": ans.get("id_slot"),
                         "prompt_n": ans["timings"]["prompt_n"], "cache_n": ans["timings"]["cache_n"],
                         "after_restart": turn >= a.kill_after})
            if serve is None:
                # the tokens of this turn that its conversation's last slot (the last prompt's tokens and the
                # tokens generated for its answer) does not begin with: what no cache of the slot can spare, the
                # floor (the same in both runs: the answers are). The answer's text may tokenize otherwise than
                # it was generated: text_new_n counts against the text's tokens.
                now = tokenize(url, prompts[i])
                rows[-1]["new_n"] = len(now) - common(before[i][0], now) if before[i] else len(now)
                rows[-1]["text_new_n"] = len(now) - common(before[i][1], now) if before[i] else len(now)
                before[i] = (now + list(ans.get("tokens") or []), tokenize(url, prompts[i] + ans["content"]))
            prompts[i] += ans["content"]
    wall = time.perf_counter() - t0
    if serve is not None:
        serve.idle()
    return {"label": label, "rows": rows, "wall": wall}


def tokenize(url: str, text: str) -> list[int]:
    return post(url, "/tokenize", {"content": text, "add_special": True, "parse_special": True})[1]["tokens"]


def common(a: list[int], b: list[int]) -> int:
    from slotctl.serve.index import as_tokens, common_prefix

    return common_prefix(as_tokens(a), as_tokens(b))


def breakdown(alone: dict, cached: dict) -> None:
    """Per round: prompt tokens evaluated straight and through serve, the new tokens of the turns (the floor),
    and each returning turn through serve that evaluated more than its new tokens and one."""
    print(f"{'round':>6}{'alone':>10}{'serve':>10}{'new':>10}   turns through serve evaluating more than new + 1")
    turns = sorted({r["turn"] for r in alone["rows"]})
    for t in turns:
        xs = [r for r in alone["rows"] if r["turn"] == t]
        ys = [r for r in cached["rows"] if r["turn"] == t]
        extra = [f"c{y['conv']}:{y['prompt_n']}>{x['new_n']}(slot {y['slot']})" for x, y in zip(xs, ys)
                 if y["prompt_n"] > x["new_n"] + 1]
        print(f"{t + 1:>6}{sum(r['prompt_n'] for r in xs):>10,}{sum(r['prompt_n'] for r in ys):>10,}"
              f"{sum(r['new_n'] for r in xs):>10,}   {' '.join(extra) or '-'}")


def summary(res: dict) -> dict:
    rows = res["rows"]
    back = [r for r in rows if r["turn"] > 0]
    before = [r for r in back if not r["after_restart"]]
    after = [r for r in back if r["after_restart"]]
    return {"prompt_n_all": sum(r["prompt_n"] for r in rows),
            "prompt_n_returning": sum(r["prompt_n"] for r in back),
            "prompt_n_returning_before_restart": sum(r["prompt_n"] for r in before),
            "prompt_n_returning_after_restart": sum(r["prompt_n"] for r in after),
            "prompt_tokens_returning": sum(r["prompt_n"] + r["cache_n"] for r in back),
            "wall_s": round(res["wall"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--kill-after", type=int, default=2, help="SIGKILL and restart the server before this round")
    ap.add_argument("--predict", type=int, default=16)
    ap.add_argument("--overhead", type=int, default=40)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--s3", action="store_true")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None, help="write every request's figures to this JSON file")
    ap.add_argument("--start-repeat", type=int, default=6,
                    help="a conversation's first turn holds the sample prompt this many times (about 100 tokens "
                         "each; 6: about 600, a system prompt and a first question)")
    ap.add_argument("--only-overhead", action="store_true", help="measure serve's overhead alone (no conversations)")
    ap.add_argument("--only-cases", action="store_true", help="issue 33's cases alone (head of line, agent loop, "
                                                                 "openai SDK streams)")
    ap.add_argument("--chats", type=int, default=100, help="streamed chats through the openai SDK (--only-cases)")
    ap.add_argument("--agent-turns", type=int, default=12, help="turns of the agent loop (--only-cases)")
    ap.add_argument("--threads", type=int, default=2,
                    help="the server's -t and -tb with --only-overhead (1: no wait on a second thread that a loaded "
                         "machine has not scheduled)")
    ap.add_argument("--router", action="store_true",
                    help="serve in front of b11669's router: two models, --models-max 1, every turn a swap")
    ap.add_argument("--ttft", action="store_true",
                    help="time to first token of a returning turn after a restart, straight and through serve")
    ap.add_argument("--ttft-shape", type=int, nargs=3, default=(24, 1024, 2816), metavar=("LAYERS", "EMBD", "FF"),
                    help="--ttft's model (f32, made in code; 8 256 512: the tiny model)")
    ap.add_argument("--ttft-tokens", type=int, default=2000, help="--ttft's conversation, about this many tokens")
    ap.add_argument("--repeats", type=int, default=3, help="--ttft's repeats (a restart each)")
    a = ap.parse_args()
    if a.ttft:
        return ttft_bench(a)
    if a.router:
        return router_bench(a)
    binary = server_binary()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        tmp = Path(tmp)
        model = make_model(tmp / "bench.gguf", n_layer=a.layers, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                           n_ff=512, context_length=8192, name="slotctl-bench-serve")
        args = ["-c", "8192", "-np", "2", "-fa", "on"]
        results = {}
        if a.only_cases:
            cases(binary, model, args, tmp, a)
            return
        if a.only_overhead:
            d = tmp / "overhead"
            (d / "slots").mkdir(parents=True)
            (d / "store").mkdir()
            with LlamaServer(binary, model, args=args, slot_save_path=d / "slots", log_path=d / "server.log",
                             threads=a.threads) as srv:
                serve = Serve(srv.url, d / "slots", str(d / "store"), log=d / "serve.log")
                try:
                    ov = overhead(srv, serve, a.overhead)
                finally:
                    serve.stop()
            print_overhead(ov)
            return
        for label in ("server alone", "serve"):
            d = tmp / label.replace(" ", "-")
            (d / "slots").mkdir(parents=True)
            (d / "store").mkdir()
            srv = LlamaServer(binary, model, args=args, slot_save_path=d / "slots", log_path=d / "server.log")
            srv.start(timeout=300)
            serve = None
            try:
                if label == "serve":
                    serve = Serve(srv.url, d / "slots", str(d / "store"), log=d / "serve.log")
                results[label] = run(serve.url if serve else srv.url, srv, a, label, serve)
                if serve is not None:
                    results[label]["stats"] = serve.stats()
                    results["overhead"] = overhead(srv, serve, a.overhead)
            finally:
                if serve is not None:
                    results[label]["serve_exit"] = serve.stop()
                srv.stop()
        alone, cached = results["server alone"], results["serve"]
        same = [x["content"] == y["content"] for x, y in zip(alone["rows"], cached["rows"])]
        sa, sc = summary(alone), summary(cached)
        print(f"load average {os.getloadavg()[0]:.1f} at the end; {a.conversations} conversations x {a.turns} turns over -np 2, server SIGKILLed and restarted before "
              f"round {a.kill_after + 1}; model {a.layers} layers, n_embd 256")
        print(f"{'':44}{'server alone':>14}{'serve':>14}{'serve/alone':>14}")
        for k in sa:
            ratio = f"{sc[k] / sa[k]:.3f}" if sa[k] else "-"
            print(f"{k:44}{sa[k]:>14,}{sc[k]:>14,}{ratio:>14}")
        print(f"answers identical: {sum(same)}/{len(same)}")
        back = [(x, y) for x, y in zip(alone["rows"], cached["rows"]) if x["turn"] > 0]
        new = sum(x["new_n"] for x, _y in back)
        text_new = sum(x["text_new_n"] for x, _y in back)
        print(f"returning turns: {new:,} of their prompt tokens are not in their conversation's last slot (its "
              f"prompt and generated tokens: no cache of it spares them; {text_new:,} against the text of the "
              f"last prompt and answer); evaluated beyond those: server alone {sa['prompt_n_returning'] - new:,}, "
              f"serve {sc['prompt_n_returning'] - new:,}")
        if sa["prompt_n_returning"]:
            print(f"prompt tokens evaluated on returning turns: {1 - sc['prompt_n_returning'] / sa['prompt_n_returning']:.1%} "
                  f"fewer through serve than the server alone (goal: at least 90%); the floor lets no cache of the "
                  f"slots do better than {1 - new / sa['prompt_n_returning']:.1%} fewer here")
        breakdown(alone, cached)
        if a.out:
            Path(a.out).write_text(json.dumps({"alone": alone["rows"], "serve": cached["rows"],
                                               "stats": cached["stats"], "overhead": results["overhead"]}))
        st = cached["stats"]
        print(f"serve: {st['restores']} restores, {st['saves']} saves ({st['saves_deduplicated']} deduplicated), "
              f"{st['restore_failures']} restore failures, {st['save_failures']} save failures, exit "
              f"{cached['serve_exit']}")
        print_overhead(results["overhead"])
        if a.s3:
            two_serves(binary, model, args, tmp, a)


def overhead(srv: LlamaServer, serve: Serve, n: int) -> dict:
    """Median extra time of a request through serve that needs no restore. Two copies of one conversation: one
    sent straight to the server in one slot, one through serve (which keeps it in the other slot); each request
    extends its copy by the same few words (new tokens to tokenize and evaluate, a prefix the slot holds) and
    generates one token; straight and through serve alternately (which goes first alternating too), a pause
    between pairs, serve's save of each answer waited for outside the timed request."""
    start = conversation_start(999)
    mine = post(serve.url, "/completion", {"prompt": start, "n_predict": 1, "temperature": 0})[1]["id_slot"]
    serve.idle()
    other = 1 - mine
    post(srv.url, "/completion", {"prompt": start, "n_predict": 1, "temperature": 0, "id_slot": other})
    st0 = serve.stats()
    straight, through = [], []
    cpu0 = cpu_seconds(serve.proc.pid)
    prompt = start
    for k in range(n):
        prompt += f" Then line {k} came."
        body = {"prompt": prompt, "n_predict": 1, "temperature": 0}
        for way in ((0, 1) if k % 2 == 0 else (1, 0)):
            if way == 0:
                through.append(post(serve.url, "/completion", body)[0])
                serve.idle()
            else:
                straight.append(post(srv.url, "/completion", dict(body, id_slot=other, cache_prompt=True))[0])
        time.sleep(0.05)
    cpu = cpu_seconds(serve.proc.pid) - cpu0
    diffs = [(b - s) * 1000 for s, b in zip(straight, through)]
    return {"n": n, "median_ms": statistics.median(diffs), "straight_ms": statistics.median(straight) * 1000,
            "serve_ms": statistics.median(through) * 1000, "restores": serve.stats()["restores"] - st0["restores"],
            "by_text": serve.stats()["matched_by_text"] - st0["matched_by_text"],
            "load": os.getloadavg()[0], "cpu_ms": cpu * 1000 / n}


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_overhead(ov: dict) -> None:
    print(f"serve's overhead on requests needing no restore ({ov['n']} pairs, {ov['restores']} restores among "
          f"them, {ov['by_text']} sent by their text before their tokens were asked for, load average {ov['load']:.1f}): median {ov['median_ms']:.2f} ms (straight "
          f"{ov['straight_ms']:.2f} ms, through serve {ov['serve_ms']:.2f} ms at the median); serve's CPU time "
          f"{ov['cpu_ms']:.1f} ms a request (its save and the benchmark's polls of its counters included)")


def head_of_line(url: str, tag: str) -> float:
    """The issue's case: A (600 tokens) and B (30) running in the two slots, C (30 tokens, its prompt sharing A's
    but for its last line) sent 0.4 s later: C's seconds."""
    a_prompt = conversation_start(50, 4) + f" {tag}"
    done: dict = {}

    def send(name: str, prompt: str, n: int) -> None:
        done[name] = post(url, "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0,
                                               "ignore_eos": True})[0]

    ts = [threading.Thread(target=send, args=("A", a_prompt, 600)),
          threading.Thread(target=send, args=("B", conversation_start(51, 4) + f" {tag}", 30))]
    for t in ts:
        t.start()
    time.sleep(0.4)
    c_secs = post(url, "/completion", {"prompt": a_prompt + " And C?", "n_predict": 30, "temperature": 0,
                                       "ignore_eos": True})[0]
    for t in ts:
        t.join()
    return c_secs


def agent_loop(url: str, turns: int) -> list[int]:
    """A conversation of about 2,000 tokens, each turn sent the moment its answer came: each turn's prompt_n."""
    prompt = conversation_start(60, 20)
    out = []
    for k in range(turns):
        _s, ans = post(url, "/completion", {"prompt": prompt, "n_predict": 16, "temperature": 0})
        out.append(ans["timings"]["prompt_n"])
        prompt += ans["content"] + f" Tool result {k}: done."
    return out


def openai_chats(url: str, n: int) -> int:
    """``n`` streamed chats through the official openai SDK, each read as its iterator gives it: the answers
    with text."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    got = 0
    for i in range(n):
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Chat {i} about the {TOPICS[i % len(TOPICS)]}."}],
            max_tokens=8, temperature=0, stream=True)
        got += bool("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
    client.close()
    return got


def cases(binary, model, args, tmp: Path, a) -> None:
    """Issue 33's cases, each straight to a server started anew and through serve before another."""
    rows = {}
    for label in ("server alone", "serve"):
        d = tmp / label.replace(" ", "-")
        (d / "slots").mkdir(parents=True)
        (d / "store").mkdir()
        with LlamaServer(binary, model, args=args, slot_save_path=d / "slots", log_path=d / "server.log") as srv:
            serve = Serve(srv.url, d / "slots", str(d / "store"), log=d / "serve.log") if label == "serve" else None
            url = serve.url if serve else srv.url
            try:
                post(url, "/completion", {"prompt": "warm up", "n_predict": 4})
                hol = [head_of_line(url, f"run {k}") for k in range(3)]
                if serve:
                    serve.idle()
                loop = agent_loop(url, a.agent_turns)
                if serve:
                    serve.idle()
                    saves0 = serve.stats()["saves"]
                chats = openai_chats(url, a.chats)
                saved = None
                if serve:
                    serve.idle()
                    saved = serve.stats()["saves"] - saves0
                rows[label] = {"hol": hol, "loop": loop, "chats": chats, "saved": saved}
            finally:
                if serve:
                    serve.stop()
    al, sv = rows["server alone"], rows["serve"]
    print(f"load average {os.getloadavg()[0]:.1f} at the end (1 min), model {a.layers} layers, n_embd 256, {' '.join(args)}")
    med_a, med_s = statistics.median(al["hol"]), statistics.median(sv["hol"])
    print(f"head of line, C's seconds (3 runs): server alone {' '.join(f'{x:.2f}' for x in al['hol'])}, serve "
          f"{' '.join(f'{x:.2f}' for x in sv['hol'])}: median {med_s / med_a:.2f}x the server alone's (goal: 1.2x)")
    print(f"agent loop, prompt tokens evaluated per turn: server alone {al['loop']}, serve {sv['loop']}; returning "
          f"turns' sum {sum(al['loop'][1:])} and {sum(sv['loop'][1:])}")
    print(f"openai SDK streamed chats: {sv['chats']}/{a.chats} answered through serve, {sv['saved']} saved "
          f"(server alone answered {al['chats']})")


def two_serves(binary, model, args, tmp: Path, a) -> None:
    from seaweed import BUCKET, Seaweed, weed_binary

    weed = Seaweed(tmp / "seaweed", weed_binary())
    (tmp / "seaweed").mkdir()
    weed.start()
    env = {**weed.env(), "HOME": str(tmp / "seaweed")}
    store = f"s3://{BUCKET}/bench/"
    servers, serves = [], []
    try:
        for name in ("a", "b"):
            (tmp / name).mkdir()
            srv = LlamaServer(binary, model, args=args, slot_save_path=tmp / name, log_path=tmp / f"{name}.log")
            servers.append(srv.start(timeout=300))
            serves.append(Serve(srv.url, tmp / name, store, env=env))
        prompt = conversation_start(7)
        _s, first = post(serves[0].url, "/completion", {"prompt": prompt, "n_predict": a.predict, "temperature": 0})
        serves[0].idle()
        prompt += first["content"] + " Question 1: and then?"
        secs, second = post(serves[1].url, "/completion", {"prompt": prompt, "n_predict": a.predict,
                                                            "temperature": 0})
        _s, ref = post(servers[1].url, "/completion", {"prompt": prompt, "n_predict": a.predict, "temperature": 0,
                                                       "cache_prompt": False})
        print(f"two serve processes over one SeaweedFS bucket: the second turn behind the other serve evaluated "
              f"{second['timings']['prompt_n']} prompt tokens ({second['timings']['cache_n']} reused; the server "
              f"alone {ref['timings']['prompt_n']}), {secs * 1000:.0f} ms; answer identical: "
              f"{second['content'] == ref['content']}; restores {serves[1].stats()['restores']}")
    finally:
        for s in serves:
            s.stop()
        for srv in servers:
            srv.stop()
        weed.stop()



# -- --router: serve in front of b11669's router, every turn a swap ------------------------------------------

#: the two models of the router: (name, layers, n_embd, heads, kv heads, n_ff)
ROUTER_MODELS = (("small", 4, 256, 4, 2, 512), ("large", 12, 512, 8, 2, 1536))


def stream(url: str, body: dict, timeout: float = 600) -> dict:
    """A streamed completion: its answer's text, the last event's timings, and the seconds to its first token."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/completion", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first, content, last = None, [], {}
    for line in resp:
        if not line.startswith(b"data: "):
            continue
        ev = json.loads(line[6:])
        if first is None and ev.get("content"):
            first = time.perf_counter() - t0
        content.append(ev.get("content", ""))
        last = ev
    conn.close()
    return {"content": "".join(content), "timings": last.get("timings") or {}, "ttft": first,
            "secs": time.perf_counter() - t0}


def router_turns(url: str, a, names: list[str]) -> list[dict]:
    """``a.conversations`` conversations with each model, interleaved (the models alternate at every request:
    with --models-max 1 each is a swap), ``a.turns`` turns each."""
    convs = [(m, i) for i in range(a.conversations) for m in names]
    prompts = {c: conversation_start(c[1] + 10 * names.index(c[0]), a.start_repeat) for c in convs}
    rows = []
    for turn in range(a.turns):
        for c in convs:
            if turn:
                prompts[c] += f" Question {turn}: and what of the {TOPICS[(c[1] + turn) % len(TOPICS)]} after that?"
            ans = stream(url, {"model": c[0], "prompt": prompts[c], "n_predict": a.predict, "temperature": 0,
                               "cache_prompt": True})
            rows.append({"model": c[0], "conv": c[1], "turn": turn, "content": ans["content"], "ttft": ans["ttft"],
                         "secs": ans["secs"], "prompt_n": ans["timings"].get("prompt_n"),
                         "cache_n": ans["timings"].get("cache_n")})
            prompts[c] += ans["content"]
    return rows


def router_bench(a) -> None:
    chroot = seed_server()
    with tempfile.TemporaryDirectory(dir=a.dir or "/tmp") as tmp:      # under /tmp: the chroot sees it
        tmp = Path(tmp)
        models = tmp / "models"
        models.mkdir()
        for name, layers, embd, heads, kv, ff in ROUTER_MODELS:
            make_model(models / f"{name}.gguf", n_layer=layers, n_embd=embd, n_head=heads, n_head_kv=kv,
                       head_dim=embd // heads, n_ff=ff, context_length=8192, seed=layers,
                       name=f"slotctl-bench-{name}")
        names = [m[0] for m in ROUTER_MODELS]
        sizes = {n: (models / f"{n}.gguf").stat().st_size for n in names}
        results = {}
        for label in ("router alone", "serve"):
            d = tmp / label.replace(" ", "-")
            (d / "slots").mkdir(parents=True)
            (d / "store").mkdir()
            srv = LlamaServer(chroot, None, args=["--models-dir", models, "--models-max", "1", "-c", "8192", "-np",
                                                  "2", "-fa", "on"],
                              slot_save_path=d / "slots", log_path=d / "router.log")
            srv.start(timeout=300)
            serve = None
            try:
                if label == "serve":
                    serve = Serve(srv.url, d / "slots", str(d / "store"), log=d / "serve.log")
                t0 = time.perf_counter()
                rows = router_turns(serve.url if serve else srv.url, a, names)
                results[label] = {"rows": rows, "wall": time.perf_counter() - t0,
                                  "loads": srv.log_text().count("spawning server instance with name=")}
                if serve is not None:
                    serve.idle()
                    results[label]["stats"] = serve.stats()
            finally:
                if serve is not None:
                    results[label]["serve_exit"] = serve.stop()
                srv.stop()
        alone, cached = results["router alone"], results["serve"]
        same = [x["content"] == y["content"] for x, y in zip(alone["rows"], cached["rows"])]
        print(f"load average {os.getloadavg()[0]:.1f} at the end; llama-server b11669's router, --models-max 1, -np 2; "
              f"models {', '.join(f'{n} ({sizes[n] / 1e6:.0f} MB)' for n in names)}; {a.conversations} conversation(s) "
              f"with each x {a.turns} turns, interleaved: every request swaps models")
        print(f"the router loaded a model {alone['loads']} times alone, {cached['loads']} times behind serve")
        print(f"{'':34}{'router alone':>14}{'serve':>14}{'serve/alone':>14}")
        for name in ("all", *names):
            xs = [r for r in alone["rows"] if r["turn"] > 0 and name in ("all", r["model"])]
            ys = [r for r in cached["rows"] if r["turn"] > 0 and name in ("all", r["model"])]
            px, py = sum(r["prompt_n"] for r in xs), sum(r["prompt_n"] for r in ys)
            tx = statistics.median(r["ttft"] for r in xs) * 1000
            ty = statistics.median(r["ttft"] for r in ys) * 1000
            print(f"{'prompt tokens, returning, ' + name:34}{px:>14,}{py:>14,}{py / px if px else 0:>14.3f}")
            print(f"{'ttft median ms, returning, ' + name:34}{tx:>14.0f}{ty:>14.0f}{ty / tx if tx else 0:>14.3f}")
        back = [(x, y) for x, y in zip(alone["rows"], cached["rows"]) if x["turn"] > 0]
        px, py = sum(x["prompt_n"] for x, _ in back), sum(y["prompt_n"] for _, y in back)
        print(f"prompt tokens evaluated on returning turns: {1 - py / px:.1%} fewer through serve (goal: at least 90%)")
        print(f"answers identical: {sum(same)}/{len(same)}")
        print(f"wall: router alone {alone['wall']:.1f} s, serve {cached['wall']:.1f} s")
        st = cached["stats"]
        print(f"serve: {st['restores']} restores, {st['saves']} saves ({st['saves_deduplicated']} deduplicated), "
              f"{st['restore_failures']} restore failures, {st['save_failures']} save failures, "
              f"{st['passed_through']} passed through, exit {cached['serve_exit']}")
        if a.out:
            Path(a.out).write_text(json.dumps({"alone": alone["rows"], "serve": cached["rows"], "stats": st}))


# -- --ttft: time to first token of a returning turn after a restart -----------------------------------------

def ttft_bench(a) -> None:
    """Issue 33's figure: a conversation of about ``--ttft-tokens`` tokens, one turn answered, the server
    SIGKILLed and started again, then the returning turn (the conversation, its answer and a few new words)
    streamed: its time to first token straight to the restarted server (its RAM cache lost: a full prefill) and
    through serve (a directory store, or an ``s3://`` bucket with ``--s3``), two servers side by side, one each
    way, both killed and started again before every repeat (``--repeats``; which goes first alternates)."""
    binary = server_binary()
    layers, embd, ff = a.ttft_shape
    heads = embd // 64
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        model = make_model(tmp / "ttft.gguf", n_layer=layers, n_embd=embd, n_head=heads, n_head_kv=max(heads // 4, 1),
                           head_dim=64, n_ff=ff, context_length=32768, name="slotctl-bench-ttft")
        made = time.perf_counter() - t0
        n_ctx = 2 * max(4096, 1024 * (a.ttft_tokens * 5 // 4 // 1024 + 1))
        args = ["-c", str(n_ctx), "-np", "2", "-fa", "on"]
        weed = None
        env: dict = {}
        if a.s3:
            from seaweed import BUCKET, Seaweed, weed_binary

            weed = Seaweed(tmp / "seaweed", weed_binary())
            (tmp / "seaweed").mkdir()
            weed.start()
            env = {**weed.env(), "HOME": str(tmp / "seaweed")}
            store = f"s3://{BUCKET}/ttft/"
        else:
            (tmp / "store").mkdir()
            store = str(tmp / "store")
        servers: dict = {}
        serve = None
        try:
            for label in ("straight", "serve"):
                (tmp / label).mkdir()
                servers[label] = LlamaServer(binary, model, args=args, slot_save_path=tmp / label,
                                             log_path=tmp / f"{label}.log").start(timeout=600)
            serve = Serve(servers["serve"].url, tmp / "serve", store, env=env, log=tmp / "serve.log")
            urls = {"straight": servers["straight"].url, "serve": serve.url}
            prompt = conversation_start(70, max(1, round(a.ttft_tokens / 100)))
            n_prompt = len(tokenize(servers["straight"].url, prompt))
            first = {}
            for label in ("straight", "serve"):
                first[label] = stream(urls[label], {"prompt": prompt, "n_predict": a.predict, "temperature": 0,
                                                    "cache_prompt": True})
            serve.idle()
            if first["straight"]["content"] != first["serve"]["content"]:
                print("note: the first turn's answers differ straight and through serve")
            rows = []
            for k in range(a.repeats):
                for srv in servers.values():
                    srv.kill_and_start_again(600)
                mark = len(serve.events)
                back = prompt + first["serve"]["content"] + f" Question {k}: and what of the {TOPICS[k % len(TOPICS)]}?"
                order = ("straight", "serve") if k % 2 == 0 else ("serve", "straight")
                got = {}
                for label in order:
                    load = os.getloadavg()[0]
                    sent = time.perf_counter()
                    r = stream(urls[label], {"prompt": back, "n_predict": a.predict, "temperature": 0,
                                             "cache_prompt": True})
                    got[label] = {"ttft": r["ttft"], "prompt_n": r["timings"].get("prompt_n"),
                                  "cache_n": r["timings"].get("cache_n"), "content": r["content"], "load": load,
                                  "sent": sent}
                serve.idle()
                evs = [e for e in serve.events[mark:] if e["event"] in ("restored", "prefill", "outcome")]
                got["events"] = [{"event": e["event"], **{x: e["details"].get(x) for x in
                                                         ("chose", "predicted_ms", "measured_ms", "prediction")
                                                         if x in e["details"]}} for e in evs]
                got["all_events"] = [dict(e, received=e["received"] - got["serve"]["sent"]) for e in serve.events[mark:]]
                rows.append(got)
                s, v = got["straight"], got["serve"]
                named = [e["event"] for e in got["events"]]
                # no prediction (nothing measured yet): the token rule restored; no event: nothing looked up
                chose = next((e["chose"] for e in got["events"] if e["event"] == "outcome"),
                             "restore by the token rule" if "restored" in named else "prefill, nothing looked up")
                print(f"repeat {k + 1}: straight {s['ttft'] * 1000:,.0f} ms ({s['prompt_n']} tokens, load "
                      f"{s['load']:.1f}), serve {v['ttft'] * 1000:,.0f} ms ({v['prompt_n']} tokens, load "
                      f"{v['load']:.1f}, chose {chose}), {v['ttft'] / s['ttft']:.3f}x; answers identical: "
                      f"{s['content'] == v['content']}", flush=True)
            st = serve.stats()
            costs = serve_costs(serve)
        finally:
            if serve is not None:
                serve.stop()
            for srv in servers.values():
                srv.stop()
            if weed is not None:
                weed.stop()
        ms = {w: statistics.median(r[w]["ttft"] for r in rows) * 1000 for w in ("straight", "serve")}
        loads = [r[w]["load"] for r in rows for w in ("straight", "serve")]
        size = model.stat().st_size
        print(f"model {layers} layers, n_embd {embd}, n_ff {ff}, {heads} heads ({max(heads // 4, 1)} kv), f32, "
              f"{size / 1e9:.2f} GB (made in {made:.0f} s); llama-server b11434 {' '.join(args)} -t 2; store "
              f"{'s3 (SeaweedFS)' if a.s3 else 'a directory'}; the returning turn: {n_prompt:,} tokens of "
              f"conversation, its answer ({a.predict} tokens) and a few words; {a.repeats} repeats, load average "
              f"{min(loads):.1f}-{max(loads):.1f}")
        print(f"time to first token, median: straight {ms['straight']:,.0f} ms, serve {ms['serve']:,.0f} ms: "
              f"{ms['serve'] / ms['straight']:.3f}x the server alone's (goal: {'at most 1' if a.s3 else 'at most 0.25'})")
        print(f"serve: {st['restores']} restores, {st['saves']} saves, {st['restore_failures']} restore failures; "
              f"costs known {json.dumps(costs)}")
        if a.out:
            Path(a.out).write_text(json.dumps({"first": first, "rows": rows, "stats": st}, default=str))


def serve_costs(serve: Serve) -> dict | None:
    try:
        with urllib.request.urlopen(serve.url + "/slotctl/stats", timeout=30) as r:
            return json.loads(r.read()).get("costs")
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    main()
