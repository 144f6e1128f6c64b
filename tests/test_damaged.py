"""Bad input: a clear one-line error naming the layer and offset, exit 1 or 2, never a traceback."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import tracemalloc

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.format.appendix import build_sckp, build_sdft
from slotctl.format.blob import blob_header
from slotctl.slotfile import open_slot_file

from conftest import DATA

runner = CliRunner()
SRC = DATA / "srv-np1.bin"


def _chain_file(tmp_path):
    """A real server file with a checkpoint and a draft appendix behind it (every layer present)."""
    raw = SRC.read_bytes()
    sf = open_slot_file(SRC)
    blob = blob_header(0) + raw[sf.target.offset:]
    data = raw + build_sckp([dict(n_tokens=8, pos_min=0, pos_max=7, tgt=blob, dft=b"", spec=b"")]) \
        + build_sdft(blob, b"")
    p = tmp_path / "full.bin"
    p.write_bytes(data)
    return p, open_slot_file(p)


def _inspect(path, *extra):
    return runner.invoke(app, ["inspect", str(path), "--json", *extra])


def _file(res) -> dict:
    """The one file's object of ``inspect --json``."""
    return json.loads(res.stdout)["files"][0]


_DAMAGE = {"damaged", "gguf_model", "checkpoints_damaged", "draft_damaged"}


def _errors(d: dict) -> list[str]:
    """What broke, layer and offset first (a damaged appendix is a drop: the server restores without it)."""
    return [f["message"] for f in d["findings"] if f["code"] in _DAMAGE]


def _warnings(d: dict) -> list[str]:
    return [f["message"] for f in d["findings"] if f["severity"] != "error"]


def _assert_one_line_error(res, code=1):
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output and "Traceback" not in (res.stderr or "")
    assert res.exception is None or isinstance(res.exception, SystemExit)


