"""The reference engine against hand-computed cases and an independent NumPy oracle."""
import copy
import math
import sys

import numpy as np
import pytest
import torch

import elmo_fast
from elmo_fast.reference import (
    char_cnn_reference,
    highway_reference,
    lstmp_reference,
    scalar_mix_reference,
    token_encoder_reference,
)
from elmo_fast.testing import TINY_OPTIONS, write_random_model
from naive_numpy import NaiveBiLM, sigmoid


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def _one_step(a, b, forget_bias=1.0, c0=0.5, x=1.0, cell_clip=None, proj_clip=None, w_proj=None):
    """D=1, H=1 cell; w_in = a (4 gate coefficients in TF order i, j, f, o), bias = b."""
    w_in = torch.tensor([a], dtype=torch.float64)
    bias = torch.tensor(b, dtype=torch.float64)
    w_rec = torch.zeros(1 if w_proj is None else w_proj.shape[1], 4, dtype=torch.float64)
    P = 1 if w_proj is None else w_proj.shape[1]
    y, h, c = lstmp_reference(torch.tensor([[[x]]], dtype=torch.float64), w_in, w_rec, bias, w_proj,
                              torch.zeros(1, P, dtype=torch.float64), torch.tensor([[c0]], dtype=torch.float64),
                              torch.tensor([1]), cell_clip=cell_clip, proj_clip=proj_clip, forget_bias=forget_bias)
    return y.item() if P == 1 else y, h, c.item()


def test_gate_order_and_forget_bias_by_hand():
    a, b = [0.3, -0.7, 0.2, 1.1], [0.05, 0.1, -0.2, 0.3]
    zi, zj, zf, zo = (a[k] + b[k] for k in range(4))
    c = sig(zf + 1.0) * 0.5 + sig(zi) * math.tanh(zj)
    h = sig(zo) * math.tanh(c)
    y, _, c_out = _one_step(a, b)
    assert c_out == pytest.approx(c, abs=1e-14)
    assert y == pytest.approx(h, abs=1e-14)
    # swapping i/f or j/o (PyTorch order) would give a different value
    c_torch_order = sig(zj + 1.0) * 0.5 + sig(zi) * math.tanh(zf)
    assert abs(c_out - c_torch_order) > 1e-3
    # the forget bias is added at run time, not stored
    _, _, c_nofb = _one_step(a, b, forget_bias=0.0)
    assert c_nofb == pytest.approx(sig(zf) * 0.5 + sig(zi) * math.tanh(zj), abs=1e-14)


def test_cell_clip_and_proj_clip_by_hand():
    a, b = [5.0, 5.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.0]
    _, _, c = _one_step(a, b, c0=2.9, cell_clip=3.0)
    assert c == 3.0  # 2.9*σ(6) + σ(5)tanh(5) > 3 -> clipped
    _, _, c_free = _one_step(a, b, c0=2.9)
    assert c_free > 3.0
    w_proj = torch.tensor([[10.0, -0.1]], dtype=torch.float64)  # H=1 -> P=2
    # a projected cell with P=2 needs a 2-wide recurrent weight; h0 = 0 so it does not matter
    y, h, _ = _one_step(a, b, c0=0.0, cell_clip=3.0, proj_clip=3.0, w_proj=w_proj)
    m = sig(5.0) * math.tanh(min(sig(6.0) * 0.0 + sig(5.0) * math.tanh(5.0), 3.0))
    assert h[0, 0].item() == 3.0  # 10*m > 3 -> clipped
    assert h[0, 1].item() == pytest.approx(-0.1 * m, abs=1e-14)
    # the output uses the clipped value; state h too
    assert y[0, 0, 0].item() == 3.0


