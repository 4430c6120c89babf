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

    calibrated_us = max(L2 bytes / BW_L2, compulsory bytes / BW_HBM, FLOPs / (peak x eff)) / busy

with ``busy`` the share of SMs a grid keeps busy (``busy()``), and ``BW_L2``, ``BW_HBM``, ``eff`` fitted per
operand class (16-bit; fp32 on the FMA path) to the measured rows by least squares on log(time), together with a
constant per-launch ``floor_us`` that ``do_bench`` adds to a lone launch (the timing floor of an empty-ish kernel:
not counted in the sums, which use the launch terms). The 16-bit tensor-core efficiency is not fitted: no
measured 16-bit launch is bound by its FLOPs (it stays 1). fp32 takes the 16-bit HBM rate: its L2 term binds in
every row, so its rows cannot tell that rate. The split-K reduce kernels (no K loop, 3 KB-20 MB, floor-bound
under do_bench) are left out of the fit: 24 of the 36 timed launches are fitted.

The rows (``kernel_fit_rows.csv``) join every timed launch with what its kernel compiled to at the code that ran
(the kernel report of 58edc9c, committed in 43df509; the kernels did not change between that commit and the
one that ran, 2bde5e4) and with the geometry of ``launch_plan`` for its tile. The fitted constants are
``FIT``; tests/test_kernel_fit.py refits them from the CSV and checks the leave-one-out error this module reports.

What the fit is and is not: 12 launches per class, one GPU, one code version, cold L2 (``do_bench`` flushes it
before each call). It says which term binds and by about how much; it is no substitute for timing a new tiling.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROWS_CSV = common.RESULTS / "kernel_fit_rows.csv"
H200_ROWS = common.RESULTS / "gpu_h200_rows.jsonl"


