"""Tests of slotctl.runtime on real llama.cpp contexts of tiny models (no mocks).

State blobs and files are checked with a small reader of the plain KV section written here from
docs/format.md, independent of slotctl.format; the contexts are checked against slot files a real
llama-server (b11434) wrote (tests/data).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA

from slotctl.runtime import (
    LOAD_STEPS,
    STATE_BLOB_MAGIC,
    STATE_FILE_MAGIC,
    STATE_FLAGS_ON_DEVICE,
    STATE_FLAGS_PARTIAL_ONLY,
    STATE_VERSION,
    Context,
    ContextSettings,
    LlamaError,
    Model,
    configure_logging,
    generate_greedy,
)
from slotctl.tinymodels import SAMPLE_PROMPT, TinyModels, make_models

#: the prompt and the server options of tests/data/srv-*.bin (see tests/data/README.md)
SERVER_PROMPT = ("what is the capital of france? paris is the capital of france. "
                 "the river of paris is north of the city")
SERVER_N_PREDICT = 8
#: the prompt of tests/data/kinds/srv-*.bin
KINDS_PROMPT = "what is the capital of france? paris is the capital"


# -- a reader of plain KV state payloads (docs/format.md, section 4) ------------------------------------


@dataclass
class Stream:
    positions: list[int]
    v_trans: int | None = None
    n_layer: int | None = None
    #: (ggml type, row size) per layer; for transposed V (type, element size, n_embd_v_gqa)
    k: list[tuple[int, ...]] | None = None
    v: list[tuple[int, ...]] | None = None
    #: offset of n_rot_k (version 4) or of the first K record (version 3)
    records_at: int = 0


@dataclass
class KVSection:
    streams: list[Stream]
    end: int

    @property
    def n_stream(self) -> int:
        return len(self.streams)


class Reader:
    def __init__(self, data: bytes, offset: int = 0):
        self.data, self.offset = data, offset

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values

    def skip(self, n: int) -> None:
        assert self.offset + n <= len(self.data), "record runs past the end"
        self.offset += n


def read_kv(data: bytes, offset: int = 0, version: int = 3) -> KVSection:
    """Read a plain KV section (no cell ext) starting at ``offset``."""
    r = Reader(data, offset)
    (n_stream,) = r.take("I")
    streams = []
    for _ in range(n_stream):
        (cell_count,) = r.take("I")
        stream = Stream(positions=[])
        streams.append(stream)
        if cell_count == 0:
            continue
        for _ in range(cell_count):
            pos, n_seq_id = r.take("iI")
            r.skip(4 * n_seq_id)
            stream.positions.append(pos)
        stream.v_trans, stream.n_layer = r.take("II")
        stream.records_at = r.offset
        if version == 4:
            r.take("II")
        stream.k, stream.v = [], []
        for _ in range(stream.n_layer):
            k_type, row = r.take("iQ")
            r.skip(cell_count * row)
            stream.k.append((k_type, row))
        for _ in range(stream.n_layer):
            if stream.v_trans:
                v_type, el_size, n_embd = r.take("iII")
                r.skip(n_embd * cell_count * el_size)
                stream.v.append((v_type, el_size, n_embd))
            else:
                v_type, row = r.take("iQ")
                r.skip(cell_count * row)
                stream.v.append((v_type, row))
    return KVSection(streams, r.offset)


def read_blob(blob: bytes) -> tuple[int, KVSection]:
    """Check a state blob's header and read its KV section to the end; returns (seq id, section)."""
    magic, seq_id = struct.unpack_from("<Ii", blob)
    assert magic == STATE_BLOB_MAGIC
    kv = read_kv(blob, 8)
    assert kv.end == len(blob)
    return seq_id, kv


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return make_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def target(models: TinyModels):
    with Model(models.target) as model:
        yield model


@pytest.fixture(scope="module")
def draft(models: TinyModels):
    with Model(models.draft) as model:
        yield model


