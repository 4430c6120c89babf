"""LSTMP Triton kernels (``elmo_fast.kernels.lstmp``): tilings that cross every tile boundary, split-K with
several splits and its deterministic reduction, the GPU launch plan run under the interpreter, the launch
plan at the original model's sizes, and the absence of host syncs. Outputs and every gradient against the
fp64 reference; ``torch.empty`` is NaN-poisoned (the fixture of test_lstmp_triton) so an unwritten element
fails.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses

import pytest
import torch
from conftest import programs_backwards, requires_triton
from test_lstmp_triton import (  # noqa: F401 - _nan_poison is an autouse fixture, imported to apply here
    DEV,
    GRAD_NAMES,
    TOL,
    _nan_poison,
    assert_close,
    assert_inference_matches,
    assert_low_precision,
    flags,
    kernel,
    make_case,
    reference,
    run,
    upstream_grads,
)

pytestmark = [pytest.mark.triton, requires_triton]


def _mod():
    from elmo_fast.kernels import lstmp

    return lstmp


# B, H, P odd and past one interpreter tile (32 x 32); K = H and 4H past one split (64 rows).
ODD = dict(B=35, T=3, D=5, H=70, P=35, lengths=[3, 0, 1, 2, 3, 3, 1] * 5)
ODD_CASES = {
    "forward": (dict(), flags()),
    "reverse_residual": (dict(), flags(reverse=True, residual=True)),
    "no_proj_reverse": (dict(proj=False, H=35), flags(reverse=True)),
    "no_clips": (dict(scale=2.0), flags(cell_clip=None, proj_clip=None)),
}


def test_interpreter_plan_splits_odd_shape():
    """The fixed interpreter tiles give ODD several row blocks, slices and K splits (what the tests rely on)."""
    mod = _mod()
    plan = mod.launch_plan(ODD["B"], ODD["T"], ODD["H"], ODD["P"], torch.float64, training=True,
                           target=mod.Target(interpret=True, sms=132))
    assert plan["fwd_cell"].grid == (2, 3)
    assert plan["fwd_proj"].grid == (2, 2, 2)  # K = H = 70 in splits of 64
    assert plan["bwd_rec"].grid == (2, 2, 5)  # K = 4H = 280
    assert plan["bwd_reduce"].constexprs["SPLITS"] == 5 and plan["bwd_reduce"].count == ODD["T"] + 1


@pytest.fixture(params=[False, True], ids=["per_gate", "fused"])
def fwd_design(request, monkeypatch):
    """The forward cell kernel's design for every dtype: one dot per gate, or one over the gate-interleaved weight
    (``Tile.fused``; the GPU's 16-bit design)."""
    mod = _mod()
    monkeypatch.setattr(mod, "FUSED_GATES", dict.fromkeys(mod.FUSED_GATES, request.param))
    return request.param


def test_fused_design_follows_the_operand_class():
    """16-bit operands run the fused forward cell kernel on the GPU and under the interpreter, fp32 one dot per gate;
    an explicit tile keeps its own design, and only the forward cell kernel has one."""
    mod = _mod()
    for target in (mod.H100, mod.Target(interpret=True, sms=132)):
        for dtype, fused in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False),
                             (torch.float64, False)):
            plan = mod.launch_plan(384, 20, 4096, 512, dtype, training=True, target=target)
            assert plan["fwd_cell"].tile.fused is fused and plan["fwd_cell"].constexprs["FUSED"] is fused
            args = dict(plan["fwd_cell"].args)
            assert ("w_rec_g" in args) is fused and ("w_rec" in args) is not fused
            assert not any(launch.tile.fused for name, launch in plan.items() if name != "fwd_cell")
    t = mod.Tile(64, 32, 32, 4, 2)
    assert not mod.launch_plan(64, 3, 64, 32, torch.bfloat16, training=False, tiles={"fwd_cell": t})["fwd_cell"
                                                                                                     ].tile.fused


