"""Every count and length field at its maximum, in a 100 GiB sparse file: one line, exit 1, bounded memory.

A damaged count must cost an error, not an allocation or a read sized by it (docs/design.md, "Bounds").
Each file is a real server file (tests/data) with checkpoints and draft state appended, one field set to
the largest value its type holds, and the file extended with a hole to 100 GiB, so "only N bytes remain"
never stops the count: only the check against what the layer can hold does.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.format.appendix import build_sckp, build_sdft
from slotctl.format.blob import BLOB_HEADER_SIZE, blob_header
from slotctl.format.cells import MAX_CELLS
from slotctl.slotfile import open_slot_file

from conftest import DATA

runner = CliRunner()
SPARSE = 100 << 30
U32, U64 = 0xFFFFFFFF, (1 << 64) - 1
#: what a command may allocate while refusing one of these files (tracemalloc peak)
MEMORY_BOUND = 64 << 20


def _payload(path: Path) -> bytes:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<I", raw, 8)
    return raw[12 + 4 * n:]


def chain_file(tmp_path: Path, base: Path = DATA / "srv-np1.bin") -> Path:
    """``base`` + SCKP (one checkpoint: target, draft and speculative blobs) + SDFT."""
    tgt = blob_header(0) + _payload(base)
    dft = blob_header(0) + _payload(DATA / "srv-draft.bin")
    sckp = build_sckp([dict(n_tokens=8, pos_min=0, pos_max=7, tgt=tgt, dft=dft, spec=b"spec")])
    p = tmp_path / "chain.bin"
    p.write_bytes(base.read_bytes() + sckp + build_sdft(dft, b"spec"))
    return p


def field_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """(offset, width in bytes) of each count and length field of the file at ``path``."""
    sf = open_slot_file(path)
    assert not sf.errors
    out = {"header: token word count": (8, 4)}
    if sf.tokens.format == "packed":
        out["token record: token count"] = (20, 4)
        out["token record: media chunk count"] = (24 + 4 * sf.tokens.n_tokens, 4)
    t = sf.target.offset
    sec = sf.target.sections[0]
    if sec.type == "kv":
        out["target: stream count"] = (t, 4)
        out["target: cell count"] = (t + 4, 4)
        rot = sec.streams[0].data.rot_offset
        out["target: layer count"] = (rot - 4, 4)
        k0 = rot + (8 if sf.version >= 4 else 0)
        out["target: K row size"] = (k0 + 4, 8)
        data = sec.streams[0].data
        if data.v_trans == 1:   # element-major V records: i32 type; u32 el_size; u32 n_embd
            v0 = data.v[0].data.offset
            out["target: V element size"] = (v0 - 8, 4)
            out["target: V n_embd"] = (v0 - 4, 4)
    else:
        out["target: recurrent cell count"] = (t, 4)
        n = sec.cell_count
        out["target: recurrent layer count"] = (t + 4 + 8 * n + 4, 4)
        out["target: r row size"] = (t + 4 + 8 * n + 8 + 4, 8)
    if sf.sckp is not None:
        s = sf.sckp.offset
        out["SCKP: checkpoint count"] = (s + 8, 4)
        c0 = s + 12
        out["checkpoint: target blob length"] = (c0 + 16, 8)
        tgt = sf.checkpoints[0].tgt.span
        out["checkpoint blob: cell count"] = (tgt.offset + BLOB_HEADER_SIZE + 4, 4)
        out["checkpoint: draft blob length"] = (tgt.end, 8)
        dft = sf.checkpoints[0].dft.span
        out["checkpoint: speculative state length"] = (dft.end, 8)
    if sf.sdft is not None:
        d = sf.sdft.offset
        out["SDFT: draft blob length"] = (d + 8, 8)
        out["SDFT: speculative state length"] = (sf.draft.span.end, 8)
    return out


def _patch(src: Path, dst: Path, offset: int, width: int, value: int) -> Path:
    raw = bytearray(src.read_bytes())
    raw[offset:offset + width] = value.to_bytes(width, "little")
    with open(dst, "wb") as f:
        f.write(raw)
        f.truncate(SPARSE)
    return dst


FILES = {"kv": lambda tmp: chain_file(tmp), "recurrent": lambda tmp: chain_file(tmp, DATA / "kinds" / "srv-mamba.bin"),
         "kv, V transposed": lambda tmp: chain_file(tmp, DATA / "srv-fa-off.bin")}


def _cases() -> list[tuple[str, str]]:
    names = ["header: token word count", "token record: token count", "token record: media chunk count",
             "SCKP: checkpoint count", "checkpoint: target blob length", "checkpoint blob: cell count",
             "checkpoint: draft blob length", "checkpoint: speculative state length", "SDFT: draft blob length",
             "SDFT: speculative state length"]
    kv = names + ["target: stream count", "target: cell count", "target: layer count", "target: K row size"]
    rec = ["target: recurrent cell count", "target: recurrent layer count", "target: r row size"]
    vt = ["target: V element size", "target: V n_embd"]
    return [("kv", n) for n in kv] + [("recurrent", n) for n in rec] + [("kv, V transposed", n) for n in vt]


@pytest.mark.parametrize("kind,field", _cases())
def test_field_at_its_maximum(tmp_path, kind, field):
    src = FILES[kind](tmp_path)
    offset, width = field_offsets(src)[field]
    bad = _patch(src, tmp_path / "bad.bin", offset, width, U32 if width == 4 else U64)
    for args in (["inspect", str(bad), "--json"], ["validate", str(bad), "--no-load", "--json"],
                 ["strip-draft", str(bad), "--dry-run", "--grace", "0", "--json"]):
        tracemalloc.start()
        t0 = time.monotonic()
        res = runner.invoke(app, args)
        elapsed = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert "Traceback" not in res.stderr, res.stderr
        assert res.exit_code in ((0, 1, 3) if args[0] == "validate" else (0, 1)), (args, res.exit_code, res.stderr)
        assert peak < MEMORY_BOUND, (args[0], field, peak)
        assert elapsed < 30, (args[0], field, elapsed)   # a guard against a hang, not a measurement
        assert " at 0x" in res.stdout, (args[0], field, res.stdout[-500:])
        if args[0] == "strip-draft" and field.startswith("SDFT"):
            # damage confined to the draft state: strip-draft would repair the file by removing it
            d = json.loads(res.stdout)
            assert res.exit_code == 0 and d["files"][0]["repaired"], res.stdout[-500:]
        elif args[0] == "validate":
            # a verdict about the server: refused or damaged (1), undecided without the model (3), or
            # restores (0) when the damage is in a layer b11434 does not read (docs/exit-codes.md)
            assert res.exit_code in (0, 1, 3), (field, res.exit_code, res.stdout[-500:], res.stderr)
        else:
            assert res.exit_code == 1, (args[0], field, res.exit_code, res.stdout[-500:], res.stderr)


def test_cell_count_at_the_limit_over_a_hole_costs_bounded_time_and_memory(tmp_path):
    """The largest cell count accepted, over 9 GiB of zeros: read in chunks, refused, within a bound."""
    src = DATA / "srv-np1.bin"
    off, _ = field_offsets(src)["target: cell count"]
    raw = bytearray(src.read_bytes()[:off + 4])
    raw[off:off + 4] = struct.pack("<I", MAX_CELLS)
    p = tmp_path / "hole.bin"
    with open(p, "wb") as f:
        f.write(raw)
        f.truncate(9 << 30)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out, err, code, maxrss_kib = run_measured([sys.executable, "-m", "slotctl", "inspect", str(p), "--json"], env)
    assert code == 1 and b"Traceback" not in err
    [f] = json.loads(out)["files"]
    assert " at 0x" in [x for x in f["findings"] if x["severity"] == "error"][0]["message"]
    # the whole process (Python, numpy, rich, the cells it read) stays under 1 GiB
    assert maxrss_kib < (1 << 20), maxrss_kib


def run_measured(cmd: list[str], env: dict, timeout: float = 120) -> tuple[bytes, bytes, int, int]:
    """Run ``cmd``; its stdout, stderr, exit code and peak resident memory (KiB, from wait4)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                pytest.fail(f"{cmd} still running after {timeout} s")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return out.read(), err.read(), proc.returncode, usage.ru_maxrss


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io (Linux)")
def test_the_appendix_scan_reads_only_the_end_of_the_file(tmp_path):
    """A payload no layout fits, in a 4 GiB file: the scan for an appendix chain reads the last 64 MiB,
    not the file; a chain inside that window is found, one that starts before it is not (docs/inspect.md)."""
    from slotctl.slotfile import SCAN_WINDOW

    src = DATA / "srv-np1.bin"
    raw = src.read_bytes()
    start = open_slot_file(src).target.offset
    blob = blob_header(0) + _payload(DATA / "srv-draft.bin")

    def build(path: Path, spec_size: int) -> Path:
        """Header and tokens, 4 GiB of zeros no layout fits (a hole), then an SDFT whose speculative
        state is ``spec_size`` bytes (a hole too), ending the file."""
        with open(path, "wb") as f:
            f.write(raw[:start] + b"\xff" * 64)
            f.seek(4 << 30)
            f.write(build_sdft(blob, b"\0" * 8)[:-8 - 8])   # the SDFT up to its speculative state ...
            f.write(struct.pack("<Q", spec_size))          # ... whose length we set
            f.seek(spec_size - 1, os.SEEK_CUR)
            f.write(b"\0")
        return path

    near = build(tmp_path / "near.bin", 1 << 20)
    before = _rchar()
    sf = open_slot_file(near)
    read = _rchar() - before
    assert sf.target is None and sf.errors and sf.sdft is not None
    assert any("by scanning" in w for w in sf.warnings)
    assert read < SCAN_WINDOW + (8 << 20), read   # the window and a few chunks, not 4 GiB

    far = build(tmp_path / "far.bin", SCAN_WINDOW + (1 << 20))
    os.unlink(near)
    before = _rchar()
    sf = open_slot_file(far)
    read = _rchar() - before
    assert sf.target is None and sf.errors and sf.sdft is None   # outside the window: not looked for
    assert read < SCAN_WINDOW + (8 << 20), read


