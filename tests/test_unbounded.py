"""Unbounded inputs (issues 27 and 28): server arguments, configuration values, standard input, working files.

Each case runs the real CLI in a child process with a time limit, so a regression shows as a timeout or a
failed assertion here, never as a stuck run: what is read is bounded in bytes before it is read whole, and
refused at once in one line (exit 2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slotctl.cli.server_args import MAX_WORD, SERVER_ARGS_MAX_BYTES
from slotctl.errors import UsageError
from slotctl.paths import STDIN_MAX_BYTES, read_bounded
from slotctl.server.flags import INT_MAX, ServerFlags, env_switch, from_environment

from conftest import DATA, default_signals

SLOT = DATA / "srv-np1.bin"
ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], timeout: float = 30, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200", **(env or {}))
    return subprocess.run([sys.executable, "-m", "slotctl", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def one_error(res: subprocess.CompletedProcess, *words: str) -> str:
    lines = res.stderr.splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr[-500:])
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-500:]
    assert len(lines[0]) < 400, lines[0][:400]   # a number of absurd length is named by its length, not echoed
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# -- --server-args @FILE and the plain flags --------------------------------------------------------------


def test_server_args_file_of_a_5_000_000_digit_number(tmp_path):
    f = tmp_path / "args"
    f.write_text("-c " + "9" * 5_000_000)
    # it did not answer within 60 s: the run's own timeout is the bound (a child's start-up under load within it)
    one_error(run(["validate", str(SLOT), "--no-load", "--server-args", f"@{f}"], timeout=60), "5,000,003 bytes",
              f"{SERVER_ARGS_MAX_BYTES:,}")


@pytest.mark.parametrize("device", ["/dev/zero", "fifo"])
def test_server_args_file_that_never_ends(tmp_path, device):
    """/dev/zero (a MemoryError) and a FIFO without a writer (a hang) are refused before a byte is read."""
    if device == "fifo":
        device = str(tmp_path / "fifo")
        os.mkfifo(device)
    line = one_error(run(["validate", str(SLOT), "--no-load", "--server-args", f"@{device}"], timeout=60))
    assert "not a regular file" in line


def test_server_args_a_megabyte_of_flags(tmp_path):
    f = tmp_path / "args"
    f.write_text(" ".join(["-c 4096"] * 150_000))
    one_error(run(["validate", str(SLOT), "--no-load", "--server-args", f"@{f}"], timeout=60), "more than the")


def test_server_args_as_text_past_the_bound_and_a_word_past_any_value():
    one_error(run(["validate", str(SLOT), "--no-load", "--server-args", "-c 1 " * 20_000]), "characters, more than")
    one_error(run(["validate", str(SLOT), "--no-load", "--server-args", "-c " + "9" * (MAX_WORD + 1)]),
              f"a word of {MAX_WORD + 1:,} characters")


def test_server_args_at_the_bound_is_read(tmp_path):
    """Just under the bound, many flags (the last -c wins, as everywhere): read, and the value used."""
    text = " ".join(["-c 4096"] * 9000)
    text = (text + " -c 512")[-(SERVER_ARGS_MAX_BYTES - 10):]
    f = tmp_path / "args"
    f.write_text("-c 1 " + text.lstrip("0123456789 "))
    res = run(["validate", str(SLOT), "--no-load", "--json", "--server-args", f"@{f}"])
    assert res.returncode == 0, res.stderr
    import json

    assert json.loads(res.stdout)["server"]["settings"]["n_ctx"] == 512


def test_read_bounded(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * 100)
    assert read_bounded(f, 100) == b"x" * 100
    with pytest.raises(UsageError, match="101 bytes, more than the 100"):
        f.write_bytes(b"x" * 101)
        read_bounded(f, 100)


@pytest.mark.parametrize("args", [["-c", "9" * 100_000], ["-np", "9" * 100_000], ["--min-cosine", "9" * 100_000]])
def test_plain_flag_numbers_of_absurd_length(args):
    cmd = ["identify", str(SLOT), "-m", str(DATA / "target.gguf")] if args[0] == "--min-cosine" else \
        ["validate", str(SLOT), "--no-load"]
    one_error(run([*cmd, *args]), "100,000 characters")


@pytest.mark.parametrize("value", [str(INT_MAX + 1), "9" * 20])
def test_server_int_flags_beyond_32_bits(value):
    """llama-server reads its numbers with std::stoi: a value past an int makes it refuse to start."""
    one_error(run(["validate", str(SLOT), "--no-load", "-c", value]), "32-bit")
    with pytest.raises(UsageError, match="32-bit"):
        ServerFlags(ctx_size=int(value))
    assert ServerFlags(ctx_size=INT_MAX).ctx_size == INT_MAX


def test_environment_values_of_absurd_length():
    """LLAMA_ARG_* and switches read as the server reads them, a number of any length refused or read at once."""
    for env in ({"LLAMA_ARG_CTX_SIZE": "9" * 10_000}, {"LLAMA_ARG_CTX_SIZE": "99999999999"}):
        one_error(run(["validate", str(SLOT), "--no-load"], env=env), "LLAMA_ARG_CTX_SIZE", "out of range")
    line = one_error(run(["validate", str(SLOT), "--no-load"], env={"LLAMA_ARG_CACHE_TYPE_K": "q" * 10_000}))
    assert "10,000 characters" in line
    assert from_environment({"LLAMA_ARG_CTX_SIZE": "  +0004096xyz"})["ctx_size"] == ("LLAMA_ARG_CTX_SIZE", 4096)
    assert env_switch("X", {"X": "9" * 10_000}) and env_switch("X", {"X": " -1"})
    assert not env_switch("X", {"X": "0" * 10_000}) and not env_switch("X", {"X": "x1"})
    res = run(["validate", str(SLOT), "--no-load"], env={"LLAMA_ATTN_ROT_DISABLE": "9" * 10_000})
    assert res.returncode == 0 and "internal error" not in res.stderr, res.stderr


# -- standard input: bounded, and its spool removed on every signal slotctl handles ---------------------------


def _spool_run(tmp_path: Path, env: dict | None = None) -> tuple[subprocess.Popen, subprocess.Popen]:
    """``(cat SLOT; cat /dev/zero) | slotctl inspect -`` with the spool in ``tmp_path`` (TMPDIR)."""
    feeder = subprocess.Popen(["sh", "-c", f"cat '{SLOT}'; exec cat /dev/zero"], stdout=subprocess.PIPE)
    child_env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path), **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "slotctl", "inspect", "-"], stdin=feeder.stdout,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env,
                            preexec_fn=default_signals)
    feeder.stdout.close()
    return feeder, proc


def _spools(tmp_path: Path) -> list[Path]:
    return list(tmp_path.glob("slotctl-stdin-*"))


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_stdin_spool_removed_on_signals(tmp_path, sig, code):
    feeder, proc = _spool_run(tmp_path)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:   # the spool exists and grows
            spools = _spools(tmp_path)
            if spools and spools[0].stat().st_size > (8 << 20):
                break
            time.sleep(0.05)
        else:
            pytest.fail("no spool grew")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        feeder.kill()
        feeder.wait()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert err.decode().splitlines() == [f"error: {dict(((143, 'terminated'), (129, 'hung up'), (130, 'interrupted')))[code]}"]
    assert _spools(tmp_path) == []


def test_stdin_spool_bounded(tmp_path):
    """Past SLOTCTL_STDIN_MAX: one line, exit 2, the spool removed (the default: 64 GiB, 1 GiB left free)."""
    feeder, proc = _spool_run(tmp_path, env={"SLOTCTL_STDIN_MAX": str(32 << 20)})
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        feeder.kill()
        feeder.wait()
    assert proc.returncode == 2, err
    line = one_error(subprocess.CompletedProcess([], 2, "", err.decode()), "more than 33,554,432 bytes")
    assert "SLOTCTL_STDIN_MAX" in line
    assert _spools(tmp_path) == []
    assert STDIN_MAX_BYTES == 64 << 30


def test_stdin_within_the_bound_is_read(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), SLOTCTL_STDIN_MAX=str(SLOT.stat().st_size), TMPDIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-m", "slotctl", "inspect", "-", "--json"], input=SLOT.read_bytes(),
                         capture_output=True, env=env, timeout=30)
    assert res.returncode == 0, res.stderr
    assert _spools(tmp_path) == []


# -- keep honours SIGTERM while a server drips its answer ----------------------------------------------------


def _keep_until_sigterm(url: str, slot_dir: Path, ready, settle: float) -> tuple[int, str, str, float]:
    """keep --timeout 600 --json before ``url``, sent SIGTERM ``settle`` seconds after ``ready()`` (waited for
    at most 30 s): its exit code, stdout, stderr, and the seconds from the signal to its exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "slotctl", "keep", "--server", url, "--slot-dir", str(slot_dir),
                             "--json", "--timeout", "600", "--every", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=default_signals)
    try:
        deadline = time.monotonic() + 30
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(settle)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        return proc.returncode, out, err, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("what", ["drip", "63 MiB"])
def test_keep_honours_sigterm_while_a_read_is_in_flight(serve, tmp_path, what):
    """keep --timeout 600 against a server whose /slots drips a byte every 0.2 s (or answers 63 MiB of
    escapes, 20.8 s to honour SIGTERM before the answer bound): SIGTERM cuts the read off, exit 0 at once."""
    from scripted import GOOD_PROPS, drip_body, send_json

    def answer(h):
        if h.path.startswith("/slots"):
            if what == "drip":
                drip_body(h)        # a byte every 0.2 s for 120 s
            else:
                body = b'"' + b"\\u00e9" * ((63 << 20) // 6) + b'"'
                h.send_response(200)
                h.send_header("Content-Length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)
            return
        send_json(h, GOOD_PROPS if h.path.startswith("/props") else {"status": "ok"} if h.path == "/health"
                  else {"data": []})

    url, script = serve(answer)
    code, out, err, took = _keep_until_sigterm(url, tmp_path, lambda: any(p.startswith("/slots")
                                                                        for _, p, _ in script.seen), settle=1)
    assert code == 0, err
    assert took < 15, took      # not --timeout 600
    assert out.splitlines()[-1].count('"stop"') == 1, out[-500:]


def test_keep_stopped_during_its_look_at_the_slots_reports_no_error(serve, tiny_models, tmp_path):
    """SIGTERM while keep's own look at the slots (after the server's facts, before a restore or save) is in
    flight: the read is cut off, which is the stop and not an error of the server; the last save looks
    again and the run ends 0 with no error event (CI once saw "GET /slots: cut off: stopping" as one)."""
    from scripted import GOOD_PROPS, GOOD_SLOTS, drip_body, send_json

    looks = []

    def answer(h):
        if h.path.startswith("/slots"):
            if h.command != "GET":      # keep's save of a slot to learn the server's flags: not a look
                send_json(h, GOOD_SLOTS)
                return
            looks.append(h.path)
            if len(looks) == 2:         # the facts' look answers; the next one, keep's own, drips
                drip_body(h)
            else:
                send_json(h, GOOD_SLOTS)
            return
        send_json(h, props if h.path.startswith("/props") else {"status": "ok"} if h.path == "/health"
                  else {"data": []})

    # a model file here: keep identifies the server's model by its content (else it saves nothing, nor looks)
    props = dict(GOOD_PROPS, model_path=str(tiny_models.target))
    url, _script = serve(answer)
    code, out, err, _took = _keep_until_sigterm(url, tmp_path, lambda: len(looks) >= 2, settle=0.5)
    assert code == 0, err
    assert len(looks) >= 2, looks
    events = [json.loads(line) for line in out.splitlines()]
    assert [e for e in events if e["event"] == "error"] == [], out
    assert events[-1]["event"] == "stop", out
    assert len(looks) >= 3, looks       # the last save looked again


# -- configuration files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["/dev/zero", "fifo", "2 MB"])
def test_aws_configuration_files_are_bounded(tmp_path, what):
    """AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE: a regular file of at most 1 MiB, refused unread
    otherwise (a FIFO hung, /dev/zero was a MemoryError)."""
    pytest.importorskip("obstore")
    path = what
    if what == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    elif what == "2 MB":
        path = str(tmp_path / "config")
        Path(path).write_text("[default]\n" + "#" * 2_000_000 + "\n")
    for var in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        res = run(["inspect", "s3://bucket/x.bin"], env={**{k: "" for k in os.environ if k.startswith("AWS_")},
                                                        var: path, "HOME": str(tmp_path)}, timeout=60)
        line = one_error(res, "AWS configuration file")
        assert ("not a regular file" in line) if what != "2 MB" else ("more than the 1,048,576" in line), line


@pytest.mark.parametrize("what", ["/dev/zero", "fifo"])
def test_a_prompt_file_that_never_ends_is_refused_unread(tmp_path, what):
    """save --prompt-file: a FIFO hung, /dev/zero was a MemoryError; a regular file of at most 256 MiB only."""
    path = what
    if what == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    res = run(["save", "-m", str(DATA / "target.gguf"), "--prompt-file", path, "-o", str(tmp_path / "x.bin")],
              timeout=60)
    assert "not a regular file" in one_error(res)
    assert not (tmp_path / "x.bin").exists()
