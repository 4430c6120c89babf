"""Training data (spec §6.2, §6.3): vocabulary, sharded corpus, bilm-tf batch packing, background loading.

Semantics follow bilm-tf's ``LMDataset`` / ``BidirectionalLMDataset``:

* shards come from a glob; in training they are drawn at random without replacement and the list is reshuffled
  when used up (iteration never ends); in test mode each shard is read once, in sorted order, then iteration stops;
* a shard is loaded whole and (training) its sentences shuffled; a sentence is ``[<S>, w1..wn, </S>]``, the reverse
  dataset reverses the words first and encodes ``[</S>, wn..w1, <S>]``, with its own random stream;
* each of the B rows is a continuous stream of sentences; T slots are filled by copying ``k = min(left - 1, free)``
  tokens as inputs and the following k as targets, so ``</S>`` is only ever a target and ``<S>`` only an input;
  sentences continue in the same row in the next batch; a batch that cannot be filled is dropped and ends the data;
* a blank line is an empty sentence, ``<S>`` as an input with ``</S>`` as its target; lines end only at a
  newline, carriage return or both (``util.text_lines``), as in bilm-tf's reader.

Char ids are *inference* ids (raw + 1, see ``elmo_fast.chars``); the zero id never occurs in packed batches.
Every stream can report its position (``get_state``) after any batch and be restored from it (``set_state``), so a
resumed run continues with exactly the batches an uninterrupted run would have seen.
"""
from __future__ import annotations

import glob as _glob
import multiprocessing
import os
import pickle
import queue
import random
import signal
import socket
import threading
import warnings
from collections import Counter
from collections.abc import Iterable

import numpy as np

from ..chars import BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, Vocabulary, word_to_char_ids
from ..util import check_int, read_utf8, text_lines

SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)


class DataError(ValueError):
    """A corpus or vocabulary cannot be used for training; the message says what and where."""


# --------------------------------------------------------------------------------------------- corpus files
def resolve_shards(pattern: str | os.PathLike | list, what: str = "corpus") -> list[str]:
    """Glob pattern (or list of patterns/paths) -> sorted existing files; raises DataError if none."""
    pats = [pattern] if isinstance(pattern, (str, os.PathLike)) else list(pattern)
    files: set[str] = set()
    for p in pats:
        p = os.fspath(p)
        if os.path.isdir(p):
            raise DataError(f"{what}: '{p}' is a directory; give a file or a glob such as '{p}/*.txt'")
        hits = _glob.glob(p)
        if not hits and os.path.isfile(p):
            hits = [p]
        files.update(h for h in hits if os.path.isfile(h))
    if not files:
        raise DataError(f"{what}: no file matches {pats if len(pats) > 1 else pats[0]!s} (missing corpus?)")
    return sorted(files)


def read_shard(path: str) -> list[list[str]]:
    """One tokenized sentence a line -> token lists (a blank line gives []). Strict UTF-8 with a clear error."""
    return [line.split() for line in text_lines(read_utf8(path, "corpus shard", DataError))]


def check_corpus(files: list[str], what: str = "corpus", full_check_bytes: int = 256 << 20) -> None:
    """Fail early on an empty or non-UTF-8 corpus. Small corpora are decoded whole; large ones shard 0 + sizes."""
    total = sum(os.path.getsize(f) for f in files)
    if total == 0:
        raise DataError(f"{what}: all {len(files)} file(s) are empty ({files[0]}{', ...' if len(files) > 1 else ''})")
    to_check = files if total <= full_check_bytes else files[:1]
    n = sum(1 for f in to_check for toks in read_shard(f) if toks)
    if n == 0 and to_check is files:
        raise DataError(f"{what}: no sentences (every line of {len(files)} file(s) is blank)")


def count_tokens(files: list[str], max_lines: int | None = None) -> tuple[Counter, int, int, bool]:
    """Word counts over the shards in sorted order. Returns (counts, n_sentences, n_tokens, complete)."""
    counts: Counter = Counter()
    n_sent = n_tok = 0
    for f in files:
        for toks in read_shard(f):
            if max_lines is not None and n_sent >= max_lines:
                return counts, n_sent, n_tok, False
            counts.update(toks)
            n_sent += 1
            n_tok += len(toks)
    return counts, n_sent, n_tok, True


