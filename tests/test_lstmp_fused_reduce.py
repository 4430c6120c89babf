"""The forward's reduce in the projection's last split (kernels/lstmp.py ``_splitk_out_kernel``; opt-in,
``ELMO_FAST_LSTMP_FUSED_REDUCE``): the same bits as the reduce kernel (the same split order), forward and every
gradient, at shapes that cross the interpreter's tiles (several row blocks, P slices and splits; rows of every
length, an empty one), two launches a forward step, the counters back at zero, any program order; and on a GPU,
where the ticket's memory ordering is real, the same bits call after call (``gpu``)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import poison_allocations, programs_backwards, requires_triton, triton_device
from elmo_fast import ops
from elmo_fast.kernels import lstmp as KL
from elmo_fast.probes import probe

pytestmark = [pytest.mark.triton, requires_triton]
DEV = triton_device()
ENV = KL.FUSED_REDUCE_ENV


def _inputs(B, T, D, H, P, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    if B > 1:  # an empty row; never the only one (B = 1 would compare zeros and h0, whatever the kernel does)
        lengths[-1] = 0
    return [r(B, T, D), r(D, 4 * H, scale=0.3), r(P, 4 * H, scale=0.3), r(4 * H, scale=0.1), r(H, P, scale=0.3),
            r(B, P, scale=0.5), r(B, H, scale=0.5)], lengths.to(device)


def _run(monkeypatch, rows: str, floats, lengths, *, reverse, residual, grads=True, backend="triton"):
    monkeypatch.setenv(ENV, rows)
    leaves = [t.detach().clone().requires_grad_(grads) for t in floats]
    y, hn, cn = ops.lstmp(*leaves, lengths, cell_clip=1.0, proj_clip=0.8, reverse=reverse, residual=residual,
                          backend=backend)
    out = [y.detach(), hn.detach(), cn.detach()]
    if grads:
        out += list(torch.autograd.grad(_loss(y, hn, cn), leaves))
    return out


def _loss(*outs):
    """A fixed random projection of the outputs (the upstream gradients, the same for every run)."""
    g = torch.Generator().manual_seed(7)
    return sum((t * torch.randn(t.shape, generator=g).to(t.device, t.dtype)).sum() for t in outs)


# B = 35: two row blocks of the interpreter's 32; H = 150: three splits of 64 K rows; P = D = 40: two P slices
SHAPE = dict(B=35, T=4, D=40, H=150, P=40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reverse,residual", [(False, False), (True, True)], ids=["fwd", "rev-resid"])
def test_fused_reduce_is_the_reduce_kernel_bit_for_bit(monkeypatch, dtype, reverse, residual):
    poison_allocations(monkeypatch)  # an element neither path writes stays NaN
    floats, lengths = _inputs(**SHAPE, dtype=dtype, device=DEV)
    want = _run(monkeypatch, "0", floats, lengths, reverse=reverse, residual=residual)
    got = _run(monkeypatch, "64", floats, lengths, reverse=reverse, residual=residual)
    assert len(got) == len(want) == 10
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
    assert not any(t.isnan().any() for t in got)


def test_fused_reduce_against_the_reference_in_fp64(monkeypatch):
    floats, lengths = _inputs(**SHAPE, dtype=torch.float64, device=DEV, seed=3)
    got = _run(monkeypatch, "64", floats, lengths, reverse=True, residual=False)
    leaves = [t.detach().clone().requires_grad_(True) for t in floats]
    y, hn, cn = ops.lstmp(*leaves, lengths, cell_clip=1.0, proj_clip=0.8, reverse=True, residual=False,
                          backend="reference")
    want = [y.detach(), hn.detach(), cn.detach(), *torch.autograd.grad(_loss(y, hn, cn), leaves)]
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, i=i: f"item {i}: {m}")


def test_two_launches_a_step_and_the_counters_back_at_zero(monkeypatch):
    """The plan has no reduce launch, a forward step is two launches (cell, projection with the reduce), and every
    tile's counter is zero after the loop (the last split resets it), so the next step and the next call start
    clean; a batch above the row count keeps the three launches."""
    monkeypatch.setenv(ENV, "64")
    floats, lengths = _inputs(**SHAPE, dtype=torch.float32, device=DEV)
    x, w_in, w_rec, bias, w_proj, h0, c0 = floats
    kw = dict(cell_clip=1.0, proj_clip=0.8, forget_bias=1.0, reverse=False, residual=False, save=False)
    plan, bufs = KL.fwd_setup(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, **kw)
    assert sorted(plan) == ["fwd_cell", "fwd_proj"] and plan["fwd_proj"].kernel is KL._splitk_out_kernel
    # splits: the interpreter's fixed 3; a GPU's from its SMs (10 on the H200), more than one either way
    assert plan["fwd_proj"].grid[2] == 3 if DEV == "cpu" else plan["fwd_proj"].grid[2] > 1
    grid = plan["fwd_proj"].grid  # a counter a (row block, P slice): 2 x 2 at the interpreter's tile
    assert bufs["tickets"].numel() == grid[0] * grid[1] and (DEV != "cpu" or grid[0] * grid[1] == 4)
    with probe() as counts:
        KL._fwd_loop(plan, bufs)
    assert [la.kernel for la in counts.launches] == ["_fwd_cell_kernel", "_splitk_out_kernel"] * SHAPE["T"]
    assert torch.equal(bufs["tickets"].cpu(), torch.zeros(grid[0] * grid[1], dtype=torch.int32))
    monkeypatch.setenv(ENV, str(SHAPE["B"] - 1))
    plan, _ = KL.fwd_setup(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, **kw)
    assert sorted(plan) == ["fwd_cell", "fwd_proj", "fwd_reduce"]


@contextlib.contextmanager
def programs_split_major():
    """Under the interpreter, the programs of every grid handed out with the last dimension (the split) slowest:
    every tile's first split, then every tile's second, ... (the interpreter's own order runs one tile's splits
    together, which hides a counter shared by two tiles)."""
    from triton.runtime import interpreter

    b = interpreter.interpreter_builder
    real = type(b).set_grid_idx

    def split_major(x, y, z):
        gx, gy, gz = b.grid_dim
        n = (x * gy + y) * gz + z  # the position in the interpreter's order
        z2, rest = divmod(n, gx * gy)
        real(b, rest // gy, rest % gy, z2)

    b.set_grid_idx = split_major
    try:
        yield
    finally:
        del b.set_grid_idx


@pytest.mark.parametrize("order", [programs_backwards, programs_split_major], ids=["backwards", "split-major"])
def test_any_program_order_gives_the_same_bits(monkeypatch, order):
    """Whichever split draws a tile's last ticket sums its partials in split order: programs handed out from the
    last to the first, or every tile's first split before any second one, give the same bits."""
    if DEV != "cpu":
        pytest.skip("program order is the interpreter's to choose; on a GPU the gpu test repeats calls instead")
    floats, lengths = _inputs(**SHAPE, dtype=torch.float32, device=DEV, seed=5)
    want = _run(monkeypatch, "64", floats, lengths, reverse=False, residual=True, grads=False)
    with order():
        got = _run(monkeypatch, "64", floats, lengths, reverse=False, residual=True, grads=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_loop_graphs_keep_the_two_plans_apart(monkeypatch):
    """The setting is part of a loop graph's key: a call with it on after calls with it off (seen, captured,
    replayed) runs the fused plan, not the other plan's recorded loop."""
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "record" if DEV == "cpu" else "1")
    floats, lengths = _inputs(5, 3, 24, 40, 24, torch.float32, DEV, seed=2)
    want = [_run(monkeypatch, "0", floats, lengths, reverse=False, residual=True, grads=False) for _ in range(3)][-1]
    with probe() as counts:
        got = _run(monkeypatch, "64", floats, lengths, reverse=False, residual=True, grads=False)
    assert any(la.kernel == "_splitk_out_kernel" for la in counts.launches), counts.launches
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_setting_is_a_row_count(monkeypatch):
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=r"ELMO_FAST_LSTMP_FUSED_REDUCE='yes': expected a row count"):
        KL.fused_reduce_rows()
    monkeypatch.delenv(ENV)
    assert KL.fused_reduce_rows() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B", [1, 16])
