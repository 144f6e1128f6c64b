"""``slotctl ls`` and ``slotctl prune`` on directories of real slot files: files saved by llama-server
b11434 (tests/data) and by ``slotctl save`` from real contexts, plus damaged ones."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.tinymodels import SAMPLE_PROMPT

DATA = Path(__file__).parent / "data"
SERVER_FILES = sorted(DATA.glob("srv-*.bin")) + sorted((DATA / "kinds").glob("srv-*.bin"))
KINDS = {"srv-gemma2.bin": "iswa", "srv-jamba.bin": "hybrid", "srv-lfm2.bin": "hybrid", "srv-mamba.bin": "recurrent"}
runner = CliRunner()
DAY = 86400


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def saved(tiny_models, tmp_path_factory):
    """Files from ``slotctl save`` (real contexts): one with checkpoints and a draft state, one without."""
    d = tmp_path_factory.mktemp("ls-saved")
    t, dr = str(tiny_models.target), str(tiny_models.draft)
    out = {}
    for name, extra in (("draft.bin", ["-md", dr, "--spec-type", "draft-simple", "--checkpoint-at", "40"]), ("plain.bin", [])):
        res = cli("save", "-m", t, "--prompt", SAMPLE_PROMPT, "-o", d / name, "-c", "256", "-t", "1", *extra)
        assert res.exit_code == 0, res.output
        out[name] = d / name
    return out


@pytest.fixture
def slotdir(tmp_path, saved):
    """A slot directory: every server file, the two saved files, a truncated file, a file that is not a
    slot file; times spread over days (access time = modification time)."""
    d = tmp_path / "slots"
    d.mkdir()
    now = time.time()
    for i, src in enumerate([*SERVER_FILES, *saved.values()]):
        shutil.copyfile(src, d / src.name)
        os.utime(d / src.name, (now - (i + 1) * DAY, now - (i + 1) * DAY))
    raw = SERVER_FILES[0].read_bytes()
    (d / "truncated.bin").write_bytes(raw[:len(raw) // 2])
    os.utime(d / "truncated.bin", (now - 3 * DAY, now - 3 * DAY))
    (d / "notes.txt").write_text("not a slot file\n")
    os.utime(d / "notes.txt", (now - 90 * DAY, now - 90 * DAY))
    return d


def ls_json(*args):
    res = cli("ls", *args, "--json")
    assert res.exit_code in (0, 1), res.output
    doc = json.loads(res.stdout)
    assert doc["exit_code"] == res.exit_code
    return doc


# -- ls --------------------------------------------------------------------------------------------------


def test_ls_rows_of_real_files(slotdir, saved):
    doc = ls_json(slotdir)
    rows = {r["name"]: r for r in doc["files"]}
    assert "notes.txt" not in rows and doc["summary"]["skipped"] == 1
    for src in SERVER_FILES:
        r = rows[src.name]
        assert (r["state_version"], r["memory_kind"], r["verdict"], r["checkpoints"], r["draft_size"]) == \
            (4, KINDS.get(src.name, "kv"), "restores", [], 0), r
        assert r["n_tokens"] == (60 if src.name in KINDS else 111)
        assert r["size"] == src.stat().st_size and r["exit_code"] == 0
    d = rows["draft.bin"]
    # a checkpoint at 40 tokens, and draft state: the SDFT appendix and the checkpoint's draft blob
    assert [c["n_tokens"] for c in d["checkpoints"]] == [40]
    from slotctl.slotfile import open_slot_file

    sf = open_slot_file(saved["draft.bin"])
    assert d["draft_size"] == sf.sdft.size + sf.checkpoints[0].dft.span.size > 0
    assert rows["plain.bin"]["draft_size"] == 0 and rows["plain.bin"]["checkpoints"] == []
    t = rows["truncated.bin"]
    # without -m the cut payload cannot be placed: the server refuses it or aborts, validate cannot tell
    assert t["damaged"] and t["verdict"] == "undecided" and t["exit_code"] == 1
    assert t["error"]["code"] == "damaged" and "target memory" in t["error"]["message"]
    assert doc["exit_code"] == 1        # a listed file would be refused
    s = doc["summary"]
    assert s["files"] == len(rows) and s["size"] == sum(r["size"] for r in rows.values())
    assert s["verdicts"]["restores"] == len(rows) - 1 and s["verdicts"]["undecided"] == 1


def test_ls_filters_sort_and_jsonl(slotdir):
    assert [r["name"] for r in ls_json(slotdir, "--broken")["files"]] == ["truncated.bin"]
    assert [r["name"] for r in ls_json(slotdir, "--has-draft")["files"]] == ["draft.bin"]
    ok = ls_json(slotdir, "--verdict", "restores")
    assert ok["exit_code"] == 0 and "truncated.bin" not in {r["name"] for r in ok["files"]}
    sizes = [r["size"] for r in ls_json(slotdir, "--sort", "size")["files"]]
    assert sizes == sorted(sizes, reverse=True)
    ages = [r["age_seconds"] for r in ls_json(slotdir, "--sort", "age")["files"]]
    assert ages == sorted(ages, reverse=True)
    res = cli("ls", slotdir, "--jsonl")
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["name"] for x in lines[:-1]] == sorted(x["name"] for x in lines[:-1])
    assert lines[-1]["summary"]["files"] == len(lines) - 1 and lines[-1]["exit_code"] == res.exit_code == 1
    assert cli("ls", slotdir, "--sort", "colour").exit_code == 2
    assert cli("ls", slotdir, "--verdict", "fine").exit_code == 2


def test_ls_human_table_has_every_row_and_totals(slotdir):
    res = cli("ls", slotdir, "--sort", "tokens")
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["size", "age", "ver"] and max(map(len, lines)) <= 80   # a pipe: 80
    total = " ".join(" ".join(lines[next(i for i, ln in enumerate(lines) if ln.startswith("total: ")):]).split())
    assert total.startswith("total: 13 file(s)")
    # every row, its name folded onto a line of its own below its column where it is longer than the room left
    flat = "".join(ln.strip() for ln in lines)
    assert all(p.name in flat for p in slotdir.glob("*.bin")) and len(list(slotdir.glob("*.bin"))) == 13
    assert "1 undecided" in total and "1 file(s) that are not slot files left out" in total
    # the class column: shown because a file restores but reuses nothing (gemma2 at b11434), said why
    assert "verdict class" in " ".join(lines[0].split())
    assert "restores useless" in " ".join(next(ln for ln in lines if "srv-gemma2" in ln).split()), res.stdout


def test_ls_with_the_servers_flags(slotdir):
    """With -m and flags: validate's prediction, the same verdicts validate gives."""
    target = DATA / "target.gguf"
    doc = ls_json(DATA / "srv-np1.bin", DATA / "srv-kvq8.bin", "-m", target, "-c", "256", "-ctk", "q8_0",
                  "-ctv", "q8_0")
    v = {r["name"]: r["verdict"] for r in doc["files"]}
    assert v == {"srv-np1.bin": "refused", "srv-kvq8.bin": "restores"}
    f16 = next(r for r in doc["files"] if r["name"] == "srv-np1.bin")
    assert any(f["code"] == "k_type_mismatch" for f in f16["findings"]), f16["findings"]
    val = json.loads(cli("validate", DATA / "srv-np1.bin", "-m", target, "-c", "256", "-ctk", "q8_0",
                         "-ctv", "q8_0", "--no-load", "--json").stdout)
    assert val["files"][0]["verdict"] == "refused"


