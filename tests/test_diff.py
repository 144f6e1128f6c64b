"""``slotctl diff`` on real files: saved by llama-server b11434 and by ``slotctl save`` from real contexts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import DATA, start_server
from slotctl.cli.app import app
from slotctl.tinymodels import SAMPLE_PROMPT

runner = CliRunner()
CTX = ["-c", "256", "-np", "1", "-fa", "on"]


def cli(*args):
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert "Traceback" not in res.output, res.output
    return res


def diff_json(a, b, *extra, code: int):
    res = cli("diff", a, b, *extra, "--json")
    assert res.exit_code == code, res.output
    doc = json.loads(res.stdout)
    assert doc["exit_code"] == code and doc["equal"] == (code == 0)
    return doc


def save(model, out: Path, prompt: str = SAMPLE_PROMPT, *extra) -> Path:
    res = cli("save", "-m", model, "--prompt", prompt, "-o", out, *CTX, "-t", "1", *extra)
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.server
def test_a_server_file_equals_slotctl_save_with_the_same_flags(llama_server_bin, tiny_models, tmp_path):
    """The server evaluates the prompt (n_predict 1: the sampled token is never evaluated, so the slot
    holds the prompt alone) and saves; slotctl save with the same flags writes the same file."""
    slots = tmp_path / "slots"
    slots.mkdir()
    srv = start_server(llama_server_bin, tiny_models.target, tmp_path, "diff", args=CTX, slot_save_path=slots)
    try:
        srv.completion(SAMPLE_PROMPT, slot=0, n_predict=1)
        srv.save(0, "server.bin")
    finally:
        srv.stop()
    mine = save(tiny_models.target, tmp_path / "slotctl.bin")
    doc = diff_json(slots / "server.bin", mine, code=0)
    assert doc["differences"] == [] and doc["tokens"]["first_difference"] is None
    (sec,) = doc["target"]["sections"]
    (st,) = sec["streams"]
    assert st["differing_cells"] == 0 and st["cell_count"][0] == doc["tokens"]["n_tokens"][0] > 0
    assert all(l["k_max_abs_diff"] == 0 and l["v_max_abs_diff"] == 0 for l in st["layers"])
    res = cli("diff", slots / "server.bin", mine)
    assert res.exit_code == 0 and "equal" in res.stdout


def test_f16_and_q8_0_of_one_prompt_differ_a_little_by_name():
    """Two files the server saved for the same prompt, -ctk/-ctv f16 and q8_0 (rotated by 64)."""
    doc = diff_json(DATA / "srv-np1.bin", DATA / "srv-kvq8.bin", code=1)
    assert doc["tokens"]["equal"] and doc["tokens"]["n_tokens"] == [111, 111]
    (st,) = doc["target"]["sections"][0]["streams"]
    assert st["cell_count"] == [111, 111] and st["positions_equal"]
    assert st["n_rot_k"] == [0, 64] and st["n_rot_v"] == [0, 64]
    for layer in st["layers"]:
        assert layer["k_type"] == ["f16", "q8_0"] and layer["v_type"] == ["f16", "q8_0"]
        # q8_0 keeps about 2-3 significant digits of values of magnitude ~1: the rotation was undone
        assert 0 < layer["k_max_abs_diff"] < 0.05 and 0 < layer["v_max_abs_diff"] < 0.05
    msgs = [d["message"] for d in doc["differences"]]
    assert "layer 0: K type f16 vs q8_0, values differ by at most" in msgs[2]
    assert any(m.startswith("K rotation 0 vs 64") for m in msgs)


def test_the_rotation_must_be_undone():
    """Compared without undoing llama.cpp's Hadamard rotation the q8_0 values are far off: the small
    differences above are the quantization error, not luck."""
    from slotctl import diff as d
    from slotctl.slotfile import open_slot_file

    a, b = open_slot_file(DATA / "srv-np1.bin"), open_slot_file(DATA / "srv-kvq8.bin")
    ka, kb = a.target.sections[0].streams[0].data.k[0], b.target.sections[0].streams[0].data.k[0]
    ma, mb = d._Rows(a), d._Rows(b)
    got = [d._compare_record(d._Record(ma, ka, 111, 0, None, "K", "target memory"),
                             d._Record(mb, kb, 111, rot, None, "K", "target memory"), 111, np.zeros(111, bool)).max_abs
           for rot in (0, 64)]
    assert got[1] < 0.05 < 1 < got[0]


def test_flash_attention_off_transposes_v_and_the_streams_of_another_np_pair_up():
    doc = diff_json(DATA / "srv-np1.bin", DATA / "srv-fa-off.bin", code=1)
    (st,) = doc["target"]["sections"][0]["streams"]
    # layer 0 holds the same numbers whether V is stored transposed or not; layer 1 differs in the last bits
    assert st["layers"][0]["v_equal"] and st["layers"][0]["k_equal"]
    assert 0 < st["layers"][1]["k_max_abs_diff"] < 0.01
    # slot 1 of a -np 2 server: two streams, the first empty; the non-empty one is the same state
    doc = diff_json(DATA / "srv-np1.bin", DATA / "srv-np2-slot1.bin", code=1)
    assert [d["message"] for d in doc["differences"]] == ["1 vs 2 streams"]
    (st,) = doc["target"]["sections"][0]["streams"]
    assert st["stream"] == [0, 1] and st["equal"]


def test_two_prompts_first_differing_token_and_cells(tiny_models, tmp_path):
    from slotctl.runtime.model import Model

    other = SAMPLE_PROMPT.replace("capital", "river", 1)
    a = save(tiny_models.target, tmp_path / "a.bin")
    b = save(tiny_models.target, tmp_path / "b.bin", other)
    with Model(tiny_models.target, vocab_only=True) as m:
        ta, tb = m.tokenize(SAMPLE_PROMPT), m.tokenize(other)
    first = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    doc = diff_json(a, b, "-m", tiny_models.target, code=1)
    assert doc["tokens"]["first_difference"] == first > 0
    assert doc["tokens"]["n_tokens"] == [len(ta), len(tb)]
    text = doc["tokens"]["text"]
    assert text["a"].lstrip().startswith("capital") and text["b"].lstrip().startswith("river")
    (st,) = doc["target"]["sections"][0]["streams"]
    # a causal model: the cells before the first differing token hold the same keys and values
    assert st["differing_ranges"][0][0] == first
    assert st["differing_cells"] == min(len(ta), len(tb)) - first
    res = cli("diff", a, b, "-m", tiny_models.target)
    assert res.exit_code == 1 and f"first differing token: {first}" in res.stdout


def test_checkpoints_and_draft_state_compared_the_same_way(tiny_models, tmp_path):
    t, dr = tiny_models.target, tiny_models.draft
    f16 = save(t, tmp_path / "f16.bin", SAMPLE_PROMPT, "-md", dr, "--spec-type", "draft-simple", "--checkpoint-at", "40")
    q8 = save(t, tmp_path / "q8.bin", SAMPLE_PROMPT, "-md", dr, "--spec-type", "draft-simple", "--checkpoint-at", "40", "-ctkd", "q8_0",
              "-ctvd", "q8_0")
    assert diff_json(f16, f16, code=0)["n_checkpoints"] == [1, 1]
    doc = diff_json(f16, q8, code=1)
    assert doc["target"]["equal"] and doc["tokens"]["equal"]
    (dst,) = doc["draft"]["sections"][0]["streams"]
    assert dst["layers"][0]["k_type"] == ["f16", "q8_0"] and 0 < dst["layers"][0]["k_max_abs_diff"] < 0.05
    # a plain KV cache's checkpoint blobs are the blob header alone (b11669's PARTIAL_ONLY): nothing to compare
    (cp,) = doc["checkpoints"]
    assert cp["n_tokens"] == [40, 40] and cp["target"] is None and cp["draft"] is None and cp["equal"]
    assert {d["layer"].split(",")[0] for d in doc["differences"]} == {"draft state"}


def test_small_chunks_give_the_same_answer(monkeypatch):
    """Rows are read in bounded chunks: a chunk of a few rows gives the same figures as one chunk."""
    from slotctl import diff as d
    from slotctl.slotfile import open_slot_file

    a, b = open_slot_file(DATA / "srv-np1.bin"), open_slot_file(DATA / "srv-fa-off.bin")
    whole = d.diff_files(a, b)
    monkeypatch.setattr(d, "CHUNK", 300)
    assert d.diff_files(a, b) == whole
    a, b = open_slot_file(DATA / "srv-np1.bin"), open_slot_file(DATA / "srv-kvq8.bin")
    monkeypatch.setattr(d, "CHUNK", 8 << 20)
    whole = d.diff_files(a, b)
    monkeypatch.setattr(d, "CHUNK", 300)
    assert d.diff_files(a, b) == whole


def test_damaged_and_missing_files(tmp_path):
    raw = (DATA / "srv-np1.bin").read_bytes()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(raw[: len(raw) - 1000])
    doc = diff_json(DATA / "srv-np1.bin", cut, code=1)
    assert doc["b"]["damaged"] and doc["b"]["findings"][0]["severity"] == "error"
    assert any(d["layer"] == "B damaged" for d in doc["differences"])
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\0" * 64)
    doc = diff_json(junk, DATA / "srv-np1.bin", code=1)
    f = doc["a"]["findings"][0]
    assert (f["layer"], f["offset"]) == ("state header", 0)
    assert f["message"].startswith("state header at 0x0 (0): state file magic")
    assert cli("diff", DATA / "srv-np1.bin", tmp_path / "missing.bin").exit_code == 2
    assert cli("diff", DATA / "srv-np1.bin", tmp_path).exit_code == 2
    shutil.copyfile(DATA / "srv-np1.bin", tmp_path / "copy.bin")
    assert cli("diff", DATA / "srv-np1.bin", tmp_path / "copy.bin").exit_code == 0


#: every file a real llama-server saved, of every memory kind (the project's shared vectors are these bytes)
SERVER_FILES = sorted(DATA.rglob("srv-*.bin"))


@pytest.mark.parametrize("path", SERVER_FILES, ids=lambda p: str(p.relative_to(DATA)))
def test_every_real_server_file_equals_itself(path):
    """A file compared with itself is identical, for every memory kind: lfm2's zero-width s records (its
    short-convolution layers) included (format.records.row_elements: zero is a width)."""
    doc = diff_json(path, path, code=0)
    assert doc["differences"] == [] and not doc["a"]["damaged"] and not doc["b"]["damaged"]
    res = cli("diff", path, path)
    assert res.exit_code == 0 and "damaged" not in res.output


def test_zero_width_records_are_rows_of_no_elements_and_a_partial_row_is_still_damage():
    """lfm2's s records have a row size of 0: every reader takes them as rows of 0 elements; a row size
    that is not a whole number of its type's blocks stays damage, named at its field."""
    from slotctl.errors import FormatError
    from slotctl.format.records import row_elements
    from slotctl.slotfile import open_slot_file

    path = DATA / "kinds" / "srv-lfm2.bin"
    sf = open_slot_file(path)
    assert not sf.errors
    sec = next(s for s in sf.target.sections if s.type != "kv")
    zero = [r for r in sec.s if r.row_size == 0]
    assert zero and all(row_elements(r, "t") == 0 for r in zero)
    assert all(row_elements(r, "t") > 0 for r in sec.r if r.row_size)
    # a row size of 2 (half an f32) or an element size that is not the type's: damage, named
    import construct as cs

    with pytest.raises(FormatError, match="multiple of 4 bytes, found 2"):
        row_elements(cs.Container(type=0, row_size=2, data=b""), "t")
    with pytest.raises(FormatError, match="element size of 2, found 4"):
        row_elements(cs.Container(type=1, el_size=4, n_embd=0, data=b""), "t")
    assert row_elements(cs.Container(type=1, el_size=2, n_embd=0, data=b""), "t") == 0
