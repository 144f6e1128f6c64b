"""The server's rules in one home (slotctl.server): flags, the restore steps, the token rule, checkpoints.

The steps read real files: server-written ones from tests/data and files slotctl writes from real
contexts, with appendices built by the same code the runtime writes them with.
"""

from __future__ import annotations

import json
import os
import struct
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.cli.options import SERVER_PANEL
from slotctl.errors import UsageError
from slotctl.format import appendix as apx
from slotctl.format.common import Span
from slotctl.server import restore as rs
from slotctl.server.checkpoints import keep_newest, requested_positions, rollback_checkpoint, user_starts
from slotctl.server.flags import FLAGS, FlagError, ServerFlags, attn_rot_disable, env_switch
from slotctl.slotfile import decode_tokens, open_slot_file

from conftest import DATA


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


# -- flags ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("typed,value,shown", [
    (["-ctk", "q8"], "q8", "-ctk q8: expected one of f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"),
    (["--cache-type-k=q8"], "q8", "--cache-type-k q8: expected one of f32, f16, bf16"),
    (["--cache-type-v-draft", "Q8_0"], "Q8_0", "--cache-type-v-draft Q8_0: expected one of"),
    (["-fa", "maybe"], "maybe", "-fa maybe: expected on, off or auto"),
])
@pytest.mark.parametrize("command", ["validate", "save", "restore"])
def test_a_bad_flag_is_named_as_typed(command, typed, value, shown):
    args = {"validate": [DATA / "srv-np1.bin"], "save": ["-m", DATA / "target.gguf", "-o", "x.bin", "-p", "hi"],
            "restore": [DATA / "srv-np1.bin", "-m", DATA / "target.gguf"]}[command]
    res = _invoke(command, *args, *typed)
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == f"error: {shown}" or res.stderr.strip().startswith(f"error: {shown}"), res.stderr


def test_flash_attn_takes_the_servers_spellings():
    for given, want in (("on", "on"), ("enabled", "on"), ("1", "on"), ("off", "off"), ("false", "off"),
                        ("auto", "auto"), ("-1", "auto")):
        assert ServerFlags(flash_attn=given).flash_attn == want
    with pytest.raises(FlagError) as e:
        ServerFlags(flash_attn="yes")
    assert str(e.value) == "-fa yes: expected on, off or auto"


def test_cache_types_are_read_as_the_server_reads_them():
    assert ServerFlags(cache_type_k="q8_0").context_settings().type_k == "q8_0"
    with pytest.raises(FlagError, match=r"^-ctk Q8_0: expected one of"):
        ServerFlags(cache_type_k="Q8_0")       # kv_cache_type_from_str compares exact names
    with pytest.raises(FlagError, match=r"^-np 0: expected a number of slots from 1 to 256"):
        ServerFlags(parallel=0)
    assert isinstance(FlagError("parallel", 0, "x"), UsageError)


def test_every_flag_is_in_one_help_panel():
    res = _invoke("validate", "--help")
    assert res.exit_code == 0
    text = res.output
    assert SERVER_PANEL in text
    panel = text.split(SERVER_PANEL)[1]
    for spellings in FLAGS.values():
        assert spellings[0] in panel, spellings
    assert "[on|off|auto]" in panel


def test_the_flags_give_the_context_settings():
    f = ServerFlags(ctx_size=512, parallel=2, kv_unified=True, cache_type_k="q8_0", flash_attn="on", threads=3)
    s = f.context_settings()
    assert (s.n_ctx, s.n_parallel, s.kv_unified, s.type_k, s.flash_attn, s.n_threads) == (512, 2, True, "q8_0", "on", 3)
    assert ServerFlags.from_settings(s) == f.replace(spec_draft_type_k="f16")


@pytest.mark.parametrize("value,on", [("1", True), ("0", False), ("", False), (" +2x", True), ("-1", True),
                                      ("abc", False), ("00", False)])
def test_environment_switches_read_like_atoi(value, on):
    assert env_switch("X", {"X": value}) is on
    assert attn_rot_disable({"LLAMA_ATTN_ROT_DISABLE": value}) is on


# -- the token rule --------------------------------------------------------------------------------------------


def test_the_token_rule_is_server_tokens_validate():
    n_vocab = 100
    assert list(rs.invalid_token_indices([1, 2, 99], n_vocab)) == []
    assert list(rs.invalid_token_indices([1, 100, -2], n_vocab)) == [1, 2]
    # -1 is a media chunk's position only where a chunk starts (and the -1 words after it)
    assert list(rs.invalid_token_indices([1, -1, -1, 5], n_vocab)) == [1, 2]
    assert list(rs.invalid_token_indices([1, -1, -1, 5], n_vocab, media=[1])) == []
    assert list(rs.invalid_token_indices([1, -1, -1, 5, -1], n_vocab, media=[1])) == [4]
    # a chunk start that is not a -1 word
    assert list(rs.invalid_token_indices([1, 2, 3], n_vocab, media=[1])) == [1]


