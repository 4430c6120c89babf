"""Pretraining: data pipeline (hand-worked bilm-tf packing), learning, exact resume after SIGKILL, weight dump,
clear errors. All on CPU with the reference backend."""
from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import h5py
import numpy as np
import pytest
import torch

from conftest import requires_triton, triton_device
from elmo_fast.chars import Vocabulary, word_to_char_ids
from elmo_fast.training import data as D
from elmo_fast.training import trainer as trainer_mod
from elmo_fast.training.cli import dump_weights, main as cli_main
from elmo_fast.training.configs import ConfigError, TrainConfig, check_memory, original, tiny
from elmo_fast.training.trainer import Trainer, latest_checkpoint, load_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models: one intra-op thread is fastest and immune to oversubscription on a busy 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _write(path, text: str | bytes):
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(path, mode, **({} if isinstance(text, bytes) else {"encoding": "utf-8"})) as fh:
        fh.write(text)
    return str(path)


# ------------------------------------------------------------------------------------------------ data
WORKED = "the cat sat\na dog\n\nhi\nx y z w\n"


def _worked_vocab():
    # built by hand: specials, then by descending count, ties by code point
    return ["<S>", "</S>", "<UNK>", "a", "cat", "dog", "hi", "sat", "the", "w", "x", "y", "z"]


def test_vocab_builder_order_and_ties(tmp_path):
    f = _write(tmp_path / "c.txt", "b a c\na b\nb z\n<S> y\n")
    counts, n_sent, n_tok, complete = D.count_tokens([f])
    assert (n_sent, n_tok, complete) == (4, 9, True)
    words = D.build_vocab(counts)
    # b:3, a:2, then count-1 ties in code-point order; a literal <S> in the text is not duplicated
    assert words == ["<S>", "</S>", "<UNK>", "b", "a", "c", "y", "z"]
    assert D.build_vocab(counts, min_count=2) == ["<S>", "</S>", "<UNK>", "b", "a"]
    assert D.build_vocab(counts, max_size=5) == ["<S>", "</S>", "<UNK>", "b", "a"]
    D.write_vocab(words, tmp_path / "v.txt")
    v = D.load_training_vocab(tmp_path / "v.txt", counts)
    assert v.words == words


def test_batcher_hand_worked_example(tmp_path):
    """B=2 rows, T=3 steps, test mode (no shuffling), worked out by hand from the rules of spec §6.3:

    sentences: s1 = <S> the cat sat </S>, s2 = <S> a dog </S>, s3 = <S> </S> (the blank line, as bilm-tf),
    s4 = <S> hi </S>, s5 = <S> x y z w </S>.
    batch 1  row 0: s1 -> k=min(5-1, 3)=3: in [<S> the cat] tgt [the cat sat]; s1 has "sat </S>" left
             row 1: s2 -> k=3:             in [<S> a dog]   tgt [a dog </S>]; s2 has "</S>" left (<= 1 token)
    batch 2  row 0: rest of s1 k=1: in [sat] tgt [</S>]; s3 k=1: in [<S>] tgt [</S>]; s4 k=1: in [<S>] tgt [hi]
             row 1: s2 is used up (</S> is target only) -> s5 k=3: in [<S> x y] tgt [x y z]
    batch 3  row 0: rest of s4 k=1, then no sentence is left -> the partial batch is dropped, iteration ends.
    The reverse stream packs [</S> sat cat the <S>], [</S> dog a <S>], [</S> <S>], [</S> hi <S>], [</S> w z y x <S>].
    """
    f = _write(tmp_path / "s.txt", WORKED)
    vocab = Vocabulary(words=_worked_vocab())
    stream = D.BidirectionalStream([f], vocab, batch_size=2, unroll_steps=3, max_chars=50, test=True)
    batches = list(stream)
    assert len(batches) == 2

    def w2i(rows):
        return [[vocab.word_to_id(w) for w in r.split()] for r in rows]

    b1, b2 = batches
    assert b1["token_ids"].tolist() == w2i(["<S> the cat", "<S> a dog"])
    assert b1["next_token_id"].tolist() == w2i(["the cat sat", "a dog </S>"])
    assert b2["token_ids"].tolist() == w2i(["sat <S> <S>", "<S> x y"])
    assert b2["next_token_id"].tolist() == w2i(["</S> </S> hi", "x y z"])
    assert b1["token_ids_reverse"].tolist() == w2i(["</S> sat cat", "</S> dog a"])
    assert b1["next_token_id_reverse"].tolist() == w2i(["sat cat the", "dog a <S>"])
    assert b2["token_ids_reverse"].tolist() == w2i(["the </S> </S>", "</S> w z"])
    assert b2["next_token_id_reverse"].tolist() == w2i(["<S> <S> hi", "w z y"])
    # chars: inference ids of the *input* tokens
    assert b2["tokens_characters"].shape == (2, 3, 50)
    assert b2["tokens_characters"][0, 0].tolist() == word_to_char_ids("sat")
    assert b2["tokens_characters"][0, 1].tolist() == word_to_char_ids("<S>")
    assert b1["tokens_characters_reverse"][0, 0].tolist() == word_to_char_ids("</S>")
    assert int(b1["tokens_characters"].min()) > 0


def test_only_newlines_end_corpus_lines(tmp_path):
    """bilm-tf reads shards with readlines(): \\r and \\r\\n end a line, \\f or U+2028 are spaces inside one."""
    f = _write(tmp_path / "s.txt", "a b\r\nc\rd\u2028e\x0cf\n\n")
    assert D.read_shard(f) == [["a", "b"], ["c"], ["d", "e", "f"], []]


def test_oov_words_keep_their_chars(tmp_path):
    f = _write(tmp_path / "s.txt", "zebra a\n")
    vocab = Vocabulary(words=["<S>", "</S>", "<UNK>", "a"])
    b = D.LMStream([f], vocab, 1, 3, 50, test=True).next_batch()
    assert b["token_ids"].tolist() == [[0, 2, 3]]  # zebra -> <UNK> as an id ...
    assert b["tokens_characters"][0, 1].tolist() == word_to_char_ids("zebra")  # ... but its real characters


