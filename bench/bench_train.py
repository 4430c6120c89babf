"""End-to-end pretraining throughput: ``elmo_fast`` Trainer vs a loop built from stock PyTorch parts.

* ``elmo_fast``: ``elmo_fast.training.Trainer.train_step`` as ``elmo-fast train`` runs it: background data worker,
  elmo_fast kernels (backend auto), bf16 autocast, sparse softmax rows + sparse Adagrad, stateful TBPTT; on a
  GPU the LSTMP time loops replay from loop graphs (the default), and ``elmo_fast-eager`` is the same with
  ``ELMO_FAST_LOOP_GRAPHS=0``, ``elmo_fast-pdl`` with ``ELMO_FAST_LSTMP_PDL=1`` (programmatic dependent launch in the
  LSTMP time loops, opt-in). ``elmo_fast-towers``: the original recipe as ``--config original`` runs it, the same
  rows a step as 3 towers of ``--batch`` / 3 rows each in one pass (``fuse_towers``, the GPU default);
  ``elmo_fast-towers-seq``: those towers one after the other.
* ``parts``: the same model from library parts: ``nn.Embedding`` + ``nn.Conv1d`` + highway ``nn.Linear`` for the
  token encoder, ``nn.LSTM(proj_size=P)`` one layer at a time (residual + dropout between), the unfused torch
  sampled softmax on a dense (V, P) weight, ``clip_grad_norm_`` and ``torch.optim.Adagrad``; bf16 autocast too.
  Its batches are packed in advance (it does not pay for data loading), so the comparison favours it.

Sizes: the original model (2x4096_512, 2048 filters, 2 highway), 128 rows x 20 steps per GPU, 8192 samples, and a
synthetic Zipfian corpus with a 100k-word vocabulary (``--vocab``). Reports tokens/s (per direction, as
``elmo-fast train`` logs them) and peak memory; appends rows to build/bench/train.csv, or to the committed
bench/results/train.csv with ``ELMO_FAST_BENCH_RECORD=1`` (bench/common.py).

    python bench/bench_train.py [--steps 30] [--vocab 100000] [--batch 128]
    python -m pytest -q bench/bench_train.py        # GPU: the benchmark; CPU: a 2-step smoke test of both loops
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from elmo_fast.chars import Vocabulary  # noqa: E402
from elmo_fast.reference.sampled_softmax import expected_count_reference, sampled_softmax_loss_reference  # noqa: E402
from elmo_fast.training import configs  # noqa: E402
from elmo_fast.training.data import BidirectionalStream, build_vocab, count_tokens  # noqa: E402
from elmo_fast.training.trainer import Trainer  # noqa: E402
from elmo_fast.ops.softmax import log_uniform_sample  # noqa: E402


def synthetic_corpus(directory: str, n_words: int, n_tokens: int, seed: int = 0, n_shards: int = 4) -> str:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(n_words)]
    vocab = [f"w{i}" for i in range(n_words)]
    toks = rng.choices(vocab, weights=weights, k=n_tokens)
    lines, i = [], 0
    while i < len(toks):
        n = rng.randint(5, 40)
        lines.append(" ".join(toks[i : i + n]))
        i += n
    for s in range(n_shards):
        with open(os.path.join(directory, f"train-{s}.txt"), "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines[s::n_shards]) + "\n")
    return os.path.join(directory, "train-*.txt")


class PartsBiLM(nn.Module):
    """The bilm-tf training graph from stock torch modules."""

    def __init__(self, cfg: configs.TrainConfig, V: int):
        super().__init__()
        d, P, H = cfg.char_embed_dim, cfg.projection_dim, cfg.lstm_dim
        F_ = sum(n for _, n in cfg.filters)
        self.cfg = cfg
        self.emb = nn.Embedding(262, d, padding_idx=0)
        self.convs = nn.ModuleList([nn.Conv1d(d, n, w) for w, n in cfg.filters])
        self.highway = nn.ModuleList([nn.Linear(F_, 2 * F_) for _ in range(cfg.n_highway)])
        self.proj = nn.Linear(F_, P)
        self.lstms = nn.ModuleList([nn.ModuleList([nn.LSTM(P, H, proj_size=P, batch_first=True)
                                                   for _ in range(cfg.n_layers)]) for _ in range(2)])
        self.W = nn.Parameter(torch.randn(V, P) / math.sqrt(P))
        self.b = nn.Parameter(torch.zeros(V))

    def encode(self, chars):
        B, T, L = chars.shape
        x = self.emb(chars.reshape(-1, L)).transpose(1, 2)
        x = torch.cat([torch.relu(conv(x).amax(-1)) for conv in self.convs], -1)
        for hw in self.highway:
            t, g = hw(x).chunk(2, -1)
            g = torch.sigmoid(g)
            x = g * x + (1 - g) * torch.relu(t)
        return self.proj(x).reshape(B, T, -1)

    def direction(self, x, k, states):
        p = self.cfg.dropout
        new = []
        for layer, lstm in enumerate(self.lstms[k]):
            inp = F.dropout(x, p, self.training)
            y, st = lstm(inp, states[layer])
            new.append(tuple(s.detach() for s in st))
            x = y + inp if layer > 0 else y
        return F.dropout(x, p, self.training), new


def parts_step(model, opt, batch, states, S, V, dev):
    cf = torch.as_tensor(batch["tokens_characters"], device=dev, dtype=torch.long)
    cb = torch.as_tensor(batch["tokens_characters_reverse"], device=dev, dtype=torch.long)
    B, T = cf.shape[:2]
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        e = model.encode(torch.cat([cf, cb]))
        losses = []
        for k, (x, key) in enumerate(((e[:B], "next_token_id"), (e[B:], "next_token_id_reverse"))):
            h, states[k] = model.direction(x, k, states[k])
            tgt = torch.as_tensor(batch[key], device=dev).reshape(-1)
            ids, tries = log_uniform_sample(S, V, device=dev)
            losses.append(sampled_softmax_loss_reference(
                h.reshape(-1, h.shape[-1]).float(), tgt, model.W, model.b, ids,
                expected_count_reference(tgt, tries, S, V), expected_count_reference(ids, tries, S, V)))
        loss = 0.5 * (losses[0] + losses[1])
    opt.zero_grad(set_to_none=True)
    (loss * T).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), model.cfg.all_clip_norm_val)
    opt.step()
    return loss.detach()


@contextlib.contextmanager
def _compiles():
    """Counts the Triton kernels compiled inside the block (not those loaded from Triton's on-disk cache): a
    compile inside a timed round is seconds the steady state never pays."""
    counts = {"compiled": 0}
    try:
        import triton

        knobs = triton.knobs.compilation
    except Exception:  # noqa: BLE001 - no triton: nothing to count
        yield counts
        return
    previous = knobs.listener

    def listener(**kw):
        counts["compiled"] += not kw.get("cache_hit")
        if previous is not None:
            previous(**kw)

    knobs.listener = listener
    try:
        yield counts
    finally:
        knobs.listener = previous


def _timed(step, steps: int, rounds: int, warmup: int, dev, waited=None) -> dict:
    """``warmup`` steps, then ``steps`` timed steps in ``rounds`` rounds. ms_per_step is the median round's, so one
    round that pays for something once (a kernel specialisation compiled on a new token count, a late
    allocation) does not set the number; every round's time and the compiles inside timed rounds are kept.
    ``waited``: the trainer's seconds spent waiting for batches so far (``Trainer.data_wait_s``), which gives
    ``data_wait``, their share of the timed rounds."""
    for _ in range(warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rounds = max(1, min(rounds, steps))
    per_round = [steps // rounds + (i < steps % rounds) for i in range(rounds)]
    ms, w0 = [], waited() if waited else 0.0
    with _compiles() as compiled:
        for n in per_round:
            t0 = time.perf_counter()
            for _ in range(n):
                loss = step()
            float(loss)  # waits for the device
            ms.append(1000 * (time.perf_counter() - t0) / n)
    mem = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else float("nan")
    wait = (waited() - w0) / (1e-3 * sum(m * n for m, n in zip(ms, per_round))) if waited else float("nan")
    return {"ms_per_step": statistics.median(ms), "round_ms": " ".join(f"{m:.1f}" for m in ms),
            "compiles_timed": compiled["compiled"], "peak_mem_mib": mem, "data_wait": round(wait, 3)}


PROVIDERS = ("elmo_fast", "elmo_fast-eager", "elmo_fast-thread-data", "elmo_fast-pdl", "elmo_fast-towers",
             "elmo_fast-towers-seq", "parts")


def run(steps: int = 30, vocab_size: int = 100_000, batch: int = 128, cfg: configs.TrainConfig | None = None,
        n_tokens: int = 2_000_000, warmup: int = 5, device: str | None = None, rounds: int = 3,
        providers=("elmo_fast", "elmo_fast-eager", "parts"), profile: int = 0, trace: str | None = None,
        append: bool = True) -> list[dict]:
    """Every provider of ``providers`` timed (``_timed``); ``profile`` > 0: then that many more steps of elmo_fast
    under torch.profiler (``common.device_profile``: the step's phases, kernels by device time, host ops, how busy
    the GPU was), and with ``trace`` their gzipped Chrome trace there. Each row is appended to the CSV as it is
    measured (``append``; the CPU smoke test leaves the CSV alone); a provider that fails on CUDA is a row with
    ``error`` (``_emit``)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg is None:
        cfg = configs.original()
        cfg.towers = 1  # one tower of `batch` rows a step (the preset has bilm-tf's 3)
    cfg.batch_size = batch
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        synthetic_corpus(tmp, vocab_size, n_tokens)
        files = sorted(Path(tmp).glob("train-*.txt"))
        counts, _, n_tok, _ = count_tokens([str(f) for f in files])
        vocab = Vocabulary(words=build_vocab(counts))
        V = len(vocab)
        cfg.n_train_tokens = n_tok
        cfg.n_negative_samples_batch = min(cfg.n_negative_samples_batch, V)
        # ---- elmo_fast; on a GPU also with the LSTMP loop graphs off (every step's launches as launched), with the
        # batches made in a thread of this process instead of a worker process (data_worker's GPU default), and with
        # programmatic dependent launch in the LSTMP time loops (ELMO_FAST_LSTMP_PDL=1, opt-in)
        variants = [("elmo_fast", None, "auto")] + (
            [("elmo_fast-eager", "0", "auto"), ("elmo_fast-thread-data", None, "thread"),
             ("elmo_fast-pdl", None, "auto")] if dev.type == "cuda" else [])
        # the original recipe's 3 towers of batch / 3 rows each (the same rows a step), fused in one pass (the GPU
        # default) or one after the other
        variants += [("elmo_fast-towers", None, "auto"), ("elmo_fast-towers-seq", None, "auto")]
        emit = functools.partial(_emit, results, batch, cfg, V, steps, dev, append)
        for name, graphs, worker in variants:
            if name not in providers:
                continue
            towers = name.startswith("elmo_fast-towers")
            if towers and batch % configs.ORIGINAL_TOWERS:
                print(f"bench_train: {name} needs --batch divisible by {configs.ORIGINAL_TOWERS}; skipped")
                continue
            run_cfg = dataclasses.replace(cfg, data_worker=worker)
            if towers:
                run_cfg = dataclasses.replace(run_cfg, towers=configs.ORIGINAL_TOWERS,
                                              batch_size=batch // configs.ORIGINAL_TOWERS,
                                              fuse_towers="off" if name.endswith("-seq") else "on")
            tr = None
            with common.env_var("ELMO_FAST_LOOP_GRAPHS", graphs), \
                    common.env_var("ELMO_FAST_LSTMP_PDL", "1" if name.endswith("-pdl") else None):
                try:
                    with emit(name):  # the row written as soon as it is timed, before the profile
                        tr = Trainer(run_cfg, vocab, [str(f) for f in files], None, tmp, device=dev)
                        results.append(dict(provider=name, **_timed(tr.train_step, steps, rounds, warmup, dev,
                                                                    waited=lambda t=tr: t.data_wait_s)))
                    if profile and name == "elmo_fast" and "error" not in results[-1]:
                        with emit(f"{name}-profile"):  # a row only if it fails
                            common.print_device_profile(f"elmo_fast training step, B={batch}", common.device_profile(
                                tr.train_step, profile, trace=trace))  # no sync a step: as the timed rounds run
                finally:
                    if tr is not None:
                        tr.close()
                    del tr
        if "parts" not in providers:
            return results
        # ---- library parts
        with emit("parts"):
            stream = BidirectionalStream([str(f) for f in files], vocab, batch, cfg.unroll_steps,
                                         cfg.max_characters_per_token, seed=0)
            batches = iter([stream.next_batch() for _ in range(steps + warmup)])
            torch.manual_seed(0)
            model = PartsBiLM(cfg, V).to(dev).train()
            opt = torch.optim.Adagrad(model.parameters(), lr=cfg.learning_rate,
                                      initial_accumulator_value=cfg.initial_accumulator_value)
            states = [[None] * cfg.n_layers, [None] * cfg.n_layers]
            results.append(dict(provider="parts", **_timed(
                lambda: parts_step(model, opt, next(batches), states, cfg.n_negative_samples_batch, V, dev),
                steps, rounds, warmup, dev)))
    return results


@contextlib.contextmanager
def _emit(results, batch, cfg, V, steps, dev, append, name):
    """Around one provider: the row the block appends to ``results`` finished, printed and (``append``) appended to
    the CSV as soon as the block ends, so a run killed at its time cap keeps every provider it timed. An exception
    becomes that provider's row (``error``) and the next provider runs where ``common.keep_going`` allows it (on
    CUDA, the device still answering: a failing opt-in must not take the baseline's numbers with it); on the CPU
    (the smoke test) it propagates."""
    n = len(results)
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - recorded, then the other providers (keep_going re-raises otherwise)
        results.append({"provider": name, "error": common.keep_going(exc, dev)})
    for r in results[n:]:
        if "error" not in r:
            r["tokens_per_s"] = batch * cfg.unroll_steps / (r["ms_per_step"] * 1e-3)
        r.update({"shape": f"2x{cfg.lstm_dim}_{cfg.projection_dim} B{batch} T{cfg.unroll_steps} "
                           f"S{cfg.n_negative_samples_batch} V{V}", "steps": steps})
        _print_row(r)
        if append:
            common.append_rows_or_say("train", [r])


def _print_row(r) -> None:
    if "error" in r:
        print(f"{r['provider']:>15}: FAILED ({r['error']})", flush=True)
        return
    print(f"{r['provider']:>15}: {r['tokens_per_s']:10.0f} tokens/s  {r['ms_per_step']:8.1f} ms/step (median "
          f"round; rounds {r['round_ms']} ms/step; {r['compiles_timed']} Triton compiles in them)  "
          f"peak {r['peak_mem_mib']:.0f} MiB  data wait {r['data_wait']:.1%}  [{r['shape']}]", flush=True)


def _report(results):
    """The speedups over the library parts (each provider's row was printed and appended as it was measured)."""
    parts = next((r for r in results if r["provider"] == "parts" and "error" not in r), None)
    for r in results:
        if parts is not None and r is not parts and "error" not in r:
            print(f"speedup {r['provider']} / parts: {r['tokens_per_s'] / parts['tokens_per_s']:.2f}x")


@pytest.mark.gpu
def test_bench_train_gpu():
    res = run()
    _report(res)
    assert not [r for r in res if "error" in r]


def test_bench_train_smoke_cpu():
    """Both loops run (2 steps, tiny model, reference backend) so the benchmark cannot rot without a GPU."""
    cfg = configs.tiny()
    cfg.backend = "reference"
    res = run(steps=2, vocab_size=200, batch=4, cfg=cfg, n_tokens=5000, warmup=1, device="cpu", profile=1,
              append=False)
    assert [r["provider"] for r in res] == ["elmo_fast", "parts"]
    assert all(r["tokens_per_s"] > 0 and len(r["round_ms"].split()) == 2 for r in res)
    assert 0.0 <= res[0]["data_wait"] <= 1.0 and res[1]["data_wait"] != res[1]["data_wait"]  # parts: NaN, no worker
    res = run(steps=2, vocab_size=200, batch=6, cfg=cfg, n_tokens=5000, warmup=1, device="cpu",
              providers=("elmo_fast-towers", "elmo_fast-towers-seq"), append=False)
    assert [r["provider"] for r in res] == ["elmo_fast-towers", "elmo_fast-towers-seq"]
    assert all(r["tokens_per_s"] > 0 for r in res) and cfg.towers == 1  # the towers set on a copy of the config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per provider, over --rounds rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--providers", default="elmo_fast,elmo_fast-eager,parts",
                    help="any of elmo_fast, elmo_fast-eager, elmo_fast-thread-data, elmo_fast-pdl (these three GPU "
                         "only), elmo_fast-towers (3 towers of --batch / 3 rows, fused), elmo_fast-towers-seq (the "
                         "same one after the other), parts")
    ap.add_argument("--profile", type=int, default=0, help="then profile this many elmo_fast steps")
    ap.add_argument("--trace", help="with --profile: write the profiled steps' Chrome trace here, gzipped")
    ap.add_argument("--vocab", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--config", default="original")
    a = ap.parse_args(argv)
    try:  # checked before anything runs: a short lease cannot lose a step to a typo
        a.providers = common.comma_list("--providers", a.providers, PROVIDERS)
    except ValueError as exc:
        ap.error(str(exc))
    if a.trace and not a.profile:
        ap.error("--trace writes the profiled steps' trace: give --profile N too")
    if not torch.cuda.is_available():
        print("bench_train: no CUDA GPU; nothing to measure (the CPU smoke test is `pytest bench/bench_train.py`)")
        return 0
    cfg = configs.load_config(a.config)
    if a.config == "original":
        cfg.towers = 1  # one tower of --batch rows a step (the preset has bilm-tf's 3)
    res = run(a.steps, a.vocab, a.batch, cfg, warmup=a.warmup, rounds=a.rounds, providers=a.providers,
              profile=a.profile, trace=a.trace)
    _report(res)
    return 1 if any("error" in r for r in res) else 0  # every provider ran; the step still says one failed


if __name__ == "__main__":
    sys.exit(main())
