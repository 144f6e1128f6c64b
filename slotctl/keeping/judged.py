"""A stored state judged for one slot of a running server: validate's verdict on its bytes as they are, what a
request extending it keeps, and when the verdict is not ``restores``, whether the conversion step can bring it
over (:mod:`slotctl.keeping.conversion`) and, once converted, the converted file's verdict.

One record for every reader (keep restores what is sendable, serve what restores, the fleet view shows it), in
neutral words: each reader says it in its own (:meth:`Judged.refusal`). The catalog keeps it per state
identity and question (:meth:`Judged.as_row`, :meth:`Judged.from_row`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the verdicts of a file the server restores (validate's words)
RESTORES = ("restores", "restores_with_drops")


@dataclass
class After:
    """The verdict on a state once converted for the server: validate's, whether an act would send it
    (``sendable``: the server neither refuses it nor aborts on it), its first error and its verdict in one
    line (:func:`slotctl.live.judge.why`)."""

    verdict: str
    sendable: bool
    error: str | None
    why: str

    def as_row(self) -> dict:
        return {"verdict": self.verdict, "sendable": self.sendable, "error": self.error, "why": self.why}

    @classmethod
    def from_row(cls, row) -> "After | None":
        if not (isinstance(row, dict) and isinstance(row.get("verdict"), str)
                and isinstance(row.get("sendable"), bool) and _opt(row.get("error"), str)
                and isinstance(row.get("why"), str)):
            return None
        return cls(row["verdict"], row["sendable"], row["error"], row["why"])


def _opt(value, kind) -> bool:
    return value is None or (isinstance(value, kind) and not isinstance(value, bool))


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


@dataclass
class Judged:
    """validate's verdict on a stored state for one slot of the server now running (:func:`judge_file`).

    ``verdict``, ``sendable`` (the server neither refuses it nor aborts on it: keep and restore send such a
    file), ``n_tokens`` (its prompt's), ``kind`` (its memory's) and the server's ``n_swa``; ``extending`` and
    ``reuse_reason``: the prompt tokens a request extending the whole state keeps and why not all, by the
    rule of the server's build (None: no prediction); ``error``: its first error finding, ``layer:
    message``; ``why``: its verdict and first error in one line (:func:`slotctl.live.judge.why`); ``parsed``:
    the file parsed whole (a damaged file is not converted: judged as it is).

    When it is not restored as it is: ``convert``, the changes the conversion step makes for this server
    (exact, and the lossy ones only when they are allowed), or why it cannot be converted: ``lossy`` (the
    re-encodings it would take, not allowed), ``not_converted`` (the conversion refuses it, or planning it
    failed); ``after``: the converted file's verdict, once it was judged (:class:`After`).

    ``identity``: the identity of the bytes the verdict was made on (:func:`slotctl.catalog.local_identity`,
    or :func:`~slotctl.catalog.object_identity` of the ETag the reads were pinned to; None: the store gives
    none): a state is sent only while it has this identity; ``changed_ns``: when the file last changed, as the
    identity says (the catalog's racy rule); ``catalog``: the verdict came from the catalog (the file was not
    opened to judge it)."""

    verdict: str
    sendable: bool
    n_tokens: int | None
    kind: str | None
    n_swa: int
    extending: int | None
    reuse_reason: str | None = None
    error: str | None = None
    why: str = ""
    parsed: bool = False
    convert: list[str] | None = None
    lossy: list[str] | None = None
    not_converted: str | None = None
    after: After | None = None
    identity: str | None = field(default=None, compare=False)
    changed_ns: int = field(default=0, compare=False)
    catalog: bool = field(default=False, compare=False)

    @property
    def restores(self) -> bool:
        """validate says the server restores it whole: nothing dropped, nothing refused (what serve sends)."""
        return self.verdict == "restores"

    def refusal(self, *, who: str, remedy: str) -> str | None:
        """Why the conversion step cannot bring the state over, in the words of its reader (``who``: the
        server, or the destination; ``remedy``: what allows a lossy conversion there); None when it can, or
        was not asked."""
        from slotctl.keeping.conversion import lossy_refusal

        if self.not_converted is not None:
            return self.not_converted
        if self.lossy:
            return lossy_refusal(who, self.lossy, remedy)
        return None

    def as_row(self) -> dict:
        """What the catalog keeps of the verdict (JSON values; the identity is the row's own)."""
        return {"verdict": self.verdict, "sendable": self.sendable, "n_tokens": self.n_tokens, "kind": self.kind,
                "n_swa": self.n_swa, "extending": self.extending, "reuse_reason": self.reuse_reason,
                "error": self.error, "why": self.why, "parsed": self.parsed, "convert": self.convert,
                "lossy": self.lossy, "not_converted": self.not_converted,
                "after": self.after.as_row() if self.after is not None else None}

    @classmethod
    def from_row(cls, row: dict, identity: str, changed_ns: int) -> "Judged | None":
        """The verdict :meth:`as_row` kept, for the file at ``identity``; None when the row is not one (a damaged
        index may hold anything: nothing but these keys, of these types, is taken)."""
        g = row.get
        after = After.from_row(g("after")) if g("after") is not None else None
        if not (isinstance(g("verdict"), str) and isinstance(g("sendable"), bool) and _opt(g("n_tokens"), int)
                and _opt(g("kind"), str) and isinstance(g("n_swa"), int) and not isinstance(g("n_swa"), bool)
                and _opt(g("extending"), int) and _opt(g("reuse_reason"), str) and _opt(g("error"), str)
                and isinstance(g("why"), str) and isinstance(g("parsed"), bool)
                and (g("convert") is None or _strings(g("convert"))) and (g("lossy") is None or _strings(g("lossy")))
                and _opt(g("not_converted"), str) and (g("after") is None or after is not None)):
            return None
        return cls(g("verdict"), g("sendable"), g("n_tokens"), g("kind"), g("n_swa"), g("extending"),
                   g("reuse_reason"), g("error"), g("why"), g("parsed"), g("convert"), g("lossy"),
                   g("not_converted"), after, identity, changed_ns, catalog=True)


def judge_file(where: str, setup, *, reads_checkpoints: bool) -> Judged:
    """validate's verdict on the file ``where`` (a local path or an ``s3://`` object, read by ranges) for
    ``setup``, what a request extending it keeps by the rule of a server that reads a file's checkpoints or
    not (``reads_checkpoints``: :func:`slotctl.live.prove.server_reads_checkpoints`), and the identity of the
    bytes it was made on (the open file's ``fstat``; the ETag an object's reads were pinned to). OSError when
    the file cannot be opened."""
    import os

    from slotctl.catalog import local_identity, object_identity
    from slotctl.live.judge import why
    from slotctl.server.reuse import reuse_for, server_n_swa
    from slotctl.sources import open_input
    from slotctl.validate.check import validate_file
    from slotctl.validate.setup import Models

    models = Models(setup)
    with open_input(where) as f:
        if where.startswith("s3://"):
            identity = object_identity(getattr(f, "etag", None), f.size)
            changed = int((getattr(f, "mtime", None) or 0) * 1e9)
        else:
            st = os.fstat(f.fileno())
            identity, changed = local_identity(st), st.st_mtime_ns
        report = validate_file(where, setup, models, f=f)
        sf = report.slot_file
        n_swa = server_n_swa(models.target, swa_full=setup.settings.swa_full) if models.target is not None else 0
        extending = reason = None
        parsed = sf is not None and sf.target is not None and not sf.errors
        kind = sf.target.layout.kind if sf is not None and sf.target is not None else None
        if sf is not None and sf.target is not None:
            r = reuse_for(sf, models.target, swa_full=setup.settings.swa_full,
                          n_ctx_checkpoints=setup.n_ctx_checkpoints, reads_checkpoints=reads_checkpoints, extends=True,
                          build=setup.build)     # the server's own build's rules (live.prove.local_setup: /props)
            if r is not None:
                extending, reason = ((r.n_reused, r.reason) if reads_checkpoints
                                     else (r.n_reused_b11434, r.reason_b11434))
        sendable = not report.refused_or_aborts
        if sf is not None:
            sf.close()
    first = next((f for f in report.findings if f.severity == "error"), None)
    return Judged(str(report.verdict), sendable, report.n_tokens, kind, n_swa, extending, reason,
                  f"{first.layer}: {first.message}" if first else None, why(report), parsed=parsed,
                  identity=identity, changed_ns=changed)