def test_every_packed_position_holds_its_words_id_and_chars(tmp_path):
    """The token table grows past its first size (1024 words); every batch position agrees with the word."""
    rng = random.Random(5)
    words = [f"w{i}" for i in range(1500)] + ["naïve", "日本語"]
    f = _write(tmp_path / "s.txt", "\n".join(" ".join(rng.choices(words, k=rng.randint(0, 12)))
                                            for _ in range(900)) + "\n")
    vocab = Vocabulary(words=["<S>", "</S>", "<UNK>"] + words[::2])  # every other word is unknown
    for b in D.BidirectionalStream([f], vocab, batch_size=4, unroll_steps=9, max_chars=50, test=True):
        for suffix in ("", "_reverse"):
            ids, chars = b["token_ids" + suffix], b["tokens_characters" + suffix]
            assert ids.dtype == np.int64 and chars.dtype == np.int32 and chars.shape == (*ids.shape, 50)
            for i, t in np.ndindex(ids.shape):
                row = chars[i, t].tolist()  # BOW 259, the UTF-8 bytes + 1 (or 257/258 for <S>/</S>), EOW 260, pad
                word = ("<S>", "</S>")[row[1] - 257] if row[1] in (257, 258) else \
                    bytes(c - 1 for c in row[1:row.index(260)]).decode()
                assert row == word_to_char_ids(word), (i, t)
                assert ids[i, t] == vocab.word_to_id(word), (word, i, t)


def _corpus(tmp_path, n_shards=3, n_sent=60, seed=0):
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(30)]
    paths = []
    for s in range(n_shards):
        lines = [" ".join(rng.choices(words, k=rng.randint(1, 9))) for _ in range(n_sent)]
        paths.append(_write(tmp_path / f"shard-{s}.txt", "\n".join(lines) + "\n"))
    return paths


