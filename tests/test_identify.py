"""``slotctl identify`` in real llama-cpp-python contexts: files written by llama-server b11434 (tests/data) and
by slotctl's runtime are matched to the model that wrote them among candidates of exactly the same shape
(the tiny models of slotctl.tinymodels with other seeds), for the target and the draft state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import DATA
from slotctl.cli.app import app
from slotctl.tinymodels import make_kind_model, make_model

runner = CliRunner()
TARGET = DATA / "target.gguf"


def identify(*args, code: int = 0) -> dict:
    res = runner.invoke(app, ["identify", *map(str, args), "--json"])
    assert "Traceback" not in res.output, res.output
    assert res.exit_code == code, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """A model of the target's exact shape (llama, 2 layers) with other weights."""
    return make_model(tmp_path_factory.mktemp("other") / "other.gguf", n_layer=2, seed=5)


@pytest.mark.parametrize("name", ["srv-np1.bin", "srv-kvq8.bin", "srv-fa-off.bin"])
def test_the_servers_file_is_matched_to_its_model(other, name):
    """f16, q8_0 (rotated) and transposed-V files: the writer matches (cosine ~1), the other does not (~0)."""
    d = identify(DATA / name, "-m", other, "-m", TARGET)
    t = d["target"]
    assert t["best"] == str(TARGET) and d["exit_code"] == 0
    right, wrong = t["candidates"][1], t["candidates"][0]
    assert right["matches"] and right["score"] > 0.9999 and right["max_abs_diff"] < 0.01
    assert not wrong["matches"] and abs(wrong["score"]) < 0.2
    assert t["margin"] == pytest.approx(right["score"] - wrong["score"])
    assert {(x["tensor"], x["layer"]) for x in right["layers"]} == {("K", 0), ("K", 1), ("V", 0), ("V", 1)}
    assert all(x["n_rows"] == 32 for x in right["layers"])


def test_no_candidate_matches(other):
    d = identify(DATA / "srv-np1.bin", "-m", other, code=1)
    assert d["target"]["best"] is None and d["exit_code"] == 1
    res = runner.invoke(app, ["identify", str(DATA / "srv-np1.bin"), "-m", str(other)])
    assert res.exit_code == 1 and "no candidate matches" in res.stdout


def test_a_model_of_another_shape_is_no_candidate():
    d = identify(DATA / "srv-np1.bin", "-m", DATA / "draft.gguf", "-m", TARGET)
    bad = d["target"]["candidates"][0]
    assert not bad["matches"] and bad["score"] is None and "shape" in bad["error"]


def test_draft_state(tiny_models, tmp_path):
    """The SDFT draft state of a file slotctl saved with the tiny draft (seed 2) is matched to that draft,
    not to a draft of the same shape with other weights; the target at the same time."""
    from slotctl.model.settings import ContextSettings
    from slotctl.runtime.slot import ServerContexts, evaluate_prompt, write_slot_file
    from slotctl.tinymodels import SAMPLE_PROMPT

    path = tmp_path / "spec.bin"
    with ServerContexts.open(tiny_models.target, ContextSettings(n_ctx=256), draft_path=tiny_models.draft,
                             draft_type_k="q8_0", draft_type_v="q8_0") as sc:
        tokens = sc.target_model.tokenize(SAMPLE_PROMPT)
        evaluate_prompt(sc, tokens, 0)
        write_slot_file(path, sc, 0, tokens, with_draft=True)
    other_draft = make_model(tmp_path / "other-draft.gguf", n_layer=1, seed=7)
    d = identify(path, "-m", tiny_models.target, "-md", other_draft, "-md", tiny_models.draft, "-n", 16)
    assert d["target"]["best"] == str(tiny_models.target)
    assert d["draft"]["best"] == str(tiny_models.draft)
    right, wrong = d["draft"]["candidates"][1], d["draft"]["candidates"][0]
    assert right["score"] > 0.9999 and not wrong["matches"] and right["n_tokens"] == 16
    # a file without draft state: every draft candidate says so, and nothing matches
    d = identify(DATA / "srv-np1.bin", "-md", tiny_models.draft, code=1)
    assert d["draft"]["candidates"][0]["error"] == "the file holds no draft state"


