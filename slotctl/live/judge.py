"""An act judges the file it sends: ``restore --server``, ``keep`` and ``migrate`` read the file they are about
to make a running llama-server restore (``--slot-dir``, the store) and ask validate's verdict for that
server's model and flags (:func:`slotctl.live.prove.local_setup`: what the server reports, this machine's copy
of its model when it has one). A file the server would refuse or abort on
(:attr:`~slotctl.validate.report.FileReport.refused_or_aborts`: a b11434 server dies on a payload cut short,
``GGML_ASSERT(nread <= state_size)``) is not sent unless the caller forces it.

The verdict is validate's (:func:`slotctl.validate.check.validate_file`), never a rule of its own here: a better
verdict there is a better act here.
"""

from __future__ import annotations

import os

from slotctl.errors import ExitStatus, SlotctlError
from slotctl.validate.report import FileReport
from slotctl.validate.setup import Models, ServerSetup


class NotSent(SlotctlError):
    """validate says the server refuses the file or aborts on it: it was not sent (exit 1)."""

    exit_status = ExitStatus.FAILED
    code = "not_sent"

    def __init__(self, message: str, report: FileReport):
        super().__init__(message)
        self.report = report


def judge(path: str | os.PathLike, setup: ServerSetup) -> FileReport:
    """validate's report of ``path`` for ``setup`` (no real load: the prediction and the structure)."""
    from slotctl.validate.check import validate_file

    return validate_file(path, setup, Models(setup))


def why(report: FileReport) -> str:
    """The verdict of ``report`` and its first error, in one line."""
    what = {"refused": "refuses it", "aborts": "aborts on it (the server process dies)",
            "unreadable": "cannot be given it (unreadable)"}.get(str(report.verdict),
                                                                "refuses it or aborts on it (its payload is "
                                                                "cut short)")
    first = next((f for f in report.ordered_findings() if f.severity == "error"), None)
    return f"validate says the server {what}" + (f": {first.layer}: {first.message}" if first is not None else "")


def check_sendable(path: str | os.PathLike, setup: ServerSetup, *, force: bool, remedy: str = "--force") -> FileReport:
    """The report of ``path`` for ``setup``; :class:`NotSent` when the server would refuse or abort on it and
    not ``force`` (``remedy``: the option of the calling command that sends it anyway)."""
    report = judge(path, setup)
    if report.refused_or_aborts and not force:
        raise NotSent(f"{os.fspath(path)}: not sent: {why(report)} ({remedy} sends it anyway)", report)
    return report
