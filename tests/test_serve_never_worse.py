"""``slotctl serve`` is never worse than the server alone (issue 33): a request waits for the first slot that
frees, an agent's next turn keeps its slot, a slot the server no longer has leaves serve's view, an answer the
server completed is saved however the client closed (the real ``openai`` SDK), serve's 502 bodies are its own
words, and each request's outcome is a metric (parsed with prometheus_client's parser).

Real llama-server b11434 processes with the tiny model; serve as a process of its own; every count of evaluated
prompt tokens is the server's own ``timings``.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from llama_server import free_port
from slotctl.tinymodels import SAMPLE_PROMPT
from keeping import samples, scrape
from serving import TURN1, TURN2_EXTRA, call, complete, serving, stream_begun

server = pytest.mark.server


def stats(url: str) -> dict:
    status, _h, raw = call(url, "GET", "/slotctl/stats")
    assert status == 200, raw
    return json.loads(raw)


def read_to_the_last_event(sock, got: bytes) -> bytes:
    """A /completion stream read on until its last event (``"stop": true``)."""
    while b'"stop":true' not in got.replace(b" ", b""):
        more = sock.recv(1 << 16)
        assert more, got[-300:]
        got += more
    return got


@server
def test_a_request_waits_for_the_first_slot_that_frees(fresh, tmp_path):
    """The issue's head-of-line case: with both slots busy (their clients read nothing yet: the server's answers
    wait in the sockets' buffers), a request whose prompt shares the most with slot A's goes to the slot that
    frees first (B's, once B's client reads its answer), as the server alone gives it, while A is still held.
    Before, serve pinned it to A's slot and it waited on that slot's lock until A ended."""
    big = {"n_predict": 2000, "temperature": 0, "stream": True, "ignore_eos": True, "n_probs": 200}
    with serving(fresh, fresh.save_dir, str(tmp_path)) as s:
        a_slot = complete(s.url, TURN1)["id_slot"]           # slot A holds TURN1
        s.wait_for("saves", 1)
        a_sock, _ = stream_begun(s.port, {"prompt": TURN1 + " Again.", **big})
        b_sock, b_got = stream_begun(s.port, {"prompt": "A different story: " + SAMPLE_PROMPT, **big})
        try:
            c: dict = {}
            r0 = stats(s.url)["counters"]["requests"]
            asked = threading.Thread(target=lambda: c.update(complete(s.url, TURN1 + " And so on.")))
            asked.start()
            polls = 1
            while stats(s.url)["counters"]["requests"] < r0 + polls + 1:    # each look counts itself too
                polls += 1
            read_to_the_last_event(b_sock, b_got)
            asked.join(120)
            assert not asked.is_alive(), "C waited for A's slot while B's freed: " + s.output()
            assert c["id_slot"] != a_slot
            st = stats(s.url)["counters"]
            assert st["client_disconnects"] == 0 and st["cached"] == 4     # A still at work
        finally:
            a_sock.close()
            b_sock.close()


@server
def test_an_agents_next_turn_sent_at_once_keeps_its_slot(fresh, tmp_path):
    """An agent loop: each turn sent the moment its answer came, while serve saves the slot. The turn waits for
    its own slot's save (a moment) and the server evaluates only the new tokens, as it would alone; before, the
    slot being saved counted as busy and the turn went to the other slot (every token evaluated again)."""
    with serving(fresh, fresh.save_dir, str(tmp_path)) as s:
        prompt = TURN1
        answer = complete(s.url, prompt)
        first_slot, turns = answer["id_slot"], []
        for i in range(6):
            prompt = prompt + answer["content"] + f" Then step {i} came."
            answer = complete(s.url, prompt)
            turns.append(answer)
        assert [t["id_slot"] for t in turns] == [first_slot] * 6, s.output()
        # the server's own count: every turn reused what its slot held (its prompt but the new words)
        assert all(t["timings"]["prompt_n"] < 32 and t["timings"]["cache_n"] > 150 for t in turns), \
            [t["timings"] for t in turns]


@server
def test_a_slot_the_server_no_longer_has_leaves_the_view(fresh, tmp_path):
    """The server restarted with fewer slots (-np 3 to -np 2): serve's view holds slots 0 and 1 only (the
    server would take a request for id 2 as slot 0's: two of serve's holds on one slot), and requests go on."""
    fresh.args = ["-c", "1536", "-np", "3", "-fa", "on"]
    fresh.kill_and_start_again()
    with serving(fresh, fresh.save_dir, str(tmp_path)) as s:
        for i in range(3):
            complete(s.url, f"{SAMPLE_PROMPT} {i}", id_slot=i)
        assert stats(s.url)["slots"] == [0, 1, 2]
        fresh.args = ["-c", "1024", "-np", "2", "-fa", "on"]
        fresh.kill_and_start_again()
        results: dict = {}

        def run(i: int) -> None:
            results[i] = complete(s.url, f"Tale {i}: {SAMPLE_PROMPT}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [0, 1, 2] and {r["id_slot"] for r in results.values()} <= {0, 1}
        assert stats(s.url)["slots"] == [0, 1], s.output()


@server
def test_streamed_chats_of_the_openai_sdk_are_all_saved(fresh, tmp_path):
    """The official ``openai`` SDK's stream iterator closes the connection right after ``data: [DONE]``,
    before the chunked body's end: the server completed the answer all the same, so serve saves it (before:
    counted as a client that went away, 1 of 20 not saved)."""
    from openai import OpenAI

    n = 20
    with serving(fresh, fresh.save_dir, str(tmp_path)) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        texts = []
        for i in range(n):
            stream = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Story {i}. {SAMPLE_PROMPT}"}], max_tokens=8,
                temperature=0, stream=True)
            texts.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
        client.close()
        c = s.wait_for("saves", n)
        assert c["saves"] == n and c["save_failures"] == 0, s.output()
        assert c["client_disconnects"] == 0
        assert all(texts)


@server
def test_a_502_says_why_in_serves_own_words(tmp_path):
    class Down:
        url = f"http://127.0.0.1:{free_port()}"

    with serving(Down, tmp_path) as s:
        status, _h, raw = call(s.url, "POST", "/completion", {"prompt": "x"})
        message = json.loads(raw)["error"]["message"]
        assert status == 502 and message.startswith("slotctl serve: ") and "connection refused" in message
        for internal in ("ssl:default", "Connect call failed", "Cannot connect to host", "Errno"):
            assert internal not in message, message
        assert all(internal not in json.dumps(e) for e in s.events for internal in ("ssl:default", "Errno"))


@server
def test_each_requests_outcome_and_serves_time_are_metrics(fresh, tmp_path):
    """/metrics, parsed by prometheus_client's parser (each family of its declared type): a request per outcome
    (cold, then slot_hit; a restore after a restart), the save and added-time-to-first-token histograms
    observed once per request, and a restore's."""
    port = free_port()
    store = tmp_path / "store"
    store.mkdir()
    with serving(fresh, fresh.save_dir, str(store), "--metrics-listen", f"127.0.0.1:{port}",
                 "--restore-policy", "tokens") as s:
        base = f"http://127.0.0.1:{port}"
        first = complete(s.url, TURN1)
        s.wait_for("saves", 1)
        second = complete(s.url, TURN1 + first["content"] + TURN2_EXTRA)
        s.wait_for("saves", 2)
        fresh.kill_and_start_again()
        complete(s.url, TURN1 + first["content"] + TURN2_EXTRA + second["content"] + " The end.")
        s.wait_for("saves", 3)
        ss = samples(scrape(base)[2], "slotctl_serve_")
        srv = s.events_named("listening")[0]["details"]["upstream"]

        def v(name: str, **labels) -> float:
            return ss.get((name, tuple(sorted({"server": srv, **labels}.items()))), 0.0)

        assert v("slotctl_serve_request_outcomes_total", outcome="cold") == 1
        assert v("slotctl_serve_request_outcomes_total", outcome="slot_hit") == 1
        assert v("slotctl_serve_request_outcomes_total", outcome="restored") == 1, s.output()
        assert v("slotctl_serve_added_time_to_first_token_seconds_count") == 3
        assert v("slotctl_serve_save_seconds_count") == 3
        assert v("slotctl_serve_restore_seconds_count") == 1
        assert v("slotctl_serve_cache_available") == 1


