"""CPU backend of a highway layer (``elmo_fast.reference.char_cnn.highway_reference`` is the oracle).

g = σ(x·W_carry + b_carry), r = relu(x·W_transform + b_transform), y = g·r + (1 - g)·x (TF's convention). The
products stay in MKL/oneDNN (``gemm``, biases folded in); what is fused, in ``elmo_fast._cpu`` (csrc/cpu/
lstmp_cell.cpp: ``highway_forward``/``highway_backward``), is the gate math around them: one pass forward (g and r
written over the products' buffers, kept for backward) and one backward (the two products' gradients and x's direct
one), where autograd through the reference runs ~7 passes forward and ~12 backward over (N, F). Backward: x's
gradient is the direct term with the two products added (``gemm_add``), each weight's gradient one GEMM.
fp32 with the extension only; anything else runs the reference.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from ..ops._library import nothing, qualname
from .ext import cpu_ext, cpu_ext_for
from .gemm import gemm, gemm_add

Tensor = torch.Tensor


@torch.compiler.assume_constant_result
def _kernels_present() -> bool:
    """``elmo_fast._cpu`` is loaded and has the kernels (a constant of the graph while torch.compile traces: it
    probes an import)."""
    ext = cpu_ext()
    return ext is not None and hasattr(ext, "highway_forward")


def highway_cpu_applies(x: Tensor, *params: Tensor) -> bool:
    """Whether :func:`highway_cpu` runs these: 2-d fp32 CPU tensors and ``elmo_fast._cpu`` with the kernels."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        return False
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
        return False
    return _kernels_present()


@custom_op(qualname("highway_cpu"), mutates_args=())
def _highway_op(x: Tensor, w_carry: Tensor, b_carry: Tensor, w_transform: Tensor, b_transform: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(y, g, r): the layer's output, and the carry gate and transform branch (N, F) kept for backward."""
    x = x.contiguous()
    g = gemm(x, w_carry, b_carry).contiguous()
    r = gemm(x, w_transform, b_transform).contiguous()
    y = torch.empty_like(x)
    cpu_ext_for(x).highway_forward(g, r, x, y)
    return y, g, r


@_highway_op.register_fake
def _(x, w_carry, b_carry, w_transform, b_transform):
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(x.shape)  # contiguous, as the real ones


@custom_op(qualname("highway_cpu_backward"), mutates_args=())
def _highway_backward(dy: Tensor, x: Tensor, g: Tensor, r: Tensor, w_carry: Tensor, w_transform: Tensor,
                      need_x: bool, need_carry: bool, need_transform: bool
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw_carry, db_carry, dw_transform, db_transform); placeholders where not needed (``need_carry``: the
    carry weight's or bias's gradient, ``need_transform`` likewise)."""
    dy, x = dy.contiguous(), x.contiguous()
    dgp, dbp, dx = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    cpu_ext_for(x).highway_backward(dy, x, g, r, dgp, dbp, dx)
    if need_x:
        dx = gemm_add(gemm_add(dx, dgp, w_carry.t(), reuse=True), dbp, w_transform.t(), reuse=True)
    xt = x.t()
    carry = (gemm(xt, dgp), dgp.sum(0)) if need_carry else (nothing(x), nothing(x))
    transform = (gemm(xt, dbp), dbp.sum(0)) if need_transform else (nothing(x), nothing(x))
    return dx if need_x else nothing(x), *carry, *transform


@_highway_backward.register_fake
def _(dy, x, g, r, w_carry, w_transform, need_x, need_carry, need_transform):
    F_ = x.shape[1]
    return (x.new_empty(x.shape) if need_x else nothing(x),
            *((x.new_empty(F_, F_), x.new_empty(F_)) if need_carry else (nothing(x), nothing(x))),
            *((x.new_empty(F_, F_), x.new_empty(F_)) if need_transform else (nothing(x), nothing(x))))


def _setup_context(ctx, inputs, output):
    x, w_carry, _, w_transform, _ = inputs
    ctx.save_for_backward(x, output[1], output[2], w_carry, w_transform)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # no zero gradients for g and r: two (N, F) fills a call


def _backward(ctx, dy, *_):
    if dy is None:  # the output reached the loss through nothing differentiable
        return (None,) * 5
    x, g, r, w_carry, w_transform = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = _highway_backward(dy, x, g, r, w_carry, w_transform, need[0], need[1] or need[2], need[3] or need[4])
    return tuple(t if n else None for t, n in zip(grads, need))


_highway_op.register_autograd(_backward, setup_context=_setup_context)


def highway_cpu(x: Tensor, w_carry: Tensor, b_carry: Tensor, w_transform: Tensor, b_transform: Tensor) -> Tensor:
    """Arguments and result of ``highway_reference`` for (N, F) fp32 CPU tensors (see :func:`highway_cpu_applies`):
    the operator ``elmo_fast::highway_cpu``, its backward ``elmo_fast::highway_cpu_backward``."""
    return _highway_op(x, w_carry, b_carry, w_transform, b_transform)[0]
