"""The core under keep and serve (slotctl.keeping), parts that need no server: the one naming scheme of stored
states and working files (the previous release's names still read), a save read back."""

from __future__ import annotations

import os

import numpy as np
import pytest

from slotctl import seal
from slotctl.keeping import names


M, D = "0a1b2c3d4e5f6a7b", "8c9d0e1f2a3b4c5d"
SUM = "f" * 64


def test_one_name_for_a_state_whoever_stores_it():
    """A stored state's name carries the model's content identity (and the draft's, for a draft state) and its
    content's checksum (slotctl.seal); one state of a slot's tokens is stored once, whatever its checksum."""
    tokens = np.array([1, 15043, 3186, 29991], dtype=np.int32)
    name = seal.state_name(1, M, tokens, SUM)
    assert name == f"slot1-{M}-0000004-{seal.tokens_hash(tokens)}-{SUM[:16]}.bin"
    assert seal.parse_name(name) == seal.StateName(1, M, 4, seal.tokens_hash(tokens), None, SUM[:16])
    assert seal.parse_name(name).sealed
    assert name.startswith(seal.slot_prefix(1, M)) and not name.startswith(seal.slot_prefix(11, M))
    assert name.startswith(seal.stored_prefix(1, M, tokens))
    # a draft state: the draft model's identity too (all zeros: not known when it was stored)
    drafted = seal.state_name(1, M, tokens, SUM, D)
    assert drafted == f"slot1-{M}x{D}-0000004-{seal.tokens_hash(tokens)}-{SUM[:16]}.bin"
    assert seal.parse_name(drafted).draft == D and drafted.startswith(seal.slot_prefix(1, M))
    assert not drafted.startswith(seal.stored_prefix(1, M, tokens))
    assert seal.parse_name(seal.state_name(0, M, tokens, SUM, seal.UNKNOWN_DRAFT)).draft == seal.UNKNOWN_DRAFT
    # the same tokens as a list or as another integer type: one hash, one name
    assert seal.state_name(1, M, [1, 15043, 3186, 29991], SUM) == name
    assert seal.state_name(1, M, tokens.astype(np.int64), SUM) == name
    # names sort by length within a slot and model
    short, long = seal.state_name(0, M, tokens[:2], SUM), seal.state_name(0, M, np.arange(1_000), SUM)
    assert sorted([long, short]) == [short, long]


def test_the_earlier_releases_names_are_read_and_of_no_known_model():
    # the last release's: slotN-MODEL-NTOKENS-TOKENS.bin, MODEL a hash of what the server reported
    last = "slot1-0a1b2c3d-0000004-9f8e7d6c5b4a3928.bin"
    assert seal.parse_name(last) == seal.StateName(1, "0a1b2c3d", 4, "9f8e7d6c5b4a3928")
    assert not seal.parse_name(last).sealed
    # keep's: slotN-MODEL-TOKENS.bin (any tail: its tokens' hash), read for its slot and model
    assert seal.parse_name("slot0-0a1b2c3d-9f8e7d6c5b4a3928.bin") == seal.StateName(0, "0a1b2c3d", None,
                                                                                       "9f8e7d6c5b4a3928")
    assert seal.parse_name("slot12-0a1b2c3d-cut100.bin").slot == 12
    # serve's: serve-MODEL-NTOKENS-TOKENS.bin, no slot
    old = "serve-0a1b2c3d-0000042-9f8e7d6c5b4a3928.bin"
    assert seal.parse_name(old) == seal.StateName(None, "0a1b2c3d", 42, "9f8e7d6c5b4a3928")
    # none of them is any server's model's: which model wrote them is not known
    from slotctl.live.identity import ServerModel
    from slotctl.model.content import ModelContent

    server = ServerModel(ModelContent(M + "0" * 48, ("m.gguf",), ("k",), 1, 1, 1))
    for n in (last, old, "slot0-0a1b2c3d-9f8e7d6c5b4a3928.bin"):
        assert "earlier slotctl" in server.refusal(seal.parse_name(n))
    assert server.refusal(seal.parse_name(seal.state_name(0, M, [1], SUM))) is None
    assert "another model" in server.refusal(seal.parse_name(seal.state_name(0, D, [1], SUM)))
    assert "not known" in server.refusal(seal.parse_name(seal.state_name(0, M, [1], SUM, D)))
    with_draft = ServerModel(server.target, ModelContent(D + "0" * 48, ("d.gguf",), ("k",), 1, 1, 1))
    assert with_draft.refusal(seal.parse_name(seal.state_name(0, M, [1], SUM, D))) is None
    assert "another draft model" in with_draft.refusal(seal.parse_name(seal.state_name(0, M, [1], SUM, M)))
    assert "not known when it was stored" in with_draft.refusal(
        seal.parse_name(seal.state_name(0, M, [1], SUM, seal.UNKNOWN_DRAFT)))
    # not states: working files, temporary files, other files
    for other in ("keep-slot0-incoming-12-0a0b0c0d.bin", "serve-slot1-incoming-12-0a0b0c0d.bin",
                  "serve-slot1-999-1-incoming.bin", ".slot0-a-b.bin.slotctl-1a2b.tmp", "notes.txt", "slot0.bin",
                  "x-slot0-a-b.bin"):
        assert seal.parse_name(other) is None, other


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
            assert seal.parse_name(w) is None
    assert names.work_name("keep", 0, "incoming") != names.work_name("keep", 0, "incoming")
    # keep's working files of the previous release are the same names
    assert names.work_owner("keep-slot0-incoming-4242-0a0b0c0d.bin") == ("keep", 4242)
    # no state is pinned: prune may delete every one
    assert not any(fnmatch.fnmatch(seal.state_name(0, M, [1, 2], SUM), g) for g in names.WORK_GLOBS)
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
    name = seal.state_name(1, M, [1, 2, 3], SUM)
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
