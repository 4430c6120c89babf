"""The ``cpu`` backend against the plain reference: fresh random inputs, fp64 and fp32, forward and every gradient,
NaN-poisoned work buffers (LSTMP chain, char CNN, sampled softmax); opt-in bf16 within its budget; backend
selection; the packed-weight cache (updates, pickling, spawned workers)."""
import copy
import io
import math
import multiprocessing
import pickle

import pytest
import torch
from conftest import isa_chosen, poison_allocations

import elmo_fast
from elmo_fast._backend import BackendUnavailableError, select_backend
from elmo_fast.cpu import char_cnn as char_cnn_module
from elmo_fast.cpu import char_cnn_cpu, lstmp_cpu, packed, sampled_softmax_loss_cpu
from elmo_fast.cpu.ext import cpu_ext
from elmo_fast.cpu.packed import PackedWeightCache
from elmo_fast.reference import char_cnn_reference, lstmp_reference
from elmo_fast.testing import write_random_model

SENTS = [["The", "cat", "sat", "on", "the", "mat", "."], ["A", "dog", "."], ["the", "the", "the"]]


@pytest.fixture
def nan_poison(monkeypatch):
    """Uninitialised allocations come back NaN-filled, so an element a backend forgets to write shows up."""
    poison_allocations(monkeypatch, ("empty_like", "new_empty"))


SLACK = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(params=["onednn", "torch.mm"])
def gemm_path(request, monkeypatch):
    """Both product paths of the cpu backend at test sizes: oneDNN (packed weights, normally only for weights of
    1 MiB and more, and in training's forward only where ``pack_pays``; the plain GEMMs through oneDNN's matmul,
    normally only where ``gemm.uses_onednn`` measured it faster) and plain torch.mm (MKL)."""
    if request.param == "onednn":
        monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
        monkeypatch.setenv("ELMO_FAST_CPU_TRAIN_PACK", "1")  # training's forward packs too (else measured)
        monkeypatch.setenv("ELMO_FAST_CPU_GEMM", "onednn")
    else:
        monkeypatch.setattr(packed, "_ONEDNN_OK", False)
    return request.param


@pytest.fixture(params=["avx512", "avx2", "scalar", "torch-ops"])
def gate_path(request, monkeypatch):
    """Every gate-math path: the compiled kernels (elmo_fast._cpu, when built) in each instruction set this CPU
    has, and torch ops."""
    if request.param == "torch-ops":
        monkeypatch.setenv("ELMO_FAST_CPU_EXT", "0")
        yield request.param
        return
    ext = cpu_ext()
    if ext is None:
        pytest.skip("elmo_fast._cpu is not built (no C++ compiler at install, or ELMO_FAST_CPU_EXT=0)")
    with isa_chosen(ext, request.param):
        yield request.param


@pytest.mark.parametrize("which", ["_cpu", "_C"])
def test_an_extension_built_for_another_torch_is_refused_with_the_fix(monkeypatch, which):
    """A compiled module built against another torch imports, then segfaults in its first call (elmo_fast._cpu built
    for torch 2.11 under 2.13, 2026-11-26): both loaders refuse a build that recorded another torch, or none, and
    say so with the fix (the cpu backend warns and runs torch ops; backend 'cuda' raises); the build made here
    recorded this torch."""
    import importlib
    import types

    from elmo_fast import _backend
    from elmo_fast.cpu import ext as ext_module

    real_import = importlib.import_module
    for built, accepted in (("1.0.0+elsewhere", False), (None, False), (torch.__version__, True)):
        fake = types.SimpleNamespace(__name__=f"elmo_fast.{which}", __file__=f"/x/{which}.so",
                                     **({"torch_version": built} if built else {}))
        monkeypatch.setattr(importlib, "import_module",
                            lambda name, fake=fake: fake if name == f"elmo_fast.{which}" else real_import(name))
        if which == "_cpu":
            ext_module._load.cache_clear()
            if accepted:
                assert ext_module.cpu_ext() is fake
            else:
                with pytest.warns(RuntimeWarning, match=r"built against torch .*this process runs torch .*Rebuild"):
                    assert ext_module.cpu_ext() is None
        else:
            _backend.cuda_ext_import_error.cache_clear()
            if accepted:
                assert _backend.cuda_ext() is fake
            else:
                with pytest.raises(BackendUnavailableError, match=r"built against torch .*ELMO_FAST_BUILD_CUDA=1"):
                    _backend.cuda_ext()
    monkeypatch.undo()
    ext_module._load.cache_clear()
    _backend.cuda_ext_import_error.cache_clear()
    real = cpu_ext()
    if which == "_cpu" and real is not None:
        assert real.torch_version == torch.__version__


def assert_close_to_oracle(got, ref64, ref_low, what):
    """|got - ref64| <= 2 |ref_low - ref64| + slack·(1 + |ref64|) elementwise: the reference run in got's dtype
    sets the bar, plus a per-dtype slack for a different (equally valid) summation order."""
    slack = SLACK[got.dtype]
    got, ref64, ref_low = got.detach().double(), ref64.detach(), ref_low.detach().double()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err, bar = (got - ref64).abs(), 2 * (ref_low - ref64).abs() + slack * (1 + ref64.abs())
    bad = err > bar
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {float((err - bar).max()):.3g} over the bar"


def _chain(B, T, D, H, P, proj, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * s).to(dtype).requires_grad_()

    return [rnd(B, T, D), rnd(D, 4 * H, s=D ** -0.5), rnd(P, 4 * H, s=P ** -0.5), rnd(4 * H, s=0.5),
            rnd(H, P, s=H ** -0.5 * 3) if proj else None, rnd(B, P), rnd(B, H, s=2.0)]


LSTMP_CASES = [
    # B, T, D, H, P, lengths, reverse, residual, proj, cell_clip, proj_clip
    pytest.param(5, 7, 6, 8, 6, [3, 7, 0, 5, 7], False, True, True, 0.8, 0.5, id="ragged-fwd-residual"),
    pytest.param(5, 7, 6, 8, 6, [3, 7, 0, 5, 7], True, True, True, 0.8, 0.5, id="ragged-rev-residual"),
    pytest.param(4, 6, 5, 7, 3, [6, 6, 6, 6], False, False, True, 1.5, 0.4, id="full-fwd"),
    pytest.param(4, 6, 5, 7, 3, [6, 2, 6, 1], True, False, True, None, None, id="rev-no-clips"),
    pytest.param(3, 5, 4, 6, 6, [5, 0, 3], False, False, False, 0.7, None, id="no-projection"),
    pytest.param(3, 5, 4, 6, 6, [2, 5, 4], True, False, False, None, None, id="no-projection-rev"),
    pytest.param(1, 1, 3, 5, 2, [1], False, False, True, 0.5, 0.5, id="one-step"),
    pytest.param(3, 4, 3, 5, 2, [0, 0, 0], True, False, True, 0.5, 0.5, id="all-empty"),
    pytest.param(3, 5, 4, 37, 5, [5, 2, 4], True, True, True, 0.9, 0.3, id="H37-vector-and-tail"),
]


def _run_lstmp(fn, args, lengths, up, **kw):
    outs = fn(*args, torch.tensor(lengths), **kw)
    ins = [a for a in args if a is not None]
    return outs, torch.autograd.grad(outs, ins, up, allow_unused=True)