def _chunk(type_: int = 1, nx: int = 2, ny: int = 1, entries: int = 1, pos_type: int = 0, merge: int = 1,
           audio_tokens: int = 0) -> bytes:
    """An mtmd chunk (serialization version 2) as mtmd_input_chunk_save writes one, built here field by field."""
    out = struct.pack("<QI", 2, type_) + struct.pack("<Q", 0)       # version, type, no text tokens
    if type_ == 1:
        out += b"\x01" + struct.pack("<IIIII", nx, ny, pos_type, 0, merge) + struct.pack("<Q", 3) + b"img"
        out += b"\x00" + struct.pack("<Q", entries) + b"".join(struct.pack("<BBiii", 0, 0, 0, 4, 4)
                                                                 for _ in range(entries))
    else:
        out += b"\x00"
    if type_ == 2:
        out += b"\x01" + struct.pack("<I", audio_tokens) + struct.pack("<Q", 3) + b"aud" + b"\x01" + struct.pack("<Q", 0)
    else:
        out += b"\x00"
    return out


@pytest.mark.parametrize("chunk,n_tokens,n_pos", [
    (_chunk(nx=2, ny=1), 2, 2),
    (_chunk(nx=3, ny=2, entries=2), 12, 12),               # nx * ny per batch entry
    (_chunk(nx=3, ny=2, entries=3, merge=2), 12, 12),      # 3 entries merged by 2: 2 frames
    (_chunk(nx=3, ny=2, pos_type=1), 6, 3),                # M-RoPE: max(nx, ny) positions
    (_chunk(nx=3, ny=2, pos_type=2), 10, 10),              # HunyuanVL: (nx + 1) * ny + 2
    (_chunk(type_=2, audio_tokens=5), 5, 5),
    (_chunk(type_=0), 0, 0),
])
def test_a_media_chunk_counts_as_mtmd_counts_it(chunk, n_tokens, n_pos):
    ext = rs.chunk_extent(chunk)
    assert (ext.n_tokens, ext.n_pos, ext.text) == (n_tokens, n_pos, chunk[8] == 0)


def test_media_words_are_exactly_each_chunks_tokens(tmp_path):
    """server_tokens::validate (b11434): at a -1 word a chunk must start; exactly its n_tokens -1 words
    follow; it is not text and has n_pos > 0; every chunk is met (issue 24: any run of -1 words from a media
    start was taken as the chunk's)."""
    two = rs.MediaExtent(False, 2, 2)
    bad = lambda toks, media: list(rs.invalid_token_indices(toks, 100, media))   # noqa: E731
    first = lambda toks, media: bad(toks, media)[:1]   # noqa: E731  (the server stops at the first)
    assert bad([1, -1, -1, 5], {1: two}) == []
    assert bad([1, -1, -1, -1, 5], {1: two}) == [3]                    # one -1 word more than the chunk's
    assert first([1, -1, 5, 6], {1: two}) == [1]                         # fewer
    assert first([1, -1, -1], {1: rs.MediaExtent(False, 3, 3)}) == [1]   # more than the tokens left
    assert first([1, -1, -1, 5], {1: rs.MediaExtent(False, 2, 0)}) == [1]     # n_pos 0
    assert first([1, -1, -1, 5], {1: rs.MediaExtent(True, 2, 2)}) == [1]      # a text chunk
    assert bad([1, -1, -1, -1, -1, 5], {1: two, 3: two}) == []               # two chunks back to back
    assert bad([1, -1, -1, -1, -1, 5], {1: two, 2: two})[0] == 2              # a start inside a chunk: never met
    assert bad([1, 2, -1, -1], {1: two, 2: two}) == [1]                       # a start on a text token
    # the chunk's extent unknown (unreadable: refused by the chunk loader first): the run from its start
    assert bad([1, -1, -1, -1, 5], {1: None}) == []
    # a file: the words the chunk says, validated with a model, and one -1 word more
    from slotctl.format.tokens import pack_tokens
    from slotctl.slotfile import build_header

    raw = (DATA / "srv-np1.bin").read_bytes()
    sf = open_slot_file(DATA / "srv-np1.bin")
    for toks, ok in (([1, -1, -1, 5], True), ([1, -1, -1, -1, 5], False)):
        words = pack_tokens(toks, media=[(1, _chunk(nx=2, ny=1))])
        (tmp_path / "m.bin").write_bytes(build_header(4, words) + raw[sf.target.offset:])
        sf2 = open_slot_file(tmp_path / "m.bin")
        assert (rs.check_tokens(decode_tokens(words), n_ctx_slot=256, n_vocab=100, has_mtmd=True).status
                == rs.RESTORED) is ok
        from slotctl.server.findings import invalid_tokens_finding, media_extents

        assert (invalid_tokens_finding(sf2.tokens.tokens, 100, media_extents(sf2)) is None) is ok