def test_training_stream_never_ends_and_resumes_exactly(tmp_path):
    files = _corpus(tmp_path)
    counts, *_ = D.count_tokens(files)
    vocab = Vocabulary(words=D.build_vocab(counts))
    a = D.BidirectionalStream(files, vocab, 3, 7, 50, seed="s")
    n_tokens = sum(counts.values())
    for _ in range(3 * n_tokens // 21):  # well past one pass over all shards: reshuffles and continues
        a.next_batch()
    st = a.get_state()
    expect = [a.next_batch() for _ in range(25)]
    b = D.BidirectionalStream(files, vocab, 3, 7, 50, seed="s")
    b.set_state(st)
    for e in expect:
        g = b.next_batch()
        for k in e:
            np.testing.assert_array_equal(g[k], e[k])
    # the reverse stream has its own shuffling: forward and reverse rows are different text
    assert not np.array_equal(expect[0]["token_ids"], expect[0]["token_ids_reverse"][:, ::-1])


@pytest.mark.parametrize("kind", ["BackgroundLoader", "ProcessLoader", "ProcessLoader-spawn"])
def test_loader_position_is_the_consumed_one(tmp_path, kind, monkeypatch):
    """Thread or process (forked, or spawned where a platform cannot fork): the batches of the stream in order,
    and a position from which a new loader goes on with exactly the next batch (the worker has read ahead by
    then)."""
    if kind.endswith("-spawn"):
        monkeypatch.setattr(D.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    Loader = getattr(D, kind.split("-")[0])
    files = _corpus(tmp_path)
    counts, *_ = D.count_tokens(files)
    vocab = Vocabulary(words=D.build_vocab(counts))
    ref = D.BidirectionalStream(files, vocab, 2, 5, 50, seed=1)
    expect = [ref.next_batch() for _ in range(12)]
    loader = Loader(D.BidirectionalStream(files, vocab, 2, 5, 50, seed=1), queue_size=3)
    if kind != "BackgroundLoader":
        assert type(loader._proc).__name__ == ("SpawnProcess" if kind.endswith("-spawn") else "ForkProcess")
    for i in range(5):
        np.testing.assert_array_equal(next(loader)["token_ids"], expect[i]["token_ids"])
    deadline = time.time() + 30
    while loader.ready() < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert loader.ready() == 3  # the worker has read ahead: the queue is full, and holds no more than its size
    pos = loader.position
    loader.close()
    again = Loader(D.BidirectionalStream(files, vocab, 2, 5, 50, seed=1), queue_size=3, state=pos)
    for i in range(5, 12):
        b = next(again)
        np.testing.assert_array_equal(b["token_ids"], expect[i]["token_ids"])
        np.testing.assert_array_equal(b["next_token_id_reverse"], expect[i]["next_token_id_reverse"])
    again.close()


def test_process_loader_ends_errs_and_notices_a_dead_worker(tmp_path):
    """The data's end is StopIteration, a worker's exception is raised in the consumer with its type and text,
    a killed worker is an error naming it (not a hang), and ``prepare`` runs on each batch handed out."""
    files = _corpus(tmp_path, n_shards=2, n_sent=10)
    counts, *_ = D.count_tokens(files)
    vocab = Vocabulary(words=D.build_vocab(counts))
    n = 0
    loader = D.ProcessLoader(D.LMStream(files, vocab, 1, 1, 50, test=True), prepare=lambda b: {**b, "seen": 1})
    for b in loader:
        assert b["seen"] == 1
        n += 1
    loader.close()
    assert n == sum(counts.values()) + 2 * 20 - 20  # every token but each sentence's last is an input once

    class Broken(D.LMStream):
        def next_batch(self):
            raise D.DataError("shard 3 is not UTF-8")

    loader = D.ProcessLoader(Broken(files, vocab, 1, 1, 50))
    with pytest.raises(D.DataError, match="shard 3 is not UTF-8"):
        next(loader)
    loader.close()

    loader = D.ProcessLoader(D.LMStream(files, vocab, 1, 1, 50), queue_size=1)
    next(loader)
    loader._proc.kill()
    loader._proc.join()
    with pytest.raises(RuntimeError, match=r"data loader process \(pid \d+\) died"):
        for _ in range(100_000):  # what it had sent before it died comes first (a socket buffer of tiny batches)
            next(loader)
    loader.close()


def test_test_mode_reads_each_shard_once(tmp_path):
    files = _corpus(tmp_path, n_shards=2, n_sent=10)
    counts, _, n_tok, _ = D.count_tokens(files)
    vocab = Vocabulary(words=D.build_vocab(counts))
    total = 0
    s = D.LMStream(files, vocab, 1, 1, 50, test=True)
    while True:
        try:
            s.next_batch()
        except StopIteration:
            break
        total += 1
    assert total == n_tok + 20  # each sentence gives n + 1 predictions, one row, no partial batch


# ------------------------------------------------------------------------------------------------ errors
def test_bad_vocabularies(tmp_path):
    f = _write(tmp_path / "c.txt", "the cat the dog the end\n" * 3 + "a b c d e f g h i j k l m n o p q r s t u v\n")
    counts, *_ = D.count_tokens([f])
    _write(tmp_path / "nospecial.txt", "the\ncat\n")
    with pytest.raises(D.DataError, match="lacks the special token"):
        D.load_training_vocab(tmp_path / "nospecial.txt", counts)
    _write(tmp_path / "late.txt", "<S>\n</S>\nthe\n<UNK>\n")
    with pytest.raises(D.DataError, match="first three lines"):
        D.load_training_vocab(tmp_path / "late.txt")
    words = D.build_vocab(counts)
    _write(tmp_path / "rev.txt", "\n".join(words[:3] + words[3:][::-1]) + "\n")
    with pytest.raises(D.DataError, match="not sorted by descending corpus frequency"):
        D.load_training_vocab(tmp_path / "rev.txt", counts, min_checked=5)
    with pytest.raises(D.DataError, match="not found"):
        D.load_training_vocab(tmp_path / "missing.txt")


def test_bad_corpora(tmp_path):
    with pytest.raises(D.DataError, match="no file matches"):
        D.resolve_shards(str(tmp_path / "nothing-*.txt"))
    e = _write(tmp_path / "empty.txt", "")
    with pytest.raises(D.DataError, match="empty"):
        D.check_corpus([e])
    b = _write(tmp_path / "blank.txt", "\n  \n\n")
    with pytest.raises(D.DataError, match="no sentences"):
        D.check_corpus([b])
    bad = _write(tmp_path / "latin1.txt", "ok line\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(D.DataError, match=r"line 2 is not valid UTF-8"):
        D.check_corpus([bad])


def test_cli_reports_errors_clearly(tmp_path, capsys):
    bad = _write(tmp_path / "latin1.txt", "caf\xe9\n".encode("latin-1"))
    rc = cli_main(["train", "--save-dir", str(tmp_path / "o"), "--config", "tiny", "--corpus", bad])
    assert rc == 2
    assert "not valid UTF-8" in capsys.readouterr().err
    rc = cli_main(["train", "--save-dir", str(tmp_path / "o"), "--config", "tiny", "--corpus",
                   str(tmp_path / "none*.txt")])
    assert rc == 2
    assert "no file matches" in capsys.readouterr().err
    good = _write(tmp_path / "good.txt", "a b c\n")
    _write(tmp_path / "v.txt", "a\nb\nc\n")
    rc = cli_main(["train", "--save-dir", str(tmp_path / "o"), "--config", "tiny", "--corpus", good,
                   "--vocab", str(tmp_path / "v.txt")])
    assert rc == 2
    assert "lacks the special token" in capsys.readouterr().err
    rc = cli_main(["train", "--save-dir", str(tmp_path / "o"), "--config", "original", "--corpus", good,
                   "--batch-size", "1000000", "--device", "cpu"])
    assert rc == 2
    assert "GiB" in capsys.readouterr().err


def test_token_width_any_from_3_that_holds_the_widest_filter():
    cfg = tiny()
    cfg.max_characters_per_token = 4  # tiny's widest filter
    cfg.validate()
    cfg.max_characters_per_token = 3
    with pytest.raises(ConfigError, match="a filter is wider than max_characters_per_token"):
        cfg.validate()
    cfg.filters = [[1, 4]]
    cfg.max_characters_per_token = 2
    with pytest.raises(ConfigError, match="at least 3 .begin-of-word, a character, end-of-word., got 2"):
        cfg.validate()


def test_original_preset_is_bilm_tf_s_three_gpus_of_128_rows():
    """bin/train_elmo.py: 3 GPUs x 128 rows x 20 steps over 768,648,884 tokens, 10 epochs = 1,000,840 steps; as 3
    towers in one process, or spread over torchrun's processes (1 and 3 share them; 2 cannot, and says so). On the
    CPU the towers run one after the other, so the memory estimate holds one tower's activations (fused on a GPU:
    tests/test_fused_towers.py)."""
    from elmo_fast.training.configs import estimate_memory, original_towers
    from elmo_fast.training.trainer import total_steps

    cfg = original()
    assert (cfg.towers, cfg.batch_size, cfg.unroll_steps) == (3, 128, 20)
    assert total_steps(cfg, cfg.towers) == 1_000_840
    assert original_towers(1) == (3, None) and original_towers(3) == (1, None)
    towers, warning = original_towers(2)
    assert towers == 1 and "cannot share them, so this run trains 2 towers (256 rows a step" in warning
    one = estimate_memory(TrainConfig.from_dict({**cfg.to_dict(), "towers": 1}), 793471, cuda=False)
    assert estimate_memory(cfg, 793471, cuda=False)["activations"] == one["activations"]


@pytest.mark.parametrize("world_size, towers", [(1, 3), (3, 1), (2, 1), (4, 1)])
def test_original_preset_spreads_its_towers_over_torchrun_processes(tmp_path, monkeypatch, world_size, towers):
    """The CLI's prepare on rank 0 of `world_size` processes (no process group: the barriers are stubbed): 3 towers
    in one process, one each in 3; a world size that 3 does not divide trains one each and warns; --towers wins."""
    import argparse
    import warnings

    from elmo_fast.training import cli
    from elmo_fast.training.trainer import DistInfo

    monkeypatch.setattr(cli, "_barrier", lambda dinfo: None)
    corpus = _write(tmp_path / "c.txt", "a b c\nb c a\n")
    vocab = _write(tmp_path / "v.txt", "<S>\n</S>\n<UNK>\na\nb\nc\n")

    def prepared(*extra):
        p = argparse.ArgumentParser()
        cli.add_train_arguments(p)
        args = p.parse_args(["--save-dir", str(tmp_path / f"run{len(list(tmp_path.iterdir()))}"), "--config",
                             "original", "--corpus", corpus, "--vocab", vocab, "--device", "cpu", *extra])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = cli.prepare(args, DistInfo(rank=0, world_size=world_size))[0]
        return cfg, [str(w.message) for w in caught if "towers of 128 rows" in str(w.message)]

    cfg, said = prepared()
    assert cfg.towers == towers
    assert bool(said) == (3 % world_size != 0), said
    assert prepared("--towers", "2")[0].towers == 2


def test_memory_estimate_rejects_what_does_not_fit():
    cfg = original()
    with pytest.raises(ConfigError, match="needs about .* GiB"):
        check_memory(cfg, 793471, "cpu", fraction=1e-6)
    cfg.batch_size = 10**6
    with pytest.raises(ConfigError, match="--batch-size"):
        check_memory(cfg, 793471, "cpu")
    check_memory(tiny(), 100, "cpu")


# ------------------------------------------------------------------------------------------------ training
def _grammar_corpus(tmp_path, n_train=1500, n_held=150, seed=0):
    rng = random.Random(seed)
    det = ["the", "a"]
    adj = ["big", "small", "red", "old"]
    noun = ["cat", "dog", "bird", "fish", "man"]
    verb = ["sees", "likes", "eats", "finds"]

    def sent():
        s = [rng.choice(det), rng.choice(adj), rng.choice(noun), rng.choice(verb), rng.choice(det), rng.choice(noun)]
        return " ".join(s + (["today", "."] if rng.random() < 0.5 else ["."]))

    d = tmp_path / "corpus"
    d.mkdir()
    tr = [sent() for _ in range(n_train)]
    for i in range(2):
        _write(d / f"train-{i}.txt", "\n".join(tr[i::2]) + "\n")
    _write(d / "heldout.txt", "\n".join(sent() for _ in range(n_held)) + "\n")
    return str(d / "train-*.txt"), str(d / "heldout.txt")


def _trainer(tmp_path, train_glob, heldout=None, **over):
    files = D.resolve_shards(train_glob)
    counts, _, n_tok, _ = D.count_tokens(files)
    vocab = Vocabulary(words=D.build_vocab(counts))
    cfg = tiny()
    cfg.backend = "reference"
    cfg.n_train_tokens = n_tok
    cfg.n_negative_samples_batch = 8
    for k, v in over.items():
        setattr(cfg, k, v)
    held = D.resolve_shards(heldout) if heldout else None
    return Trainer(cfg, vocab, files, held, str(tmp_path / "run")), counts


def test_data_worker_process_trains_as_the_thread_does(tmp_path):
    """data_worker 'process' (the default on a GPU) and 'thread': the same losses step by step and the same data
    position to checkpoint."""
    train_glob, _ = _grammar_corpus(tmp_path)
    losses, positions = {}, {}
    for worker in ("thread", "process"):
        tr, _ = _trainer(tmp_path / worker, train_glob, batch_size=4, unroll_steps=6, data_worker=worker)
        try:
            assert type(tr.towers[0].loader).__name__ == {"thread": "BackgroundLoader",
                                                          "process": "ProcessLoader"}[worker]
            losses[worker] = [float(tr.train_step()) for _ in range(4)]
            positions[worker] = str(tr.towers[0].state())
        finally:
            tr.close()
    assert losses["process"] == losses["thread"]
    assert positions["process"] == positions["thread"]


def test_log_records_the_share_of_time_spent_waiting_for_data(tmp_path, monkeypatch):
    """Each train record says which share of the time since the last one the step waited for batches: near all of it
    when making a batch takes far longer than a step (here 0.2 s against a few ms), little when the worker has the
    next batch ready (here a 0.1 s pause after each step, ``sleep_per_step``, lets it read ahead)."""
    from elmo_fast.training.trainer import train_loop

    train_glob, _ = _grammar_corpus(tmp_path)
    shares, real = {}, D.BidirectionalStream.next_batch_and_tokens  # what the trainer's stream calls
    for case, delay, pause in (("slow data", 0.2, 0.0), ("data ready", 0.0, 0.1)):
        def next_batch(self, chars=True, delay=delay):
            time.sleep(delay)
            return real(self, chars)

        monkeypatch.setattr(D.BidirectionalStream, "next_batch_and_tokens", next_batch)
        tr, _ = _trainer(tmp_path / case.replace(" ", "_"), train_glob, batch_size=2, unroll_steps=3, max_steps=6,
                         log_every=3, queue_size=1, data_worker="thread", checkpoint_every=100, eval_every=None,
                         sleep_per_step=pause)
        recs = []
        train_loop(tr, recs.append, progress=False)
        shares[case] = [r["data_wait"] for r in recs if r["event"] == "train"]
    # the first record also covers the start of the run (the worker's first batch): its share fell to 0.56 once for
    # slow data, and rose to 0.58 once with data ready, with other tests running beside (make test's 2 processes),
    # so the bounds hold the second, steady record
    assert len(shares["slow data"]) == 2 and 0.7 < shares["slow data"][-1] <= 1.0, shares
    assert len(shares["data ready"]) == 2 and 0.0 <= shares["data ready"][-1] < 0.3, shares
    assert all(0.0 <= x <= 1.0 for x in shares["slow data"] + shares["data ready"]), shares


def test_tiny_model_beats_unigram_perplexity(tmp_path):
    train_glob, held = _grammar_corpus(tmp_path)
    tr, counts = _trainer(tmp_path, train_glob, held, batch_size=8, unroll_steps=10, dropout=0.0,
                          eval_batch_size=4, eval_unroll_steps=10)
    try:
        before = tr.evaluate()["heldout_perplexity"]
        for _ in range(150):
            tr.train_step()
        after = tr.evaluate()["heldout_perplexity"]
    finally:
        tr.close()
    # unigram perplexity of the held-out targets (words and </S>) under add-one smoothed training counts
    n_sent = sum(1 for f in D.resolve_shards(train_glob) for _ in D.read_shard(f))
    c = Counter(counts)
    c["</S>"] = n_sent
    total = sum(c.values()) + len(c)
    nll, n = 0.0, 0
    for toks in D.read_shard(held):
        for w in toks + ["</S>"]:
            nll -= math.log((c[w] + 1) / total)
            n += 1
    unigram = math.exp(nll / n)
    assert after < before
    assert after < 0.6 * unigram, (before, after, unigram)


@pytest.mark.parametrize("clip", [1e-3, 1e6], ids=["clipped", "not clipped"])
def test_one_adagrad_step_by_hand(tmp_path, clip, monkeypatch):
    """One step of the trainer against Adagrad and global-norm clipping written out by hand, at a learning rate
    and an initial accumulator that are not the defaults (0.2, 1.0):
    g' = g * clip / max(|g|, clip) over all gradients together; acc' = acc + g'^2; w' = w - lr * g' / sqrt(acc')."""
    lr, acc0 = 0.05, 0.3
    train_glob, _ = _grammar_corpus(tmp_path, n_train=200, n_held=10)
    tr, _ = _trainer(tmp_path, train_glob, learning_rate=lr, initial_accumulator_value=acc0, all_clip_norm_val=clip,
                     dropout=0.0)
    try:
        params = [*tr.dense_params, tr.softmax_W, tr.softmax_b]
        before = [p.detach().clone() for p in params]
        accs = [*tr.acc_dense, tr.acc_W, tr.acc_b]
        assert all(torch.all(a == acc0) for a in accs)
        seen = {}
        real = trainer_mod.adagrad_dense

        def spy(params_, grads_, *args):  # the raw gradients, before the update rescales them in place
            seen.update({id(p): g.clone() for p, g in zip(params_, grads_)})
            return real(params_, grads_, *args)

        monkeypatch.setattr(trainer_mod, "adagrad_dense", spy)
        tr.train_step()
        grads = [seen[id(p)] if id(p) in seen else p.grad.to_dense() if p.grad.is_sparse else p.grad
                 for p in params]
        assert tr.softmax_W.grad.is_sparse  # only the touched rows have a gradient
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
        factor = min(1.0, clip / norm)
        assert (factor < 0.01) == (clip < 1)  # the clipped case does clip, hard
        assert float(tr.last_grad_norm) == pytest.approx(norm, rel=1e-5)
        for p, w0, g, acc in zip(params, before, grads, accs):
            g = g.double() * factor
            acc_expected = acc0 + g * g
            torch.testing.assert_close(acc.double(), acc_expected, rtol=1e-6, atol=1e-12)
            torch.testing.assert_close(p.detach().double(), w0.double() - lr * g / acc_expected.sqrt(), rtol=1e-6,
                                       atol=1e-7)
    finally:
        tr.close()


@pytest.mark.parametrize("width", [50, 10], ids=["50 ids", "10 ids"])
def test_dumped_weights_reproduce_trainer_outputs(tmp_path, width):
    """The dumped hdf5 + options.json give the trainer's own outputs. Also with 10 character ids a token, the width
    of bilm-tf's training tests: read through bilm-tf's Batcher, which takes any width; the AllenNLP API, which
    takes 50, refuses that model by name, and dump_token_embeddings encodes at the model's width."""
    from elmo_fast import Batcher, ElmoBiLM, batch_to_ids
    from elmo_fast.compat import dump_bilm_embeddings, dump_token_embeddings
    from elmo_fast.models.bilm import BiLM
    from elmo_fast.options import OptionsError

    train_glob, _ = _grammar_corpus(tmp_path, n_train=200, n_held=10)
    tr, _ = _trainer(tmp_path, train_glob, max_characters_per_token=width)
    try:
        for _ in range(5):
            tr.train_step()
        tr.save_checkpoint()
        out = tmp_path / "dump"
        out.mkdir()
        dump_weights(str(tmp_path / "run"), str(out / "weights.hdf5"))
        files = str(out / "options.json"), str(out / "weights.hdf5")
        opts = json.load(open(files[0]))
        assert opts["char_cnn"]["n_characters"] == 262
        assert opts["char_cnn"]["max_characters_per_token"] == width
        if width == 50:
            bilm = ElmoBiLM(*files, backend="reference", stateful=False)

            def activations(sent):
                return bilm(batch_to_ids([sent]))["activations"]
        else:
            with pytest.raises(OptionsError, match="max_characters_per_token=10, and this AllenNLP-style API"):
                ElmoBiLM(*files, backend="reference")
            bilm = BiLM.from_files(*files, backend="reference", stateful=False)

            def activations(sent):
                return bilm(Batcher(max_token_length=width).batch_sentences([sent]))["activations"]
        sents = [["the", "big", "cat", "sees", "a", "fish", "."], ["unseen", "wordz", "here"]]
        P = tr.P
        for s in sents:
            n = len(s)
            acts = activations(s)
            fwd_words = ["<S>", *s]
            rev_words = ["</S>", *s[::-1]]
            chars = np.array([[word_to_char_ids(w, width) for w in fwd_words]], dtype=np.int32)
            chars_r = np.array([[word_to_char_ids(w, width) for w in rev_words]], dtype=np.int32)
            z = np.zeros((1, n + 1), dtype=np.int64)
            batch = {"tokens_characters": chars, "tokens_characters_reverse": chars_r, "next_token_id": z,
                     "next_token_id_reverse": z}
            L = tr.cfg.n_layers
            h = torch.zeros(2, L, 1, P)
            c = torch.zeros(2, L, 1, tr.cfg.lstm_dim)
            tr.model.eval()
            with torch.no_grad():
                *_, o = tr.run_batch(batch, h, c, training=False)
            torch.testing.assert_close(acts[0][0, : n + 1, :P], o["emb_fwd"][0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(acts[0][0, 1:, P:], o["emb_bwd"][0].flip(0), rtol=1e-5, atol=1e-6)
            for layer in range(L):
                torch.testing.assert_close(acts[layer + 1][0, : n + 1, :P], o["fwd"][layer][0], rtol=1e-5, atol=1e-6)
                # reverse-stream position k is sentence position n + 1 - k
                torch.testing.assert_close(acts[layer + 1][0, 1:, P:], o["bwd"][layer][0].flip(0), rtol=1e-5,
                                           atol=1e-6)
        vocab = tmp_path / "vocab.txt"
        vocab.write_text("<S>\n</S>\nthe\nwordz\n", encoding="utf-8")
        dump_token_embeddings(str(vocab), *files, str(out / "tokens.hdf5"), backend="reference")
        with h5py.File(out / "tokens.hdf5", "r") as fh:
            got = torch.from_numpy(fh["embedding"][...])
        ids = torch.tensor([word_to_char_ids(w, width) for w in ["<S>", "</S>", "the", "wordz"]])
        with torch.no_grad():
            torch.testing.assert_close(got, tr.model.token_encoder(ids), rtol=1e-5, atol=1e-6)
        text = tmp_path / "sents.txt"
        text.write_text("the big cat\n", encoding="utf-8")
        dump_bilm_embeddings(str(vocab), str(text), *files, str(out / "bilm.hdf5"))  # Batcher at the model's width
        with h5py.File(out / "bilm.hdf5", "r") as fh:
            assert fh["0"].shape == (tr.cfg.n_layers + 1, 3, 2 * P)
    finally:
        tr.close()


@pytest.mark.parametrize("tied", [True, False], ids=["softmax tied", "own softmax"])
def test_word_input_model_trains_with_row_gradients_and_loads_as_bilm_tf_reads_it(tmp_path, tied):
    """A word-input biLM (bilm-tf's options without char_cnn), its softmax tied to its embedding or not: the table
    gets row (sparse) gradients and an accumulator that a resumed run gets back; the dump holds 'embedding' and no
    CNN; bilm-tf's loader path (use_character_inputs=False, the weight file as embedding_weight_file, TokenBatcher
    ids) gives the trainer's own outputs; the character APIs refuse the model by name."""
    from elmo_fast import ElmoBiLM, TokenBatcher
    from elmo_fast.compat import BidirectionalLanguageModel, _ElmoCharacterEncoder
    from elmo_fast.options import OptionsError

    train_glob, _ = _grammar_corpus(tmp_path, n_train=200, n_held=10)
    tr, _ = _trainer(tmp_path, train_glob, char_inputs=False, share_embedding_softmax=tied)
    try:
        assert (tr.softmax_W is tr.embedding) == tied and tr.model.token_encoder is None
        acc = tr.acc_W if tied else tr.acc_emb
        before = tr.embedding.detach().clone()
        for _ in range(3):
            tr.train_step()
        assert tr.embedding.grad.is_sparse and not torch.equal(tr.embedding, before)
        assert all(p is not tr.embedding for p in tr.dense_params)
        ck = load_checkpoint(tr.save_checkpoint())
        again = Trainer(tr.cfg, tr.vocab, tr.train_shards, None, str(tmp_path / "run2"), checkpoint=ck)
        try:  # a resumed run has the table (tied or not) and the table's accumulator
            assert (again.softmax_W is again.embedding) == tied and torch.equal(again.embedding, tr.embedding)
            again_acc = again.acc_W if tied else again.acc_emb
            assert torch.equal(again_acc, acc) and not torch.equal(acc, torch.ones_like(acc))
        finally:
            again.close()
        out = tmp_path / "dump"
        out.mkdir()
        dump_weights(str(tmp_path / "run"), str(out / "weights.hdf5"))
        files = str(out / "options.json"), str(out / "weights.hdf5")
        assert "char_cnn" not in json.load(open(files[0]))
        with h5py.File(files[1], "r") as fh:
            assert "CNN/W_cnn_0" not in fh
            torch.testing.assert_close(torch.from_numpy(fh["embedding"][...]), tr.embedding.detach(), rtol=0, atol=0)
        vocab = tmp_path / "vocab.txt"
        vocab.write_text("\n".join(tr.vocab.words), encoding="utf-8")
        blm = BidirectionalLanguageModel(*files, use_character_inputs=False, embedding_weight_file=files[1],
                                         max_batch_size=1, backend="reference")
        own = BidirectionalLanguageModel(*files, use_character_inputs=False, max_batch_size=1, backend="reference")
        P, L = tr.P, tr.cfg.n_layers
        tr.model.eval()
        for s in [["the", "big", "cat", "sees", "a", "fish", "."], ["a", "dog", "today"]]:
            n = len(s)
            ids = TokenBatcher(str(vocab)).batch_sentences([s])
            got, got_own = blm(ids)["lm_embeddings"][0], own(ids)["lm_embeddings"][0]
            blm.reset_states()
            own.reset_states()
            torch.testing.assert_close(got_own, got, rtol=0, atol=0)
            fwd_ids = torch.tensor([[tr.vocab.word_to_id(w) for w in ["<S>", *s]]])
            rev_ids = torch.tensor([[tr.vocab.word_to_id(w) for w in ["</S>", *s[::-1]]]])
            z = torch.zeros(1, n + 1, dtype=torch.long)
            batch = {"token_ids": fwd_ids, "token_ids_reverse": rev_ids, "next_token_id": z,
                     "next_token_id_reverse": z}
            with torch.no_grad():
                *_, o = tr.run_batch(batch, torch.zeros(2, L, 1, P), torch.zeros(2, L, 1, tr.cfg.lstm_dim),
                                     training=False)
            for layer in range(L):  # bilm-tf's lm_embeddings drop the boundaries: positions 1..n
                torch.testing.assert_close(got[layer + 1, :, :P], o["fwd"][layer][0, 1:], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(got[layer + 1, :, P:], o["bwd"][layer][0].flip(0)[:n], rtol=1e-5,
                                           atol=1e-6)
        with pytest.raises(OptionsError, match="word-input biLM, and this AllenNLP-style API takes characters"):
            ElmoBiLM(*files, backend="reference")
        with pytest.raises(ValueError, match="word-input biLM.*use_character_inputs=False"):
            BidirectionalLanguageModel(*files, backend="reference")
        with pytest.raises(OptionsError, match="word-input biLM, and this AllenNLP-style API takes characters"):
            _ElmoCharacterEncoder(*files, backend="reference")
    finally:
        tr.close()


@requires_triton
@pytest.mark.triton
def test_word_input_forward_only_steps_on_the_triton_backend(tmp_path):
    """The word-input and forward-only paths of the step on the GPU kernels (under the interpreter in make test, on
    the GPU in gpu-check): a tied embedding's row gradients through Triton's sampled softmax, the forward stack
    alone; two finite steps that change the table."""
    train_glob, _ = _grammar_corpus(tmp_path, n_train=100, n_held=5)
    files = D.resolve_shards(train_glob)
    counts, _, n_tok, _ = D.count_tokens(files)
    cfg = tiny()
    cfg.backend, cfg.n_train_tokens, cfg.n_negative_samples_batch = "triton", n_tok, 8
    cfg.batch_size, cfg.unroll_steps = 2, 3
    cfg.char_inputs, cfg.share_embedding_softmax, cfg.bidirectional = False, True, False
    tr = Trainer(cfg, Vocabulary(words=D.build_vocab(counts)), files, None, str(tmp_path / "run"),
                 device=torch.device(triton_device()))
    try:
        before = tr.embedding.detach().clone()
        losses = [float(tr.train_step()) for _ in range(2)]
        assert all(math.isfinite(x) for x in losses) and not torch.equal(tr.embedding.detach(), before)
    finally:
        tr.close()


def test_forward_only_lm_trains_its_stack_alone_and_is_not_dumped(tmp_path):
    """bidirectional false: the step's loss is the forward LM's softmax loss alone (one softmax call), held-out
    perplexity too; the backward stack is neither updated nor in the dense parameters; a dump is refused (the
    published layout holds both directions)."""
    train_glob, held_glob = _grammar_corpus(tmp_path, n_train=200, n_held=10)
    tr, _ = _trainer(tmp_path, train_glob, heldout=held_glob, bidirectional=False)
    try:
        bwd = [p.detach().clone() for p in tr.model.backward_lstm.parameters()]
        fwd = [p.detach().clone() for p in tr.model.forward_lstm.parameters()]
        calls, softmax_forward = [], tr.softmax.forward
        tr.softmax.forward = lambda *a, **k: calls.append(softmax_forward(*a, **k)) or calls[-1]
        for _ in range(2):
            calls.clear()
            loss = tr.train_step()
            assert len(calls) == 1 and torch.equal(loss, calls[0].detach().float())
        calls.clear()
        ev = tr.evaluate(batch_size=2, unroll_steps=3, max_batches=2)
        assert len(calls) == 2 and ev["heldout_loss"] == pytest.approx(sum(float(c) for c in calls) / 2)
        assert all(torch.equal(a, b) for a, b in zip(bwd, tr.model.backward_lstm.parameters()))
        assert not any(torch.equal(a, b) for a, b in zip(fwd, tr.model.forward_lstm.parameters()))
        ids = {id(p) for p in tr.dense_params}
        assert not any(id(p) in ids for p in tr.model.backward_lstm.parameters())
        tr.save_checkpoint()
        with pytest.raises(ConfigError, match="forward-only LM"):
            dump_weights(str(tmp_path / "run"), str(tmp_path / "w.hdf5"))
    finally:
        tr.close()


def test_tied_word_embedding_with_the_full_softmax_takes_dense_gradients(tmp_path):
    """A word embedding tied to a full softmax gets its lookup's row gradient and the softmax's dense one; the sum is
    dense and goes through the dense update, with the table's accumulator (TF aggregates the same way)."""
    train_glob, _ = _grammar_corpus(tmp_path, n_train=200, n_held=10)
    tr, _ = _trainer(tmp_path, train_glob, char_inputs=False, share_embedding_softmax=True, sample_softmax=False)
    try:
        before, acc0 = tr.embedding.detach().clone(), tr.acc_W.clone()
        tr.train_step()
        assert not tr.embedding.grad.is_sparse
        changed = (tr.embedding != before).any(1)
        assert bool(changed.all()) and bool((tr.acc_W != acc0).any(1).all())  # every row: the softmax's gradient
    finally:
        tr.close()


def _cli_env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("WORLD_SIZE", None)
    return env


def _train_cmd(save_dir, train_glob, steps, extra=()):
    return [sys.executable, "-m", "elmo_fast.training.cli", "train", "--save-dir", str(save_dir), "--config", "tiny",
            "--corpus", train_glob, "--backend", "reference", "--max-steps", str(steps), "--checkpoint-every", "6",
            "--log-every", "1", "--n-negative-samples-batch", "8", "--no-progress", "--quiet",
            "--keep-checkpoints", "10", *extra]


def test_a_new_run_refuses_a_save_dir_with_checkpoints(tmp_path, capsys):
    """A second run into a save dir that holds a run's checkpoints would mix the two (and a later --resume would pick
    the older run's latest): refused, naming the ways out, before touching any of the run's files."""
    train_glob, _ = _grammar_corpus(tmp_path, n_train=100, n_held=5)
    run = tmp_path / "run"
    assert cli_main(_train_cmd(run, train_glob, 2)[3:]) == 0
    files = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    capsys.readouterr()
    assert cli_main(_train_cmd(run, train_glob, 3, ["--seed", "5"])[3:]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == files
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["ckpt-000000002.pt"]


def test_init_from_starts_a_new_run_from_a_checkpoints_weights(tmp_path, monkeypatch, capsys):
    """bilm-tf's restart.py: a new run on another corpus, with another batch size and epochs, from a checkpoint's
    weights and Adagrad accumulators; its steps, data positions and LSTM states start from zero, its token count
    is the new corpus's; a change to the model or a vocabulary of another size is refused."""
    train_glob, _ = _grammar_corpus(tmp_path, n_train=100, n_held=5)
    other = tmp_path / "other.txt"
    other.write_text("the cat sees a dog .\na big fish eats the old man today .\n" * 20, encoding="utf-8")
    old = tmp_path / "old"
    assert cli_main(_train_cmd(old, train_glob, 3, ["--sleep-per-step", "0.01", "--queue-size", "2"])[3:]) == 0
    ck = load_checkpoint(latest_checkpoint(str(old)))
    seen = []
    monkeypatch.setattr(trainer_mod, "train_loop", lambda tr, log, progress: seen.append(tr) or {})
    new = ["train", "--save-dir", str(tmp_path / "new"), "--init-from", str(old / "checkpoints"), "--corpus",
           str(other), "--batch-size", "3", "--n-epochs", "2", "--backend", "reference", "--no-progress", "--quiet"]
    assert cli_main(new) == 0
    tr = seen[0]
    try:
        assert tr.step == 0 and tr.cfg.batch_size == 3 and tr.cfg.n_epochs == 2 and tr.cfg.n_train_tokens == 300
        assert tr.cfg.sleep_per_step == 0.0 and tr.cfg.queue_size == TrainConfig().queue_size  # not the old machine
        for k, v in tr.model.state_dict().items():
            assert torch.equal(v, ck["model"][k]), k
        assert all(torch.equal(a, b) for a, b in zip(tr.acc_dense, ck["acc_dense"]))
        assert torch.equal(tr.softmax_W.detach(), ck["softmax_W"]) and torch.equal(tr.acc_W, ck["acc_W"])
        assert all(float(tw.h.abs().sum()) == 0 and tw.h.shape[2] == 3 for tw in tr.towers)
        run = json.load(open(tmp_path / "new" / "run.json"))
        assert run["init_from"] == os.path.abspath(latest_checkpoint(str(old)))
    finally:
        tr.close()
    capsys.readouterr()
    assert cli_main([*new[:2], str(tmp_path / "new2"), *new[3:], "--lstm-dim", "64"]) == 2
    assert "['lstm_dim'] would change the model the checkpoint holds" in capsys.readouterr().err
    small_vocab = tmp_path / "v.txt"
    small_vocab.write_text("<S>\n</S>\n<UNK>\nthe\n", encoding="utf-8")
    assert cli_main([*new[:2], str(tmp_path / "new3"), *new[3:], "--vocab", str(small_vocab)]) == 2
    assert "has 4 entries but the checkpoint's softmax has" in capsys.readouterr().err
    assert cli_main([*new[:2], str(tmp_path / "new4"), *new[3:], "--resume"]) == 2
    assert "give one of them" in capsys.readouterr().err
    same_size = tmp_path / "same_size.txt"  # the run's words in another order
    words = (old / "vocab.txt").read_text(encoding="utf-8").splitlines()
    same_size.write_text("\n".join(words[:3] + words[3:][::-1]), encoding="utf-8")
    assert cli_main([*new[:2], str(tmp_path / "new5"), *new[3:], "--vocab", str(same_size)]) == 2
    assert "is not the vocabulary the checkpoint was trained with" in capsys.readouterr().err
    no_corpus = [a for i, a in enumerate(new) if a != "--corpus" and (i == 0 or new[i - 1] != "--corpus")]
    assert cli_main([*no_corpus[:2], str(tmp_path / "new6"), *no_corpus[3:]]) == 2
    assert "--init-from needs the corpus to train on" in capsys.readouterr().err


def test_evaluate_command_gives_the_runs_own_held_out_perplexity(tmp_path, capsys):
    """``elmo-fast evaluate`` (bilm-tf's run_test.py) on a run's last checkpoint and held-out shards, batched as the
    run evaluated them: the perplexity the run logged, to the last bit; a vocabulary of another size is refused."""
    train_glob, held = _grammar_corpus(tmp_path, n_train=100, n_held=10)
    run = tmp_path / "run"
    assert cli_main(_train_cmd(run, train_glob, 3, ["--heldout", held])[3:]) == 0
    done = json.loads((run / "train_log.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    cfg = tiny()
    assert cli_main(["evaluate", "--save-dir", str(run), "--test-prefix", held, "--batch-size",
                     str(cfg.eval_batch_size), "--unroll-steps", str(cfg.eval_unroll_steps)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["step"] == 3 and got["heldout_batches"] == done["heldout_batches"] > 0
    assert got["heldout_perplexity"] == done["heldout_perplexity"]
    small_vocab = tmp_path / "v.txt"
    small_vocab.write_text("<S>\n</S>\n<UNK>\nthe\n", encoding="utf-8")
    assert cli_main(["evaluate", "--save-dir", str(run), "--test-prefix", held, "--vocab", str(small_vocab)]) == 2
    assert "has 4 entries but the checkpoint's softmax has" in capsys.readouterr().err
    words = (run / "vocab.txt").read_text(encoding="utf-8").splitlines()
    small_vocab.write_text("\n".join(words[:3] + words[3:][::-1]), encoding="utf-8")  # same size, other order
    assert cli_main(["evaluate", "--save-dir", str(run), "--test-prefix", held, "--vocab", str(small_vocab)]) == 2
    assert "is not the vocabulary the checkpoint was trained with" in capsys.readouterr().err
    assert cli_main(["evaluate", "--save-dir", str(run), "--test-prefix", held, "--batch-size", "100000"]) == 2
    assert "not one full batch of 100000 rows" in capsys.readouterr().err


def _final_tensors(save_dir):
    from elmo_fast.training.trainer import latest_checkpoint

    ck = load_checkpoint(latest_checkpoint(str(save_dir)))
    out = {f"model.{k}": v for k, v in ck["model"].items()}
    for k in ("softmax_W", "softmax_b", "acc_W", "acc_b"):
        out[k] = ck[k]
    for i, a in enumerate(ck["acc_dense"]):
        out[f"acc{i}"] = a
    for t in ck["towers"]:
        out[f"h{t['gid']}"], out[f"c{t['gid']}"] = t["h"], t["c"]
    return ck["step"], out


def _processes_running(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (Linux /proc; empty elsewhere)."""
    pids = []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    pids.append(int(pid))
        except (OSError, ValueError):
            continue
    return pids


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_resume_after_sigkill_is_bit_identical(tmp_path, worker):
    """Killed mid-run and resumed: the bits of an uninterrupted run. With data_worker 'process' (the GPU default)
    the killed run's loader process exits too (its socket breaks), and the positions it sent resume exactly."""
    train_glob, _ = _grammar_corpus(tmp_path, n_train=300, n_held=10)
    steps = 20
    env = _cli_env()
    full = tmp_path / "full"
    r = subprocess.run(_train_cmd(full, train_glob, steps), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

    killed = tmp_path / "killed"
    worker_args = ["--data-worker", worker]
    p = subprocess.Popen(_train_cmd(killed, train_glob, steps, ["--sleep-per-step", "0.3", *worker_args]), env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = killed / "checkpoints" / "ckpt-000000006.pt"
    t0 = time.time()
    while not first.exists() and p.poll() is None and time.time() - t0 < 240:
        time.sleep(0.05)
    time.sleep(0.5)  # mid-way between checkpoints
    assert p.poll() is None, "the run ended before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    t0 = time.time()
    while _processes_running(str(killed)) and time.time() - t0 < 20:
        time.sleep(0.1)
    assert not _processes_running(str(killed)), "a process of the killed run outlived it"
    # a temp file may be left by the kill, but every ckpt-*.pt is complete (written to a temp name, then renamed)
    for ck in (killed / "checkpoints").glob("ckpt-*.pt"):
        assert load_checkpoint(str(ck))["step"] > 0
    log = [json.loads(x) for x in open(killed / "train_log.jsonl")]
    killed_at = max(x["step"] for x in log if x["event"] == "train")
    assert killed_at < steps
    r = subprocess.run(_train_cmd(killed, train_glob, steps, ["--resume", *worker_args]), env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s1, a = _final_tensors(full)
    s2, b = _final_tensors(killed)
    assert s1 == s2 == steps
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and the per-step losses after the resume point match the uninterrupted run's
    la = {x["step"]: x["loss"] for x in map(json.loads, open(full / "train_log.jsonl")) if x["event"] == "train"}
    lb = {x["step"]: x["loss"] for x in map(json.loads, open(killed / "train_log.jsonl")) if x["event"] == "train"}
    assert all(la[s] == lb[s] for s in la)


@pytest.mark.parametrize("pref", ["gpu", "cuda:x", "meta", "cuda", "cuda:1"])
def test_resolve_device_applies_the_one_device_rule(pref):
    from elmo_fast.util import parse_device

    if torch.cuda.is_available() and pref.startswith("cuda"):
        pytest.skip("checks the messages for a machine without a GPU")
    dinfo = trainer_mod.DistInfo()
    with pytest.raises(ConfigError) as expected:
        parse_device(pref, "device", ConfigError)
    with pytest.raises(ConfigError) as got:
        trainer_mod.resolve_device(pref, dinfo)
    assert str(got.value) == str(expected.value)
    assert trainer_mod.resolve_device("cpu", dinfo) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert trainer_mod.resolve_device("auto", dinfo) == torch.device("cpu")


def test_checkpoints_carry_the_cpu_packing_timings(tmp_path, monkeypatch):
    """The cpu backend times whether training's forward packs a weight (cpu.packed.pack_pays) and which library
    runs each GEMM shape (cpu.gemm.uses_onednn): a checkpoint holds those timings and a resumed trainer restores
    them, so it makes the interrupted run's choices (the summation orders they imply) instead of timing afresh."""
    from elmo_fast.cpu import gemm, packed

    monkeypatch.setattr(packed, "_PAYS", {})
    monkeypatch.setattr(gemm, "_TIMES", {})
    key = (16, (512, 16384), (16384, 1), torch.float32, 2, True)
    packed._PAYS[key] = (0.05, 0.012, 0.005)
    gkey = (512, 512, 16384, True, True, True, 2)
    gemm._TIMES[gkey] = (0.05, 0.04)
    train_glob, _ = _grammar_corpus(tmp_path, n_train=200, n_held=10)
    tr, _ = _trainer(tmp_path, train_glob)
    try:
        ck = tr.state_dict()
    finally:
        tr.close()
    assert ck["cpu_pack_timings"] == [[16, [512, 16384], [16384, 1], "float32", 2, True, 0.05, 0.012, 0.005]]
    assert ck["cpu_gemm_timings"] == [[512, 512, 16384, True, True, True, 2, 0.05, 0.04]]
    packed._PAYS.clear()
    gemm._TIMES.clear()
    tr2, _ = _trainer(tmp_path / "b", train_glob)
    try:
        tr2._load_state(ck)
    finally:
        tr2.close()
    assert packed._PAYS == {key: (0.05, 0.012, 0.005)}
    assert gemm._TIMES == {gkey: (0.05, 0.04)}
    # older checkpoints have none: nothing restored, nothing fails
    packed._PAYS.clear()
    gemm._TIMES.clear()
    tr2._load_state({k: v for k, v in ck.items() if k not in ("cpu_pack_timings", "cpu_gemm_timings")})
    assert packed._PAYS == {} and gemm._TIMES == {}
    with pytest.raises(ValueError, match="a pack timing row of 7 fields, expected 9 \\(or 8, without panels\\)"):
        packed.restore_pack_timings([[16, [512, 16384], [16384, 1], "float32", 2, 0.05, 0.012]])
    packed.restore_pack_timings([[16, [512, 16384], [16384, 1], "float32", 2, 0.05, 0.012, 0.005]])  # before panels
    assert packed._PAYS[key[:5] + (False,)] == (0.05, 0.012, 0.005)