def test_a_fused_call_keeps_the_plain_w_rec_only_for_backward(fwd_design):
    """The forward's buffers (a loop graph refills each every call) hold the interleaved weight where the fused cell
    kernel reads it, and the plain one only where something reads it: the per-gate kernel, or training's backward."""
    mod = _mod()
    case = make_case(B=3, T=2)
    for save in (False, True):
        _, bufs = mod.fwd_setup(*(case[k].to(DEV) for k in GRAD_NAMES), case["lengths"].to(DEV), cell_clip=None,
                                proj_clip=None, forget_bias=1.0, reverse=False, residual=False, save=save)
        assert ("w_rec_g" in bufs) is fwd_design
        assert ("w_rec" in bufs) is (save or not fwd_design), save


def test_interleave_gates():
    """Column 4h + g of the interleaved weight is column g·H + h of w_rec (gate blocks i|j|f|o), into a new tensor or
    in place (the loop graphs' refill), from any strides."""
    mod = _mod()
    P, H = 3, 5
    w = torch.arange(P * 4 * H, dtype=torch.float64).reshape(P, 4 * H)
    want = torch.stack([w[:, g * H:(g + 1) * H] for g in range(4)], dim=2).reshape(P, 4 * H)
    assert torch.equal(mod.interleave_gates(w), want)
    assert torch.equal(mod.interleave_gates(w.t().contiguous().t()), want)
    out = torch.full_like(w, float("nan"))
    assert mod.interleave_gates(w, out=out) is out and torch.equal(out, want)


@pytest.mark.parametrize("name", list(ODD_CASES))
def test_odd_shape_fp64(name, fwd_design):
    shape, fl = ODD_CASES[name]
    case = make_case(**{**ODD, **shape, "residual": fl["residual"]})
    want = run(reference, case, torch.float64, fl, upstream_grads(3))
    got = run(kernel, case, torch.float64, fl, upstream_grads(3))
    assert_close(got, want, TOL[torch.float64], f"[{name}] ")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_odd_shape_low_precision(dtype, fwd_design):
    shape, fl = ODD_CASES["reverse_residual"]
    case = make_case(**{**ODD, **shape, "residual": True})
    exact = run(reference, case, torch.float64, fl, upstream_grads(4))
    got = run(kernel, case, dtype, fl, upstream_grads(4))
    if dtype == torch.float32:
        assert_close(got, exact, TOL[torch.float32])
        return
    assert_low_precision(got, exact, run(reference, case, dtype, fl, upstream_grads(4)), dtype)


# ------------------------------------------------------------------------------------ the GPU plan
@pytest.fixture
def gpu_plan(monkeypatch):
    """Run the launchers with the compiled-GPU planning rules (split counts from the SM count, TUNED tiles)
    under the interpreter: ``use(sms, tile)`` sets the pretend SM count and the tile of every kernel."""
    mod = _mod()

    def use(sms, tile):
        monkeypatch.setattr(mod, "device_target", lambda device: mod.Target(interpret=False, sms=sms))
        monkeypatch.setattr(mod, "TUNED", collections.defaultdict(lambda: tile))

    return use


# (pretend SMs, tile BM=BN, expected splits of fwd_proj (K = H = 70) and bwd_rec (K = 4H = 280)) at B = P = 19
# (4 output tiles of 16, 1 of 32): the fewest splits of whole BK=16 steps that give every SM a program.
SMALL = dict(ODD, B=19, P=19, lengths=[3, 0, 1, 2, 3, 3, 1] * 2 + [2, 3, 1, 0, 3])
SPLIT_CASES = {"sms4": (4, 16, (1, 1)), "sms8": (8, 16, (2, 2)), "sms40_tile32": (40, 32, (5, 18))}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_gpu_plan_split_counts_fp64(gpu_plan, name):
    """Split counts chosen for the SM count (1 to 18 splits of 18 to 1 K steps) agree with the reference,
    forward and every gradient."""
    mod = _mod()
    sms, bm, want = SPLIT_CASES[name]
    gpu_plan(sms, mod.Tile(bm, bm, 16, warps=4, stages=2))
    plan = mod.launch_plan(SMALL["B"], SMALL["T"], SMALL["H"], SMALL["P"], torch.float64, training=True,
                           target=mod.device_target(None))
    assert (plan["fwd_proj"].grid[2], plan["bwd_rec"].grid[2]) == want
    case = make_case(**{**SMALL, "residual": True})
    fl = flags(reverse=True, residual=True)
    ref = run(reference, case, torch.float64, fl, upstream_grads(5))
    got = run(kernel, case, torch.float64, fl, upstream_grads(5))
    assert_close(got, ref, TOL[torch.float64], f"[{name}] ")


