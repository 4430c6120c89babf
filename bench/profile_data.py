"""cProfile of the training data thread's batching: ``BidirectionalStream.next_batch`` and ``get_state`` (what
``BackgroundLoader`` runs per batch) on a small Zipf-like corpus, B=32 x T=20 per direction. Prints the function
call count (a count, not a speed: cProfile's overhead is per call) and the top functions by own time.

    .venv/bin/python bench/profile_data.py [--batches 200]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import tempfile

from elmo_fast.chars import Vocabulary
from elmo_fast.training.data import BidirectionalStream, build_vocab, count_tokens


def corpus(folder: str, n_words: int = 2000, n_shards: int = 2, n_sentences: int = 3000) -> list[str]:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(n_words)]
    weights = [1.0 / (k + 1) for k in range(n_words)]
    files = []
    for s in range(n_shards):
        files.append(os.path.join(folder, f"train-{s}.txt"))
        with open(files[-1], "w", encoding="utf-8") as fh:
            for _ in range(n_sentences):
                fh.write(" ".join(rng.choices(words, weights, k=rng.randint(5, 40))) + "\n")
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=200)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        files = corpus(tmp)
        counts, *_ = count_tokens(files)
        stream = BidirectionalStream(files, Vocabulary(words=build_vocab(counts)), 32, 20, 50, seed=1)
        for _ in range(5):  # past the first shard load
            stream.next_batch()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.batches):
            stream.next_batch()
            stream.get_state()
        prof.disable()
    stats = pstats.Stats(prof)
    print(f"{stats.total_calls} function calls for {a.batches} batches (32 x 20 tokens, both directions)")
    stats.sort_stats("tottime").print_stats(8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