# --------------------------------------------------------------------------------------------- vocabulary
def build_vocab(counts: Counter, min_count: int = 1, max_size: int | None = None) -> list[str]:
    """``<S>``, ``</S>``, ``<UNK>``, then words by descending count, ties by code-point order of the word."""
    words = [w for w, c in counts.items() if c >= min_count and w not in SPECIAL_TOKENS]
    words.sort(key=lambda w: (-counts[w], w))
    if max_size is not None:
        words = words[: max(0, max_size - len(SPECIAL_TOKENS))]
    return list(SPECIAL_TOKENS) + words


def write_vocab(words: list[str], path: str | os.PathLike) -> None:
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        for w in words:
            fh.write(w + "\n")
    os.replace(tmp, path)


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    def rank(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x), dtype=np.float64)
        xs = x[order]
        # average ranks for ties
        _, start, cnt = np.unique(xs, return_index=True, return_counts=True)
        avg = start + (cnt - 1) / 2.0
        r[order] = np.repeat(avg, cnt)
        return r

    ra, rb = rank(a), rank(b)
    ra -= ra.mean()
    rb -= rb.mean()
    den = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / den) if den > 0 else 1.0


def load_training_vocab(path: str | os.PathLike, counts: Counter | None = None, min_correlation: float = 0.3,
                        min_checked: int = 20) -> Vocabulary:
    """Read a bilm-tf vocabulary for training and validate it.

    * the file must exist and be UTF-8; blank lines are words (bilm-tf); a word listed twice is an error;
    * ``<S>``, ``</S>`` and ``<UNK>`` must all be present, as the first three lines (spec §6.2);
    * with corpus ``counts``: the remaining words must be sorted by descending frequency, since the log-uniform
      sampler assumes id ~ frequency rank. A vocabulary from another corpus is fine, so the test is the Spearman
      correlation between vocabulary position and (negative) count over the words the corpus contains; below
      ``min_correlation`` is an error (alphabetical or random orders score ~0, reversed ones -1).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"vocabulary file not found: {path}")
    try:
        vocab = Vocabulary(path)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    words = vocab.words
    if not words:
        raise DataError(f"vocabulary file {path} is empty")
    first: dict[str, int] = {}
    for i, w in enumerate(words):
        if w in first:
            raise DataError(f"vocabulary {path} lists {w!r} twice (lines {first[w] + 1} and {i + 1}); a training "
                            "vocabulary needs distinct words (bilm-tf would keep the later id and never train the "
                            "earlier softmax row)")
        first[w] = i
    missing = [t for t in SPECIAL_TOKENS if t not in first]
    if missing:
        raise DataError(f"vocabulary {path} lacks the special token(s) {missing}; its first three lines must be "
                        f"<S>, </S>, <UNK> (build one with `elmo-fast train` without --vocab, which writes vocab.txt)")
    misplaced = [t for t in SPECIAL_TOKENS if first[t] > 2]
    if misplaced:
        raise DataError(f"vocabulary {path}: {misplaced} must be among the first three lines (found at lines "
                        f"{[first[t] + 1 for t in misplaced]})")
    if counts is not None:
        rest = words[3:]
        c = np.array([counts.get(w, 0) for w in rest], dtype=np.float64)
        pos = np.nonzero(c > 0)[0]
        if len(pos) >= min_checked:
            rho = _spearman(pos.astype(np.float64), -c[pos])
            if rho < min_correlation:
                # show one inversion as an example
                ex = ""
                for a, b in zip(pos[:-1], pos[1:]):
                    if c[b] > c[a]:
                        ex = (f"; e.g. {rest[b]!r} (count {int(c[b])}, line {b + 4}) comes after {rest[a]!r} "
                              f"(count {int(c[a])}, line {a + 4})")
                        break
                raise DataError(
                    f"vocabulary {path} is not sorted by descending corpus frequency (rank correlation {rho:.2f} "
                    f"< {min_correlation}){ex}. The sampled softmax assumes id ~ frequency rank; rebuild the "
                    "vocabulary (omit --vocab) or pass --no-check-vocab-order to skip this check")
    return vocab


# --------------------------------------------------------------------------------------------- streams
class TokenCache:
    """Each distinct word's vocabulary id and (L,) int32 inference char ids, computed once: a word is a row of
    ``word_ids`` and ``chars`` (tables that grow), so packing a batch is array indexing, not per-token calls."""

    def __init__(self, vocab: Vocabulary, max_chars: int):
        self.vocab, self.max_chars = vocab, max_chars
        self._rows: dict[str, int] = {}
        self.word_ids = np.zeros(1024, dtype=np.int64)
        self.chars = np.zeros((1024, max_chars), dtype=np.int32)

    def rows(self, words: list[str]) -> np.ndarray:
        """The table rows of ``words`` (int64), adding the words not seen before."""
        rows = list(map(self._rows.get, words))  # one C-level dict lookup a word
        if None in rows:
            rows = [self._rows[w] if w in self._rows else self._add(w) for w in words]
        return np.array(rows, dtype=np.int64)

    def _add(self, word: str) -> int:
        n = len(self._rows)
        if n == len(self.word_ids):  # full: double both tables
            self.word_ids = np.concatenate([self.word_ids, np.zeros_like(self.word_ids)])
            self.chars = np.concatenate([self.chars, np.zeros_like(self.chars)])
        self.word_ids[n] = self.vocab.word_to_id(word)
        self.chars[n] = word_to_char_ids(word, self.max_chars, shift=1)
        self._rows[word] = n
        return n


class SentenceSource:
    """Sentences from shards, bilm-tf order (training: random shard without replacement, shuffled sentences)."""

    def __init__(self, shards: list[str], reverse: bool, test: bool, shuffle_on_load: bool, seed: str | int):
        if not shards:
            raise DataError("no shards")
        self.shards = list(shards)
        self.reverse = reverse
        self.test = test
        self.shuffle = shuffle_on_load
        self.rng = random.Random(seed)
        self.order: list[int] = list(range(len(shards))) if test else []
        self.order_pos = -1
        self.shard_rng_state = None
        self.sent_pos = 0
        self.sentences: list[list[str]] | None = None

    def _load(self) -> None:
        self.sentences = read_shard(self.shards[self.order[self.order_pos]])
        if self.shuffle:
            self.rng.shuffle(self.sentences)

    def _next_shard(self) -> None:
        self.order_pos += 1
        if self.order_pos >= len(self.order):
            if self.test:
                raise StopIteration
            self.order = list(range(len(self.shards)))
            self.rng.shuffle(self.order)
            self.order_pos = 0
        self.shard_rng_state = self.rng.getstate()
        self._load()
        self.sent_pos = 0

    def next(self) -> list[str]:
        empty_loads = 0
        while self.sentences is None or self.sent_pos >= len(self.sentences):
            self._next_shard()
            if not self.sentences:
                empty_loads += 1
                if empty_loads > 2 * len(self.shards):
                    raise DataError(f"corpus has no sentences ({len(self.shards)} shard(s), all blank)")
        toks = self.sentences[self.sent_pos]
        self.sent_pos += 1
        if self.reverse:
            return [EOS_TOKEN, *reversed(toks), BOS_TOKEN]
        return [BOS_TOKEN, *toks, EOS_TOKEN]

    def get_state(self) -> dict:
        return {"order": list(self.order), "order_pos": self.order_pos, "shard_rng_state": self.shard_rng_state,
                "sent_pos": self.sent_pos, "loaded": self.sentences is not None, "rng_state": self.rng.getstate()}

    def set_state(self, st: dict) -> None:
        self.order = list(st["order"])
        self.order_pos = st["order_pos"]
        self.sent_pos = st["sent_pos"]
        self.shard_rng_state = st["shard_rng_state"]
        if st["loaded"]:
            # replay the shard's shuffle from the state just before it: the rng ends where the original run had it
            self.rng.setstate(st["shard_rng_state"])
            self._load()
        else:
            self.sentences = None
            self.rng.setstate(st["rng_state"])


class LMStream:
    """One direction of bilm-tf's ``LMDataset``: packs sentences into (B, T) batches, rows carried over."""

    def __init__(self, shards: list[str], vocab: Vocabulary, batch_size: int, unroll_steps: int, max_chars: int,
                 reverse: bool = False, test: bool = False, shuffle_on_load: bool | None = None,
                 seed: str | int = 0, token_cache: TokenCache | None = None):
        # every packer passes here (the trainer's, its evaluation's, compat's iter_batches): 0 rows or 0 steps would
        # make empty batches forever (test data never runs out), a negative number a raw numpy error
        batch_size = check_int(batch_size, "batch_size", 1)
        unroll_steps = check_int(unroll_steps, "unroll_steps (bilm-tf's num_steps)", 1)
        self.source = SentenceSource(shards, reverse, test, (not test) if shuffle_on_load is None else shuffle_on_load,
                                     seed)
        self.B, self.T = batch_size, unroll_steps
        self.tokens = token_cache or TokenCache(vocab, max_chars)
        self.rows: list[list[str] | None] = [None] * batch_size  # the row's current sentence (words)
        self.row_tokens: list[np.ndarray | None] = [None] * batch_size  # its words' TokenCache rows
        self.offset = [0] * batch_size
        self.done = False

    def next_batch(self) -> dict[str, np.ndarray]:
        """The next (B, T) batch; raises StopIteration when a batch cannot be filled (it is dropped)."""
        return self.next_batch_and_inputs()[0]

    def next_batch_and_inputs(self, chars: bool = True) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """``next_batch``, and its inputs as rows of the ``TokenCache`` (B, T) int64; without ``tokens_characters``
        when not ``chars`` (a caller that takes the distinct tokens instead)."""
        if self.done:
            raise StopIteration
        B, T = self.B, self.T
        inputs = np.zeros((B, T), dtype=np.int64)  # TokenCache rows of the inputs and of the targets
        targets = np.zeros((B, T), dtype=np.int64)
        for i in range(B):
            t = 0
            while t < T:
                rows = self.row_tokens[i]
                if rows is None or len(rows) - self.offset[i] <= 1:
                    try:
                        w = self.source.next()
                    except StopIteration:
                        self.done = True
                        raise
                    self.rows[i], self.row_tokens[i], self.offset[i] = w, self.tokens.rows(w), 0
                    rows = self.row_tokens[i]
                o = self.offset[i]
                k = min(len(rows) - o - 1, T - t)
                inputs[i, t : t + k] = rows[o : o + k]
                targets[i, t : t + k] = rows[o + 1 : o + 1 + k]
                self.offset[i] = o + k
                t += k
        ids = self.tokens.word_ids
        out = {"token_ids": ids[inputs], "next_token_id": ids[targets]}
        if chars:
            out["tokens_characters"] = self.tokens.chars[inputs]
        return out, inputs

    def get_state(self) -> dict:
        return {"source": self.source.get_state(), "rows": list(self.rows), "offset": list(self.offset),
                "done": self.done}

    def set_state(self, st: dict) -> None:
        self.source.set_state(st["source"])
        self.rows = [list(r) if r is not None else None for r in st["rows"]]
        self.row_tokens = [self.tokens.rows(r) if r is not None else None for r in self.rows]
        self.offset = list(st["offset"])
        self.done = st["done"]


