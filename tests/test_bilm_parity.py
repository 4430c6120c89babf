"""bilm-tf's data classes in elmo_fast against bilm-tf's own ``bilm/data.py`` (PyPI ``bilm==0.1.post5``) on the
same files: bilm-tf's fixture files and generated ones (blank lines, duplicates, ``!!!MAXTERMID``, line ends,
unicode, OOV words). Run from ``.venv-allennlp`` by ``make test-parity``; see ``tests/oracles.py``."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from oracles import fixtures_dir, require_bilm_data

bilm = require_bilm_data()

import elmo_fast  # noqa: E402
from elmo_fast import BidirectionalLMDataset, LMDataset, UnicodeCharsVocabulary, Vocabulary  # noqa: E402

ODD_VOCAB = ["<S>", "</S>", "<UNK>", "the", "", "cat", "the", "!!!MAXTERMID", "  dog\t", "naïve", "x" * 60, "日本",
             "", "é" * 30, "<UNK>"]
SENTENCES = ["the cat sat", "", "dog the naïve unknown", "<S> inside </S>", "日本 " + "x" * 60, "a\u2028b c",
             "the"]


def _vocab_files(tmp_path):
    files = {name: os.path.join(fixtures_dir("bilm-tf", "tests", "fixtures", sub), fname)
             for name, sub, fname in (("data", "data", "vocab_test.txt"), ("train", "train", "vocab.txt"),
                                      ("model", "model", "vocab_test.txt"))}
    odd = tmp_path / "odd.txt"
    odd.write_bytes(("\r\n".join(ODD_VOCAB) + "\n").encode("utf-8"))
    files["odd"] = str(odd)
    return files


def _words_of(path):
    words = set()
    for line in open(path, encoding="utf-8"):
        words.update(line.split())
    return sorted(words) + ["never-seen", "", "<S>", "</S>", "<UNK>"]


@pytest.mark.parametrize("which", ["data", "train", "model", "odd"])
def test_vocabulary_matches_bilm_tf(tmp_path, which):
    path = _vocab_files(tmp_path)[which]
    theirs, ours = bilm.Vocabulary(path), Vocabulary(path)
    assert ours.size == theirs.size and len(ours) == theirs.size
    assert [ours.id_to_word(i) for i in range(ours.size)] == [theirs.id_to_word(i) for i in range(theirs.size)]
    assert (ours.bos, ours.eos, ours.unk) == (theirs.bos, theirs.eos, theirs.unk)
    for w in _words_of(path):
        assert ours.word_to_id(w) == theirs.word_to_id(w), w
    for s in SENTENCES:
        for reverse in (False, True):
            a, b = ours.encode(s, reverse), theirs.encode(s, reverse)
            assert a.dtype == b.dtype and np.array_equal(a, b), s
        assert np.array_equal(ours.encode(s.split(), split=False), theirs.encode(s.split(), split=False))
    ids = list(range(ours.size))[::3]
    assert ours.decode(ids) == theirs.decode(ids)


@pytest.mark.parametrize("max_len", [50, 5])
@pytest.mark.parametrize("which", ["data", "train", "model"])
def test_unicode_chars_vocabulary_matches_bilm_tf(tmp_path, which, max_len):
    path = _vocab_files(tmp_path)[which]
    theirs, ours = bilm.UnicodeCharsVocabulary(path, max_len), UnicodeCharsVocabulary(path, max_len)
    assert ours.max_word_length == theirs.max_word_length == max_len
    assert np.array_equal(ours.word_char_ids, theirs.word_char_ids)
    assert np.array_equal(ours.bos_chars, theirs.bos_chars) and np.array_equal(ours.eos_chars, theirs.eos_chars)
    for w in _words_of(path):
        assert np.array_equal(ours.word_to_char_ids(w), theirs.word_to_char_ids(w)), w
    for s in SENTENCES:
        for reverse in (False, True):
            a, b = ours.encode_chars(s, reverse), theirs.encode_chars(s, reverse)
            assert a.dtype == b.dtype and np.array_equal(a, b), s


def test_odd_vocabulary_chars(tmp_path):
    """Blank lines, duplicates and a 60-byte word: same table (the file holds <S> and </S> once each)."""
    path = _vocab_files(tmp_path)["odd"]
    theirs, ours = bilm.UnicodeCharsVocabulary(path, 50), UnicodeCharsVocabulary(path, 50)
    assert np.array_equal(ours.word_char_ids, theirs.word_char_ids)


def test_batchers_match_bilm_tf(tmp_path):
    path = _vocab_files(tmp_path)["data"]
    sents = [s.split() for s in SENTENCES if s.split()]
    assert np.array_equal(elmo_fast.Batcher(path).batch_sentences(sents).numpy(),
                          bilm.Batcher(path, 50).batch_sentences(sents))
    assert np.array_equal(elmo_fast.TokenBatcher(path).batch_sentences(sents).numpy(),
                          bilm.TokenBatcher(path).batch_sentences(sents))


def _batches(it, n):
    """Up to n batches; bilm-tf's test-mode data ends with RuntimeError (a StopIteration inside a generator)."""
    out = []
    try:
        for b in itertools.islice(it, n):
            out.append(b)
    except RuntimeError:
        pass
    return out


