"""Sampled softmax (spec §6.5), the log-uniform sampler, and the full-softmax NLL (spec §6.7).

Oracles: fp64 reference (``elmo_fast.reference.sampled_softmax``), an independent per-row loop, and
``torch.nn.functional.cross_entropy``, on the CPU; the Triton kernels run on ``triton_device()`` (CUDA tensors on
a GPU, CPU tensors under the interpreter). Kernel tolerance (style anchors §8.4): max|kernel − fp64| ≤
2·max|reference-in-dtype − fp64| + slack[dtype].
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import poison_allocations, programs_backwards, requires_triton, triton_device
from elmo_fast import ops
from elmo_fast.modules.sampled_softmax import SampledSoftmaxLoss
from elmo_fast.reference.sampled_softmax import (
    expected_count_reference,
    full_softmax_nll_reference,
    log_uniform_ids_from_uniform,
    log_uniform_probability,
    log_uniform_sample_reference,
    sampled_softmax_loss_reference,
)

# Where the Triton kernels' tensors live, chosen once at import (as test_lstmp_triton.py does): a test's
# device cannot change with the environment at run time.
DEV = triton_device()

SLACK = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _chi2_critical_999(df: int) -> float:
    try:
        from scipy.stats import chi2

        return float(chi2.ppf(0.999, df))
    except ImportError:  # Wilson–Hilferty approximation (within ~0.2% at df ≥ 30)
        z = 3.090232306167813
        return df * (1.0 - 2.0 / (9.0 * df) + z * math.sqrt(2.0 / (9.0 * df))) ** 3


def _close(kernel: torch.Tensor, ref_dt: torch.Tensor, ref64: torch.Tensor, dtype, what: str):
    kernel, ref_dt = kernel.to_dense().double().cpu(), ref_dt.to_dense().double().cpu()
    ref64 = ref64.to_dense().double().cpu()
    err = (kernel - ref64).abs().max().item()
    budget = 2.0 * (ref_dt - ref64).abs().max().item() + SLACK[dtype] * max(1.0, ref64.abs().max().item())
    assert torch.isfinite(kernel).all(), f"{what}: non-finite values"
    assert err <= budget, f"{what}: max err {err:.3e} > budget {budget:.3e} ({dtype})"


def _problem(N, P, V, S, *, seed=0, hits=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, P, generator=g, dtype=torch.float64)
    weight = torch.randn(V, P, generator=g, dtype=torch.float64) / math.sqrt(P)
    bias = 0.3 * torch.randn(V, generator=g, dtype=torch.float64)
    ids, tries = ops.log_uniform_sample(S, V, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[:hits] = ids[torch.randperm(S, generator=g)[:hits] % S]  # force accidental hits
    return hidden, targets, weight, bias, ids, tries


# ------------------------------------------------------------------------------------------------ sampler

@pytest.mark.parametrize("S,V,seed,chunk", [(1, 50, 0, None), (20, 50, 1, None), (40, 300, 2, None),
                                             (50, 50, 3, None), (40, 300, 4, 7), (300, 300, 5, 64)],
                         ids=["S1", "S20-V50", "S40-V300", "S=V", "chunk7", "S=V-chunk64"])
def test_sampler_matches_tf_rejection_loop(S, V, seed, chunk):
    a_ids, a_tries = ops.log_uniform_sample(S, V, generator=torch.Generator().manual_seed(seed), chunk=chunk)
    b_ids, b_tries = log_uniform_sample_reference(S, V, generator=torch.Generator().manual_seed(seed), chunk=chunk)
    assert torch.equal(a_ids, b_ids)
    assert a_tries == b_tries
    assert a_ids.dtype == torch.long and a_ids.shape == (S,)
    assert a_ids.unique().numel() == S, "samples must be unique"
    assert 0 <= int(a_ids.min()) and int(a_ids.max()) < V
    assert a_tries >= S
    if S == V:
        assert torch.equal(a_ids.sort().values, torch.arange(V))


def test_sampler_num_tries_counts_rejected_draws():
    """Replay the stream by hand: num_tries = index of the draw giving the S-th distinct id, + 1."""
    S, V, seed = 30, 60, 11
    ids, tries = ops.log_uniform_sample(S, V, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    from elmo_fast.reference.sampled_softmax import sampler_chunk_size

    draws = log_uniform_ids_from_uniform(
        torch.rand(sampler_chunk_size(S, V), generator=g, dtype=torch.float64), V).tolist()
    seen: list[int] = []
    for i, d in enumerate(draws):
        if d not in seen:
            seen.append(d)
        if len(seen) == S:
            assert tries == i + 1
            break
    assert ids.tolist() == seen
    assert tries > S  # with V = 2S the log-uniform law rejects (almost surely; fixed seed)


def test_sampler_reproducible_and_advances():
    g1 = torch.Generator().manual_seed(7)
    g2 = torch.Generator().manual_seed(7)
    a = ops.log_uniform_sample(40, 300, generator=g1)
    b = ops.log_uniform_sample(40, 300, generator=g2)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    c = ops.log_uniform_sample(40, 300, generator=g1)
    assert not torch.equal(a[0], c[0])


def test_sampler_rejects_bad_sizes():
    with pytest.raises(ValueError):
        ops.log_uniform_sample(0, 10)
    with pytest.raises(ValueError):
        ops.log_uniform_sample(11, 10)


def test_single_draw_distribution_chi_square():
    """Raw draws follow P(k) = log((k+2)/(k+1)) / log(V+1) (the kept-first draw of the sampler with S = 1 too)."""
    V, n = 50, 200_000
    g = torch.Generator().manual_seed(0)
    draws = log_uniform_ids_from_uniform(torch.rand(n, generator=g, dtype=torch.float64), V)
    counts = torch.bincount(draws, minlength=V).double()
    expected = n * log_uniform_probability(torch.arange(V), V)
    assert abs(expected.sum().item() - n) < 1e-6
    stat = ((counts - expected) ** 2 / expected).sum().item()
    assert stat < _chi2_critical_999(V - 1), f"chi-square {stat:.1f}"
    # the sampler with S = 1 keeps exactly one draw: its law is P too
    g = torch.Generator().manual_seed(1)
    m = 3000
    firsts = torch.stack([ops.log_uniform_sample(1, V, generator=g)[0][0] for _ in range(m)])
    counts = torch.bincount(firsts, minlength=V).double()
    exp1 = m * log_uniform_probability(torch.arange(V), V)
    stat = ((counts - exp1) ** 2 / exp1).sum().item()
    assert stat < _chi2_critical_999(V - 1), f"chi-square (S=1 sampler) {stat:.1f}"


def test_expected_count_closed_form_and_inclusion_probability():
    V, S = 50, 10
    ids = torch.arange(V)
    p = log_uniform_probability(ids, V)
    # num_tries == S: TF's special case p·S
    assert torch.allclose(expected_count_reference(ids, S, S, V), p * S, rtol=1e-15, atol=0)
    # otherwise 1 − (1 − p)^tries, computed stably
    tries = 17
    closed = 1.0 - (1.0 - p) ** tries
    q = expected_count_reference(ids, tries, S, V)
    assert torch.allclose(q, closed, rtol=1e-12, atol=0)
    assert (q > 0).all() and (q <= 1).all()
    # the formula is the probability that id k appears among `tries` i.i.d. draws
    trials = 20_000
    g = torch.Generator().manual_seed(3)
    d = log_uniform_ids_from_uniform(torch.rand(trials, tries, generator=g, dtype=torch.float64), V)
    present = torch.zeros(trials, V).scatter_(1, d, 1.0).mean(0).double()
    se = torch.sqrt(closed * (1 - closed) / trials)
    assert ((present - closed).abs() <= 5 * se + 1e-9).all()
    # stability for the tiniest probabilities of a real vocabulary
    big_v = 793_471
    tiny = expected_count_reference(torch.tensor([big_v - 1]), 15_000, 8192, big_v)
    pv = log_uniform_probability(torch.tensor([big_v - 1]), big_v)
    assert torch.allclose(tiny, -torch.expm1(15_000 * torch.log1p(-pv)), rtol=1e-14)


# --------------------------------------------------------------------------------------- reference oracle

def _loop_loss(hidden, targets, weight, bias, ids, tries, remove_hits):
    """Independent per-row TF sampled softmax in fp64 (accidental hits dropped from the row)."""
    V, S = weight.shape[0], ids.numel()
    p = lambda k: math.log((k + 2.0) / (k + 1.0)) / math.log(V + 1.0)  # noqa: E731
    q = (lambda k: p(k) * S) if tries == S else (lambda k: 1.0 - (1.0 - p(k)) ** tries)  # noqa: E731
    out = []
    for n in range(hidden.shape[0]):
        y = int(targets[n])
        logit = lambda k: float(hidden[n] @ weight[k] + bias[k]) - math.log(q(k))  # noqa: E731
        row = [logit(y)] + [logit(int(s)) for s in ids if not (remove_hits and int(s) == y)]
        mx = max(row)
        out.append(mx + math.log(sum(math.exp(r - mx) for r in row)) - row[0])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("remove_hits", [True, False])
def test_reference_matches_independent_loop(remove_hits):
    hidden, targets, weight, bias, ids, tries = _problem(9, 7, 60, 12, hits=4)
    tq = expected_count_reference(targets, tries, ids.numel(), 60)
    sq = expected_count_reference(ids, tries, ids.numel(), 60)
    got = sampled_softmax_loss_reference(hidden, targets, weight, bias, ids, tq, sq,
                                         remove_accidental_hits=remove_hits, reduction="none")
    torch.testing.assert_close(got, _loop_loss(hidden, targets, weight, bias, ids, tries, remove_hits),
                               rtol=1e-12, atol=1e-12)


def test_reference_gradcheck():
    hidden, targets, weight, bias, ids, tries = _problem(4, 3, 20, 5, hits=2)
    tq = expected_count_reference(targets, tries, 5, 20)
    sq = expected_count_reference(ids, tries, 5, 20)
    args = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    fn = lambda h, w, b: sampled_softmax_loss_reference(h, targets, w, b, ids, tq, sq, reduction="sum")  # noqa
    assert torch.autograd.gradcheck(fn, args)


def test_full_softmax_reference_is_cross_entropy():
    hidden, targets, weight, bias, _, _ = _problem(7, 5, 40, 3)
    for red in ("mean", "sum", "none"):
        torch.testing.assert_close(full_softmax_nll_reference(hidden, targets, weight, bias, red),
                                   F.cross_entropy(hidden @ weight.t() + bias, targets, reduction=red))


# ------------------------------------------------------------------------------------------ fused kernels

def _grads(loss_fn, tensors, reduction, seed=0):
    args = [t.clone().requires_grad_() for t in tensors]
    loss = loss_fn(*args)
    up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    up = up.to(device=loss.device, dtype=loss.dtype)
    grads = torch.autograd.grad(loss, args, up if reduction == "none" else None)
    return loss.detach(), grads


SHAPES = [
    pytest.param(13, 20, 300, 37, 3, id="N13-P20-V300-S37"),
    pytest.param(16, 16, 64, 16, 0, id="tile-multiples"),
    pytest.param(1, 5, 50, 1, 0, id="N1-P5-S1"),
    pytest.param(16, 9, 257, 40, 16, id="all-rows-hit"),
]


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,P,V,S,hits", SHAPES)
def test_sampled_softmax_triton_matches_reference(N, P, V, S, hits, dtype):
    hidden, targets, weight, bias, ids, tries = _problem(N, P, V, S, hits=hits, seed=N + S)
    for reduction, remove_hits in (("mean", True), ("none", True), ("sum", False)):
        def run(backend, dt, dev="cpu"):
            def fn(h, w, b):
                return ops.sampled_softmax_loss(h, targets.to(dev), w, b, ids.to(dev), tries,
                                                remove_accidental_hits=remove_hits, reduction=reduction,
                                                backend=backend)
            return _grads(fn, [t.to(dev, dt) for t in (hidden, weight, bias)], reduction)

        l64, g64 = run("reference", torch.float64)
        ldt, gdt = run("reference", dtype)
        lk, gk = run("triton", dtype, DEV)
        assert lk.dtype == dtype and lk.shape == l64.shape
        what = f"{reduction}/hits={remove_hits}"
        _close(lk, ldt, l64, dtype, f"loss {what}")
        for name, a, b, c in zip(("hidden", "weight", "bias"), gk, gdt, g64):
            assert a.dtype == dtype
            _close(a, b, c, dtype, f"d{name} {what}")


@pytest.mark.triton
@requires_triton
def test_sampled_softmax_triton_no_rejection_branch():
    """num_tries == S uses Q = p·S; S = 1 never rejects."""
    hidden, targets, weight, bias, ids, tries = _problem(8, 16, 100, 1, seed=5)
    assert tries == 1
    dev = DEV
    a = ops.sampled_softmax_loss(*(t.to(dev) for t in (hidden.float(), targets, weight.float(), bias.float(), ids)),
                                 tries, backend="triton")
    b = ops.sampled_softmax_loss(hidden, targets, weight, bias, ids, tries, backend="reference")
    torch.testing.assert_close(a.double().cpu(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=[pytest.mark.triton,
                                                                               requires_triton])])
def test_sparse_grad_equals_dense_rows(backend):
    hidden, targets, weight, bias, ids, tries = _problem(12, 16, 200, 30, hits=3, seed=9)
    targets[5] = targets[6]  # a repeated target: its row must be summed once
    dev = DEV if backend == "triton" else "cpu"
    hidden, weight, bias = (t.to(dev, torch.float32) for t in (hidden, weight, bias))
    targets, ids = targets.to(dev), ids.to(dev)

    def run(sparse):
        w = weight.clone().requires_grad_()
        b = bias.clone().requires_grad_()
        ops.sampled_softmax_loss(hidden, targets, w, b, ids, tries, backend=backend, sparse_grad=sparse).backward()
        return w.grad, b.grad

    dw, db = run(False)
    sw, sb = run(True)
    assert sw.is_sparse and sb.is_sparse and not dw.is_sparse
    rows = torch.unique(torch.cat([ids, targets]))
    sw_c, sb_c = sw.coalesce(), sb.coalesce()
    assert torch.equal(sw_c.indices()[0], rows) and torch.equal(sb_c.indices()[0], rows)
    torch.testing.assert_close(sw_c.values(), dw[rows], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sb_c.values(), db[rows], rtol=1e-6, atol=1e-7)
    untouched = torch.ones(200, dtype=torch.bool, device=dev)
    untouched[rows] = False
    assert (dw[untouched] == 0).all() and (db[untouched] == 0).all()


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,P,V", [(13, 20, 300), (16, 16, 32), (1, 7, 77)], ids=["N13-V300", "multiples", "N1-V77"])
def test_full_softmax_triton_matches_cross_entropy(N, P, V, dtype):
    hidden, targets, weight, bias, _, _ = _problem(N, P, V, 1, seed=N + V)
    dev = DEV
    for reduction in ("mean", "none", "sum"):
        def ce(h, w, b):
            return F.cross_entropy(h @ w.t() + b, targets, reduction=reduction)

        def kern(h, w, b):
            return ops.full_softmax_nll(h, targets.to(dev), w, b, reduction, backend="triton")

        l64, g64 = _grads(ce, [hidden, weight, bias], reduction)
        ldt, gdt = _grads(ce, [t.to(dtype) for t in (hidden, weight, bias)], reduction)
        lk, gk = _grads(kern, [t.to(dev, dtype) for t in (hidden, weight, bias)], reduction)
        _close(lk, ldt, l64, dtype, f"nll {reduction}")
        for name, a, b, c in zip(("hidden", "weight", "bias"), gk, gdt, g64):
            _close(a, b, c, dtype, f"d{name} {reduction}")


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("splits", [1, 3, 100])
def test_full_softmax_column_splits(splits):
    from elmo_fast.kernels.softmax import softmax_lse_fwd

    hidden, targets, weight, bias, _, _ = _problem(5, 16, 230, 1, seed=2)
    dev = DEV
    h, w, b = (x.to(dev, torch.float32) for x in (hidden, weight, bias))
    t = targets.to(dev)
    lse, tgt = softmax_lse_fwd(h, w, None, b, t, b[t].contiguous(), mask_hits=False, num_splits=splits)
    logits = hidden @ weight.t() + bias
    torch.testing.assert_close(lse.double().cpu(), torch.logsumexp(logits, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tgt.double().cpu(), logits.gather(1, targets[:, None])[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N, C", [(7680, 8192), (2560, 8192), (2048, 793471), (1280, 793471)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_column_splits_fill_the_waves(N, C, dtype):
    """The GPU forward's default column splits (the report's target, 132 SMs): at least 2 programs an SM, every
    split non-empty, and the last wave of one program an SM nearly full (at the training shape exactly 5 waves)."""
    from elmo_fast.kernels._common import H100
    from elmo_fast.kernels.softmax import lse_fwd_launch

    lc, per_split = lse_fwd_launch(N, C, 512, dtype, H100, gather=C < 10**5, mask_hits=C < 10**5)
    rows, splits, groups = lc.grid
    n = rows * splits
    assert groups == 1
    assert n >= 2 * H100.sms and (splits - 1) * per_split < C <= splits * per_split
    assert n / (-(-n // H100.sms) * H100.sms) >= 0.9
    if (N, C, dtype) == (7680, 8192, torch.bfloat16):
        assert n == 5 * H100.sms
        # the trainer's calls: both directions (2 x 7,680 rows), the original config's towers (6 x 2,560)
        for n_g, g in ((7680, 2), (2560, 6)):
            lc, _ = lse_fwd_launch(n_g, C, 512, dtype, H100, gather=True, mask_hits=True, groups=g)
            assert lc.grid == (n_g // 128, 11, g) and math.prod(lc.grid) == 10 * H100.sms
    assert lse_fwd_launch(0, C, 512, dtype, H100, gather=False, mask_hits=False)[0].grid[0] == 0  # no rows: no error


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty returns NaN-filled tensors: an output element a kernel never writes fails the test."""
    poison_allocations(monkeypatch, ("empty",))


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("chunk", [None, 16, 40])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "full"])
def test_softmax_grad_chunked_dlogit_and_gemms(nan_empty, sampled, chunk):
    """The deterministic backward: per column chunk (all columns, or 16 / 40 at a time: the last chunk partial)
    the dlogit kernel's tile and bias partials, dH accumulated over the chunks, dW per chunk; shapes cross every
    tile (N 37, P 40, C 45/70, accidental hits), fp32 against an fp64 formula, and a second run, with every grid
    run backwards, is bitwise equal."""
    from elmo_fast.kernels.softmax import softmax_grad

    N, P, V, S = 37, 40, 70, 45
    hidden, targets, weight, bias, ids, _ = _problem(N, P, V, S, hits=5 if sampled else 0, seed=3)
    cid = ids if sampled else torch.arange(V)
    off = torch.randn(cid.numel(), dtype=torch.float64) * 0.3
    logits = hidden @ weight[cid].t() + off
    keep = cid[None, :] != targets[:, None] if sampled else torch.ones_like(logits, dtype=torch.bool)
    lse = torch.logsumexp(logits.masked_fill(~keep, -math.inf), 1)
    g = torch.rand(N, dtype=torch.float64)
    d = torch.where(keep, torch.exp(logits - lse[:, None]), 0.0) * g[:, None]
    if not sampled:
        d -= torch.nn.functional.one_hot(targets, V) * g[:, None]
    dev = DEV
    args = tuple(t if t is None else t.to(dev, torch.float32 if t.is_floating_point() else t.dtype)
                 for t in (hidden, weight, ids if sampled else None, off, targets, lse, g))
    out = softmax_grad(*args, mask_hits=sampled, sub_target=not sampled, chunk_cols=chunk)
    with programs_backwards() if dev == "cpu" else contextlib.nullcontext():
        again = softmax_grad(*args, mask_hits=sampled, sub_target=not sampled, chunk_cols=chunk)
    for name, got, want, rep in zip(("dH", "dW", "db"), out, (d @ weight[cid], d.t() @ hidden, d.sum(0)), again):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(got, rep), f"{name} is not deterministic"


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "full"])
def test_softmax_grad_bf16_products_are_fp32(nan_empty, sampled, chunk):
    """bf16 operands: dlogit is rounded to bf16 once (as the kernel stores it: to nearest even on a GPU, truncated
    by the interpreter, which has no bf16 of its own), and the two GEMMs sum its products in fp32 into fp32
    outputs: dH, dW and db match the fp64 products of that rounded dlogit to 1e-5 of their largest entry (on a GPU
    plus what entries within 1e-5 of a rounding midpoint move if they round the other way). A 16-bit GEMM output
    (one more rounding) is off by ~2e-3 and fails."""
    from elmo_fast.kernels.softmax import softmax_grad

    N, P, V, S = 37, 40, 70, 45
    hidden, targets, weight, bias, ids, _ = _problem(N, P, V, S, hits=5 if sampled else 0, seed=3)
    hidden, weight = (t.to(torch.bfloat16).double() for t in (hidden, weight))
    cid = ids if sampled else torch.arange(V)
    off = (torch.randn(cid.numel(), dtype=torch.float64) * 0.3).float().double()
    logits = hidden @ weight[cid].t() + off
    keep = cid[None, :] != targets[:, None] if sampled else torch.ones_like(logits, dtype=torch.bool)
    lse = torch.logsumexp(logits.masked_fill(~keep, -math.inf), 1).float().double()
    g = torch.rand(N, dtype=torch.float64).float().double()
    d = torch.where(keep, torch.exp(logits - lse[:, None]), 0.0) * g[:, None]
    if not sampled:
        d -= torch.nn.functional.one_hot(targets, V) * g[:, None]
    dev = DEV
    low = (d.float().view(torch.int32) & ~0xFFFF).view(torch.float32)  # the bf16 neighbour towards zero
    if dev == "cpu":
        rounded, either = low.double(), torch.zeros_like(d)
    else:  # to nearest; within 1e-5 (relative) of a midpoint the kernel's fp32 dlogit may round the other way
        high = (low.view(torch.int32) + 0x10000).view(torch.float32).double()
        rounded = d.to(torch.bfloat16).double()
        either = torch.where((d - (low.double() + high) / 2).abs() <= 1e-5 * d.abs(), high - low.double(), 0.0)
    args = (hidden.to(dev, torch.bfloat16), weight.to(dev, torch.bfloat16), ids.to(dev) if sampled else None,
            off.to(dev, torch.float32), targets.to(dev), lse.to(dev, torch.float32), g.to(dev, torch.float32))
    out = softmax_grad(*args, mask_hits=sampled, sub_target=not sampled, chunk_cols=chunk)
    flips = (either.abs() @ weight[cid].abs(), either.abs().t() @ hidden.abs(), torch.zeros(cid.numel()))
    for name, got, want, slack in zip(("dH", "dW", "db"), out, (rounded @ weight[cid], rounded.t() @ hidden,
                                                                   d.sum(0)), flips):
        assert got.dtype == torch.float32, name
        err = (got.double().cpu() - want).abs() - slack  # what a rounding the other way could move
        assert err.max().item() <= 1e-5 * want.abs().max().item(), (name, err.max().item())


