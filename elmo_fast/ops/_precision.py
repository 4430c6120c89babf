"""The mixed-precision policy of the fused ops, in one place (every op in ``elmo_fast.ops`` calls it).

Under ``torch.autocast(device, dtype=torch.bfloat16)`` (or float16) on the tensors' device:

* the operands of every product (activations and weights) go to the autocast dtype, so the Triton and CUDA
  kernels run their tensor-core variants (fp32 accumulation inside). fp64 inputs are left alone, as autocast
  leaves them;
* weights are cast once per optimizer step, not per call: :func:`cast_weight` keeps the cast copy of each
  parameter (or view of one) until the parameter's version counter moves (every in-place update bumps it),
  and the gradient of the copy flows back to the fp32 master weight, cast to its dtype;
* biases and recurrent states keep their dtype (fp32): the kernels read them into fp32 accumulators, and the
  LSTM cell state stays fp32 across steps and calls.

The reference path is plain PyTorch and mixes no dtypes, so it gets every floating input in the compute dtype
and runs with autocast off (:func:`reference_inputs`): it is then the reference "in the same low precision"
of the accuracy budget. Outside autocast nothing is cast: a bf16 model runs bf16 kernels as it is.
"""
from __future__ import annotations

import contextlib

import torch

from .._stamp import stamp, unchanged
from torch.utils.weak import WeakIdKeyDictionary

from ._library import tracing

_LOW = (torch.bfloat16, torch.float16)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``device``'s type, else None."""
    kind = torch.device(device).type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype in which recurrent states are kept between calls for activations of ``dtype``: fp32 for bf16/fp16."""
    return torch.float32 if dtype in _LOW else dtype


def compute_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype ``t``'s products run in under the current autocast state: None when nothing is to be cast."""
    low = autocast_dtype(t.device)
    if low is None or not t.is_floating_point() or t.dtype == torch.float64:
        return None
    return low


class _CachedCast(torch.autograd.Function):
    """Returns the cached low-precision copy; backward hands its gradient to the master weight in its dtype."""

    @staticmethod
    def forward(ctx, master, low):
        ctx.dtype = master.dtype
        return low.view_as(low)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


# master tensor (a parameter, or the base of a view of one) -> {(offset, shape, stride, dtype): (stamp, copy)}
_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def cast_weight(w: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``w`` in ``dtype`` (None: ``w`` itself), cast once per version of ``w``.

    Leaves (parameters) and views of leaves are cached, keyed by the leaf and the view's geometry and
    invalidated by the shared version counter; any other tensor (a product of autograd) is cast per call, and so
    is every tensor while torch.compile / torch.export trace (the cast is then part of the graph).
    """
    if dtype is None or w.dtype == dtype:
        return w
    if tracing(w):
        return w.to(dtype)
    base = w._base if w._base is not None else w
    if not base.is_leaf:
        return w.to(dtype)
    key = (w.storage_offset(), tuple(w.shape), tuple(w.stride()), dtype)
    entries = _CACHE.setdefault(base, {})
    hit = entries.get(key)
    if hit is None or not unchanged(hit[0], w):  # elmo_fast._stamp: version counter, storage, values on CPU
        with torch.no_grad():
            hit = (stamp(w), w.detach().to(dtype))
        entries[key] = hit
    low = hit[1]
    if torch.is_grad_enabled() and w.requires_grad:
        return _CachedCast.apply(w, low)
    return low


def activations(dtype: torch.dtype | None, *ts: torch.Tensor | None):
    """Cast activations to ``dtype`` (None: unchanged); autograd records the cast."""
    if dtype is None:
        return ts
    return tuple(t if t is None or t.dtype == dtype else t.to(dtype) for t in ts)


def weights(dtype: torch.dtype | None, *ws: torch.Tensor | None):
    """:func:`cast_weight` over several weights (None entries pass through)."""
    return tuple(None if w is None else cast_weight(w, dtype) for w in ws)


def reference_inputs(dtype: torch.dtype | None, *ts):
    """Every floating tensor of ``ts`` in ``dtype`` (weights through the cache; others passed as they are)."""
    if dtype is None:
        return ts
    return tuple(t if not isinstance(t, torch.Tensor) or not t.is_floating_point() else cast_weight(t, dtype)
                 for t in ts)


def no_autocast(device: torch.device):
    """Autocast off on ``device``'s type for the duration (inputs are cast explicitly by this module)."""
    kind = torch.device(device).type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()
