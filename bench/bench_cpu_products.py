"""The CPU products a pretraining step is made of, alone: what bounds them on this machine (2 threads, fp32).

Rows (provider, shape, rows B, ms, GFLOP/s, GB/s of weight read):

* ``mm``: a 2048^3 ``torch.mm`` (the machine's GEMM rate now) and ``read``: a sum over a 512 MiB tensor (the read
  bandwidth);
* the three per-step products of an LSTMP chain at the original size, ``h·W_rec`` (512 x 16384),
  ``dz·W_recᵀ`` (16384 x 512) and ``m·W_proj`` (4096 x 512), at B rows: ``packed`` (the weight packed for oneDNN,
  the same weight every call: hot in cache where it fits), ``packed-cold`` (four such weights in turn, as four
  chains' weights are in a step: what the last-level cache cannot hold comes from memory), ``panels`` and
  ``panels-cold`` (the same through elmo_fast._cpu's ``small_mm``, where the CPU has AVX-512; the cpu backend
  takes it for at most 16 rows, and for 17-32 rows where K <= 1024) and ``mm`` (torch.mm on the plain weight, MKL);
* the chain's weight gradient ``[x; h]ᵀ·dz`` (1024 x 320 by 320 x 16384): into a fresh 64 MiB output (``fresh``,
  as autograd's) and into one written before (``out=``): the cost of the fresh pages;
* the step's whole-sequence GEMMs (``WIDE``: input projection, weight gradient, ``dx``, the sampled softmax's
  two) through MKL (``torch.mm``/``addmm``) and through oneDNN's matmul, in turn: what ``elmo_fast.cpu.gemm``
  chooses between.

The per-step products' GB/s column is the weight's bytes over the time: compare it with ``read``'s to see whether
a product is bandwidth bound. ``--small`` shrinks every size (the CI smoke run).

    .venv/bin/python bench/bench_cpu_products.py [--batch 1,4,16,32] [--rounds 8]

Rows go to build/bench/cpu_products.csv, or to the committed bench/results/cpu_products.csv with
``ELMO_FAST_BENCH_RECORD=1`` (bench/common.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from elmo_fast.cpu import gemm, packed  # noqa: E402
from elmo_fast.cpu.packed import PackedLinear  # noqa: E402

N_THREADS = 2
FIELDS = ["provider", "shape", "B", "ms", "gflops", "weight_gbps", "rounds", "date", "device", "torch", "commit",
          "command"]
# (name, K, N) of x (B, K) · W (K, N); a dz·W_recᵀ weight is the transposed view of a row-major W_rec, as the
# backward passes it
PRODUCTS = [("h.W_rec", 512, 16384, False), ("dz.W_rec^T", 16384, 512, True), ("m.W_proj", 4096, 512, False)]
# the whole-sequence GEMMs of a B=16 training step that elmo_fast.cpu.gemm runs through MKL or oneDNN (whichever it
# measures faster): (name, M, K, N, a transposed view, b transposed view, bias)
WIDE = [("in-proj", 320, 512, 16384, False, False, True), ("[x;h]^T.dz", 1024, 320, 16384, True, False, False),
        ("dz.W_in^T", 320, 16384, 512, False, True, False), ("softmax h.W_s^T", 320, 512, 8192, False, True, True),
        ("softmax d^T.[h;1]", 8192, 320, 513, True, False, False)]


def _forced() -> bool:
    """Whether elmo_fast._cpu's small_mm runs here at all (ELMO_FAST_CPU_PANELS=1 and an AVX-512 CPU)."""
    with common.env_var("ELMO_FAST_CPU_PANELS", "1"):
        return packed.panels_apply(torch.empty(1, 1), 1)


def _best(fn, rounds: int) -> float:
    return common.best_times({"f": fn}, rounds, warmup=1)["f"]