def test_check_tokens_in_the_servers_order():
    sf = open_slot_file(DATA / "srv-np1.bin")
    tk = sf.tokens
    assert rs.check_tokens(tk, n_ctx_slot=4096, n_vocab=10**6, has_mtmd=False).status == rs.RESTORED
    short = rs.check_tokens(tk, n_ctx_slot=tk.n_tokens - 1, n_vocab=1, has_mtmd=False)
    assert (short.status, short.message) == (rs.REFUSED, "Restored prompt does not fit in the slot context")
    bad = rs.check_tokens(tk, n_ctx_slot=4096, n_vocab=1, has_mtmd=False)
    assert (bad.status, bad.message) == (rs.REFUSED, "Invalid tokens in slot save file")


# -- the steps, on real files --------------------------------------------------------------------------------


def _copy_with(tmp_path, name: str, tail: bytes):
    src = (DATA / "srv-np1.bin").read_bytes()
    sf = open_slot_file(DATA / "srv-np1.bin", layout=_layout())
    path = tmp_path / name
    path.write_bytes(src[:sf.target.end] + tail)
    return path, sf.target.end


def _layout():
    from slotctl.model.info import read_model_info

    return read_model_info(DATA / "target.gguf").layout()


def test_state_header_step(tmp_path):
    size = (DATA / "srv-np1.bin").stat().st_size
    with open(DATA / "srv-np1.bin", "rb") as f:
        ok = rs.check_state_header(f, size)
        old = rs.check_state_header(f, size, state_version=3)
    assert (ok.status, ok.version) == (rs.RESTORED, 4) and ok.bytes == 12 + 4 * ok.n_words
    assert old.status == rs.REFUSED and old.message == rs.TARGET_ERROR
    assert old.reason.startswith("unknown (magic, version) for sequence state file: 67677371, 00000004")
    cut = tmp_path / "cut.bin"
    cut.write_bytes((DATA / "srv-np1.bin").read_bytes()[:20])
    with open(cut, "rb") as f:
        got = rs.check_state_header(f, 20)
    assert got.status == rs.REFUSED and "exceeds the file size" in got.reason


def test_checkpoints_step_keeps_the_newest(tmp_path):
    cps = [dict(n_tokens=n, pos_min=0, pos_max=n - 1, tgt=b"t" * n, dft=b"", spec=b"s") for n in (4, 8, 12)]
    path, end = _copy_with(tmp_path, "sckp.bin", apx.build_sckp(cps))
    size = path.stat().st_size
    with open(path, "rb") as f:
        got = rs.load_slot_checkpoints(f, end, size, n_ctx_checkpoints=2)
        assert got.status == rs.RESTORED and got.bytes == size - end and got.count == 3
        assert [c.n_tokens for c in got.kept] == [8, 12]
        assert got.kept[0].tgt.read(f) == b"t" * 8 and got.kept[0].spec.read(f) == b"s"
        assert "kept the last 2 of 3" in got.reason
        assert rs.load_slot_checkpoints(f, end, size, n_ctx_checkpoints=0).kept == ()
    # cut inside the last blob: the appendix is ignored, 0 bytes
    path.write_bytes(path.read_bytes()[:-3])
    with open(path, "rb") as f:
        got = rs.load_slot_checkpoints(f, end, size - 3)
    assert (got.status, got.bytes, got.kept) == (rs.IGNORED, 0, ())
    with open(DATA / "srv-np1.bin", "rb") as f:
        assert rs.load_slot_checkpoints(f, end, end).status == rs.ABSENT


def _appendix_variants():
    """SCKP appendices the loader keeps or ignores: well formed, another version, a count the bytes cannot hold,
    cut short, a length beyond the file, an empty target blob, a blob llama.cpp would not load."""
    cps = [dict(n_tokens=n, pos_min=0, pos_max=n - 1, tgt=b"t" * n, dft=b"", spec=b"") for n in (4, 8)]
    good = apx.build_sckp(cps)
    empty_tgt = apx.build_sckp([dict(cps[0], tgt=b""), cps[1]])
    sdft = apx.build_sdft(b"d" * 8)
    yield "good", good
    yield "good+sdft", good + sdft
    yield "version", good[:4] + struct.pack("<I", apx.SCKP_VERSION + 1) + good[8:]
    yield "count", good[:8] + struct.pack("<I", apx.MAX_CHECKPOINTS + 1) + good[12:]
    yield "cut", good[:-3]
    yield "length", good[:-4] + struct.pack("<I", 1 << 30)
    yield "empty-target", empty_tgt
    yield "empty-target+sdft", empty_tgt + sdft


@pytest.mark.parametrize("name,tail", list(_appendix_variants()), ids=[n for n, _ in _appendix_variants()])
def test_checkpoints_read_is_the_loaders_rule(tmp_path, name, tail):
    """``findings.checkpoints_read`` (what inspect, validate and ls read) says what ``load_slot_checkpoints``
    does with the same bytes: one rule, the parsed file's form of the step."""
    from slotctl.server.findings import checkpoints_read

    path, end = _copy_with(tmp_path, f"{name}.bin", tail)
    size = path.stat().st_size
    with open(path, "rb") as f:
        step = rs.load_slot_checkpoints(f, end, size)
    sf = open_slot_file(path, layout=_layout())
    assert checkpoints_read(sf) == (step.status != rs.IGNORED), (step, sf.errors)
    assert step.status == (rs.RESTORED if name.startswith("good") else rs.IGNORED)


