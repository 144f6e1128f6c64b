"""``slotctl save`` and ``slotctl restore`` on real llama.cpp contexts of tiny models (no mocks).

The reference for "a restored slot drafts like a fresh one" is the seed change's own test
(``test_slot_restore_draft_state``): the target model drafts for itself, and a restored slot must give
the same text, the same number of prompt tokens evaluated and the same drafted and accepted counts as
a slot that was never saved.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.format.tokens import pack_tokens
from slotctl.runtime import STATE_VERSION, Context, ContextSettings, Model, generate_greedy
from slotctl.slotfile import open_slot_file
from slotctl.tinymodels import SAMPLE_PROMPT, make_model, make_models

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent

#: small contexts keep the suite fast; one thread spins least on a busy machine
CTX = ["-c", "256", "-t", "1"]
CONTINUE = " And the"
N = 16


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("save-restore-models")
    m = make_models(d)
    # the target's very weights, but a training context of 64 tokens: its slots hold 64 tokens at most
    short = make_model(d / "short-ctx.gguf", n_layer=2, seed=1, context_length=64)
    return {"target": str(m.target), "draft": str(m.draft), "short": str(short)}


@pytest.fixture(scope="session")
def prompt_tokens(models):
    with Model(models["target"], vocab_only=True) as m:
        return m.tokenize(SAMPLE_PROMPT), m.tokenize(SAMPLE_PROMPT + CONTINUE), m.n_vocab


@pytest.fixture(scope="session")
def files(models, tmp_path_factory):
    """Slot files saved once per session: with the target drafting for itself (v4 and v3), without a draft."""
    d = tmp_path_factory.mktemp("save-restore-files")
    t = models["target"]
    out = {}
    for name, extra in {
        "v4": ["-md", t, "--spec-type", "draft-simple", "--checkpoint-at", "40"],
        "v3": ["-md", t, "--spec-type", "draft-simple", "--state-version", "3"],
        "nodraft": [],
    }.items():
        path = d / f"{name}.bin"
        res = cli("save", "-m", t, "--prompt", SAMPLE_PROMPT, "-o", str(path), *CTX, *extra, "--json")
        assert res.exit_code == 0, res.output
        out[name] = path
        out[name + "_json"] = json.loads(res.stdout)
    return out


@pytest.fixture(scope="session")
def never_saved(models, prompt_tokens):
    """The continuation's text by plain greedy decoding in one context: what any restore must produce."""
    prompt, request, _ = prompt_tokens
    with Model(models["target"]) as m, Context(m, ContextSettings(n_ctx=256, n_threads=1)) as ctx:
        ctx.decode(request, 0, 0)
        tokens = generate_greedy(ctx, 0, N, len(request))
        return b"".join(m.token_to_piece(t, special=False) for t in tokens).decode("utf-8", "replace")


def cli(*args, input=None):
    res = runner.invoke(app, [str(a) for a in args], input=input)
    assert "Traceback" not in (res.stderr or ""), res.stderr
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res


def restore(models, path, *extra, code=0):
    res = cli("restore", path, "-m", models["target"], *CTX, *extra, "--json")
    assert res.exit_code == code, (res.stdout, res.stderr)
    return json.loads(res.stdout), res


def steps(report):
    return {s["step"]: s for s in report["steps"]}


# -- save ------------------------------------------------------------------------------------------