class BidirectionalStream:
    """Forward and reverse ``LMStream`` over the same shards with independent shuffling (bilm-tf semantics)."""

    def __init__(self, shards: list[str], vocab: Vocabulary, batch_size: int, unroll_steps: int, max_chars: int,
                 test: bool = False, shuffle_on_load: bool | None = None, seed: str | int = 0):
        cache = TokenCache(vocab, max_chars)
        self.fwd = LMStream(shards, vocab, batch_size, unroll_steps, max_chars, False, test, shuffle_on_load,
                            f"{seed}/forward", cache)
        self.rev = LMStream(shards, vocab, batch_size, unroll_steps, max_chars, True, test, shuffle_on_load,
                            f"{seed}/reverse", cache)

    def next_batch(self) -> dict[str, np.ndarray]:
        return self._next()[0]

    def _next(self, chars: bool = True) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        f, fin = self.fwd.next_batch_and_inputs(chars)
        r, rin = self.rev.next_batch_and_inputs(chars)
        out = dict(f)
        out.update({k + "_reverse": v for k, v in r.items()})
        return out, fin, rin

    def next_batch_and_tokens(self, chars: bool = True) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """``next_batch``, and its distinct input tokens, the forward direction's then the reverse one's: rows (U, L)
        char ids, int32, and inverse (2·B·T,) int64, with ``rows[inverse]`` its ``tokens_characters`` then its
        ``tokens_characters_reverse``, flattened. A word is a row of the directions' shared ``TokenCache``, so this is
        a sort of 2·B·T integers, then one of the U distinct words' rows by content. The trainer's char batches carry
        them (``TowerStream``): the step's token encoder runs each distinct token once without deduplicating on the
        device, where ``torch.unique(dim=0)`` waits for its sort and its count (6 host syncs a step and a 1.4 ms sort
        on the H200, 2026-11-27). The rows are in the order of their char ids (lexicographic), as torch.unique's, not
        of the cache, whose rows depend on the order the words came in: a resumed run, whose cache is rebuilt, encodes
        them in the same order (the char embedding's gradient sums them in it); words that share their char ids
        (truncated long words) are one row. Without ``chars`` the batch leaves out its char ids (``TowerStream``:
        the distinct tokens replace them)."""
        out, fin, rin = self._next(chars)
        words, inverse = np.unique(np.concatenate([fin.reshape(-1), rin.reshape(-1)]), return_inverse=True)
        rows, row_of_word = np.unique(self.fwd.tokens.chars[words], axis=0, return_inverse=True)
        return out, rows, row_of_word.reshape(-1)[inverse.reshape(-1)].astype(np.int64)

    def get_state(self) -> dict:
        return {"fwd": self.fwd.get_state(), "rev": self.rev.get_state()}

    def set_state(self, st: dict) -> None:
        self.fwd.set_state(st["fwd"])
        self.rev.set_state(st["rev"])

    def __iter__(self):
        while True:
            try:
                yield self.next_batch()
            except StopIteration:
                return


