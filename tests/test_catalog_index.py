"""The catalog's index on disk (SQLite, slotctl.catalog.Index): a file whose identity has not changed is
not read again; a changed, too young, corrupt or foreign index entry is never trusted.

The files are real llama-server b11434 saves (tests/data). Which files were read is observed through
``slotctl.catalog.rows._Worker.row`` (the only place a row is made from a file).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import DATA
from slotctl import catalog as cat
from slotctl.catalog import rows as made
from slotctl.cli.app import app

runner = CliRunner()
FILES = ["srv-np1.bin", "srv-kvq8.bin", "srv-draft.bin", "srv-np2-slot1.bin"]


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOTCTL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def index_of(d) -> str:
    return cat.index_path(str(d))


@pytest.fixture
def slots(tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    old = time.time() - 3600
    for n in FILES:
        shutil.copy(DATA / n, d / n)
        os.utime(d / n, (old, old))
    return d


@pytest.fixture
def reads(monkeypatch):
    """The paths rows were made from (files read), in order."""
    seen: list[str] = []
    real = made._Worker.row

    def row(self, path, now):
        seen.append(os.path.basename(path))
        return real(self, path, now)

    monkeypatch.setattr(made._Worker, "row", row)
    return seen


def rows(d, **kw):
    return list(cat.catalog(sorted(str(p) for p in d.glob("*.bin")), processes=1, **kw))


def without_age(rs):
    return [{k: v for k, v in r.items() if k != "age_seconds"} for r in rs]


def test_unchanged_files_are_not_read_again(slots, reads):
    first = rows(slots)
    assert sorted(reads) == sorted(FILES)
    assert os.path.exists(index_of(slots)) and not (slots / cat.INDEX_NAME).exists()   # ls writes no file there
    reads.clear()
    second = rows(slots)
    assert reads == []
    assert without_age(json.loads(json.dumps(second))) == without_age(json.loads(json.dumps(first)))
    # --no-cache (index=False) reads every one
    rows(slots, index=False)
    assert sorted(reads) == sorted(FILES)


def test_a_changed_file_is_read_again(slots, reads):
    rows(slots)
    reads.clear()
    p = slots / "srv-kvq8.bin"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])       # another size, mtime and ctime: its identity changed
    old = time.time() - 3600
    os.utime(p, (old, old))                     # even with the old mtime back
    got = {r["name"]: r for r in rows(slots)}
    assert reads == ["srv-kvq8.bin"]
    assert got["srv-kvq8.bin"]["size"] == len(data) // 2
    # a file replaced by another of the same size and mtime (another inode) is read again too
    reads.clear()
    q = slots / "tmp"
    shutil.copy(DATA / "srv-np1.bin", q)
    st = (slots / "srv-np1.bin").stat()
    os.utime(q, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(q, slots / "srv-np1.bin")
    rows(slots)
    assert reads == ["srv-np1.bin"]


def test_a_row_younger_than_the_file_s_granularity_is_read_again(tmp_path, reads, monkeypatch):
    d = tmp_path / "young"
    d.mkdir()
    shutil.copy(DATA / "srv-np1.bin", d / "a.bin")     # modified now: its row is not trusted yet
    rows(d)
    rows(d)
    assert reads == ["a.bin", "a.bin"]
    monkeypatch.setenv("SLOTCTL_RACY_SECONDS", "0")      # the tests' rule: a row is trusted however young
    rows(d)
    assert reads == ["a.bin", "a.bin"]


def sql(path, statement: str) -> None:
    con = sqlite3.connect(path)
    con.execute(statement)
    con.commit()
    con.close()


def test_a_corrupt_or_foreign_index_is_rebuilt_never_trusted(slots, reads):
    first = rows(slots)
    from pathlib import Path

    ix = Path(index_of(slots))
    # another version: rebuilt (every file read again), and right after
    sql(ix, "PRAGMA user_version=99")
    reads.clear()
    assert without_age(rows(slots)) == without_age(first)
    assert sorted(reads) == sorted(FILES)
    # rows doctored in the index are never shown once their file's identity disagrees
    sql(ix, "UPDATE files SET identity = 'x', row = '{\"verdict\": \"restores\"}'")
    reads.clear()
    assert without_age(rows(slots)) == without_age(first)
    assert sorted(reads) == sorted(FILES)
    # a row that is no JSON object, its identity intact: never shown, the file read again
    rows(slots)
    sql(ix, "UPDATE files SET row = '{not json'")
    reads.clear()
    assert without_age(rows(slots)) == without_age(first) and sorted(reads) == sorted(FILES)
    sql(ix, "UPDATE files SET row = '[1, 2]'")
    reads.clear()
    assert without_age(rows(slots)) == without_age(first) and sorted(reads) == sorted(FILES)
    # garbage: rebuilt
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(str(ix) + suffix):
            os.unlink(str(ix) + suffix)
    ix.write_bytes(b"not a database at all" * 100)
    reads.clear()
    assert without_age(rows(slots)) == without_age(first)
    assert sorted(reads) == sorted(FILES)
    reads.clear()
    rows(slots)
    assert reads == []


def test_another_question_is_another_row(slots, reads):
    from slotctl.validate import ServerSetup

    rows(slots)
    reads.clear()
    rows(slots, request=cat.Request(setup=ServerSetup()))    # a server given: judged again
    assert sorted(reads) == sorted(FILES)


def test_ls_uses_it_and_does_not_list_it(slots, reads):
    res = runner.invoke(app, ["ls", str(slots), "--json"])
    first = json.loads(res.stdout)
    reads.clear()
    res = runner.invoke(app, ["ls", str(slots), "--json"])
    second = json.loads(res.stdout)
    assert reads == []
    assert without_age(second["files"]) == without_age(first["files"])
    assert second["summary"] == first["summary"]
    assert os.path.exists(index_of(slots))
    res = runner.invoke(app, ["ls", str(slots), "--json", "--no-cache"])
    assert sorted(reads) == sorted(FILES)
    assert without_age(json.loads(res.stdout)["files"]) == without_age(first["files"])


def test_tokens_kept_for_prefix_lookups(tmp_path):
    ix = cat.Index(cat.index_path(str(tmp_path), beside=True))
    assert ix.path == str(tmp_path / cat.INDEX_NAME)
    p = tmp_path / "s.bin"
    p.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(p, (old, old))
    st = p.stat()
    toks = np.arange(1000, dtype=np.int32)
    ix.put("tokens", [(str(p), cat.local_identity(st), st.st_mtime_ns, cat.Cached(None, "kv", toks, "m0"))])
    got = ix.get([str(p)], "tokens", {str(p): cat.local_identity(st)})[str(p)]
    assert got.kind == "kv" and got.model == "m0" and np.array_equal(got.tokens, toks)
    assert ix.get([str(p)], "tokens", {str(p): "another"}) == {}
    ix.close()


@pytest.fixture
def opened(monkeypatch):
    """The paths whose first bytes a directory listing read (to tell slot files from the rest)."""
    import slotctl.inputs as inputs
    import slotctl.sources as sources

    seen: list[str] = []
    real = sources.first_bytes

    def first_bytes(paths, n=4):
        seen.extend(os.path.basename(p) for p in paths)
        return real(paths, n)

    monkeypatch.setattr(inputs, "first_bytes", first_bytes)
    monkeypatch.setattr(sources, "first_bytes", first_bytes)     # prune's scan
    return seen


def test_ls_of_an_unchanged_directory_opens_no_file(slots, reads, opened):
    (slots / "README.md").write_text("not a slot file")
    old = time.time() - 3600
    os.utime(slots / "README.md", (old, old))
    first = runner.invoke(app, ["ls", str(slots), "--json"])
    assert sorted(opened) == sorted(FILES + ["README.md"]) and sorted(reads) == sorted(FILES)
    opened.clear(), reads.clear()
    second = runner.invoke(app, ["ls", str(slots), "--json"])
    assert opened == [] and reads == []       # neither opened to tell what it is nor parsed
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert b["summary"] == a["summary"] and b["summary"]["skipped"] == 1
    assert without_age(b["files"]) == without_age(a["files"])
    # the human listing too, and --no-cache opens and reads every one again
    assert runner.invoke(app, ["ls", str(slots)]).exit_code == first.exit_code and opened == [] and reads == []
    runner.invoke(app, ["ls", str(slots), "--no-cache"])
    assert sorted(opened) == sorted(FILES + ["README.md"]) and sorted(reads) == sorted(FILES)


def test_a_file_named_on_its_own_stays_out_of_its_directory(slots, reads, opened):
    """A README named alone gets a row (ls says what the server does with it: refused); listed with its
    directory it is still no slot file, from its first bytes as the index keeps them."""
    readme = slots / "README.md"
    readme.write_text("not a slot file")
    old = time.time() - 3600
    os.utime(readme, (old, old))
    alone = json.loads(runner.invoke(app, ["ls", str(readme), "--json"]).stdout)
    assert alone["summary"]["files"] == 1 and alone["files"][0]["verdict"] == "refused"
    for _ in range(2):
        d = json.loads(runner.invoke(app, ["ls", str(slots), "--json"]).stdout)
        assert d["summary"]["files"] == len(FILES) and d["summary"]["skipped"] == 1
        assert "README.md" not in [r["name"] for r in d["files"]]


def test_a_file_that_becomes_a_slot_file_is_looked_at_again(slots, reads, opened):
    other = slots / "notes.dat"
    other.write_bytes(b"hello there")
    old = time.time() - 3600
    os.utime(other, (old, old))
    for _ in range(2):
        assert json.loads(runner.invoke(app, ["ls", str(slots), "--json"]).stdout)["summary"]["skipped"] == 1
    opened.clear(), reads.clear()
    other.write_bytes((DATA / "srv-np1.bin").read_bytes())     # now a slot file: another identity
    os.utime(other, (old, old))
    d = json.loads(runner.invoke(app, ["ls", str(slots), "--json"]).stdout)
    assert opened == ["notes.dat"] and reads == ["notes.dat"]
    assert d["summary"]["skipped"] == 0 and "notes.dat" in [r["name"] for r in d["files"]]


def test_plain_lines_are_the_lines_rich_prints(slots, monkeypatch):
    """On a pipe the listing is written as plain lines (no rich work per row): the same text rich prints,
    at every width, with names that fold (wide characters, escapes) and errors that wrap."""
    import io

    from slotctl.cli.ls_cmd import _Cells, _Totals
    from slotctl.cli.output import Output

    base = rows(slots)
    names = ["a.bin", "x" * 150 + ".bin", "名前の長いファイル" * 6 + ".bin", "tab\tand\x1b[31m.bin", "e\u0301" * 40]
    errors = [None, "short", "a long message that wraps " * 9, "y" * 230, "名前 " * 50]
    many = []
    for i in range(40):
        r = dict(base[i % len(base)], name=names[i % len(names)], path=names[i % len(names)])
        if errors[i % len(errors)]:
            r["error"] = {"code": "x", "message": errors[i % len(errors)]}
        many.append(r)
    from rich.cells import cell_len

    for width in (30, 60, 80, 120, 200):
        monkeypatch.setenv("COLUMNS", str(width))
        printed = []
        for plain in (False, True):
            buf = io.StringIO()
            out = Output(stdout=buf)
            assert out.console.width == width
            cells, totals = _Cells(show_reuse=False, names=True), _Totals(0)
            for r in many:
                totals.seen(r), totals.add(r), cells.add(r)
            import unittest.mock

            with unittest.mock.patch.object(Output, "plain", plain):
                cells.render(out, totals, broken=False)
            printed.append(buf.getvalue())
        assert printed[1] == printed[0], width
        assert max(cell_len(line) for line in printed[1].splitlines()) <= width


def test_an_s3_prefix_unchanged_is_listed_without_reading_an_object(s3, reads, opened, cache_home, monkeypatch):
    """Objects under a prefix of the real SeaweedFS: the listing's ETag, size and Last-Modified are each
    object's identity; the index is under the user's cache directory. An object's Last-Modified is when it was
    put: its row is trusted at once under the rule 0 s (SLOTCTL_RACY_SECONDS; 3 s would be a wait)."""
    import obstore
    from seaweed import BUCKET

    monkeypatch.setenv("SLOTCTL_RACY_SECONDS", "0")

    prefix = f"s3://{BUCKET}/catalog25/"
    for n in FILES:
        obstore.put(s3.client(), f"catalog25/{n}", (DATA / n).read_bytes())
    obstore.put(s3.client(), "catalog25/README.md", b"not a slot file")
    first = runner.invoke(app, ["ls", prefix, "--json"])
    assert first.exit_code == 0, first.output
    assert sorted(reads) == sorted(FILES) and sorted(opened) == sorted(FILES + ["README.md"])
    assert os.path.exists(cat.index_path(prefix)) and str(cache_home) in cat.index_path(prefix)
    reads.clear(), opened.clear()
    second = runner.invoke(app, ["ls", prefix, "--json"])
    assert reads == [] and opened == []          # no object read, not even its first bytes
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert b["summary"] == a["summary"] and without_age(b["files"]) == without_age(a["files"])
    # an object written again (another ETag and Last-Modified) is read again; the others are not
    obstore.put(s3.client(), "catalog25/srv-kvq8.bin", (DATA / "srv-kvq8.bin").read_bytes()[:1000])
    third = json.loads(runner.invoke(app, ["ls", prefix, "--json"]).stdout)
    assert reads == ["srv-kvq8.bin"] and opened == ["srv-kvq8.bin"]
    assert {r["name"]: r["damaged"] for r in third["files"]}["srv-kvq8.bin"] is True
    # --no-cache reads every one
    reads.clear(), opened.clear()
    runner.invoke(app, ["ls", prefix, "--json", "--no-cache"])
    assert sorted(reads) == sorted(FILES) and sorted(opened) == sorted(FILES + ["README.md"])


def test_prune_reads_only_what_changed_and_forgets_what_it_deletes(slots, reads, opened):
    """prune: whether a file is a slot file, and its verdict for --broken, from the catalog for a file whose
    identity has not changed; a file it deletes leaves the index; --no-cache reads every one."""
    (slots / "README.md").write_text("not a slot file")
    cut = slots / "cut.bin"
    data = (DATA / "srv-np1.bin").read_bytes()
    cut.write_bytes(data[:1000])                   # broken: damaged (cut in its tokens)
    old = time.time() - 3600
    for p in (slots / "README.md", cut):
        os.utime(p, (old, old))
    listed = runner.invoke(app, ["ls", str(slots), "--json"])
    assert json.loads(listed.stdout)["summary"]["classes"]["broken"] == 1
    reads.clear(), opened.clear()
    res = runner.invoke(app, ["prune", str(slots), "--broken", "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    assert reads == [] and opened == []            # ls's rows and first bytes: nothing opened, nothing parsed
    doc = json.loads(res.stdout)
    assert [f["path"] for f in doc["files"] if f["action"] == "would_delete"] == [str(cut)]
    assert {f["path"]: f["action"] for f in doc["files"]}[str(slots / "README.md")] == "skipped"
    res = runner.invoke(app, ["prune", str(slots), "--max-size", "1", "--dry-run", "--json"])
    assert opened == [] and reads == []
    # deleted for real: its row and first bytes leave the index
    res = runner.invoke(app, ["prune", str(slots), "--broken", "--json"])
    assert [f["path"] for f in json.loads(res.stdout)["files"] if f["action"] == "deleted"] == [str(cut)]
    con = sqlite3.connect(index_of(slots))
    for table in ("files", "heads"):
        assert con.execute(f"SELECT count(*) FROM {table} WHERE path = ?", (str(cut),)).fetchone()[0] == 0
        assert con.execute(f"SELECT count(*) FROM {table}").fetchone()[0] > 0
    con.close()
    assert reads == [] and opened == []
    # --no-cache: every file opened and judged again
    res = runner.invoke(app, ["prune", str(slots), "--broken", "--dry-run", "--no-cache", "--json"])
    assert sorted(opened) == sorted(FILES + ["README.md"]) and sorted(reads) == sorted(FILES)


def test_an_index_a_killed_process_held_locked_is_used_as_it_was(slots, reads):
    """A process killed inside a write transaction (SIGKILL: no rollback, its WAL frames left) holds no lock
    once dead (SQLite's locks die with it) and its uncommitted rows are never read: the next run uses what
    was committed."""
    import signal
    import subprocess
    import sys

    first = rows(slots)
    reads.clear()
    script = ("import os, signal, sqlite3, sys\n"
              "con = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
              "con.execute('BEGIN IMMEDIATE')\n"
              "con.execute('UPDATE files SET row = ?', ('{}',))\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    child = subprocess.run([sys.executable, "-c", script, index_of(slots)], capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    again = rows(slots)
    assert reads == []
    assert without_age(again) == without_age(first)


def test_a_file_written_just_now_is_opened_and_read_every_time(slots, reads, opened):
    """Neither the first bytes nor the row of a file changed less than 3 s before they were read is trusted
    (it may change again within its mtime's granularity); its neighbours are."""
    runner.invoke(app, ["ls", str(slots), "--json"])
    shutil.copy(DATA / "srv-np1.bin", slots / "new.bin")       # modified now
    for _ in range(2):
        opened.clear(), reads.clear()
        d = json.loads(runner.invoke(app, ["ls", str(slots), "--json"]).stdout)
        assert opened == ["new.bin"] and reads == ["new.bin"]
        assert d["summary"]["files"] == len(FILES) + 1


def test_a_verdict_is_read_back_only_for_its_question_identity_and_a_whole_row(tmp_path):
    """Index.verdict / put_verdict (keep's refusals, serve's verdicts): the dict kept is given back for the
    same question and identity once made long enough after the file changed; another question or identity,
    a racy row, or a row a damaged index holds (not JSON, not an object, a tokens blob of the wrong length)
    gives nothing, and the index stays usable."""
    ix = cat.Index(str(tmp_path / "ix.sqlite"))
    now = time.time_ns()
    old = now - 3600 * 10**9
    ix.put_verdict("/s/a.bin", "serve:q", "1:2:3:4:5", old, {"verdict": "restores"}, read_ns=now)
    ix.put_verdict("/s/b.bin", "serve:q", "1:2:3:4:6", now - 10**9, {"verdict": "refused"}, read_ns=now)
    assert ix.verdict("/s/a.bin", "serve:q", "1:2:3:4:5") == {"verdict": "restores"}
    assert ix.verdict("/s/a.bin", "serve:other", "1:2:3:4:5") is None
    assert ix.verdict("/s/a.bin", "serve:q", "1:2:3:4:7") is None
    assert ix.verdict("/s/b.bin", "serve:q", "1:2:3:4:6") is None        # made 1 s after its file changed
    for row, tokens in (("{not json", None), ("[1, 2]", None), ('{"verdict": "restores"}', b"\x01\x02\x03")):
        ix._conn.execute("UPDATE files SET row = ?, tokens = ? WHERE path = '/s/a.bin'", (row, tokens))
        assert ix.verdict("/s/a.bin", "serve:q", "1:2:3:4:5") is None and ix.usable, row
    ix.close()


def test_one_index_is_shared_by_threads(tmp_path):
    """serve judges and indexes in worker threads over one Index: transactions and reads from several threads
    at once never give the index up."""
    import threading

    ix = cat.Index(str(tmp_path / "ix.sqlite"))
    old = time.time_ns() - 3600 * 10**9
    failed: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(150):
                path = f"/s/{n}-{i}.bin"
                ix.put_verdict(path, "serve:q", f"id{i}", old, {"n": n, "i": i}, read_ns=time.time_ns())
                assert ix.verdict(path, "serve:q", f"id{i}") == {"n": n, "i": i}
                ix.get([path], "tokens", {path: f"id{i}"})
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == [] and ix.usable, failed
    ix.close()