def test_ls_leaves_access_times_alone(slotdir):
    """slotctl's own reads are not uses of a file: prune orders by access time."""
    before = {p.name: p.stat().st_atime_ns for p in slotdir.iterdir()}
    ls_json(slotdir)
    ls_json(slotdir, "-m", DATA / "target.gguf", "-c", "256")
    assert {p.name: p.stat().st_atime_ns for p in slotdir.iterdir()} == before


def test_ls_pool_over_many_files(tmp_path):
    """Enough files for the process pool: rows in order, the same as one process makes."""
    for i in range(60):
        shutil.copyfile(SERVER_FILES[i % len(SERVER_FILES)], tmp_path / f"f{i:02d}.bin")
    a = ls_json(tmp_path)
    b = ls_json(tmp_path, "--jobs", "1")
    strip = lambda d: [{k: v for k, v in r.items() if k != "age_seconds"} for r in d["files"]]  # noqa: E731
    assert strip(a) == strip(b) and len(a["files"]) == 60


def test_ls_usage_errors(tmp_path):
    assert cli("ls", tmp_path / "missing").exit_code == 2
    assert cli("ls", tmp_path, "--load").exit_code == 2          # --load needs -m
    assert cli("ls", tmp_path, "-m", DATA / "srv-np1.bin").exit_code == 2   # not a GGUF
    doc = ls_json(tmp_path)
    assert doc["files"] == [] and doc["exit_code"] == 0


# -- prune -----------------------------------------------------------------------------------------------


def prune_json(*args):
    res = cli("prune", *args, "--json")
    doc = json.loads(res.stdout)
    assert doc["exit_code"] == res.exit_code
    return doc


