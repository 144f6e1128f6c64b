"""Small files that cost seconds (issue 27): the hostile files of issue 27 (tests/data/adversarial) and a family of our own
(counts near each cap, the file cut after each header), through validate -m, inspect -m, ls -m and diff.

What each reports is checked (the loader's order decides: a count the context does not hold is refused where
the loader checks it). Cost is checked as work, not time: the bytes the process reads (``rchar`` of
/proc/self/io: read and pread alike) stay within a small multiple of the bytes the file really has, and the
Python heap's peak (tracemalloc) within a few MiB, whatever the counts claim. Wall time and resident memory of
whole processes: benchmarks/bench_adversarial.py.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.format.cells import MAX_CELLS
from slotctl.format.common import MAX_LAYERS, MAX_STREAMS
from slotctl.format.header import MAX_TOKEN_WORDS

from conftest import DATA

ADVERSARIAL = DATA / "adversarial"
MODEL = DATA / "target.gguf"
SRC = DATA / "srv-np1.bin"
#: reads allowed per file: a few passes over its bytes, plus a constant (the ahead read of its head, a chunk)
READ_SLACK = 2 << 20
#: the Python heap's peak allowed per command, whatever the counts
HEAP_MAX = 24 << 20


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _cost(args: list[str]) -> tuple[dict | None, int, int, int]:
    """Run one command in process: (its JSON, exit code, bytes read, heap peak)."""
    tracemalloc.start()
    before = _rchar()
    res = CliRunner().invoke(app, [str(a) for a in args])
    read = _rchar() - before
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    try:
        doc = json.loads(res.stdout)
    except ValueError:
        doc = None
    return doc, res.exit_code, read, peak


def _commands(path: Path) -> dict[str, list]:
    return {
        "validate": ["validate", path, "-m", MODEL, "-c", "256", "--json"],
        "inspect": ["inspect", path, "-m", MODEL, "--json"],
        "ls": ["ls", path, "-m", MODEL, "-c", "256", "--json"],
        "diff": ["diff", path, SRC, "-m", MODEL, "--json"],
    }


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """The model's header read once (read_model_info caches it): its bytes are not the file's."""
    CliRunner().invoke(app, ["inspect", str(SRC), "-m", str(MODEL), "--json"])


def _assert_bounded(path: Path, name: str, read: int, peak: int) -> None:
    size = path.stat().st_size
    assert read <= 4 * size + READ_SLACK, (name, path.name, size, read)
    assert peak <= HEAP_MAX, (name, path.name, peak)


# -- the adversarial files ---------------------------------------------------------------------------------

ADVERSARIAL_FILES = {
    # name: (the code validate's first error has, the field it names)
    "cut-ns1-nl4096-r1.bin": ("layer_count_mismatch", "n_layer is 4,096"),
    "cut-ns16-nl4096-r1.bin": ("n_stream_mismatch", "n_stream is 16"),
    "cut-ns16-nl4096-r4000.bin": ("n_stream_mismatch", "n_stream is 16"),
    "cut-ns64-nl4096-r1.bin": ("n_stream_mismatch", "n_stream is 64"),
    "nlayer-2050-np1.bin": ("layer_count_mismatch", "n_layer is 2,050"),
    "nlayer-4096-np1.bin": ("layer_count_mismatch", "n_layer is 4,096"),
    "slow-validate.bin": ("layer_count_mismatch", "n_layer is 2,050"),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL_FILES))
def test_an_adversarial_file_costs_what_its_bytes_allow(name):
    path = ADVERSARIAL / name
    code, said = ADVERSARIAL_FILES[name]
    for cmd, args in _commands(path).items():
        doc, rc, read, peak = _cost(args)
        assert doc is not None and rc == 1, (cmd, rc)
        _assert_bounded(path, cmd, read, peak)
        if cmd == "validate":
            (rep,) = doc["files"]
            errors = [f for f in rep["findings"] if f["severity"] != "note"]
            assert (rep["verdict"], rep["certain"], errors[0]["code"]) == ("refused", True, code), errors
            assert said in errors[0]["message"]
            (c,) = rep["checks"]
            assert c["loaded"] == "skipped"      # the prediction refuses it: the real load never loads it


# -- our own family ----------------------------------------------------------------------------------------


def _fields(data: bytes) -> dict[str, int]:
    he = 12 + 4 * struct.unpack_from("<I", data, 8)[0]
    (cells,) = struct.unpack_from("<I", data, he + 4)
    at = {"tokens": 12, "n_stream": he, "cell count": he + 4, "cells": he + 8, "data header": he + 8 + 12 * cells}
    pos = at["data header"] + 16
    at["K0"] = pos
    pos += 12 + cells * struct.unpack_from("<Q", data, pos + 4)[0]
    at["K1"] = pos
    return at


def _family() -> dict[str, tuple[bytes, str, str]]:
    """name: (bytes, validate's verdict, a code among its errors). Counts at and next to each cap, each file
    cut right after the header holding the count (so that only the count is big); and the real file cut
    after each of its headers."""
    data = SRC.read_bytes()
    at = _fields(data)

    def put(offset: int, fmt: str, value: int, cut: int) -> bytes:
        out = bytearray(data)
        struct.pack_into(fmt, out, offset, value)
        return bytes(out[:cut])

    dh = at["data header"]
    out = {}
    for n in (MAX_STREAMS - 1, MAX_STREAMS, MAX_STREAMS + 1):
        out[f"n-stream-{n}"] = (put(at["n_stream"], "<I", n, at["n_stream"] + 4), "refused", "n_stream_mismatch")
    for n in (MAX_LAYERS - 1, MAX_LAYERS, MAX_LAYERS + 1, 2**32 - 1):
        out[f"n-layer-{n}"] = (put(dh + 4, "<I", n, dh + 16), "refused", "layer_count_mismatch")
    for n in (MAX_CELLS - 1, MAX_CELLS, MAX_CELLS + 1, 2**32 - 1):
        out[f"cells-{n}"] = (put(at["cell count"], "<I", n, at["cells"] + 12), "refused", "too_many_cells")
    for n in (MAX_TOKEN_WORDS - 1, MAX_TOKEN_WORDS, MAX_TOKEN_WORDS + 1, 2**32 - 1):
        # more words than the file holds: the loader's first check ("exceeds the file size")
        out[f"token-words-{n}"] = (put(8, "<I", n, 12 + 4 * 200), "refused", "damaged")
    out["k0-row-size-2^63"] = (put(at["K0"] + 4, "<Q", 1 << 63, at["K0"] + 12), "refused", "k_row_size_mismatch")
    # the real file cut after each header: the loader reads past the end with every check before it passed
    for name, cut in (("state-header", 12), ("token-words", at["n_stream"]), ("n-stream", at["n_stream"] + 4),
                      ("cell-count", at["cells"]), ("cells", dh), ("data-header", dh + 16), ("k0-header", at["K0"] + 12),
                      ("k1-header", at["K1"] + 12)):
        verdict = "refused" if cut < at["n_stream"] else "aborts"   # the token count is checked against the size
        out[f"cut-after-{name}"] = (data[:cut], verdict, "" if verdict == "refused" else "payload_cut")
    return out


FAMILY = _family()


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_a_family_of_hostile_counts_and_cuts_costs_what_its_bytes_allow(tmp_path, name):
    data, verdict, code = FAMILY[name]
    path = tmp_path / f"{name}.bin"
    path.write_bytes(data)
    for cmd, args in _commands(path).items():
        doc, rc, read, peak = _cost(args)
        assert doc is not None and rc in (1, 2), (cmd, rc)
        _assert_bounded(path, cmd, read, peak)
        if cmd == "validate":
            (rep,) = doc["files"]
            errors = [f["code"] for f in rep["findings"] if f["severity"] != "note"]
            assert rep["verdict"] == verdict, (rep["verdict"], errors)
            assert not code or code in errors, errors
