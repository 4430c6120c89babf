"""``elmo_fast.LSTMP`` against ``torch.nn.LSTM`` with the same weights (clips off, forget bias 0): outputs, final
states and every gradient (input, h0, c0, every weight) within 1e-12 in fp64 and 1e-5 in fp32, on the reference,
cpu and Triton (``triton_device()``: CUDA, or the CPU under the interpreter) backends; packed unsorted lengths,
batch_first both ways, bidirectional, 3 layers, proj_size 0 and > 0. Then the state_dict both ways, the layout
cache, the ELMo extras and the errors."""

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import elmo_fast
from conftest import poison_allocations, triton_available, triton_device
from elmo_fast.modules import lstmp_layer
from elmo_fast.reference.lstmp import lstmp_reference

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
BACKENDS = ["reference", "cpu", pytest.param("triton", marks=[pytest.mark.triton, pytest.mark.skipif(
    not triton_available(), reason="needs triton and a GPU, or TRITON_INTERPRET=1")])]


@pytest.fixture(autouse=True)
def _nan_poison(monkeypatch):
    """torch.empty / empty_like / new_empty start as NaN: an element no kernel writes cannot pass."""
    poison_allocations(monkeypatch)


def _run(module, x, hx, lengths, batch_first, weights):
    """Outputs (data, h_n, c_n) and the gradients of a fixed random-weighted sum of them w.r.t. x, h0, c0 and every
    parameter; packed when ``lengths`` is given."""
    x = x.clone().requires_grad_()
    h0, c0 = (s.clone().requires_grad_() for s in hx)
    inp = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False) if lengths is not None else x
    y, (h_n, c_n) = module(inp, (h0, c0))
    data = y.data if isinstance(y, PackedSequence) else y
    loss = sum((o * w).sum() for o, w in zip((data, h_n, c_n), weights(data, h_n, c_n)))
    grads = torch.autograd.grad(loss, [x, h0, c0, *module.parameters()])
    return [data, h_n, c_n, *grads]


