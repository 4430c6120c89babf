"""The sparse softmax rows' sum and Adagrad update in elmo_fast._cpu (csrc/cpu/sparse_rows.cpp) against the torch
ops of trainer.sum_rows / trainer.adagrad_rows and an fp32 emulation of TF1 Adagrad's arithmetic."""
import numpy as np
import pytest
import torch

import elmo_fast.training.trainer as tr
from conftest import isa_chosen, poison_allocations
from elmo_fast.cpu.ext import cpu_ext

ext = cpu_ext()
pytestmark = pytest.mark.skipif(ext is None, reason="elmo_fast._cpu is not built (no C++ compiler at install)")


def _rows(seed, V=97, k=37, n_sampled=300, n_hot=60):
    """Ids as a step gives them: samples spread over V, targets piling up on a few frequent ids; id 0 real."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, V, (n_sampled,), generator=g), torch.randint(0, 5, (n_hot,), generator=g)])
    ids[:2] = 0
    vals = torch.randn(len(ids), k, generator=g) * torch.exp(2 * torch.randn(len(ids), 1, generator=g))
    w = torch.randn(V, k, generator=g)
    acc = torch.rand(V, k, generator=g) + 0.05
    return ids, vals, w, acc


def _torch_ops(monkeypatch):
    monkeypatch.setenv("ELMO_FAST_CPU_EXT", "0")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sum_rows_is_bit_identical_to_the_torch_ops(seed, monkeypatch):
    ids, vals, _, _ = _rows(seed)
    with monkeypatch.context() as m:
        _torch_ops(m)
        want_ids, want = tr.sum_rows(ids, vals)
    poison_allocations(monkeypatch, int_fill=-7)  # every element the kernel leaves unwritten would show
    got_ids, got = tr.sum_rows(ids, vals)  # the extension
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got, want)  # the same additions in the same order, zero padding rows included


def _adagrad_fp32(w, acc, rows, g, lr, f):
    """TF1 Adagrad on the touched rows in numpy fp32, one rounding per operation (np.sqrt is correctly rounded)."""
    w, acc = w.numpy().copy(), acc.numpy().copy()
    for r, x in zip(rows.tolist(), g.numpy()):
        if not x.any():
            continue
        gc = x / np.float32(f)
        a = acc[r] + gc * gc
        acc[r] = a
        w[r] = w[r] + (gc / np.sqrt(a)) * np.float32(-lr)
    return torch.from_numpy(w), torch.from_numpy(acc)


@pytest.fixture(params=["scalar", "avx512"])
def isa(request):
    """The update's loops: the scalar one, and the AVX-512 one where this CPU runs it."""
    with isa_chosen(ext, request.param):
        yield request.param


@pytest.mark.parametrize("seed,k", [(0, 37), (1, 48), (2, 7)])
def test_adagrad_rows_matches_the_fp32_arithmetic_bit_for_bit(seed, k, isa, monkeypatch):
    ids, vals, w0, acc0 = _rows(seed, k=k)
    rows, sums = tr.sum_rows(ids, vals)
    inv_factor, lr = torch.tensor(1.7), 0.2
    w, acc = w0.clone(), acc0.clone()
    tr.adagrad_rows(w, acc, rows, sums, lr, inv_factor)
    want_w, want_acc = _adagrad_fp32(w0, acc0, rows, sums, lr, 1.7)
    assert torch.equal(acc, want_acc) and torch.equal(w, want_w)
    # the torch ops agree to the last bit on acc; on w within an ulp of w or two of the step, which is under lr = 0.2
    # in size (torch's sqrt_ runs MKL's vsSqrt, which is not always correctly rounded; torch's fused dense Adagrad
    # and this kernel are)
    _torch_ops(monkeypatch)
    w_t, acc_t = w0.clone(), acc0.clone()
    tr.adagrad_rows(w_t, acc_t, rows, sums, lr, inv_factor)
    assert torch.equal(acc_t, acc)
    torch.testing.assert_close(w_t, w, rtol=2.5e-7, atol=4 * lr * 2.0**-24)


