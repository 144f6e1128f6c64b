"""``slotctl serve``'s stored states out of a client's slot save's reach, and a SIGKILLed serve's working files
swept at the next start (issue 36).

Every serve is a real process in front of a real llama-server b11434 (tiny model); the unit tests at the top
run the parts alone.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_serve import TURN1, TURN2_EXTRA, Serve, call, complete, fresh, serving  # noqa: F401
from slotctl.tinymodels import SAMPLE_PROMPT

server = pytest.mark.server


# -- the parts alone -----------------------------------------------------------------------------------------


def test_a_killed_process_leaves_nothing_the_next_one_does_not_sweep(tmp_path):
    """What a process of this machine that is gone left (its working files, their atomic writes' temporary files,
    its staging directories) is swept at once; another machine's only once untouched for an hour; a live
    process's, and everything else, never."""
    from slotctl.atomic import private_name
    from slotctl.keeping import names
    from slotctl.keeping.states import ORPHAN_AGE, ServerStates
    from slotctl.keeping.store import DEFAULT_STORE

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here, there = names.host_tag(), "0" * names.HOST_DIGITS if names.host_tag() != "0" * 8 else "1" * 8
    old = time.time() - ORPHAN_AGE - 60
    gone = [f"serve-slot0-incoming-{dead.pid}-{here}{'1' * 16}.bin", f"serve-slot1-placed-{dead.pid}-{here}{'2' * 16}.bin",
            private_name(f"serve-slot1-converted-{dead.pid}-{here}{'3' * 16}.bin", "0a0b0c0d"),
            f"serve-slot0-probe-{dead.pid}-{there}{'4' * 16}.bin"]      # another machine's, an hour old
    kept = [f"serve-slot0-incoming-{os.getppid()}-{here}{'5' * 16}.bin",   # alive
            f"serve-slot0-incoming-{dead.pid}-{there}{'6' * 16}.bin",      # another machine's, recent
            f"keep-slot0-incoming-{dead.pid}-{here}{'7' * 16}.bin",        # keep's: keep sweeps its own
            "slot0-0a1b2c3d-0000002-0123456789abcdef.bin", "notes.txt"]
    for name in gone + kept:
        (tmp_path / name).write_bytes(b"x" * 10)
    os.utime(tmp_path / gone[3], (old, old))
    staging = tmp_path / f".serve-slot0-staging-{dead.pid}-{here}{'8' * 16}"
    staging.mkdir()
    (staging / "state.bin").write_bytes(b"y")
    states = ServerStates("http://127.0.0.1:9", tmp_path, role="serve")
    store_tmp = tmp_path / DEFAULT_STORE / private_name("slot0-x.bin", "1a2b3c4d")
    store_tmp.write_bytes(b"z" * 3)
    os.utime(store_tmp, (old, old))
    swept = []
    states.sweep(lambda p, pid, size: swept.append((p.name, pid, size)))
    assert sorted(swept) == sorted([(n, dead.pid, 10) for n in gone] + [(staging.name, dead.pid, 0),
                                                                          (store_tmp.name, 0, 3)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + [DEFAULT_STORE])
    assert not store_tmp.exists()


def test_the_default_store_is_out_of_a_client_saves_reach(tmp_path):
    from slotctl.keeping.store import DEFAULT_STORE, open_store
    from slotctl.server.filenames import check_filename
    from slotctl.errors import UsageError

    store = open_store(None, tmp_path, create=True)
    assert Path(str(store)) == tmp_path / DEFAULT_STORE and (tmp_path / DEFAULT_STORE).is_dir()
    # llama-server saves only plain names in its slot directory: nothing under the store
    with pytest.raises(UsageError):
        check_filename(f"{DEFAULT_STORE}/slot0-x.bin")
    assert not open_store(None, tmp_path / "elsewhere").names("")     # a reader makes nothing


# -- against a real llama-server b11434 ----------------------------------------------------------------------


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@server
def test_a_clients_slot_save_cannot_reach_serves_states(fresh, tmp_path):
    """With the default store: serve's states, catalog and lock live in a directory of the slot directory no
    client's save can name; a client's save under a stored state's name writes the slot directory's own file,
    and that file (another conversation's state) is never restored in the stored state's place: the returning
    turn gets the store's state and the answer of the server alone."""
    from slotctl.keeping.store import DEFAULT_STORE

    store = fresh.save_dir / DEFAULT_STORE
    with serving(fresh, fresh.save_dir, None) as s:
        first = complete(s.url, TURN1)
        s.wait_for("saves", 1)
        stored = store / s.events_named("stored")[0]["details"]["name"]
        # another conversation in the other slot: a client saves it under the stored state's name, under serve's
        # own files' names, and tries the store's directory
        other = "Nothing of the kind was ever told. " * 14
        complete(s.url, other)
        s.wait_for("saves", 2)
        kept = {p.name: digest(p) for p in store.iterdir() if p.is_file()}
        assert stored.name in kept and any(n.startswith(".slotctl-serve-") for n in kept), kept   # the lock too
        slot = s.events_named("stored", 2)[1]["details"]["slot"]
        for name in (stored.name, f"{DEFAULT_STORE}/{stored.name}", f"../{stored.name}", *kept):
            call(s.url, "POST", f"/slots/{slot}?action=save", {"filename": name})
        assert (fresh.save_dir / stored.name).exists()       # the client's own file, in the slot directory
        assert digest(fresh.save_dir / stored.name) != kept[stored.name]
        assert {n: digest(store / n) for n in kept} == kept
        fresh.kill_and_start_again()
        p2 = TURN1 + first["content"] + TURN2_EXTRA
        second = complete(s.url, p2)
        c = s.wait_for("saves", 3)
        assert c["restores"] == 1, s.output()
    direct = complete(fresh.url, p2, id_slot=1, cache_prompt=False)
    assert second["content"] == direct["content"]
    assert second["timings"]["prompt_n"] < direct["timings"]["prompt_n"] // 4, (second["timings"], direct["timings"])


def leftovers(slot_dir: Path) -> list[str]:
    from slotctl.keeping import names

    return sorted(e.name for e in os.scandir(slot_dir) if (lo := names.leftover(e.name)) is not None
                  and lo.role == "serve")


def whole(path: Path) -> bool:
    from slotctl.slotfile import open_slot_file

    with open_slot_file(path) as sf:
        return not sf.errors


def settle(srv) -> None:
    """Once the server has done what a killed serve asked (its saves queued, written): ``GET /slots`` answered
    after them, and the slot directory unchanged over half a second (a window where nothing must happen)."""
    def listing():
        return sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(srv.save_dir)
                      if e.is_file())

    while True:
        srv.get("/slots")
        before = listing()
        time.sleep(0.5)
        if listing() == before:
            return


