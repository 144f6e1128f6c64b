"""Slot files in object storage (``s3://``), against a real S3 server: SeaweedFS (tests/seaweed.py), never a
mock. inspect, validate and ls of an object answer as of the local file; errors are one line, exit 2, and
never show a credential; reads are pinned to the object's ETag."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seaweed import BUCKET, SECRET_KEY, Seaweed, next_second, put, weed_binary
from slotctl.cli.app import app
from slotctl.errors import UsageError

DATA = Path(__file__).parent / "data"
#: every slot file of the tests, written by a real llama-server
FILES = sorted(DATA.glob("*.bin")) + sorted((DATA / "kinds").glob("*.bin"))
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "100", "NO_COLOR": "1"})


def _without_paths(doc):
    if isinstance(doc, dict):
        return {k: _without_paths(v) for k, v in doc.items() if k not in ("path", "name", "mtime", "atime",
                                                                             "age_seconds")}
    if isinstance(doc, list):
        return [_without_paths(v) for v in doc]
    return doc


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_inspect_validate_ls_of_an_object_equal_those_of_the_file(s3, path):
    model = DATA / "target.gguf" if path.parent == DATA else path.with_name(path.stem.removeprefix("srv-") + ".gguf")
    url = put(s3, f"same/{path.name}", path.read_bytes())
    for args in (["inspect", "--json"], ["inspect", "--json", "-m", str(model)], ["validate", "--json"],
                 ["validate", "--json", "-m", str(model), "--no-load"], ["ls", "--json"]):
        local, remote = run(*args, str(path)), run(*args, url)
        assert remote.exit_code == local.exit_code, (args, remote.output)
        a, b = json.loads(local.stdout), json.loads(remote.stdout)
        assert _without_paths(a) == _without_paths(b), args
        assert b["files"][0]["path"] == url


def test_a_prefix_is_a_directory(s3, tmp_path):
    for p in FILES[:3]:
        put(s3, f"dir/{p.name}", p.read_bytes())
    put(s3, "dir/README.md", b"not a slot file")
    put(s3, "dir/sub/deeper.bin", FILES[0].read_bytes())    # not listed: a directory is not recursive
    r = run("ls", "--json", f"s3://{BUCKET}/dir/")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [f["name"] for f in doc["files"]] == [p.name for p in FILES[:3]]
    assert doc["summary"]["skipped"] == 1
    r = run("inspect", "--json", f"s3://{BUCKET}/dir")   # without the slash too
    assert [f["path"] for f in json.loads(r.stdout)["files"]] == [f"s3://{BUCKET}/dir/{p.name}" for p in FILES[:3]]
    r = run("validate", "--json", f"s3://{BUCKET}/dir/")
    assert json.loads(r.stdout)["summary"]["skipped"] == 1


def test_a_damaged_object_is_damaged_not_unreadable(s3):
    data = FILES[0].read_bytes()
    url = put(s3, "damaged/cut.bin", data[: len(data) // 2])
    r = run("inspect", "--json", url)
    assert r.exit_code == 1
    assert json.loads(r.stdout)["files"][0]["damaged"] is True


def _error(r) -> str:
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output and SECRET_KEY not in r.output
    return lines[0]


def test_errors_are_one_line_exit_2_without_credentials(s3, monkeypatch):
    url = put(s3, "err/a.bin", FILES[0].read_bytes())
    assert "no such object" in _error(run("inspect", f"s3://{BUCKET}/err/missing.bin"))
    assert "no such bucket" in _error(run("inspect", "s3://no-such-bucket/a.bin"))
    from slotctl.store.s3 import S3_STORE

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-0000")
    S3_STORE.reset()
    line = _error(run("inspect", url))
    assert "credentials" in line or "secret" in line
    assert "wrong-secret-0000" not in line
    S3_STORE.reset()
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert "no credentials" in _error(run("ls", url))
    S3_STORE.reset()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "some-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "some-secret-key")
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # nothing listens there now
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    line = _error(run("inspect", url))
    assert "does not answer" in line
    for bad in ("http://[bad", "http://host:port", "ftp://host"):   # obstore panics on some: refused first
        monkeypatch.setenv("AWS_ENDPOINT_URL", bad)
        S3_STORE.reset()
        assert "expected an http:// or https:// URL" in _error(run("inspect", url))


def test_json_error_document(s3):
    r = run("inspect", "--json", f"s3://{BUCKET}/err/missing.bin")
    assert r.exit_code == 2
    assert json.loads(r.stdout)["files"][0]["error"]["code"] == "no_such_file"


def test_profile_files_are_read(s3, monkeypatch, tmp_path):
    url = put(s3, "prof/a.bin", FILES[0].read_bytes())
    aws = tmp_path / ".aws"
    aws.mkdir()
    (aws / "credentials").write_text(f"[ci]\naws_access_key_id = {s3.env()['AWS_ACCESS_KEY_ID']}\n"
                                     f"aws_secret_access_key = {SECRET_KEY}\n")
    (aws / "config").write_text(f"[profile ci]\nregion = us-east-1\nendpoint_url = {s3.endpoint}\n")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_PROFILE", "ci")
    from slotctl.store.s3 import S3_STORE

    S3_STORE.reset()
    r = run("inspect", "--json", url)
    assert r.exit_code == 0, r.output
    monkeypatch.setenv("AWS_PROFILE", "nope")
    S3_STORE.reset()
    assert "no such profile" in _error(run("inspect", url))


def test_plain_http_only_when_the_endpoint_says_so(s3, monkeypatch):
    from slotctl.store.config import Config

    assert Config().allow_http is True       # http://127.0.0.1:PORT
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.example.invalid")
    assert Config().allow_http is False
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    assert Config().allow_http is True


def test_an_object_replaced_while_read_stops_the_read(s3):
    import slotctl.store.s3  # noqa: F401 - the s3 scheme
    from slotctl.errors import UsageError
    from slotctl.sources import open_input

    big = bytes(range(256)) * 4096    # 1 MiB: the first read holds only its head
    url = put(s3, "replaced/a.bin", big)
    with open_input(url) as f:
        assert f.read(16) == big[:16]
        put(s3, "replaced/a.bin", big[::-1])
        f.seek(512 << 10)
        with pytest.raises(UsageError) as e:
            f.read(100)
    assert e.value.code == "object_changed" and "replaced" in str(e.value)


def test_a_store_gone_mid_read_is_an_io_error(tmp_path, monkeypatch):
    """A second server, stopped between the first read and the next: exit 2, one line, not "damaged"."""
    srv = Seaweed(tmp_path, weed_binary())
    srv.start()
    try:
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        from slotctl.store.s3 import S3_STORE
        from slotctl.slotfile import read_slot_file
        from slotctl.sources import open_input
        from slotctl.errors import UsageError

        S3_STORE.reset()
        data = FILES[0].read_bytes() + bytes(1 << 20)   # trailing bytes: the walk reads past the first read
        url = put(srv, "gone/a.bin", data)
        with open_input(url) as f:
            srv.stop()
            with pytest.raises(UsageError) as e:
                read_slot_file(f, url)
        assert e.value.code == "store_unreachable"
    finally:
        srv.stop()
        S3_STORE.reset()


# -- cp ----------------------------------------------------------------------------------------------------


def _get(srv: Seaweed, key: str) -> bytes:
    import obstore

    return bytes(obstore.get(srv.client(), key).bytes())


def _exists(srv: Seaweed, key: str) -> bool:
    import obstore

    try:
        obstore.head(srv.client(), key)
        return True
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_cp_there_and_back_is_byte_identical(s3, path, tmp_path):
    url = f"s3://{BUCKET}/cp/{path.name}"
    r = run("cp", "--json", str(path), url)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["files"][0]
    assert doc["status"] == "copied" and doc["method"] == "put" and doc["checksum"] == "md5"
    assert _get(s3, f"cp/{path.name}") == path.read_bytes()
    r = run("cp", "--json", url, f"s3://{BUCKET}/cp-again/")          # S3 to S3, server-side
    assert r.exit_code == 0 and json.loads(r.stdout)["files"][0]["method"] == "server_copy", r.output
    back = tmp_path / "back.bin"
    r = run("cp", "--json", f"s3://{BUCKET}/cp-again/{path.name}", str(back))
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["files"][0]["checksum"] == "md5"
    assert back.read_bytes() == path.read_bytes()


def test_a_refused_cp_leaves_the_object_unchanged(s3, tmp_path):
    good, other = FILES[0].read_bytes(), FILES[1].read_bytes()
    url = put(s3, "refused/a.bin", good)
    src = tmp_path / "a.bin"
    src.write_bytes(other)
    r = run("cp", "--json", str(src), url)                    # exists: refused without --overwrite
    assert r.exit_code == 2 and json.loads(r.stdout)["files"][0]["error"]["code"] == "exists"
    assert _get(s3, "refused/a.bin") == good
    damaged = tmp_path / "damaged.bin"
    damaged.write_bytes(other[: len(other) // 2])
    r = run("cp", "--json", "--overwrite", str(damaged), url)   # damaged: refused without --force
    assert r.exit_code == 1 and json.loads(r.stdout)["files"][0]["status"] == "refused"
    assert _get(s3, "refused/a.bin") == good
    r = run("cp", "--overwrite", str(src), url)
    assert r.exit_code == 0 and _get(s3, "refused/a.bin") == other
    r = run("cp", "--force", str(damaged), f"s3://{BUCKET}/refused/d.bin")
    assert r.exit_code == 0 and _get(s3, "refused/d.bin") == damaged.read_bytes()
    local = tmp_path / "local.bin"
    local.write_bytes(b"keep me")
    r = run("cp", url, str(local))                             # a local destination is not overwritten either
    assert r.exit_code == 2 and local.read_bytes() == b"keep me"


def _large_slot_file(path: Path, mib: int) -> int:
    """A valid slot file of about ``mib`` MiB, sparse (its tensor bytes are a hole): benchmarks/bench_inspect's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_inspect", Path(__file__).parents[1] / "benchmarks"
                                                  / "bench_inspect.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = max(256, (mib << 20) // (17 * 8192))   # 8 layers of 4,096 cells, K and V: target, checkpoint, draft
    return mod.build(str(path), layers=8, cells=4096, row=row)


