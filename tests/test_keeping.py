"""The core under keep and serve (slotctl.keeping), parts that need no server: the one naming scheme of stored
states and working files (the previous release's names still read), a save read back."""

from __future__ import annotations

import os

import numpy as np
import pytest

from slotctl.keeping import names


def test_one_name_for_a_state_whoever_stores_it():
    tokens = np.array([1, 15043, 3186, 29991], dtype=np.int32)
    name = names.state_name(1, "0a1b2c3d", tokens)
    assert name == f"slot1-0a1b2c3d-0000004-{names.tokens_hash(tokens)}.bin"
    assert names.parse_name(name) == names.StateName(1, "0a1b2c3d", 4, names.tokens_hash(tokens))
    assert name.startswith(names.slot_prefix(1, "0a1b2c3d")) and not name.startswith(names.slot_prefix(11, "0a1b2c3d"))
    assert names.of_model(name, "0a1b2c3d") and not names.of_model(name, "ffffffff")
    # the same tokens as a list or as another integer type: one hash, one name
    assert names.state_name(1, "0a1b2c3d", [1, 15043, 3186, 29991]) == name
    assert names.state_name(1, "0a1b2c3d", tokens.astype(np.int64)) == name
    # names sort by length within a slot and model
    short, long = names.state_name(0, "m", tokens[:2]), names.state_name(0, "m", np.arange(1_000))
    assert sorted([long, short]) == [short, long]


def test_the_previous_releases_names_are_still_read():
    # keep's: slotN-MODEL-TOKENS.bin (any tail: its tokens' hash), read for its slot and model
    assert names.parse_name("slot0-0a1b2c3d-9f8e7d6c5b4a3928.bin") == names.StateName(0, "0a1b2c3d", None,
                                                                                        "9f8e7d6c5b4a3928")
    assert names.parse_name("slot12-0a1b2c3d-cut100.bin").slot == 12
    assert "slot3-0a1b2c3d-9f8e7d6c5b4a3928.bin".startswith(names.slot_prefix(3, "0a1b2c3d"))
    # serve's: serve-MODEL-NTOKENS-TOKENS.bin, no slot
    old = "serve-0a1b2c3d-0000042-9f8e7d6c5b4a3928.bin"
    assert names.parse_name(old) == names.StateName(None, "0a1b2c3d", 42, "9f8e7d6c5b4a3928")
    assert names.of_model(old, "0a1b2c3d")
    # not states: working files, temporary files, other files
    for other in ("keep-slot0-incoming-12-0a0b0c0d.bin", "serve-slot1-incoming-12-0a0b0c0d.bin",
                  "serve-slot1-999-1-incoming.bin", ".slot0-a-b.bin.slotctl-1a2b.tmp", "notes.txt", "slot0.bin",
                  "x-slot0-a-b.bin"):
        assert names.parse_name(other) is None, other


def test_working_files_are_private_to_their_process_and_pinned():
    import fnmatch

    seen = set()
    for role in names.ROLES:
        for what in names.WORKS:
            w = names.work_name(role, 3, what)
            assert w not in seen
            seen.add(w)
            assert names.work_owner(w) == (role, os.getpid())
            assert fnmatch.fnmatch(w, names.own_works(role))
            assert any(fnmatch.fnmatch(w, g) for g in names.WORK_GLOBS)
            assert names.parse_name(w) is None
    assert names.work_name("keep", 0, "incoming") != names.work_name("keep", 0, "incoming")
    # keep's working files of the previous release are the same names
    assert names.work_owner("keep-slot0-incoming-4242-0a0b0c0d.bin") == ("keep", 4242)
    # no state is pinned: prune may delete every one
    assert not any(fnmatch.fnmatch(names.state_name(0, "0a1b2c3d", [1, 2]), g) for g in names.WORK_GLOBS)
    assert not any(fnmatch.fnmatch("serve-0a1b2c3d-0000002-9f8e7d6c5b4a3928.bin", g) for g in names.WORK_GLOBS)
    with pytest.raises(ValueError):
        names.work_name("migrate", 0, "incoming")


def _facts(url: str = "http://127.0.0.1:9"):
    from slotctl.live.http import ServerFacts

    return ServerFacts(url, "/nowhere/tiny.gguf", 2, 512, "/slots", False, None, "b11434-test", False,
                       {"n_vocab": 64, "n_embd": 16, "n_params": 1000, "size": 4000, "n_ctx_train": 1024}, {}, [])


def _judged(identity: str):
    from slotctl.keeping.judged import Judged

    return Judged("restores", True, 3, "kv", 0, 3, None, None, "validate says ...", parsed=True, identity=identity,
                  changed_ns=0)


def test_one_verdict_kept_for_every_reader_and_slot(tmp_path):
    """What keep or serve kept for a state is what another process asks for, whatever the slot; the fleet view
    reads it, and writes into a store only a catalog keep or serve made."""
    import time

    from slotctl.catalog import INDEX_NAME, local_identity
    from slotctl.keeping.states import ServerStates

    store = tmp_path / "store"
    store.mkdir()
    name = names.state_name(1, names.model_hash(_facts()), [1, 2, 3])
    (store / name).write_bytes(b"\0" * 64)
    old = time.time() - 3600        # changed long before the row is made: trusted
    os.utime(store / name, (old, old))
    ident = local_identity(os.stat(store / name))

    view = ServerStates("http://127.0.0.1:9", None, str(store), create_catalog=False)
    view.set_facts(_facts())
    view.remember(name, _judged(ident), time.time_ns())
    assert not (store / INDEX_NAME).exists()        # the view made none
    assert view.judge(name, 0).verdict == "restores" and view.held() == 1      # its own, in memory

    keep = ServerStates("http://127.0.0.1:9", tmp_path, str(store), role="keep")
    keep.set_facts(_facts())
    keep.remember(name, _judged(ident), time.time_ns())
    assert (store / INDEX_NAME).exists()
    # a serve started anew: the verdict from the catalog for slot 0 and slot 1 alike, the state never opened
    serve = ServerStates("http://127.0.0.1:9", tmp_path, str(store), role="serve")
    serve.set_facts(_facts())
    for slot in (0, 1):
        got = serve.judge(name, slot)
        assert got.catalog and got.verdict == "restores" and got.identity == ident
    # the state changed: no verdict kept for its new identity (it would be read again)
    os.utime(store / name, (old + 60, old + 60))
    fresh = ServerStates("http://127.0.0.1:9", tmp_path, str(store), role="serve")
    fresh.set_facts(_facts())
    index = fresh.catalog(create=False)
    assert index.verdict(fresh.store.where(name), fresh.question(), fresh.identity(name)[0]) is None
    # other flags learnt: another question
    other = ServerStates("http://127.0.0.1:9", tmp_path, str(store), role="serve")
    other.set_facts(_facts())
    assert other.question() == serve.question()
    from slotctl.server.flags import ServerFlags

    unified = ServerStates("http://127.0.0.1:9", tmp_path, str(store), role="serve",
                           flags=ServerFlags(kv_unified=True), given=frozenset({"kv_unified"}))
    unified.set_facts(_facts())
    assert unified.question() != serve.question()
