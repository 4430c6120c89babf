"""The compile-time model of the LSTMP kernels, calibrated on the one set of per-kernel GPU timings we have.

    python bench/kernel_fit.py            # fit, leave-one-out check -> bench/results/kernel_fit.md
    python bench/kernel_fit.py --build    # rebuild bench/results/kernel_fit_rows.csv (needs git history)

The roofline of kernel_report / lstmp_compile (``max(bytes / 3.35 TB/s, FLOPs / peak) / busy``) counts every
operand once. On an H200 (2026-11-26, bench/results/gpu_h200.md, ``bench_lstmp.py`` part ``kernels``: each
launch of a middle step timed alone with ``triton.testing.do_bench``) the LSTMP kernels ran at 2-12x that
estimate. What the roofline leaves out is the traffic through L2: in a (row block x column slice) tiling every
program re-reads its rows' A tile and its slice's weights, so the operands cross L2 once per tile that reads them
(``lstmp_compile.l2_bytes``: 142 MB for the 58 MB of the bf16 forward cell kernel at B=384).

The calibrated model, per launch, GPU time only (the launch terms stay ``common.launched_us``'s)::

    calibrated_us = (max(L2 bytes / BW_L2, compulsory bytes / BW_HBM, FLOPs / (peak x eff)) / busy
                     + (rounds - 1) x round_us) x (1 + spill x KiB spilled a thread)

with ``busy`` the share of SMs a grid keeps busy (``busy()``) and ``rounds`` (``rounds()``) the program rounds an
SM runs one after another: waves of ``blocks_per_sm`` resident programs (registers, shared memory and warps of the
compiled code: ``occupancy()``), times the row blocks a stationary program walks in turn (``row_passes``). Each
program is a chain of dependent memory round trips (the K loop's pipeline fill, the epilogue's loads after the last
dot, its stores) that the programs resident beside it hide, but a later round cannot start before an earlier one
ends: the latency of every round after the first is charged, ``round_us`` (the occupancy term: more programs
resident, fewer rounds). ``spill``: the slowdown per KiB of local memory a thread stores and loads (ptxas' spill
counts). ``BW_L2``, ``BW_HBM``, ``eff``, ``round_us``, ``spill`` are fitted per operand class (16-bit; fp32 on the
FMA path) to the measured rows by least squares on log(time), together with a constant per-launch ``floor_us`` that
``do_bench`` adds to a lone launch (the timing floor of an empty-ish kernel: not counted in the sums, which use the
launch terms). The 16-bit tensor-core efficiency is not fitted: no measured 16-bit launch is bound by its FLOPs (it
stays 1). fp32 takes the 16-bit HBM rate, round latency and spill factor (``SHARED``): its L2 term binds in every row,
2 of its 12 launches run more than one round and none spills. The split-K reduce kernels (no K loop, 3 KB-20 MB,
floor-bound under do_bench) are left out of the fit.

Why rounds and not a per-warp rate: the second H200 lease (2026-11-27, bench/results/gpu_h200_s42.md) timed 14 cell
tiles at B=384 bf16. A Little's-law term (each SM's rate = min(its bandwidth share, resident warps x a per-warp rate))
fitted nothing: the forward and backward cell kernels at the same tile (64x32x32, 4 warps, 3 programs an SM) took
43.0 and 53.6 µs, the backward with fewer bytes of every kind, so one per-warp rate cannot serve both, and the fit
left it unused (rms unchanged, the fastest tiles ranked wrongly). Within a kernel the times follow the rounds: the
tiles that keep 3 programs an SM resident (2 waves) beat those that keep 1 (3 waves), and the stationary tile (one
wave, but 6 row blocks a program in turn, its row loop not pipelined) lost to them. The w4 and w8 builds of the same
128x64 backward tile keep the same warps resident (5.8 an SM) and differ only in their spills (5.3 KiB against 96 B
a thread): 110 against 69 µs; hence the spill factor (the search, ``lstmp_compile --search``, drops spilling tiles
anyway).

The rows (``kernel_fit_rows.csv``, ``build_rows``) join every timed launch with what its kernel compiled to at the
code that ran and with the geometry of ``launch_plan`` for its tile: the first lease's per-kernel rows (2026-11-26,
gpu_h200_rows.jsonl: the kernel report of 58edc9c, committed in 43df509; the kernels did not change between that
commit and the one that ran, 2bde5e4) and the second lease's (gpu_h200_s42_rows.jsonl: per-kernel rows of call 1 and
the tile sweep of call 3, at 1aca4d1; the tile sweep of call 5, at 0ac4030, from gpu_h200_s42_logs.txt), compiled
for sm_90a here (the @triton.jit code of kernels/lstmp.py and _common.py is the same at 1aca4d1, 0ac4030 and the
commit that built the rows). The fitted constants are ``FIT``; tests/test_kernel_fit.py refits them from the CSV
and checks the leave-one-out error this module reports and the ranking of the B=384 tile sweeps.

What the fit is and is not: 46 16-bit launches (34 of them cell kernels at B=384) and 12 fp32 ones, one GPU, two
code versions, cold L2 (``do_bench`` flushes it before each call). It says which term binds and by about how much and
picks the fastest of the timed B=384 cell tiles (in sample: the same rows fit ``round_us`` and ``spill``, and the
spill factor rests mostly on one pair of builds, 128x64 backward w4 against w8), but it still misses the backward
cell kernel by up to x0.7 (its bytes cost more than the forward's), and only one timed launch (32x32x32 forward,
293 MB) is bound by L2 traffic, so ``BW_L2`` rests on it. It is no substitute for timing a new tiling.
"""
from __future__ import annotations

