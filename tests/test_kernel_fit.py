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
    """One row per per-launch timing of the two H200 leases: the first's per-kernel rows (4 batch sizes x 2 dtypes x 3
    or 6 kernels), the second's per-kernel rows (call 1) and tile sweeps (calls 3 and 5, B=384 bf16), each with where
    it ran and where its compile stats come from."""
    first = [r for r in rows if kf.is_first_lease(r)]
    assert len(first) == 36
    assert {(r["device"], r["torch"], r["cuda"], r["commit"], r["date"][:10]) for r in first} == {
        ("NVIDIA H200", "2.11.0+cu130", "13.0", "2bde5e4", "2026-11-26")}  # each row says where it ran
    assert {(r["kernel"], r["dtype"]) for r in first if r["B"] == 384} == {
        (k, d) for k in ("fwd_cell", "fwd_proj", "fwd_reduce", "bwd_cell", "bwd_rec", "bwd_reduce")
        for d in ("bf16", "fp32")}
    second = {(r["source"], r["bench"], r["commit"]): 0 for r in rows if not kf.is_first_lease(r)}
    for r in rows:
        if not kf.is_first_lease(r):
            second[(r["source"], r["bench"], r["commit"])] += 1
            assert (r["device"], r["torch"], r["triton"], r["cuda"], r["date"][:10]) == (
                "NVIDIA H200", "2.11.0+cu130", "3.6.0", "13.0", "2026-11-27")
    assert second == {("gpu_h200_s42_rows.jsonl", "lstmp_kernels", "1aca4d1"): 9,
                      ("gpu_h200_s42_rows.jsonl", "lstmp_tiles", "1aca4d1"): 14,
                      ("gpu_h200_s42_logs.txt call 5", "lstmp_tiles", "0ac4030"): 14}
    assert all(r["compile_stats"].startswith("sm_90a") for r in rows)
    assert {r["compile_stats"].split(" (")[0].split(" at ")[0] for r in rows if not kf.is_first_lease(r)} == {
        "sm_90a, compiled without a GPU"}


def test_tile_texts(kf):
    """The rows' tile texts (bench_lstmp's) parse into the Tile that ran, and back."""
    from elmo_fast.kernels import lstmp as KL

    t = kf.parse_tile("64x32x0 w8 s1 fused stationary g1 (tuned)")
    assert t == KL.Tile(64, 32, 0, 8, 1, fused=True, stationary=True, groups=1)
    assert kf.tile_text(t) == "64x32x0 w8 s1 fused stationary g1" and kf.parse_tile(kf.tile_text(t)) == t
    assert kf.tile_text(t, design=False) == "64x32x0 w8 s1"  # the per-kernel rows' form
    assert kf.parse_tile("128x64x32 w4 s4") == KL.Tile(128, 64, 32, 4, 4)
    assert kf.parse_tile("16x32x32 w4 s4", fused=True).fused  # bench_kernels' text has no design words
    with pytest.raises(ValueError):
        kf.parse_tile("64x32 w4")
    assert kf.row_passes(384, t) == 6 and kf.row_passes(384, KL.Tile(64, 32, 0, 8, 1, True, True, 2)) == 3
    assert kf.row_passes(384, KL.Tile(64, 32, 32, 4, 4)) == 1
    assert kf.launch_passes(dict(STATIONARY=True, BB=64), (1, 128), 384) == 6
    assert kf.launch_passes(dict(BB=64), (6, 128), 384) == 1


@pytest.mark.parametrize("cls", ["16bit", "fp32"])
def test_constants_are_the_fit(kf, rows, cls):
    """FIT holds what ``fit`` finds on the committed rows (to the rounding of its printed digits)."""
    got = kf.fit(rows, cls)
    for k, v in kf.FIT[cls].items():
        assert got[k] == pytest.approx(v, rel=0.01), k


