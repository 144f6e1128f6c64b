"""inspect on slot files that real llama-cpp-python contexts produced: it must report the true numbers."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.format.convert import convert_payload
from slotctl.model.info import read_model_info
from slotctl.model.predict import rotation_rule
from slotctl.runtime.context import STATE_VERSION
from slotctl.model.settings import ContextSettings
from slotctl.runtime.slot import ServerContexts, evaluate_prompt, write_slot_file
from slotctl.slotfile import build_header, open_slot_file, rebuild
from slotctl.tinymodels import SAMPLE_PROMPT

runner = CliRunner()

# n_embd_k_gqa = head 64 x 1 KV head; f16 rows are 128 bytes, q8_0 rows 2 blocks of 34
ROW = {"f16": 128, "q8_0": 68}


def inspect_json(path, *args):
    res = runner.invoke(app, ["inspect", str(path), "--json", *args])
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.stderr
    return json.loads(res.stdout)["files"][0]


CASES = {
    "f16-fa-on": (ContextSettings(n_ctx=256, flash_attn="on"), 0),
    "f16-fa-off": (ContextSettings(n_ctx=256, flash_attn="off"), 0),
    "q8_0": (ContextSettings(n_ctx=256, flash_attn="on", type_k="q8_0", type_v="q8_0"), 0),
    "unified-np2": (ContextSettings(n_ctx=512, n_parallel=2, kv_unified=True, flash_attn="on"), 1),
    "np4-slot2": (ContextSettings(n_ctx=1024, n_parallel=4, flash_attn="on"), 2),
}


@pytest.fixture(scope="module")
def files(tiny_models, tmp_path_factory):
    """One slot file per case, written from real contexts with two checkpoints and a draft state."""
    d = tmp_path_factory.mktemp("real")
    out = {}
    for name, (settings, slot) in CASES.items():
        with ServerContexts.open(tiny_models.target, settings, draft_path=tiny_models.draft) as sc:
            tokens = sc.target_model.tokenize(SAMPLE_PROMPT)
            cps = evaluate_prompt(sc, tokens, slot, checkpoint_at=[24, 60])
            for version in (3, 4):
                w = write_slot_file(d / f"{name}-v{version}.bin", sc, slot, tokens, version=version, checkpoints=cps)
                out[(name, version)] = (w.path, settings, slot, len(tokens))
            # the runtime's own file writer (state version 3, plain token list) for the same slot
            sc.target.save_seq_file(d / f"{name}-runtime.bin", slot, tokens)
            out[(name, "runtime")] = (str(d / f"{name}-runtime.bin"), settings, slot, len(tokens))
    return out


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("version", [3, 4])
def test_inspect_reports_the_true_numbers(files, tiny_models, name, version):
    path, settings, slot, n = files[(name, version)]
    for extra in ([], ["--model", str(tiny_models.target), "--draft-model", str(tiny_models.draft)]):
        d = inspect_json(path, *extra)
        assert d["state_version"] == version
        assert d["prompt"]["format"] == "packed" and d["prompt"]["n_tokens"] == n
        sec = d["target"]["memory"]["sections"][0]
        n_stream = 1 if settings.kv_unified else settings.n_parallel
        assert sec["n_stream"] == n_stream
        cells = [0] * n_stream
        cells[0 if settings.kv_unified else slot] = n
        assert [s["cell_count"] for s in sec["streams"]] == cells
        filled = [s for s in sec["streams"] if s["cell_count"]][0]
        assert (filled["pos_min"], filled["pos_max"]) == (0, n - 1)
        assert sec["v_trans"] == (1 if settings.flash_attn == "off" else 0)
        quant = settings.type_k == "q8_0"
        if version == 4:
            assert (sec["n_rot_k"], sec["n_rot_v"]) == ((64, 64) if quant else (0, 0))
        else:
            assert sec["n_rot_k"] is None
        assert sec["n_layer"] == 2
        assert [(l["k_type"], l["k_row_size"]) for l in sec["layers"]] == [(settings.type_k, ROW[settings.type_k])] * 2
        assert [l["v_type"] for l in sec["layers"]] == [settings.type_v] * 2
        # checkpoints: PARTIAL_ONLY blobs of both contexts at 24 and 60 tokens (plain KV: the blob header
        # alone, as b11669's libllama writes it)
        cps = d["checkpoints"]
        assert [(c["n_tokens"], c["pos_min"], c["pos_max"]) for c in cps] == [(24, 0, 23), (60, 0, 59)]
        for c in cps:
            assert c["target"]["seq_id"] == slot and c["draft"]["seq_id"] == slot
            for blob in (c["target"], c["draft"]):
                assert blob["header_only"] and blob["size"] == 8 and blob["memory"] is None and blob["error"] is None
            assert c["spec_size"] == 0
        # the draft state: the draft context's full state, draft cache types f16 (the server's default)
        dr = d["draft"]
        assert dr["seq_id"] == slot and dr["spec_size"] == 0
        dsec = dr["memory"]["sections"][0]
        assert dsec["n_layer"] == 1 and sum(s["cell_count"] for s in dsec["streams"]) == n
        assert [l["k_type"] for l in dsec["layers"]] == ["f16"]
        assert d["trailing_bytes"] == 0 and not d["damaged"]
        if extra:
            assert d["prompt"]["text"] == "<s>" + SAMPLE_PROMPT


@pytest.mark.parametrize("name", list(CASES))
def test_real_files_round_trip(files, name):
    for version in (3, 4, "runtime"):
        path = files[(name, version)][0]
        sf = open_slot_file(path)
        assert not sf.errors
        assert rebuild(sf) == open(path, "rb").read()


@pytest.mark.parametrize("name", list(CASES))
def test_runtime_file_converted_to_version_4_equals_ours(files, tiny_models, name):
    """The runtime's own version-3 file, converted to 4, holds the same payload as the file we wrote as 4."""
    rpath, settings, slot, n = files[(name, "runtime")]
    sf = open_slot_file(rpath)
    assert sf.version == STATE_VERSION == 3 and sf.tokens.format == "legacy" and sf.tokens.n_tokens == n
    raw = open(rpath, "rb").read()
    info = read_model_info(tiny_models.target)
    v4 = convert_payload(raw[sf.target.offset:sf.target.end], sf.target.layout, 3, 4, rotations=rotation_rule(info))
    ours = open_slot_file(files[(name, 4)][0])
    ours_raw = open(files[(name, 4)][0], "rb").read()
    assert v4 == ours_raw[ours.target.offset:ours.target.end]
    # and the whole converted file inspects as version 4
    conv = rpath.replace("runtime", "runtime-v4")
    with open(conv, "wb") as f:
        f.write(build_header(4, sf.words) + v4)
    d = inspect_json(conv)
    assert d["state_version"] == 4 and d["target"]["size"] == len(v4)


def test_prompt_text_is_escaped_on_a_terminal(tiny_models, tmp_path):
    """A prompt is untrusted: control characters (an ANSI escape here) are shown as \\xNN, never sent raw."""
    from slotctl.format.tokens import pack_tokens
    from slotctl.tinymodels import vocabulary

    vocab = vocabulary()
    esc = [vocab.index(p) for p in ("<0x1B>", "[", "3", "1", "m")] + [vocab.index("Paris")]
    src = open_slot_file(_server_file())
    raw = open(src.path, "rb").read()
    p = tmp_path / "esc.bin"
    p.write_bytes(build_header(4, pack_tokens([1] + esc)) + raw[src.target.offset:])
    res = runner.invoke(app, ["inspect", str(p), "--model", str(tiny_models.target)])
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.stdout
    assert "\\x1b[31mParis" in res.stdout
    d = inspect_json(p, "--model", str(tiny_models.target))
    assert d["prompt"]["text"] == "<s>\x1b[31mParis"  # JSON carries the real text, escaped by JSON itself


def _server_file():
    from conftest import DATA

    return DATA / "srv-np1.bin"