def _assert_same_batches(ours, theirs):
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert sorted(a) == sorted(b)
        for k in b:
            if b[k] is None:
                assert a[k] is None, k
            else:
                assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def _corpus(tmp_path):
    text = "\r\n".join(SENTENCES * 3) + "\n\n  \nthe cat\n"
    path = tmp_path / "corpus.txt"
    path.write_bytes(text.encode("utf-8"))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["<S>", "</S>", "<UNK>", "the", "cat", "", "dog", "日本", "sat"]) + "\n")
    return str(path), str(vocab)


@pytest.mark.parametrize("chars", [True, False], ids=["chars", "words"])
@pytest.mark.parametrize("source", ["fixture", "generated"])
@pytest.mark.parametrize("shape", [(2, 10), (3, 7), (1, 1)])
def test_lm_datasets_match_bilm_tf(tmp_path, chars, source, shape):
    """Training mode without shuffling on one shard (bilm-tf's test_data setting): the same endless stream."""
    if source == "fixture":
        d = fixtures_dir("bilm-tf", "tests", "fixtures", "train")
        data, vocab_file = os.path.join(d, "data.txt"), os.path.join(d, "vocab.txt")
    else:
        data, vocab_file = _corpus(tmp_path)

    def vocab(mod):
        return mod.UnicodeCharsVocabulary(vocab_file, 50) if chars else mod.Vocabulary(vocab_file)

    ours_v = UnicodeCharsVocabulary(vocab_file, 50) if chars else Vocabulary(vocab_file)
    n = 40
    for reverse in (False, True):
        ours = _batches(LMDataset(data, ours_v, reverse=reverse).iter_batches(*shape), n)
        theirs = _batches(bilm.LMDataset(data, vocab(bilm), reverse=reverse).iter_batches(*shape), n)
        _assert_same_batches(ours, theirs)
    ours = _batches(BidirectionalLMDataset(data, ours_v).iter_batches(*shape), n)
    theirs = _batches(bilm.BidirectionalLMDataset(data, vocab(bilm)).iter_batches(*shape), n)
    _assert_same_batches(ours, theirs)


def test_test_mode_matches_bilm_tf_until_the_data_ends(tmp_path):
    data, vocab_file = _corpus(tmp_path)
    ours = _batches(BidirectionalLMDataset(data, UnicodeCharsVocabulary(vocab_file, 50), test=True)
                    .iter_batches(2, 5), 10_000)
    theirs = _batches(bilm.BidirectionalLMDataset(data, bilm.UnicodeCharsVocabulary(vocab_file, 50), test=True)
                      .iter_batches(2, 5), 10_000)
    _assert_same_batches(ours, theirs)
    assert len(ours) < 10_000


def test_shuffled_training_data_is_the_same_text(tmp_path):
    """With shuffle_on_load the orders differ (bilm-tf uses the global `random`), but one epoch of sentences
    through a single row holds the same multiset of (input, target) pairs."""
    data, vocab_file = _corpus(tmp_path)
    n_tokens = sum(len(line.split()) + 1 for line in open(data, encoding="utf-8", newline=None))

    def pairs(ds):
        b = next(ds.iter_batches(1, n_tokens))
        return sorted(zip(b["token_ids"][0].tolist(), b["next_token_id"][0].tolist()))

    ours = pairs(LMDataset(data, Vocabulary(vocab_file), shuffle_on_load=True, seed=3))
    theirs = pairs(bilm.LMDataset(data, bilm.Vocabulary(vocab_file), shuffle_on_load=True))
    assert ours == theirs
