"""``slotctl migrate``: move a slot from one running llama-server to another, proven by the destination.

The steps, each with its outcome (:class:`Step`), stopping at the first that does not succeed; each is a method
of :class:`_Migrator` named as the step, written in this order:

1. ``source``: the source's facts (``/props``, ``/slots``, ``/v1/models``); the slot exists; its model told by
   its content (:func:`slotctl.live.identity.identify`: the file ``/props`` names, on this machine), else
   refused (a model that cannot be read here is not known);
2. ``destination``: the destination's facts; the slot exists; the destination runs the source's model: as far
   as the servers report it (``/v1/models`` meta: vocabulary, embedding size, parameters, tensor bytes,
   training context: :func:`other_model`) and by its content (the two files' digests), else refused;
3. ``save``: the source saves the slot into its ``--slot-save-path`` (``--from-dir`` here);
4. ``fetch``: the saved file holds the slot's tokens in the size the source answered; its checksum made
   (:mod:`slotctl.seal`); a state that carries a draft state moves only with ``draft_model`` (no server
   reports its draft model: the one both servers run), else refused;
5. ``check``: the conversion the destination's flags need (the conversion step keep and serve take too,
   :mod:`slotctl.keeping.conversion`: ``-np``/``-kvu`` streams, exact; cache types, lossy, only with
   ``allow_lossy``), then validate's verdict for the converted file
   and the destination's own model and flags (:func:`slotctl.live.prove.local_setup`): refused when the
   destination would refuse it (another model, a context too small, ...);
6. ``store`` (with ``store``): the (converted) file written into the store (a directory or an ``s3://``
   prefix, :mod:`slotctl.keeping.store`), never over a file of that name; the next step places the store's copy,
   read back and checked against the checksum the conversion made;
7. ``place``: the (converted) file written into ``--to-dir`` atomically, under the same name, its bytes checked
   against the checksum as they are copied (a file whose bytes changed on the way is never restored);
8. ``restore``: the destination restores it into its slot;
9. ``prove``: the proving request (:mod:`slotctl.live.prove`; not sent where it would spend the restore);
10. ``cleanup``: after a migration that succeeded, the working files are removed (the source's save in
    ``--from-dir``, the copy placed in ``--to-dir``; a ``store`` keeps its copy).

The destination's slot, when not given, is the source's slot number if the destination has it, else an
idle slot of the destination (:func:`default_slot`). A file validate says the destination refuses or aborts
on is never placed unless ``force``.

Nothing reaches the destination before step 7: a refusal leaves it untouched. The source's slot is only
saved (``action=save`` reads the slot, changes nothing), so a failure anywhere leaves it as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from slotctl.errors import ExitStatus, SlotctlError, UsageError, error_entry
from slotctl.keeping.conversion import Conversion, Refused, convert_for
from slotctl.keeping.names import IDENTITY_KEYS
from slotctl.keeping.store import copy_atomic, read_saved
from slotctl.live import http
from slotctl.live.prove import Proof, local_setup
from slotctl.live.prove import prove as prove_restore   # the step is the method _Migrator.prove
from slotctl.server.flags import ServerFlags

STEPS = ("source", "destination", "save", "fetch", "check", "store", "place", "restore", "prove", "cleanup")


@dataclass
class Step:
    """One step: ``status`` "ok", "refused" (cannot work: exit 1), "failed" (an error: its exit code),
    "skipped" (an earlier step did not succeed); ``message`` what happened; ``details`` the step's figures."""

    step: str
    status: str = "skipped"
    message: str | None = None
    ms: float | None = None
    details: dict = field(default_factory=dict)
    error: dict | None = None

    def as_dict(self) -> dict:
        return {"step": self.step, "status": self.status, "message": self.message,
                "ms": round(self.ms, 3) if self.ms is not None else None, "details": self.details,
                "error": self.error}