def test_residual_rule_and_padding():
    torch.manual_seed(0)
    B, T, P, H = 3, 5, 4, 6
    x = torch.randn(B, T, P, dtype=torch.float64)
    args = (torch.randn(P, 4 * H, dtype=torch.float64), torch.randn(P, 4 * H, dtype=torch.float64),
            torch.randn(4 * H, dtype=torch.float64), torch.randn(H, P, dtype=torch.float64),
            torch.randn(B, P, dtype=torch.float64), torch.randn(B, H, dtype=torch.float64))
    lengths = torch.tensor([5, 2, 0])
    y0, h0, c0 = lstmp_reference(x, *args, lengths, cell_clip=3.0, proj_clip=3.0)
    y1, h1, c1 = lstmp_reference(x, *args, lengths, cell_clip=3.0, proj_clip=3.0, residual=True)
    valid = (torch.arange(T)[None] < lengths[:, None]).unsqueeze(-1)
    torch.testing.assert_close(y1, (y0 + x) * valid)  # residual adds the input at valid positions only
    assert torch.equal(h0, h1) and torch.equal(c0, c1)  # the state is the pure LSTMP output
    assert torch.all(y0[1, 2:] == 0) and torch.all(y0[2] == 0)
    # a row of length 0 keeps its initial state
    assert torch.equal(h0[2], args[4][2]) and torch.equal(c0[2], args[5][2])


def _naive_chain(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, reverse, cell_clip, proj_clip):
    B, T, _ = x.shape
    H = c0.shape[1]
    ys = np.zeros((B, T, h0.shape[1]))
    hs, cs = h0.copy(), c0.copy()
    for b in range(B):
        h, c = h0[b], c0[b]
        steps = range(lengths[b] - 1, -1, -1) if reverse else range(lengths[b])
        for t in steps:
            z = x[b, t] @ w_in + h @ w_rec + bias
            i, j, f, o = z[:H], z[H:2 * H], z[2 * H:3 * H], z[3 * H:]
            c = np.clip(sigmoid(f + 1) * c + sigmoid(i) * np.tanh(j), -cell_clip, cell_clip)
            h = np.clip((sigmoid(o) * np.tanh(c)) @ w_proj, -proj_clip, proj_clip)
            ys[b, t] = h
        hs[b], cs[b] = h, c
    return ys, hs, cs


@pytest.mark.parametrize("reverse", [False, True])
def test_lstmp_against_per_row_loop(reverse):
    rng = np.random.default_rng(1)
    B, T, D, H, P = 4, 7, 5, 6, 3
    arrs = [rng.normal(size=s) for s in [(B, T, D), (D, 4 * H), (P, 4 * H), (4 * H,), (H, P), (B, P), (B, H)]]
    lengths = np.array([3, 7, 0, 5])
    ref = _naive_chain(*arrs, lengths, reverse, 0.8, 0.5)
    got = lstmp_reference(*[torch.from_numpy(a) for a in arrs], torch.from_numpy(lengths), cell_clip=0.8,
                          proj_clip=0.5, reverse=reverse)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g.numpy(), r, atol=1e-12)


def test_gradcheck_reference_ops_fp64():
    torch.manual_seed(0)
    dd = dict(dtype=torch.float64, requires_grad=True)
    B, T, P, H = 2, 3, 2, 3
    x = torch.randn(B, T, P, **dd)
    w_in, w_rec = torch.randn(P, 4 * H, **dd), torch.randn(P, 4 * H, **dd)
    bias, w_proj = torch.randn(4 * H, **dd), torch.randn(H, P, **dd)
    h0, c0 = torch.randn(B, P, **dd), torch.randn(B, H, **dd)
    lengths = torch.tensor([3, 2])

    def f(*a):
        y, h, c = lstmp_reference(*a, lengths, cell_clip=10.0, proj_clip=10.0, residual=True, reverse=True)
        return y, h, c

    assert torch.autograd.gradcheck(f, (x, w_in, w_rec, bias, w_proj, h0, c0))
    v = torch.randn(4, 5, **dd)
    wc, wt = torch.randn(5, 5, **dd), torch.randn(5, 5, **dd)
    bc, bt = torch.randn(5, **dd), torch.randn(5, **dd)
    assert torch.autograd.gradcheck(highway_reference, (v, wc, bc, wt, bt))
    emb = torch.randn(262, 3, **dd)
    ws = [torch.randn(2, 3, 4, **dd), torch.randn(3, 3, 2, **dd)]
    bs = [torch.randn(4, **dd), torch.randn(2, **dd)]
    ids = torch.tensor([elmo_fast.word_to_char_ids(w, 10) for w in ["ab", "cde", "ab"]])
    assert torch.autograd.gradcheck(lambda e, *p: char_cnn_reference(ids, e, list(p[:2]), list(p[2:]), "tanh"),
                                    (emb, *ws, *bs))
    layers = [torch.randn(2, 3, 4, **dd) for _ in range(3)]
    w, g = torch.randn(3, **dd), torch.tensor(1.3, **dd)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    def mix(*a):
        return scalar_mix_reference(list(a[:3]), a[3], a[4], mask, True)

    assert torch.autograd.gradcheck(mix, (*layers, w, g))


