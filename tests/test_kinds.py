"""Every memory kind: sliding-window (iSWA), recurrent and hybrid models, and checkpoints as the server makes them.

The tiny models of ``slotctl.tinymodels.make_kind_model`` (one per kind, made once per module) are saved,
inspected, validated and restored in real llama.cpp contexts; a restored slot answers a request that
extends the saved prompt, and one that diverges from it (the server then rolls back to a checkpoint), and
``--compare`` checks it against a slot that was never saved. Where a test asserts a number, it is what
b11434's rules give (docs/kinds.md explains each).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.model.info import read_model_info
from slotctl.runtime import Context, ContextSettings, Model
from slotctl.runtime.slot import ServerContexts, evaluate_prompt, write_slot_file
from slotctl.server.checkpoints import (
    SEQ_RM_FULL,
    SEQ_RM_PART,
    Checkpoint,
    CheckpointPolicy,
    add_checkpoint,
    seq_rm_type,
)
from slotctl.slotfile import open_slot_file, rebuild
from slotctl.tinymodels import KINDS, MEMORY_KINDS, SAMPLE_PROMPT, make_kind_model, make_models
from slotctl.validate import ChildProcess, ServerSetup, validate_paths

runner = CliRunner()
CTX = ["-c", "256", "-t", "1"]
#: 42 tokens with BOS; its 25th token (" country") is where DIVERGED departs from it
PROMPT = ("What is the capital of France? Paris is the capital of France, and it is also the largest city in the "
          "country. The river Seine runs through the middle of Paris from the east to the west.")
DIVERGED = ("What is the capital of France? Paris is the capital of France, and it is also the largest city in the "
            "world. The river")
NEEDS_CHECKPOINTS = [k for k in KINDS if MEMORY_KINDS[k] != "kv"]
#: kinds whose memory position check the restored slot passes without going back when a request extends
#: the prompt: the sliding window of gemma2 and lfm2-swa is rolled back to a checkpoint (see docs/kinds.md)
ROLLS_BACK_ON_EXTENSION = {"gemma2", "lfm2-swa"}


def cli(*args, **kw):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False, env={"COLUMNS": "250"}, **kw)


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("kind-models")
    return {kind: make_kind_model(kind, d / f"{kind}.gguf") for kind in KINDS}


@pytest.fixture(scope="module")
def files(models, tmp_path_factory) -> dict[str, Path]:
    """Each kind's model saved with the server's checkpoints and one every 12 tokens: at 12, 24, 36 and
    (the server's own, 4 before the end of the prompt, for every kind but llama) 38."""
    d = tmp_path_factory.mktemp("kind-files")
    out = {}
    for kind, model in models.items():
        path = d / f"{kind}.bin"
        res = cli("save", "-m", model, "--prompt", PROMPT, "-o", path, *CTX, "--server-checkpoints",
                  "--checkpoint-every", "12", "--json")
        assert res.exit_code == 0, res.stderr
        out[kind] = path
        out[kind + "_json"] = json.loads(res.stdout)
    return out


@pytest.fixture(scope="module")
def child():
    with ChildProcess() as c:
        yield c


def restore(model, path, *args, draft=None) -> tuple[dict, int]:
    extra = ["-md", draft, "--spec-type", "draft-simple"] if draft else []
    res = cli("restore", path, "-m", model, *extra, *CTX, *args, "--json")
    return json.loads(res.stdout), res.exit_code


# -- the models ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_kind_models_load_decode_and_have_their_memory(models, kind):
    info = read_model_info(models[kind])
    assert info.memory_kind == MEMORY_KINDS[kind]
    with Model(models[kind]) as m, Context(m, ContextSettings(n_ctx=256, n_threads=1)) as ctx:
        tokens = m.tokenize(SAMPLE_PROMPT)
        ctx.decode(tokens, 0, 0)
        out = []
        for i in range(12):
            out.append(ctx.argmax())
            ctx.decode([out[-1]], 0, len(tokens) + i)
    # random weights: noise, but not one token repeated (a tied output could repeat the input token)
    assert len(set(out)) > 3, out


def test_kind_model_layouts(models):
    g = read_model_info(models["gemma2"])
    assert g.swa_layers == (True, False, True, False) and g.sliding_window == 16
    m = read_model_info(models["mamba"])
    assert (m.n_layer, m.n_embd_r, m.n_embd_s) == (2, 3 * 128, 16 * 128)
    lf = read_model_info(models["lfm2"])
    assert lf.recurrent_layers == (True, False, True, False) and (lf.n_embd_r, lf.n_embd_s) == (2 * 128, 0)
    j = read_model_info(models["jamba"])
    assert j.recurrent_layers == (True, False, True, False) and j.head_dim_k == 32
    sw = read_model_info(models["lfm2-swa"])
    assert sw.swa_layers == (False, True, False, True) and sw.kv_layers("base") == ()


def test_making_kind_models_again_gives_the_same_bytes(models, tmp_path):
    before = models["mamba"].stat()
    assert make_kind_model("mamba", models["mamba"]) == models["mamba"]
    after = models["mamba"].stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # "llama" is the standard target, byte for byte
    assert make_kind_model("llama", tmp_path / "l.gguf").read_bytes() == make_models(tmp_path).target.read_bytes()
    # lfm2-swa is lfm2 with a window
    other = make_kind_model("gemma2", tmp_path / "g8.gguf", sliding_window=8)
    assert read_model_info(other).sliding_window == 8
    with pytest.raises(ValueError):
        make_kind_model("mamba", tmp_path / "x.gguf", sliding_window=8)
    with pytest.raises(ValueError):
        make_kind_model("rwkv", tmp_path / "x.gguf")


@pytest.mark.parametrize("kind", KINDS)
def test_seq_rm_type_is_what_the_server_finds(models, kind):
    """common_context_can_seq_rm: decode two tokens, remove the second."""
    with Model(models[kind]) as m, Context(m, ContextSettings(n_ctx=256, n_threads=1)) as ctx:
        ctx.decode([0, 0], 0, 0)
        probed = SEQ_RM_PART if ctx.seq_rm(0, 1, -1) else SEQ_RM_FULL
    assert seq_rm_type(MEMORY_KINDS[kind]) == probed


# -- where checkpoints are taken -----------------------------------------------------------------


class _Cp:
    def __init__(self, n, task):
        self.n_tokens, self.task = n, task


def test_add_checkpoint_keeps_the_newest_and_thins_out_other_tasks():
    cps = [_Cp(n, -1) for n in (10, 12, 100)]
    add_checkpoint(cps, _Cp(200, 1), n_max=4, min_step=8)
    # full: 12 lies within 8 of 10 (another task's): erased
    assert [c.n_tokens for c in cps] == [10, 100, 200]
    add_checkpoint(cps, _Cp(300, 1), n_max=3, min_step=0)
    assert [c.n_tokens for c in cps] == [100, 200, 300]
    add_checkpoint(cps, _Cp(300, 1), n_max=32, min_step=0)  # the same n_tokens is superseded
    assert [c.n_tokens for c in cps] == [100, 200, 300]


@pytest.mark.parametrize("before,new,n_max,min_step,after", [
    # issue 24: create_checkpoint checks "full" again at every step: 2 and 4 go, then there is room
    ((0, 2, 4, 6), 200, 4, 8, (0, 6, 200)),
    # 2, 4 and 6 go (each within 8 of 0); then there is room and 8 stays
    ((0, 2, 4, 6, 8), 200, 4, 8, (0, 8, 200)),
    # not full: nothing is thinned out, however close
    ((0, 2), 200, 4, 8, (0, 2, 200)),
    # the current task's own checkpoints are never thinned out
    ((0, 2, 4, 6), 200, 4, 8, (2, 4, 6, 200)),
])
def test_add_checkpoint_checks_full_at_every_step(before, new, n_max, min_step, after):
    own = 7 if after == (2, 4, 6, 200) else 1
    cps = [_Cp(n, own if own == 7 else -1) for n in before]
    add_checkpoint(cps, _Cp(new, 7), n_max=n_max, min_step=min_step)
    assert tuple(c.n_tokens for c in cps) == after


def _server_cps(model, tokens, **kw) -> list[Checkpoint]:
    settings = ContextSettings(n_ctx=256, n_threads=1, n_ubatch=kw.pop("n_ubatch", 512))
    with ServerContexts.open(model, settings) as sc:
        return evaluate_prompt(sc, tokens, 0, policy=CheckpointPolicy(server=True, **kw))


@pytest.mark.parametrize("kind", KINDS)
def test_the_server_checkpoints_near_the_end_of_the_prompt(models, kind):
    with Model(models[kind], vocab_only=True) as m:
        tokens = m.tokenize(SAMPLE_PROMPT)  # 99 tokens
    cps = _server_cps(models[kind], tokens)
    if kind == "llama":
        assert cps == []   # a KV cache is rolled back by removing positions: no checkpoints
        return
    assert [c.n_tokens for c in cps] == [95]            # 4 before the end (n_ubatch 256 > the prompt)
    cps = _server_cps(models[kind], tokens, n_ubatch=32)
    assert [c.n_tokens for c in cps] == [63, 95]        # 4 + n_ubatch and 4 before the end
    cp = cps[-1]
    info = read_model_info(models[kind])
    if info.memory_kind == "iswa":
        assert (cp.pos_min, cp.pos_max) == (0, 94)      # the fresh SWA cache still holds every cell
    else:
        assert (cp.pos_min, cp.pos_max) == (94, 94)     # the recurrent state: one cell


def test_user_messages_are_checkpointed_as_the_server_does(models):
    """With n_ubatch 8 (so that only the last batches are near the end): the first user message (there is no
    checkpoint yet) and the last one, not those within --checkpoint-min-step of the last checkpoint; then 4 + 8
    and 4 tokens before the end. (With a larger n_ubatch every batch of this short prompt is "near the end".)"""
    with Model(models["mamba"], vocab_only=True) as m:
        tokens = m.tokenize(SAMPLE_PROMPT)
    users = (10, 30, 50, 70)
    cps = _server_cps(models["mamba"], tokens, user_starts=users, n_ubatch=8)
    assert [c.n_tokens for c in cps] == [10, 70, 87, 95]
    cps = _server_cps(models["mamba"], tokens, user_starts=users, n_ubatch=8, min_step=15)
    assert [c.n_tokens for c in cps] == [10, 30, 50, 70, 87, 95]
    cps = _server_cps(models["mamba"], tokens, user_starts=users, n_ubatch=8, min_step=15, n_ctx_checkpoints=2)
    assert [c.n_tokens for c in cps] == [87, 95]
    # n_ubatch 256: every batch ends near the end of the prompt
    cps = _server_cps(models["mamba"], tokens, user_starts=users)
    assert [c.n_tokens for c in cps] == [10, 30, 70, 95]
    # -ctxcp 0: the server takes none
    assert _server_cps(models["mamba"], tokens, user_starts=users, n_ctx_checkpoints=0) == []


# -- save and inspect -------------------------------------------------------------------------------


def _sections(mem: dict) -> list[tuple]:
    return [(s["role"], s["n_layer"], len(s["layers"])) for s in mem["sections"]]


EXPECTED_SECTIONS = {
    "llama": [("kv", 2, 2)],
    "gemma2": [("base", 2, 2), ("swa", 2, 2)],
    "mamba": [("recurrent", 2, 2)],
    "lfm2": [("attention", 2, 2), ("recurrent", 4, 2)],
    "jamba": [("attention", 2, 2), ("recurrent", 4, 2)],
    "lfm2-swa": [("base", 0, 0), ("swa", 2, 2), ("recurrent", 4, 2)],
}
#: what a PARTIAL_ONLY checkpoint blob holds
PARTIAL_ROLES = {"llama": ["kv"], "gemma2": ["swa"], "mamba": ["recurrent"], "lfm2": ["recurrent"],
                 "jamba": ["recurrent"], "lfm2-swa": ["swa", "recurrent"]}


@pytest.mark.parametrize("kind", KINDS)
def test_save_writes_the_servers_checkpoints_and_inspect_dissects_every_kind(models, files, kind):
    saved = files[kind + "_json"]
    assert saved["n_tokens"] == 42
    assert [c["n_tokens"] for c in saved["checkpoints"]] == ([12, 24, 36] if kind == "llama" else [12, 24, 36, 38])
    for args in ([], ["-m", models[kind]]):   # without a model the layout is found all the same
        res = cli("inspect", files[kind], *args, "--json")
        assert res.exit_code == 0, res.stdout
        d = json.loads(res.stdout)["files"][0]
        assert d["target"]["memory"]["kind"] == MEMORY_KINDS[kind]
        assert _sections(d["target"]["memory"]) == EXPECTED_SECTIONS[kind]
        for cp in d["checkpoints"]:
            if kind == "llama":   # a plain KV cache's PARTIAL_ONLY state as b11669 writes it: the blob header alone
                assert cp["target"]["header_only"] and cp["target"]["memory"] is None
                continue
            assert [s["role"] for s in cp["target"]["memory"]["sections"]] == PARTIAL_ROLES[kind]
    # with the model: which layers each section holds
    ids = {s["role"]: s["layer_ids"] for s in d["target"]["memory"]["sections"]}
    assert ids == {"llama": {"kv": [0, 1]}, "gemma2": {"base": [1, 3], "swa": [0, 2]},
                   "mamba": {"recurrent": [0, 1]}, "lfm2": {"attention": [1, 3], "recurrent": [0, 2]},
                   "jamba": {"attention": [1, 3], "recurrent": [0, 2]},
                   "lfm2-swa": {"base": [], "swa": [1, 3], "recurrent": [0, 2]}}[kind]
    # the layers rebuild to the very bytes
    sf = open_slot_file(files[kind])
    assert rebuild(sf) == files[kind].read_bytes()


def test_what_each_section_holds(models, files):
    sf = open_slot_file(files["gemma2"], layout=read_model_info(models["gemma2"]).layout())
    base, swa = sf.target.sections
    assert (base.streams[0].cell_count, swa.streams[0].cell_count) == (42, 16)
    assert (swa.streams[0].cells.pos_min, swa.streams[0].cells.pos_max) == (26, 41)   # the window
    # checkpoint at 12 tokens: the window was not full yet
    assert [c.tgt.memory.sections[0].streams[0].cell_count for c in sf.checkpoints] == [12, 16, 16, 16]
    sf = open_slot_file(files["lfm2"])
    rec = sf.target.sections[1]
    assert rec.cell_count == 1 and int(rec.cells.n_seq_id[0]) == 0 and int(rec.cells.pos[0]) == 41
    assert [r.row_size for r in rec.r] == [1024, 1024] and [s.row_size for s in rec.s] == [0, 0]
    sf = open_slot_file(files["mamba"])
    assert [r.row_size for r in sf.target.sections[0].r] == [1536] * 2
    assert [s.row_size for s in sf.target.sections[0].s] == [8192] * 2


def test_inspect_says_what_a_checkpoint_holds(models, files):
    res = cli("inspect", files["lfm2-swa"], "-m", models["lfm2-swa"])
    text = " ".join(res.stdout.split())
    assert "each target blob holds only the SWA and recurrent parts" in text
    assert "swa 16 cells + recurrent 1 cell" in text
    assert "no full-attention layers: it lists its cells only" in text
    assert "(recurrent layers 0, 2)" in text and "(sliding-window layers 1, 3)" in text


@pytest.mark.parametrize("kind", NEEDS_CHECKPOINTS)
def test_an_empty_slot_is_found_without_a_model(models, tmp_path, kind):
    path = tmp_path / "empty.bin"
    with ServerContexts.open(models[kind], ContextSettings(n_ctx=256, n_threads=1)) as sc:
        write_slot_file(path, sc, 0, [])
    sf = open_slot_file(path)
    assert sf.errors == [] and sf.target.layout.kind == MEMORY_KINDS[kind]


def test_inspect_names_the_kinds_it_cannot_tell_apart(files, tmp_path):
    """A payload cut short of its end, with an SCKP appendix after it that parses: nothing fits."""
    raw = files["jamba"].read_bytes()
    sf = open_slot_file(files["jamba"])
    bad = tmp_path / "cut.bin"
    bad.write_bytes(raw[:sf.target.end - 4] + raw[sf.target.end:])
    res = cli("inspect", bad, "--json")
    d = json.loads(res.stdout)["files"][0]
    assert res.exit_code == 1 and d["target"] is None
    assert any("none fits (give --model to name the layout)" in f["message"] for f in d["findings"])
    assert d["sckp"] is not None  # the appendix is still found, by a scan


# -- validate ---------------------------------------------------------------------------------------


def _validate(child, path, model, **settings):
    setup = ServerSetup(target=model, settings=ContextSettings(**settings))
    (r,) = validate_paths([path], setup, child=child, confirm_refusals=True).files
    return r


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_validates_and_loads(child, models, files, kind):
    r = _validate(child, files[kind], models[kind], n_ctx=256)
    assert r.verdict == "restores", r.findings
    # a plain KV cache's checkpoints are the blob header alone (b11669's PARTIAL_ONLY): predicted to fit, not
    # loaded into this runtime's llama.cpp, which writes and reads the whole cache there
    header_only = {c.layer for c in r.checks if c.layer.startswith("checkpoint")} if kind == "llama" else set()
    assert all((c.predicted, c.loaded, c.effect) == ("fits", "skipped" if c.layer in header_only else "fits", "ok")
               for c in r.checks), r.checks
    assert len(r.checks) == 1 + len(files[kind + "_json"]["checkpoints"])


def test_validate_explains_recurrent_rows_in_the_models_own_keys(child, models, files):
    """An lfm2 file against jamba: same layer pattern, other widths."""
    r = _validate(child, files["lfm2"], models["jamba"], n_ctx=256)
    assert r.verdict == "refused"
    msgs = {f.code: f.message for f in r.findings if f.layer == "target memory"}
    assert set(msgs) == {"k_row_size_mismatch", "v_row_size_mismatch", "r_row_size_mismatch", "s_row_size_mismatch"}
    assert ("r rows (the convolution state) of layer 0 are 1,024 bytes in the file and 1,536 in the target "
            "context; jamba.gguf: (ssm.conv_kernel 4 - 1) x ssm.inner_size 128 elements of f32"
            in msgs["r_row_size_mismatch"])
    assert "ssm.state_size 16 x ssm.inner_size 128" in msgs["s_row_size_mismatch"]
    # prediction and the real load agree on every layer
    assert all(c.loaded == "refused" for c in r.checks)
    assert "prediction_disagrees" not in {f.code for f in r.findings}


def test_validate_names_another_memory_kind(child, models, files):
    r = _validate(child, files["gemma2"], models["lfm2-swa"], n_ctx=256)
    f = [f for f in r.findings if f.code == "memory_kind_mismatch"]
    assert f[0].layer == "target memory" and "is an iSWA cache (base and SWA KV), but lfm2-swa.gguf (lfm2) keeps a " \
        "hybrid memory with SWA" in f[0].message
    assert ("checkpoint 0's target blob is a KV cache alone (the SWA part of an iSWA cache, or a whole plain KV "
            "cache), but lfm2-swa.gguf (lfm2) keeps the SWA and recurrent parts of a hybrid memory with SWA"
            in f[1].message)
    # a hybrid with a second slot: its attention KV gets two streams; a checkpoint (the recurrent part) still fits
    r = _validate(child, files["jamba"], models["jamba"], n_ctx=512, n_parallel=2)
    assert [f.code for f in r.findings if f.severity == "error"] == ["n_stream_mismatch"]
    assert [c.predicted for c in r.checks[1:]] == ["fits"] * 4


def test_validate_notes_another_sliding_window(child, models, files, tmp_path):
    wider = make_kind_model("gemma2", tmp_path / "g32.gguf", sliding_window=32)
    r = _validate(child, files["gemma2"], wider, n_ctx=256)
    assert r.verdict == "restores"   # the loader does not check the window: notes only
    (note,) = [f for f in r.findings if f.code == "swa_window_mismatch" and f.layer == "target memory"]
    assert "holds 16 cells (positions 26..41), fewer than the 32 the model's window of 32 keeps" in note.message


# -- restore: a request that extends the prompt, one that diverges ----------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_restore_continue_and_compare(models, files, kind):
    d, code = restore(models[kind], files[kind], "--continue", " And the", "-n", "8", "--compare")
    c, f = d["continuation"], d["compare"]["fresh"]
    assert c["text"] == f["text"] and c["n_generated"] == 8
    assert (c["n_prompt"], c["n_common"]) == (44, 42)
    if kind == "gemma2":
        # the file holds only the window: back to the checkpoint at 38 (its recorded pos_min is 0), the token at
        # position 37 evaluated again; the never-saved slot holds every cell
        assert (c["checkpoint"], c["n_reused"], f["n_reused"]) == (38, 37, 42)
        # the server's documented behaviour, and the count validate predicts: explained, exit 0
        assert code == 0 and d["compare"]["explained"] and "as validate predicts" in d["compare"]["note"]
        assert "goes back to the checkpoint at 38 tokens" in d["compare"]["note"]
    elif kind == "lfm2-swa":
        # the memory's pos_min is the recurrent state's position, 41: past pos_next - n_swa = 26, so both slots
        # go back, to the last checkpoint whose pos_min (its recurrent position) is below 26: the one at 24
        assert (c["checkpoint"], c["n_reused"], c["n_reevaluated"]) == (24, 24, 18) and code == 0
        assert (f["checkpoint"], f["n_reused"]) == (24, 24)
    else:
        assert (c["checkpoint"], c["n_reused"], c["n_reevaluated"]) == (None, 42, 0) and code == 0
    assert d["compare"]["agree"] == (kind != "gemma2")


@pytest.mark.parametrize("kind", KINDS)
def test_a_diverging_request_rolls_back_to_the_last_checkpoint(models, files, kind):
    d, code = restore(models[kind], files[kind], "--prompt", DIVERGED, "-n", "8", "--compare")
    c, f = d["continuation"], d["compare"]["fresh"]
    assert (c["n_prompt"], c["n_common"], c["prompt"], c["continue_text"]) == (28, 24, DIVERGED, None)
    assert c["text"] == f["text"]
    want = {
        "llama": (None, 24),      # positions are removed: nothing to roll back
        "gemma2": (24, 23),       # the checkpoint at 24 tokens; its pos_max 23 is evaluated again
        "mamba": (24, 24),        # the recurrent state at 24 tokens
        "lfm2": (24, 24),
        "jamba": (24, 24),
        "lfm2-swa": (None, 0),    # a checkpoint must lie n_swa (16) before the divergence: none does
    }[kind]
    assert (c["checkpoint"], c["n_reused"]) == want
    assert c["n_reevaluated"] == 24 - want[1]
    if kind == "gemma2":
        assert code == 0 and d["compare"]["explained"] and (f["checkpoint"], f["n_reused"]) == (None, 24)
    else:
        assert code == 0 and d["compare"]["agree"]
        assert (f["checkpoint"], f["n_reused"]) == want


def test_the_report_says_which_checkpoint_and_how_much_was_evaluated_again(models, files):
    res = cli("restore", files["lfm2-swa"], "-m", models["lfm2-swa"], *CTX, "--prompt", DIVERGED, "-n", "2")
    text = " ".join(res.stdout.replace("│", " ").split())  # the panel's lines, unboxed
    assert "the slot held the request's first 24 tokens, but its memory cannot stay at that position (an SWA " \
           "window or a recurrent state): no checkpoint was early enough, so the server started over, and 24 of " \
           "them were evaluated again, with the 4 new ones" in text
    res = cli("restore", files["gemma2"], "-m", models["gemma2"], *CTX, "--prompt", DIVERGED, "-n", "2")
    text = " ".join(res.stdout.replace("│", " ").split())  # the panel's lines, unboxed
    assert "from the checkpoint at 24 tokens" in text
    assert "the memory went back to the checkpoint at 24 tokens, and 1 of them was evaluated again" in text


def test_user_delimiters_checkpoint_each_turn_and_an_edited_last_turn_rolls_back(models, tmp_path):
    turns = ["Q: What is the capital of France?\nA: Paris.\n", "Q: And the river?\nA: The Seine.\n",
             "Q: Which tower is famous?\nA: The Eiffel Tower."]
    path = tmp_path / "chat.bin"
    res = cli("save", "-m", models["jamba"], "--prompt", "".join(turns), "-o", path, *CTX, "-ub", "8",
              "--user-delimiter", "Q:", "--json")
    assert res.exit_code == 0, res.stderr
    saved = json.loads(res.stdout)
    first, _, last = saved["user_starts"]
    assert first == 1     # right after BOS
    # the first user message (no checkpoint yet), the last one, and 4 + n_ubatch and 4 before the end
    n = saved["n_tokens"]
    saved_at = [c["n_tokens"] for c in saved["checkpoints"]]
    assert saved_at == [first, last, n - 12, n - 4]
    for edited in ("".join(turns[:2]) + "Q: Which bridge is old?", "Q: What is the capital of Spain?"):
        d, code = restore(models["jamba"], path, "--prompt", edited, "-n", "4", "--compare")
        c = d["continuation"]
        assert code == 0 and d["compare"]["agree"]
        # back to the last checkpoint at or before the point where the request diverges
        back = max(n for n in saved_at if n <= c["n_common"])
        assert (c["checkpoint"], c["n_reused"], c["n_reevaluated"]) == (back, back, c["n_common"] - back)
    assert back == first  # the edit in the first message went back to the first checkpoint


def test_save_refuses_an_empty_delimiter(models, tmp_path):
    res = runner.invoke(app, ["save", "-m", str(models["mamba"]), "--prompt", "x", "-o", str(tmp_path / "x.bin"),
                              "--user-delimiter", ""])
    assert res.exit_code == 2 and "empty delimiter" in res.stderr


# -- speculative decoding: checkpoints and replay ------------------------------------------------------


@pytest.mark.parametrize("target, draft", [("mamba", "mamba"), ("jamba", "llama"), ("lfm2", "mamba"),
                                           ("lfm2-swa", "lfm2-swa")])
def test_speculative_decoding_with_recurrent_and_hybrid_targets(models, tmp_path, target, draft):
    path = tmp_path / "spec.bin"
    res = cli("save", "-m", models[target], "-md", models[draft], "--spec-type", "draft-simple", "--prompt", PROMPT, "-o", path, *CTX,
              "--server-checkpoints")
    assert res.exit_code == 0, res.stderr
    d, code = restore(models[target], path, "--continue", " And the", "-n", "16", "--compare", draft=models[draft])
    c = d["continuation"]
    assert code == 0 and d["compare"]["agree"], d["compare"]
    assert c["speculative"] and c["n_generated"] == 16
    if target == draft:
        # drafting for itself: every draft is accepted, nothing is replayed
        assert c["n_accepted"] == c["n_drafted"] > 0 and c["n_replayed"] == 0
    else:
        # another model's drafts are rejected: each partly accepted draft restores the speculative
        # checkpoint and replays the accepted tokens
        assert c["n_accepted"] < c["n_drafted"] and c["n_replayed"] > 0


def test_the_server_aborts_with_a_recurrent_draft_for_a_target_that_removes_positions(models, tmp_path):
    path = tmp_path / "abort.bin"
    res = cli("save", "-m", models["llama"], "-md", models["mamba"], "--spec-type", "draft-simple", "--prompt", PROMPT, "-o", path, *CTX)
    assert res.exit_code == 0, res.stderr
    d, code = restore(models["llama"], path, "--continue", " And the", "-n", "16", draft=models["mamba"])
    assert code == 1 and not d["ok"]
    assert re.search(r"llama-server aborts here: failed to remove sequence 0 with p0=\d+, p1=-1 from the draft "
                     r"context", d["error"]["message"])


def test_greedy_decoding_agrees_with_a_restored_recurrent_slot(models, files):
    """The restored mamba slot's continuation is plain greedy decoding of the whole request."""
    d, _ = restore(models["mamba"], files["mamba"], "--continue", " And the", "-n", "6")
    with Model(models["mamba"]) as m, Context(m, ContextSettings(n_ctx=256, n_threads=1)) as ctx:
        request = m.tokenize(PROMPT + " And the")
        ctx.decode(request, 0, 0)
        out = []
        for i in range(6):
            out.append(ctx.argmax())
            ctx.decode([out[-1]], 0, len(request) + i)
    assert d["continuation"]["tokens"] == out


# -- files a real llama-server (b11434) saved: tests/data/kinds, see its README -----------------------


SRV = Path(__file__).parent / "data" / "kinds"


@pytest.mark.parametrize("kind", ["gemma2", "mamba", "lfm2", "jamba"])
def test_files_a_real_server_saved_restore_and_continue(kind):
    d, code = restore(SRV / f"{kind}.gguf", SRV / f"srv-{kind}.bin", "-fa", "on", "--continue", " and", "-n", "6",
                      "--compare")
    c, f = d["continuation"], d["compare"]["fresh"]
    assert d["ok"] and d["steps"][0]["converted_from"] == 4 and d["n_tokens"] == 60
    assert c["text"] == f["text"] and c["checkpoint"] is None   # b11434 writes no checkpoints
    if kind == "gemma2":
        # the restored SWA cache holds the last 16 cells: without a checkpoint the prompt is evaluated again
        assert (c["n_reused"], f["n_reused"], code) == (0, 60, 0) and d["compare"]["explained"]
    else:
        # the generated tokens do not tokenize back from their text: the request diverges after 53 tokens,
        # and a recurrent state without a checkpoint starts over, restored or not
        assert (c["n_common"], c["n_reused"], f["n_reused"], code) == (53, 0, 0, 0)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "mamba"])
def test_save_takes_the_servers_checkpoints_by_default(models, tmp_path, kind):
    """Like the server: a model whose memory cannot be rolled back gets a checkpoint 4 tokens before the end
    of the prompt without being asked; a plain KV model gets none; --no-server-checkpoints turns them off."""
    n = len(Model(models[kind], vocab_only=True).tokenize(PROMPT))
    res = cli("save", "-m", models[kind], "--prompt", PROMPT, "-o", tmp_path / "a.bin", *CTX, "--json")
    assert res.exit_code == 0, res.stderr
    cps = open_slot_file(tmp_path / "a.bin").checkpoints
    if MEMORY_KINDS[kind] == "kv":
        assert cps is None
    else:
        assert [c.n_tokens for c in cps] == [n - 4]
    res = cli("save", "-m", models[kind], "--prompt", PROMPT, "-o", tmp_path / "b.bin", *CTX,
              "--no-server-checkpoints", "--json")
    assert res.exit_code == 0 and open_slot_file(tmp_path / "b.bin").checkpoints is None
