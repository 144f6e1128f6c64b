"""Predicting a slot file's memory layout from a GGUF and context settings (slotctl.model).

The real files were saved by llama-server b11434 from the GGUFs next to them (tests/data/README.md and
tests/data/kinds/README.md give the server flags); the synthetic GGUFs written here carry only the
header keys the rules read.
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import pytest

from slotctl.errors import UsageError
from slotctl.format import ggml
from slotctl.model.info import read_model_info
from slotctl.model.predict import context_sizes, predict, rotations, swa_cells
from slotctl.model.settings import ContextSettings
from slotctl.slotfile import open_slot_file

from conftest import DATA

EXPECT = json.loads((DATA / "expect.json").read_text())

#: (model, slot file, the server flags it was saved with)
SERVER_FILES = [
    ("target.gguf", "srv-np1.bin", ContextSettings(n_ctx=256, n_parallel=1)),
    ("target.gguf", "srv-np2-slot1.bin", ContextSettings(n_ctx=512, n_parallel=2)),
    ("target.gguf", "srv-fa-off.bin", ContextSettings(n_ctx=256, n_parallel=1, flash_attn="off")),
    ("target.gguf", "srv-kvq8.bin", ContextSettings(n_ctx=256, n_parallel=1, type_k="q8_0", type_v="q8_0")),
    ("target.gguf", "srv-unified-np2.bin", ContextSettings(n_ctx=512, n_parallel=2, kv_unified=True)),
    # -md / -ctkd shape the draft context only; the target's flags are those of srv-np1.bin
    ("target.gguf", "srv-draft.bin", ContextSettings(n_ctx=256, n_parallel=1)),
    ("kinds/gemma2.gguf", "kinds/srv-gemma2.bin", ContextSettings(n_ctx=256, n_parallel=1)),
    ("kinds/mamba.gguf", "kinds/srv-mamba.bin", ContextSettings(n_ctx=256, n_parallel=1)),
    ("kinds/lfm2.gguf", "kinds/srv-lfm2.bin", ContextSettings(n_ctx=256, n_parallel=1)),
    ("kinds/jamba.gguf", "kinds/srv-jamba.bin", ContextSettings(n_ctx=256, n_parallel=1)),
]
IDS = [name for _, name, _ in SERVER_FILES]


def _parse(model: str, name: str):
    info = read_model_info(DATA / model)
    return info, open_slot_file(DATA / name, layout=info.layout())


def _mismatches(pred, sf) -> list[str]:
    """Where the parsed payload of ``sf`` disagrees with ``pred``, as the loader would see it."""
    out = []
    for i, (p, sec) in enumerate(zip(pred.sections, sf.target.sections, strict=True)):
        where = f"section {i} ({p.role})"
        if p.type == "recurrent":
            got = (sec.n_layer, [(r.type, r.row_size) for r in sec.r], [(s.type, s.row_size) for s in sec.s])
            want = (p.n_layer, [(ggml.BY_NAME[l.k_type].id, l.k_row_size) for l in p.layers],
                    [(ggml.BY_NAME[l.v_type].id, l.v_row_size) for l in p.layers])
            if got != want:
                out.append(f"{where}: records {got} != {want}")
            if sec.cell_count > p.cells_per_stream:
                out.append(f"{where}: {sec.cell_count} cells > {p.cells_per_stream}")
            continue
        if sec.n_stream != p.n_stream:
            out.append(f"{where}: n_stream {sec.n_stream} != {p.n_stream}")
        for st in sec.streams:
            if st.cell_count > p.cells_per_stream:
                out.append(f"{where}: {st.cell_count} cells > {p.cells_per_stream} per stream")
            if p.window is not None and st.cell_count > p.window:
                out.append(f"{where}: {st.cell_count} cells > window {p.window}")
            if not st.cell_count:
                continue
            d = st.data
            got = (d.v_trans, d.n_layer, d.n_rot_k, d.n_rot_v,
                   [(k.type, k.row_size) for k in d.k],
                   [(v.type, v.get("row_size"), v.get("el_size"), v.get("n_embd")) for v in d.v])
            want = (p.v_trans, p.n_layer, p.n_rot_k, p.n_rot_v,
                    [(ggml.BY_NAME[l.k_type].id, l.k_row_size) for l in p.layers],
                    [(ggml.BY_NAME[l.v_type].id, l.v_row_size, l.v_el_size, l.n_embd_v_gqa)
                     for l in p.layers if l.v_type is not None])
            if got != want:
                out.append(f"{where}: {got} != {want}")
    return out


# --- the real server files ------------------------------------------------------------------------


@pytest.mark.parametrize("model,name,settings", SERVER_FILES, ids=IDS)
def test_the_model_layout_parses_the_file_to_its_end(model, name, settings):
    _, sf = _parse(model, name)
    assert sf.errors == [] and sf.warnings == []
    assert sf.target.end == sf.size
    assert sf.sckp is None and sf.sdft is None and sf.trailing is None


@pytest.mark.parametrize("model,name,settings", SERVER_FILES, ids=IDS)
def test_prediction_from_the_server_flags_matches_the_file(model, name, settings):
    info, sf = _parse(model, name)
    pred = predict(info, settings)
    assert _mismatches(pred, sf) == []


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_prediction_matches_the_independent_reader(name):
    """expect.json was written by a reader that shares no code with slotctl."""
    e = EXPECT[name]
    settings = dict((n, s) for _, n, s in SERVER_FILES)[name]
    (sec,) = predict(read_model_info(DATA / "target.gguf"), settings, version=e["version"]).sections
    assert sec.n_stream == e["n_stream"] == len(e["stream_cells"])
    assert all(c <= sec.cells_per_stream for c in e["stream_cells"])
    assert (sec.v_trans, sec.n_layer, sec.n_rot_k, sec.n_rot_v) == (e["v_trans"], e["n_layer"], e["n_rot_k"],
                                                                    e["n_rot_v"])
    assert [[ggml.BY_NAME[l.k_type].id, l.k_row_size] for l in sec.layers] == e["k"]
    v = [[ggml.BY_NAME[l.v_type].id, l.v_el_size, l.n_embd_v_gqa] if sec.v_trans
         else [ggml.BY_NAME[l.v_type].id, l.v_row_size] for l in sec.layers]
    assert v == e["v"]


def test_quantized_caches_get_64_wide_rotations():
    info, sf = _parse("target.gguf", "srv-kvq8.bin")
    (sec,) = predict(info, ContextSettings(n_ctx=256, type_k="q8_0", type_v="q8_0")).sections
    assert (sec.n_rot_k, sec.n_rot_v) == (64, 64)
    assert [(l.k_type, l.k_row_size, l.v_type, l.v_row_size) for l in sec.layers] == [("q8_0", 68, "q8_0", 68)] * 2
    d = sf.target.sections[0].streams[0].data
    assert (d.n_rot_k, d.n_rot_v) == (64, 64)


def test_wrong_flags_predict_what_the_loader_rejects():
    """Predictions discriminate: flags other than the ones a file was saved with disagree with it."""
    info, sf = _parse("target.gguf", "srv-fa-off.bin")
    (m,) = _mismatches(predict(info, ContextSettings(n_ctx=256)), sf)
    assert m.startswith("section 0 (kv): (1, 2, 0, 0,") and "!= (0, 2, 0, 0," in m  # v_trans 1 vs 0
    info, sf = _parse("target.gguf", "srv-np2-slot1.bin")
    assert _mismatches(predict(info, ContextSettings(n_ctx=512)), sf) == ["section 0 (kv): n_stream 2 != 1"]
    info, sf = _parse("target.gguf", "srv-np1.bin")
    assert len(_mismatches(predict(info, ContextSettings(n_ctx=256, type_k="q8_0")), sf)) == 1


def test_gemma2_base_and_swa_caches():
    info, sf = _parse("kinds/gemma2.gguf", "kinds/srv-gemma2.bin")
    assert info.memory_kind == "iswa" and info.sliding_window == 16 and info.swa_type == "standard"
    assert info.swa_layers == (True, False, True, False)  # gemma2 default pattern 2
    base, swa = predict(info, ContextSettings(n_ctx=256)).sections
    assert (base.role, [l.il for l in base.layers], base.cells_per_stream, base.window) == ("base", [1, 3], 256, None)
    assert (swa.role, [l.il for l in swa.layers], swa.cells_per_stream, swa.window) == ("swa", [0, 2], 256, 16)
    file_base, file_swa = sf.target.sections
    assert file_base.streams[0].cell_count == 60
    cells = file_swa.streams[0].cells
    assert len(cells) == 16 and (cells.pos_min, cells.pos_max) == (44, 59)  # the last window of 60 tokens


def test_recurrent_and_hybrid_records():
    mamba = read_model_info(DATA / "kinds/mamba.gguf")
    assert mamba.memory_kind == "recurrent" and mamba.attention_layers == (False, False)
    assert (mamba.n_embd_r, mamba.n_embd_s) == (3 * 128, 16 * 128)  # (d_conv - 1) d_inner, d_state d_inner
    (rec,) = predict(mamba, ContextSettings(n_ctx=256, n_parallel=3)).sections
    assert (rec.type, rec.n_layer, rec.cells_per_stream, rec.v_trans, rec.n_rot_k) == ("recurrent", 2, 3, None, None)

    jamba = read_model_info(DATA / "kinds/jamba.gguf")
    attn, rec = predict(jamba, ContextSettings(n_ctx=256)).sections
    assert [l.il for l in attn.layers] == [1, 3] and [l.il for l in rec.layers] == [0, 2]
    assert {(l.k_row_size, l.v_row_size) for l in rec.layers} == {(1536, 8192)}
    assert rec.n_layer == 4


def test_lfm2_per_layer_kv_head_counts():
    info = read_model_info(DATA / "kinds/lfm2.gguf")
    assert info.n_head_kv == (0, 1, 0, 1) and info.n_head == (2, 2, 2, 2)
    assert info.recurrent_layers == (True, False, True, False)
    assert info.attention_layers == (False, True, False, True)
    assert [info.n_embd_k_gqa(il) for il in range(4)] == [0, 64, 0, 64]
    assert (info.n_embd_r, info.n_embd_s) == (128 * 2, 0)  # n_embd (l_cache - 1); no ssm state
    assert info.layout().describe() == "hybrid: attention KV + recurrent (2 r, 2 s records)"
    assert info.layout().partial().describe() == "hybrid: recurrent (2 r, 2 s records)"


def test_model_info_of_the_target():
    info = read_model_info(DATA / "target.gguf")
    assert (info.arch, info.memory_kind, info.n_layer, info.n_embd, info.n_vocab, info.n_ctx_train) == \
        ("llama", "kv", 2, 128, 310, 2048)
    assert (info.n_head, info.n_head_kv, info.head_dim_k, info.head_dim_v) == ((2, 2), (1, 1), 64, 64)
    assert not info.mla and not info.has_cell_ext and info.sliding_window is None
    assert info.n_embd_r is None and info.n_embd_s is None


# --- settings, as llama.cpp checks and rounds them --------------------------------------------------


def test_context_rounding():
    info = read_model_info(DATA / "target.gguf")
    assert context_sizes(info, ContextSettings(n_ctx=300)) == (512, 512)
    assert context_sizes(info, ContextSettings(n_ctx=512, n_parallel=3)) == (768, 256)  # 512/3 -> 256 per stream
    assert context_sizes(info, ContextSettings(n_ctx=4096, n_parallel=4)) == (4096, 1024)
    assert context_sizes(info, ContextSettings(n_ctx=512, n_parallel=2, kv_unified=True)) == (512, 512)
    assert context_sizes(info, ContextSettings(n_ctx=0)) == (2048, 2048)  # the training context
    pred = predict(info, ContextSettings(n_ctx=8192))
    assert (pred.n_ctx_seq, pred.n_ctx_slot) == (8192, 2048)  # the server caps the slot at n_ctx_train


def test_swa_cache_size():
    info = read_model_info(DATA / "kinds/gemma2.gguf")  # window 16
    assert swa_cells(info, ContextSettings(n_ctx=4096), 4096) == 768  # 16 + 512 -> 768
    assert swa_cells(info, ContextSettings(n_ctx=4096, n_ubatch=1024, n_batch=4096), 4096) == 1280
    assert swa_cells(info, ContextSettings(n_ctx=4096, n_parallel=64, kv_unified=True), 4096) == 1536  # 16*64 + 512
    assert swa_cells(info, ContextSettings(n_ctx=256), 256) == 256  # never more than the base cache
    assert swa_cells(info, ContextSettings(n_ctx=4096, swa_full=True), 4096) == 4096
    wide = dataclasses.replace(info, sliding_window=4096)
    assert swa_cells(wide, ContextSettings(n_ctx=32768, n_parallel=2), 16384) == 4608
    swa = predict(info, ContextSettings(n_ctx=4096, n_parallel=2)).sections[1]
    assert (swa.n_stream, swa.cells_per_stream) == (2, 768)


def test_rotation_sizes():
    info = read_model_info(DATA / "target.gguf")
    q8, q4, f16 = ggml.BY_NAME["q8_0"], ggml.BY_NAME["q4_0"], ggml.BY_NAME["f16"]

    def rot(head_k, head_v, tk, tv, mla=False, disable=False):
        m = dataclasses.replace(info, head_dim_k=head_k, head_dim_v=head_v, head_dim_k_swa=head_k,
                                head_dim_v_swa=head_v, mla=mla)
        return rotations(m, (0, 1), tk, tv, disable)

    assert rot(64, 64, q8, q8) == (64, 64)
    assert rot(128, 128, q8, q8) == (128, 64)  # K doubles while the head size allows, V stays 64
    assert rot(256, 256, q4, q4) == (256, 64)
    assert rot(192, 128, q8, q8) == (64, 64)
    assert rot(576, 512, q8, q8, mla=True) == (64, 0)  # MLA: no V
    assert rot(128, 128, q8, f16) == (128, 0)
    assert rot(96, 96, q8, q8) == (0, 0)  # not a multiple of 64
    assert rot(128, 128, f16, f16) == (0, 0)
    assert rot(128, 128, q8, q8, disable=True) == (0, 0)
    assert predict(info, ContextSettings(type_k="q8_0", type_v="q8_0"), version=3).sections[0].n_rot_k is None


@pytest.mark.parametrize("settings,message", [
    (ContextSettings(type_v="q8_0", flash_attn="off"), "requires flash attention: -fa on"),
    (ContextSettings(n_parallel=257), "-np 257"),
])
def test_settings_llama_cpp_refuses(settings, message):
    with pytest.raises(UsageError, match=message):
        predict(read_model_info(DATA / "target.gguf"), settings)


@pytest.mark.parametrize("kwargs,message", [
    (dict(type_k="q9_9"), "type_k: unknown cache type 'q9_9'"),
    (dict(type_v="i32"), "type_v: unknown cache type 'i32'"),
    (dict(n_parallel=0), "n_parallel must be at least 1"),
    (dict(n_ctx=-1), "n_ctx must not be negative"),
])
def test_settings_refused_before_any_prediction(kwargs, message):
    """The flags are checked once, by the settings the runtime builds contexts from."""
    with pytest.raises(ValueError, match=message):
        ContextSettings(**kwargs)


def test_unset_flags_resolve_as_the_server_resolves_them():
    """-c 0 sizes every stream to the training context; -fa auto is on, so V is not transposed."""
    info = read_model_info(DATA / "target.gguf")  # n_ctx_train 2048
    assert context_sizes(info, ContextSettings(n_parallel=2)) == (4096, 2048)
    assert context_sizes(info, ContextSettings(n_parallel=2, kv_unified=True)) == (2048, 2048)
    assert context_sizes(info, ContextSettings(n_parallel=2, kv_unified_per_slot=512)) == (1024, 512)
    assert predict(info, ContextSettings()).sections[0].v_trans == 0
    assert predict(info, ContextSettings(flash_attn="off")).sections[0].v_trans == 1
    pred = predict(info, ContextSettings(n_ctx=4096, n_parallel=2, kv_unified=True, kv_unified_per_slot=1000))
    assert (pred.n_ctx_seq, pred.n_ctx_slot) == (4096, 1000)
    # a draft context takes the target's n_ctx, slots and -fa, and its own cache types
    draft = predict(info, ContextSettings(n_parallel=2).for_draft(4096, "q8_0", "q8_0"))
    assert (draft.n_ctx, draft.sections[0].layers[0].k_type, draft.sections[0].n_rot_k) == (4096, "q8_0", 64)


def test_the_prediction_matches_the_contexts_the_runtime_builds():
    from slotctl.runtime import Context, Model

    info = read_model_info(DATA / "target.gguf")
    with Model(DATA / "target.gguf") as model:
        for s in (ContextSettings(n_ctx=300, n_parallel=3), ContextSettings(n_parallel=2, kv_unified=True),
                  ContextSettings(n_ctx=256).for_draft(1024)):
            pred = predict(info, s)
            with Context(model, s) as ctx:
                assert (ctx.n_ctx, ctx.n_ctx_seq, ctx.n_ctx_slot) == (pred.n_ctx, pred.n_ctx_seq, pred.n_ctx_slot)


def test_quantized_k_needs_whole_blocks():
    info = dataclasses.replace(read_model_info(DATA / "target.gguf"), head_dim_k=80, head_dim_k_swa=80)
    with pytest.raises(UsageError, match="-ctk q8_0: its blocks of 32 do not divide the head size 80"):
        predict(info, ContextSettings(type_k="q8_0"))
    with pytest.raises(UsageError, match="row size 80"):
        predict(info, ContextSettings(type_k="q8_0", flash_attn="off"))


def test_unknown_state_version():
    with pytest.raises(UsageError, match="state version 5"):
        predict(read_model_info(DATA / "target.gguf"), ContextSettings(), version=5)


# --- files that are not (good) GGUFs ----------------------------------------------------------------


def test_a_slot_file_is_not_a_gguf():
    with pytest.raises(UsageError, match="^not a GGUF file: .*srv-np1.bin$"):
        read_model_info(DATA / "srv-np1.bin")


def test_missing_directory_and_damaged_models(tmp_path):
    with pytest.raises(UsageError, match="model not found"):
        read_model_info(tmp_path / "nope.gguf")
    with pytest.raises(UsageError, match="is a directory"):
        read_model_info(tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(UsageError, match="not a GGUF file"):
        read_model_info(tmp_path / "empty.gguf")
    (tmp_path / "cut.gguf").write_bytes((DATA / "target.gguf").read_bytes()[:300])
    with pytest.raises(UsageError, match="not a GGUF file: .*damaged header") as e:
        read_model_info(tmp_path / "cut.gguf")
    assert "\n" not in str(e.value)


# --- architecture rules, on synthetic headers -------------------------------------------------------


def _gguf(tmp_path, arch: str, **keys) -> str:
    """A GGUF with no tensors and the given ``{arch}.`` keys (ints, bools, lists)."""
    path = str(tmp_path / f"{arch}-{len(list(tmp_path.iterdir()))}.gguf")
    w = gguf.GGUFWriter(path, arch)
    base = {"block_count": 4, "context_length": 4096, "embedding_length": 256, "attention.head_count": 4}
    for key, value in {**base, **keys}.items():
        key = f"{arch}.{key.replace('__', '.')}"
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_swa_patterns(tmp_path):
    g3 = read_model_info(_gguf(tmp_path, "gemma3", block_count=12, attention__sliding_window=512))
    assert g3.memory_kind == "iswa" and g3.swa_layers == (True,) * 5 + (False,) + (True,) * 5 + (False,)
    no_swa = read_model_info(_gguf(tmp_path, "gemma3", attention__sliding_window=0))
    assert no_swa.memory_kind == "kv" and no_swa.sliding_window is None
    l4 = read_model_info(_gguf(tmp_path, "llama4", attention__sliding_window=4096))
    assert (l4.swa_type, l4.sliding_window, l4.swa_layers) == ("chunked", 8192, (True, True, True, False))
    arr = read_model_info(_gguf(tmp_path, "granite_swa", attention__sliding_window=128,
                                attention__sliding_window_pattern=[True, False, False, True],
                                attention__key_length_swa=32, attention__value_length_swa=32))
    assert arr.swa_layers == (True, False, False, True)
    assert [arr.n_embd_k_gqa(il) for il in range(4)] == [128, 256, 256, 128]
    plain = read_model_info(_gguf(tmp_path, "llama", attention__sliding_window=4096))
    assert plain.memory_kind == "kv"  # llama ignores the key


def test_hybrid_rules(tmp_path):
    ssm = dict(ssm__conv_kernel=4, ssm__inner_size=512, ssm__state_size=64, ssm__group_count=2)
    q = read_model_info(_gguf(tmp_path, "qwen35", block_count=8, full_attention_interval=4,
                              rope__dimension_sections=[11, 11, 10, 0], **ssm))
    assert q.memory_kind == "hybrid" and q.has_cell_ext
    assert q.recurrent_layers == (True, True, True, False) * 2
    assert (q.n_embd_r, q.n_embd_s) == (3 * (512 + 2 * 2 * 64), 64 * 512)
    assert q.layout().describe() == "hybrid: attention KV (ext) + recurrent (6 r, 6 s records)"
    nh = read_model_info(_gguf(tmp_path, "nemotron_h", attention__head_count_kv=[0, 0, 2, 0],
                               feed_forward_length=[0, 1024, 0, 0], **ssm))
    assert nh.recurrent_layers == (True, False, False, True)  # layer 1 is an MLP: neither
    assert nh.attention_layers == (False, False, True, False)
    fh = read_model_info(_gguf(tmp_path, "falcon-h1", **ssm))
    assert fh.recurrent_layers == fh.attention_layers == (True,) * 4


def test_a_hybrid_without_recurrent_layers_still_writes_its_recurrent_section(tmp_path):
    info = read_model_info(_gguf(tmp_path, "jamba", attention__head_count_kv=2, ssm__conv_kernel=4,
                                 ssm__inner_size=128, ssm__state_size=16))
    attn, rec = predict(info, ContextSettings()).sections
    assert (attn.n_layer, rec.type, rec.n_layer, rec.layers) == (4, "recurrent", 4, ())


def test_nextn_blocks_stay_out_of_the_main_context(tmp_path):
    info = read_model_info(_gguf(tmp_path, "glm4moe", block_count=5, nextn_predict_layers=1))
    assert (info.n_layer, info.n_layer_all) == (4, 5)
    assert info.kv_layers() == (0, 1, 2, 3)
    assert predict(info, ContextSettings()).sections[0].n_layer == 4


def test_mla_models_have_no_v_records(tmp_path):
    info = read_model_info(_gguf(tmp_path, "deepseek2", attention__head_count_kv=1, attention__key_length=576,
                                 attention__value_length=512, attention__key_length_mla=192,
                                 attention__value_length_mla=128))
    assert info.mla and not info.layout().sections[0].v_records
    (sec,) = predict(info, ContextSettings(type_k="q8_0", type_v="q8_0")).sections
    assert {(l.k_row_size, l.v_type) for l in sec.layers} == {(576 * 34 // 32, None)}
    assert (sec.n_rot_k, sec.n_rot_v) == (64, 0)
    with pytest.raises(UsageError, match="same K and V cache types"):
        predict(info, ContextSettings(type_k="q8_0"))


def test_models_without_memory_and_unsupported_ones(tmp_path):
    bert = read_model_info(_gguf(tmp_path, "bert"))
    assert bert.memory_kind == "none" and bert.layout().sections == ()
    assert predict(bert, ContextSettings()).sections == ()
    g4 = read_model_info(_gguf(tmp_path, "gemma4"))
    assert g4.memory_kind == "unsupported"
    with pytest.raises(UsageError, match="cannot predict the memory layout of gemma4 models"):
        g4.layout()


def test_bad_per_layer_arrays(tmp_path):
    with pytest.raises(UsageError, match="head_count_kv has 3 entries; expected one per block"):
        read_model_info(_gguf(tmp_path, "llama", attention__head_count_kv=[1, 1, 1]))
