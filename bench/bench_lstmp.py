"""Benchmarks of one LSTMP chain (one layer, one direction): Triton kernel vs reference vs cuDNN.

CPU part (pytest-benchmark, tiny sizes): the reference and the cpu backend, forward and forward+backward. Smoke
test: ``python -m pytest -q bench/bench_lstmp.py --benchmark-disable``. The CPU measurement at the ELMo shape,
against nn.LSTM and the GEMM rate, is ``bench/bench_cpu_lstmp.py``.

GPU part (skipped without CUDA): ``triton.testing.do_bench`` at (B, T) in (384,20), (128,20), (16,20), (1,20),
H=4096, P=512, D=512, cell/proj clip 3, bf16 and fp32, modes ``fwd`` and ``fwd+bwd``. Providers:

* ``triton``: ``elmo_fast.kernels.lstmp.lstmp_triton``;
* ``reference``: ``elmo_fast.reference.lstmp.lstmp_reference`` (step by step, PyTorch ops);
* ``triton-graph`` (mode ``fwd`` only): the same forward captured once in a CUDA graph and replayed (no
  per-launch host overhead: what the capturable time loop buys);
* ``cudnn``: ``torch.nn.LSTM(512, 4096, proj_size=512)``. It has no clipping and no per-row lengths, so it
  computes a slightly different function: a speed bar, not an oracle.

Per kernel (``bench_kernels``): every launch of the chain's plan (``elmo_fast.kernels.lstmp.launch_plan``) at
a middle step, timed alone with ``do_bench`` on the buffers the launchers build, beside its roofline estimate
from bench/lstmp_compile.py (``ratio`` = measured / estimated) -> ``lstmp_kernels.csv``. Split-K alternatives
(``bench_splits``): the projection and the recurrent backward with their reduce kernel, tuned tile against
tiles with fewer splits -> ``lstmp_splits.csv`` (the pick the compile-time model cannot make).

All rows are full length (lengths = T) so the three do the same amount of work. The Triton kernel is checked
against the reference before anything is timed; a mismatch stops the sweep. Each case appends a CSV row
(device, torch/triton/CUDA versions, git commit, command) to ``$ELMO_FAST_BENCH_CSV``, else build/bench/lstmp.csv,
or the committed bench/results/lstmp.csv with ``ELMO_FAST_BENCH_RECORD=1`` (bench/common.py).
Also runnable as ``python bench/bench_lstmp.py``.

FLOP per token (multiply-add = 2), forward: 2·(D·4H + P·4H + H·P); forward+backward counted as 3x forward.
"""
from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import kernel_fit  # noqa: E402

from elmo_fast.cpu.lstmp import lstmp_cpu  # noqa: E402
from elmo_fast.reference.lstmp import lstmp_reference  # noqa: E402

FIELDS = ["date", "op", "provider", "mode", "B", "T", "D", "H", "P", "dtype", "ms_p50", "ms_p20", "ms_p80",
          "tflops", "tokens_per_s", "peak_mem_mib", "device", "torch", "triton", "cuda", "commit", "command",
          "note"]
GPU_SHAPES = [(384, 20), (128, 20), (16, 20), (1, 20)]
ELMO = dict(D=512, H=4096, P=512)
CLIP = 3.0
PROVIDERS = ("triton", "triton-pdl", "triton-pdl-kloop", "triton-eager", "triton-graph", "reference", "cudnn")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ------------------------------------------------------------------------------------------ helpers
def append_csv(rows: list[dict]) -> Path:
    return common.append_rows("lstmp", rows, FIELDS, os.environ.get("ELMO_FAST_BENCH_CSV"))


def _csv_path() -> Path:
    """Where ``append_csv`` writes."""
    return Path(os.environ.get("ELMO_FAST_BENCH_CSV") or common.results_dir() / "lstmp.csv")


def flop_per_token(D: int, H: int, P: int) -> int:
    return 2 * (D * 4 * H + P * 4 * H + H * P)


