"""Kernel launches, host syncs and pageable uploads per biLM forward and per training step.

    TRITON_INTERPRET=1 python bench/bench_launches.py          # on the CPU (counts only; no GPU needed)
    python bench/bench_launches.py                              # on a GPU: the same counts, compiled kernels

Counted with ``elmo_fast.probes.probe`` (Triton launches by wrapping the launch path; syncs and uploads by
patching the calls that make them; torch operator calls beside, each about one more kernel on a GPU):

* ``forward``: ``ElmoBiLM`` inference, batch 1 x 20 tokens (22 LSTM steps with the boundaries), eager;
* ``forward-graph`` (GPU only): the same call replayed from a CUDA graph (``cuda_graph=True``);
* ``train-step``: one ``Trainer.train_step`` at the original configuration's structure (2 layers, 7 filter
  widths, 2 highway layers, 20 steps, the sampled softmax of both directions in one grouped call);
* ``train-step-det``: the same in deterministic mode (``deterministic: true``, ``elmo_fast.determinism``);
* ``train-step-loop-graphs``: ``train-step`` with the LSTMP time loops replayed from loop graphs (the GPU default,
  ``kernels/lstmp_graphs.py``; on the CPU their ``record`` stand-in, whose replay counts as one launch, as a
  CUDA graph's does). The other cases run with loop graphs off (``ELMO_FAST_LOOP_GRAPHS=0``): every launch, but
* ``train-step-towers3``: ``--config original``'s step on one GPU, its 3 towers in one pass (``fuse_towers``), with
  loop graphs: the launches of one tower's step (the towers share every launch, the softmax's included), a
  sample-set sync per tower and direction on the CPU (on a GPU the data worker draws them ahead).

The counts depend on the structure (layers, steps, filter groups), not on the widths, so the model runs at
small widths (fast under the interpreter); the structure is the original model's. Backend ``triton``.
``BUDGET`` holds the design's counts: ceilings for syncs and uploads, the exact number of launches
(tests/test_launch_budget.py holds the code to them). Rows go to build/bench/launches.csv, or to the committed
bench/results/launches.csv with ``ELMO_FAST_BENCH_RECORD=1`` (bench/common.py).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import elmo_fast  # noqa: E402
from elmo_fast.probes import probe  # noqa: E402
from elmo_fast.testing import ORIGINAL_OPTIONS, write_random_model  # noqa: E402

# Ceilings of this design: what the code makes, counted under the interpreter (TRITON_INTERPRET=1 python
# bench/bench_launches.py; before this design, at d7c2cef, the same probe counted: forward 179 launches, 11 syncs,
# 4 pageable uploads; training step 335 launches, 20 syncs, 12 uploads).
# * forward: 4 chains x 22 steps x 3 launches (cell, split-K projection, ordered reduce: kernels/lstmp.py) + char
#   CNN + 2 highway = 267 Triton launches (a CUDA-graph replay makes them one); 2 syncs, both once per call:
#   the char-id range check before any work (models/elmo.py: one aminmax read on the host) and the token
#   encoder's deduplication (torch.unique sizes its output on the host; the graph path encodes every token
#   instead); no upload (constants are uploaded once and reused).
# * train-step: 509 launches (4 chains x (20 steps x 6 (3 fwd + 3 bwd) + 1 backward prologue) + encoder + 2
#   softmax: its forward and its backward's dlogit kernel, once for both directions (and every tower, fused:
#   ops.sampled_softmax_loss_groups), the backward's GEMMs are cuBLAS; + 12 dropout: 6 sites (4 LSTM inputs, 2
#   top outputs), forward and backward, each one hashed-dropout kernel (kernels/dropout.py; 497 launches and 279
#   torch ops when F.dropout ran there, 267 torch ops since, 276 with the data stream's distinct tokens, 274 with the
#   char CNN's embedded characters (an embedding forward and backward), the highway's bias sums and the batch's
#   char ids left on the host, 2026-11-28)); 2 syncs:
#   the sampler's one per sample set (x2: num_tries is a host int; this count runs the trainer on the CPU, where
#   the step draws its samples itself -- on a GPU the data thread draws them ahead from its CPU generator, off
#   the step: none there); the token encoder's deduplication (torch.unique, 6 syncs a step on the H200) moved to
#   the data stream (BidirectionalStream.next_batch_and_tokens: the batch brings its distinct tokens); no
#   upload (the trainer's batch arrays are pinned by the data thread on a GPU and copied with non_blocking; on the
#   CPU nothing moves).
# * train-step-det: one launch more (the char CNN's window-gradient kernel), no sync more.
# * train-step-loop-graphs: the 4 x 121 LSTMP launches become 4 x 2 replays: 509 - 484 + 8 = 33; no sync more
#   (a replay refills its buffers with device copies).
# * train-step-towers3: the same 33 launches for the 3 towers fused (one pass, one grouped softmax call, one
#   dropout launch a site for the 3 towers' masks); the sampler's sync per sample set, 6 (7 with the
#   deduplication's, before the data stream found the distinct tokens; 31 launches before the grouped softmax
#   call; 21 and 593 torch ops with F.dropout a tower and a cat a site, 527 torch ops then).
BUDGET = {
    "forward": {"launches": 267, "syncs": 2, "uploads": 0},
    "train-step": {"launches": 509, "syncs": 2, "uploads": 0},
    "train-step-det": {"launches": 510, "syncs": 2, "uploads": 0},
    "train-step-loop-graphs": {"launches": 33, "syncs": 2, "uploads": 0},
    "train-step-towers3": {"launches": 33, "syncs": 6, "uploads": 0},
}
STEPS = 20  # the original configuration's unroll steps (and the forward's tokens), at which BUDGET holds
CHAINS = 4


def budget(case: str, steps: int = STEPS) -> dict:
    """BUDGET for ``steps`` tokens (forward) or unroll steps (training) instead of 20: the LSTMP launches scale with
    the steps (3 a forward step, 6 a training step, + 1 backward prologue per chain), the encoder's and the
    softmax's do not, nor do the loop graphs' replays, the syncs or the uploads (the tests run a few steps: the
    interpreter's time grows with every launch)."""
    b = dict(BUDGET[case])
    if case == "forward":
        b["launches"] += CHAINS * 3 * (steps - STEPS)
    elif case in ("train-step", "train-step-det"):
        b["launches"] += CHAINS * 6 * (steps - STEPS)
    return b


def small_original_options() -> dict:
    """The original model's structure (2 layers, 7 filter widths, 2 highway, projections) at small widths."""
    opts = {k: dict(v) for k, v in ORIGINAL_OPTIONS.items()}
    opts["char_cnn"].update(embedding={"dim": 4}, filters=[[w, 4 * w] for w in range(1, 8)])
    opts["lstm"].update(dim=64, projection_dim=16)
    return opts


def measure_forward(device: torch.device, cuda_graph: bool = False, steps: int = STEPS) -> dict:
    words = "the cat sat on the mat and then it ran off to see what the dog had done today .".split()[:steps]
    assert len(words) == steps, f"measure_forward: at most 20 tokens, got steps={steps}"
    with tempfile.TemporaryDirectory() as d:
        model = elmo_fast.ElmoBiLM(*write_random_model(d, small_original_options()), backend="triton",
                                   cuda_graph=cuda_graph).to(device).eval()
    ids = elmo_fast.batch_to_ids([words]).to(device)
    with torch.no_grad(), common.loop_graphs(False, device):
        for _ in range(3 if cuda_graph else 1):  # warm-up (compile, self-check, constants; graph capture)
            model(ids)
        with probe(count_ops=True) as counts:
            model(ids)
    return _row("forward-graph" if cuda_graph else "forward", counts)


@contextlib.contextmanager
def _trainer(device: torch.device, deterministic: bool, steps: int = STEPS, towers: int = 1):
    """A Trainer at the original configuration's structure (small widths, ``steps`` unroll steps) on a tiny
    corpus; ``towers`` > 1: that many towers in one pass (``fuse_towers``), as --config original on one GPU."""
    from elmo_fast.chars import Vocabulary
    from elmo_fast.training import configs
    from elmo_fast.training.trainer import Trainer

    opts = small_original_options()
    cfg = configs.original()
    cfg.towers = towers  # one tower a step by default (the preset is bilm-tf's 3)
    cfg.fuse_towers = "on" if towers > 1 else "off"
    cfg.char_embed_dim = opts["char_cnn"]["embedding"]["dim"]
    cfg.filters = opts["char_cnn"]["filters"]
    cfg.lstm_dim, cfg.projection_dim = opts["lstm"]["dim"], opts["lstm"]["projection_dim"]
    cfg.batch_size, cfg.n_negative_samples_batch, cfg.backend, cfg.check_memory = 2, 64, "triton", False
    cfg.deterministic, cfg.unroll_steps = deterministic, steps
    words = [f"w{i}" for i in range(300)]
    with tempfile.TemporaryDirectory() as d:
        corpus = Path(d) / "train.txt"
        corpus.write_text("\n".join(" ".join(words[(7 * i + j * j) % 300] for j in range(12)) for i in range(400)))
        vocab = Vocabulary(words=["<S>", "</S>", "<UNK>"] + words)
        trainer = Trainer(cfg, vocab, [str(corpus)], None, d, device=device)
        try:
            yield trainer
        finally:
            trainer.close()


def _probed_step(trainer):
    with probe(count_ops=True) as counts:
        trainer.train_step()
    return counts


def measure_train_step(device: torch.device, deterministic: bool = False, graphs: bool = False,
                       steps: int = STEPS, towers: int = 1) -> dict:
    with _trainer(device, deterministic, steps, towers) as trainer, common.loop_graphs(graphs, device):
        for _ in range(2 if graphs else 1):  # warm-up (and the loop graphs' capture)
            trainer.train_step()
        counts = _probed_step(trainer)
    case = "train-step-loop-graphs" if graphs else "train-step-det" if deterministic else "train-step"
    return _row(f"train-step-towers{towers}" if towers > 1 else case, counts)


def measure_train_steps(device: torch.device, steps: int = STEPS) -> dict[str, dict]:
    """``train-step`` and ``train-step-loop-graphs`` from one trainer, in 4 steps instead of 5 (and one trainer
    instead of two): the warm-up step runs with loop graphs on (it is their first sight of the shapes, so it runs
    every launch and compiles), then a probed step with them off, a step that captures them, a probed replay."""
    with _trainer(device, False, steps) as trainer:
        with common.loop_graphs(True, device):
            trainer.train_step()
        with common.loop_graphs(False, device):
            eager = _probed_step(trainer)
        with common.loop_graphs(True, device):
            trainer.train_step()
            graphs = _probed_step(trainer)
    return {"train-step": _row("train-step", eager), "train-step-loop-graphs": _row("train-step-loop-graphs", graphs)}


def _row(case: str, counts) -> dict:
    return {"case": case, "triton_launches": counts.n_launches, "host_syncs": len(counts.syncs),
            "pageable_uploads": len(counts.uploads), "torch_ops": counts.torch_ops,
            "syncs_at": ";".join(sorted(set(counts.syncs))), "uploads_at": ";".join(sorted(set(counts.uploads)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default="forward,forward-graph,train-step,train-step-det,train-step-loop-graphs,"
                    "train-step-towers3")
    ap.add_argument("--steps", type=int, default=STEPS, help="tokens of the forward / unroll steps of the training "
                    "step (the budget scales with them: budget())")
    args = ap.parse_args(argv)
    if not 1 <= args.steps <= STEPS:
        ap.error(f"--steps {args.steps}: expected 1 to {STEPS}")
    dev = torch.device(args.device)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("the Triton kernels run on CPU tensors only under the interpreter: run "
                 "`TRITON_INTERPRET=1 python bench/bench_launches.py` (or run it on a GPU)")
    rows = []
    n = args.steps
    for case in args.cases.split(","):
        if case == "forward-graph" and dev.type != "cuda":
            continue
        fn = {"forward": lambda: measure_forward(dev, steps=n), "forward-graph": lambda: measure_forward(dev, True, n),
              "train-step": lambda: measure_train_step(dev, steps=n),
              "train-step-det": lambda: measure_train_step(dev, deterministic=True, steps=n),
              "train-step-loop-graphs": lambda: measure_train_step(dev, graphs=True, steps=n),
              "train-step-towers3": lambda: measure_train_step(dev, graphs=True, steps=n, towers=3)}[case]
        rows.append(fn())
        if n != STEPS:  # the CSV's case names the step count when it is not the budget's 20
            rows[-1]["case"] += f" ({n} steps)"
        r = rows[-1]
        b = budget(case, n) if case in BUDGET else {}
        print(f"{case:14s} launches {r['triton_launches']:4d} (budget {b.get('launches', '-')})  "
              f"syncs {r['host_syncs']:3d} (budget {b.get('syncs', '-')})  uploads {r['pageable_uploads']:2d}  "
              f"torch ops {r['torch_ops']:5d}  syncs at: {r['syncs_at'] or '-'}", flush=True)
    common.append_rows("launches", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
