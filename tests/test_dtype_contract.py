"""The dtype contract (elmo_fast/ops/_precision.py): under autocast and for bf16 models every fused op launches
its bf16 tensor-core variant (bf16 operands, IEEE flag off, fp32 accumulation and cell state), weights are cast
once per version with gradients reaching the fp32 master weights, and the reference path works under CPU
autocast. A spy on Triton's launch path (elmo_fast.probes) records each launch's operand dtypes and flags."""
import pytest
import torch

import elmo_fast
from conftest import requires_triton, triton_device
from elmo_fast import ops
from elmo_fast.ops import _precision
from elmo_fast.probes import probe

BF16, F32 = torch.bfloat16, torch.float32


# The "cpu" case runs Triton on CPU tensors, which only the interpreter can (the "cuda" case is its GPU run).
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
    triton_device() != "cpu", reason="Triton runs on CPU tensors only under TRITON_INTERPRET=1; the cuda case runs "
                                     "this test on the GPU")), pytest.param("cuda", marks=pytest.mark.gpu)]


def _autocast(device="cpu"):
    return torch.autocast(device, dtype=BF16)


def _params(*shapes, scale=0.3, device="cpu"):
    return [torch.nn.Parameter(torch.randn(*s, device=device) * scale) for s in shapes]


def _launched(counts, name):
    found = [la for la in counts.launches if la.kernel == name]
    assert found, f"{name} was not launched; launched: {sorted({la.kernel for la in counts.launches})}"
    return found


def _assert_bf16_variant(counts, name, operands, fp32=()):
    for la in _launched(counts, name):
        assert la.flags.get("IEEE") is False, f"{name} ran its IEEE fp32 variant: {la.flags}"
        for arg in operands:
            assert la.dtypes[arg] == BF16, f"{name}: {arg} is {la.dtypes[arg]}, expected bfloat16"
        for arg in fp32:
            assert la.dtypes[arg] == F32, f"{name}: {arg} is {la.dtypes[arg]}, expected float32"


def _grads_are_fp32(params):
    for p in params:
        assert p.grad is not None and p.grad.dtype == F32 and torch.isfinite(p.grad).all()


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("device", DEVICES)
def test_lstmp_autocast_runs_bf16_variant_with_fp32_state(device):
    B, T, H, P = 2, 3, 16, 16
    w_in, w_rec, bias, w_proj = params = _params((P, 4 * H), (P, 4 * H), (4 * H,), (H, P), device=device)
    x = torch.randn(B, T, P, device=device)
    h0, c0 = torch.zeros(B, P, device=device), torch.zeros(B, H, device=device)
    lengths = torch.tensor([3, 2], device=device)
    with _autocast(device), probe() as counts:
        y, h_n, c_n = ops.lstmp(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=3.0, proj_clip=3.0,
                                backend="triton")
        (y.float().sum() + h_n.sum() + c_n.sum()).backward()
    assert y.dtype == BF16 and h_n.dtype == F32 and c_n.dtype == F32
    _assert_bf16_variant(counts, "_fwd_cell_kernel", ["gx_ptr", "w_rec_ptr", "hop_ptr", "m_ptr", "z_ptr"],
                         fp32=["c_ptr", "cpre_ptr"])
    _assert_bf16_variant(counts, "_splitk_kernel", ["a_ptr", "b_ptr"], fp32=["part_ptr"])
    _assert_bf16_variant(counts, "_bwd_cell_kernel", ["w_proj_ptr", "z_ptr", "dz_ptr"], fp32=["dc_ptr", "cpre_ptr"])
    for la in _launched(counts, "_fwd_reduce_kernel"):  # no product: only the state dtypes matter
        assert la.dtypes["hn_ptr"] == F32 and la.dtypes["hpre_ptr"] == F32 and la.dtypes["hop_ptr"] == BF16
    for la in _launched(counts, "_bwd_reduce_kernel"):
        assert la.dtypes["dh_ptr"] == F32 and la.dtypes["dhpre_ptr"] == BF16
    _grads_are_fp32(params)


