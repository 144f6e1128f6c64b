"""The fleet view (``slotctl slots`` over several servers, and the ``/ui`` page of keep): every server's slots
in one list of rows, with what each server's store holds for each slot and what the best of it would keep
(docs/fleet.md, "The fleet view").

Each server is read with :func:`slotctl.live.http.server_facts` (``GET /props``, ``/slots``, ``/v1/models``);
a server that does not answer is a row of its own with its error, and the others are still shown. The
stored states of a slot are the store's states named for that slot and the server's model (keep's names:
:func:`slotctl.fleet.keep.stored_name`); the newest one's time is the slot's "last saved".

Each stored state is judged for the server now running, as keep judges the state it would restore
(:func:`slotctl.live.judge.judge`: validate's verdict, no real load, for what the server reports,
:func:`slotctl.live.prove.local_setup`; the model read once for all the states of a slot), and its predicted reuse is validate's
(:func:`slotctl.server.reuse.reuse_for`, the one home of the prediction, which validate calls for a file that
restores): the prompt tokens a restored slot keeps for a request that extends the saved prompt, by the rule
of the server's build (b11434 ignores a file's checkpoints: :func:`slotctl.live.prove.server_reads_checkpoints`).
The slot's *best* state is the one that restores and keeps the most (the newest of equals). A judgement is
kept for as long as the process runs (:class:`Judgements`: a state's bytes never change under its name, and
its identity, size and time, is part of the key), so ``--watch`` and the page judge each state once.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from slotctl.errors import ExitStatus, SlotctlError, error_entry
from slotctl.live import http

#: the verdicts of a state the server restores (validate's words)
RESTORES = ("restores", "restores_with_drops")


@dataclass
class Target:
    url: str
    name: str | None = None
    store: str | None = None
    api_key: str | None = None


class Judgements:
    """What each stored state was judged for a server (verdict, tokens, predicted reuse), kept by the
    server's identity, the slot, the state's name and its time: judged once per process; and the setup each
    server is judged with (:func:`slotctl.live.prove.local_setup` reads the server's model: once a server
    identity, then the same for each slot)."""

    def __init__(self):
        self._done: dict[tuple, dict[tuple, dict]] = {}
        self._setups: dict[str, object] = {}
        self._models: dict[tuple, tuple] = {}
        self._lock = threading.Lock()

    def setup(self, ident: str, facts: http.ServerFacts, slot: int, flags, given: frozenset[str]):
        """The (setup, models) to judge ``slot``'s states with, for the server ``facts`` describe."""
        import dataclasses

        from slotctl.live.prove import local_setup
        from slotctl.validate.setup import Models

        with self._lock:
            found = self._models.get((ident, slot))
            base = self._setups.get(ident)
        if found is not None:
            return found
        if base is None:
            base, _notes = local_setup(facts, slot, flags, given)
        setup = base if base.slot == slot else dataclasses.replace(base, slot=slot)
        found = (setup, Models(setup))
        with self._lock:
            self._setups.setdefault(ident, base)
            self._models[(ident, slot)] = found
        return found

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._done.values())

    def of(self, ident: str, slot: int) -> dict[tuple, dict]:
        """The judgements of the states of ``slot`` on the server ``ident``, by (name, time)."""
        with self._lock:
            return dict(self._done.get((ident, slot), {}))

    def keep(self, ident: str, slot: int, judged: dict[tuple, dict]) -> None:
        """``judged`` (the states the store holds now) replaces what was kept for ``slot``: a state pruned
        from the store is forgotten, so a process that runs for months holds only the store's states."""
        with self._lock:
            self._done[(ident, slot)] = judged


#: the judgements of this process (``--watch`` passes, page loads)
JUDGED = Judgements()


def _judge(where: str, setup, models, reads: bool) -> dict:
    """validate's verdict on the state at ``where`` for ``setup`` (``models``: its
    :class:`~slotctl.validate.setup.Models`, read once for every state of a slot) and its predicted reuse
    (validate's own call of :func:`slotctl.server.reuse.reuse_for`; ``reads``: the server reads a file's
    checkpoints)."""
    from slotctl.validate.check import validate_file

    report = validate_file(where, setup, models)
    sf = report.slot_file
    if sf is not None:
        sf.close()
    n_reused = reason = None
    r = report.reuse if str(report.verdict) in RESTORES else None
    if r is not None:
        rule = r if reads else r["b11434"]
        n_reused, reason = rule["n_reused"], rule["reason"]
    if str(report.verdict) not in RESTORES:
        from slotctl.live.judge import why

        reason = why(report)
    return {"verdict": str(report.verdict), "n_tokens": report.n_tokens, "n_reused": n_reused, "reason": reason}


def stored_states(store, facts: http.ServerFacts, slot: int, *, flags=None, given: frozenset[str] = frozenset(),
                  judged: Judgements = JUDGED) -> list[dict]:
    """The store's states for ``slot`` and the server's model, newest first, each judged for the server
    ``facts`` describe: ``{name, saved, n_tokens, verdict, n_reused, reason}`` (``n_reused`` None when the
    server would not restore it). ``flags``/``given``: what the server does not report (keep's ``-kvu``,
    cache types)."""
    from slotctl.catalog import iso_time
    from slotctl.fleet.keep import model_hash, server_identity
    from slotctl.live.prove import server_reads_checkpoints

    mh = model_hash(facts)
    ident = repr(sorted(server_identity(facts).items())) + repr((flags, sorted(given)))
    reads = server_reads_checkpoints(facts.build_info)
    setup = models = None
    out = []
    before, now = judged.of(ident, slot), {}
    for name in store.names(f"slot{slot}-{mh}-"):
        try:
            t = store.mtime(name)
        except (SlotctlError, OSError):     # gone since the list (pruned): not a state any more
            continue
        found = before.get((name, t))
        if found is None:
            if setup is None:
                setup, models = judged.setup(ident, facts, slot, flags, given)
            try:
                found = _judge(store.where(name), setup, models, reads)
            except OSError as e:
                found = {"verdict": "unreadable", "n_tokens": None, "n_reused": None,
                         "reason": f"{name}: {e.strerror or e}"}
        now[(name, t)] = found
        out.append({"name": name, "saved": iso_time(t), **found})
    judged.keep(ident, slot, now)
    return out


