"""Live mode against hostile servers: a few lines of ``http.server`` on 127.0.0.1 per case (docs/live.md).

Each server answers every request with what its case scripts; a second server records whatever reaches it
(where a redirect points). Commands run through the CLI in this process.
"""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from scripted import GOOD_PROPS, GOOD_SLOTS, HOSTILE, by_path, drip_body, one_error_line
from slotctl.cli.app import app

runner = CliRunner()


# -- redirects ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_redirects_are_reported_not_followed_and_the_key_stays(serve, status):
    elsewhere, seen_there = serve(by_path({"/props": (200, GOOD_PROPS), "/slots/0": (200, {
        "id_slot": 0, "filename": "x.bin", "n_saved": 1, "n_written": 1, "timings": {"save_ms": 1}})}))

    def redirect(h):
        h.send_response(status)
        h.send_header("Location", elsewhere + h.path)
        h.send_header("Content-Length", "0")
        h.end_headers()

    url, _ = serve(redirect)
    for args in (["save", "--server", url, "--slot", "0", "x.bin", "--api-key", "SECRET"],
                 ["slots", "--server", url, "--api-key", "SECRET"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, res.output
        line = one_error_line(res)
        assert f"answered HTTP {status}, a redirect to {elsewhere}" in line and "which is not followed" in line
    assert seen_there.seen == []   # nothing, and no key, went where the redirect pointed


# -- the timeout bounds the whole request --------------------------------------------------------------------


def drip_headers(h):
    """The status line and headers one byte every 0.2 s."""
    for b in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Padding: " + b"a" * 1000:
        h.wfile.write(bytes([b]))
        h.wfile.flush()
        time.sleep(0.2)


@pytest.mark.parametrize("drip", [drip_body, drip_headers], ids=["body", "headers"])
def test_a_dripping_server_is_cut_off_at_the_timeout(serve, drip):
    url, _ = serve(drip)
    for args in (["slots", "--server", url, "--timeout", "1"],
                 ["save", "--server", url, "--slot", "0", "x.bin", "--timeout", "1"]):
        t0 = time.monotonic()
        res = runner.invoke(app, args)
        elapsed = time.monotonic() - t0
        assert res.exit_code == 2, res.output
        assert "no answer within 1 s" in one_error_line(res)
        # 1 s and the command's own work, not 0.2 s per byte (120 s or more): the bound leaves a loaded machine room
        assert elapsed < 30, elapsed


# -- answers of the wrong shape ----------------------------------------------------------------------------


@pytest.mark.parametrize("props,said", [
    (None, "the answer should be an object, got null"),
    ([], "the answer should be an object, got []"),
    ({}, "total_slots is missing"),
    ({"total_slots": "2"}, 'total_slots should be a number of slots, 1 to 256, got "2"'),
    ({"total_slots": 0}, "total_slots should be a number of slots, 1 to 256, got 0"),
    ({"total_slots": 2, "model_path": 7}, "model_path should be a string, got 7"),
])
def test_props_of_the_wrong_shape(serve, props, said):
    url, script = serve(by_path({"/props": (200, props), "/slots": (200, GOOD_SLOTS)}))
    res = runner.invoke(app, ["save", "--server", url, "--slot", "5", "x.bin"])
    assert res.exit_code == 2
    line = one_error_line(res)
    assert f"GET {url}/props: unexpected answer: {said}" in line
    assert not any(m == "POST" for m, _, _ in script.seen)   # the slot action was never sent


@pytest.mark.parametrize("action,answer,said", [
    ("save", {}, "id_slot is missing"),
    ("save", {"id_slot": 0, "filename": "x.bin", "n_saved": "many", "n_written": 10}, 'n_saved should be a count'),
    ("save", {"id_slot": 1, "filename": "x.bin", "n_saved": 3, "n_written": 10}, "id_slot should be 0, got 1"),
    ("save", {"id_slot": 0, "filename": "y.bin", "n_saved": 3, "n_written": 10}, 'filename should be "x.bin"'),
    ("save", None, "the answer should be an object, got null"),
    ("restore", [], "the answer should be an object, got []"),
    ("restore", {"id_slot": 0, "filename": "x.bin", "n_restored": -1, "n_read": 1}, "n_restored should be a count"),
    ("erase", {"id_slot": 0, "n_erased": True}, "n_erased should be a count"),
])
def test_slot_action_answers_of_the_wrong_shape(serve, action, answer, said):
    url, _ = serve(by_path({"/props": (200, GOOD_PROPS), "/slots/0": (200, answer)}))
    args = {"save": ["save", "--server", url, "--slot", "0", "x.bin"],
            "restore": ["restore", "--server", url, "--slot", "0", "x.bin"],
            "erase": ["erase", "--server", url, "--slot", "0"]}[action]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert f"unexpected answer: {said}" in one_error_line(res)
    assert "saved" not in res.stdout and "restored" not in res.stdout


@pytest.mark.parametrize("slots,said", [
    (None, "should be a list of one object per slot, got null"),
    ({}, "should be a list of one object per slot, got {}"),
    ([], "should be a list of one object per slot, got []"),
    ([{"id": "zero"}], '[0].id should be a count (an integer >= 0), got "zero"'),
    ([{"id": 0, "is_processing": "no"}], '[0].is_processing should be true or false, got "no"'),
])
def test_slots_of_the_wrong_shape(serve, slots, said):
    url, _ = serve(by_path({"/props": (200, GOOD_PROPS), "/slots": (200, slots)}))
    res = runner.invoke(app, ["slots", "--server", url])
    assert res.exit_code == 2
    assert f"GET {url}/slots: unexpected answer: {said}" in one_error_line(res)


# -- server text reaches the terminal escaped -----------------------------------------------------------------


def test_error_message_from_the_server_is_escaped(serve):
    url, _ = serve(by_path({"/props": (200, GOOD_PROPS),
                            "/slots/0": (500, {"error": {"code": 500, "message": HOSTILE, "type": "server_error"}})}))
    res = runner.invoke(app, ["save", "--server", url, "--slot", "0", "x.bin"])
    assert res.exit_code == 1
    line = one_error_line(res)
    assert "\x1b" not in res.stderr and "\x07" not in res.stderr and "\r" not in res.stderr
    assert "boom\\x1b[2J\\x1b]0;pwned\\x07\\x0dline\\nnext" in line


def test_model_path_from_the_server_is_escaped(serve):
    props = dict(GOOD_PROPS, model_path="/m/" + HOSTILE + ".gguf", build_info=HOSTILE)
    url, _ = serve(by_path({"/props": (200, props), "/slots": (200, GOOD_SLOTS)}))
    res = runner.invoke(app, ["slots", "--server", url])
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout and "\r" not in res.stdout
    assert "boom\\x1b[2J" in res.stdout