@pytest.mark.parametrize("B, T, D, H, P, lengths, reverse, residual, proj, cell_clip, proj_clip", LSTMP_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lstmp_cpu_matches_reference(nan_poison, gemm_path, gate_path, dtype, B, T, D, H, P, lengths, reverse,
                                     residual, proj, cell_clip, proj_clip):
    if residual:
        D = P
    kw = dict(cell_clip=cell_clip, proj_clip=proj_clip, reverse=reverse, residual=residual, forget_bias=1.0)
    args = _chain(B, T, D, H, P, proj, dtype, seed=B * 100 + T)
    args64 = [a.detach().double().requires_grad_() if a is not None else None for a in args]
    up = [torch.randn(B, T, P, dtype=dtype), torch.randn(B, P, dtype=dtype), torch.randn(B, H, dtype=dtype)]
    ref64, gref64 = _run_lstmp(lstmp_reference, args64, lengths, [u.double() for u in up], **kw)
    ref, gref = _run_lstmp(lstmp_reference, args, lengths, up, **kw)
    got, ggot = _run_lstmp(lstmp_cpu, args, lengths, up, **kw)
    names = ["x", "w_in", "w_rec", "bias", "w_proj", "h0", "c0"]
    names = [n for n, a in zip(names, args) if a is not None]
    for what, g, r64, r in zip(["y", "h_n", "c_n"], got, ref64, ref):
        assert_close_to_oracle(g, r64, r, what)
    for what, g, r64, r in zip(names, ggot, gref64, gref):
        r64 = r64 if r64 is not None else torch.zeros(())
        r = r if r is not None else torch.zeros(())
        g = g if g is not None else torch.zeros(())
        assert_close_to_oracle(g, r64, r, "d" + what)
    with torch.no_grad():  # the inference path (no buffers saved, deduplicated rows) computes the same
        inf = lstmp_cpu(*args, torch.tensor(lengths), **kw)
    for what, g, r64, r in zip(["y", "h_n", "c_n"], inf, ref64, ref):
        assert_close_to_oracle(g, r64, r, "inference " + what)


@pytest.mark.parametrize("lengths, padded", [([6, 6, 6], False), ([6, 2, 0], True)], ids=["full", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lstmp_cpu_zero_fills_only_where_positions_are_padded(nan_poison, dtype, lengths, padded):
    """y and dx are scattered from the packed rows: zero-filled first only where padded positions exist (the
    NaN-poisoned empty tensors show any position left unwritten); without dy the packed dy is built as zeros
    directly (no (B, T, P) zeros gathered). Every output and gradient against the reference."""
    from torch.profiler import profile

    B, T, D, H, P = 3, 6, 4, 5, 3
    kw = dict(cell_clip=1.0, proj_clip=0.5, reverse=True, residual=False)
    args = _chain(B, T, D, H, P, True, dtype, seed=9)
    args64 = [a.detach().double().requires_grad_() for a in args]
    up = [torch.randn(B, T, P, dtype=dtype), torch.randn(B, P, dtype=dtype), torch.randn(B, H, dtype=dtype)]
    ref64, gref64 = _run_lstmp(lstmp_reference, args64, lengths, [u.double() for u in up], **kw)
    ref, gref = _run_lstmp(lstmp_reference, args, lengths, up, **kw)
    with profile() as prof:
        got, ggot = _run_lstmp(lstmp_cpu, args, lengths, up, **kw)
    assert ("aten::new_zeros" in {e.key for e in prof.key_averages()}) == padded
    for what, g, r64, r in zip(["y", "h_n", "c_n", "dx", "dw_in", "dw_rec", "db", "dw_proj", "dh0", "dc0"],
                               [*got, *ggot], [*ref64, *gref64], [*ref, *gref]):
        assert_close_to_oracle(g, r64, r, what)
    outs = lstmp_cpu(*args, torch.tensor(lengths), **kw)  # only h_n gets a gradient: dy is zeros
    g_h = torch.autograd.grad(outs[1], args, up[1], allow_unused=True)
    r_h = torch.autograd.grad(lstmp_reference(*args64, torch.tensor(lengths), **kw)[1], args64, up[1].double(),
                              allow_unused=True)
    for g, r in zip(g_h, r_h):
        torch.testing.assert_close(g, r.to(dtype), atol=1e-5, rtol=1e-5)


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of the fp32 spacing at |exact| (the smallest normal's below it)."""
    e = exact.abs().float().clamp(min=torch.finfo(torch.float32).tiny)
    return (got.double() - exact).abs() / (torch.nextafter(e, torch.tensor(math.inf)) - e).double()


def test_gate_nonlinearities_are_accurate_to_a_few_ulp(gate_path):
    """σ and tanh of the fused gate math against fp64, in ulp of the result, over tiny to saturating arguments of
    both signs: tanh as 1 - 2/(exp(2x) + 1) was right only to ~1e-7 absolute (tanh(1e-6) 5% off)."""
    from elmo_fast.cpu.lstmp import _cell_forward

    mag = torch.logspace(-30, 1.3, 20000, dtype=torch.float64)
    x = torch.cat([mag, -mag, torch.linspace(-10, 10, 20001, dtype=torch.float64)]).float()
    n, H = 64, 1024
    x = torch.cat([x, x.new_zeros(n * H - x.numel())]).view(n, H)
    z = torch.cat([x, x, x, x.flip(0)], 1)  # i | j | f | o
    g = torch.full((n, 4 * H), math.nan)
    _cell_forward(z, torch.zeros(n, H), None, g, *(torch.empty(n, H) for _ in range(3)))
    x64 = x.double()
    for what, got, exact in (("sigmoid", g[:, :H], torch.sigmoid(x64)), ("tanh", g[:, H : 2 * H], torch.tanh(x64)),
                             ("sigmoid (o)", g[:, 3 * H :], torch.sigmoid(x64.flip(0)))):
        worst = _ulps(got, exact).max().item()
        assert worst <= 3.0, f"{what}: {worst:.2f} ulp"
    z = torch.zeros(1, 4 * H)
    z[0, H] = -0.0
    _cell_forward(z, torch.zeros(1, H), None, g[:1], *(torch.empty(1, H) for _ in range(3)))
    assert torch.signbit(g[0, H]), "tanh(-0.0) must be -0.0"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lstmp_cpu_stacked_weight_gets_one_gradient(gemm_path, gate_path, dtype):
    """w_in, w_rec as the row blocks of one W_0 (as the model passes them): W_0's gradient comes from the chain
    directly (no slice gradients), and equals the reference's, as does every other gradient."""
    B, T, D, H, P = 3, 5, 4, 17, 4
    x, _, _, bias, w_proj, h0, c0 = _chain(B, T, D, H, P, True, dtype, seed=11)
    w0 = (torch.randn(D + P, 4 * H, dtype=torch.float64) * 0.4).to(dtype).requires_grad_()
    lengths = torch.tensor([5, 3, 4])
    kw = dict(cell_clip=1.0, proj_clip=0.6, residual=True, reverse=False)
    ups = [torch.randn(B, T, P, dtype=dtype), torch.randn(B, P, dtype=dtype), torch.randn(B, H, dtype=dtype)]
    got = lstmp_cpu(x, w0[:D], w0[D:], bias, w_proj, h0, c0, lengths, **kw)
    assert any(type(f).__name__ == "AccumulateGrad" and f.variable is w0 for f, _ in got[0].grad_fn.next_functions)
    wrt = (w0, x, bias, w_proj, h0, c0)
    g_got = torch.autograd.grad(got, wrt, ups)
    w64 = w0.detach().double().requires_grad_()
    args64 = [t.detach().double().requires_grad_() for t in (x, bias, w_proj, h0, c0)]
    ref64 = lstmp_reference(args64[0], w64[:D], w64[D:], *args64[1:], lengths, **kw)
    g64 = torch.autograd.grad(ref64, (w64, *args64), [u.double() for u in ups])
    g_ref = torch.autograd.grad(lstmp_reference(x, w0[:D], w0[D:], bias, w_proj, h0, c0, lengths, **kw), wrt, ups)
    for name, a, b, c in zip(("dW_0", "dx", "dbias", "dw_proj", "dh0", "dc0"), g_got, g64, g_ref):
        assert_close_to_oracle(a, b, c, name)


def test_lstmp_cpu_gradcheck_fp64():
    args = _chain(3, 4, 3, 4, 2, True, torch.float64, seed=7)
    lengths = torch.tensor([4, 1, 3])
    for reverse in (False, True):
        assert torch.autograd.gradcheck(
            lambda *a: lstmp_cpu(*a, lengths, cell_clip=5.0, proj_clip=5.0, reverse=reverse), args)


def test_lstmp_cpu_inference_with_repeated_rows_and_cache(gemm_path, gate_path):
    """Repeated input rows take the deduplicated projection; the cached packed weights follow in-place updates."""
    B, T, D, H, P = 4, 9, 8, 16, 8
    args = [a.detach() for a in _chain(B, T, D, H, P, True, torch.float32, seed=3)]
    args[0][:, 3:] = args[0][:, :1]  # most rows repeat one input vector
    lengths = torch.tensor([9, 4, 7, 9])
    kw = dict(cell_clip=3.0, proj_clip=3.0, residual=True, reverse=True)
    cache = PackedWeightCache()
    for _ in range(2):
        got = lstmp_cpu(*args, lengths, weight_cache=cache, **kw)
        for g, r in zip(got, lstmp_reference(*args, lengths, **kw)):
            torch.testing.assert_close(g, r, atol=2e-6, rtol=1e-5)
        args[2].mul_(0.5)  # an optimizer-like in-place update: the next call must see it
    assert len(cache) == 2  # one entry per weight role, replaced when the weight changes


def test_inference_dedups_only_where_rows_may_repeat(monkeypatch):
    """The dedup's row sort (torch.unique over rows) runs only where a cheap hash says a quarter of the rows may
    repeat: a first layer's repeated tokens, never the LSTM outputs of a second layer."""
    from elmo_fast.cpu import lstmp as cpu_lstmp

    sorts = []
    real_unique = torch.unique

    def unique(*a, **k):
        sorts.append(k.get("dim"))
        return real_unique(*a, **k)

    monkeypatch.setattr(torch, "unique", unique)
    B, T, D, H, P = 4, 9, 8, 16, 8
    args = [a.detach() for a in _chain(B, T, D, H, P, True, torch.float32, seed=4)]
    lengths = torch.tensor([9, 4, 7, 9])
    with torch.no_grad():
        lstmp_cpu(*args, lengths, cell_clip=3.0, proj_clip=3.0)
        assert 0 not in sorts  # distinct rows: hashed, not sorted
        args[0][:, 3:] = args[0][:, :1]
        lstmp_cpu(*args, lengths, cell_clip=3.0, proj_clip=3.0)
        assert 0 in sorts
    x = torch.randn(40, 8)
    assert not cpu_lstmp._may_repeat(x) and not cpu_lstmp._may_repeat(torch.cat([x[:31], x[:9]]))  # 9 of 40 repeat
    assert cpu_lstmp._may_repeat(torch.cat([x[:30], x[:10]]))  # 10 of 40: a quarter


def test_weight_stamps_sample_runs_over_the_whole_storage():
    """elmo_fast._stamp: a write that bypasses the version counter (as torch's fused optimizers do) is caught by the
    value sample, for a weight far larger than the sample, in either storage order; an untouched weight matches."""
    from elmo_fast._stamp import RUN, SAMPLE_RUNS, stamp, unchanged

    for w in (torch.randn(700, 90), torch.randn(90, 700).t()):
        st = stamp(w)
        assert st[3].numel() == SAMPLE_RUNS * RUN < w.numel() and unchanged(st, w)
        in_storage_order = w if w.is_contiguous() else w.t()
        in_storage_order.data[:5].mul_(0.5)  # the first run sees the head ...
        assert not unchanged(st, w)
        st = stamp(w)
        in_storage_order.data[-5:].mul_(0.5)  # ... and the last run the tail
        assert not unchanged(st, w)
        st = stamp(w)
        w.data.add_(1.0)
        assert not unchanged(st, w)
    small = torch.randn(30, 40)
    st = stamp(small)
    small.data[17, 3] += 1  # a weight within the sample's size is compared whole
    assert not unchanged(st, small)


needs_bf16 = pytest.mark.skipif(not packed.bf16_supported(), reason="this CPU has neither AVX512-BF16 nor AMX")


@needs_bf16
@pytest.mark.parametrize("reverse", [False, True])
def test_lstmp_cpu_bf16_inference_within_budget(monkeypatch, reverse):
    """Opt-in bf16 products (fp32 gates and cell state): the error against fp64 is at most twice the error of
    the reference run entirely in bf16, plus a slack (performance.md's accuracy budget)."""
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)  # pack the test-sized weights too
    B, T, D, H, P = 6, 12, 32, 48, 32
    args = [a.detach() for a in _chain(B, T, D, H, P, True, torch.float64, seed=5)]
    lengths = torch.tensor([12, 7, 12, 3, 0, 9])
    kw = dict(cell_clip=3.0, proj_clip=3.0, reverse=reverse, residual=True)
    ref64 = lstmp_reference(*args, lengths, **kw)
    ref16 = lstmp_reference(*[a.bfloat16() for a in args], lengths, **kw)
    with torch.no_grad():
        got = lstmp_cpu(*[a.float() for a in args], lengths, bf16=True, **kw)
    for what, g, r64, r16 in zip(["y", "h_n", "c_n"], got, ref64, ref16):
        assert g.dtype == torch.float32
        err, bar = (g.double() - r64).abs().max(), 2 * (r16.double() - r64).abs().max() + 1e-3
        assert err <= bar, f"{what}: bf16 error {err:.3g} over the budget {bar:.3g}"
    with pytest.raises(ValueError, match="inference only"):
        lstmp_cpu(*[a.float().requires_grad_() for a in args], lengths, bf16=True, **kw)
    monkeypatch.setattr("elmo_fast.cpu.lstmp.bf16_supported", lambda: False)
    with pytest.raises(BackendUnavailableError, match="AVX512-BF16 or AMX"):
        lstmp_cpu(*[a.float() for a in args], lengths, bf16=True, **kw)


@needs_bf16
def test_bf16_opt_in_from_the_environment(tmp_path, monkeypatch):
    """ELMO_FAST_CPU_BF16=1 switches a new model's LSTMs to bf16 products; the default stays fp32."""
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)  # the tiny model's weights are packed too
    o, w = write_random_model(tmp_path)
    ids = elmo_fast.batch_to_ids(SENTS)
    fp32 = elmo_fast.ElmoBiLM(o, w, stateful=False)
    assert not fp32._bilm.forward_lstm.cpu_bf16
    monkeypatch.setenv("ELMO_FAST_CPU_BF16", "1")
    bf16 = elmo_fast.ElmoBiLM(o, w, stateful=False)
    assert bf16._bilm.forward_lstm.cpu_bf16 and bf16._bilm.backward_lstm.cpu_bf16
    calls = []
    real = packed.PackedLinear.__init__

    def spy(self, w_, rows, dtype=None):
        calls.append(dtype)
        real(self, w_, rows, dtype)

    monkeypatch.setattr(packed.PackedLinear, "__init__", spy)
    with torch.no_grad():
        a, b = fp32(ids)["activations"][2], bf16(ids)["activations"][2]
    assert torch.bfloat16 in calls
    assert 0 < float((a - b).abs().max()) < 0.1


def test_backend_selection():
    assert select_backend("auto", torch.device("cpu"), "lstmp") == "cpu"
    assert select_backend("cpu", torch.device("cpu"), "lstmp") == "cpu"
    msg = r"backend 'cpu' for lstmp needs CPU tensors, got cuda.*\.cpu\(\)"
    with pytest.raises(BackendUnavailableError, match=msg):
        select_backend("cpu", torch.device("cuda"), "lstmp")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("act", ["relu", "tanh"])
@pytest.mark.parametrize("bucket", [512, 3])
def test_char_cnn_cpu_matches_reference(monkeypatch, dtype, act, bucket):
    """Buckets of 3 tokens put short words together, so their all-padding windows take the shortcut."""
    monkeypatch.setattr(char_cnn_module, "_BUCKET", bucket)
    g = torch.Generator().manual_seed(0)
    d, filters = 4, [(1, 3), (2, 4), (3, 5), (7, 6)]

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    emb = rnd(262, d)
    emb.detach()[0] = 0.0  # row 0 is the "no token" row (the model prepends it to the file's table)
    ws = [rnd(w, d, n) for w, n in filters]
    bs = [rnd(n) for _, n in filters]
    words = ["a", "to", "The", "internationalization", "x" * 60, "<S>", "</S>", "é", "bb", "c"]
    ids = torch.tensor([elmo_fast.word_to_char_ids(w) for w in words] + [[0] * 50])
    params = [emb, *ws, *bs]
    up = torch.randn(len(ids), sum(n for _, n in filters), dtype=dtype)

    def run(fn, ps):
        out = fn(ids, ps[0], list(ps[1:5]), list(ps[5:]), act)
        return out, torch.autograd.grad(out, ps, up)

    p64 = [p.detach().double().requires_grad_() for p in params]
    ref64, gref64 = run(char_cnn_reference, p64)
    ref, gref = run(char_cnn_reference, params)
    got, ggot = run(char_cnn_cpu, params)
    assert_close_to_oracle(got, ref64, ref, "char_cnn")
    # row 0 is a constant in the model (prepended zeros): the cpu path never reads it, so it gets no gradient
    ggot, gref64, gref = ([g[0][1:], *g[1:]] for g in (ggot, gref64, gref))
    for k, (a, b, c) in enumerate(zip(ggot, gref64, gref)):
        assert_close_to_oracle(a, b, c, f"grad {k}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_char_cnn_dense_path_shares_a_tie_with_the_padding_windows_evenly(monkeypatch, dtype):
    """The dense path (fp64, or fp32 without the extension's sparse backward): a real window that ties with the
    all-padding windows shares the gradient evenly among all of them, as the reference (amax over every window)
    and TF's reduce_max do. "a" in a bucket with a longer word: its one real window of the width-1 filter ties with
    its 47 all-padding windows (the padding character's row equals that of "a"), of which 45 take the shortcut."""
    monkeypatch.setattr(char_cnn_module, "_sparse_backward", lambda *a: False)
    emb = torch.zeros(262, 2, dtype=dtype)
    emb[ord("a") + 1] = emb[char_cnn_module.PAD_CHAR_ID] = torch.tensor([1.0, 2.0], dtype=dtype)
    emb[ord("b") + 1] = torch.tensor([-1.0, 0.5], dtype=dtype)
    emb[259 + 1] = emb[258 + 1] = torch.tensor([-5.0, -5.0], dtype=dtype)  # begin/end of word lose the max
    emb.requires_grad_()
    w = torch.tensor([[[1.0], [1.0]]], dtype=dtype, requires_grad=True)  # (1, 2, 1)
    b = torch.zeros(1, dtype=dtype, requires_grad=True)
    ids = torch.tensor([elmo_fast.word_to_char_ids(word) for word in ("bbb", "a")])
    up = torch.tensor([[0.0], [2.0]], dtype=dtype)
    got = torch.autograd.grad(char_cnn_cpu(ids, emb, [w], [b], "tanh"), [emb, w, b], up)
    ref = torch.autograd.grad(char_cnn_reference(ids, emb, [w], [b], "tanh"), [emb, w, b], up)
    dm = 2.0 * (1 - torch.tanh(torch.tensor(3.0, dtype=dtype)) ** 2)
    assert torch.allclose(ref[0][ord("a") + 1], dm / 48 * torch.ones(2, dtype=dtype))  # the reference: 1/48 each
    for k, (a, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, r, msg=lambda m: f"grad {k}: {m}")


@pytest.mark.parametrize("shape", [(37, 24), (2, 5, 40)], ids=["rows", "batched"])
def test_highway_cpu_matches_reference(nan_poison, gemm_path, gate_path, shape):
    """The fused highway (fp32, the extension's gate math in each instruction set; torch ops: the reference runs)
    against the fp64 reference, forward and every gradient; transform pre-activations of exactly 0 (relu's
    gradient is 0 there, as torch's), a column count off the vector width; fp64 runs the reference itself."""
    from elmo_fast.cpu import highway as hw_module
    from elmo_fast.ops import highway
    from elmo_fast.reference.char_cnn import highway_reference

    g = torch.Generator().manual_seed(5)
    F_ = shape[-1]
    x64 = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = [torch.randn(F_, F_, generator=g, dtype=torch.float64) * F_ ** -0.5 for _ in range(2)]
    b = [torch.randn(F_, generator=g, dtype=torch.float64) for _ in range(2)]
    w[1][:, :3] = 0.0
    b[1][:3] = 0.0  # columns 0-2 of the transform: relu at exactly 0
    base = [x64, w[0], b[0], w[1], b[1]]
    up = torch.randn(*shape, generator=g, dtype=torch.float64)
    calls = []
    real = hw_module.highway_cpu_applies

    def spy(*a):
        calls.append(real(*a))
        return calls[-1]

    import importlib

    ops_char_cnn = importlib.import_module("elmo_fast.ops.char_cnn")
    nan_poison  # noqa: B018 - the fixture poisons fresh buffers
    for dt in (torch.float32, torch.float64):
        ins = [t.to(dt).clone().requires_grad_() for t in base]
        calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ops_char_cnn, "highway_cpu_applies", spy)
            got = highway(*ins, backend="cpu")
            ggot = torch.autograd.grad(got, ins, up.to(dt))
        assert calls == [dt == torch.float32 and gate_path != "torch-ops"]
        p64 = [t.clone().requires_grad_() for t in base]
        ref64 = highway_reference(*p64)
        gref64 = torch.autograd.grad(ref64, p64, up)
        low = [t.to(dt).clone().requires_grad_() for t in base]
        ref = highway_reference(*low)
        gref = torch.autograd.grad(ref, low, up.to(dt))
        assert_close_to_oracle(got, ref64, ref, "highway")
        for k, (a, c, d) in enumerate(zip(ggot, gref64, gref)):
            assert_close_to_oracle(a, c, d, f"highway grad {k}")
    ins = [t.float().clone().requires_grad_(k > 0) for k, t in enumerate(base)]  # x needs no gradient
    grads = torch.autograd.grad(highway(*ins, backend="cpu"), ins[1:], up.float())
    assert all(torch.isfinite(t).all() for t in grads)


@pytest.mark.skipif(cpu_ext() is None, reason="needs elmo_fast._cpu")
def test_highway_cpu_propagates_nan_as_the_reference():
    """A NaN input element gives NaN where the reference has NaN, in the output and every gradient (relu passes
    a NaN's gradient on, as torch's does), not a silent 0."""
    from elmo_fast.cpu import highway_cpu
    from elmo_fast.reference.char_cnn import highway_reference

    g = torch.Generator().manual_seed(6)
    F_ = 20
    base = [torch.randn(4, F_, generator=g), torch.randn(F_, F_, generator=g) * 0.2, torch.randn(F_, generator=g),
            torch.randn(F_, F_, generator=g) * 0.2, torch.randn(F_, generator=g)]
    base[0][1, 3] = float("nan")
    outs = []
    for fn in (highway_cpu, highway_reference):
        ins = [t.clone().requires_grad_() for t in base]
        y = fn(*ins)
        outs.append((y.isnan(), [gr.isnan() for gr in torch.autograd.grad(y, ins, torch.ones_like(y))]))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][0][1].all() and not outs[0][0][0].any()
    for a, c in zip(outs[0][1], outs[1][1]):
        assert torch.equal(a, c)


def _softmax_inputs():
    """(targets, sample ids, expected counts of both, fp64 (hidden, weight, bias)) with accidental hits and a
    repeated target; N, P, V, S = 13, 7, 50, 11."""
    from elmo_fast.ops import log_uniform_sample
    from elmo_fast.reference.sampled_softmax import expected_count_reference

    g = torch.Generator().manual_seed(3)
    N, P, V, S = 13, 7, 50, 11
    ids, tries = log_uniform_sample(S, V, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[:3] = ids[:3]  # accidental hits
    targets[5] = targets[6]  # a repeated target
    q_t, q_s = expected_count_reference(targets, tries, S, V), expected_count_reference(ids, tries, S, V)
    base = [torch.randn(N, P, generator=g, dtype=torch.float64), torch.randn(V, P, generator=g, dtype=torch.float64),
            torch.randn(V, generator=g, dtype=torch.float64)]
    return targets, ids, q_t, q_s, base


def _run_softmax(fn, dt, trainable=(True, True, True), reduction="mean", sparse=False, spread=1.0):
    """The loss and the dense gradients of the trainable ones of (hidden, weight, bias), in dtype ``dt``; the
    weight times ``spread``."""
    targets, ids, q_t, q_s, base = _softmax_inputs()
    base[1] *= spread
    ins = [t.to(dt).requires_grad_(r) for t, r in zip(base, trainable)]
    loss = fn(*ins[:1], targets, *ins[1:], ids, q_t, q_s, reduction=reduction, sparse_grad=sparse)
    up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).add_(1.7)
    grads = torch.autograd.grad(loss, [t for t in ins if t.requires_grad], up.to(dt))
    return loss, [gr.to_dense() for gr in grads]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sampled_softmax_cpu_matches_reference(nan_poison, gemm_path, dtype, sparse, reduction):
    """Forward and every gradient (hidden, weight and bias, sparse or dense), accidental hits included; products on
    MKL and on oneDNN (dh's accumulating product included)."""
    from elmo_fast.reference.sampled_softmax import sampled_softmax_loss_reference

    kw = dict(reduction=reduction, sparse=sparse)
    ref64, g64 = _run_softmax(sampled_softmax_loss_reference, torch.float64, **kw)
    ref, gref = _run_softmax(sampled_softmax_loss_reference, dtype, **kw)
    got, ggot = _run_softmax(sampled_softmax_loss_cpu, dtype, **kw)
    assert_close_to_oracle(got, ref64, ref, "loss")
    for what, a, b, c in zip(("dhidden", "dweight", "dbias"), ggot, g64, gref):
        assert_close_to_oracle(a, b, c, what)


@pytest.mark.parametrize("trainable", [(True, True, True, True), (False, True, True, False),
                                       (True, False, False, True)], ids=["all", "h_b and W", "h_f and b"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sampled_softmax_pair_equals_two_calls(nan_poison, dtype, sparse, reduction, trainable):
    """bilm-tf's two directions over one table as one cpu operator (ops.sampled_softmax_loss_pair): the losses,
    the hidden states' gradients and the table's (one tensor of all four row sets, forward's first) equal two
    sampled_softmax_loss calls; accidental hits and a repeated target in each direction."""
    from elmo_fast.ops import log_uniform_sample, sampled_softmax_loss, sampled_softmax_loss_pair

    g = torch.Generator().manual_seed(8)
    V, P, S = 50, 7, 11
    dirs = []
    for N in (13, 9):
        ids, tries = log_uniform_sample(S, V, generator=g)
        t = torch.randint(0, V, (N,), generator=g)
        t[:2] = ids[:2]
        t[4] = t[5]
        dirs.append((torch.randn(N, P, generator=g, dtype=torch.float64).to(dtype), t, ids, tries))
    w0 = torch.randn(V, P, generator=g, dtype=torch.float64).to(dtype)
    b0 = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    ups = [torch.randn(() if reduction != "none" else (d[0].shape[0],), generator=g, dtype=torch.float64).to(dtype)
           for d in dirs]
    runs = []
    for pair in (True, False):
        h_f, h_b, w, b = (t.clone().requires_grad_(r) for t, r in zip((dirs[0][0], dirs[1][0], w0, b0), trainable))
        kw = dict(reduction=reduction, sparse_grad=sparse, backend="cpu")
        if pair:
            losses = sampled_softmax_loss_pair((h_f, *dirs[0][1:]), (h_b, *dirs[1][1:]), w, b, **kw)
        else:
            losses = [sampled_softmax_loss(h, d[1], w, b, d[2], d[3], **kw)
                      for h, d in ((h_f, dirs[0]), (h_b, dirs[1]))]
        wrt = [t for t in (h_f, h_b, w, b) if t.requires_grad]
        grads = torch.autograd.grad(losses, wrt, ups)
        assert ("pair" in type(losses[0].grad_fn).__name__) == pair  # the pair ran as one operator
        if pair and sparse and w.requires_grad:
            rows = grads[[i for i, t in enumerate(wrt) if t is w][0]]._indices()[0]
            assert torch.equal(rows, torch.cat([dirs[0][1], dirs[0][2], dirs[1][1], dirs[1][2]]))
        runs.append((losses, [gr.to_dense() if gr.is_sparse else gr for gr in grads]))
    for a, c in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, c)
    for a, c in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, c, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0.0)


def test_sampled_softmax_pair_module_and_fallbacks():
    """SampledSoftmaxLoss.forward_pair equals two calls with the same samples; refuses eval mode; the reference
    backend runs two calls."""
    from elmo_fast.modules import SampledSoftmaxLoss
    from elmo_fast.ops import sampled_softmax_loss_pair

    sm = SampledSoftmaxLoss(40, 6, num_samples=9, sparse=True, seed=3).train()
    g = torch.Generator().manual_seed(9)
    hs = [torch.randn(5, 6, generator=g), torch.randn(4, 6, generator=g)]
    ts = [torch.randint(0, 40, (5,), generator=g), torch.randint(0, 40, (4,), generator=g)]
    samples = [sm.sample(), sm.sample()]
    lf, lb = sm.forward_pair(hs[0], ts[0], samples[0], hs[1], ts[1], samples[1])
    assert torch.equal(lf, sm(hs[0], ts[0], samples=samples[0]))
    assert torch.equal(lb, sm(hs[1], ts[1], samples=samples[1]))
    assert "pair" in type(lf.grad_fn).__name__
    import importlib

    ops_softmax = importlib.import_module("elmo_fast.ops.softmax")
    counted = []
    real_count = ops_softmax.expected_count_reference

    def count(*a):
        counted.append(1)
        return real_count(*a)

    with pytest.MonkeyPatch.context() as mp:  # the checks and expected counts run once per direction, either way
        mp.setattr(ops_softmax, "expected_count_reference", count)
        ref = sampled_softmax_loss_pair((hs[0], ts[0], *samples[0]), (hs[1], ts[1], *samples[1]), sm.softmax_W,
                                        sm.softmax_b, backend="reference")
        assert len(counted) == 4
        sampled_softmax_loss_pair((hs[0], ts[0], *samples[0]), (hs[1], ts[1], *samples[1]), sm.softmax_W,
                                  sm.softmax_b, backend="cpu")
        assert len(counted) == 8
    assert "pair" not in type(ref[0].grad_fn).__name__
    torch.testing.assert_close(torch.stack(list(ref)), torch.stack([lf, lb]))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: two calls, each cast as one call casts
        auto = sampled_softmax_loss_pair((hs[0], ts[0], *samples[0]), (hs[1], ts[1], *samples[1]), sm.softmax_W,
                                         sm.softmax_b, backend="cpu")
    assert "pair" not in type(auto[0].grad_fn).__name__
    with pytest.raises(RuntimeError, match="forward_pair / forward_groups are the sampled softmax of training"):
        sm.eval().forward_pair(hs[0], ts[0], samples[0], hs[1], ts[1], samples[1])


@pytest.mark.parametrize("used", ["forward", "backward"])
def test_sampled_softmax_pair_with_one_loss_used(nan_poison, used):
    """Only one of the pair's losses reaches the gradient: the table's and that direction's gradients equal a single
    call's; the other direction's hidden state gets none and its rows in the table's gradient are zeros."""
    from elmo_fast.ops import log_uniform_sample, sampled_softmax_loss, sampled_softmax_loss_pair

    g = torch.Generator().manual_seed(10)
    V, P, S = 30, 5, 7
    dirs = []
    for N in (6, 4):
        ids, tries = log_uniform_sample(S, V, generator=g)
        dirs.append((torch.randn(N, P, generator=g), torch.randint(0, V, (N,), generator=g), ids, tries))
    w0, b0 = torch.randn(V, P, generator=g), torch.randn(V, generator=g)
    k = 0 if used == "forward" else 1
    h = [d[0].clone().requires_grad_() for d in dirs]
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    losses = sampled_softmax_loss_pair((h[0], *dirs[0][1:]), (h[1], *dirs[1][1:]), w, b, backend="cpu")
    got = torch.autograd.grad(losses[k], [h[k], h[1 - k], w, b], allow_unused=True)
    assert got[1] is None
    h1 = dirs[k][0].clone().requires_grad_()
    w1, b1 = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    want = torch.autograd.grad(sampled_softmax_loss(h1, dirs[k][1], w1, b1, dirs[k][2], dirs[k][3], backend="cpu"),
                               [h1, w1, b1])
    for a, c in zip((got[0], got[2], got[3]), want):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=0.0)


