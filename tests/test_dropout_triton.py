"""The hashed dropout's Triton kernel (kernels/dropout.py): the reference's masks (elmo_fast/reference/dropout.py) bit
for bit on fresh inputs and seeds, in every dtype, over groups of rows with their own seeds (more groups than one
launch takes, empty groups), its gradient, its launches, its self-check, and the backend choice around it."""
from __future__ import annotations

import importlib

import pytest
import torch

from conftest import poison_allocations, programs_backwards, requires_triton, triton_device
from elmo_fast import ops
from elmo_fast._backend import BackendUnavailableError
from elmo_fast.probes import probe
from elmo_fast.reference.dropout import dropout_reference

D = importlib.import_module("elmo_fast.ops.dropout")
pytestmark = [pytest.mark.triton, requires_triton]
DEV = triton_device()


def _kd():
    return importlib.import_module("elmo_fast.kernels.dropout")


def _want(x, seeds, numels, p):
    """The reference's masks group by group (each group indexed from its own first element)."""
    xs = x.detach().cpu().reshape(-1).split(numels)
    return torch.cat([dropout_reference(a, int(s), p) for a, s in zip(xs, seeds)]).reshape(x.shape)


def _same(a, b) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # the interpreter's inf · 0
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows", [[7], [2, 3], [1, 0, 4, 2, 3, 1]])  # one group; two; more than a launch takes
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1e-9])
def test_kernel_is_the_reference_bit_for_bit(monkeypatch, dtype, rows, p):
    poison_allocations(monkeypatch)  # an element the kernel does not write stays NaN
    g = torch.Generator().manual_seed(len(rows) * 100 + int(p * 10))
    per_row = 173  # not a multiple of the block: groups start and end inside one
    x = (torch.randn(sum(rows), per_row, generator=g) * 3).to(dtype)
    x[0, 0] = float("nan")  # NaN stays NaN, dropped or kept
    x[-1, -1] = float("inf")
    seeds = torch.randint(-(2 ** 63), 2 ** 63 - 1, (len(rows),), generator=g)
    seeds[0] = 2 ** 63 - 1
    numels = [r * per_row for r in rows]
    y = _kd().dropout_hash_triton(x.to(DEV), seeds, numels, p)
    assert y.dtype == dtype and y.shape == x.shape
    assert _same(y, _want(x, seeds, numels, p))


def test_rounding_to_bf16_is_to_nearest_even():
    """x · 1/(1 - p) rounded once, to nearest (ties to even), as torch's bf16 product: the interpreter's own
    fp32 -> bf16 store truncates, which the kernel must not inherit."""
    x = torch.tensor([-0.296875, -0.96875, 0.27734375, 1.5, 3.0, -65280.0], dtype=torch.bfloat16)
    seeds = torch.tensor([3])
    y = _kd().dropout_hash_triton(x.to(DEV), seeds, [x.numel()], 1e-9)  # every element kept, x 1.0000000010
    assert torch.equal(y.cpu(), x)  # 1 / (1 - 1e-9) rounds to 1 in bf16
    y = _kd().dropout_hash_triton(x.to(DEV), seeds, [x.numel()], 0.1)
    want = _want(x, seeds, [x.numel()], 0.1)
    assert _same(y, want)
    kept = want != 0
    assert (want[kept].double() - x[kept].double() * (1 / 0.9)).abs().max() > 0  # a real rounding happened


def test_gradient_is_the_same_mask_and_the_launches(monkeypatch):
    """Forward and backward: one launch each for up to 4 groups, two for 6 (the same dtype and flags); the gradient
    is the kernel on the upstream gradient with the same seeds, nothing saved."""
    x = torch.randn(6, 40, dtype=torch.float64, device=DEV, requires_grad=True)
    seeds = torch.tensor([5, 6, 7, 8, 9, 10])
    numels = [40] * 6
    up = torch.randn(6, 40, dtype=torch.float64, device=DEV)
    with probe() as counts:
        y = _kd().dropout_hash_triton(x, seeds, numels, 0.4)
        (dx,) = torch.autograd.grad(y, x, up)
    assert [k.kernel for k in counts.launches] == ["_dropout_hash_kernel"] * 4
    assert counts.syncs == [] and counts.uploads == []  # the seeds are a host read: no sync on a GPU
    assert _same(dx, _want(up, seeds, numels, 0.4))
    kept = y.detach() != 0
    assert torch.equal(kept, dx != 0) and 0 < int(kept.sum()) < kept.numel()


