"""CPU backend of the sampled softmax loss (``elmo_fast.reference.sampled_softmax`` is the oracle).

One operator pair instead of autograd through ~12 ops: the (N, 1+S) logits are written once (the sampled block by
one GEMM with the corrected biases folded in, the true logit beside it), accidental hits masked in place, and the
softmax kept for backward in the same buffer; backward is two GEMMs: ``dh``, and the weight and bias gradient rows
of the samples together (``dᵀ·[hidden | 1]``: one pass over ``d`` sums both), each part computed only when its
parameter needs a gradient. The weight and bias gradients are sparse COO over ``cat(targets, samples)``
(uncoalesced, fixed size: no host read; one index tensor for both), or dense.
"""
from __future__ import annotations

import math

import torch
from torch.library import custom_op

from ..ops._library import nothing, qualname
from .ext import denormals_flushed
from .gemm import gemm

Tensor = torch.Tensor


@custom_op(qualname("sampled_softmax_cpu"), mutates_args=())
def _sampled_softmax_op(hidden: Tensor, weight: Tensor, bias: Tensor, targets: Tensor, sampled_ids: Tensor,
                        true_logq: Tensor, samp_logq: Tensor, remove_hits: bool, reduction: str, sparse: bool
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, w_t, w_s, probs): the target and sample rows of ``weight`` and the (N, 1+S) softmax, which backward
    reads. ``sparse`` is for backward only (the form of the weight and bias gradients)."""
    w_t, w_s = weight.index_select(0, targets), weight.index_select(0, sampled_ids)
    N, S = hidden.shape[0], sampled_ids.shape[0]
    logits = hidden.new_empty(N, 1 + S)
    with denormals_flushed():
        gemm(hidden, w_s.t(), bias.index_select(0, sampled_ids) - samp_logq, out=logits[:, 1:])
        logits[:, 0] = torch.einsum("np,np->n", hidden, w_t) + bias.index_select(0, targets) - true_logq
        if remove_hits:
            logits[:, 1:].masked_fill_(targets.unsqueeze(1) == sampled_ids.unsqueeze(0),
                                       torch.finfo(hidden.dtype).min)
        loss, probs = _softmax_(logits)
    if reduction == "mean":
        loss = loss.mean()
    elif reduction == "sum":
        loss = loss.sum()
    return loss, w_t, w_s, probs


def _softmax_(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(logsumexp − first column, softmax) of each row, the softmax in the logits' buffer: ``exp(x − max) / sum``,
    where terms below 2·tiny (2^-125 in fp32: x − max < −86.6) count as zero, as the flushed denormals they would be
    after the division. They would cost more than a flush: torch's exp takes a slow path, ~20x the time, for each
    argument whose result falls below tiny (x < −87.3 in fp32: logits that spread so far apart, or masked hits), so
    the arguments are floored at ceil(log tiny) (−87) first, and what the floor touched is zeroed after."""
    info = torch.finfo(logits.dtype)
    loss = logits[:, 0].neg()
    top = logits.amax(1, keepdim=True)
    probs = logits.sub_(top).clamp_min_(math.ceil(math.log(info.tiny))).exp_()
    torch.threshold_(probs, 2 * info.tiny, 0.0)  # x ≤ 2·tiny -> 0: the floored terms (exp(−87) = 1.65e-38) and below
    total = probs.sum(1, keepdim=True)
    loss += (top + total.log()).squeeze(1)
    return loss, probs.div_(total)


@_sampled_softmax_op.register_fake
def _(hidden, weight, bias, targets, sampled_ids, true_logq, samp_logq, remove_hits, reduction, sparse):
    N, S = hidden.shape[0], sampled_ids.shape[0]
    loss = hidden.new_empty(N) if reduction == "none" else hidden.new_empty(())
    return (loss, weight.new_empty(N, weight.shape[1]), weight.new_empty(S, weight.shape[1]),
            hidden.new_empty(N, 1 + S))