def test_cp_to_another_bucket_is_server_side_conditional_and_byte_identical(s3, tmp_path):
    """S3 to S3 across buckets: a multipart upload of part copies in the destination bucket (no byte through
    this machine: no GET of the object's data beyond the metadata), refused when the destination exists
    (the completion's If-None-Match), replaced with --overwrite."""
    from slotctl.sources import TOTALS

    s3.make_bucket("other")
    src = tmp_path / "large.bin"
    size = _large_slot_file(src, 24)
    import obstore

    with open(src, "rb") as f:
        obstore.put(s3.client(), "across/large.bin", f, chunk_size=16 << 20)
    url, dst = f"s3://{BUCKET}/across/large.bin", "s3://other/copied/large.bin"
    for k in TOTALS:
        TOTALS[k] = 0
    r = run("cp", "--json", url, dst)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["files"][0]
    assert doc["status"] == "copied" and doc["method"] == "server_copy" and doc["size"] == size
    assert TOTALS["bytes"] < 1 << 20, TOTALS      # the metadata only: the copy's bytes never came here
    assert bytes(obstore.get(s3.client("other"), "copied/large.bin").bytes()) == src.read_bytes()
    small = FILES[0].read_bytes()
    other = put(s3, "across/small.bin", small)
    r = run("cp", "--json", other, dst)                             # exists: refused, left as it is
    assert r.exit_code == 2 and json.loads(r.stdout)["files"][0]["error"]["code"] == "exists", r.output
    assert bytes(obstore.get(s3.client("other"), "copied/large.bin").bytes()) == src.read_bytes()
    r = run("cp", "--json", "--overwrite", other, dst)
    assert r.exit_code == 0 and json.loads(r.stdout)["files"][0]["method"] == "server_copy", r.output
    assert bytes(obstore.get(s3.client("other"), "copied/large.bin").bytes()) == small