@server
def test_a_sigkilled_serve_leaves_nothing_after_the_next_start_and_loses_no_state(fresh, tmp_path):
    """A bounded loop (SLOTCTL_KILL_TRIALS, 12 here; the finding's 100 by hand): serve is SIGKILLed at a random
    moment of a busy turn (a request, its restore, its save, its store); once the server has done what it was
    asked, serve is started again: after its start nothing of the killed one is left in the slot directory,
    every state stored before is still in the store and whole, and the returning turns answer as before."""
    from slotctl.keeping.store import DEFAULT_STORE

    trials = int(os.environ.get("SLOTCTL_KILL_TRIALS", "12"))
    rnd = random.Random(36)
    store = fresh.save_dir / DEFAULT_STORE
    stored: dict[str, str] = {}
    convs = [f"Conversation {i}: " + " ".join([SAMPLE_PROMPT] * 2) for i in range(3)]
    killed_with = []
    for trial in range(trials):
        s = Serve(fresh.url, fresh.save_dir, None)
        try:
            s.stats()       # serve answers: its start's sweep is done
            assert leftovers(fresh.save_dir) == [], (trial, s.output())
            for name, d in stored.items():
                assert (store / name).exists() and digest(store / name) == d, (trial, name)
            # a busy turn: two conversations take the slots, a third comes back (a restore), and is saved
            kill_at = rnd.uniform(0.0, 1.2)
            threading.Timer(kill_at, lambda p=s.proc: p.kill()).start()
            try:
                for prompt in rnd.sample(convs, 3):
                    status, _h, raw = call(s.url, "POST", "/completion", {"prompt": prompt, "n_predict": 4}, timeout=60)
            except OSError:
                pass
            s.proc.wait(60)
        finally:
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()
        settle(fresh)       # every save the killed serve asked is written
        killed_with.append(leftovers(fresh.save_dir))
        for p in store.glob("slot*.bin"):
            if p.name not in stored:
                assert whole(p), p
                stored[p.name] = digest(p)
    s = Serve(fresh.url, fresh.save_dir, None)
    try:
        s.stats()
        assert leftovers(fresh.save_dir) == []
        assert {p.name: digest(p) for p in store.glob("slot*.bin")} == stored
    finally:
        assert s.stop() == 0, s.output()
    print(f"\n{trials} kills; left by the killed serves: {sum(1 for k in killed_with if k)} times "
          f"({sorted({n.split('-')[2] for k in killed_with for n in k})}); states stored: {len(stored)}")
    assert stored