import os

if __name__ == "__main__":  # --build compiles (JITFunction), not the interpreter's: before triton is imported
    os.environ.pop("TRITON_INTERPRET", None)

import argparse  # noqa: E402
import ast  # noqa: E402
import csv  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROWS_CSV = common.RESULTS / "kernel_fit_rows.csv"
H200_ROWS = common.RESULTS / "gpu_h200_rows.jsonl"
S42_ROWS = common.RESULTS / "gpu_h200_s42_rows.jsonl"  # the second lease (2026-11-27)
S42_LOGS = common.RESULTS / "gpu_h200_s42_logs.txt"


def h200_rows(bench: str, path: Path = H200_ROWS) -> list[dict]:
    """The committed H200 rows (one JSON object a line) of one bench (``lstmp``, ``lstmp_kernels``, ``softmax``)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("bench") == bench]
OLD_REPORT = ("43df509", "bench/results/kernel_report.csv")  # compile stats of the kernels that ran on the H200
SMS = 132
PEAK = {"16bit": 990e12, "fp32": 67e12}
FIELDS = ["kernel", "B", "dtype", "mode", "tile", "launch_tile", "grid", "programs", "warps", "blocks_per_sm", "passes",
          "regs", "spill_bytes", "tensor_cores", "flops", "hbm_bytes", "l2_bytes", "measured_us", "roofline_us",
          # where the timing ran (the H200 row's own record: its bench, the file it is in) and where the compile
          # stats come from
          "bench", "source", "device", "torch", "triton", "cuda", "commit", "date", "command", "compile_stats"]
PROVENANCE = ("device", "torch", "triton", "cuda", "commit", "date", "command")
FIT_KERNELS = ("fwd_cell", "fwd_proj", "bwd_cell", "bwd_rec")

# Fitted by ``fit(load_rows(), cls)`` (tests/test_kernel_fit.py checks that a refit gives these back). ``round_us``:
# the latency of a program round that the resident programs cannot hide (``rounds``); ``spill``: the slowdown per KiB
# a thread spills (stores + loads, ptxas); fp32 takes both and the HBM rate from the 16-bit fit.
FIT = {
    "16bit": dict(floor_us=5.91, bw_l2=8.07e12, bw_hbm=1.60e12, eff=1.0, round_us=4.60, spill=0.409),
    "fp32": dict(floor_us=4.25, bw_l2=1.18e12, bw_hbm=1.60e12, eff=0.424, round_us=4.60, spill=0.409),
}
SHARED = ("bw_hbm", "round_us", "spill")  # what the fp32 class takes from the 16-bit fit


def cls_of(dtype: str) -> str:
    return "fp32" if dtype in ("fp32", "float32") else "16bit"


REGS_PER_SM, SMEM_PER_SM, MAX_WARPS, MAX_BLOCKS = 65536, 228 * 1024, 64, 32  # an H100 / H200 SM


def occupancy(st: dict) -> int:
    """Programs per SM from registers (allocated per warp in units of 256), shared memory and warps; ``st``: the
    compile stats (``regs``, ``smem`` bytes, ``warps``)."""
    warps = st["warps"]
    per_warp = -(-max(st["regs"], 1) * 32 // 256) * 256
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_smem = SMEM_PER_SM // (st["smem"] + 1024) if st["smem"] else MAX_BLOCKS  # 1 KiB reserved per block
    return min(by_regs, by_smem, MAX_WARPS // warps, MAX_BLOCKS)


def busy(programs: int, blocks_per_sm: int | None) -> float:
    """Share of the SMs a grid keeps busy: n < SMS programs use n SMs; a last partial wave of ``blocks_per_sm``
    programs per SM idles the rest of its slots, but never more than with fewer programs resident (a lone program
    may use its SM's whole bandwidth), so the share never falls as occupancy rises. ``None``: every program resident
    at once (the upper bound, for a tile whose compiled code is not known)."""
    if blocks_per_sm is None:
        return min(1.0, programs / SMS)

    def with_slots(k: int) -> float:
        slots = SMS * k
        return min(1.0, programs / SMS) if programs <= slots else programs / (math.ceil(programs / slots) * slots)

    return max(with_slots(k) for k in range(1, max(blocks_per_sm, 1) + 1))


def rounds(programs: int, blocks_per_sm: int | None, passes: int = 1) -> int:
    """Program rounds an SM runs one after another: waves of ``blocks_per_sm`` programs an SM (``None``: every
    program resident at once, one wave), times ``passes``, the row blocks a program walks one after another (a
    stationary tile's: ``row_passes``; 1 for every K-loop tile)."""
    waves = 1 if blocks_per_sm is None else math.ceil(programs / (SMS * max(blocks_per_sm, 1)))
    return waves * max(passes, 1)


def row_passes(B: int, tile) -> int:
    """The row blocks one program of ``tile`` (a kernels.lstmp.Tile) walks one after another at batch ``B``: a
    stationary tile's row blocks per row group (grid (groups, H/BN)), 1 for a K-loop tile (one row block each)."""
    return math.ceil(math.ceil(B / tile.BM) / tile.groups) if tile.stationary else 1


def launch_passes(meta: dict, grid: tuple, B: int) -> int:
    """``row_passes`` from a built launch: its constexprs (``STATIONARY``, ``BB`` rows a block) and grid (a stationary
    launch's first dimension: its row groups)."""
    return math.ceil(math.ceil(B / meta["BB"]) / grid[0]) if meta.get("STATIONARY") else 1


def terms_us(l2_bytes: float, hbm_bytes: float, flops: float, cls: str, params: dict | None = None) -> dict:
    """The three throughput terms in µs (before the SM-fill factor)."""
    p = params or FIT[cls]
    return dict(l2=l2_bytes / p["bw_l2"] * 1e6, hbm=hbm_bytes / p["bw_hbm"] * 1e6,
                mma=flops / (PEAK[cls] * p["eff"]) * 1e6)


def calibrated_us(l2_bytes: float, hbm_bytes: float, flops: float, programs: int, blocks_per_sm: int | None,
                  cls: str, params: dict | None = None, *, passes: int = 1, spill_bytes: int = 0) -> float:
    """GPU time of one launch (no launch term, no timing floor) under the calibrated model: the binding throughput
    term over the busy share of the SMs, plus ``round_us`` for each program round after the first (``rounds``:
    latency the resident programs do not hide), slowed by ``spill`` per KiB that a thread spills. ``passes``: a
    stationary tile's row blocks per program (``row_passes``); ``spill_bytes``: ptxas' spill stores + loads a thread
    (0 where the compiled code is not known)."""
    p = params or FIT[cls]
    bound = max(terms_us(l2_bytes, hbm_bytes, flops, cls, p).values()) / busy(programs, blocks_per_sm)
    late = (rounds(programs, blocks_per_sm, passes) - 1) * p["round_us"]
    return (bound + late) * (1 + p["spill"] * spill_bytes / 1024)


def binding(l2_bytes: float, hbm_bytes: float, flops: float, cls: str) -> str:
    t = terms_us(l2_bytes, hbm_bytes, flops, cls)
    return max(t, key=t.get)


# ------------------------------------------------------------------------------------------ rows
def load_rows(path: Path = ROWS_CSV) -> list[dict]:
    ints = ("B", "programs", "warps", "blocks_per_sm", "passes", "regs", "spill_bytes", "tensor_cores", "flops",
            "hbm_bytes", "l2_bytes")
    out = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            out.append({**r, **{k: int(r[k]) for k in ints},
                        **{k: float(r[k]) for k in ("measured_us", "roofline_us")}})
    return out


def parse_tile(text: str, fused: bool = False):
    """A tile as the rows name it (``tile_text``, with or without its design; the sweep's rows add ``(tuned)``),
    e.g. ``64x32x0 w8 s1 fused stationary g1 (tuned)``, as a ``kernels.lstmp.Tile``. ``fused``: the design where the
    text does not name it (bench_kernels' rows print dims, warps and stages only)."""
    from elmo_fast.kernels import lstmp as KL

    m = re.fullmatch(r"(\d+)x(\d+)x(\d+) w(\d+) s(\d+)( fused)?( stationary g(\d+))?( \(tuned\))?", text.strip())
    if not m:
        raise ValueError(f"parse_tile: {text!r} is not a tile text")
    bm, bn, bk, warps, stages = map(int, m.group(1, 2, 3, 4, 5))
    return KL.Tile(bm, bn, bk, warps, stages, fused=bool(m.group(6)) or fused, stationary=bool(m.group(7)),
                   groups=int(m.group(8) or 1))


def tile_text(t, design: bool = True) -> str:
    """The tile text: ``BMxBNxBK wW sS``, with ``design`` every other field of ``Tile`` too (what ``parse_tile`` reads
    back to the same tile); without, the per-kernel rows' form (bench_lstmp's ``kernels`` part: their design is the
    commit's, ``_fused_gates_at``)."""
    return (f"{t.BM}x{t.BN}x{t.BK} w{t.warps} s{t.stages}"
            + ((" fused" if t.fused else "") + (f" stationary g{t.groups}" if t.stationary else "") if design else ""))


def _fused_gates_at(commit: str) -> dict:
    """``kernels/lstmp.FUSED_GATES`` as it stood at ``commit`` (absent before the gate-interleaved design: every
    class one dot per gate)."""
    text = subprocess.run(["git", "show", f"{commit}:kernels/lstmp.py"], cwd=common.ROOT, check=True,
                          capture_output=True, text=True).stdout
    m = re.search(r"^FUSED_GATES\s*=\s*(\{.*\})", text, re.M)
    return ast.literal_eval(m.group(1)) if m else {"16bit": False, "fp32": False}


def s42_rows(path: Path = S42_ROWS, logs: Path = S42_LOGS) -> list[dict]:
    """The second H200 lease's per-launch timings (2026-11-27, bench/results/gpu_h200_s42.md): the rows of
    ``path`` (bench ``lstmp_kernels``, call 1, and ``lstmp_tiles``, call 3, at 1aca4d1) and the tile sweep of call 5
    (0ac4030), which is only in the logs' text: its lines name the tile with its design and the median; the rest of
    its provenance is the call's header and gpu_h200_s42.md's (the lease's device and versions, the call's command)."""
    out = [dict(r, source=path.name) for bench in ("lstmp_kernels", "lstmp_tiles") for r in h200_rows(bench, path)]
    text = logs.read_text()
    head = "######## call 5: bash .devtmp/final.sh (code of 0ac4030; the device copy's git metadata said 1aca4d1)"
    part = text[text.index(head):]
    part = part[part.index("## tiles\n"):part.index("wrote tiles rows")]
    meta = {k: out[0][k] for k in ("device", "torch", "triton", "cuda")}  # one lease, one machine
    for line in part.splitlines()[1:]:
        m = re.fullmatch(r"(\w+) bfloat16 B=(\d+) (.+?) +grid (\S+) +: +([\d.]+) us \(estimate +([\d.]+)\)", line)
        if not m:
            raise AssertionError(f"s42_rows: call 5's tile line {line!r} not understood")
        out.append(dict(meta, bench="lstmp_tiles", kernel=m.group(1), B=m.group(2), dtype="bfloat16", mode="train",
                        tile=m.group(3), grid=m.group(4), us_p50=m.group(5), est_us=m.group(6), commit="0ac4030",
                        date="2026-11-27 (call 5, 21:4x-22:09Z)",
                        command="bash .devtmp/final.sh: python3 bench/bench_lstmp.py --parts tiles --batches 384 "
                                "--dtypes bf16 (gpu_h200_s42.md, call 5)",
                        source=f"{logs.name} call 5"))
    return out


_JOBS: list = []  # the launches compile_launches hands its forked workers (by index: a Launch holds a JITFunction)


def _compile_job(i: int) -> dict:
    """One launch compiled for sm_90a (``lstmp_compile._compile``: triton's binder, ptxas -v): the stats the model
    joins (registers, shared memory, warps -> programs per SM; tensor-core instructions)."""
    import tempfile

    import lstmp_compile as LC

    with tempfile.TemporaryDirectory(prefix="kernel_fit_") as work:
        return LC._compile(_JOBS[i], work)


def compile_launches(launches: list, jobs: int = 2) -> list[dict]:
    """``_compile_job`` over ``launches`` in ``jobs`` processes, into a fresh temporary triton cache."""
    import multiprocessing
    import tempfile

    import triton

    global _JOBS
    _JOBS = list(launches)
    with tempfile.TemporaryDirectory(prefix="kernel_fit_cache_") as cache:
        triton.knobs.cache.dir = cache
        if jobs > 1:
            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                return pool.map(_compile_job, range(len(_JOBS)), chunksize=1)
        return [_compile_job(i) for i in range(len(_JOBS))]


def _geometry(name: str, B: int, dtype, tile) -> tuple:
    """(the launch ``launch_plan`` builds for ``tile``, with bench_lstmp's flags: both clips, forward direction,
    residual (the 'fwd resid' variant of the report); its grid text). Training plan for every row: a B=1 inference
    row's bytes then count the cache write of training (B x 4H, 32 KiB at B=1) as the first rows did."""
    import lstmp_compile as LC
    from elmo_fast.kernels import lstmp as KL

    lc = KL.launch_plan(B, 20, LC.H, LC.P, dtype, training=True, tiles={name: tile}, cell_clip=True,
                        proj_clip=True, reverse=False, residual=True)[name]
    return lc, "x".join(map(str, lc.grid))


def _row(r: dict, name: str, B: int, dt: str, tile, lc, grid: str, st: dict, compile_stats: str) -> dict:
    import lstmp_compile as LC
    import torch

    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    return dict(kernel=name, B=B, dtype=dt, mode=r["mode"], tile=r["tile"], launch_tile=tile_text(tile), grid=grid,
                programs=LC.programs(lc), warps=tile.warps, blocks_per_sm=st["blocks_per_sm"],
                passes=row_passes(B, tile), regs=st["regs"],
                spill_bytes=st["spill_bytes"], tensor_cores=st["tensor_cores"], flops=lc.flops,
                hbm_bytes=lc.bytes + lc.scratch_bytes,
                l2_bytes=LC.l2_bytes(name, lc, B, dtype), measured_us=float(r["us_p50"]),
                roofline_us=float(r["est_us"]), bench=r.get("bench", "lstmp_kernels"), source=r["source"],
                **{k: r[k] for k in PROVENANCE}, compile_stats=compile_stats)


def build_rows(jobs: int = 2) -> list[dict]:
    """Every timed LSTMP launch joined with the compile stats of the code that ran and launch_plan's geometry: the
    first lease's per-kernel rows (compile stats: the kernel report of 58edc9c, committed in 43df509), then the
    second lease's per-kernel and tile-sweep rows (compiled here at HEAD for sm_90a: the @triton.jit functions of
    kernels/lstmp.py and kernels/_common.py are the same at 1aca4d1, 0ac4030 and HEAD; only host code and TUNED
    changed)."""
    import torch

    import lstmp_compile as LC
    from elmo_fast.kernels import lstmp as KL

    names = {"fwd_cell": "_fwd_cell_kernel", "fwd_proj": "_splitk_kernel", "fwd_reduce": "_fwd_reduce_kernel",
             "bwd_cell": "_bwd_cell_kernel", "bwd_rec": "_splitk_kernel", "bwd_reduce": "_bwd_reduce_kernel"}
    text = subprocess.run(["git", "show", f"{OLD_REPORT[0]}:{OLD_REPORT[1]}"], cwd=common.ROOT, check=True,
                          capture_output=True, text=True).stdout
    old = list(csv.DictReader(io.StringIO(text)))
    out = []
    for r in h200_rows("lstmp_kernels"):
        name, B = r["kernel"], int(r["B"])
        dtype = torch.bfloat16 if r["dtype"] == "bfloat16" else torch.float32
        dt = "bf16" if dtype == torch.bfloat16 else "fp32"
        tile = parse_tile(r["tile"])  # fused=False: one dot per gate then
        lc, grid = _geometry(name, B, dtype, tile)
        if grid != r["grid"]:
            raise AssertionError(f"{name} B={B} {dt}: launch_plan's grid {grid} is not the measured {r['grid']}")
        st = [o for o in old if o["op"] == "lstmp" and o["size"] == f"{r['mode']} B={B}" and o["dtype"] == dt
              and o["kernel"] == names[name] and o["variant"] == "fwd resid" and o["phase"] == name.split("_")[0]
              and o["grid"] == grid and not (name == "bwd_reduce" and o["slot"] == "0")]  # slot 0: the prologue
        if not st:
            raise AssertionError(f"{name} B={B} {dt}: no compile stats in {OLD_REPORT}")
        st = st[-1]
        if int(st["warps"]) != tile.warps:
            raise AssertionError(f"{name} B={B} {dt}: the report's {st['warps']} warps, the row's {tile.warps}")
        out.append(_row(dict(r, source=H200_ROWS.name), name, B, dt, tile, lc, grid,
                        dict(blocks_per_sm=int(st["blocks_per_sm"]), regs=int(st["regs"]),
                             spill_bytes=int(st["spill_st"]) + int(st["spill_ld"]),
                             tensor_cores=int(int(st["hgmma"]) + int(st["hmma"]) > 0)),
                        f"sm_90a, compiled without a GPU: {OLD_REPORT[1]} of {OLD_REPORT[0]} (code {st['commit']})"))
    # the second lease: compiled here, each distinct launch once
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "kernels/lstmp.py", "kernels/_common.py"],
                      cwd=common.ROOT).returncode:
        head += " with kernels/lstmp.py or kernels/_common.py modified in the working tree"
    todo, keys = [], {}
    fused_at = {}
    for r in s42_rows():
        name, B = r["kernel"], int(r["B"])
        dtype = torch.bfloat16 if r["dtype"] == "bfloat16" else torch.float32
        dt = "bf16" if dtype == torch.bfloat16 else "fp32"
        cls = cls_of(dt)
        if r["commit"] not in fused_at:
            fused_at[r["commit"]] = _fused_gates_at(r["commit"])
        # bench_kernels' text has no design words: the forward cell kernel's design of that commit, and a cell
        # kernel without a K loop (BK = 0) is the stationary one, one row group per grid row
        tile = parse_tile(r["tile"], fused=name == "fwd_cell" and r["bench"] == "lstmp_kernels"
                          and fused_at[r["commit"]][cls])
        if r["bench"] == "lstmp_kernels" and name.endswith("cell") and tile.BK == 0:
            tile = KL.Tile(tile.BM, tile.BN, 0, tile.warps, tile.stages, fused=tile.fused, stationary=True,
                           groups=int(r["grid"].split("x")[0]))
        lc, grid = _geometry(name, B, dtype, tile)
        if grid != r["grid"] or lc.tile != tile:
            raise AssertionError(f"{name} B={B} {dt} {r['tile']}: launch_plan's {grid} {lc.tile}, measured "
                                 f"{r['grid']}")
        # compiled as it ran: the row's mode (inference: no cache written)
        run = KL.launch_plan(B, 20, LC.H, LC.P, dtype, training=r["mode"] == "train", tiles={name: tile},
                             cell_clip=True, proj_clip=True, reverse=False, residual=True)[name]
        key = (name, B, dt, r["mode"], tile)
        if key not in keys:
            keys[key] = len(todo)
            todo.append(run)
        out.append((r, name, B, dt, tile, lc, grid, keys[key]))
    stats = compile_launches(todo, jobs)
    rows = [o for o in out if isinstance(o, dict)]
    for r, name, B, dt, tile, lc, grid, i in (o for o in out if not isinstance(o, dict)):
        s = stats[i]
        st = dict(blocks_per_sm=occupancy(s), regs=s["regs"], spill_bytes=s["spill_st"] + s["spill_ld"],
                  tensor_cores=int(s["wgmma"] + s["mma"] > 0))
        rows.append(_row(r, name, B, dt, tile, lc, grid, st,
                         f"sm_90a, compiled without a GPU at {head} (kernel_fit.py --build, lstmp_compile._compile; "
                         "the @triton.jit code of kernels/lstmp.py and _common.py as at 1aca4d1 and 0ac4030)"))
    return rows


