"""The pretraining data path on the host: what making batches costs the training step's process, by data worker.

Rows (measure, worker, ms):

* ``batch``: one ``BidirectionalStream.next_batch`` (both directions) at B rows x 20, on a warm token cache: the
  Python the data worker runs per step;
* ``step``: a stand-in for a GPU step's host work (``--ops`` small torch ops, which hold the interpreter lock as
  launching kernels does) with a batch taken from the loader each step, for the thread loader and the process
  loader (``data_worker``), beside the same work alone (``none``): in a thread, making batches holds the lock the
  step needs and the two add up; from a process they can overlap;
* ``received``: batches the process loader's receiving thread took in 2 s while this process sleeps or spins in
  Python (a receiver that needs the lock for each chunk of a batch is starved by a busy step);
* ``payload``: what the process loader sends a step for the trainer's char batch (``TowerStream.next_batch``): its
  pickled bytes and the receiver's ``pickle.loads`` time, as shipped now (the distinct tokens, int16 rows and int32
  inverse, without the char ids: worker ``tokens``) and as before d6cc232 (the (B, T, 50) int32 char ids of both
  directions beside int32 rows and an int64 inverse: worker ``char ids``).

Corpus: a Zipf-distributed synthetic one (bench_train.synthetic_corpus), 100,000 words, 4M tokens in one shard
(steady state: no shard loaded inside a timed window).
Rounds alternate the workers; each round is reported (the host is shared). ``--small`` shrinks everything (CI).

    .venv/bin/python bench/bench_data.py [--batch 384] [--rounds 3]

Rows go to build/bench/data.csv, or to the committed bench/results/data.csv with ``ELMO_FAST_BENCH_RECORD=1``
(bench/common.py).
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_train import synthetic_corpus  # noqa: E402

from elmo_fast.chars import Vocabulary  # noqa: E402
from elmo_fast.training.data import (BackgroundLoader, BidirectionalStream, ProcessLoader, build_vocab,  # noqa: E402
                                     count_tokens)
from elmo_fast.training.trainer import TowerStream  # noqa: E402

LOADERS = {"thread": BackgroundLoader, "process": ProcessLoader}


def _stream(tmp: str, batch: int, n_words: int, n_tokens: int) -> BidirectionalStream:
    # one shard: no shard is loaded inside a timed window (a real run loads one every few hundred steps, ~0.1 s per
    # 1M tokens in the worker; the thread holds the lock through it, the process does not)
    synthetic_corpus(tmp, n_words, n_tokens, n_shards=1)
    files = sorted(str(f) for f in Path(tmp).glob("train-*.txt"))
    counts, *_ = count_tokens(files)
    stream = BidirectionalStream(files, Vocabulary(words=build_vocab(counts)), batch, 20, 50, seed=0)
    for _ in range(60):  # the token cache holds the corpus's frequent words by now, as in a long run
        stream.next_batch()
    return stream


def _host_work(n_ops: int, a=torch.zeros(64), b=torch.ones(64)) -> None:
    for _ in range(n_ops):
        a.add_(b, alpha=1e-9)


def _payloads(stream: BidirectionalStream) -> dict[str, dict]:
    """One step's char batch as the process loader pickles it: now (``TowerStream``) and before d6cc232."""
    b, rows, inverse = stream.next_batch_and_tokens()
    before = {k: torch.from_numpy(b[k]) for k in TowerStream.KEYS}
    before.update(char_rows=torch.from_numpy(rows), char_inverse=torch.from_numpy(inverse))
    now = TowerStream(stream, None, 0, 1, ahead=False, pin=False).next_batch()
    return {"tokens": now, "char ids": before}


def run(batch: int = 384, rounds: int = 3, steps: int = 20, n_ops: int = 10_000, small: bool = False) -> list[dict]:
    if small:
        batch, rounds, steps, n_ops = 8, 1, 3, 100
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the stand-in step's ops are tiny: no OpenMP team
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            stream = _stream(tmp, batch, 2_000 if small else 100_000, 50_000 if small else 4_000_000)
            for r in range(rounds):
                t0 = time.perf_counter()
                for _ in range(steps):
                    stream.next_batch()
                rows.append({"measure": "batch", "worker": "none", "round": r,
                             "ms": (time.perf_counter() - t0) / steps * 1e3})
                t0 = time.perf_counter()
                for _ in range(steps):
                    _host_work(n_ops)
                rows.append({"measure": "step", "worker": "none", "round": r,
                             "ms": (time.perf_counter() - t0) / steps * 1e3})
                for name, Loader in LOADERS.items():
                    loader = Loader(stream, queue_size=2)
                    try:
                        next(loader)
                        time.sleep(0.3)  # the worker has filled its queue
                        t0 = time.perf_counter()
                        for _ in range(steps):
                            next(loader)
                            _host_work(n_ops)
                        rows.append({"measure": "step", "worker": name, "round": r,
                                     "ms": (time.perf_counter() - t0) / steps * 1e3})
                    finally:
                        loader.close()
            for r in range(rounds):
                sizes: dict[str, list] = {}
                for _ in range(steps):
                    for name, d in _payloads(stream).items():
                        blob = pickle.dumps(d, pickle.HIGHEST_PROTOCOL)
                        t0 = time.perf_counter()
                        pickle.loads(blob)
                        sizes.setdefault(name, []).append((len(blob), time.perf_counter() - t0))
                for name, v in sizes.items():  # medians (a collection pause lands in one loads or another)
                    rows.append({"measure": "payload", "worker": name, "round": r,
                                 "ms": statistics.median(t for _, t in v) * 1e3,
                                 "bytes": int(statistics.median(n for n, _ in v))})
            for busy in (False, True):
                loader = ProcessLoader(stream, queue_size=100_000)
                try:
                    next(loader)
                    t0 = time.perf_counter()
                    while time.perf_counter() - t0 < (0.3 if small else 2.0):
                        if not busy:
                            time.sleep(0.01)
                    rows.append({"measure": "received", "worker": "process", "round": "busy" if busy else "asleep",
                                 "batches": loader.ready(), "seconds": round(time.perf_counter() - t0, 2)})
                finally:
                    loader.close()
    finally:
        torch.set_num_threads(threads)
    for r in rows:
        r.update(B=batch, ops=n_ops)
        if "ms" in r:
            r["ms"] = round(r["ms"], 2)
    return rows


def report(rows: list[dict]) -> None:
    def line(r):
        if r["measure"] == "received":
            return f"received  process  this process {r['round']:6s}: {r['batches']} batches in {r['seconds']} s"
        if r["measure"] == "payload":
            return f"payload   {r['worker']:8s} round {r['round']}: {r['bytes']:>9,d} bytes, loads {r['ms']:6.3f} ms"
        return f"{r['measure']:8s}  {r['worker']:7s}  round {r['round']}: {r['ms']:8.2f} ms"

    common.report_rows("data", rows, line, ["measure", "worker", "round", "ms", "bytes", "batches", "seconds", "B",
                                            "ops", "date", "device", "torch", "triton", "commit", "command"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ops", type=int, default=10_000, help="small torch ops in the stand-in step (~1 us each)")
    ap.add_argument("--small", action="store_true", help="tiny sizes (CI smoke run)")
    a = ap.parse_args(argv)
    report(run(a.batch, a.rounds, n_ops=a.ops, small=a.small))
    return 0


if __name__ == "__main__":
    sys.exit(main())
