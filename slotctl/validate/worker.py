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

    ``init`` requests (re)build the contexts; every other request loads one layer, whose bytes follow the
    request on stdin (the parent read them from the file it holds open: this process opens no slot file).
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
    stdin = sys.stdin.buffer
    for line in iter(stdin.readline, b""):
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
            data = _layer_bytes(msg, stdin)
            reply(_load_step(sc, msg, data, STATE_VERSION))
        except Exception as e:  # noqa: BLE001 - a failure of this process is not llama.cpp's verdict
            reply({"status": SKIPPED, "reason": f"internal error: {type(e).__name__}: {e}"})


def _ctx_info(c) -> dict:
    return {"n_ctx": c.n_ctx, "n_ctx_seq": c.n_ctx_seq, "n_seq_max": c.n_seq_max, "n_ctx_slot": c.n_ctx_slot}


def _layer_bytes(step: dict, stdin) -> bytearray:
    """The layer's ``size`` bytes, from stdin right after the request. A short read (the parent stopped:
    the file it read them from ended) gives fewer bytes."""
    data = bytearray(step["size"])
    view = memoryview(data)
    got = 0
    while got < len(data):
        n = stdin.readinto(view[got:])
        if not n:
            break
        got += n
    view.release()
    del data[got:]
    return data


def _load_step(sc, step: dict, data: bytearray, state_version: int) -> dict:
    """Convert and restore one layer (in the child), holding as few copies of it as it can: one for a
    layer of this runtime's version (``data`` itself, the blob header put in front), three at the peak of
    a conversion (:func:`convert_payload`)."""
    from slotctl.format.blob import blob_header
    from slotctl.format.convert import convert_payload
    from slotctl.model.predict import rotation_rule

    ctx = sc.target if step["ctx"] == "target" else sc.draft
    info = sc.target_info if step["ctx"] == "target" else sc.draft_info
    if step["blob"]:
        n_head = min(len(data), BLOB_HEADER_SIZE)
    else:
        data[0:0] = blob_header(step["slot"])
        n_head = BLOB_HEADER_SIZE
    if step["version"] == state_version:
        buf = data
    else:
        try:
            payload = convert_payload(bytes(data[n_head:]), _layout_from_dict(step["layout"]), step["version"],
                                      state_version, rotations=rotation_rule(info), layer=f"{step['ctx']} layer")
        except FormatError as e:
            return {"status": SKIPPED, "reason": f"its conversion to state version {state_version} (this "
                                                 f"runtime's) is refused: {e.expected}"}
        del data[n_head:]
        buf = data
        buf += payload
        del payload
    slot = step["slot"]
    ctx.seq_rm(slot)
    n = ctx.state_seq_set(buf, slot, step["flags"])
    status = FITS if n == len(buf) or (n and step.get("prefix")) else (PARTIAL if n else REFUSED)
    return {"status": status, "consumed": n, "expected": len(buf), "errors": ctx.last_errors}