def make_chain(B, T, D, H, P, dtype, device, seed=0, requires_grad=False):
    """Inputs of one chain with O(1) activations; every row full length."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device=device, dtype=dtype).requires_grad_(requires_grad)

    return dict(
        x=rnd(B, T, D), w_in=rnd(D, 4 * H, s=D ** -0.5), w_rec=rnd(P, 4 * H, s=P ** -0.5), bias=rnd(4 * H, s=0.1),
        w_proj=rnd(H, P, s=H ** -0.5), h0=rnd(B, P, s=0.1), c0=rnd(B, H, s=0.1),
        lengths=torch.full((B,), T, dtype=torch.long, device=device),
    )


ARGS = ("x", "w_in", "w_rec", "bias", "w_proj", "h0", "c0", "lengths")


def run_chain(fn, chain):
    return fn(*(chain[k] for k in ARGS), cell_clip=CLIP, proj_clip=CLIP, forget_bias=1.0, reverse=False,
              residual=True)


def fwd_bwd(fn, chain, upstream):
    outs = run_chain(fn, chain)
    torch.autograd.backward(outs, upstream)


# --------------------------------------------------------------------------------------- CPU (tiny)
# Smoke-sized: the reference and the cpu backend. The CPU measurement at the ELMo shape is bench_cpu_lstmp.py.
TINY = dict(B=4, T=6, D=16, H=32, P=16)
CPU_FNS = {"reference": lstmp_reference, "cpu": lstmp_cpu}


@pytest.mark.parametrize("provider", CPU_FNS)
def test_cpu_forward(benchmark, provider):
    chain = make_chain(dtype=torch.float32, device="cpu", **TINY)
    with torch.no_grad():
        y, _, _ = benchmark(run_chain, CPU_FNS[provider], chain)
    assert y.shape == (TINY["B"], TINY["T"], TINY["P"])


@pytest.mark.parametrize("provider", CPU_FNS)
def test_cpu_forward_backward(benchmark, provider):
    chain = make_chain(dtype=torch.float32, device="cpu", requires_grad=True, **TINY)
    B, T, H, P = TINY["B"], TINY["T"], TINY["H"], TINY["P"]
    upstream = (torch.randn(B, T, P), torch.randn(B, P), torch.randn(B, H))
    benchmark(fwd_bwd, CPU_FNS[provider], chain, upstream)
    assert chain["w_rec"].grad is not None and torch.isfinite(chain["w_rec"].grad).all()


# ----------------------------------------------------------------------------------------------- GPU
def _cudnn_fn(D, H, P, dtype, device):
    lstm = torch.nn.LSTM(D, H, proj_size=P, batch_first=True).to(device=device, dtype=dtype)

    def fn(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, **_):
        y, (hn, cn) = lstm(x, (h0.unsqueeze(0), c0.unsqueeze(0)))
        return y, hn[0], cn[0]

    return fn, list(lstm.parameters())


def check_triton(device: str, dims: dict) -> None:
    """Gate: the kernel matches the reference at the benchmark's sizes before any timing is reported."""
    from elmo_fast.kernels.lstmp import lstmp_triton

    chain = make_chain(4, 5, dtype=torch.float32, device=device, requires_grad=True, **dims)
    ref = {k: (v.detach().double().requires_grad_() if v.is_floating_point() else v) for k, v in chain.items()}
    up = [torch.randn(4, 5, dims["P"], device=device), torch.randn(4, dims["P"], device=device),
          torch.randn(4, dims["H"], device=device)]
    fwd_bwd(lstmp_triton, chain, up)
    fwd_bwd(lstmp_reference, ref, [u.double() for u in up])
    for k in ARGS[:-1]:
        want, got = ref[k].grad, chain[k].grad.double()
        err = float((got - want).abs().max())
        if err > 1e-4 * max(1.0, float(want.abs().max())):
            raise AssertionError(f"triton LSTMP disagrees with the reference on d{k}: {err:.3g}; not timing it")


def _graphed(fn, chain):
    """fn(chain) (no grad) captured once in a CUDA graph; returns the replay."""
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_chain(fn, chain)  # warm-up: compiles, caches the kernels' constants
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_chain(fn, chain)
    return graph.replay


def _eager(fn):
    """``fn`` with the LSTMP loop graphs off."""
    def call(*args, **kw):
        with common.env_var("ELMO_FAST_LOOP_GRAPHS", "0"):
            return fn(*args, **kw)
    return call


