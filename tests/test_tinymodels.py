"""Tests of slotctl.tinymodels: the tiny models load, tokenize English and decode in llama.cpp."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from slotctl.tinymodels import SAMPLE_PROMPT, TinyModels, make_model, make_models, vocabulary

ROUND_TRIP_TEXTS = [
    SAMPLE_PROMPT,
    "what is the capital of france? paris is the capital of france. "
    "the river of paris is north of the city",
    " Leading space,  two spaces, trailing space ",
    "Lines\nand\ttabs\r\n\nend.",
    "Numbers: 3.14159, 2024-06-01 and 100%!",
    "Unicode: café, naïve, Straße, 東京, emoji 🙂 — done…",
    "Unlisted words: antidisestablishmentarianism, Parisian, zyx.",
    "<0x41> and </s> written out are text, not tokens.",
    "",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return make_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tokenizer(models: TinyModels) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(models.target), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def draft_tokenizer(models: TinyModels) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(models.draft), vocab_only=True, verbose=False)


def fields(path: Path) -> dict[str, object]:
    """The metadata of a GGUF file, the token arrays included, as Python values."""
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}


def test_vocabulary_layout() -> None:
    tokens = vocabulary()
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert len(set(tokens)) == len(tokens)
    assert len(tokens) < 4096
    for word in ("the", "The", "▁the", "▁The", "▁capital", "▁Paris", "▁France", "?", "▁"):
        assert word in tokens


def test_models_are_llama_models_with_the_requested_shapes(models: TinyModels) -> None:
    target, draft = fields(models.target), fields(models.draft)
    assert target["general.architecture"] == "llama"
    assert target["llama.block_count"] == 2
    assert draft["llama.block_count"] == 1
    for meta in (target, draft):
        assert meta["llama.embedding_length"] == 128
        assert meta["llama.attention.head_count"] == 2
        assert meta["llama.attention.head_count_kv"] == 1
        assert meta["llama.attention.key_length"] == 64
        assert meta["llama.attention.value_length"] == 64
        assert meta["llama.rope.dimension_count"] == 64
        assert meta["tokenizer.ggml.model"] == "llama"
        assert meta["tokenizer.ggml.add_bos_token"] is True
        assert meta["tokenizer.ggml.bos_token_id"] == 1
        assert meta["tokenizer.ggml.tokens"] == vocabulary()
    tensors = {t.name: (t.tensor_type, [int(n) for n in t.shape])
               for t in gguf.GGUFReader(models.target).tensors}
    assert tensors["blk.1.attn_k.weight"] == (gguf.GGMLQuantizationType.F32, [128, 64])
    assert tensors["token_embd.weight"] == (gguf.GGMLQuantizationType.F32, [128, len(vocabulary())])


def test_making_twice_gives_identical_bytes(tmp_path: Path) -> None:
    first = make_models(tmp_path / "first")
    second = make_models(tmp_path / "second")
    assert first.target.read_bytes() == second.target.read_bytes()
    assert first.draft.read_bytes() == second.draft.read_bytes()
    assert first.target.read_bytes() != first.draft.read_bytes()
    assert first.target.name == "tiny-target.gguf"
    assert first.draft.name == "tiny-draft.gguf"


def test_identical_files_are_reused_and_others_replaced(tmp_path: Path) -> None:
    made = make_models(tmp_path)
    before = made.target.stat()
    made.draft.write_bytes(b"not a model")

    again = make_models(tmp_path)

    assert again == made
    after = made.target.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert made.draft.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-draft.gguf", "tiny-target.gguf"]


def test_seed_changes_only_the_weights(tmp_path: Path) -> None:
    one = fields(make_model(tmp_path / "one.gguf", seed=1))
    two = fields(make_model(tmp_path / "two.gguf", seed=2))
    assert one == two
    assert (tmp_path / "one.gguf").read_bytes() != (tmp_path / "two.gguf").read_bytes()


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_text_round_trips(tokenizer: llama_cpp.Llama, text: str) -> None:
    tokens = tokenizer.tokenize(text.encode(), add_bos=False, special=False)
    assert tokenizer.detokenize(tokens).decode() == text
    with_bos = tokenizer.tokenize(text.encode())
    assert with_bos == [1, *tokens]
    # llama-cpp-python drops one leading space after BOS (a Llama-1 rule of its own)
    assert tokenizer.detokenize(with_bos).decode() == text.removeprefix(" ")


def test_english_tokenizes_into_words(tokenizer: llama_cpp.Llama) -> None:
    tokens = tokenizer.tokenize(SAMPLE_PROMPT.encode(), add_bos=False)
    pieces = [vocabulary()[t] for t in tokens]
    assert pieces[:6] == ["What", "▁is", "▁the", "▁capital", "▁of", "▁France"]
    # one token per word and per punctuation mark: about a hundred
    assert len(tokens) == len(re.findall(r"\w+|[^\w\s]", SAMPLE_PROMPT))
    assert 90 <= len(tokens) <= 110


def test_every_listed_word_is_one_token(tokenizer: llama_cpp.Llama) -> None:
    tokens = vocabulary()
    words = [t[1:] for t in tokens if t.startswith("▁") and len(t) > 1]
    assert len(words) > 800
    for word in words:
        for text, pieces in (
            (word, [word]),
            (" " + word, ["▁" + word]),
            (f"({word}.", ["(", word, "."]),
            (f"{word}, {word}", [word, ",", "▁" + word]),
        ):
            ids = tokenizer.tokenize(text.encode(), add_bos=False)
            assert [tokens[i] for i in ids] == pieces


def test_target_and_draft_share_the_vocabulary(
    tokenizer: llama_cpp.Llama, draft_tokenizer: llama_cpp.Llama
) -> None:
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.tokenize(text.encode()) == draft_tokenizer.tokenize(text.encode())
    assert speculation_compatible(tokenizer, draft_tokenizer)
    assert speculation_compatible(tokenizer, tokenizer)


def speculation_compatible(target: llama_cpp.Llama, draft: llama_cpp.Llama) -> bool:
    """The checks llama.cpp's common_speculative_are_compatible makes before drafting."""
    tgt = llama_cpp.llama_model_get_vocab(target.model)
    dft = llama_cpp.llama_model_get_vocab(draft.model)
    n_tgt, n_dft = llama_cpp.llama_vocab_n_tokens(tgt), llama_cpp.llama_vocab_n_tokens(dft)
    return (
        llama_cpp.llama_vocab_type(tgt) == llama_cpp.llama_vocab_type(dft)
        and llama_cpp.llama_vocab_get_add_bos(tgt) == llama_cpp.llama_vocab_get_add_bos(dft)
        and llama_cpp.llama_vocab_bos(tgt) == llama_cpp.llama_vocab_bos(dft)
        and llama_cpp.llama_vocab_get_add_eos(tgt) == llama_cpp.llama_vocab_get_add_eos(dft)
        and llama_cpp.llama_vocab_eos(tgt) == llama_cpp.llama_vocab_eos(dft)
        and abs(n_tgt - n_dft) <= 128
        and all(
            llama_cpp.llama_vocab_get_text(tgt, i) == llama_cpp.llama_vocab_get_text(dft, i)
            for i in range(5, min(n_tgt, n_dft))
        )
    )