@pytest.mark.parametrize("size", [128, 384])
def test_tuned_backward_cell_tile(gpu_plan, monkeypatch, size):
    """The 16-bit backward cell kernel's GPU tile at B = ``size`` (TUNED, wider than 16 columns since its epilogue
    stores each gate as soon as it is known) at a shape that crosses each of its tile edges (rows, H columns, K =
    P), the other kernels at a small tile: outputs and every gradient against the fp64 reference."""
    mod = _mod()
    tile = mod.TUNED[("bwd_cell", "16bit", size)]
    gpu_plan(8, mod.Tile(16, 16, 16, warps=4, stages=2))
    tuned = collections.defaultdict(lambda: mod.Tile(16, 16, 16, warps=4, stages=2))
    tuned.update({("bwd_cell", cls, b): tile for cls in ("16bit", "fp32") for b in mod.BATCHES})
    monkeypatch.setattr(mod, "TUNED", tuned)
    shape = dict(ODD, B=tile.BM + 3, H=tile.BN + 3, P=tile.BK + 3, lengths=[3, 0, 1, 2, 3, 3, 1] * 20)
    shape["lengths"] = shape["lengths"][: shape["B"]]
    plan = mod.launch_plan(shape["B"], shape["T"], shape["H"], shape["P"], torch.float64, training=True,
                           target=mod.device_target(None))
    assert plan["bwd_cell"].tile == tile and plan["bwd_cell"].grid == (2, 2)
    case = make_case(**{**shape, "residual": True})
    fl = flags(reverse=True, residual=True)
    want = run(reference, case, torch.float64, fl, upstream_grads(7))
    got = run(kernel, case, torch.float64, fl, upstream_grads(7))
    assert_close(got, want, TOL[torch.float64], f"[bwd_cell {tile}] ")


def _stationary_tiles():
    mod = _mod()
    # fwd_384_replaced: TUNED's at 384 until the H200 timed it
    return {"fwd_384_replaced": ("fwd_cell", mod.Tile(64, 32, 0, 8, 1, stationary=True)),
            "fwd_groups2": ("fwd_cell", mod.Tile(64, 32, 0, 8, 1, stationary=True, groups=2)),
            "bwd_groups2": ("bwd_cell", mod.Tile(64, 32, 0, 8, 1, stationary=True, groups=2))}


