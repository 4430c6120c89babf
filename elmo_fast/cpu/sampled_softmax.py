"""CPU backend of the sampled softmax loss (``elmo_fast.reference.sampled_softmax`` is the oracle).

One autograd Function instead of autograd through ~12 ops: the (N, 1+S) logits are written once (the sampled
block by one GEMM with the corrected biases folded in, the true logit beside it), accidental hits masked in
place, and the softmax kept for backward in the same buffer; backward is two GEMMs (``dh``, ``dW`` of the sample
rows) plus row sums. The weight and bias gradients are sparse COO over ``cat(targets, samples)`` (uncoalesced,
fixed size: no host read), or dense.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


class _SampledSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, sampled_ids, true_logq, samp_logq, remove_hits, reduction,
                sparse):
        w_t, w_s = weight.index_select(0, targets), weight.index_select(0, sampled_ids)
        N, S = hidden.shape[0], sampled_ids.shape[0]
        logits = hidden.new_empty(N, 1 + S)
        torch.addmm(bias.index_select(0, sampled_ids) - samp_logq, hidden, w_s.t(), out=logits[:, 1:])
        logits[:, 0] = torch.einsum("np,np->n", hidden, w_t) + bias.index_select(0, targets) - true_logq
        if remove_hits:
            logits[:, 1:].masked_fill_(targets.unsqueeze(1) == sampled_ids.unsqueeze(0), torch.finfo(hidden.dtype).min)
        lse = torch.logsumexp(logits, dim=1)
        loss = lse - logits[:, 0]
        probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in the logits' buffer
        ctx.save_for_backward(hidden, w_t, w_s, probs, targets, sampled_ids)
        ctx.flags = (reduction, sparse, weight.shape, bias.shape)
        if reduction == "mean":
            return loss.mean()
        return loss.sum() if reduction == "sum" else loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        hidden, w_t, w_s, probs, targets, sampled_ids = ctx.saved_tensors
        reduction, sparse, w_shape, b_shape = ctx.flags
        N = hidden.shape[0]
        g = grad.expand(N) / N if reduction == "mean" else grad.expand(N)  # d loss / d per-row loss
        d = probs * g.unsqueeze(1)  # d loss / d logits: softmax - onehot(true), scaled
        d[:, 0] -= g
        d_true, d_samp = d[:, 0], d[:, 1:]
        dh = torch.addmm(d_true.unsqueeze(1) * w_t, d_samp, w_s) if ctx.needs_input_grad[0] else None
        dw = db = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            ids = torch.cat([targets, sampled_ids])
            rows_w = torch.cat([d_true.unsqueeze(1) * hidden, torch.mm(d_samp.t(), hidden)])
            rows_b = torch.cat([d_true, d_samp.sum(0)])
            if sparse:
                dw = torch.sparse_coo_tensor(ids.unsqueeze(0), rows_w, w_shape, check_invariants=False)
                db = torch.sparse_coo_tensor(ids.unsqueeze(0), rows_b, b_shape, check_invariants=False)
            else:
                dw = rows_w.new_zeros(w_shape).index_add_(0, ids, rows_w)
                db = rows_b.new_zeros(b_shape).index_add_(0, ids, rows_b)
        return dh, dw, db, None, None, None, None, None, None, None


def sampled_softmax_loss_cpu(hidden, targets, weight, bias, sampled_ids, true_expected, sampled_expected, *,
                             remove_accidental_hits=True, reduction="mean", sparse_grad=False):
    """Arguments and result of ``sampled_softmax_loss_reference`` (expected counts in float64, as there)."""
    dt = hidden.dtype
    return _SampledSoftmax.apply(hidden, weight, bias, targets, sampled_ids, torch.log(true_expected).to(dt),
                                 torch.log(sampled_expected).to(dt), remove_accidental_hits, reduction, sparse_grad)
