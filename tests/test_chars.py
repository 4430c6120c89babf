"""Character ids: the exact arrays of spec §1.2 and the batching conventions of §1.3."""
import pytest
import torch

import elmo_fast
from elmo_fast.chars import Batcher, TokenBatcher, Vocabulary, word_to_char_ids


def _trim(ids):
    while ids and ids[-1] == 261:
        ids = ids[:-1]
    return ids


@pytest.mark.parametrize("word, expected", [
    ("The", [259, 85, 105, 102, 260]),
    (".", [259, 47, 260]),
    (chr(256) + "t", [259, 197, 129, 117, 260]),
    ("<S>", [259, 257, 260]),
    ("</S>", [259, 258, 260]),
])
def test_word_ids(word, expected):
    ids = word_to_char_ids(word)
    assert len(ids) == 50
    assert _trim(ids) == expected
    assert ids[len(expected):] == [261] * (50 - len(expected))


def test_truncation_is_bytewise_48():
    ids = word_to_char_ids("é" * 30)  # 60 bytes -> 48 kept, the last code point cut in half is fine
    assert ids[0] == 259 and ids[49] == 260 and len(ids) == 50
    assert ids[1:49] == [b + 1 for b in ("é" * 30).encode()[:48]]
    assert word_to_char_ids("a" * 300) == [259] + [98] * 48 + [260]


def test_invalid_unicode_dropped_and_tokens_to_add():
    assert _trim(word_to_char_ids("a\ud800b")) == [259, 98, 99, 260]
    assert _trim(word_to_char_ids("@@X@@", tokens_to_add={"@@X@@": 5})) == [259, 6, 260]


def test_batch_to_ids_padding_and_no_boundaries():
    ids = elmo_fast.batch_to_ids([["The", "."], ["a"], []])
    assert ids.shape == (3, 2, 50) and ids.dtype == torch.long
    assert _trim(ids[0, 0].tolist()) == [259, 85, 105, 102, 260]
    assert torch.all(ids[1, 1] == 0) and torch.all(ids[2] == 0)
    assert elmo_fast.batch_to_ids([[]]).shape == (1, 0, 50)


@pytest.mark.parametrize("bad, err", [
    ([], ValueError), ("a sentence", TypeError), (["a", "b"], TypeError), ([["a", 3]], TypeError),
])
def test_batch_to_ids_bad_input(bad, err):
    with pytest.raises(err):
        elmo_fast.batch_to_ids(bad)


def test_empty_string_token_is_a_token(tmp_path):
    """AllenNLP's batch_to_ids and bilm-tf's batchers take "" (e.g. from "a  b".split(" ")): the begin and end of
    word marks, then padding; the token batcher looks it up like any word (<UNK> here)."""
    ids = elmo_fast.batch_to_ids([["a", "", "b"]])
    assert ids.shape == (1, 3, 50) and ids[0, 1].tolist() == [259, 260] + [261] * 48
    assert Batcher().batch_sentences([[""]])[0, 1].tolist() == [259, 260] + [261] * 48
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("<S>\n</S>\n<UNK>\na\n")
    assert TokenBatcher(str(vocab)).batch_sentences([["a", ""]]).tolist() == [[1, 4, 3, 2]]


def test_batcher_adds_boundaries(tmp_path):
    ids = Batcher().batch_sentences([["The"], []])
    assert ids.shape == (2, 3, 50)
    assert _trim(ids[0, 0].tolist()) == [259, 257, 260] and _trim(ids[0, 2].tolist()) == [259, 258, 260]
    assert _trim(ids[1, 1].tolist()) == [259, 258, 260] and torch.all(ids[1, 2] == 0)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("<S>\n</S>\n<UNK>\nthe\n!!!MAXTERMID\ncat\n")
    v = Vocabulary(str(vocab))
    assert v.words == ["<S>", "</S>", "<UNK>", "the", "cat"]
    tb = TokenBatcher(str(vocab)).batch_sentences([["the", "dog"], ["cat"]])
    assert tb.tolist() == [[1, 4, 3, 2], [1, 5, 2, 0]]


def test_token_batcher_needs_the_boundaries_and_unk_for_unknown_words(tmp_path):
    """bilm-tf's TokenBatcher gives missing <S>/</S>/<UNK> the padding id 0, silently: refused here, by name."""
    vocab = tmp_path / "v.txt"
    vocab.write_text("the\ncat\n")
    with pytest.raises(ValueError, match=r"lacks \['<S>', '</S>'\]; TokenBatcher puts <S> and </S>"):
        TokenBatcher(str(vocab))
    vocab.write_text("<S>\n</S>\nthe\ncat\n")
    tb = TokenBatcher(str(vocab))
    assert tb.batch_sentences([["the", "cat"]]).tolist() == [[1, 3, 4, 2]]
    with pytest.raises(ValueError, match=r"sentence 1: \['dog'\] are not in the vocabulary, which has no <UNK>"):
        tb.batch_sentences([["cat"], ["the", "dog"]])


@pytest.mark.parametrize("width", [2, 0, "50", 50.0])
def test_batcher_names_a_bad_token_width(width):
    with pytest.raises(ValueError, match=f"max_token_length must be an integer >= 3 .*, got {width!r}"):
        Batcher(max_token_length=width)
