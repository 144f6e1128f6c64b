"""``slotctl migrate``: move a slot from one running llama-server to another, proven by the destination.

The steps, each with its outcome (:class:`Step`), stopping at the first that does not succeed:

1. ``source``: the source's facts (``/props``, ``/slots``, ``/v1/models``); the slot exists;
2. ``destination``: the destination's facts; the slot exists; the destination runs the source's model as far
   as the servers report it (``/v1/models`` meta: vocabulary, embedding size, parameters, tensor bytes,
   training context), else refused (:func:`other_model`);
3. ``save``: the source saves the slot into its ``--slot-save-path`` (``--from-dir`` here);
4. ``fetch``: the saved file parses and holds the slot's tokens;
5. ``check``: the conversion the destination's flags need (:mod:`slotctl.convert`: ``-np``/``-kvu`` streams,
   exact; cache types, lossy, only with ``allow_lossy``), then validate's verdict for the converted file
   and the destination's own model and flags (:func:`slotctl.live.prove.local_setup`): refused when the
   destination would refuse it (another model, a context too small, ...);
6. ``store`` (with ``store``): the (converted) file written into the store (a directory or an ``s3://``
   prefix, :mod:`slotctl.fleet.states`), never over a file of that name; the next step places the store's copy;
7. ``place``: the (converted) file written into ``--to-dir`` atomically, under the same name;
8. ``restore``: the destination restores it into its slot;
9. ``prove``: the proving request (:mod:`slotctl.live.prove`).

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
from slotctl.live import http
from slotctl.live.prove import Proof, local_setup, prove
from slotctl.fleet.states import copy_atomic, read_saved
from slotctl.server.flags import ServerFlags

#: the /v1/models meta keys that tell two models apart (llama_model_n_vocab, n_embd, n_params, size, n_ctx_train)
IDENTITY_KEYS = ("n_vocab", "n_embd", "n_params", "size", "n_ctx_train")

STEPS = ("source", "destination", "save", "fetch", "check", "store", "place", "restore", "prove")


class Refused(SlotctlError):
    """The migration cannot work; nothing was sent to the destination."""

    exit_status = ExitStatus.FAILED
    code = "refused"


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


def migrate(src_url: str, src_slot: int, dst_url: str, dst_slot: int, *, from_dir: str | os.PathLike,
            to_dir: str | os.PathLike, name: str | None = None, store: str | None = None,
            dst_flags: ServerFlags | None = None,
            given: frozenset[str] = frozenset(), allow_lossy: bool = False, api_key: str | None = None,
            to_api_key: str | None = None, timeout: float = 600.0, progress=None) -> Migration:
    """Run the steps of the module docstring. ``dst_flags`` / ``given``: the destination's flags it does not
    report (``-kvu``, ``-ctk``, ``-ctv``), for the fields named in ``given``. ``store``: a directory or an
    ``s3://`` prefix the (converted) file goes through on its way to ``to_dir``, and stays in (step ``store``;
    without it, ``skipped``). ``progress(step name)`` is called
    as each step starts. Errors become the failing step's outcome; UsageError for arguments (before any
    request)."""
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
        from slotctl.fleet.states import open_store

        kept = open_store(store, to_dir)
        if kept.has(name):
            raise UsageError(f"{kept.where(name)}: exists in --store (give another --name)")
    run = _Migrator(http.normalize_url(src_url), src_slot, http.normalize_url(dst_url), dst_slot, from_dir,
                    to_dir, name, kept, dst_flags, given, allow_lossy, api_key,
                    api_key if to_api_key is None else to_api_key, timeout)
    staging = tempfile.mkdtemp(prefix="slotctl-migrate-")
    run.staging = Path(staging)
    try:
        for step in STEPS:
            if step == "store" and kept is None:
                continue
            if not run.step(step, progress):
                break
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return run.m


class _Migrator:
    """One migration: a method per step of the module docstring (named as the step), each returning its
    message and leaving its figures in its :class:`Step`'s details and what later steps need in ``self``."""

    def __init__(self, src_url, src_slot, dst_url, dst_slot, from_dir: Path, to_dir: Path, name: str, kept,
                 dst_flags, given, allow_lossy: bool, api_key, to_key, timeout: float):
        self.src_url, self.src_slot, self.dst_url, self.dst_slot = src_url, src_slot, dst_url, dst_slot
        self.from_dir, self.to_dir, self.name, self.kept = from_dir, to_dir, name, kept
        self.dst_flags, self.given, self.allow_lossy = dst_flags, given, allow_lossy
        self.api_key, self.to_key, self.timeout = api_key, to_key, timeout
        self.steps = {s: Step(s) for s in STEPS}
        self.m = Migration({"server": src_url, "slot": src_slot, "dir": os.fspath(from_dir)},
                           {"server": dst_url, "slot": dst_slot, "dir": os.fspath(to_dir)}, name,
                           list(self.steps.values()))
        self.staging: Path | None = None
        self.src = self.dst = self.setup = None
        self.path: Path | None = None          # the file the source saved (step fetch)
        self.placed_from: Path | None = None   # the file that goes to the destination (check, store)

    def step(self, step: str, progress=None) -> bool:
        """Run the step ``step``: its outcome recorded, True when it succeeded."""
        s = self.steps[step]
        if progress:
            progress(step)
        t0 = time.perf_counter()
        try:
            s.message = getattr(self, step)(s)
            s.status = "ok"
        except Refused as e:
            s.status, s.message, s.error = "refused", str(e), {"code": e.error_code, "message": str(e)}
            self.m.exit_status = ExitStatus.FAILED
        except (SlotctlError, OSError) as e:
            err = error_entry(e)
            s.status, s.message, s.error = "failed", err.message, err.as_dict()
            self.m.exit_status = ExitStatus(err.exit_status)
        s.ms = (time.perf_counter() - t0) * 1000
        return s.status == "ok"

    def _facts(self, url: str, slot: int, api_key) -> http.ServerFacts:
        http.check_slot(url, slot, api_key=api_key, timeout=self.timeout)
        return http.server_facts(url, slot, api_key=api_key, timeout=self.timeout)

    @staticmethod
    def _facts_details(f: http.ServerFacts) -> dict:
        return {"model": f.model_path, "total_slots": f.total_slots, "n_ctx_slot": f.n_ctx_slot,
                "build_info": f.build_info}

    def source(self, s: Step) -> str:
        f = self.src = self._facts(self.src_url, self.src_slot, self.api_key)
        s.details = self._facts_details(f)
        return f"{self.src_url}: slot {self.src_slot} of {f.total_slots}, model {f.model_path}"

    def destination(self, s: Step) -> str:
        f = self.dst = self._facts(self.dst_url, self.dst_slot, self.to_key)
        s.details = self._facts_details(f)
        why = other_model(self.src, f)
        if why:
            raise Refused(why)
        self.setup, s.details["notes"] = local_setup(f, self.dst_slot, self.dst_flags, self.given)
        return f"{self.dst_url}: slot {self.dst_slot} of {f.total_slots}, model {f.model_path}"

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
        saved = read_saved(path, self.steps["save"].details["answer"])
        if saved.problem is not None:
            raise Refused(f"{path}: {saved.problem}" + ("" if saved.damaged else " (another file under that name?)"))
        self.path = path
        s.details = {"path": os.fspath(path), "size": saved.size, "n_tokens": saved.n_tokens,
                     "state_version": saved.version}
        return f"{path}: {saved.n_tokens:,} tokens, {saved.size:,} bytes"

    def check(self, s: Step) -> str:
        from slotctl import convert as conv
        from slotctl.validate.check import validate_file
        from slotctl.validate.setup import Models

        models = Models(self.setup)
        flags = self.setup.flags
        rule = layout = None
        if models.target is not None:
            from slotctl.model.predict import rotation_rule

            rule, layout = rotation_rule(models.target), models.target.layout()
        req = conv.Request(target=conv.Target(conv.stream_count(flags.parallel, flags.kv_unified),
                                              conv.cache_type_id(flags.cache_type_k, "-ctk"),
                                              conv.cache_type_id(flags.cache_type_v, "-ctv"), rule))
        try:
            plan = conv.plan_convert(self.path, req, layout=layout)
        except conv.ConversionRefused as e:
            raise Refused(f"the file cannot be converted for the destination: {e}") from None
        changes = [c.describe() for c in plan.changes]
        lossy = [c.describe() for c in plan.changes if c.what in ("K type", "V type")]
        s.details = {"changes": changes, "lossy": lossy, "converted": bool(plan.changes)}
        if lossy and not self.allow_lossy:
            raise Refused(f"the destination's cache types differ ({'; '.join(lossy)}): re-encoding is lossy, "
                          "pass --allow-lossy to accept it")
        path = self.path
        if plan.changes:
            path = self.staging / self.name
            errors = conv.write_converted(plan, path, layout=layout)
            s.details["max_abs_error"] = max((e.max_abs_error for e in errors), default=None)
        self.placed_from = path
        report = validate_file(path, self.setup, models)
        s.details["verdict"] = report.verdict
        s.details["findings"] = [f.as_dict() for f in report.findings if f.severity != "note"]
        if report.verdict not in ("restores", "restores_with_drops", "undecided"):
            worst = next((f for f in report.findings if f.severity == "error"),
                         next(iter(report.findings), None))
            raise Refused(f"the destination would not restore the file ({report.verdict})"
                          + (f": {worst.layer}: {worst.message}" if worst is not None else ""))
        done = "converted (" + "; ".join(changes) + ")" if changes else "no conversion needed"
        return f"{done}; validate for the destination: {report.verdict}"

    def store(self, s: Step) -> str:
        kept, name = self.kept, self.name
        kept.put(self.placed_from, name, move=False)
        (self.staging / "from-store").mkdir(exist_ok=True)
        local = kept.local(name, self.staging / "from-store")
        s.details = {"where": kept.where(name)}
        self.placed_from = local
        return f"{kept.where(name)}: written"

    def place(self, s: Step) -> str:
        src, dest = self.placed_from, self.to_dir / self.name
        if self.kept is not None and os.fspath(src) == os.fspath(dest):
            s.details = {"path": os.fspath(dest), "copied": False}
            return f"{dest}: already there (--store is --to-dir)"
        if src == self.path and _same_dir(self.from_dir, self.to_dir):
            s.details = {"path": os.fspath(dest), "copied": False}
            return f"{dest}: already there (--from-dir and --to-dir are one directory)"
        copy_atomic(src, dest)
        s.details = {"path": os.fspath(dest), "copied": True, "size": os.path.getsize(dest)}
        return f"{dest}: written ({s.details['size']:,} bytes)"

    def restore(self, s: Step) -> str:
        answer = http.restore_slot(self.dst_url, self.dst_slot, self.name, api_key=self.to_key,
                                   timeout=self.timeout, check=False)
        s.details = {"answer": answer}
        return (f"{self.name} restored into slot {self.dst_slot}: {answer['n_restored']:,} tokens, "
                f"{answer['n_read']:,} bytes")

    def prove(self, s: Step) -> str:
        p = self.m.proof = prove(self.dst_url, self.dst_slot, self.placed_from, self.setup,
                                 build_info=self.dst.build_info, api_key=self.to_key, timeout=self.timeout)
        if p.exit_status:
            self.m.exit_status = p.exit_status
        s.details = {"verdict": p.verdict}
        return (f"{p.verdict}: the destination reused {p.n_reused:,} and evaluated {p.n_evaluated:,} of "
                f"{p.n_prompt:,} prompt tokens")


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
