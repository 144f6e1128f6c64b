"""``slotctl convert`` proven where it matters: the converted file restores in a real llama-server b11434
started with the new flags, restores every token, the next request evaluates only the new tokens, and the
slot continues with the same greedy tokens as a slot that was never saved. Checkpoint and draft blobs,
which b11434 does not read, are proven in real llama-cpp-python contexts built with the new flags.

The server files come from tests/data (saved by b11434 with tests/data/target.gguf; see its README); one
server per flag set, module-scoped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import DATA, start_server
from slotctl.cli.app import app
from slotctl.model.info import read_model_info
from slotctl.slotfile import open_slot_file
from slotctl import tensors
from slotctl.format.records import row_elements

runner = CliRunner()
TARGET = DATA / "target.gguf"
#: appended to the restored tokens for the next request (tokenized without BOS)
SUFFIX = " the river of paris is north of the city"
N_PREDICT = 8


def cli(*args, code: int | None = 0):
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert "Traceback" not in res.output, res.output
    if code is not None:
        assert res.exit_code == code, res.output
    return res


def convert_json(*args, code: int = 0) -> dict:
    res = cli("convert", *args, "--json", code=code)
    return json.loads(res.stdout)


def file_tokens(path: Path) -> list[int]:
    return [int(t) for t in open_slot_file(path).tokens.tokens]


class Srv:
    """A server of one flag set with a slot-save folder, and its reference answers."""

    def __init__(self, server, save_dir: Path):
        self.server = server
        self.save_dir = save_dir
        self._refs: dict = {}

    def reference(self, tokens: list[int]) -> dict:
        """The next request (``tokens`` + SUFFIX) in a slot that was never saved or restored (slot 0)."""
        key = tuple(tokens)
        if key not in self._refs:
            assert self.server.erase(0)[0] == 200
            prompt = tokens + self.server.tokenize(SUFFIX, add_special=False)
            ans = self.server.completion(prompt, slot=0, n_predict=N_PREDICT, return_tokens=True)
            assert ans["timings"]["cache_n"] == 0, ans["timings"]
            self._refs[key] = ans
        return self._refs[key]

    def restores_and_continues(self, name: str, slot: int, tokens: list[int]) -> dict:
        """Restore ``name`` into ``slot``: every token restored, only the new ones evaluated next, the
        same continuation as the never-saved reference. Returns the next request's answer."""
        ref = self.reference(tokens)
        status, ans = self.server.restore(slot, name)
        assert status == 200, (ans, self.server.log_tail())
        assert ans["n_restored"] == len(tokens)
        suffix = self.server.tokenize(SUFFIX, add_special=False)
        turn = self.server.completion(tokens + suffix, slot=slot, n_predict=N_PREDICT, return_tokens=True)
        assert turn["timings"]["cache_n"] == len(tokens), turn["timings"]
        assert turn["timings"]["prompt_n"] == len(suffix), turn["timings"]
        assert turn["tokens"] == ref["tokens"]
        return turn


def _server(llama_server_bin, tmp_path_factory, name: str, args: list[str], model: Path = TARGET) -> Srv:
    tmp = tmp_path_factory.mktemp(f"convert-{name}")
    save_dir = tmp / "slots"
    save_dir.mkdir()
    srv = start_server(llama_server_bin, model, tmp, name, args=["--cache-ram", "0", *args], slot_save_path=save_dir)
    return Srv(srv, save_dir)