def test_prune_older_than_dry_run_then_for_real(slotdir):
    names = sorted(p.name for p in slotdir.iterdir())
    doc = prune_json(slotdir, "--older-than", "6.5d", "--dry-run")
    gone = sorted(Path(f["path"]).name for f in doc["files"] if f["action"] == "would_delete")
    # files aged 7..12 days (the notes file is older but not a slot file)
    assert len(gone) == 6 and "notes.txt" not in gone
    assert sorted(p.name for p in slotdir.iterdir()) == names      # nothing deleted
    assert doc["summary"]["freed"] == sum(f["size"] for f in doc["files"] if f["action"] == "would_delete")
    assert doc["time_source"] in ("atime", "mtime") and doc["time_source_reason"]
    doc = prune_json(slotdir, "--older-than", "6.5d")
    assert sorted(Path(f["path"]).name for f in doc["files"] if f["action"] == "deleted") == gone
    assert not any((slotdir / n).exists() for n in gone) and (slotdir / "notes.txt").exists()


def test_prune_max_size_least_recently_used_first_with_pins(slotdir):
    files = {p.name: p for p in slotdir.iterdir() if p.name != "notes.txt"}
    total = sum(p.stat().st_size for p in files.values())
    # a recent read: the oldest file was restored a minute ago, so it is the most recently used
    oldest = max(files.values(), key=lambda p: time.time() - p.stat().st_mtime)
    os.utime(oldest, (time.time() - 60, oldest.stat().st_mtime))
    budget = total // 2
    doc = prune_json(slotdir, "--max-size", str(budget), "--pin", "srv-np1*")
    if doc["time_source"] == "mtime":
        pytest.skip("the filesystem does not keep access times")
    deleted = [f for f in doc["files"] if f["action"] == "deleted"]
    assert oldest.exists() and (slotdir / "srv-np1.bin").exists()
    assert doc["summary"]["size_after"] <= budget and doc["exit_code"] == 0
    used = sorted((f["last_used"], f["path"]) for f in doc["files"] if f["action"] in ("deleted", "kept"))
    # least recently used first: everything deleted was used before everything kept
    last_deleted = max(f["last_used"] for f in deleted)
    assert all(u >= last_deleted for u, p in used if p not in {f["path"] for f in deleted})
    assert sum(os.path.getsize(p) for p in slotdir.iterdir() if p.name != "notes.txt") == doc["summary"]["size_after"]


def test_prune_keep_broken_and_busy_files(slotdir):
    # a file being written right now and a temporary file of slotctl's own are never touched
    shutil.copyfile(SERVER_FILES[0], slotdir / "busy.bin")
    (slotdir / ".x.bin.slotctl-abc.tmp").write_bytes(b"partial")
    doc = prune_json(slotdir, "--broken")
    assert [Path(f["path"]).name for f in doc["files"] if f["action"] == "deleted"] == ["truncated.bin"]
    doc = prune_json(slotdir, "--keep", "2")
    kept = sorted(Path(f["path"]).name for f in doc["files"] if f["action"] == "kept")
    assert kept == ["srv-draft.bin", "srv-fa-off.bin"]        # the two used most recently (1 and 2 days)
    assert (slotdir / "busy.bin").exists() and (slotdir / ".x.bin.slotctl-abc.tmp").exists()
    busy = next(f for f in doc["files"] if f["path"].endswith("busy.bin"))
    assert busy["action"] == "skipped" and "being written" in busy["reason"]


def test_prune_usage_errors(slotdir):
    assert cli("prune", slotdir).exit_code == 2                                  # no budget
    assert cli("prune", slotdir, "--max-size", "lots").exit_code == 2
    assert cli("prune", slotdir, "--older-than", "7 fortnights").exit_code == 2
    assert cli("prune", slotdir, "--broken", "--keep", "1").exit_code == 2
    assert cli("prune", slotdir / "missing", "--keep", "1").exit_code == 2


def test_prune_over_budget_exits_1(slotdir):
    doc = prune_json(slotdir, "--max-size", "1K", "--pin", "*.bin", "--dry-run")
    assert doc["exit_code"] == 1 and doc["summary"]["over_budget"]
    assert doc["summary"]["would_delete"] == 0


