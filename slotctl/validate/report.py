"""What ``validate`` found: per layer (:class:`LayerCheck`), per file (:class:`FileReport`) and for a run
(:class:`Report`), with the effects and verdicts they are expressed in."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from slotctl.errors import ExitStatus
from slotctl.server.findings import Finding
from slotctl.validate.setup import ServerSetup


# what a layer's problems make the server do (LayerCheck.effect), worst last
EFFECT_OK = "ok"
EFFECT_DROPPED = "dropped"           # restored without this layer
EFFECT_ABORTS_LATER = "aborts_later"  # restored; aborts when the server rolls back to this checkpoint
EFFECT_REFUSED = "refused"           # "Unable to restore slot"
EFFECT_ABORTS = "aborts"             # llama.cpp aborts the server while restoring
EFFECT_UNDECIDED = "undecided"       # what the server does cannot be told without the model

#: ``FileReport.verdict`` values, from best to worst
VERDICTS = ("restores", "restores_with_drops", "undecided", "aborts", "refused", "unreadable")

# LayerCheck.predicted / .loaded
FITS = "fits"
MISMATCH = "mismatch"
REFUSED = "refused"
PARTIAL = "partial"
ABORTED = "aborted"
SKIPPED = "skipped"

TARGET = "target memory"
DRAFT = "draft"


# -- results ---------------------------------------------------------------------------------------------


@dataclass
class LayerCheck:
    """One memory layer of a file, checked against its context.

    ``predicted``: "fits", "mismatch" or None (no prediction: no model for it). ``loaded``: "fits",
    "refused", "partial" (llama.cpp read fewer bytes than the layer holds), "aborted", "skipped" or
    None (not loaded). ``loader_messages``: what llama.cpp logged when it refused or aborted; ``reason``:
    why it was skipped. ``effect``: what the server does with this layer (see the module docstring).
    """

    layer: str
    offset: int | None
    size: int | None
    context: str                      # "target" or "draft"
    predicted: str | None = None
    loaded: str | None = None
    loader_messages: list[str] = field(default_factory=list)
    reason: str | None = None
    effect: str = EFFECT_OK

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class FileReport:
    path: str
    size: int | None = None
    version: int | None = None
    findings: list[Finding] = field(default_factory=list)
    checks: list[LayerCheck] = field(default_factory=list)
    verdict: str = "restores"
    n_tokens: int | None = None
    #: tokens a restored slot keeps for a request extending the saved prompt (:mod:`slotctl.server.reuse`)
    reuse: dict | None = None
    #: what each step of the server's restore does (``slotctl restore``'s step names and statuses)
    steps: list[dict] = field(default_factory=list)
    #: effects of findings on layers that are not memory layers (header, tokens, appendices)
    effects: list[str] = field(default_factory=list, repr=False)
    #: the file as it was parsed (for callers that show its metadata too: ``slotctl ls``)
    slot_file: object = field(default=None, repr=False)
    #: why the file could not be read at all (verdict "unreadable"): {"code", "message"}
    error: dict | None = None

    @property
    def exit_status(self) -> ExitStatus:
        if self.verdict == "unreadable":
            return ExitStatus.USAGE
        if self.verdict == "undecided":
            return ExitStatus.UNDECIDED
        if self.verdict != "restores" or any(f.severity == "error" for f in self.findings):
            return ExitStatus.FAILED     # refused, aborts, loses a layer, or holds a rollback hazard
        return ExitStatus.OK

    def counts(self) -> dict:
        return {s: sum(f.severity == s for f in self.findings) for s in ("error", "drop", "note")}

    def as_dict(self) -> dict:
        out = {
            "path": self.path,
            "size": self.size,
            "state_version": self.version,
            "n_tokens": self.n_tokens,
            "verdict": self.verdict,
            "exit_code": int(self.exit_status),
            "counts": self.counts(),
            "findings": [f.as_dict() for f in self.findings],
            "checks": [c.as_dict() for c in self.checks],
            "steps": self.steps,
            "reuse": self.reuse,
        }
        if self.error is not None:
            out["error"] = dict(self.error)
        return out


@dataclass
class Report:
    files: list[FileReport]
    setup: ServerSetup
    server: dict
    real_check: bool

    @property
    def exit_status(self) -> ExitStatus:
        codes = {f.exit_status for f in self.files}
        for worst in (ExitStatus.USAGE, ExitStatus.FAILED, ExitStatus.UNDECIDED):
            if worst in codes:
                return worst     # a usage or I/O error first, then a file that fails, then one undecided
        return ExitStatus.OK

    def summary(self) -> dict:
        out = {"files": len(self.files)}
        out.update({v: sum(f.verdict == v for f in self.files) for v in VERDICTS})
        return out

    def as_dict(self) -> dict:
        return {
            "server": {**self.setup.as_dict(), **self.server, "real_check": self.real_check},
            "files": [f.as_dict() for f in self.files],
            "summary": self.summary(),
            "exit_code": int(self.exit_status),
        }


