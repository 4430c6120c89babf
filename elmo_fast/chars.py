"""Character ids (spec §1): the 50-id token encoding, sentence boundaries, batching, vocabularies.

Ids here are *inference* ids (the raw ids + 1; 0 means "no token here"):
UTF-8 byte b -> b + 1, BOS char 257, EOS char 258, begin-of-word 259, end-of-word 260, in-word padding 261.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .util import check_int

MAX_WORD_LENGTH = 50
BOS_CHAR = 256  # raw ids (training uses these; inference adds 1)
EOS_CHAR = 257
BOW_CHAR = 258
EOW_CHAR = 259
PAD_CHAR = 260
BOS_TOKEN = "<S>"
EOS_TOKEN = "</S>"
UNK_TOKEN = "<UNK>"
MAXTERMID = "!!!MAXTERMID"  # a vocabulary-file line that is not a word (bilm-tf)


def _special(char: int, max_len: int) -> list[int]:
    ids = [PAD_CHAR] * max_len
    ids[0], ids[1], ids[2] = BOW_CHAR, char, EOW_CHAR
    return ids


def word_to_char_ids(word: str, max_len: int = MAX_WORD_LENGTH, shift: int = 1,
                     tokens_to_add: dict[str, int] | None = None) -> list[int]:
    """One token -> ``max_len`` ids: [BOW, up to max_len-2 UTF-8 bytes, EOW, padding...] (+``shift``).

    ``<S>``/``</S>`` map to the sentence-boundary arrays; ``tokens_to_add`` maps extra tokens to
    [BOW, id, EOW, padding]. Bytes are truncated byte-wise (a code point may be cut, as in the original);
    characters that cannot be encoded (lone surrogates) are dropped, like ``errors='ignore'``.
    """
    if not isinstance(word, str):
        raise TypeError(f"a token must be a str, got {type(word).__name__}: {word!r}")
    if tokens_to_add and word in tokens_to_add:
        ids = _special(tokens_to_add[word], max_len)
    elif word == BOS_TOKEN:
        ids = _special(BOS_CHAR, max_len)
    elif word == EOS_TOKEN:
        ids = _special(EOS_CHAR, max_len)
    else:
        data = word.encode("utf-8", "ignore")[: max_len - 2]
        ids = [PAD_CHAR] * max_len
        ids[0] = BOW_CHAR
        ids[1 : len(data) + 1] = list(data)
        ids[len(data) + 1] = EOW_CHAR
    return [i + shift for i in ids]


def _check_batch(batch) -> None:
    if isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence):
        raise TypeError(f"expected a list of sentences (each a list of str tokens), got {type(batch).__name__}")
    for k, sent in enumerate(batch):
        if isinstance(sent, (str, bytes)) or not isinstance(sent, Sequence):
            raise TypeError(
                f"sentence {k} must be a list of str tokens, got {type(sent).__name__}; "
                "tokenize first, e.g. text.split()"
            )
        for tok in sent:
            if not isinstance(tok, str):
                raise TypeError(f"sentence {k}: token {tok!r} is a {type(tok).__name__}, expected str")
            # an empty-string token is a token, as in AllenNLP and bilm-tf (e.g. "a  b".split(" ")): its ids are
            # the begin and end of word marks and padding


def batch_to_ids(batch: list[list[str]]) -> torch.Tensor:
    """AllenNLP's ``batch_to_ids``: (n_sentences, max_tokens, 50) int64 inference ids, padded rows all 0.

    No sentence boundaries are added: the model adds ``<S>``/``</S>`` itself.
    """
    _check_batch(batch)
    if len(batch) == 0:
        raise ValueError("batch_to_ids: empty batch (no sentences)")
    max_len = max((len(s) for s in batch), default=0)
    out = torch.zeros(len(batch), max_len, MAX_WORD_LENGTH, dtype=torch.long)
    cache: dict[str, list[int]] = {}
    for k, sent in enumerate(batch):
        for t, tok in enumerate(sent):
            ids = cache.get(tok)
            if ids is None:
                ids = cache[tok] = word_to_char_ids(tok)
            out[k, t] = torch.tensor(ids)
    return out


class Vocabulary:
    """bilm-tf's ``Vocabulary``: a vocabulary file read as bilm-tf reads it (docs/data.md).

    One token a line, surrounding whitespace stripped; a ``!!!MAXTERMID`` line is skipped. Every other line is a
    word, a blank line too (the word ``""``), so line k (0-based, skipped lines not counted) has id k and ``size``
    counts every line. A word listed twice has two ids; ``word_to_id`` gives the last one, and so do ``bos``,
    ``eos`` and ``unk`` (the ids of ``<S>``, ``</S>``, ``<UNK>``, or -1 when absent). Unknown words map to ``unk``.
    ``Vocabulary(words=[...])`` builds one from a list instead of a file.
    """

    def __init__(self, filename=None, validate_file: bool = False, *, words: list[str] | None = None):
        if words is None:
            if filename is None:
                raise ValueError("Vocabulary needs a file name or a list of words")
            from .util import read_utf8, text_lines

            words = [w for w in (ln.strip() for ln in text_lines(read_utf8(filename, "vocabulary"))) if w != MAXTERMID]
        self.words = list(words)
        self._word_to_id = {w: i for i, w in enumerate(self.words)}  # a repeated word keeps its last id
        if validate_file:
            missing = [t for t in (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN) if t not in self._word_to_id]
            if missing:
                raise ValueError(f"vocabulary {filename or '<list>'} lacks the special tokens {missing}")

    @property
    def bos(self) -> int:
        return self._word_to_id.get(BOS_TOKEN, -1)

    @property
    def eos(self) -> int:
        return self._word_to_id.get(EOS_TOKEN, -1)

    @property
    def unk(self) -> int:
        return self._word_to_id.get(UNK_TOKEN, -1)

    @property
    def size(self) -> int:
        return len(self.words)

    def __len__(self) -> int:
        return len(self.words)

    def word_to_id(self, word: str) -> int:
        return self._word_to_id.get(word, self.unk)

    def id_to_word(self, cur_id: int) -> str:
        return self.words[cur_id]

    def decode(self, cur_ids) -> str:
        """Ids -> the words joined by single spaces."""
        return " ".join(self.words[i] for i in cur_ids)

    def encode(self, sentence, reverse: bool = False, split: bool = True) -> np.ndarray:
        """A sentence (a string, or a token list with ``split=False``) -> int32 ids ``[bos, w1..wn, eos]``;
        with ``reverse`` the sentence is taken as already reversed and the ends are ``[eos, ..., bos]``."""
        words = sentence.split() if split else sentence
        ids = [self.word_to_id(w) for w in words]
        ends = (self.eos, self.bos) if reverse else (self.bos, self.eos)
        return np.array([ends[0], *ids, ends[1]], dtype=np.int32)


class Batcher:
    """bilm-tf ``Batcher``: sentences -> (n, max_len + 2, 50) ids *with* ``<S>``/``</S>`` added.

    The vocabulary is only a cache in the original, so it is optional here; boundary positions always get the
    boundary arrays and literal ``<S>``/``</S>`` tokens map to them too (the original's intent).
    """

    def __init__(self, lm_vocab_file: str | None = None, max_token_length: int = MAX_WORD_LENGTH):
        self.max_token_length = check_int(max_token_length, "max_token_length", 3, " (begin, end and one byte)")
        self.vocab = Vocabulary(lm_vocab_file) if lm_vocab_file else None

    def batch_sentences(self, sentences: list[list[str]]) -> torch.Tensor:
        _check_batch(sentences)
        n = len(sentences)
        max_len = max((len(s) for s in sentences), default=0) + 2
        out = torch.zeros(n, max_len, self.max_token_length, dtype=torch.long)
        for k, sent in enumerate(sentences):
            toks = [BOS_TOKEN, *sent, EOS_TOKEN]
            for t, tok in enumerate(toks):
                out[k, t] = torch.tensor(word_to_char_ids(tok, self.max_token_length))
        return out


class TokenBatcher:
    """bilm-tf ``TokenBatcher``: sentences -> (n, max_len + 2) word ids (vocab id + 1, 0 = padding)."""

    def __init__(self, lm_vocab_file: str):
        self.vocab = Vocabulary(lm_vocab_file)
        missing = [t for t, i in ((BOS_TOKEN, self.vocab.bos), (EOS_TOKEN, self.vocab.eos)) if i < 0]
        if missing:  # bilm-tf would give every boundary the padding id 0
            raise ValueError(f"vocabulary {lm_vocab_file} lacks {missing}; TokenBatcher puts <S> and </S> around every "
                             "sentence (a model's vocabulary file has them)")

    def batch_sentences(self, sentences: list[list[str]]) -> torch.Tensor:
        _check_batch(sentences)
        max_len = max((len(s) for s in sentences), default=0) + 2
        out = torch.zeros(len(sentences), max_len, dtype=torch.long)
        v = self.vocab
        for k, sent in enumerate(sentences):
            ids = v.encode(sent, split=False)  # an unknown word is -1 when the vocabulary has no <UNK>
            if v.unk < 0 and (ids < 0).any():  # bilm-tf would give them the padding id 0
                unknown = [sent[i - 1] for i in np.flatnonzero(ids < 0)[:5]]
                raise ValueError(f"sentence {k}: {unknown} are not in the vocabulary, which has no <UNK> to map them "
                                 "to")
            out[k, : len(ids)] = torch.from_numpy(ids.astype(np.int64)) + 1
        return out