_END = object()


class _ReadAhead:
    """What both loaders share: the bounded queue of batches made ahead, and how a batch goes into it."""

    def __init__(self, queue_size: int):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._finished = False

    def _put(self, item, stop: threading.Event) -> bool:
        """Queue ``item``, waiting for room; False (not queued) once ``stop`` is set."""
        while not stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def ready(self) -> int:
        """Items in the read-ahead queue: batches made and not handed out yet (and the end-of-data or error mark once
        the worker has stopped); 0: the next step waits for data."""
        return self._q.qsize()

    def __iter__(self):
        return self


class BackgroundLoader(_ReadAhead):
    """Runs ``stream.next_batch`` in a daemon thread with a bounded queue.

    ``position`` is the stream state *after the last batch handed out* (not after the read-ahead), so a checkpoint
    taken between steps resumes exactly. Errors in the worker are re-raised in the consumer.
    """

    def __init__(self, stream, queue_size: int = 4, state: dict | None = None):
        self.stream = stream
        if state is not None:
            stream.set_state(state)
        self.position = stream.get_state()
        super().__init__(queue_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="elmo-fast-data", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    b = self.stream.next_batch()
                except StopIteration:
                    self._put(_END, self._stop)
                    return
                if not self._put((b, self.stream.get_state()), self._stop):
                    return
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            self._put(exc, self._stop)

    def __next__(self) -> dict:
        if self._finished:
            raise StopIteration
        item = self._q.get()
        if item is _END:
            self._finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        batch, self.position = item
        return batch

    def close(self) -> None:
        self._stop.set()
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=5)