def test_save_writes_what_the_server_writes(files, models, prompt_tokens):
    prompt, _, _ = prompt_tokens
    d = files["v4_json"]
    assert (d["state_version"], d["n_tokens"], d["slot"], d["checkpoints"], d["draft_model"]) == \
        (4, 99, 0, [{"n_tokens": 40}], str(models["target"]))
    assert set(d["timings"]) == {"load_ms", "evaluate_ms", "write_ms"}
    assert d["size"] == files["v4"].stat().st_size == 12 + 4 * (3 + 99 + 1) + d["payload_size"] + \
        d["sckp_size"] + d["sdft_size"]
    assert not d["file"]["damaged"] and d["file"]["prompt"]["n_tokens"] == 99

    sf = open_slot_file(files["v4"])
    assert sf.version == 4 and not sf.errors
    assert [int(t) for t in sf.tokens.tokens] == prompt and sf.tokens.format == "packed"
    (sec,) = sf.target.sections
    assert sec.n_stream == 1 and sec.streams[0].cell_count == 99
    (cp,) = sf.checkpoints
    assert (cp.n_tokens, cp.pos_min, cp.pos_max) == (40, 0, 39) and cp.spec.size == 0
    for blob in (cp.tgt, cp.dft):  # PARTIAL_ONLY of a plain KV cache as b11669 writes it: the blob header alone
        assert blob.header_only and blob.span.size == 8 and blob.memory is None and blob.error is None
    assert sf.draft.memory.sections[0].streams[0].cell_count == 99 and sf.draft_spec.size == 0
    # no draft model: no SDFT; no --checkpoint-at: no SCKP
    sf = open_slot_file(files["nodraft"])
    assert sf.sckp is None and sf.sdft is None and sf.size == sf.target.end


def test_a_version_3_file_loads_with_the_runtimes_own_loader(files, models, prompt_tokens):
    prompt, _, _ = prompt_tokens
    with Model(models["target"]) as m, Context(m, ContextSettings(n_ctx=256)) as ctx:
        words, n = ctx.load_seq_file(files["v3"], 0)
        assert n > 0 and words == pack_tokens(prompt).tolist()
        assert (ctx.seq_pos_min(0), ctx.seq_pos_max(0)) == (0, 98)
        # the version-4 file is what current servers read; this runtime's loader refuses it
        assert ctx.load_seq_file(files["v4"], 0) == ([], 0)
        assert any("unknown (magic, version)" in line for line in ctx.last_errors)


def test_save_refuses_to_overwrite_without_force(files, models, tmp_path):
    path = tmp_path / "slot.bin"
    path.write_bytes(b"keep me")
    args = ["save", "-m", models["target"], "--prompt", "Paris", "-o", path, *CTX]
    res = cli(*args)
    assert res.exit_code == 2 and "exists (use --force to overwrite)" in res.stderr
    assert path.read_bytes() == b"keep me"
    res = cli(*args, "--force", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["n_tokens"] == 2
    assert open_slot_file(path).tokens.n_tokens == 2
    assert not list(tmp_path.glob(".*.tmp"))


def test_prompt_from_a_file_or_stdin(models, tmp_path, prompt_tokens):
    prompt, _, _ = prompt_tokens
    src = tmp_path / "prompt.txt"
    src.write_text(SAMPLE_PROMPT, encoding="utf-8")
    for i, (args, stdin) in enumerate([(["--prompt-file", src], None), (["--prompt-file", "-"], SAMPLE_PROMPT)]):
        res = cli("save", "-m", models["target"], *args, "-o", tmp_path / f"{i}.bin", *CTX, "--json", input=stdin)
        assert res.exit_code == 0, res.stderr
        assert [int(t) for t in open_slot_file(tmp_path / f"{i}.bin").tokens.tokens] == prompt
    for args in ([], ["--prompt", "a", "--prompt-file", src]):
        res = cli("save", "-m", models["target"], *args, "-o", tmp_path / "x.bin", *CTX)
        assert res.exit_code == 2 and "exactly one of --prompt" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--state-version", "2"], "--state-version: 2 is not one of 3, 4"),
    (["--checkpoint-at", "99"], "--checkpoint-at 99: a checkpoint is taken inside the prompt"),
    (["--slot", "1"], "--slot 1: the server has slots 0..0"),
    (["-ctk", "q9_9"], "-ctk q9_9: expected one of f32, f16"),
])
def test_save_usage_errors(models, tmp_path, args, message):
    res = cli("save", "-m", models["target"], "--prompt", SAMPLE_PROMPT, "-o", tmp_path / "x.bin", *CTX, *args)
    assert res.exit_code == 2 and message in res.stderr, res.stderr
    assert not (tmp_path / "x.bin").exists()