def _fixed_weights():
    cache = {}

    def weights(*outs):  # the same upstream gradients for both modules
        key = tuple(tuple(o.shape) for o in outs)
        if key not in cache:
            g = torch.Generator().manual_seed(7)
            cache[key] = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]  # on the CPU
        return [w.to(o.device) for w, o in zip(cache[key], outs)]

    return weights


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("proj_size", [0, 3], ids=["plain-lstm", "proj"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time-major", "batch-first"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed-unsorted", "padded"])
def test_matches_nn_lstm(backend, dtype, proj_size, batch_first, packed):
    torch.manual_seed(0)
    B, T, D, H = 4, 6, 5, 8
    lstm = torch.nn.LSTM(D, H, num_layers=3, bidirectional=True, proj_size=proj_size, batch_first=batch_first,
                         dtype=dtype)
    dev = triton_device() if backend == "triton" else "cpu"
    model = elmo_fast.LSTMP.from_lstm(lstm, backend=backend).to(dev)
    x = torch.randn((B, T, D) if batch_first else (T, B, D), dtype=dtype)
    P = proj_size or H
    hx = (torch.randn(6, B, P, dtype=dtype), torch.randn(6, B, H, dtype=dtype))
    lengths = torch.tensor([3, T, 1, 5]) if packed else None
    weights = _fixed_weights()
    want = _run(lstm, x, hx, lengths, batch_first, weights)
    got = [t.cpu() for t in _run(model, x.to(dev), tuple(s.to(dev) for s in hx), lengths, batch_first, weights)]
    names = ["output", "h_n", "c_n", "d input", "d h0", "d c0", *(f"d {n}" for n, _ in lstm.named_parameters())]
    for name, a, b in zip(names, want, got, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(b, a, atol=TOL[dtype], rtol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_unbatched_input_and_default_state(bidirectional):
    torch.manual_seed(1)
    lstm = torch.nn.LSTM(3, 5, num_layers=2, bidirectional=bidirectional, proj_size=2, dtype=torch.float64)
    model = elmo_fast.LSTMP.from_lstm(lstm)
    for x in (torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, 3, dtype=torch.float64)):
        (y1, (h1, c1)), (y2, (h2, c2)) = lstm(x), model(x)
        for a, b in ((y1, y2), (h1, h2), (c1, c2)):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
    x = torch.randn(4, 3, dtype=torch.float64)
    hx = (torch.randn(2 * (1 + bidirectional), 2, dtype=torch.float64),
          torch.randn(2 * (1 + bidirectional), 5, dtype=torch.float64))
    torch.testing.assert_close(model(x, hx)[0], lstm(x, hx)[0], atol=1e-12, rtol=0)


def test_dropout_masks_are_nn_lstms():
    """In training, dropout acts between layers with the masks nn.LSTM's CPU kernels draw for the same seed."""
    lstm = torch.nn.LSTM(5, 6, num_layers=3, bidirectional=True, proj_size=3, dropout=0.3, dtype=torch.float64)
    model = elmo_fast.LSTMP.from_lstm(lstm)
    x = torch.randn(7, 4, 5, dtype=torch.float64)
    torch.manual_seed(5)
    want = lstm(x)[0]
    torch.manual_seed(5)
    got = model(x)[0]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert not torch.allclose(model.eval()(x)[0], got)


def test_parameters_and_state_dict_are_nn_lstms():
    lstm = torch.nn.LSTM(5, 8, num_layers=2, bidirectional=True, proj_size=3)
    model = elmo_fast.LSTMP(5, 8, num_layers=2, bidirectional=True, proj_size=3)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in lstm.named_parameters()]
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert list(model.state_dict()) == list(lstm.state_dict())
    model.load_state_dict(lstm.state_dict())  # both ways, strict
    lstm.load_state_dict(elmo_fast.LSTMP.from_lstm(lstm).state_dict())
    back = model.to_lstm()
    assert isinstance(back, torch.nn.LSTM)
    for (n, a), (_, b) in zip(lstm.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    no_bias = torch.nn.LSTM(5, 8, bias=False)
    assert list(elmo_fast.LSTMP.from_lstm(no_bias).state_dict()) == list(no_bias.state_dict())


def test_to_lstm_refuses_the_extras():
    with pytest.raises(ValueError, match="cell_clip, forget_bias"):
        elmo_fast.LSTMP(4, 6, cell_clip=3.0, forget_bias=1.0).to_lstm()
    with pytest.raises(ValueError, match="nn.LSTM has no proj_clip"):  # a clip of 0 clips everything to 0
        elmo_fast.LSTMP(4, 6, proj_size=2, proj_clip=0.0).to_lstm()


def test_layout_is_converted_once_per_parameter_version(monkeypatch):
    """The TF-layout copies are made on the first call and after each optimizer step, not per call; the step's
    gradients reach the parameters (the result follows nn.LSTM trained the same way)."""
    calls = []
    real = lstmp_layer._w_to_tf
    monkeypatch.setattr(lstmp_layer, "_CONVERSIONS", dict(lstmp_layer._CONVERSIONS, w_in=(
        lambda w: calls.append(1) or real(w), lstmp_layer._w_grad)))
    torch.manual_seed(2)
    lstm = torch.nn.LSTM(4, 6, num_layers=2, proj_size=3, dtype=torch.float64)
    model = elmo_fast.LSTMP.from_lstm(lstm, backend="cpu")
    x = torch.randn(5, 2, 4, dtype=torch.float64)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (lstm, model)]
    for step in range(3):
        for _ in range(2):  # two calls per version
            outs = [m(x)[0] for m in (lstm, model)]
        torch.testing.assert_close(outs[1], outs[0], atol=1e-12, rtol=0)
        assert len(calls) == 2 * (step + 1)  # one w_in per layer per version
        for o, opt in zip(outs, opts):
            opt.zero_grad()
            o.square().sum().backward()
            opt.step()