def run(batches=(1, 4, 16, 32), rounds: int = 8, small: bool = False) -> list[dict]:
    torch.set_num_threads(N_THREADS)
    s = 16 if small else 1  # --small: every dimension / s
    gen = torch.Generator().manual_seed(0)
    rows = []

    def row(provider, shape, B, t, flops, weight_bytes=0):
        rows.append({"provider": provider, "shape": shape, "B": B, "ms": round(1e3 * t, 3),
                     "gflops": round(flops / t / 1e9, 1) if flops else "",
                     "weight_gbps": round(weight_bytes / t / 1e9, 1) if weight_bytes else "", "rounds": rounds})

    n = 2048 // s
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    row("mm", f"{n}^3", n, _best(lambda: torch.mm(a, b), rounds), 2 * n**3)
    big = torch.randn((128 << 20) // s**2, generator=gen)
    row("read", f"{big.numel() * 4 >> 20} MiB sum", 1, _best(big.sum, rounds), 0, big.numel() * 4)
    del big
    for name, K, N, transposed in PRODUCTS:
        K, N = K // s, N // s
        ws = [torch.randn(N, K, generator=gen).t() if transposed else torch.randn(K, N, generator=gen)
              for _ in range(4)]
        wbytes = K * N * 4
        for B in batches:
            x = torch.randn(B, K, generator=gen)
            shape = f"{B}x{K} . {K}x{N}"
            flops = 2 * B * K * N
            # "packed": oneDNN's pack; "panels": elmo_fast._cpu's small_mm where it runs (the cpu backend takes it for
            # at most 16 rows, or 17-32 rows and K <= 1024: elmo_fast.cpu.packed)
            kinds = [("packed", "0")] + ([("panels", "1")] if _forced() else [])
            for kind, panels in kinds:
                with common.env_var("ELMO_FAST_CPU_PANELS", panels):
                    packs = [PackedLinear(w, B) for w in ws]

                def cold(packs=packs, x=x):
                    for p in packs:
                        p(x)

                for provider, fn, per in ((kind, lambda p=packs[0], x=x: p(x), 1), (f"{kind}-cold", cold, 4)):
                    t = _best(fn, rounds) / per
                    row(f"{name} {provider}", shape, B, t, flops, wbytes)
            row(f"{name} mm", shape, B, _best(lambda w=ws[0], x=x: torch.mm(x, w), rounds), flops, wbytes)
    R, K, N = 320 // s, 1024 // s, 16384 // s
    A, dz = torch.randn(R, K, generator=gen), torch.randn(R, N, generator=gen)
    out = torch.empty(K, N)
    for provider, fn in (("dW fresh", lambda: torch.mm(A.t(), dz)), ("dW out=", lambda: torch.mm(A.t(), dz, out=out))):
        row(provider, f"{K}x{R} . {R}x{N}", R, _best(fn, rounds), 2 * R * K * N)
    if packed.onednn_enabled():
        for name, M, K, N, a_t, b_t, bias in WIDE:
            M, K, N = M // s, K // s, N // s
            a = torch.randn(K, M, generator=gen).t() if a_t else torch.randn(M, K, generator=gen)
            b = torch.randn(N, K, generator=gen).t() if b_t else torch.randn(K, N, generator=gen)
            c = torch.randn(N, generator=gen) if bias else None
            best = common.best_times({"mkl": lambda a=a, b=b, c=c: gemm._mkl(a, b, c),
                                      "onednn": lambda a=a, b=b, c=c: gemm._onednn(a, b, c)}, rounds)
            for lib, t in best.items():
                row(f"{name} {lib}", f"{M}x{K} . {K}x{N}", M, t, 2 * M * K * N)
    return rows


def report(rows: list[dict]) -> None:
    common.report_rows("cpu_products", rows, lambda r: f"{r['provider']:>24} {r['shape']:>24} {r['ms']:9.3f} ms  "
                       f"{r['gflops']!s:>6} GFLOP/s  {r['weight_gbps']!s:>5} GB/s", FIELDS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,4,16,32", help="comma-separated rows of the per-step products")
    ap.add_argument("--rounds", type=int, default=8, help="best of this many calls")
    ap.add_argument("--small", action="store_true", help="every size / 16 (a smoke run)")
    a = ap.parse_args(argv)
    report(run(tuple(int(b) for b in a.batch.split(",")), a.rounds, a.small))
    return 0


if __name__ == "__main__":
    sys.exit(main())
