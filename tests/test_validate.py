"""``slotctl validate``: findings from structure, prediction and real contexts, and that the three agree.

Test files are slot files a real llama-server (b11434) wrote (tests/data, flags in tests/data/README.md)
and files written from real llama.cpp contexts by slotctl.runtime.slot (target + draft, with checkpoints).
The real check loads every layer into real contexts in a child process; one child serves the whole module
(it rebuilds its contexts when the flags change), and the tiny models are made once.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.errors import ExitStatus, UsageError
from slotctl.format.appendix import SCKP_MAGIC, SDFT_MAGIC
from slotctl.model.info import read_model_info
from slotctl.model.settings import ContextSettings
from slotctl.runtime.slot import ServerContexts, evaluate_prompt, write_slot_file
from slotctl.slotfile import open_slot_file
from slotctl.tinymodels import SAMPLE_PROMPT, make_model, make_models
from slotctl.validate import ChildProcess, FileReport, ServerSetup, validate_paths

from conftest import DATA

runner = CliRunner()
KINDS = DATA / "kinds"


# -- fixtures --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Models:
    target: Path        # 2 layers, 1 KV head of 64
    draft: Path         # 1 layer
    wide_target: Path   # 2 layers, 2 KV heads: K/V rows twice as wide
    wide_draft: Path    # 1 layer, 2 KV heads


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    d = tmp_path_factory.mktemp("models")
    tiny = make_models(d)
    return Models(tiny.target, tiny.draft,
                  make_model(d / "wide-target.gguf", n_layer=2, n_head_kv=2, seed=3),
                  make_model(d / "wide-draft.gguf", n_layer=1, n_head_kv=2, seed=4))


@pytest.fixture(scope="module")
def child():
    with ChildProcess() as c:
        yield c


@dataclass(frozen=True)
class Made:
    """Slot files written from real target and draft contexts (state version 4, as the seed change's server)."""

    good: Path          # -c 256, checkpoints at 32 and 64 tokens, draft state
    plain: Path         # the same contexts, no checkpoints
    draft_q8: Path      # -ctkd q8_0 -ctvd q8_0, no checkpoints
    fa_off: Path        # -fa off
    np2: Path           # -c 512 -np 2, slot 1
    long: Path          # -c 512, 300 tokens


def _save(path: Path, m: Models, settings: ContextSettings, *, n_tokens: int | None = None, slot: int = 0,
          checkpoint_at=(), draft_types=("f16", "f16"), also: Path | None = None) -> Path:
    with ServerContexts.open(m.target, settings, draft_path=m.draft, draft_type_k=draft_types[0],
                             draft_type_v=draft_types[1]) as sc:
        tokens = sc.target_model.tokenize(SAMPLE_PROMPT)
        while n_tokens is not None and len(tokens) < n_tokens:
            tokens += tokens[1:]
        tokens = tokens[:n_tokens] if n_tokens else tokens
        ckpts = evaluate_prompt(sc, tokens, slot, checkpoint_at=checkpoint_at)
        write_slot_file(path, sc, slot, tokens, version=4, checkpoints=ckpts)
        if also is not None:
            write_slot_file(also, sc, slot, tokens, version=4)
    return path


@pytest.fixture(scope="module")
def made(models, tmp_path_factory) -> Made:
    d = tmp_path_factory.mktemp("made")
    s256 = ContextSettings(n_ctx=256, flash_attn="on")
    return Made(
        good=_save(d / "good.bin", models, s256, checkpoint_at=(32, 64), also=d / "plain.bin"),
        plain=d / "plain.bin",
        draft_q8=_save(d / "draft-q8.bin", models, s256, draft_types=("q8_0", "q8_0")),
        fa_off=_save(d / "fa-off.bin", models, ContextSettings(n_ctx=256, flash_attn="off")),
        np2=_save(d / "np2.bin", models, ContextSettings(n_ctx=512, n_parallel=2), slot=1),
        long=_save(d / "long.bin", models, ContextSettings(n_ctx=512), n_tokens=300),
    )


def check(child, path, model=None, draft=None, *, load=True, ctkd="f16", ctvd="f16", slot=0, mmproj=False,
          build="b11669", **settings) -> FileReport:
    """Validate one file (the library call the CLI makes), the real check in the module's child."""
    setup = ServerSetup(target=model, draft=draft, settings=ContextSettings(**settings), draft_type_k=ctkd,
                        spec_type="draft-simple" if draft is not None else None,
                        draft_type_v=ctvd, slot=slot, mmproj=mmproj, build=build)
    # confirm_refusals: the real loader is asked about every layer, the refused ones too (the CLI never does),
    # so that each predicted refusal is checked against llama.cpp's own
    (report,) = validate_paths([path], setup, real_check=load, child=child, confirm_refusals=True).files
    return report


def codes(report: FileReport, layer: str | None = None, severity: str | None = None) -> list[str]:
    return [f.code for f in report.findings
            if (layer is None or f.layer == layer) and (severity is None or f.severity == severity)]


def finding(report: FileReport, code: str, layer: str | None = None):
    found = [f for f in report.findings if f.code == code and (layer is None or f.layer == layer)]
    assert found, (code, layer, [(f.layer, f.code, f.message) for f in report.findings])
    return found[0]


def layer_check(report: FileReport, layer: str):
    (c,) = [c for c in report.checks if c.layer == layer]
    return c


def assert_agree(report: FileReport, layer: str, loaded=("refused",)):
    """The prediction named a mismatch and the real contexts refused the layer, for a reason it named."""
    c = layer_check(report, layer)
    assert c.predicted == "mismatch" and c.loaded in loaded, c
    assert c.loader_messages, c
    assert "prediction_disagrees" not in codes(report), report.findings


def patched(src: Path, dst: Path, patches: dict[int, bytes]) -> Path:
    raw = bytearray(src.read_bytes())
    for off, b in patches.items():
        raw[off:off + len(b)] = b
    dst.write_bytes(bytes(raw))
    return dst


def zero_rotations(src: Path, dst: Path, model: Path, which: str) -> Path:
    """A version-4 file whose rotation words (n_rot_k, n_rot_v) in ``which`` ("target" or "draft") are 0."""
    info = read_model_info(model)
    if which == "target":
        mem = open_slot_file(src, layout=info.layout()).target
    else:
        mem = open_slot_file(src, draft_layout=info.layout()).draft.memory
    data = [st.data for sec in mem.sections for st in sec.streams if st.cell_count]
    assert data and all((d.n_rot_k, d.n_rot_v) == (64, 64) for d in data)
    return patched(src, dst, {d.rot_offset: struct.pack("<II", 0, 0) for d in data})


# -- files that restore ----------------------------------------------------------------------------------

#: (file, model, flags it was saved with: tests/data/README.md, tests/data/kinds/README.md)
SERVER_FILES = [
    ("srv-np1.bin", "target.gguf", dict(n_ctx=256, flash_attn="on")),
    ("srv-np2-slot1.bin", "target.gguf", dict(n_ctx=512, n_parallel=2, flash_attn="on", slot=1)),
    ("srv-fa-off.bin", "target.gguf", dict(n_ctx=256, flash_attn="off")),
    ("srv-kvq8.bin", "target.gguf", dict(n_ctx=256, flash_attn="on", type_k="q8_0", type_v="q8_0")),
    ("srv-unified-np2.bin", "target.gguf", dict(n_ctx=512, n_parallel=2, kv_unified=True, flash_attn="on")),
    ("srv-draft.bin", "target.gguf", dict(n_ctx=256, flash_attn="on")),
    ("kinds/srv-gemma2.bin", "kinds/gemma2.gguf", dict(n_ctx=256, flash_attn="on")),
    ("kinds/srv-mamba.bin", "kinds/mamba.gguf", dict(n_ctx=256, flash_attn="on")),
    ("kinds/srv-lfm2.bin", "kinds/lfm2.gguf", dict(n_ctx=256, flash_attn="on")),
    ("kinds/srv-jamba.bin", "kinds/jamba.gguf", dict(n_ctx=256, flash_attn="on")),
]


@pytest.mark.parametrize("name,model,flags", SERVER_FILES, ids=[f[0] for f in SERVER_FILES])
def test_real_server_files_validate_clean_with_their_flags(child, name, model, flags):
    r = check(child, DATA / name, DATA / model, **flags)
    assert r.verdict == "restores" and r.exit_status == ExitStatus.OK, r.findings
    assert codes(r, severity="error") == codes(r, severity="drop") == []
    (c,) = r.checks
    assert (c.layer, c.predicted, c.loaded, c.effect) == ("target memory", "fits", "fits", "ok")


def test_a_file_from_real_contexts_with_checkpoints_and_draft_restores_completely(child, models, made):
    r = check(child, made.good, models.target, models.draft, n_ctx=256)
    assert r.verdict == "restores" and r.exit_status == ExitStatus.OK
    assert [c.layer for c in r.checks] == ["target memory", "checkpoint 0 target", "checkpoint 0 draft",
                                           "checkpoint 1 target", "checkpoint 1 draft", "draft"]
    # a plain KV cache's checkpoint blobs are the blob header alone (b11669's PARTIAL_ONLY): predicted to fit,
    # not loaded into this runtime's llama.cpp (which writes and reads the whole cache there)
    assert all((c.predicted, c.loaded, c.effect) == ("fits", "skipped" if c.layer.startswith("checkpoint") else "fits",
                                                     "ok") for c in r.checks), r.checks
    # no finding: b11669 (the build judged for by default) reads both appendices
    assert set(codes(r)) == set() and r.build == "b11669"
    # for b11434, which ignores them: a note, and only the target is checked
    r = check(child, made.good, models.target, models.draft, n_ctx=256, build="b11434")
    assert set(codes(r)) == {"appendix_needs_new_server"} and [c.layer for c in r.checks] == ["target memory"]
    assert "b11434 (the build judged for)" in finding(r, "appendix_needs_new_server", "appendix").message


@pytest.mark.parametrize("kind", ["gemma2", "lfm2", "jamba", "mamba"])
def test_checkpoints_of_other_memory_kinds_hold_the_part_that_cannot_roll_back(child, tmp_path, kind):
    """PARTIAL_ONLY checkpoint blobs: the SWA cache (iSWA), the recurrent state (hybrid, recurrent);
    each is predicted against that part of the context and loaded with PARTIAL_ONLY, as load_tgt does."""
    model = KINDS / f"{kind}.gguf"
    path = tmp_path / f"{kind}.bin"
    with ServerContexts.open(model, ContextSettings(n_ctx=256)) as sc:
        tokens = sc.target_model.tokenize("what is the capital of france? paris is the capital")
        ckpts = evaluate_prompt(sc, tokens, 0, checkpoint_at=(6, 12))
        write_slot_file(path, sc, 0, tokens, version=4, checkpoints=ckpts)
    r = check(child, path, model, n_ctx=256)
    assert r.verdict == "restores", r.findings
    assert [c.layer for c in r.checks] == ["target memory", "checkpoint 0 target", "checkpoint 1 target"]
    assert all((c.predicted, c.loaded) == ("fits", "fits") for c in r.checks), r.checks
    if kind in ("lfm2", "jamba"):
        # two slots: the attention KV gets two streams, the recurrent part (all a checkpoint holds) still fits
        r2 = check(child, path, model, n_ctx=512, n_parallel=2)
        assert codes(r2, "target memory") == ["n_stream_mismatch"]
        assert [(c.predicted, c.loaded) for c in r2.checks[1:]] == [("fits", "fits")] * 2
        assert r2.verdict == "refused"


def test_a_file_that_is_not_a_slot_file(child, tmp_path):
    p = tmp_path / "noise.bin"
    p.write_bytes(b"GGUF" + bytes(100))
    r = check(child, p, DATA / "target.gguf", n_ctx=256)
    assert r.verdict == "refused" and r.checks == []
    assert finding(r, "gguf_model", "state header").message.startswith(
        "state header at 0x0 (0): this is a GGUF model, not a slot file")
    p.write_bytes(b"GGUG" + bytes(100))
    r = check(child, p, DATA / "target.gguf", n_ctx=256)
    assert r.verdict == "refused" and r.checks == []
    assert finding(r, "damaged", "state header").message.startswith("state header at 0x0 (0): state file magic")


def test_without_models_every_layer_is_checked_structurally(made):
    r = check(None, made.good)
    assert r.verdict == "restores"
    assert [(c.predicted, c.loaded) for c in r.checks] == [(None, None)] * 6


def test_srv_kvq8_needs_its_cache_types(child):
    ok = check(child, DATA / "srv-kvq8.bin", DATA / "target.gguf", n_ctx=256, type_k="q8_0", type_v="q8_0")
    assert ok.verdict == "restores"
    bad = check(child, DATA / "srv-kvq8.bin", DATA / "target.gguf", n_ctx=256)
    assert bad.verdict == "refused" and bad.exit_status == ExitStatus.FAILED
    k = finding(bad, "k_type_mismatch", "target memory")
    assert k.severity == "error"
    assert k.message.startswith("target K cache is q8_0 in the file and f16 in the context")
    assert "start the server with -ctk q8_0, or convert the file: slotctl convert FILE -o OUT -ctk f16 -m MODEL" \
        in k.message
    assert "start the server with -ctv q8_0, or convert" in finding(bad, "v_type_mismatch").message
    # a type mismatch explains the rotation mismatch (64 vs 0): only the types are named
    assert "k_rotation_mismatch" not in codes(bad)
    assert_agree(bad, "target memory")
    assert "mismatched key type" in layer_check(bad, "target memory").loader_messages[0]


# -- the target: each loader rejection ---------------------------------------------------------------------


def test_target_layer_count(child, models):
    r = check(child, DATA / "srv-np1.bin", models.draft, n_ctx=256)
    f = finding(r, "layer_count_mismatch", "target memory")
    assert f.message.startswith("the target memory has 2 layers, the target context 1: the file was saved "
                                "with another model")
    assert r.verdict == "refused"
    assert_agree(r, "target memory")


def test_target_row_size(child, models):
    r = check(child, DATA / "srv-np1.bin", models.wide_target, n_ctx=256)
    f = finding(r, "k_row_size_mismatch", "target memory")
    assert "K rows of layer 0 are 128 bytes in the file and 256 in the context" in f.message
    assert "another model" in f.message
    assert_agree(r, "target memory")


@pytest.mark.parametrize("name,flags,remedy", [
    ("srv-fa-off.bin", dict(n_ctx=256), "start the server with -fa off"),      # -fa auto is on
    ("srv-np1.bin", dict(n_ctx=256, flash_attn="off"), "start the server with -fa on"),
])
def test_target_v_trans(child, name, flags, remedy):
    r = check(child, DATA / name, DATA / "target.gguf", **flags)
    assert finding(r, "v_trans_mismatch").message.endswith(remedy)
    assert_agree(r, "target memory")


@pytest.mark.parametrize("name,flags,remedy", [
    ("srv-np2-slot1.bin", dict(n_ctx=512), "the target memory has 2 KV streams, the target context 1: "
                                           "start the server with -np 2"),
    ("srv-unified-np2.bin", dict(n_ctx=512, n_parallel=2), "the target memory has 1 KV stream, the target "
                                                           "context 2: start the server with -kvu"),
    ("srv-np1.bin", dict(n_ctx=512, n_parallel=2, kv_unified=True), None),
])
def test_target_n_stream(child, name, flags, remedy):
    r = check(child, DATA / name, DATA / "target.gguf", **flags)
    if remedy is None:  # one stream either way
        assert r.verdict == "restores"
        return
    message = finding(r, "n_stream_mismatch").message
    assert message.startswith(remedy)
    # a single slot's save: slotctl convert rewrites the stream count for these flags
    assert message.endswith(", or convert the file: slotctl convert FILE -o OUT -np "
                            + ("1" if name == "srv-np2-slot1.bin" else "2"))
    assert_agree(r, "target memory")


def test_target_too_few_cells(child, models, made):
    r = check(child, made.long, models.target, n_ctx=256)
    f = finding(r, "too_many_cells", "target memory")
    assert f.message == "300 cells do not fit a 256-cell target context: raise -c to 300 or more"
    assert_agree(r, "target memory")
    # the server checks the prompt too, after the restore
    p = finding(r, "prompt_too_long", "token words")
    assert p.message.startswith("the prompt has 300 tokens, the slot context 256")
    # with two slots each has half: the remedy says so
    r2 = check(child, made.long, models.target, n_ctx=512, n_parallel=2)
    assert "raise -c to 600 or more, or lower -np" in finding(r2, "too_many_cells").message
    assert check(child, made.long, models.target, models.draft, n_ctx=512).verdict == "restores"


def test_target_rotation(child, tmp_path):
    """A version-4 q8_0 file whose rotation words were zeroed: b11434 says "incompatible key rotation".

    This runtime (state version 3) records no rotation, so the layer cannot be converted exactly for it:
    the real check is skipped and the prediction alone decides.
    """
    p = zero_rotations(DATA / "srv-kvq8.bin", tmp_path / "rot0.bin", DATA / "target.gguf", "target")
    r = check(child, p, DATA / "target.gguf", n_ctx=256, type_k="q8_0", type_v="q8_0")
    k = finding(r, "k_rotation_mismatch", "target memory")
    assert "target K rotation is 0 in the file and 64 in the target context" in k.message
    assert "LLAMA_ATTN_ROT_DISABLE" in k.message
    assert finding(r, "v_rotation_mismatch").severity == "error"
    c = layer_check(r, "target memory")
    assert (c.predicted, c.loaded) == ("mismatch", "skipped")
    assert "rotation" in c.reason
    assert finding(r, "load_skipped").severity == "note"
    assert r.verdict == "refused"


def test_target_of_another_memory_kind(child):
    r = check(child, KINDS / "srv-mamba.bin", DATA / "target.gguf", n_ctx=256)
    f = finding(r, "memory_kind_mismatch", "target memory")
    assert f.message.startswith("the target memory is a recurrent state with state for 2 layers, but target.gguf "
                                "(llama) keeps a plain KV cache: the file was saved with another model")
    assert "damaged" not in codes(r)
    assert_agree(r, "target memory")


# -- the draft: each loader rejection drops the draft state -----------------------------------------------------


def test_draft_layer_count(child, models, made):
    r = check(child, made.plain, models.target, models.target, n_ctx=256)
    f = finding(r, "layer_count_mismatch", "draft")
    assert f.severity == "drop"
    assert f.message.startswith("the draft state has 1 layer, the draft context 2: the file was saved with "
                                "another draft model")
    assert r.verdict == "restores_with_drops" and r.exit_status == ExitStatus.FAILED
    assert layer_check(r, "target memory").loaded == "fits"
    assert_agree(r, "draft")


def test_draft_k_type(child, models, made):
    r = check(child, made.draft_q8, models.target, models.draft, n_ctx=256)
    f = finding(r, "k_type_mismatch", "draft")
    assert f.message.startswith("draft K cache is q8_0 in the file and f16 in the context")
    assert "start the server with -ctkd q8_0, or convert the file: slotctl convert FILE -o OUT -ctkd f16 -md MODEL" \
        in f.message
    assert "-ctvd q8_0, or convert the file: slotctl convert FILE -o OUT -ctvd f16" in \
        finding(r, "v_type_mismatch", "draft").message
    assert r.verdict == "restores_with_drops"
    assert_agree(r, "draft")
    ok = check(child, made.draft_q8, models.target, models.draft, n_ctx=256, ctkd="q8_0", ctvd="q8_0")
    assert ok.verdict == "restores", ok.findings


def test_draft_row_size(child, models, made):
    r = check(child, made.plain, models.target, models.wide_draft, n_ctx=256)
    f = finding(r, "k_row_size_mismatch", "draft")
    assert "draft K rows of layer 0 are 128 bytes in the file and 256" in f.message
    assert "another draft model" in f.message and "-md" in f.message
    assert_agree(r, "draft")


def test_draft_v_trans(child, models, made):
    """-fa is shared by both contexts: target and draft both mismatch; the draft's is a drop."""
    r = check(child, made.fa_off, models.target, models.draft, n_ctx=256)
    assert finding(r, "v_trans_mismatch", "draft").severity == "drop"
    assert finding(r, "v_trans_mismatch", "target memory").severity == "error"
    assert_agree(r, "draft")
    assert_agree(r, "target memory")
    assert check(child, made.fa_off, models.target, models.draft, n_ctx=256, flash_attn="off").verdict == "restores"


def test_draft_n_stream(child, models, made):
    r = check(child, made.np2, models.target, models.draft, n_ctx=512)
    assert finding(r, "n_stream_mismatch", "draft").message.startswith(
        "the draft state has 2 KV streams, the draft context 1: start the server with -np 2")
    assert_agree(r, "draft")
    ok = check(child, made.np2, models.target, models.draft, n_ctx=512, n_parallel=2, slot=1)
    assert ok.verdict == "restores", ok.findings


def test_draft_too_few_cells(child, models, made):
    r = check(child, made.long, models.target, models.draft, n_ctx=256)
    f = finding(r, "too_many_cells", "draft")
    assert f.severity == "drop"
    assert f.message == "300 cells do not fit a 256-cell draft context: raise -c to 300 or more"
    assert_agree(r, "draft")


def test_draft_rotation(child, models, made, tmp_path):
    p = zero_rotations(made.draft_q8, tmp_path / "draft-rot0.bin", models.draft, "draft")
    r = check(child, p, models.target, models.draft, n_ctx=256, ctkd="q8_0", ctvd="q8_0")
    f = finding(r, "k_rotation_mismatch", "draft")
    assert f.severity == "drop" and "draft K rotation is 0 in the file and 64 in the draft context" in f.message
    c = layer_check(r, "draft")
    assert (c.predicted, c.loaded) == ("mismatch", "skipped")
    assert r.verdict == "restores_with_drops"


def test_a_draft_state_without_a_draft_model_is_dropped(child, models, made):
    r = check(child, made.plain, models.target, n_ctx=256)
    assert finding(r, "no_draft_context", "draft").severity == "drop"
    assert r.verdict == "restores_with_drops"


# -- checkpoints -------------------------------------------------------------------------------------------


def test_checkpoint_blobs_of_a_plain_kv_draft_fit_any_plain_kv_draft(child, models, made):
    """b11669 writes a plain KV cache's PARTIAL_ONLY state as the blob header alone and reads those 8 bytes
    back: a checkpoint's draft blob of a 1-layer draft fits a 2-layer one (nothing of it is checked), where the
    draft state (SDFT, the whole cache) is dropped."""
    r = check(child, made.good, models.target, models.target, n_ctx=256)
    for i in (0, 1):
        assert not [f for f in r.findings if f.layer == f"checkpoint {i} draft"]
        assert (layer_check(r, f"checkpoint {i} draft").predicted, layer_check(r, f"checkpoint {i} draft").effect) \
            == ("fits", "ok")
        assert layer_check(r, f"checkpoint {i} target").effect == "ok"
    assert finding(r, "layer_count_mismatch", "draft").severity == "drop"
    assert r.verdict == "restores_with_drops"


def test_a_plain_kv_cache_rolls_back_to_a_checkpoint_of_positions_0_to_1(child, models, tmp_path):
    """Correction 3 of issue 15: a request of one token equal to the slot's first makes pos_min_thold 0
    (b11434 update_slots: no new tokens), so a plain KV cache, which starts at 0, searches its checkpoints and
    loads the newest with pos_min 0 and pos_max <= 1 (save --checkpoint-at 1 makes one). In real contexts,
    then in validate: a draft blob that does not fit in that checkpoint is an error, in another a note."""
    from slotctl.runtime.speculative import ServerSlot

    s = ContextSettings(n_ctx=256, flash_attn="on")
    path = tmp_path / "at-1.bin"
    with ServerContexts.open(models.target, s, draft_path=models.draft) as sc:
        tokens = sc.target_model.tokenize(SAMPLE_PROMPT)
        cps = evaluate_prompt(sc, tokens, 0, checkpoint_at=(1, 32))
        write_slot_file(path, sc, 0, tokens, version=4, checkpoints=cps)
        assert [(c.n_tokens, c.pos_min, c.pos_max) for c in cps] == [(1, 0, 0), (32, 0, 31)]
        slot = ServerSlot(sc, 0, tokens, cps)
        n_past, used, _ = slot.evaluate(tokens[:1])      # the slot's first token, alone
        assert (n_past, used) == (0, 1)
        longer = ServerSlot(sc, 0, tokens[:1], [cps[0]])
        assert longer.evaluate(tokens[:3])[1] is None     # new tokens: pos_min_thold 1, the cache starts at 0
    # b11669's checkpoints of a plain KV cache hold the blob header alone, which any plain KV draft reads
    r = check(child, path, models.target, models.target, n_ctx=256)
    assert not [f for f in r.findings if f.layer.startswith("checkpoint")]


def test_an_iswa_cache_with_swa_full_rolls_back_as_a_plain_kv_cache(tmp_path):
    """Correction 3: with --swa-full the server's n_swa is 0 and the SWA cache holds every position, so an
    iSWA server behaves as a plain KV cache: a checkpoint of positions 4..19 is never loaded."""
    p = _gemma2_with_a_bad_checkpoint(tmp_path)
    for swa_full, severity, verdict in ((False, "drop", "restores_with_drops"), (True, "note", "restores")):
        r = check(None, p, DATA / "kinds" / "gemma2.gguf", load=False, n_ctx=256, swa_full=swa_full)
        assert finding(r, "checkpoint_blob_damaged", "checkpoint 0 target").severity == severity, swa_full
        assert r.verdict == verdict


def _gemma2_with_a_bad_checkpoint(tmp_path) -> Path:
    """gemma2's server file with one checkpoint (positions 4..19) whose target blob is no state."""
    raw = (DATA / "kinds" / "srv-gemma2.bin").read_bytes()
    junk = struct.pack("<Ii", 0xAF143CD8, 0) + b"\x07" * 56
    sckp = b"SCKP" + struct.pack("<II", 1, 1) + struct.pack("<qii", 20, 4, 19)
    sckp += b"".join(struct.pack("<Q", len(b)) + b for b in (junk, b"", b""))
    p = tmp_path / "gemma2-bad-checkpoint.bin"
    p.write_bytes(raw + sckp)
    return p


def test_a_checkpoint_blob_damaged_inside_is_kept(made, tmp_path):
    sf = open_slot_file(made.good)
    blob = sf.checkpoints[1].tgt
    p = patched(made.good, tmp_path / "ckpt-magic.bin", {blob.span.offset: b"XXXX"})
    r = check(None, p)
    f = finding(r, "checkpoint_blob_damaged", "checkpoint 1 target")
    assert f.severity == "note" and "keeps the checkpoint unchecked" in f.message and "no request" in f.message
    assert r.verdict == "restores" and r.exit_status == 0


def test_a_checkpoint_blob_that_does_not_load_is_a_drop_where_the_server_rolls_back(tmp_path):
    """An SWA cache (gemma2) rolls back to checkpoints: the file restores; b11669, going back to this one,
    fails to load it and evaluates the whole prompt again (measured: tests/test_b11669.py), a drop."""
    p = _gemma2_with_a_bad_checkpoint(tmp_path)
    r = check(None, p, DATA / "kinds" / "gemma2.gguf", load=False, n_ctx=256)
    f = finding(r, "checkpoint_blob_damaged", "checkpoint 0 target")
    assert f.severity == "drop" and "failed to load context checkpoint restored from a slot file" in f.message
    assert r.verdict == "restores_with_drops" and r.exit_status == 1 and r.certain


def test_too_many_checkpoints_are_dropped(child, models, made):
    setup = ServerSetup(models.target, models.draft, ContextSettings(n_ctx=256), n_ctx_checkpoints=1,
                        spec_type="draft-simple")
    (r,) = validate_paths([made.good], setup, child=child).files
    assert finding(r, "too_many_checkpoints").severity == "drop"
    assert r.verdict == "restores_with_drops"


# -- damaged appendices ------------------------------------------------------------------------------------


def _appendix(path: Path, magic: int) -> int:
    raw = path.read_bytes()
    return raw.index(struct.pack("<I", magic))


@pytest.mark.parametrize("with_models", [False, True])
@pytest.mark.parametrize("what,code", [("SCKP version", "checkpoints_damaged"), ("SDFT version", "draft_damaged"),
                                       ("SDFT cut", "draft_damaged")])
def test_damaged_appendices_are_drops(child, models, made, tmp_path, what, code, with_models):
    raw = made.good.read_bytes()
    p = tmp_path / "damaged.bin"
    if what == "SCKP version":
        patched(made.good, p, {_appendix(made.good, SCKP_MAGIC) + 4: struct.pack("<I", 7)})
    elif what == "SDFT version":
        patched(made.good, p, {_appendix(made.good, SDFT_MAGIC) + 4: struct.pack("<I", 7)})
    else:
        p.write_bytes(raw[:-100])
    r = check(child, p, models.target if with_models else None, models.draft if with_models else None, n_ctx=256)
    f = finding(r, code)
    assert f.severity == "drop", r.findings
    assert codes(r, severity="error") == [], r.findings
    assert r.verdict == "restores_with_drops" and r.exit_status == ExitStatus.FAILED
    if with_models:
        assert layer_check(r, "target memory").loaded == "fits"


# -- an abort inside llama.cpp becomes a finding ---------------------------------------------------------------


def _mamba_two_cells(dst: Path) -> Path:
    """srv-mamba.bin with the recurrent state claiming 2 cells: a fake cell and every r/s row doubled."""
    info = read_model_info(KINDS / "mamba.gguf")
    sf = open_slot_file(KINDS / "srv-mamba.bin", layout=info.layout())
    raw = (KINDS / "srv-mamba.bin").read_bytes()
    (sec,) = sf.target.sections
    assert sec.cell_count == 1
    out = raw[:sf.target.offset] + struct.pack("<I", 2) + struct.pack("<iIiI", 58, 0, int(sec.cells.pos[0]), 0)
    out += struct.pack("<II", sec.s_trans, sec.n_layer)
    for rec in [*sec.r, *sec.s]:
        row = raw[rec.data.offset:rec.data.end]
        out += struct.pack("<iQ", rec.type, rec.row_size) + row + row
    dst.write_bytes(out)
    return dst


def test_an_abort_in_llama_cpp_is_a_finding_and_the_next_file_still_validates(child, tmp_path):
    bad = _mamba_two_cells(tmp_path / "mamba-2cells.bin")
    assert open_slot_file(bad, layout=read_model_info(KINDS / "mamba.gguf").layout()).errors == []
    setup = ServerSetup(KINDS / "mamba.gguf", settings=ContextSettings(n_ctx=256, n_parallel=2))
    started = child.started
    report = validate_paths([bad, KINDS / "srv-mamba.bin"], setup, child=child, confirm_refusals=True)
    r, ok = report.files
    f = finding(r, "load_aborted", "target memory")
    assert f.severity == "error" and "GGML_ASSERT" in f.message and "signal 6" in f.message
    assert "recurrent_cells" in codes(r, "target memory")
    c = layer_check(r, "target memory")
    assert (c.predicted, c.loaded, c.effect) == ("mismatch", "aborted", "aborts")
    assert r.verdict == "aborts"
    assert ok.verdict == "restores" and layer_check(ok, "target memory").loaded == "fits"
    # a new child after the abort (when no child ran yet, the first file's load started one)
    assert child.started == max(started, 1) + 1
    # with one slot llama.cpp refuses it instead ("not enough cells"): the prediction names that too
    r1 = check(child, bad, KINDS / "mamba.gguf", n_ctx=256)
    assert r1.verdict == "refused"
    assert_agree(r1, "target memory")
    assert "not enough cells" in layer_check(r1, "target memory").loader_messages[0]


# -- the prompt ----------------------------------------------------------------------------------------------


def test_tokens_outside_the_vocabulary(child, tmp_path):
    sf = open_slot_file(DATA / "srv-np1.bin")
    assert sf.tokens.format == "packed"
    p = patched(DATA / "srv-np1.bin", tmp_path / "tok.bin", {12 + 4 * 3 + 4 * 5: struct.pack("<i", 5000)})
    r = check(child, p, DATA / "target.gguf", n_ctx=256)
    f = finding(r, "invalid_tokens", "token words")
    assert f.message.startswith("token 5000 at index 5 is outside the vocabulary of target.gguf [0, 310)")
    assert r.verdict == "refused"
    assert layer_check(r, "target memory").loaded == "fits"   # the memory itself is fine


def test_media_needs_an_mmproj(tmp_path):
    from slotctl.format.tokens import pack_tokens
    from slotctl.slotfile import build_header

    raw = (DATA / "srv-np1.bin").read_bytes()
    sf = open_slot_file(DATA / "srv-np1.bin")
    words = pack_tokens([1, -1, -1, 5], media=[(1, b"not a chunk")])
    p = tmp_path / "media.bin"
    p.write_bytes(build_header(4, words) + raw[sf.target.offset:])
    assert finding(check(None, p), "media_without_mmproj").severity == "error"
    assert finding(check(None, p, mmproj=True), "media_damaged").severity == "error"


def _image_chunk(**over) -> bytes:
    from slotctl.format.tokens import MediaChunk

    batch = dict(is_audio=0, n=1, entries=[dict(add_viewsep=0, add_newline=0, lead_pad=0, nx=4, ny=4)])
    chunk = dict(version=2, type=1, n_text_tokens=0, text_tokens=np.zeros(0, np.int32), has_image=1,
                 image=dict(nx=2, ny=1, pos_type=0, image_idx=0, n_temporal_merge=1, id=b"img", batch=batch),
                 has_audio=0, audio=None, trailing=b"")
    chunk.update(over)
    return MediaChunk.build(chunk)


@pytest.mark.parametrize("chunk, code", [
    (dict(), None),
    (dict(trailing=b"\x00" * 7), "media_trailing_bytes"),      # mtmd_input_chunk::deserialize never reads them
    (dict(has_image=0, image=None), "media_damaged"),         # "type is IMAGE but tokens_image is missing"
    (dict(type=2), "media_damaged"),                          # audio type, no audio tokens
])
def test_media_chunks_as_the_servers_chunk_loader_reads_them(tmp_path, chunk, code):
    from slotctl.format.tokens import pack_tokens
    from slotctl.slotfile import build_header

    raw = (DATA / "srv-np1.bin").read_bytes()
    sf = open_slot_file(DATA / "srv-np1.bin")
    p = tmp_path / "media.bin"
    words = pack_tokens([1, -1, -1, 5], media=[(1, _image_chunk(**chunk))])
    p.write_bytes(build_header(4, words) + raw[sf.target.offset:])
    r = check(None, p, mmproj=True)
    media = [f for f in r.findings if f.code.startswith("media_")]
    assert [f.code for f in media] == ([code] if code else [])
    if code == "media_trailing_bytes":
        assert media[0].severity == "note" and "7 bytes" in media[0].message
    if code == "media_damaged":
        assert media[0].severity == "error"
        assert f"no {'audio' if chunk.get('type') == 2 else 'image'} tokens" in media[0].message


def test_an_image_position_type_the_loader_does_not_know(tmp_path):
    from slotctl.format.tokens import pack_tokens
    from slotctl.slotfile import build_header

    good = _image_chunk()
    # pos_type sits after version (8), type (4), n_text_tokens (8), has_image (1), nx, ny (8)
    bad = good[:29] + struct.pack("<I", 3) + good[33:]
    raw = (DATA / "srv-np1.bin").read_bytes()
    sf = open_slot_file(DATA / "srv-np1.bin")
    p = tmp_path / "media.bin"
    p.write_bytes(build_header(4, pack_tokens([1, -1, -1, 5], media=[(1, bad)])) + raw[sf.target.offset:])
    f = finding(check(None, p, mmproj=True), "media_damaged")
    assert f.severity == "error" and "image position type" in f.message


def test_a_state_version_the_server_does_not_load(models, tmp_path):
    with ServerContexts.open(models.target, ContextSettings(n_ctx=256)) as sc:
        tokens = sc.target_model.tokenize("hello world")
        evaluate_prompt(sc, tokens, 0)
        write_slot_file(tmp_path / "v3.bin", sc, 0, tokens, version=3)
    r = check(None, tmp_path / "v3.bin")
    assert finding(r, "version_mismatch", "state header").severity == "error"
    setup = ServerSetup(state_version=3)
    assert validate_paths([tmp_path / "v3.bin"], setup).files[0].verdict == "restores"


# -- agreement is checked ------------------------------------------------------------------------------------


def test_a_load_that_contradicts_the_prediction_is_a_finding():
    from slotctl.validate import LayerCheck
    from slotctl.validate.compare import _draft_side, _MemLayer, _target_side
    from slotctl.validate.load import _judge

    def layer(side, predicted, issues=()):
        ml = _MemLayer(side, LayerCheck(side.layer, 0, 10, side.kind, predicted=predicted), 0, 10, False, 0,
                       None, None)
        ml.issues += list(issues)
        return ml

    ml = layer(_target_side(), "fits")
    _judge(ml, {"status": "refused", "errors": ["state_read_data: mismatched key type"]})
    (i,) = ml.issues
    assert (i.finding.code, i.finding.severity, i.effect) == ("prediction_disagrees", "error", "refused")
    ml = layer(_draft_side(), "fits")
    _judge(ml, {"status": "partial", "consumed": 5, "expected": 10, "errors": []})
    assert "read 5 of its 10 bytes" in ml.issues[0].finding.message and ml.issues[0].effect == "dropped"
    ml = layer(_target_side(), "mismatch")
    _judge(ml, {"status": "fits", "errors": []})
    assert ml.issues[0].finding.code == "prediction_disagrees"


# -- the command ---------------------------------------------------------------------------------------------


def _invoke(*args):
    res = runner.invoke(app, ["validate", *map(str, args)])
    assert "Traceback" not in res.output and "Traceback" not in (res.stderr or "")
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res


def test_cli_json_document():
    res = _invoke(DATA / "srv-kvq8.bin", "-m", DATA / "target.gguf", "-c", 256, "-ctk", "q8_0", "-ctv", "q8_0",
                  "--json")
    assert res.exit_code == 0, res.output
    assert res.stderr == ""
    d = json.loads(res.stdout)
    assert set(d) == {"server", "files", "summary", "exit_code"}
    assert d["summary"] == {"files": 1, "restores": 1, "restores_with_drops": 0, "undecided": 0, "other_model": 0,
                            "corrupt": 0, "aborts": 0, "refused": 0, "unreadable": 0, "skipped": 0}
    (f,) = d["files"]
    assert set(f) == {"path", "size", "state_version", "n_tokens", "build", "verdict", "certain", "uncertain", "exit_code", "counts", "findings",
                      "checks", "steps", "reuse"}
    assert f["n_tokens"] == 111 and [s["status"] for s in f["steps"]] == ["restored", "restored", "absent", "absent"]
    assert f["reuse"] == {"build": "b11669", "n_tokens": 111, "n_reused": 111, "checkpoint": None, "reason": None,
                          "divergence": "a request that diverges after k tokens keeps those k: the positions after "
                                        "them are removed",
                          "b11434": {"n_reused": 111, "reason": None}}
    assert (f["verdict"], f["exit_code"], f["findings"]) == ("restores", 0, [])
    assert set(f["checks"][0]) == {"layer", "offset", "size", "context", "predicted", "loaded",
                                   "loader_messages", "reason", "effect"}
    s = d["server"]
    assert s["settings"]["type_k"] == "q8_0" and s["real_check"] is True
    assert s["target_context"]["n_ctx"] == 256 and s["n_ctx_slot"] == 256


def test_cli_a_file_with_checkpoints_and_draft_restores(models, made):
    res = _invoke(made.good, "-m", models.target, "-md", models.draft, "--spec-type", "draft-simple", "-c", 256)
    assert res.exit_code == 0, res.output
    assert "restores completely" in res.stdout and res.stderr == ""
    for layer in ("target memory", "checkpoint 1 draft", "draft"):
        assert layer in res.stdout


def test_cli_names_the_mismatch_and_the_remedy():
    res = _invoke(DATA / "srv-kvq8.bin", "-m", DATA / "target.gguf", "-c", 256, "--json")
    assert res.exit_code == 1
    (f,) = json.loads(res.stdout)["files"]
    k = [x for x in f["findings"] if x["code"] == "k_type_mismatch"][0]
    assert set(k) == {"layer", "severity", "code", "message", "offset"}
    assert (k["layer"], k["severity"]) == ("target memory", "error")
    assert "-ctk q8_0, or convert the file: slotctl convert FILE -o OUT -ctk f16 -m MODEL" in k["message"]
    assert f["verdict"] == "refused"
    # the same for people
    res = _invoke(DATA / "srv-kvq8.bin", "-m", DATA / "target.gguf", "-c", 256)
    assert res.exit_code == 1
    assert "the server refuses it" in res.stdout and "-ctk q8_0" in res.stdout


def test_cli_many_files_and_a_directory(made, tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    shutil.copy(made.good, d / "b-good.bin")
    p = d / "a-damaged.bin"
    patched(made.good, p, {_appendix(made.good, SDFT_MAGIC) + 4: struct.pack("<I", 7)})
    (d / ".x.bin.slotctl-1234.tmp").write_bytes(b"half written")
    res = _invoke(d, DATA / "srv-np1.bin", "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert [Path(f["path"]).name for f in doc["files"]] == ["a-damaged.bin", "b-good.bin", "srv-np1.bin"]
    assert [f["verdict"] for f in doc["files"]] == ["restores_with_drops", "restores", "restores"]
    assert doc["summary"]["files"] == 3 and doc["summary"]["restores"] == 2
    assert doc["server"]["real_check"] is False   # no model: structure only
    res = _invoke(d, DATA / "srv-np1.bin")
    assert "3 file(s): 2 restoring completely, 1 restoring with layers dropped" in res.stdout


def test_cli_escapes_what_it_did_not_write(tmp_path):
    p = tmp_path / "evil\x1b[31m.bin"
    shutil.copy(DATA / "srv-np1.bin", p)
    res = _invoke(p)
    assert res.exit_code == 0
    assert "\x1b" not in res.stdout and "evil\\x1b[31m.bin" in res.stdout


def test_cli_an_abort_is_reported_not_suffered(tmp_path):
    """The prediction says the server aborts: the CLI's real load never loads that layer (issue 24: validate
    never loads what the prediction refuses), so nothing aborts here, and the report says why it was not
    loaded. (The child's handling of an abort: test_an_abort_in_llama_cpp_is_a_finding...)"""
    bad = _mamba_two_cells(tmp_path / "mamba-2cells.bin")
    res = _invoke(bad, "-m", KINDS / "mamba.gguf", "-c", 256, "-np", 2, "--json")
    assert res.exit_code == 1
    (f,) = json.loads(res.stdout)["files"]
    assert f["verdict"] == "aborts"
    assert not any(x["code"] == "load_aborted" for x in f["findings"])
    (c,) = f["checks"]
    assert c["loaded"] == "skipped" and "the prediction already keeps it out (recurrent_cells)" in c["reason"]
    assert "GGML_ASSERT" not in res.stderr


def test_the_real_load_never_loads_what_the_prediction_refuses(child, tmp_path):
    """Issue 24 item 10: a file the prediction refuses is never handed to the child (no child even starts
    when no layer is to be loaded); a sparse file whose claimed counts make its layer gigabytes is refused
    at its counts, at no cost of them; a layer the prediction passes but larger than LOAD_MAX_BYTES is not
    loaded either, and the report says so."""
    from slotctl.validate.load import LOAD_MAX_BYTES

    setup = ServerSetup(DATA / "target.gguf", settings=ContextSettings(n_ctx=256))
    started = child.started
    (r,) = validate_paths([DATA / "srv-fa-off.bin"], setup, child=child).files     # v_trans: refused
    (c,) = r.checks
    assert (r.verdict, c.predicted, c.loaded) == ("refused", "mismatch", "skipped")
    assert "v_trans_mismatch" in c.reason
    # a sparse file: a stream claiming 2^24 cells, its KV data 2^40 bytes past a hole
    raw = bytearray((DATA / "srv-np1.bin").read_bytes())
    he = 12 + 4 * struct.unpack_from("<I", raw, 8)[0]
    struct.pack_into("<I", raw, he + 4, 1 << 24)
    p = tmp_path / "sparse.bin"
    with open(p, "wb") as out:
        out.write(raw)
        out.truncate(1 << 40)
    (r,) = validate_paths([p], setup, child=child).files
    (c,) = r.checks
    assert (r.verdict, c.loaded) == ("refused", "skipped") and "too_many_cells" in c.reason
    assert child.started == started     # nothing was loaded: no child was started for either file
    # a layer the prediction passes, larger than the bound: not loaded, said
    from slotctl.validate.compare import _MemLayer, _target_side
    from slotctl.validate.load import _real_check
    from slotctl.validate.report import LayerCheck

    big = _MemLayer(_target_side(), LayerCheck("target memory", he, LOAD_MAX_BYTES + 1, "target"), he,
                    LOAD_MAX_BYTES + 1, False, 0, None, None)
    assert _real_check([big], None, None, None, setup, None, None) == []   # no checker is even asked
    assert big.check.loaded == "skipped" and "more than the real load takes" in big.check.reason
    assert [i.finding.code for i in big.issues] == ["load_skipped"]


def test_cli_no_load_predicts_only():
    res = _invoke(DATA / "srv-fa-off.bin", "-m", DATA / "target.gguf", "-c", 256, "--no-load", "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    (c,) = doc["files"][0]["checks"]
    assert (c["predicted"], c["loaded"]) == ("mismatch", None)
    assert doc["server"]["real_check"] is False


@pytest.mark.parametrize("args,message", [
    (["missing.bin"], "no such file"),
    ([DATA / "srv-np1.bin", "-md", DATA / "draft.gguf"], "needs a target model"),
    ([DATA / "srv-np1.bin", "-m", DATA / "target.gguf", "--slot", 1], "--slot 1"),
    ([DATA / "srv-np1.bin", "-m", DATA / "target.gguf", "-ctk", "q9"], "-ctk q9: expected one of f32"),
    ([DATA / "srv-np1.bin", "-m", DATA / "target.gguf", "-ctv", "q8_0", "-fa", "off"], "requires flash attention"),
    ([DATA / "srv-np1.bin", "-m", DATA / "srv-np1.bin"], "not a GGUF"),
])
def test_cli_usage_errors_exit_2(args, message):
    res = _invoke(*args)
    assert res.exit_code == 2, res.output
    assert message in res.stderr, res.stderr


def test_settings_refused_before_any_file_is_read():
    with pytest.raises(UsageError, match="needs a target model"):
        ServerSetup(draft=DATA / "draft.gguf")
