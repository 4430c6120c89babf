"""Training's dropout (elmo_fast.ops.dropout): the extension's kernel (csrc/cpu/dropout.cpp) bit for bit against the
reference (elmo_fast/reference/dropout.py) on fresh inputs and seeds, its masks' statistics, the operator's gradient,
determinism under torch.manual_seed, and the fallbacks."""
from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from elmo_fast import ops
from elmo_fast.cpu.ext import cpu_ext
from elmo_fast.reference.dropout import dropout_keep_reference, dropout_reference, dropout_threshold

D = importlib.import_module("elmo_fast.ops.dropout")  # the module (elmo_fast.ops.dropout is also the function)
ext = cpu_ext()
needs_ext = pytest.mark.skipif(ext is None or not hasattr(ext, "dropout_apply"),
                               reason="needs elmo_fast._cpu with csrc/cpu/dropout.cpp")


@needs_ext
@pytest.mark.parametrize("shape", [(16, 20, 512), (3, 7), (1,), (40001,)])  # a vector tail, one element, odd sizes
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1e-9])
@pytest.mark.parametrize("seed", [0, -5, 2 ** 40 + 17, 2 ** 63 - 1])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_is_the_reference_bit_for_bit(shape, p, seed, threads):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(abs(seed) % 1000))
    x.view(-1)[0] = float("nan")  # a NaN stays NaN, dropped or kept (x · 0)
    y = torch.full_like(x, float("nan") if x.numel() > 1 else 7.0)  # an element the kernel does not write fails
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ext.dropout_apply(x, y, seed, dropout_threshold(p), 1.0 / (1.0 - p))
    finally:
        torch.set_num_threads(before)
    want = dropout_reference(x, seed, p)
    assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.nan_to_num(), want.nan_to_num())
    assert math.isnan(float(y.view(-1)[0]))


@needs_ext
def test_kernel_checks_its_arguments():
    x = torch.zeros(4)
    with pytest.raises(RuntimeError, match="y must have x's shape"):
        ext.dropout_apply(x, torch.zeros(5), 0, 10, 1.0)
    with pytest.raises(RuntimeError, match=r"threshold must be in \[0, 2\^32\)"):
        ext.dropout_apply(x, x, 0, 2 ** 32, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.dropout_apply(torch.zeros(4, 2).t(), torch.zeros(2, 4), 0, 10, 1.0)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_masks_look_random(p):
    """The drop fraction within 5 sigma of p; the number dropped varies from seed to seed as a binomial count does
    (a key mixed in before the index was would give every seed with the same high half the same count); neighbours,
    and the same element under two seeds, uncorrelated."""
    n = 1 << 18
    sigma = math.sqrt(n * p * (1 - p))
    counts = []
    for seed in range(24):
        dropped = int((~dropout_keep_reference(n, seed, p)).sum())
        assert abs(dropped - n * p) < 5 * sigma, (seed, dropped)
        counts.append(dropped)
    spread = torch.tensor(counts, dtype=torch.float64).std()
    assert 0.4 * sigma < spread < 2.0 * sigma, (counts, sigma)
    k = dropout_keep_reference(n, 99, p).double() - (1 - p)
    other = dropout_keep_reference(n, 100, p).double() - (1 - p)
    var = p * (1 - p)
    for a, b in ((k[1:], k[:-1]), (k[16:], k[:-16]), (k, other)):
        assert abs(float((a * b).mean()) / var) < 5 / math.sqrt(n)


def test_dropout_op_gradient_and_determinism():
    x = torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    y = ops.dropout(x, 0.3)
    torch.manual_seed(3)
    assert torch.equal(ops.dropout(x, 0.3), y)  # the seed comes from torch's generator
    assert not torch.equal(ops.dropout(x, 0.3), y)  # and each call draws a fresh one
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] / 0.7)
    up = torch.randn_like(x)
    (g,) = torch.autograd.grad(y, x, up)
    assert torch.equal(g, torch.where(kept, up * (1.0 / (1.0 - 0.3)), 0.0))  # the same mask on the gradient
    assert 0.15 < 1 - float(kept.double().mean()) < 0.45


@needs_ext
def test_extension_and_torch_ops_give_the_same_masks(monkeypatch):
    """fp32 through the extension and through the reference's torch ops: one mask for one seed, so a training run
    does not depend on whether the extension was built."""
    monkeypatch.delenv("ELMO_FAST_BACKEND", raising=False)
    x = torch.randn(5, 300)
    torch.manual_seed(11)
    a = ops.dropout(x, 0.25)
    monkeypatch.setenv("ELMO_FAST_CPU_EXT", "0")
    torch.manual_seed(11)
    b = ops.dropout(x, 0.25)
    assert torch.equal(a, b)


