"""The fleet view (``slotctl slots`` over several servers, and the ``/ui`` page of keep): every server's slots
in one list of rows, with what each server's store holds for each slot and what the best of it would keep
(docs/fleet.md, "The fleet view").

Each server is read with :func:`slotctl.live.http.server_facts` (``GET /props``, ``/slots``, ``/v1/models``);
a server that does not answer is a row of its own with its error, and the others are still shown. The
stored states of a slot are the store's states named for that slot and the server's model, told by its content
(the names keep and serve write: :mod:`slotctl.seal`; none while the model is not identified, the document's
``identity`` says why); the newest one's time is the slot's "last saved".

Each stored state is judged for the server now running as keep and serve judge the states they restore, by
the same object (:class:`slotctl.keeping.states.ServerStates`: validate's verdict, no real load, for what the
server reports, :func:`slotctl.live.prove.local_setup`; its predicted reuse, by the rule of the server's build)
and through the same catalog: a verdict keep or serve kept for the state and the server is shown without
reading the state again, and one made here is kept for them. The prediction is the prompt tokens a restored
slot keeps for a request that extends the saved prompt (b11434 ignores a file's checkpoints:
:func:`slotctl.live.prove.server_reads_checkpoints`). The slot's *best* state is the one that restores and
keeps the most (the newest of equals). Each server's states are kept for as long as the process runs
(:func:`states_of`), so ``--watch`` judges each state once; keep's page judges with keep's own.

A router (llama-server started without ``-m``) is one document per model (:func:`router_docs`): the router's
``GET /models`` lists them, loaded or not; a loaded one is read as a server of its own (through the router, by its
name, never loading it), and an unloaded one shows what the store holds for it (each state named for the model
as its server would name it: :func:`slotctl.live.http.unloaded_facts`), not judged: it is judged for the server the
router starts next. A configuration file's entry that names a router's model is that model's document alone.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from slotctl.errors import ExitStatus, SlotctlError, error_entry
from slotctl.keeping.judged import RESTORES
from slotctl.live import http, router


@dataclass
class Target:
    url: str
    name: str | None = None
    store: str | None = None
    api_key: str | None = None
    #: the router's model (a configuration file entry's ``model``); None: a server of its own, or every model of
    #: the router at ``url``
    model: str | None = None


#: each server's states with its store, as this process judged them (``--watch`` passes): by URL, model and store
_STATES: dict[tuple[str, str | None, str], object] = {}
_STATES_LOCK = threading.Lock()


def states_of(t: Target):
    """The server's states with its store (:class:`~slotctl.keeping.states.ServerStates`, judging only: its
    verdicts read from the store's catalog, and kept there only when keep or serve made one), one per server
    and store for the life of the process."""
    from slotctl.keeping.states import ServerStates

    key = (http.normalize_url(t.url), t.model, t.store)
    with _STATES_LOCK:
        found = _STATES.get(key)
        if found is None:
            found = _STATES[key] = ServerStates(t.url, None, t.store, api_key=t.api_key, create_catalog=False,
                                                router_model=t.model)
        return found


def judged_row(judged) -> dict:
    """What the view shows of a verdict (:class:`~slotctl.keeping.judged.Judged`): ``{verdict, n_tokens,
    n_reused, reason}``, ``n_reused`` None when the server would not restore the state, ``reason`` why fewer
    than all are kept, or why it is not restored."""
    restores = judged.verdict in RESTORES
    return {"verdict": judged.verdict, "n_tokens": judged.n_tokens, "n_reused": judged.extending if restores else None,
            "reason": judged.reuse_reason if restores else judged.why}


def stored_states(states, slot: int) -> list[dict]:
    """The store's states for ``slot`` and the server's model, newest first, each judged for the server now
    running (``states``: its :class:`~slotctl.keeping.states.ServerStates`, its facts read):
    ``{name, saved, n_tokens, verdict, n_reused, reason}``. The verdicts of the slot's states gone from the
    store are forgotten, so a process that runs for months holds only the store's states."""
    from slotctl.catalog import iso_time
    from slotctl.seal import slot_prefix

    if states.model is None:        # the server's model not identified by its content: no state is its model's
        return []
    prefix = slot_prefix(slot, states.model)
    listed = states.listing(lambda name: name.startswith(prefix) and states.takes(name))
    out = []
    for name in sorted(listed, key=lambda n: listed[n][1], reverse=True):
        try:
            found = judged_row(states.judge(name, slot))
        except OSError as e:     # gone since the listing, or unreadable
            found = {"verdict": "unreadable", "n_tokens": None, "n_reused": None,
                     "reason": f"{name}: {e.strerror or e}"}
        out.append({"name": name, "saved": iso_time(listed[name][1] / 1e9), **found})
    states.keep_only(prefix, listed)
    return out