def test_recurrent_state_is_compared_after_the_whole_prompt(tmp_path):
    """A mamba file (one recurrent cell at the last position): candidates evaluate every token."""
    other = make_kind_model("mamba", tmp_path / "other-mamba.gguf", seed=99)
    model = DATA / "kinds" / "mamba.gguf"
    d = identify(DATA / "kinds" / "srv-mamba.bin", "-m", other, "-m", model)
    right = d["target"]["candidates"][1]
    assert d["target"]["best"] == str(model) and right["score"] > 0.999 and right["n_tokens"] == 60
    assert {x["tensor"] for x in right["layers"]} == {"r", "s"}


def test_damaged_file_and_usage(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes((DATA / "srv-np1.bin").read_bytes()[:3000])
    d = identify(bad, "-m", TARGET, code=1)
    assert d["target"]["candidates"][0]["error"] and d["target"]["best"] is None
    res = runner.invoke(app, ["identify", str(DATA / "srv-np1.bin")])
    assert res.exit_code == 2 and "-m" in res.output


# -- files it cannot compare: a finding with its reason, never an internal error (issue 27) ------------------


def _records(path: Path):
    from slotctl.model.info import read_model_info
    from slotctl.slotfile import open_slot_file

    sf = open_slot_file(path, layout=read_model_info(TARGET).layout())
    assert not sf.errors, sf.errors
    d = next(st for st in sf.target.sections[0].streams if st.cell_count).data
    return d, list(d.k) + list(d.v)


def test_a_rotation_that_does_not_split_the_rows_is_a_reason(tmp_path):
    """n_rot_v = 8,388,608 on rows of 64 elements (the mutant identify-nrot.bin): exit 1, the candidate's
    reason, no internal error; the candidate of another shape keeps its own reason."""
    import struct

    raw = bytearray((DATA / "srv-np1.bin").read_bytes())
    d, recs = _records(DATA / "srv-np1.bin")
    at = recs[0].data.offset - 12 - 8     # u32 n_rot_k, u32 n_rot_v, then the first K record: u32 type, u64 row size
    assert struct.unpack_from("<II", raw, at) == (d.n_rot_k, d.n_rot_v) == (0, 0)
    struct.pack_into("<I", raw, at + 4, 8388608)
    path = tmp_path / "nrot.bin"
    path.write_bytes(bytes(raw))
    t = identify(path, "-m", TARGET, "-m", DATA / "draft.gguf", code=1)["target"]
    assert t["best"] is None
    assert "rotation recorded (8,388,608) does not split rows of 64 elements" in t["candidates"][0]["error"]
    assert "shape" in t["candidates"][1]["error"]
    res = runner.invoke(app, ["identify", str(path), "-m", str(TARGET)])
    assert res.exit_code == 1 and "internal error" not in res.output and "rotation" in res.stdout


def test_a_record_of_zero_width_is_not_compared(tmp_path):
    """The last V record's row size 0, the file ending there (identify-reshape.bin): its rows are not compared,
    the others still are (the writer matches)."""
    import struct

    raw = bytearray((DATA / "srv-np1.bin").read_bytes())
    _, recs = _records(DATA / "srv-np1.bin")
    last = recs[-1].data.offset
    struct.pack_into("<Q", raw, last - 8, 0)
    path = tmp_path / "zero.bin"
    path.write_bytes(bytes(raw[:last]))
    t = identify(path, "-m", TARGET, "-m", DATA / "draft.gguf")["target"]
    assert t["best"] == str(TARGET)
    assert len(t["candidates"][0]["layers"]) == len(recs) - 1


def test_rows_that_are_not_finite_are_a_reason(tmp_path):
    """An f16 value of the first K record set to infinity (a fuzz finding: a numpy RuntimeWarning, then NaN
    cosines): the candidate's reason, exit 1, strict JSON."""
    raw = bytearray((DATA / "srv-np1.bin").read_bytes())
    _, recs = _records(DATA / "srv-np1.bin")
    raw[recs[0].data.offset:recs[0].data.offset + 2] = b"\x00\x7c"    # f16 +inf
    path = tmp_path / "inf.bin"
    path.write_bytes(bytes(raw))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = identify(path, "-m", TARGET, code=1)["target"]
    assert "not finite" in t["candidates"][0]["error"] and t["candidates"][0]["score"] is None