@custom_op(qualname("sampled_softmax_cpu_backward"), mutates_args=())
def _sampled_softmax_backward(grad: Tensor, hidden: Tensor, w_t: Tensor, w_s: Tensor, probs: Tensor,
                              reduction: str, need_h: bool, need_w: bool, need_b: bool) -> tuple[Tensor, Tensor]:
    """(dh, rows): the gradient of ``hidden`` and the (N + S, P·need_w + need_b) gradient rows of
    ``cat(targets, sampled_ids)``: the weight's in the first P columns (with ``need_w``), the bias's in the last
    (with ``need_b``); placeholders where nothing is needed."""
    with denormals_flushed():  # d = probs / N: far-off samples' terms below tiny, flushed (see _softmax_)
        return _backward_rows(grad, hidden, w_t, w_s, probs, reduction, need_h, need_w, need_b)


def _backward_rows(grad, hidden, w_t, w_s, probs, reduction, need_h, need_w, need_b):
    N = hidden.shape[0]
    g = grad.expand(N) / N if reduction == "mean" else grad.expand(N)  # d loss / d per-row loss
    d = probs * g.unsqueeze(1)  # d loss / d logits: softmax - onehot(true), scaled
    d[:, 0] -= g
    d_true, d_samp = d[:, 0], d[:, 1:]
    dh = torch.addmm(d_true.unsqueeze(1) * w_t, d_samp, w_s) if need_h else nothing(hidden)
    if not (need_w or need_b):
        return dh, nothing(hidden)
    # d loss / d (w_row, b_row) = Σ_n d_n·(hidden_n, 1): the bias column rides along the weight's product
    h1 = torch.cat([hidden] * need_w + [hidden.new_ones(N, 1)] * need_b, 1)
    rows = hidden.new_empty(N + d_samp.shape[1], h1.shape[1])  # written in place: no (N + S, P + 1) concatenation
    torch.mul(d_true.unsqueeze(1), h1, out=rows[:N])
    gemm(d_samp.t(), h1, out=rows[N:])
    return dh, rows


@_sampled_softmax_backward.register_fake
def _(grad, hidden, w_t, w_s, probs, reduction, need_h, need_w, need_b):
    (N, P), S = hidden.shape, w_s.shape[0]
    rows = hidden.new_empty(N + S, P * int(need_w) + int(need_b)) if need_w or need_b else nothing(hidden)
    return (torch.empty_like(hidden) if need_h else nothing(hidden)), rows


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, sampled_ids, true_logq, samp_logq, remove_hits, reduction, sparse = inputs
    ctx.save_for_backward(hidden, targets, sampled_ids, *output[1:])
    ctx.flags = (reduction, sparse, weight.shape, bias.shape)
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grad, *_):
    hidden, targets, sampled_ids, w_t, w_s, probs = ctx.saved_tensors
    reduction, sparse, w_shape, b_shape = ctx.flags
    need = ctx.needs_input_grad
    dh, rows = _sampled_softmax_backward(grad, hidden, w_t, w_s, probs, reduction, need[0], need[1], need[2])
    ids = torch.cat([targets, sampled_ids]) if need[1] or need[2] else None
    dw = _table_grad(ids, rows[:, : w_shape[1]], w_shape, sparse) if need[1] else None
    db = _table_grad(ids, rows[:, -1], b_shape, sparse) if need[2] else None
    return dh if need[0] else None, dw, db, *(None,) * 7


def _table_grad(ids: Tensor, rows: Tensor, shape, sparse: bool) -> Tensor:
    """The gradient of a table of ``shape`` from its rows at ``ids`` (repeated ids add up): sparse COO, or dense
    (zeros where no id points)."""
    if sparse:
        return torch.sparse_coo_tensor(ids.unsqueeze(0), rows, shape, check_invariants=False)
    return rows.new_zeros(shape).index_add_(0, ids, rows)


_sampled_softmax_op.register_autograd(_backward, setup_context=_setup_context)


def sampled_softmax_loss_cpu(hidden, targets, weight, bias, sampled_ids, true_expected, sampled_expected, *,
                             remove_accidental_hits=True, reduction="mean", sparse_grad=False):
    """Arguments and result of ``sampled_softmax_loss_reference`` (expected counts in float64, as there): the
    operator ``elmo_fast::sampled_softmax_cpu``, its backward ``elmo_fast::sampled_softmax_cpu_backward``."""
    dt = hidden.dtype
    return _sampled_softmax_op(hidden, weight, bias, targets, sampled_ids, torch.log(true_expected).to(dt),
                               torch.log(sampled_expected).to(dt), bool(remove_accidental_hits), reduction,
                               bool(sparse_grad))[0]
