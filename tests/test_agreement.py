"""The agreement matrix: what ``slotctl validate`` says a server does with a slot file, against what it does.

Two matrices, each of slot files x server flag sets:

* **b11434**: files written by llama-server b11434 (tests/data and files saved here by the servers of the
  matrix), by ``slotctl save``, and damaged copies (cut inside the tokens, inside the cell metadata, inside
  the KV data, one byte short, a torn appendix magic, bytes after the payload, another state version, a
  checkpoint appendix with an empty target blob or a count beyond its entries, a draft blob that is no state, a
  checkpoint blob that is no state) are restored by a real llama-server (``POST /slots/0?action=restore``)
  under each flag set: ``-c``, ``-np``, ``-kvu``, ``-ctk/-ctv``, ``-fa``, another model of the same shape,
  and for the other memory kinds their own models. The truth of a cell: ``restored`` (200, with
  ``n_restored``), ``refused`` (an error answer, the server alive) or ``aborts`` (the process died).
  ``validate --json`` with the same model and flags must say the same of every cell, and ``n_restored``
  must equal the file's token count. One server per flag set and many restores per server; a server is
  started again only after it died.
* **appendices**: b11434 ignores the appendices (SCKP, SDFT) that the draft-state change (llama.cpp
  ea736c1d5) and the upstream checkpoint loader read. For them,
  ``slotctl restore --json`` (real llama-cpp-python contexts, the draft context included) is the reference:
  validate's prediction of every step (``target``, ``tokens``, ``checkpoints`` with the count kept,
  ``draft``) must equal what the restore did, for files with valid, damaged and unusable appendices under
  draft flag sets (none, the draft of the save, ``-ctkd q8_0``, a draft of another shape, fewer
  ``--ctx-checkpoints``).

The figures are printed (``pytest -s``); docs/validate.md ("Agreement") has the latest.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import DATA, start_server
from llama_server import LlamaServer
from slotctl.format.blob import BLOB_MAGIC
from slotctl.cli.app import app
from slotctl.tinymodels import make_model

pytestmark = pytest.mark.server
runner = CliRunner()

SCKP, SDFT = b"SCKP", b"SDFT"

#: the prompt of tests/data's files (their models know these words), and the one the servers of the matrix
#: save after
SAVE_PROMPT = "what is the capital of france? paris is the capital of france. the river of paris is north of the city"
LIVE_PROMPT = "the river of paris is north of the city. what is the capital of france? paris is"


# -- the truth of one cell ----------------------------------------------------------------------------------


def n_tokens_of(data: bytes) -> int:
    """The prompt's token count as the server reads the token words (packed record or plain list)."""
    (n_words,) = struct.unpack_from("<I", data, 8)
    if n_words and struct.unpack_from("<i", data, 12)[0] == -1:
        return struct.unpack_from("<I", data, 20)[0]
    return n_words


def tokens_of(data: bytes) -> list[int]:
    """The prompt's tokens as the server reads the token words."""
    (n_words,) = struct.unpack_from("<I", data, 8)
    words = list(struct.unpack_from(f"<{n_words}i", data, 12))
    if n_words and words[0] == -1:
        return words[3:3 + words[2]]
    return words


def reused_by_server(srv: LlamaServer, tokens: list[int]) -> int:
    """Send the restored slot a request extending its prompt (token ids: no tokenization in between) and
    return how many prompt tokens the server kept (``timings.cache_n``)."""
    extra = tokens[:3] or [5, 6, 7]
    answer = srv.completion(tokens + extra, slot=0, n_predict=1)
    t = answer["timings"]
    assert t["prompt_n"] + t["cache_n"] == len(tokens) + len(extra), t
    return t["cache_n"]


def restore_outcome(srv: LlamaServer, name: str) -> tuple[str, dict | str | None]:
    """What the server did restoring ``name`` into slot 0: ("restored", answer), ("refused", answer) or
    ("aborts", None) when the process died."""
    try:
        status, answer = srv.restore(0, name)
    except (OSError, http.client.HTTPException):
        status, answer = None, None
    if status is None or srv.proc.poll() is not None:
        deadline = time.monotonic() + 10
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.proc.poll() is not None, f"restore {name}: no answer and the server still runs"
        return "aborts", None
    if status == 200:
        return "restored", answer
    return "refused", answer


#: validate's verdict -> the cell's truth
VERDICT_TRUTH = {"restores": "restored", "restores_with_drops": "restored", "refused": "refused",
                 "aborts": "aborts"}


# -- the files ---------------------------------------------------------------------------------------------


def sckp(*entries: tuple[int, int, int, bytes, bytes, bytes], count: int | None = None, version: int = 1) -> bytes:
    out = SCKP + struct.pack("<II", version, len(entries) if count is None else count)
    for n_tokens, pos_min, pos_max, tgt, dft, spec in entries:
        out += struct.pack("<qii", n_tokens, pos_min, pos_max)
        for b in (tgt, dft, spec):
            out += struct.pack("<Q", len(b)) + b
    return out


def sdft(dft: bytes, spec: bytes = b"", version: int = 1) -> bytes:
    return SDFT + struct.pack("<I", version) + struct.pack("<Q", len(dft)) + dft + struct.pack("<Q", len(spec)) + spec


def not_a_state(n: int) -> bytes:
    """A well-framed blob that is no state llama.cpp loads: the blob magic, then zeros."""
    return struct.pack("<Ii", BLOB_MAGIC, 0) + b"\x07" * (n - 8)


def with_version(data: bytes, version: int) -> bytes:
    return data[:4] + struct.pack("<I", version) + data[8:]


