"""The real check's parent side: a child process (:mod:`slotctl.validate.worker`) that loads memory layers
into real contexts, so that an abort inside llama.cpp kills only the child."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import BinaryIO

from slotctl.atomic import copy_range
from slotctl.errors import UsageError
from slotctl.format.memory import MemoryLayout, SectionLayout
from slotctl.validate.report import ABORTED, SKIPPED
from slotctl.validate.setup import ServerSetup


def _layout_dict(layout: MemoryLayout | None) -> dict | None:
    if layout is None:
        return None
    return {"kind": layout.kind, "sections": [dataclasses.asdict(s) for s in layout.sections]}


def _layout_from_dict(d: dict | None) -> MemoryLayout | None:
    if d is None:
        return None
    return MemoryLayout(d["kind"], tuple(SectionLayout(**s) for s in d["sections"]))


class ChildProcess:
    """A child Python process running :func:`worker_main`, which loads layers into real contexts.

    Requests and replies are JSON lines (stdin / stdout of the child; whatever llama.cpp prints goes to
    the child's stderr, kept in a temporary file unless ``verbose``). :meth:`ask` returns None when the
    child died answering, and :meth:`death` then says how: the assertion llama.cpp printed, the signal.
    The next :meth:`ask` starts a new child. One child serves any number of :class:`LoadChecker`
    objects, one after the other (each sends its own ``init`` when the child holds another's contexts).
    """

    def __init__(self, *, verbose: bool = False):
        self.verbose = verbose
        self.started = 0
        #: the init message whose contexts the running child holds, and its reply
        self.current_init: dict | None = None
        self.current_reply: dict | None = None
        self._proc: subprocess.Popen | None = None
        self._stderr = None if verbose else tempfile.TemporaryFile()
        self._mark = 0
        self._rc: int | None = None

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        import slotctl

        root = os.path.dirname(os.path.dirname(os.path.abspath(slotctl.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["GGML_NO_BACKTRACE"] = "1"      # no debugger attaching to an aborting child
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from slotctl.validate.worker import worker_main; worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        self.started += 1
        self.current_init = None

    def ask(self, message: dict, source: tuple | None = None) -> dict | None:
        """Send one request and wait for its reply; None when the child died first. ``source``:
        ``(file, offset, size)``, bytes sent right after the request (the request says ``"inline"``)."""
        if self._proc is None:
            self._start()
        proc = self._proc
        if self._stderr is not None:
            self._stderr.seek(0, os.SEEK_END)
            self._mark = self._stderr.tell()
        try:
            proc.stdin.write((json.dumps(message) + "\n").encode())
            if source is not None:
                f, offset, size = source
                copy_range(f, proc.stdin, offset, size)
            proc.stdin.flush()
            line = proc.stdout.readline()
        except OSError:     # the child died (a broken pipe), or the file ended before the layer did
            line = b""
            try:
                proc.stdin.close()      # a child waiting for the rest of the layer reads the end, and exits
            except OSError:
                pass
        if line:
            return json.loads(line)
        proc.wait()
        self._rc = proc.returncode
        proc.stdout.close()
        proc.stdin.close()
        self._proc, self.current_init = None, None
        return None

    @property
    def aborted(self) -> bool:
        """Whether the child that died last was killed by a signal (SIGABRT: an abort in llama.cpp)."""
        return self._rc is not None and self._rc < 0

    def death(self) -> str:
        """How the child that died last died: the assertion llama.cpp printed, and the signal or exit code."""
        rc = self._rc
        text = ""
        if self._stderr is not None:
            self._stderr.seek(self._mark)
            text = self._stderr.read().decode("utf-8", errors="replace")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        ggml_lines = [ln for ln in lines if "GGML_ASSERT" in ln or "GGML_ABORT" in ln or "error" in ln.lower()]
        said = ggml_lines[-1] if ggml_lines else (lines[-1] if lines else "")
        m = re.match(r"^(\S+?):(\d+): (.*)$", said)
        if m:  # ggml_abort's "/full/path/file.cpp:LINE: message": keep the file's name
            said = f"{os.path.basename(m.group(1))}:{m.group(2)}: {m.group(3)}"
        how = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit code {rc}"
        return f"{said} ({how})" if said else how

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


class LoadChecker:
    """Loads memory layers into real contexts, as a server started with ``setup`` would, in a child process.

    The child (:class:`ChildProcess`, running :func:`worker_main`) loads the models and builds the
    contexts once (:meth:`slotctl.runtime.slot.ServerContexts.open`), then answers one request per layer:
    read the bytes from the file, convert them to the runtime's state version, restore them into the slot
    (``llama_state_seq_set_data_ext``, after emptying it) and say whether every byte was consumed, with
    llama.cpp's reasons when not. An abort inside llama.cpp kills only the child: the layer is reported as
    aborted, with the assertion llama.cpp printed, and the next request starts a new child.

    ``child``: a :class:`ChildProcess` to share (left open by :meth:`close`); by default one of its own.
    """

    def __init__(self, setup: ServerSetup, *, verbose: bool = False, child: ChildProcess | None = None):
        if setup.target is None:
            raise UsageError("the real check needs a target model (-m)")
        self.setup = setup
        self.failure: str | None = None
        self.runtime_version: int | None = None
        self._own = child is None
        self.child = child or ChildProcess(verbose=verbose)
        self._contexts: dict | None = None
        s = setup
        draft = None
        if s.draft is not None:   # the draft context the server builds, if any (-md alone builds none)
            from slotctl.server.speculative import runtime_draft_model

            try:
                draft = runtime_draft_model(s.spec_type, s.target, s.draft)[0]
            except UsageError:    # an MTP context: not built by the runtime; the prediction decides
                draft = None
        self._init = {"init": True, "target": os.fspath(s.target), "draft": os.fspath(draft) if draft else None,
                      "settings": dataclasses.asdict(s.settings), "draft_type_k": s.draft_type_k.lower(),
                      "draft_type_v": s.draft_type_v.lower(), "verbose": self.child.verbose}

    def __enter__(self) -> LoadChecker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ready(self) -> bool:
        """Make the child hold this setup's contexts; False (``failure`` says why) when it cannot."""
        if self.failure is not None:
            return False
        reply = self.child.current_reply if self.child.current_init == self._init else self.child.ask(self._init)
        if reply is None:
            self.failure = f"the child process died building the contexts ({self.child.death()})"
        elif not reply.get("ok"):
            self.failure = f"cannot build the contexts here: {reply.get('error')}"
        else:
            self.child.current_init, self.child.current_reply = self._init, reply
            self._contexts = {"target": reply["target"], "draft": reply.get("draft")}
            self.runtime_version = reply["state_version"]
            return True
        return False

    def contexts(self) -> dict | None:
        """What the child built (``n_ctx``, ``n_ctx_seq``, ... of each context), or None when it could
        not (``failure`` says why)."""
        return self._contexts if self._ready() else None

    def load(self, step: dict, f: BinaryIO) -> dict:
        """Load one layer; the result has ``status`` ("fits", "refused", "partial", "aborted",
        "skipped"), ``consumed``, ``expected``, ``errors`` (llama.cpp's messages) and ``reason``.
        ``f``: the slot file, open (the parsed file's own stream): the layer's bytes go to the child through
        the pipe, and the child opens nothing (``step["path"]`` only names the file in messages)."""
        if not self._ready():
            return {"status": SKIPPED, "reason": self.failure}
        reply = self.child.ask({**step, "inline": True}, (f, step["offset"], step["size"]))
        if reply is not None:
            return reply
        if self.child.aborted:
            return {"status": ABORTED, "errors": [self.child.death()], "consumed": 0, "expected": None}
        return {"status": SKIPPED, "reason": f"the child process failed ({self.child.death()})"}

    def close(self) -> None:
        if self._own:
            self.child.close()


