"""How often the cpu backend packs weights for oneDNN and checks the packed product: the self-test once per process
and dtype, backward's packs of column-major weights once per weight version (with every gradient still equal to
the reference's, fp64 and fp32), and one cache per ``elmo_fast.LSTMP`` module shared by its chains."""
import pytest
import torch

import elmo_fast
from elmo_fast.cpu import lstmp_cpu, packed
from elmo_fast.cpu.packed import PackedLinear, PackedWeightCache
from elmo_fast.reference import lstmp_reference
from test_cpu_backend import _chain, _run_lstmp, assert_close_to_oracle

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
KW = dict(cell_clip=0.9, proj_clip=0.6, reverse=True, residual=False, forget_bias=1.0)
LENGTHS = [6, 2, 5, 0]


@pytest.fixture(autouse=True)
def _training_forward_unpacked(monkeypatch):
    """Training's forward packs a weight for one call only where ``packed.pack_pays`` measures that it pays, which
    at these sizes may go either way: these counts are of the other packs, so that choice is fixed to "never" here
    (``test_training_forward_packs_are_fresh_every_call`` covers "always")."""
    monkeypatch.setenv("ELMO_FAST_CPU_TRAIN_PACK", "0")


def _spy(monkeypatch, name):
    """Count the calls of ``packed.<name>`` (recording the dtype argument)."""
    calls, real = [], getattr(packed, name)

    def spy(*a):
        calls.append(a[2])
        return real(*a)

    monkeypatch.setattr(packed, name, spy)
    return calls


@needs_onednn
def test_self_test_runs_once_per_process_and_dtype(monkeypatch):
    monkeypatch.setenv("ELMO_FAST_CPU_PANELS", "0")  # oneDNN's packs (test_cpu_small_gemm.py: the panels' probe)
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    monkeypatch.setattr(packed, "_VERIFIED", set())
    tests, packs = _spy(monkeypatch, "_self_test"), _spy(monkeypatch, "_pack")
    args = _chain(4, 6, 5, 8, 3, True, torch.float32, seed=1)
    up = [torch.randn(4, 6, 3), torch.randn(4, 3), torch.randn(4, 8)]
    for _ in range(3):  # three training steps: every backward packs w_recᵀ and w_projᵀ afresh
        _run_lstmp(lstmp_cpu, args, LENGTHS, up, **KW)
    assert len(packs) == 6
    assert tests == [torch.float32]
    assert all(p.packed is not None for p in (PackedLinear(args[2].detach(), 4), PackedLinear(args[4].detach(), 4)))


@needs_onednn
def test_failed_self_test_turns_the_packed_path_off(monkeypatch):
    monkeypatch.setenv("ELMO_FAST_CPU_PANELS", "0")
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    monkeypatch.setattr(packed, "_VERIFIED", set())
    monkeypatch.setattr(packed, "_ONEDNN_OK", True)

    def broken(*a):
        raise RuntimeError("oneDNN linear returned unexpected values")

    monkeypatch.setattr(packed, "_self_test", broken)
    w = torch.randn(5, 7)
    lin = PackedLinear(w, 3)
    assert lin.packed is None and not packed._ONEDNN_OK
    x = torch.randn(3, 5)
    torch.testing.assert_close(lin(x), x @ w)


