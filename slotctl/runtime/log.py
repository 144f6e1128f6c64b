"""llama.cpp's process-wide state: the backend and where its log messages go.

llama.cpp logs through one callback shared by the whole process (``llama_log_set`` sets the
ggml logger too). llama-cpp-python installs its own on import, which prints everything, so the
runtime replaces it: by default messages are dropped; with ``configure_logging(True)`` they are
written to stderr. Either way, error-level messages are also kept while a ``capture_errors()``
block runs: llama.cpp reports why a call failed (a state that does not fit a context, a context
it cannot build) only in its log, and callers turn those lines into their own messages.

The C library keeps a raw pointer to the callback, so the ctypes objects below live at module
level for the life of the process: a callback that is garbage collected while llama.cpp still
holds it crashes the process at the next log line.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator

import llama_cpp

#: ``enum ggml_log_level`` values the callback distinguishes (ggml/include/ggml.h)
_LEVEL_ERROR = 4
_LEVEL_CONT = 5

_verbose = False
_configured = False
_backend_ready = False
#: the error lines of the innermost running ``capture_errors()`` block, if any
_captured: list[str] | None = None
_last_level = 0


def _on_log(level: int, text: bytes | None, user_data: ctypes.c_void_p) -> None:
    """Receive one llama.cpp log message: keep it if it is an error being captured, echo it if verbose."""
    global _last_level
    if level != _LEVEL_CONT:
        _last_level = level
    message = (text or b"").decode("utf-8", errors="replace")
    if _captured is not None and _last_level == _LEVEL_ERROR:
        if level == _LEVEL_CONT and _captured:
            _captured[-1] += message
        else:
            _captured.append(message)
    if _verbose:
        sys.stderr.write(message)
        sys.stderr.flush()


_CALLBACK = llama_cpp.llama_log_callback(_on_log)


def configure_logging(verbose: bool) -> None:
    """Send llama.cpp's log to stderr when ``verbose``, else drop it. Can be called any time."""
    global _verbose, _configured
    _verbose = verbose
    llama_cpp.llama_log_set(_CALLBACK, ctypes.c_void_p(0))
    _configured = True


def ensure_backend() -> None:
    """Initialise the llama.cpp backend once, silencing its log unless it was configured already.

    Called before any model is loaded; safe to call repeatedly.
    """
    global _backend_ready
    if not _configured:
        configure_logging(False)
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _backend_ready = True


@contextlib.contextmanager
def capture_errors() -> Iterator[list[str]]:
    """Collect the error messages llama.cpp logs inside the block, one stripped line each.

    The yielded list fills while the block runs; blocks nest, each seeing only its own messages.
    """
    global _captured
    outer, _captured = _captured, []
    lines = _captured
    try:
        yield lines
    finally:
        _captured = outer
        stripped = [line.strip() for line in lines]
        lines[:] = [line for line in stripped if line]