# ------------------------------------------------------------------------------------------ fit
def predict_us(row: dict, params: dict) -> float:
    """A row's lone launch as do_bench timed it: the calibrated GPU time plus the timing floor."""
    return params["floor_us"] + calibrated_us(row["l2_bytes"], row["hbm_bytes"], row["flops"], row["programs"],
                                              row["blocks_per_sm"], cls_of(row["dtype"]), params,
                                              passes=row["passes"], spill_bytes=row["spill_bytes"])


def log_rms(rows: list[dict], params: dict) -> float:
    return math.sqrt(sum(math.log(predict_us(r, params) / r["measured_us"]) ** 2 for r in rows) / len(rows))


_RANGES = dict(floor_us=(1.0, 10.0), bw_l2=(0.3e12, 20e12), bw_hbm=(0.3e12, 6e12), eff=(0.02, 1.0),
               round_us=(0.01, 30.0), spill=(0.001, 10.0))


def fitted(rows: list[dict], cls: str) -> list[dict]:
    """The rows a class's constants are fitted to: its launches of ``FIT_KERNELS`` (the reduce kernels, floor-bound
    under do_bench, are left out)."""
    return [r for r in rows if cls_of(r["dtype"]) == cls and r["kernel"] in FIT_KERNELS]


def fit(rows: list[dict], cls: str, plain: bool = False) -> dict:
    """Least squares on log(time) over the class's rows: a log-spaced grid, then coordinate refinement (no
    randomness: the same rows give the same constants). fp32 takes the 16-bit class's HBM rate, round latency and
    spill factor (``SHARED``: in fp32 the L2 term binds everywhere and 2 of its 12 launches run more than one round,
    none spills) and fits its FLOP efficiency. ``plain``: the model before the round and spill terms (both 0), as
    fitted until 2026-11-27, for comparison."""
    if cls == "fp32":
        free = ["floor_us", "bw_l2", "eff"]
        sixteen = fit(rows, "16bit", plain)
        best = dict(floor_us=5.0, bw_l2=3e12, eff=1.0, **{k: sixteen[k] for k in SHARED})
    else:
        free = ["floor_us", "bw_l2", "bw_hbm"] + ([] if plain else ["round_us", "spill"])
        best = dict(floor_us=5.0, bw_l2=3e12, bw_hbm=2e12, eff=1.0, round_us=0.0 if plain else 1.0,
                    spill=0.0 if plain else 0.1)
    rows = fitted(rows, cls)
    for _ in range(2):  # coarse: each parameter over its range with the others held, twice round
        for k in free:
            lo, hi = _RANGES[k]
            grid = [lo * (hi / lo) ** (i / 64) for i in range(65)]
            best[k] = min(grid, key=lambda v: log_rms(rows, {**best, k: v}))
    step = 1.25
    while step > 1.0005:  # refine: multiplicative coordinate steps, shrinking
        moved = False
        for k in free:
            lo, hi = _RANGES[k]
            for v in (best[k] * step, best[k] / step):
                if lo <= v <= hi and log_rms(rows, {**best, k: v}) < log_rms(rows, best):
                    best[k], moved = v, True
        if not moved:
            step = math.sqrt(step)
    return best


