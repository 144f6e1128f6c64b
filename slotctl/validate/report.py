"""What ``validate`` found: per layer (:class:`LayerCheck`), per file (:class:`FileReport`) and for a run
(:class:`Report`), with the effects and verdicts they are expressed in."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from slotctl.errors import ExitStatus, worst
from slotctl.server.findings import Finding
from slotctl.validate.words import SEVERITIES, VERDICTS, Effect, Load, Verdict  # noqa: F401 - named here too
from slotctl.validate.setup import ServerSetup
from slotctl.validate.wording import ROLLBACK_HARMLESS


# the members by the names the checks write them with
(EFFECT_OK, EFFECT_DROPPED, EFFECT_ABORTS_LATER, EFFECT_REFUSED, EFFECT_ABORTS, EFFECT_UNDECIDED, EFFECT_OTHER_MODEL,
 EFFECT_CORRUPT) = Effect
FITS, MISMATCH, REFUSED, PARTIAL, ABORTED, SKIPPED = Load

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
    verdict: Verdict = Verdict.RESTORES
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
    #: why the verdict is not settled by the sources slotctl reads (undefined behaviour in b11434's loader,
    #: a reading of code neither sdist holds); empty: the verdict is certain
    uncertain: list[str] = field(default_factory=list)
    #: the llama-server build the verdict is for (:mod:`slotctl.server.builds`)
    build: str | None = None

    @property
    def certain(self) -> bool:
        return not self.uncertain

    @property
    def refused_or_aborts(self) -> bool:
        """The server refuses the file or aborts on it, for the setup it was judged for: its verdict says so,
        or its payload is cut short (undecided which, one or the other); or it restores a state that is not the
        one stored or not this model's (``corrupt``, ``other_model``). An act (``restore --server``, ``keep``,
        ``migrate``) never sends such a file unless forced (and never those two, forced or not)."""
        if Verdict(self.verdict).broken or self.verdict == Verdict.OTHER_MODEL:
            return True
        sf = self.slot_file
        return self.verdict == Verdict.UNDECIDED and bool(getattr(sf, "payload_cut", False))

    @property
    def exit_status(self) -> ExitStatus:
        if self.verdict == Verdict.UNREADABLE:
            return ExitStatus.USAGE
        if self.verdict == Verdict.UNDECIDED:
            return ExitStatus.UNDECIDED
        if self.verdict != Verdict.RESTORES or any(f.severity == "error" for f in self.findings):
            return ExitStatus.FAILED     # refused, aborts, loses a layer, or holds a rollback hazard
        return ExitStatus.OK

    def ordered_findings(self) -> list[Finding]:
        """The findings worst first (errors, drops, notes; in the order found within each), as both outputs
        show them. On a file the server refuses or aborts on, a checkpoint's note no longer says the file
        restores with it: the server stops before it reads the checkpoints."""
        stops = {Verdict.REFUSED: "refuses", Verdict.ABORTS: "aborts on"}.get(self.verdict)
        out = []
        for f in sorted(self.findings, key=lambda f: SEVERITIES.index(f.severity)):
            if stops and f.message.endswith("; " + ROLLBACK_HARMLESS):
                f = dataclasses.replace(f, message=f.message.removesuffix(ROLLBACK_HARMLESS)
                                        + f"not reached: the server {stops} the file before it reads its checkpoints")
            out.append(f)
        return out

    def counts(self) -> dict:
        return {s: sum(f.severity == s for f in self.findings) for s in ("error", "drop", "note")}

    def as_dict(self) -> dict:
        out = {
            "path": self.path,
            "size": self.size,
            "state_version": self.version,
            "n_tokens": self.n_tokens,
            "build": self.build,
            "verdict": self.verdict,
            "certain": self.certain,
            "uncertain": list(self.uncertain),
            "exit_code": int(self.exit_status),
            "counts": self.counts(),
            "findings": [f.as_dict() for f in self.ordered_findings()],
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
        return worst(f.exit_status for f in self.files)   # 2, then 1, then 3

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


