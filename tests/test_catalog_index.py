"""The catalog's index on disk (SQLite, slotctl.catalog.Index): a file whose identity has not changed is
not read again; a changed, too young, corrupt or foreign index entry is never trusted.

The files are real llama-server b11434 saves (tests/data). Which files were read is observed through
``slotctl.catalog._Worker.row`` (the only place a row is made from a file).
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
    real = cat._Worker.row

    def row(self, path, now):
        seen.append(os.path.basename(path))
        return real(self, path, now)

    monkeypatch.setattr(cat._Worker, "row", row)
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


def test_a_row_younger_than_the_file_s_granularity_is_read_again(tmp_path, reads):
    d = tmp_path / "young"
    d.mkdir()
    shutil.copy(DATA / "srv-np1.bin", d / "a.bin")     # modified now: its row is not trusted yet
    rows(d)
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