def launch_key(row: dict) -> tuple:
    """What makes two rows the same launch: kernel, batch, dtype, mode, tile with its design, and the code that ran
    (its compile stats' source): the second lease timed some tiles twice (calls 3 and 5) and in both benches."""
    return (row["kernel"], row["B"], row["dtype"], row["mode"], row["launch_tile"], row["compile_stats"])


def leave_one_out(rows: list[dict], cls: str, plain: bool = False) -> list[tuple[dict, float]]:
    """Each of the class's fitted rows predicted by the constants fitted without its launch (every timing of the same
    launch held out together: ``launch_key``; fp32's shared constants then come from all 16-bit rows): (row,
    predicted / measured)."""
    out = []
    cache: dict = {}
    for r in fitted(rows, cls):
        key = launch_key(r)
        if key not in cache:
            cache[key] = fit([o for o in rows if launch_key(o) != key], cls, plain)
        out.append((r, predict_us(r, cache[key]) / r["measured_us"]))
    return out


def rms_of_ratios(ratios) -> float:
    ratios = list(ratios)
    return math.sqrt(sum(math.log(x) ** 2 for x in ratios) / len(ratios))


def is_first_lease(row: dict) -> bool:
    """A row of the first lease (2026-11-26, gpu_h200_rows.jsonl), the rows the model was first fitted to."""
    return row["source"] == H200_ROWS.name


