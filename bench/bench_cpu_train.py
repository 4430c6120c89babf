"""CPU pretraining step, 2 threads, fp32: elmo_fast's Trainer against the same step composed from AllenNLP 2.10.1.

* ``elmo_fast``: ``Trainer.train_step`` as ``elmo-fast train`` runs it (backend auto = cpu): background data
  thread, token encoder with each distinct token once, the four LSTMP chains with their own backward, sampled
  softmax with sparse rows, global-norm clipping, TF Adagrad.
* ``allennlp``: the bilm-tf step from AllenNLP's modules: ``_ElmoCharacterEncoder`` on each stream (its
  convolutions, highway and projection; the <S>/</S> insertion is skipped so both encode the same tokens),
  ``ElmoLstm``'s forward layers on the forward stream and its backward layers on the reversed one (states carried
  between steps, residual from layer 1, dropout on layer inputs as bilm-tf), ``SampledSoftmaxLoss(sparse=True)``
  once per direction, ``clip_grad_norm_`` and ``torch.optim.Adagrad`` (lr 0.2, accumulator 1.0). Its batches are
  packed before timing (it does not pay for data loading): the comparison favours it.

Matched work: the original sizes (2048-filter CNN, 2 highway, 2 x LSTMP 4096/512 per direction), B rows x 20 steps
per direction, 8,192 samples, a Zipf-distributed corpus (p(w_k) ~ 1/k) over 50,000 words. tokens/s counts B x 20
per step (one direction, as bilm-tf logs it). Rounds alternate the two providers; each provider's time is the
best round's mean step time (the machine may be shared).

    .venv-allennlp/bin/python bench/bench_cpu_train.py --batch 4,8,16,32    # table + cpu_train.csv
    .venv-allennlp/bin/python -m pytest bench/bench_cpu_train.py --benchmark-only -s   # B=16 (the issue's shape)
    .venv-allennlp/bin/python bench/bench_cpu_train.py --profile 2 --batch 16   # where each step's time goes

Rows go to build/bench/cpu_train.csv, or to the committed bench/results/cpu_train.csv with
``ELMO_FAST_BENCH_RECORD=1`` (bench/common.py).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_train import synthetic_corpus  # noqa: E402

from elmo_fast.chars import Vocabulary  # noqa: E402
from elmo_fast.testing import ORIGINAL_OPTIONS, write_random_model  # noqa: E402
from elmo_fast.training import configs  # noqa: E402
from elmo_fast.training.data import BidirectionalStream, build_vocab, count_tokens  # noqa: E402
from elmo_fast.training.trainer import Trainer  # noqa: E402

try:
    from allennlp.modules.elmo import _ElmoCharacterEncoder
    from allennlp.modules.elmo_lstm import ElmoLstm
    from allennlp.modules.sampled_softmax_loss import SampledSoftmaxLoss
except ImportError:  # the project's own venv: elmo_fast alone
    _ElmoCharacterEncoder = None

N_THREADS = 2
N_WORDS = 50_000
N_TOKENS = 400_000  # the synthetic corpus
FIELDS = ["provider", "B", "T", "S", "V", "tokens_per_s", "ms_per_step", "speedup", "steps", "rounds", "load1",
          "date", "device", "torch", "commit", "command"]


class AllenNLPStep:
    """The bilm-tf training step from AllenNLP 2.10.1 modules (see the module docstring)."""

    def __init__(self, cfg: configs.TrainConfig, V: int, options_file: str, weight_file: str):
        P, H, L = cfg.projection_dim, cfg.lstm_dim, cfg.n_layers
        self.cfg, self.L = cfg, L
        self.encoder = _ElmoCharacterEncoder(options_file, weight_file, requires_grad=True)
        self.lstm = ElmoLstm(P, P, H, L, requires_grad=True, memory_cell_clip_value=cfg.cell_clip,
                             state_projection_clip_value=cfg.proj_clip)
        self.softmax = SampledSoftmaxLoss(V, P, cfg.n_negative_samples_batch, sparse=True)
        self.params = [p for m in (self.encoder, self.lstm, self.softmax) for p in m.parameters() if p.requires_grad]
        self.opt = torch.optim.Adagrad(self.params, lr=cfg.learning_rate,
                                       initial_accumulator_value=cfg.initial_accumulator_value)
        self.states = [[None] * L, [None] * L]

    def encode(self, chars: torch.Tensor) -> torch.Tensor:
        """``_ElmoCharacterEncoder.forward`` without the <S>/</S> insertion: (B, T, 50) ids -> (B, T, P)."""
        enc = self.encoder
        B, T, Lc = chars.shape
        x = F.embedding(chars.reshape(-1, Lc), enc._char_embedding_weights).transpose(1, 2)
        act = torch.tanh if enc._options["char_cnn"]["activation"] == "tanh" else F.relu
        x = torch.cat([act(getattr(enc, f"char_conv_{i}")(x).max(-1)[0]) for i in range(len(enc._convolutions))], -1)
        return enc._projection(enc._highways(x)).view(B, T, -1)

    def direction(self, x: torch.Tensor, k: int) -> torch.Tensor:
        p, B, T = self.cfg.dropout, x.shape[0], x.shape[1]
        name = ("forward", "backward")[k]
        for layer in range(self.L):
            inp = F.dropout(x, p, training=True)
            y, st = getattr(self.lstm, f"{name}_layer_{layer}")(inp, [T] * B, self.states[k][layer])
            self.states[k][layer] = tuple(s.detach() for s in st)
            x = y + inp if layer > 0 else y
        return F.dropout(x, p, training=True)

    def step(self, batch: dict) -> torch.Tensor:
        cf = torch.as_tensor(batch["tokens_characters"]).long()
        cb = torch.as_tensor(batch["tokens_characters_reverse"]).long()
        B, T = cf.shape[:2]
        e = self.encode(torch.cat([cf, cb]))
        top_f = self.direction(e[:B], 0)
        top_b = self.direction(e[B:].flip(1), 1).flip(1)
        losses = [self.softmax(top.reshape(-1, top.shape[-1]), torch.as_tensor(batch[key]).reshape(-1)) / (B * T)
                  for top, key in ((top_f, "next_token_id"), (top_b, "next_token_id_reverse"))]
        loss = 0.5 * (losses[0] + losses[1])
        self.opt.zero_grad(set_to_none=True)
        (loss * T).backward()
        clip_global_norm(self.params, self.cfg.all_clip_norm_val)
        self.opt.step()
        return loss.detach()


@torch.no_grad()
def clip_global_norm(params, max_norm: float) -> None:
    """Global-norm clipping over dense and sparse gradients (torch's clip_grad_norm_ refuses sparse ones)."""
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            p.grad = p.grad.coalesce()
    vals = [p.grad._values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(vals)))
    torch._foreach_mul_(vals, torch.clamp(max_norm / norm, max=1.0))