def damaged(base: bytes, header_end: int) -> dict[str, bytes]:
    """Damaged copies of a file of one KV stream holding ``base``'s payload, at the damage's name."""
    cells = header_end + 8          # n_stream, cell_count, then the cells
    return {
        "cut-tokens": base[:12 + 4 * 10],
        "cut-cells": base[:cells + 8 * 5 + 2],
        "cut-kv-half": base[:len(base) // 2],
        "one-short": base[:-1],
        "torn-magic-SDF": base + b"SDF",
        "torn-magic-S": base + b"S",
        "extra-16": base + bytes(range(7, 7 + 16 * 13, 13)),
        "version-3": with_version(base, 3),
        "version-5": with_version(base, 5),
        "sckp-empty-target": base + sckp((20, 0, 19, b"", b"", b"")),
        "sckp-count-1025": base + SCKP + struct.pack("<II", 1, 1025),
        "sckp-version-2": base + sckp((20, 0, 19, not_a_state(64), b"", b""), version=2),
        "sckp-not-a-state": base + sckp((20, 0, 19, not_a_state(64), b"", b"")),
        "sdft-not-a-state": base + sdft(not_a_state(64)),
    }


def header_end_of(data: bytes) -> int:
    return 12 + 4 * struct.unpack_from("<I", data, 8)[0]


def kv_fields(data: bytes, header_end: int) -> dict[str, int]:
    """Offsets of the fields of a version-4 payload of one KV stream (cells without ext), read from its bytes
    as the loader reads them: the cells, the data header, and each K and V record's header."""
    return kv_section_fields(data, header_end)[0]


def _put(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def kv_section_fields(data: bytes, pos: int) -> tuple[dict[str, int], int]:
    """Offsets of the fields of a version-4 KV section of one stream at ``pos`` (cells without ext), read from
    its bytes as the loader reads them, and where the section ends: n_stream, the cell count, the cells, the
    data header (v_trans, n_layer, the rotations) and each K and V record's header."""
    (cells,) = struct.unpack_from("<I", data, pos + 4)
    at = {"n_stream": pos, "cell count": pos + 4, "cells": pos + 8}
    pos += 8 + 12 * cells
    v_trans, n_layer = struct.unpack_from("<II", data, pos)
    at["data header"] = pos
    pos += 16
    for kind in ("K", "V"):
        for i in range(n_layer):
            at[f"{kind}{i}"] = pos
            if kind == "V" and v_trans:
                _t, el, n_embd = struct.unpack_from("<iII", data, pos)
                pos += 12 + n_embd * cells * el
            else:
                _t, row = struct.unpack_from("<iQ", data, pos)
                pos += 12 + cells * row
    return at, pos


def loader_order_damages(base: bytes) -> dict[str, bytes]:
    """Copies of ``base`` (a version-4 file of one KV section of one stream, or of an iSWA model's two) with a
    field b11434's loader checks changed, and cut halfway through the last record's data, so that a parse
    that believed the changed field would overrun the end: v_trans, a record's type or row size, n_layer,
    the cell count (one more, beyond the context), n_stream, a rotation, a cell's n_seq_id, and the token
    word count (which moves every later field). The loader checks the changed field before it reads past
    the end: each is refused, for certain (llama_kv_cache::state_read_sinfo / state_read_meta /
    state_read_data; llama_context::state_seq_load_file)."""
    he = header_end_of(base)
    at, end = kv_section_fields(base, he)
    sections = [at]
    if end < len(base) and struct.unpack_from("<I", base, end)[0] == 1:   # a second (SWA) section
        sections.append(kv_section_fields(base, end)[0])
    cut = len(base) - 40
    (cells,) = struct.unpack_from("<I", base, at["cell count"])
    (v_trans,) = struct.unpack_from("<I", base, at["data header"])
    out = {}
    for n, f in enumerate(sections):
        sec = "" if n == 0 else "swa-"
        dh = f["data header"]
        out.update({
            f"{sec}v-trans-flipped": _put(base, dh, "<I", 1 - v_trans),
            f"{sec}n-layer-3": _put(base, dh + 4, "<I", 3),
            f"{sec}n-layer-4096": _put(base, dh + 4, "<I", 4096),
            f"{sec}rot-k-64": _put(base, dh + 8, "<I", 64),
            f"{sec}k0-type-q8_0": _put(base, f["K0"], "<i", 8),
            f"{sec}k1-row-size-2^40": _put(base, f["K1"] + 4, "<Q", 1 << 40),
            f"{sec}v0-type-bf16": _put(base, f["V0"], "<i", 30),
            f"{sec}cell-2-n-seq-id-2": _put(base, f["cells"] + 12 * 2 + 4, "<I", 2),
            f"{sec}n-stream-2": _put(base, f["n_stream"], "<I", 2),
            f"{sec}cell-count-5000": _put(base, f["cell count"], "<I", 5000),
        })
        if not v_trans:
            out[f"{sec}v1-row-size-257"] = _put(base, f["V1"] + 4, "<Q", 257)
        else:
            out[f"{sec}v1-width-2^20"] = _put(base, f["V1"] + 8, "<I", 1 << 20)
    out["cell-count-plus-1"] = _put(base, at["cell count"], "<I", cells + 1)
    out["token-words-plus-1"] = _put(base, 8, "<I", struct.unpack_from("<I", base, 8)[0] + 1)
    out["token-words-plus-2"] = _put(base, 8, "<I", struct.unpack_from("<I", base, 8)[0] + 2)
    return {f"order-{name}": data[:cut] for name, data in out.items()}


def recurrent_order_damages(data: bytes) -> dict[str, bytes]:
    """Copies of a recurrent (mamba) file with a field ``llama_memory_recurrent::state_read`` checks changed
    and cut halfway through the last s record's data: the cell count (beyond the one cell a slot has), the
    cell's n_seq_id, s_trans, n_layer, an r record's type and row size, an s record's row size."""
    he = header_end_of(data)
    (cells,) = struct.unpack_from("<I", data, he)
    head = he + 4 + 8 * cells
    (n_layer,) = struct.unpack_from("<I", data, head + 4)
    pos, at = head + 8, {}
    for kind in ("r", "s"):
        for i in range(n_layer):
            at[f"{kind}{i}"] = pos
            pos += 12 + cells * struct.unpack_from("<Q", data, pos + 4)[0]
    out = {
        "cell-count-2": _put(data, he, "<I", 2),
        "n-seq-id-1": _put(data, he + 8, "<I", 1),
        "s-trans-1": _put(data, head, "<I", 1),
        "n-layer-3": _put(data, head + 4, "<I", 3),
        "r0-type-f16": _put(data, at["r0"], "<i", 1),
        "r1-row-size-2^40": _put(data, at["r1"] + 4, "<Q", 1 << 40),
        "s0-row-size-8": _put(data, at["s0"] + 4, "<Q", 8),
    }
    return {f"order-{name}": d[:len(data) - 100] for name, d in out.items()}


def recurrent_header_cuts(data: bytes, header_end: int) -> dict[str, bytes]:
    """Copies of a recurrent payload (every layer with state: mamba) cut inside the cell, the section's
    header (s_trans, n_layer) and the headers of its r and s records, read from its bytes."""
    (cells,) = struct.unpack_from("<I", data, header_end)
    pos = header_end + 4 + 8 * cells          # a single-sequence cell: pos, n_seq_id 0
    head = pos
    (n_layer,) = struct.unpack_from("<I", data, pos + 4)
    pos += 8
    at = {}
    for kind in ("r", "s"):
        for i in range(n_layer):
            at[f"{kind}{i}"] = pos
            pos += 12 + cells * struct.unpack_from("<Q", data, pos + 4)[0]
    return {
        "cut-cell": data[:header_end + 4 + 5],
        "cut-section-header": data[:head + 5],
        "cut-r0-type": data[:at["r0"] + 3],
        "cut-r1-row-size": data[:at["r1"] + 4 + 2],
        "cut-s0-row-size": data[:at["s0"] + 4 + 6],
    }


def header_cuts(base: bytes, header_end: int) -> dict[str, bytes]:
    """Copies of ``base`` cut inside a field the loader checks or reads before its data: the cell metadata
    (a position, a sequence-id count, a sequence id), the data header, and the headers of K and V records
    (the type read in part; the type whole and the row size, or the element size, in part)."""
    at = kv_fields(base, header_end)
    cells = at["cells"]
    return {
        "cut-cell-pos": base[:cells + 12 * 3 + 2],
        "cut-cell-seq-id": base[:cells + 12 * 3 + 9],
        "cut-data-header": base[:at["data header"] + 6],
        "cut-k0-type": base[:at["K0"] + 2],
        "cut-k0-row-size": base[:at["K0"] + 4 + 3],
        "cut-k1-row-size": base[:at["K1"] + 4 + 3],
        "cut-v0-type": base[:at["V0"] + 1],
        "cut-v1-row-size": base[:at["V1"] + 4 + 5],
    }


@dataclass(frozen=True)
class FlagSet:
    """One llama-server: its model (``target``, ``other`` or a memory kind) and flags (also validate's)."""

    name: str
    model: str
    flags: tuple[str, ...]


B11434_FLAG_SETS = [
    FlagSet("c256-np1", "target", ("-c", "256", "-np", "1", "-fa", "on")),
    FlagSet("c512-np2", "target", ("-c", "512", "-np", "2", "-fa", "on")),
    FlagSet("fa-off", "target", ("-c", "256", "-np", "1", "-fa", "off")),
    FlagSet("kv-q8_0", "target", ("-c", "256", "-np", "1", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0")),
    FlagSet("kvu-np2", "target", ("-c", "512", "-np", "2", "-kvu", "-fa", "on")),
    FlagSet("np4-c256", "target", ("-c", "256", "-np", "4", "-fa", "on")),
    FlagSet("other-model", "other", ("-c", "256", "-np", "1", "-fa", "on")),
]
KIND_FLAG_SETS = [
    FlagSet("gemma2", "gemma2", ("-c", "256", "-np", "1", "-fa", "on")),
    FlagSet("mamba", "mamba", ("-c", "256", "-np", "1", "-fa", "on")),
]


@dataclass
class Matrix:
    """The cells of one matrix and whether validate agreed with each."""

    cells: list[dict] = field(default_factory=list)
    reuse_checked: int = 0
    #: cells validate called aborts with certain: false (undefined behaviour), by what the server did
    uncertain: dict[str, int] = field(default_factory=dict)

    def add(self, **cell) -> None:
        self.cells.append(cell)

    @property
    def disagreements(self) -> list[dict]:
        return [c for c in self.cells if not c["agree"]]

    def summary(self, title: str) -> str:
        n, bad = len(self.cells), len(self.disagreements)
        lines = [f"{title}: {n} cells, {n - bad} agree ({100 * (n - bad) / max(n, 1):.1f}%)"
                 + (f"; predicted reuse checked in {self.reuse_checked}" if self.reuse_checked else "")
                 + (f"; not certain (the worst, aborts) in {sum(self.uncertain.values())}, where the server "
                    + ", ".join(f"{k} {v}" for k, v in sorted(self.uncertain.items())) if self.uncertain else "")]
        lines += [f"  DISAGREE {c['file']} x {c['flags']}: server {c['truth']}, validate {c['verdict']}"
                  f"{' (' + c['why'] + ')' if c.get('why') else ''}" for c in self.disagreements]
        return "\n".join(lines)


def validate_json(files: list[Path], *args: str) -> dict[str, dict]:
    res = runner.invoke(app, ["validate", *map(str, files), *args, "--json"])
    assert res.exit_code in (0, 1), res.output
    doc = json.loads(res.stdout)
    assert doc["exit_code"] == res.exit_code
    return {Path(f["path"]).name: f for f in doc["files"]}


def first_error(report: dict) -> str:
    errs = [f for f in report["findings"] if f["severity"] != "note"]
    return f"{errs[0]['code']}: {errs[0]['message'][:160]}" if errs else ""


# -- the b11434 matrix ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("agreement-models")
    out = {"target": DATA / "target.gguf", "draft": DATA / "draft.gguf",
           "other": make_model(d / "other.gguf", seed=7, name="slotctl-tiny-other")}
    for kind in ("gemma2", "mamba"):
        out[kind] = DATA / "kinds" / f"{kind}.gguf"
    return out


def _slotctl_save(out: Path, model: Path, *args: str) -> None:
    res = runner.invoke(app, ["save", "-m", str(model), "-p", SAVE_PROMPT, "-o", str(out), "--force", *args])
    assert res.exit_code == 0, res.output


@pytest.fixture(scope="module")
def b11434_matrix(llama_server_bin, models, tmp_path_factory) -> Matrix:
    tmp = tmp_path_factory.mktemp("agreement")
    slots = tmp / "slots"
    slots.mkdir()
    llama_files: dict[str, Path] = {}
    for p in sorted(DATA.glob("srv-*.bin")):
        llama_files[p.name] = Path(shutil.copy(p, slots / p.name))
    # written by slotctl save
    for name, args in (("slotctl-np1.bin", ("-c", "256", "-np", "1", "-fa", "on")),
                       ("slotctl-fa-off.bin", ("-c", "256", "-np", "1", "-fa", "off")),
                       ("slotctl-draft.bin", ("-c", "256", "-np", "1", "-fa", "on", "-md", str(models["draft"]), "--spec-type", "draft-simple"))):
        _slotctl_save(slots / name, models["target"], *args)
        llama_files[name] = slots / name
    base = (DATA / "srv-np1.bin").read_bytes()
    for name, data in damaged(base, header_end_of(base)).items():
        (slots / f"np1-{name}.bin").write_bytes(data)
        llama_files[f"np1-{name}.bin"] = slots / f"np1-{name}.bin"
    for name, data in header_cuts(base, header_end_of(base)).items():
        (slots / f"np1-{name}.bin").write_bytes(data)
        llama_files[f"np1-{name}.bin"] = slots / f"np1-{name}.bin"
    for name, data in loader_order_damages(base).items():
        (slots / f"np1-{name}.bin").write_bytes(data)
        llama_files[f"np1-{name}.bin"] = slots / f"np1-{name}.bin"
    base = (DATA / "srv-fa-off.bin").read_bytes()
    for name, data in loader_order_damages(base).items():
        (slots / f"fa-off-{name}.bin").write_bytes(data)
        llama_files[f"fa-off-{name}.bin"] = slots / f"fa-off-{name}.bin"
    cuts = {**damaged(base, header_end_of(base)), **header_cuts(base, header_end_of(base))}
    for name in ("cut-kv-half", "one-short", "cut-v0-type", "cut-v1-row-size"):
        (slots / f"fa-off-{name}.bin").write_bytes(cuts[name])
        llama_files[f"fa-off-{name}.bin"] = slots / f"fa-off-{name}.bin"
    kind_files: dict[str, dict[str, Path]] = {}
    for kind in ("gemma2", "mamba"):
        data = (DATA / "kinds" / f"srv-{kind}.bin").read_bytes()
        kind_files[kind] = {}
        cuts = ({**recurrent_header_cuts(data, header_end_of(data)), **recurrent_order_damages(data)}
                if kind == "mamba" else loader_order_damages(data))
        for name, blob in (("", data), ("-one-short", data[:-1]), ("-cut-half", data[:len(data) // 2]),
                           ("-extra-16", data + bytes(16)), *((f"-{n}", b) for n, b in cuts.items())):
            p = slots / f"srv-{kind}{name}.bin"
            p.write_bytes(blob)
            kind_files[kind][p.name] = p

    matrix = Matrix()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GGML_NO_BACKTRACE", "1")   # an aborting server dies at once, without a debugger
        servers: dict[str, LlamaServer] = {}
        try:
            # each server saves one file of its own first: server-written files under every flag set
            for fs in B11434_FLAG_SETS:
                srv = start_server(llama_server_bin, models[fs.model], tmp, fs.name, args=fs.flags,
                                   slot_save_path=slots)
                servers[fs.name] = srv
                srv.completion(LIVE_PROMPT, slot=0, n_predict=4)
                srv.save(0, f"live-{fs.name}.bin")
                srv.erase(0)
                llama_files[f"live-{fs.name}.bin"] = slots / f"live-{fs.name}.bin"
            for fs in B11434_FLAG_SETS + KIND_FLAG_SETS:
                files = llama_files if fs in B11434_FLAG_SETS else kind_files[fs.model]
                srv = servers.get(fs.name) or start_server(llama_server_bin, models[fs.model], tmp, fs.name,
                                                           args=fs.flags, slot_save_path=slots)
                servers[fs.name] = srv
                verdicts = validate_json(list(files.values()), "-m", str(models[fs.model]), *fs.flags,
                                         "--server-build", "b11434")
                for name, path in sorted(files.items()):
                    truth, answer = restore_outcome(srv, name)
                    if truth == "aborts":
                        srv.stop()
                        srv = servers[fs.name] = start_server(llama_server_bin, models[fs.model], tmp,
                                                              f"{fs.name}-again", args=fs.flags,
                                                              slot_save_path=slots)
                    rep = verdicts[name]
                    got = VERDICT_TRUTH.get(rep["verdict"], rep["verdict"])
                    agree, why = got == truth, ""
                    if not rep["certain"] and rep["verdict"] == "aborts":
                        # the source does not settle it: validate says the worst, the build does either
                        agree = truth in ("refused", "aborts")
                        matrix.uncertain[truth] = matrix.uncertain.get(truth, 0) + 1
                    if truth == "restored":
                        data = path.read_bytes()
                        n = n_tokens_of(data)
                        if answer.get("n_restored") != n:
                            agree, why = False, f"n_restored {answer.get('n_restored')}, the file holds {n}"
                        reuse = rep.get("reuse")
                        kept = reused_by_server(srv, tokens_of(data))
                        srv.erase(0)
                        if agree and (reuse is None or reuse["b11434"]["n_reused"] != kept):
                            agree, why = False, f"the server kept {kept} tokens, validate predicted {reuse}"
                        matrix.reuse_checked += 1
                    if not agree and not why:
                        why = first_error(rep) if truth == "restored" else (
                            "server: " + str(answer)[:160] if truth == "refused" else "")
                    matrix.add(file=name, flags=fs.name, truth=truth, verdict=rep["verdict"], certain=rep["certain"],
                               agree=agree, why=why)
        finally:
            for srv in servers.values():
                srv.stop()
    print("\n" + matrix.summary("b11434 agreement matrix"))
    return matrix


def _cells(spec: dict[str, tuple[str, ...]]) -> set[tuple[str, str]]:
    return {(f, fs) for f, flag_sets in spec.items() for fs in flag_sets}


#: cells where validate disagreed with the server when this test was written (issue 9); each fix removes
#: its cells, and the test fails on a cell listed here that agrees, so the list only shrinks
KNOWN_B11434: set[tuple[str, str]] = set()


def check_matrix(matrix: Matrix, known: set[tuple[str, str]], title: str) -> None:
    found = {(c["file"], c["flags"]) for c in matrix.disagreements}
    assert not found - known, matrix.summary(title)
    assert not known - found, f"{title}: these cells agree now, remove them from the known list: {known - found}"


def test_validate_agrees_with_llama_server_b11434(b11434_matrix):
    check_matrix(b11434_matrix, KNOWN_B11434, "b11434 agreement matrix")


def test_a_cut_inside_a_k_record_header_crashes_where_the_file_would_restore(b11434_matrix):
    """The disagreement of issue 15: a file cut inside a K record's header (the type read whole, the row size
    in part) crashed b11434 in every configuration where the whole file restores, and validate said
    "refused". Now it says the worst, aborts, and that this rests on undefined behaviour (certain: false);
    a cut whose own bytes contradict the context, or after a mismatch, is refused for certain."""
    cells = {(c["file"], c["flags"]): c for c in b11434_matrix.cells}
    restores = [fs for fs in ("c256-np1", "kvu-np2", "other-model")
                if cells[("srv-np1.bin", fs)]["truth"] == "restored"]
    assert len(restores) == 3
    for fs in restores:
        c = cells[("np1-cut-k1-row-size.bin", fs)]
        assert (c["truth"], c["verdict"], c["certain"]) == ("aborts", "aborts", False), c
    # a context the file does not fit refuses it whatever the cut, for certain
    for fs in ("c512-np2", "np4-c256", "fa-off", "kv-q8_0"):
        c = cells[("np1-cut-k1-row-size.bin", fs)]
        assert (c["truth"], c["verdict"], c["certain"]) == ("refused", "refused", True), c
    # one byte short, in the last record's data: nothing is checked after it, so it aborts for certain
    for fs in restores:
        c = cells[("np1-one-short.bin", fs)]
        assert (c["truth"], c["verdict"], c["certain"]) == ("aborts", "aborts", True), c


def test_the_b11434_matrix_covers_every_outcome(b11434_matrix):
    """The matrix is not trivially green: it holds restores, refusals and aborts under several flag sets."""
    truths = {c["truth"] for c in b11434_matrix.cells}
    assert truths == {"restored", "refused", "aborts"}
    assert len({c["flags"] for c in b11434_matrix.cells}) == len(B11434_FLAG_SETS) + len(KIND_FLAG_SETS)
    assert len(b11434_matrix.cells) >= 200


# -- the b11669 matrix: the seed's own server, which reads both appendices --------------------------------------


def b11669_flag_sets(models: dict[str, Path]) -> list[FlagSet]:
    """b11434's flag sets and memory kinds, and drafters: the draft of the save, another draft cache type,
    -md without a drafter, and fewer --ctx-checkpoints."""
    d = str(models["draft"])
    return [*B11434_FLAG_SETS, *KIND_FLAG_SETS,
            FlagSet("draft", "target", ("-c", "256", "-np", "1", "-fa", "on", "-md", d, "--spec-type", "draft-simple")),
            FlagSet("draft-ctkd-q8_0", "target", ("-c", "256", "-np", "1", "-fa", "on", "-md", d, "--spec-type",
                                                  "draft-simple", "-ctkd", "q8_0", "-ctvd", "q8_0")),
            FlagSet("md-without-drafter", "target", ("-c", "256", "-np", "1", "-fa", "on", "-md", d)),
            FlagSet("gemma2-draft-ctxcp-1", "gemma2", ("-c", "256", "-np", "1", "-fa", "on", "-md", d, "--spec-type",
                                                       "draft-simple", "--ctx-checkpoints", "1"))]


def appendix_damages(data: bytes) -> dict[str, bytes]:
    """Copies of a file b11669 saved with checkpoints and a draft state, each appendix damaged one way: the
    checkpoint appendix's version, count, an empty target blob, a target or draft blob that is no state, a cut
    in it; the draft state's version, magic, length, a blob that is no state, a cut in it."""
    at = data.find(SCKP)
    base = data[:at]
    k, s = split_appendices(data, at)
    n_tokens, pos_min, pos_max = struct.unpack_from("<qii", k, 12)
    blobs, pos = [], 12 + 16
    for _ in range(3):
        (n,) = struct.unpack_from("<Q", k, pos)
        blobs.append(k[pos + 8:pos + 8 + n])
        pos += 8 + n
    rest = k[pos:]      # the later checkpoints
    count = struct.unpack_from("<I", k, 8)[0]

    def first(tgt: bytes, dft: bytes) -> bytes:
        return (SCKP + struct.pack("<II", 1, count) + struct.pack("<qii", n_tokens, pos_min, pos_max)
                + b"".join(struct.pack("<Q", len(b)) + b for b in (tgt, dft, blobs[2])) + rest)

    (n_dft,) = struct.unpack_from("<Q", s, 8)
    return {
        "b11669-saved": data,
        "sckp-version-2": base + k[:4] + struct.pack("<I", 2) + k[8:] + s,
        "sckp-count-plus-1": base + k[:8] + struct.pack("<I", count + 1) + k[12:] + s,
        "sckp-empty-target": base + first(b"", blobs[1]) + s,
        "sckp-target-not-a-state": base + first(not_a_state(64), blobs[1]) + s,
        "sckp-target-cut": base + first(blobs[0][:-9], blobs[1]) + s,
        "sckp-draft-not-a-state": base + first(blobs[0], not_a_state(64)) + s,
        "sckp-cut": base + k[:len(k) // 2],
        "sdft-version-2": base + k + s[:4] + struct.pack("<I", 2) + s[8:],
        "sdft-magic": base + k + b"SDFX" + s[4:],
        "sdft-length-beyond": base + k + s[:8] + struct.pack("<Q", 1 << 40) + s[16:],
        "sdft-not-a-state": base + k + sdft(not_a_state(64)),
        "sdft-cut": base + k + s[:16 + n_dft // 2],
        "no-sdft": base + k,
        "no-appendix": base,
    }


@pytest.fixture(scope="module")
def b11669_matrix(llama_server_b11669, models, tmp_path_factory) -> Matrix:
    """Every class of damage of the b11434 matrix and the appendices' under b11669, restored by b11669: the
    truth of a cell is its outcome and, when restored, the checkpoint and draft steps its log lines say
    (tests/test_b11669.py's reading of them); validate --server-build b11669 must say the same, and its predicted
    reuse must be the server's cache_n."""
    from server_log import restore as restore_logged
    from server_log import steps_of

    tmp = tmp_path_factory.mktemp("agreement-b11669")
    slots = tmp / "slots"
    slots.mkdir()
    # the chroot sees /tmp only: the models are copied there
    models = {k: Path(shutil.copy(v, tmp / f"{k}.gguf")) for k, v in models.items()}
    flag_sets = b11669_flag_sets(models)
    plain: dict[str, Path] = {}
    for p in sorted(DATA.glob("srv-*.bin")):
        plain[p.name] = Path(shutil.copy(p, slots / p.name))
    for name, args in (("slotctl-np1.bin", ("-c", "256", "-np", "1", "-fa", "on")),
                       ("slotctl-draft.bin", ("-c", "256", "-np", "1", "-fa", "on", "-md", str(models["draft"]),
                                              "--spec-type", "draft-simple"))):
        _slotctl_save(slots / name, models["target"], *args)
        plain[name] = slots / name
    base = (DATA / "srv-np1.bin").read_bytes()
    for name, data in {**damaged(base, header_end_of(base)), **header_cuts(base, header_end_of(base)),
                       **loader_order_damages(base)}.items():
        (slots / f"np1-{name}.bin").write_bytes(data)
        plain[f"np1-{name}.bin"] = slots / f"np1-{name}.bin"
    kind_files: dict[str, dict[str, Path]] = {}
    for kind in ("gemma2", "mamba"):
        data = (DATA / "kinds" / f"srv-{kind}.bin").read_bytes()
        cuts = ({**recurrent_header_cuts(data, header_end_of(data)), **recurrent_order_damages(data)}
                if kind == "mamba" else loader_order_damages(data))
        kind_files[kind] = {}
        for name, blob in (("", data), ("-one-short", data[:-1]), ("-cut-half", data[:len(data) // 2]),
                           *((f"-{n}", b) for n, b in cuts.items())):
            p = slots / f"srv-{kind}{name}.bin"
            p.write_bytes(blob)
            kind_files[kind][p.name] = p

    matrix = Matrix()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GGML_NO_BACKTRACE", "1")
        servers: dict[str, LlamaServer] = {}
        try:
            # files b11669 saves itself: one per flag set, and gemma2 with a draft (checkpoints and SDFT),
            # whose appendices are then damaged one way each
            for fs in flag_sets:
                srv = servers[fs.name] = start_server(llama_server_b11669, models[fs.model], tmp, fs.name,
                                                      args=fs.flags, slot_save_path=slots)
                srv.completion(LIVE_PROMPT, slot=0, n_predict=4)
                srv.save(0, f"live-{fs.name}.bin")
                srv.erase(0)
                (kind_files[fs.model] if fs.model in kind_files else plain)[f"live-{fs.name}.bin"] = \
                    slots / f"live-{fs.name}.bin"
            srv = servers["gemma2-draft-ctxcp-1"]
            srv.completion(SAVE_PROMPT, slot=0, n_predict=4)
            srv.completion(SAVE_PROMPT + " " + LIVE_PROMPT, slot=0, n_predict=4)
            srv.save(0, "gemma2-draft-saved.bin")
            srv.erase(0)
            for name, data in appendix_damages((slots / "gemma2-draft-saved.bin").read_bytes()).items():
                (slots / f"gemma2-{name}.bin").write_bytes(data)
                kind_files["gemma2"][f"gemma2-{name}.bin"] = slots / f"gemma2-{name}.bin"
            for fs in flag_sets:
                files = kind_files.get(fs.model, plain)
                srv = servers[fs.name]
                reports = validate_json(list(files.values()), "-m", str(models[fs.model]), *fs.flags,
                                        "--server-build", "b11669")
                for name, path in sorted(files.items()):
                    try:
                        got = restore_logged(srv, name)
                        truth, answer = ("restored" if got.status == 200 else "refused"), got.answer
                    except (OSError, http.client.HTTPException, AssertionError):
                        truth, answer = "aborts", None
                    if srv.proc.poll() is not None:
                        truth = "aborts"
                    if truth == "aborts":
                        srv.stop()
                        srv = servers[fs.name] = start_server(llama_server_b11669, models[fs.model], tmp,
                                                              f"{fs.name}-again", args=fs.flags, slot_save_path=slots)
                    rep = reports[name]
                    verdict = VERDICT_TRUTH.get(rep["verdict"], rep["verdict"])
                    agree, why = verdict == truth, ""
                    if not rep["certain"] and rep["verdict"] == "aborts":
                        agree = truth in ("refused", "aborts")
                        matrix.uncertain[truth] = matrix.uncertain.get(truth, 0) + 1
                    if truth == "restored" and agree:
                        if got.steps != steps_of(rep):
                            agree, why = False, f"the server {got.steps}, validate {steps_of(rep)}"
                        elif answer.get("n_restored") != n_tokens_of(path.read_bytes()):
                            agree, why = False, f"n_restored {answer.get('n_restored')}"
                        else:   # restored again (the log's marker was a failed restore into the slot)
                            assert restore_outcome(srv, name)[0] == "restored"
                            kept = reused_by_server(srv, tokens_of(path.read_bytes()))
                            srv.erase(0)
                            matrix.reuse_checked += 1
                            if rep.get("reuse") is None or rep["reuse"]["n_reused"] != kept:
                                agree, why = False, f"the server kept {kept} tokens, validate predicted {rep.get('reuse')}"
                    if not agree and not why:
                        why = first_error(rep) if truth == "restored" else (
                            "server: " + str(answer)[:160] if truth == "refused" else "")
                    matrix.add(file=name, flags=fs.name, truth=truth, verdict=rep["verdict"],
                               certain=rep["certain"], agree=agree, why=why)
        finally:
            for srv in servers.values():
                srv.stop()
    print("\n" + matrix.summary("b11669 agreement matrix"))
    return matrix


KNOWN_B11669: set[tuple[str, str]] = set()


def test_validate_agrees_with_llama_server_b11669(b11669_matrix):
    """100% of the cells validate calls certain agree with b11669 (outcome, the appendices' steps from its log
    lines, the reuse); the uncertain ones (a payload cut where the loader reads what the file never filled)
    are counted by what the server did."""
    check_matrix(b11669_matrix, KNOWN_B11669, "b11669 agreement matrix")
    assert not [c for c in b11669_matrix.cells if c["certain"] and not c["agree"]]


def test_the_b11669_matrix_covers_every_outcome(b11669_matrix):
    truths = {c["truth"] for c in b11669_matrix.cells}
    assert {"restored", "refused"} <= truths
    assert len(b11669_matrix.cells) >= 250 and b11669_matrix.reuse_checked >= 50


# -- the appendix matrix: against slotctl restore in real llama-cpp-python contexts -------------------------


def split_appendices(data: bytes, payload_end: int) -> tuple[bytes, bytes]:
    """(SCKP bytes, SDFT bytes) of a well-formed file whose payload ends at ``payload_end``."""
    pos, ck = payload_end, b""
    if data[pos:pos + 4] == SCKP:
        count = struct.unpack_from("<I", data, pos + 8)[0]
        end = pos + 12
        for _ in range(count):
            end += 16
            for _ in range(3):
                end += 8 + struct.unpack_from("<Q", data, end)[0]
        ck, pos = data[pos:end], end
    return ck, data[pos:]


COMMON = ("-c", "256", "-np", "1", "-fa", "on")


def appendix_flag_sets(models: dict[str, Path]) -> list[tuple[str, tuple[str, ...]]]:
    d, t = str(models["draft"]), str(models["target"])
    return [
        ("no-draft", ()),
        ("draft", ("-md", d, "--spec-type", "draft-simple")),
        ("draft-ctkd-q8_0", ("-md", d, "--spec-type", "draft-simple", "-ctkd", "q8_0", "-ctvd", "q8_0")),
        ("draft-of-another-shape", ("-md", t, "--spec-type", "draft-simple")),
        ("draft-ctx-checkpoints-1", ("-md", d, "--spec-type", "draft-simple", "--ctx-checkpoints", "1")),
        # -md without --spec-type: b11434 loads the draft model and builds no drafter, so no draft context:
        # a file's draft state is dropped (server.speculative.draft_context)
        ("draft-without-spec-type", ("-md", d)),
    ]


def restore_steps(path: Path, model: Path, flags: tuple[str, ...]) -> dict[str, dict]:
    res = runner.invoke(app, ["restore", str(path), "-m", str(model), *COMMON, *flags, "--json"])
    assert res.exit_code in (0, 1), res.output
    doc = json.loads(res.stdout)
    return {s["step"]: s for s in doc["steps"]}


def predicted_steps(rep: dict) -> dict[str, dict]:
    """validate's prediction of each restore step (``steps`` in its JSON)."""
    return {s["step"]: s for s in rep["steps"]}


def step_view(steps: dict[str, dict]) -> dict[str, str]:
    """What must agree: each step's status, and the checkpoints kept."""
    out = {}
    for name in ("target", "tokens", "checkpoints", "draft"):
        s = steps.get(name)
        if s is None:
            continue
        out[name] = s["status"] + (f" {s.get('kept')}" if name == "checkpoints" and s["status"] == "restored"
                                   else "")
    return out


@pytest.fixture(scope="module")
def appendix_matrix(models, tmp_path_factory) -> Matrix:
    tmp = tmp_path_factory.mktemp("agreement-appendix")
    t, d = models["target"], str(models["draft"])
    _slotctl_save(tmp / "base.bin", t, *COMMON)
    _slotctl_save(tmp / "draft.bin", t, *COMMON, "-md", d, "--spec-type", "draft-simple")
    _slotctl_save(tmp / "ckpt-draft.bin", t, *COMMON, "-md", d, "--spec-type", "draft-simple", "--checkpoint-at", "20", "--checkpoint-at", "40")
    full = (tmp / "ckpt-draft.bin").read_bytes()
    head = SCKP + struct.pack("<II", 1, 2)   # the checkpoints at 20 and 40 (a batch split changes the payload)
    at = full.find(head)
    assert at > 0 and full.find(head, at + 1) == -1
    base = full[:at]
    k, s = split_appendices(full, at)
    assert k.startswith(SCKP) and s.startswith(SDFT), "save wrote no SCKP and SDFT"
    plain = (tmp / "base.bin").read_bytes()
    assert (tmp / "draft.bin").read_bytes()[len(plain):].startswith(SDFT)
    files = {
        "base": base,
        "saved-sdft": (tmp / "draft.bin").read_bytes(),
        "sdft": base + s,
        "sckp-sdft": full,
        "torn-SDF": base + b"SDF",
        "sckp-torn-SD": base + k + b"SD",
        "sdft-version-2": base + s[:4] + struct.pack("<I", 2) + s[8:],
        "sdft-truncated": base + s[:-10],
        "sdft-not-a-state": base + sdft(not_a_state(64)),
        "sdft-spec-only": base + sdft(b"", b"\x01" * 8),
        "sckp-truncated": base + k[:-5],
        "sckp-empty-target+sdft": base + sckp((20, 0, 19, b"", b"", b"")) + s,
        "sckp-count-1025+sdft": base + SCKP + struct.pack("<II", 1, 1025) + s,
        "sckp-version-2+sdft": base + k[:4] + struct.pack("<I", 2) + k[8:] + s,
        "sckp-not-a-state+sdft": base + sckp((20, 0, 19, not_a_state(64), b"", b"")) + s,
    }
    paths = []
    for name, data in files.items():
        (tmp / f"{name}.bin").write_bytes(data)
        paths.append(tmp / f"{name}.bin")
    matrix = Matrix()
    for fs_name, flags in appendix_flag_sets(models):
        verdicts = validate_json(paths, "-m", str(t), *COMMON, *flags)
        for p in paths:
            truth = step_view(restore_steps(p, t, flags))
            got = step_view(predicted_steps(verdicts[p.name]))
            matrix.add(file=p.name, flags=fs_name, truth=truth, verdict=got, agree=truth == got,
                       why=first_error(verdicts[p.name]))
    print("\n" + matrix.summary("appendix agreement matrix"))
    return matrix


#: what the server of the draft-state change does with each file under ``-md draft`` (the draft of the
#: save), by its ``load_slot_draft`` (llama.cpp ea736c1d5) and the two readings of upstream ``load_slot_checkpoints`` (llama.cpp
#: commit 033df86b6, in neither sdist): a damaged SCKP appendix, one with an empty target blob or a count
#: above 1024 is ignored and consumes 0 bytes, so the draft loader finds "SCKP" where it looks for "SDFT":
#: the draft state is absent; a torn magic is no appendix; a well-framed blob that does not load is
#: dropped (the draft) or kept (a checkpoint: the loader checks only lengths)
DRAFT_CHANGE_READINGS = {
    "base.bin": ("absent", "absent"),
    "saved-sdft.bin": ("absent", "restored"),
    "sdft.bin": ("absent", "restored"),
    "sckp-sdft.bin": ("restored 2", "restored"),
    "torn-SDF.bin": ("absent", "absent"),
    "sckp-torn-SD.bin": ("restored 2", "absent"),
    "sdft-version-2.bin": ("absent", "ignored"),
    "sdft-truncated.bin": ("absent", "ignored"),
    "sdft-not-a-state.bin": ("absent", "dropped"),
    "sdft-spec-only.bin": ("absent", "restored"),
    "sckp-truncated.bin": ("ignored", "absent"),
    "sckp-empty-target+sdft.bin": ("ignored", "absent"),
    "sckp-count-1025+sdft.bin": ("ignored", "absent"),
    "sckp-version-2+sdft.bin": ("ignored", "absent"),
    "sckp-not-a-state+sdft.bin": ("restored 1", "restored"),
}

KNOWN_APPENDIX: set[tuple[str, str]] = set()
KNOWN_RESTORE: set[str] = set()


def test_validate_predicts_every_restore_step(appendix_matrix):
    check_matrix(appendix_matrix, KNOWN_APPENDIX, "appendix agreement matrix")


def test_restore_follows_the_draft_change_and_the_sckp_readings(appendix_matrix):
    """The reference of the appendix matrix is itself checked against the readings of the server's code."""
    wrong = set()
    for c in appendix_matrix.cells:
        if c["flags"] == "draft":
            ck, dr = DRAFT_CHANGE_READINGS[c["file"]]
            if (c["truth"].get("checkpoints"), c["truth"].get("draft")) != (ck, dr):
                wrong.add(c["file"])
    assert wrong == KNOWN_RESTORE, [(c["file"], c["truth"]) for c in appendix_matrix.cells
                                    if c["flags"] == "draft" and c["file"] in wrong ^ KNOWN_RESTORE]


def test_the_appendix_matrix_covers_every_step_outcome(appendix_matrix):
    seen = {(step, status.split()[0]) for c in appendix_matrix.cells for step, status in c["truth"].items()}
    for want in [("checkpoints", "absent"), ("checkpoints", "ignored"), ("checkpoints", "restored"),
                 ("draft", "absent"), ("draft", "ignored"), ("draft", "dropped"), ("draft", "restored")]:
        assert want in seen, want