def test_a_conditional_cross_bucket_copy_loses_to_a_writer(s3, tmp_path):
    """The copy's existence check and its completion are two steps: a writer that creates the destination
    between them wins, and the copy is refused by the completion's If-None-Match (exists), never replacing
    it."""
    from slotctl.store.s3copy import copy_object
    from slotctl.store.s3 import S3_STORE

    s3.make_bucket("other")
    url = put(s3, "race/a.bin", FILES[0].read_bytes())
    import obstore

    obstore.put(s3.client("other"), "race/a.bin", b"the writer's")
    etag = obstore.head(s3.client(), "race/a.bin")["e_tag"]
    with pytest.raises(UsageError) as e:
        copy_object(S3_STORE.config, url, etag, "s3://other/race/a.bin", len(FILES[0].read_bytes()),
                    if_none_match=True)
    assert e.value.code == "exists"
    assert bytes(obstore.get(s3.client("other"), "race/a.bin").bytes()) == b"the writer's"


def test_a_large_cp_goes_in_parts_and_back(s3, tmp_path):
    src = tmp_path / "large.bin"
    size = _large_slot_file(src, 40)
    assert size > 32 << 20
    url = f"s3://{BUCKET}/large/large.bin"
    r = run("cp", "--json", str(src), url)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["files"][0]
    assert doc["method"] == "multipart+copy" and doc["checksum"] == "md5" and doc["size"] == size
    import obstore

    keys = [m["path"] for b in obstore.list(s3.client(), prefix="large/") for m in b]
    assert keys == ["large/large.bin"]          # the temporary key is gone
    back = tmp_path / "back.bin"
    assert run("cp", url, str(back)).exit_code == 0
    assert back.read_bytes() == src.read_bytes()
    r = run("cp", "--json", "--overwrite", str(src), url)
    assert json.loads(r.stdout)["files"][0]["method"] == "multipart", r.output