def bench_gpu(shapes=GPU_SHAPES, dtypes=(torch.bfloat16, torch.float32), providers=None, append=False,
              modes=("fwd", "fwd+bwd"), warmup=25, rep=100, device="cuda", dims=ELMO) -> list[dict]:
    """The chain sweep (module docstring): every dtype x shape x provider (None: all of ``PROVIDERS``) x mode; with
    ``append`` each row goes to the CSV as soon as it is timed."""
    from elmo_fast.kernels.lstmp import lstmp_triton

    providers = providers or PROVIDERS
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    check_triton(device, dims)
    D, H, P = dims["D"], dims["H"], dims["P"]
    meta = dict(op="lstmp", **common.environment())
    rows = []
    for dtype in dtypes:
        for B, T in shapes:
            for provider in providers:
                for mode in modes:
                    if provider == "triton-graph" and mode != "fwd":
                        continue
                    chain = make_chain(B, T, dtype=dtype, device=device, requires_grad=mode != "fwd", **dims)
                    params = [v for v in chain.values() if v.is_floating_point()]
                    note = ""
                    if provider.startswith("triton"):
                        # triton: the time loops replay from loop graphs (the default on a GPU) after the first
                        # call; triton-pdl: the same with programmatic dependent launch (ELMO_FAST_LSTMP_PDL=1,
                        # opt-in; set around the whole call below: backward reads it too), whose plan takes
                        # PDL_TUNED's stationary cell tile at bf16 B <= 16; triton-pdl-kloop: PDL with TUNED's
                        # K-loop tile there (the launches' share apart from the tile's; common.with_pdl keeps the
                        # two variants' loop graphs apart); triton-eager: every step's launches as launched
                        # (ELMO_FAST_LOOP_GRAPHS=0)
                        fn = _eager(lstmp_triton) if provider == "triton-eager" else lstmp_triton
                    elif provider == "reference":
                        fn = lstmp_reference
                    else:
                        fn, lstm_params = _cudnn_fn(D, H, P, dtype, device)
                        if mode != "fwd":
                            params = [chain["x"], chain["h0"], chain["c0"]] + lstm_params
                        note = "no clipping, no lengths (different function; speed bar)"
                    up = [torch.randn(B, T, P, device=device, dtype=dtype), torch.randn(B, P, device=device,
                                                                                       dtype=dtype),
                          torch.randn(B, H, device=device, dtype=dtype)]
                    if provider == "triton-graph":
                        call = _graphed(fn, chain)
                    elif mode == "fwd":
                        def call(fn=fn, chain=chain):
                            with torch.no_grad():
                                run_chain(fn, chain)
                    else:
                        def call(fn=fn, chain=chain, up=up):
                            fwd_bwd(fn, chain, up)
                    if provider.startswith("triton-pdl"):
                        call = common.with_pdl(call, k_loop=provider.endswith("kloop"))
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    try:
                        p50, p20, p80 = common.gpu_time_ms(call, warmup, rep, grad_to_none=params)
                    except Exception as exc:  # noqa: BLE001 - e.g. cuDNN without bf16 RNNs: record, go on
                        p50 = p20 = p80 = float("nan")
                        note = f"error: {type(exc).__name__}: {exc}"[:200]
                    peak = torch.cuda.max_memory_allocated() / 2**20
                    flop = flop_per_token(D, H, P) * B * T * (1 if mode == "fwd" else 3)
                    rows.append(dict(
                        meta, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        provider=provider, mode=mode, B=B, T=T, D=D, H=H, P=P, dtype=str(dtype).split(".")[-1],
                        ms_p50=f"{p50:.4f}", ms_p20=f"{p20:.4f}", ms_p80=f"{p80:.4f}",
                        tflops=f"{flop / (p50 * 1e-3) / 1e12:.2f}", tokens_per_s=f"{B * T / (p50 * 1e-3):.0f}",
                        peak_mem_mib=f"{peak:.0f}", note=note,
                    ))
                    print(f"{provider:>9} {mode:>7} B={B:<3} T={T} {rows[-1]['dtype']:>8}: {p50:8.3f} ms "
                          f"{rows[-1]['tflops']:>7} TFLOP/s {note}", flush=True)
                    if append:  # as it comes: a run killed at its time cap keeps every row it timed
                        append_csv(rows[-1:])
                    del chain, params, up
    return rows


KERNEL_FIELDS = ["date", "op", "kernel", "B", "T", "dtype", "mode", "grid", "tile", "us_p50", "us_p20", "us_p80",
                 "est_us", "ratio", "cal_us", "cal_ratio", "bytes", "flops", "device", "torch", "triton", "cuda",
                 "commit", "command"]


