"""What llama-server b11669 logs of a restore, read as validate's steps (tests/test_b11669.py,
test_agreement.py): the checkpoint and draft-state lines of ``load_slot_checkpoints`` / ``load_slot_draft``
(b11669 server-context.cpp), a restore with the lines it made, validate's steps in the same words."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from llama_server import LlamaServer

#: the restore's log lines (b11669 server-context.cpp load_slot_checkpoints / load_slot_draft), as steps
CKPT_RESTORED = re.compile(r"restored (\d+) context checkpoint\(s\) from")
CKPT_IGNORED = re.compile(r"(invalid|truncated) context checkpoint appendix in .* - ignored")
CKPT_DRAFT_DROPPED = re.compile(r"draft context checkpoint data in .* does not match the draft context - dropped")
DRAFT_RESTORED = re.compile(r"restored the draft state \([0-9.]+ MiB\) from")
DRAFT_DROPPED = re.compile(r"(?<!checkpoint data in )'[^']*' does not match the draft context - dropped")
DRAFT_IGNORED = re.compile(r"invalid draft state in .* - ignored")


@dataclass
class Restored:
    """One restore: the HTTP answer and what the server logged about the file's appendices."""

    status: int
    answer: dict
    lines: list[str]

    @property
    def steps(self) -> dict[str, str]:
        """The checkpoint and draft steps in validate's words, from the log lines."""
        text = "\n".join(self.lines)
        m = CKPT_RESTORED.search(text)
        ck = f"restored {m.group(1)}" if m else "ignored" if CKPT_IGNORED.search(text) else "absent"
        dr = ("restored" if DRAFT_RESTORED.search(text) else "dropped" if DRAFT_DROPPED.search(text)
              else "ignored" if DRAFT_IGNORED.search(text) else "absent")
        return {"checkpoints": ck, "draft": dr}

    @property
    def checkpoint_drafts_dropped(self) -> bool:
        return any(CKPT_DRAFT_DROPPED.search(line) for line in self.lines)


def wait_log(srv: LlamaServer, pattern: str, after: int = 0, timeout: float = 30) -> list[str]:
    """The server's log lines after line ``after`` up to the first that matches ``pattern`` (bounded: the
    server writes its log from a thread of its own, after its answer)."""
    return srv.wait_for_log(pattern, after, timeout)


def restore(srv: LlamaServer, name: str, slot: int = 0, *, lines: bool = True) -> Restored:
    """Restore ``name`` into ``slot``; with ``lines``, what the server logged of it, up to the error line of a
    restore of a file that does not exist (a marker: the log is written in order, after the answers)."""
    before = len(srv.log_text().splitlines())
    status, answer = srv.restore(slot, name)
    said = []
    if lines:
        marker = f"no-such-file-{time.monotonic_ns()}.bin"
        srv.restore(slot, marker)
        said = [line for line in wait_log(srv, re.escape(marker), before) if "load_slot" in line]
    return Restored(status, answer if isinstance(answer, dict) else {"text": answer}, said)


def steps_of(rep: dict) -> dict[str, str]:
    steps = {s["step"]: s for s in rep["steps"]}
    ck = steps["checkpoints"]
    return {"checkpoints": f"restored {ck['kept']}" if ck["status"] == "restored" else ck["status"],
            "draft": steps["draft"]["status"]}