@pytest.mark.triton
@requires_triton
def test_softmax_grad_empty_shapes_and_bad_chunks():
    """No rows or no columns: zero gradients of the right shapes, no launch; a forward over no columns gives a
    log-sum-exp of -inf; a chunk width that is not a positive number of columns is refused by name."""
    from elmo_fast.kernels.softmax import softmax_grad

    dev = DEV
    f32 = dict(dtype=torch.float32, device=dev)
    w, off = torch.randn(6, 8, **f32), torch.zeros(6, **f32)
    for N, C in ((0, 6), (3, 0)):
        h, t = torch.randn(N, 8, **f32), torch.zeros(N, dtype=torch.long, device=dev)
        dh, dw, db = softmax_grad(h, w[:C], None, off[:C], t, torch.zeros(N, **f32), torch.ones(N, **f32),
                                  mask_hits=False, sub_target=True)
        assert dh.shape == (N, 8) and dw.shape == (C, 8) and db.shape == (C,)
        assert not (dh.any() or dw.any() or db.any())
    h, t = torch.randn(3, 8, **f32), torch.zeros(3, dtype=torch.long, device=dev)
    from elmo_fast.kernels.softmax import softmax_lse_fwd

    lse, tgt = softmax_lse_fwd(h, w, None, off[:0], t, off[t].contiguous(), mask_hits=False)  # no columns
    assert torch.equal(lse.cpu(), torch.full((3,), -math.inf)) and torch.allclose(tgt, h @ w[0])
    for bad in (0, -4, 2.5):
        with pytest.raises(ValueError, match="chunk_cols"):
            softmax_grad(h, w, None, off, t, torch.zeros(3, **f32), torch.ones(3, **f32), mask_hits=False,
                         sub_target=True, chunk_cols=bad)