@pytest.mark.skipif(cpu_ext() is None, reason="needs elmo_fast._cpu")
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "empty"])
def test_highway_cpu_operators_pass_opcheck(layout):
    """The highway operators' fakes, schemas and autograd registration (torch.library.opcheck), with a transposed
    input (the real outputs are contiguous whatever x is: so must the fakes be) and no rows."""
    from elmo_fast.cpu import highway as hw

    g = torch.Generator().manual_seed(11)
    F_, N = 24, 0 if layout == "empty" else 37
    x = torch.randn(F_, N, generator=g).t() if layout == "transposed" else torch.randn(N, F_, generator=g)
    args = [x, torch.randn(F_, F_, generator=g) * 0.2, torch.randn(F_, generator=g),
            torch.randn(F_, F_, generator=g) * 0.2, torch.randn(F_, generator=g)]
    torch.library.opcheck(hw._highway_op, tuple(t.clone().requires_grad_() for t in args))
    y, gate, r = hw._highway_op(*args)
    for needs in ((True, True, True), (False, True, False), (True, False, True)):
        torch.library.opcheck(hw._highway_backward, (torch.randn(N, F_, generator=g), x, gate, r, args[1], args[3],
                                                     *needs))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sampled_softmax_cpu_with_logits_far_apart(nan_poison, dtype):
    """Weights x 40: logits ~100 apart, most softmax terms below exp(-87) (fp32's denormals, torch exp's slow path).
    The loss and every gradient still match the reference."""
    from elmo_fast.reference.sampled_softmax import sampled_softmax_loss_reference

    ref64, g64 = _run_softmax(sampled_softmax_loss_reference, torch.float64, spread=40.0)
    ref, gref = _run_softmax(sampled_softmax_loss_reference, dtype, spread=40.0)
    got, ggot = _run_softmax(sampled_softmax_loss_cpu, dtype, spread=40.0)
    assert_close_to_oracle(got, ref64, ref, "loss")
    for what, a, b, c in zip(("dhidden", "dweight", "dbias"), ggot, g64, gref):
        assert_close_to_oracle(a, b, c, what)