def best_state(states: list[dict]) -> dict | None:
    """The state that restores and keeps the most prompt tokens (the newest of equals: ``states`` are
    newest first); None when none restores."""
    best = None
    for s in states:
        if s["verdict"] in RESTORES and s["n_reused"] is not None and (best is None or s["n_reused"] > best["n_reused"]):
            best = s
    return None if best is None else {k: best[k] for k in ("name", "n_tokens", "n_reused", "reason")}


def server_doc(t: Target, facts: http.ServerFacts | None, *, states=None, error: SlotctlError | None = None) -> dict:
    """The fleet view's document of one server from its facts (read now, or keep's last look) and its store's
    states (``states``: the server's :class:`~slotctl.keeping.states.ServerStates`, keep's own; else
    ``t.store``'s, :func:`states_of`); ``error``: why the server could not be read."""
    doc = {"server": http.normalize_url(t.url), "name": t.name, "store": t.store, "model": None,
           "identity": None, "router_model": t.model,
           "status": "loaded" if t.model is not None and facts is not None else None,
           "total_slots": None, "build_info": None, "error": None, "slots": []}
    if facts is None:
        e = error or SlotctlError("not read yet")
        doc["error"] = {"code": getattr(e, "error_code", "error"), "message": str(e)}
        doc["exit_code"] = int(getattr(e, "exit_status", ExitStatus.USAGE))
        return doc
    doc.update(model=facts.model_path, total_slots=facts.total_slots, build_info=facts.build_info, exit_code=0)
    if states is None and t.store is not None:
        states = states_of(t)
        states.set_facts(facts)
    if states is not None:
        ident = states.server_model
        doc["identity"] = {"model": ident.target.digest if ident is not None else None,
                           "unidentified": states.unidentified if ident is None else None}
    for s in facts.slots or ():
        sid = s.get("id")
        row = {"slot": sid, "n_ctx": s.get("n_ctx"), "n_tokens": s.get("n_prompt_tokens"),
               "busy": bool(s.get("is_processing")), "task": s.get("id_task"), "stored_states": None,
               "last_saved": None, "states": [], "best": None}
        if states is not None and doc["exit_code"] == 0:
            try:
                found = stored_states(states, sid)
                row.update(stored_states=len(found), last_saved=found[0]["saved"] if found else None,
                           states=found, best=best_state(found))
            except (SlotctlError, OSError) as e:
                doc["error"] = {"code": error_entry(e).code, "message": f"{t.store or states.store}: {e}"}
                doc["exit_code"] = int(ExitStatus.USAGE)
        doc["slots"].append(row)
    return doc


def unloaded_doc(t: Target, entry: dict, build_info: str | None = None) -> dict:
    """The document of a router's model that is not loaded (``entry``: the router's ``GET /models`` entry of it,
    :func:`slotctl.live.router.parse_models`): its status and GGUF, no slots of a server, and the states the store
    holds for it (``t.store``'s, named for the model's content as its server names it: its GGUF read and hashed
    here), one row per slot
    they were saved from, not judged (verdict ``not_judged``: judged for the server the router starts next)."""
    from slotctl import seal
    from slotctl.catalog import iso_time
    from slotctl.live.identity import identify

    doc = {"server": http.normalize_url(t.url), "name": t.name, "store": t.store, "model": entry["model_path"],
           "identity": None, "router_model": entry["name"], "status": entry["status"], "total_slots": None, "build_info": build_info,
           "error": None, "slots": [], "exit_code": 0}
    if t.store is None:
        return doc
    why = f"{entry['name']!r} is {entry['status']}: judged for the server the router starts for it next"
    try:
        facts = http.unloaded_facts(t.url, entry, build_info)
        ident = identify(facts.model_path, facts.model_meta)     # its content, as its server would name it
        doc["identity"] = {"model": ident.target.digest, "unidentified": None}
        model = ident.short
        states = states_of(t)
        listed = states.listing(lambda name: (said := seal.parse_name(name)) is not None and said.sealed
                                and said.model == model)
    except (SlotctlError, OSError) as e:
        doc["error"] = {"code": error_entry(e).code, "message": f"{t.store}: {e}"}
        doc["exit_code"] = int(ExitStatus.USAGE)
        return doc
    by_slot: dict[int, list[dict]] = {}
    for name in sorted(listed, key=lambda n: listed[n][1], reverse=True):
        said = seal.parse_name(name)
        if said is None or said.slot is None:
            continue
        by_slot.setdefault(said.slot, []).append({"name": name, "saved": iso_time(listed[name][1] / 1e9),
                                                   "n_tokens": said.n_tokens, "verdict": "not_judged",
                                                   "n_reused": None, "reason": why})
    for slot in sorted(by_slot):
        found = by_slot[slot]
        doc["slots"].append({"slot": slot, "n_ctx": None, "n_tokens": None, "busy": False, "task": None,
                             "stored_states": len(found), "last_saved": found[0]["saved"], "states": found,
                             "best": None})
    return doc