def _column_major(t):
    """The same values in a column-major leaf, as ``elmo_fast.LSTMP`` passes nn.LSTM's weights to the op."""
    return t.detach().t().contiguous().t().requires_grad_()


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backward_packs_column_major_weights_once_per_version(monkeypatch, dtype):
    """Two backward passes of one weight version (gradient accumulation) pack the transposed column-major weights
    once; an in-place update makes the next backward pack again; every gradient equals the reference's each time."""
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    packs = _spy(monkeypatch, "_pack")
    B, T, D, H, P = 4, 6, 5, 8, 3
    args = _chain(B, T, D, H, P, True, dtype, seed=2)
    args[2], args[4] = _column_major(args[2]), _column_major(args[4])
    assert not args[2].is_contiguous() and args[2].t().is_contiguous()
    up = [torch.randn(B, T, P, dtype=dtype), torch.randn(B, P, dtype=dtype), torch.randn(B, H, dtype=dtype)]
    cache = PackedWeightCache()
    counts = []
    for step in range(3):
        if step == 2:
            with torch.no_grad():  # an optimizer-like update: the kept packs are stale now
                args[2].mul_(0.5)
                args[4].add_(0.1)
        args64 = [a.detach().double().requires_grad_() for a in args]
        _, g64 = _run_lstmp(lstmp_reference, args64, LENGTHS, [u.double() for u in up], **KW)
        _, gref = _run_lstmp(lstmp_reference, args, LENGTHS, up, **KW)
        before = len(packs)
        _, got = _run_lstmp(lstmp_cpu, args, LENGTHS, up, weight_cache=cache, **KW)
        counts.append(len(packs) - before)
        for name, g, r64, r in zip(["x", "w_in", "w_rec", "bias", "w_proj", "h0", "c0"], got, g64, gref):
            assert_close_to_oracle(g, r64, r, f"step {step} d{name}")
    assert counts == [2, 0, 2]
    assert len(cache) == 2  # w_recᵀ and w_projᵀ, each replaced when its weight changed


@needs_onednn
def test_training_forward_packs_are_fresh_every_call(monkeypatch):
    """Where training's forward packs (``ELMO_FAST_CPU_TRAIN_PACK=1``), it packs w_rec and w_proj afresh in every
    call and keeps nothing: the weights change between training calls (the cache holds backward's packs only),
    and every gradient still matches the reference's."""
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    monkeypatch.setenv("ELMO_FAST_CPU_TRAIN_PACK", "1")
    packs = _spy(monkeypatch, "_pack")
    B, T, D, H, P = 4, 6, 5, 8, 3
    args = _chain(B, T, D, H, P, True, torch.float32, seed=4)
    args[2], args[4] = _column_major(args[2]), _column_major(args[4])
    up = [torch.randn(B, T, P), torch.randn(B, P), torch.randn(B, H)]
    args64 = [a.detach().double().requires_grad_() for a in args]
    _, g64 = _run_lstmp(lstmp_reference, args64, LENGTHS, [u.double() for u in up], **KW)
    _, gref = _run_lstmp(lstmp_reference, args, LENGTHS, up, **KW)
    cache = PackedWeightCache()
    counts = []
    for _ in range(2):
        before = len(packs)
        _, got = _run_lstmp(lstmp_cpu, args, LENGTHS, up, weight_cache=cache, **KW)
        counts.append(len(packs) - before)
        for name, g, r64, r in zip(["x", "w_in", "w_rec", "bias", "w_proj", "h0", "c0"], got, g64, gref):
            assert_close_to_oracle(g, r64, r, f"d{name}")
    assert counts == [4, 2]  # forward's two every call; backward's two column-major packs once per version
    assert len(cache) == 2


@needs_onednn
def test_backward_keeps_no_packs_of_row_major_weights(monkeypatch):
    """A row-major weight packs without a transposing copy: backward packs it afresh and keeps nothing."""
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    packs = _spy(monkeypatch, "_pack")
    args = _chain(4, 6, 5, 8, 3, True, torch.float32, seed=3)
    up = [torch.randn(4, 6, 3), torch.randn(4, 3), torch.randn(4, 8)]
    cache = PackedWeightCache()
    for _ in range(2):
        _run_lstmp(lstmp_cpu, args, LENGTHS, up, weight_cache=cache, **KW)
    assert len(packs) == 4 and len(cache) == 0


def test_lstmp_module_picks_the_backend_once_per_call(monkeypatch):
    from elmo_fast.modules import lstmp_layer

    picks, real = [], lstmp_layer.backend_for

    def spy(*a):
        picks.append(real(*a))
        return picks[-1]

    monkeypatch.setattr(lstmp_layer, "backend_for", spy)
    m = elmo_fast.LSTMP(4, 6, num_layers=2, bidirectional=True, proj_size=3)  # 4 chains
    m(torch.randn(5, 2, 4))
    assert picks == ["cpu"]