def sweep(rows: list[dict], kernel: str, source: str) -> list[dict]:
    """One call's B=384 bf16 tile sweep of ``kernel`` (bench ``lstmp_tiles``): the timed tiles the model should rank."""
    return [r for r in rows if r["kernel"] == kernel and r["B"] == 384 and r["dtype"] == "bf16"
            and r["bench"] == "lstmp_tiles" and r["source"] == source]


def sweeps(rows: list[dict]) -> dict:
    """(kernel, source) -> that call's sweep rows, for every sweep in ``rows``."""
    keys = sorted({(r["kernel"], r["source"]) for r in rows if r["bench"] == "lstmp_tiles"},
                  key=lambda k: (k[0] != "fwd_cell", k[0], k[1] != S42_ROWS.name, k[1]))
    return {k: sweep(rows, *k) for k in keys}


def _ranks(vs) -> list[float]:
    """Ranks from 0, tied values sharing their mean rank."""
    order = sorted(range(len(vs)), key=lambda i: vs[i])
    out = [0.0] * len(vs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and vs[order[j + 1]] == vs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(xs, ys) -> float:
    """Rank correlation of two equally long sequences: the Pearson correlation of their ranks (ties: mean ranks)."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx, sy = math.sqrt(sum((a - mx) ** 2 for a in rx)), math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (sx * sy) if sx and sy else 0.0


# ------------------------------------------------------------------------------------------ report
def _source_line(rows: list[dict]) -> str:
    """Where a set of rows ran: per source file, its benches, the days, and each distinct provenance."""
    out = []
    for src in sorted({r["source"] for r in rows}, key=lambda x: (x != H200_ROWS.name, x)):
        mine = [r for r in rows if r["source"] == src]
        ran = sorted({", ".join(f"{k} {r[k]}" for k in PROVENANCE if k != "date") for r in mine})
        days = sorted({r["date"][:10] for r in mine})
        out.append(f"{src}: {len(mine)} rows (bench {', '.join(sorted({r['bench'] for r in mine}))}; "
                   f"{', '.join(days)}; {'; '.join(ran)})")
    return "; ".join(out)


def _rms(pairs, keep) -> str:
    xs = [x for r, x in pairs if keep(r)]
    return f"{rms_of_ratios(xs):.3f} (x{math.exp(rms_of_ratios(xs)):.2f})" if xs else "-"


def report(rows: list[dict]) -> str:
    env = common.environment()
    first = [r for r in rows if is_first_lease(r)]
    stats = sorted({r["compile_stats"] for r in rows})
    lines = ["# The LSTMP kernels' model, calibrated on the H200's per-kernel timings", "",
             f"Command: `python bench/kernel_fit.py` at `{env['commit']}` ({env['date']}, {env['device']}: a fit, "
             f"nothing timed here). Rows: `{ROWS_CSV.relative_to(common.ROOT)}`: {_source_line(rows)}. Compile stats: "
             + "; ".join(stats) + ". Model and method: the docstring of `bench/kernel_fit.py`.", "",
             "## Constants", "",
             "| class | floor µs | BW_L2 TB/s | BW_HBM TB/s | FLOP efficiency | round µs | spill per KiB | "
             "fitted rows |",
             "|---|---|---|---|---|---|---|---|"]
    shared = " (the 16-bit value)"
    for cls in ("16bit", "fp32"):
        p = fit(rows, cls)
        sh = shared if cls == "fp32" else ""
        lines.append(f"| {cls} | {p['floor_us']:.2f} | {p['bw_l2'] / 1e12:.2f} | {p['bw_hbm'] / 1e12:.2f}{sh} | "
                     f"{p['eff']:.2f}{' (not fitted)' if cls == '16bit' else ''} | {p['round_us']:.2f}{sh} | "
                     f"{p['spill']:.3f}{sh} | {len(fitted(rows, cls))} |")
    p16 = FIT["16bit"]
    near = [r for r in fitted(rows, "16bit") if (lambda t: t["l2"] >= 0.95 * max(t.values()))(
        terms_us(r["l2_bytes"], r["hbm_bytes"], r["flops"], "16bit"))]
    flat = log_rms(fitted(rows, "16bit"), {**p16, "bw_l2": 100 * p16["bw_l2"]}) - log_rms(fitted(rows, "16bit"), p16)
    lines += ["", f"16-bit BW_L2 is a lower bound: with it 100x higher the rms changes by {flat:+.4f}; the launches "
              f"whose L2 term comes within 5% of their binding term: "
              + (", ".join(f"{r['kernel']} B={r['B']} {r['launch_tile']}" for r in near) or "none") + "."]
    lines += ["", "## Error: rms of log(model / measured) over the fitted launches (reduce kernels left out)", "",
              "'before': the model without the round and spill terms; fitted to the first lease alone, it is the model "
              "as committed until this fit (its second-lease column is then a prediction: out of sample). "
              "Leave-one-out holds out every timing of a launch together (`launch_key`: the second lease timed some "
              "tiles two or three times). An rms of 0.2 is a typical factor of exp(0.2) = 1.22 either way.", "",
              "| class | model | fitted to | first lease: fitted | leave-one-out | second lease: fitted | "
              "leave-one-out |", "|---|---|---|---|---|---|---|"]
    models = {"before": (first, True), "before, refit": (rows, True), "this model": (rows, False)}
    held = {}
    fits = {}
    for cls in ("16bit", "fp32"):
        for name, (train, plain) in models.items():
            p = fits[(cls, name)] = fit(train, cls, plain)
            mine = fitted(rows, cls)
            got = [(r, predict_us(r, p) / r["measured_us"]) for r in mine]
            loo = held[(cls, name)] = leave_one_out(train, cls, plain)
            oos = " (prediction)" if train is first else ""
            lines.append(f"| {cls} | {name} | {'first lease' if train is first else 'all rows'} | "
                         f"{_rms(got, is_first_lease)} | {_rms(loo, is_first_lease)} | "
                         f"{_rms(got, lambda r: not is_first_lease(r))}{oos} | "
                         f"{_rms(loo, lambda r: not is_first_lease(r))} |")
    roof = [(r, r["roofline_us"] / r["measured_us"]) for r in fitted(rows, "16bit")]
    lines += ["", f"The roofline the runs printed (3 µs a launch in the first lease; the launch terms since): 16-bit "
              f"{_rms(roof, is_first_lease)} on the first lease, {_rms(roof, lambda r: not is_first_lease(r))} on "
              "the second.", "",
              "## Ranking the B=384 bf16 tile sweeps", "",
              "Each call's timed tiles of one kernel, ranked by the model against the clock (Spearman's rank "
              "correlation; 1 = the same order).", "",
              "| kernel | call | tiles | measured fastest | this model's fastest | rank corr. | before's fastest | "
              "rank corr. | before, refit: fastest | rank corr. |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (kernel, source), sw in sweeps(rows).items():
        meas = [r["measured_us"] for r in sw]
        cells = [kernel, source.replace("gpu_h200_s42_rows.jsonl", "3 (rows)").replace(
            "gpu_h200_s42_logs.txt call 5", "5 (logs)"), str(len(sw)), min(sw, key=lambda r: r["measured_us"])[
            "launch_tile"]]
        for name in ("this model", "before", "before, refit"):
            p = fits[("16bit", name)]
            pred = [predict_us(r, p) for r in sw]
            best = sw[pred.index(min(pred))]["launch_tile"]
            cells += [best + (" (=)" if best == cells[3] else ""), f"{spearman(meas, pred):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Every measured launch", "",
              "rounds: program rounds an SM runs one after another (`rounds`: waves x a stationary tile's row "
              "passes); spill: bytes a thread spills (stores + loads).", "",
              "| kernel | B | dtype | tile | source | grid | blk/SM | rounds | spill B | L2 MB | HBM MB | GFLOP | "
              "measured µs | roofline µs | calibrated µs | leave-one-out µs | before µs | binds |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    loo = {id(r): x for cls in ("16bit", "fp32") for r, x in held[(cls, "this model")]}
    for r in rows:
        cls = cls_of(r["dtype"])
        cal = predict_us(r, FIT[cls])
        lo = f"{loo[id(r)] * r['measured_us']:.1f}" if id(r) in loo else "(not fitted)"
        n = rounds(r["programs"], r["blocks_per_sm"], r["passes"])
        src = ("1st" if is_first_lease(r) else "2nd, call 1" if r["bench"] == "lstmp_kernels" else
               "2nd, call 3" if r["source"] == S42_ROWS.name else "2nd, call 5")
        lines.append(f"| {r['kernel']} | {r['B']} | {r['dtype']} | {r['launch_tile']} | {src} | {r['grid']} | "
                     f"{r['blocks_per_sm']} | {n} | {r['spill_bytes']} | {r['l2_bytes'] / 1e6:.1f} | "
                     f"{r['hbm_bytes'] / 1e6:.1f} | {r['flops'] / 1e9:.2f} | {r['measured_us']:.2f} | "
                     f"{r['roofline_us']:.2f} | {cal:.1f} | {lo} | {predict_us(r, fits[(cls, 'before')]):.1f} | "
                     f"{binding(r['l2_bytes'], r['hbm_bytes'], r['flops'], cls)}"
                     f"{f' + {n - 1} rounds' if n > 1 else ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help=f"rebuild {ROWS_CSV.name} from the H200 rows and git")
    ap.add_argument("--out", default=str(common.RESULTS / "kernel_fit.md"))
    a = ap.parse_args(argv)
    if a.build:
        rows = build_rows()
        with open(ROWS_CSV, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {len(rows)} rows to {ROWS_CSV}")
    rows = load_rows()
    for cls in ("16bit", "fp32"):
        p = fit(rows, cls)
        print(cls, {k: f"{v:.4g}" for k, v in p.items()})
    text = report(rows)
    Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
