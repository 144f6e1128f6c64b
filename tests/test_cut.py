"""A payload cut short, read as b11434's loader reads it (slotctl.format.cut, server.restore.cut_payload_outcome).

Field by field and byte by byte: a clamped read fills the bytes the file holds and leaves the rest of the
variable as it was. Where the source settles the outcome (a check that fails on bytes the file holds; no
check after the end) validate is certain; elsewhere it says the worst, aborts, with certain: false. The
real server's side of these cuts is tests/test_agreement.py's matrix.
"""

from __future__ import annotations

import json
import struct
import time
import tracemalloc

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.format.cut import locate_cut
from slotctl.model.info import read_model_info

from conftest import DATA

SRC = DATA / "srv-np1.bin"
MODEL = DATA / "target.gguf"


def _fields() -> dict[str, int]:
    """Offsets of srv-np1.bin's fields: one KV stream of cells without ext, V not transposed."""
    data = SRC.read_bytes()
    he = 12 + 4 * struct.unpack_from("<I", data, 8)[0]
    (cells,) = struct.unpack_from("<I", data, he + 4)
    at = {"header end": he, "cell count": he + 4, "cells": he + 8, "data header": he + 8 + 12 * cells}
    pos = at["data header"] + 16
    (n_layer,) = struct.unpack_from("<I", data, at["data header"] + 4)
    for kind in ("K", "V"):
        for i in range(n_layer):
            at[f"{kind}{i}"] = pos
            pos += 12 + cells * struct.unpack_from("<Q", data, pos + 4)[0]
    return at


def _validate(tmp_path, data: bytes, *flags: str) -> dict:
    p = tmp_path / "cut.bin"
    p.write_bytes(data)
    res = CliRunner().invoke(app, ["validate", str(p), "-m", str(MODEL), "-c", "256", "-fa", "on", *flags,
                                   "--no-load", "--json"])
    (rep,) = json.loads(res.stdout)["files"]
    return rep


@pytest.mark.parametrize("where,extra,field", [
    ("K1", 4 + 3, "K row size (stream 0, record 1) (the file holds 3 of its 8 bytes)"),
    ("K0", 2, "K type (stream 0, record 0) (the file holds 2 of its 4 bytes)"),
    ("cells", 12 * 3 + 5, "cell 3 n_seq_id (the file holds 1 of its 4 bytes)"),
    ("data header", 6, "stream 0 n_layer (the file holds 2 of its 4 bytes)"),
])
def test_a_cut_the_loader_reads_past_is_the_worst_and_not_certain(tmp_path, where, extra, field):
    data = SRC.read_bytes()
    cut = data[:_fields()[where] + extra]
    with open(SRC, "rb") as f:
        got = locate_cut(f, _fields()["header end"], len(cut), read_model_info(MODEL).layout(), 4)
    assert got.describe() == field and not got.settled and got.refuses is None
    rep = _validate(tmp_path, cut)
    assert (rep["verdict"], rep["certain"]) == ("aborts", False)
    assert any("undefined behaviour" in why for why in rep["uncertain"])
    (f,) = [x for x in rep["findings"] if x["code"] == "payload_cut"]
    assert field in f["message"] and "The worst, and the verdict" in f["message"]


def test_bytes_the_file_holds_that_fail_a_check_refuse_for_certain(tmp_path):
    """Two bytes of K type 1 (f16) against a q8_0 cache (8): no value of the other two makes it 8."""
    cut = SRC.read_bytes()[:_fields()["K0"] + 2]
    rep = _validate(tmp_path, cut, "-ctk", "q8_0", "-ctv", "q8_0")
    assert (rep["verdict"], rep["certain"]) == ("refused", True)
    # the rotations, read whole before the cut, differ already (64 for q8_0): the loader's first check that
    # fails, and the one finding (b11434 returns false there and reads no further)
    codes = [x["code"] for x in rep["findings"] if x["severity"] == "error"]
    assert codes == ["k_rotation_mismatch"], codes
    # with the rotations the context expects, the bytes of the K type decide it
    data = bytearray(cut)
    struct.pack_into("<II", data, _fields()["data header"] + 8, 64, 64)
    rep = _validate(tmp_path, bytes(data), "-ctk", "q8_0", "-ctv", "q8_0")
    assert (rep["verdict"], rep["certain"]) == ("refused", True)
    assert [x["code"] for x in rep["findings"] if x["severity"] == "error"] == ["k_type_mismatch"]
    with open(SRC, "rb") as f:
        got = locate_cut(f, _fields()["header end"], len(cut), read_model_info(MODEL).layout(), 4,
                         lambda key, section, record: {"k_type": 8}.get(key))
    assert got.refuses.startswith("the 2 byte(s) of K type (stream 0, record 0) the file holds (01 00) make it 1")


def test_a_cut_inside_the_last_records_data_aborts_for_certain(tmp_path):
    rep = _validate(tmp_path, SRC.read_bytes()[:-1])
    assert (rep["verdict"], rep["certain"], rep["uncertain"]) == ("aborts", True, [])
    (f,) = [x for x in rep["findings"] if x["code"] == "payload_cut"]
    assert "checks nothing after it" in f["message"]


def test_a_cell_count_beyond_the_context_is_refused_without_making_its_cells(tmp_path):
    """2^24 cells claimed, the file cut after three: refused at the count, for certain, and the cells after
    the end are never made (the walk stops at the count)."""
    data = bytearray(SRC.read_bytes()[:_fields()["cells"] + 12 * 3])
    struct.pack_into("<I", data, _fields()["cell count"], 1 << 24)
    tracemalloc.start()
    t0 = time.monotonic()
    rep = _validate(tmp_path, bytes(data))
    elapsed, peak = time.monotonic() - t0, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (rep["verdict"], rep["certain"]) == ("refused", True)
    assert "16,777,216 cells, more than the 256" in json.dumps(rep["findings"])
    # the memory bound is what the cells would break; the time is a guard against a hang (3.5 s at load 7 here,
    # with tracemalloc on and the command's first imports: 10 s was within reach of a loaded machine)
    assert peak < 64 << 20 and elapsed < 30, (peak, elapsed)


def test_ls_says_certain_beside_the_verdict_as_validate_does(tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    data = SRC.read_bytes()
    (d / "cut.bin").write_bytes(data[:_fields()["K1"] + 7])
    (d / "whole.bin").write_bytes(data)
    args = ["ls", str(d), "-m", str(MODEL), "-c", "256", "-fa", "on"]
    doc = json.loads(CliRunner().invoke(app, args + ["--json"]).stdout)
    rows = {r["name"]: r for r in doc["files"]}
    assert (rows["cut.bin"]["verdict"], rows["cut.bin"]["certain"]) == ("aborts", False)
    assert rows["cut.bin"]["uncertain"] and rows["whole.bin"]["certain"] and rows["whole.bin"]["uncertain"] == []
    human = CliRunner().invoke(app, args, env={"COLUMNS": "200"}).stdout
    assert "not certain: b11434's loader compares variables the file never filled" in human
