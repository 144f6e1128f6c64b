"""``slotctl strip-draft``: the draft state goes, every other byte stays, and no moment leaves a broken file.

Test files are real server files (tests/data) with real state blobs appended as the seed change's server
appends them. The expected results are built independently of the code under test: the stripped file is
the original up to the SDFT appendix, or, with --checkpoints, the same checkpoints rebuilt by
``build_sckp`` with empty draft and speculative blobs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slotctl.atomic import COPY_CHUNK
from slotctl.cli.app import app
from slotctl.format.appendix import SCKP_MAGIC, SDFT_MAGIC, build_sckp, build_sdft
from slotctl.format.blob import blob_header
from slotctl.slotfile import open_slot_file
from slotctl.inputs import expand_slot_paths
from slotctl.strip import SourceChanged, plan_strip, strip_files, write_plan

from appendices import DRAFT_SRC, SPEC_STATE, TARGET_SRC, Built, build_file, state_blob
from conftest import DATA

runner = CliRunner()


def strip(*args: str | Path):
    """strip-draft ARGS; the files the tests build are fresh, so without a --grace of the test's own: 0."""
    grace = [] if "--grace" in map(str, args) else ["--grace", "0"]
    return runner.invoke(app, ["strip-draft", *map(str, args), *grace])


def strip_json(*args: str | Path) -> tuple[int, dict]:
    res = strip(*args, "--json")
    assert "Traceback" not in res.output and "Traceback" not in res.stderr
    return res.exit_code, json.loads(res.stdout)


def identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def temp_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(".*.slotctl-*.tmp"))


# -- what is removed and what stays ------------------------------------------------------------------


@pytest.mark.parametrize("base", ["srv-np1.bin", "srv-draft.bin", "srv-kvq8.bin", "srv-fa-off.bin",
                                  "srv-np2-slot1.bin", "srv-unified-np2.bin"])
def test_strips_the_sdft_appendix_and_keeps_every_other_byte(tmp_path, base):
    b = build_file(tmp_path / "slot.bin", base=DATA / base)
    before = open_slot_file(b.path)
    assert before.sdft is not None and not before.errors
    inode = os.stat(b.path).st_ino

    code, d = strip_json(b.path)
    assert code == 0
    assert b.path.read_bytes() == b.stripped
    after = open_slot_file(b.path)
    assert after.sdft is None and after.draft is None and not after.errors
    # header, tokens and payload are the original prefix; the checkpoints are untouched
    assert after.target.offset == before.target.offset and after.target.end == before.target.end
    assert b.stripped[:after.target.end] == b.original[:before.target.end]
    assert (after.sckp.offset, after.sckp.end) == (before.sckp.offset, before.sckp.end)
    assert [c.dft.span.size for c in after.checkpoints] == [len(c["dft"]) for c in b.checkpoints]
    assert not temp_files(tmp_path)

    [f] = d["files"]
    assert f == {"path": str(b.path), "status": "stripped", "size": len(b.original),
                 "size_after": len(b.stripped), "bytes_freed": len(b.original) - len(b.stripped),
                 "removed": ["SDFT"], "output": str(b.path), "method": "truncate",
                 "draft_size": len(b.original) - len(b.stripped) + sum(len(c["dft"]) + len(c["spec"])
                                                                       for c in b.checkpoints),
                 "checkpoint_draft_size": sum(len(c["dft"]) + len(c["spec"]) for c in b.checkpoints),
                 "repaired": None, "other_links": 0, "exit_code": 0}
    assert f["checkpoint_draft_size"] > 0
    # the SDFT appendix ended the file: it was cut off in place, the same inode
    assert os.stat(b.path).st_ino == inode
    s = d["summary"]
    assert s["bytes_freed"] == f["bytes_freed"] and s["stripped"] == 1 and s["refused"] == 0 and d["exit_code"] == 0


