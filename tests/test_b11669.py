"""slotctl against llama-server b11669, the first reachable build that writes and reads both appendices (SCKP,
SDFT): every behaviour of the draft state and the checkpoints, with the server's own log lines and answers as the
expected values, and what validate, inspect, strip-draft, convert and save say of the same files for b11669
(slotctl.server.builds: the rules measured here). docs/testing.md, "llama-server b11669"."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import start_server
from llama_server import LlamaServer
from server_log import CKPT_DRAFT_DROPPED, CKPT_RESTORED, restore, steps_of, wait_log
from slotctl.cli.app import app
from slotctl.server.reuse import diverging_reuse, server_n_swa
from slotctl.slotfile import open_slot_file
from slotctl.tinymodels import make_kind_model, make_model, make_models

pytestmark = pytest.mark.server
runner = CliRunner()

PROMPT = ("what is the capital of france? paris is the capital of france. the river of paris is north of the city. "
          "the river of paris is north of the city. what is the capital of france? paris is the capital of france.")
TURNS = (" what is the river of paris?", " the river of paris is north of the city.", " what is paris?")
FLAGS = ("-c", "1024", "-np", "1", "-fa", "on")
DRAFT = ("--spec-type", "draft-simple")
KINDS = ("gemma2", "mamba", "lfm2", "jamba", "lfm2-swa")


# -- the server's own words: tests/server_log.py; validate's -------------------------------------------------


def validate(path: Path, *args, build: str = "b11669") -> dict:
    res = runner.invoke(app, ["validate", str(path), *map(str, args), "--server-build", build, "--no-load", "--json"])
    assert res.exit_code in (0, 1), res.output
    (rep,) = json.loads(res.stdout)["files"]
    assert rep["build"] == build
    return rep


def tokens_of(path: Path) -> list[int]:
    with open_slot_file(path) as sf:
        return [int(t) for t in sf.tokens.tokens]


def sdft_at(data: bytes) -> int:
    at = data.rfind(b"SDFT")
    assert at > 0
    return at


# -- models --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("b11669-models")
    tiny = make_models(d)
    out = {"target": tiny.target, "draft": tiny.draft,
           "other-draft": make_model(d / "other-draft.gguf", n_layer=2, seed=5, name="slotctl-tiny-other-draft")}
    for kind in KINDS:
        out[kind] = make_kind_model(kind, d / f"{kind}.gguf")
    return out


@pytest.fixture(scope="module")
def slots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("b11669-slots")


def serve(binary, model: Path, tmp: Path, name: str, *args, draft: Path | None = None, slot_dir: Path) -> LlamaServer:
    return start_server(binary, model, tmp, name, draft=draft, args=args, slot_save_path=slot_dir)


@pytest.fixture(scope="module")
def draft_file(llama_server_b11669, models, slots, tmp_path_factory) -> Path:
    """A slot file b11669 saved with a drafter: the payload, then SDFT (a plain model: no checkpoints)."""
    srv = serve(llama_server_b11669, models["target"], tmp_path_factory.mktemp("log"), "save-draft", *FLAGS, *DRAFT,
                draft=models["draft"], slot_dir=slots)
    try:
        srv.completion(PROMPT, slot=0, n_predict=8)
        srv.save(0, "draft.bin")
        said = wait_log(srv, r"appended the draft state \([0-9.]+ MiB\) to")
        assert not [line for line in said if "context checkpoint" in line]     # a plain KV cache needs none
    finally:
        srv.stop()
    return slots / "draft.bin"


# -- the draft state: restored, dropped, ignored ---------------------------------------------------------------


def _damaged_drafts(data: bytes) -> dict[str, bytes]:
    at = sdft_at(data)
    (n_dft,) = struct.unpack_from("<Q", data, at + 8)
    spec_len_at = at + 16 + n_dft
    return {
        "sdft-version-2": data[:at + 4] + struct.pack("<I", 2) + data[at + 8:],
        "sdft-magic": data[:at] + b"SDFX" + data[at + 4:],
        "sdft-length-beyond": data[:at + 8] + struct.pack("<Q", 1 << 40) + data[at + 16:],
        "sdft-cut-in-draft-blob": data[:at + 16 + n_dft // 2],
        "sdft-cut-in-spec-length": data[:spec_len_at + 3],
    }


#: (server: draft model, flags) -> what b11669 does with the draft state of ``draft_file``
DRAFT_CASES = {
    "same-draft": ("draft", DRAFT, "restored"),
    "other-draft-model": ("other-draft", DRAFT, "dropped"),
    "ctkd-q8_0": ("draft", (*DRAFT, "-ctkd", "q8_0", "-ctvd", "q8_0"), "dropped"),
    "md-without-drafter": ("draft", (), "dropped"),
    "spec-type-none": ("draft", ("--spec-type", "none"), "dropped"),
    "no-md": (None, (), "dropped"),
}


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_the_draft_state_restored_or_dropped_as_validate_says(llama_server_b11669, models, draft_file, tmp_path,
                                                              case):
    """The draft state of a file b11669 saved, restored by b11669 under each drafter set-up: the server's log
    line says restored or dropped ("does not match the draft context - dropped": another draft model, other
    -ctkd/-ctvd, -md without a drafter, no -md), and validate --server-build b11669 says the same."""
    draft, flags, want = DRAFT_CASES[case]
    dm = models[draft] if draft else None
    srv = serve(llama_server_b11669, models["target"], tmp_path, case, *FLAGS, *flags, draft=dm,
                slot_dir=draft_file.parent)
    try:
        got = restore(srv, draft_file.name)
    finally:
        srv.stop()
    assert got.status == 200 and got.answer["n_restored"] == len(tokens_of(draft_file)), got
    assert got.steps == {"checkpoints": "absent", "draft": want}, got.lines
    args = ["-m", models["target"], *FLAGS, *flags] + (["-md", dm] if dm else [])
    rep = validate(draft_file, *args)
    assert steps_of(rep) == got.steps, rep["findings"]
    assert rep["verdict"] == ("restores" if want == "restored" else "restores_with_drops") and rep["certain"]


def test_a_damaged_draft_state_is_ignored_as_validate_says(llama_server_b11669, models, draft_file, tmp_path):
    """Damage in the SDFT appendix (version, lengths, a cut in the draft blob or in the speculative state's
    length): "invalid draft state ... - ignored"; a damaged magic is no appendix at all (no line: the loader
    returns at once). validate names each so, for b11669, and the target restores."""
    files = {}
    for name, data in _damaged_drafts(draft_file.read_bytes()).items():
        files[name] = draft_file.parent / f"{name}.bin"
        files[name].write_bytes(data)
    srv = serve(llama_server_b11669, models["target"], tmp_path, "damaged", *FLAGS, *DRAFT, draft=models["draft"],
                slot_dir=draft_file.parent)
    try:
        got = {name: restore(srv, p.name) for name, p in files.items()}
    finally:
        srv.stop()
    want = {name: "absent" if name == "sdft-magic" else "ignored" for name in files}
    assert {n: g.steps["draft"] for n, g in got.items()} == want, {n: g.lines for n, g in got.items()}
    assert all(g.status == 200 for g in got.values())
    for name, p in files.items():
        rep = validate(p, "-m", models["target"], "-md", models["draft"], *FLAGS, *DRAFT)
        assert steps_of(rep)["draft"] == want[name], (name, rep["findings"])
        assert rep["certain"], name


def test_ngram_drafters_keep_no_speculative_state(llama_server_b11669, models, tmp_path):
    """b11669's n-gram drafters (the drafters a tiny model can run without a second model) have no draft
    context and no speculative state: a save appends no SDFT. (EAGLE-3 and MTP drafters need models of their
    own kind; slotctl.server.speculative reads their state by its sizes.)"""
    for spec in ("ngram-simple", "ngram-mod", "ngram-map-k", "ngram-cache"):
        srv = serve(llama_server_b11669, models["target"], tmp_path, spec, *FLAGS, "--spec-type", spec,
                    slot_dir=tmp_path)
        try:
            srv.completion(PROMPT, slot=0, n_predict=16)
            srv.completion(PROMPT + TURNS[0], slot=0, n_predict=16)
            srv.save(0, f"{spec}.bin")
        finally:
            srv.stop()
        data = (tmp_path / f"{spec}.bin").read_bytes()
        assert b"SDFT" not in data and "draft state" not in srv.log_text(), spec
        rep = validate(tmp_path / f"{spec}.bin", "-m", models["target"], *FLAGS, "--spec-type", spec)
        assert steps_of(rep) == {"checkpoints": "absent", "draft": "absent"}


# -- checkpoints of every memory kind ------------------------------------------------------------------------


CKPT_FLAGS = ("-c", "1024", "-np", "1", "-fa", "on", "-ub", "32", "-b", "32", "--ctx-checkpoints", "6",
              "--checkpoint-min-step", "8")


@pytest.fixture(scope="module")
def kind_files(llama_server_b11669, models, slots, tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """For each memory kind: a file b11669 saved after a prompt and three turns extending it (checkpoints taken
    by the server itself), and how many checkpoints it said it appended."""
    tmp = tmp_path_factory.mktemp("kinds-log")
    out = {}
    for kind in KINDS:
        srv = serve(llama_server_b11669, models[kind], tmp, f"save-{kind}", *CKPT_FLAGS, slot_dir=slots)
        try:
            text = PROMPT
            srv.completion(text, slot=0, n_predict=4)
            for turn in TURNS:
                text += turn
                srv.completion(text, slot=0, n_predict=4)
            srv.save(0, f"kind-{kind}.bin")
            (line,) = wait_log(srv, r"appended \d+ context checkpoint\(s\)")[-1:]
            m = re.findall(r"appended (\d+) context checkpoint\(s\)", line)
        finally:
            srv.stop()
        assert m, f"{kind}: b11669 appended no checkpoint"
        out[kind] = (slots / f"kind-{kind}.bin", int(m[-1]))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoints_written_by_b11669_restore_as_validate_says(llama_server_b11669, models, kind_files, tmp_path,
                                                                kind):
    """Checkpoints b11669 took for an iSWA, a recurrent and the hybrid memories: inspect reads every one;
    restored by b11669 with its --ctx-checkpoints and with fewer (the newest kept: "restored N context
    checkpoint(s)"), as validate predicts for b11669."""
    path, n_written = kind_files[kind]
    res = runner.invoke(app, ["inspect", str(path), "-m", str(models[kind]), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)["files"][0]
    assert len(doc["checkpoints"]) == n_written and doc["build"] == "b11669"
    assert all(c["target"]["memory"] is not None and c["target"]["error"] is None for c in doc["checkpoints"])
    assert not [f for f in doc["findings"] if f["severity"] != "note"], doc["findings"]
    for keep in (6, 2):
        flags = [f for f in CKPT_FLAGS]
        flags[flags.index("--ctx-checkpoints") + 1] = str(keep)
        srv = serve(llama_server_b11669, models[kind], tmp_path, f"{kind}-{keep}", *flags, slot_dir=path.parent)
        try:
            got = restore(srv, path.name)
        finally:
            srv.stop()
        assert got.status == 200 and got.steps == {"checkpoints": f"restored {min(keep, n_written)}",
                                                   "draft": "absent"}, got.lines
        rep = validate(path, "-m", models[kind], *flags)
        trimmed = keep < n_written    # the oldest dropped: too_many_checkpoints
        assert steps_of(rep) == got.steps and rep["certain"], rep["findings"]
        assert rep["verdict"] == ("restores_with_drops" if trimmed else "restores"), rep["findings"]


def _reuse_cases(n: int) -> dict[str, int | None]:
    """Requests after a restore, by the number of the saved prompt's tokens they share: the whole prompt and
    more (None), and divergences late, in the middle and early."""
    return {"extends": None, "diverges-late": n - 3, "diverges-middle": n // 2, "diverges-early": 5}


@pytest.mark.parametrize("kind", ("llama",) + KINDS)
def test_predicted_reuse_is_the_servers_cache_n(llama_server_b11669, models, kind_files, slots, tmp_path, kind):
    """A restored slot's ``timings.cache_n`` for a request extending the saved prompt and for requests that
    diverge from it, against validate's prediction for b11669 (``reuse.n_reused``) and
    slotctl.server.reuse.diverging_reuse, for every memory kind: b11669 keeps every token of an iSWA slot
    for the extending request (b11434 keeps none), and goes back to the newest checkpoint early enough for a
    divergence."""
    if kind == "llama":
        model, flags = models["target"], CKPT_FLAGS
        srv = serve(llama_server_b11669, model, tmp_path, "save-llama", *flags, slot_dir=slots)
        try:
            srv.completion(PROMPT + TURNS[0], slot=0, n_predict=4)
            srv.save(0, "kind-llama.bin")
        finally:
            srv.stop()
        path = slots / "kind-llama.bin"
    else:
        model, flags = models[kind], CKPT_FLAGS
        path = kind_files[kind][0]
    tokens = tokens_of(path)
    rep = validate(path, "-m", model, *flags)
    from slotctl.model.info import read_model_info

    n_swa = server_n_swa(read_model_info(model))
    srv = serve(llama_server_b11669, model, tmp_path, f"reuse-{kind}", *flags, slot_dir=path.parent)
    seen = {}
    try:
        with open_slot_file(path) as sf:
            for case, common in _reuse_cases(len(tokens)).items():
                got = restore(srv, path.name, lines=False)
                assert got.status == 200, got
                request = tokens + [5, 6, 7] if common is None else tokens[:common] + [7, 8, 9]
                t = srv.completion(request, slot=0, n_predict=1)["timings"]
                assert t["cache_n"] + t["prompt_n"] == len(request), t
                want = rep["reuse"]["n_reused"] if common is None else \
                    diverging_reuse(sf, common, n_swa=n_swa, n_ctx_checkpoints=6)
                seen[case] = (t["cache_n"], want)
    finally:
        srv.stop()
    assert all(got == want for got, want in seen.values()), seen
    if kind == "gemma2":     # the rule that differs from b11434's, measured
        assert seen["extends"][0] == len(tokens)
        assert validate(path, "-m", model, *flags, build="b11434")["reuse"]["n_reused"] == 0


# -- the draft blobs of checkpoints ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def iswa_draft_files(llama_server_b11669, models, slots, tmp_path_factory) -> dict[str, Path]:
    """gemma2 with a plain draft (its checkpoints' draft blobs: the blob header alone, PARTIAL_ONLY of a plain
    KV cache) and gemma2 drafting for itself (draft blobs of an SWA cache), saved by b11669."""
    tmp = tmp_path_factory.mktemp("iswa-draft-log")
    out = {}
    for name, draft in (("plain-draft", models["draft"]), ("self-draft", models["gemma2"])):
        srv = serve(llama_server_b11669, models["gemma2"], tmp, name, *CKPT_FLAGS, *DRAFT, draft=draft, slot_dir=slots)
        try:
            srv.completion(PROMPT, slot=0, n_predict=8)
            srv.completion(PROMPT + TURNS[0], slot=0, n_predict=8)
            srv.save(0, f"gemma2-{name}.bin")
        finally:
            srv.stop()
        out[name] = slots / f"gemma2-{name}.bin"
    return out


def test_the_8_byte_draft_blobs_of_b11669_are_read_for_what_they_are(llama_server_b11669, models, iswa_draft_files,
                                                                      tmp_path):
    """Issue 35: b11669's checkpoints of a plain draft carry 8-byte draft blobs (the blob header alone).
    b11669 restores the file with them; validate says it restores (certain), inspect shows them as
    header_only, and strip-draft strips the file (it refused it)."""
    path = iswa_draft_files["plain-draft"]
    with open_slot_file(path) as sf:
        blobs = [c.dft for c in sf.checkpoints]
        assert blobs and all(b.header_only and b.span.size == 8 and b.error is None for b in blobs)
    srv = serve(llama_server_b11669, models["gemma2"], tmp_path, "restore", *CKPT_FLAGS, *DRAFT, draft=models["draft"],
                slot_dir=path.parent)
    try:
        got = restore(srv, path.name)
        assert got.status == 200 and not got.checkpoint_drafts_dropped, got.lines
        assert restore(srv, path.name, lines=False).status == 200
        # a request that goes back to a checkpoint loads its draft blob too: no abort, the answer is given
        tokens = tokens_of(path)
        srv.completion(tokens[:len(tokens) - 2] + [7, 8], slot=0, n_predict=2)
        assert srv.proc.poll() is None
    finally:
        srv.stop()
    rep = validate(path, "-m", models["gemma2"], "-md", models["draft"], *CKPT_FLAGS, *DRAFT)
    assert rep["verdict"] == "restores" and rep["certain"] and steps_of(rep) == got.steps, rep["findings"]
    res = runner.invoke(app, ["inspect", str(path), "--json"])
    assert res.exit_code == 0 and all(c["draft"]["header_only"] for c in json.loads(res.stdout)["files"][0]["checkpoints"])
    for extra, left in (((), 8), (("--checkpoints",), 0)):
        out = tmp_path / f"stripped{len(extra)}.bin"
        res = runner.invoke(app, ["strip-draft", str(path), "-o", str(out), "--grace", "0", *extra, "--json"])
        assert res.exit_code == 0, res.output
        with open_slot_file(out) as sf:
            assert sf.sdft is None and sf.checkpoints and all(c.dft.span.size == left for c in sf.checkpoints)


@pytest.mark.parametrize("case", ["same", "ctkd-q8_0"])
def test_checkpoint_draft_blobs_are_dropped_when_the_draft_context_differs(llama_server_b11669, models,
                                                                           iswa_draft_files, tmp_path, case):
    """gemma2 drafting for itself: its checkpoints' draft blobs are SWA caches. Restored with another draft
    cache type, b11669 drops them ("draft context checkpoint data ... does not match the draft context -
    dropped") and keeps the checkpoints; validate says the same drops."""
    path = iswa_draft_files["self-draft"]
    flags = (*CKPT_FLAGS, *DRAFT) + (("-ctkd", "q8_0", "-ctvd", "q8_0") if case != "same" else ())
    srv = serve(llama_server_b11669, models["gemma2"], tmp_path, case, *flags, draft=models["gemma2"],
                slot_dir=path.parent)
    try:
        got = restore(srv, path.name)
    finally:
        srv.stop()
    assert got.status == 200 and got.checkpoint_drafts_dropped == (case != "same"), got.lines
    rep = validate(path, "-m", models["gemma2"], "-md", models["gemma2"], *flags)
    dropped = [f for f in rep["findings"] if re.fullmatch(r"checkpoint \d+ draft", f["layer"])
               and f["severity"] == "drop"]
    assert bool(dropped) == got.checkpoint_drafts_dropped and steps_of(rep) == got.steps, rep["findings"]
    assert rep["certain"]


# -- files slotctl writes --------------------------------------------------------------------------------------


def test_files_slotctl_writes_restore_in_b11669_as_validate_says(llama_server_b11669, models, iswa_draft_files,
                                                                  tmp_path):
    """save (for b11669: a plain draft's checkpoint blobs are the blob header alone), strip-draft and convert
    (-ctkd q8_0) of a b11669 file: each restored by b11669, its log lines the steps validate predicts, and no
    checkpoint draft blob dropped where validate says none is."""
    saved = tmp_path / "saved.bin"
    res = runner.invoke(app, ["save", "-m", str(models["gemma2"]), "-md", str(models["draft"]), *CKPT_FLAGS, *DRAFT,
                              "-p", PROMPT, "-o", str(saved), "--checkpoint-at", "20"])
    assert res.exit_code == 0, res.output
    stripped = tmp_path / "stripped.bin"
    res = runner.invoke(app, ["strip-draft", str(iswa_draft_files["plain-draft"]), "-o", str(stripped), "--grace", "0"])
    assert res.exit_code == 0, res.output
    converted = tmp_path / "converted-q8.bin"
    res = runner.invoke(app, ["convert", str(iswa_draft_files["plain-draft"]), "-m", str(models["gemma2"]), "-md",
                              str(models["draft"]), "-ctkd", "q8_0", "-ctvd", "q8_0", "-o", str(converted)])
    assert res.exit_code == 0, res.output
    cases = [(saved, ()), (stripped, ()), (converted, ("-ctkd", "q8_0", "-ctvd", "q8_0")), (converted, ())]
    for path, extra in cases:
        flags = (*CKPT_FLAGS, *DRAFT, *extra)
        srv = serve(llama_server_b11669, models["gemma2"], tmp_path, f"{path.stem}{len(extra)}", *flags,
                    draft=models["draft"], slot_dir=path.parent)
        try:
            got = restore(srv, path.name)
        finally:
            srv.stop()
        rep = validate(path, "-m", models["gemma2"], "-md", models["draft"], *flags)
        assert got.status == 200 and steps_of(rep) == got.steps, (path.name, extra, got.lines, rep["findings"])
        assert not got.checkpoint_drafts_dropped
        assert rep["verdict"] == ("restores" if got.steps["draft"] != "dropped" else "restores_with_drops")


# -- -kvu: the other slots' cells -------------------------------------------------------------------------------


def test_a_unified_cache_fit_depends_on_the_other_slots(llama_server_b11669, models, tmp_path):
    """-kvu: the slots share one cache. A file of ~200 tokens restores into an empty one and is refused
    ("failed to find ... available cells") while another slot holds enough cells; validate judges against an
    empty cache and says that the fit depends on the other slots."""
    long_prompt = (PROMPT + " ") * 5
    flags = ("-c", "512", "-np", "2", "-kvu", "-fa", "on")
    srv = serve(llama_server_b11669, models["target"], tmp_path, "kvu", *flags, slot_dir=tmp_path)
    try:
        srv.completion(long_prompt, slot=0, n_predict=1)
        srv.save(0, "long.bin")
        n = srv.save(0, "long.bin")["n_saved"]
        srv.erase(0)
        assert restore(srv, "long.bin", lines=False).status == 200
        srv.erase(0)
        srv.completion(long_prompt + long_prompt[:600], slot=1, n_predict=1)     # the other slot fills the cache
        before = len(srv.log_text().splitlines())
        got = restore(srv, "long.bin", lines=False)
        assert got.status != 200, got
        wait_log(srv, r"failed to find \d+ available cells", before)
    finally:
        srv.stop()
    rep = validate(tmp_path / "long.bin", "-m", models["target"], *flags)
    assert rep["verdict"] == "restores"
    (note,) = [f for f in rep["findings"] if f["code"] == "unified_cache_shared"]
    assert f"{n:,} cells" in note["message"] and "other slots" in note["message"]


# -- what the draft state is worth ------------------------------------------------------------------------------


def test_draft_acceptance_with_and_without_the_draft_state(llama_server_b11669, models, tmp_path):
    """The seed's reason for SDFT, measured: the first continuation after a restore drafts as a slot that was
    never saved when the file holds the draft state, and accepts fewer drafts when it was stripped (the draft
    context starts empty). The target drafts for itself (every draft of a filled draft context is accepted).
    The figures go to docs/strip-draft.md."""
    flags = ("-c", "1024", "-np", "2", "-fa", "on", *DRAFT)
    srv = serve(llama_server_b11669, models["target"], tmp_path, "accept", *flags, draft=models["target"],
                slot_dir=tmp_path)
    figures = {}
    try:
        first = {s: srv.completion(PROMPT, slot=s, n_predict=16)["content"] for s in (0, 1)}
        assert first[0] == first[1]
        srv.save(0, "with-draft.bin")
        res = runner.invoke(app, ["strip-draft", str(tmp_path / "with-draft.bin"), "-o",
                                  str(tmp_path / "stripped.bin"), "--grace", "0"])
        assert res.exit_code == 0, res.output
        follow = PROMPT + first[0] + " the river of paris is"
        t = srv.completion(follow, slot=1, n_predict=32)["timings"]
        figures["never saved"] = (t["draft_n_accepted"], t["draft_n"], t["prompt_n"])
        for name in ("with-draft.bin", "stripped.bin"):
            srv.erase(0)
            got = restore(srv, name, lines=False)
            assert got.status == 200
            t = srv.completion(follow, slot=0, n_predict=32)["timings"]
            figures[name] = (t["draft_n_accepted"], t["draft_n"], t["prompt_n"])
    finally:
        srv.stop()
    print("\ndraft acceptance (accepted, drafted, prompt evaluated) on the first continuation:", figures)
    assert figures["with-draft.bin"] == figures["never saved"], figures
    acc = {k: a / d if d else 0.0 for k, (a, d, _) in figures.items()}
    assert acc["stripped.bin"] < acc["with-draft.bin"], figures


def test_2000_checkpoints_are_read_and_the_newest_kept(llama_server_b11669, models, draft_file, tmp_path):
    """The checkpoint loader has no count cap (PR #26004's description says 1024): 2,000 checkpoints are read,
    the newest --ctx-checkpoints kept ("restored 32 context checkpoint(s)"), and the draft state behind them
    read ("restored the draft state"); the answer's n_read is the whole file. validate says the same."""
    from slotctl.format import appendix as apx

    data = draft_file.read_bytes()
    at = sdft_at(data)
    empty_kv = struct.pack("<IiII", 0xAF143CD8, 0, 1, 0)    # a state blob of one empty KV stream
    cps = [dict(n_tokens=n, pos_min=0, pos_max=n - 1, tgt=empty_kv, dft=b"", spec=b"") for n in range(1, 2001)]
    path = tmp_path / "2000.bin"
    path.write_bytes(data[:at] + apx.build_sckp(cps) + data[at:])
    srv = serve(llama_server_b11669, models["target"], tmp_path, "2000", *FLAGS, *DRAFT, draft=models["draft"],
                slot_dir=tmp_path)
    try:
        got = restore(srv, path.name)
    finally:
        srv.stop()
    assert got.status == 200 and got.answer["n_read"] == path.stat().st_size, got.answer
    assert got.steps == {"checkpoints": "restored 32", "draft": "restored"}, got.lines
    rep = validate(path, "-m", models["target"], "-md", models["draft"], *FLAGS, *DRAFT)
    assert steps_of(rep) == got.steps and rep["certain"], rep["findings"]


def test_live_mode_learns_the_build_from_the_server(llama_server_b11669, llama_server_bin, models, draft_file,
                                                    tmp_path):
    """validate --server judges a file by the build the server says it is (/props build_info): b11669 reads
    the draft state; b11434 ignores it (appendix_needs_new_server, said only there)."""
    from conftest import start_server as start

    local = tmp_path / "slots"
    local.mkdir()
    shutil.copy(draft_file, local / "draft.bin")
    for binary, build in ((llama_server_b11669, "b11669"), (llama_server_bin, "b11434")):
        srv = start(binary, models["target"], tmp_path, build, args=(*FLAGS, *DRAFT), draft=models["draft"],
                    slot_save_path=local)
        try:
            res = runner.invoke(app, ["validate", str(local / "draft.bin"), "--server", srv.url, "-m",
                                      str(models["target"]), "-md", str(models["draft"]), "--no-load", "--json"])
        finally:
            srv.stop()
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        (rep,) = doc["files"]
        assert rep["build"] == doc["server"]["build"] == build
        codes = {f["code"] for f in rep["findings"]}
        assert ("appendix_needs_new_server" in codes) == (build == "b11434")
        assert steps_of(rep)["draft"] == ("restored" if build == "b11669" else "ignored")


def test_migrate_between_two_b11669_servers(llama_server_b11669, models, tmp_path):
    """slotctl migrate from a b11669 (gemma2 with a draft, -np 1) to another (-np 2 -kvu): the file converted
    for the destination, restored there with its checkpoints and draft state ("restored N context
    checkpoint(s)", "restored the draft state"), and proven by the server's own counts (b11669's rule: the saved
    prompt itself keeps all but its last token in an iSWA slot)."""
    import subprocess
    import sys

    a_dir, b_dir, store = tmp_path / "a", tmp_path / "b", tmp_path / "store"
    for d in (a_dir, b_dir, store):
        d.mkdir()
    a = serve(llama_server_b11669, models["gemma2"], tmp_path, "a", *CKPT_FLAGS, *DRAFT, draft=models["draft"],
              slot_dir=a_dir)
    b_flags = [f for f in CKPT_FLAGS]
    b_flags[b_flags.index("-np") + 1] = "2"
    b = serve(llama_server_b11669, models["gemma2"], tmp_path, "b", *b_flags, "-kvu", *DRAFT, draft=models["draft"],
              slot_dir=b_dir)
    try:
        a.completion(PROMPT, slot=0, n_predict=8)
        a.completion(PROMPT + TURNS[0], slot=0, n_predict=8)
        before = len(b.log_text().splitlines())
        res = subprocess.run([sys.executable, "-m", "slotctl", "migrate", "--from", a.url, "--slot", "0", "--to", b.url,
                              "--to-slot", "1", "--from-dir", str(a_dir), "--to-dir", str(b_dir), "--name", "moved.bin",
                              "-kvu", "--store", str(store), "--json"], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        doc = json.loads(res.stdout)
        said = "\n".join(wait_log(b, r"restored the draft state", before))
    finally:
        a.stop()
        b.stop()
    assert all(s["status"] == "ok" for s in doc["steps"]), doc["steps"]
    assert doc["proof"]["verdict"] == "proven", doc["proof"]
    n = doc["proof"]["n_prompt"]
    assert (doc["proof"]["n_reused"], doc["proof"]["n_evaluated"]) == (n - 1, 1)
    assert CKPT_RESTORED.search(said) and not CKPT_DRAFT_DROPPED.search(said), said