def _cut_points(sf):
    points = set()
    for _name, off, size in sf.layers():
        points.update({off, off + 1, off + 4, off + size // 2, off + size - 1})
    return sorted(p for p in points if 0 <= p < sf.size)


def test_cut_at_every_layer_boundary_and_inside_each(tmp_path):
    src, sf = _chain_file(tmp_path)
    raw = src.read_bytes()
    layers = sf.layers()
    for cut in _cut_points(sf):
        p = tmp_path / f"cut{cut}.bin"
        p.write_bytes(raw[:cut])
        res = _inspect(p)
        # cutting exactly at an appendix start leaves a valid, shorter file; inside its magic, a torn one
        starts = {off for name, off, _ in layers if name in ("SCKP appendix", "SDFT appendix")}
        if any(0 <= cut - off < 4 for off in starts):
            assert res.exit_code == 0, (cut, res.output)
            continue
        _assert_one_line_error(res)
        d = _file(res)
        assert _errors(d), cut
        err = _errors(d)[0]
        assert " at 0x" in err and "\n" not in err, err


def test_error_names_layer_offset_and_expectation(tmp_path):
    raw = SRC.read_bytes()
    sf = open_slot_file(SRC)
    p = tmp_path / "short.bin"
    p.write_bytes(raw[: sf.target.offset + 2])
    res = runner.invoke(app, ["inspect", str(p)])
    assert res.exit_code == 1
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert errors, res.stderr
    # without a model no layout fits; with the model the exact field is named
    res = runner.invoke(app, ["inspect", str(p), "--model", str(DATA / "target.gguf"), "--json"])
    err = _errors(_file(res))[0]
    assert err.startswith("target memory at 0x1d8 (472): expected n_stream"), err


@pytest.mark.parametrize("patch,expect", [
    ((0, b"GGUF"), "state header at 0x0 (0): this is a GGUF model, not a slot file"),
    ((0, b"GGUG"), "state header at 0x0 (0): state file magic 0x67677371, found 0x47554747"),
    ((4, struct.pack("<I", 9)), "state header at 0x4 (4): state version 2 or 3 or 4, found 9"),
    ((8, struct.pack("<I", 0xFFFFFFF0)), "state header at 0x8 (8): token word count of at most 17,825,792, found 4,294,967,280"),
])
def test_header_damage(tmp_path, patch, expect):
    raw = bytearray(SRC.read_bytes())
    off, b = patch
    raw[off:off + len(b)] = b
    p = tmp_path / "bad.bin"
    p.write_bytes(bytes(raw))
    res = _inspect(p)
    _assert_one_line_error(res)
    assert _errors(_file(res))[0].startswith(expect)


def test_absurd_lengths_allocate_nothing_big(tmp_path):
    """Counts and lengths near 2**32 / 2**64 are refused before anything is allocated or skipped."""
    src, sf = _chain_file(tmp_path)
    raw = bytearray(src.read_bytes())
    cases = {
        "n_words": (8, struct.pack("<I", 0xFFFFFFFF)),
        "n_stream": (sf.target.offset, struct.pack("<I", 0xFFFFFFFF)),
        "cell_count": (sf.target.offset + 4, struct.pack("<I", 0xFFFFFFFF)),
        "sckp count": (sf.sckp.offset + 8, struct.pack("<I", 0xFFFFFFFF)),
        "sckp blob length": (sf.sckp.offset + 28, struct.pack("<Q", 2**64 - 1)),
        "sdft blob length": (sf.sdft.offset + 8, struct.pack("<Q", 2**63)),
    }
    for name, (off, b) in cases.items():
        data = bytearray(raw)
        data[off:off + len(b)] = b
        p = tmp_path / f"{name.replace(' ', '_')}.bin"
        p.write_bytes(bytes(data))
        tracemalloc.start()
        try:
            parsed = open_slot_file(p, layout=sf.target.layout)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert parsed.errors, name
        assert peak < 8 << 20, (name, peak)


def test_random_bytes_and_empty_files(tmp_path):
    rng = random.Random(1234)
    for i, n in enumerate([0, 1, 11, 12, 100, 4096, 65536]):
        p = tmp_path / f"rand{i}.bin"
        p.write_bytes(bytes(rng.getrandbits(8) for _ in range(n)))
        _assert_one_line_error(_inspect(p))
    # a valid header followed by noise
    raw = SRC.read_bytes()
    sf = open_slot_file(SRC)
    p = tmp_path / "noise.bin"
    p.write_bytes(raw[: sf.target.offset] + bytes(rng.getrandbits(8) for _ in range(5000)))
    res = _inspect(p)
    _assert_one_line_error(res)
    d = _file(res)
    assert d["prompt"]["n_tokens"] == 111  # what parsed is still shown


def test_damaged_appendix_keeps_the_rest(tmp_path):
    src, sf = _chain_file(tmp_path)
    raw = bytearray(src.read_bytes())
    raw[sf.sdft.offset + 4:sf.sdft.offset + 8] = struct.pack("<I", 7)  # SDFT version 7
    p = tmp_path / "badsdft.bin"
    p.write_bytes(bytes(raw))
    res = _inspect(p)
    _assert_one_line_error(res)
    d = _file(res)
    assert d["target"] is not None and len(d["checkpoints"]) == 1
    [err] = _errors(d)
    assert err.startswith(f"SDFT appendix at 0x{sf.sdft.offset + 4:x} ({sf.sdft.offset + 4}): SDFT version 1, found 7")
    assert "invalid draft state" in err


def test_usage_errors_exit_2(tmp_path):
    res = _inspect(tmp_path / "missing.bin")
    assert res.exit_code == 2
    res = _inspect(tmp_path)
    assert res.exit_code == 2
    res = runner.invoke(app, ["inspect"])
    assert res.exit_code == 2
    res = runner.invoke(app, ["inspect", str(SRC), "--model", str(SRC)])
    assert res.exit_code == 2 and "not a GGUF" in res.stderr


def test_the_installed_command_prints_one_line(tmp_path):
    """Through a real process: stderr is one line, no traceback, exit 1."""
    p = tmp_path / "bad.bin"
    p.write_bytes(b"\x71\x73\x67\x67" + b"\x04\0\0\0" + b"\xff" * 8)
    r = subprocess.run([sys.executable, "-m", "slotctl", "inspect", str(p)], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == \
        [f"error: {p}: state header at 0x8 (8): token word count of at most 17,825,792, found 4,294,967,295"]


def test_appendices_are_found_by_a_scan_when_the_payload_cannot_be_placed(tmp_path):
    """No layout fits the payload: the header, the tokens and the appendix chain (found by scanning for
    a chain that parses to the end of the file) are still shown, and the file is reported damaged."""
    raw = SRC.read_bytes()
    sf = open_slot_file(SRC)
    blob = blob_header(0) + raw[sf.target.offset:]
    garbage = bytes(random.Random(7).getrandbits(8) for _ in range(3000))
    p = tmp_path / "scan.bin"
    p.write_bytes(raw[:sf.target.offset] + garbage + build_sdft(blob, b"spec"))
    res = _inspect(p)
    _assert_one_line_error(res)
    d = _file(res)
    assert d["prompt"]["n_tokens"] == 111 and d["target"] is None
    assert d["sdft"]["offset"] == sf.target.offset + len(garbage)
    assert d["draft"]["memory"]["kind"] == "kv" and d["draft"]["spec_size"] == 4
    assert any("by scanning" in w for w in _warnings(d))
