"""Benchmarks: TF sampled softmax (fwd+bwd) and full-softmax NLL, fused Triton vs unfused torch.

* CPU part (pytest-benchmark, small sizes): the reference (= unfused torch) path and the sampler.
  ``python -m pytest -q bench/bench_softmax.py --benchmark-disable`` runs each once as a smoke test.
* GPU part (skipped without CUDA): ``triton.testing.do_bench`` at the bilm-tf sizes, bf16:
  sampled: N=7,680 (384 rows × 20 steps), S=8,192, P=512, V=793,471, fwd+bwd;
  full: N=2,048, V=793,471, fwd (evaluation) and fwd+bwd.
  Providers: ``torch`` (unfused: gathers, matmul, logsumexp, autograd; the reference path) and ``triton``
  (fused kernels; dense and sparse weight gradients); and the trainer's grouped call (``groups_rows``: every
  tower's two directions in one call against one call a group, at the original config's 6 x 2,560 rows and a
  one-tower step's 2 x 7,680). Reports ms (p50/p20/p80), TFLOP/s and peak memory, and
  appends CSV rows (device, versions, git commit, command) to ``$ELMO_FAST_BENCH_CSV``, else
  build/bench/softmax.csv, or the committed bench/results/softmax.csv with ``ELMO_FAST_BENCH_RECORD=1``
  (bench/common.py). Correctness is checked first; no speedup is printed on a mismatch.
  Then each Triton kernel alone (``kernel_rows``: time, the kernel report's L2 count, that count over the time) to
  ``softmax_kernels.csv``: the per-kernel data the LSTMP model was fitted to, for the softmax's kernels.
  Also runnable as ``python bench/bench_softmax.py``.

FLOP counts (multiply-add = 2): sampled forward 2·N·(S+1)·P, backward 2× that (dH and dW); full softmax
forward 2·N·V·P, backward 2× that.
"""
from __future__ import annotations

import datetime
import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from elmo_fast import ops  # noqa: E402

CSV_FIELDS = ["date", "op", "provider", "mode", "shape", "dtype", "ms_p50", "ms_p20", "ms_p80", "tflops",
              "peak_mem_mib", "device", "torch", "triton", "cuda", "commit", "command"]


def write_rows(rows: list[dict]) -> Path:
    return common.append_rows("softmax", rows, CSV_FIELDS, os.environ.get("ELMO_FAST_BENCH_CSV"))


