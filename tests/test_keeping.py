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