@pytest.fixture(scope="module")
def servers(llama_server_bin, tmp_path_factory):
    """The flag sets of the -np / -kvu / -ctk proofs, all on tests/data/target.gguf."""
    flags = {
        "np1": ["-c", "256", "-np", "1", "-fa", "on"],
        "np2-kvu": ["-c", "512", "-np", "2", "-kvu", "-fa", "on"],
        "np4": ["-c", "1024", "-np", "4", "-fa", "on"],
        "q8": ["-c", "256", "-np", "1", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"],
    }
    started = {}
    try:
        for name, args in flags.items():
            started[name] = _server(llama_server_bin, tmp_path_factory, name, args)
        yield started
    finally:
        for s in started.values():
            s.server.stop()


# -- -np / -kvu ---------------------------------------------------------------------------------------------

NP_CASES = [
    # (server, slot, convert flags, streams in the converted file)
    ("np1", 0, ["-np", "1"], 1),
    ("np2-kvu", 1, ["-np", "2", "-kvu"], 1),
    ("np4", 2, ["-np", "4"], 4),
]


@pytest.mark.server
@pytest.mark.parametrize("name,slot,flags,n_stream", NP_CASES, ids=[c[0] for c in NP_CASES])
def test_stream_count_rewrite_restores(servers, name, slot, flags, n_stream):
    """srv-np2-slot1.bin (saved from slot 1 at -np 2) restores, rewritten, at -np 1, -np 2 -kvu and -np 4."""
    srv = servers[name]
    src = DATA / "srv-np2-slot1.bin"
    tokens = file_tokens(src)
    assert len(tokens) == 111
    shutil.copy(src, srv.save_dir / "original.bin")
    status, ans = srv.server.restore(slot, "original.bin")
    assert status == 400 and "Unable to restore slot" in json.dumps(ans)   # n_stream mismatch

    d = convert_json(src, "-o", srv.save_dir / "converted.bin", *flags)
    assert d["changes"] == [{"part": "target memory", "section": "kv", "what": "n_stream", "from": 2,
                             "to": n_stream}]
    assert d["output_size"] == d["size"] + 4 * (n_stream - 2) and d["layers"] == []
    sf = open_slot_file(srv.save_dir / "converted.bin", layout=read_model_info(TARGET).layout())
    assert sf.target.sections[0].n_stream == n_stream and not sf.errors
    srv.restores_and_continues("converted.bin", slot, tokens)


# -- cache types ----------------------------------------------------------------------------------------------


def _rows(path: Path) -> list[np.ndarray]:
    """Every K then V record of the file's first stream with cells, dequantized and unrotated."""
    info = read_model_info(TARGET)
    sf = open_slot_file(path, layout=info.layout())
    st = next(s for s in sf.target.sections[0].streams if s.cell_count)
    out = []
    with open(path, "rb") as f:
        for recs, rot in ((st.data.k, st.data.n_rot_k), (st.data.v, st.data.n_rot_v)):
            for r in recs:
                n = row_elements(r, "test")
                out.append(tensors.rotate(tensors.dequantize(r.data.read(f), r.type, n), rot))
    return out


@pytest.mark.server
def test_f16_to_q8_0_restores_like_the_servers_own_file(servers):
    """An f16 file converted to q8_0 restores in a -ctk q8_0 -ctv q8_0 server and continues with the
    greedy tokens of a never-saved slot; its rows are within 0.025 of the file that server saves for the
    same prompt (max |difference| per layer; q8_0's own step on these values is ~0.02)."""
    srv = servers["q8"]
    src = DATA / "srv-np1.bin"
    shutil.copy(src, srv.save_dir / "f16.bin")
    assert srv.server.restore(0, "f16.bin")[0] == 400   # mismatched key type
    d = convert_json(src, "-o", srv.save_dir / "q8.bin", "-ctk", "q8_0", "-ctv", "q8_0", "-m", TARGET)
    assert {(c["what"], c["from"], c["to"]) for c in d["changes"]} == {("K type", "f16", "q8_0"),
                                                                        ("V type", "f16", "q8_0")}
    assert len(d["layers"]) == 4 and all(0 < e["max_abs_error"] < 0.02 for e in d["layers"])
    # the server's own save of the same prompt with the same flags (tests/data/srv-kvq8.bin)
    own = DATA / "srv-kvq8.bin"
    assert os.path.getsize(srv.save_dir / "q8.bin") == os.path.getsize(own)
    for mine, theirs in zip(_rows(srv.save_dir / "q8.bin"), _rows(own)):
        assert mine.shape == theirs.shape
        assert np.abs(mine - theirs).max() < 0.025
    srv.restores_and_continues("q8.bin", 0, file_tokens(src))


@pytest.mark.server
def test_q8_0_back_to_f16_restores(servers):
    """The server's q8_0 file, converted to f16 (the rotation undone), restores at -ctk f16 and continues."""
    srv = servers["np1"]
    src = DATA / "srv-kvq8.bin"
    d = convert_json(src, "-o", srv.save_dir / "from-q8.bin", "-ctk", "f16", "-ctv", "f16", "-m", TARGET)
    assert all(e["max_abs_error"] < 1e-2 for e in d["layers"])   # only f16 rounding
    # unrotated, the values are q8_0's approximation of the f16 file's
    for a, b in zip(_rows(srv.save_dir / "from-q8.bin"), _rows(DATA / "srv-np1.bin")):
        assert np.abs(a - b).max() < 0.03
    srv.restores_and_continues("from-q8.bin", 0, file_tokens(src))


@pytest.mark.server
def test_rotation_matters(servers, tmp_path):
    """Without the rotation the same q8_0 bytes would be wrong: the converted rows differ from the
    unrotated reading by far more than the quantization step."""
    out = tmp_path / "q8.bin"
    convert_json(DATA / "srv-np1.bin", "-o", out, "-ctk", "q8_0", "-ctv", "q8_0", "-m", TARGET)
    info = read_model_info(TARGET)
    sf = open_slot_file(out, layout=info.layout())
    st = sf.target.sections[0].streams[0]
    assert (st.data.n_rot_k, st.data.n_rot_v) == (64, 64)
    with open(out, "rb") as f:
        r = st.data.k[0]
        raw = tensors.dequantize(r.data.read(f), r.type, 64)
    f16 = _rows(DATA / "srv-np1.bin")[0]
    assert np.abs(raw - f16).max() > 0.5


def test_quantized_target_needs_the_model(tmp_path):
    res = cli("convert", DATA / "srv-np1.bin", "-o", tmp_path / "x.bin", "-ctk", "q4_0", code=2)
    assert "give -m" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "x.bin").exists()


