"""``slotctl migrate``: move a slot from one running llama-server to another, proven by the destination.

The steps, each with its outcome (:class:`Step`), stopping at the first that does not succeed:

1. ``source``: the source's facts (``/props``, ``/slots``, ``/v1/models``); the slot exists;
2. ``destination``: the destination's facts; the slot exists; the destination runs the source's model as far
   as the servers report it (``/v1/models`` meta: vocabulary, embedding size, parameters, tensor bytes,
   training context), else refused (:func:`other_model`);
3. ``save``: the source saves the slot into its ``--slot-save-path`` (``--from-dir`` here);
4. ``fetch``: the saved file holds the slot's tokens in the size the source answered;
5. ``check``: the conversion the destination's flags need (:mod:`slotctl.convert`: ``-np``/``-kvu`` streams,
   exact; cache types, lossy, only with ``allow_lossy``), then validate's verdict for the converted file
   and the destination's own model and flags (:func:`slotctl.live.prove.local_setup`): refused when the
   destination would refuse it (another model, a context too small, ...);
6. ``store`` (with ``store``): the (converted) file written into the store (a directory or an ``s3://``
   prefix, :mod:`slotctl.fleet.states`), never over a file of that name; the next step places the store's copy;
7. ``place``: the (converted) file written into ``--to-dir`` atomically, under the same name;
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
from slotctl.live import http
from slotctl.live.prove import Proof, local_setup, prove
from slotctl.fleet.states import copy_atomic
from slotctl.server.flags import ServerFlags

#: the /v1/models meta keys that tell two models apart (llama_model_n_vocab, n_embd, n_params, size, n_ctx_train)
IDENTITY_KEYS = ("n_vocab", "n_embd", "n_params", "size", "n_ctx_train")

STEPS = ("source", "destination", "save", "fetch", "check", "store", "place", "restore", "prove", "cleanup")


class Refused(SlotctlError):
    """The migration cannot work; nothing was sent to the destination."""

    exit_status = ExitStatus.FAILED
    code = "refused"

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        #: the figures of the step that refused (what a conversion would have changed)
        self.details = details


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


@dataclass
class Conversion:
    """A file made fit for a server's flags (:func:`convert_for`): ``path`` the file to send (the original
    when nothing changes), ``changes`` in words, ``details`` for a step's or an event's figures."""

    path: Path
    changes: list[str]
    details: dict


def convert_for(path: Path, setup, dest: Path, *, allow_lossy: bool, lossy_remedy: str,
                who: str = "server") -> Conversion:
    """``path`` converted for the server of ``setup`` (:mod:`slotctl.convert`: its ``-np``/``-kvu`` streams,
    exact; its cache types, lossy, only with ``allow_lossy``) into ``dest`` when anything changes; the
    one conversion step of ``migrate`` and ``keep``. :class:`Refused` when it cannot be converted, or the
    conversion would be lossy and not allowed (``lossy_remedy``: what the caller's command takes to allow it)."""
    from slotctl import convert as conv
    from slotctl.validate.setup import Models

    models = Models(setup)
    flags = setup.flags
    rule = layout = None
    if models.target is not None:
        from slotctl.model.predict import rotation_rule

        rule, layout = rotation_rule(models.target), models.target.layout()
    req = conv.Request(target=conv.Target(conv.stream_count(flags.parallel, flags.kv_unified),
                                          conv.cache_type_id(flags.cache_type_k, "-ctk"),
                                          conv.cache_type_id(flags.cache_type_v, "-ctv"), rule))
    try:
        plan = conv.plan_convert(path, req, layout=layout)
    except conv.ConversionRefused as e:
        raise Refused(f"the file cannot be converted for the {who}: {e}") from None
    changes = [c.describe() for c in plan.changes]
    lossy = [c.describe() for c in plan.changes if c.what in ("K type", "V type")]
    details = {"changes": changes, "lossy": lossy, "converted": bool(plan.changes)}
    if lossy and not allow_lossy:
        raise Refused(f"the {who}'s cache types differ ({'; '.join(lossy)}): re-encoding is lossy, {lossy_remedy}",
                      details)
    if not plan.changes:
        return Conversion(Path(path), [], details)
    errors = conv.write_converted(plan, dest, layout=layout)
    details["max_abs_error"] = max((e.max_abs_error for e in errors), default=None)
    return Conversion(Path(dest), changes, details)


def default_name(slot: int) -> str:
    """The file name a migration saves under when none is given."""
    return f"migrate-slot{slot}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}.bin"


def migrate(src_url: str, src_slot: int, dst_url: str, dst_slot: int | None, *, from_dir: str | os.PathLike,
            to_dir: str | os.PathLike, name: str | None = None, store: str | None = None,
            dst_flags: ServerFlags | None = None,
            given: frozenset[str] = frozenset(), allow_lossy: bool = False, api_key: str | None = None,
            to_api_key: str | None = None, timeout: float = 600.0, progress=None, force: bool = False) -> Migration:
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
    src_url, dst_url = http.normalize_url(src_url), http.normalize_url(dst_url)
    to_key = api_key if to_api_key is None else to_api_key
    if (to_dir / name).exists() and not _same_dir(from_dir, to_dir):
        raise UsageError(f"{to_dir / name}: exists in --to-dir (give another --name)")
    kept = None
    if store is not None:
        from slotctl.fleet.states import open_store

        kept = open_store(store, to_dir)
        if kept.has(name):
            raise UsageError(f"{kept.where(name)}: exists in --store (give another --name)")
    steps = {s: Step(s) for s in STEPS}
    m = Migration({"server": src_url, "slot": src_slot, "dir": os.fspath(from_dir)},
                  {"server": dst_url, "slot": dst_slot, "dir": os.fspath(to_dir)}, name, list(steps.values()))
    given_slot = dst_slot is not None
    state: dict = {}
    staging = tempfile.mkdtemp(prefix="slotctl-migrate-")

    def run(step: str, fn) -> bool:
        s = steps[step]
        if progress:
            progress(step)
        t0 = time.perf_counter()
        try:
            s.message = fn(s)
            s.status = "ok"
        except Refused as e:
            s.status, s.message, s.error = "refused", str(e), {"code": e.error_code, "message": str(e)}
            s.details = e.details or s.details
            m.exit_status = ExitStatus.FAILED
        except (SlotctlError, OSError) as e:
            err = error_entry(e)
            s.status, s.message, s.error = "failed", err.message, err.as_dict()
            m.exit_status = ExitStatus(err.exit_status)
        s.ms = (time.perf_counter() - t0) * 1000
        return s.status == "ok"

    def source(s: Step) -> str:
        http.check_slot(src_url, src_slot, api_key=api_key, timeout=timeout)
        f = state["src"] = http.server_facts(src_url, src_slot, api_key=api_key, timeout=timeout)
        s.details = {"model": f.model_path, "total_slots": f.total_slots, "n_ctx_slot": f.n_ctx_slot,
                     "build_info": f.build_info}
        return f"{src_url}: slot {src_slot} of {f.total_slots}, model {f.model_path}"

    def destination(s: Step) -> str:
        nonlocal dst_slot
        if dst_slot is None:
            dst_slot = default_slot(dst_url, src_slot, api_key=to_key, timeout=timeout)
            m.destination["slot"] = dst_slot
        http.check_slot(dst_url, dst_slot, api_key=to_key, timeout=timeout)
        f = state["dst"] = http.server_facts(dst_url, dst_slot, api_key=to_key, timeout=timeout)
        s.details = {"model": f.model_path, "total_slots": f.total_slots, "n_ctx_slot": f.n_ctx_slot,
                     "build_info": f.build_info, "slot_given": given_slot}
        why = other_model(state["src"], f)
        if why:
            raise Refused(why)
        setup, notes = local_setup(f, dst_slot, dst_flags, given)
        state["setup"] = setup
        s.details["notes"] = notes
        return f"{dst_url}: slot {dst_slot} of {f.total_slots}, model {f.model_path}"

    def save(s: Step) -> str:
        answer = http.save_slot(src_url, src_slot, name, api_key=api_key, timeout=timeout, check=False)
        s.details = {"answer": answer}
        return f"slot {src_slot} saved to {name}: {answer['n_saved']:,} tokens, {answer['n_written']:,} bytes"

    def fetch(s: Step) -> str:
        from slotctl.slotfile import open_slot_file

        path = from_dir / name
        if not path.is_file():
            raise UsageError(f"{path}: the source answered that it saved {name}, but --from-dir holds no such "
                             "file (is --from-dir the source's --slot-save-path?)")
        with open_slot_file(path) as sf:
            # a damage is the check's to judge (validate's verdict for the destination; --force sends it)
            state["damaged"] = sf.errors[0].one_line() if sf.errors else None
            saved = steps["save"].details["answer"]
            n = sf.tokens.n_tokens if sf.tokens is not None else 0
            if n != saved["n_saved"] or sf.size != saved["n_written"]:
                raise Refused(f"{path}: holds {n:,} tokens in {sf.size:,} bytes, the source saved {saved['n_saved']:,} "
                              f"in {saved['n_written']:,} (another file under that name?)")
            state["path"] = path
            s.details = {"path": os.fspath(path), "size": sf.size, "n_tokens": n, "state_version": sf.version}
            return f"{path}: {n:,} tokens, {sf.size:,} bytes"

    def check(s: Step) -> str:
        from slotctl.live.judge import judge, why

        setup = state["setup"]
        if state["damaged"]:   # judged as it is: a damaged file is not converted
            conv = Conversion(state["path"], [], {"changes": [], "lossy": [], "converted": False,
                                                  "damaged": state["damaged"]})
        else:
            conv = convert_for(state["path"], setup, Path(staging) / name, allow_lossy=allow_lossy,
                               lossy_remedy="pass --allow-lossy to accept it", who="destination")
        s.details = conv.details
        path = state["placed_from"] = conv.path
        report = judge(path, setup)
        s.details["verdict"] = report.verdict
        s.details["findings"] = [f.as_dict() for f in report.findings if f.severity != "note"]
        if report.refused_or_aborts:
            if not force:
                raise Refused(f"the destination would not restore the file: {why(report)} (--force sends it anyway)",
                          s.details)
            s.details["forced"] = True
        done = "converted (" + "; ".join(conv.changes) + ")" if conv.changes else "no conversion needed"
        forced = " (sent with --force)" if s.details.get("forced") else ""
        return f"{done}; validate for the destination: {report.verdict}{forced}"

    def keep_it(s: Step) -> str:
        kept.put(state["placed_from"], name, move=False)
        (Path(staging) / "from-store").mkdir(exist_ok=True)
        local = kept.local(name, Path(staging) / "from-store")
        s.details = {"where": kept.where(name)}
        state["placed_from"] = local
        return f"{kept.where(name)}: written"

    def place(s: Step) -> str:
        src, dest = state["placed_from"], to_dir / name
        if kept is not None and os.fspath(src) == os.fspath(dest):
            s.details = {"path": os.fspath(dest), "copied": False}
            return f"{dest}: already there (--store is --to-dir)"
        if src == state["path"] and _same_dir(from_dir, to_dir):
            s.details = {"path": os.fspath(dest), "copied": False}
            return f"{dest}: already there (--from-dir and --to-dir are one directory)"
        copy_atomic(src, dest)
        s.details = {"path": os.fspath(dest), "copied": True, "size": os.path.getsize(dest)}
        return f"{dest}: written ({s.details['size']:,} bytes)"

    def restore(s: Step) -> str:
        answer = http.restore_slot(dst_url, dst_slot, name, api_key=to_key, timeout=timeout, check=False)
        s.details = {"answer": answer}
        return f"{name} restored into slot {dst_slot}: {answer['n_restored']:,} tokens, {answer['n_read']:,} bytes"

    def proof(s: Step) -> str:
        p = m.proof = prove(dst_url, dst_slot, state["placed_from"], state["setup"],
                            build_info=state["dst"].build_info, api_key=to_key, timeout=timeout)
        if p.exit_status:
            m.exit_status = p.exit_status
        s.details = {"verdict": p.verdict}
        return p.summary("the destination")

    def cleanup(s: Step) -> str:
        """The working files gone: the source's save in --from-dir and the copy placed in --to-dir (the
        destination's slot holds the state now; ``store`` keeps a copy when given)."""
        removed = []
        for p in {os.fspath(from_dir / name), os.fspath(to_dir / name)}:
            if kept is not None and os.fspath(p) == kept.where(name):
                continue     # the store's own copy stays
            if os.path.lexists(p):
                os.unlink(p)
                removed.append(p)
        s.details = {"removed": sorted(removed)}
        return f"removed {', '.join(sorted(removed))}" if removed else "nothing to remove"

    try:
        for step, fn in (("source", source), ("destination", destination), ("save", save), ("fetch", fetch),
                         ("check", check), ("store", keep_it), ("place", place), ("restore", restore),
                         ("prove", proof), ("cleanup", cleanup)):
            if step == "store" and kept is None:
                continue
            if step == "cleanup" and m.exit_status:
                continue     # a failed or unproven migration keeps its files, to look at
            if not run(step, fn):
                break
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return m


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
