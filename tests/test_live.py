"""Live mode of save, restore and validate (``--server URL``) against a real llama-server b11434.

``save --server URL --slot N NAME`` and ``restore --server URL --slot N NAME`` act through the server's
``/slots`` API; ``validate FILE --server URL`` learns the server's model, ``-c`` and ``-np`` from ``/props``
and ``/slots``. One server per flag set, module-scoped, on 127.0.0.1 only; every request bounded.
Tests without the ``server`` marker need no server (usage errors, unreachable addresses).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import start_server
from llama_server import free_port
from slotctl.cli.app import app
from slotctl.errors import ExitStatus
from slotctl.tinymodels import SAMPLE_PROMPT

server = pytest.mark.server
runner = CliRunner()

API_KEY = "slotctl-live-key"
#: bound on every slotctl request in these tests
TIMEOUT = ["--timeout", "20"]
OK, FAILED, USAGE = int(ExitStatus.OK), int(ExitStatus.FAILED), int(ExitStatus.USAGE)


def slotctl(*args: str, code: int | None = None, env: dict | None = None):
    res = runner.invoke(app, [str(a) for a in args], env=env)
    assert "Traceback" not in res.output, res.output
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    if code is not None:
        assert res.exit_code == code, f"exit {res.exit_code}, expected {code}\n{res.output}"
    return res


def one_error_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


# -- servers -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def saving_server(binary: Path, model: Path, tmp: Path, name: str, args: list[str], *, slot: int, **kw):
    """A server with ``--slot-save-path tmp/slots`` (as ``save_dir``) whose ``slot`` holds a greedy completion
    of SAMPLE_PROMPT; stopped on exit."""
    (tmp / "slots").mkdir()
    srv = start_server(binary, model, tmp, name, args=args, slot_save_path=tmp / "slots", **kw)
    srv.save_dir = tmp / "slots"
    try:
        srv.completion(SAMPLE_PROMPT, slot=slot, n_predict=8)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def live(llama_server_bin, tiny_models, tmp_path_factory):
    """``-c 512 -np 2 -fa on --slot-save-path DIR``; slot 1 holds a greedy completion of SAMPLE_PROMPT."""
    with saving_server(llama_server_bin, tiny_models.target, tmp_path_factory.mktemp("live"), "live",
                       ["-c", "512", "-np", "2", "-fa", "on"], slot=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed(llama_server_bin, tiny_models, tmp_path_factory):
    """``-c 256 -np 1 --api-key KEY --slot-save-path DIR``: other flags than ``live``."""
    with saving_server(llama_server_bin, tiny_models.target, tmp_path_factory.mktemp("keyed"), "keyed",
                       ["-c", "256", "-np", "1", "-fa", "on"], slot=0, api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def nosave(llama_server_bin, tiny_models, tmp_path_factory):
    """No ``--slot-save-path``; its model is a copy the tests may move away (the server keeps it mapped)."""
    tmp = tmp_path_factory.mktemp("nosave")
    model = tmp / "served-model.gguf"
    shutil.copyfile(tiny_models.target, model)
    srv = start_server(llama_server_bin, model, tmp, "nosave", args=["-c", "256", "-np", "1", "-fa", "on"])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def spec(llama_server_bin, tiny_models, tmp_path_factory):
    """A speculative server: ``-md DRAFT --spec-type draft-simple -c 256 -np 1``."""
    tmp = tmp_path_factory.mktemp("spec")
    srv = start_server(llama_server_bin, tiny_models.target, tmp, "spec", draft=tiny_models.draft,
                       args=["-c", "256", "-np", "1", "-fa", "on", "--spec-type", "draft-simple"])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def keyed_file(keyed) -> Path:
    """A file the ``keyed`` server saved (``-c 256 -np 1``)."""
    keyed.save(0, "keyed.bin")
    return keyed.save_dir / "keyed.bin"


# -- save --server / restore --server --------------------------------------------------------------------------


@server
def test_a_slot_that_has_run_no_task_reports_the_servers_speculative_types(live):
    """b11434's /slots gives a slot's ``params`` (``speculative.types`` among them) only once it has run a task;
    the types are the server's, so the facts of a slot that has run none take them from one that has: slot 0
    of ``live`` (only slot 1 ran a task) says what slot 1 says. Read from the slot alone they came and went
    with which slot served the last requests, and every verdict kept under them was asked again."""
    from slotctl.live import http

    entries = {e["id"]: e for e in http.get_slots(live.url, timeout=60)}
    assert "params" not in entries[0] and entries[1]["params"]["speculative.types"] == "none"
    assert http.server_facts(live.url, 0, timeout=60).speculative_types == "none"
    assert http.server_facts(live.url, 1, timeout=60).speculative_types == "none"


@server
def test_a_server_that_has_run_no_task_learns_the_same_setup_as_after_its_first(llama_server_bin, tiny_models,
                                                                                tmp_path):
    """A server started (or restarted) reports no speculative types until a slot runs a task, then "none" (it
    drafts nothing): what a setup is learnt from, and the question its verdicts are kept under, are the same
    before and after. They differed: every restart forgot every verdict and setup twice (at the restart, and at
    its first task), and the first returning turn judged its state again in the request path."""
    from slotctl.live import http
    from slotctl.live.prove import learnt_from, local_setup_key

    srv = start_server(llama_server_bin, tiny_models.target, tmp_path, "fresh", args=["-c", "256", "-np", "1",
                                                                                      "-fa", "on"])
    try:
        before = http.server_facts(srv.url, 0, timeout=60)
        srv.completion(SAMPLE_PROMPT, slot=0, n_predict=2)
        after = http.server_facts(srv.url, 0, timeout=60)
    finally:
        srv.stop()
    assert (before.speculative_types, after.speculative_types) == (None, "none")     # what the server says
    assert before.speculative is after.speculative is False
    assert learnt_from(before) == learnt_from(after)
    assert local_setup_key(before, 0) == local_setup_key(after, 0)


@server
def test_save_then_restore_round_trip(live):
    res = slotctl("save", "--server", live.url, "--slot", "1", "round.bin", "--json", *TIMEOUT, code=OK)
    doc = json.loads(res.stdout)
    assert (doc["server"], doc["slot"], doc["name"], doc["exit_code"]) == (live.url, 1, "round.bin", 0)
    saved = doc["answer"]
    assert saved["id_slot"] == 1 and saved["filename"] == "round.bin"
    path = live.save_dir / "round.bin"
    assert path.is_file() and saved["n_written"] == path.stat().st_size
    # slotctl inspect of the file agrees with the server's count
    doc = json.loads(slotctl("inspect", path, "--json", code=OK).stdout)["files"][0]
    assert doc["prompt"]["n_tokens"] == saved["n_saved"] > 0

    slotctl("erase", "--server", live.url, "--slot", "0", code=OK)
    res = slotctl("restore", "--server", live.url, "--slot", "0", "round.bin", "--json", *TIMEOUT, code=OK)
    restored = json.loads(res.stdout)["answer"]
    assert (restored["id_slot"], restored["filename"]) == (0, "round.bin")
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    # the restored slot (erased before) serves the saved prompt from its cache; the saved tokens beyond it
    # are the generated ones, which this request does not repeat
    turn = live.completion(SAMPLE_PROMPT + " The river", slot=0, n_predict=2)
    assert turn["timings"]["cache_n"] == len(live.tokenize(SAMPLE_PROMPT)) < saved["n_saved"]


@server
def test_json_is_the_servers_answer(live):
    res = slotctl("save", "--server", live.url, "--slot", "1", "answer.bin", "--json", code=OK)
    ours = json.loads(res.stdout)["answer"]
    theirs = live.save(1, "answer-raw.bin")  # the same slot, saved directly
    assert set(ours) == set(theirs) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert set(ours["timings"]) == {"save_ms"}
    assert {k: ours[k] for k in ("id_slot", "n_saved", "n_written")} == \
        {k: theirs[k] for k in ("id_slot", "n_saved", "n_written")}


@server
def test_human_output_is_a_table_of_the_answer(live):
    name = "human[1].bin"  # brackets: shown as they are, not read as rich markup
    res = slotctl("save", "--server", live.url.removeprefix("http://"), "--slot", "1", name, code=OK,
                  env={"COLUMNS": "200"})
    n_saved = json.loads(slotctl("inspect", live.save_dir / name, "--json").stdout)["files"][0]["prompt"]["n_tokens"]
    assert f"slot 1 saved to {name}" in res.stdout and "\\[" not in res.stdout, res.stdout
    assert any("n_saved" in line and f"{n_saved:,}" in line for line in res.stdout.splitlines()), res.stdout
    assert any("filename" in line and name in line for line in res.stdout.splitlines()), res.stdout
    res = slotctl("restore", "--server", live.url, "--slot", "1", name, code=OK, env={"COLUMNS": "200"})
    assert f"{name} restored into slot 1" in res.stdout
    assert any("n_restored" in line and f"{n_saved:,}" in line for line in res.stdout.splitlines()), res.stdout


@server
def test_restore_a_file_slotctl_wrote(live, tiny_models):
    """slotctl save (local mode, the server's flags) writes into the save dir; the server restores it."""
    path = live.save_dir / "by-slotctl.bin"
    res = slotctl("save", "-m", tiny_models.target, "--prompt", SAMPLE_PROMPT, "-o", path, "-c", "512", "-np", "2",
                  "-fa", "on", "--slot", "1", "--json", code=OK)
    n_tokens = json.loads(res.stdout)["n_tokens"]
    res = slotctl("restore", "--server", live.url, "--slot", "1", "by-slotctl.bin", "--json", *TIMEOUT, code=OK)
    assert json.loads(res.stdout)["answer"]["n_restored"] == n_tokens
    turn = live.completion(SAMPLE_PROMPT + " The river", slot=1, n_predict=2)
    assert turn["timings"]["cache_n"] == n_tokens


@server
def test_restore_a_missing_or_foreign_file_is_refused(live, keyed_file):
    res = slotctl("restore", "--server", live.url, "--slot", "0", "no-such.bin", code=FAILED)
    assert "HTTP 400" in one_error_line(res) and "Unable to restore slot" in res.stderr
    # a file of a 1-slot server into this 2-slot server: the server refuses it (n_stream differs)
    shutil.copyfile(keyed_file, live.save_dir / "foreign.bin")
    res = slotctl("restore", "--server", live.url, "--slot", "0", "foreign.bin", code=FAILED)
    assert "Unable to restore slot" in one_error_line(res)


@server
def test_slot_the_server_does_not_have(live):
    for cmd in ("save", "restore"):
        res = slotctl(cmd, "--server", live.url, "--slot", "2", "x.bin", code=USAGE)
        assert "has 2 slot(s), 0..1" in one_error_line(res)


NAMES = ["../x", "a/b", "", "x/", "./x", "a\\b", "c:d", " lead", "trail.", "..", "."]


@server
@pytest.mark.parametrize("name", NAMES)
def test_file_name_rules_before_sending(live, name):
    before = sorted(os.listdir(live.save_dir))
    res = slotctl("save", "--server", live.url, "--slot", "1", name, code=USAGE)
    assert "invalid slot file name" in one_error_line(res)
    res = slotctl("restore", "--server", live.url, "--slot", "1", name, code=USAGE)
    assert "invalid slot file name" in one_error_line(res)
    assert sorted(os.listdir(live.save_dir)) == before


@pytest.mark.parametrize("name", NAMES)
def test_file_name_rules_need_no_server(name):
    """Checked before any request: an address where nothing listens never gets to refuse the connection."""
    url = f"http://127.0.0.1:{free_port()}"
    res = slotctl("save", "--server", url, "--slot", "0", name, code=USAGE)
    assert "invalid slot file name" in one_error_line(res) and "connection refused" not in res.stderr
    res = slotctl("restore", "--server", url, "--slot", "0", name, code=USAGE)
    assert "invalid slot file name" in one_error_line(res) and "connection refused" not in res.stderr


# -- API key, no --slot-save-path, unreachable ---------------------------------------------------------------------


@server
def test_api_key(keyed, monkeypatch):
    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    res = slotctl("save", "--server", keyed.url, "--slot", "0", "k.bin", "--api-key", "wrong", code=USAGE)
    assert "HTTP 401" in one_error_line(res) and "Invalid API Key" in res.stderr
    res = slotctl("save", "--server", keyed.url, "--slot", "0", "k.bin", code=USAGE)  # no key at all
    assert "HTTP 401" in one_error_line(res)
    assert not (keyed.save_dir / "k.bin").exists()
    res = slotctl("save", "--server", keyed.url, "--slot", "0", "k.bin", "--api-key", API_KEY, "--json", code=OK)
    assert json.loads(res.stdout)["answer"]["n_saved"] > 0 and (keyed.save_dir / "k.bin").is_file()
    monkeypatch.setenv("LLAMA_API_KEY", API_KEY)
    res = slotctl("restore", "--server", keyed.url, "--slot", "0", "k.bin", "--json", code=OK)
    assert json.loads(res.stdout)["answer"]["n_restored"] > 0
    res = slotctl("validate", keyed.save_dir / "k.bin", "--server", keyed.url, "--no-load", "--json", code=OK)
    assert json.loads(res.stdout)["server"]["live"]["learned"]["total_slots"] == 1


@server
def test_without_slot_save_path(nosave, monkeypatch):
    """b11434 answers HTTP 501 to slot actions without --slot-save-path: exit 1 with its message."""
    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    for cmd in ("save", "restore"):
        res = slotctl(cmd, "--server", nosave.url, "--slot", "0", "x.bin", code=FAILED)
        line = one_error_line(res)
        assert "HTTP 501" in line and "This server does not support slots action. Start it with " \
                                      "`--slot-save-path`" in line, line


def test_unreachable(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "f.bin").write_bytes(b"ggsq")
    for args in (["save", "--server", url, "x.bin"], ["restore", "--server", url, "x.bin"],
                 ["validate", tmp_path / "f.bin", "--server", url]):
        res = slotctl(*args, *TIMEOUT, code=USAGE)
        assert "connection refused" in one_error_line(res)


@pytest.fixture
def hanging_server():
    """An HTTP server on 127.0.0.1 that answers GET /props (one slot) and never answers a slot action,
    as llama-server does while the slot is busy with a long request (it defers the action)."""
    release = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._json({"total_slots": 1, "model_path": "/nowhere/model.gguf",
                        "default_generation_settings": {"n_ctx": 256}})

        def do_POST(self):
            release.wait(10)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()


def test_busy_slot_timeout(hanging_server):
    for cmd in ("save", "restore"):
        res = slotctl(cmd, "--server", hanging_server, "--slot", "0", "x.bin", "--timeout", "0.5", code=USAGE)
        line = one_error_line(res)
        assert f"POST {hanging_server}/slots/0: no answer within 0.5 s" in line
        assert "waits until a busy slot is idle" in line


# -- server mode and local mode do not mix ------------------------------------------------------------------------


@pytest.mark.parametrize("args, named", [
    (["save", "--server", "127.0.0.1:1", "x.bin", "-o", "y.bin"], "-o/--output"),
    (["save", "--server", "127.0.0.1:1", "x.bin", "-m", "m.gguf", "--prompt", "hi"], "-m/--model, -p/--prompt"),
    (["save", "--server", "127.0.0.1:1", "x.bin", "--force", "-c", "256"], "-c/--ctx-size, --force"),
    (["restore", "--server", "127.0.0.1:1", "x.bin", "--continue", "more"], "--continue"),
    (["restore", "--server", "127.0.0.1:1", "x.bin", "--compare", "-n", "4"], "-n/--n-predict, --compare"),
    (["restore", "--server", "127.0.0.1:1", "x.bin", "-m", "m.gguf"], "-m/--model"),
])
def test_server_mode_refuses_local_options(args, named):
    res = slotctl(*args, code=USAGE)
    line = one_error_line(res)
    assert "--server:" in line and all(n in line for n in named.split(", ")), line
    assert "for a local" in line


@pytest.mark.parametrize("args, words", [
    (["save", "--prompt", "hi", "-o", "y.bin"], "missing option -m/--model"),
    (["save", "-m", "m.gguf", "--prompt", "hi"], "missing option -o/--output"),
    (["save", "x.bin", "-m", "m.gguf", "-o", "y.bin", "--prompt", "hi"], "goes with --server"),
    (["save", "-m", "m.gguf", "-o", "y.bin", "--prompt", "hi", "--api-key", "k"], "--api-key goes with --server"),
    (["restore", "x.bin"], "missing option -m/--model"),
    (["restore", "x.bin", "-m", "m.gguf", "--timeout", "3"], "--timeout goes with --server"),
    (["validate", "x.bin", "--api-key", "k"], "--api-key goes with --server"),
])
def test_local_mode_needs_its_options(args, words):
    res = slotctl(*args, code=USAGE)
    assert words in one_error_line(res)


# -- validate --server ---------------------------------------------------------------------------------------------


@server
def test_validate_learns_the_servers_flags(live, tiny_models):
    live.save(1, "to-validate.bin")
    path = live.save_dir / "to-validate.bin"
    res = slotctl("validate", path, "--server", live.url, "--slot", "1", "--json", *TIMEOUT, code=OK)
    doc = json.loads(res.stdout)
    srv = doc["server"]
    assert Path(srv["model"]) == tiny_models.target
    assert (srv["settings"]["n_ctx"], srv["settings"]["n_parallel"], srv["slot"]) == (512, 2, 1)
    assert srv["n_ctx_slot"] == 256 and srv["real_check"] is True
    lv = srv["live"]
    assert lv["url"] == live.url
    assert lv["learned"]["total_slots"] == 2 and lv["learned"]["n_ctx_slot"] == 256
    assert lv["learned"]["n_ctx_from"] == "/slots" and lv["learned"]["speculative"] is False
    assert lv["learned"]["model_meta"]["n_vocab"] > 0
    assert {k: lv["sources"][k] for k in ("model", "parallel", "ctx_size")} == \
        {"model": "server", "parallel": "server", "ctx_size": "server"}
    assert lv["sources"]["kv_unified"] == "default" and lv["sources"]["cache_type_k"] == "default"
    assert any("-kvu" in n for n in lv["notes"]) and any("-ctk f16" in n for n in lv["notes"])
    assert lv["warnings"] == []
    assert doc["files"][0]["verdict"] == "restores"
    # the human view names the flags it validated with
    res = slotctl("validate", path, "--server", live.url, "--slot", "1", "--no-load", code=OK,
                  env={"COLUMNS": "250"})
    assert "-c 512 -np 2 --slot 1" in res.stdout and "from the server" in res.stdout


@server
def test_validate_names_the_mismatch(live, keyed_file):
    """A file of a 1-slot server, validated for the 2-slot ``live`` server: exit 1, the stream count named."""
    res = slotctl("validate", keyed_file, "--server", live.url, "--no-load", "--json", code=FAILED)
    doc = json.loads(res.stdout)
    (f,) = doc["files"]
    assert f["verdict"] == "refused"
    assert any(x["code"] == "n_stream_mismatch" and "-np" in x["message"] for x in f["findings"]), f["findings"]
    res = slotctl("validate", keyed_file, "--server", live.url, "--no-load", code=FAILED)
    assert "n_stream_mismatch" in res.stdout


@server
def test_validate_flags_given_win(live, keyed_file):
    res = slotctl("validate", keyed_file, "--server", live.url, "-np", "1", "-c", "256", "--no-load", "--json",
                  code=OK)
    lv = json.loads(res.stdout)["server"]["live"]
    assert (lv["sources"]["parallel"], lv["sources"]["ctx_size"]) == ("command line", "command line")
    assert lv["flags"]["parallel"] == 1 and lv["learned"]["total_slots"] == 2
    assert any("validated for -np 1 as given" in n for n in lv["notes"])


@server
def test_validate_slot_outside_the_server(live, keyed_file):
    res = slotctl("validate", keyed_file, "--server", live.url, "--slot", "2", "--no-load", code=USAGE)
    assert "has 2 slot(s)" in one_error_line(res)


@server
def test_validate_model_not_on_this_machine(nosave, keyed_file, tmp_path):
    """/props names a path on the server's machine: missing here, -m is required (and then used)."""
    served = Path(json.loads(slotctl("slots", "--server", nosave.url, "--json").stdout)["model"])
    moved = tmp_path / "copy.gguf"
    os.rename(served, moved)  # the server keeps its mapping; the path it reports is gone here
    try:
        res = slotctl("validate", keyed_file, "--server", nosave.url, "--no-load", code=USAGE)
        line = one_error_line(res)
        assert str(served) in line and "-m" in line and "not a file here" in line
        res = slotctl("validate", keyed_file, "--server", nosave.url, "-m", moved, "--no-load", "--json", code=OK)
        lv = json.loads(res.stdout)["server"]["live"]
        assert lv["sources"]["model"] == "command line" and lv["warnings"] == []
    finally:
        os.rename(moved, served)


@server
def test_validate_with_another_model_warns(live, keyed_file, tiny_models):
    """-m given wins, but a GGUF that is not the server's model (GET /v1/models) is warned about."""
    res = slotctl("validate", keyed_file, "--server", live.url, "-m", tiny_models.draft, "-np", "1", "-c", "256",
                  "--no-load", "--json")
    lv = json.loads(res.stdout)["server"]["live"]
    assert lv["sources"]["model"] == "command line"
    assert any("is not the server's model" in w for w in lv["warnings"]), lv
    assert "is not the server's model" in res.stderr


@server
def test_validate_speculative_server(spec, keyed_file, tiny_models):
    """b11434 says a slot speculates (/slots) but names no draft model: a note; -md given is used."""
    res = slotctl("validate", keyed_file, "--server", spec.url, "--no-load", "--json", code=OK)
    lv = json.loads(res.stdout)["server"]["live"]
    assert lv["learned"]["speculative"] is True and lv["sources"]["draft_model"] == "unknown"
    assert any("does not name its draft model" in n and "-md" in n for n in lv["notes"])
    res = slotctl("validate", keyed_file, "--server", spec.url, "-md", tiny_models.draft, "--no-load", "--json")
    doc = json.loads(res.stdout)
    assert doc["server"]["draft_model"] == str(tiny_models.draft)
    assert doc["server"]["live"]["sources"]["draft_model"] == "command line"
    assert doc["server"]["draft_context"] is not None