def make_problem(N, P, V, S, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(N, P, device=device, generator=g).to(dtype)
    weight = (torch.randn(V, P, device=device, generator=g) / math.sqrt(P)).to(dtype)
    bias = torch.zeros(V, device=device, dtype=dtype)
    targets = torch.randint(0, V, (N,), device=device, generator=g)
    ids, tries = ops.log_uniform_sample(S, V, generator=g, device=device) if S else (None, None)
    return hidden, targets, weight, bias, ids, tries


def sampled_step(hidden, targets, weight, bias, ids, tries, backend, sparse=False):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    b = bias.detach().requires_grad_()
    loss = ops.sampled_softmax_loss(h, targets, w, b, ids, tries, backend=backend, sparse_grad=sparse)
    loss.backward()
    return loss, h.grad, w.grad, b.grad


def full_step(hidden, targets, weight, bias, backend, backward):
    if not backward:
        with torch.no_grad():
            return ops.full_softmax_nll(hidden, targets, weight, bias, backend=backend)
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    b = bias.detach().requires_grad_()
    loss = ops.full_softmax_nll(h, targets, w, b, backend=backend)
    loss.backward()
    return loss


# ----------------------------------------------------------------------------------------------- CPU part

@pytest.mark.benchmark(group="softmax-cpu")
def test_cpu_sampled_reference_fwd_bwd(benchmark):
    prob = make_problem(256, 64, 20_000, 512, torch.float32, "cpu")
    loss = benchmark(sampled_step, *prob, "reference")[0]
    assert torch.isfinite(loss)


@pytest.mark.benchmark(group="softmax-cpu")
def test_cpu_full_reference_fwd(benchmark):
    hidden, targets, weight, bias, _, _ = make_problem(64, 64, 20_000, 0, torch.float32, "cpu")
    loss = benchmark(full_step, hidden, targets, weight, bias, "reference", False)
    assert torch.isfinite(loss)


@pytest.mark.benchmark(group="softmax-cpu")
def test_cpu_sampler(benchmark):
    g = torch.Generator().manual_seed(0)
    ids, tries = benchmark(ops.log_uniform_sample, 8192, 793_471, generator=g)
    assert ids.numel() == 8192 and tries >= 8192


# ----------------------------------------------------------------------------------------------- GPU part

def _measure(fn, flops: float, device) -> dict:
    torch.cuda.synchronize(device)
    fn()  # warm-up / compile
    peak = common.peak_memory_mib(fn)
    p50, p20, p80 = common.gpu_time_ms(fn, warmup_ms=25, rep_ms=200)
    return {"ms_p50": f"{p50:.4f}", "ms_p20": f"{p20:.4f}", "ms_p80": f"{p80:.4f}",
            "tflops": f"{flops / (p50 * 1e-3) / 1e12:.1f}", "peak_mem_mib": f"{peak:.1f}"}


def run_gpu(N_s=7680, S=8192, P=512, V=793_471, N_f=2048, dtype=torch.bfloat16) -> list[dict]:
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = {**common.environment(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dtype": str(dtype).replace("torch.", "")}
    rows = []

    # sampled softmax, fwd+bwd
    prob = make_problem(N_s, P, V, S, dtype, dev)
    ref = sampled_step(*prob, "reference")
    for sparse in (False, True):
        got = sampled_step(*prob, "triton", sparse)
        err = (got[0].float() - ref[0].float()).abs().item()
        dh = (got[1].float() - ref[1].float()).abs().max().item()
        if err > 2e-2 * max(1.0, ref[0].abs().item()) or dh > 1e-2 or not math.isfinite(dh):
            raise AssertionError(f"fused sampled softmax disagrees with torch (loss err {err}, dh err {dh}); "
                                 "not benchmarking")
    del ref, got
    shape = f"N={N_s},S={S},P={P},V={V}"
    flops = 3 * 2.0 * N_s * (S + 1) * P
    for provider, backend, sparse in (("torch", "reference", False), ("triton", "triton", False),
                                      ("triton-sparse-grad", "triton", True)):
        r = _measure(lambda prob=prob, backend=backend, sparse=sparse: sampled_step(*prob, backend, sparse),
                     flops, dev)
        rows.append({**meta, "op": "sampled_softmax", "provider": provider, "mode": "fwd+bwd", "shape": shape, **r})
    del prob
    torch.cuda.empty_cache()

    # full softmax: evaluation (fwd) and fwd+bwd
    hidden, targets, weight, bias, _, _ = make_problem(N_f, P, V, 0, dtype, dev)
    a = full_step(hidden, targets, weight, bias, "reference", False)
    b = full_step(hidden, targets, weight, bias, "triton", False)
    if (a.float() - b.float()).abs().item() > 2e-2 * max(1.0, a.abs().item()):
        raise AssertionError(f"fused full softmax disagrees with torch ({a.item()} vs {b.item()}); not benchmarking")
    shape = f"N={N_f},P={P},V={V}"
    for mode, backward, mult in (("fwd", False, 1), ("fwd+bwd", True, 3)):
        for provider, backend in (("torch", "reference"), ("triton", "triton")):
            r = _measure(lambda backend=backend, backward=backward:
                         full_step(hidden, targets, weight, bias, backend, backward), mult * 2.0 * N_f * V * P, dev)
            rows.append({**meta, "op": "full_softmax_nll", "provider": provider, "mode": mode, "shape": shape, **r})
    return rows


def groups_rows(N=2560, S=8192, P=512, V=793_471, groups=6, dtype=torch.bfloat16, device="cuda",
                reps=5) -> list[dict]:
    """The trainer's grouped call against one call per group, forward and backward (dense table gradients):
    ``groups`` sample sets of S over N rows each (defaults: the original config fused, 3 towers x 2 directions x
    2,560 rows; 2 x 7,680 is a one-tower step at 384 rows). Providers ``triton-calls`` (one sampled_softmax_loss
    call per group, as the trainer ran before the grouped call) and ``triton-groups`` (one
    sampled_softmax_loss_groups call), after a check that both give the same losses. Under the interpreter (CPU
    tensors) the same code runs with a plain clock: a smoke run, not numbers."""
    dev = torch.device(device)
    meta = {**common.environment(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dtype": str(dtype).replace("torch.", "")}
    hidden, _, weight, bias, _, _ = make_problem(N * groups, P, V, 0, dtype, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    sets = [ops.log_uniform_sample(S, V, generator=g, device=dev) for _ in range(groups)]
    targets = torch.randint(0, V, (N * groups,), device=dev, generator=g)

    def step(grouped: bool):
        h, w, b = (t.detach().requires_grad_() for t in (hidden, weight, bias))
        items = [(hk, tk, ids, tries) for hk, tk, (ids, tries) in zip(h.split(N), targets.split(N), sets)]
        if grouped:
            losses = ops.sampled_softmax_loss_groups(items, w, b, backend="triton")
        else:
            losses = [ops.sampled_softmax_loss(hk, tk, w, b, ids, tries, backend="triton")
                      for hk, tk, ids, tries in items]
        torch.stack(losses).float().sum().backward()
        return torch.stack(losses).float()

    a, c = step(False), step(True)
    if not torch.allclose(a, c, rtol=1e-2, atol=1e-2):
        raise AssertionError(f"grouped sampled softmax disagrees with one call per group ({a} vs {c}); "
                             "not benchmarking")
    shape = f"groups={groups},N={N},S={S},P={P},V={V}"
    flops = groups * 3 * 2.0 * N * (S + 1) * P
    rows = []
    for provider, grouped in (("triton-calls", False), ("triton-groups", True)):
        p50, p20, p80 = common.time_ms(lambda grouped=grouped: step(grouped), dev, reps)
        rows.append({**meta, "op": "sampled_softmax", "provider": provider, "mode": "fwd+bwd", "shape": shape,
                     "ms_p50": f"{p50:.4f}", "ms_p20": f"{p20:.4f}", "ms_p80": f"{p80:.4f}",
                     "tflops": f"{flops / (p50 * 1e-3) / 1e12:.1f}", "peak_mem_mib": "nan"})
    return rows


KERNEL_FIELDS = ["date", "op", "kernel", "mode", "shape", "dtype", "grid", "tile", "us_p50", "us_p20", "us_p80",
                 "l2_gb", "l2_tbps", "device", "torch", "triton", "cuda", "commit", "command"]


def kernel_rows(N_s=7680, S=8192, P=512, V=793_471, N_f=2048, dtype=torch.bfloat16, device="cuda",
                reps=5) -> list[dict]:
    """Each softmax Triton kernel alone, on the buffers the op builds: the sampled forward and the backward's dlogit
    kernel at the training shape, the full forward at the evaluation shape. Per kernel its time, the bytes its
    programs move through L2 by the kernel report's count (``kernel_report.softmax_l2_bytes``) and that count
    over the time (``l2_tbps``): the softmax's counterpart of the per-kernel LSTMP timings bench/kernel_fit.py
    was fitted to (there 3.22 TB/s; the H200's full-softmax forward of the design before ran at 5.2). Under
    the interpreter (CPU tensors) the same code runs with a plain clock: a smoke run, not numbers."""
    import kernel_report

    from elmo_fast.kernels import softmax as KS
    from elmo_fast.kernels._common import target_of

    dev = torch.device(device)
    tg = target_of(dev)
    e = dtype.itemsize
    f32 = dict(dtype=torch.float32, device=dev)
    meta = {**common.environment(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dtype": str(dtype).replace("torch.", "")}
    rows = []

    def timed(op, mode, shape, launch, args, l2):
        p50, p20, p80 = common.time_ms(lambda: launch(*args), dev, reps)
        m = launch.meta
        rows.append({**meta, "op": op, "kernel": launch.kernel.__name__, "mode": mode, "shape": shape,
                     "grid": "x".join(map(str, launch.grid)),
                     "tile": f"{m['BLOCK_N']}x{m['BLOCK_C']}x{m['BLOCK_K']} w{m['num_warps']} s{m['num_stages']}",
                     "us_p50": f"{p50 * 1e3:.2f}", "us_p20": f"{p20 * 1e3:.2f}", "us_p80": f"{p80 * 1e3:.2f}",
                     "l2_gb": f"{l2 / 1e9:.4g}", "l2_tbps": f"{l2 / (p50 * 1e-3) / 1e12:.3g}"})

    hidden, targets, weight, _, ids, _ = make_problem(N_s, P, V, S, dtype, dev)
    off, true_off = torch.zeros(S, **f32), torch.zeros(N_s, **f32)
    fw, cps = KS.lse_fwd_launch(N_s, S, P, dtype, tg, gather=True, mask_hits=True)
    out_m, out_l = torch.empty((fw.grid[1], N_s), **f32), torch.empty((fw.grid[1], N_s), **f32)
    args = (hidden, weight, ids, off, targets, true_off, out_m, out_l, torch.empty(N_s, **f32), N_s, P, S, cps)
    shape = f"N={N_s},S={S},P={P}"
    timed("sampled_softmax", "fwd", shape, fw, args,
          kernel_report.softmax_l2_bytes(fw, N_s, S, P, e))
    fw(*args)
    lse = torch.logsumexp(out_m + torch.log(out_l), dim=0)
    dl = KS.dlogit_launch(N_s, S, P, dtype, tg, gather=True, mask_hits=True, sub_target=False)
    args = (hidden, weight, ids, off, targets, lse, torch.full((N_s,), 1.0 / N_s, **f32),
            torch.empty((N_s, S), dtype=dtype, device=dev), torch.empty((dl.grid[0], S), **f32), N_s, P, 0, S, S)
    timed("sampled_softmax", "bwd", shape, dl, args,
          kernel_report.softmax_l2_bytes(dl, N_s, S, P, e))
    del hidden, targets, weight, ids, args

    hidden, targets, weight, bias, _, _ = make_problem(N_f, P, V, 0, dtype, dev)
    off = bias.float()
    fw, cps = KS.lse_fwd_launch(N_f, V, P, dtype, tg, gather=False, mask_hits=False)
    args = (hidden, weight, off, off, targets, off[targets], torch.empty((fw.grid[1], N_f), **f32),
            torch.empty((fw.grid[1], N_f), **f32), torch.empty(N_f, **f32), N_f, P, V, cps)
    timed("full_softmax_nll", "fwd", f"N={N_f},P={P},V={V}", fw, args,
          kernel_report.softmax_l2_bytes(fw, N_f, V, P, e))
    return rows


def write_kernel_rows(rows: list[dict]) -> Path:
    return common.append_rows("softmax_kernels", rows, KERNEL_FIELDS, os.environ.get("ELMO_FAST_BENCH_KERNEL_CSV"))


def _print(rows):
    for r in rows:
        print(f"{r['op']:>17} {r['mode']:>8} {r['provider']:>19} {r['ms_p50']:>9} ms {r['tflops']:>6} TFLOP/s "
              f"{r['peak_mem_mib']:>9} MiB  [{r['device']}, {r['shape']}]")
    by = {(r["op"], r["mode"], r["provider"]): float(r["ms_p50"]) for r in rows}
    for op, mode in {(r["op"], r["mode"]) for r in rows}:
        t = by.get((op, mode, "torch"))
        for prov in ("triton", "triton-sparse-grad"):
            if t and (op, mode, prov) in by:
                print(f"speedup {op} {mode} {prov}: {t / by[(op, mode, prov)]:.2f}x over unfused torch")
    calls = {r["shape"]: float(r["ms_p50"]) for r in rows if r["provider"] == "triton-calls"}
    for r in rows:
        if r["provider"] == "triton-groups" and r["shape"] in calls:
            print(f"grouped call {r['shape']}: {calls[r['shape']] / float(r['ms_p50']):.2f}x over one call a group")


def _print_kernels(rows):
    for r in rows:
        print(f"{r['op']:>17} {r['mode']:>4} {r['kernel']:>24} {r['tile']:>20} grid {r['grid']:>8}: "
              f"{r['us_p50']:>9} us, L2 {r['l2_gb']} GB -> {r['l2_tbps']} TB/s  [{r['device']}]")
    print(f"kernel rows appended to {write_kernel_rows(rows)}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_softmax_real_sizes():
    rows = run_gpu() + groups_rows() + groups_rows(7680, groups=2)
    path = write_rows(rows)
    _print(rows)
    print(f"rows appended to {path}")
    _print_kernels(kernel_rows())


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("the GPU part needs a CUDA GPU; run the CPU part with `python -m pytest -q bench/bench_softmax.py`")
    rows = run_gpu() + groups_rows() + groups_rows(7680, groups=2)
    _print(rows)
    print(f"rows appended to {write_rows(rows)}")
    _print_kernels(kernel_rows())