@pytest.mark.triton
@requires_triton
def test_char_cnn_and_highway_autocast_run_bf16_variants():
    dev = triton_device()
    emb, w1, w2, b1, b2 = enc = _params((262, 4), (1, 4, 16), (2, 4, 16), (16,), (16,), device=dev)
    wc, bc, wt, bt = hw = _params((32, 32), (32,), (32, 32), (32,), device=dev)
    ids = torch.randint(1, 262, (5, 8)).to(dev)
    with _autocast(dev), probe() as counts:
        v = ops.char_cnn(ids, emb, [w1, w2], [b1, b2], backend="triton")
        out = ops.highway(v, wc, bc, wt, bt, backend="triton")
        out.float().sum().backward()
    assert v.dtype == BF16 and out.dtype == BF16
    _assert_bf16_variant(counts, "_char_cnn_fwd_kernel", ["e_ptr", "emb_ptr", "w_ptr"])
    _assert_bf16_variant(counts, "_char_cnn_bwd_kernel", ["e_ptr", "w_ptr"])
    _assert_bf16_variant(counts, "_highway_fused_kernel", ["x_ptr", "wc_ptr", "wt_ptr"])
    _assert_bf16_variant(counts, "_mm_kernel", [])
    _grads_are_fp32(enc + hw)


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled", [True, False, "groups"], ids=["sampled", "full", "groups"])
def test_softmax_autocast_runs_bf16_variant(sampled, device):
    W, b = _params((40, 16), (40,), device=device)
    hidden = torch.randn(6, 16, device=device)
    targets = torch.randint(0, 40, (6,), device=device)
    with _autocast(device), probe() as counts:
        if sampled == "groups":  # the trainer's call: two groups' rows (fp32 here) cast once, as one call's
            loss = sum(ops.sampled_softmax_loss_groups([(hidden, targets, torch.arange(8, device=device), 9),
                                                        (hidden * 2, targets, torch.arange(3, 11, device=device),
                                                         12)], W, b, backend="triton"))
        elif sampled:
            loss = ops.sampled_softmax_loss(hidden, targets, W, b, torch.arange(8, device=device), 9,
                                            backend="triton")
        else:
            loss = ops.full_softmax_nll(hidden, targets, W, b, backend="triton")
        loss.backward()
    _assert_bf16_variant(counts, "_softmax_lse_fwd_kernel", ["H", "W"])
    _assert_bf16_variant(counts, "_softmax_dlogit_kernel", ["H", "W", "DL"], fp32=["DB"])
    _grads_are_fp32([W, b])


def test_weights_are_cast_once_per_version():
    W = torch.nn.Parameter(torch.randn(8, 4))
    first = _precision.cast_weight(W[:4], BF16)
    assert first.dtype == BF16
    assert _precision.cast_weight(W[:4], BF16).data_ptr() == first.data_ptr()  # cached, views included
    other = _precision.cast_weight(W[4:], BF16)
    with torch.no_grad():
        W.add_(1.0)  # an optimizer step bumps the version counter
    again = _precision.cast_weight(W[:4], BF16)
    assert again.data_ptr() != first.data_ptr()
    torch.testing.assert_close(again.float(), W[:4].detach(), atol=0.02, rtol=0.01)
    assert _precision.cast_weight(W[4:], BF16).data_ptr() != other.data_ptr()
    # gradients reach the fp32 master through the cached copy, summed over uses
    (_precision.cast_weight(W[:4], BF16).float().sum() * 2 + _precision.cast_weight(W, BF16).float().sum()).backward()
    assert W.grad.dtype == F32
    torch.testing.assert_close(W.grad, torch.cat([torch.full((4, 4), 3.0), torch.ones(4, 4)]))