def test_quantized_v_with_transposed_v_is_refused(tmp_path):
    res = cli("convert", DATA / "srv-fa-off.bin", "-o", tmp_path / "x.bin", "-ctv", "q8_0", "-m", TARGET, code=1)
    assert "flash attention" in res.output and len(res.output.strip().splitlines()) == 1


def test_transposed_v_changes_type(tmp_path):
    """-fa off files (V element-major) convert between float types; the values survive f16 -> f32 exactly."""
    d = convert_json(DATA / "srv-fa-off.bin", "-o", tmp_path / "f32.bin", "-ctk", "f32", "-ctv", "f32")
    assert all(e["max_abs_error"] == 0 for e in d["layers"])
    back = convert_json(tmp_path / "f32.bin", "-o", tmp_path / "f16.bin", "-ctk", "f16", "-ctv", "f16")
    assert all(e["max_abs_error"] == 0 for e in back["layers"])
    assert (tmp_path / "f16.bin").read_bytes() == (DATA / "srv-fa-off.bin").read_bytes()


@pytest.mark.parametrize("typ", ["bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_every_cache_type_round_trips_within_its_step(tmp_path, typ):
    d = convert_json(DATA / "srv-np1.bin", "-o", tmp_path / "x.bin", "-ctk", typ, "-ctv", typ, "-m", TARGET)
    bound = {"bf16": 0.02, "q8_0": 0.02, "q5_0": 0.25, "q5_1": 0.25, "q4_0": 0.5, "q4_1": 0.5}[typ]
    assert all(0 < e["max_abs_error"] < bound for e in d["layers"]), d["layers"]
    assert open_slot_file(tmp_path / "x.bin", layout=read_model_info(TARGET).layout()).errors == []


# -- state version ---------------------------------------------------------------------------------------------


def test_state_version_round_trip_is_exact(tmp_path):
    for name in ("srv-np1.bin", "srv-kvq8.bin"):
        d = convert_json(DATA / name, "-o", tmp_path / "v3.bin", "--state-version", "3", "-m", TARGET, "--force")
        assert d["state_version"] == 3 and d["source_state_version"] == 4
        convert_json(tmp_path / "v3.bin", "-o", tmp_path / "v4.bin", "--state-version", "4", "-m", TARGET, "--force")
        assert (tmp_path / "v4.bin").read_bytes() == (DATA / name).read_bytes()


# -- damaged and refused files ---------------------------------------------------------------------------------


def _two_full_streams() -> bytes:
    """srv-np2-slot1.bin with its empty stream 0 replaced by a copy of stream 1 (a whole-context shape)."""
    raw = (DATA / "srv-np2-slot1.bin").read_bytes()
    n_words = struct.unpack_from("<I", raw, 8)[0]
    at = 12 + 4 * n_words
    assert struct.unpack_from("<II", raw, at) == (2, 0)
    stream1 = raw[at + 8:]
    return raw[:at] + struct.pack("<I", 2) + stream1 + stream1


@pytest.mark.parametrize("damage,code,words", [
    ("truncated", 1, "target memory at 0x1d8"),
    ("garbage", 1, "magic"),
    ("two-streams", 1, "streams 0, 1"),
])
def test_damaged_and_unconvertible_files(tmp_path, damage, code, words):
    raw = (DATA / "srv-np2-slot1.bin").read_bytes()
    data = {"truncated": raw[:len(raw) // 2], "garbage": b"\x00" * 64, "two-streams": _two_full_streams()}[damage]
    src = tmp_path / "in.bin"
    src.write_bytes(data)
    res = cli("convert", src, "-o", tmp_path / "out.bin", "-np", "1", code=code)
    assert words in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "out.bin").exists()
    assert src.read_bytes() == data
    d = convert_json(src, "-o", tmp_path / "out.bin", "-np", "1", code=code)
    assert d["exit_code"] == code and d["error"]["code"] in ("damaged", "refused")


def test_usage_errors(tmp_path):
    cli("convert", DATA / "srv-np1.bin", "-o", tmp_path / "x.bin", code=2)                       # nothing asked
    cli("convert", DATA / "srv-np1.bin", "-o", DATA / "srv-np1.bin", "-np", "2", code=2)         # exists
    res = cli("convert", DATA / "srv-np1.bin", "-o", tmp_path / "x.bin", "-ctk", "q7", code=2)
    assert "expected one of" in res.output
    cli("convert", tmp_path / "missing.bin", "-o", tmp_path / "x.bin", "-np", "2", code=2)


def test_dry_run_writes_nothing(tmp_path):
    d = convert_json(DATA / "srv-np2-slot1.bin", "-o", tmp_path / "x.bin", "-np", "1", "--dry-run")
    assert d["dry_run"] and d["output_size"] == d["size"] - 4 and not (tmp_path / "x.bin").exists()


# -- a kill during convert -------------------------------------------------------------------------------------


def _big_file(path: Path, n_cells: int) -> None:
    """A valid version-4 slot file of the target model's shape with ``n_cells`` cells of random f16 rows."""
    raw = (DATA / "srv-np1.bin").read_bytes()
    n_words = struct.unpack_from("<I", raw, 8)[0]
    head = raw[:12 + 4 * n_words]
    rng = np.random.default_rng(0)
    cells = np.zeros(n_cells, [("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")])
    cells["pos"], cells["n"] = np.arange(n_cells), 1
    with open(path, "wb") as f:
        f.write(head + struct.pack("<II", 1, n_cells) + cells.tobytes() + struct.pack("<IIII", 0, 2, 0, 0))
        for _ in range(4):   # 2 K then 2 V records, 64 f16 per row
            f.write(struct.pack("<iQ", 1, 128))
            for start in range(0, n_cells, 1 << 16):
                n = min(1 << 16, n_cells - start)
                f.write(rng.standard_normal((n, 64)).astype("<f2").tobytes())


@pytest.mark.parametrize("existing", [False, True])
def test_sigkill_leaves_the_output_old_or_absent(tmp_path, existing):
    src = tmp_path / "big.bin"
    _big_file(src, 400_000)
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    out = tmp_path / "out.bin"
    if existing:
        out.write_bytes(b"old contents")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "slotctl", "convert", str(src), "-o", str(out), "-ctk", "q4_0",
                             "-ctv", "q4_0", "-m", str(TARGET), "--force"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # kill once the temporary file holds converted rows
            tmp = [p for p in tmp_path.iterdir() if p.name.startswith(".out.bin.slotctl-")]
            if tmp and tmp[0].stat().st_size > 200_000:
                break
            assert proc.poll() is None, "convert ended before it could be killed"
            time.sleep(0.01)
        else:
            pytest.fail("no temporary file appeared")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest
    if existing:
        assert out.read_bytes() == b"old contents"
    else:
        assert not out.exists()


# -- other memory kinds: iSWA (two KV caches), hybrid (KV + recurrent), recurrent (no streams) -------------------

KIND_FILES = {"gemma2": "srv-gemma2.bin", "jamba": "srv-jamba.bin", "mamba": "srv-mamba.bin"}


@pytest.fixture(scope="module", params=sorted(KIND_FILES))
def kind_np2(request, llama_server_bin, tmp_path_factory):
    """A ``-c 512 -np 2`` server for each kind's model of tests/data/kinds (its files were saved at -np 1)."""
    kind = request.param
    model = DATA / "kinds" / f"{kind}.gguf"
    srv = _server(llama_server_bin, tmp_path_factory, f"{kind}-np2", ["-c", "512", "-np", "2", "-fa", "on"], model)
    try:
        yield kind, model, srv
    finally:
        srv.server.stop()


@pytest.mark.server
def test_other_kinds_restore_into_another_slot_count(kind_np2):
    """A -np 1 file of each kind, converted with -np 2, restores into slot 1 of a -np 2 server and continues
    like a never-saved slot. iSWA: base and SWA caches are both rewritten; hybrid: the attention cache;
    recurrent: nothing changes (no streams, one cell per slot), and the unconverted file restores as well."""
    kind, model, srv = kind_np2
    src = DATA / "kinds" / KIND_FILES[kind]
    tokens = file_tokens(src)
    d = convert_json(src, "-o", srv.save_dir / "converted.bin", "-np", "2", "-m", model)
    sections = {"gemma2": {"base", "swa"}, "jamba": {"attention"}, "mamba": set()}[kind]
    assert {c["section"] for c in d["changes"]} == sections
    assert all((c["what"], c["from"], c["to"]) == ("n_stream", 1, 2) for c in d["changes"])
    assert d["output_size"] == d["size"] + 4 * len(sections)
    if kind == "mamba":
        assert (srv.save_dir / "converted.bin").read_bytes() == src.read_bytes()
    else:
        shutil.copy(src, srv.save_dir / "original.bin")
        assert srv.server.restore(1, "original.bin")[0] == 400
    ref = srv.reference(tokens)
    status, ans = srv.server.restore(1, "converted.bin")
    assert status == 200 and ans["n_restored"] == len(tokens), ans
    suffix = srv.server.tokenize(SUFFIX, add_special=False)
    turn = srv.server.completion(tokens + suffix, slot=1, n_predict=N_PREDICT, return_tokens=True)
    if kind != "gemma2":   # an SWA slot without checkpoints evaluates the whole prompt again (docs/kinds.md)
        assert turn["timings"]["prompt_n"] == len(suffix), turn["timings"]
    assert turn["tokens"] == ref["tokens"]


def test_recurrent_section_of_a_whole_context_is_refused(tmp_path):
    """A recurrent section with two cells is no slot's state (the loader would assert on it at -np 2):
    converting its slot count is refused, in one line."""
    model = DATA / "kinds" / "mamba.gguf"
    src = DATA / "kinds" / "srv-mamba.bin"
    sf = open_slot_file(src, layout=read_model_info(model).layout())
    sec = sf.target.sections[0]
    raw = src.read_bytes()
    at = sf.target.offset
    out = bytearray(raw[:at] + struct.pack("<IiIiI", 2, 58, 0, 59, 0))
    first = sec.r[0].data.offset - 12
    out += raw[at + 12:first]                              # s_trans, n_layer
    for rec in [*sec.r, *sec.s]:
        out += raw[rec.data.offset - 12:rec.data.offset]  # type, row size
        out += raw[rec.data.offset:rec.data.end] * 2       # two cells' rows
    two = tmp_path / "two.bin"
    two.write_bytes(bytes(out))
    assert open_slot_file(two, layout=read_model_info(model).layout()).errors == []
    res = cli("convert", two, "-o", tmp_path / "out.bin", "-np", "2", "-m", model, code=1)
    assert "(at most 1 cell), found 2 cells" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "out.bin").exists()


# -- checkpoints and the draft state, in real llama-cpp-python contexts ---------------------------------------


def test_checkpoints_and_draft_follow_the_slot_count_and_draft_types(tmp_path):
    """A gemma2 file slotctl saves from slot 1 at -np 2, with checkpoints and a draft (SDFT), converted with
    -np 1 -ctkd q8_0 -ctvd q8_0: the target, every checkpoint blob and the draft blob load into real
    contexts built with -np 1 and the q8_0 draft, in this runtime's state version."""
    from slotctl.model.info import read_model_info as info_of
    from slotctl.model.settings import ContextSettings
    from slotctl.runtime.context import STATE_FLAGS_PARTIAL_ONLY
    from slotctl.runtime.restore import RESTORED, restore_slot
    from slotctl.runtime.slot import ServerContexts, evaluate_prompt, write_slot_file
    from slotctl.tinymodels import SAMPLE_PROMPT, make_kind_model, make_model

    target = make_kind_model("gemma2", tmp_path / "gemma2.gguf")
    draft = make_model(tmp_path / "draft.gguf", n_layer=1, seed=2)
    src = tmp_path / "np2.bin"
    with ServerContexts.open(target, ContextSettings(n_ctx=512, n_parallel=2), draft_path=draft) as sc:
        tokens = sc.target_model.tokenize(SAMPLE_PROMPT)
        cps = evaluate_prompt(sc, tokens, 1, checkpoint_at=[20, 40])
        write_slot_file(src, sc, 1, tokens, checkpoints=cps, with_draft=True)
    out = tmp_path / "np1.bin"
    d = convert_json(src, "-o", out, "-np", "1", "-ctkd", "q8_0", "-ctvd", "q8_0", "-m", target, "-md", draft)
    parts = {(c["part"].split(" ")[0], c["what"]) for c in d["changes"]}
    # the checkpoints' draft blobs of the plain draft are the blob header alone (b11669's PARTIAL_ONLY):
    # no types to convert there
    assert parts == {("target", "n_stream"), ("checkpoint", "n_stream"), ("SDFT", "n_stream"),
                     ("SDFT", "K type"), ("SDFT", "V type")}
    assert d["layers"] and all(e["max_abs_error"] < 0.05 for e in d["layers"])
    assert {e["part"].split(" ")[0] for e in d["layers"]} == {"SDFT"}

    # the unconverted file's draft would be dropped at -np 1; the converted one restores completely
    with ServerContexts.open(target, ContextSettings(n_ctx=512, n_parallel=1), draft_path=draft,
                             draft_type_k="q8_0", draft_type_v="q8_0") as sc:
        restored = restore_slot(sc, out, 0)
        assert restored.tokens == tokens
        assert restored.step("draft").status == RESTORED
        assert len(restored.checkpoints) == 2
        for cp in restored.checkpoints:
            assert sc.target.state_seq_set(bytearray(cp.tgt), 0, STATE_FLAGS_PARTIAL_ONLY) == len(cp.tgt)
            assert len(cp.dft) == 8     # the blob header alone: read as b11669's libllama reads it, nothing to load
        with pytest.raises(Exception):
            restore_slot(sc, src, 0)   # n_stream mismatch
    assert info_of(target).memory_kind == "iswa"


def test_quantized_to_quantized_keeps_the_rotation(tmp_path):
    """q8_0 -> q4_0: both rotated by 64 (the model's rule does not depend on the quantized type); the values
    stay q4_0's approximation of the f16 file's, which they would not be had the rotation been touched."""
    convert_json(DATA / "srv-kvq8.bin", "-o", tmp_path / "q4.bin", "-ctk", "q4_0", "-ctv", "q4_0")
    sf = open_slot_file(tmp_path / "q4.bin", layout=read_model_info(TARGET).layout())
    d = sf.target.sections[0].streams[0].data
    assert (d.n_rot_k, d.n_rot_v) == (64, 64) and d.k[0].type == 2
    for a, b in zip(_rows(tmp_path / "q4.bin"), _rows(DATA / "srv-np1.bin")):
        assert np.abs(a - b).max() < 0.5


@pytest.mark.server
@pytest.mark.parametrize("kind,sections", [("gemma2", {"base", "swa"}), ("jamba", {"attention"})])
def test_other_kinds_to_q8_0_restore(llama_server_bin, tmp_path_factory, kind, sections):
    """gemma2 (iSWA: base and SWA caches, each rotated by its own rule) and jamba (hybrid: the attention
    cache; the recurrent state stays f32) converted to q8_0 restore in a -ctk q8_0 -ctv q8_0 server: the
    loader checks every type, row size and rotation. jamba's next request evaluates only the new tokens
    and continues like a never-saved slot; gemma2's evaluates the prompt again (SWA without checkpoints)."""
    model = DATA / "kinds" / f"{kind}.gguf"
    srv = _server(llama_server_bin, tmp_path_factory, f"{kind}-q8",
                  ["-c", "256", "-np", "1", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"], model)
    try:
        src = DATA / "kinds" / f"srv-{kind}.bin"
        d = convert_json(src, "-o", srv.save_dir / "q8.bin", "-ctk", "q8_0", "-ctv", "q8_0", "-m", model)
        assert {(c["section"], c["what"]) for c in d["changes"]} == {(s, w) for s in sections
                                                                      for w in ("K type", "V type")}
        assert d["layers"] and all(e["max_abs_error"] < 0.05 for e in d["layers"])
        tokens = file_tokens(src)
        ref = srv.reference(tokens)
        status, ans = srv.server.restore(0, "q8.bin")
        assert status == 200 and ans["n_restored"] == len(tokens), ans
        suffix = srv.server.tokenize(SUFFIX, add_special=False)
        turn = srv.server.completion(tokens + suffix, slot=0, n_predict=N_PREDICT, return_tokens=True)
        if kind == "jamba":
            assert turn["timings"]["prompt_n"] == len(suffix), turn["timings"]
        assert turn["tokens"] == ref["tokens"]
    finally:
        srv.server.stop()
