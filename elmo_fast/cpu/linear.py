"""CPU backend of the token encoder's projection, ``x · W + b`` (the reference is ``torch.addmm(b, x, W)``).

One operator for the product and one for its gradients, each product through :func:`elmo_fast.cpu.gemm.gemm`, so
that the faster of MKL and oneDNN runs it (under autograd, ``torch.addmm`` and its backward's ``mm`` always run on
MKL, at half oneDNN's rate on an AMD EPYC with AVX-512: ~13 ms of a training step's ~690 there). fp32 CPU matrices
only; anything else stays on ``torch.addmm``.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from ..ops._library import nothing, qualname, wants_grad
from .gemm import gemm

Tensor = torch.Tensor


def linear_cpu_applies(x: Tensor, w: Tensor, b: Tensor) -> bool:
    """Whether :func:`linear_cpu` runs these: a gradient wanted (training; inference keeps ``torch.addmm``, see
    ``elmo_fast.ops.projection``), 2-d fp32 CPU ``x`` and ``w``, a 1-d fp32 CPU ``b``, no CPU autocast (under it
    ``torch.addmm`` takes the autocast dtype, and so does the projection)."""
    return (wants_grad(x, w, b) and x.dim() == 2 and w.dim() == 2 and b.dim() == 1
            and not torch.is_autocast_enabled("cpu")
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (x, w, b)))


@custom_op(qualname("linear_cpu"), mutates_args=())
def _linear_op(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    return gemm(x, w, b)


@_linear_op.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[1])


@custom_op(qualname("linear_cpu_backward"), mutates_args=())
def _linear_backward(dy: Tensor, x: Tensor, w: Tensor, need_x: bool, need_w: bool, need_b: bool
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db); placeholders where not needed."""
    dx = gemm(dy, w.t()) if need_x else nothing(x)
    dw = gemm(x.t(), dy) if need_w else nothing(x)
    db = dy.sum(0) if need_b else nothing(x)
    return dx, dw, db


@_linear_backward.register_fake
def _(dy, x, w, need_x, need_w, need_b):
    return (x.new_empty(x.shape) if need_x else nothing(x), w.new_empty(w.shape) if need_w else nothing(x),
            w.new_empty(w.shape[1]) if need_b else nothing(x))


def _setup_context(ctx, inputs, output):
    x, w, _ = inputs
    ctx.save_for_backward(x, w)


def _backward(ctx, dy):
    x, w = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = _linear_backward(dy, x, w, need[0], need[1], need[2])
    return tuple(t if n else None for t, n in zip(grads, need))


_linear_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cpu(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """``torch.addmm(b, x, w)`` for (N, K) ``x``, (K, M) ``w``, (M,) ``b`` (see :func:`linear_cpu_applies`): the
    operator ``elmo_fast::linear_cpu``, its backward ``elmo_fast::linear_cpu_backward``."""
    return _linear_op(x, w, b)
