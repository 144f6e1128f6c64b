"""Resources as a property: mutated real slot files through every command (hypothesis).

Each example damages one layer of a real server file with checkpoints and draft state (truncation, bit
flip, a count or length overwritten, bytes inserted, deleted or spliced from elsewhere in the file), then
runs inspect, validate's structural checks, strip-draft --dry-run with the model's layout, convert -m
(re-encoding every K and V record), diff against the intact file and strip-draft --checkpoints in place. Every command must return a documented exit code with one-line messages, within bounded time and
memory (tests/mutate.py), and strip-draft must leave the file intact or cleanly stripped. The example
count is modest for CI; ``fuzz/fuzz_slotfiles.py`` runs the same contract for as long as it is given.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mutate import EXTREMES, KINDS, apply, check_file, sources

SOURCES = {s.name: s for s in sources()}
LAYERS = sorted({name for s in SOURCES.values() for name, _, _ in s.layers})


def _mutation(layer_offset: int, layer_size: int):
    return st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, max(0, layer_size - 1)).map(lambda i: layer_offset + i),
        st.one_of(st.sampled_from(EXTREMES), st.integers(0, (1 << 64) - 1)),
    )


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("layer", LAYERS)
def test_one_damaged_layer_keeps_every_command_within_its_contract(source, layer):
    src = SOURCES[source]
    spans = [(off, size) for name, off, size in src.layers if name == layer]
    if not spans:
        pytest.skip(f"{source} has no {layer}")
    off, size = spans[0]

    @settings(max_examples=3, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(mutations=st.lists(_mutation(off, size), min_size=1, max_size=2))
    def run(mutations):
        data = src.data
        for kind, pos, arg in mutations:
            data = apply(data, kind, pos, arg)
        with tempfile.TemporaryDirectory() as d:
            check_file(data, src, Path(d))

    run()


def test_the_fuzz_contract_covers_identify_and_the_store(seaweed, monkeypatch, tmp_path):
    """What fuzz/fuzz_slotfiles.py --identify --store runs on each mutant keeps the contract: identify -m (real
    contexts) and the mutant as an s3:// object (inspect, validate, ls of its prefix, cp down), on each source
    intact, cut in its target memory and with a count overwritten there."""
    import os

    import obstore

    from seaweed import BUCKET
    from slotctl.store.s3 import S3_STORE

    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in {**seaweed.env(), "HOME": str(seaweed.dir)}.items():
        monkeypatch.setenv(k, v)
    url = f"s3://{BUCKET}/fuzz-contract/mutated.bin"
    for src in sources():
        _, off, size = next(layer for layer in src.layers if layer[0] == "target memory")
        for data in (src.data, apply(src.data, "truncate", off + size // 2, 0), apply(src.data, "u32", off + 8, 0x7FFFFFFF)):
            S3_STORE.reset()
            obstore.put(seaweed.client(), "fuzz-contract/mutated.bin", data)
            codes = check_file(data, src, tmp_path, identify=True, store=url)
            assert len(codes) == 11, codes
    S3_STORE.reset()


def test_a_file_whose_memory_claims_no_kv_stream_is_broken_not_unreadable(tmp_path):
    """A fuzz finding (seed 5, fuzz/fuzz_slotfiles.py): 64 bytes deleted in the token words of the KV source
    leave a target memory of 0 KV streams. ``ls -m`` judged it again for "a server started as it was saved",
    ``-np 0``, which no server takes: the flag's usage error made the file unreadable (exit 2). No server saved
    it: the first judgement stands (refused, broken, exit 1), and every command keeps its contract on it. validate's
    words for the stream count advise no ``-np 0`` either: the count is damaged."""
    import json

    from mutate import check_command, runner
    from slotctl.cli.app import app

    src = SOURCES["kv"]
    data = apply(src.data, "delete", 236, 63)
    p = tmp_path / "mutated.bin"
    p.write_bytes(data)
    code, _, _ = check_command(["ls", str(p), "-m", str(src.model), "--json"], measure=False)
    assert code == 1
    row = json.loads(runner.invoke(app, ["ls", str(p), "-m", str(src.model), "--json"]).stdout)["files"][0]
    assert (row["verdict"], row["class"], row["exit_code"]) == ("refused", "broken", 1), row
    said = " ".join(f["message"] for f in row["findings"])
    assert "0 KV streams" in said and "no server is started with -np 0" in said, said
    assert "start the server with -np 0" not in said and "convert" not in said, said   # no advice no server takes
    every = tmp_path / "every"
    every.mkdir()
    assert 1 in check_file(data, src, every, full=True)   # every command of the long run, ls -m among them
