"""Every fused op is a ``torch.library`` operator in the ``elmo_fast::`` namespace with a fake implementation and
its autograd: ``torch.library.opcheck`` (schema, fake tensors, autograd registration, AOT dispatch with dynamic
shapes) on the CPU for the reference and cpu paths, and for the Triton paths on ``triton_device()`` (CUDA tensors on
a GPU, CPU tensors under the interpreter)."""
import pytest
import torch

from conftest import requires_triton, triton_device
from elmo_fast.cpu.lstmp import _lstmp_cpu_backward, _lstmp_cpu_op
from elmo_fast.cpu.sampled_softmax import (_full_softmax_backward, _full_softmax_op, _sampled_softmax_backward,
                                         _sampled_softmax_op)
from elmo_fast.ops.char_cnn import _char_cnn_cpu_op, _char_cnn_reference_op, _highway_reference_op
from elmo_fast.ops.lstmp import _lstmp_reference_op
from elmo_fast.ops.softmax import _full_reference_op, _sampled_reference_op
from elmo_fast.reference.sampled_softmax import expected_count_reference

B, T, D, H, P = 3, 5, 8, 16, 8
F_, L = 24, 12


def _t(*shape, dtype=torch.float64, grad=True, scale=0.5, device="cpu"):
    return (torch.randn(*shape, dtype=dtype) * scale).to(device).requires_grad_(grad)


def _lstmp_args(projection=True, dtype=torch.float64, device="cpu"):
    P_ = P if projection else H
    kw = dict(dtype=dtype, device=device)
    return [_t(B, T, D if projection else H, **kw), _t(D if projection else H, 4 * H, **kw),
            _t(P_, 4 * H, **kw), _t(4 * H, **kw), _t(H, P, **kw) if projection else None,
            _t(B, P_, **kw), _t(B, H, **kw), torch.tensor([T, 2, 0], device=device)]


LSTMP_FLAGS = [pytest.param((0.5, 0.3, 1.0, True, True), id="clips-reverse-residual"),
               pytest.param((None, None, 0.0, False, False), id="plain")]


def _detached(args):
    return [[t.detach() for t in a] if isinstance(a, list) else a.detach() if isinstance(a, torch.Tensor) else a
            for a in args]


def _check_composite(op, args):
    """opcheck of a composite path's operator and of its backward operator (recomputation)."""
    torch.library.opcheck(op.op, args)
    out = op.op(*args)
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn_like(o) for o in outs]
    needs = [t.is_floating_point() for a in args for t in (a if isinstance(a, list) else [a])
             if isinstance(t, torch.Tensor)]
    torch.library.opcheck(op.backward_op, (grads, needs, *_detached(args)))