def test_save_refuses_a_prompt_the_slot_cannot_hold(models, tmp_path):
    res = cli("save", "-m", models["short"], "--prompt", SAMPLE_PROMPT, "-o", tmp_path / "x.bin", *CTX)
    assert res.exit_code == 1
    assert "request (99 tokens) exceeds the available context size (64 tokens)" in res.stderr


# -- restore and continue --------------------------------------------------------------------------


def test_restore_and_continue_equals_never_saved(files, models, prompt_tokens, never_saved):
    """The seed change's test: the target drafts for itself; restored and never saved agree."""
    prompt, request, _ = prompt_tokens
    t = models["target"]
    d, res = restore(models, files["v4"], "-md", t, "--spec-type", "draft-simple", "--continue", CONTINUE, "-n", N, "--compare")
    assert res.stderr == ""
    assert d["ok"] and "error" not in d and d["draft_status"] == "restored" and d["exit_code"] == 0
    s = steps(d)
    assert [x["status"] for x in d["steps"]] == ["restored"] * 4
    assert s["target"]["converted_from"] == 4 and s["tokens"]["n_tokens"] == 99
    assert s["checkpoints"]["kept"] == 1 and s["draft"]["positions"] == [0, 98]
    assert d["bytes_read"] == d["size"] == files["v4"].stat().st_size == sum(x["bytes"] for x in d["steps"])

    c = d["continuation"]
    # the whole new prompt is tokenized as the server does; only the new tokens are evaluated
    assert c["n_prompt"] == len(request) and c["n_reused"] == len(prompt) == 99
    assert c["n_evaluated"] == len(request) - len(prompt) == 2
    assert c["n_draft_reused"] == 99
    assert c["text"] == never_saved and c["n_generated"] == N and c["stop"] == "limit"
    assert c["speculative"] and c["n_accepted"] > 0 and c["n_drafted"] >= c["n_accepted"]

    cmp = d["compare"]
    assert cmp["agree"] and cmp["difference"] is None
    assert [x["check"] for x in cmp["checks"]] == ["text", "n_evaluated", "n_drafted", "n_accepted"]
    f = cmp["fresh"]
    assert (f["text"], f["n_evaluated"], f["n_drafted"], f["n_accepted"]) == \
        (c["text"], c["n_evaluated"], c["n_drafted"], c["n_accepted"])


@pytest.mark.parametrize("kind", ["v4", "v3", "runtime-packed", "runtime-legacy"])
def test_every_state_version_and_the_runtimes_own_files_restore(kind, files, models, prompt_tokens, never_saved,
                                                                 tmp_path):
    prompt, _, _ = prompt_tokens
    path = files.get(kind)
    if path is None:
        # written by llama_state_seq_save_file itself: the server's packed record, or a plain token list
        path = tmp_path / f"{kind}.bin"
        with Model(models["target"]) as m, Context(m, ContextSettings(n_ctx=256)) as ctx:
            ctx.decode(prompt, 0, 0)
            words = pack_tokens(prompt).tolist() if kind == "runtime-packed" else prompt
            ctx.save_seq_file(path, 0, words)
    d, _ = restore(models, path, "--continue", CONTINUE, "-n", N)
    s = steps(d)
    assert d["state_version"] == (4 if kind == "v4" else STATE_VERSION)
    assert s["target"]["converted_from"] == (4 if kind == "v4" else None)
    assert s["tokens"]["format"] == ("legacy" if kind == "runtime-legacy" else "packed")
    assert d["n_tokens"] == 99
    # the file holds a draft state but there is no draft model: the server drops it
    if kind.startswith("v"):
        assert s["draft"]["status"] == "dropped" and "no draft model" in s["draft"]["reason"]
    else:
        assert s["draft"]["status"] == "absent"
    c = d["continuation"]
    assert (c["text"], c["n_evaluated"], c["speculative"]) == (never_saved, 2, False)