def test_ops_validate_inputs():
    hidden, targets, weight, bias, ids, tries = _problem(4, 8, 30, 5)
    with pytest.raises(ValueError, match="hidden"):
        ops.sampled_softmax_loss(hidden[0], targets, weight, bias, ids, tries)
    with pytest.raises(ValueError, match="weight"):
        ops.sampled_softmax_loss(hidden, targets, weight[:, :3], bias, ids, tries)
    with pytest.raises(ValueError, match="bias"):
        ops.full_softmax_nll(hidden, targets, weight, bias[:3])
    with pytest.raises(ValueError, match="num_tries"):
        ops.sampled_softmax_loss(hidden, targets, weight, bias, ids, ids.numel() - 1)
    with pytest.raises(ValueError, match="reduction"):
        ops.full_softmax_nll(hidden, targets, weight, bias, "max")
    with pytest.raises(TypeError):
        ops.full_softmax_nll(hidden, targets.float(), weight, bias)


@pytest.mark.triton
@requires_triton
def test_triton_rejects_fp64_with_hint():
    *tensors, tries = _problem(4, 8, 30, 5)
    hidden, targets, weight, bias, ids = (t.to(DEV) for t in tensors)
    with pytest.raises(TypeError, match="reference"):
        ops.sampled_softmax_loss(hidden, targets, weight, bias, ids, tries, backend="triton")