@dataclass
class Migration:
    """What :func:`migrate` did: every step, the proof (when it got that far), the exit status."""

    source: dict
    destination: dict
    name: str
    steps: list[Step]
    proof: Proof | None = None
    exit_status: ExitStatus = ExitStatus.OK

    def as_dict(self) -> dict:
        return {"from": self.source, "to": self.destination, "name": self.name,
                "steps": [s.as_dict() for s in self.steps],
                "proof": self.proof.as_dict() if self.proof is not None else None,
                "exit_code": int(self.exit_status)}


def other_model(src: http.ServerFacts, dst: http.ServerFacts) -> str | None:
    """Why the destination does not run the source's model, as far as the two servers report their
    models (``/v1/models`` meta); None when they agree or neither says."""
    a, b = src.model_meta or {}, dst.model_meta or {}
    diffs = [f"{k} {a[k]:,} there, {b[k]:,} here" for k in IDENTITY_KEYS
             if isinstance(a.get(k), int) and isinstance(b.get(k), int) and a[k] != b[k]]
    if not diffs:
        return None
    names = f" ({os.path.basename(src.model_path or '?')} -> {os.path.basename(dst.model_path or '?')})"
    return f"the destination runs another model than the source{names}: {'; '.join(diffs)} (GET /v1/models)"


def default_name(slot: int) -> str:
    """The file name a migration saves under when none is given."""
    return f"migrate-slot{slot}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}.bin"


def migrate(src_url: str, src_slot: int, dst_url: str, dst_slot: int | None, *, from_dir: str | os.PathLike,
            to_dir: str | os.PathLike, name: str | None = None, store: str | None = None,
            dst_flags: ServerFlags | None = None,
            given: frozenset[str] = frozenset(), allow_lossy: bool = False, api_key: str | None = None,
            to_api_key: str | None = None, timeout: float = 600.0, progress=None, force: bool = False,
            draft_model: str | os.PathLike | None = None, hashing=None) -> Migration:
    """Run the steps of the module docstring. ``dst_flags`` / ``given``: the destination's flags it does not
    report (``-kvu``, ``-ctk``, ``-ctv``), for the fields named in ``given``. ``store``: a directory or an
    ``s3://`` prefix the (converted) file goes through on its way to ``to_dir``, and stays in (step ``store``;
    without it, ``skipped``). ``progress(step name)`` is called
    as each step starts. Errors become the failing step's outcome; UsageError for arguments (before any
    request). ``draft_model``: the draft model both servers run (a state that carries a draft state moves only
    with it); ``hashing(done, total)``: the progress of a model's hashing (once per model file)."""
    name = name or default_name(src_slot)
    http.check_filename(name)
    from_dir, to_dir = Path(from_dir), Path(to_dir)
    for flag, d in (("--from-dir", from_dir), ("--to-dir", to_dir)):
        if not d.is_dir():
            raise UsageError(f"{flag} {d}: not a directory")
    if (to_dir / name).exists() and not _same_dir(from_dir, to_dir):
        raise UsageError(f"{to_dir / name}: exists in --to-dir (give another --name)")
    kept = None
    if store is not None:
        from slotctl.keeping.store import open_store

        kept = open_store(store, to_dir)
        if kept.has(name):
            raise UsageError(f"{kept.where(name)}: exists in --store (give another --name)")
    staging = Path(tempfile.mkdtemp(prefix="slotctl-migrate-"))
    try:
        run = _Migrator(http.normalize_url(src_url), src_slot, http.normalize_url(dst_url), dst_slot,
                        from_dir=from_dir, to_dir=to_dir, name=name, kept=kept, staging=staging,
                        dst_flags=dst_flags, given=given, allow_lossy=allow_lossy, force=force, api_key=api_key,
                        to_key=api_key if to_api_key is None else to_api_key, timeout=timeout,
                        draft_model=draft_model, hashing=hashing)
        for step in STEPS:
            if step == "store" and kept is None:
                continue
            if step == "cleanup" and run.m.exit_status:
                continue     # a failed or unproven migration keeps its files, to look at
            if not run.step(step, progress):
                break
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return run.m


