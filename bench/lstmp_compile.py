"""Compile every LSTMP kernel launch for an H100 (sm_90a) on a machine without a GPU and measure it.

    .venv/bin/python bench/lstmp_compile.py                 # table of every variant -> stdout (markdown)
    .venv/bin/python bench/lstmp_compile.py --md FILE       # ... also written to FILE
    .venv/bin/python bench/lstmp_compile.py --search        # tune: candidate tiles per (kernel, dtype, B)

Variants: the original model (H=4096, P=512, T=20), inference at B = 1, 16, 64 and training at B = 128,
384, bf16 and fp32, both clips, residual and reverse on (the heaviest epilogues). Every launch comes from
``elmo_fast.kernels.lstmp.launch_plan`` — the function the launchers call — so this compiles what runs.

Per launch: registers, spill bytes, stack, shared memory (ptxas -v on triton's PTX for sm_90a), warps,
stages, programs against the SMs, wgmma / mma.sync / cp.async / TMA instruction counts in the PTX, and the
roofline estimate of performance.md: max(bytes / 3.35 TB/s, FLOPs / peak) (with the launch terms of
``common.launched_us``); peak 990 TFLOP/s with 16-bit tensor cores, 67 TFLOP/s for the IEEE fp32 FMA path.
``bytes`` counts every operand once (the HBM term); ``L2`` is this tool's count of what the programs read in total
(operands re-read by other tiles). ``calibrated`` is the estimate of ``bench/kernel_fit.py``: L2 traffic,
compulsory bytes and FLOPs at the rates fitted to the H200's per-kernel timings (16-bit: within a factor of
~1.2 of every timed launch; the roofline was 2-12x short), the SMs a grid leaves idle charged.

``--search`` compiles candidate tiles in the order of their calibrated estimate with every program resident (no
compile needed), then of their L2 traffic; drops those that spill, lack tensor-core instructions (16-bit), lack
async copies in a K loop, or launch fewer than ``sms`` programs at B >= 128 (stationary tiles excepted from the last
two: ``KL.STATIONARY_EXEMPT``); keeps the one with the best calibrated
estimate at its compiled occupancy (then the fewest registers), stopping once the order's estimates pass that; and
prints the ``TUNED`` entries to paste into kernels/lstmp.py (``--kernels``, ``--batches``, ``--dtypes``: a part).
"""
from __future__ import annotations

import os

if __name__ == "__main__":  # compiled code, not the interpreter: before triton is imported (bench_lstmp
    os.environ.pop("TRITON_INTERPRET", None)  # imports this module for its estimates and keeps its own mode)

import argparse  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import MockTensor, create_function_from_signature  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import kernel_fit  # noqa: E402

from elmo_fast.kernels import lstmp as KL  # noqa: E402

ARCH = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(ARCH)
NVBIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
H, P, D, T = 4096, 512, 512, 20
HBM = 3.35e12
PEAK = {True: 990e12, False: 67e12}  # 16-bit tensor cores / fp32 without them
SMEM_BLOCK = 227 * 1024
VARIANTS = [(dt, B, B >= 128) for dt in (torch.bfloat16, torch.float32) for B in KL.BATCHES]
FLAGS = dict(cell_clip=True, proj_clip=True, reverse=True, residual=True)