def best_state(states: list[dict]) -> dict | None:
    """The state that restores and keeps the most prompt tokens (the newest of equals: ``states`` are
    newest first); None when none restores."""
    best = None
    for s in states:
        if s["verdict"] in RESTORES and s["n_reused"] is not None and (best is None or s["n_reused"] > best["n_reused"]):
            best = s
    return None if best is None else {k: best[k] for k in ("name", "n_tokens", "n_reused", "reason")}


def server_doc(t: Target, facts: http.ServerFacts | None, *, store=None, error: SlotctlError | None = None,
               flags=None, given: frozenset[str] = frozenset(), judged: Judgements = JUDGED) -> dict:
    """The fleet view's document of one server from its facts (read now, or keep's last look) and its store
    (an open store, or ``t.store`` opened here); ``error``: why the server could not be read."""
    from slotctl.fleet.states import open_store

    doc = {"server": http.normalize_url(t.url), "name": t.name, "store": t.store, "model": None,
           "total_slots": None, "build_info": None, "error": None, "slots": []}
    if facts is None:
        e = error or SlotctlError("not read yet")
        doc["error"] = {"code": getattr(e, "error_code", "error"), "message": str(e)}
        doc["exit_code"] = int(getattr(e, "exit_status", ExitStatus.USAGE))
        return doc
    doc.update(model=facts.model_path, total_slots=facts.total_slots, build_info=facts.build_info, exit_code=0)
    if store is None and t.store is not None:
        from pathlib import Path

        store = open_store(t.store, Path(t.store) if "://" not in t.store else Path("."))
    for s in facts.slots or ():
        sid = s.get("id")
        row = {"slot": sid, "n_ctx": s.get("n_ctx"), "n_tokens": s.get("n_prompt_tokens"),
               "busy": bool(s.get("is_processing")), "task": s.get("id_task"), "stored_states": None,
               "last_saved": None, "states": [], "best": None}
        if store is not None and doc["exit_code"] == 0:
            try:
                states = stored_states(store, facts, sid, flags=flags, given=given, judged=judged)
                row.update(stored_states=len(states), last_saved=states[0]["saved"] if states else None,
                           states=states, best=best_state(states))
            except (SlotctlError, OSError) as e:
                doc["error"] = {"code": error_entry(e).code, "message": f"{t.store or store}: {e}"}
                doc["exit_code"] = int(ExitStatus.USAGE)
        doc["slots"].append(row)
    return doc


def _server(t: Target, timeout: float) -> dict:
    try:
        facts = http.server_facts(t.url, api_key=t.api_key, timeout=timeout)
    except SlotctlError as e:
        return server_doc(t, None, error=e)
    return server_doc(t, facts)


def fleet(targets: list[Target], timeout: float) -> list[dict]:
    """One document per server, in the order given, read concurrently."""
    with ThreadPoolExecutor(max(1, min(8, len(targets)))) as pool:
        return list(pool.map(lambda t: _server(t, timeout), targets))


# -- the rows (the table, the rows on a pipe, the page) ------------------------------------------------------

COLUMNS = ("server", "model", "slot", "tokens", "state", "last saved", "stored", "best reuse")


def reuse_text(row: dict) -> str:
    """The best state's predicted reuse of a slot, in words: ``N of M`` tokens; ``none restores`` when the
    store has states of the slot and the server would restore none; ``-`` without a store or states."""
    if not row.get("states"):
        return "-"
    b = row["best"]
    if b is None:
        return "none restores"
    return f"{b['n_reused']:,} of {b['n_tokens']:,}" if isinstance(b["n_tokens"], int) else f"{b['n_reused']:,}"


def rows(servers: list[dict]) -> list[tuple[str, ...]]:
    """One row of :data:`COLUMNS` per slot (a server that did not answer: one row with its error), every
    value whole and as it came (escape it for where it is shown)."""
    import os

    out = []
    for d in servers:
        name = d["name"] or d["server"]
        if d["error"] is not None and not d["slots"]:
            out.append((name, "-", "-", "-", "error", "-", "-", "-"))
            continue
        model = os.path.basename(d["model"] or "") or "-"
        for s in d["slots"]:
            out.append((name, model, str(s["slot"]), "-" if s["n_tokens"] is None else f"{s['n_tokens']:,}",
                        "busy" if s["busy"] else "idle", s["last_saved"] or "-",
                        "-" if s["stored_states"] is None else str(s["stored_states"]), reuse_text(s)))
    return out


def summary(servers: list[dict]) -> str:
    n = sum(len(d["slots"]) for d in servers)
    busy = sum(1 for d in servers for s in d["slots"] if s["busy"])
    down = sum(1 for d in servers if d["error"] is not None)
    return f"{len(servers)} server(s), {n} slot(s), {busy} busy" + (f", {down} with an error" if down else "")