def test_draft_step_applies_the_speculative_state_as_the_seed_does(tmp_path):
    path, end = _copy_with(tmp_path, "sdft.bin", apx.build_sdft(b"D" * 10, b"S" * 6))
    size = path.stat().st_size
    seen = []

    def take(span):
        seen.append(span.size)
        return None

    with open(path, "rb") as f:
        got = rs.load_slot_draft(f, end, size, has_draft_context=True, set_draft=take)
        assert (got.status, got.bytes, seen) == (rs.RESTORED, size - end, [10])
        assert got.speculative.status == rs.IGNORED      # no decoder of a draft-simple server keeps one
        # no draft context: dropped, bytes consumed, the speculative state never set
        got = rs.load_slot_draft(f, end, size, has_draft_context=False, set_draft=take,
                                 set_speculative=lambda s: pytest.fail("set after a drop"))
        assert (got.status, got.bytes, got.speculative) == (rs.DROPPED, size - end, None)
        assert got.message == "draft state does not match the draft context - dropped"
    # an empty draft blob with a speculative state: the state is still set
    path, end = _copy_with(tmp_path, "spec-only.bin", apx.build_sdft(b"", b"S" * 6))
    with open(path, "rb") as f:
        got = rs.load_slot_draft(f, end, path.stat().st_size, has_draft_context=False, set_draft=take,
                                 set_speculative=lambda s: rs.apply_speculative_state(s, keeps=True, expected_size=6))
    assert got.status == rs.RESTORED and got.speculative.status == rs.RESTORED
    # a magic cut short: no draft state (the server's "return 0")
    path, end = _copy_with(tmp_path, "magic.bin", b"SDF")
    with open(path, "rb") as f:
        assert rs.read_slot_draft(f, end, path.stat().st_size).status == rs.ABSENT
    # another version: ignored
    path, end = _copy_with(tmp_path, "v2.bin", struct.pack("<II", apx.SDFT_MAGIC, 2) + bytes(16))
    with open(path, "rb") as f:
        got = rs.read_slot_draft(f, end, path.stat().st_size)
    assert (got.status, got.bytes) == (rs.IGNORED, 0)


def test_eagle3_state_size_is_checked():
    assert rs.apply_speculative_state(Span(0, 8), keeps=True, expected_size=8).status == rs.RESTORED
    assert rs.apply_speculative_state(Span(0, 7), keeps=True, expected_size=8).status == rs.IGNORED
    assert rs.apply_speculative_state(Span(0, 8), keeps=False, expected_size=8).status == rs.IGNORED


# -- checkpoints -----------------------------------------------------------------------------------------------


def test_checkpoint_rules():
    class C:
        def __init__(self, pos_min, pos_max):
            self.pos_min, self.pos_max = pos_min, pos_max

    cps = [C(0, 10), C(5, 20), C(15, 30)]
    assert rollback_checkpoint(cps, 25, 16) is cps[1]
    assert rollback_checkpoint(cps, 35, 16) is cps[2]
    assert rollback_checkpoint(cps, 35, 15) is cps[1]
    assert rollback_checkpoint(cps, 5, 1) is None
    assert keep_newest([1, 2, 3], 2) == [2, 3] and keep_newest([1, 2], 0) == []
    assert requested_positions([5, 3, 5], 4, 13) == [3, 4, 5, 8, 12]
    with pytest.raises(ValueError, match="--checkpoint-at 13"):
        requested_positions([13], None, 13)
    words = {"<u>": [7, 8]}
    assert user_starts(lambda d: words[d], [1, 7, 8, 2, 7, 8], ["<u>"]) == [1, 4]


def test_decode_tokens_feeds_the_token_step():
    words = np.array([1, 2, 3], dtype=np.int32)
    tk = decode_tokens(words)
    assert rs.check_tokens(tk, n_ctx_slot=3, n_vocab=4, has_mtmd=False).status == rs.RESTORED


# -- source facts of the model package (b11434 llama_model_rope_type, llama_kv_cache constructor) ----------