def _setup(tmp: str, batch: int, n_tokens: int):
    torch.set_num_threads(N_THREADS)
    synthetic_corpus(tmp, N_WORDS, n_tokens, seed=0)
    files = sorted(str(f) for f in Path(tmp).glob("train-*.txt"))
    counts, _, n_tok, _ = count_tokens(files)
    # all 50,000 words in frequency (= Zipf rank) order, seen in this sample or not
    vocab = Vocabulary(words=build_vocab(counts)[:3] + [f"w{i}" for i in range(N_WORDS)])
    cfg = configs.original()
    cfg.towers = 1  # one tower of `batch` rows a step (the preset is bilm-tf's 3)
    cfg.batch_size, cfg.n_train_tokens, cfg.device, cfg.backend = batch, n_tok, "cpu", "auto"
    return cfg, vocab, files


def _finite(step):
    def call():
        loss = step()
        assert math.isfinite(float(loss)), loss
    return call


@functools.lru_cache(maxsize=None)
def _random_model(tmp: str) -> tuple[str, str]:
    """The original-size random model AllenNLP's modules load, written once per temporary directory."""
    return write_random_model(os.path.join(tmp, "model"), ORIGINAL_OPTIONS, seed=0)


@contextlib.contextmanager
def providers_for(tmp: str, B: int, n_batches: int, variants=()):
    """The timed callables for batch size ``B``: elmo_fast's trainer step (and one per variant) and, where allennlp
    imports, the composition's step over ``n_batches`` pre-packed batches. Closes the trainer on exit."""
    cfg, vocab, files = _setup(tmp, B, N_TOKENS)
    V = len(vocab)
    trainer = Trainer(cfg, vocab, files, None, os.path.join(tmp, f"run{B}"), device=torch.device("cpu"))
    try:
        providers = {"elmo_fast": _finite(trainer.train_step)}
        for name, value in variants:
            providers[f"elmo_fast[{name}={value}]"] = _finite(common.with_env(trainer.train_step, name, value))
        if _ElmoCharacterEncoder is not None:
            allen = AllenNLPStep(cfg, V, *_random_model(tmp))
            stream = BidirectionalStream(files, vocab, B, cfg.unroll_steps, cfg.max_characters_per_token, seed=1)
            batches = iter([stream.next_batch() for _ in range(n_batches)])
            providers["allennlp"] = _finite(lambda: allen.step(next(batches)))
        yield cfg, V, providers
    finally:
        trainer.close()


