"""What the tests of serve share (tests/test_serve.py, test_serve_unattended.py, test_router.py): ``slotctl serve``
as a process of its own (its signals and event lines real), requests to it, the server flags and the turns
of a conversation, llama-server's router mode. The server of a test's own (``fresh``) is conftest.py's
fixture."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import json_schemas
from conftest import default_signals
from slotctl.tinymodels import SAMPLE_PROMPT

ARGS = ["-c", "1024", "-np", "2", "-fa", "on"]
#: a conversation's first turn (about 200 tokens) and the turn that comes back to it
TURN1 = " ".join([SAMPLE_PROMPT] * 2)
TURN2_EXTRA = " And then the story went on, as stories do, to its end."


class Serve:
    """``slotctl serve`` as a process: its JSON event lines collected, its address read from the first."""

    def __init__(self, upstream: str, slot_dir: Path, store: str | None = None, *extra: str, env=None,
                 max_file_size: int | None = None):
        cmd = [sys.executable, "-m", "slotctl", "serve", "--upstream", upstream, "--slot-dir", str(slot_dir),
               "--listen", "127.0.0.1:0", "--json", "--min-gain", "4", *extra]
        if store is not None:
            cmd += ["--store", store]
        def child() -> None:      # default signals; RLIMIT_FSIZE: a write past it fails (EFBIG: Python ignores SIGXFSZ)
            default_signals()
            if max_file_size is not None:
                import resource

                resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_size, max_file_size))

        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})}, preexec_fn=child)
        self.events: list[dict] = []
        self.schema_errors: list[str] = []
        self.stderr: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        #: notified at each event line read, and at the end of serve's stdout (``read_all``)
        self._read_more = threading.Condition()
        self.read_all = False
        threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True).start()
        first = self._lines.get(timeout=60)
        assert first is not None and first["event"] == "listening", (first, self.stderr)
        self.port = first["details"]["port"]
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self, stream, is_json: bool) -> None:
        try:
            for line in stream:
                if is_json:
                    ev = json.loads(line)
                    self.schema_errors += json_schemas.errors("serve", ev)
                    with self._read_more:
                        self.events.append(ev)
                        self._read_more.notify_all()
                    self._lines.put(ev)
                else:
                    self.stderr.append(line)
        finally:
            if is_json:
                with self._read_more:
                    self.read_all = True
                    self._read_more.notify_all()
                self._lines.put(None)

    def events_named(self, event: str, n: int = 1, timeout: float = 60, where=None) -> list[dict]:
        """serve's ``event`` lines (those ``where`` accepts) once ``n`` of them were read. serve prints a line
        before it answers or counts (or counts first: ``pruned``, ``stored``), but this process reads its lines
        on a thread of their own: what the answer or a counter says done may not be in ``events`` yet. Fewer
        than ``n`` when serve's output ended or ``timeout`` passed first (the caller's assertion then fails)."""
        def named() -> list[dict]:
            return [e for e in self.events if e["event"] == event and (where is None or where(e))]

        with self._read_more:
            self._read_more.wait_for(lambda: len(named()) >= n or self.read_all, timeout)
            return named()

    def read_to_the_end(self, timeout: float = 60) -> list[dict]:
        """Every event line, once serve's stdout ended (it exited: its last lines may still be in the pipe)."""
        with self._read_more:
            assert self._read_more.wait_for(lambda: self.read_all, timeout), "serve's output did not end"
            return list(self.events)

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/slotctl/stats", timeout=30) as r:
            return json.loads(r.read())["counters"]

    def wait_for(self, key: str, n: int, timeout: float = 60) -> dict:
        """The counters once ``key`` reached ``n`` (saves are done after the answer)."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.stats()
            if c[key] >= n or time.monotonic() > deadline:
                return c
            time.sleep(0.05)

    def wait_for_any(self, *reached: tuple[str, int], timeout: float = 60) -> dict:
        """The counters once one of ``reached``'s (key, n) pairs has its key at n or more."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.stats()
            if any(c[key] >= n for key, n in reached) or time.monotonic() > deadline:
                return c
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with self._read_more:       # its last lines read (schema-checked, in output()) before anyone looks
            self._read_more.wait_for(lambda: self.read_all, 60)
        return self.proc.returncode

    def output(self) -> str:
        return "".join(json.dumps(e) + "\n" for e in self.events) + "".join(self.stderr)


def call(url: str, method: str, path: str, body=None, *, raw: bytes | None = None, headers=None,
         timeout: float = 120) -> tuple[int, dict, bytes]:
    """(status, headers, body bytes) of one request (no proxy, no redirects followed)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json"} if data is not None else {}
    h.update(headers or {})
    req = urllib.request.Request(url + path, data=data, headers=h, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def complete(url: str, prompt, path: str = "/completion", **extra) -> dict:
    status, _h, raw = call(url, "POST", path, {"prompt": prompt, "n_predict": 8, "temperature": 0, **extra})
    assert status == 200, raw
    return json.loads(raw)


class Router:
    """b11434 in router mode: no -m, ``--models-dir`` with the tiny model as ``tiny``; it starts the model's own
    server (a child on 127.0.0.1 and a port it chooses) at the first request naming it."""

    def __init__(self, binary: Path, models: Path, slots: Path, log: Path):
        from llama_server import LlamaServer

        class R(LlamaServer):
            def command(self) -> list[str]:
                return [str(self.binary), "--host", self.host, "--port", str(self.port), "--models-dir", str(models),
                        "-t", "2", "-tb", "2", "--no-ui", "--slot-save-path", str(slots), *ARGS]

        self.srv = R(binary, models / "tiny.gguf", log_path=log).start()
        self.url = self.srv.url

    @classmethod
    def of_tiny(cls, binary: Path, tiny_models, tmp_path: Path) -> tuple["Router", Path, Path]:
        """A router whose --models-dir holds the tiny model as ``tiny``; with its slot directory and a store."""
        import shutil

        models, slots, store = tmp_path / "models", tmp_path / "slots", tmp_path / "store"
        for d in (models, slots, store):
            d.mkdir()
        shutil.copy(tiny_models.target, models / "tiny.gguf")
        return cls(binary, models, slots, tmp_path / "router.log"), slots, store

    def stop(self) -> None:
        self.srv.stop()     # its process group: the children with it