def _header(tmp_path, arch: str, **keys) -> str:
    import gguf

    path = str(tmp_path / f"{arch}-{len(list(tmp_path.iterdir()))}.gguf")
    w = gguf.GGUFWriter(path, arch)
    for key, value in {"block_count": 2, "context_length": 4096, "embedding_length": 256,
                       "attention.head_count": 2, **keys}.items():
        key = f"{arch}.{key.replace('__', '.')}"
        w.add_array(key, value) if isinstance(value, list) else w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_architectures_whose_rules_slotctl_does_not_write_are_unsupported_and_say_so(tmp_path):
    """Correction 6 of issue 15: bailingmoe3's and dflash's cell ext and the DeepSeek lightning indexers' forced
    K rotation concern only architectures whose caches slotctl does not model, so they are not written: each
    such model is "unsupported", and asking it for a layout says plainly what its memory is."""
    from slotctl.model.archs import MROPE_IF_SECTIONS_ARCHS, UNSUPPORTED_ARCHS
    from slotctl.model.info import read_model_info

    for arch, keys in (("bailingmoe3", dict(rope__dimension_sections=[8, 8, 0, 0])),
                       ("dflash", dict(rope__dimension_sections=[0, 0, 0, 4])),
                       ("deepseek32", dict(attention__key_length=128, attention__indexer__key_length=128)),
                       ("deepseek4", {}), ("glm-dsa", {}), ("dots3note", {})):
        info = read_model_info(_header(tmp_path, arch, **keys))
        assert info.memory_kind == "unsupported" and info.unsupported == UNSUPPORTED_ARCHS[arch]
        with pytest.raises(UsageError, match=arch):
            info.layout()
    assert "bailingmoe3" not in MROPE_IF_SECTIONS_ARCHS
    # the rule that stays: glm4's M-RoPE by its first two sections
    assert read_model_info(_header(tmp_path, "glm4", rope__dimension_sections=[8, 8, 0, 0])).has_cell_ext
    assert not read_model_info(_header(tmp_path, "glm4", rope__dimension_sections=[8, 0, 0, 0])).has_cell_ext


# -- speculative state ----------------------------------------------------------------------------------------


def test_eagle3_state_parses_where_the_draft_model_says_so():
    from types import SimpleNamespace

    from slotctl.server.speculative import decoder_kind, describe_state, parse_state

    eagle = SimpleNamespace(arch="eagle3", n_embd=4)
    assert decoder_kind(eagle) == "eagle3" and decoder_kind(SimpleNamespace(arch="llama")) is None
    data = struct.pack("<i4f", 17, 0.5, -1.0, 2.0, 0.0)
    st = parse_state(data, "eagle3", eagle)
    assert (st.kind, st.pos, st.n_embd, st.expected_size, st.error) == ("eagle3", 17, 4, 20, None)
    assert parse_state(data[:-4], "eagle3", eagle).error == "3 values, the draft model's embedding has 4"
    assert parse_state(data, None).as_dict()["kind"] == "opaque"
    mamba = SimpleNamespace(memory_kind="recurrent")
    assert describe_state(20, mamba, eagle) == {"kind": "eagle3", "size": 20, "expected_size": 20, "applied": True}
    assert describe_state(20, SimpleNamespace(memory_kind="kv"), eagle)["applied"] is False
    assert describe_state(7)["kind"] == "opaque" and describe_state(0) is None


def test_validate_checks_the_speculative_state_against_the_draft_model(tmp_path):
    from types import SimpleNamespace

    from slotctl.model.info import read_model_info
    from slotctl.validate.speculative import speculative_findings

    src = DATA / "kinds" / "srv-mamba.bin"
    tinfo = read_model_info(DATA / "kinds" / "mamba.gguf")
    sf0 = open_slot_file(src, layout=tinfo.layout())
    eagle = SimpleNamespace(arch="eagle3", n_embd=4)
    for spec, want in ((struct.pack("<i4f", 3, 1, 2, 3, 4), []), (bytes(12), ["speculative_state_mismatch"])):
        path = tmp_path / f"spec-{len(spec)}.bin"
        path.write_bytes(src.read_bytes()[:sf0.target.end] + apx.build_sdft(b"", spec))
        sf = open_slot_file(path, layout=tinfo.layout())
        with open(path, "rb") as f:
            got = speculative_findings(sf, f, tinfo, eagle)
            assert [x.code for x in got] == want
            if want:
                assert got[0].severity == "drop" and got[0].layer == "draft"
            # a draft model that is not eagle3: the server ignores the state (checked below too)
            other = speculative_findings(sf, f, tinfo, read_model_info(DATA / "draft.gguf"))
            assert [(x.code, x.severity) for x in other] == [("speculative_state_ignored", "note")]


def test_validate_says_a_draft_simple_server_ignores_the_speculative_state(tmp_path):
    import json

    src = DATA / "srv-np1.bin"
    sf0 = open_slot_file(src, layout=_layout())
    path = tmp_path / "spec.bin"
    path.write_bytes(src.read_bytes()[:sf0.target.end] + apx.build_sdft(b"", b"\x01" * 24))
    res = _invoke("validate", path, "-m", DATA / "target.gguf", "-md", DATA / "draft.gguf", "--spec-type", "draft-simple", "--no-load", "--json")
    doc = json.loads(res.stdout)
    codes = [f["code"] for f in doc["files"][0]["findings"]]
    assert "speculative_state_ignored" in codes
    res = _invoke("inspect", path, "-m", DATA / "target.gguf", "-md", DATA / "draft.gguf", "--json")
    spec = json.loads(res.stdout)["files"][0]["draft"]["speculative"]
    assert spec == {"kind": "opaque", "size": 24, "expected_size": None, "applied": False}


# -- validate's real load: the parent sends the layer's bytes, the child opens no file ----------------------