def test_calibration_explains_the_16bit_timings(kf, rows):
    """16-bit: every fitted launch of both leases within x1.5 of its timing; rms of log error <= 0.2 on each lease
    (the roofline: 1.49 and 1.17; the model without the round and spill terms, refitted to both: 0.25 and 0.33), and
    leave-one-out (each launch predicted from the others, its repeated timings held out with it) rms <= 0.2 on the
    first lease, <= 0.25 on the second."""
    mine = kf.fitted(rows, "16bit")
    assert len(mine) == 46
    for r in mine:
        ratio = kf.predict_us(r, kf.FIT["16bit"]) / r["measured_us"]
        assert 1 / 1.5 < ratio < 1.5, (r["kernel"], r["B"], r["launch_tile"], ratio)
    first = [r for r in mine if kf.is_first_lease(r)]
    second = [r for r in mine if not kf.is_first_lease(r)]
    assert kf.log_rms(first, kf.FIT["16bit"]) <= 0.2 and kf.log_rms(second, kf.FIT["16bit"]) <= 0.2
    assert kf.rms_of_ratios(r["roofline_us"] / r["measured_us"] for r in mine) > 1.0
    plain = kf.fit(rows, "16bit", plain=True)
    assert kf.log_rms(second, plain) > kf.log_rms(second, kf.FIT["16bit"]) + 0.1
    loo = kf.leave_one_out(rows, "16bit")
    assert kf.rms_of_ratios(x for r, x in loo if kf.is_first_lease(r)) <= 0.2
    assert kf.rms_of_ratios(x for r, x in loo if not kf.is_first_lease(r)) <= 0.25


def test_ranks_the_fastest_b384_cell_tiles_first(kf, rows):
    """Each B=384 bf16 tile sweep of the second lease (calls 3 and 5: 7 forward and 7 backward cell tiles each) has
    its measured fastest tile first by the model too: forward 64x32x32 w4 s4 fused, backward 64x32x32 w4 s4 (the
    TUNED entries since 0ac4030), which the model without the round term ranked behind the stationary forward tile
    and the spilling 128x64x32 w4 backward one."""
    sweeps = kf.sweeps(rows)
    assert len(sweeps) == 4 and all(len(sw) == 7 for sw in sweeps.values())
    for (kernel, source), sw in sweeps.items():
        fastest = min(sw, key=lambda r: r["measured_us"])
        assert fastest["launch_tile"] == ("64x32x32 w4 s4 fused" if kernel == "fwd_cell" else "64x32x32 w4 s4")
        picked = min(sw, key=lambda r: kf.predict_us(r, kf.FIT["16bit"]))
        assert picked is fastest, (kernel, source, picked["launch_tile"])
        # (ties mean-ranked: call 5's forward sweep, with two tiles the model ties, reads 0.39; the rest 0.70-0.86)
        assert kf.spearman([r["measured_us"] for r in sw], [kf.predict_us(r, kf.FIT["16bit"]) for r in sw]) > 0.35


def test_rows_match_launch_plan(kf, rows):
    """The rows' grids, FLOPs, bytes and L2 traffic are what launch_plan and lstmp_compile give for the timed tiles
    today (the second lease's forward cell tiles in their design: gate-interleaved or stationary); when the byte
    accounting changes, rebuild them (`python bench/kernel_fit.py --build`) and refit."""
    import lstmp_compile as LC

    from elmo_fast.kernels import lstmp as KL

    for r in rows:
        tile = kf.parse_tile(r["launch_tile"])
        dtype = torch.bfloat16 if r["dtype"] == "bf16" else torch.float32
        lc = KL.launch_plan(r["B"], 20, LC.H, LC.P, dtype, training=True, cell_clip=True, proj_clip=True,
                            residual=True, tiles={r["kernel"]: tile})[r["kernel"]]
        assert lc.tile == tile and "x".join(map(str, lc.grid)) == r["grid"]
        assert (lc.flops, lc.bytes + lc.scratch_bytes) == (r["flops"], r["hbm_bytes"])
        assert LC.l2_bytes(r["kernel"], lc, r["B"], dtype) == r["l2_bytes"]
        assert (r["warps"], r["passes"]) == (tile.warps, kf.row_passes(r["B"], tile))


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
    tightest of registers (per warp, in 256s), shared memory (+1 KiB a block) and warps. Rounds: waves of the
    resident programs, times a stationary program's row passes."""
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
    assert kf.occupancy(dict(regs=168, smem=49152, warps=4)) == 3  # the tuned B=384 forward cell tile
    assert [kf.rounds(768, k) for k in (1, 2, 3, 6)] == [6, 3, 2, 1]
    assert kf.rounds(128, 1) == kf.rounds(768, None) == 1 and kf.rounds(128, 1, passes=6) == 6
    p = kf.FIT["16bit"]
    t = kf.terms_us(p["bw_l2"], p["bw_hbm"], 990e12, "16bit")
    assert t == pytest.approx(dict(l2=1e6, hbm=1e6, mma=1e6), rel=1e-6)
    assert kf.calibrated_us(p["bw_l2"] * 1e-6, 0, 0, 66, 1, "16bit") == pytest.approx(2.0)  # half the SMs
    # 768 programs, 1 resident an SM: 6 rounds, 5 charged; a spill of 1 KiB a thread slows it by the spill factor
    one = kf.calibrated_us(0, p["bw_hbm"] * 1e-6, 0, 768, 1, "16bit")
    assert one == pytest.approx(1 / kf.busy(768, 1) + 5 * p["round_us"])
    assert kf.calibrated_us(0, p["bw_hbm"] * 1e-6, 0, 768, 1, "16bit", spill_bytes=1024) == pytest.approx(
        one * (1 + p["spill"]))
    assert kf.calibrated_us(0, p["bw_hbm"] * 1e-6, 0, 768, 6, "16bit") == pytest.approx(1.0 / kf.busy(768, 6))
    f = kf.FIT["fp32"]
    assert all(f[k] == p[k] for k in kf.SHARED)
    assert math.isclose(kf.calibrated_us(0, 0, 67e12 * f["eff"], 132, 1, "fp32"), 1e6, rel_tol=1e-9)