def h200_rows(bench: str, path: Path = H200_ROWS) -> list[dict]:
    """The committed H200 rows (one JSON object a line) of one bench (``lstmp``, ``lstmp_kernels``, ``softmax``)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("bench") == bench]
OLD_REPORT = ("43df509", "bench/results/kernel_report.csv")  # compile stats of the kernels that ran on the H200
SMS = 132
PEAK = {"16bit": 990e12, "fp32": 67e12}
FIELDS = ["kernel", "B", "dtype", "mode", "tile", "grid", "programs", "blocks_per_sm", "regs", "tensor_cores",
          "flops", "hbm_bytes", "l2_bytes", "measured_us", "roofline_us",
          # where the timing ran (the H200 row's own record) and where the compile stats come from
          "device", "torch", "triton", "cuda", "commit", "date", "command", "compile_stats"]
PROVENANCE = ("device", "torch", "triton", "cuda", "commit", "date", "command")
FIT_KERNELS = ("fwd_cell", "fwd_proj", "bwd_cell", "bwd_rec")

# Fitted by ``fit(load_rows(), cls)`` (tests/test_kernel_fit.py checks that a refit gives these back).
FIT = {
    "16bit": dict(floor_us=5.56, bw_l2=3.22e12, bw_hbm=1.62e12, eff=1.0),
    "fp32": dict(floor_us=4.02, bw_l2=1.16e12, bw_hbm=1.62e12, eff=0.423),  # bw_hbm: the 16-bit class's
}


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


def terms_us(l2_bytes: float, hbm_bytes: float, flops: float, cls: str, params: dict | None = None) -> dict:
    """The three throughput terms in µs (before the SM-fill factor)."""
    p = params or FIT[cls]
    return dict(l2=l2_bytes / p["bw_l2"] * 1e6, hbm=hbm_bytes / p["bw_hbm"] * 1e6,
                mma=flops / (PEAK[cls] * p["eff"]) * 1e6)


def calibrated_us(l2_bytes: float, hbm_bytes: float, flops: float, programs: int, blocks_per_sm: int | None,
                  cls: str, params: dict | None = None) -> float:
    """GPU time of one launch (no launch term, no timing floor) under the calibrated model."""
    return max(terms_us(l2_bytes, hbm_bytes, flops, cls, params).values()) / busy(programs, blocks_per_sm)


def binding(l2_bytes: float, hbm_bytes: float, flops: float, cls: str) -> str:
    t = terms_us(l2_bytes, hbm_bytes, flops, cls)
    return max(t, key=t.get)


# ------------------------------------------------------------------------------------------ rows
def load_rows(path: Path = ROWS_CSV) -> list[dict]:
    ints = ("B", "programs", "blocks_per_sm", "regs", "tensor_cores", "flops", "hbm_bytes", "l2_bytes")
    out = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            out.append({**r, **{k: int(r[k]) for k in ints},
                        **{k: float(r[k]) for k in ("measured_us", "roofline_us")}})
    return out


def build_rows() -> list[dict]:
    """The H200's per-kernel rows joined with the compile stats of the code that ran and launch_plan's geometry."""
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
        dims, warps, stages = r["tile"].split()
        bm, bn, bk = map(int, dims.split("x"))
        tile = KL.Tile(bm, bn, bk, int(warps[1:]), int(stages[1:]), fused=False)  # one dot per gate then
        # bench_kernels' flags: both clips, forward direction, residual (the 'fwd resid' variant of the report)
        lc = KL.launch_plan(B, 20, LC.H, LC.P, dtype, training=True, tiles={name: tile}, cell_clip=True,
                            proj_clip=True, reverse=False, residual=True)[name]
        grid = "x".join(map(str, lc.grid))
        if grid != r["grid"]:
            raise AssertionError(f"{name} B={B} {dt}: launch_plan's grid {grid} is not the measured {r['grid']}")
        st = [o for o in old if o["op"] == "lstmp" and o["size"] == f"{r['mode']} B={B}" and o["dtype"] == dt
              and o["kernel"] == names[name] and o["variant"] == "fwd resid" and o["phase"] == name.split("_")[0]
              and o["grid"] == grid and not (name == "bwd_reduce" and o["slot"] == "0")]  # slot 0: the prologue
        if not st:
            raise AssertionError(f"{name} B={B} {dt}: no compile stats in {OLD_REPORT}")
        st = st[-1]
        out.append(dict(kernel=name, B=B, dtype=dt, mode=r["mode"], tile=r["tile"], grid=grid,
                        programs=LC.programs(lc), blocks_per_sm=int(st["blocks_per_sm"]), regs=int(st["regs"]),
                        tensor_cores=int(int(st["hgmma"]) + int(st["hmma"]) > 0), flops=lc.flops,
                        hbm_bytes=lc.bytes + lc.scratch_bytes, l2_bytes=LC.l2_bytes(name, lc, B, dtype),
                        measured_us=float(r["us_p50"]), roofline_us=float(r["est_us"]),
                        **{k: r[k] for k in PROVENANCE},
                        compile_stats=f"sm_90a, compiled without a GPU: {OLD_REPORT[1]} of {OLD_REPORT[0]} "
                                      f"(code {st['commit']})"))
    return out


# ------------------------------------------------------------------------------------------ fit
def predict_us(row: dict, params: dict) -> float:
    """A row's lone launch as do_bench timed it: the calibrated GPU time plus the timing floor."""
    return params["floor_us"] + calibrated_us(row["l2_bytes"], row["hbm_bytes"], row["flops"], row["programs"],
                                              row["blocks_per_sm"], cls_of(row["dtype"]), params)


def log_rms(rows: list[dict], params: dict) -> float:
    return math.sqrt(sum(math.log(predict_us(r, params) / r["measured_us"]) ** 2 for r in rows) / len(rows))


_RANGES = dict(floor_us=(1.0, 10.0), bw_l2=(0.3e12, 20e12), bw_hbm=(0.3e12, 6e12), eff=(0.02, 1.0))


def fit(rows: list[dict], cls: str) -> dict:
    """Least squares on log(time) over the class's rows: a log-spaced grid, then coordinate refinement (no
    randomness: the same rows give the same constants). fp32 takes the 16-bit class's HBM rate (the same memory;
    in fp32 the L2 term binds everywhere, so its rows cannot tell the HBM rate) and fits its FLOP efficiency."""
    if cls == "fp32":
        free = ["floor_us", "bw_l2", "eff"]
        best = dict(floor_us=5.0, bw_l2=3e12, bw_hbm=fit(rows, "16bit")["bw_hbm"], eff=1.0)
    else:
        free = ["floor_us", "bw_l2", "bw_hbm"]
        best = dict(floor_us=5.0, bw_l2=3e12, bw_hbm=2e12, eff=1.0)
    rows = [r for r in rows if cls_of(r["dtype"]) == cls and r["kernel"] in FIT_KERNELS]
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