class _Migrator:
    """One migration: a method per step of the module docstring, named as the step and written in the order
    the steps run (:data:`STEPS`). Each takes its :class:`Step`, leaves its figures in the step's details and
    what later steps need in ``self``, and returns its message; :class:`Refused` or an error ends the run."""

    def __init__(self, src_url: str, src_slot: int, dst_url: str, dst_slot: int | None, *, from_dir: Path,
                 to_dir: Path, name: str, kept, staging: Path, dst_flags: ServerFlags | None, given: frozenset[str],
                 allow_lossy: bool, force: bool, api_key: str | None, to_key: str | None, timeout: float,
                 draft_model=None, hashing=None):
        self.src_url, self.src_slot, self.dst_url, self.dst_slot = src_url, src_slot, dst_url, dst_slot
        self.from_dir, self.to_dir, self.name, self.kept, self.staging = from_dir, to_dir, name, kept, staging
        self.dst_flags, self.given, self.allow_lossy, self.force = dst_flags, given, allow_lossy, force
        self.api_key, self.to_key, self.timeout = api_key, to_key, timeout
        self.slot_given = dst_slot is not None
        self.steps = {s: Step(s) for s in STEPS}
        self.m = Migration({"server": src_url, "slot": src_slot, "dir": os.fspath(from_dir)},
                           {"server": dst_url, "slot": dst_slot, "dir": os.fspath(to_dir)}, name,
                           list(self.steps.values()))
        self.src: http.ServerFacts | None = None    # the source's facts (source)
        self.dst: http.ServerFacts | None = None    # the destination's facts (destination)
        self.setup = None                           # the destination's model and flags (destination)
        self.damaged: str | None = None             # the saved file's first damage, in one line (fetch)
        self.path: Path | None = None               # the file the source saved (fetch)
        self.placed_from: Path | None = None        # the file that goes to the destination (check, store)
        self.draft_model, self.hashing = draft_model, hashing
        self.src_model = None                       # the source's model by its content (source)
        self.checksum: str | None = None            # the hex SHA-256 of the file that goes (fetch, check)

    def step(self, step: str, progress=None) -> bool:
        """Run the step ``step`` (the method of that name): its outcome recorded, True when it succeeded."""
        s = self.steps[step]
        if progress:
            progress(step)
        t0 = time.perf_counter()
        try:
            s.message = getattr(self, step)(s)
            s.status = "ok"
        except Refused as e:
            s.status, s.message, s.error = "refused", str(e), {"code": e.error_code, "message": str(e)}
            s.details = e.details or s.details
            self.m.exit_status = ExitStatus.FAILED
        except (SlotctlError, OSError) as e:
            err = error_entry(e)
            s.status, s.message, s.error = "failed", err.message, err.as_dict()
            self.m.exit_status = ExitStatus(err.exit_status)
        s.ms = (time.perf_counter() - t0) * 1000
        return s.status == "ok"

    def source(self, s: Step) -> str:
        http.check_slot(self.src_url, self.src_slot, api_key=self.api_key, timeout=self.timeout)
        f = self.src = http.server_facts(self.src_url, self.src_slot, api_key=self.api_key, timeout=self.timeout)
        s.details = {"model": f.model_path, "total_slots": f.total_slots, "n_ctx_slot": f.n_ctx_slot,
                     "build_info": f.build_info}
        self.src_model = _identified(f, self.draft_model, self.hashing, "source")
        s.details["model_digest"] = self.src_model.target.digest
        return (f"{self.src_url}: slot {self.src_slot} of {f.total_slots}, model {f.model_path} (model "
                f"{self.src_model.short} by its content)")

    def destination(self, s: Step) -> str:
        if self.dst_slot is None:
            self.dst_slot = default_slot(self.dst_url, self.src_slot, api_key=self.to_key, timeout=self.timeout)
            self.m.destination["slot"] = self.dst_slot
        http.check_slot(self.dst_url, self.dst_slot, api_key=self.to_key, timeout=self.timeout)
        f = self.dst = http.server_facts(self.dst_url, self.dst_slot, api_key=self.to_key, timeout=self.timeout)
        s.details = {"model": f.model_path, "total_slots": f.total_slots, "n_ctx_slot": f.n_ctx_slot,
                     "build_info": f.build_info, "slot_given": self.slot_given}
        why = other_model(self.src, f)
        if why:
            raise Refused(why)
        dst_model = _identified(f, self.draft_model, self.hashing, "destination")
        s.details["model_digest"] = dst_model.target.digest
        if dst_model.target.digest != self.src_model.target.digest:
            raise Refused(f"the destination runs another model than the source, by their content (model "
                          f"{self.src_model.short} there, {dst_model.short} here: "
                          f"{os.path.basename(self.src.model_path or '?')} -> {os.path.basename(f.model_path or '?')}"
                          f"): the state would restore, and answer as neither")
        self.setup, s.details["notes"] = local_setup(f, self.dst_slot, self.dst_flags, self.given)
        return (f"{self.dst_url}: slot {self.dst_slot} of {f.total_slots}, model {f.model_path} (model "
                f"{dst_model.short}, the source's)")

    def save(self, s: Step) -> str:
        answer = http.save_slot(self.src_url, self.src_slot, self.name, api_key=self.api_key, timeout=self.timeout,
                                check=False)
        s.details = {"answer": answer}
        return (f"slot {self.src_slot} saved to {self.name}: {answer['n_saved']:,} tokens, "
                f"{answer['n_written']:,} bytes")

    def fetch(self, s: Step) -> str:
        path = self.from_dir / self.name
        if not path.is_file():
            raise UsageError(f"{path}: the source answered that it saved {self.name}, but --from-dir holds no such "
                             "file (is --from-dir the source's --slot-save-path?)")
        saved = self.steps["save"].details["answer"]
        got = read_saved(path, saved)
        # a damage is the check's to judge (validate's verdict for the destination; --force sends it)
        self.damaged = got.damage
        if got.mismatch:
            raise Refused(f"{path}: holds {got.n_tokens:,} tokens in {got.size:,} bytes, the source saved "
                          f"{saved['n_saved']:,} in {saved['n_written']:,} (another file under that name?)")
        if got.draft and self.draft_model is None:
            raise Refused(f"{path}: it carries a draft state, and which draft model the servers run is not known (no "
                          f"server reports it): give --draft-model, the draft model both run")
        self.path, self.checksum = path, got.checksum
        s.details = {"path": os.fspath(path), "size": got.size, "n_tokens": got.n_tokens, "state_version": got.version,
                     "checksum": got.checksum}
        return f"{path}: {got.n_tokens:,} tokens, {got.size:,} bytes"

    def check(self, s: Step) -> str:
        from slotctl.live.judge import judge, why

        if self.damaged:   # judged as it is: a damaged file is not converted
            conv = Conversion(self.path, [], {"changes": [], "lossy": [], "converted": False,
                                              "damaged": self.damaged})
        else:
            conv = convert_for(self.path, self.setup, self.staging / self.name, allow_lossy=self.allow_lossy,
                               lossy_remedy="pass --allow-lossy to accept it", who="destination")
        s.details = conv.details
        self.placed_from = conv.path
        if conv.checksum is not None:       # a conversion: the checksum of the file it wrote
            self.checksum = s.details["checksum"] = conv.checksum
        report = judge(conv.path, self.setup)
        s.details["verdict"] = report.verdict
        s.details["findings"] = [f.as_dict() for f in report.findings if f.severity != "note"]
        if report.refused_or_aborts:
            if not self.force:
                raise Refused(f"the destination would not restore the file: {why(report)} (--force sends it anyway)",
                              s.details)
            s.details["forced"] = True
        done = "converted (" + "; ".join(conv.changes) + ")" if conv.changes else "no conversion needed"
        forced = " (sent with --force)" if s.details.get("forced") else ""
        return f"{done}; validate for the destination: {report.verdict}{forced}"

    def store(self, s: Step) -> str:
        kept, name = self.kept, self.name
        from slotctl.seal import checksum_file, verify

        kept.put(self.placed_from, name, move=False)
        (self.staging / "from-store").mkdir(exist_ok=True)
        local = kept.local(name, self.staging / "from-store")
        verify(kept.where(name), self.checksum, checksum_file(local))       # the store's copy, read back
        s.details = {"where": kept.where(name), "checksum": self.checksum}
        self.placed_from = local
        return f"{kept.where(name)}: written, read back and checked"

    def place(self, s: Step) -> str:
        src, dest = self.placed_from, self.to_dir / self.name
        from slotctl.seal import checksum_file, verify

        if self.kept is not None and os.fspath(src) == os.fspath(dest):
            s.details = {"path": os.fspath(dest), "copied": False}
            return f"{dest}: already there (--store is --to-dir, checked)"
        if src == self.path and _same_dir(self.from_dir, self.to_dir):
            verify(dest, self.checksum, checksum_file(dest))
            s.details = {"path": os.fspath(dest), "copied": False}
            return f"{dest}: already there (--from-dir and --to-dir are one directory; checked)"
        copy_atomic(src, dest, checksum=self.checksum)      # checked as it is copied: never a changed file
        s.details = {"path": os.fspath(dest), "copied": True, "size": os.path.getsize(dest)}
        return f"{dest}: written ({s.details['size']:,} bytes)"

    def restore(self, s: Step) -> str:
        answer = http.restore_slot(self.dst_url, self.dst_slot, self.name, api_key=self.to_key, timeout=self.timeout,
                                   check=False)
        s.details = {"answer": answer}
        return (f"{self.name} restored into slot {self.dst_slot}: {answer['n_restored']:,} tokens, "
                f"{answer['n_read']:,} bytes")

    def prove(self, s: Step) -> str:
        p = self.m.proof = prove_restore(self.dst_url, self.dst_slot, self.placed_from, self.setup,
                                         build_info=self.dst.build_info, api_key=self.to_key, timeout=self.timeout)
        if p.exit_status:
            self.m.exit_status = p.exit_status
        s.details = {"verdict": p.verdict}
        return p.summary("the destination")

    def cleanup(self, s: Step) -> str:
        """The working files gone: the source's save in --from-dir and the copy placed in --to-dir (the
        destination's slot holds the state now; ``store`` keeps a copy when given)."""
        removed = []
        for p in {os.fspath(self.from_dir / self.name), os.fspath(self.to_dir / self.name)}:
            if self.kept is not None and os.fspath(p) == self.kept.where(self.name):
                continue     # the store's own copy stays
            if os.path.lexists(p):
                os.unlink(p)
                removed.append(p)
        s.details = {"removed": sorted(removed)}
        return f"removed {', '.join(sorted(removed))}" if removed else "nothing to remove"


def _identified(facts: http.ServerFacts, draft_model, hashing, who: str):
    """The model of the server ``facts`` describe, by its content (:func:`slotctl.live.identity.identify`);
    :class:`Refused` naming ``who`` when it cannot be told here."""
    from slotctl.live.identity import Unidentified, identify

    try:
        return identify(facts.model_path, facts.model_meta, draft_model, progress=hashing)
    except Unidentified as e:
        raise Refused(f"the {who}'s model is not known: {e}") from None


def default_slot(url: str, src_slot: int, *, api_key: str | None, timeout: float) -> int:
    """The destination's slot when ``--to-slot`` is not given: the source's slot number when the destination
    has it, else its first idle slot that holds nothing, else its first idle slot, else slot 0 (``GET /slots``)."""
    slots = http.get_slots(url, api_key=api_key, timeout=timeout)
    ids = [e["id"] for e in slots]
    if src_slot in ids:
        return src_slot
    idle = [e for e in slots if not e.get("is_processing")]
    empty = [e["id"] for e in idle if not e.get("n_prompt_tokens")]
    return (empty or [e["id"] for e in idle] or [min(ids, default=0)])[0]


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
