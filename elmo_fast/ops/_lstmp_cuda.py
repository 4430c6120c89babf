"""``backend="cuda"`` for ``lstmp``: the persistent CUDA kernels of ``elmo_fast._C`` behind autograd.

The extension is loaded lazily through ``elmo_fast._backend.cuda_ext`` (never at import time).

* Inference (no gradient needed): ``_C.lstmp`` runs the forward kernel without caches.
* Training: the operator ``elmo_fast::lstmp_cuda`` runs ``_C.lstmp_forward``, which also returns the caches
  backward needs (haste-style training cache, not recomputation): gate activations (B, T, 4H) in the input
  dtype, the unclipped cell (B, T, H) fp32 and the unclipped projection (B, T, P) fp32. ``_C.lstmp_backward`` runs the
  backward time loop on chip, then the weight gradients as large GEMMs (``elmo_fast::lstmp_cuda_backward``).

Cast policy (elmo_fast.ops._precision): x and the three weight matrices share one dtype (float32 or bfloat16);
bias, h0 and c0 may be float32 beside bfloat16 operands (autocast keeps them fp32); h_n, c_n come back in h0's
and c0's dtypes, every gradient in its input's dtype.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from .._backend import cuda_ext
from ._library import nothing, qualname, wants_grad


def unsupported_reason(
    x: torch.Tensor, w_in: torch.Tensor, w_proj: torch.Tensor | None, h0: torch.Tensor
) -> str | None:
    """None when the persistent kernel can run these shapes on x's device, else why not."""
    if w_proj is None:
        return "the persistent CUDA kernel needs a projection (w_proj); this chain has none"
    if x.dtype not in (torch.float32, torch.bfloat16):
        return f"the persistent CUDA kernel supports float32 and bfloat16, got {x.dtype}"
    H, P = w_in.shape[1] // 4, h0.shape[-1]
    reason = cuda_ext().lstmp_unsupported_reason(x, H, P)
    return reason or None


Tensor = torch.Tensor


@custom_op(qualname("lstmp_cuda"), mutates_args=())
def _lstmp_cuda_op(x: Tensor, w_in: Tensor, w_rec: Tensor, bias: Tensor, w_proj: Tensor, h0: Tensor, c0: Tensor,
                   lengths: Tensor, cell_clip: float | None, proj_clip: float | None, forget_bias: float,
                   reverse: bool, residual: bool, save: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, h_n, c_n, gates, cpre, hpre): the training caches of ``_C.lstmp_forward`` with ``save``, else
    placeholders (``_C.lstmp``, the forward kernel without caches)."""
    flags = dict(cell_clip=cell_clip, proj_clip=proj_clip, forget_bias=forget_bias, reverse=reverse,
                 residual=residual)
    if save:
        return tuple(cuda_ext().lstmp_forward(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, **flags))
    y, h_n, c_n = cuda_ext().lstmp(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, **flags)
    return y, h_n, c_n, nothing(x), nothing(x), nothing(x)


@_lstmp_cuda_op.register_fake
def _(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip, forget_bias, reverse, residual, save):
    B, T, _ = x.shape
    G, P = w_in.shape[1], h0.shape[1]
    f32 = dict(dtype=torch.float32)
    caches = ((x.new_empty(B, T, G), x.new_empty(B, T, G // 4, **f32), x.new_empty(B, T, P, **f32)) if save
              else (nothing(x), nothing(x), nothing(x)))
    return (x.new_empty(B, T, P), torch.empty_like(h0), torch.empty_like(c0), *caches)


@custom_op(qualname("lstmp_cuda_backward"), mutates_args=())
def _lstmp_cuda_backward(x: Tensor, w_in: Tensor, w_rec: Tensor, bias: Tensor, w_proj: Tensor, h0: Tensor,
                         c0: Tensor, lengths: Tensor, gates: Tensor, cpre: Tensor, hpre: Tensor, dy: Tensor | None,
                         dh_n: Tensor | None, dc_n: Tensor | None, cell_clip: float | None, proj_clip: float | None,
                         forget_bias: float, reverse: bool, residual: bool
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``_C.lstmp_backward``: (dx, dw_in, dw_rec, dbias, dw_proj, dh0, dc0), each in its input's dtype."""
    return tuple(cuda_ext().lstmp_backward(
        x, w_in, w_rec, bias, w_proj, h0, c0, lengths, gates, cpre, hpre,
        None if dy is None else dy.contiguous(), None if dh_n is None else dh_n.contiguous(),
        None if dc_n is None else dc_n.contiguous(), cell_clip=cell_clip, proj_clip=proj_clip,
        forget_bias=forget_bias, reverse=reverse, residual=residual))


@_lstmp_cuda_backward.register_fake
def _(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, gates, cpre, hpre, dy, dh_n, dc_n, cell_clip, proj_clip,
      forget_bias, reverse, residual):
    return tuple(torch.empty_like(t) for t in (x, w_in, w_rec, bias, w_proj, h0, c0))


def _setup_context(ctx, inputs, output):
    *tensors, cell_clip, proj_clip, forget_bias, reverse, residual, save = inputs
    ctx.flags = (cell_clip, proj_clip, forget_bias, reverse, residual)
    ctx.saved = save
    ctx.set_materialize_grads(False)
    if save:
        ctx.save_for_backward(*tensors, *output[3:])


def _backward(ctx, dy, dh_n, dc_n, *_):
    if not ctx.saved:
        raise RuntimeError("lstmp (cuda): this call ran without save=True and kept nothing for backward")
    grads = _lstmp_cuda_backward(*ctx.saved_tensors, dy, dh_n, dc_n, *ctx.flags)
    need = ctx.needs_input_grad
    return tuple(g if need[i] else None for i, g in enumerate(grads)) + (None,) * 7


_lstmp_cuda_op.register_autograd(_backward, setup_context=_setup_context)


def lstmp_cuda(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, *, cell_clip=None, proj_clip=None, forget_bias=1.0,
               reverse=False, residual=False):
    """Same contract as ``elmo_fast.ops.lstmp`` (returns y, h_n, c_n); shapes already validated there."""
    tensors = (x, w_in, w_rec, bias, w_proj, h0, c0)
    train = wants_grad(*tensors)
    out = _lstmp_cuda_op(*tensors, lengths, None if cell_clip is None else float(cell_clip),
                         None if proj_clip is None else float(proj_clip), float(forget_bias), bool(reverse),
                         bool(residual), train)
    return out[0], out[1], out[2]
