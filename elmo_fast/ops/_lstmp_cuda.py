"""``backend="cuda"`` for ``lstmp``: the persistent CUDA kernels of ``elmo_fast._C`` behind autograd.

The extension is loaded lazily through ``elmo_fast._backend.cuda_ext`` (never at import time).

* Inference (no gradient needed): ``_C.lstmp`` runs the forward kernel without caches.
* Training: ``_LSTMPCudaFunction`` runs ``_C.lstmp_forward``, which also returns the caches backward needs
  (haste-style training cache, not recomputation): gate activations (B, T, 4H) in the input dtype, the
  unclipped cell (B, T, H) fp32 and the unclipped projection (B, T, P) fp32. ``_C.lstmp_backward`` runs the
  backward time loop on chip, then the weight gradients as large GEMMs.

Cast policy (elmo_fast.ops._precision): x and the three weight matrices share one dtype (float32 or bfloat16);
bias, h0 and c0 may be float32 beside bfloat16 operands (autocast keeps them fp32); h_n, c_n come back in h0's
and c0's dtypes, every gradient in its input's dtype.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .._backend import cuda_ext


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


class _LSTMPCudaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip, forget_bias, reverse,
                residual):
        flags = dict(cell_clip=cell_clip, proj_clip=proj_clip, forget_bias=forget_bias, reverse=reverse,
                     residual=residual)
        y, h_n, c_n, gates, cpre, hpre = cuda_ext().lstmp_forward(x, w_in, w_rec, bias, w_proj, h0, c0, lengths,
                                                                  **flags)
        ctx.save_for_backward(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, gates, cpre, hpre)
        ctx.flags = flags
        return y, h_n, c_n

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dh_n, dc_n):
        x, w_in, w_rec, bias, w_proj, h0, c0, lengths, gates, cpre, hpre = ctx.saved_tensors
        dx, dw_in, dw_rec, dbias, dw_proj, dh0, dc0 = cuda_ext().lstmp_backward(
            x, w_in, w_rec, bias, w_proj, h0, c0, lengths, gates, cpre, hpre,
            None if dy is None else dy.contiguous(),
            None if dh_n is None else dh_n.contiguous(),
            None if dc_n is None else dc_n.contiguous(),
            **ctx.flags,
        )
        need = ctx.needs_input_grad
        grads = (dx, dw_in, dw_rec, dbias, dw_proj, dh0, dc0)
        return tuple(g if need[i] else None for i, g in enumerate(grads)) + (None,) * 6


def lstmp_cuda(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, *, cell_clip=None, proj_clip=None, forget_bias=1.0,
               reverse=False, residual=False):
    """Same contract as ``elmo_fast.ops.lstmp`` (returns y, h_n, c_n); shapes already validated there."""
    cell_clip = None if cell_clip is None else float(cell_clip)
    proj_clip = None if proj_clip is None else float(proj_clip)
    tensors = (x, w_in, w_rec, bias, w_proj, h0, c0)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _LSTMPCudaFunction.apply(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip,
                                        float(forget_bias), bool(reverse), bool(residual))
    return cuda_ext().lstmp(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=cell_clip,
                            proj_clip=proj_clip, forget_bias=float(forget_bias), reverse=bool(reverse),
                            residual=bool(residual))
