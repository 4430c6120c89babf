"""The char CNN's max over windows in elmo_fast._cpu (csrc/cpu/char_cnn.cpp) and its sparse backward, against the
reference on fresh inputs, with ties (repeated characters, all-padding windows) where the gradient is shared."""
from __future__ import annotations

import pytest
import torch

import elmo_fast
from elmo_fast.cpu import char_cnn as C
from elmo_fast.cpu.ext import cpu_ext
from elmo_fast.reference import char_cnn_reference


from conftest import isa_chosen, poison_allocations
from test_cpu_backend import assert_close_to_oracle

ext = cpu_ext()
pytestmark = pytest.mark.skipif(ext is None or not hasattr(ext, "conv_max_backward"),
                                reason="needs elmo_fast._cpu with csrc/cpu/char_cnn.cpp")

# ties everywhere: one repeated letter, a long word cut at 50 characters, alternating letters, short words whose
# bucket mates are long (their all-padding windows are inside the bucket's convolution), and padding tokens
WORDS = ["aaaa", "x" * 60, "abab", "internationalization", "a", "to", "bb", "é", "<S>", "Mississippi", "zzzzzzzzzz"]


@pytest.fixture(params=["scalar", "avx512"])
def isa(request):
    with isa_chosen(ext, request.param):
        yield request.param


def _params(seed, d, filters):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).float().requires_grad_()

    emb = rnd(262, d)
    emb.detach()[0] = 0.0
    return [emb, *(rnd(w, d, n) for w, n in filters), *(rnd(n) for _, n in filters)]


def _ids():
    return torch.tensor([elmo_fast.word_to_char_ids(w) for w in WORDS] + [[0] * 50, [0] * 50])