def test_operator_opcheck():
    x = torch.randn(3, 5, requires_grad=True)
    torch.library.opcheck(D._dropout_op, (x, torch.tensor([123], dtype=torch.int64), [15], 0.2))
    torch.library.opcheck(D._dropout_op, (x, torch.tensor([123, -4], dtype=torch.int64), [5, 10], 0.2))


def test_groups_are_their_own_calls():
    """One operator call over groups of elements, each group's mask from its own seed and its own first element:
    what each group gets in a call of its own."""
    x = torch.randn(2 + 3, 4)
    seeds = torch.tensor([7, 2 ** 40], dtype=torch.int64)
    y = D._dropout_op(x, seeds, [8, 12], 0.5)
    torch.testing.assert_close(y, torch.cat([dropout_reference(x[:2], 7, 0.5), dropout_reference(x[2:], 2 ** 40, 0.5)]),
                               rtol=0, atol=0)


def test_edges_and_bad_probabilities():
    x = torch.tensor([1.0, float("nan"), -2.0])
    assert ops.dropout(x, 0.0) is x and ops.dropout(x, 0.5, training=False) is x
    y = ops.dropout(x, 1.0)
    assert y[0] == 0 and y[2] == 0 and math.isnan(float(y[1]))  # as F.dropout(p=1): x · 0
    for bad in (-0.1, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="dropout probability must be a number in"):
            ops.dropout(x, bad)
    for backend in ("cpu", "reference"):
        with pytest.raises(TypeError, match="x must be a floating-point tensor, got torch.int64"):
            ops.dropout(torch.ones(4, dtype=torch.long), 0.5, backend=backend)


def test_the_cuda_backend_takes_torch_dropout(monkeypatch):
    """The cuda backend (its extension has no dropout) takes F.dropout; every other backend the hash (the triton
    backend's kernel: tests/test_dropout_triton.py)."""
    monkeypatch.delenv("ELMO_FAST_BACKEND", raising=False)
    calls, real = [], F.dropout
    monkeypatch.setattr(D.F, "dropout", lambda x, p, training: calls.append(p) or real(x, p, training))
    ops.dropout(torch.ones(4), 0.5, backend="cuda")
    assert calls == [0.5]
    for cpu_backend in ("cpu", "reference", "auto", None):
        ops.dropout(torch.ones(4), 0.5, backend=cpu_backend)
    assert calls == [0.5]
    with pytest.raises(ValueError, match="is not a backend"):
        ops.dropout(torch.ones(4), 0.5, backend="gpu")
    monkeypatch.setenv("ELMO_FAST_BACKEND", "cuda")  # auto follows the environment's backend
    ops.dropout(torch.ones(4), 0.5)
    assert calls == [0.5, 0.5]


def test_hash_known_answers():
    """murmur3's fmix32 at fixed points (independent of the kernel, which the reference is compared with)."""
    from elmo_fast.reference.dropout import _fmix32

    got = _fmix32(torch.tensor([0, 1, 0xFFFFFFFF], dtype=torch.int64)).tolist()
    assert got == [0, 0x514E28B7, 0x81F16F39]


@needs_ext
def test_fp32_gradient_through_the_extension_and_a_transposed_input(monkeypatch):
    monkeypatch.delenv("ELMO_FAST_BACKEND", raising=False)
    base = torch.randn(300, 7, requires_grad=True)
    x = base.t()  # not contiguous
    torch.manual_seed(5)
    y = ops.dropout(x, 0.4)
    mask = (y != 0).float() / 0.6
    up = torch.randn(7, 300)
    (g,) = torch.autograd.grad(y, base, up)
    torch.testing.assert_close(g, (up * mask).t(), rtol=1e-6, atol=0)


def test_p_next_to_one_drops_everything_and_numpy_probabilities_pass():
    import numpy as np

    x = torch.ones(1000)
    assert torch.equal(ops.dropout(x, 1 - 1e-12), torch.zeros(1000))  # no biased survivor scaled by 1e12
    torch.manual_seed(0)
    y = ops.dropout(x, np.float32(0.25))
    assert 0.15 < float((y == 0).float().mean()) < 0.35


def test_the_seed_stays_on_the_cpu_under_another_default_device(monkeypatch):
    monkeypatch.delenv("ELMO_FAST_BACKEND", raising=False)
    x = torch.ones(64)
    with torch.device("meta"):
        y = ops.dropout(x, 0.5)
    assert y.device.type == "cpu" and set(y.unique().tolist()) <= {0.0, 2.0}
    with pytest.raises(ValueError, match="seeds must be a 1-d CPU int64 tensor of one seed per group"):
        D._dropout_op(x, torch.tensor([5.0]), [64], 0.5)
    with pytest.raises(ValueError, match=r"one seed per group \(2\)"):
        D._dropout_op(x, torch.tensor([5]), [32, 32], 0.5)
    with pytest.raises(ValueError, match=r"element counts \[32, 31\] must cover x's 64 elements"):
        D._dropout_op(x, torch.tensor([5, 6]), [32, 31], 0.5)
