"""slotctl behind llama-server b11669's router with real model swaps (issue 34): two models of different sizes in
one ``--models-dir``, ``--models-max 1`` (a request for one model unloads the other). The fleet view (``slots
--config``) shows the router's models, loaded or not, with what the store holds for each; keep keeps a model's
slots across swaps (``--router-model``, and a configuration file naming several models of one router); serve
fronts the whole router (docs/serve.md, "In front of llama-server's router")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import start_server

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[1]

#: the two models: the tiny target and a larger model of other shapes (4 layers, n_embd 256)
SMALL, BIG = "small", "big"
PROMPT = ("Conversation about the river. The city of Paris lies on the Seine, which runs from east to west "
          "through its heart; its bridges are old and its quays are lined with booksellers.")


@pytest.fixture(scope="module")
def router_models(tmp_path_factory) -> Path:
    """A ``--models-dir`` with the two models (under /tmp: the chroot sees it)."""
    from slotctl.tinymodels.llama import make_model

    d = tmp_path_factory.mktemp("router-models")
    make_model(d / f"{SMALL}.gguf", n_layer=2, seed=1)
    make_model(d / f"{BIG}.gguf", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, seed=3)
    return d


class Router:
    """llama-server b11669 as a router over ``models`` (``--models-max 1``, ``-np 2``), its slot directory and a
    store beside it."""

    def __init__(self, chroot, models: Path, tmp: Path, *, models_max: int = 1, args: tuple = ()):
        self.slots, self.store = tmp / "slots", tmp / "store"
        self.slots.mkdir()
        self.store.mkdir()
        self.srv = start_server(chroot, None, tmp, "router", slot_save_path=self.slots,
                                args=("--models-dir", models, "--models-max", str(models_max), "-c", "1024", "-np",
                                      "2", *args))
        self.url = self.srv.url

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        return call(self.url, method, path, body)

    def status(self) -> dict[str, str]:
        """Each model's status, as the router lists it."""
        _, answer = self.call("GET", "/v1/models")
        return {m["id"]: m["status"]["value"] for m in answer["data"]}

    def completion(self, url: str, model: str, prompt: str, slot: int | None = None, n_predict: int = 6) -> dict:
        body = {"model": model, "prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": True}
        if slot is not None:
            body["id_slot"] = slot
        data = json.dumps(body).encode()
        req = urllib.request.Request(url + "/completion", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=300) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        self.srv.stop()     # its process group: the models' servers with it


@pytest.fixture
def router(llama_server_b11669, router_models, tmp_path):
    r = Router(llama_server_b11669, router_models, tmp_path)
    yield r
    r.stop()


def call(url: str, method: str, path: str, body: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def slotctl(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "slotctl", *args], capture_output=True, text=True, timeout=300,
                          env=env)


# -- the fleet view ------------------------------------------------------------------------------------