def test_the_result_does_not_depend_on_program_order():
    x = torch.randn(3, 2000, device=DEV)
    seeds, numels = torch.tensor([1, 2, 3]), [2000] * 3
    a = _kd().dropout_hash_triton(x, seeds, numels, 0.3)
    with programs_backwards():
        b = _kd().dropout_hash_triton(x, seeds, numels, 0.3)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_one_seed_one_mask_on_every_backend(monkeypatch, backend):
    """torch.manual_seed fixes the masks, and the triton backend's masks are the cpu backend's (the seed comes from
    torch's CPU generator, the mask is the same function of it): a GPU run drops what a CPU run drops."""
    monkeypatch.delenv("ELMO_FAST_BACKEND", raising=False)
    x = torch.randn(4, 5, 6)
    torch.manual_seed(21)
    got = D.dropout(x.to(DEV) if backend == "triton" else x, 0.35, backend=backend)
    torch.manual_seed(21)
    want = D.dropout(x, 0.35, backend="reference")
    assert torch.equal(got.cpu(), want)


def test_backend_choice(monkeypatch):
    """The hash everywhere but the cuda backend (no dropout in its extension: torch's), and for a group of 2^32
    elements or more; an explicit triton that cannot run is refused with the fix."""
    monkeypatch.delenv("ELMO_FAST_BACKEND", raising=False)
    dev, cpu = torch.device(DEV), torch.device("cpu")
    assert D.hash_impl("triton", dev) == "triton"
    assert D.hash_impl("reference", cpu) == "op" and D.hash_impl("cpu", cpu) == "op" and D.hash_impl(None, cpu) == "op"
    assert D.hash_impl("cuda", cpu) == "torch"
    monkeypatch.setenv("ELMO_FAST_BACKEND", "triton")
    assert D.hash_impl(None, dev) == "triton"
    monkeypatch.setattr(importlib.import_module("elmo_fast._backend"), "triton_interpret", lambda: False)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):  # CPU tensors, no interpreter
        D.hash_impl("triton", cpu)


def test_self_check_passes_and_catches_a_wrong_mask(monkeypatch):
    from elmo_fast.ops import _selfcheck

    dev = torch.device(DEV)
    assert _selfcheck.run_self_check("dropout", dev) is None
    kd = _kd()
    real = kd._keys
    monkeypatch.setattr(kd, "_keys", lambda seed: real(seed + 1))  # another seed's mask
    assert "differs from the CPU's masks" in _selfcheck.run_self_check("dropout", dev)


def test_ops_dropout_takes_the_kernel_on_the_triton_backend(monkeypatch):
    monkeypatch.delenv("ELMO_FAST_BACKEND", raising=False)
    with probe() as counts:
        y = ops.dropout(torch.ones(3, 7, device=DEV), 0.5, backend="triton")
    assert [k.kernel for k in counts.launches] == ["_dropout_hash_kernel"]
    assert set(y.unique().tolist()) == {0.0, 2.0}


@pytest.mark.gpu
def test_auto_on_a_gpu_takes_the_kernel_behind_its_self_check(monkeypatch):
    """auto on CUDA tensors: the kernel once its self-check passed there (the masks of a CPU run); torch's
    F.dropout where it failed."""
    from elmo_fast import _backend

    monkeypatch.delenv("ELMO_FAST_BACKEND", raising=False)
    x = torch.randn(3, 50, device="cuda")
    assert D.hash_impl(None, x.device) == "triton" and _backend._SELF_CHECKED[("dropout", str(x.device))]
    torch.manual_seed(4)
    got = D.dropout(x, 0.5)
    torch.manual_seed(4)
    assert torch.equal(got.cpu(), D.dropout(x.cpu(), 0.5, backend="reference"))
    monkeypatch.setitem(_backend._SELF_CHECKED, ("dropout", str(x.device)), False)
    assert D.hash_impl(None, x.device) == "torch"


def test_operator_opcheck():
    x = torch.randn(3, 5, device=DEV, requires_grad=True)
    torch.library.opcheck(_kd()._dropout_op, (x, torch.tensor([1, 2]), [5, 10], 0.2))


def test_operator_checks_its_arguments():
    """The CPU operator's checks (elmo_fast.ops.dropout.check_hash_args): a seed per group, groups covering x."""
    x = torch.randn(4, 8, device=DEV)
    with pytest.raises(ValueError, match=r"one seed per group \(2\)"):
        _kd().dropout_hash_triton(x, torch.tensor([5]), [16, 16], 0.5)
    with pytest.raises(ValueError, match=r"must cover x's 32 elements"):
        _kd().dropout_hash_triton(x, torch.tensor([5, 6]), [16, 8], 0.5)