@pytest.fixture(scope="module")
def prompt(target: Model) -> list[int]:
    return target.tokenize(SAMPLE_PROMPT)


def context(model: Model, **options) -> Context:
    """A small context: 256 cells unless given."""
    options.setdefault("n_ctx", 256)
    return Context(model, ContextSettings(**options))


def decoded(model: Model, tokens: list[int], seq_id: int = 0, **options) -> Context:
    ctx = context(model, **options)
    ctx.decode(tokens, seq_id, 0)
    return ctx


# -- models and tokenization --------------------------------------------------------------------


def test_model_properties(target: Model, draft: Model) -> None:
    assert (target.n_layer, draft.n_layer) == (2, 1)
    assert target.n_vocab == draft.n_vocab > 259
    assert target.n_ctx_train == 4096
    assert target.add_bos


def test_tokenize_like_the_server(target: Model, prompt: list[int]) -> None:
    bos = 1
    assert prompt[0] == bos and bos not in prompt[1:]
    assert target.tokenize(SAMPLE_PROMPT, add_special=False) == prompt[1:]
    # special-token text is parsed, as the server asks for
    assert target.tokenize("<s>Paris", add_special=False) == [bos] + target.tokenize("Paris", add_special=False)
    assert bos not in target.tokenize("<s>Paris", add_special=False, parse_special=False)
    assert target.detokenize(prompt[1:]) == SAMPLE_PROMPT
    assert target.detokenize(prompt).startswith("<s>What")
    assert target.detokenize(prompt, special=False) == SAMPLE_PROMPT
    assert target.token_to_piece(prompt[1]) == b"What"
    assert target.token_to_piece(bos) == b"<s>" and target.token_to_piece(bos, special=False) == b""


def test_bad_token_ids_raise_instead_of_aborting(target: Model) -> None:
    for token in (-1, target.n_vocab):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            target.token_to_piece(token)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            target.detokenize([1, token])


def test_a_vocabulary_only_model_tokenizes_but_builds_no_context(models: TinyModels, prompt: list[int]) -> None:
    with Model(models.target, vocab_only=True) as vocab:
        assert vocab.tokenize(SAMPLE_PROMPT) == prompt
        assert vocab.detokenize(prompt[1:]) == SAMPLE_PROMPT
        with pytest.raises(ValueError, match="vocab_only"):
            context(vocab)


def test_model_load_reports_progress(models: TinyModels) -> None:
    steps: list[tuple[int, int]] = []
    with Model(models.draft, on_progress=lambda done, total: steps.append((done, total))):
        pass
    assert steps[-1] == (LOAD_STEPS, LOAD_STEPS)
    assert [done for done, _ in steps] == sorted(done for done, _ in steps)


