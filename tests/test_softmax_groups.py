"""Several sampled softmaxes over one table in one call (``ops.sampled_softmax_loss_groups``, the trainer's every
tower's two directions): each group its own rows and sample set. The Triton backend runs them as one grouped call
(each kernel launched once for all the groups, batched GEMMs): checked against the fp64 reference and against one
call per group, forward and every gradient, at shapes that cross the interpreter's tiles (rows 21 against 16,
samples 40 against 32), with accidental hits and a repeated target in every group."""
from __future__ import annotations

import collections
import math

import pytest
import torch

from conftest import poison_allocations, requires_triton, triton_device
from elmo_fast import ops
from elmo_fast.probes import probe
from test_softmax import _close

# Where the Triton kernels' tensors live, chosen once at import (as test_lstmp_triton.py does): a test's
# device cannot change with the environment at run time.
DEV = triton_device()

pytestmark = [pytest.mark.triton, requires_triton]


def _groups(G, N, P, V, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(G):
        ids, tries = ops.log_uniform_sample(S, V, generator=g)
        t = torch.randint(0, V, (N,), generator=g)
        t[:2] = ids[:2]  # accidental hits
        t[3] = t[4]  # a repeated target
        out.append((torch.randn(N, P, generator=g, dtype=torch.float64), t, ids, tries))
    w = torch.randn(V, P, generator=g, dtype=torch.float64) / math.sqrt(P)
    return out, w, 0.3 * torch.randn(V, generator=g, dtype=torch.float64)


def _run(groups, w, b, backend, dtype, dev, *, reduction, sparse=False, grouped=True, seed=1):
    """(losses, [dh per group], dW, db) of the groups' losses weighted by a random upstream gradient."""
    hs = [h.to(dev, dtype).requires_grad_() for h, *_ in groups]
    wd, bd = w.to(dev, dtype).requires_grad_(), b.to(dev, dtype).requires_grad_()
    items = [(h, t.to(dev), ids.to(dev), tries) for h, (_, t, ids, tries) in zip(hs, groups)]
    kw = dict(reduction=reduction, backend=backend, sparse_grad=sparse)
    if grouped:
        losses = ops.sampled_softmax_loss_groups(items, wd, bd, **kw)
    else:
        losses = [ops.sampled_softmax_loss(h, t, wd, bd, ids, tries, **kw) for h, t, ids, tries in items]
    g = torch.Generator().manual_seed(seed)
    ups = [torch.randn(loss.shape, generator=g, dtype=torch.float64).to(dev, loss.dtype) for loss in losses]
    grads = torch.autograd.grad(losses, [*hs, wd, bd], ups)
    dense = [gr.to_dense() if gr.is_sparse else gr for gr in grads]
    return [loss.detach() for loss in losses], dense[:len(hs)], dense[-2], dense[-1]


@pytest.fixture
def nan_empty(monkeypatch):
    poison_allocations(monkeypatch, ("empty",))


def _launched(fn):
    """(fn(), the Triton launches it made by kernel name: ``elmo_fast.probes.probe``)."""
    with probe() as counts:
        out = fn()
    return out, collections.Counter(la.kernel for la in counts.launches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_groups_match_the_reference(nan_empty, reduction, dtype):
    """Three groups of 21 rows, 40 samples each: every group's loss and hidden gradient and the table's gradients
    within the accuracy budget of the fp64 reference (``test_softmax._close``), each kernel launched once."""
    groups, w, b = _groups(3, 21, 24, 300, 40, seed=4)
    got, launches = _launched(lambda: _run(groups, w, b, "triton", dtype, DEV, reduction=reduction))
    assert launches == {"_softmax_lse_fwd_kernel": 1, "_softmax_dlogit_kernel": 1}
    ref64 = _run(groups, w, b, "reference", torch.float64, "cpu", reduction=reduction)
    refdt = _run(groups, w, b, "reference", dtype, "cpu", reduction=reduction)
    for k in range(3):
        assert got[0][k].dtype == dtype and got[0][k].shape == ref64[0][k].shape
        _close(got[0][k], refdt[0][k], ref64[0][k], dtype, f"loss of group {k}")
        _close(got[1][k], refdt[1][k], ref64[1][k], dtype, f"dh of group {k}")
    _close(got[2], refdt[2], ref64[2], dtype, "dW")
    _close(got[3], refdt[3], ref64[3], dtype, "db")


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_groups_equal_one_call_per_group(nan_empty, reduction, sparse):
    """fp32: the grouped call against one triton call per group: the losses bitwise (the same tiles), the
    gradients to fp32 rounding (batched GEMMs, the table's rows summed once instead of per call)."""
    groups, w, b = _groups(4, 21, 24, 300, 40, seed=5)
    dev = DEV
    one = _run(groups, w, b, "triton", torch.float32, dev, reduction=reduction, sparse=sparse)
    each = _run(groups, w, b, "triton", torch.float32, dev, reduction=reduction, sparse=sparse, grouped=False)
    for a, c in zip(one[0], each[0]):
        assert torch.equal(a, c)
    for a, c in zip([*one[1], one[2], one[3]], [*each[1], each[2], each[3]]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_groups_over_the_dlogit_budget_go_one_by_one(nan_empty, monkeypatch):
    """Where every group's dlogit at once would pass the backward's budget (``dlogit_columns`` below the
    columns), the groups run one after the other, each in column chunks: the same values."""
    from elmo_fast.kernels import softmax as KS

    groups, w, b = _groups(2, 21, 24, 300, 40, seed=6)
    dev = DEV
    whole = _run(groups, w, b, "triton", torch.float32, dev, reduction="mean")
    monkeypatch.setattr(KS, "dlogit_columns", lambda N, C, itemsize: min(C, 16))
    chunked, launches = _launched(lambda: _run(groups, w, b, "triton", torch.float32, dev, reduction="mean"))
    assert launches == {"_softmax_lse_fwd_kernel": 1, "_softmax_dlogit_kernel": 2 * 3}  # 2 groups x 40 / 16
    for a, c in zip([*whole[0], *whole[1], whole[2], whole[3]], [*chunked[0], *chunked[1], chunked[2], chunked[3]]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_unlike_groups_run_one_call_each(nan_empty):
    """Groups of different row counts or sample counts cannot share a launch: one call each, the same values as
    the per-group calls."""
    (g1,), w, b = _groups(1, 21, 24, 300, 40, seed=7)
    (g2,), _, _ = _groups(1, 17, 24, 300, 40, seed=8)
    (g3,), _, _ = _groups(1, 21, 24, 300, 33, seed=9)
    dev = DEV
    got, launches = _launched(lambda: _run([g1, g2, g3], w, b, "triton", torch.float32, dev, reduction="mean"))
    assert launches["_softmax_lse_fwd_kernel"] == 3
    want = _run([g1, g2, g3], w, b, "reference", torch.float64, "cpu", reduction="mean", grouped=False)
    for a, c in zip([*got[0], *got[1], got[2], got[3]], [*want[0], *want[1], want[2], want[3]]):
        torch.testing.assert_close(a.double().cpu(), c.double(), rtol=1e-5, atol=1e-6)


def test_groups_refuse_bad_input():
    from elmo_fast.kernels.softmax import sampled_softmax_loss_triton, softmax_lse_fwd

    groups, w, b = _groups(2, 6, 8, 50, 5)
    w32, b32 = w.float(), b.float()
    with pytest.raises(ValueError, match="non-empty sequence"):
        ops.sampled_softmax_loss_groups([], w32, b32)
    with pytest.raises(ValueError, match="non-empty sequence"):
        ops.sampled_softmax_loss_groups([groups[0][:3]], w32, b32)
    h = torch.randn(12, 8)
    t = torch.zeros(12, dtype=torch.long)
    ids = torch.stack([groups[0][2], groups[1][2]])
    q = torch.full((2, 5), 0.5)
    with pytest.raises(ValueError, match="sampled_expected of its shape"):
        sampled_softmax_loss_triton(h, t, w32, b32, ids, torch.ones(12), q[0])
    with pytest.raises(ValueError, match="a multiple of the groups"):
        sampled_softmax_loss_triton(h[:11], t[:11], w32, b32, ids, torch.ones(11), q)
    with pytest.raises(ValueError, match="groups must be a positive int"):
        softmax_lse_fwd(h, w32, ids.view(-1), q.view(-1), t, torch.zeros(12), mask_hits=True, groups=5)
    with pytest.raises(ValueError, match="gathered columns"):
        softmax_lse_fwd(h, w32, None, torch.zeros(10), t, torch.zeros(12), mask_hits=False, groups=2)


def test_groups_of_no_rows_and_strided_ids():
    """Groups of no rows give one empty loss each ('none') or zeros ('sum'); (G, S) ids that are a transposed
    view (not contiguous) run forward and backward."""
    from elmo_fast.kernels.softmax import sampled_softmax_loss_triton

    dev = DEV
    groups, w, b = _groups(2, 6, 8, 50, 5, seed=2)
    w32, b32 = w.to(dev, torch.float32), b.to(dev, torch.float32)
    empty = [(torch.zeros(0, 8, device=dev), torch.zeros(0, dtype=torch.long, device=dev), ids.to(dev), tries)
             for _, _, ids, tries in groups]
    none = ops.sampled_softmax_loss_groups(empty, w32, b32, reduction="none", backend="triton")
    assert len(none) == 2 and all(loss.shape == (0,) for loss in none)
    total = ops.sampled_softmax_loss_groups(empty, w32, b32, reduction="sum", backend="triton")
    assert len(total) == 2 and all(loss.item() == 0 for loss in total)
    h = torch.randn(12, 8, device=dev, requires_grad=True)
    t = torch.cat([g[1] for g in groups]).to(dev)
    ids = torch.stack([g[2] for g in groups], 1).to(dev).t()  # (2, S), not contiguous
    assert not ids.is_contiguous()
    q = torch.full((2, 5), 0.5, device=dev)
    def run(ids):
        hh = h.detach().requires_grad_()
        loss = sampled_softmax_loss_triton(hh, t, w32, b32, ids, torch.full((12,), 0.1, device=dev), q)
        return loss, *torch.autograd.grad(loss.sum(), hh)

    got, want = run(ids), run(ids.contiguous())  # the strided view read as its contiguous copy
    assert got[0].shape == (2,) and all(torch.equal(a, c) for a, c in zip(got, want))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("groups,rows", [(2, 7680), (6, 2560)], ids=["one-tower", "original-towers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_groups_at_the_trainer_sizes_on_a_gpu(groups, rows, dtype):
    """The trainer's grouped calls at their real sizes (V = 793,471, S = 8,192, P = 512: a one-tower step's two
    directions of 7,680 rows, the original config's six groups of 2,560), compiled kernels: each group's loss and
    hidden gradient and the table's gradient against one call per group (fp32: to fp32 rounding; bf16: to the
    16-bit budget of a rounding, the table's rows summed once instead of per call)."""
    dev, V, P, S = "cuda", 793_471, 512, 8192
    g = torch.Generator(device=dev).manual_seed(0)
    sets = [ops.log_uniform_sample(S, V, generator=g, device=dev) for _ in range(groups)]
    h = torch.randn(groups * rows, P, device=dev, generator=g).to(dtype)
    w = (torch.randn(V, P, device=dev, generator=g) / math.sqrt(P)).to(dtype)
    b = torch.zeros(V, device=dev, dtype=dtype)
    y = torch.randint(0, V, (groups * rows,), device=dev, generator=g)

    def run(grouped):
        hh, ww, bb = (t.detach().requires_grad_() for t in (h, w, b))
        items = [(hk, yk, ids, tries) for hk, yk, (ids, tries) in zip(hh.split(rows), y.split(rows), sets)]
        if grouped:
            losses = ops.sampled_softmax_loss_groups(items, ww, bb, backend="triton")
        else:
            losses = [ops.sampled_softmax_loss(*item[:2], ww, bb, *item[2:], backend="triton") for item in items]
        loss = torch.stack(losses).float()
        return (loss.detach(), *torch.autograd.grad(loss.sum(), (hh, ww, bb)))

    one, each = run(True), run(False)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # of the largest entry
    for name, a, c in zip(("loss", "dh", "dW", "db"), one, each):
        err = (a.float() - c.float()).abs().max().item()
        assert err <= tol * c.float().abs().max().item(), (name, err)