def test_an_s3_store_from_the_configuration_without_the_s3_extra_is_one_line(tmp_path):
    """An ``s3://`` store named by ``--config`` on an install without obstore (the ``[s3]`` extra): one line and
    exit 2, as for ``--store`` (before: "internal error: ModuleNotFoundError obstore")."""
    import subprocess
    import sys

    (tmp_path / "slots").mkdir()
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'[[servers]]\nurl = "http://127.0.0.1:{free_port()}"\nslot_dir = "{tmp_path / "slots"}"\n'
                   f'store = "s3://bucket/prefix/"\n')
    without = ("import sys; sys.modules['obstore'] = None; sys.argv = ['slotctl'] + sys.argv[1:]; "
               "from slotctl.cli.app import main; main()")
    r = subprocess.run([sys.executable, "-c", without, "serve", "--config", str(cfg), "--listen", "127.0.0.1:0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r
    assert "slotctl[s3]" in r.stderr and "internal error" not in r.stderr, r.stderr


@server
def test_the_llm_cli_through_serve_is_answered_and_saved(fresh, tmp_path):
    """The ``llm`` CLI (its OpenAI-compatible models, streamed) as a client of serve: each prompt answered, each
    answer's slot saved (llm's client, the openai SDK, closes after ``data: [DONE]``)."""
    import shutil
    import subprocess

    binary = shutil.which("llm")
    assert binary, "the llm CLI (the [test] extra) is missing"
    (tmp_path / "store").mkdir()
    with serving(fresh, fresh.save_dir, str(tmp_path / "store")) as s:
        home = tmp_path / "llm"
        home.mkdir()
        (home / "extra-openai-models.yaml").write_text(
            f'- model_id: tiny\n  model_name: tiny\n  api_base: "{s.url}/v1"\n')
        env = {**os.environ, "LLM_USER_PATH": str(home), "OPENAI_API_KEY": "unused"}
        for i in range(3):
            r = subprocess.run([binary, "-m", "tiny", "-o", "max_tokens", "8", "-o", "temperature", "0",
                                f"Story {i}. {SAMPLE_PROMPT}"], capture_output=True, text=True, timeout=120, env=env)
            assert r.returncode == 0 and r.stdout.strip(), r
        c = s.wait_for("saves", 3)
        assert c["saves"] == 3 and c["client_disconnects"] == 0, s.output()