def test_an_error_in_the_progress_callback_cancels_loading(models: TinyModels) -> None:
    def fail(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Model(models.draft, on_progress=fail)


def test_unloadable_models_raise(tmp_path: Path) -> None:
    with pytest.raises(LlamaError, match="no such file"):
        Model(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(LlamaError, match="cannot load model .*bad.gguf: .*GGUF"):
        Model(bad)


def test_close_frees_the_contexts_of_the_model(models: TinyModels) -> None:
    model = Model(models.draft)
    ctx = context(model)
    model.close()
    assert ctx.closed and model.closed
    with pytest.raises(ValueError, match="closed"):
        ctx.seq_pos_max(0)
    with pytest.raises(ValueError, match="closed"):
        model.tokenize("Paris")
    model.close()


# -- settings and sizes -------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    (dict(type_k="q9_0"), "unknown cache type"),
    (dict(flash_attn="yes"), "flash_attn"),
    (dict(n_parallel=0), "n_parallel"),
    (dict(n_parallel=4, n_outputs_max=2), "n_outputs_max"),
])
def test_settings_are_checked(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ContextSettings(**options)


def test_cache_type_names_are_case_insensitive() -> None:
    settings = ContextSettings(type_k="Q8_0")
    assert settings.type_k == "q8_0" and settings.type_k_id == 8


@pytest.mark.parametrize("options, n_ctx, n_ctx_seq, n_ctx_slot", [
    # llama.cpp pads every stream to a multiple of 256 cells
    (dict(n_ctx=256, n_parallel=4), 1024, 256, 256),
    (dict(n_ctx=1024, n_parallel=4), 1024, 256, 256),
    (dict(n_ctx=256, n_parallel=4, kv_unified=True), 256, 256, 256),
    (dict(n_ctx=300), 512, 512, 512),
    # unset: the training context (4096) for every stream
    (dict(n_ctx=0, n_parallel=2, kv_unified=True), 4096, 4096, 4096),
    (dict(n_ctx=0, n_parallel=2), 8192, 4096, 4096),
    # unset with --kv-unified-per-slot: n_parallel * the cap, and slots capped
    (dict(n_ctx=0, n_parallel=2, kv_unified=True, kv_unified_per_slot=200), 512, 512, 200),
    # a slot never exceeds the training context
    (dict(n_ctx=8192), 8192, 8192, 4096),
])
def test_context_sizes(target: Model, options: dict, n_ctx: int, n_ctx_seq: int, n_ctx_slot: int) -> None:
    with Context(target, ContextSettings(**options)) as ctx:
        assert (ctx.n_ctx, ctx.n_ctx_seq, ctx.n_ctx_slot) == (n_ctx, n_ctx_seq, n_ctx_slot)
        assert ctx.n_seq_max == options.get("n_parallel", 1)


def test_draft_settings_follow_the_target(target: Model, draft: Model) -> None:
    with context(target, n_parallel=2, type_k="q8_0", type_v="q8_0", flash_attn="on", n_batch=512) as tgt:
        settings = tgt.draft_settings()
        assert settings == ContextSettings(n_ctx=tgt.n_ctx, n_parallel=2, type_k="f16", type_v="f16",
                                           flash_attn="on", n_batch=512, n_outputs_max=2)
        assert tgt.draft_settings(type_k="q8_0").type_k == "q8_0"
        with Context(draft, settings) as dft:
            assert (dft.n_ctx, dft.n_ctx_seq, dft.n_seq_max) == (tgt.n_ctx, tgt.n_ctx_seq, 2)
            assert dft.n_outputs_max == 2
            with pytest.raises(ValueError, match="at most 2 tokens"):
                dft.decode([1, 2, 3], 0, 0, all_logits=True)


def test_a_context_llama_cpp_refuses_raises(target: Model) -> None:
    with pytest.raises(LlamaError, match="quantized V cache requires flash_attn"):
        context(target, type_v="q8_0", flash_attn="off")


# -- decoding -----------------------------------------------------------------------------------


def test_decode_in_batches_reports_progress(target: Model, prompt: list[int]) -> None:
    steps: list[tuple[int, int]] = []
    with context(target, n_batch=32) as ctx, decoded(target, prompt) as whole:
        ctx.decode(prompt, 0, 0, on_progress=lambda done, total: steps.append((done, total)))
        assert steps == [(32, 99), (64, 99), (96, 99), (99, 99)]
        assert (ctx.seq_pos_min(0), ctx.seq_pos_max(0)) == (0, 98)
        assert ctx.argmax() == whole.argmax()


def test_all_logits_match_decoding_one_token_at_a_time(target: Model, prompt: list[int]) -> None:
    head, tail = prompt[:-5], prompt[-5:]
    with decoded(target, head) as batched, decoded(target, head) as single:
        batched.decode(tail, 0, len(head), all_logits=True)
        for i, token in enumerate(tail):
            single.decode([token], 0, len(head) + i)
            np.testing.assert_allclose(batched.logits_at(i), single.logits_at(), rtol=1e-3, atol=1e-3)
            assert batched.argmax(i) == single.argmax()
        assert batched.logits_at(-1).shape == (target.n_vocab,)


def test_logits_only_where_asked(target: Model, prompt: list[int]) -> None:
    with context(target, n_batch=64) as ctx:
        with pytest.raises(ValueError, match="nothing decoded"):
            ctx.logits_at()
        ctx.decode(prompt, 0, 0)
        with pytest.raises(ValueError, match="only the last token"):
            ctx.logits_at(0)
        with pytest.raises(IndexError):
            ctx.logits_at(len(prompt))
        assert ctx.argmax(len(prompt) - 1) == ctx.argmax(-1)
        with pytest.raises(ValueError, match="at most 64 tokens"):
            ctx.decode(prompt, 0, 0, all_logits=True)


def test_a_full_context_raises(target: Model, prompt: list[int]) -> None:
    with context(target, n_batch=64) as ctx:
        with pytest.raises(LlamaError, match=r"tokens 256\.\.296 of sequence 0: .*context is full"):
            ctx.decode(prompt * 3, 0, 0)
        assert ctx.seq_pos_max(0) == 255


def test_generate_greedy_continues_the_sequence(target: Model, prompt: list[int]) -> None:
    with decoded(target, prompt, 1, n_parallel=2) as ctx, decoded(target, prompt) as verify:
        generated = generate_greedy(ctx, 1, 6, len(prompt))
        assert len(generated) == 6
        assert ctx.seq_pos_max(1) == len(prompt) + 5
        # what a speculative step checks: the target, fed the tokens in one batch, chooses each next one
        first = verify.argmax()
        verify.decode(generated, 0, len(prompt), all_logits=True)
        assert [first] + [verify.argmax(i) for i in range(5)] == generated
        assert verify.argmax() == ctx.argmax()


# -- sequences ----------------------------------------------------------------------------------


def test_seq_rm(target: Model, prompt: list[int]) -> None:
    with decoded(target, prompt, 2, n_parallel=4) as ctx:
        ctx.decode(prompt, 3, 0)
        assert ctx.seq_rm(2, 50, -1)
        assert (ctx.seq_pos_min(2), ctx.seq_pos_max(2)) == (0, 49)
        assert ctx.seq_rm(-1)
        assert ctx.seq_pos_max(2) == ctx.seq_pos_max(3) == -1
        ctx.decode(prompt, 0, 0)
        ctx.clear()
        assert ctx.seq_pos_max(0) == -1


def test_sequence_ids_out_of_range_raise_instead_of_aborting(target: Model) -> None:
    blob = b""
    with context(target, n_parallel=4) as ctx:
        for call in (lambda: ctx.seq_rm(4), lambda: ctx.seq_rm(-2), lambda: ctx.seq_pos_min(-1),
                     lambda: ctx.seq_pos_max(4), lambda: ctx.state_seq_get(4), lambda: ctx.state_seq_get(-1),
                     lambda: ctx.state_seq_set(blob, -1), lambda: ctx.decode([1], 4, 0),
                     lambda: ctx.save_seq_file("unused", 4, []), lambda: ctx.load_seq_file("unused", -1)):
            with pytest.raises(ValueError, match="sequence id"):
                call()


# -- state blobs --------------------------------------------------------------------------------


def test_one_stream_per_slot(target: Model, prompt: list[int]) -> None:
    with decoded(target, prompt, 2, n_parallel=4) as ctx:
        seq_id, kv = read_blob(ctx.state_seq_get(2))
        assert seq_id == 2
        assert kv.n_stream == 4
        assert [len(s.positions) for s in kv.streams] == [0, 0, len(prompt), 0]
        assert kv.streams[2].positions == list(range(len(prompt)))


def test_unified_cache_has_one_stream(target: Model, prompt: list[int]) -> None:
    with decoded(target, prompt, 2, n_parallel=4, kv_unified=True) as ctx:
        seq_id, kv = read_blob(ctx.state_seq_get(2))
        assert (seq_id, kv.n_stream) == (2, 1)
        assert len(kv.streams[0].positions) == len(prompt)


@pytest.mark.parametrize("flash_attn, v_trans", [("off", 1), ("on", 0), ("auto", 0)])
def test_v_is_transposed_without_flash_attention(target: Model, prompt: list[int], flash_attn: str,
                                                 v_trans: int) -> None:
    with decoded(target, prompt, flash_attn=flash_attn) as ctx:
        (stream,) = read_blob(ctx.state_seq_get(0))[1].streams
        assert stream.v_trans == v_trans
        assert stream.n_layer == 2
        assert stream.k == [(1, 128)] * 2  # f16 rows of head size 64 x 1 KV head
        assert stream.v == ([(1, 2, 64)] * 2 if v_trans else [(1, 128)] * 2)


def test_q8_0_cache_with_flash_attention(target: Model, prompt: list[int]) -> None:
    with decoded(target, prompt, type_k="q8_0", type_v="q8_0", flash_attn="on") as ctx:
        (stream,) = read_blob(ctx.state_seq_get(0))[1].streams
        assert stream.v_trans == 0
        assert stream.k == stream.v == [(8, 68)] * 2  # 64 values = 2 blocks of 34 bytes


def test_partial_only_equals_full_for_a_plain_kv_cache(target: Model, prompt: list[int]) -> None:
    with decoded(target, prompt, 1, n_parallel=2) as ctx:
        assert ctx.state_seq_get(1, STATE_FLAGS_PARTIAL_ONLY) == ctx.state_seq_get(1)


@pytest.mark.parametrize("model, partial", [
    ("gemma2.gguf", "the SWA KV section"),
    ("lfm2.gguf", "the recurrent section"),
    ("jamba.gguf", "the recurrent section"),
    ("mamba.gguf", "everything"),
])
def test_partial_only_leaves_out_the_first_kv_section_of_other_kinds(model: str, partial: str) -> None:
    """iSWA: base KV + SWA KV; hybrid: attention KV + recurrent; recurrent: only the recurrent part."""
    with Model(DATA / "kinds" / model) as m, decoded(m, m.tokenize(KINDS_PROMPT), 1, n_parallel=2) as ctx:
        full, part = ctx.state_seq_get(1), ctx.state_seq_get(1, STATE_FLAGS_PARTIAL_ONLY)
        rest = full[8:] if partial == "everything" else full[read_kv(full, 8).end:]
        assert part[:8] == full[:8] and part[8:] == rest


def test_on_device_blobs_hold_no_tensor_data_and_are_not_restored(target: Model, prompt: list[int]) -> None:
    with decoded(target, prompt) as ctx:
        full, meta = ctx.state_seq_get(0), ctx.state_seq_get(0, STATE_FLAGS_ON_DEVICE)
        assert len(meta) < len(full) // 10
        with pytest.raises(ValueError, match="ON_DEVICE"):
            ctx.state_seq_set(meta, 0, STATE_FLAGS_ON_DEVICE)


def test_empty_sequence_state(target: Model) -> None:
    with context(target, n_parallel=2) as ctx:
        blob = ctx.state_seq_get(1)
        assert read_blob(blob)[1].streams[1].positions == []
        assert ctx.state_seq_set(blob, 0) == len(blob)


def test_state_round_trip_into_a_fresh_context(target: Model, prompt: list[int]) -> None:
    head, nxt = prompt[:-1], prompt[-1]
    with decoded(target, head, 2, n_parallel=4) as source, context(target, n_parallel=4) as fresh:
        blob = source.state_seq_get(2)
        assert fresh.state_seq_set(blob + b"trailing bytes are not read", 2) == len(blob)
        assert fresh.last_errors == []
        assert fresh.state_seq_get(2) == blob
        # the seq id in the blob is ignored: it restores into any slot
        assert fresh.state_seq_set(blob, 1) == len(blob)
        assert (fresh.seq_pos_min(1), fresh.seq_pos_max(1)) == (0, len(head) - 1)
        source.decode([nxt], 2, len(head))
        fresh.decode([nxt], 1, len(head))
        np.testing.assert_array_equal(fresh.logits_at(), source.logits_at())
        assert fresh.argmax() == source.argmax()


def _blob_with_cells(target: Model, prompt: list[int], n: int) -> bytes:
    with context(target, n_ctx=n + 1) as ctx:
        tokens = (prompt * (n // len(prompt) + 1))[:n]
        ctx.decode(tokens, 0, 0)
        return ctx.state_seq_get(0)


@pytest.mark.parametrize("case, reason", [
    ("other model", "mismatched layer count (2 instead of 1)"),
    ("other slot count", "n_stream mismatch"),
    ("flash attention off", "incompatible V transposition"),
    ("q8_0 keys", "mismatched key type (8 != 1, layer 0)"),  # the context's type first
    ("too many cells", "not enough cells in kv cache"),
    ("truncated", "failed to restore kv cache"),
    ("not a blob", "wrong sequence state magic"),
    ("empty", "error loading state"),
])
def test_a_blob_that_does_not_fit_returns_0(target: Model, draft: Model, prompt: list[int], case: str,
                                             reason: str) -> None:
    with decoded(target, prompt) as source:
        blob = source.state_seq_get(0)
    receivers = {
        "other model": lambda: context(draft),
        "other slot count": lambda: context(target, n_parallel=2),
        "flash attention off": lambda: context(target, flash_attn="off"),
        "q8_0 keys": lambda: context(target, type_k="q8_0"),
    }
    blobs = {
        "too many cells": lambda: _blob_with_cells(target, prompt, 300),
        "truncated": lambda: blob[:-1],
        "not a blob": lambda: bytes(range(64)),
        "empty": lambda: b"",
    }
    with receivers.get(case, lambda: context(target))() as ctx:
        ctx.decode(prompt[:10], 0, 0)
        assert ctx.state_seq_set(blobs.get(case, lambda: blob)(), 0) == 0
        assert any(reason in line for line in ctx.last_errors), ctx.last_errors
        # the process lives on and the context still works
        assert ctx.state_seq_set(ctx.state_seq_get(0), 0) > 0
        assert ctx.last_errors == []


def test_a_failed_restore_empties_the_sequence(target: Model, prompt: list[int]) -> None:
    with decoded(target, prompt) as ctx:
        blob = ctx.state_seq_get(0)
        assert ctx.state_seq_set(blob[:-1], 0) == 0
        assert ctx.seq_pos_max(0) == -1


# -- state files --------------------------------------------------------------------------------


def test_save_and_load_a_state_file(target: Model, prompt: list[int], tmp_path: Path) -> None:
    path = tmp_path / "slot.bin"
    # the server stores a packed token record, -1 first: words are kept as they are
    words = [-1, 1, len(prompt), *prompt, 0]
    with decoded(target, prompt, 1, n_parallel=2) as ctx, context(target, n_parallel=2) as fresh:
        size = ctx.save_seq_file(path, 1, words)
        data = path.read_bytes()
        assert size == len(data)
        assert struct.unpack_from("<III", data) == (STATE_FILE_MAGIC, STATE_VERSION, len(words))
        assert (STATE_FILE_MAGIC, STATE_VERSION) == (0x67677371, 3)
        assert list(struct.unpack_from(f"<{len(words)}i", data, 12)) == words
        payload = data[12 + 4 * len(words):]
        assert payload == ctx.state_seq_get(1)[8:]

        assert fresh.load_seq_file(path, 1) == (words, size)
        assert fresh.seq_pos_max(1) == len(prompt) - 1
        assert fresh.state_seq_get(1)[8:] == payload


def test_a_state_file_that_does_not_load_returns_0(target: Model, prompt: list[int], tmp_path: Path) -> None:
    path = tmp_path / "slot.bin"
    with decoded(target, prompt) as ctx, context(target, flash_attn="off") as other:
        ctx.save_seq_file(path, 0, prompt)
        data = path.read_bytes()
        assert other.load_seq_file(path, 0) == ([], 0)
        assert any("incompatible V transposition" in line for line in other.last_errors)

        path.write_bytes(data[:4] + struct.pack("<I", 4) + data[8:])
        assert ctx.load_seq_file(path, 0) == ([], 0)
        assert any("unknown (magic, version)" in line for line in ctx.last_errors)

        path.write_bytes(data[:8] + struct.pack("<I", 10**6) + data[12:])
        assert ctx.load_seq_file(path, 0) == ([], 0)
        assert any("exceeds the file size" in line for line in ctx.last_errors)

        assert ctx.load_seq_file(tmp_path / "missing.bin", 0) == ([], 0)
        assert ctx.last_errors

    with pytest.raises(LlamaError, match="cannot save sequence 0"):
        with context(target) as ctx:
            ctx.save_seq_file(tmp_path / "no" / "such" / "dir.bin", 0, [])


# -- the server's own slot files ----------------------------------------------------------------


@dataclass(frozen=True)
class ServerFile:
    """A slot file in tests/data, how the server that wrote it was started, and what it holds."""

    name: str
    model: str
    prompt: str
    slot: int = 0
    options: tuple[tuple[str, object], ...] = ()
    #: plain KV sections at the start of the payload (iSWA: 2; hybrid: 1, then the recurrent part)
    kv_sections: int = 1

    def settings(self) -> ContextSettings:
        return ContextSettings(**{"n_ctx": 256, "flash_attn": "on", **dict(self.options)})


SERVER_FILES = [
    ServerFile("srv-np1.bin", "target.gguf", SERVER_PROMPT),
    ServerFile("srv-np2-slot1.bin", "target.gguf", SERVER_PROMPT, 1, (("n_ctx", 512), ("n_parallel", 2))),
    ServerFile("srv-fa-off.bin", "target.gguf", SERVER_PROMPT, options=(("flash_attn", "off"),)),
    ServerFile("srv-kvq8.bin", "target.gguf", SERVER_PROMPT, options=(("type_k", "q8_0"), ("type_v", "q8_0"))),
    ServerFile("srv-unified-np2.bin", "target.gguf", SERVER_PROMPT,
               options=(("n_ctx", 512), ("n_parallel", 2), ("kv_unified", True))),
    ServerFile("kinds/srv-gemma2.bin", "kinds/gemma2.gguf", KINDS_PROMPT, kv_sections=2),
    ServerFile("kinds/srv-mamba.bin", "kinds/mamba.gguf", KINDS_PROMPT, kv_sections=0),
    ServerFile("kinds/srv-lfm2.bin", "kinds/lfm2.gguf", KINDS_PROMPT),
    ServerFile("kinds/srv-jamba.bin", "kinds/jamba.gguf", KINDS_PROMPT),
]


def server_payload_as_version_3(payload: bytes, kv_sections: int) -> bytes:
    """Drop the version-4 rotation words (n_rot_k, n_rot_v) of every KV stream that has cells."""
    cuts, offset = [], 0
    for _ in range(kv_sections):
        kv = read_kv(payload, offset, version=4)
        cuts += [s.records_at for s in kv.streams if s.positions]
        offset = kv.end
    pieces, last = [], 0
    for cut in cuts:
        pieces.append(payload[last:cut])
        last = cut + 8
    return b"".join(pieces) + payload[last:]


def _records(obj):
    """Every tensor record (a container with ``type`` and ``data`` bytes) of a parsed memory section."""
    if isinstance(obj, dict):
        if "type" in obj and isinstance(obj.get("data"), (bytes, bytearray)):
            yield obj
            return
        for k, v in obj.items():
            if not str(k).startswith("_"):
                yield from _records(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _records(v)


def _values(rec) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = np.frombuffer(rec["data"], dtype=np.uint8)
    return np.asarray(dequantize(raw, GGMLQuantizationType(rec["type"])), dtype=np.float64).ravel()


def assert_same_state(ours: bytes, theirs: bytes, model_path) -> None:
    """The same memory: every count, cell, type and size equal, every tensor value equal to float rounding.

    On the CPU that saved tests/data the bytes are identical; another instruction set (AVX-512 against
    AVX2, say) rounds a few sums differently, so tensor values are compared after dequantizing, with a
    bound far below any real difference (another prompt or cache type moves values by 0.1 and more).
    """
    import io

    from slotctl.model.info import read_model_info
    from slotctl.slotfile import parse_memory

    layout = read_model_info(model_path).layout()
    assert len(ours) == len(theirs)
    a = parse_memory(io.BytesIO(ours), 0, len(ours), layout, 3, lazy=False)
    b = parse_memory(io.BytesIO(theirs), 0, len(theirs), layout, 3, lazy=False)
    assert a.end == b.end == len(ours)
    ra = [r for s in a.sections for r in _records(s)]
    rb = [r for s in b.sections for r in _records(s)]
    assert ra and len(ra) == len(rb)
    worst: list[float] = []
    for x, y in zip(ra, rb):
        assert x["type"] == y["type"] and len(x["data"]) == len(y["data"])
        vx, vy = _values(x), _values(y)
        if not vx.size:
            continue
        scale = max(1.0, float(np.abs(vy).max()))
        worst.append(float(np.abs(vx - vy).max()) / scale)
        assert worst[-1] <= 2e-2
    # and everything but the tensor values byte for byte
    for m in (a, b):
        for r in (r for sec in m.sections for r in _records(sec)):
            r["data"] = bytes(len(r["data"]))
    rebuilt = [b"".join(sl.schema().build(sec, version=3) for sl, sec in zip(layout.sections, m.sections))
               for m in (a, b)]
    assert rebuilt[0] == rebuilt[1]


@pytest.mark.parametrize("f", SERVER_FILES, ids=lambda f: f.name)
def test_the_server_slot_is_reproduced(f: ServerFile) -> None:
    """Same prompt, same options, same greedy generation: the same tokens and the same state.

    The server's file is version 4; dropping its rotation words gives the version-3 state this
    runtime writes, which restores into the context as it is.
    """
    data = (DATA / f.name).read_bytes()
    magic, version, n_words = struct.unpack_from("<III", data)
    assert (magic, version) == (STATE_FILE_MAGIC, 4)
    marker, record_version, n_tokens = struct.unpack_from("<iII", data, 12)
    assert (marker, record_version) == (-1, 1)
    saved_tokens = list(struct.unpack_from(f"<{n_tokens}i", data, 24))
    server_state = server_payload_as_version_3(data[12 + 4 * n_words:], f.kv_sections)

    with Model(DATA / f.model) as model, Context(model, f.settings()) as ctx:
        tokens = model.tokenize(f.prompt)
        ctx.decode(tokens, f.slot, 0)
        # the server samples n_predict tokens and decodes all but the last into the cache
        tokens += generate_greedy(ctx, f.slot, SERVER_N_PREDICT - 1, len(tokens))
        assert tokens == saved_tokens
        ours = ctx.state_seq_get(f.slot)
        assert len(ours) - 8 == len(server_state)
        assert_same_state(ours[8:], server_state, DATA / f.model)
        blob = ours[:8] + server_state
        assert ctx.state_seq_set(blob, f.slot) == len(blob)
        assert ctx.seq_pos_max(f.slot) == n_tokens - 1


# -- logging ------------------------------------------------------------------------------------


def test_llama_cpp_log_goes_to_stderr_only_when_verbose(target: Model, capsys: pytest.CaptureFixture) -> None:
    try:
        configure_logging(True)
        context(target).close()
        assert "llama_context" in capsys.readouterr().err
    finally:
        configure_logging(False)
    context(target).close()
    assert capsys.readouterr().err == ""