def greedy(model_path: Path, prompt: str, n: int) -> list[int]:
    """Evaluate ``prompt`` and greedily generate ``n`` tokens, checking the logits on the way."""
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=256, logits_all=True, verbose=False)
    tokens = llm.tokenize(prompt.encode())
    llm.eval(tokens)
    assert np.isfinite(llm.scores[: llm.n_tokens]).all()
    assert llm.scores[llm.n_tokens - 1].std() > 0.5
    out = []
    for token in llm.generate(tokens, temp=0.0, top_k=1):
        out.append(token)
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("role", ["target", "draft"])
def test_models_decode_and_generate_greedily(models: TinyModels, role: str) -> None:
    path = getattr(models, role)
    generated = greedy(path, SAMPLE_PROMPT, 8)
    assert len(generated) == 8
    assert all(0 <= t < len(vocabulary()) for t in generated)
    assert greedy(path, SAMPLE_PROMPT, 8) == generated


def test_variants_load_and_decode(tmp_path: Path) -> None:
    path = make_model(tmp_path / "variant.gguf", n_layer=3, n_embd=96, n_head=4, n_head_kv=2,
                      head_dim=32, n_ff=160, seed=7, context_length=512, name="variant")
    meta = fields(path)
    assert meta["general.name"] == "variant"
    assert meta["llama.context_length"] == 512
    assert meta["llama.feed_forward_length"] == 160
    assert len(greedy(path, "The river runs north.", 4)) == 4


@pytest.mark.parametrize(
    "options",
    [{"n_layer": 0}, {"n_head": 3, "n_head_kv": 2}, {"head_dim": 63}, {"context_length": -1}],
)
def test_bad_shapes_are_refused(tmp_path: Path, options: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        make_model(tmp_path / "bad.gguf", **options)
    assert list(tmp_path.iterdir()) == []