def _run_full(fn, dt, trainable=(True, True, True), reduction="mean", spread=1.0):
    """The full-softmax loss and the gradients of the trainable ones of (hidden, weight, bias) in dtype ``dt``; the
    weight times ``spread``. The inputs of ``_softmax_inputs`` (V = 50)."""
    targets, _, _, _, base = _softmax_inputs()
    base[1] *= spread
    ins = [t.to(dt).requires_grad_(r) for t, r in zip(base, trainable)]
    loss = fn(ins[0], targets, ins[1], ins[2], reduction=reduction)
    up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).add_(1.7)
    return loss, torch.autograd.grad(loss, [t for t in ins if t.requires_grad], up.to(dt))


@pytest.mark.parametrize("trainable", [(True, True, True), (True, False, True), (False, True, False)],
                         ids=["all", "frozen-weight", "weight-only"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype, spread", [(torch.float64, 1.0), (torch.float32, 1.0), (torch.bfloat16, 1.0),
                                           (torch.float16, 1.0), (torch.float64, 40.0), (torch.float32, 40.0)],
                         ids=["fp64", "fp32", "bf16", "fp16", "fp64-logits-far-apart", "fp32-logits-far-apart"])
def test_full_softmax_cpu_matches_reference(monkeypatch, nan_poison, gemm_path, dtype, spread, reduction, trainable):
    """The full softmax over the vocabulary in chunks of 16 words (the last one ragged: V = 50): the loss and
    every gradient asked for, against the reference, products on MKL and on oneDNN; forward and backward each
    compute every chunk's logits once (never N x V). (Not bf16 with logits in the hundreds: a bf16 logit is then
    rounded by up to 1.)"""
    from elmo_fast.cpu import sampled_softmax as sm_module
    from elmo_fast.reference.sampled_softmax import full_softmax_nll_reference

    monkeypatch.setattr(sm_module, "_CHUNK_LOGITS", 13 * 16)  # N = 13 rows
    monkeypatch.setattr(sm_module, "_CHUNK_MIN_WORDS", 1)
    widths, real = [], sm_module._chunk_logits
    monkeypatch.setattr(sm_module, "_chunk_logits", lambda *a: widths.append(a[4] - a[3]) or real(*a))
    kw = dict(trainable=trainable, reduction=reduction, spread=spread)
    ref64, g64 = _run_full(full_softmax_nll_reference, torch.float64, **kw)
    ref, gref = _run_full(full_softmax_nll_reference, dtype, **kw)
    got, ggot = _run_full(sm_module.full_softmax_nll_cpu, dtype, **kw)
    assert widths == [16, 16, 16, 2] * 2
    assert_close_to_oracle(got, ref64, ref, "loss")
    assert len(ggot) == sum(trainable)
    for k, (a, b, c) in enumerate(zip(ggot, g64, gref)):
        assert_close_to_oracle(a, b, c, f"gradient {k}")