def test_gpu_fused_reduce_is_the_reduce_kernel_bit_for_bit(monkeypatch, B, dtype):
    """On a GPU, at the original model's sizes and the batches it is meant for, with loop graphs (the default) and
    without: 30 calls each, every one the reduce kernel's bits (a missing release or acquire, or a stale L1 line,
    would let a last split read a partial before it lands), and a training call (forward caches and every
    gradient)."""
    from elmo_fast.kernels import lstmp_graphs

    floats, lengths = _inputs(B, 20, 512, 4096, 512, dtype, "cuda", seed=B)
    assert int(lengths.max()) == 20
    want = _run(monkeypatch, "0", floats, lengths, reverse=True, residual=True, grads=False)
    for graphs in (True, False):
        with lstmp_graphs.suspended() if not graphs else contextlib.nullcontext():
            with probe() as counts:
                _run(monkeypatch, "16", floats, lengths, reverse=True, residual=True, grads=False)
            if not graphs:  # eager: the fused kernel is what ran (a replay counts as one launch)
                assert any(la.kernel == "_splitk_out_kernel" for la in counts.launches)
            for i in range(30):
                got = _run(monkeypatch, "16", floats, lengths, reverse=True, residual=True, grads=False)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (graphs, i)
    want = _run(monkeypatch, "0", floats, lengths, reverse=False, residual=False)
    got = _run(monkeypatch, "16", floats, lengths, reverse=False, residual=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


PTX_SCRIPT = """
import os, re, sys
sys.path.insert(0, sys.argv[1])
import triton
import kernel_report as KR
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
case = next(c for c in KR.workload_cases([z for z in KR.SIZES if z.name == "infer B=1"], [KR.BF16])
            if c.kernel == "_splitk_out_kernel")
options, signature, constexprs, attrs = KR.compile_key(case)
ck = triton.compile(ASTSource(case.launch.kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                    options=options.__dict__)
print(ck.asm["ptx"])
"""


def test_the_compiled_ticket_orders_the_partials():
    """What the interpreter cannot run, checked in the code compiled for sm_90a (no GPU): the partial stores, then a
    CTA barrier, then the ticket as an acq_rel atomic at GPU scope, then a barrier, then every split's partial read
    past L1 (``ld.global.cg``), then the counter's reset."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", PTX_SCRIPT, str(root / "bench")], env=env, capture_output=True,
                       text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln.strip() for ln in r.stdout.splitlines()]

    def first(rx, start=0):
        return next(i for i in range(start, len(lines)) if re.search(rx, lines[i]))

    ticket = first(r"atom\.global\.gpu\.acq_rel\.add")
    last_store = max(i for i in range(ticket) if re.search(r"\bst\.global", lines[i]))
    assert any("bar.sync" in ln for ln in lines[last_store:ticket])  # every thread's partial before the ticket
    after = first(r"bar\.sync", ticket)
    loads = [i for i in range(after, len(lines)) if re.search(r"ld\.global\.cg", lines[i])]
    assert len(loads) == 9  # SPLITS = 9 at B = 1: each partial once, past L1
    assert first(r"atom\.global.*\.exch", after) > loads[-1]  # the counter reset once all are read