# ------------------------------------------------------------------------------------------ compiling
def _compile(launch: KL.Launch, workdir: str) -> dict:
    """triton.compile for sm_90a with the arguments JITFunction.run would specialise on, then ptxas -v."""
    fn = launch.kernel
    args = [MockTensor(v) if isinstance(v, torch.dtype) else v for _, v in launch.args]
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages, debug=False,
                  instrumentation_mode="")
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound, specialization, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound, specialization, None)
    ck = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=ARCH, options=options.__dict__)
    ptx = ck.asm["ptx"]
    src = Path(workdir) / "k.ptx"
    src.write_text(ptx)
    r = subprocess.run([str(NVBIN / "ptxas"), "-v", "--gpu-name=sm_90a", str(src), "-o", str(src) + ".cubin"],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ptxas failed: {(r.stdout + r.stderr)[-800:]}")
    log = r.stdout + r.stderr

    def num(rx):
        m = re.search(rx, log)
        return int(m.group(1)) if m else 0

    return dict(
        regs=num(r"Used (\d+) registers"), spill_st=num(r"(\d+) bytes spill stores"),
        spill_ld=num(r"(\d+) bytes spill loads"), stack=num(r"(\d+) bytes stack frame"),
        smem=ck.metadata.shared + num(r"(\d+) bytes smem"), warps=ck.metadata.num_warps,
        stages=launch.num_stages, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        mma=len(re.findall(r"\bmma\.sync", ptx)), cp_async=len(re.findall(r"cp\.async\.(?:ca|cg)", ptx)),
        tma=len(re.findall(r"cp\.async\.bulk", ptx)),
    )


# ------------------------------------------------------------------------------------------ the model
def programs(launch: KL.Launch) -> int:
    n = 1
    for g in launch.grid:
        n *= g
    return n


def estimate_us(launch: KL.Launch, low: bool, graph: bool = True, scratch_in_hbm: bool = False) -> float:
    """performance.md's rule, max(bytes / HBM, FLOPs / peak), with the launch terms measured on an H200
    (``common.launched_us``). The split-K partials (a few MiB, written and read back within the step, the same
    buffer every step) are taken as L2-resident unless ``scratch_in_hbm``."""
    return common.launched_us(_roofline_us(launch, low, scratch_in_hbm), graph)


def _roofline_us(launch: KL.Launch, low: bool, scratch_in_hbm: bool = False) -> float:
    nbytes = launch.bytes + (launch.scratch_bytes if scratch_in_hbm else 0)
    return max(nbytes / HBM, launch.flops / PEAK[low]) * 1e6


def filled_us(launch: KL.Launch, low: bool, graph: bool = True, sms: int = KL.H100.sms) -> float:
    """The estimate with a launch of n < sms programs given n/sms of the bandwidth and of the peak (this tool's
    assumption, pessimistic for memory-bound launches: one SM can pull more than its 1/sms share)."""
    return common.launched_us(_roofline_us(launch, low) * max(1.0, sms / programs(launch)), graph)


def calibrated_us(name: str, launch: KL.Launch, B: int, dtype: torch.dtype, blocks_per_sm: int | None,
                  spill_bytes: int = 0) -> float:
    """GPU time of one launch under the model calibrated on the H200's per-kernel timings (``kernel_fit``): the
    L2 traffic of the tiling, the compulsory bytes (partials included) and the FLOPs at fitted rates; the SMs a last
    partial wave of ``blocks_per_sm`` programs per SM leaves idle charged, and each program round after the first
    (waves of ``blocks_per_sm`` programs an SM, times a stationary tile's row passes; ``None``: every program
    resident at once, the lower bound for any occupancy); ``spill_bytes``: a thread's spill stores + loads."""
    return kernel_fit.calibrated_us(l2_bytes(name, launch, B, dtype), launch.bytes + launch.scratch_bytes,
                                    launch.flops, programs(launch), blocks_per_sm,
                                    kernel_fit.cls_of(dtype_name(dtype)),
                                    passes=kernel_fit.row_passes(B, launch.tile), spill_bytes=spill_bytes)


def l2_bytes(name: str, launch: KL.Launch, B: int, dtype: torch.dtype) -> int:
    """What the programs move through L2 in total: operands re-read by other tiles and the partials too."""
    isz = dtype.itemsize
    m_tiles, n_tiles = launch.grid[0], launch.grid[1]
    extra = launch.scratch_bytes
    if name in ("fwd_cell", "bwd_cell"):  # A (B x P) read by every H slice, the weight by every row block
        W = 4 * H * P if name == "fwd_cell" else H * P  # w_rec (P x 4H) or w_proj (H x P)
        extra += (n_tiles - 1) * B * P * isz + (m_tiles - 1) * W * isz
    elif name in ("fwd_proj", "bwd_rec"):
        K = H if name == "fwd_proj" else 4 * H
        extra += (n_tiles - 1) * B * K * isz + (m_tiles - 1) * K * P * isz
    return launch.bytes + extra


def plan(dtype, B, training, tiles=None):
    return KL.launch_plan(B, T, H, P, dtype, training=training, tiles=tiles, **FLAGS)


def step_us(pl: dict, low: bool, graph: bool, scratch_in_hbm: bool = False, filled: bool = False
            ) -> tuple[float, float]:
    """(forward step, backward step) in µs; bwd_reduce's one extra launch per call is spread over the T steps."""
    steps = pl["fwd_cell"].count

    def est(k):
        one = filled_us(pl[k], low, graph) if filled else estimate_us(pl[k], low, graph, scratch_in_hbm)
        return one * pl[k].count / steps

    fwd = sum(est(k) for k in ("fwd_cell", "fwd_proj", "fwd_reduce") if k in pl)
    bwd = sum(est(k) for k in ("bwd_cell", "bwd_rec", "bwd_reduce") if k in pl)
    return fwd, bwd


def gemm_us(M: int, N: int, K: int, isz: int, low: bool, graph: bool) -> float:
    """A cuBLAS GEMM outside the time loop at the same roofline (operands and result once)."""
    return max((M * K + K * N + M * N) * isz / HBM, 2 * M * N * K / PEAK[low]) * 1e6 + (
        0 if graph else common.TORCH_LAUNCH_US)


def chain_us(dtype, B: int, training: bool, graph: bool, steps: int = T) -> float:
    """One chain call of ``steps`` steps: input projection and time loop, + backward loop and the
    after-loop GEMMs (dW_in, dW_rec, dW_proj, dx) and the db column sum in training."""
    low = dtype != torch.float32
    isz = dtype.itemsize
    pl = KL.launch_plan(B, steps, H, P, dtype, training=training, **FLAGS)
    fwd, bwd = step_us(pl, low, graph)
    N = B * steps
    total = gemm_us(N, 4 * H, D, isz, low, graph) + steps * fwd
    if training:
        total += steps * bwd
        total += (gemm_us(D, 4 * H, N, isz, low, graph) + gemm_us(P, 4 * H, N, isz, low, graph)
                  + gemm_us(H, P, N, isz, low, graph) + gemm_us(N, D, 4 * H, isz, low, graph)
                  + N * 4 * H * isz / HBM * 1e6 + (0 if graph else common.TORCH_LAUNCH_US))
    return total


# ------------------------------------------------------------------------------------------ report
def report(md_path: str | None) -> int:
    work = tempfile.mkdtemp(prefix="lstmp_ptxas_")
    rows, bad = [], []
    for dtype, B, training in VARIANTS:
        low = dtype != torch.float32
        pl = plan(dtype, B, training)
        for name, launch in pl.items():
            r = _compile(launch, work)
            n = programs(launch)
            t = launch.tile
            spills = r["spill_st"] + r["spill_ld"]
            split = launch.constexprs.get("KS")
            tile = (f"{t.BM}x{t.BN}" + (f"x{t.BK}" if t.BK else "") + (f" KS={split}" if split else "")
                    + (f" stationary g{t.groups}" if t.stationary else ""))
            cells = [name, dtype_name(dtype), B, "train" if training else "infer", tile,
                     f"{r['warps']}/{r['stages']}", f"{'x'.join(map(str, launch.grid))}={n}", r["regs"],
                     f"{r['spill_st']}/{r['spill_ld']}", r["stack"], r["smem"] // 1024, r["wgmma"], r["mma"],
                     f"{r['cp_async']}/{r['tma']}", f"{launch.bytes / 1e6:.2f}",
                     f"{l2_bytes(name, launch, B, dtype) / 1e6:.1f}", f"{launch.flops / 1e9:.2f}",
                     f"{estimate_us(launch, low):.2f}", f"{filled_us(launch, low):.2f}",
                     f"{calibrated_us(name, launch, B, dtype, kernel_fit.occupancy(r), spills):.2f}"]
            rows.append("| " + " | ".join(map(str, cells)) + " |")
            print(rows[-1], flush=True)
            bad += rule_violations(name, launch, r, B, low)
    head = ("| kernel | dtype | B | mode | tile BMxBNxBK | warps/stages | grid=programs | regs | spill st/ld B | "
            "stack B | smem KiB | wgmma | mma | cp.async/TMA | MB | L2 MB | GFLOP | est µs | filled µs | "
            "calibrated µs |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = ["## Every launch (after)", "", head, *rows, "",
             "## Estimates per step (µs): rule in a CUDA graph / rule outside one (an eager launch: max(kernel, "
             "42 µs)) / filled in a graph",
             "", "| dtype | B | mode | fwd step | bwd step | chain call (graph / no graph) |",
             "|---|---|---|---|---|---|"]
    for dtype, B, training in VARIANTS:
        low = dtype != torch.float32
        pl = plan(dtype, B, training)
        f = [step_us(pl, low, True), step_us(pl, low, False), step_us(pl, low, True, filled=True)]
        c = [chain_us(dtype, B, training, g) for g in (True, False)]
        bwd = " / ".join(f"{x[1]:.1f}" for x in f) if training else "-"
        lines.append(f"| {dtype_name(dtype)} | {B} | {'train' if training else 'infer'} | "
                     f"{' / '.join(f'{x[0]:.1f}' for x in f)} | {bwd} | {c[0]:.0f} / {c[1]:.0f} |")
    lines += ["", "## The biLM's four LSTMP chains (2 layers x 2 directions), bf16, against performance.md's targets",
              "", "| what | graph | no graph | target |", "|---|---|---|---|"]
    one = [4 * chain_us(torch.bfloat16, 1, False, g, steps=22) / 1e3 for g in (True, False)]
    lines.append(f"| batch-1 forward, 20 tokens + 2 boundary tokens (ms) | {one[0]:.2f} | {one[1]:.2f} | "
                 "<= 1 ms for the whole biLM |")
    tr = [4 * chain_us(torch.bfloat16, 384, True, g) / 1e3 for g in (True, False)]
    lines.append(f"| training step, 384 rows x 20 steps, forward + backward (ms) | {tr[0]:.2f} | {tr[1]:.2f} | "
                 f"<= {384 * 20 / 400e3 * 1e3:.1f} ms for the whole step (400k tokens/s) |")
    env = common.environment()
    lines += ["", f"device: sm_90a compiled on CPU, no GPU run; triton {env['triton']}, torch {env['torch']}, "
                  f"commit {env['commit']}, command `{env['command']}`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if md_path:
        Path(md_path).write_text(text)
    for v in bad:
        print("RULE:", v)
    return 1 if bad else 0


def rule_violations(name, launch, r, B, low) -> list[str]:
    tag = f"{name} {'16bit' if low else 'fp32'} B={B}"
    out = []
    if (r["spill_st"] or r["spill_ld"]) and (low or B <= 128):
        out.append(f"{tag}: spills {r['spill_st']}/{r['spill_ld']} B")
    if low and launch.flops and not (r["wgmma"] or r["mma"]):
        out.append(f"{tag}: GEMM without tensor-core instructions")
    if launch.tile.BK and not (r["cp_async"] or r["tma"]):  # BK = 0: no K loop (reduce kernels, stationary)
        out.append(f"{tag}: K loop without async copies")
    if few_programs(launch, B):
        out.append(f"{tag}: {programs(launch)} programs < {KL.H100.sms} SMs")
    return out


def few_programs(launch: KL.Launch, B: int) -> bool:
    """The programs rule broken: fewer programs than SMs at B >= 128, but for a stationary cell launch
    (``KL.STATIONARY_EXEMPT``: one program per (row group, H slice) by design)."""
    return B >= 128 and programs(launch) < KL.H100.sms and not launch.tile.stationary


def dtype_name(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


# ------------------------------------------------------------------------------------------ search
def candidates(name: str, B: int, low: bool) -> list[KL.Tile]:
    """Tiles worth compiling: block dims within the problem, accumulators and stages that can fit."""
    bm_max = max(16, triton.next_power_of_2(B))
    out = []
    if name.endswith("reduce"):
        for bm, bn in itertools.product((16, 32, 64), (16, 32, 64, 128)):
            if bm <= bm_max:
                out.append(KL.Tile(bm, bn, 0, 4, 1))
        return out
    cell = name.endswith("cell")
    n_acc = 4 if name == "fwd_cell" else 1
    for bm, bn, bk, warps in itertools.product((16, 32, 64, 128), (16, 32, 64, 128, 256), (16, 32, 64, 128),
                                               (4, 8)):
        if bm > bm_max or (cell and bn > 128) or (low and bk < 32) or (not low and bk > 32) or bk < 16:
            continue
        if n_acc * bm * bn / (32 * warps) > (128 if low else 64):  # accumulator registers per thread
            continue
        if bm * bn < 32 * warps * (4 if low else 2):  # too small a tile for this many warps
            continue
        stage_bytes = (bm * bk + n_acc * bk * bn) * (2 if low else 4)
        stages = min(4, SMEM_BLOCK // stage_bytes)  # memory-bound loops: as deep as shared memory allows
        if stages >= 2:  # the forward cell kernel in its class's design (kernels/lstmp.FUSED_GATES)
            out.append(KL.Tile(bm, bn, bk, warps, stages, fused=KL._fused(name, low)))
    # The stationary design (the slice's whole weight and one A tile in shared memory): a candidate only where one
    # row block of the other tiles cannot hold the batch; up to B = 128 a 128-row tile reads the same L2 bytes from
    # the same grid, with a pipelined K loop, and the stationary design would win only by its programs exemption.
    # Row groups: divisors of the row block count only (the model charges idle SMs, not a group with one block more).
    if (KL._fused(name, low) or name == "bwd_cell") and low and B > 128:
        width = 4 if name == "fwd_cell" else 1  # weight columns per H unit: the forward's four gates
        for bm, bn, warps, groups in itertools.product((64, 128), (16, 32, 64, 128), (4, 8), (1, 2, 3, 4)):
            blocks = triton.cdiv(B, bm)
            if (bm <= bm_max and KL._stationary_smem(name, KL.Tile(bm, bn), P, 2) <= SMEM_BLOCK
                    and width * bm * bn / (32 * warps) <= 128 and groups <= blocks and blocks % groups == 0):
                out.append(KL.Tile(bm, bn, 0, warps, 1, fused=KL._fused(name, low), stationary=True, groups=groups))
    return out


def _prekey(name, dtype, B, tile):
    """Compile-free ranking: the programs rule at B >= 128, the calibrated estimate (``calibrated_us``: until
    2026-11-27 the SM-fill-charged roofline, which the H200 found 2-12x short and blind to the L2 traffic that set
    the measured times; every program of the grid taken as resident, so only a grid of fewer than ``sms`` programs
    is charged for idle SMs: occupancy needs the compiled code), then L2 traffic."""
    launch = plan(dtype, B, True, {name: tile})[name]
    return (few_programs(launch, B),
            round(calibrated_us(name, launch, B, dtype, blocks_per_sm=None), 2), l2_bytes(name, launch, B, dtype))


def search(kernels=KL.KERNELS, batches=KL.BATCHES, dtypes=(torch.bfloat16, torch.float32)) -> int:
    """Per (dtype, B, kernel): candidates in order of the compile-free key (programs rule, estimate, L2
    traffic); compile group by group and keep the passing candidate (no rule broken, no spill) with the best
    calibrated estimate at its compiled occupancy, then the fewest registers a thread (headroom against spills),
    then the fewest registers x warps. The compile-free estimate takes every program as resident, so it bounds the
    compiled one from below: the search stops at the first group whose key is above the best compiled estimate."""
    work = tempfile.mkdtemp(prefix="lstmp_ptxas_")
    chosen = {}
    for dtype, B in itertools.product(dtypes, batches):
        low = dtype != torch.float32
        for name in kernels:
            prekey = functools.partial(_prekey, name, dtype, B)
            best = None
            for key, group in itertools.groupby(sorted(candidates(name, B, low), key=prekey), key=prekey):
                if best and (key[0] or key[1] > best[1][0]):
                    break
                for tile in group:
                    launch = plan(dtype, B, True, {name: tile})[name]
                    try:
                        r = _compile(launch, work)
                    except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is dropped
                        print(f"  {name} {tile}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    bad = rule_violations(name, launch, r, B, low) + (["spills"] if r["spill_st"] else [])
                    print(f"  {name} {dtype_name(dtype)} B={B} {tile} key={key} regs={r['regs']} "
                          f"spill={r['spill_st']} wgmma={r['wgmma']} mma={r['mma']} {'; '.join(bad)}", flush=True)
                    rank = (round(calibrated_us(name, launch, B, dtype, kernel_fit.occupancy(r)), 2), r["regs"],
                            r["regs"] * r["warps"])
                    if not bad and (best is None or rank < best[1]):
                        best = (tile, rank)
            chosen[(name, "16bit" if low else "fp32", B)] = best[0]
            print(f"{name} {dtype_name(dtype)} B={B}: {best[0]}", flush=True)
    print("\nTUNED = {")
    for (name, cls, B), t in chosen.items():
        flags = f", stationary=True, groups={t.groups}" if t.stationary else ""
        print(f"    ({name!r}, {cls!r}, {B}): Tile({t.BM}, {t.BN}, {t.BK}, {t.warps}, {t.stages}{flags}),")
    print("}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--md", help="write the markdown tables here")
    ap.add_argument("--search", action="store_true", help="compile candidate tiles and print TUNED")
    ap.add_argument("--kernels", nargs="*", default=list(KL.KERNELS), choices=KL.KERNELS, help="--search: these only")
    ap.add_argument("--batches", nargs="*", type=int, default=list(KL.BATCHES), help="--search: these only")
    ap.add_argument("--dtypes", nargs="*", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                    help="--search: these only")
    a = ap.parse_args()
    triton.knobs.cache.dir = os.path.join(tempfile.gettempdir(), "lstmp_compile_cache")
    if a.search:
        dts = [{"bf16": torch.bfloat16, "fp32": torch.float32}[d] for d in a.dtypes]
        return search(a.kernels, a.batches, dts)
    return report(a.md)


if __name__ == "__main__":
    sys.exit(main())