def test_autocast_runs_low_precision_with_fp32_master_weights():
    torch.manual_seed(3)
    model = elmo_fast.LSTMP(6, 8, num_layers=2, proj_size=4, backend="reference")
    x = torch.randn(5, 3, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, (h, c) = model(x)
    assert y.dtype == torch.bfloat16 and h.dtype == c.dtype == torch.float32
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    ref = model(x)[0]
    assert (y.float() - ref).abs().max() < 0.05


def test_extras_match_the_tf_chain():
    """cell/projection clipping, the forget bias and residual layers are those of the biLM's chain
    (``lstmp_reference`` on the converted weights, the residual adding each layer's input)."""
    torch.manual_seed(4)
    model = elmo_fast.LSTMP(4, 6, num_layers=3, proj_size=4, batch_first=True, dtype=torch.float64, cell_clip=0.5,
                            proj_clip=0.2, forget_bias=1.0, residual=True)
    x = torch.randn(2, 5, 4, dtype=torch.float64) * 3
    y, (h_n, c_n) = model(x)
    inp = x
    lengths = torch.tensor([5, 5])
    for layer in range(3):
        w_ih, w_hh, b_ih, b_hh, w_hr = (getattr(model, f"{n}_l{layer}") for n in
                                         ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr"))
        sw = lstmp_layer._swap_gates
        out, h, c = lstmp_reference(inp, sw(w_ih).t(), sw(w_hh).t(), sw(b_ih + b_hh), w_hr.t(),
                                    torch.zeros(2, 4, dtype=x.dtype), torch.zeros(2, 6, dtype=x.dtype), lengths,
                                    cell_clip=0.5, proj_clip=0.2, forget_bias=1.0)
        torch.testing.assert_close(h_n[layer], h, atol=1e-12, rtol=0)
        torch.testing.assert_close(c_n[layer], c, atol=1e-12, rtol=0)
        inp = out + inp if layer > 0 else out
    torch.testing.assert_close(y, inp, atol=1e-12, rtol=0)
    assert c_n.abs().max() <= 0.5 and h_n.abs().max() <= 0.2


@pytest.mark.parametrize("make, match", [
    (lambda: elmo_fast.LSTMP(4, 6, proj_size=6), r"proj_size must lie in \[0, hidden_size=6\)"),
    (lambda: elmo_fast.LSTMP(4, 6, dropout=1.5), "dropout must be a probability"),
    (lambda: elmo_fast.LSTMP(4, 6, proj_clip=1.0), "proj_clip clips the projection"),
    (lambda: elmo_fast.LSTMP(4, 6, backend="gpu"), "is not a backend"),
    (lambda: elmo_fast.LSTMP(4, 6, cell_clip=float("nan")), "cell_clip must be None or a number >= 0, got nan"),
    (lambda: elmo_fast.LSTMP(4, 6, proj_size=3, proj_clip=float("nan")), "proj_clip must be None or a number >= 0"),
    (lambda: elmo_fast.LSTMP(4, 6, forget_bias=float("nan")), "forget_bias must be a finite number, got nan"),
])
def test_constructor_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_forward_errors():
    model = elmo_fast.LSTMP(4, 6, num_layers=2)
    with pytest.raises(ValueError, match=r"input.size\(-1\) must be input_size=4, got 5"):
        model(torch.randn(3, 2, 5))
    with pytest.raises(ValueError, match="2-D .* or 3-D tensor"):
        model(torch.randn(3))
    with pytest.raises(ValueError, match=r"h0 must have shape \(2, 2, 6\), got a tensor of shape \(1, 2, 6\)"):
        model(torch.randn(3, 2, 4), (torch.zeros(1, 2, 6), torch.zeros(2, 2, 6)))
    with pytest.raises(TypeError, match="input must be a floating-point tensor .* got torch.int64"):
        model(torch.ones(3, 2, 4, dtype=torch.long))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_weight_writes_that_bypass_the_version_counter_are_seen(backend):
    """torch's fused optimizers and ``.data`` writes do not bump the version counter: the converted copies (and the
    cpu backend's packed weights, and the autocast casts) must still follow the new values (elmo_fast._stamp)."""
    torch.manual_seed(7)
    model = elmo_fast.LSTMP(4, 8, proj_size=3, backend=backend)
    x = torch.randn(5, 2, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    for _ in range(2):
        model(x)[0].square().sum().backward()  # also fills the caches
        versions = [p._version for p in model.parameters()]
        opt.step()
        assert [p._version for p in model.parameters()] == versions  # the case under test
        with torch.no_grad():
            torch.testing.assert_close(model(x)[0], model.to_lstm()(x)[0], atol=1e-6, rtol=0)
        opt.zero_grad()
    with torch.no_grad():
        model.weight_hh_l0.data.add_(1.0)
        torch.testing.assert_close(model(x)[0], model.to_lstm()(x)[0], atol=1e-6, rtol=0)


def test_cast_weight_sees_a_data_write():
    from elmo_fast.ops._precision import cast_weight

    w = torch.nn.Parameter(torch.randn(600, 3))
    first = cast_weight(w, torch.bfloat16)
    w.data.add_(1.0)
    torch.testing.assert_close(cast_weight(w, torch.bfloat16), w.detach().to(torch.bfloat16), atol=0, rtol=0)
    assert not torch.equal(first, w.detach().to(torch.bfloat16))