def test_the_real_load_gets_the_layer_through_the_pipe():
    from slotctl.model.settings import ContextSettings
    from slotctl.validate import LoadChecker, ServerSetup
    from slotctl.validate.child import _layout_dict

    path = DATA / "srv-np1.bin"
    sf = open_slot_file(path, layout=_layout())
    step = {"ctx": "target", "path": str(path), "offset": sf.target.offset, "size": sf.target.size, "blob": False,
            "version": sf.version, "layout": _layout_dict(sf.target.layout), "flags": 0, "slot": 0, "prefix": False}
    setup = ServerSetup(target=DATA / "target.gguf", settings=ContextSettings(n_ctx=4096))
    gone = DATA.parent / "no-such-dir" / "srv-np1.bin"     # the child never opens the path it is told
    with LoadChecker(setup) as checker, open(path, "rb") as f:
        by_pipe = checker.load(step, f)
        named_elsewhere = checker.load({**step, "path": str(gone)}, f)
        cut = checker.load({**step, "size": step["size"] - 1}, f)
    assert by_pipe["status"] == "fits" and by_pipe == named_elsewhere
    assert cut["status"] != "fits"


# -- validate opens each file once --------------------------------------------------------------------------

_OPENED: list | None = None


def _count_opens(event, args):
    if _OPENED is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fspath(args[0]))


def test_validate_opens_each_file_once(tmp_path):
    global _OPENED
    from slotctl.model.settings import ContextSettings
    from slotctl.validate import ServerSetup, validate_paths

    sys.addaudithook(_count_opens)
    whole = tmp_path / "draft.bin"
    whole.write_bytes((DATA / "srv-draft.bin").read_bytes())
    cut = tmp_path / "cut.bin"
    cut.write_bytes(whole.read_bytes()[:-1000])
    setup = ServerSetup(target=DATA / "target.gguf", draft=DATA / "draft.gguf", settings=ContextSettings(n_ctx=4096),
                        spec_type="draft-simple")
    for path in (whole, cut):
        _OPENED = []
        try:
            report = validate_paths([path], setup, real_check=True)
        finally:
            opened, _OPENED = _OPENED, None
        assert report.files[0].checks, report.files[0].findings
        assert opened.count(str(path)) == 1, opened


def test_damage_is_recorded_with_its_layer_as_a_name(tmp_path):
    src = (DATA / "srv-np1.bin").read_bytes()
    sf0 = open_slot_file(DATA / "srv-np1.bin", layout=_layout())
    end = sf0.target.end
    cps = [dict(n_tokens=4, pos_min=0, pos_max=3, tgt=b"t" * 40, dft=b"", spec=b"")]
    cases = {
        "state header": src[:10],
        "target memory": src[:end - 7],
        "SCKP appendix": src[:end] + apx.build_sckp(cps)[:-5],
        "checkpoint 0 target blob": src[:end] + apx.build_sckp(cps),
        "SDFT appendix": src[:end] + apx.build_sdft(b"D" * 20, b"")[:-3],
    }
    for want, data in cases.items():
        path = tmp_path / "f.bin"
        path.write_bytes(data)
        sf = open_slot_file(path, layout=_layout())
        assert [e.part for e in sf.errors] == [want], (want, [e.one_line() for e in sf.errors])


def test_an_appendix_of_2000_checkpoints_keeps_the_newest_and_the_draft_behind_it(tmp_path):
    """Correction 1 of issue 15: the checkpoint loader (a reading of 033df86b6) has no count cap; the 1024 of
    PR #26004's description is not in it. 2,000 checkpoints: read, the newest --ctx-checkpoints kept, the SDFT
    behind them read; the verdict rests on that reading (certain: false). Above slotctl's own bound of
    65,536, slotctl reads none and says so."""
    import json

    empty_kv = struct.pack("<IiII", 0xAF143CD8, 0, 1, 0)    # a state blob of one empty KV stream
    cps = [dict(n_tokens=n, pos_min=0, pos_max=n - 1, tgt=empty_kv, dft=b"", spec=b"") for n in range(1, 2001)]
    path, end = _copy_with(tmp_path, "2000.bin", apx.build_sckp(cps) + apx.build_sdft(b"", b"\x01" * 8))
    size = path.stat().st_size
    with open(path, "rb") as f:
        got = rs.load_slot_checkpoints(f, end, size, n_ctx_checkpoints=32)
        assert (got.status, got.count, len(got.kept)) == (rs.RESTORED, 2000, 32)
        assert [c.n_tokens for c in got.kept] == list(range(1969, 2001))
        draft = rs.read_slot_draft(f, end + got.bytes, size)
        assert draft.status == rs.RESTORED and draft.spec.size == 8
    res = _invoke("validate", path, "-m", DATA / "target.gguf", "-c", "256", "-fa", "on", "--no-load", "--json")
    (rep,) = json.loads(res.stdout)["files"]
    codes = {f["code"]: f for f in rep["findings"]}
    assert "keeps the last 32" in codes["too_many_checkpoints"]["message"]
    assert "checkpoints_damaged" not in codes and "draft_unreachable" not in codes
    steps = {s["step"]: s for s in rep["steps"]}
    assert (steps["checkpoints"]["status"], steps["checkpoints"]["count"], steps["checkpoints"]["kept"]) == \
        ("restored", 2000, 32)
    assert steps["draft"]["status"] == "restored"
    # b11669 (the default build) restores such a file so (tests/test_b11669.py): certain; for b11434 the
    # appendix is ignored whole
    assert rep["verdict"] == "restores_with_drops" and rep["certain"] is True and rep["build"] == "b11669"
    # beyond slotctl's bound: nothing read, nothing claimed but the reading
    head = apx.SckpAppendix.build(dict(magic=apx.SCKP_MAGIC, version=1, count=0, checkpoints=[]))[:8]
    big = head + struct.pack("<I", apx.MAX_CHECKPOINTS + 1) + bytes(40 * (apx.MAX_CHECKPOINTS + 1))
    path, end = _copy_with(tmp_path, "big.bin", big)
    with open(path, "rb") as f, pytest.raises(rs.FormatError, match="at most 65,536"):
        rs.load_slot_checkpoints(f, end, path.stat().st_size)
    res = _invoke("validate", path, "-m", DATA / "target.gguf", "-c", "256", "-fa", "on", "--no-load", "--json")
    (rep,) = json.loads(res.stdout)["files"]
    assert [f["code"] for f in rep["findings"] if f["layer"] == "checkpoints"] == ["checkpoints_unread"]
    assert rep["certain"] is False