def test_the_fleet_view_shows_every_model_of_the_router_with_what_the_store_holds(router, tmp_path):
    """slots --config over a real b11669 router (--models-max 1): the router's entry without a model is one
    document per model, the loaded one with its slots, the unloaded one with the states the store holds for it
    (named as its server names them: its GGUF read here), not judged and not loaded by the look; an entry naming a
    model is that model's alone, two entries of one router naming two models are read side by side."""
    config = tmp_path / "fleet.toml"
    config.write_text(f'[[servers]]\nname = "r"\nurl = "{router.url}"\nslot_dir = "{router.slots}"\n'
                      f'store = "{router.store}"\n'
                      f'[[servers]]\nname = "r-small"\nurl = "{router.url}"\nmodel = "{SMALL}"\nstore = "{router.store}"\n'
                      f'[[servers]]\nname = "r-big"\nurl = "{router.url}"\nmodel = "{BIG}"\nstore = "{router.store}"\n')
    router.completion(router.url, SMALL, PROMPT, slot=1)
    r = slotctl("keep", "--config", str(config), "--server", "r-small", "--slot-dir", str(router.slots), "--save-all",
                "--json", "--timeout", "60")
    assert r.returncode == 0, r
    stored = [json.loads(x) for x in r.stdout.splitlines() if json.loads(x)["event"] == "stored"]
    assert [e["slot"] for e in stored] == [1], r.stdout
    router.completion(router.url, BIG, PROMPT, slot=0)     # the swap: small is unloaded for big
    assert router.status() == {SMALL: "unloaded", BIG: "loaded"}

    r = slotctl("slots", "--config", str(config), "--json")
    assert r.returncode == 0, r
    docs = json.loads(r.stdout)["servers"]
    assert [(d["name"], d["router_model"], d["status"]) for d in docs] == [
        ("r", BIG, "loaded"), ("r", SMALL, "unloaded"), ("r-small", SMALL, "unloaded"), ("r-big", BIG, "loaded")], docs
    big, small = docs[0], docs[1]
    assert big["total_slots"] == 2 and [s["slot"] for s in big["slots"]] == [0, 1], big
    assert big["slots"][0]["n_tokens"] > 0 and big["slots"][0]["stored_states"] == 0, big
    assert small["model"].endswith(f"{SMALL}.gguf") and small["total_slots"] is None, small
    (row,) = small["slots"]
    assert (row["slot"], row["stored_states"]) == (1, 1), row
    (state,) = row["states"]
    assert state["name"] == stored[0]["details"]["name"] and state["verdict"] == "not_judged", state
    assert state["n_tokens"] == stored[0]["details"]["n_tokens"] and row["best"] is None, state
    assert docs[2]["slots"] == small["slots"] and docs[3]["slots"] == big["slots"]
    assert router.status() == {SMALL: "unloaded", BIG: "loaded"}      # no look loaded a model

    r = slotctl("slots", "--config", str(config))     # the table: the model's name and its status
    assert r.returncode == 0, r
    assert f"server: r  model: {SMALL}  slot: 1  tokens: -  state: unloaded" in r.stdout, r.stdout

    # loaded again (a request for it), small's slots are read through the router and its state judged
    router.completion(router.url, SMALL, "Another conversation entirely.", slot=0)
    r = slotctl("slots", "--config", str(config), "--json")
    docs = json.loads(r.stdout)["servers"]
    small = next(d for d in docs if d["name"] == "r-small")
    assert small["status"] == "loaded" and small["slots"][1]["states"][0]["verdict"] == "restores", small
    assert small["slots"][1]["best"]["name"] == stored[0]["details"]["name"], small


# -- serve in front of the router ----------------------------------------------------------------------


def tokenize(r: Router, model: str, text: str) -> list[int]:
    status, answer = r.call("POST", "/tokenize?autoload=false", {"model": model, "content": text, "add_special": True,
                                                                  "parse_special": True})
    assert status == 200, answer
    return answer["tokens"]


def common(a: list[int], b: list[int]) -> int:
    """The tokens two token lists share from their start."""
    return len(os.path.commonprefix([a, b]))


def loads(r: Router) -> list[str]:
    """The models the router started a server for, in order (its log's "spawning server instance" lines)."""
    import re

    return re.findall(r"spawning server instance with name=(\S+) on port", r.srv.log_text())


def converse(url: str, r: Router, turns: int, *, measure: bool = False) -> list[dict]:
    """Two conversations, one with each model, interleaved turn by turn (small, big, small, ...: with
    --models-max 1 every turn swaps), each turn its conversation so far, its last answer and a new question.
    ``measure``: each turn's new tokens (its tokens past what its conversation's last slot held: the last prompt
    and the tokens generated for it), tokenized by the model itself once its turn is done (never loading it)."""
    prompts = {SMALL: f"{PROMPT} Now, about the river:", BIG: f"{PROMPT} Now, about the bridges:"}
    held: dict[str, list[int]] = {}
    rows = []
    for turn in range(turns):
        for model in (SMALL, BIG):
            if turn:
                prompts[model] += f" Question {turn}: and what came after that?"
            ans = r.completion(url, model, prompts[model], n_predict=6)
            ans = dict(ans, model=model, turn=turn)
            if measure:
                now = tokenize(r, model, prompts[model])
                ans["n_prompt"] = len(now)
                ans["new"] = len(now) - common(held.get(model, []), now)
                held[model] = now + list(ans["tokens"])
            rows.append(ans)
            prompts[model] += ans["content"]
    return rows


@pytest.fixture
def alone(llama_server_b11669, router_models, tmp_path):
    d = tmp_path / "alone"
    d.mkdir()
    r = Router(llama_server_b11669, router_models, d)
    yield r
    r.stop()