def bench_kernels(batches=(1, 64, 128, 384), dtypes=(torch.bfloat16, torch.float32), T=20, dims=ELMO,
                  device="cuda") -> list[dict]:
    """Every launch of the plan, timed alone at step T // 2 on real buffers, beside its roofline estimate."""
    import lstmp_compile

    from elmo_fast.kernels import lstmp as KL

    H, P = dims["H"], dims["P"]
    fl = dict(cell_clip=CLIP, proj_clip=CLIP, reverse=False, residual=True)
    meta = dict(op="lstmp", **common.environment())
    rows = []
    for dtype in dtypes:
        for B in batches:
            training = B >= 128
            c = make_chain(B, T, dtype=dtype, device=device, **dims)
            args = [c[k] for k in ARGS]
            with torch.no_grad(), common.env_var(KL.FUSED_REDUCE_ENV, "0"):  # each of the three launches timed
                plan, bufs = KL.fwd_setup(*args, forget_bias=1.0, save=training, **fl)
                timed = [(k, plan[k], bufs) for k in ("fwd_cell", "fwd_proj", "fwd_reduce")]
                if training:
                    _, _, _, cache = KL.lstmp_fwd(*args, forget_bias=1.0, save=True, **fl)
                    up = [torch.randn(B, T, P, device=device, dtype=dtype), torch.randn(B, P, device=device),
                          torch.randn(B, H, device=device)]
                    bplan, bbufs = KL.bwd_setup(*up, c["x"], c["w_rec"], c["w_proj"], c["c0"], cache, **fl)
                    timed += [(k, bplan[k], bbufs) for k in ("bwd_cell", "bwd_rec", "bwd_reduce")]
            for name, launch, b in timed:
                run = KL._bind(launch, b)  # bound once, as the time loops do: a timed call is the launch alone
                p50, p20, p80 = common.gpu_time_ms(lambda run=run: run(T // 2))
                est = lstmp_compile.estimate_us(launch, dtype != torch.float32)
                rows.append(dict(
                    meta, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    kernel=name, B=B, T=T, dtype=str(dtype).split(".")[-1], mode="train" if training else "infer",
                    grid="x".join(map(str, launch.grid)), tile=kernel_fit.tile_text(launch.tile, design=False),
                    us_p50=f"{p50 * 1e3:.2f}", us_p20=f"{p20 * 1e3:.2f}", us_p80=f"{p80 * 1e3:.2f}",
                    est_us=f"{est:.2f}", ratio=f"{p50 * 1e3 / est:.2f}", bytes=launch.bytes, flops=launch.flops,
                    **_calibrated([(name, launch)], B, dtype, p50),
                ))
                print(f"{name:>10} {rows[-1]['dtype']:>8} B={B:<3}: {p50 * 1e3:8.2f} us, estimate {est:6.2f} us, "
                      f"ratio {rows[-1]['ratio']}, calibrated {rows[-1]['cal_us']} us", flush=True)
            del c, args, bufs, plan
    return rows


TRAIN_FLAGS = dict(cell_clip=CLIP, proj_clip=CLIP, reverse=False, residual=True)


def _step_buffers(B, T, dtype, device, dims):
    """(forward plan, forward buffers, backward plan, backward buffers) of one training chain, both time loops
    run once, so every buffer a launch at any step reads holds real values (what bench_splits / bench_tiles time
    single launches on)."""
    from elmo_fast.kernels import lstmp as KL

    H, P = dims["H"], dims["P"]
    c = make_chain(B, T, dtype=dtype, device=device, **dims)
    args = [c[k] for k in ARGS]
    with torch.no_grad(), common.env_var(KL.FUSED_REDUCE_ENV, "0"):  # the three-launch plan the sweeps vary
        plan, bufs = KL.fwd_setup(*args, forget_bias=1.0, save=True, **TRAIN_FLAGS)
        KL._fwd_loop(plan, bufs)
        _, _, _, cache = KL.lstmp_fwd(*args, forget_bias=1.0, save=True, **TRAIN_FLAGS)
        up = [torch.randn(B, T, P, device=device, dtype=dtype), torch.randn(B, P, device=device),
              torch.randn(B, H, device=device)]
        bplan, bbufs = KL.bwd_setup(*up, c["x"], c["w_rec"], c["w_proj"], c["c0"], cache, **TRAIN_FLAGS)
        KL._bwd_loop(bplan, bbufs)
    return plan, bufs, bplan, bbufs


def _plan_with(name, tile, B, T, dtype, device, dims) -> dict:
    """The training chain's launch plan with ``tile`` for kernel ``name`` (None: the tuned one)."""
    from elmo_fast.kernels import lstmp as KL

    return KL.launch_plan(B, T, dims["H"], dims["P"], dtype, training=True, target=KL.device_target(
        torch.device(device)), tiles={name: tile} if tile else None, cell_clip=True, proj_clip=True,
        reverse=TRAIN_FLAGS["reverse"], residual=TRAIN_FLAGS["residual"])


def _tile_row(meta, kernel, launch, tuned, B, T, dtype, times, est, nbytes, cal) -> dict:
    p50, p20, p80 = times
    return dict(meta, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                kernel=kernel, B=B, T=T, dtype=str(dtype).split(".")[-1], mode="train",
                grid="x".join(map(str, launch.grid)),
                tile=kernel_fit.tile_text(launch.tile) + (" (tuned)" if tuned else ""),
                us_p50=f"{p50 * 1e3:.2f}", us_p20=f"{p20 * 1e3:.2f}", us_p80=f"{p80 * 1e3:.2f}",
                est_us=f"{est:.2f}", ratio=f"{p50 * 1e3 / est:.2f}", bytes=nbytes, flops=launch.flops,
                **_calibrated(cal, B, dtype, p50))


def _split_alternatives():
    from elmo_fast.kernels.lstmp import Tile

    # None = the tuned tile. At B=384 (bf16: 128x128, 11 splits; 128x256, 22 splits) the alternatives keep >= 132
    # programs with 6 splits: about half the fp32 partials written and read back, but narrower tiles, so the
    # activations and the weights are re-read by more tiles. performance.md's model (compulsory bytes, partials
    # in HBM) puts the pair at 8.2 -> 5.8 us (projection) and 20.0 -> 12.5 us (recurrent backward); with an L2
    # term of 5.5 TB/s for the re-reads the tuned tile wins. Compiled for sm_90a: no spill, wgmma, cp.async.
    return {"fwd_proj": (None, Tile(128, 64, 32, 4, 4), Tile(64, 128, 32, 4, 4)),
            "bwd_rec": (None, Tile(128, 128, 32, 8, 4), Tile(128, 64, 32, 4, 4))}


def bench_splits(batches=(384,), dtypes=(torch.bfloat16,), T=20, dims=ELMO, device="cuda",
                 alternatives=None) -> list[dict]:
    """The split-K GEMMs of the time loop (projection, recurrent backward) with their reduce kernel, timed as a
    pair at step T // 2 for the tuned tile and each alternative (``_split_alternatives``).

    The compile-time model cannot rank them: a wider tile needs more K splits to give every SM a program, so more
    fp32 partials cross L2 or HBM, while a narrower one makes more tiles re-read the same activations and weights
    (bench/results/lstmp_compile.md). Each alternative's result must match the tuned one's before it counts.
    Rows -> ``lstmp_splits.csv``; under the interpreter (CPU tensors) the same code runs with a plain clock."""
    from elmo_fast.kernels import lstmp as KL

    alternatives = alternatives or _split_alternatives()
    P = dims["P"]
    meta = dict(op="lstmp", **common.environment())
    rows = []
    s = T // 2
    for dtype in dtypes:
        acc = KL.acc_dtype(dtype)
        for B in batches:
            plan, bufs, bplan, bbufs = _step_buffers(B, T, dtype, device, dims)
            for gemm, reduce, b, out in (("fwd_proj", "fwd_reduce", bufs, lambda b: b["y"][:, s]),
                                         ("bwd_rec", "bwd_reduce", bbufs, lambda b: b["dh"])):
                first = None
                for tile in alternatives[gemm]:
                    pl = _plan_with(gemm, tile, B, T, dtype, device, dims)
                    bb = dict(b, part=torch.empty(pl[gemm].grid[2], B, P, dtype=acc, device=device))

                    def pair(first=KL._bind(pl[gemm], bb), then=KL._bind(pl[reduce], bb)):
                        first(s)
                        then(s)

                    times = common.time_ms(pair, device)
                    got = out(bb).float().clone()
                    first = got if first is None else first
                    if not torch.allclose(got, first, rtol=2e-2, atol=2e-2) or not torch.isfinite(got).all():
                        raise AssertionError(f"bench_splits: {gemm} with {tile} differs from the tuned tile's "
                                             f"result (max |diff| {(got - first).abs().max().item():.3g})")
                    est = _estimate_us(pl[gemm], dtype) + _estimate_us(pl[reduce], dtype)
                    rows.append(_tile_row(meta, f"{gemm}+{reduce}", pl[gemm], tile is None, B, T, dtype, times, est,
                                          pl[gemm].bytes + pl[reduce].bytes + 2 * pl[gemm].scratch_bytes,
                                          [(gemm, pl[gemm]), (reduce, pl[reduce])]))
                    print(f"{gemm:>8}+reduce {rows[-1]['dtype']:>8} B={B:<3} {rows[-1]['tile']:<26} "
                          f"S={pl[gemm].grid[2]:<3}: {times[0] * 1e3:8.2f} us (estimate, partials in HBM "
                          f"{est:6.2f})", flush=True)
            del bufs, bbufs, plan, bplan
    return rows


# (kernel, operand class, batch) -> the Tile fields that TUNED held before it was last replaced: the tile sweep times
# each beside its successor. At 384 the H200's timings (2026-11-27, bench/results/gpu_h200_s42.md) replaced the
# calibrated search's picks with its occupancy probes: the forward cell's stationary tile (50.7 against 43.0 µs a
# step) and the backward cell's 64x64x32 w8 (72.2 against 53.6 µs). (Plain dicts: this module imports without
# triton, for its CPU part.)
REPLACED = {("bwd_cell", "16bit", 128): dict(BM=128, BN=16, BK=32, warps=4, stages=4),
            ("bwd_cell", "16bit", 384): dict(BM=64, BN=64, BK=32, warps=8, stages=4),
            ("fwd_cell", "16bit", 384): dict(BM=64, BN=32, BK=0, warps=8, stages=1, stationary=True)}
# (kernel, operand class, batch) -> the Tile fields of an occupancy probe: a tile that keeps more programs an SM
# resident than the tuned one. The last probes (64x32x32 w4 s4, 3 programs an SM against 1) beat the tuned tiles on
# the H200 by 15 and 26 % and replaced them, though the calibrated model ranked them below for their extra L2 bytes
# (forward 192 against 142 MB a step): the model needs an occupancy term. The next ones go further: 32-row tiles,
# twice the programs again (mma.sync rather than wgmma: a warp group's wgmma wants 64 rows); they lost (51.3 and
# 57.7 µs against 43.9 and 53.2, 2026-11-27).
PROBES = {("fwd_cell", "16bit", 384): dict(BM=32, BN=32, BK=32, warps=4, stages=4),
          ("bwd_cell", "16bit", 384): dict(BM=32, BN=32, BK=32, warps=4, stages=4),
          # at 128, the tiles that won at 384 (the 32-row ones lost there, 2026-11-27)
          ("fwd_cell", "16bit", 128): dict(BM=64, BN=32, BK=32, warps=4, stages=4),
          ("bwd_cell", "16bit", 128): dict(BM=64, BN=32, BK=32, warps=4, stages=4)}


def _tile_alternatives(name: str, B: int, dtype, top: int) -> tuple:
    """None (the tuned tile), for ``fwd_cell`` the tuned tile in the other design (``Tile.fused``: one dot over the
    gate-interleaved weight, or one per gate; chosen from compiled code alone, kernels/lstmp.FUSED_GATES), the tile
    the tuned one replaced (``REPLACED``), the occupancy probe (``PROBES``, in the tuned design), and the first other
    candidates of ``bench/lstmp_compile.py``'s search in its compile-free order (programs rule, calibrated estimate,
    L2 traffic), in the tuned tile's design, up to ``top`` alternatives in all: the compile-time model's short list,
    for the clock to rank. On the H200 (2026-11-26) the cell kernels ran at 3.5-4.4x their roofline estimates at
    B=384 bf16 and were two thirds of a step; the calibrated model (x1.2 on those timings) met the H200 on
    2026-11-27 and ranked the cell kernels' tiles at B=384 wrongly (the occupancy probes won: gpu_h200_s42.md)."""
    import dataclasses
    import functools

    import lstmp_compile

    from elmo_fast.kernels import lstmp as KL

    tuned = KL._tile(name, B, dtype, KL.H100)
    ranked = sorted(lstmp_compile.candidates(name, B, dtype != torch.float32),
                    key=functools.partial(lstmp_compile._prekey, name, dtype, B))
    # a stationary tile's twin is the fused design without the row loop (the tile replaced, REPLACED, is the other)
    twin = ((dataclasses.replace(tuned, fused=not tuned.fused),) if name == "fwd_cell" and not tuned.stationary
            else ())
    key = (name, "16bit" if dtype != torch.float32 else "fp32", KL.tuned_size(B))
    old, probe = REPLACED.get(key), PROBES.get(key)
    extra = twin + ((KL.Tile(**{"fused": tuned.fused, **old}),) if old else ()) + (
        (KL.Tile(**{"fused": tuned.fused, **probe}),) if probe else ())
    # twin, predecessor and probe take the place of the last candidates: a sweep's launches (and its minutes on a
    # leased GPU) stay the same
    return (None, *extra, *[t for t in ranked if t != tuned and t not in extra][: max(0, top - len(extra))])


def bench_tiles(kernels=("fwd_cell", "bwd_cell"), batches=(128, 384), dtypes=(torch.bfloat16,), T=20, dims=ELMO,
                device="cuda", top=6, alternatives=None) -> list[dict]:
    """Each kernel of ``kernels`` at step T // 2 with the tuned tile and its alternatives
    (``_tile_alternatives``, or ``alternatives``: kernel -> tiles), each alone, on the buffers the launchers
    build. Every alternative's outputs (every buffer the launch writes) must match the tuned tile's from the
    same inputs before its time counts. Rows -> ``lstmp_tiles.csv``; under the interpreter the same code runs
    with a plain clock."""
    from elmo_fast.kernels import lstmp as KL

    meta = dict(op="lstmp", **common.environment())
    rows = []
    s = T // 2
    for dtype in dtypes:
        for B in batches:
            plan, bufs, bplan, bbufs = _step_buffers(B, T, dtype, device, dims)
            if "w_rec_g" not in bufs:  # the fused cell kernel's weight, for a fused alternative
                bufs["w_rec_g"] = KL.interleave_gates(bufs["w_rec"])
            for name in kernels:
                b = bufs if name.startswith("fwd") else bbufs
                dbp = b.get("dbp")  # the bias partials: a buffer per tile (its rows follow the tile's BM)
                saved = {k: v.clone() for k, v in b.items() if k != "dbp"}

                def restore(b=b, saved=saved):
                    for k, v in saved.items():
                        b[k].copy_(v)

                tiles = (alternatives or {}).get(name) or _tile_alternatives(name, B, dtype, top)
                first = None
                for tile in tiles:
                    restore()
                    try:
                        launch = _plan_with(name, tile, B, T, dtype, device, dims)[name]
                        if dbp is not None:  # one row per (step, row block) of this tile's BM
                            b["dbp"] = torch.full((T, -(-B // launch.tile.BM), 4 * dims["H"]), float("nan"),
                                                  dtype=dbp.dtype, device=device)
                        KL._run(launch, b, s)
                    except Exception as exc:  # noqa: BLE001 - a candidate that does not plan, compile or fit: noted
                        print(f"{name:>8} {tile}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    got = {k: v.float().clone() for k, v in b.items() if k != "dbp" and not torch.equal(v, saved[k])}
                    if dbp is not None:  # compared as step s's column sums, which do not depend on the row blocks
                        got["dbp[s]"] = b["dbp"][s].float().sum(0)
                    first = got if first is None else first
                    bad = [k for k in set(first) | set(got) if k not in got or k not in first
                           or not torch.allclose(got[k], first[k], rtol=2e-2, atol=2e-2)]
                    if bad or not all(torch.isfinite(v).all() for v in got.values()):
                        raise AssertionError(f"bench_tiles: {name} with {tile} differs from the tuned tile's result "
                                             f"in {sorted(bad)}")
                    run = KL._bind(launch, b)
                    times = common.time_ms(lambda run=run: run(s), device)
                    restore()
                    est = _estimate_us(launch, dtype)
                    rows.append(_tile_row(meta, name, launch, tile is None, B, T, dtype, times, est, launch.bytes,
                                          [(name, launch)]))
                    print(f"{name:>8} {rows[-1]['dtype']:>8} B={B:<3} {rows[-1]['tile']:<26} "
                          f"grid {rows[-1]['grid']:<8}: {times[0] * 1e3:8.2f} us (estimate {est:6.2f})", flush=True)
                if dbp is not None:
                    b["dbp"] = dbp
                del saved
            del bufs, bbufs, plan, bplan
    return rows


def _calibrated(launches, B, dtype, p50_ms) -> dict:
    """``cal_us``: launches timed together by do_bench under the calibrated model (bench/kernel_fit.py): its timing
    floor once, plus each launch's GPU time with every program taken as resident (the occupancy is not known here:
    kernel_report charges it from the compiled code, a few % at most on the tuned tiles); ``cal_ratio`` = measured /
    that. A refit joins these rows with the compile stats of their code (kernel_fit.build_rows)."""
    import lstmp_compile

    cls = kernel_fit.cls_of("fp32" if dtype == torch.float32 else "bf16")
    cal = kernel_fit.FIT[cls]["floor_us"] + sum(lstmp_compile.calibrated_us(name, launch, B, dtype, None)
                                                for name, launch in launches)
    return dict(cal_us=f"{cal:.2f}", cal_ratio=f"{p50_ms * 1e3 / cal:.2f}")


def _estimate_us(launch, dtype) -> float:
    """The roofline estimate with the partials as HBM traffic (the upper bound: the pair writes and reads them)."""
    import lstmp_compile

    return lstmp_compile.estimate_us(launch, dtype != torch.float32, scratch_in_hbm=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sweep():
    rows = bench_gpu(append=True)
    print(f"wrote {len(rows)} rows, each as it came, to {_csv_path()}")


PARTS = ("sweep", "kernels", "splits", "tiles")


def _batches(text: str | None) -> tuple | None:
    """``--batches 384,1`` as (384, 1): positive integers (None: the flag not given)."""
    if text is None:
        return None
    try:
        vals = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise ValueError(f"--batches {text!r}: expected a comma-separated list of positive integers, e.g. 384,1")
    return vals


def parse_args(argv=None):
    """The command line, checked (a short lease cannot lose a step to a typo): the parts, and the batches, dtypes
    and sweep providers that narrow them. ``--dry-run`` prints the plan and exits: the CPU smoke of a lease step."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in this order: {', '.join(PARTS)}")
    ap.add_argument("--batches", help="comma-separated batch sizes for every part, T = 20 (default: each part's "
                    f"own; the sweep's: {', '.join(str(b) for b, _ in GPU_SHAPES)})")
    ap.add_argument("--dtypes", help="comma-separated, of bf16, fp32 (default: each part's own)")
    ap.add_argument("--providers", help=f"the sweep's, comma-separated, of {', '.join(PROVIDERS)} (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, then exit (no GPU needed)")
    a = ap.parse_args(argv)
    try:
        a.parts = common.comma_list("--parts", a.parts, PARTS)
        a.batches = _batches(a.batches)
        a.dtypes = common.comma_list("--dtypes", a.dtypes, DTYPES)
        a.providers = common.comma_list("--providers", a.providers, PROVIDERS)
    except ValueError as exc:
        ap.error(str(exc))
    if a.providers and "sweep" not in a.parts:
        ap.error("--providers narrows the sweep: add sweep to --parts")
    return a


def _narrowed(a) -> dict:
    """Per part, the keyword arguments that ``--batches`` / ``--dtypes`` / ``--providers`` set."""
    kw = {}
    if a.dtypes:
        kw["dtypes"] = tuple(DTYPES[d] for d in a.dtypes)
    sweep = dict(kw, **({"providers": a.providers} if a.providers else {}))
    if a.batches:
        sweep["shapes"] = [(b, 20) for b in a.batches]
        kw["batches"] = a.batches
    return {"sweep": sweep, "kernels": kw, "splits": kw, "tiles": kw}


def main(argv=None) -> int:
    a = parse_args(argv)
    kw = _narrowed(a)
    if a.dry_run:
        for part in a.parts:
            print(f"bench_lstmp {part}: {kw[part] or 'its defaults'}")
        return 0
    if not torch.cuda.is_available():
        sys.exit("bench_lstmp: the GPU sweep needs CUDA; run the CPU part with pytest instead")
    if "sweep" in a.parts:
        rows = bench_gpu(**kw["sweep"], append=True)
        print(f"wrote {len(rows)} rows, each as it came, to {_csv_path()}")
    for part, name, fn in (("kernels", "lstmp_kernels", bench_kernels), ("splits", "lstmp_splits", bench_splits),
                           ("tiles", "lstmp_tiles", bench_tiles)):
        if part in a.parts:
            print(f"wrote {part} rows to {common.append_rows(name, fn(**kw[part]), KERNEL_FIELDS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