def test_a_right_sized_eagle3_state_that_is_not_finite_is_applied(tmp_path):
    """Correction 4 of issue 15: common_speculative_impl_draft_eagle3::set_state (b11434) checks the size
    only, so a row of NaN and infinities of the right size is applied: not a mismatch, not dropped; a note."""
    from types import SimpleNamespace

    from slotctl.model.info import read_model_info
    from slotctl.server.speculative import parse_state
    from slotctl.validate.speculative import speculative_findings

    eagle = SimpleNamespace(arch="eagle3", n_embd=4)
    row = struct.pack("<i4f", 3, float("nan"), 1.0, float("inf"), 2.0)
    st = parse_state(row, "eagle3", eagle)
    assert (st.error, st.non_finite) == (None, 2)
    src = DATA / "kinds" / "srv-mamba.bin"
    tinfo = read_model_info(DATA / "kinds" / "mamba.gguf")
    sf0 = open_slot_file(src, layout=tinfo.layout())
    path = tmp_path / "nan.bin"
    path.write_bytes(src.read_bytes()[:sf0.target.end] + apx.build_sdft(b"", row))
    sf = open_slot_file(path, layout=tinfo.layout())
    with open(path, "rb") as f:
        got = speculative_findings(sf, f, tinfo, eagle)
    assert [(x.code, x.severity) for x in got] == [("speculative_state_not_finite", "note")]
    assert "2 values that are not finite" in got[0].message and "applies it" in got[0].message
    with open(path, "rb") as f:
        spec = rs.load_slot_draft(f, sf0.target.end, path.stat().st_size, has_draft_context=True,
                                  set_draft=lambda span: None,
                                  set_speculative=lambda s: rs.apply_speculative_state(s, keeps=True,
                                                                                       expected_size=20)).speculative
    assert spec.status == rs.RESTORED


def test_each_appendix_is_named_with_the_change_that_reads_it(tmp_path):
    """Correction 5 of issue 15: SCKP comes from the checkpoint change (PR #26004, 033df86b6), SDFT from the
    draft-state change (ea736c1d5); live mode's n_read is b11434's (to the end of the payload) only there."""
    from slotctl.cli.remote import _ANSWER_KEYS
    from slotctl.server.findings import structural_findings

    cps = [dict(n_tokens=4, pos_min=0, pos_max=3, tgt=b"t" * 4, dft=b"", spec=b"")]
    for name, tail, has, lacks in (
            ("sckp", apx.build_sckp(cps), "checkpoint change (PR #26004, llama.cpp 033df86b6)", "ea736c1d5"),
            ("sdft", apx.build_sdft(b"d" * 8), "draft-state change (llama.cpp ea736c1d5)", "033df86b6")):
        path, _ = _copy_with(tmp_path, f"{name}.bin", tail)
        (f,) = [x for x in structural_findings(open_slot_file(path, layout=_layout()), build="b11434")
                if x.code == "appendix_needs_new_server"]
        assert has in f.message and lacks not in f.message, f.message
        assert (f.doubt is not None) == (name == "sckp")
        # b11669 has both changes: no such note
        assert not [x for x in structural_findings(open_slot_file(path, layout=_layout()))
                    if x.code == "appendix_needs_new_server"]
    assert "b11434" in _ANSWER_KEYS["n_read"] and "appendices" in _ANSWER_KEYS["n_read"]


# -- the draft context from the flags -------------------------------------------------------------------------


