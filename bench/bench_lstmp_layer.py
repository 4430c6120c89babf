"""``elmo_fast.LSTMP`` beside ``torch.nn.LSTM(proj_size)``: the drop-in layer against the layer it replaces.

Shape (issue 14): B=32, T=20, input 512 -> cell 4096 -> projection 512, bidirectional, 2 layers (4 chains; the
second layer reads the 1024-wide concatenation), time-major input, no clipping, forget bias 0 (nn.LSTM's
function: both compute the same thing, tests/test_lstmp_layer.py). Both modules hold the same weights.

Modes, for each provider:

* ``fwd``: ``torch.no_grad``, eval mode (inference);
* ``fwd+bwd``: forward, then backward of random upstream gradients on output, h_n and c_n (every parameter's and
  the input's gradient); the weights are unchanged between calls, so LSTMP reuses its TF-layout copies;
* ``fwd+bwd new-weights``: the same after an in-place ``mul_(1)`` of every parameter before each call (both
  providers), as after an optimizer step: LSTMP converts its layouts again (counted in its time).

CPU (``--device cpu``, 2 threads): mode after mode, the providers run in turn, one call each per round, and a
provider's time is its best round (the machine may be shared). pytest-benchmark runs the same calls:
``.venv/bin/python -m pytest bench/bench_lstmp_layer.py --benchmark-only`` (``ELMO_FAST_BENCH_ROUNDS``, default 3).
GPU (``--device cuda``): ``triton.testing.do_bench`` (median, p20, p80); LSTMP's backend is ``auto`` (the
Triton kernels behind their self-check; ``--backend`` to choose), nn.LSTM is cuDNN; ``--dtype bfloat16`` runs
both under ``torch.autocast``.

    .venv/bin/python bench/bench_lstmp_layer.py [--rounds 5] [--device cpu|cuda] [--dtype float32|bfloat16]
                                                [--backend auto]                     # -> lstmp_layer.csv

The CSV is ``--out``, else build/bench/lstmp_layer.csv, or the committed bench/results/lstmp_layer.csv with
``ELMO_FAST_BENCH_RECORD=1`` (bench/common.py).

FLOP (multiply-add = 2) per token and direction, forward: 2·(D_l·4H + P·4H + H·P) summed over the layers
(D_0 = 512, D_1 = 1024); forward+backward counted as 3x forward.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import elmo_fast  # noqa: E402

N_THREADS = 2
SHAPE = dict(B=32, T=20, D=512, H=4096, P=512, layers=2)
MODES = ("fwd", "fwd+bwd", "fwd+bwd new-weights")
FIELDS = ["provider", "mode", "B", "T", "D", "H", "P", "layers", "dtype", "backend", "ms", "ms_p20", "ms_p80",
          "gflops", "speedup_vs_nn_lstm", "rounds", "load1", "date", "device", "torch", "triton", "cuda", "commit",
          "command"]


def flop(B: int, T: int, D: int, H: int, P: int, layers: int, mode: str) -> int:
    fwd = sum(2 * ((D if layer == 0 else 2 * P) * 4 * H + P * 4 * H + H * P) for layer in range(layers))
    return 2 * fwd * B * T * (1 if mode == "fwd" else 3)  # two directions


def providers(device: str, dtype: torch.dtype, backend: str, seed: int = 0) -> dict:
    """name -> module; the same weights in both."""
    s = SHAPE
    torch.manual_seed(seed)
    lstm = torch.nn.LSTM(s["D"], s["H"], s["layers"], bidirectional=True, proj_size=s["P"], device=device)
    return {"nn.LSTM": lstm, "LSTMP": elmo_fast.LSTMP.from_lstm(lstm, backend=backend)}


def calls(modules: dict, device: str, dtype: torch.dtype) -> dict:
    """(provider, mode) -> a callable running one call."""
    s = SHAPE
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s["T"], s["B"], s["D"], generator=g).to(device)
    up = [torch.randn(s["T"], s["B"], 2 * s["P"], generator=g).to(device),
          torch.randn(2 * s["layers"], s["B"], s["P"], generator=g).to(device),
          torch.randn(2 * s["layers"], s["B"], s["H"], generator=g).to(device)]
    def cast():
        return torch.autocast(device, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    def forward(m):
        def call():
            with torch.no_grad(), cast():
                m.eval()(x)
        return call

    def forward_backward(m, touch: bool):
        params = list(m.parameters())
        xg = x.clone().requires_grad_()

        def call():
            if touch:
                with torch.no_grad():
                    torch._foreach_mul_(params, 1.0)  # bumps every version counter, changes no value
            with cast():
                y, (h, c) = m.train()(xg)
            torch.autograd.backward([y, h, c], [u.to(o.dtype) for u, o in zip(up, (y, h, c))])
            for p in (*params, xg):
                p.grad = None
        return call

    out = {}
    for name, m in modules.items():
        out[(name, "fwd")] = forward(m)
        out[(name, "fwd+bwd")] = forward_backward(m, touch=False)
        out[(name, "fwd+bwd new-weights")] = forward_backward(m, touch=True)
    return out


def _cpu_times(fns: dict, rounds: int) -> dict:
    """Best of ``rounds`` per call: mode after mode, the providers in turn each round (after one warm-up call
    each). Modes are not interleaved: a ``new-weights`` call changes the weights, which would make every
    inference call after it a first call (LSTMP converts and packs its weights again)."""
    best = {}
    for mode in MODES:
        best.update(common.best_times({k: fn for k, fn in fns.items() if k[1] == mode}, rounds))
    return {k: (1e3 * v, math.nan, math.nan) for k, v in best.items()}


def run(device: str = "cpu", dtype: torch.dtype = torch.float32, backend: str = "auto", rounds: int = 5) -> list:
    if device == "cpu":
        torch.set_num_threads(N_THREADS)
    warnings.filterwarnings("ignore", message="LSTM with projections is not supported with oneDNN")
    fns = calls(providers(device, dtype, backend), device, dtype)
    times = (_cpu_times(fns, rounds) if device == "cpu"
             else {k: common.gpu_time_ms(fn) for k, fn in fns.items()})
    s = SHAPE
    rows = []
    for (name, mode), (ms, p20, p80) in times.items():
        base = times[("nn.LSTM", mode)][0]
        rows.append({"provider": name, "mode": mode, **{k: s[k] for k in ("B", "T", "D", "H", "P", "layers")},
                     "dtype": str(dtype).removeprefix("torch."), "backend": backend if name == "LSTMP" else "",
                     "ms": round(ms, 2), "ms_p20": round(p20, 2), "ms_p80": round(p80, 2),
                     "gflops": round(flop(**s, mode=mode) / ms / 1e6, 1),
                     "speedup_vs_nn_lstm": round(base / ms, 2), "rounds": rounds if device == "cpu" else "",
                     "load1": round(os.getloadavg()[0], 2)})
    return rows


def report(rows: list[dict], path=None) -> None:
    common.report_rows("lstmp_layer", rows, lambda r: f"{r['provider']:>8} {r['mode']:>20}: {r['ms']:9.2f} ms "
                       f"{r['gflops']:7.1f} GFLOP/s {r['speedup_vs_nn_lstm']:5.2f}x nn.LSTM  load1 {r['load1']}",
                       FIELDS, path)


# ------------------------------------------------------------------------------------- pytest-benchmark (CPU)
_CALLS: dict = {}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", ["LSTMP", "nn.LSTM"])
def test_bench_lstmp_layer(benchmark, provider, mode):
    torch.set_num_threads(N_THREADS)
    warnings.filterwarnings("ignore", message="LSTM with projections is not supported with oneDNN")
    if not _CALLS:
        _CALLS.update(calls(providers("cpu", torch.float32, "auto"), "cpu", torch.float32))
    rounds = common.env_rounds(3)
    benchmark.pedantic(_CALLS[(provider, mode)], rounds=rounds, iterations=1, warmup_rounds=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", help="CSV to append to (default: lstmp_layer.csv where bench/common.py's "
                    "results_dir() says)")
    a = ap.parse_args(argv)
    # fp32 is fp32 on both sides: cuDNN's LSTM would take TF32 tensor cores by default (on the H200, 2026-11-26,
    # nn.LSTM fp32 ran at 41.8 TFLOP/s, with TF32 on), while elmo_fast's fp32 products are IEEE
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report(run(a.device, getattr(torch, a.dtype), a.backend, a.rounds), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