# ------------------------------------------------------------------------------------------------- module

@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=[pytest.mark.triton,
                                                                               requires_triton])])
def test_module_train_and_eval(backend):
    V, P, S, N = 120, 16, 20, 10
    dev = DEV if backend == "triton" else "cpu"
    m = SampledSoftmaxLoss(V, P, S, seed=123, backend=backend).to(dev)
    assert m.softmax_W.shape == (V, P) and m.softmax_b.shape == (V,)
    assert (m.softmax_b == 0).all()
    assert abs(m.softmax_W.std().item() - 1 / math.sqrt(P)) < 0.03
    hidden = torch.randn(N, P)
    targets = torch.randint(0, V, (N,))
    h, y = hidden.to(dev), targets.to(dev)
    W, b = m.softmax_W.detach().cpu(), m.softmax_b.detach().cpu()  # the oracles' copies, on the CPU

    m.train()
    loss1 = m(h, y)
    ids1, tries1 = m.last_samples
    assert ids1.numel() == S and loss1.dim() == 0
    expected = ops.sampled_softmax_loss(hidden, targets, W, b, ids1.cpu(), tries1, backend="reference")
    torch.testing.assert_close(loss1.detach().cpu(), expected, rtol=1e-5, atol=1e-6)
    loss1.backward()
    assert m.softmax_W.grad is not None and m.softmax_b.grad is not None
    m(h, y)
    assert not torch.equal(m.last_samples[0], ids1), "each training call draws a fresh sample set"

    m.eval()
    with torch.no_grad():
        full = m(h, y)
    torch.testing.assert_close(full.cpu(), F.cross_entropy(hidden @ W.t() + b, targets), rtol=1e-5, atol=1e-6)
    # allennlp's check: the sampled loss is below the full one (the sample row is a subset, with −log Q ≥ 0 here)
    assert loss1.item() < full.item()