class ProcessLoader(_ReadAhead):
    """``BackgroundLoader`` with the stream in a worker process: ``stream.next_batch`` is Python (9.4-10.3 ms for a
    384-row batch of both directions on a 2-core Xeon), and in a thread it holds the interpreter lock that the
    training step's own host work needs, so the two add up (a stand-in step of 9.7-9.9 ms took 20.1-21.4 ms beside
    the thread, 15.2-20.6 ms beside this process even on those 2 cores: bench/results/data.md). The trainer uses it
    on a GPU. The same batches and positions as the thread, in the same order.

    The process is forked where the platform can (Linux, as torch's DataLoader workers are: no re-import of the
    user's ``__main__``, nothing to pickle on the way in; the worker touches no CUDA and runs one intra-op thread),
    else spawned with the stream pickled. Batches come back through a socket pair (arrays and CPU tensors, a few
    MB at the original sizes, with the stream state after each); a thread here receives each in one wait without
    the interpreter lock (``_recv_exact``) into a queue of ``queue_size``, and the socket's back-pressure holds the
    worker there. The worker holds the only other end, so its death is an end of file here (an error in the
    consumer, not a hang), and this process's death a broken connection there (it exits). ``prepare`` (optional)
    runs on each batch in the receiving thread, in this process (the trainer pins the tensors there: pinned memory
    belongs to the process that copies it).
    """

    def __init__(self, stream, queue_size: int = 4, state: dict | None = None, prepare=None):
        self._position = state if state is not None else stream.get_state()
        self._position_blob = None
        self.prepare = prepare
        fork = "fork" in multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if fork else "spawn")
        self._reader, writer = socket.socketpair()
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_loader_process, name="elmo-fast-data", daemon=True,
                                 args=(stream, state, writer, self._reader if fork else None, self._stop))
        with warnings.catch_warnings():
            # Python >= 3.12 warns at any fork of a process with threads; this child runs only the stream's Python
            # and numpy code and one-thread torch CPU ops, as a DataLoader worker does
            warnings.filterwarnings("ignore", message=r".*multi-threaded, use of fork\(\) may lead to deadlocks",
                                    category=DeprecationWarning)
            self._proc.start()
        writer.close()  # the worker's is now the only writing end
        super().__init__(queue_size)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="elmo-fast-data-receiver", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while True:
            try:
                item = _recv_message(self._reader)
                if item[0] == "batch" and self.prepare is not None:  # here, off the consumer's path
                    item = ("batch", self.prepare(item[1]), item[2])
            except (EOFError, OSError):
                item = ("died",)
            except Exception as exc:  # noqa: BLE001 - a failed prepare: the consumer's error
                item = ("error", exc)
            if not self._put(item, self._closing) or item[0] != "batch":
                return

    @property
    def position(self) -> dict:
        """The stream state after the last batch handed out. It travels pickled and is unpickled only here, when
        asked for (a checkpoint): the rows' sentences of a 384-row state took 0.9 ms to unpickle, every step."""
        if self._position_blob is not None:
            self._position, self._position_blob = pickle.loads(self._position_blob), None
        return self._position

    def __next__(self) -> dict:
        if self._finished:
            raise StopIteration
        kind, *item = self._q.get()
        if kind == "batch":
            batch, self._position_blob = item
            return batch
        self._finished = True
        if kind == "end":
            raise StopIteration
        if kind == "error":
            raise item[0]
        self._proc.join(timeout=1)
        raise RuntimeError(f"the data loader process (pid {self._proc.pid}) died without a word (exit code "
                           f"{self._proc.exitcode}): killed, or out of memory?")

    def close(self) -> None:
        self._closing.set()
        self._stop.set()
        self._proc.join(timeout=1)
        if self._proc.is_alive():  # blocked sending a batch nobody will read
            self._proc.terminate()
            self._proc.join(timeout=5)
        self._thread.join(timeout=5)  # the worker's end is closed: the receiver has its end of file
        self._reader.close()