def test_checkpoints_option_empties_draft_and_spec_blobs_keeps_target_blobs(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    code, d = strip_json(b.path, "--checkpoints")
    assert code == 0
    assert b.path.read_bytes() == b.stripped_ckpt
    assert d["files"][0]["removed"] == ["SDFT", "checkpoint draft blobs", "checkpoint speculative state"]
    sf = open_slot_file(b.path)
    assert sf.sdft is None and not sf.errors
    with open(b.path, "rb") as f:
        for c, want in zip(sf.checkpoints, b.checkpoints):
            assert (c.n_tokens, c.pos_min, c.pos_max) == (want["n_tokens"], want["pos_min"], want["pos_max"])
            assert c.tgt.span.read(f) == want["tgt"]
            assert c.dft.span.size == 0 and c.spec.size == 0


def test_checkpoints_option_without_sdft(tmp_path):
    b = build_file(tmp_path / "slot.bin", draft=False)
    code, d = strip_json(b.path, "--checkpoints")
    assert code == 0 and d["files"][0]["removed"] == ["checkpoint draft blobs", "checkpoint speculative state"]
    assert b.path.read_bytes() == b.stripped_ckpt


def test_checkpoint_draft_blobs_are_kept_without_the_option_and_a_note_says_so(tmp_path):
    b = build_file(tmp_path / "slot.bin", draft=False)
    before = identity(b.path)
    res = strip(b.path)
    assert res.exit_code == 0
    assert identity(b.path) == before and b.path.read_bytes() == b.original
    assert "unchanged" in res.stdout
    assert "--checkpoints removes them" in res.stderr


def test_second_run_changes_nothing(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    assert strip(b.path, "--checkpoints").exit_code == 0
    before = identity(b.path)
    for extra in ([], ["--checkpoints"]):
        code, d = strip_json(b.path, *extra)
        assert code == 0
        assert d["files"][0]["status"] == "unchanged" and d["files"][0]["output"] is None
        assert d["summary"]["bytes_freed"] == 0 and d["summary"]["stripped"] == 0
        assert identity(b.path) == before
    assert b.path.read_bytes() == b.stripped_ckpt


def test_a_server_file_without_appendices_is_left_alone(tmp_path):
    p = tmp_path / "plain.bin"
    p.write_bytes(TARGET_SRC.read_bytes())
    before = identity(p)
    code, d = strip_json(p, "--checkpoints")
    assert code == 0 and d["files"][0]["status"] == "unchanged" and d["files"][0]["removed"] == []
    assert identity(p) == before


def test_trailing_bytes_are_kept(tmp_path):
    trailing = b"\0\0\0\0 bytes a server ignores"
    b = build_file(tmp_path / "slot.bin", trailing=trailing)
    assert open_slot_file(b.path).trailing.size == len(trailing)
    assert strip(b.path).exit_code == 0
    assert b.path.read_bytes() == b.stripped


@pytest.mark.parametrize("magic", [SCKP_MAGIC, SDFT_MAGIC])
def test_trailing_bytes_that_would_read_as_an_appendix_are_refused(tmp_path, magic):
    b = build_file(tmp_path / "slot.bin", checkpoints=[], trailing=struct.pack("<I", magic) + b"junk")
    before = identity(b.path)
    res = strip(b.path)
    assert res.exit_code == 1
    assert identity(b.path) == before and b.path.read_bytes() == b.original
    assert "would read as an appendix" in res.stderr


# -- refusing ----------------------------------------------------------------------------------------


def _damaged(tmp_path: Path) -> tuple[Path, bytes, int]:
    """A file whose SCKP appendix (not its draft state) is damaged: version 7. Returns (path, bytes, SCKP offset)."""
    b = build_file(tmp_path / "damaged.bin")
    sckp = open_slot_file(b.path).sckp.offset
    raw = bytearray(b.original)
    raw[sckp + 4:sckp + 8] = struct.pack("<I", 7)   # SCKP version 7
    b.path.write_bytes(bytes(raw))
    return b.path, bytes(raw), sckp


def test_damaged_file_is_refused_untouched_and_others_still_stripped(tmp_path):
    bad, bad_bytes, sdft = _damaged(tmp_path)
    cut = tmp_path / "cut.bin"
    cut.write_bytes(TARGET_SRC.read_bytes()[:1000])
    good = build_file(tmp_path / "good.bin")
    before = {p: identity(p) for p in (bad, cut)}

    res = strip(bad, cut, good.path, "--json")
    assert res.exit_code == 1
    assert bad.read_bytes() == bad_bytes and cut.read_bytes() == TARGET_SRC.read_bytes()[:1000]
    assert {p: identity(p) for p in (bad, cut)} == before
    assert good.path.read_bytes() == good.stripped
    d = json.loads(res.stdout)
    assert [f["status"] for f in d["files"]] == ["refused", "refused", "stripped"]
    assert d["summary"]["refused"] == 2 and d["summary"]["stripped"] == 1
    assert d["files"][0]["size_after"] is None and d["files"][0]["bytes_freed"] == 0
    assert d["files"][0]["error"] == {
        "code": "damaged", "message": f"{bad}: SCKP appendix at 0x{sdft + 4:x} ({sdft + 4}): SCKP version 1, found 7"}
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: {d['files'][0]['error']['message']}", f"error: {d['files'][1]['error']['message']}"]
    assert "\n".join(res.stderr.splitlines()[2:]).startswith(f"warning: {good.path}: its checkpoints hold")
    assert not temp_files(tmp_path)


def test_damaged_file_one_line_error_in_human_mode(tmp_path):
    bad, bad_bytes, sdft = _damaged(tmp_path)
    res = strip(bad)
    assert res.exit_code == 1 and bad.read_bytes() == bad_bytes
    assert "refused" in res.stdout
    assert [ln for ln in res.stderr.splitlines() if ln.strip()] == \
        [f"error: {bad}: SCKP appendix at 0x{sdft + 4:x} ({sdft + 4}): SCKP version 1, found 7"]


def test_file_that_changes_after_the_parse_is_not_replaced(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    plan = plan_strip(b.path)
    with open(b.path, "ab") as f:
        f.write(b"appended after the parse")
    with pytest.raises(SourceChanged):
        write_plan(plan, b.path, overwrite=True)
    assert b.path.read_bytes() == b.original + b"appended after the parse"
    assert not temp_files(tmp_path)


# -- where the result goes ---------------------------------------------------------------------------


def test_output_elsewhere_leaves_the_input_untouched(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    out = tmp_path / "out.bin"
    before = identity(b.path)
    code, d = strip_json(b.path, "-o", out)
    assert code == 0 and d["files"][0]["output"] == str(out)
    assert identity(b.path) == before and b.path.read_bytes() == b.original
    assert out.read_bytes() == b.stripped

    # an existing OUT needs --force
    out_before = identity(out)
    res = strip(b.path, "-o", out, "--checkpoints")
    assert res.exit_code == 2 and res.stderr.startswith(f"error: {out}: exists (use --force")
    assert identity(out) == out_before
    assert strip(b.path, "-o", out, "--checkpoints", "--force").exit_code == 0
    assert out.read_bytes() == b.stripped_ckpt
    assert identity(b.path) == before


def test_output_of_a_file_without_draft_state_is_a_copy(tmp_path):
    out = tmp_path / "copy.bin"
    code, d = strip_json(TARGET_SRC, "--output", out)
    assert code == 0 and d["files"][0]["status"] == "unchanged" and d["files"][0]["output"] == str(out)
    assert out.read_bytes() == TARGET_SRC.read_bytes()


def test_output_with_several_inputs_or_a_directory_is_a_usage_error(tmp_path):
    a, b = build_file(tmp_path / "a.bin"), build_file(tmp_path / "b.bin")
    for args in ([a.path, b.path, "-o", tmp_path / "out.bin"], [tmp_path, "-o", tmp_path / "out.bin"],
                 [a.path, "-o", tmp_path]):
        res = strip(*args)
        assert res.exit_code == 2, args
        assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith("error: ")
    assert a.path.read_bytes() == a.original and b.path.read_bytes() == b.original
    assert not (tmp_path / "out.bin").exists()


def test_usage_errors_touch_nothing(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    before = identity(b.path)
    assert strip().exit_code == 2
    assert strip(b.path, "--model", b.path).exit_code == 2   # not a GGUF
    assert identity(b.path) == before


def test_a_missing_path_is_its_own_error_and_the_others_are_stripped(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    missing = tmp_path / "missing.bin"
    res = strip(b.path, missing, "--json")
    assert res.exit_code == 2 and f"error: {missing}: no such file or directory\n" in res.stderr
    d = json.loads(res.stdout)
    assert [(f["status"], f["exit_code"]) for f in d["files"]] == [("stripped", 0), ("unreadable", 2)]
    assert d["summary"]["unreadable"] == 1 and d["summary"]["refused"] == 0
    assert d["files"][1]["error"] == {"code": "no_such_file", "message": f"{missing}: no such file or directory"}
    assert b.path.read_bytes() == b.stripped and not missing.exists()


def test_model_options_name_the_layouts(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    code, d = strip_json(b.path, "--model", DATA / "target.gguf", "--draft-model", DATA / "target.gguf",
                         "--checkpoints")
    assert code == 0 and d["files"][0]["status"] == "stripped"
    assert b.path.read_bytes() == b.stripped_ckpt


def test_in_place_through_a_symbolic_link_replaces_the_file_it_points_to(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    link = tmp_path / "link.bin"
    link.symlink_to(b.path.name)
    code, d = strip_json(link)
    assert code == 0 and d["files"][0]["output"] == str(link)
    assert link.is_symlink() and b.path.read_bytes() == b.stripped


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_in_place_keeps_mode_owner_and_group(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    os.chown(b.path, 1234, 4321)
    os.chmod(b.path, 0o640)
    assert strip(b.path).exit_code == 0
    st = os.stat(b.path)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 4321, 0o640)
    assert b.path.read_bytes() == b.stripped


def test_directory_mode(tmp_path):
    d_ = tmp_path / "slots"
    d_.mkdir()
    with_draft = build_file(d_ / "b-draft.bin")
    ckpt_only = build_file(d_ / "c-ckpt.bin", draft=False)
    plain = d_ / "a-plain.bin"
    plain.write_bytes(TARGET_SRC.read_bytes())
    notes = d_ / "notes.txt"
    notes.write_bytes(b"not a slot file")
    tmp = d_ / ".b-draft.bin.slotctl-abc123.tmp"
    tmp.write_bytes(b"a temp file left by a killed run")
    (d_ / "sub").mkdir()
    build_file(d_ / "sub" / "nested.bin")
    (d_ / "z-link.bin").symlink_to(with_draft.path)
    untouched = {p: identity(p) for p in (plain, notes, tmp, d_ / "sub" / "nested.bin")}

    got = expand_slot_paths([d_])
    assert got.files == [str(d_ / n) for n in ("a-plain.bin", "b-draft.bin", "c-ckpt.bin")]
    assert got.skipped == [str(d_ / "notes.txt")] and got.links == [str(d_ / "z-link.bin")]
    code, d = strip_json(d_, "--checkpoints")
    assert code == 0   # notes.txt does not begin with the state magic: not a slot file, skipped
    assert [(Path(f["path"]).name, f["status"]) for f in d["files"]] == [
        ("a-plain.bin", "unchanged"), ("b-draft.bin", "stripped"), ("c-ckpt.bin", "stripped")]
    assert d["summary"]["skipped"] == 1
    assert with_draft.path.read_bytes() == with_draft.stripped_ckpt
    assert ckpt_only.path.read_bytes() == ckpt_only.stripped_ckpt
    assert {p: identity(p) for p in untouched} == untouched
    freed = (len(with_draft.original) - len(with_draft.stripped_ckpt)
             + len(ckpt_only.original) - len(ckpt_only.stripped_ckpt))
    assert d["summary"]["bytes_freed"] == freed == sum(f["bytes_freed"] for f in d["files"])
    assert d["summary"]["stripped"] == 2 and d["summary"]["refused"] == 0
    assert temp_files(d_) == [tmp]

    # a directory given with one of its files: each file once
    assert expand_slot_paths([with_draft.path, d_]).files.count(str(with_draft.path)) == 1


def test_dry_run_writes_nothing(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    plain = tmp_path / "plain.bin"
    plain.write_bytes(TARGET_SRC.read_bytes())
    before = {p: identity(p) for p in (b.path, plain)}
    code, d = strip_json(b.path, plain, "--dry-run", "--checkpoints")
    assert code == 0
    assert {p: identity(p) for p in (b.path, plain)} == before and b.path.read_bytes() == b.original
    assert [f["status"] for f in d["files"]] == ["would_strip", "unchanged"]
    assert d["files"][0]["size_after"] == len(b.stripped_ckpt)
    assert d["files"][0]["output"] == str(b.path) and d["files"][1]["output"] is None
    assert d["summary"]["bytes_freed"] == len(b.original) - len(b.stripped_ckpt) and d["summary"]["would_strip"] == 1

    out = tmp_path / "out.bin"
    res = strip(b.path, "--dry-run", "-o", out)
    assert res.exit_code == 0 and not out.exists()
    assert "would strip" in res.stdout and "would be freed" in res.stdout
    assert not temp_files(tmp_path)


def test_json_keys_are_stable(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    cut = tmp_path / "cut.bin"
    cut.write_bytes(b"\x71\x73\x67\x67")
    code, d = strip_json(b.path, cut)
    assert code == 1
    assert list(d) == ["files", "summary", "exit_code"]
    keys = ["path", "status", "size", "size_after", "bytes_freed", "removed", "output", "method", "draft_size",
            "checkpoint_draft_size", "repaired", "other_links", "exit_code"]
    assert list(d["files"][0]) == keys and list(d["files"][1]) == keys + ["error"]
    assert d["files"][1]["error"]["code"] == "damaged" and d["files"][1]["output"] is None


def test_human_output(tmp_path):
    b = build_file(tmp_path / "slot.bin", checkpoints=[])
    res = runner.invoke(app, ["strip-draft", str(b.path), "--grace", "0"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and res.stderr == ""
    row = next(ln for ln in res.stdout.splitlines() if "slot.bin" in ln)
    for cell in ("stripped", "SDFT"):
        assert cell in row
    freed = len(b.original) - len(b.stripped)
    assert f"total: 1 stripped, 0 unchanged, 0 refused; {freed / 1024:,.1f} KiB freed" in res.stdout


# -- streaming, progress, atomicity ------------------------------------------------------------------


def write_sparse_file(path: Path, *, kept: int, removed: int, sdft: bool = True, ckpt_draft: bool = True) -> None:
    """A big file that costs little disk: a real server file; one checkpoint (a real target blob, and a real
    draft blob and speculative state when ``ckpt_draft``); when ``sdft``, an SDFT appendix whose speculative
    state is ``removed`` sparse bytes; then ``kept`` sparse trailing bytes a server ignores (they start
    with a zero word, no appendix magic). Without ``sdft`` (and ``ckpt_draft``) it is the stripped file.
    """
    tgt, dft = state_blob(TARGET_SRC), state_blob(DRAFT_SRC)
    ckpt = dict(n_tokens=8, pos_min=0, pos_max=7, tgt=tgt, dft=dft if ckpt_draft else b"",
                spec=SPEC_STATE if ckpt_draft else b"")
    with open(path, "wb") as f:
        f.write(TARGET_SRC.read_bytes() + build_sckp([ckpt]))
        if sdft:
            f.write(struct.pack("<IIQ", SDFT_MAGIC, 1, len(dft)) + dft + struct.pack("<Q", removed))
            f.seek(removed - 1, os.SEEK_CUR)
            f.write(b"\x02")
        f.seek(kept - 1, os.SEEK_CUR)
        f.write(b"\x03")


def same_bytes(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes (compared in chunks)."""
    if os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            chunk = fa.read(COPY_CHUNK)
            if chunk != fb.read(len(chunk)):
                return False
            if not chunk:
                return True


@pytest.fixture
def big_dir(tmp_path):
    """A directory for big files, removed after the test (pytest keeps recent tmp dirs around)."""
    d = tmp_path / "big"
    d.mkdir()
    yield d
    shutil.rmtree(d)


def test_copies_stream_and_report_progress(big_dir):
    sizes = dict(kept=96 << 20, removed=64 << 20)
    p, want = big_dir / "slot.bin", big_dir / "want.bin"
    write_sparse_file(p, **sizes)
    write_sparse_file(want, **sizes, sdft=False)
    seen = []
    tracemalloc.start()
    try:
        [res] = strip_files([str(p)], grace=0, progress=lambda done, total: seen.append((done, total)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert res.status == "stripped" and res.size_after == os.path.getsize(want)
    assert same_bytes(p, want)
    assert peak < 3 * COPY_CHUNK, peak   # chunks, never the whole payload
    assert seen[-1] == (res.size_after, res.size_after)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


@pytest.mark.parametrize("checkpoints", [False, True], ids=["sdft", "sdft+checkpoints"])
def test_killed_at_any_moment_leaves_the_old_file_or_the_new_one(big_dir, checkpoints):
    """SIGKILL a real ``python -m slotctl strip-draft`` at several moments, some of them mid-copy.

    The removed SDFT appendix sits between kept parts, so the new file is no prefix of the old one: only
    an atomic replace passes.
    """
    sizes = dict(kept=320 << 20, removed=64 << 20)
    old, new = big_dir / "old.bin", big_dir / "new.bin"
    write_sparse_file(old, **sizes)
    write_sparse_file(new, **sizes, sdft=False, ckpt_draft=not checkpoints)
    work = big_dir / "work"
    work.mkdir()
    victim = work / "slot.bin"
    cmd = [sys.executable, "-m", "slotctl", "strip-draft", str(victim), "--grace", "0"] + (["--checkpoints"] if checkpoints else [])
    env = {**os.environ, "SLOTCTL_NO_PROGRESS": "1"}

    def run_and_kill(delay: float | None) -> tuple[bool, bool]:
        """Start a strip and kill it ``delay`` s later (None: as soon as its temp file has bytes).

        Returns (killed while running, temp file present right before the kill)."""
        write_sparse_file(victim, **sizes)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        start = time.monotonic()
        while proc.poll() is None:
            tmps = temp_files(work)
            if delay is None and tmps and tmps[0].stat().st_size > 0:
                break
            if delay is not None and time.monotonic() - start >= delay:
                break
            time.sleep(0.002)
        mid_copy = bool(temp_files(work))
        running = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return running and proc.returncode == -signal.SIGKILL, running and mid_copy

    outcomes = []
    for delay in (None, 0.3, 0.6, 0.9, None, 1.3, 2.0):
        killed, mid_copy = run_and_kill(delay)
        state = "old" if same_bytes(victim, old) else "new" if same_bytes(victim, new) else "broken"
        outcomes.append((delay, killed, mid_copy, state))
        assert state != "broken", outcomes
        for t in temp_files(work):   # what a killed run may leave behind
            t.unlink()
    assert any(mid for _, _, mid, _ in outcomes), outcomes
    assert any(state == "old" and killed for _, killed, _, state in outcomes), outcomes

    # run to the end: the stripped file, no temp file
    write_sparse_file(victim, **sizes)
    r = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["summary"]["bytes_freed"] == os.path.getsize(old) - os.path.getsize(new)
    assert same_bytes(victim, new) and not temp_files(work)


# -- the runtime still loads a stripped file -----------------------------------------------------------


def test_stripped_file_loads_in_llama_cpp(tmp_path):
    """llama-cpp-python 0.3.36 reads state version 3: a v3 copy of a real server file, with draft state."""
    from slotctl.format.convert import convert_payload
    from slotctl.runtime import STATE_VERSION, Context, ContextSettings, Model
    from slotctl.slotfile import build_header

    assert STATE_VERSION == 3
    src = open_slot_file(TARGET_SRC)
    raw = TARGET_SRC.read_bytes()
    payload = convert_payload(raw[src.target.offset:src.target.end], src.target.layout, 4, 3)
    v3 = build_header(3, src.words) + payload
    p = tmp_path / "v3.bin"
    p.write_bytes(v3 + build_sdft(blob_header(0) + payload, SPEC_STATE))
    assert open_slot_file(p).sdft is not None

    code, d = strip_json(p)
    assert code == 0 and d["files"][0]["removed"] == ["SDFT"]
    assert p.read_bytes() == v3
    with Model(DATA / "target.gguf") as model, \
            Context(model, ContextSettings(n_ctx=256, n_parallel=1, flash_attn="on")) as ctx:
        words, n_read = ctx.load_seq_file(p, 0)
        assert n_read == len(v3), ctx.last_errors
        assert words == [int(w) for w in src.words]
        # the restored cells are the server's (tests/data/expect.json, read independently)
        expect = json.loads((DATA / "expect.json").read_text())[TARGET_SRC.name]
        assert (ctx.seq_pos_min(0), ctx.seq_pos_max(0)) == (expect["pos_min"], expect["pos_max"])


# -- cutting the tail in place; repairing a damaged SDFT appendix; the draft cost ------------------------


def test_sdft_at_the_end_is_cut_off_in_place_needing_no_free_space(tmp_path, monkeypatch):
    """The SDFT appendix ends the file: one truncate, same inode, even with no free space at all."""
    b = build_file(tmp_path / "slot.bin")
    inode = os.stat(b.path).st_ino
    monkeypatch.setattr(os, "statvfs", lambda p: pytest.fail("a truncation must not need free space"))
    [res] = strip_files([str(b.path)], grace=0)
    assert (res.status, res.method) == ("stripped", "truncate")
    assert b.path.read_bytes() == b.stripped and os.stat(b.path).st_ino == inode
    assert not temp_files(tmp_path)


def test_a_copy_checks_free_space_first_and_says_how_much(tmp_path, monkeypatch):
    """--checkpoints rewrites the middle: a copy; with too little free space nothing is written."""
    b = build_file(tmp_path / "slot.bin")
    before = identity(b.path)

    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Full())
    [res] = strip_files([str(b.path)], checkpoints=True, grace=0)
    # refused: nothing was removed and no method wrote it (issue 19, item 11)
    assert (res.status, res.method, res.removed, res.exit_status) == ("refused", None, [], 2)
    need = len(b.stripped_ckpt) + (1 << 20)
    assert f"the stripped copy needs {need:,} bytes free, 40,960 are" in res.error
    assert identity(b.path) == before and not temp_files(tmp_path)


def test_output_is_a_copy_and_the_input_stays(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    before = identity(b.path)
    out = tmp_path / "out.bin"
    [res] = strip_files([str(b.path)], output=out, grace=0)
    assert (res.status, res.method) == ("stripped", "copy")
    assert out.read_bytes() == b.stripped and identity(b.path) == before


def _cut_sdft(tmp_path: Path, how: str) -> tuple[Built, int, bytes]:
    """A file whose SDFT appendix is damaged (``how``); returns it, the SDFT offset and its bytes."""
    b = build_file(tmp_path / "slot.bin")
    sdft = open_slot_file(b.path).sdft.offset
    raw = bytearray(b.original)
    if how == "truncated":
        raw = raw[:sdft + 100]                       # cut inside the draft blob
    elif how == "in the magic":
        raw = raw[:sdft + 2]                         # cut inside the SDFT magic
    elif how == "blob length":
        raw[sdft + 8:sdft + 16] = struct.pack("<Q", 1 << 40)
    b.path.write_bytes(bytes(raw))
    return b, sdft, bytes(raw)


@pytest.mark.parametrize("how", ["truncated", "in the magic", "blob length"])
def test_a_damaged_sdft_appendix_is_removed_and_said(tmp_path, how):
    b, sdft, raw = _cut_sdft(tmp_path, how)
    damaged = open_slot_file(b.path)
    # inspect reports the file damaged, or (cut inside the magic) holding a torn magic a server ignores ...
    assert damaged.errors or (how == "in the magic" and damaged.trailing.size == 2)
    code, d = strip_json(b.path, "--dry-run")   # ... strip-draft would repair it
    [f] = d["files"]
    assert code == 0 and f["status"] == "would_strip" and f["removed"] == ["SDFT"]
    assert f["repaired"] and f["size_after"] == sdft and b.path.read_bytes() == raw

    res = strip(b.path)
    assert res.exit_code == 0, res.output
    assert b.path.read_bytes() == b.stripped      # exactly the file without its draft state
    assert "damaged draft state" in res.stderr and "it was removed" in res.stderr
    repaired = open_slot_file(b.path)
    assert not repaired.errors and repaired.sdft is None


def test_damage_before_the_sdft_appendix_is_still_refused(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    sf = open_slot_file(b.path)
    raw = bytearray(b.original[:sf.sdft.offset + 50])   # SDFT cut short ...
    raw[sf.sckp.offset + 4:sf.sckp.offset + 8] = struct.pack("<I", 9)   # ... and the SCKP damaged
    b.path.write_bytes(bytes(raw))
    res = strip(b.path)
    assert res.exit_code == 1 and b.path.read_bytes() == bytes(raw)
    assert "SCKP version 1, found 9" in res.stderr


def test_dry_run_reports_the_whole_draft_cost_and_names_the_checkpoints_flag(tmp_path):
    b = build_file(tmp_path / "slot.bin")
    in_ckpts = sum(len(c["dft"]) + len(c["spec"]) for c in b.checkpoints)
    sdft = len(b.original) - len(b.stripped)
    code, d = strip_json(b.path, "--dry-run")
    [f] = d["files"]
    assert code == 0 and f["bytes_freed"] == sdft
    assert f["draft_size"] == sdft + in_ckpts and f["checkpoint_draft_size"] == in_ckpts
    assert f["method"] == "truncate"
    res = strip(b.path, "--dry-run")
    want = sdft + in_ckpts
    assert f"draft state in all: " in res.stdout and f"({want:,} bytes)" in res.stdout
    assert "--checkpoints" in res.stdout
    # with --checkpoints everything goes, by a copy
    code, d = strip_json(b.path, "--dry-run", "--checkpoints")
    [f] = d["files"]
    assert f["bytes_freed"] == len(b.original) - len(b.stripped_ckpt) and f["checkpoint_draft_size"] == 0
    assert f["method"] == "copy"