@pytest.mark.parametrize("which", ["fwd_384_replaced", "fwd_groups2", "bwd_groups2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_stationary_cell_tiles(monkeypatch, dtype, which):
    """Stationary cell tiles (each program holds its H slice's whole weight, loaded once, and walks every groups-th
    row block): the 16-bit forward's GPU tile at B = 384 until the H200 timed it (one row group), and two row groups
    over three row blocks (the first program walks blocks 0 and 2, the second block 1) for the forward and the
    backward cell kernel, at a shape with three row blocks (the last partial), two H slices (the second partial) and
    P = 35 padded to PK = 64; the other kernels at the interpreter's tiles (the interpreter's plan: bf16 products
    emulated as on the other interpreter tests). Outputs and every gradient against the fp64 reference (bf16: within
    the budget of the reference run in bf16)."""
    name, tile = _stationary_tiles()[which]
    assert tile.stationary and not tile.BK
    B = 2 * tile.BM + 3
    _stationary_against_reference(monkeypatch, name, tile, dtype, ([3, 0, 1, 2, 3, 3, 1] * 20)[:B], tile.groups,
                                  f"[{name} {tile}] ")


def _stationary_against_reference(monkeypatch, name, tile, dtype, lengths, groups, what):
    """``tile`` for ``name`` (the interpreter's tile; TUNED's at this batch on a GPU), at len(lengths) rows, two H
    slices (the second partial) and P = 35 padded to PK = 64, reverse with the residual, training: outputs and every
    gradient against the fp64 reference (bf16: within the budget of the reference run in bf16)."""
    mod = _mod()
    B = len(lengths)
    monkeypatch.setattr(mod, "FUSED_GATES", dict.fromkeys(mod.FUSED_GATES, True))  # fp64 runs the 16-bit design
    monkeypatch.setitem(mod._INTERPRET_TILE, name, tile)
    if DEV != "cpu":  # on a GPU the plan takes TUNED's tiles
        monkeypatch.setitem(mod.TUNED, (name, "16bit" if dtype == torch.bfloat16 else "fp32", mod.tuned_size(B)), tile)
    shape = dict(ODD, B=B, H=tile.BN + 3, P=35, lengths=lengths)
    plan = mod.launch_plan(B, shape["T"], shape["H"], shape["P"], dtype, training=True,
                           target=mod.device_target(torch.device(DEV)))
    assert plan[name].grid == (groups, 2) and plan[name].constexprs["PK"] == 64
    case = make_case(**{**shape, "residual": True})
    fl = flags(reverse=True, residual=True)
    want = run(reference, case, torch.float64, fl, upstream_grads(8))
    got = run(kernel, case, dtype, fl, upstream_grads(8))
    if dtype == torch.float64:
        assert_close(got, want, TOL[torch.float64], what)
        return
    assert_low_precision(got, want, run(reference, case, dtype, fl, upstream_grads(8)), dtype, what)


@pytest.mark.parametrize("B", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_pdl_small_batch_tile(monkeypatch, dtype, B):
    """``PDL_TUNED``'s stationary forward cell tile (16 rows, one row group) at the batches it is for: one row block,
    partial below 16 rows (the next block the program loads ahead is wholly masked), an empty row at B = 3, two H
    slices (the second partial), P = 35 padded to PK = 64; reverse with the residual, training: outputs and every
    gradient against the fp64 reference (bf16: within the budget of the reference run in bf16)."""
    mod = _mod()
    tile = mod.PDL_TUNED[("fwd_cell", "16bit", 1)]
    assert tile == mod.PDL_TUNED[("fwd_cell", "16bit", 16)] and tile.stationary and tile.groups == 1
    _stationary_against_reference(monkeypatch, "fwd_cell", tile, dtype,
                                  [3, 0, 1, 2, 3, 3, 1, 3, 2, 0, 3, 1, 2, 3, 3, 1][:B], 1, f"[B={B}] ")


# (kernel, tile fields, B, reverse, cell clip): row groups that do not divide the row blocks (3 over 4) and more
# groups than blocks (5 over 3: the grid keeps 3), the forward direction and no cell clip
GROUP_CASES = {
    "fwd_g3_of_4": ("fwd_cell", dict(groups=3), 3 * 16 + 5, False, 0.5),
    "bwd_g3_of_4": ("bwd_cell", dict(groups=3), 3 * 16 + 5, False, 0.5),
    "fwd_g5_of_3": ("fwd_cell", dict(groups=5), 2 * 16 + 3, True, None),
    "bwd_g5_of_3": ("bwd_cell", dict(groups=5), 2 * 16 + 3, True, None),
}


@pytest.mark.parametrize("which", list(GROUP_CASES))
def test_stationary_row_groups(monkeypatch, which):
    """Stationary tiles whose row groups do not split the row blocks evenly, or outnumber them; both directions, with
    and without the cell clip: outputs and every gradient against the fp64 reference."""
    mod = _mod()
    name, kw, B, rev, clip = GROUP_CASES[which]
    tile = mod.Tile(16, 32, 0, 4, 1, stationary=True, **kw)
    monkeypatch.setattr(mod, "FUSED_GATES", dict.fromkeys(mod.FUSED_GATES, True))
    monkeypatch.setitem(mod._INTERPRET_TILE, name, tile)
    if DEV != "cpu":
        monkeypatch.setitem(mod.TUNED, (name, "fp32", 64), tile)
    shape = dict(ODD, B=B, H=35, P=35, lengths=([3, 0, 1, 2, 3, 3, 1] * 20)[:B])
    plan = mod.launch_plan(B, shape["T"], shape["H"], shape["P"], torch.float64, training=True,
                           target=mod.device_target(torch.device(DEV)))
    assert plan[name].constexprs["STATIONARY"] and plan[name].grid == (min(kw["groups"], -(-B // 16)), 2)
    case = make_case(**{**shape, "residual": True})
    fl = flags(reverse=rev, residual=True, cell_clip=clip)
    want = run(reference, case, torch.float64, fl, upstream_grads(8))
    got = run(kernel, case, torch.float64, fl, upstream_grads(8))
    assert_close(got, want, TOL[torch.float64], f"[{which}] ")


@pytest.mark.parametrize("rev", [False, True], ids=["fwd", "rev"])
def test_stationary_inference(monkeypatch, rev):
    """The stationary forward cell kernel in inference (the cell state read and written in place every step), two
    row groups over four row blocks."""
    mod = _mod()
    tile = mod.Tile(16, 32, 0, 4, 1, stationary=True, groups=2)
    monkeypatch.setattr(mod, "FUSED_GATES", dict.fromkeys(mod.FUSED_GATES, True))
    monkeypatch.setitem(mod._INTERPRET_TILE, "fwd_cell", tile)
    if DEV != "cpu":
        monkeypatch.setitem(mod.TUNED, ("fwd_cell", "fp32", 64), tile)
    B = 3 * 16 + 5
    plan = mod.launch_plan(B, 4, 35, 35, torch.float64, training=False, target=mod.device_target(torch.device(DEV)))
    assert plan["fwd_cell"].constexprs["STATIONARY"] and plan["fwd_cell"].grid == (2, 2)
    assert_inference_matches(make_case(B=B, T=4, D=5, H=35, P=35, lengths=([4, 0, 1, 2, 3, 4, 1] * 20)[:B]),
                             flags(reverse=rev))


def test_gpu_target_reads_the_opt_in_shared_memory():
    """A GPU's target carries the shared memory a block may opt into (what decides whether a stationary tile fits),
    or torch's 48 KiB default where its properties lack the opt-in field."""
    import types

    from elmo_fast.kernels._common import target_from

    h100 = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_block=48 * 1024,
                                 shared_memory_per_block_optin=227 * 1024, major=9)
    assert target_from(h100) == _mod().Target(interpret=False, sms=132, smem=227 * 1024, major=9)
    old = types.SimpleNamespace(multi_processor_count=80, shared_memory_per_block=48 * 1024, major=7)
    assert target_from(old).smem == 48 * 1024
    assert target_from(old).major == 7


def test_stationary_tiles_where_they_apply(monkeypatch):
    """A stationary tile is for the forward cell kernel in its gate-interleaved design or for the backward cell
    kernel, with at least one row group: asked for elsewhere, launch_plan says so. Where TUNED's stationary tile does
    not apply (its weight slice and A tile do not fit the target's shared memory at this P: P = H without a
    projection, P = 1024, a GPU with less shared memory than Hopper; or the per-gate design), the plan runs the same
    tile with a K loop; an explicit stationary tile that does not fit is refused. P = 8 pads to K = 16 (tl.dot's
    least). Without a projection the backward cell kernel has no product and runs its plain tile."""
    mod = _mod()
    st = mod.Tile(64, 32, 0, 8, 1, stationary=True)
    bad = (("fwd_cell", st), ("bwd_rec", st), ("fwd_cell", mod.Tile(64, 32, 0, 8, 1, True, True, 0)),
           ("fwd_proj", mod.Tile(64, 32, 0, 8, 1)))
    for name, t in bad:
        with pytest.raises(ValueError, match="stationary|BK"):
            mod.launch_plan(384, 20, 4096, 512, torch.bfloat16, training=True, tiles={name: t})
    # no TUNED entry is stationary since the H200's timings: one put in for the test, which falls back to itself
    # with a K loop
    old = mod.Tile(64, 32, 32, 8, 4)
    monkeypatch.setitem(mod.TUNED, ("fwd_cell", "16bit", 384), mod.Tile(64, 32, 0, 8, 1, stationary=True))
    tuned = mod.launch_plan(384, 20, 4096, 512, torch.bfloat16, training=True)["fwd_cell"]
    assert tuned.tile.stationary and tuned.constexprs["PK"] == 512
    for P, has_proj, target in ((1024, True, mod.H100), (4096, False, mod.H100),
                                (512, True, mod.Target(interpret=False, sms=108, smem=163 * 1024))):
        lc = mod.launch_plan(384, 20, 4096, P, torch.bfloat16, training=True, has_proj=has_proj,
                             target=target)["fwd_cell"]
        assert lc.tile == dataclasses.replace(old, fused=True) and "STATIONARY" not in lc.constexprs, (P, has_proj)
        assert lc.grid == (6, 128)
    with pytest.raises(ValueError, match="shared memory"):
        mod.launch_plan(384, 20, 4096, 1024, torch.bfloat16, training=True,
                        tiles={"fwd_cell": mod.Tile(64, 32, 0, 8, 1, fused=True, stationary=True)})
    assert mod.launch_plan(384, 20, 4096, 8, torch.bfloat16, training=True)["fwd_cell"].constexprs["PK"] == 16
    monkeypatch.setattr(mod, "FUSED_GATES", dict.fromkeys(mod.FUSED_GATES, False))  # the per-gate design
    lc = mod.launch_plan(384, 20, 4096, 512, torch.bfloat16, training=True)["fwd_cell"]
    assert lc.tile == old and not lc.tile.fused and lc.tile.BK == 32
    for has_proj, grid in ((True, (2, 128)), (False, (6, 128))):
        plan = mod.launch_plan(384, 20, 4096, 512 if has_proj else 4096, torch.bfloat16, training=True,
                               has_proj=has_proj, tiles={"bwd_cell": mod.Tile(64, 32, 0, 8, 1, stationary=True,
                                                                                groups=2)})
        lc = plan["bwd_cell"]  # the tile says what runs (the report's and the search's rule exemptions read it)
        assert lc.grid == grid and lc.constexprs.get("STATIONARY", False) is has_proj is lc.tile.stationary


def test_deterministic_bitwise(gpu_plan):
    """No atomics: two runs with 3 and 10 K splits give the same bits, forward and every gradient (the second with
    every grid run backwards: a result that depended on program order would differ)."""
    mod = _mod()
    gpu_plan(40, mod.Tile(16, 16, 16, warps=4, stages=2))
    case = make_case(B=4, T=3, D=5, H=40, P=5, residual=True)
    plan = mod.launch_plan(4, 3, 40, 5, torch.float32, training=True, target=mod.device_target(None))
    assert (plan["fwd_proj"].grid[2], plan["bwd_rec"].grid[2]) == (3, 10)
    fl = flags(reverse=True, residual=True)
    a = run(kernel, case, torch.float32, fl, upstream_grads(6))
    with programs_backwards() if DEV == "cpu" else contextlib.nullcontext():
        b = run(kernel, case, torch.float32, fl, upstream_grads(6))
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------- the plan at ELMo size
ELMO = dict(T=20, H=4096, P=512)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_launch_plan_at_elmo_size(dtype):
    """What the compiled code is held to (performance.md): at B >= 128 every launch fills the 132 SMs of an
    H100; every K loop is pipelined; 16-bit GEMM operands stay 16-bit; the tile table covers every size."""
    mod = _mod()
    for B in mod.BATCHES:
        plan = mod.launch_plan(B, **ELMO, dtype=dtype, training=True)
        assert set(plan) == set(mod.KERNELS)
        for name, launch in plan.items():
            n = launch.grid[0] * launch.grid[1] * (launch.grid[2] if len(launch.grid) > 2 else 1)
            if launch.tile.stationary:  # one program per H slice by design (mod.STATIONARY_EXEMPT)
                assert name == "fwd_cell" and launch.grid == (1, ELMO["H"] // launch.tile.BN), (name, B)
            elif B >= 128:
                assert n >= mod.H100.sms, f"{name} B={B}: {n} programs"
            if launch.tile.BK:
                assert launch.constexprs["STAGES"] >= 2 and launch.num_stages == launch.constexprs["STAGES"]
            args = dict(launch.args)
            assert args["B"] == B and args["T"] == ELMO["T"]
            for operand in ("w_rec", "w_proj", "hop", "m", "dz"):
                assert args.get(operand, dtype) == dtype, (name, operand)
        assert plan["fwd_reduce"].constexprs["SPLITS"] == plan["fwd_proj"].grid[2]
        assert plan["bwd_reduce"].constexprs["SPLITS"] == plan["bwd_rec"].grid[2]
        KS = plan["fwd_proj"].constexprs["KS"]
        assert KS % plan["fwd_proj"].tile.BK == 0 and plan["fwd_proj"].grid[2] == -(-ELMO["H"] // KS)
        infer = mod.launch_plan(B, **ELMO, dtype=dtype, training=False)
        assert set(infer) == {"fwd_cell", "fwd_proj", "fwd_reduce"}
        assert not infer["fwd_cell"].constexprs["SAVE"] and plan["fwd_cell"].constexprs["SAVE"]


def test_launch_plan_is_the_launchers_plan(monkeypatch):
    """The launchers launch exactly the plan's launches, in order (what a compile report reads)."""
    mod = _mod()
    seen = []
    real_bind = mod._bind

    def spy(launch, bufs, **over):  # the loops bind each launch once, then call it step after step
        run = real_bind(launch, bufs, **over)

        def step(s):
            seen.append((launch, over))
            run(s)

        return step

    monkeypatch.setattr(mod, "_bind", spy)
    T = 2
    run(kernel, make_case(B=3, T=T, lengths=[2, 1, 0]), torch.float64, flags(), upstream_grads(), device=DEV)
    # the plan for the target of the device the run used (the interpreter's on CPU tensors, the GPU's on CUDA ones)
    plan = mod.launch_plan(3, T, 12, 5, torch.float64, training=True, target=mod.device_target(torch.device(DEV)))
    fwd = [plan[k] for k in ("fwd_cell", "fwd_proj", "fwd_reduce")] * T
    bwd = [plan["bwd_reduce"]] + [plan[k] for k in ("bwd_cell", "bwd_rec", "bwd_reduce")] * T
    assert [launch for launch, _ in seen] == fwd + bwd
    # every launch a dependent one (the PDL attribute where the plan has PDL) but the backward's prologue; this plan
    # has no PDL, so the forward's first launch reuses the step's binding (test_lstmp_pdl checks it plain under PDL)
    dep = {"dependent": True}
    assert [over for _, over in seen] == [dep] * len(fwd) + [{"HAS_PART": False}] + [dep] * (len(bwd) - 1)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_graph_capture_of_the_time_loop():
    """The forward time loop captured in a CUDA graph replays to the eager result: static buffers, no host
    sync, no data-dependent allocation."""
    case = make_case(B=8, T=6, D=32, H=64, P=32, residual=True, lengths=[6, 0, 3, 5, 6, 1, 2, 4])
    fl = flags(reverse=True, residual=True)
    dev = torch.device("cuda")
    args = [case[k].to(dev, torch.float32) if case[k] is not None else None for k in GRAD_NAMES]
    lengths = case["lengths"].to(dev)
    with torch.no_grad():
        eager = kernel(*args, lengths, **fl)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            kernel(*args, lengths, **fl)  # warm-up on a side stream: compiles, caches the constants
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static = kernel(*args, lengths, **fl)
        g.replay()
        torch.cuda.synchronize()
    for a, b in zip(eager, static):
        assert torch.equal(a, b)
