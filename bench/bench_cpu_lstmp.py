"""One LSTMP chain on the CPU, 2 threads, fp32: the cpu backend against nn.LSTM(proj_size) and the GEMM rate.

Shape (issue 13): B=32, T=20, 512 -> 4096 -> 512, cell and projection clip 3, residual, all rows full length.
Providers, timed in the same run, in turn (one call of each per round; a provider's time is its best round, since
the machine may be shared):

* ``mm``: a 2048^3 ``torch.mm`` (MKL), the machine's fp32 GEMM rate in this run (issue 13's yardstick);
* ``mm-onednn``: the same product through oneDNN's matmul (where torch has oneDNN): on a CPU where MKL takes a
  slower code path (an AMD EPYC with AVX-512: 219 against 439 GFLOP/s) ``pct_of_best_gemm`` divides by the faster;
* ``cpu``: ``elmo_fast.cpu.lstmp_cpu`` (packed weights cached across calls, as the model runs it), forward under
  ``torch.no_grad`` and forward+backward (every gradient, random upstream gradients on all three outputs);
* ``nn.LSTM``: ``torch.nn.LSTM(512, 4096, proj_size=512)``, the same two modes (no clipping, no lengths: a
  slightly different function; a speed bar);
* ``cpu-bf16``: the opt-in bf16 inference of the cpu backend (forward only; where the CPU has AMX/AVX512-BF16).

FLOP (multiply-add = 2): forward 2·(D·4H + P·4H + H·P) per token, forward+backward 3x that. With
``--keep-freed-memory`` the process runs with ``elmo_fast.cpu.memory.keep_freed_memory()`` (large freed buffers
stay in the heap), as elmo_fast's trainer does; it applies to every provider (nn.LSTM's backward gains most).
The weights do not change between calls, as in inference; in training they do, so the cpu backend's
forward+backward packs nothing from one call to the next (see elmo_fast/cpu/lstmp.py).

    .venv/bin/python bench/bench_cpu_lstmp.py [--rounds 5] [--batch 32] [--keep-freed-memory]   # + cpu_lstmp.csv
        [--variant ELMO_FAST_CPU_TRAIN_PACK=0]   # + the cpu provider with that switch, in the same rounds
    .venv/bin/python -m pytest bench/bench_cpu_lstmp.py --benchmark-only -s

Both append to build/bench/cpu_lstmp.csv, or to the committed bench/results/cpu_lstmp.csv with
``ELMO_FAST_BENCH_RECORD=1`` (bench/common.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_lstmp import flop_per_token, fwd_bwd, make_chain, run_chain  # noqa: E402

from elmo_fast.cpu import lstmp_cpu  # noqa: E402
from elmo_fast.cpu.gemm import gemm  # noqa: E402
from elmo_fast.cpu.memory import keep_freed_memory  # noqa: E402
from elmo_fast.cpu.packed import PackedWeightCache, bf16_supported, onednn_enabled  # noqa: E402

N_THREADS = 2
DIMS = dict(D=512, H=4096, P=512)
FIELDS = ["provider", "mode", "B", "T", "ms", "gflops", "pct_of_mm", "pct_of_best_gemm", "speedup_vs_nn_lstm", "malloc",
          "rounds", "load1", "date", "device", "torch", "commit", "command"]


def providers(B: int, T: int, variants=()):
    """name -> (mode, FLOP, callable) for one round; each (NAME, VALUE) of ``variants`` adds the cpu provider run
    with that environment variable (``cpu[NAME=VALUE]``)."""
    D, H, P = DIMS["D"], DIMS["H"], DIMS["P"]
    chain = make_chain(B, T, dtype=torch.float32, device="cpu", requires_grad=True, **DIMS)
    up = [torch.randn(B, T, P), torch.randn(B, P), torch.randn(B, H)]
    cache, cache16 = PackedWeightCache(), PackedWeightCache()
    lstm = torch.nn.LSTM(D, H, proj_size=P, batch_first=True)

    def cpu(*a, **k):
        return lstmp_cpu(*a, weight_cache=cache, **k)

    def cpu16(*a, **k):
        return lstmp_cpu(*a, weight_cache=cache16, bf16=True, **k)

    def nn_lstm(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, **_):
        y, (hn, cn) = lstm(x, (h0.unsqueeze(0), c0.unsqueeze(0)))
        return y, hn[0], cn[0]

    def no_grad(fn):
        def call():
            with torch.no_grad():
                run_chain(fn, chain)
        return call

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    fwd = flop_per_token(D, H, P) * B * T
    out = {"mm": ("gemm", 2 * 2048**3, lambda: torch.mm(a, b))}
    if onednn_enabled():  # the same product through oneDNN's matmul: on some CPUs MKL's code path is not the fastest
        out["mm-onednn"] = ("gemm", 2 * 2048**3, common.with_env(lambda: gemm(a, b), "ELMO_FAST_CPU_GEMM", "onednn"))
    out |= {
           "cpu fwd": ("fwd", fwd, no_grad(cpu)), "nn.LSTM fwd": ("fwd", fwd, no_grad(nn_lstm)),
           "cpu fwd+bwd": ("fwd+bwd", 3 * fwd, lambda: fwd_bwd(cpu, chain, up)),
           "nn.LSTM fwd+bwd": ("fwd+bwd", 3 * fwd, lambda: fwd_bwd(nn_lstm, chain, up))}
    if bf16_supported():
        out["cpu-bf16 fwd"] = ("fwd", fwd, no_grad(cpu16))
    for name, value in variants:
        tag = f"cpu[{name}={value}]"
        out[f"{tag} fwd"] = ("fwd", fwd, common.with_env(no_grad(cpu), name, value))
        out[f"{tag} fwd+bwd"] = ("fwd+bwd", 3 * fwd, common.with_env(lambda: fwd_bwd(cpu, chain, up), name, value))
    return out


def run(B: int = 32, T: int = 20, rounds: int = 5, keep_freed: bool = False, variants=()) -> list[dict]:
    torch.set_num_threads(N_THREADS)
    if keep_freed:  # as elmo_fast's trainer runs on the CPU; every provider in this process benefits
        keep_freed_memory()
    warnings.filterwarnings("ignore", message="LSTM with projections is not supported with oneDNN")
    provs = providers(B, T, variants)
    best = common.best_times({name: fn for name, (_, _, fn) in provs.items()}, rounds)  # warm-up: packing, allocations
    mm_rate = provs["mm"][1] / best["mm"]
    best_gemm = max(provs[k][1] / best[k] for k in ("mm", "mm-onednn") if k in best)
    rows = []
    for name, (mode, flop, _) in provs.items():
        rate = flop / best[name]
        base = f"nn.LSTM {mode}"
        rows.append({"provider": name.rsplit(" ", 1)[0], "mode": mode, "B": B, "T": T, "ms": round(1e3 * best[name], 2),
                     "gflops": round(rate / 1e9, 1), "pct_of_mm": round(100 * rate / mm_rate, 1),
                     "pct_of_best_gemm": round(100 * rate / best_gemm, 1),
                     "speedup_vs_nn_lstm": round(best[base] / best[name], 2) if base in best else "",
                     "malloc": "keep-freed" if keep_freed else "default", "rounds": rounds,
                     "load1": round(os.getloadavg()[0], 2)})
    return rows


def report(rows: list[dict]) -> None:
    def line(r):
        vs = f"{r['speedup_vs_nn_lstm']}x nn.LSTM" if r["speedup_vs_nn_lstm"] else ""
        return (f"{r['provider']:>9} {r['mode']:>8}: {r['ms']:9.2f} ms {r['gflops']:7.1f} GFLOP/s "
                f"({r['pct_of_mm']:5.1f}% of mm, {r['pct_of_best_gemm']:5.1f}% of the faster 2048^3 GEMM) {vs}  load1 "
                f"{r['load1']}")
    common.report_rows("cpu_lstmp", rows, line, FIELDS)


def test_bench_cpu_lstmp(benchmark):
    rows = benchmark.pedantic(run, rounds=1, iterations=1)
    report(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--keep-freed-memory", action="store_true", help="glibc keeps freed large buffers (as the trainer)")
    ap.add_argument("--variant", action="append", metavar="NAME=VALUE",
                    help="also time the cpu provider with this ELMO_FAST_* variable set (repeatable)")
    a = ap.parse_args(argv)
    report(run(a.batch, 20, a.rounds, a.keep_freed_memory, common.parse_variants(a.variant)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