@pytest.mark.parametrize("which", ["sampled", "full"])
def test_cpu_softmax_refuses_an_unknown_reduction(which):
    """A misspelt reduction is refused with the reference's message, not answered with the rows' losses."""
    from elmo_fast.cpu import sampled_softmax as sm_module

    targets, ids, q_t, q_s, (h, w, b) = _softmax_inputs()
    h, w, b = h.float(), w.float(), b.float()
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        if which == "sampled":
            sm_module.sampled_softmax_loss_cpu(h, targets, w, b, ids, q_t, q_s, reduction="avg")
        else:
            sm_module.full_softmax_nll_cpu(h, targets, w, b, reduction="avg")


def test_full_softmax_cpu_with_a_chunk_of_minus_inf_logits(monkeypatch):
    """Words 0-15 masked with a bias of -inf: the first chunk of 16 is -inf in every row. The running maximum
    stays finite (no -inf - -inf = NaN); loss and gradients equal the reference's."""
    from elmo_fast.cpu import sampled_softmax as sm_module
    from elmo_fast.reference.sampled_softmax import full_softmax_nll_reference

    monkeypatch.setattr(sm_module, "_CHUNK_LOGITS", 13 * 16)
    monkeypatch.setattr(sm_module, "_CHUNK_MIN_WORDS", 1)
    targets, _, _, _, base = _softmax_inputs()
    targets = targets % 34 + 16
    base[2][:16] = -math.inf
    out = []
    for fn in (full_softmax_nll_reference, sm_module.full_softmax_nll_cpu):
        h, w, b = (t.clone().requires_grad_() for t in base)
        loss = fn(h, targets, w, b)
        out.append((loss, *torch.autograd.grad(loss, (h, w, b))))
    for what, want, got in zip(("loss", "dhidden", "dweight", "dbias"), *out):
        torch.testing.assert_close(got, want, msg=what)