@pytest.mark.parametrize("d", [16, 5])  # 16: the kernel's fixed-width loop (the original model), else any width
@pytest.mark.parametrize("act", ["relu", "tanh"])
@pytest.mark.parametrize("bucket", [512, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_sparse_backward_matches_the_reference(isa, d, act, bucket, seed, monkeypatch):
    filters = [(1, 6), (2, 5), (3, 7), (7, 20)]
    k = len(filters)
    params = _params(seed, d, filters)
    ids = _ids()
    up = torch.randn(len(ids), sum(n for _, n in filters), generator=torch.Generator().manual_seed(seed + 7))
    calls = []

    def run(fn, ps):
        out = fn(ids, ps[0], list(ps[1 : 1 + k]), list(ps[1 + k :]), act)
        return out, torch.autograd.grad(out, ps, up)

    monkeypatch.setattr(C, "_BUCKET", bucket)
    p64 = [p.detach().double().requires_grad_() for p in params]
    ref64, g64 = run(char_cnn_reference, p64)
    ref, gref = run(char_cnn_reference, params)
    with monkeypatch.context() as mp:
        poison_allocations(mp, int_fill=-1)  # an element the kernels do not write fails
        mp.setattr(C, "cpu_ext", lambda: _Spy(ext, calls))
        got, ggot = run(C.char_cnn_cpu, params)
    assert calls, "the sparse backward did not run"
    assert_close_to_oracle(got, ref64, ref, "char_cnn")
    for i, (a, b, c) in enumerate(zip(ggot, g64, gref)):
        if i == 0:  # row 0 is the model's constant "no token" row: the cpu path never reads it
            a, b, c = a[1:], b[1:], c[1:]
        assert_close_to_oracle(a, b, c, f"grad {i}")


class _Spy:
    """The extension, counting conv_max_backward's calls."""

    def __init__(self, ext_, calls):
        self._ext, self._calls = ext_, calls

    def __getattr__(self, name):
        attr = getattr(self._ext, name)
        if name == "conv_max_backward":
            def counted(*a):
                self._calls.append(name)
                return attr(*a)
            return counted
        return attr


def test_ties_share_the_gradient_evenly(isa):
    """One width-1 filter over "aaaa": the four windows tie, so each gets a quarter (TF's reduce_max, torch's
    amax); the gradient of the table row of 'a' is then the whole upstream gradient times the filter."""
    emb = torch.zeros(262, 2)
    emb[ord("a") + 1] = torch.tensor([1.0, 2.0])
    emb[259 + 1] = torch.tensor([-5.0, -5.0])  # begin/end-of-word characters lose the max
    emb[258 + 1] = torch.tensor([-5.0, -5.0])
    emb.requires_grad_()
    w = torch.tensor([[[1.0], [1.0]]], requires_grad=True)  # (1, 2, 1)
    b = torch.zeros(1, requires_grad=True)
    ids = torch.tensor([elmo_fast.word_to_char_ids("aaaa")])
    out = C.char_cnn_cpu(ids, emb, [w], [b], "tanh")
    up = torch.tensor([[2.0]])
    ge, gw, gb = torch.autograd.grad(out, [emb, w, b], up)
    dm = 2.0 * (1 - torch.tanh(torch.tensor(3.0)) ** 2)
    assert torch.allclose(ge[ord("a") + 1], dm * torch.tensor([1.0, 1.0]))
    assert torch.allclose(gw[0, :, 0], dm * torch.tensor([1.0, 2.0]))
    assert torch.allclose(gb, dm.reshape(1))


def test_a_nan_window_gives_a_nan_gradient(isa):
    """A NaN in the table reaches the output and, through the backward, the bias and weight gradients: never a
    finite, silently wrong gradient."""
    params = _params(3, 4, [(2, 3)])
    with torch.no_grad():
        params[0][ord("q") + 1, 0] = float("nan")
    ids = _ids()[:1].clone()
    ids[0, 3] = ord("q") + 1
    out = C.char_cnn_cpu(ids, params[0], [params[1]], [params[2]], "tanh")
    assert torch.isnan(out).all()
    ge, gw, gb = torch.autograd.grad(out.sum(), params)
    assert torch.isnan(gb).all() and torch.isnan(gw).all()
    assert torch.isnan(ge[ids[0]]).all()  # the table rows of the token's characters, as the dense backward's


@pytest.mark.parametrize("L", [64, 70])
def test_long_tokens(isa, L, monkeypatch):
    """64 characters: 64 windows for the width-1 filter, a token with no padding (every window real); past 64 windows
    the masks cannot hold them and the autograd path runs."""
    filters = [(1, 5), (3, 4)]
    params = _params(5, 16, filters)
    words = ["y" * (L - 2), "ab" * 40, "short", "x"]
    ids = torch.tensor([elmo_fast.word_to_char_ids(w, L) for w in words])
    up = torch.randn(len(words), 9, generator=torch.Generator().manual_seed(L))
    calls = []
    monkeypatch.setattr(C, "cpu_ext", lambda: _Spy(ext, calls))

    def run(fn, ps):
        out = fn(ids, ps[0], ps[1:3], ps[3:], "tanh")
        return out, torch.autograd.grad(out, ps, up)

    p64 = [p.detach().double().requires_grad_() for p in params]
    ref64, g64 = run(char_cnn_reference, p64)
    ref, gref = run(char_cnn_reference, params)
    got, ggot = run(C.char_cnn_cpu, params)
    assert bool(calls) == (L <= 64)
    assert_close_to_oracle(got, ref64, ref, "char_cnn")
    for i, (a, b, c) in enumerate(zip(ggot, g64, gref)):
        if i == 0:
            a, b, c = a[1:], b[1:], c[1:]
        assert_close_to_oracle(a, b, c, f"grad {i}")


def test_double_backward_is_refused():
    params = _params(6, 4, [(2, 3)])
    out = C.char_cnn_cpu(_ids(), params[0], [params[1]], [params[2]], "tanh")
    (gw,) = torch.autograd.grad(out.sum(), [params[1]], create_graph=True)
    assert gw.requires_grad  # a graph that refuses, not a silently constant gradient
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gw.sum().backward()


def test_kernel_arguments_are_checked():
    ids = torch.zeros(2, 10, dtype=torch.int32)
    table, wt = torch.zeros(262, 4), torch.zeros(3, 2, 4)
    g, bits = torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.long)
    dwt, dtab, db = torch.empty_like(wt), torch.zeros_like(table), torch.empty(3)
    ext.conv_max_backward(ids, table, 261, wt, g, bits, dwt, dtab, db)
    bad = ids.clone()
    bad[1, 4] = 262
    with pytest.raises(RuntimeError, match="char id 262 is not a row of the 262-row table"):
        ext.conv_max_backward(bad, table, 261, wt, g, bits, dwt, dtab, db)
    with pytest.raises(RuntimeError, match="bits name a window past the 9"):
        ext.conv_max_backward(ids, table, 261, wt, g, torch.full((3, 2), 1 << 9), dwt, dtab, db)
    with pytest.raises(RuntimeError, match="ids must be a contiguous 2-d CPU int32"):
        ext.conv_max_backward(ids.long(), table, 261, wt, g, bits, dwt, dtab, db)
    y = torch.zeros(2, 3, 4)
    with pytest.raises(RuntimeError, match="pv is needed when P < n_win"):
        ext.conv_max(y, None, 6, torch.empty(2, 3), torch.empty(3, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"need 1 <= P \(4\) <= n_win \(65\) <= 64"):
        ext.conv_max(y, torch.zeros(3), 65, torch.empty(2, 3), torch.empty(3, 2, dtype=torch.long))


def test_inference_and_fp64_keep_autograd_path(monkeypatch):
    """Without a gradient, or in fp64, the extension's max is not used (the forward is the same either way)."""
    used = []
    monkeypatch.setattr(C._ConvMax, "apply", lambda *a: used.append(1))
    params = _params(0, 4, [(1, 3), (2, 4)])
    with torch.no_grad():
        C.char_cnn_cpu(_ids(), params[0], params[1:3], params[3:], "relu")
    p64 = [p.detach().double().requires_grad_() for p in params]
    C.char_cnn_cpu(_ids(), p64[0], p64[1:3], p64[3:], "relu")
    assert not used


@pytest.mark.parametrize("bucket", [512, 1])
def test_tokens_of_padding_characters_only(bucket, monkeypatch):
    """Raw ids may hold a token of padding characters only (every window all padding): alone in its bucket it used
    to reach a convolution over no positions."""
    monkeypatch.setattr(C, "_BUCKET", bucket)
    params = _params(7, 4, [(1, 3), (2, 4)])
    ids = torch.tensor([[261] * 50, elmo_fast.word_to_char_ids("ab"), [0] * 50])
    up = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    for rows in (ids[:1], ids):
        p64 = [p.detach().double().requires_grad_() for p in params]
        ref64 = char_cnn_reference(rows, p64[0], p64[1:3], p64[3:], "tanh")
        ref = char_cnn_reference(rows, params[0], params[1:3], params[3:], "tanh")
        got = C.char_cnn_cpu(rows, params[0], params[1:3], params[3:], "tanh")
        assert_close_to_oracle(got, ref64, ref, "char_cnn")
        g64 = torch.autograd.grad(ref64, p64, up[: len(rows)].double())
        gref = torch.autograd.grad(ref, params, up[: len(rows)])
        ggot = torch.autograd.grad(got, params, up[: len(rows)])
        for i, (a, b, c) in enumerate(zip(ggot, g64, gref)):
            assert_close_to_oracle(a[1:] if i == 0 else a, b[1:] if i == 0 else b, c[1:] if i == 0 else c, f"grad {i}")
