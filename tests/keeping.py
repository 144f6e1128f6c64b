"""What the tests of keep and the fleet share (tests/test_fleet.py, test_unattended.py, test_ui.py, test_router.py,
test_serve_unattended.py, test_store_hostile.py): slotctl in this process, real llama-servers with a slot
directory, ``slotctl keep`` as a process of its own (its signals, lock and sockets real) and what it says.
The module-scoped servers themselves (``one``, ``three``, ``kept``) are conftest.py's fixtures."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from typer.testing import CliRunner

import json_schemas
from conftest import default_signals, start_server
from llama_server import LlamaServer
from slotctl.cli.app import app
from slotctl.slotfile import open_slot_file

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def slotctl(*args, code: int | None = None):
    """``slotctl ARGS`` in this process (its exit code checked when ``code`` is given): no traceback."""
    res = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in res.output, res.output
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    if code is not None:
        assert res.exit_code == code, f"exit {res.exit_code}, expected {code}\n{res.stdout}\n{res.stderr}"
    return res


@contextlib.contextmanager
def serving(binary, model, tmp: Path, name: str, args: list[str]):
    """A llama-server with ``--slot-save-path tmp/slots`` (its ``save_dir``), stopped on exit."""
    (tmp / "slots").mkdir()
    srv = start_server(binary, model, tmp, name, args=args, slot_save_path=tmp / "slots")
    srv.save_dir = tmp / "slots"
    try:
        yield srv
    finally:
        srv.stop()


def tokens_of(path: Path) -> list[int]:
    """The tokens the slot file at ``path`` holds."""
    return [int(t) for t in open_slot_file(path).tokens.tokens]


def emptied(srv) -> None:
    """Every slot of ``srv`` erased: a keep started now stores only what the test puts in the slots. The slots
    of the module's server hold what earlier tests left; keep's first look stores that too, and a test that
    waits for "the" stored state of a slot, or counts what the store holds, races the second look (which
    stores the test's own state) against its next step."""
    status, props = srv.get("/props")
    assert status == 200, props
    for slot in range(props["total_slots"]):
        status, answer = srv.erase(slot)
        assert status == 200, answer


#: llama-swap serves each model under a path prefix: keep works through one
PREFIX = "/upstream/tiny"


class PrefixedServer(LlamaServer):
    """A server started with ``--api-prefix``, reached under it."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{PREFIX}"


class Keep:
    """``slotctl keep --json`` as a process of its own (signals are real); its lines, checked against the
    schema, as they come."""

    def __init__(self, srv, store: Path | str, *more: str, env: dict | None = None):
        # PYTHONFAULTHANDLER: a keep that does not stop is made to say where each of its threads is (SIGABRT)
        env = dict(env or os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   PYTHONFAULTHANDLER="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "slotctl", "keep", "--server", srv.url, "--slot-dir",
                                      str(srv.save_dir), "--store", str(store), "--json", "--timeout", "60", *more],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=default_signals)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        #: keep's stderr, read as it comes (a pipe nobody reads would stop keep once full)
        self.errors: list[str] = []
        #: set once the reader met the end of keep's stdout: every line it will ever put is in ``lines``
        self.read_all = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self._err_reader = threading.Thread(target=self._read_errors, daemon=True)
        self._err_reader.start()

    def _read_errors(self) -> None:
        for line in self.proc.stderr:
            self.errors.append(line)

    @property
    def stderr(self) -> str:
        """What keep wrote on stderr (all of it once it exited)."""
        if self.proc.poll() is not None:
            self._err_reader.join(10)
        return "".join(self.errors)

    def _read(self) -> None:
        try:
            for raw in self.proc.stdout:
                line = json.loads(raw)
                json_schemas.check("keep", line, "line")
                self.lines.put(line)
        finally:
            self.read_all.set()

    def wait_for(self, event: str, slot: int | None = None, timeout: float = 90) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                # keep's end is told by its reader, not by the process: a keep that exited may have lines
                # in the pipe the reader has not put yet (a loaded machine, the schema check of each line)
                assert not (self.read_all.is_set() and self.lines.empty()), \
                    f"keep exited with {self.proc.wait(60)}: {self.stderr}\n{self.seen}"
                continue
            self.seen.append(line)
            if line["event"] == event and (slot is None or line["slot"] == slot):
                return line
        raise AssertionError(f"no {event!r} event for slot {slot} within {timeout} s: {self.seen}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        """``sig`` sent, keep's exit code. A keep still running ``timeout`` seconds later fails the test with
        where each of its threads was (SIGABRT: Python's fault handler), its lines and its stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            while not self.lines.empty():
                self.seen.append(self.lines.get())
            raise AssertionError(f"keep did not stop within {timeout} s of signal {sig}: its lines {self.seen}\n"
                                 f"its stderr:\n{self.stderr}") from None


def child_env(extra: dict | None = None, drop_aws: bool = False) -> dict:
    """The environment of a slotctl child process: this one's (without its AWS_ variables with ``drop_aws``),
    this checkout first on PYTHONPATH, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not (drop_aws and k.startswith("AWS_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def keep_proc(url: str, slot_dir: Path, *more: str, env: dict | None = None) -> subprocess.Popen:
    """``slotctl keep --json`` as a process of its own."""
    return subprocess.Popen([sys.executable, "-m", "slotctl", "keep", "--server", url, "--slot-dir", str(slot_dir),
                             "--json", "--timeout", "5", *more], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env or child_env(), preexec_fn=default_signals)


def first_line(proc: subprocess.Popen, timeout: float = 60) -> dict:
    """The first JSON line of a keep process (its ``start`` event), or the failure it exited with: the document
    of a keep refused at its start (one JSON document over several lines, then exit 2)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise AssertionError(f"keep said nothing within {timeout} s")
    line = proc.stdout.readline()
    assert line, f"keep exited with {proc.wait(5)}: {proc.stderr.read()}"
    if line.rstrip("\n") == "{":
        return json.loads(line + proc.stdout.read())
    return json.loads(line)


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(30)
    finally:
        proc.stdout.close()
        proc.stderr.close()


def lease_of(seaweed, prefix: str) -> tuple[str, dict]:
    import obstore

    client = seaweed.client()
    found = [m["path"] for m in obstore.list(client, prefix=prefix).collect() if m["path"].endswith(".lease")]
    assert len(found) == 1, found
    return found[0], json.loads(bytes(obstore.get(client, found[0]).bytes()))


def scrape(base: str, path: str = "/metrics") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(base + path, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def wait_until(check, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s")


# -- metrics: keep's and serve's expositions, and what the docs say of them ---------------------------------


def families(text: str, prefix: str = "slotctl_keep_") -> dict[str, str]:
    """Each family of an exposition parsed by prometheus_client's own parser, named as its samples are (a
    counter's with ``_total``), and its type. Every sample belongs to a family of the type declared for it:
    a counter whose ``# TYPE`` line the parser does not match to its samples reads as an empty counter and
    an ``unknown`` family per sample, which fails here."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith(prefix) or fam.name == "slotctl_build_info", fam.name
        assert fam.type in ("counter", "gauge", "histogram"), (fam.name, fam.type)
        name = fam.name + ("_total" if fam.type == "counter" else "")
        suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}[fam.type]
        assert all(s.name in [fam.name + x for x in suffixes] for s in fam.samples), (fam.name, fam.samples)
        assert name not in out, name
        out[name] = fam.type
    return out


def documented(page: str) -> dict[str, str]:
    """The families a page's metrics table lists (``| `NAME{labels}`, `NAME2` | type | what |``) and their
    types."""
    out = {}
    for line in (ROOT / "docs" / page).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `slotctl_") or len(cells) < 3:
            continue
        for name in re.findall(r"`([a-z_]+)(?:\{[^}]*\})?`", cells[0]):
            out[name] = cells[1]
    return out


def samples(text: str, prefix: str = "slotctl_keep_") -> dict[tuple, float]:
    """Every sample of an exposition, parsed by prometheus_client's parser: (name, sorted labels) -> value
    (each family's type checked by :func:`families`)."""
    from prometheus_client.parser import text_string_to_metric_families

    families(text, prefix)
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(ss: dict, name: str, **labels) -> float:
    return ss.get((name, tuple(sorted({k: str(v) for k, v in labels.items()}.items()))), 0.0)