def test_prune_killed_leaves_every_file_whole_or_gone(tmp_path):
    """SIGKILL in the middle of a prune: each file is either the original, byte for byte, or gone."""
    raw = SERVER_FILES[0].read_bytes()[:4096]     # a slot file by its magic; prune reads no further
    old = time.time() - 30 * DAY
    # on a loaded machine this process may be scheduled out until prune has finished: then try again
    for attempt in range(4):
        d = tmp_path / f"many{attempt}"
        d.mkdir()
        for i in range(4000):
            p = d / f"s{i:04d}.bin"
            p.write_bytes(raw)
            os.utime(p, (old, old))
        proc = subprocess.Popen([sys.executable, "-m", "slotctl", "prune", str(d), "--keep", "0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "SLOTCTL_NO_PROGRESS": "1"})
        deadline = time.time() + 60
        while time.time() < deadline and len(os.listdir(d)) == 4000 and proc.poll() is None:
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left = sorted(os.listdir(d))
        for name in left:
            assert (d / name).read_bytes() == raw, name
        if 0 < len(left) < 4000:
            break
    assert 0 < len(left) < 4000, "the kill never landed during the deletions"


@pytest.mark.server
def test_ls_for_a_running_server(llama_server_bin, tiny_models, tmp_path):
    """--server URL: the files judged for that server's own model and flags (learned from /props, /slots)."""
    from conftest import start_server

    slots = tmp_path / "slots"
    slots.mkdir()
    srv = start_server(llama_server_bin, tiny_models.target, tmp_path, "ls", args=["-c", "256", "-np", "1", "-fa", "on"],
                       slot_save_path=slots)
    try:
        srv.completion(SAMPLE_PROMPT, slot=0, n_predict=4)
        srv.save(0, "mine.bin")
        shutil.copyfile(DATA / "srv-kvq8.bin", slots / "q8.bin")
        doc = ls_json(slots, "--server", srv.url)
    finally:
        srv.stop()
    v = {r["name"]: r["verdict"] for r in doc["files"]}
    assert v == {"mine.bin": "restores", "q8.bin": "refused"}
    live = doc["summary"]["server"]
    assert live["url"] and live["sources"]["parallel"] == "server"
    assert cli("ls", slots, "--api-key", "x").exit_code == 2      # live-only option without --server


def _sparse_file_with_a_big_checkpoint(path: Path) -> None:
    """A small payload, then a checkpoint whose blob holds 16 GiB of (sparse) tensor rows."""
    import struct

    from slotctl.format.appendix import SCKP_MAGIC
    from slotctl.format.blob import blob_header

    def kv(cells: int, row: int) -> bytes:
        out = struct.pack("<II", 1, cells) + b"".join(struct.pack("<iIi", p, 1, 0) for p in range(cells))
        return out + struct.pack("<IIII", 0, 1, 0, 0)

    row = 1 << 31
    with open(path, "wb") as f:
        f.write(struct.pack("<III", 0x67677371, 4, 4) + struct.pack("<4i", 1, 2, 3, 4))
        f.write(kv(4, 8) + struct.pack("<iQ", 1, 8) + b"\0" * 32 + struct.pack("<iQ", 1, 8) + b"\0" * 32)
        body = kv(4, row)
        blob_len = len(blob_header(0)) + len(body) + 2 * (12 + 4 * row)
        f.write(struct.pack("<II", SCKP_MAGIC, 1) + struct.pack("<Iqii", 1, 4, 0, 3) + struct.pack("<Q", blob_len))
        f.write(blob_header(0) + body)
        for _ in range(2):
            f.write(struct.pack("<iQ", 1, row))
            f.seek(4 * row, os.SEEK_CUR)
        f.write(struct.pack("<QQ", 0, 0))


def test_ls_of_a_huge_sparse_file_reads_metadata_only(tmp_path):
    """Bytes a candidate layout misreads as a count (an appendix magic read as a recurrent cell count)
    must not become a read or an allocation: ls of a 16 GiB file runs in a process limited to 2 GiB."""
    import resource

    p = tmp_path / "big.bin"
    _sparse_file_with_a_big_checkpoint(p)
    assert p.stat().st_size > 16 << 30

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    r = subprocess.run([sys.executable, "-m", "slotctl", "ls", str(p), "--json", "--jobs", "1"],
                       capture_output=True, text=True, preexec_fn=limit, timeout=120)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["files"]
    assert (row["memory_kind"], row["verdict"], row["n_tokens"]) == ("kv", "restores", 4)
    assert [c["n_tokens"] for c in row["checkpoints"]] == [4]


def test_a_recurrent_cell_count_beyond_llama_max_seq_is_not_read():
    """A recurrent memory holds max(1, n_seq_max) <= 256 cells and llama.cpp's loader refuses more: a larger
    count is refused before any cell is read (it was an appendix magic read as a count: 10 GiB of reads)."""
    import io
    import struct

    from slotctl.errors import FormatError
    from slotctl.format.common import parse
    from slotctl.format.recurrent import recurrent_head

    class Counting(io.BytesIO):
        asked = 0

        def read(self, n=-1):
            Counting.asked += max(n, 0)
            return super().read(n)

    data = struct.pack("<I", 0x504B4353) + b"\0" * (1 << 20)
    with pytest.raises(FormatError) as e:
        parse(recurrent_head, Counting(data), "target memory", version=4)
    assert "a cell count of at most 256" in str(e.value)
    assert Counting.asked < 64
    ok = parse(recurrent_head, io.BytesIO(struct.pack("<IiIII", 1, 59, 0, 0, 2)), "target memory", version=4)
    assert (ok.cell_count, ok.n_layer) == (1, 2)


# -- every file that would fail a restore is seen ---------------------------------------------------------


@pytest.fixture
def wrecked(tmp_path):
    """What a slot directory holds after crashes: a 0-byte .bin (a save that died), a .bin of zeros (a crash
    before the data reached the disk), a .bin whose header was overwritten, one with bytes after its payload
    (undecided without -m), a good file; and what is no slot file: a README, a JSON sidecar, a GGUF named
    .bin, an empty .gitkeep."""
    d = tmp_path / "slots"
    d.mkdir()
    raw = (DATA / "srv-np1.bin").read_bytes()
    files = {"good.bin": raw, "died.bin": b"", "zeros.BIN": bytes(8192), "header.bin": b"XXXX" + raw[4:],
             "tail.bin": raw + bytes(range(256)) * 2, "README.md": b"notes\n", "good.save.json": b"{}",
             "model.bin": (DATA / "target.gguf").read_bytes(), ".gitkeep": b""}
    old = time.time() - 2 * DAY
    for name, data in files.items():
        (d / name).write_bytes(data)
        os.utime(d / name, (old, old))
    return d


BROKEN_BY_NAME = {"died.bin", "zeros.BIN", "header.bin"}
NOT_SLOT_FILES = {"README.md", "good.save.json", "model.bin", ".gitkeep"}


def test_an_empty_or_overwritten_bin_is_a_broken_slot_file_in_ls(wrecked):
    doc = ls_json(wrecked)
    rows = {r["name"]: r for r in doc["files"]}
    assert set(rows) == {"good.bin", "tail.bin"} | BROKEN_BY_NAME
    for name in BROKEN_BY_NAME:
        r = rows[name]
        assert r["verdict"] == "refused" and r["exit_code"] == 1 and r["error"]["code"] == "damaged", r
        assert "state header at 0x0" in r["error"]["message"]
    assert "file ends 0 bytes later" in rows["died.bin"]["error"]["message"]
    assert doc["summary"]["skipped"] == len(NOT_SLOT_FILES) and doc["exit_code"] == 1


def test_validate_and_inspect_of_the_directory_report_them(wrecked):
    res = cli("validate", wrecked, "--json")
    doc = json.loads(res.stdout)
    verdicts = {Path(f["path"]).name: f["verdict"] for f in doc["files"]}
    assert verdicts == {"good.bin": "restores", "tail.bin": "undecided", **{n: "refused" for n in BROKEN_BY_NAME}}
    assert res.exit_code == 1 == doc["exit_code"] and doc["summary"]["skipped"] == len(NOT_SLOT_FILES)
    doc = json.loads(cli("inspect", wrecked, "--json").stdout)
    assert {Path(f["path"]).name for f in doc["files"] if f["exit_code"] == 1} >= BROKEN_BY_NAME


def test_ls_broken_lists_the_undecided_files_too(wrecked):
    doc = ls_json(wrecked, "--broken")
    assert {r["name"]: r["verdict"] for r in doc["files"]} == {"tail.bin": "undecided",
                                                              **{n: "refused" for n in BROKEN_BY_NAME}}
    res = cli("ls", wrecked, "--broken")
    said = " ".join(res.stdout.split())
    assert "1 undecided" in said and "give -m with the server's model and flags to decide" in said
    # with the model the undecided file is decided, and it restores (the bytes after it are never read)
    doc = ls_json(wrecked, "--broken", "-m", DATA / "target.gguf")
    assert {r["name"] for r in doc["files"]} == BROKEN_BY_NAME and doc["summary"]["verdicts"]["undecided"] == 0


def test_prune_broken_deletes_them_and_keeps_the_undecided_saying_so(wrecked):
    res = cli("prune", wrecked, "--broken", "--dry-run")
    assert res.exit_code == 3                                 # undecided files were kept: -m decides them
    assert "1 undecided file(s) kept" in res.stderr and "give -m" in res.stderr
    doc = prune_json(wrecked, "--broken")
    acts = {Path(f["path"]).name: f["action"] for f in doc["files"]}
    assert {n for n, a in acts.items() if a == "deleted"} == BROKEN_BY_NAME
    assert acts["tail.bin"] == "kept" and doc["summary"]["undecided"] == 1 and doc["exit_code"] == 3
    tail = next(f for f in doc["files"] if f["path"].endswith("tail.bin"))
    assert tail["verdict"] == "undecided" and "give -m" in tail["reason"] and tail["exit_code"] == 3
    assert all(acts[n] == "skipped" for n in NOT_SLOT_FILES)
    assert sorted(p.name for p in wrecked.iterdir()) == sorted({"good.bin", "tail.bin"} | NOT_SLOT_FILES)
    doc = prune_json(wrecked, "--broken", "-m", DATA / "target.gguf")
    assert doc["exit_code"] == 0 and doc["summary"]["undecided"] == 0 and doc["summary"]["deleted"] == 0


def test_a_missing_file_is_a_row_and_the_others_are_listed(tmp_path):
    res = cli("ls", DATA / "srv-np1.bin", tmp_path / "nope.bin", DATA / "srv-kvq8.bin", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 2 == doc["exit_code"]
    rows = {r["name"]: r for r in doc["files"]}
    assert {n: r["verdict"] for n, r in rows.items()} == {"srv-np1.bin": "restores", "nope.bin": "unreadable",
                                                          "srv-kvq8.bin": "restores"}
    assert rows["nope.bin"]["error"] == {"code": "no_such_file",
                                         "message": f"{tmp_path / 'nope.bin'}: no such file or directory"}
    res = cli("ls", DATA / "srv-np1.bin", tmp_path / "nope.bin")
    assert res.exit_code == 2 and "srv-np1.bin" in "".join(res.stdout.split())
    assert "no such file or directory" in " ".join(res.stdout.split())


# -- broken means broken (issue 24) ------------------------------------------------------------------------


def _mixed(d: Path) -> dict[str, Path]:
    """Intact files llama-server b11434 saved at -np 1 (plain, -fa off, a q8_0 cache) and one of them cut
    by 100 bytes (a payload cut short: b11434 aborts on it at -np 1)."""
    d.mkdir()
    old = time.time() - 3 * DAY
    files = {}
    for name in ("srv-np1.bin", "srv-fa-off.bin", "srv-kvq8.bin"):
        files[name] = d / name
        shutil.copyfile(DATA / name, files[name])
    raw = (DATA / "srv-np1.bin").read_bytes()
    files["cut.bin"] = d / "cut.bin"
    files["cut.bin"].write_bytes(raw[:-100])
    for p in files.values():
        os.utime(p, (old, old))
    return files


NP2 = ["-m", DATA / "target.gguf", "-c", "1024", "-np", "2"]


def _prune_actions(*args) -> dict[str, dict]:
    res = cli("prune", *args, "--grace", "0", "--json")
    doc = json.loads(res.stdout)
    return {Path(e["path"]).name: e for e in doc["files"]}, res.exit_code


def _check_mismatch_and_broken(where: str, names) -> None:
    # ls: the class of each, with the remedy for the files refused only by the flags given
    doc = json.loads(cli("ls", where, *NP2, "--json").stdout)
    rows = {r["name"]: r for r in doc["files"]}
    assert {n: (r["verdict"], r["class"]) for n, r in rows.items()} == {
        "srv-np1.bin": ("refused", "mismatch"), "srv-fa-off.bin": ("refused", "mismatch"),
        "srv-kvq8.bin": ("refused", "mismatch"), "cut.bin": ("refused", "broken")}
    assert all("convert FILE -o OUT -np 2" in rows[n]["remedy"] for n in names if n != "cut.bin")
    assert doc["summary"]["classes"]["mismatch"] == 3 and doc["summary"]["classes"]["broken"] == 1
    listed = json.loads(cli("ls", where, *NP2, "--broken", "--json").stdout)["files"]
    assert [r["name"] for r in listed] == ["cut.bin"]
    listed = json.loads(cli("ls", where, *NP2, "--mismatched", "--json").stdout)["files"]
    assert sorted(r["name"] for r in listed) == ["srv-fa-off.bin", "srv-kvq8.bin", "srv-np1.bin"]
    human = runner.invoke(app, ["ls", where, *map(str, NP2)], env={"COLUMNS": "200"}).stdout
    assert "refused only by the flags given: target memory: the target memory has 1 KV stream" in human

    # prune --broken with -np 2 flags: only the damaged file, the intact -np 1 files are kept and said why
    acts, code = _prune_actions(where, "--broken", *NP2, "--dry-run")
    assert {n: e["action"] for n, e in acts.items()} == {"cut.bin": "would_delete", "srv-np1.bin": "kept",
                                                         "srv-fa-off.bin": "kept", "srv-kvq8.bin": "kept"}
    assert "--mismatched deletes it" in acts["srv-np1.bin"]["reason"] and acts["srv-np1.bin"]["class"] == "mismatch"
    acts, code = _prune_actions(where, "--broken", *NP2)
    assert code == 0 and [n for n, e in acts.items() if e["action"] == "deleted"] == ["cut.bin"]
    # --mismatched deletes them, when asked, after --dry-run shows them
    acts, _ = _prune_actions(where, "--mismatched", *NP2, "--dry-run")
    assert sorted(n for n, e in acts.items() if e["action"] == "would_delete") == ["srv-fa-off.bin", "srv-kvq8.bin",
                                                                                   "srv-np1.bin"]
    acts, _ = _prune_actions(where, "--mismatched", *NP2)
    assert sorted(n for n, e in acts.items() if e["action"] == "deleted") == ["srv-fa-off.bin", "srv-kvq8.bin",
                                                                              "srv-np1.bin"]


def test_prune_broken_over_intact_np1_files_with_np2_flags_deletes_none_of_them(tmp_path):
    files = _mixed(tmp_path / "slots")
    _check_mismatch_and_broken(str(tmp_path / "slots"), files)
    assert not any(p.exists() for p in files.values())


def test_prune_broken_over_an_s3_prefix_keeps_the_mismatched_objects(seaweed, monkeypatch, tmp_path):
    """The issue's own case, on the real SeaweedFS: an s3:// prefix of intact -np 1 files and a damaged one."""
    from seaweed import BUCKET

    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in {**seaweed.env(), "HOME": str(seaweed.dir)}.items():
        monkeypatch.setenv(k, v)
    from slotctl.store.s3 import S3_STORE

    S3_STORE.reset()
    try:
        files = _mixed(tmp_path / "local")
        prefix = f"s3://{BUCKET}/broken-means-broken/"
        res = cli("cp", *files.values(), prefix, "--force")
        assert res.exit_code == 0, res.output
        _check_mismatch_and_broken(prefix, files)
        # a prefix behaves as a directory: empty now, it holds 0 files (exit 0); its sub-prefixes are named
        res = cli("ls", prefix, "--json")
        assert res.exit_code == 0 and json.loads(res.stdout)["files"] == [], res.output
        res = cli("prune", prefix, "--broken", *NP2, "--json")
        assert res.exit_code == 0 and json.loads(res.stdout)["files"] == [], res.output
        # nothing at all under a prefix: none there, as a missing directory (a store has no directories)
        res = cli("ls", f"s3://{BUCKET}/never-written/", "--json")
        assert res.exit_code == 2, res.output
        shutil.copyfile(DATA / "srv-np1.bin", tmp_path / "one.bin")
        assert cli("cp", tmp_path / "one.bin", prefix + "sub/").exit_code == 0
        doc = json.loads(cli("ls", prefix, "--json").stdout)
        assert doc["files"] == [] and doc["summary"]["prefixes"] == [prefix + "sub/"] and doc["exit_code"] == 0
        assert (prefix + "sub/") in " ".join(cli("ls", prefix).stdout.split())
    finally:
        S3_STORE.reset()


# -- operator edges (issue 24) ------------------------------------------------------------------------------


def test_a_pasted_server_command_line_and_its_slot_save_path(tmp_path):
    """llama-server's command line pasted as it is, its program path first: the rest is the server's (its -np
    is read, its other flags ignored), and its --slot-save-path is the directory when no path is given."""
    d = tmp_path / "slots"
    files = _mixed(d)
    line = ["/opt/llama/bin/llama-server", "-m", DATA / "target.gguf", "-c", "1024", "-np", "2", "--port", "8080",
            "-ngl", "99", "--slot-save-path", d]
    res = cli("ls", "--json", *line)
    assert res.exit_code == 1, res.output
    rows = {r["name"]: r["class"] for r in json.loads(res.stdout)["files"]}
    assert rows == {"srv-np1.bin": "mismatch", "srv-fa-off.bin": "mismatch", "srv-kvq8.bin": "mismatch",
                    "cut.bin": "broken"}
    res = cli("prune", "--broken", "--dry-run", "--json", *line)    # after the program, all is the server's
    acts = {Path(e["path"]).name: e["action"] for e in json.loads(res.stdout)["files"]}
    assert [n for n, a in acts.items() if a == "would_delete"] == ["cut.bin"], res.output
    res = cli("prune", "--broken")
    assert res.exit_code == 2 and "--slot-save-path" in res.output
    assert all(p.exists() for p in files.values())


def test_a_second_server_is_never_dropped_silently():
    for args in (["ls", "--server", "http://127.0.0.1:9", "--server", "http://127.0.0.1:10"],
                 ["erase", "--server", "http://127.0.0.1:9", "--server=http://127.0.0.1:10", "--slot", "0"],
                 ["keep", "--server", "http://127.0.0.1:9", "--server", "http://127.0.0.1:10", "--slot-dir", "."],
                 ["restore", "--server", "http://127.0.0.1:9", "--server", "http://127.0.0.1:10", "--slot", "0", "x.bin"],
                 ["migrate", "--from", "http://a:1", "--from", "http://b:1", "--to", "http://c:1", "--slot", "0",
                  "--from-dir", ".", "--to-dir", "."]):
        res = cli(*args)
        assert res.exit_code == 2 and "given 2 times" in res.output, (args, res.output)
    # slots takes several servers: each is listed, none dropped (not a usage error of this kind)
    assert "given 2 times" not in cli("slots", "--server", "http://127.0.0.1:9", "--server", "http://127.0.0.1:10",
                                      "--timeout", "1").output


def test_no_layer_shows_server_ok_beside_a_verdict_that_refuses():
    res = runner.invoke(app, ["validate", str(DATA / "srv-np1.bin"), "-m", str(DATA / "target.gguf"), "-kvu",
                              "--kv-unified-per-slot", "64"], env={"COLUMNS": "150"})
    assert res.exit_code == 1 and "the server refuses it" in res.stdout
    row = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("target memory"))
    assert row.split()[-2:] == ["not", "restored"] and " ok" not in row


class _DeleteOnSecondOpen:
    """Watches ``directory`` (Linux inotify, through ctypes): at the first file opened a second time (``ls``
    lists a directory by reading each file's first bytes, then reads the files), every file not yet opened a
    second time is deleted: gone between its listing and its read, as another process's prune would make it."""

    def __init__(self, directory: Path):
        import ctypes
        import threading

        self.dir = directory
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0 and libc.inotify_add_watch(self.fd, str(directory).encode(), 0x20) >= 0  # IN_OPEN
        self.opened: dict[str, int] = {}
        self.deleted: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        import select
        import struct

        while not self._stop.is_set():
            if not select.select([self.fd], [], [], 0.05)[0]:
                continue
            buf, i = os.read(self.fd, 1 << 16), 0
            while i < len(buf):
                _wd, _mask, _cookie, n = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16:i + 16 + n].rstrip(b"\0").decode()
                i += 16 + n
                self.opened[name] = self.opened.get(name, 0) + 1
                if name and self.opened[name] == 2 and not self.deleted:
                    for p in sorted(self.dir.iterdir()):
                        if p.name != name and self.opened.get(p.name, 0) < 2:
                            p.unlink()
                            self.deleted.append(str(p))

    def close(self) -> None:
        self._stop.set()
        self.thread.join()
        os.close(self.fd)


def test_ls_skips_a_file_deleted_between_its_listing_and_its_read(tmp_path):
    """A directory of 40 slot files, 39 of them deleted after ls listed them and before it read them (issue
    36: ls --json exited 2): ls --json exits 0 listing the one left, its summary counts the 39 vanished; for
    people, a note for each on stderr and the count in the last line. A file named on the command line that
    is missing is still an error of its own (exit 2)."""
    from slotctl.sample import SLOT_FILE

    import json_schemas

    env = {**os.environ, "SLOTCTL_NO_PROGRESS": "1"}
    for human in (False, True):
        d = tmp_path / f"slots-{human}"
        d.mkdir()
        for i in range(40):
            shutil.copy(SLOT_FILE, d / f"s{i:03d}.bin")
        watch = _DeleteOnSecondOpen(d)
        try:
            r = subprocess.run([sys.executable, "-m", "slotctl", "ls", str(d), "--no-cache", "--jobs", "1",
                                *([] if human else ["--json"])], capture_output=True, text=True, timeout=300, env=env)
        finally:
            watch.close()
        assert len(watch.deleted) == 39, watch.opened
        assert r.returncode == 0, (r.stdout, r.stderr)
        if human:
            notes = [x for x in r.stderr.splitlines() if "gone since it was listed" in x]
            assert sorted(n.split("note: ", 1)[1].split(": gone")[0] for n in notes) == sorted(watch.deleted), r.stderr
            assert "39 file(s) gone since they were listed, skipped" in r.stdout, r.stdout
        else:
            doc = json.loads(r.stdout)
            json_schemas.check("ls", doc)
            assert doc["summary"]["vanished"] == 39 and doc["summary"]["files"] == len(doc["files"]) == 1, doc
            assert doc["exit_code"] == 0 and not [f for f in doc["files"] if f.get("error")]
    r = subprocess.run([sys.executable, "-m", "slotctl", "ls", str(tmp_path / "missing.bin"), "--json"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and json.loads(r.stdout)["files"][0]["error"]["code"] == "no_such_file", r.stdout
