"""Mutations of real slot files and the contract every command keeps on them.

Shared by ``tests/test_properties.py`` (hypothesis, a modest number of examples in CI) and
``fuzz/fuzz_slotfiles.py`` (the long run). The sources are real server files (tests/data) of two memory
kinds with checkpoints and draft state appended, so every layer is there to be damaged.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import time
import tracemalloc
import warnings
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from slotctl.cli.app import app
from slotctl.format.appendix import build_sckp, build_sdft
from slotctl.format.blob import blob_header
from slotctl.slotfile import open_slot_file

DATA = Path(__file__).resolve().parent / "data"
runner = CliRunner()
#: what one command may allocate (tracemalloc peak) and take on a mutated file of ~250 KB
MEMORY_BOUND = 64 << 20
TIME_BOUND = 20.0


def _payload(path: Path) -> bytes:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<I", raw, 8)
    return raw[12 + 4 * n:]


def chain_bytes(base: Path) -> bytes:
    """``base`` + SCKP (two checkpoints: target, draft and speculative blobs; one without draft) + SDFT."""
    tgt = blob_header(0) + _payload(base)
    dft = blob_header(0) + _payload(DATA / "srv-draft.bin")
    sckp = build_sckp([dict(n_tokens=8, pos_min=0, pos_max=7, tgt=tgt, dft=dft, spec=b"spec"),
                       dict(n_tokens=9, pos_min=0, pos_max=8, tgt=tgt, dft=b"", spec=b"")])
    return base.read_bytes() + sckp + build_sdft(dft, b"spec")


@dataclass(frozen=True)
class Source:
    name: str
    data: bytes
    model: Path
    #: (layer name, offset, size) of each layer of the intact file
    layers: tuple[tuple[str, int, int], ...]


def sources() -> list[Source]:
    out = []
    for name, base, model in (("kv", DATA / "srv-np1.bin", DATA / "target.gguf"),
                              ("recurrent", DATA / "kinds" / "srv-mamba.bin", DATA / "kinds" / "mamba.gguf")):
        data = chain_bytes(base)
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "src.bin"
            p.write_bytes(data)
            sf = open_slot_file(p)
            assert not sf.errors, sf.errors
            out.append(Source(name, data, model, tuple(sf.layers())))
    return out


# -- mutations: (kind, position, argument) ---------------------------------------------------------------

KINDS = ("truncate", "flip", "u32", "u64", "insert", "delete", "splice")
EXTREMES = (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, (1 << 63) - 1, (1 << 64) - 1)


def apply(data: bytes, kind: str, pos: int, arg: int) -> bytes:
    """``data`` with one mutation at ``pos`` (clamped into the file); ``arg`` is the kind's parameter. An empty
    ``data`` (an earlier mutation cut everything) stays empty."""
    if not data:
        return data
    pos = max(0, min(pos, len(data) - 1))
    b = bytearray(data)
    if kind == "truncate":
        return bytes(b[:pos])
    if kind == "flip":
        b[pos] ^= 1 << (arg % 8)
    elif kind == "u32":
        b[pos:pos + 4] = (arg & 0xFFFFFFFF).to_bytes(4, "little")
    elif kind == "u64":
        b[pos:pos + 8] = (arg & ((1 << 64) - 1)).to_bytes(8, "little")
    elif kind == "insert":
        b[pos:pos] = (arg & 0xFFFFFFFF).to_bytes(4, "little") * (1 + arg % 3)
    elif kind == "delete":
        del b[pos:pos + 1 + arg % 64]
    elif kind == "splice":   # a copy of another part of the file lands here (an appendix spliced in, ...)
        src = arg % len(data)
        piece = data[src:src + 1 + (arg >> 8) % 256]
        b[pos:pos + len(piece)] = piece
    return bytes(b)


# -- the contract -----------------------------------------------------------------------------------------


def commands(path: Path, model: Path, *, full: bool = False, original: Path | None = None,
             identify: bool = False, store: str | None = None) -> list[list[str]]:
    """The commands run on a mutated file (each leaves it as it is); ``full`` adds the slower ones (the fuzz
    run: inspect -m, strip-draft without -m, validate -m, convert to state version 3, diff -m -md, ls -m -md
    of the file). ``original``: the intact file, which ``diff`` compares with the mutated one; ``convert`` writes
    next to the file, re-encoding every K and V record (q8_0), or changing the state version. ``identify``:
    identify with two candidates for the target (the model and the draft model) and two for the draft state
    (target.gguf, which wrote the appended draft blob, and the draft model): real llama-cpp-python contexts. ``store``: the same file as an
    ``s3://`` object (uploaded by the caller): inspect, validate, ls of its prefix and cp of it down."""
    p, m, d = str(path), str(model), str(DATA / "draft.gguf")
    out_file = str(path.with_name("converted.bin"))
    convert = ["convert", p, "-m", m, "-md", d, "-o", out_file, "--force", "--json"]
    out = [["inspect", p, "--json"], ["validate", p, "--no-load", "--json"],
           ["strip-draft", p, "-m", m, "--dry-run", "--grace", "0", "--json"],
           [*convert, "-ctk", "q8_0", "-ctv", "q8_0", "-ctkd", "q4_0"]]
    if original is not None:
        out.append(["diff", str(original), p, "--json"])
    if full:
        out += [["inspect", p, "-m", m, "--json"], ["strip-draft", p, "--dry-run", "--grace", "0", "--json"],
                ["validate", p, "-m", m, "--no-load", "--json"], [*convert, "--state-version", "3"]]
        if original is not None:
            out.append(["diff", p, str(original), "-m", m, "-md", d, "--json"])
        out.append(["ls", p, "-m", m, "-md", d, "--json"])
    if identify:   # two candidates for each state: the one that wrote it and another (the SDFT blob is target.gguf's)
        out.append(["identify", p, "-m", m, "-m", d, "-md", str(DATA / "target.gguf"), "-md", d, "--json"])
    if store is not None:
        prefix = store.rpartition("/")[0] + "/"
        out += [["inspect", store, "--json"], ["validate", store, "--no-load", "--json"],
                ["ls", prefix, "-m", m, "--json", "--timeout", "60"],
                ["cp", store, str(path.with_name("downloaded.bin")), "--force", "--overwrite", "--json",
                 "--timeout", "60"]]
    return out


