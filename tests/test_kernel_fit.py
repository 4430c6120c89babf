"""The calibrated model of the LSTMP kernels (bench/kernel_fit.py): its constants are what its own fit gives on the
committed rows, it reproduces the H200's timings as closely as bench/results/kernel_fit.md says, and the rows
still describe the launches that ``launch_plan`` builds for the timed tiles."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import requires_triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = requires_triton  # lstmp_compile imports triton's compiler front end


@pytest.fixture(scope="module")
def kf():
    import kernel_fit

    return kernel_fit


@pytest.fixture(scope="module")
def rows(kf):
    return kf.load_rows()


def test_rows_are_the_h200_kernel_rows(kf, rows):
    """One row per per-kernel timing of the H200 run (4 batch sizes x 2 dtypes x 3 or 6 kernels)."""
    assert len(rows) == 36
    assert {(r["device"], r["torch"], r["cuda"], r["commit"], r["date"][:10]) for r in rows} == {
        ("NVIDIA H200", "2.11.0+cu130", "13.0", "2bde5e4", "2026-11-26")}  # each row says where it ran
    assert all(r["compile_stats"].startswith("sm_90a") for r in rows)
    assert {(r["kernel"], r["dtype"]) for r in rows if r["B"] == 384} == {
        (k, d) for k in ("fwd_cell", "fwd_proj", "fwd_reduce", "bwd_cell", "bwd_rec", "bwd_reduce")
        for d in ("bf16", "fp32")}


@pytest.mark.parametrize("cls", ["16bit", "fp32"])
def test_constants_are_the_fit(kf, rows, cls):
    """FIT holds what ``fit`` finds on the committed rows (to the rounding of its printed digits)."""
    got = kf.fit(rows, cls)
    for k, v in kf.FIT[cls].items():
        assert got[k] == pytest.approx(v, rel=0.01), k


def test_calibration_explains_the_16bit_timings(kf, rows):
    """16-bit: every fitted launch within x1.5 of its timing, rms of log error <= 0.2 (the roofline: 1.49), and
    leave-one-out (each launch predicted from the other eleven) rms <= 0.25."""
    mine = [r for r in rows if r["dtype"] == "bf16" and r["kernel"] in kf.FIT_KERNELS]
    assert len(mine) == 12
    for r in mine:
        ratio = kf.predict_us(r, kf.FIT["16bit"]) / r["measured_us"]
        assert 1 / 1.5 < ratio < 1.5, (r["kernel"], r["B"], ratio)
    assert kf.log_rms(mine, kf.FIT["16bit"]) <= 0.2
    assert kf.rms_of_ratios(r["roofline_us"] / r["measured_us"] for r in mine) > 1.0
    assert kf.rms_of_ratios(x for _, x in kf.leave_one_out(rows, "16bit")) <= 0.25


def test_rows_match_launch_plan(kf, rows):
    """The rows' grids, FLOPs, bytes and L2 traffic are what launch_plan and lstmp_compile give for the timed tiles
    today; when the byte accounting changes, rebuild them (`python bench/kernel_fit.py --build`) and refit."""
    import lstmp_compile as LC

    from elmo_fast.kernels import lstmp as KL

    for r in rows:
        dims, warps, stages = r["tile"].split()
        bm, bn, bk = map(int, dims.split("x"))
        dtype = torch.bfloat16 if r["dtype"] == "bf16" else torch.float32
        lc = KL.launch_plan(r["B"], 20, LC.H, LC.P, dtype, training=True, cell_clip=True, proj_clip=True,
                            residual=True, tiles={r["kernel"]: KL.Tile(bm, bn, bk, int(warps[1:]), int(stages[1:]))}
                            )[r["kernel"]]
        assert "x".join(map(str, lc.grid)) == r["grid"]
        assert (lc.flops, lc.bytes + lc.scratch_bytes) == (r["flops"], r["hbm_bytes"])
        assert LC.l2_bytes(r["kernel"], lc, r["B"], dtype) == r["l2_bytes"]


def test_l2_bytes_counts_each_cell_kernels_own_weight():
    """The cell kernels' weight re-reads: w_rec (P x 4H) in the forward, w_proj (H x P) in the backward, once per
    row block; their A operand (B x P) once per H slice."""
    import lstmp_compile as LC

    from elmo_fast.kernels import lstmp as KL

    B, es = 384, 2
    for name, weight in (("fwd_cell", 4 * LC.H * LC.P), ("bwd_cell", LC.H * LC.P)):
        lc = LC.plan(torch.bfloat16, B, True, {name: KL.Tile(64, 64, 32, 8, 4)})[name]
        m, n = lc.grid
        assert (m, n) == (6, LC.H // 64)
        want = lc.bytes + lc.scratch_bytes + (n - 1) * B * LC.P * es + (m - 1) * weight * es
        assert LC.l2_bytes(name, lc, B, torch.bfloat16) == want


def test_busy_and_occupancy(kf):
    """Fewer programs than SMs use that share of the GPU; a last partial wave idles its slots, but never more than with
    fewer programs resident (the share does not fall as occupancy rises); ``None``: all resident. Occupancy is the
    tightest of registers (per warp, in 256s), shared memory (+1 KiB a block) and warps."""
    assert kf.busy(66, 1) == 0.5
    assert kf.busy(264, 1) == 1.0
    assert kf.busy(384, 1) == pytest.approx(384 / 396)
    assert kf.busy(384, 2) == pytest.approx(384 / 396)  # 384 / 528 alone: a second slot per SM cannot make it worse
    assert kf.busy(400, 3) == pytest.approx(400 / 528) and kf.busy(400, 4) == 1.0  # 400 / 792 alone at 3
    assert kf.busy(384, 32) == kf.busy(384, None) == 1.0
    for n in (100, 133, 384, 768, 6144):
        shares = [kf.busy(n, k) for k in range(1, 33)]
        assert shares == sorted(shares) and shares[-1] <= kf.busy(n, None)
    assert kf.occupancy(dict(regs=128, smem=0, warps=8)) == 2
    assert kf.occupancy(dict(regs=64, smem=100 * 1024, warps=4)) == 2
    assert kf.occupancy(dict(regs=32, smem=0, warps=4)) == 16
    t = kf.terms_us(3.22e12, 1.62e12, 990e12, "16bit")
    assert t == pytest.approx(dict(l2=1e6, hbm=1e6, mma=1e6), rel=1e-2)
    assert kf.calibrated_us(3.22e6, 0, 0, 66, 1, "16bit") == pytest.approx(2.0, rel=1e-2)
    assert math.isclose(kf.calibrated_us(0, 0, 67e12 * 0.423, 132, 1, "fp32"), 1e6, rel_tol=1e-2)


def test_gpu_rows_carry_the_calibrated_estimate(kf):
    """bench_lstmp's per-kernel and sweep rows (GPU only) carry ``cal_us`` = the timing floor once plus each timed
    launch's calibrated GPU time with every program resident, so a lease's rows check the model directly."""
    import bench_lstmp
    import lstmp_compile as LC

    from elmo_fast.kernels import lstmp as KL

    assert {"cal_us", "cal_ratio"} <= set(bench_lstmp.KERNEL_FIELDS)
    # the 64x64x32 w8 tile (TUNED's until the H200 timed the occupancy probe that replaced it): 384 programs, all
    # resident, which keeps the arithmetic below to one wave
    lc = LC.plan(torch.bfloat16, 384, True, tiles={"bwd_cell": KL.Tile(64, 64, 32, 8, 4)})["bwd_cell"]
    # 100.7 MB of L2, of which the bias gradient's partials (6 row blocks x 4H, fp32) 0.39 MB
    l2 = 100_663_296 + 6 * 4 * 4096 * 4
    assert lc.tile == KL.Tile(64, 64, 32, 8, 4) and LC.l2_bytes("bwd_cell", lc, 384, torch.bfloat16) == l2
    # 5.56 µs of floor + the compulsory 55.3 MB at 1.62 TB/s (the L2 term, 101.1 MB at 3.22 TB/s, is 2.7 µs
    # shorter; the FLOP term far shorter), 384 programs all resident
    hbm = lc.bytes + lc.scratch_bytes
    assert hbm == pytest.approx(55.31e6, rel=1e-3)
    want = 5.56 + max(l2 / 3.22e12, hbm / 1.62e12) * 1e6
    got = bench_lstmp._calibrated([("bwd_cell", lc)], 384, torch.bfloat16, p50_ms=2 * want / 1e3)
    assert float(got["cal_us"]) == pytest.approx(want, abs=0.01)
    assert got["cal_ratio"] == "2.00"
    pair = [("bwd_rec", LC.plan(torch.bfloat16, 384, True)["bwd_rec"]), ("bwd_cell", lc)]
    two = float(bench_lstmp._calibrated(pair, 384, torch.bfloat16, 1.0)["cal_us"])
    assert two == pytest.approx(float(got["cal_us"]) + LC.calibrated_us(*pair[0], 384, torch.bfloat16, None), abs=0.02)