def leave_one_out(rows: list[dict], cls: str) -> list[tuple[dict, float]]:
    """Each of the class's fitted rows predicted by the constants fitted without it (fp32's HBM rate then comes from
    all 16-bit rows): (row, predicted / measured)."""
    mine = [r for r in rows if cls_of(r["dtype"]) == cls and r["kernel"] in FIT_KERNELS]
    out = []
    for r in mine:
        p = fit([o for o in rows if o is not r], cls)
        out.append((r, predict_us(r, p) / r["measured_us"]))
    return out


def rms_of_ratios(ratios) -> float:
    ratios = list(ratios)
    return math.sqrt(sum(math.log(x) ** 2 for x in ratios) / len(ratios))


# ------------------------------------------------------------------------------------------ report
def report(rows: list[dict]) -> str:
    env = common.environment()
    ran = sorted({", ".join(f"{k} {r[k]}" for k in PROVENANCE if k != "date") for r in rows})
    days = sorted({r["date"][:10] for r in rows})
    lines = ["# The LSTMP kernels' model, calibrated on the H200's per-kernel timings", "",
             f"Command: `python bench/kernel_fit.py` at `{env['commit']}` ({env['date']}, {env['device']}: a fit, "
             f"nothing timed here). Rows: `{ROWS_CSV.relative_to(common.ROOT)}`, the per-kernel timings of "
             f"gpu_h200_rows.jsonl (bench `lstmp_kernels`, {', '.join(days)}; {'; '.join(ran)}) joined with "
             f"the compile stats of the code that ran ({rows[0]['compile_stats']}). Model and method: the docstring "
             "of `bench/kernel_fit.py`.", "",
             "| class | floor µs | BW_L2 TB/s | BW_HBM TB/s | FLOP efficiency | rms log error: roofline | fitted | "
             "leave-one-out (max) |", "|---|---|---|---|---|---|---|---|"]
    notes = {"16bit": ("", " (not fitted)"), "fp32": (" (the 16-bit rate)", "")}
    loo = {}
    for cls in ("16bit", "fp32"):
        p = fit(rows, cls)
        mine = [r for r in rows if cls_of(r["dtype"]) == cls and r["kernel"] in FIT_KERNELS]
        loo[cls] = leave_one_out(rows, cls)
        roof = rms_of_ratios(r["roofline_us"] / r["measured_us"] for r in mine)
        lo = [x for _, x in loo[cls]]
        worst = max(lo, key=lambda x: abs(math.log(x)))
        lines.append(f"| {cls} | {p['floor_us']:.2f} | {p['bw_l2'] / 1e12:.2f} | {p['bw_hbm'] / 1e12:.2f}"
                     f"{notes[cls][0]} | {p['eff']:.2f}{notes[cls][1]} | {roof:.2f} (x{math.exp(roof):.2f}) | "
                     f"{log_rms(mine, p):.2f} (x{math.exp(log_rms(mine, p)):.2f}) | {rms_of_ratios(lo):.2f} "
                     f"(x{math.exp(rms_of_ratios(lo)):.2f}; worst x{worst:.2f}) |")
    lines += ["", "An rms log error of 0.2 is a typical factor of exp(0.2) = 1.22 either way. The roofline column is "
              "the estimate the H200 run printed (3 µs a launch then, not the 42 / 2.6 µs launch terms since).", "",
              "## Every measured launch", "",
              "| kernel | B | dtype | tile | grid | blk/SM | L2 MB | HBM MB | GFLOP | measured µs | roofline µs | "
              "calibrated µs | leave-one-out µs | binds |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    held = {id(r): x for cls in loo for r, x in loo[cls]}
    for r in rows:
        cls = cls_of(r["dtype"])
        cal = predict_us(r, FIT[cls])
        lo = f"{held[id(r)] * r['measured_us']:.1f}" if id(r) in held else "(not fitted)"
        lines.append(f"| {r['kernel']} | {r['B']} | {r['dtype']} | {r['tile']} | {r['grid']} | {r['blocks_per_sm']} | "
                     f"{r['l2_bytes'] / 1e6:.1f} | {r['hbm_bytes'] / 1e6:.1f} | {r['flops'] / 1e9:.2f} | "
                     f"{r['measured_us']:.2f} | {r['roofline_us']:.2f} | {cal:.1f} | {lo} | "
                     f"{binding(r['l2_bytes'], r['hbm_bytes'], r['flops'], cls)} |")
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