#: documented exit codes for a file that is read (docs/exit-codes.md): validate's 3 is "undecided without -m"
ALLOWED_EXIT = {"validate": (0, 1, 3), "ls": (0, 1, 3)}


def check_command(args: list[str], *, measure: bool = True) -> tuple[int, float, int]:
    """Run one command in this process; assert the contract; return (exit code, seconds, peak bytes).

    Contract: exit 0 or 1 (3 for validate without -m; a file that is read is never a usage error), no exception,
    no Python warning (a numpy RuntimeWarning is a line of noise on stderr), stderr holds only one-line
    ``error:`` / ``warning:`` messages, ``--json`` output is one JSON document, within :data:`TIME_BOUND`
    and :data:`MEMORY_BOUND`.
    """
    if measure:
        tracemalloc.start()
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for hidden in (ResourceWarning, DeprecationWarning, PendingDeprecationWarning):   # never shown to users
                warnings.simplefilter("ignore", hidden)
            res = runner.invoke(app, args)
    finally:
        elapsed = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1] if measure else 0
        if measure:
            tracemalloc.stop()
    where = " ".join(args)
    assert res.exception is None or isinstance(res.exception, SystemExit), (where, repr(res.exception))
    assert not caught, (where, [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught])
    assert res.exit_code in ALLOWED_EXIT.get(args[0], (0, 1)), (where, res.exit_code, res.stderr)
    for line in res.stderr.splitlines():
        assert line.startswith(("error: ", "warning: ")), (where, line)
    if "--json" in args:   # strict JSON: NaN and Infinity are not JSON (jq refuses them)
        json.loads(res.stdout, parse_constant=lambda c: _not_json(f"{where}: {c} in the JSON"))
    assert elapsed < TIME_BOUND, (where, elapsed)
    assert peak < MEMORY_BOUND, (where, peak)
    return res.exit_code, elapsed, peak


def _not_json(message: str):
    raise AssertionError(message)


def check_strip_in_place(path: Path) -> int:
    """strip-draft in place (and --checkpoints): the file is unchanged, or it is a clean file without draft state."""
    before = path.read_bytes()
    code, _, _ = check_command(["strip-draft", str(path), "--checkpoints", "--grace", "0", "--json"], measure=False)
    after = path.read_bytes()
    if code == 1:
        assert after == before, "a refused file was changed"
    elif after != before:
        sf = open_slot_file(path)
        assert not sf.errors and sf.sdft is None, sf.errors
        assert after[:sf.header_end] == before[:sf.header_end]
    assert not [n for n in os.listdir(path.parent) if n.endswith(".tmp")]
    return code


def check_file(data: bytes, src: Source, directory: Path, *, full: bool = False, identify: bool = False,
               store: str | None = None, measure_all: bool | None = None) -> list[int]:
    """Every command on ``data``, a mutation of ``src`` (both written to ``directory``); the exit codes.

    Memory is measured (tracemalloc, which slows Python several times) on the first command, inspect;
    with ``full`` (or ``measure_all``) on every command. ``identify``, ``store``: see :func:`commands`
    (the object at ``store`` holds ``data`` already).
    """
    p = directory / "mutated.bin"
    p.write_bytes(data)
    original = directory / "original.bin"
    if not original.exists() or original.read_bytes() != src.data:
        original.write_bytes(src.data)
    cmds = commands(p, src.model, full=full, original=original, identify=identify, store=store)
    measure_all = full if measure_all is None else measure_all
    codes = [check_command(args, measure=measure_all or i == 0)[0] for i, args in enumerate(cmds)]
    codes.append(check_strip_in_place(p))
    return codes