def test_adagrad_rows_leaves_zero_gradient_rows_alone_even_with_a_zero_accumulator(isa):
    """The padding rows of sum_rows (id 0, zero gradient) change nothing; the torch ops would write 0/0 = NaN into a
    row whose accumulator is 0."""
    w, acc = torch.randn(6, 4), torch.ones(6, 4)
    acc[0] = 0
    rows = torch.tensor([3, 0, 0])
    g = torch.zeros(3, 4)
    g[0] = 1.0
    w0 = w.clone()
    tr.adagrad_rows(w, acc, rows, g, 0.5, torch.tensor(1.0))
    assert torch.equal(w[[0, 1, 2, 4, 5]], w0[[0, 1, 2, 4, 5]]) and not torch.equal(w[3], w0[3])
    assert torch.equal(acc[0], torch.zeros(4)) and torch.equal(acc[3], torch.full((4,), 2.0))


def test_repeated_ids_fall_back_to_the_torch_ops(monkeypatch):
    """Rows that share an id (not sum_rows's output) are left to the torch ops: index_add_ sums their updates."""
    ids, vals, w0, acc0 = _rows(3)
    inv_factor = torch.tensor(2.0)
    w, acc = w0.clone(), acc0.clone()
    assert not ext.adagrad_rows(w, acc, ids, vals, 0.1, inv_factor)  # refused ...
    assert torch.equal(w, w0) and torch.equal(acc, acc0)  # ... before changing anything
    tr.adagrad_rows(w, acc, ids, vals, 0.1, inv_factor)
    _torch_ops(monkeypatch)
    w_t, acc_t = w0.clone(), acc0.clone()
    tr.adagrad_rows(w_t, acc_t, ids, vals, 0.1, inv_factor)
    assert torch.equal(w, w_t) and torch.equal(acc, acc_t)


def test_bad_inputs_are_named():
    w, acc = torch.zeros(5, 3), torch.ones(5, 3)
    with pytest.raises(RuntimeError, match="rows\\[1\\] = 5 is not a row of p \\(5 rows\\)"):
        ext.adagrad_rows(w, acc, torch.tensor([1, 5]), torch.ones(2, 3), 0.1, torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="g must be a contiguous 2-d CPU float32 tensor"):
        ext.adagrad_rows(w, acc, torch.tensor([1, 2]), torch.ones(2, 3, dtype=torch.float64), 0.1, torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="acc must be \\(5, 3\\)"):
        ext.adagrad_rows(w, torch.ones(4, 3), torch.tensor([1, 2]), torch.ones(2, 3), 0.1, torch.tensor(1.0))
    out = torch.empty(2, dtype=torch.long), torch.empty(2, 3)
    with pytest.raises(RuntimeError, match="sid must be sorted"):
        ext.sum_rows(torch.tensor([2, 1]), torch.tensor([0, 1]), torch.ones(2, 3), *out)
    with pytest.raises(RuntimeError, match="perm\\[1\\] = 7 is not a row of vals"):
        ext.sum_rows(torch.tensor([1, 2]), torch.tensor([0, 7]), torch.ones(2, 3), *out)
    with pytest.raises(RuntimeError, match="sums must be \\(2, 3\\)"):
        ext.sum_rows(torch.tensor([1, 2]), torch.tensor([0, 1]), torch.ones(2, 3), out[0], torch.empty(3, 3))


def test_other_dtypes_take_the_torch_ops():
    """fp64 (the oracle's dtype) never reaches the fp32 kernels."""
    ids, vals, w, acc = (t.double() if t.is_floating_point() else t for t in _rows(4))
    rows, sums = tr.sum_rows(ids, vals)
    tr.adagrad_rows(w, acc, rows, sums, 0.1, torch.tensor(1.5, dtype=torch.float64))
    assert sums.dtype == w.dtype == torch.float64