@pytest.mark.parametrize("field,value", [("target: stream count", U32), ("target: cell count", U32),
                                         ("target: cell count", MAX_CELLS), ("target: layer count", U32)])
def test_a_cut_payload_with_an_absurd_count_is_walked_within_bounds(tmp_path, field, value):
    """validate -m on a file cut inside its payload walks the loader's order to the end (format.cut): a count
    on the way beyond what the layer holds is refused there, not walked (found by fuzz/fuzz_slotfiles.py:
    a stream count of billions built a list of billions)."""
    src = DATA / "srv-np1.bin"
    offset, width = field_offsets(src)[field]
    raw = bytearray(src.read_bytes()[:-1000])   # cut inside the last V record
    raw[offset:offset + width] = value.to_bytes(width, "little")
    p = tmp_path / "cut.bin"
    p.write_bytes(bytes(raw))
    tracemalloc.start()
    t0 = time.monotonic()
    res = runner.invoke(app, ["validate", str(p), "-m", str(DATA / "target.gguf"), "--no-load", "--json"])
    elapsed = time.monotonic() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert res.exit_code == 1, (res.stdout[-400:], res.stderr)
    assert json.loads(res.stdout)["summary"]["refused"] == 1
    assert peak < MEMORY_BOUND and elapsed < 30, (peak, elapsed)