def test_a_draft_model_with_another_layer_count_drops_the_draft_state(files, models, never_saved):
    res = cli("restore", files["v4"], "-m", models["target"], "-md", models["draft"], "--spec-type", "draft-simple", *CTX, "--continue", CONTINUE,
              "-n", N, "--compare", "--json")
    d = json.loads(res.stdout)
    draft = steps(d)["draft"]
    assert draft["status"] == "dropped"
    assert draft["reason"].startswith("draft state does not match the draft context - dropped")
    assert "mismatched layer count (2 instead of 1)" in draft["reason"]
    assert d["draft_status"] == "dropped" and d["ok"]
    assert d["continuation"]["n_draft_reused"] == 0
    text = d["compare"]["checks"][0]
    assert text["check"] == "text" and text["equal"] and d["continuation"]["text"] == never_saved
    assert res.exit_code == (0 if d["compare"]["agree"] else 1)


def test_another_draft_cache_type_drops_the_draft_state_and_drafts_worse(files, models, never_saved):
    d, res = restore(models, files["v4"], "-md", models["target"], "--spec-type", "draft-simple", "-ctkd", "q8_0", "--continue", CONTINUE,
                     "-n", N, "--compare", code=0)
    draft = steps(d)["draft"]
    assert draft["status"] == "dropped" and "mismatched key type (8 != 1, layer 0)" in draft["reason"]
    c, f = d["continuation"], d["compare"]["fresh"]
    assert c["text"] == f["text"] == never_saved
    assert c["n_evaluated"] == f["n_evaluated"] == 2
    # the draft context holds only what was evaluated since the restore: it drafts worse than a fresh one
    assert c["n_draft_reused"] == 0 and f["n_draft_reused"] == 99
    assert c["n_accepted"] < f["n_accepted"]
    diff = d["compare"]["difference"]
    assert re.match(r"draft accepted \d+ of \d+ after restore, \d+ of \d+ fresh: draft state does not match", diff)
    assert d["compare"]["explained"] and "error" not in res.stderr   # the server's documented behaviour


def test_a_file_without_draft_state_drafts_from_an_empty_draft(files, models, never_saved):
    d, res = restore(models, files["nodraft"], "-md", models["target"], "--spec-type", "draft-simple", "--continue", CONTINUE, "-n", N,
                     "--compare", code=0)
    assert steps(d)["draft"]["status"] == "absent" and d["draft_status"] == "absent"
    assert d["compare"]["difference"].endswith("fresh: the file holds no draft state")
    assert d["compare"]["explained"] and "llama-server does the same" in d["compare"]["note"]
    assert d["continuation"]["text"] == never_saved


def test_restore_without_continuation_reports_the_steps_only(files, models):
    d, res = restore(models, files["v4"], "-md", models["target"], "--spec-type", "draft-simple")
    assert d["continuation"] is None and d["compare"] is None and res.stderr == ""
    assert set(d["timings"]) == {"load_ms", "restore_ms"}


def test_a_slot_too_small_for_the_prompt_is_refused(files, models):
    """The payload loads (256 cells), but a slot of this model holds 64 tokens: the server's error."""
    res = cli("restore", files["v4"], "-m", models["short"], *CTX, "--continue", CONTINUE, "--json")
    assert res.exit_code == 1
    d = json.loads(res.stdout)
    assert not d["ok"] and d["continuation"] is None
    assert d["error"]["message"] == ("Unable to restore slot: Restored prompt does not fit in the slot context "
                          "(99 tokens, the slot holds 64)")
    assert [(x["step"], x["status"]) for x in d["steps"]] == [("target", "restored"), ("tokens", "refused")]
    assert "error: Unable to restore slot: Restored prompt does not fit in the slot context" in res.stderr


def test_a_context_too_small_for_the_payload_is_refused(models, tmp_path):
    path = tmp_path / "long.bin"
    long_prompt = " ".join([SAMPLE_PROMPT] * 3)
    res = cli("save", "-m", models["target"], "--prompt", long_prompt, "-o", path, "-c", "512", "-t", "1")
    assert res.exit_code == 0, res.stderr
    d, _ = restore(models, path, code=1)
    assert d["error"]["message"].startswith("Unable to restore slot: No available space in KV cache or invalid slot save file")
    assert "not enough cells in kv cache" in steps(d)["target"]["reason"]