def test_gpu_rows_carry_the_calibrated_estimate(kf):
    """bench_lstmp's per-kernel and sweep rows (GPU only) carry ``cal_us`` = the timing floor once plus each timed
    launch's calibrated GPU time with every program resident (one round), so a lease's rows check the model
    directly."""
    import bench_lstmp
    import lstmp_compile as LC

    from elmo_fast.kernels import lstmp as KL

    assert {"cal_us", "cal_ratio"} <= set(bench_lstmp.KERNEL_FIELDS)
    p = kf.FIT["16bit"]
    # the 64x64x32 w8 tile (TUNED's until the H200 timed the occupancy probe that replaced it): 384 programs, all
    # resident, which keeps the arithmetic below to one round
    lc = LC.plan(torch.bfloat16, 384, True, tiles={"bwd_cell": KL.Tile(64, 64, 32, 8, 4)})["bwd_cell"]
    # 100.7 MB of L2, of which the bias gradient's partials (6 row blocks x 4H, fp32) 0.39 MB
    l2 = 100_663_296 + 6 * 4 * 4096 * 4
    assert lc.tile == KL.Tile(64, 64, 32, 8, 4) and LC.l2_bytes("bwd_cell", lc, 384, torch.bfloat16) == l2
    # the floor + the compulsory 55.3 MB at BW_HBM (the L2 term, 101.1 MB at BW_L2, far shorter; the FLOP term
    # shorter still), 384 programs all resident
    hbm = lc.bytes + lc.scratch_bytes
    assert hbm == pytest.approx(55.31e6, rel=1e-3)
    want = p["floor_us"] + max(l2 / p["bw_l2"], hbm / p["bw_hbm"]) * 1e6
    assert hbm / p["bw_hbm"] > 2 * l2 / p["bw_l2"]
    got = bench_lstmp._calibrated([("bwd_cell", lc)], 384, torch.bfloat16, p50_ms=2 * want / 1e3)
    assert float(got["cal_us"]) == pytest.approx(want, abs=0.01)
    assert got["cal_ratio"] == "2.00"
    pair = [("bwd_rec", LC.plan(torch.bfloat16, 384, True)["bwd_rec"]), ("bwd_cell", lc)]
    two = float(bench_lstmp._calibrated(pair, 384, torch.bfloat16, 1.0)["cal_us"])
    assert two == pytest.approx(float(got["cal_us"]) + LC.calibrated_us(*pair[0], 384, torch.bfloat16, None), abs=0.02)
    # a stationary tile's row passes are charged even with every program resident: 6 row blocks a program at 384
    st = LC.plan(torch.bfloat16, 384, True, tiles={"fwd_cell": KL.Tile(64, 32, 0, 8, 1, True, True, 1)})["fwd_cell"]
    plain = kf.calibrated_us(LC.l2_bytes("fwd_cell", st, 384, torch.bfloat16), st.bytes + st.scratch_bytes, st.flops,
                             LC.programs(st), None, "16bit")
    assert LC.calibrated_us("fwd_cell", st, 384, torch.bfloat16, None) == pytest.approx(plain + 5 * p["round_us"])