# -- a parsed file owns its stream: nothing reopens a file by its name ---------------------------------

def _stdin_cases() -> list[tuple[Path, Path]]:
    """(slot file, its model) for every slot file of tests/data."""
    out = [(p, DATA / "target.gguf") for p in sorted(DATA.glob("*.bin"))]
    out += [(p, DATA / "kinds" / (p.stem.removeprefix("srv-") + ".gguf")) for p in sorted((DATA / "kinds").glob("*.bin"))]
    return out


def _without_path(doc: dict) -> dict:
    for f in doc["files"]:
        f.pop("path")
    return doc


@pytest.mark.parametrize("trailing", [b"", b"NOT AN APPENDIX"], ids=["as saved", "trailing bytes"])
@pytest.mark.parametrize("src,model", _stdin_cases(), ids=lambda p: p.name)
def test_standard_input_reads_as_the_file_does(tmp_path, src, model, trailing):
    """``inspect -m MODEL -`` and ``validate -m MODEL -`` say what they say of the file by name (but the
    path): once, findings reopened the file by its name and ``-`` ended in "-: no such file or directory"."""
    p = tmp_path / src.name
    p.write_bytes(src.read_bytes() + trailing)
    for cmd in (["inspect", "-m", str(model)], ["validate", "-m", str(model), "--no-load"]):
        by_name = runner.invoke(app, [*cmd, str(p), "--json"])
        piped = runner.invoke(app, [*cmd, "-", "--json"], input=p.read_bytes())
        assert by_name.exit_code == piped.exit_code, (cmd, by_name.stdout[-400:], piped.stdout[-400:], piped.stderr)
        assert _without_path(json.loads(piped.stdout)) == _without_path(json.loads(by_name.stdout)), cmd
        assert json.loads(piped.stdout)["files"][0].get("error") is None, piped.stdout[-400:]


