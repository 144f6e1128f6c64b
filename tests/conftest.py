"""Shared fixtures. Test data copied from real llama-server runs lives in tests/data (see its README)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).parent))

from llama_server import BuildError, LlamaServer, ServerStartError, server_binary  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """The tiny target (2 layers) and draft (1 layer) from slotctl.testing, made once per session."""
    from slotctl.testing import make_models

    return make_models(tmp_path_factory.mktemp("models"))


# -- the server binary and the log of a failing test -----------------------------------------------------

_build_failure: list[str] = []


@pytest.fixture(scope="session")
def llama_server_bin(request) -> Path:
    """llama-server b11434: $SLOTCTL_LLAMA_SERVER, the cached build, or a build now (once per machine)."""
    if _build_failure:
        pytest.fail(_build_failure[0], pytrace=False)
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def say(message: str) -> None:  # shown while pytest captures output: a build takes minutes
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"\n[slotctl tests] {message}", flush=True)

    try:
        return server_binary(log=say)
    except BuildError as e:
        _build_failure.append(f"cannot build llama-server: {e}")
        pytest.fail(_build_failure[0], pytrace=False)


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


def start_server(binary: Path, model: Path, tmp: Path, name: str, **kw) -> LlamaServer:
    srv = LlamaServer(binary, model, log_path=tmp / f"{name}.log", **kw)
    try:
        return srv.start()
    except ServerStartError as e:
        pytest.fail(str(e), pytrace=False)