def test_the_draft_context_as_b11434_builds_it_from_its_flags():
    import dataclasses

    from slotctl.model.info import gguf_spec_types, read_model_info
    from slotctl.server.speculative import draft_context, parse_spec_types, server_spec_types

    t, d = read_model_info(DATA / "target.gguf"), read_model_info(DATA / "draft.gguf")
    # -md alone: the default list is none, nothing is inferred from a plain GGUF: no drafter, no context
    got = draft_context(None, d, t)
    assert not got.built and got.types == ("none",) and "--spec-type" in got.why
    assert draft_context("draft-simple", d, t).built
    assert draft_context("ngram-mod", d, t).built          # an implementation: ctx_dft is kept
    assert not draft_context("none", d, t).built
    assert not draft_context("draft-simple", None, t).built    # no draft model, no MTP
    # the types inferred from a draft GGUF (common_speculative_types_from_gguf): MTP heads, dflash, dspark
    assert gguf_spec_types("qwen3", 3, frozenset({"blk.2.nextn.eh_proj.weight"})) == ("draft-mtp",)
    assert gguf_spec_types("qwen3", 3, frozenset({"blk.1.nextn.eh_proj.weight"})) == ()
    assert gguf_spec_types("dflash", 2, frozenset()) == ("draft-dflash",)
    assert gguf_spec_types("dflash", 2, frozenset({"markov_w1.weight"})) == ("draft-dspark",)
    assert gguf_spec_types("eagle3", 1, frozenset()) == ()     # eagle3 only by --spec-type draft-eagle3
    mtp = dataclasses.replace(d, spec_types_gguf=("draft-mtp",))
    assert server_spec_types(None, mtp) == ("draft-mtp",)
    assert server_spec_types("draft-simple", mtp) == ("none", "draft-simple")   # a flag: nothing inferred
    assert server_spec_types("none", mtp) == ("none", "none")                   # even "none"
    got = draft_context(None, mtp, t)
    assert got.built and got.mtp
    assert parse_spec_types("ngram-mod,draft-simple") == ("ngram-mod", "draft-simple")
    assert parse_spec_types("draft-simple,none") == ("none",)
    with pytest.raises(FlagError, match="unknown speculative type: draft-fast"):
        ServerFlags(spec_type="draft-fast")


def test_an_mtp_draft_context_holds_the_nextn_layers_only():
    import dataclasses

    from slotctl.model.info import read_model_info

    t = read_model_info(DATA / "target.gguf")
    with pytest.raises(UsageError, match="needs nextn layers"):
        t.mtp_context()
    # two blocks, the last an MTP head: the main context holds block 0, the MTP context block 1
    head = dataclasses.replace(t, n_layer=1, attention_layers=(True, False))
    m = head.mtp_context()
    assert m.kv_layers() == (1,) and head.kv_layers() == (0,)
    hybrid = dataclasses.replace(head, memory_kind="hybrid")
    assert hybrid.mtp_context().memory_kind == "unsupported"


def test_validate_drops_a_draft_state_for_md_alone_and_says_why(tmp_path):
    from slotctl.format.appendix import SDFT_MAGIC

    raw = (DATA / "srv-np1.bin").read_bytes()
    blob = (DATA / "srv-draft.bin").read_bytes()
    path = tmp_path / "sdft.bin"
    # a draft blob that is some state: its bytes do not matter, the server has no context to put it in
    dft = b"\0" * 64
    path.write_bytes(raw + struct.pack("<II", SDFT_MAGIC, 1) + struct.pack("<Q", len(dft)) + dft
                     + struct.pack("<Q", 0))
    del blob
    base = ["validate", path, "-m", DATA / "target.gguf", "-md", DATA / "draft.gguf", "-c", "256", "-fa", "on",
            "--no-load", "--json"]
    res = _invoke(*base)
    (rep,) = json.loads(res.stdout)["files"]
    (f,) = [x for x in rep["findings"] if x["code"] == "no_draft_context"]
    assert "builds no drafter" in f["message"] and rep["verdict"] == "restores_with_drops"


def test_the_build_a_server_names_is_judged_by_a_known_one():
    """/props build_info -> the build whose rules apply (slotctl.server.builds.from_build_info)."""
    from slotctl.server.builds import KNOWN, NEWEST, from_build_info, get

    assert KNOWN == ("b11434", "b11669") and NEWEST == "b11669"
    assert from_build_info("b11669-Debian") == ("b11669", None)
    assert from_build_info("b11434-1a2b3c") == ("b11434", None)
    assert from_build_info("b11549-abc")[0] == "b11434" and "nearest" in from_build_info("b11549-abc")[1]
    assert from_build_info("b12000")[0] == "b11669"
    assert from_build_info("b100")[0] == "b11434"
    assert from_build_info(None)[0] == NEWEST and "no build number" in from_build_info(None)[1]
    with pytest.raises(ValueError, match="known: b11434, b11669"):
        get("b9")
    assert get("B11669").reads_checkpoints and not get("b11434").reads_checkpoints