def test_a_parsed_file_reads_through_its_stream_after_its_name_is_gone(tmp_path):
    """Every later read of a parsed file (findings' trailing bytes, a rebuild) uses the stream it was parsed
    from: the name may be removed or name another file meanwhile."""
    from slotctl.server.findings import file_findings
    from slotctl.slotfile import rebuild

    p = tmp_path / "a.bin"
    raw = (DATA / "srv-np1.bin").read_bytes()
    p.write_bytes(raw + b"SDF")       # a torn SDFT magic: findings read the trailing bytes
    sf = open_slot_file(p)
    os.unlink(p)
    p.write_bytes(b"something else entirely")
    assert "torn_appendix_magic" in {f.code for f in file_findings(sf)}
    sf.trailing = None
    assert rebuild(sf) == raw
    assert sf.changed() is not None     # the name names another file now
    sf.close()
    assert sf.stream is None


# -- diff and convert: a damaged field is a finding; a file changed under diff too -----------------------

def _kv_fields(path: Path) -> dict[str, int]:
    """Offsets of the first stream's rotation fields and first K and V record headers."""
    sf = open_slot_file(path)
    data = sf.target.sections[0].streams[0].data
    return {"n_rot_k": data.rot_offset, "k0": data.k[0].data.offset - 12, "v0": data.v[0].data.offset - 12}


def _patched(src: Path, dst: Path, *edits: tuple[int, int, int]) -> Path:
    raw = bytearray(src.read_bytes())
    for offset, width, value in edits:
        raw[offset:offset + width] = value.to_bytes(width, "little")
    dst.write_bytes(bytes(raw))
    return dst


def _damaged(tmp_path: Path, case: str) -> Path:
    """Files that parse (every length still adds up) but whose fields cannot hold the rows they claim;
    each ended diff or convert in an internal error once (issue 15's mutation run)."""
    if case == "rotation 1025":      # tensors.py:117: rows of 64 elements do not split into rotation groups of 1025
        src = DATA / "srv-kvq8.bin"
        return _patched(src, tmp_path / "rot.bin", (_kv_fields(src)["n_rot_k"], 4, 1025))
    if case == "K row size not whole q8_0 blocks":   # tensors.py:75: a reshape
        src = DATA / "srv-np1.bin"
        return _patched(src, tmp_path / "rows.bin", (_kv_fields(src)["k0"], 4, 8))
    if case == "transposed V as q4_0":                # convert.py:114: ZeroDivisionError
        src = DATA / "srv-fa-off.bin"
        return _patched(src, tmp_path / "vt.bin", (_kv_fields(src)["v0"], 4, 2))
    if case == "transposed V element size 1":         # halves the element, doubles n_embd: the lengths agree
        src = DATA / "srv-fa-off.bin"
        v0 = _kv_fields(src)["v0"]
        n_embd = open_slot_file(src).target.sections[0].streams[0].data.v[0].n_embd
        return _patched(src, tmp_path / "el.bin", (v0 + 4, 4, 1), (v0 + 8, 4, 2 * n_embd))
    raise AssertionError(case)


DAMAGED = ["rotation 1025", "K row size not whole q8_0 blocks", "transposed V as q4_0", "transposed V element size 1"]


