"""Parsing slot files a real llama-server (b11434) wrote, checked against an independent reader."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from slotctl.describe import describe_file
from slotctl.format import ggml
from slotctl.format.appendix import build_sckp, build_sdft
from slotctl.format.blob import blob_header
from slotctl.format.convert import ConversionRefused, convert_payload
from slotctl.model.info import read_model_info
from slotctl.model.predict import rotation_rule
from slotctl.format.tokens import pack_tokens
from slotctl.slotfile import decode_tokens, open_slot_file, rebuild

from conftest import DATA

EXPECT = json.loads((DATA / "expect.json").read_text())
SERVER_FILES = sorted(EXPECT)
KIND_FILES = sorted(p.name for p in (DATA / "kinds").glob("srv-*.bin"))


def _section(d):
    return d["target"]["memory"]["sections"][0]


@pytest.mark.parametrize("name", SERVER_FILES)
def test_inspect_matches_independent_reader(name):
    e = EXPECT[name]
    d = describe_file(open_slot_file(DATA / name))
    sec = _section(d)
    assert d["size"] == e["size"]
    assert d["state_version"] == e["version"]
    assert d["prompt"]["n_words"] == e["n_words"]
    assert d["prompt"]["format"] == e["format"]
    assert d["prompt"]["n_tokens"] == e["n_tokens"]
    assert d["target"]["offset"] + d["target"]["size"] == e["payload_end"]
    assert sec["n_stream"] == e["n_stream"]
    assert [s["cell_count"] for s in sec["streams"]] == e["stream_cells"]
    assert sec["v_trans"] == e["v_trans"]
    assert sec["n_layer"] == e["n_layer"]
    assert (sec["n_rot_k"], sec["n_rot_v"]) == (e["n_rot_k"], e["n_rot_v"])
    assert [[ggml.BY_NAME[l["k_type"]].id, l["k_row_size"]] for l in sec["layers"]] == e["k"]
    v = [[ggml.BY_NAME[l["v_type"]].id, l["v_el_size"], l["v_n_embd"]] if "v_el_size" in l
         else [ggml.BY_NAME[l["v_type"]].id, l["v_row_size"]] for l in sec["layers"]]
    assert v == e["v"]
    filled = [s for s in sec["streams"] if s["cell_count"]]
    assert min(s["pos_min"] for s in filled) == e["pos_min"]
    assert max(s["pos_max"] for s in filled) == e["pos_max"]
    assert d["checkpoints"] == [] and d["draft"] is None and d["trailing_bytes"] == 0
    assert d["findings"] == [] and not d["damaged"]


@pytest.mark.parametrize("name", SERVER_FILES + [f"kinds/{n}" for n in KIND_FILES])
def test_parse_then_build_gives_the_same_bytes(name):
    sf = open_slot_file(DATA / name)
    assert not sf.errors
    assert rebuild(sf) == (DATA / name).read_bytes()


@pytest.mark.parametrize("name,kind,sections", [
    ("kinds/srv-gemma2.bin", "iswa", ["base", "swa"]),
    ("kinds/srv-mamba.bin", "recurrent", ["recurrent"]),
    ("kinds/srv-lfm2.bin", "hybrid", ["attention", "recurrent"]),
    ("kinds/srv-jamba.bin", "hybrid", ["attention", "recurrent"]),
])
def test_other_memory_kinds_are_found_without_a_model(name, kind, sections):
    sf = open_slot_file(DATA / name)
    assert sf.target is not None and len(sf.target_candidates) == 1
    assert sf.target.layout.kind == kind
    assert [s.role for s in sf.target.layout.sections] == sections
    assert sf.target.end == sf.size


def test_packed_token_record_round_trips():
    sf = open_slot_file(DATA / "srv-np1.bin")
    assert sf.tokens.format == "packed"
    assert np.array_equal(pack_tokens(sf.tokens.tokens), sf.words)
    # a media chunk record survives the round trip too
    words = pack_tokens([1, 2, -1, -1, 5], media=[(2, b"\x02" + b"\0" * 8)])
    tk = decode_tokens(words)
    assert tk.format == "packed" and tk.tokens.tolist() == [1, 2, -1, -1, 5]
    assert [(s, bytes(m)) for s, m in tk.media] == [(2, b"\x02" + b"\0" * 8)]
    assert len(words) == 3 + 5 + 1 + 1 + 1 + 3  # marker, version, n, tokens, n_media, start, len, 9 bytes -> 3 words


def test_legacy_token_list():
    tk = decode_tokens(np.array([1, 15043, 3186], np.int32))
    assert tk.format == "legacy" and tk.tokens.tolist() == [1, 15043, 3186]
    assert decode_tokens(np.array([], np.int32)).format == "legacy"


@pytest.mark.parametrize("name", [n for n in SERVER_FILES if n != "srv-kvq8.bin"])
def test_version_4_converts_to_3_and_back_exactly(name):
    sf = open_slot_file(DATA / name)
    payload = (DATA / name).read_bytes()[sf.target.offset:sf.target.end]
    v3 = convert_payload(payload, sf.target.layout, 4, 3)
    n_data = sum(1 for s in _section(describe_file(sf))["streams"] if s["cell_count"])
    assert len(payload) - len(v3) == 8 * n_data
    assert convert_payload(v3, sf.target.layout, 3, 4) == payload


def test_rotated_cache_converts_with_the_rotation_both_versions_apply():
    """Both runtimes rotate a quantized cache by the same rule; version 4 only records it (64 for head 64)."""
    sf = open_slot_file(DATA / "srv-kvq8.bin")
    payload = (DATA / "srv-kvq8.bin").read_bytes()[sf.target.offset:sf.target.end]
    v3 = convert_payload(payload, sf.target.layout, 4, 3)
    assert len(v3) == len(payload) - 8
    with pytest.raises(ConversionRefused, match="head sizes"):
        convert_payload(v3, sf.target.layout, 3, 4)
    rule = rotation_rule(read_model_info(DATA / "target.gguf"))
    assert convert_payload(v3, sf.target.layout, 3, 4, rotations=rule) == payload
    # a model whose heads are not a multiple of 64 is not rotated: the recorded 64 cannot be right
    with pytest.raises(ConversionRefused, match="key rotation of 0"):
        convert_payload(payload, sf.target.layout, 4, 3, rotations=lambda role, tk, tv: (0, 0))
    # a quantized cache saved with rotation disabled would be rotated by a version-3 runtime
    unrotated = bytearray(payload)
    at = sf.target.sections[0].streams[0].data.rot_offset - sf.target.offset
    unrotated[at:at + 8] = bytes(8)
    with pytest.raises(ConversionRefused, match="rotation was disabled"):
        convert_payload(bytes(unrotated), sf.target.layout, 4, 3)


def test_appendix_chain_behind_a_server_payload(tmp_path):
    """SCKP and SDFT appended to a real payload are found, dissected and rebuilt byte for byte."""
    raw = (DATA / "srv-np1.bin").read_bytes()
    sf0 = open_slot_file(DATA / "srv-np1.bin")
    payload = raw[sf0.target.offset:]
    blob = blob_header(0) + payload
    data = raw + build_sckp([dict(n_tokens=64, pos_min=0, pos_max=63, tgt=blob, dft=b"", spec=b"xy")]) \
        + build_sdft(blob, b"spec")
    p = tmp_path / "chain.bin"
    p.write_bytes(data)
    sf = open_slot_file(p)
    assert not sf.errors
    assert [n for n, _, _ in sf.layers()] == ["state header", "token words", "target memory", "SCKP appendix",
                                              "SDFT appendix"]
    assert len(sf.checkpoints) == 1 and sf.checkpoints[0].n_tokens == 64
    assert sf.checkpoints[0].tgt.memory.layout.kind == "kv"
    assert sf.draft.seq_id == 0 and sf.draft.memory is not None
    assert sf.draft_spec.size == 4
    assert rebuild(sf) == data


def test_nothing_is_written_for_empty_appendices():
    assert build_sckp([]) == b"" and build_sdft(b"", b"") == b""
    assert struct.unpack("<II", build_sdft(b"", b"x")[:8]) == (0x54464453, 1)
