"""The fleet view (``slotctl slots`` over several servers): every server's slots in one list of rows, with
what each server's store holds for each slot (docs/live.md, "Several servers").

Each server is read with :func:`slotctl.live.http.server_facts` (``GET /props``, ``/slots``, ``/v1/models``);
a server that does not answer is a row of its own with its error, and the others are still shown. The
stored states of a slot are the store's states named for that slot and the server's model (keep's names:
:func:`slotctl.fleet.keep.stored_name`); the newest one's time is the slot's "last saved".
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from slotctl.errors import ExitStatus, SlotctlError, error_entry
from slotctl.live import http


@dataclass
class Target:
    url: str
    name: str | None = None
    store: str | None = None
    api_key: str | None = None


def _server(t: Target, timeout: float) -> dict:
    from slotctl.catalog import iso_time
    from slotctl.fleet.keep import model_hash
    from slotctl.fleet.states import open_store

    doc = {"server": http.normalize_url(t.url), "name": t.name, "store": t.store, "model": None,
           "total_slots": None, "build_info": None, "error": None, "slots": []}
    try:
        facts = http.server_facts(t.url, api_key=t.api_key, timeout=timeout)
    except SlotctlError as e:
        doc["error"] = {"code": e.error_code, "message": str(e)}
        doc["exit_code"] = int(e.exit_status)
        return doc
    doc.update(model=facts.model_path, total_slots=facts.total_slots, build_info=facts.build_info, exit_code=0)
    store = None
    if t.store is not None:
        from pathlib import Path

        store = open_store(t.store, Path(t.store) if "://" not in t.store else Path("."))
    mh = model_hash(facts)
    for s in facts.slots or ():
        sid = s.get("id")
        row = {"slot": sid, "n_ctx": s.get("n_ctx"), "n_tokens": s.get("n_prompt_tokens"),
               "busy": bool(s.get("is_processing")), "task": s.get("id_task"), "stored_states": None,
               "last_saved": None}
        if store is not None:
            try:
                names = store.names(f"slot{sid}-{mh}-")
                row["stored_states"] = len(names)
                if names:
                    row["last_saved"] = iso_time(store.mtime(names[0]))
            except (SlotctlError, OSError) as e:
                if doc["error"] is None:
                    doc["error"] = {"code": error_entry(e).code, "message": f"{t.store}: {e}"}
                    doc["exit_code"] = int(ExitStatus.USAGE)
        doc["slots"].append(row)
    return doc


def fleet(targets: list[Target], timeout: float) -> list[dict]:
    """One document per server, in the order given, read concurrently."""
    with ThreadPoolExecutor(max(1, min(8, len(targets)))) as pool:
        return list(pool.map(lambda t: _server(t, timeout), targets))
