"""The vocabulary every tiny model shares, the sample prompt, and the tokenizer keys that carry them."""

from __future__ import annotations

import functools
import string
from dataclasses import dataclass

import gguf

#: A few sentences of English, 98 tokens (99 with BOS): one per word or punctuation mark.
SAMPLE_PROMPT = (
    "What is the capital of France? Paris is the capital of France, and it is also the "
    "largest city in the country. The river Seine runs through the middle of Paris from the "
    "east to the west. Every year many people come to the city to visit the Eiffel Tower, "
    "the old churches and the famous museums. In the evening the lights of the city shine on "
    "the water, and the streets are full of music. Paris is a beautiful city, and people from "
    "every country love it."
)

# Each word becomes one token in four forms: "word", "Word", "▁word" and "▁Word".
# Roughly in order of frequency, which is the order of their scores.
_WORDS = """
    the of and to a in is it you that he was for on are with as i his they be at one have
    this from or had by not but what some we can out other were all there when up use your
    how said an each she which do their time if will way about many then them would like so
    these her long make thing see him two has look more day could go come did no most
    people my over know water than call first who may down side been now find any new work
    part take get place made live where after back little only round man year years came
    show every good me give our under name very through just form great think say help low
    line turn much mean before move right old too same tell does set three want air well
    also play small end put home read hand large even land here must big high such follow
    why ask men change went light lights kind off need house try us again point mother
    world near build earth father head stand own page should country found answer school
    grow study still learn food sun four between state keep eye never last let thought
    city cities tree cross hard start might story saw far sea draw left late run runs
    while close night real life few north open seem together next white children begin
    got walk example paper group always music those both often until river car feet care
    second book carry took science eat room friend began idea fish mountain stop once base
    hear horse cut sure watch color face wood main enough girl young ready above ever red
    list though feel talk bird soon body dog family leave song door black short class wind
    question happen complete ship area half rock order fire south problem piece told knew
    pass since top whole king queen space heard best hour better true during hundred five
    remember step early hold west ground reach fast sing listen six table travel less
    morning ten simple toward war against slow center love person money serve road map
    rain cold voice power town fine certain fall lead dark machine note wait plan star box
    field rest able done drive stood front teach week final gave green quick ocean warm
    free minute strong mind behind clear fact street streets full stay wheel blue deep
    moon island foot system busy test boat common gold possible age dry laugh thousand ago
    ran check game shape yes hot bring sit fill east language among capital france paris
    french europe seine eiffel tower museum museums church churches bridge art visit
    famous beautiful evening largest middle shine history garden palace wine bread summer
    winter spring model token tokens slot slots cache server prompt draft target text
    hello
"""

#: tokenizer.ggml.token_type values
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = (
    gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.BYTE,
)
_SPACE = "\u2581"  # "▁", SentencePiece's visible space
_SPECIAL_TOKENS = (("<unk>", _UNKNOWN), ("<s>", _CONTROL), ("</s>", _CONTROL))
_UNK_ID, _BOS_ID, _EOS_ID = 0, 1, 2
#: single-character tokens: the visible space and every printable ASCII character but space
_CHARACTERS = _SPACE + string.ascii_letters + string.digits + string.punctuation


@dataclass(frozen=True)
class _Vocabulary:
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]


@functools.cache
def _build_vocabulary() -> _Vocabulary:
    """Lay out the vocabulary: special tokens, bytes, word pieces, then single characters.

    llama.cpp's SentencePiece tokenizer starts from characters and keeps merging the
    adjacent pair whose concatenation is a token, highest score first.  Two rules make
    every listed word come out as one token:

    * every prefix of length >= 2 of a word (lower case and capitalized) is a token, so
      the left end of a word can always grow by the next character until it is whole;
    * the pieces inside words outscore the ``▁``-joined forms, so the text between two
      spaces is merged completely before ``▁`` is joined to the whole word.

    Scores fall by one per token along pieces and characters; specials and bytes score 0
    (the tokenizer never merges into them).
    """
    words = _WORDS.split()
    inner: dict[str, None] = {}
    for word in words:
        for form in (word, word.capitalize()):
            for end in range(2, len(form) + 1):
                inner[form[:end]] = None
    joined = [_SPACE + form for word in words for form in (word, word.capitalize())]
    pieces = [*inner, *joined, *_CHARACTERS]

    tokens = [text for text, _ in _SPECIAL_TOKENS] + [f"<0x{b:02X}>" for b in range(256)]
    types = [kind for _, kind in _SPECIAL_TOKENS] + [_BYTE] * 256
    scores = [0.0] * len(tokens)
    tokens += pieces
    types += [_NORMAL] * len(pieces)
    scores += [-float(rank) for rank in range(len(pieces))]
    return _Vocabulary(tuple(tokens), tuple(scores), tuple(int(t) for t in types))


def vocabulary() -> list[str]:
    """Return the token texts shared by every model made here, indexed by token id.

    Ids 0, 1, 2 are ``<unk>``, ``<s>`` (BOS) and ``</s>`` (EOS); ids 3..258 are the byte
    tokens ``<0x00>``..``<0xFF>``; then come word pieces (``▁`` stands for a space) and
    single characters.
    """
    return list(_build_vocabulary().tokens)


def _add_tokenizer(writer: gguf.GGUFWriter, vocab: _Vocabulary) -> None:
    """The shared vocabulary, as llama.cpp's SentencePiece ("llama") tokenizer reads it."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_scores(list(vocab.scores))
    writer.add_token_types(list(vocab.types))
    writer.add_unk_token_id(_UNK_ID)
    writer.add_bos_token_id(_BOS_ID)
    writer.add_eos_token_id(_EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