def test_model_weights_cast_once_per_step(tiny_model):
    model = elmo_fast.ElmoBiLM(*tiny_model, backend="reference", requires_grad=True)
    ids = elmo_fast.batch_to_ids([["The", "cat", "sat", "."]])

    def copies():
        return {id(v[1]) for entries in _precision._CACHE.values() for v in entries.values()}

    with _autocast():
        model(ids)
        before = copies()
        model(ids)
        assert copies() == before  # a second call casts nothing
        with torch.no_grad():
            model._bilm.forward_lstm.W_0[0].add_(0.0)  # an update bumps that weight's version
        model(ids)
        assert len(copies() - before) >= 2  # its two cast views (input and recurrent rows) are new


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=[pytest.mark.triton, requires_triton])])
def test_elmo_under_cpu_autocast_forward_and_backward(tiny_model, backend):
    """Under the autocast of the device the model runs on: the CPU, or the GPU for Triton on CUDA tensors."""
    dev = triton_device() if backend == "triton" else "cpu"
    ids = elmo_fast.batch_to_ids([["The", "cat", "sat", "."], ["Hi"]]).to(dev)
    results = {}
    for ac in (False, True):
        torch.manual_seed(0)
        elmo = elmo_fast.Elmo(*tiny_model, 1, requires_grad=True, dropout=0.0, backend=backend).to(dev)
        with torch.autocast(dev, dtype=BF16, enabled=ac):
            rep = elmo(ids)["elmo_representations"][0]
        (rep.float() * torch.linspace(-1, 1, rep.numel(), device=dev).view_as(rep)).sum().backward()
        results[ac] = rep.float().detach(), {n: p.grad for n, p in elmo.named_parameters() if p.grad is not None}
    (ref, g_ref), (got, g_got) = results[False], results[True]
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 0.05 * scale  # bf16 operands, fp32 accumulation
    assert g_got.keys() == g_ref.keys()
    for name, g in g_got.items():
        assert g.dtype == F32 and torch.isfinite(g).all(), name


@pytest.mark.triton
@requires_triton
def test_bf16_model_keeps_fp32_lstm_state(tiny_model):
    dev = triton_device()
    model = elmo_fast.ElmoBiLM(*tiny_model, backend="triton").to(dev, BF16)
    ids = elmo_fast.batch_to_ids([["The", "cat", "sat", "."]]).to(dev)
    with torch.no_grad(), probe() as counts:
        out = model(ids)
    assert all(a.dtype == BF16 for a in out["activations"])
    _assert_bf16_variant(counts, "_fwd_cell_kernel", ["w_rec_ptr", "hop_ptr"], fp32=["c_ptr"])
    for la in _launched(counts, "_fwd_reduce_kernel"):
        assert la.dtypes["hn_ptr"] == F32
    assert all(s.dtype == F32 for s in model._bilm._states)


@pytest.mark.gpu
@pytest.mark.cuda_ext
def test_cuda_extension_takes_autocast_calls():
    """bf16 operands with fp32 bias and states (what autocast hands over): no dtype error, close to Triton's."""
    from elmo_fast._backend import cuda_ext_import_error

    if cuda_ext_import_error() is not None:
        pytest.skip(f"elmo_fast._C is not built: {cuda_ext_import_error()}")
    B, T, D, H, P = 4, 5, 512, 4096, 512
    params = _params((D, 4 * H), (P, 4 * H), (4 * H,), (H, P), scale=0.02, device="cuda")
    x = torch.randn(B, T, D, device="cuda")
    h0, c0 = torch.zeros(B, P, device="cuda"), torch.zeros(B, H, device="cuda")
    lengths = torch.full((B,), T, device="cuda")
    out = {}
    for be in ("cuda", "triton"):
        with _autocast("cuda"):
            y, h_n, c_n = ops.lstmp(x, *params, h0, c0, lengths, cell_clip=3.0, proj_clip=3.0, backend=be)
        (y.float().sum() + c_n.sum()).backward()
        out[be] = [y.float(), c_n] + [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
    assert out["cuda"][1].dtype == F32
    for a, b in zip(out["cuda"], out["triton"]):
        assert (a - b).abs().max() <= 0.02 * b.abs().max() + 1e-3