def test_save_from_slot_2_of_4_restores_into_slot_0(models, tmp_path, never_saved):
    path = tmp_path / "np4.bin"
    np4 = ["-np", "4", "-c", "1024", "-t", "1"]
    res = cli("save", "-m", models["target"], "--prompt", SAMPLE_PROMPT, "-o", path, *np4, "--slot", "2",
              "-md", models["target"], "--spec-type", "draft-simple", "--json")
    assert res.exit_code == 0, res.stderr
    sec = open_slot_file(path).target.sections[0]
    assert [s.cell_count for s in sec.streams] == [0, 0, 99, 0]
    res = cli("restore", path, "-m", models["target"], "-md", models["target"], "--spec-type", "draft-simple", *np4, "--slot", "0",
              "--continue", CONTINUE, "-n", N, "--compare", "--json")
    assert res.exit_code == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["slot"] == 0 and d["draft_status"] == "restored" and d["compare"]["agree"]
    assert d["continuation"]["text"] == never_saved
    # one slot: the file's four streams do not fit
    d, _ = restore(models, path, code=1)
    assert "n_stream mismatch" in steps(d)["target"]["reason"]


def _patched(src: Path, dst: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(src.read_bytes())
    raw[offset:offset + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


def test_invalid_tokens_are_refused(files, models, tmp_path, prompt_tokens):
    _, _, n_vocab = prompt_tokens
    # the packed record: -1, version, n_tokens, then the tokens from byte 24
    path = _patched(files["nodraft"], tmp_path / "bad.bin", 24 + 4 * 5, struct.pack("<i", n_vocab + 5))
    d, _ = restore(models, path, code=1)
    assert d["error"]["message"] == (f"Unable to restore slot: Invalid tokens in slot save file (token {n_vocab + 5} at "
                          f"index 5 is outside the vocabulary (0..{n_vocab - 1}))")


def test_damaged_appendices_are_ignored_not_fatal(files, models, tmp_path):
    sf = open_slot_file(files["v4"])
    # a truncated draft state: "invalid draft state ... ignored"
    cut = tmp_path / "cut.bin"
    cut.write_bytes(files["v4"].read_bytes()[:sf.sdft.offset + 20])
    d, _ = restore(models, cut, "-md", models["target"], "--spec-type", "draft-simple")
    s = steps(d)
    assert s["checkpoints"]["status"] == "restored"
    assert s["draft"]["status"] == "ignored" and "invalid draft state (truncated) - ignored" in s["draft"]["reason"]
    # a checkpoint appendix of an unknown version is ignored; the draft loader then finds no SDFT there
    path = _patched(files["v4"], tmp_path / "sckp.bin", sf.sckp.offset + 4, struct.pack("<I", 7))
    d, _ = restore(models, path, "-md", models["target"], "--spec-type", "draft-simple")
    s = steps(d)
    assert (s["checkpoints"]["status"], s["checkpoints"]["bytes"]) == ("ignored", 0)
    assert "version 7" in s["checkpoints"]["reason"]
    assert s["draft"]["status"] == "absent"
    # a draft appendix of an unknown version
    path = _patched(files["v4"], tmp_path / "sdft.bin", sf.sdft.offset + 4, struct.pack("<I", 2))
    d, _ = restore(models, path, "-md", models["target"], "--spec-type", "draft-simple")
    assert steps(d)["draft"]["status"] == "ignored" and "version 2" in steps(d)["draft"]["reason"]


def test_at_most_ctx_checkpoints_are_kept(models, tmp_path):
    path = tmp_path / "cps.bin"
    res = cli("save", "-m", models["target"], "--prompt", SAMPLE_PROMPT, "-o", path, *CTX,
              "--checkpoint-at", "30", "--checkpoint-at", "10", "--checkpoint-at", "20")
    assert res.exit_code == 0, res.stderr
    d, _ = restore(models, path, "--ctx-checkpoints", "2")
    cps = steps(d)["checkpoints"]
    assert (cps["count"], cps["kept"]) == (3, 2)
    assert cps["checkpoints"] == [{"n_tokens": 20, "pos_min": 0, "pos_max": 19},
                                  {"n_tokens": 30, "pos_min": 0, "pos_max": 29}]
    assert "kept the last 2 of 3" in cps["reason"]


def test_spec_draft_n_max_bounds_each_draft(files, models):
    d, _ = restore(models, files["v4"], "-md", models["target"], "--spec-type", "draft-simple", "--continue", CONTINUE, "-n", N,
                   "--spec-draft-n-max", "1")
    c = d["continuation"]
    assert c["n_draft_max"] == 1 and 0 < c["n_drafted"] <= c["n_verify_steps"]


def test_human_output(files, models):
    res = cli("restore", files["nodraft"], "-m", models["target"], "-md", models["target"], "--spec-type", "draft-simple", *CTX, "--continue",
              CONTINUE, "-n", "4", "--compare")
    assert res.exit_code == 0    # the difference is the server's documented behaviour: said, not an error
    for word in ("target", "tokens", "checkpoints", "draft", "absent", "continuation", "compare", "expected"):
        assert word in res.stdout
    assert "error" not in res.stderr
    res = cli("save", "-m", models["target"], "--prompt", "Paris", "-o", files["v4"].parent / "human.bin", *CTX)
    assert res.exit_code == 0 and "byte map" in res.stdout and "evaluate" in res.stdout


def test_llama_cpp_logs_only_with_verbose(files, models):
    _, res = restore(models, files["nodraft"])
    assert res.stderr == ""
    res = cli("restore", files["nodraft"], "-m", models["target"], *CTX, "--verbose", "--json")
    assert res.exit_code == 0 and "llama_context" in res.stderr


# -- the documented JSON ---------------------------------------------------------------------------


def _documented_keys(section: str) -> set[str]:
    doc = (ROOT / "docs" / "save-restore.md").read_text()
    part = doc.split(f"<!-- keys:{section} -->")[1].split("<!-- /keys -->")[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", part, re.M))


def test_json_keys_are_stable_and_documented(files, models):
    d, _ = restore(models, files["v4"], "-md", models["target"], "--spec-type", "draft-simple", "--continue", CONTINUE, "-n", "4", "--compare")
    assert set(d) | {"error"} == _documented_keys("restore")   # error: only when the restore failed
    step_keys = set().union(*(set(s) for s in d["steps"]))
    assert step_keys == _documented_keys("step")
    assert set(d["continuation"]) == _documented_keys("continuation")
    assert set(d["compare"]) == _documented_keys("compare")
    assert set(d["timings"]) == _documented_keys("restore-timings")
    save = files["v4_json"]
    assert set(save) == _documented_keys("save")
    assert set(save["timings"]) == _documented_keys("save-timings")


# -- a model whose memory cannot be rolled back past its window (SWA): the checkpoints matter ------


GEMMA2 = Path(__file__).parent / "data" / "kinds" / "gemma2.gguf"
SWA_PROMPT = ("what is the capital of france? paris is the capital of france. "
              "the river of paris is north of the city")


def test_a_restored_swa_slot_goes_back_to_its_last_checkpoint(tmp_path):
    """gemma2 (window 16): a slot file holds only the window of the SWA cache, so the server must go back
    to a checkpoint to reuse the prompt (or evaluate it all again); a slot that was never saved still
    holds every cell. --compare reports the difference, as the server would show it."""
    g = str(GEMMA2)
    args = ["-m", g, "-md", g, "--spec-type", "draft-simple", *CTX]
    with_cps, without = tmp_path / "cps.bin", tmp_path / "none.bin"
    for path, extra in ((with_cps, ["--checkpoint-at", "20", "--checkpoint-at", "40"]), (without, [])):
        res = cli("save", *args, "--prompt", SWA_PROMPT, "-o", path, "--no-server-checkpoints", *extra)
        assert res.exit_code == 0, res.stderr
    res = cli("restore", with_cps, *args, "--continue", " and the", "-n", "8", "--compare", "--json")
    d = json.loads(res.stdout)
    n = d["n_tokens"]
    c, f = d["continuation"], d["compare"]["fresh"]
    assert (c["checkpoint"], c["n_reused"]) == (40, 39)
    assert (f["checkpoint"], f["n_reused"]) == (None, n)
    assert c["text"] == f["text"]
    assert res.exit_code == 0 and d["compare"]["difference"] == \
        f"prompt tokens evaluated: {c['n_evaluated']} after restore, {f['n_evaluated']} fresh"
    assert d["compare"]["explained"] and "goes back to the checkpoint at 40 tokens" in d["compare"]["note"]
    # no checkpoint early enough: the whole prompt is evaluated again
    d, _ = restore({"target": g}, without, "-md", g, "--spec-type", "draft-simple", "--continue", " and the", "-n", "2")
    c = d["continuation"]
    assert (c["checkpoint"], c["n_reused"], c["n_evaluated"]) == (None, 0, c["n_prompt"])


# -- the library -----------------------------------------------------------------------------------


def test_a_refused_restore_empties_the_slot_in_both_contexts(files, models, tmp_path, prompt_tokens):
    from slotctl.runtime.restore import RestoreRefused, restore_slot
    from slotctl.runtime.slot import ServerContexts, evaluate_prompt

    prompt, _, n_vocab = prompt_tokens
    bad = _patched(files["v4"], tmp_path / "bad.bin", 24, struct.pack("<i", -7))
    with ServerContexts.open(models["target"], ContextSettings(n_ctx=256, n_threads=1),
                             draft_path=models["target"]) as sc:
        evaluate_prompt(sc, prompt[:10], 0)
        with pytest.raises(RestoreRefused) as e:
            restore_slot(sc, bad, 0)
        assert e.value.message == "Invalid tokens in slot save file"
        assert [s.name for s in e.value.steps] == ["target", "tokens"]
        assert sc.target.seq_pos_max(0) == sc.draft.seq_pos_max(0) == -1
        # a good file restores into the same contexts afterwards
        r = restore_slot(sc, files["v4"], 0)
        assert r.tokens == prompt and r.draft_status == "restored" and len(r.checkpoints) == 1
        assert sc.draft.seq_pos_max(0) == 98


def test_progress_bars_on_a_terminal(files, models, tmp_path, monkeypatch):
    """Progress bars are drawn only on a terminal; pretend stderr is one, so that they are."""
    from slotctl.cli.output import Output

    monkeypatch.setattr(Output, "interactive", property(lambda self: True))
    res = cli("restore", files["v4"], "-m", models["target"], "-md", models["target"], "--spec-type", "draft-simple", *CTX, "--continue",
              CONTINUE, "-n", "4", "--compare", "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["compare"]["agree"]
    res = cli("save", "-m", models["target"], "--prompt", "Paris", "-o", tmp_path / "p.bin", *CTX, "--json")
    assert res.exit_code == 0, res.stderr


# -- files a real llama-server (b11434) saved: tests/data, see its README ---------------------------


DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("name, flags", [
    ("srv-np2-slot1.bin", ["-c", "512", "-np", "2", "--slot", "1"]),
    ("srv-kvq8.bin", ["-c", "256", "-ctk", "q8_0", "-ctv", "q8_0"]),  # version-4 rotation 64, checked
    ("srv-draft.bin", ["-c", "256", "-md", DATA / "draft.gguf", "--spec-type", "draft-simple", "-ctkd", "q8_0"]),
])
def test_files_a_real_server_saved_restore_and_continue(name, flags):
    res = cli("restore", DATA / name, "-m", DATA / "target.gguf", "-fa", "on", "-t", "1", *flags,
              "--continue", " and", "-n", "4", "--json")
    assert res.exit_code == 0, res.stderr
    d = json.loads(res.stdout)
    s = steps(d)
    assert s["target"]["converted_from"] == 4 and d["n_tokens"] == 111
    # b11434 writes neither checkpoints nor a draft state
    assert s["checkpoints"]["status"] == s["draft"]["status"] == "absent"
    c = d["continuation"]
    # the model generated the byte token <0x2E> for ".", which its text tokenizes back to as the
    # character token: the server's common prefix, and so the reuse, ends with the prompt's 104 tokens
    assert (c["n_reused"], c["n_generated"]) == (104, 4)
    assert c["speculative"] == (name == "srv-draft.bin")