def test_full_softmax_on_the_cpu_runs_the_cpu_backend(monkeypatch):
    """``ops.full_softmax_nll`` on CPU tensors: ``auto`` and ``cpu`` run the cpu backend, ``reference`` the oracle."""
    from elmo_fast.ops import softmax as ops_softmax

    calls = []
    real = ops_softmax.full_softmax_nll_cpu
    monkeypatch.setattr(ops_softmax, "full_softmax_nll_cpu", lambda *a: calls.append(1) or real(*a))
    targets, _, _, _, (h, w, b) = _softmax_inputs()
    h, w, b = h.float(), w.float(), b.float()
    want = ops_softmax.full_softmax_nll(h, targets, w, b, backend="reference")
    assert not calls
    for backend in ("auto", "cpu"):
        torch.testing.assert_close(ops_softmax.full_softmax_nll(h, targets, w, b, backend=backend), want)
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_sampled_softmax_cpu_softmax_avoids_slow_and_denormal_floats(dtype):
    """``_softmax_`` on rows spread 0..-2000 with a masked entry: exp never sees an argument below ceil(log tiny)
    (-87 in fp32, bf16 and fp16, whose exp runs in fp32: below it torch's exp takes a ~20x slower path); no
    probability is denormal (the backward's products would take a microcode assist for each); loss and softmax
    equal fp64's on the same inputs."""
    from torch.overrides import TorchFunctionMode

    from elmo_fast.cpu.sampled_softmax import _softmax_

    class ExpArguments(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.exp, torch.Tensor.exp, torch.Tensor.exp_):
                lowest.append(float(args[0].min()))
            return func(*args, **(kwargs or {}))

    info, lowest = torch.finfo(torch.promote_types(dtype, torch.float32)), []
    x64 = -torch.linspace(0, 2000, 4 * 801, dtype=torch.float64).view(4, 801)[:, torch.randperm(801)]
    x64[1, 5] = torch.finfo(dtype).min  # an accidental hit, masked
    with ExpArguments():
        x = x64.to(dtype, copy=True)
        loss, probs, p_true = _softmax_(x[:, 1:], x[:, 0])  # the samples' in place
        probs = torch.cat([p_true.unsqueeze(1), probs], 1)
    assert lowest and min(lowest) >= math.ceil(math.log(info.tiny))
    assert not ((probs != 0) & (probs.abs() < info.tiny)).any()
    assert probs[1, 5] == 0
    x64 = x64.to(dtype).double()  # the inputs as _softmax_ saw them
    tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    rtol = tol if dtype.itemsize == 2 else tol / 10  # a bf16/fp16 loss of ~300 is itself rounded by 2^-8 / 2^-11
    torch.testing.assert_close(loss.double(), torch.logsumexp(x64, 1) - x64[:, 0], rtol=rtol, atol=tol / 10)
    low = torch.finfo(dtype)
    atol = 4 * max(info.tiny, low.tiny * low.eps)  # fp16's subnormal spacing, 6e-8, where its values are subnormal
    torch.testing.assert_close(probs.double(), torch.softmax(x64, 1), rtol=tol, atol=atol)
    # one logit at 0, 8,192 at -10: the far terms add up (0.316), though each is below fp16's normal range
    loss, *_ = _softmax_(torch.full((1, 8192), -10.0, dtype=dtype), torch.zeros(1, dtype=dtype))
    assert abs(float(loss) - math.log1p(8192 * math.exp(-10))) < tol * 10


@pytest.mark.skipif(cpu_ext() is None, reason="needs elmo_fast._cpu (csrc/cpu/fpenv.cpp)")
def test_denormals_flushed_reaches_the_openmp_team_and_restores():
    """Inside the block a product that torch splits over 2 threads has every denormal result flushed, not just
    the calling thread's half; nesting keeps it; after the block denormals are back on every thread."""
    from elmo_fast.cpu.ext import denormals_flushed

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.full((1 << 20,), 1e-30)  # x · 1e-10 = 1e-40: denormal in fp32
        assert (x * 1e-10 != 0).all()
        with denormals_flushed():
            assert (x * 1e-10 == 0).all()
            with denormals_flushed():
                pass
            assert (x * 1e-10 == 0).all()
        assert (x * 1e-10 != 0).all()
        torch.set_flush_denormal(True)  # this thread alone, before the block: so again after it, not the team
        with denormals_flushed():
            assert (x * 1e-10 == 0).all()
        torch.set_flush_denormal(False)
        assert (x * 1e-10 != 0).all()
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