def run(batches=(16,), rounds: int = 3, steps: int = 3, warmup: int = 2, variants=()) -> list[dict]:
    """Alternating rounds of both providers per batch size; returns one row per (provider, B). Each (NAME, VALUE)
    of ``variants`` adds ``elmo_fast[NAME=VALUE]``: the same trainer's steps with that environment variable set."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for B in batches:
            with providers_for(tmp, B, warmup + rounds * steps, variants) as (cfg, V, providers):
                best = common.best_times(providers, rounds, warmup=warmup, calls=steps)
            for name, t in best.items():
                rows.append({"provider": name, "B": B, "T": cfg.unroll_steps, "S": cfg.n_negative_samples_batch,
                             "V": V, "tokens_per_s": round(B * cfg.unroll_steps / t, 1),
                             "ms_per_step": round(1000 * t, 1), "steps": steps, "rounds": rounds,
                             "load1": round(os.getloadavg()[0], 2)})
            if "allennlp" in best:
                for r in rows[-len(best):]:
                    if r["provider"] != "allennlp":
                        r["speedup"] = round(best["allennlp"] / best[r["provider"]], 2)
    return rows


def profile(B: int = 16, steps: int = 2, warmup: int = 2, top: int = 25, variants=()) -> dict[str, list[dict]]:
    """Each provider's step under torch.profiler after ``warmup`` steps: the ``top`` ops by self time per step,
    grouped by input shapes (common.op_profile). Nothing is written to the results."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        with providers_for(tmp, B, warmup + steps, variants) as (_, _, providers):
            for name, step in providers.items():
                for _ in range(warmup):
                    step()
                out[name] = common.op_profile(step, steps, top)
    return out


def report(rows: list[dict]) -> None:
    common.report_rows("cpu_train", rows, lambda r: (
        f"{r['provider']:>10} B={r['B']:<3} {r['tokens_per_s']:8.1f} tokens/s {r['ms_per_step']:9.1f} ms/step"
        f"  {('speed-up ' + str(r['speedup']) + 'x') if r.get('speedup') else ''}  load1 {r['load1']}"), FIELDS)


@pytest.mark.skipif(_ElmoCharacterEncoder is None, reason="allennlp not importable (run from .venv-allennlp)")
def test_bench_cpu_train(benchmark):
    rows = benchmark.pedantic(run, kwargs=dict(batches=(16,)), rounds=1, iterations=1)
    report(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="16", help="comma-separated batch sizes (rows per direction)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variant", action="append", metavar="NAME=VALUE",
                    help="also time elmo_fast's step with this ELMO_FAST_* variable set (repeatable)")
    ap.add_argument("--profile", type=int, metavar="STEPS", default=0,
                    help="instead of timing: profile STEPS steps of each provider at the first --batch size and "
                         "print where the time goes (self time per step by op and input shapes)")
    ap.add_argument("--top", type=int, default=25, help="rows of each --profile table")
    a = ap.parse_args(argv)
    batches, variants = tuple(int(b) for b in a.batch.split(",")), common.parse_variants(a.variant)
    if a.profile:
        for name, rows in profile(batches[0], a.profile, top=a.top, variants=variants).items():
            common.print_op_profile(f"{name} B={batches[0]}", rows)
        return 0
    report(run(batches, a.rounds, a.steps, variants=variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