def test_serve_in_front_of_a_router_restores_each_model_after_every_swap(router, alone):
    """One serve for the whole router (--models-max 1), two conversations, one per model, interleaved so that
    every turn swaps: each returning turn is restored into its model's fresh server from the store and evaluates
    only its new tokens (the router's own timings), where the router alone evaluates the whole prompt again; every
    answer is the router alone's; the router loaded exactly the models the router alone loaded, in the same order
    (serve had it load each one for the request that would have loaded it, never one on its own)."""
    from serving import Serve

    # --restore-policy tokens: on these tiny models the prefill of a returning turn costs less than its restore,
    # and the default policy (cost) rightly prefills; the restore after each swap is what is tested here
    serve = Serve(router.url, router.slots, str(router.store), "--restore-policy", "tokens")
    try:
        via = converse(serve.url, router, 3, measure=True)
        serve.wait_for("saves", len(via))
        ref = converse(alone.url, alone, 3)
        stats = serve.stats()
    finally:
        assert serve.proc.poll() is None, serve.stderr
        serve.proc.terminate()
        serve.proc.wait(60)
    assert [a["content"] for a in via] == [b["content"] for b in ref]
    assert loads(router) == loads(alone) == [SMALL, BIG] * 3
    for a, b in zip(via, ref):
        if a["turn"] == 0:
            continue
        # the router alone evaluates the whole prompt again (the model's server is a fresh one); through serve, the
        # new tokens only (and the last token again, for its logits, when the restored state holds them all)
        assert b["timings"]["prompt_n"] == a["n_prompt"], (b["timings"], a["n_prompt"])
        assert a["timings"]["prompt_n"] <= a["new"] + 1, (a["model"], a["turn"], a["timings"], a["new"],
                                                          serve.output())
        assert a["timings"]["cache_n"] >= a["n_prompt"] - a["new"] - 1, (a["timings"], a["new"])
    assert stats["restores"] == 4 and stats["saves"] == len(via) and stats["save_failures"] == 0, stats
    assert stats["restore_failures"] == 0 and stats["passed_through"] == 0, stats


def stream_until_first_token(url: str, body: dict):
    """A streamed completion begun (its first event read): (its connection, its response)."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("POST", "/completion", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    while not resp.readline().startswith(b"data: "):
        pass
    return conn, resp


def test_a_swap_waits_for_the_save_of_the_answer_it_would_unload(router, alone):
    """While a long answer of the small model streams through serve, a request for the big model comes: the router
    (--models-max 1) would unload the small model as soon as its request ends, before serve's save of its slot
    reaches it; serve holds the big model's request until that save is made (the router itself holds it until the
    small model's request ends). The small model's slot is stored whole, no save fails, and the big model's answer
    is the router alone's."""
    import threading

    from serving import Serve

    serve = Serve(router.url, router.slots, str(router.store))
    try:
        first = {"model": SMALL, "prompt": PROMPT, "n_predict": 160, "temperature": 0, "cache_prompt": True}
        conn, resp = stream_until_first_token(serve.url, first)
        got: dict = {}
        big = threading.Thread(target=lambda: got.update(router.completion(serve.url, BIG, PROMPT)))
        big.start()
        resp.read()             # the rest of the small model's answer
        conn.close()
        big.join(300)
        assert got, "the big model's request did not end"
        stats = serve.wait_for("saves", 2)
        ref = router.completion(alone.url, BIG, PROMPT)
    finally:
        serve.proc.terminate()
        serve.proc.wait(60)
    assert got["content"] == ref["content"]
    assert stats["saves"] == 2 and stats["save_failures"] == 0 and stats["passed_through"] == 0, stats
    n_prompt = len(tokenize(alone, BIG, PROMPT))        # the same vocabulary: the small model's prompt tokens too
    stored = serve.events_named("stored", 2)
    small = next(e for e in stored if e["details"]["router_model"] == SMALL)
    assert small["details"]["n_tokens"] == n_prompt + 160 - 1, small
    assert loads(router) == [SMALL, BIG]