@pytest.mark.parametrize("projection", [True, False], ids=["proj", "no-proj"])
@pytest.mark.parametrize("flags", LSTMP_FLAGS)
def test_lstmp_reference_op(projection, flags):
    args = _lstmp_args(projection)
    _check_composite(_lstmp_reference_op, (*args, *flags))


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with transposed strides (how elmo_fast.LSTMP passes nn.LSTM's weights to the cpu op)."""
    return t.detach().t().contiguous().t().requires_grad_(t.requires_grad)


@pytest.mark.parametrize("stack", [False, True, "col-major"], ids=["w_in+w_rec", "w_stack", "col-major"])
@pytest.mark.parametrize("save", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("flags", LSTMP_FLAGS)
def test_lstmp_cpu_ops(stack, save, flags):
    x, w_in, w_rec, *rest = _lstmp_args() if save else _detached(_lstmp_args())  # inference: no gradients
    if stack == "col-major":
        w_in, w_rec, rest[1] = _col_major(w_in), _col_major(w_rec), _col_major(rest[1])
        stack = False
    ws = (None, None, torch.cat([w_in, w_rec]).detach().requires_grad_(save)) if stack else (w_in, w_rec, None)
    args = (x, *ws, *rest, *flags, save, -1, False)
    torch.library.opcheck(_lstmp_cpu_op, args)
    if save:
        out = _lstmp_cpu_op(*args)
        needs = [True, not stack, not stack, stack, True, True]
        bias, w_proj, h0, c0, lengths = _detached(rest)
        bwd = (torch.randn(B, T, P, dtype=x.dtype), torch.randn(B, P, dtype=x.dtype), None, *_detached(ws), w_proj,
               h0, c0, lengths, *(o.detach() for o in out[3:]), T, *flags[:2], *flags[3:], -1, needs)
        torch.library.opcheck(_lstmp_cpu_backward, bwd)


def _char_args(dtype=torch.float64, device="cpu"):
    ids = torch.randint(1, 262, (7, L))
    ids[2] = 0
    ids[3, 4:] = 261
    kw = dict(dtype=dtype, device=device)
    ws = [_t(w, 4, n, **kw) for w, n in ((1, 8), (3, 16))]
    return [ids.to(device), _t(262, 4, **kw), ws, [_t(8, **kw), _t(16, **kw)]]


@pytest.mark.parametrize("op", [_char_cnn_reference_op, _char_cnn_cpu_op], ids=["reference", "cpu"])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_char_cnn_ops(op, activation):
    _check_composite(op, (*_char_args(), activation))


def test_highway_reference_op():
    _check_composite(_highway_reference_op, (_t(6, F_), _t(F_, F_), _t(F_), _t(F_, F_), _t(F_)))


def _softmax_args(dtype=torch.float64, device="cpu"):
    V, S, N = 40, 10, 7
    targets = torch.tensor([1, 2, 2, 5, 1, 0, 3])
    ids = torch.tensor([0, 2, 4, 6, 8, 9, 11, 20, 30, 39])
    tq, sq = expected_count_reference(targets, 13, S, V), expected_count_reference(ids, 13, S, V)
    kw = dict(dtype=dtype, device=device)
    return (_t(N, P, **kw), targets.to(device), _t(V, P, **kw), _t(V, **kw), ids.to(device), tq.to(device),
            sq.to(device))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_sampled_softmax_reference_op(reduction, sparse):
    _check_composite(_sampled_reference_op, (*_softmax_args(), True, reduction, sparse))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_full_softmax_reference_op(reduction):
    hidden, targets, W, b, *_ = _softmax_args()
    _check_composite(_full_reference_op, (hidden, targets, W, b, reduction))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_sampled_softmax_cpu_ops(reduction, sparse):
    hidden, targets, W, b, ids, tq, sq = _softmax_args()
    args = (hidden, W, b, targets, ids, tq.log(), sq.log(), True, reduction, sparse)
    torch.library.opcheck(_sampled_softmax_op, args)
    loss, w_t, w_s, probs, p_true = (o.detach() for o in _sampled_softmax_op(*args))
    for needs in ((True, True, True), (True, False, False), (False, True, False)):
        torch.library.opcheck(_sampled_softmax_backward, (torch.randn_like(loss), hidden.detach(), w_t, w_s, probs,
                                                          p_true, reduction, *needs))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_full_softmax_cpu_ops(reduction, layout):
    hidden, targets, W, b, *_ = _softmax_args()
    if layout == "transposed":  # the fakes' outputs are contiguous, as the real ones
        hidden, W = hidden.detach().t().contiguous().t().requires_grad_(), W.detach().t().contiguous().t()
    torch.library.opcheck(_full_softmax_op, (hidden, W, b, targets, reduction))
    loss, lse = (o.detach() for o in _full_softmax_op(hidden, W, b, targets, reduction))
    for needs in ((True, True, True), (False, True, False)):
        torch.library.opcheck(_full_softmax_backward, (torch.randn_like(loss), hidden.detach(), W.detach(),
                                                       b.detach(), targets, lse, reduction, *needs))


# ------------------------------------------------------------------------------------------------- Triton
@requires_triton
@pytest.mark.triton
@pytest.mark.parametrize("save", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("flags", LSTMP_FLAGS)
def test_lstmp_triton_ops(save, flags):
    from elmo_fast.kernels.lstmp import _lstmp_backward_op, _lstmp_op

    dev = triton_device()
    args = _lstmp_args(dtype=torch.float32, device=dev)
    args = args if save else _detached(args)  # inference: no gradients
    torch.library.opcheck(_lstmp_op, (*args, *flags, save))
    if save:
        out = _lstmp_op(*args, *flags, save)
        x, w_in, w_rec, bias, w_proj, h0, c0, lengths = _detached(args)
        bwd = (torch.randn(B, T, P).to(dev), torch.randn(B, P).to(dev), None, x, w_in, w_rec, w_proj, h0, c0, lengths,
               *(o.detach() for o in out[3:]), *flags[:2], *flags[3:], [True] * 5)
        torch.library.opcheck(_lstmp_backward_op, bwd)


@requires_triton
@pytest.mark.triton
@pytest.mark.parametrize("save", [True, False], ids=["train", "infer"])
def test_char_cnn_and_highway_triton_ops(save):
    from elmo_fast.kernels.char_cnn import _char_cnn_backward_op, _char_cnn_op
    from elmo_fast.kernels.highway import _highway_backward_op, _highway_op

    dev = triton_device()
    ids, emb, ws, bs = _char_args(torch.float32, dev) if save else _detached(_char_args(torch.float32, dev))
    torch.library.opcheck(_char_cnn_op, (ids, emb, ws, bs, "relu", save))
    kw = dict(dtype=torch.float32, device=dev)
    hw = (_t(6, F_, **kw), _t(F_, F_, **kw), _t(F_, **kw), _t(F_, F_, **kw), _t(F_, **kw))
    torch.library.opcheck(_highway_op, hw)
    if save:
        out, *saved = (o.detach() for o in _char_cnn_op(ids, emb, ws, bs, "relu", True))
        w_packed, arg, perm, bound = saved
        torch.library.opcheck(_char_cnn_backward_op, (ids, emb.detach(), w_packed, out, arg, perm, bound,
                                                      torch.randn_like(out), [1, 8, 3, 16], "relu", True, True))
        torch.library.opcheck(_highway_backward_op, (*(t.detach() for t in hw), torch.randn(6, F_).to(dev), True,
                                                     True, torch.float32))


@requires_triton
@pytest.mark.triton
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softmax_triton_ops(reduction):
    from elmo_fast.kernels import softmax as ks

    hidden, targets, W, b, ids, tq, sq = _softmax_args(torch.float32, triton_device())
    args = (hidden, W, b, targets, ids, tq, sq, True, reduction, False)
    torch.library.opcheck(ks._sampled_op, args)
    loss, samp_off, lse, true_logit = (o.detach() for o in ks._sampled_op(*args))
    torch.library.opcheck(ks._sampled_backward_op, (torch.randn_like(loss), hidden.detach(), W.detach(), targets,
                                                    ids, samp_off, lse, true_logit, True, reduction, True))
    torch.library.opcheck(ks._full_op, (hidden, W, b, targets, reduction))
    loss, off, lse = (o.detach() for o in ks._full_op(hidden, W, b, targets, reduction))
    torch.library.opcheck(ks._full_backward_op, (torch.randn_like(loss), hidden.detach(), W.detach(), targets, off,
                                                 lse, reduction))


def test_lstmp_cpu_weight_gradients_keep_the_weights_layout():
    """Column-major weights (transposed views) get the same gradients, in their own layout (no transposing copy
    is needed to map them back to nn.LSTM's parameters)."""
    from elmo_fast.cpu.lstmp import lstmp_cpu

    args = _lstmp_args()
    cols = [_col_major(t) if i in (1, 2, 4) else t for i, t in enumerate(args)]
    grads = []
    for a in (args, cols):
        y, h, c = lstmp_cpu(*a, cell_clip=0.5, proj_clip=0.3, reverse=True)
        weights = [a[1], a[2], a[4]]
        grads.append(torch.autograd.grad((y.square().sum() + h.sum() + c.sum()), weights))
    for w, g_row, g_col in zip([cols[1], cols[2], cols[4]], *grads):
        torch.testing.assert_close(g_col, g_row, atol=1e-12, rtol=0)
        assert g_col.stride() == w.stride() and g_row.is_contiguous()


def test_device_constants_made_under_fake_mode_are_not_cached(monkeypatch):
    """The kernels' per-device constants (lstmp's clip/bias scalars, the char CNN's filter widths) made while a fake
    mode is active (FakeTensorMode, make_fx, opcheck) must not be served to a later real call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from elmo_fast.kernels import char_cnn as KC
    from elmo_fast.kernels import lstmp as KL
    from elmo_fast.ops._library import tracing

    monkeypatch.setattr(KL, "_CONSTS", {})  # empty caches for this test; the process's own come back after it
    monkeypatch.setattr(KC, "_WIDTHS", {})
    args = (0.25, 0.125, 0.0625, torch.float64)
    groups = ((1, 3), (2, 5))
    with FakeTensorMode() as mode:
        like = mode.from_tensor(torch.zeros(2))  # the op's input, fake
        assert tracing(KL._consts(*args, like)) and tracing(KC._filter_widths(groups, like))
    real = torch.zeros(2)
    consts, wid = KL._consts(*args, real), KC._filter_widths(groups, real)
    assert not tracing(consts) and consts.tolist() == [0.25, 0.125, 0.0625]
    assert not tracing(wid) and wid.tolist() == [1, 1, 1, 2, 2, 2, 2, 2]


def test_cached_device_constants_are_not_served_to_a_traced_call():
    """The other way round: once a real call has cached its constants, a call whose input is fake (opcheck's AOT
    dispatch, make_fx: dynamo not running) gets constants made in its own mode. On a GPU the launch is traced with
    them, and a real tensor among fake ones fails that trace (the H200, 2026-11-27: opcheck and torch.compile of
    the LSTMP op)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from elmo_fast.kernels import char_cnn as KC
    from elmo_fast.kernels import dropout as KD
    from elmo_fast.kernels import lstmp as KL
    from elmo_fast.ops._library import tracing

    args = (0.25, 0.125, 0.0625, torch.float64)
    groups = ((1, 3), (2, 5))
    real = torch.zeros(2)
    KL._consts(*args, real), KC._filter_widths(groups, real), KD._scale(0.5, real)  # cached by a real call
    with FakeTensorMode() as mode:
        like = mode.from_tensor(real)
        assert tracing(KL._consts(*args, like))
        assert tracing(KC._filter_widths(groups, like))
        assert tracing(KD._scale(0.5, like))


def test_tracing_tells_real_fake_and_functional_tensors():
    """``tracing`` (asked of every kernel launch's arguments): real tensors and parameters are real; fake tensors,
    functional (C++) wrappers, and a mix of real and fake arguments are traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from elmo_fast.ops._library import tracing

    real = torch.ones(3)
    assert not tracing(real, torch.nn.Parameter(torch.ones(2)), 3, None)
    assert tracing(real, torch._to_functional_tensor(torch.ones(2)))
    with FakeTensorMode():
        fake = torch.ones(3)
    assert tracing(fake) and tracing(real, fake, 1)


def test_auto_gives_fp64_calls_of_kernels_without_gpu_fp64_to_the_reference(monkeypatch):
    """On a GPU, auto sends an fp64 char-CNN or softmax call to the reference (their Triton kernels have no fp64
    there); an explicit 'triton', other dtypes and ops with fp64 kernels keep what select_backend chose."""
    import elmo_fast._backend as B
    from elmo_fast.ops._library import NO_FP64_ON_GPU, backend_for

    monkeypatch.setattr(B, "select_backend", lambda backend, device, op: "triton")
    monkeypatch.delenv("ELMO_FAST_BACKEND", raising=False)
    gpu = torch.device("cuda")
    assert NO_FP64_ON_GPU == {"char_cnn", "sampled_softmax", "full_softmax"}
    for op in NO_FP64_ON_GPU:
        assert backend_for("auto", gpu, op, torch.float64) == "reference"
        assert backend_for("triton", gpu, op, torch.float64) == "triton"
        assert backend_for("auto", gpu, op, torch.float32) == "triton"
        assert backend_for("auto", torch.device("cpu"), op, torch.float64) == "triton"
    assert backend_for("auto", gpu, "lstmp", torch.float64) == "triton"


def test_softmax_column_splits_pick_under_symbolic_shapes():
    """The full softmax's column-split pick (``_splits``, a GPU target's loop over split counts) traced with
    symbolic shapes, as opcheck's AOT dispatch of dynamic shapes does on a GPU (the H200, 2026-11-27: SymBools
    compared, a TypeError): it guards on the shapes and picks what the concrete call picks."""
    import triton
    from torch.fx.experimental.proxy_tensor import make_fx

    from elmo_fast.kernels import softmax as KS
    from elmo_fast.kernels._common import H100

    def f(h):
        splits, per = KS._splits(triton.cdiv(h.shape[1], 64), triton.cdiv(h.shape[0], 64), H100, None)
        return h.new_tensor([splits, per])

    want = KS._splits(triton.cdiv(8192, 64), triton.cdiv(384 * 20, 64), H100, None)
    assert want[0] > 1  # the loop ran: a pick, not the interpreter's fixed count
    g = make_fx(f, tracing_mode="symbolic")(torch.zeros(384 * 20, 8192))
    assert g(torch.zeros(384 * 20, 8192)).tolist() == list(want)


def test_the_lstmp_operators_are_kept_whole_under_compile_on_a_gpu_too(monkeypatch):
    """torch.compile keeps the LSTMP operators whole on a GPU as under the interpreter (traced into on the H200,
    2026-11-27, their outputs differed from eager: opcheck's AOT dispatch and the stateful biLM); the others are
    traced into there (their kernels recorded) and kept whole only under the interpreter."""
    from elmo_fast.kernels import _common
    from elmo_fast.kernels import lstmp as KL

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what the check says on a GPU machine
    assert _common.kept_whole("lstmp_triton") and _common.kept_whole("lstmp_triton_backward")
    assert not _common.kept_whole("highway_triton") and not _common.kept_whole("sampled_softmax_triton")
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    for op in (KL._lstmp_op, KL._lstmp_backward_op):  # (triton_op's own rule traces into the function)
        assert op._torch_dispatch_fns[FunctionalTensorMode] is _common._opaque

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    # triton_operator registers what kept_whole says, interpreter off: a name in the set whole, another not
    monkeypatch.setattr(_common, "KEPT_WHOLE", _common.KEPT_WHOLE | {"kept_whole_probe"})
    assert _common.triton_operator("kept_whole_probe", fn)._torch_dispatch_fns[FunctionalTensorMode] is _common._opaque
    assert _common.triton_operator("traced_probe", fn)._torch_dispatch_fns[FunctionalTensorMode] is not _common._opaque
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _common.kept_whole("highway_triton")