@needs_onednn
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lstmp_module_packs_a_shared_weight_once(monkeypatch, dtype):
    """One packed-weight cache for all chains of an ``elmo_fast.LSTMP``: a projection tied between the two
    directions is packed once (by inference, and by backward for its transposed use), every result and
    gradient still matching nn.LSTM's (fp64 and fp32)."""
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    packs = _spy(monkeypatch, "_pack")
    lstm = torch.nn.LSTM(4, 6, bidirectional=True, proj_size=3, batch_first=True, dtype=dtype)
    lstm.weight_hr_l0_reverse = lstm.weight_hr_l0  # tied: one parameter, two chains
    m = elmo_fast.LSTMP.from_lstm(lstm, backend="cpu")
    m.weight_hr_l0_reverse = m.weight_hr_l0
    x = torch.randn(3, 5, 4, dtype=dtype)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(m(x)[0], lstm(x)[0])
    assert len(packs) == 3  # w_rec of each chain, the tied w_proj once; nothing on the second call
    packs.clear()
    up = torch.randn(3, 5, 6, dtype=dtype)
    got = torch.autograd.grad(m(x)[0], list(m.parameters()), up)
    want = torch.autograd.grad(lstm(x)[0], list(lstm.parameters()), up)
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in lstm.named_parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert len(packs) == 3  # backward: w_recᵀ of each chain, the tied w_projᵀ once


def _train_calls(cache, dtype, n=3, lengths=(6, 2, 5, 0)):
    """``n`` training calls of one chain with fresh inputs (and the same weights): outputs and every gradient."""
    B, T, D, H, P = 4, 6, 5, 7, 3
    w = _chain(B, T, D, H, P, True, dtype, seed=1)[1:5]
    res = []
    for i in range(n):
        x, *_, h0, c0 = _chain(B, T, D, H, P, True, dtype, seed=10 + i)
        args = [x, *w, h0, c0]
        g = torch.Generator().manual_seed(i)
        up = [torch.randn(s, generator=g, dtype=dtype) for s in ((B, T, P), (B, P), (B, H))]
        outs, grads = _run_lstmp(lambda *a, **k: lstmp_cpu(*a, weight_cache=cache, **k), args, list(lengths), up,
                                 **KW)
        res.append([t.detach().clone() for t in (*outs, *grads)])
    return res


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_training_reuses_saved_buffers_after_backward(dtype):
    """With a module's cache, a training call takes the saved-activation buffers (and backward's dz) that the
    previous call's backward released: the same memory, the same results as fresh buffers (and the reference)."""
    cache = PackedWeightCache()
    got = _train_calls(cache, dtype)
    want = _train_calls(None, dtype)
    for a, b in zip(got, want):
        for u, v in zip(a, b):
            assert torch.equal(u, v)
    from elmo_fast.cpu.lstmp import _SAVED

    assert {name: len(k) for name, k in cache._kept.items()} == {n: 1 for n in (*_SAVED, "dz")}


def test_saved_buffers_in_use_are_never_handed_out():
    """Two forwards before their backwards (and a retained graph) keep their own buffers: none is reused while a
    graph still holds it, so every backward sees its own forward's values."""
    B, T, D, H, P = 4, 6, 5, 7, 3
    dtype = torch.float64
    cache = PackedWeightCache()
    w = _chain(B, T, D, H, P, True, dtype, seed=1)[1:5]
    xs = [_chain(B, T, D, H, P, True, dtype, seed=10 + i)[0] for i in range(3)]
    h0, c0 = torch.zeros(B, P, dtype=dtype), torch.zeros(B, H, dtype=dtype)
    lengths = torch.tensor([6, 2, 5, 0])

    def loss(x, use_cache):
        y, _, _ = lstmp_cpu(x, *w, h0, c0, lengths, weight_cache=cache if use_cache else None, **KW)
        return (y * torch.arange(y.numel(), dtype=dtype).view_as(y).sin()).sum()

    first = loss(xs[0], True)
    first.backward(retain_graph=True)  # retained: its buffers stay referenced
    pending = [loss(x, True) for x in xs[1:]]  # two more forwards, no backward yet
    assert len(cache._kept["gates"]) == 3  # three sets: none was handed out twice
    want = [torch.autograd.grad(loss(x, False), w) for x in xs]
    for lo, wa in zip([first, *pending], want):
        for g, v in zip(torch.autograd.grad(lo, w), wa):
            assert torch.equal(g, v)