def test_serve_loads_no_model_the_router_would_not_load_for_the_request(llama_server_b11669, router_models, tmp_path):
    """A router started with --no-models-autoload: a request for a model not loaded passes through serve as it
    came and gets the router's own answer (HTTP 400, not loaded), the model still unloaded; a chat request whose
    own query says autoload=true has the router load it (serve has it loaded first, with the request's autoload,
    and caches the request); a request for the other model without it passes through, and nothing else is ever
    loaded: the router started one server, the one the request asked for."""
    from serving import Serve

    r = Router(llama_server_b11669, router_models, tmp_path, args=("--no-models-autoload",))
    serve = Serve(r.url, r.slots, str(r.store))
    try:
        body = {"model": SMALL, "prompt": PROMPT, "n_predict": 4, "temperature": 0}
        assert call(serve.url, "POST", "/completion", body) == call(r.url, "POST", "/completion", body)
        status, answer = call(serve.url, "POST", "/completion", body)
        assert (status, answer["error"]["message"]) == (400, "model is not loaded"), answer
        assert r.status() == {SMALL: "unloaded", BIG: "unloaded"}

        chat = {"model": SMALL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0}
        status, first = call(serve.url, "POST", "/v1/chat/completions?autoload=true", chat)
        assert status == 200 and first["model"] == SMALL, first
        assert r.status() == {SMALL: "loaded", BIG: "unloaded"}
        status, answer = call(serve.url, "POST", "/completion", dict(body, model=BIG))
        assert (status, answer["error"]["message"]) == (400, "model is not loaded"), answer
        chat["messages"] += [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        status, second = call(serve.url, "POST", "/v1/chat/completions?autoload=true", chat)
        assert status == 200, second
        assert second["usage"]["prompt_tokens"] - second["timings"]["prompt_n"] >= first["usage"]["prompt_tokens"], \
            (first["usage"], second["timings"])      # the slot kept the first turn
        stats = serve.wait_for("saves", 2)
    finally:
        serve.proc.terminate()
        serve.proc.wait(60)
        r.stop()
    assert loads(r) == [SMALL]
    assert (stats["cached"], stats["passed_through"], stats["saves"]) == (2, 3, 2), stats


# -- keep ----------------------------------------------------------------------------------------------


def test_keep_keeps_each_model_of_a_router_across_real_swaps(router, tmp_path):
    """Two keepers from one configuration file whose two entries name the two models of one b11669 router
    (--models-max 1; the entries' names given as --server): each stores its model's slot while it is loaded,
    sees it go when a request for the other model swaps it out (down: never loaded by keep), and, once a request
    for it has the router load it again, restores the slot into the fresh server, proven by the server's own
    counts; slots --config lists both models the while."""
    from types import SimpleNamespace

    from keeping import Keep

    config = tmp_path / "keep.toml"
    config.write_text("".join(f'[[servers]]\nname = "{m}"\nurl = "{router.url}"\nmodel = "{m}"\nslot_dir = '
                              f'"{router.slots}"\nstore = "{router.store}"\n' for m in (SMALL, BIG)))
    keeps = {}
    try:
        for m in (SMALL, BIG):
            keeps[m] = Keep(SimpleNamespace(url=m, save_dir=router.slots), router.store, "--config", str(config),
                            "--every", "0.3")
        for m in (SMALL, BIG):
            assert "is not loaded" in keeps[m].wait_for("down")["message"]
        router.completion(router.url, SMALL, PROMPT, slot=1)
        stored = {SMALL: keeps[SMALL].wait_for("stored", 1)["details"]}
        router.completion(router.url, BIG, PROMPT, slot=0)          # the swap: small goes
        keeps[SMALL].wait_for("down")
        stored[BIG] = keeps[BIG].wait_for("stored", 0)["details"]
        r = slotctl("slots", "--config", str(config), "--json")
        assert [(d["router_model"], d["status"]) for d in json.loads(r.stdout)["servers"]] == [
            (SMALL, "unloaded"), (BIG, "loaded")], r.stdout

        for m, other, slot in ((SMALL, BIG, 1), (BIG, SMALL, 0)):
            router.completion(router.url, m, "Another conversation, in the other slot.", slot=1 - slot)
            keeps[other].wait_for("down")
            restored = keeps[m].wait_for("restored", slot)["details"]
            assert restored["name"] == stored[m]["name"], keeps[m].seen
            proof = keeps[m].wait_for("proof", slot)["details"]["proof"]
            assert (proof["verdict"], proof["n_reused"]) == ("proven", stored[m]["n_tokens"] - 1), proof
        assert loads(router) == [SMALL, BIG, SMALL, BIG]      # the requests' loads, none of keep's
    finally:
        for k in keeps.values():
            assert k.stop() == 0, k.seen