def test_module_state_dict_resumes_sampler():
    a = SampledSoftmaxLoss(300, 8, 40, seed=5)
    h, y = torch.randn(4, 8), torch.randint(0, 300, (4,))
    a(h, y)
    a(h, y)
    state = a.state_dict()
    assert "_extra_state" in state
    b = SampledSoftmaxLoss(300, 8, 40, seed=999)
    b.load_state_dict(state)
    assert torch.equal(b.last_samples[0], a.last_samples[0]) and b.last_samples[1] == a.last_samples[1]
    for _ in range(3):
        a(h, y)
        b(h, y)
        assert torch.equal(a.last_samples[0], b.last_samples[0])
    # a fresh module with the same seed draws the same first set
    c, d = SampledSoftmaxLoss(300, 8, 40, seed=42), SampledSoftmaxLoss(300, 8, 40, seed=42)
    assert torch.equal(c.sample()[0], d.sample()[0])


def test_module_shared_embedding_and_sparse():
    emb = torch.nn.Embedding(50, 8)
    m = SampledSoftmaxLoss(50, 8, 10, seed=0, share_embedding=emb, sparse=True)
    assert m.softmax_W is emb.weight and m.tied
    w_before = emb.weight.detach().clone()
    m.reset_parameters()
    assert torch.equal(emb.weight, w_before), "reset must not re-initialise a tied embedding"
    ids = torch.randint(0, 50, (6,))
    loss = m(emb(ids), torch.randint(0, 50, (6,)))
    loss.backward()
    assert emb.weight.grad is not None  # dense (from the embedding) + sparse (softmax) accumulate
    assert m.softmax_b.grad.is_sparse
    with pytest.raises(ValueError):
        SampledSoftmaxLoss(50, 9, 10, share_embedding=emb)
    opt = torch.optim.Adagrad([m.softmax_b], lr=0.2, initial_accumulator_value=1.0)
    before = m.softmax_b.detach().clone()
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        opt.step()  # a sparse-aware optimizer takes the sparse bias gradient
    touched = m.softmax_b.grad.coalesce().indices()[0]
    changed = (m.softmax_b.detach() != before).nonzero().squeeze(1)
    assert set(changed.tolist()) <= set(touched.tolist())


