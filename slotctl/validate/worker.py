"""The child process of :class:`slotctl.validate.child.LoadChecker`: loads memory layers into real
contexts built like the server's. With :mod:`slotctl.runtime`, the only code of slotctl that runs llama.cpp
(imported inside :func:`worker_main`, so that importing this module stays light)."""

from __future__ import annotations

import json
import os
import sys

from slotctl.errors import FormatError
from slotctl.format.blob import BLOB_HEADER_SIZE
from slotctl.model.settings import ContextSettings
from slotctl.validate.child import _layout_from_dict
from slotctl.validate.report import FITS, PARTIAL, REFUSED, SKIPPED


def worker_main() -> None:
    """The child of :class:`LoadChecker`: JSON requests on stdin, one JSON reply per line on stdout.

    ``init`` requests (re)build the contexts; every other request loads one layer.
    """
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)            # whatever llama.cpp prints goes to stderr, never into the replies

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    from slotctl.runtime.context import STATE_VERSION
    from slotctl.runtime.log import configure_logging
    from slotctl.runtime.slot import ServerContexts

    sc = None
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("init"):
            if sc is not None:
                sc.close()
                sc = None
            configure_logging(bool(msg.get("verbose")))
            try:
                sc = ServerContexts.open(msg["target"], ContextSettings(**msg["settings"]), draft_path=msg["draft"],
                                         draft_type_k=msg["draft_type_k"], draft_type_v=msg["draft_type_v"])
            except Exception as e:  # noqa: BLE001 - any failure is reported to the parent
                reply({"ok": False, "error": str(e)})
                continue
            reply({"ok": True, "state_version": STATE_VERSION, "target": _ctx_info(sc.target),
                   "draft": _ctx_info(sc.draft) if sc.draft is not None else None})
            continue
        try:
            reply(_load_step(sc, msg, STATE_VERSION))
        except Exception as e:  # noqa: BLE001 - a failure of this process is not llama.cpp's verdict
            reply({"status": SKIPPED, "reason": f"internal error: {type(e).__name__}: {e}"})


def _ctx_info(c) -> dict:
    return {"n_ctx": c.n_ctx, "n_ctx_seq": c.n_ctx_seq, "n_seq_max": c.n_seq_max, "n_ctx_slot": c.n_ctx_slot}


def _load_step(sc, step: dict, state_version: int) -> dict:
    """Read, convert and restore one layer (in the child), holding as few copies of it as it can: one
    for a layer of this runtime's version, three at the peak of a conversion (:func:`convert_payload`)."""
    from slotctl.format.blob import blob_header
    from slotctl.format.convert import convert_payload
    from slotctl.model.predict import rotation_rule

    ctx = sc.target if step["ctx"] == "target" else sc.draft
    info = sc.target_info if step["ctx"] == "target" else sc.draft_info
    size = step["size"]
    with open(step["path"], "rb") as f:
        f.seek(step["offset"])
        if step["blob"]:
            header, size = f.read(min(size, BLOB_HEADER_SIZE)), max(size - BLOB_HEADER_SIZE, 0)
        else:
            header = blob_header(step["slot"])
        if step["version"] == state_version:
            buf = bytearray(len(header) + size)
            buf[:len(header)] = header
            got = f.readinto(memoryview(buf)[len(header):])
            del buf[len(header) + got:]
        else:
            payload = f.read(size)
            try:
                payload = convert_payload(payload, _layout_from_dict(step["layout"]), step["version"], state_version,
                                          rotations=rotation_rule(info), layer=f"{step['ctx']} layer")
            except FormatError as e:
                return {"status": SKIPPED, "reason": f"its conversion to state version {state_version} (this "
                                                     f"runtime's) is refused: {e.expected}"}
            buf = bytearray(header)
            buf += payload
            del payload
    slot = step["slot"]
    ctx.seq_rm(slot)
    n = ctx.state_seq_set(buf, slot, step["flags"])
    status = FITS if n == len(buf) or (n and step.get("prefix")) else (PARTIAL if n else REFUSED)
    return {"status": status, "consumed": n, "expected": len(buf), "errors": ctx.last_errors}