@pytest.mark.parametrize("case", DAMAGED)
def test_diff_reports_a_field_that_cannot_hold_its_rows_as_a_finding(tmp_path, case):
    bad = _damaged(tmp_path, case)
    copy = tmp_path / "copy.bin"
    copy.write_bytes(bad.read_bytes())
    for a, b in ((DATA / "srv-np1.bin", bad), (copy, bad)):   # against another file, and against its copy
        res = runner.invoke(app, ["diff", str(a), str(b), "--json"])
        assert res.exit_code == 1 and res.exception is None or isinstance(res.exception, SystemExit), \
            (case, res.exit_code, repr(res.exception), res.stderr)
        assert "Traceback" not in res.stderr and "Warning" not in res.stderr, res.stderr
        doc = json.loads(res.stdout)
        side = doc["b"]
        assert side["damaged"], (case, doc["differences"])
        [f] = [f for f in side["findings"] if f["layer"] == "target memory"]
        assert f["code"] == "damaged" and f["severity"] == "error" and f["offset"] is not None, f
        assert f"at 0x{f['offset']:x}" in f["message"]
        assert any(d["layer"] == "B damaged" for d in doc["differences"])


@pytest.mark.parametrize("case", DAMAGED)
def test_convert_reports_a_field_that_cannot_hold_its_rows_as_damage(tmp_path, case):
    bad = _damaged(tmp_path, case)
    flags = ["-ctv", "f32"] if "transposed" in case else ["-ctk", "q4_0", "-ctv", "q4_0"]
    res = runner.invoke(app, ["convert", str(bad), "-m", str(DATA / "target.gguf"), "-o", str(tmp_path / "out.bin"),
                              *flags, "--json"])
    assert res.exit_code == 1, (case, res.exit_code, repr(res.exception), res.stdout[-500:], res.stderr)
    assert "Traceback" not in res.stderr and "Warning" not in res.stderr, res.stderr
    doc = json.loads(res.stdout)
    assert doc["error"]["code"] in ("damaged", "conversion_refused") and " at 0x" in doc["error"]["message"], doc
    assert not (tmp_path / "out.bin").exists()