def router_docs(t: Target, timeout: float) -> list[dict]:
    """One document per model of the router at ``t.url`` (its ``GET /models``, in its order): a loaded one read
    through the router by its name (never loading it: ``autoload=false``), one that is not, :func:`unloaded_doc`."""
    from dataclasses import replace

    try:
        models = http.router_models(t.url, api_key=t.api_key, timeout=timeout)
        props = http.router_props(t.url, api_key=t.api_key, timeout=timeout) or {}
    except SlotctlError as e:
        return [server_doc(t, None, error=e)]
    build = props.get("build_info") if isinstance(props.get("build_info"), str) else None
    return [_server(replace(t, model=m["name"]), timeout, m, build)[0] for m in models]


def _server(t: Target, timeout: float, entry: dict | None = None, build: str | None = None) -> list[dict]:
    """The documents of ``t``: one, or one per model of a router named with no model."""
    if entry is not None and entry["url"] is None:
        return [unloaded_doc(t, entry, build)]
    try:
        facts = http.server_facts(t.url, api_key=t.api_key, timeout=timeout, model=t.model)
    except http.RouterMode as e:
        if t.model is None and router.model_for(http.normalize_url(t.url)) is None:
            return router_docs(t, timeout)
        return [server_doc(t, None, error=e)]
    except http.RouterModelNotLoaded as e:
        try:    # unloaded since (or named in the configuration file): what the store holds for it
            entry = router.pick_model(http.router_models(t.url, api_key=t.api_key, timeout=timeout),
                                      t.model or router.model_for(http.normalize_url(t.url)) or "")
        except SlotctlError:
            entry = None
        return [unloaded_doc(t, entry, build) if entry is not None else server_doc(t, None, error=e)]
    except SlotctlError as e:
        return [server_doc(t, None, error=e)]
    return [server_doc(t, facts)]


def fleet(targets: list[Target], timeout: float) -> list[dict]:
    """One document per server (a router's: one per model), in the order given, read concurrently."""
    with ThreadPoolExecutor(max(1, min(8, len(targets)))) as pool:
        return [doc for docs in pool.map(lambda t: _server(t, timeout), targets) for doc in docs]


# -- the rows (the table, the rows on a pipe, the page) ------------------------------------------------------

COLUMNS = ("server", "model", "slot", "tokens", "state", "last saved", "stored", "best reuse")


def reuse_text(row: dict) -> str:
    """The best state's predicted reuse of a slot, in words: ``N of M`` tokens; ``none restores`` when the
    store has states of the slot and the server would restore none; ``-`` without a store or states, or when
    they are not judged (a router's model not loaded)."""
    if not row.get("states") or all(s["verdict"] == "not_judged" for s in row["states"]):
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
        model = d.get("router_model") or os.path.basename(d["model"] or "") or "-"
        status = d.get("status")
        if status not in (None, "loaded") and not d["slots"]:
            out.append((name, model, "-", "-", status, "-", "-" if d["store"] is None else "0", "-"))
        for s in d["slots"]:
            state = status if status not in (None, "loaded") else "busy" if s["busy"] else "idle"
            out.append((name, model, str(s["slot"]), "-" if s["n_tokens"] is None else f"{s['n_tokens']:,}",
                        state, s["last_saved"] or "-",
                        "-" if s["stored_states"] is None else str(s["stored_states"]), reuse_text(s)))
    return out


def summary(servers: list[dict]) -> str:
    n = sum(len(d["slots"]) for d in servers)
    busy = sum(1 for d in servers for s in d["slots"] if s["busy"])
    down = sum(1 for d in servers if d["error"] is not None)
    return f"{len(servers)} server(s), {n} slot(s), {busy} busy" + (f", {down} with an error" if down else "")