def test_module_casts_hidden_to_parameter_dtype():
    m = SampledSoftmaxLoss(60, 8, 10, seed=1)
    loss = m(torch.randn(5, 8, dtype=torch.float64), torch.randint(0, 60, (5,)))
    assert loss.dtype == torch.float32
    loss.backward()
    assert m.softmax_W.grad.dtype == torch.float32


def test_module_explicit_samples_and_reduction():
    m = SampledSoftmaxLoss(60, 8, 10, seed=1, reduction="none")
    h, y = torch.randn(5, 8), torch.randint(0, 60, (5,))
    ids, tries = ops.log_uniform_sample(10, 60, generator=torch.Generator().manual_seed(0))
    out = m(h, y, samples=(ids, tries))
    assert out.shape == (5,)
    assert m.last_samples[0] is ids


# ---------------------------------------------------------------------------------------------- real sizes

@pytest.mark.gpu
@pytest.mark.slow
def test_sampled_softmax_gpu_real_size():
    dev, V, P, S, N = "cuda", 793_471, 512, 8192, 1024
    g = torch.Generator(device=dev).manual_seed(0)
    ids, tries = ops.log_uniform_sample(S, V, generator=g, device=dev)
    assert ids.unique().numel() == S
    h = torch.randn(N, P, device=dev)
    w = torch.randn(V, P, device=dev) / math.sqrt(P)
    b = torch.zeros(V, device=dev)
    y = torch.randint(0, V, (N,), device=dev)
    y[:64] = ids[:64]
    for dt in (torch.float32, torch.bfloat16):
        def run(backend, d):
            args = [t.to(d).requires_grad_() for t in (h, w, b)]
            loss = ops.sampled_softmax_loss(args[0], y, args[1], args[2], ids, tries, backend=backend)
            return (loss.detach(), *torch.autograd.grad(loss, args))
        r64 = run("reference", torch.float64)
        rdt = run("reference", dt)
        k = run("triton", dt)
        for name, a, bb, c in zip(("loss", "dh", "dW", "db"), k, rdt, r64):
            _close(a, bb, c, dt, name)