def test_scalar_mix_values():
    """Hand-computed: softmax weights, gamma, and the whole-tensor masked normalisation."""
    t1 = torch.tensor([[[1.0, 2.0], [3.0, 100.0]]])
    t2 = torch.tensor([[[0.0, 1.0], [2.0, -50.0]]])
    mask = torch.tensor([[True, False]])
    w, g = torch.tensor([0.1, 0.5]), torch.tensor(1.1)
    s = torch.softmax(w, 0)
    out = scalar_mix_reference([t1, t2], w, g, mask, do_layer_norm=False)
    torch.testing.assert_close(out, 1.1 * (s[0] * t1 + s[1] * t2))
    out = scalar_mix_reference([t1, t2], w, g, mask, do_layer_norm=True, eps=1e-13)
    n1 = (t1 - 1.5) / math.sqrt(0.25 + 1e-13)  # statistics over the masked elements only (1, 2)
    n2 = (t2 - 0.5) / math.sqrt(0.25 + 1e-13)
    torch.testing.assert_close(out, 1.1 * (s[0] * n1 + s[1] * n2))
    mix = elmo_fast.ScalarMix(2, initial_scalar_parameters=[0.1, 0.5], trainable=False)
    assert not mix.gamma.requires_grad and mix.gamma.item() == 1.0
    torch.testing.assert_close(mix([t1, t2]), s[0] * t1 + s[1] * t2)


def test_scalar_mix_errors_are_allennlp_s_configuration_error_when_it_is_loaded(monkeypatch):
    """Without allennlp a plain ValueError; with a module ``allennlp.common.checks`` loaded (a stand-in here: the
    parity suite checks the real one), also its ConfigurationError, with the message."""
    import types

    import importlib.util

    import elmo_fast.util

    monkeypatch.delitem(sys.modules, "allennlp.common.checks", raising=False)
    with pytest.raises(ValueError, match="ScalarMix has 3 weights but got 2 tensors") as caught:
        elmo_fast.ScalarMix(3)([torch.zeros(1)] * 2)
    assert type(caught.value) is ValueError
    if importlib.util.find_spec("allennlp") is None:  # probing the attribute must not raise ImportError
        monkeypatch.delitem(vars(elmo_fast.util), "ConfigurationError", raising=False)
        assert not hasattr(elmo_fast.util, "ConfigurationError")

    class StandIn(Exception):
        def __init__(self, message):
            super().__init__()
            self.message = message

        def __str__(self):
            return self.message

    monkeypatch.setitem(sys.modules, "allennlp.common.checks", types.SimpleNamespace(ConfigurationError=StandIn))
    with pytest.raises(StandIn, match=r"initial_scalar_parameters has 2 values, expected 3") as caught:
        elmo_fast.ScalarMix(3, initial_scalar_parameters=[0.0, 1.0])
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("skip", [True, False])
def test_bilm_against_numpy_oracle_stateful(tmp_path, skip):
    opts = copy.deepcopy(TINY_OPTIONS)
    opts["lstm"]["use_skip_connections"] = skip
    opts["lstm"]["dim"] = 12
    opts["lstm"]["projection_dim"] = 6
    opts["char_cnn"]["filters"] = [[1, 4], [2, 3], [3, 5]]
    o, w = write_random_model(tmp_path, opts, seed=3, scale=2.0)
    arrays = elmo_fast.read_weights(w, elmo_fast.ElmoOptions.from_dict(opts))
    naive = NaiveBiLM(arrays, opts)
    model = elmo_fast.BiLM.from_files(o, w, backend="reference").double()
    batcher = elmo_fast.Batcher()
    batches = [[["The", "cat", "sat"], ["A"], ["Un", "été", "très", "chaud", "."]],
               [["Dogs", "bark"], []],
               [["x" * 55], ["Yes", "no"], ["ok"], ["final", "one"]]]
    for sents in batches:
        ids = batcher.batch_sentences(sents)
        got = model(ids)
        ref = naive.run([ids[k, : len(s) + 2].numpy() for k, s in enumerate(sents)])
        for k, s in enumerate(sents):
            n = len(s) + 2
            for layer in range(3):
                np.testing.assert_allclose(got["activations"][layer][k, :n].detach().numpy(),
                                           np.stack(ref[k][layer]), atol=1e-10)
            assert torch.all(got["activations"][1][k, n:] == 0)


