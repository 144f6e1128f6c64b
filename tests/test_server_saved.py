"""``slotctl.server.saved``: what a file llama-server b11434 saved says of its -kvu, -ctk, -ctv.

The files are tests/data's, each saved by a real llama-server run with the flags tests/data/README.md names;
the expected values are those command lines. A save of a slot that holds nothing (its stream count alone) is
checked against the real server in tests/test_serve.py (serve's probe).
"""

from __future__ import annotations

import pytest

from conftest import DATA
from slotctl.server.saved import SavedFlags, kv_unified, saved_flags
from slotctl.slotfile import open_slot_file, written_flags


@pytest.mark.parametrize("name, parallel, expected", [
    # -c 256 -np 1 -fa on: one slot, one stream either way: -kvu not told
    ("srv-np1.bin", 1, SavedFlags(1, None, "f16", "f16")),
    # -c 512 -np 2 -fa on: a stream per slot
    ("srv-np2-slot1.bin", 2, SavedFlags(2, False, "f16", "f16")),
    # -c 512 -np 2 -kvu -fa on: one stream for both slots
    ("srv-unified-np2.bin", 2, SavedFlags(1, True, "f16", "f16")),
    # -ctk q8_0 -ctv q8_0
    ("srv-kvq8.bin", 1, SavedFlags(1, None, "q8_0", "q8_0")),
    # -fa off: V rows transposed, their type read all the same
    ("srv-fa-off.bin", 1, SavedFlags(1, None, "f16", "f16")),
    # -ctkd q8_0: the draft's cache types are not -ctk's (the target memory is read, not the draft state)
    ("srv-draft.bin", 1, SavedFlags(1, None, "f16", "f16")),
])
def test_a_servers_save_says_its_flags(name, parallel, expected):
    with open_slot_file(DATA / name) as sf:
        assert saved_flags(written_flags(sf.target), parallel) == expected


def test_a_stream_count_no_server_of_that_many_slots_writes_says_nothing_of_kvu():
    with open_slot_file(DATA / "srv-np2-slot1.bin") as sf:
        got = saved_flags(written_flags(sf.target), 3)     # two streams, three slots: not this server's
    assert got.kv_unified is None and got.said() == {"cache_type_k": "f16", "cache_type_v": "f16"}
    assert kv_unified(None, 2) is None and kv_unified(1, None) is None


def test_a_file_that_did_not_parse_says_nothing():
    assert saved_flags(None, 2) == SavedFlags(None, None, None, None)
    assert saved_flags(None, 2).said() == {}
    # a type that is no cache type llama-server takes (a damaged file): not said
    assert saved_flags(("type99", "f16", "on", 2), 2).said() == {"kv_unified": False, "cache_type_v": "f16"}


def test_what_saves_say_wins_over_the_flags_given_and_a_contradiction_is_said_once():
    from slotctl.server.flags import ServerFlags
    from slotctl.server.saved import Learnt

    def take(saved):
        events, changed = learnt.take(saved, slot=0, total_slots=2, source="probe")
        return [(e, d.get("flag"), d.get("given"), d.get("server")) for e, _m, d in events], changed

    learnt = Learnt(ServerFlags(kv_unified=True, cache_type_k="f16"), frozenset({"kv_unified", "cache_type_k"}))
    # an empty slot's save: the stream count alone (-np 2, two streams): -kvu given wrongly
    assert take(SavedFlags(2, False, None, None)) == ([("warning", "-kvu", True, False),
                                                        ("learned", None, None, None)], True)
    assert learnt.flags.kv_unified is False and learnt.flags.cache_type_k == "f16"
    # a save with cells: the types; -ctk given wrongly, -ctv was not given (the default f16 replaced, no warning)
    assert take(SavedFlags(2, False, "q8_0", "q8_0")) == ([("warning", "-ctk", "f16", "q8_0"),
                                                           ("learned", None, None, None)], True)
    assert (learnt.flags.cache_type_k, learnt.flags.cache_type_v) == ("q8_0", "q8_0")
    assert learnt.given == {"kv_unified", "cache_type_k", "cache_type_v"}
    # the same said again: nothing new, nothing said again
    assert take(SavedFlags(2, False, "q8_0", "q8_0")) == ([], False)
    assert learnt.as_details() == {"kv_unified": False, "cache_type_k": "q8_0", "cache_type_v": "q8_0"}
    # the flags given said back by a save: learnt, no warning, nothing judged otherwise
    learnt = Learnt(ServerFlags(cache_type_k="q8_0"), frozenset({"cache_type_k"}))
    assert take(SavedFlags(1, None, "q8_0", "f16")) == ([("learned", None, None, None)], False)
    # another model's server: back to the flags given
    learnt.forget()
    assert learnt.flags.cache_type_k == "q8_0" and learnt.said == {} and learnt.given == {"cache_type_k"}