@pytest.mark.skipif(cpu_ext() is None, reason="needs elmo_fast._cpu (csrc/cpu/fpenv.cpp)")
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_lstmp_cpu_runs_with_denormals_flushed(monkeypatch, train):
    """The LSTMP chain's forward (training and inference) and backward through time run with denormals flushed:
    an output gate saturated below -87 gives denormal states, which the next products would read."""
    from elmo_fast.cpu import lstmp as lstmp_module

    flushed = []
    for name in ("_forward", "_backward_through_time"):
        real = getattr(lstmp_module, name)
        monkeypatch.setattr(lstmp_module, name, lambda *a, _real=real, **k: flushed.append(
            cpu_ext().denormals_flushed()) or _real(*a, **k))
    args = _chain(3, 4, 5, 6, 4, True, torch.float32, seed=0)
    with torch.set_grad_enabled(train):
        y, h, c = lstmp_cpu(*args, torch.tensor([4, 2, 3]), cell_clip=3.0, proj_clip=3.0)
        if train:
            torch.autograd.grad((y.sum(), h.sum(), c.sum()), [a for a in args if a is not None])
    assert flushed == [True] * (1 + train) and not cpu_ext().denormals_flushed()


@pytest.mark.skipif(cpu_ext() is None, reason="needs elmo_fast._cpu (csrc/cpu/fpenv.cpp)")
def test_softmax_ops_run_with_denormals_flushed(monkeypatch):
    """Every product of both cpu softmax operators, forward and backward, runs with denormals flushed."""
    from elmo_fast.cpu import sampled_softmax as sm_module

    flushed, real = [], sm_module.gemm
    monkeypatch.setattr(sm_module, "gemm", lambda *a, **k: flushed.append(cpu_ext().denormals_flushed())
                        or real(*a, **k))
    targets, ids, q_t, q_s, base = _softmax_inputs()
    h, w, b = (t.float().requires_grad_() for t in base)
    torch.autograd.grad(sampled_softmax_loss_cpu(h, targets, w, b, ids, q_t, q_s), (h, w, b))
    torch.autograd.grad(sm_module.full_softmax_nll_cpu(h, targets, w, b), (h, w, b))
    assert flushed == [True] * 5 and not cpu_ext().denormals_flushed()  # 1 + 1 products sampled, 1 + 2 full


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("trainable", [(True, False, True), (True, True, False), (False, False, True),
                                       (False, True, True), (True, False, False)],
                         ids=["frozen-weight", "frozen-bias", "bias-only", "frozen-hidden", "frozen-table"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sampled_softmax_cpu_computes_only_the_needed_gradients(monkeypatch, nan_poison, dtype, trainable, sparse):
    """A parameter that needs no gradient gets nothing computed (a frozen weight: no dᵀ·hidden product); the
    gradients that are asked for still equal the reference's."""
    from elmo_fast.cpu import sampled_softmax as sm_module
    from elmo_fast.reference.sampled_softmax import sampled_softmax_loss_reference

    computed, real = [], sm_module._sampled_softmax_backward

    def spy(*a):
        out = real(*a)
        computed.append(tuple(t.numel() > 0 for t in out))
        return out

    monkeypatch.setattr(sm_module, "_sampled_softmax_backward", spy)
    kw = dict(trainable=trainable, sparse=sparse)
    _, g64 = _run_softmax(sampled_softmax_loss_reference, torch.float64, **kw)
    _, gref = _run_softmax(sampled_softmax_loss_reference, dtype, **kw)
    _, ggot = _run_softmax(sampled_softmax_loss_cpu, dtype, **kw)
    assert computed == [trainable]  # (dh, weight rows, bias rows)
    assert len(ggot) == len(g64) == sum(trainable)
    for k, (a, b, c) in enumerate(zip(ggot, g64, gref)):
        assert_close_to_oracle(a, b, c, f"gradient {k}")


def test_softmax_ops_take_no_gradient_when_none_arrives():
    """With no zero-filled gradients (materialize_grads off), a loss that reaches the output only through a
    non-differentiable path gives the backward None: nothing flows to the inputs, no error."""
    from elmo_fast.cpu.sampled_softmax import full_softmax_nll_cpu

    class Stop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return None

    targets, ids, q_t, q_s, base = _softmax_inputs()
    h, w, b = (t.float().requires_grad_() for t in base)
    for loss in (sampled_softmax_loss_cpu(h, targets, w, b, ids, q_t, q_s), full_softmax_nll_cpu(h, targets, w, b)):
        (Stop.apply(loss) + h.sum()).backward()
    assert torch.equal(h.grad, torch.full_like(h, 2.0)) and w.grad is None and b.grad is None


def test_sampled_softmax_cpu_without_samples_matches_reference():
    """S = 0: the loss is the true logit's alone (0), as the reference gives it; gradients 0."""
    from elmo_fast.reference.sampled_softmax import sampled_softmax_loss_reference

    targets, _, q_t, _, base = _softmax_inputs()
    ids, q_s = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64)
    out = []
    for fn in (sampled_softmax_loss_reference, sampled_softmax_loss_cpu):
        h, w, b = (t.float().requires_grad_() for t in base)
        loss = fn(h, targets, w, b, ids, q_t, q_s)
        out.append((loss, *torch.autograd.grad(loss, (h, w, b))))
    for want, got in zip(*out):
        torch.testing.assert_close(got, want)


def test_sampled_softmax_cpu_backward_makes_no_copies_or_fills(monkeypatch):
    """Backward with sparse gradients (the trainer's): one product for the weight's rows, MKL's aten::mm or
    oneDNN's (``gemm``), plus dh's addmm_ (in place: addmm copies its input first); rows written contiguous, so
    autograd keeps both sparse gradients without a copy (a column slice of one (N + S, P + 1) product cost a 17 MB
    clone a call at the original sizes); and no zero gradients made for the operator's other outputs (w_t, w_s,
    probs: 28 MB of fills). On MKL's products: oneDNN's matmul (``gemm`` picks it where faster) takes its left
    operand contiguous and returns its own result, two copies that its speed pays for."""
    from torch.profiler import profile

    monkeypatch.setenv("ELMO_FAST_CPU_GEMM", "mkl")

    targets, ids, q_t, q_s, base = _softmax_inputs()
    h, w, b = (t.float().requires_grad_() for t in base)
    loss = sampled_softmax_loss_cpu(h, targets, w, b, ids, q_t, q_s, sparse_grad=True)
    with profile(record_shapes=True) as prof:
        loss.backward()
    counts = {e.key: e.count for e in prof.key_averages()}
    products = counts.get("aten::mm", 0) + counts.get("mkldnn::_linear_pointwise", 0)
    assert products == 1 and counts.get("aten::addmm_") == 1
    copies = {(e.key, str(e.input_shapes)) for e in prof.key_averages(group_by_input_shape=True)
              if e.key in ("aten::zero_", "aten::clone", "aten::copy_") and e.input_shapes[0]}
    assert not copies  # (scalar copies aside: the upstream gradient)
    assert w.grad.is_sparse and b.grad.is_sparse


def test_pack_pays_weighs_the_pack_against_the_steps_it_speeds_up(monkeypatch):
    """Training's forward packs a weight for one call only where uses x (t_mm - t_packed) > t_pack, measured once per
    (rows, shape, strides, dtype, threads, panels or oneDNN); ELMO_FAST_CPU_TRAIN_PACK fixes the choice; deterministic
    mode never packs there."""
    from elmo_fast.determinism import deterministic

    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    monkeypatch.setattr(packed, "_PAYS", {})
    monkeypatch.delenv("ELMO_FAST_CPU_TRAIN_PACK", raising=False)
    w = torch.randn(8, 64)
    key = packed._pays_key(w, 4)
    assert key == (4, (8, 64), (64, 1), torch.float32, torch.get_num_threads(), packed.panels_apply(w, 4))
    packed._PAYS[key] = (0.030, 0.0020, 0.0005)  # pack 30 ms; 1.5 ms saved a product
    assert packed.pack_pays(w, 4, 21) and not packed.pack_pays(w, 4, 20)
    with deterministic():
        assert not packed.pack_pays(w, 4, 1000)
    monkeypatch.setenv("ELMO_FAST_CPU_TRAIN_PACK", "0")
    assert not packed.pack_pays(w, 4, 1000)
    monkeypatch.setenv("ELMO_FAST_CPU_TRAIN_PACK", "1")
    assert packed.pack_pays(w, 4, 1)
    monkeypatch.setenv("ELMO_FAST_CPU_TRAIN_PACK", "yes")
    with pytest.raises(ValueError, match="ELMO_FAST_CPU_TRAIN_PACK='yes': expected one of auto, 0, 1"):
        packed.pack_pays(w, 4, 1)
    monkeypatch.setenv("ELMO_FAST_CPU_TRAIN_PACK", "auto")
    assert packed.pack_pays(w, 4, 10) in (True, False) and len(packed._PAYS) == 1  # measured key reused
    wt = w.t().contiguous().t()
    packed.pack_pays(wt, 4, 10)  # other strides: measured once more, on that weight
    assert len(packed._PAYS) == 2 and all(t > 0 for t in packed._PAYS[packed._pays_key(wt, 4)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:  # another intra-op thread count: measured once more
        packed.pack_pays(w, 4, 10)
        assert len(packed._PAYS) == 3
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(packed, "_ONEDNN_OK", False)
    assert not packed.pack_pays(w, 4, 1000)


def test_training_forward_packs_only_where_it_pays(monkeypatch):
    """The choice reaches the time loop: training's forward builds its per-step weights packed or not as pack_pays
    says (inference always packs, through the module's cache)."""
    from elmo_fast.cpu import lstmp as cpu_lstmp

    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    built = []
    real = cpu_lstmp.PackedLinear

    def spy(w, rows, dtype=None, pack=True):
        built.append(pack)
        return real(w, rows, dtype, pack)

    monkeypatch.setattr(cpu_lstmp, "PackedLinear", spy)
    args = _chain(3, 4, 5, 6, 3, True, torch.float32, seed=3)
    for mode, want in (("1", True), ("0", False)):
        monkeypatch.setenv("ELMO_FAST_CPU_TRAIN_PACK", mode)
        built.clear()
        y, _, _ = lstmp_cpu(*args, torch.tensor([4, 2, 3]), cell_clip=1.0, proj_clip=0.5)
        assert built[:2] == [want, want], (mode, built)  # forward: w_rec, w_proj
        y.sum().backward()
        assert built[2:] == [True, True]  # backward's transposed products always pack


def test_cpu_weight_cache_follows_weight_updates(tmp_path, monkeypatch):
    """The cpu backend keeps packed weights across calls; an in-place update must invalidate them."""
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)  # pack the tiny model's weights
    o, w = write_random_model(tmp_path)
    model = elmo_fast.ElmoBiLM(o, w, stateful=False, backend="cpu")
    ids = elmo_fast.batch_to_ids(SENTS)
    with torch.no_grad():
        first = model(ids)["activations"][2]
        assert len(model._bilm.forward_lstm._cpu_weight_cache) > 0
        torch.testing.assert_close(model(ids)["activations"][2], first)  # cached path == first call
        model._bilm.forward_lstm.W_0[1].mul_(0.5)  # an in-place update bumps the version counter
        model._bilm.backward_lstm.W_P_0[0].data.mul_(0.5)  # .data (like fused optimizers) does not: the sample does
        changed = model(ids)["activations"][2]
        fresh = elmo_fast.ElmoBiLM(o, w, stateful=False, backend="reference")
        fresh.load_state_dict(model.state_dict())
        torch.testing.assert_close(changed, fresh(ids)["activations"][2], atol=2e-6, rtol=1e-5)
    assert not torch.allclose(changed, first)


def _embed_in_worker(model, ids, queue):
    with torch.no_grad():
        queue.put(model(ids)["activations"][2].numpy())  # by value (a tensor would travel as a shared fd)


def test_model_pickles_after_cpu_inference(tmp_path):
    """pickle, torch.save, deepcopy and a spawned worker all work after a CPU fp32 inference filled the cache."""
    o, w = write_random_model(tmp_path)
    model = elmo_fast.ElmoBiLM(o, w, stateful=False)
    ids = elmo_fast.batch_to_ids(SENTS)
    with torch.no_grad():
        want = model(ids)["activations"][2]
    cache = model._bilm.forward_lstm._cpu_weight_cache
    assert len(cache) > 0
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [pickle.loads(pickle.dumps(model)), copy.deepcopy(model), torch.load(buf, weights_only=False)]
    for m in copies:
        assert len(m._bilm.forward_lstm._cpu_weight_cache) == 0  # dropped, rebuilt lazily
        with torch.no_grad():
            torch.testing.assert_close(m(ids)["activations"][2], want)
        assert len(m._bilm.forward_lstm._cpu_weight_cache) > 0
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_embed_in_worker, args=(model, ids, queue))
    proc.start()
    got = torch.from_numpy(queue.get(timeout=120))
    proc.join(timeout=60)
    assert proc.exitcode == 0
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_projection_cpu_matches_reference(nan_poison, gemm_path, layout):
    """The token encoder's projection in training on the cpu backend (``elmo_fast::linear_cpu``, fp32; fp64, the
    other backends and inference take torch.addmm, the reference) against the fp64 product, forward and every
    gradient (and with x, W or b frozen, the others'), on MKL and on oneDNN, with a row-major or a transposed input."""
    from elmo_fast.cpu import linear as lin_module
    from elmo_fast.ops import projection

    g = torch.Generator().manual_seed(17)
    N, F_, P_ = 37, 40, 24
    x64 = torch.randn(F_, N, generator=g, dtype=torch.float64).t() if layout == "transposed" else \
        torch.randn(N, F_, generator=g, dtype=torch.float64)
    base = [x64, torch.randn(F_, P_, generator=g, dtype=torch.float64) * F_ ** -0.5,
            torch.randn(P_, generator=g, dtype=torch.float64)]
    up = torch.randn(N, P_, generator=g, dtype=torch.float64)
    p64 = [t.clone().requires_grad_() for t in base]
    ref64 = torch.addmm(p64[2], p64[0], p64[1])
    gref64 = torch.autograd.grad(ref64, p64, up)
    cases = [(torch.float32, "cpu", (True,) * 3), (torch.float64, "cpu", (True,) * 3),
             (torch.float32, "reference", (True,) * 3),  # and, on the operator, each input frozen in turn
             (torch.float32, "cpu", (False, True, True)), (torch.float32, "cpu", (True, False, True)),
             (torch.float32, "cpu", (True, True, False))]
    for dt, backend, wants in cases:
        calls = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(lin_module, "_linear_op", lambda *a, real=lin_module._linear_op: calls.append(1) or real(*a))
            ins = [t.to(dt).clone().requires_grad_(w) for t, w in zip(base, wants)]
            got = projection(ins[0], ins[1], ins[2], backend=backend)
            ggot = torch.autograd.grad(got, [t for t in ins if t.requires_grad], up.to(dt))
        assert calls == ([1] if (dt, backend) == (torch.float32, "cpu") else [])
        with torch.no_grad(), pytest.MonkeyPatch.context() as mp:  # inference: torch.addmm (MKL), bit for bit
            mp.setattr(lin_module, "_linear_op", lambda *a, real=lin_module._linear_op: calls.append(2) or real(*a))
            assert torch.equal(projection(*ins, backend=backend), torch.addmm(ins[2], ins[0], ins[1]))
        assert 2 not in calls
        low = [t.to(dt).clone().requires_grad_() for t in base]
        ref = torch.addmm(low[2], low[0], low[1])
        gref = torch.autograd.grad(ref, low, up.to(dt))
        assert_close_to_oracle(got, ref64, ref, "projection")
        wanted = [(c, d, k) for k, (c, d, w) in enumerate(zip(gref64, gref, wants)) if w]
        for a, (c, d, k) in zip(ggot, wanted, strict=True):
            assert_close_to_oracle(a, c, d, f"projection grad {k}")


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "empty"])
def test_linear_cpu_operators_pass_opcheck(layout):
    """The projection's operators: fakes, schemas and autograd registration (torch.library.opcheck), with a
    transposed input and with no rows."""
    from elmo_fast.cpu import linear as lin

    g = torch.Generator().manual_seed(12)
    F_, P_, N = 24, 16, 0 if layout == "empty" else 37
    x = torch.randn(F_, N, generator=g).t() if layout == "transposed" else torch.randn(N, F_, generator=g)
    w, b = torch.randn(F_, P_, generator=g) * 0.2, torch.randn(P_, generator=g)
    torch.library.opcheck(lin._linear_op, (x.clone().requires_grad_(), w.clone().requires_grad_(),
                                           b.clone().requires_grad_()))
    for needs in ((True, True, True), (False, True, False), (True, False, True)):
        torch.library.opcheck(lin._linear_backward, (torch.randn(N, P_, generator=g), x, w, *needs))


def test_projection_keeps_addmm_under_cpu_autocast(monkeypatch):
    """Under CPU autocast the projection is torch.addmm's, in the autocast dtype, as before the operator (whose
    products on oneDNN would come back fp32)."""
    from elmo_fast.ops import projection

    monkeypatch.setenv("ELMO_FAST_CPU_GEMM", "onednn")
    x, w, b = (torch.randn(*s).requires_grad_() for s in ((5, 8), (8, 4), (4,)))  # training: else addmm anyway
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = projection(x, w, b, backend="cpu")
        want = torch.addmm(b, x, w)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