def test_token_encoder_reference_matches_module(tmp_path):
    o, w = write_random_model(tmp_path)
    bilm = elmo_fast.BiLM.from_files(o, w, backend="reference")
    enc = bilm.token_encoder
    params = {"char_embed": enc.padded_char_embed(), "conv_weights": list(enc.conv_w), "conv_biases": list(enc.conv_b),
              "highway": [(h.W_carry, h.b_carry, h.W_transform, h.b_transform) for h in enc.highway],
              "proj": (enc.W_proj, enc.b_proj)}
    ids = elmo_fast.Batcher().batch_sentences([["a", "b", "a"], ["c"]])
    torch.testing.assert_close(token_encoder_reference(ids, params, "relu"), enc(ids))


@pytest.mark.parametrize("change, err, msg", [
    (dict(lengths=torch.tensor([1, 5])), ValueError, r"lengths must lie in \[0, T=3\], got \[1, 5\]"),
    (dict(lengths=torch.tensor([1.0, 2.0])), TypeError, "integer tensor"),
    (dict(h0=torch.zeros(3, 2)), ValueError, r"h0 must have shape \(2, 2\)"),
    (dict(w_rec=torch.zeros(2, 9)), ValueError, r"w_rec must have shape \(2, 8\)"),
])
def test_lstmp_op_validates_inputs(change, err, msg):
    from elmo_fast.ops import lstmp

    args = dict(x=torch.zeros(2, 3, 4), w_in=torch.zeros(4, 8), w_rec=torch.zeros(2, 8), bias=torch.zeros(8),
                w_proj=torch.zeros(2, 2), h0=torch.zeros(2, 2), c0=torch.zeros(2, 2), lengths=torch.tensor([1, 3]))
    args.update(change)
    with pytest.raises(err, match=msg):
        lstmp(**args, backend="reference")


def test_scalar_mix_names_wrong_inputs():
    """Tensors of different shapes, a non-tensor, a layer-norm mask of another shape (a (1, T) or (B, 1) mask
    broadcast and gave wrong statistics), a mixture size below 1."""
    layers = [torch.randn(2, 3, 4) for _ in range(2)]
    mix = elmo_fast.ScalarMix(2, do_layer_norm=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert mix(layers, mask).shape == (2, 3, 4)
    for bad in ([layers[0], torch.randn(2, 3, 5)], [layers[0], 1.0]):
        with pytest.raises(ValueError, match="ScalarMix mixes tensors of one shape, got"):
            mix(bad, mask)
    for bad_mask in (mask[:1], mask[:, :1]):
        with pytest.raises(ValueError, match=r"the mask must have the layers' shape without the feature axis, "
                                             r"\(2, 3\)"):
            mix(layers, bad_mask)
    for size in (0, -1, 1.5):
        with pytest.raises(ValueError, match="ScalarMix's mixture_size must be an integer >= 1"):
            elmo_fast.ScalarMix(size)