def _record_part_copies(monkeypatch) -> list[tuple[str, int]]:
    """Every ``UploadPartCopy`` slotctl asks the store for, as (key, bytes of its range), recorded on the way
    to the real store (the requests go through unchanged)."""
    from slotctl.store import s3copy

    asked: list[tuple[str, int]] = []
    real = s3copy.Signed.request

    def request(self, method, key, query, headers=None, body=b"", **kw):
        rng = (headers or {}).get("x-amz-copy-source-range")
        if method == "PUT" and rng:
            first, last = map(int, rng.removeprefix("bytes=").split("-"))
            asked.append((key, last - first + 1))
        return real(self, method, key, query, headers, body, **kw)

    monkeypatch.setattr(s3copy.Signed, "request", request)
    return asked


def test_copies_within_one_bucket_go_in_parts_of_at_most_5_gib(s3, tmp_path, monkeypatch):
    """S3 allows at most 5 GiB per copy part: an upload's copy from its temporary key and an S3-to-S3 copy
    in one bucket ask for parts of at most s3copy.MAX_PART each (set to 6 MiB here, so a 24 MiB object
    takes several), as the cross-bucket copy does; the results are byte-identical."""
    from slotctl.store import s3copy

    assert s3copy.MAX_PART == 5 << 30            # S3's bound; the 5.2 GiB object of the report: 2 parts
    assert [n for _, n in s3copy.parts_for(5_554_428_496)] == [2_777_214_248] * 2
    asked = _record_part_copies(monkeypatch)
    monkeypatch.setattr(s3copy, "MAX_PART", 6 << 20)
    src = tmp_path / "large.bin"
    size = _large_slot_file(src, 24)
    want = -(-size // (6 << 20))
    url = f"s3://{BUCKET}/within/large.bin"
    r = run("cp", "--json", str(src), url)                      # a new upload: temporary key, then copied
    assert r.exit_code == 0 and json.loads(r.stdout)["files"][0]["method"] == "multipart+copy", r.output
    assert len(asked) == want >= 4 and sum(n for _, n in asked) == size, asked
    assert all(n <= 6 << 20 for _, n in asked) and {k for k, _ in asked} == {"within/large.bin"}
    assert _get(s3, "within/large.bin") == src.read_bytes()
    asked.clear()
    r = run("cp", "--json", url, f"s3://{BUCKET}/within/copy.bin")   # S3 to S3, the same bucket
    assert r.exit_code == 0 and json.loads(r.stdout)["files"][0]["method"] == "server_copy", r.output
    assert len(asked) == want and sum(n for _, n in asked) == size and all(n <= 6 << 20 for _, n in asked)
    assert _get(s3, "within/copy.bin") == src.read_bytes()
    asked.clear()
    r = run("cp", "--json", f"s3://{BUCKET}/within/copy.bin", url)   # exists: refused before any part
    assert r.exit_code == 2 and json.loads(r.stdout)["files"][0]["error"]["code"] == "exists" and not asked
    r = run("cp", "--json", "--overwrite", put(s3, "within/small.bin", FILES[0].read_bytes()), url)
    assert r.exit_code == 0 and len(asked) == 1 and _get(s3, "within/large.bin") == FILES[0].read_bytes()


def test_a_cp_killed_with_sigkill_leaves_no_object(s3, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    import obstore

    src = tmp_path / "large.bin"
    _large_slot_file(src, 200)
    env = {**os.environ, **s3.env()}
    for attempt in range(5):
        key = f"killed/{attempt}.bin"
        p = subprocess.Popen([sys.executable, "-m", "slotctl", "cp", str(src), f"s3://{BUCKET}/{key}"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0 + 0.3 * attempt)
        if p.poll() is not None:
            continue   # a quiet machine finished first: try again, killing sooner would prove less
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        break
    else:
        pytest.skip("the copy always finished before the kill")
    keys = [m["path"] for b in obstore.list(s3.client(), prefix="killed/") for m in b]
    finished = {f"killed/{i}.bin" for i in range(attempt)}
    assert f"killed/{attempt}.bin" not in keys
    assert all(k in finished or k.rsplit("/", 1)[1].startswith(".") for k in keys), keys


# -- what a read costs ---------------------------------------------------------------------------------


def test_inspect_of_a_large_sparse_object_reads_metadata_only_in_few_round_trips(s3, tmp_path):
    """A 160 MiB object (a payload, one checkpoint and a draft state: three KV sections of 8 layers and 4,096
    cells, tensor bytes a hole): inspect fetches under 1 MiB, in one batch per KV section beside the head and
    each section's cells, and says what inspect of the local file says."""
    from slotctl.sources import TOTALS

    src = tmp_path / "large.bin"
    size = _large_slot_file(src, 160)
    assert size > 128 << 20
    import obstore

    with open(src, "rb") as f:
        obstore.put(s3.client(), "sparse/large.bin", f, chunk_size=16 << 20)
    url = f"s3://{BUCKET}/sparse/large.bin"
    for k in TOTALS:
        TOTALS[k] = 0
    remote = run("inspect", "--json", url)
    assert remote.exit_code == 0, remote.output
    fetched = dict(TOTALS)
    assert fetched["bytes"] < 1 << 20, fetched
    # head; the target's cells and data header; its records; then per blob (checkpoint, draft) the same two
    # (the walk alone makes a round trip per record: 34 here)
    assert fetched["batches"] <= 1 + 2 * 3, fetched
    local = run("inspect", "--json", str(src))
    assert _without_paths(json.loads(local.stdout)) == _without_paths(json.loads(remote.stdout))


@pytest.mark.parametrize("kind, params", [
    ("recurrent", dict(n_rec=8, r_row=1 << 20, s_row=3 << 20)),
    ("hybrid", dict(n_layer=8, row=4096, type=1, n_rec=8, r_row=1 << 20, s_row=2 << 20)),
    ("iswa", dict(n_layer=12, row=4096, type=1)),
])
def test_inspect_of_other_memory_kinds_fetches_each_section_in_a_batch(s3, tmp_path, kind, params):
    """Recurrent, hybrid and iSWA objects whose records lie MiBs apart (a read-ahead never covers the next):
    each section's record headers come in one batch (a recurrent one in two: its r records, then its s
    records), not a round trip each; and the answer is the local file's."""
    import importlib.util

    import obstore
    from slotctl.sources import TOTALS

    spec = importlib.util.spec_from_file_location("bench_ls", Path(__file__).parents[1] / "benchmarks" / "bench_ls.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = tmp_path / f"{kind}.bin"
    mod.write_file(str(src), kind, params, 6000, 4, legacy=False, appendix=False)
    with open(src, "rb") as f:
        obstore.put(s3.client(), f"kinds/{kind}.bin", f, chunk_size=16 << 20)
    for k in TOTALS:
        TOTALS[k] = 0
    remote = run("inspect", "--json", f"s3://{BUCKET}/kinds/{kind}.bin")
    local = run("inspect", "--json", str(src))
    assert remote.exit_code == local.exit_code and not json.loads(local.stdout)["files"][0]["damaged"], remote.output
    assert _without_paths(json.loads(local.stdout)) == _without_paths(json.loads(remote.stdout))
    assert json.loads(local.stdout)["files"][0]["target"]["memory"]["kind"] == kind
    records = 2 * params.get("n_layer", 0) * (2 if kind == "iswa" else 1) + 2 * params.get("n_rec", 0)
    # the head; per KV section its cells (6,000: beyond the head) and then its records; per recurrent
    # section its r records, then its s records, and one more: the walk's candidate search reads the
    # recurrent section as KV cells first (its cell's position, 5,999, taken for a cell count) before that
    # layout fails (the walk alone: a round trip per record)
    assert TOTALS["batches"] <= 1 + {"recurrent": 3, "hybrid": 2 + 3, "iswa": 2 + 2}[kind], (TOTALS, records)


# -- prune ---------------------------------------------------------------------------------------------


def _objects(srv: Seaweed, prefix: str) -> list[str]:
    import obstore

    return sorted(m["path"].rpartition("/")[2] for b in obstore.list(srv.client(), prefix=prefix) for m in b)


def test_prune_of_a_prefix_lru_by_last_modified_with_pins_and_dry_run(s3):
    data = FILES[0].read_bytes()
    for name in ("a.bin", "b.bin", "c.bin", "d.bin"):     # Last-Modified has a resolution of a second
        put(s3, f"prune/{name}", data)
        next_second()
    put(s3, "prune/README", b"not a slot file")
    prefix = f"s3://{BUCKET}/prune/"
    r = run("prune", "--json", "--dry-run", "--keep", "2", "--grace", "0", prefix)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["time_source"] == "mtime" and "Last-Modified" in doc["time_source_reason"]
    assert [f["path"].rpartition("/")[2] for f in doc["files"] if f["action"] == "would_delete"] == ["a.bin", "b.bin"]
    assert _objects(s3, "prune/") == ["README", "a.bin", "b.bin", "c.bin", "d.bin"]     # --dry-run: nothing gone
    r = run("prune", "--json", "--keep", "2", "--grace", "0", "--pin", "a.bin", prefix)
    assert r.exit_code == 0, r.output
    assert _objects(s3, "prune/") == ["README", "a.bin", "c.bin", "d.bin"]     # a.bin pinned, b.bin oldest left
    r = run("prune", "--json", "--older-than", "0s", prefix)            # the default grace keeps fresh objects
    assert all(f["action"] != "deleted" for f in json.loads(r.stdout)["files"])


def test_two_hosts_pruning_one_prefix_at_once_delete_what_one_would(s3):
    """Two prune processes over the same prefix at the same time (two hosts): together they delete exactly
    what one would (each plans from a listing, least recently used first; an object the other deleted first
    is skipped as gone), and every object kept is whole."""
    import subprocess
    import sys

    data = FILES[0].read_bytes()
    for i in range(6):
        put(s3, f"two/{i}.bin", data)
        if i in (1, 3):
            next_second()
    env = {**os.environ, **s3.env()}
    cmd = [sys.executable, "-m", "slotctl", "prune", "--json", "--keep", "2", "--grace", "0", f"s3://{BUCKET}/two/"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert _objects(s3, "two/") == ["4.bin", "5.bin"]
    deleted = [f["path"] for o, _ in outs for f in json.loads(o)["files"] if f["action"] == "deleted"]
    assert sorted(set(deleted)) == [f"s3://{BUCKET}/two/{i}.bin" for i in range(4)]
    for name in ("4.bin", "5.bin"):
        assert _get(s3, f"two/{name}") == data


def test_prune_broken_judges_objects(s3):
    data = FILES[0].read_bytes()
    put(s3, "broken/good.bin", data)
    put(s3, "broken/cut.bin", data[:100])
    r = run("prune", "--json", "--broken", "--grace", "0", "-m", str(DATA / "target.gguf"), f"s3://{BUCKET}/broken/")
    assert r.exit_code == 0, r.output
    assert _objects(s3, "broken/") == ["good.bin"]


# -- strip-draft ---------------------------------------------------------------------------------------


def test_strip_draft_of_an_object_is_a_server_side_rewrite(s3, tmp_path):
    """The object becomes exactly what strip-draft makes of the local file, without being downloaded."""
    from slotctl.sources import TOTALS

    src = tmp_path / "draft.bin"
    _large_slot_file(src, 24)
    import obstore

    with open(src, "rb") as f:
        obstore.put(s3.client(), "strip/draft.bin", f, chunk_size=16 << 20)
    url = f"s3://{BUCKET}/strip/draft.bin"
    r = run("strip-draft", "--json", "--dry-run", url)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["files"][0]
    assert doc["status"] == "would_strip" and doc["method"] == "server_copy"
    assert _get(s3, "strip/draft.bin") == src.read_bytes()
    for k in TOTALS:
        TOTALS[k] = 0
    r = run("strip-draft", "--json", url)
    assert r.exit_code == 0, r.output
    assert TOTALS["bytes"] < 1 << 20                       # metadata only: nothing downloaded
    local = tmp_path / "local.bin"
    local.write_bytes(src.read_bytes())
    assert run("strip-draft", "--grace", "0", str(local)).exit_code == 0
    assert _get(s3, "strip/draft.bin") == local.read_bytes()
    assert json.loads(r.stdout)["files"][0]["size_after"] == local.stat().st_size
    r = run("strip-draft", "--json", url)                  # nothing left to strip
    assert json.loads(r.stdout)["files"][0]["status"] == "unchanged"


def test_a_rewrite_of_a_replaced_object_leaves_it_alone(s3):
    import obstore

    import slotctl.store.s3  # noqa: F401 - the s3 scheme
    from slotctl.errors import UsageError
    from slotctl.store.s3copy import rewrite_prefix
    from slotctl.store.s3 import S3_STORE

    url = put(s3, "strip/replaced.bin", b"old" * 1000)
    stale = obstore.head(s3.client(), "strip/replaced.bin")["e_tag"]
    put(s3, "strip/replaced.bin", b"new" * 1000)
    with pytest.raises(UsageError) as e:
        rewrite_prefix(S3_STORE.config, url, stale, 100)
    assert e.value.code == "object_changed"
    assert _get(s3, "strip/replaced.bin") == b"new" * 1000


def test_convert_a_prefix_into_another_and_a_directory_into_another(s3, tmp_path):
    """A server upgrade that changes the flags: the whole store converted in one command."""
    for p in FILES[:3]:
        put(s3, f"conv-in/{p.name}", p.read_bytes())
    put(s3, "conv-in/README", b"not a slot file")
    r = run("convert", "--json", f"s3://{BUCKET}/conv-in/", "-o", f"s3://{BUCKET}/conv-out/", "-np", "2")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["summary"] == {"files": 3, "converted": 3, "refused": 0, "failed": 0, "skipped": 1}
    local_in, local_out = tmp_path / "in", tmp_path / "out"
    local_in.mkdir()
    local_out.mkdir()
    for p in FILES[:3]:
        (local_in / p.name).write_bytes(p.read_bytes())
    r = run("convert", "--json", str(local_in), "-o", str(local_out), "-np", "2")
    assert r.exit_code == 0, r.output
    for p in FILES[:3]:
        assert _get(s3, f"conv-out/{p.name}") == (local_out / p.name).read_bytes()
    r = run("convert", "--json", f"s3://{BUCKET}/conv-in/", "-o", f"s3://{BUCKET}/conv-out/", "-np", "2")
    assert r.exit_code == 2                      # every destination exists: not overwritten without --force
    assert {f["error"]["code"] for f in json.loads(r.stdout)["files"]} == {"exists"}


def test_restore_of_an_object_says_to_copy_it_down(tmp_path):
    """restore (local) reads the file into real contexts: an object is refused with one line saying what to do
    (it said "s3:/b/x.bin: No such file or directory")."""
    r = run("restore", f"s3://{BUCKET}/x.bin", "-m", str(DATA / "target.gguf"))
    assert r.exit_code == 2
    assert r.stderr.strip() == (f"error: s3://{BUCKET}/x.bin: restore reads a local slot file into real contexts: "
                                "copy the object down first (slotctl cp URL DIR/)"), r.stderr


def test_diff_and_identify_of_objects_answer_as_of_the_files(s3):
    a, b = DATA / "srv-np1.bin", DATA / "srv-kvq8.bin"
    ua, ub = put(s3, "diff/a.bin", a.read_bytes()), put(s3, "diff/b.bin", b.read_bytes())
    local, remote = run("diff", "--json", str(a), str(b)), run("diff", "--json", ua, ub)
    assert remote.exit_code == local.exit_code == 1, remote.output
    assert _without_paths(json.loads(local.stdout)) == _without_paths(json.loads(remote.stdout))
    assert run("diff", "--json", ua, str(a)).exit_code == 0
    args = ["identify", "--json", "-m", str(DATA / "target.gguf"), "-m", str(DATA / "draft.gguf")]
    local, remote = run(*args, str(a)), run(*args, ua)
    assert remote.exit_code == local.exit_code == 0, remote.output
    assert _without_paths(json.loads(local.stdout)) == _without_paths(json.loads(remote.stdout))


# -- small inconsistencies (issue 28) ---------------------------------------------------------------------

import socket  # noqa: E402
import threading  # noqa: E402


def _head_and_rest(sock: socket.socket) -> tuple[bytes, bytes] | None:
    """An HTTP message's head (up to the blank line) and the bytes read after it; None at the end."""
    data = b""
    while b"\r\n\r\n" not in data:
        d = sock.recv(65536)
        if not d:
            return None
        data += d
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return None


def _body(sock: socket.socket, got: bytes, n: int) -> bytes:
    while len(got) < n:
        d = sock.recv(65536)
        if not d:
            break
        got += d
    return got


class _CuttingProxy:
    """A TCP proxy in front of the real S3 server that cuts the body of every object GET (no query: not a
    listing) after ``keep`` bytes and closes the connection: a store whose answer ends early (a dropped
    connection mid-read). ``cut`` counts the answers cut."""

    def __init__(self, target_port: int, keep: int = 1000):
        self.target_port, self.keep = target_port, keep
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.cut = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c):
        up = socket.create_connection(("127.0.0.1", self.target_port))
        try:
            while True:
                got = _head_and_rest(c)
                if got is None:
                    return
                head, body = got
                up.sendall(head + b"\r\n\r\n" + _body(c, body, _content_length(head) or 0))
                target = head.split(b" ")[1]
                got = _head_and_rest(up)
                if got is None:
                    return
                rh, rb = got
                status = rh.split(b" ")[1]
                length = 0 if head.startswith(b"HEAD ") or status in (b"204", b"304") else _content_length(rh)
                if length is None:        # no length given: passed through until the store closes
                    c.sendall(rh + b"\r\n\r\n" + rb)
                    while d := up.recv(65536):
                        c.sendall(d)
                    return
                rb = _body(up, rb, length)
                if head.startswith(b"GET ") and b"?" not in target and status in (b"200", b"206") \
                        and length > self.keep:
                    self.cut += 1
                    c.sendall(rh + b"\r\n\r\n" + rb[:self.keep])
                    c.shutdown(socket.SHUT_RDWR)
                    return
                c.sendall(rh + b"\r\n\r\n" + rb)
        except OSError:
            return
        finally:
            c.close()
            up.close()

    def close(self):
        self.sock.close()


def test_a_body_cut_short_is_store_unreachable_in_one_clean_line(s3, monkeypatch):
    """An object GET whose body ends early (a real store behind a proxy that drops the connection mid-body):
    `store_unreachable`, the documented code of a store that stops answering mid-read, in slotctl's words
    (it was `store_error` with obstore's "HTTP error: request or response body error")."""
    url = put(s3, "cut/a.bin", FILES[0].read_bytes())
    proxy = _CuttingProxy(s3.s3_port, keep=1000)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        from slotctl.store.s3 import S3_STORE

        S3_STORE.reset()
        for args in (["inspect", url, "--json"], ["cp", url, "/nonexistent-dir-for-slotctl/x.bin", "--json"],
                     ["ls", url, "--json"], ["convert", url, "-o", "/tmp/slotctl-never.bin", "--state-version", "3",
                                              "--json"]):
            r = run(*args)
            assert r.exit_code == 2, r.output
            doc = json.loads(r.stdout)
            err = doc["error"] if "error" in doc else doc["files"][0]["error"]
            assert err["code"] == "store_unreachable", err
            assert "ended early" in err["message"] and "HTTP error" not in err["message"], err
        assert proxy.cut >= 4
    finally:
        proxy.close()
        S3_STORE.reset()


def test_a_missing_prefix_and_object_are_said_as_a_missing_directory_and_file_are(s3, tmp_path):
    """prune of a prefix with no object under it exits 2 (`no_such_file`), as prune of a missing directory;
    convert of a missing object speaks of an object; `s3:///x.bin` is a usage error (no bucket), never
    bucket `x.bin`."""
    put(s3, "here/a.bin", FILES[0].read_bytes())
    for target in (f"s3://{BUCKET}/missing/", str(tmp_path / "missing")):
        r = run("prune", target, "--keep", "0", "--json")
        assert r.exit_code == 2 and json.loads(r.stdout)["error"]["code"] == "no_such_file", r.output
    r = run("prune", f"s3://{BUCKET}/here/", "--keep", "5", "--json")
    assert r.exit_code == 0, r.output
    r = run("convert", f"s3://{BUCKET}/missing.bin", "-o", str(tmp_path / "f.bin"), "--state-version", "3")
    assert r.exit_code == 2 and "no such object" in r.stderr and "director" not in r.stderr, r.stderr
    for args in (["inspect", "s3:///x.bin"], ["ls", "s3:///x.bin"], ["validate", "s3:///x.bin"],
                 ["cp", "s3:///x.bin", str(tmp_path / "y.bin")], ["cp", str(FILES[0]), "s3:///x.bin"],
                 ["prune", "s3:///x/", "--keep", "1"], ["convert", "s3:///x.bin", "-o", str(tmp_path / "z.bin"),
                                                        "--state-version", "3"]):
        r = run(*args)
        assert r.exit_code == 2 and "no bucket" in r.stderr and "x.bin: no such bucket" not in r.stderr, (args, r.stderr)


def test_prune_temp_files_removes_temporary_keys_a_killed_copy_left(s3):
    """A temporary key (`.NAME.slotctl-RANDOM.tmp`: a cp killed between its upload and its copy) is skipped
    by prune, and deleted with --temp-files once older than --grace (--dry-run first: nothing goes)."""
    from slotctl.store.s3 import temp_key

    slot = put(s3, "tmpkeys/a.bin", FILES[0].read_bytes())
    left = put(s3, temp_key("tmpkeys/b.bin"), FILES[0].read_bytes())
    name = left.rpartition("/")[2]
    r = run("prune", f"s3://{BUCKET}/tmpkeys/", "--keep", "5", "--grace", "0", "--json")
    assert r.exit_code == 0 and {f["path"]: f["action"] for f in json.loads(r.stdout)["files"]}[left] == "skipped"
    r = run("prune", f"s3://{BUCKET}/tmpkeys/", "--temp-files", "--grace", "3600", "--json")
    assert r.exit_code == 0 and {f["path"]: f["action"] for f in json.loads(r.stdout)["files"]}[left] == "skipped"
    r = run("prune", f"s3://{BUCKET}/tmpkeys/", "--temp-files", "--grace", "0", "--dry-run", "--json")
    assert {f["path"]: f["action"] for f in json.loads(r.stdout)["files"]}[left] == "would_delete"
    assert _exists(s3, f"tmpkeys/{name}")
    r = run("prune", f"s3://{BUCKET}/tmpkeys/", "--temp-files", "--grace", "0", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and {f["path"]: (f["action"], f["temp"]) for f in doc["files"]} == {
        left: ("deleted", True), slot: ("kept", False)}, doc
    assert not _exists(s3, f"tmpkeys/{name}") and _exists(s3, "tmpkeys/a.bin")