@pytest.mark.gpu
@pytest.mark.slow
def test_full_softmax_gpu_real_size():
    dev, V, P, N = "cuda", 793_471, 512, 256
    h = torch.randn(N, P, device=dev)
    w = torch.randn(V, P, device=dev) / math.sqrt(P)
    b = torch.randn(V, device=dev) * 0.1
    y = torch.randint(0, V, (N,), device=dev)
    for dt in (torch.float32, torch.bfloat16):
        ref64 = full_softmax_nll_reference(h.double(), y, w.double(), b.double())
        refdt = full_softmax_nll_reference(h.to(dt), y, w.to(dt), b.to(dt))
        k = ops.full_softmax_nll(h.to(dt), y, w.to(dt), b.to(dt), backend="triton")
        _close(k, refdt, ref64, dt, "full nll")


@pytest.mark.parametrize("grouped", [False, True], ids=["forward", "forward_groups"])
def test_module_under_autocast_hands_16_bit_rows_over_uncast(monkeypatch, grouped):
    """Under autocast the op casts the rows and the table to the autocast dtype itself: the module passes bf16 top
    layers as they are (no fp32 copy and back), with the losses and gradients of the cast path."""
    import elmo_fast.modules.sampled_softmax as mod

    m = SampledSoftmaxLoss(60, 8, 10, seed=1).train()
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 5, 8, generator=g).to(torch.bfloat16)
    y = torch.randint(0, 60, (2, 5), generator=g)
    samples = m.sample()
    seen = []
    real = mod.ops.sampled_softmax_loss_groups if grouped else mod.ops.sampled_softmax_loss

    def spy(*args, **kwargs):
        seen.append((args[0][0][0] if grouped else args[0]).dtype)
        return real(*args, **kwargs)

    def run(autocast):
        x = h.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if grouped:
                loss = sum(m.forward_groups([(x, y, samples), (x * 2, y, samples)]))
            else:
                loss = m(x, y, samples=samples)
        loss.float().backward()
        return loss.detach().float(), x.grad

    with monkeypatch.context() as mp:
        mp.setattr(mod.ops, "sampled_softmax_loss_groups" if grouped else "sampled_softmax_loss", spy)
        got = run(True)
    assert seen == [torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the cast path the module took before, by hand
        want_h = h.clone().requires_grad_()
        up = want_h.float()
        if grouped:
            want = sum(mod.ops.sampled_softmax_loss_groups(
                [(up.reshape(-1, 8), y.reshape(-1), *samples), ((up * 2).reshape(-1, 8), y.reshape(-1), *samples)],
                m.softmax_W, m.softmax_b))
        else:
            want = mod.ops.sampled_softmax_loss(up.reshape(-1, 8), y.reshape(-1), m.softmax_W, m.softmax_b, *samples)
    want.float().backward()
    torch.testing.assert_close(got[0], want.detach().float())
    assert got[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[1], want_h.grad)