def _loader_process(stream, state, writer, reader, stop) -> None:
    """ProcessLoader's worker: sends ("batch", batch, pickled state) until stopped or the data ends ("end"), or
    ("error", exc). Ctrl-C is the parent's to handle (the trainer checkpoints, then stops this process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if reader is not None:
        reader.close()  # a forked copy of the parent's end: with it a dead parent would not break the socket
    try:
        import torch

        torch.set_num_threads(1)  # the sampler's few ops: no OpenMP team beside the trainer's
        if state is not None:
            stream.set_state(state)
        while not stop.is_set():
            try:
                item = ("batch", stream.next_batch(), pickle.dumps(stream.get_state(), pickle.HIGHEST_PROTOCOL))
            except StopIteration:
                _send_message(writer, ("end",))
                return
            _send_message(writer, item)
    except (BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        return  # the consumer is gone
    except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
            exc = RuntimeError(f"the data loader process failed: {exc!r}")
        try:
            _send_message(writer, ("error", exc))
        except OSError:
            pass


def _send_message(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    sock.sendall(len(data).to_bytes(8, "little"))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    """``n`` bytes, received by as few calls as the socket allows: each call waits for all that is left without the
    interpreter lock (MSG_WAITALL). A pipe's reader takes a batch of a few MB in 64 KB chunks, taking the lock
    again for each, and a step busy in Python starved it: 7 batches in 2 s against 72 while the step slept
    (2026-11-26, this 2-core Xeon)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise EOFError("the data loader process closed its socket")
        got += k
    return buf


def _recv_message(sock: socket.socket):
    return pickle.loads(_recv_exact(sock, int.from_bytes(_recv_exact(sock, 8), "little")))


def iter_sentences(files: Iterable[str]):
    for f in files:
        yield from read_shard(f)