def test_a_file_that_shrinks_or_is_rewritten_under_diff_is_a_finding(tmp_path):
    """diff reads rows with preads on the parsed stream: a file cut under it (a server saving the slot
    again, strip-draft) is a finding of that file (file_changed, exit 1), not SIGBUS (exit 135) as under
    np.memmap; nor is one rewritten in place at the same size."""
    from slotctl.diff import diff_files

    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    raw = (DATA / "srv-np1.bin").read_bytes()
    for change in ("shrink", "rewrite"):
        a.write_bytes(raw)
        b.write_bytes(raw)
        sa, sb = open_slot_file(a), open_slot_file(b)
        if change == "shrink":
            os.truncate(b, len(raw) // 2)
        else:
            with open(b, "r+b") as f:
                f.seek(len(raw) - 100)
                f.write(b"\x55" * 100)
            st = os.stat(b)
            os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
        doc = diff_files(sa, sb)
        codes = {f["code"] for f in doc["b"]["findings"]}
        assert "file_changed" in codes and not doc["equal"], (change, doc["b"]["findings"])
        assert not doc["a"]["findings"]


def test_diff_survives_a_writer_cutting_and_rewriting_the_file(tmp_path):
    """The race of issue 19 (18 SIGBUS in 425 runs under in-place re-saves): diff in a child process while a
    writer truncates the file and writes it again; every run exits 0 or 1 with one JSON document."""
    import threading

    src = chain_file(tmp_path)
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    raw = src.read_bytes()
    a.write_bytes(raw)
    b.write_bytes(raw)
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            with open(b, "r+b") as f:   # in place, as a server's fopen("wb") and fwrite
                f.truncate(0)
                for i in range(0, len(raw), 4096):
                    f.write(raw[i:i + 4096])

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    codes = []
    try:
        for _ in range(6):
            p = subprocess.run([sys.executable, "-m", "slotctl", "diff", str(a), str(b), "--json"], env=env,
                               capture_output=True, timeout=60)
            codes.append(p.returncode)
            assert p.returncode in (0, 1) and b"Traceback" not in p.stderr, (p.returncode, p.stderr[-800:])
            json.loads(p.stdout)
    finally:
        stop.set()
        t.join()
    assert codes


# -- standard input: read only as far as a slot file's header allows -----------------------------------

@pytest.mark.parametrize("command", ["inspect", "validate"])
@pytest.mark.parametrize("head", [b"GGUF\x03\0\0\0", b"\x71\x73\x67\x67\x09\0\0\0\0\0\0\0",
                                  b"\x71\x73\x67\x67\x04\0\0\0\xff\xff\xff\xff"],
                         ids=["a GGUF model", "an unknown state version", "a token word count beyond any slot's"])
def test_standard_input_that_is_no_slot_file_is_refused_after_its_header(tmp_path, command, head):
    """``-`` was copied whole before it was parsed, even after its first bytes showed it is no slot file
    (issue 19, item 10): now the first 12 bytes decide, and the stream is read no further."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "slotctl", command, "-", "--json"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    sent, chunk = 0, head + b"\0" * ((1 << 20) - len(head))
    try:
        while sent < (256 << 20):      # far more than any pipe buffer; the reader stops long before
            proc.stdin.write(chunk)
            sent += len(chunk)
            chunk = b"\0" * (1 << 20)
    except BrokenPipeError:
        pass
    out, err = proc.communicate(timeout=60)
    assert sent < (256 << 20), "standard input was read to its end"
    assert proc.returncode == 1, (proc.returncode, err)
    [f] = json.loads(out)["files"]
    assert f["path"] == "-" and b"Traceback" not in err
    assert f.get("size", 12) == 12, f     # the 12 bytes read, not the stream


# -- a budget per file: what one file may cost as a whole, in every command ------------------------------

def _sparse_checkpoints(path: Path, count: int, blob: int, cells: int) -> Path:
    """srv-np1.bin, then an SCKP of ``count`` checkpoints, each a target blob of ``blob`` bytes whose KV
    section claims ``cells`` cells over a hole (zeros: valid cells to the structure)."""
    base = (DATA / "srv-np1.bin").read_bytes()
    head = blob_header(0) + struct.pack("<II", 1, cells)
    with open(path, "wb") as f:
        f.write(base + struct.pack("<III", 0x504B4353, 1, count))
        for _ in range(count):
            f.write(struct.pack("<qiiQ", 8, 0, 7, blob) + head)
            f.seek(blob - len(head), os.SEEK_CUR)
            f.write(struct.pack("<QQ", 0, 0))
    return path


def _sparse_tokens(path: Path) -> Path:
    """The largest token word count the header allows (17,825,792 words, 71 MB) over a hole."""
    from slotctl.format.header import MAX_TOKEN_WORDS, fixed_header

    with open(path, "wb") as f:
        f.write(fixed_header(4, MAX_TOKEN_WORDS))
        f.truncate(12 + 4 * MAX_TOKEN_WORDS + 4096)
    return path


def _alternating_cells(path: Path, n: int = 5_700_000) -> Path:
    """A real (not sparse) file of ``n`` KV cells of alternating sizes (1 and 2 sequence ids): 80 MB. The
    run reader read each as a run of one: 160 MB took inspect -m 196 s and 3.66 GB (issue 19)."""
    import numpy as np

    raw = (DATA / "srv-np1.bin").read_bytes()
    (words,) = struct.unpack_from("<I", raw, 8)
    a = np.zeros((n // 2, 7), "<u4")
    a[:, 0], a[:, 1] = np.arange(0, n, 2), 1
    a[:, 3], a[:, 4], a[:, 6] = np.arange(1, n, 2), 2, 1
    path.write_bytes(raw[:12 + 4 * words] + struct.pack("<II", 1, n) + a.tobytes() + bytes(1000))
    return path


def _unpatterned_cells(path: Path, n: int = 1_500_000) -> Path:
    """A real file of ``n`` KV cells whose sizes (1 or 2 sequence ids, drawn at random) follow no pattern, so
    each is walked with a Python step: 21 MB. They were refused as over budget after ~1,000 cells (each 32
    walked cells cost a fresh 8 MiB read); walked cells now cost ``WALKED_CELL_COST`` each."""
    import numpy as np

    raw = (DATA / "srv-np1.bin").read_bytes()
    (words,) = struct.unpack_from("<I", raw, 8)
    k = np.random.default_rng(3).integers(1, 3, n)
    starts = np.concatenate([[0], np.cumsum(2 + k)[:-1]])
    w = np.zeros(int((2 + k).sum()), "<u4")
    w[starts], w[starts + 1] = np.arange(n), k
    path.write_bytes(raw[:12 + 4 * words] + struct.pack("<II", 1, n) + w.tobytes() + bytes(1000))
    return path


BUDGET_CASES = {
    "16,384 checkpoints over a 4 GiB hole": lambda p: _sparse_checkpoints(p, 16_384, 256 << 10, 1000),
    "2,000 checkpoints claiming cells over a 4 GiB hole": lambda p: _sparse_checkpoints(p, 2_000, 2 << 20, 250_000),
    "a token list of 17.8M words over a hole": _sparse_tokens,
    "5.7M cells of alternating sizes": _alternating_cells,
    "1.5M cells of sizes without a pattern": _unpatterned_cells,
}

#: the goal of issue 19, measured on this 2-core machine: any file at most 10 s and 1 GiB in each command.
#: Time is asserted with room for a machine shared by other runs (the figures are in docs/design.md).
RSS_BOUND_KIB = 1 << 20
TIME_GUARD = 40.0


@pytest.mark.parametrize("case", sorted(BUDGET_CASES))
def test_one_file_costs_bounded_time_and_memory_in_every_command(tmp_path, case):
    """Each command on each hostile file in a child process limited to 4 GiB of address space
    (RLIMIT_AS): a documented exit code with one JSON document, no MemoryError or other internal error,
    peak resident memory under 1 GiB."""
    import resource

    bad = BUDGET_CASES[case](tmp_path / "bad.bin")
    m = str(DATA / "target.gguf")

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for args in (["inspect", str(bad)], ["inspect", str(bad), "-m", m], ["validate", str(bad), "-m", m, "--no-load"],
                 ["ls", str(bad)], ["diff", str(bad), str(DATA / "srv-np1.bin")],
                 ["convert", str(bad), "-m", m, "-ctk", "q8_0", "-o", str(tmp_path / "out.bin"), "--force"]):
        t0 = time.monotonic()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([sys.executable, "-m", "slotctl", *args, "--json"], stdout=out, stderr=err,
                                    env=env, preexec_fn=limit)
            _, status, usage = os.wait4(proc.pid, 0)
            elapsed = time.monotonic() - t0
            code = os.waitstatus_to_exitcode(status)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        assert code in ((0, 1, 3) if args[0] in ("validate", "ls") else (0, 1)), (args[0], code, stderr[-500:])
        assert b"Traceback" not in stderr and b"MemoryError" not in stderr and b"internal error" not in stderr, stderr
        json.loads(stdout)
        assert usage.ru_maxrss < RSS_BOUND_KIB, (case, args[0], usage.ru_maxrss)
        assert elapsed < TIME_GUARD, (case, args, elapsed)


@pytest.mark.parametrize("source,mutations", [
    ("kv", [("delete", 16699, 16074898141332404178)]),
    ("kv", [("insert", 12759, 2147483648)]),
    ("recurrent", [("delete", 1283, 8051073783131267982), ("insert", 3489, 887603785573371957),
                   ("insert", 18817, 18446744073709551615)]),
], ids=["kv delete", "kv insert", "recurrent"])
def test_a_cut_walk_past_the_end_never_seeks_there(tmp_path, source, mutations):
    """Found by fuzz/fuzz_slotfiles.py (seed 7): validate -m walking a payload cut short (format.cut) sought
    to the position of a field beyond the end, which a length of 2^63 puts past any offset: an internal
    error ("cannot fit 'int' into an offset-sized integer") or "Invalid argument", exit 2."""
    import mutate

    src = {s.name: s for s in mutate.sources()}[source]
    data = src.data
    for kind, pos, arg in mutations:
        data = mutate.apply(data, kind, pos, arg)
    p = tmp_path / "m.bin"
    p.write_bytes(data)
    res = runner.invoke(app, ["validate", str(p), "-m", str(src.model), "--no-load", "--json"])
    assert res.exit_code == 1, (res.exit_code, res.stdout[-400:], res.stderr)
    assert "internal error" not in res.stderr
