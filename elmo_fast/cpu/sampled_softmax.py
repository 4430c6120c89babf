"""CPU backend of the softmax losses, sampled and full (``elmo_fast.reference.sampled_softmax`` is the oracle).

Sampled: one operator pair instead of autograd through ~12 ops: the (N, S) sample logits are written once, by one
GEMM with the corrected biases folded in (the true logits (N,) apart: no copy into a (N, 1+S) block), accidental
hits masked in place, and the softmax kept for backward in the same buffer. Backward: two GEMMs, ``dh`` and the
weight's gradient rows (written contiguous, which autograd keeps without the copy a column slice would cost), and
a column sum for the bias's; each computed only when its parameter needs a gradient. The weight and bias gradients
are sparse COO over ``cat(targets, samples)`` (uncoalesced, fixed size: no host read; one index tensor for both),
or dense.

Full (held-out perplexity, and training with ``sample_softmax: false``): the vocabulary in chunks of ~4M logits, an
online log-sum-exp over them; backward recomputes each chunk's logits. Memory O(N·P + chunk) instead of the
reference's N × V (8 GB at 2,560 rows and the original 793,471 words, twice over with autograd's saved softmax),
for one product more than the reference's three.

Both run with denormals flushed (``ext.denormals_flushed``) and never give exp an argument below ceil(log tiny)
(``_exp_floored_``): see ``_softmax_``.
"""
from __future__ import annotations

import math

import torch
from torch.library import custom_op

from ..ops._library import nothing, qualname
from .ext import denormals_flushed
from .gemm import gemm, gemm_add

Tensor = torch.Tensor


@custom_op(qualname("sampled_softmax_cpu"), mutates_args=())
def _sampled_softmax_op(hidden: Tensor, weight: Tensor, bias: Tensor, targets: Tensor, sampled_ids: Tensor,
                        true_logq: Tensor, samp_logq: Tensor, remove_hits: bool, reduction: str, sparse: bool
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, w_t, w_s, probs, p_true): the target and sample rows of ``weight``, and the softmax over
    ``[true, samples]`` as the samples' (N, S) and the true logits' (N,), which backward reads. ``sparse`` is for
    backward only (the form of the weight and bias gradients)."""
    return _forward_one(hidden, weight, bias, targets, sampled_ids, true_logq, samp_logq, remove_hits, reduction)


def _forward_one(hidden, weight, bias, targets, sampled_ids, true_logq, samp_logq, remove_hits, reduction):
    w_t, w_s = weight.index_select(0, targets), weight.index_select(0, sampled_ids)
    with denormals_flushed():
        logits = gemm(hidden, w_s.t(), bias.index_select(0, sampled_ids) - samp_logq)  # (N, S), the product's own
        true = torch.einsum("np,np->n", hidden, w_t) + bias.index_select(0, targets) - true_logq
        if remove_hits:
            logits.masked_fill_(targets.unsqueeze(1) == sampled_ids.unsqueeze(0), torch.finfo(hidden.dtype).min)
        loss, probs, p_true = _softmax_(logits, true)
    if reduction == "mean":
        loss = loss.mean()
    elif reduction == "sum":
        loss = loss.sum()
    return loss, w_t, w_s, probs, p_true


def _softmax_(sampled: Tensor, true: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(logsumexp − true, softmax of the samples, softmax of the true logit) of each row ``[true, sampled]``, the
    samples' softmax in their buffer: ``exp(x − max) / sum``, where terms below 2·tiny (2^-125 in fp32: x − max <
    −86.6) count as zero, as the flushed denormals they would be after the division. They would cost more than a
    flush: torch's exp takes a slow path, ~20x the time, for each argument whose result falls below tiny (x < −87.3
    in fp32: logits that spread so far apart, or masked hits), so the arguments are floored at ceil(log tiny) (−87)
    first, and what the floor touched is zeroed after."""
    top = torch.maximum(sampled.amax(1), true) if sampled.shape[1] else true.clone()
    probs = _exp_floored_(sampled.sub_(top.unsqueeze(1)))
    p_true = _exp_floored_(true - top)
    total = probs.sum(1) + p_true
    loss = top + total.log() - true
    return loss, probs.div_(total.unsqueeze(1)), p_true.div_(total)


def _exp_floored_(x: Tensor) -> Tensor:
    """exp(x) in place for x ≤ 0, with results ≤ 2·tiny set to 0 (see ``_softmax_``); tiny of fp32 for bf16 and
    fp16 (whose exp runs in fp32: fp16's own tiny, 6.1e-5, would floor at −9)."""
    info = torch.finfo(torch.promote_types(x.dtype, torch.float32))
    x.clamp_min_(math.ceil(math.log(info.tiny))).exp_()
    return torch.threshold_(x, 2 * info.tiny, 0.0)  # x ≤ 2·tiny -> 0: the floored terms (exp(−87) = 1.65e-38)


@_sampled_softmax_op.register_fake
def _sampled_fake(hidden, weight, bias, targets, sampled_ids, true_logq, samp_logq, remove_hits, reduction, sparse):
    N, S = hidden.shape[0], sampled_ids.shape[0]
    loss = hidden.new_empty(N) if reduction == "none" else hidden.new_empty(())
    return (loss, weight.new_empty(N, weight.shape[1]), weight.new_empty(S, weight.shape[1]),
            hidden.new_empty(N, S), hidden.new_empty(N))


@custom_op(qualname("sampled_softmax_cpu_backward"), mutates_args=())
def _sampled_softmax_backward(grad: Tensor, hidden: Tensor, w_t: Tensor, w_s: Tensor, probs: Tensor,
                              p_true: Tensor, reduction: str, need_h: bool, need_w: bool, need_b: bool
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, rows_w, rows_b): the gradient of ``hidden``, and the gradient rows of ``cat(targets, sampled_ids)`` of
    the weight (N + S, P) and of the bias (N + S,); placeholders where nothing is needed."""
    with denormals_flushed():  # d = probs / N: far-off samples' terms below tiny, flushed (see _softmax_)
        return _backward_rows(grad, hidden, w_t, w_s, probs, p_true, reduction, need_h, need_w, need_b)


def _backward_rows(grad, hidden, w_t, w_s, probs, p_true, reduction, need_h, need_w, need_b, out_w=None, out_b=None):
    """``out_w`` (N + S, P), ``out_b`` (N + S,): where the rows go (a pair's slices of one buffer), else new ones."""
    N = hidden.shape[0]
    g = grad.expand(N) / N if reduction == "mean" else grad.expand(N)  # d loss / d per-row loss
    d_samp = probs * g.unsqueeze(1)  # d loss / d logits: softmax - onehot(true), scaled
    d_true = p_true * g - g
    dh = gemm_add(d_true.unsqueeze(1) * w_t, d_samp, w_s, reuse=True) if need_h else nothing(hidden)
    rows_w, rows_b = nothing(hidden), nothing(hidden)  # two tensors: an operator's outputs may not alias
    if need_w:  # d loss / d w_row = Σ_n d_n·hidden_n, written in place: contiguous, so autograd keeps it uncopied
        rows_w = hidden.new_empty(N + d_samp.shape[1], hidden.shape[1]) if out_w is None else out_w
        torch.mul(d_true.unsqueeze(1), hidden, out=rows_w[:N])
        gemm(d_samp.t(), hidden, out=rows_w[N:])
    if need_b:
        if out_b is None:
            rows_b = torch.cat([d_true, d_samp.sum(0)])
        else:
            rows_b = out_b
            rows_b[:N] = d_true
            torch.sum(d_samp, 0, out=rows_b[N:])
    return dh, rows_w, rows_b


@_sampled_softmax_backward.register_fake
def _(grad, hidden, w_t, w_s, probs, p_true, reduction, need_h, need_w, need_b):
    (N, P), S = hidden.shape, w_s.shape[0]
    return (hidden.new_empty(hidden.shape) if need_h else nothing(hidden),
            hidden.new_empty(N + S, P) if need_w else nothing(hidden),
            hidden.new_empty(N + S) if need_b else nothing(hidden))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, sampled_ids, true_logq, samp_logq, remove_hits, reduction, sparse = inputs
    ctx.save_for_backward(hidden, targets, sampled_ids, *output[1:])
    ctx.flags = (reduction, sparse, weight.shape, bias.shape)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero gradients for w_t, w_s, probs, p_true: 28 MB of fills a call


def _backward(ctx, grad, *_):
    if grad is None:  # the loss reached the output through nothing differentiable (no zero-filled gradients here)
        return (None,) * 10
    hidden, targets, sampled_ids, w_t, w_s, probs, p_true = ctx.saved_tensors
    reduction, sparse, w_shape, b_shape = ctx.flags
    need = ctx.needs_input_grad
    dh, rows_w, rows_b = _sampled_softmax_backward(grad, hidden, w_t, w_s, probs, p_true, reduction, *need[:3])
    ids = torch.cat([targets, sampled_ids]) if need[1] or need[2] else None
    dw = _table_grad(ids, rows_w, w_shape, sparse) if need[1] else None
    db = _table_grad(ids, rows_b, b_shape, sparse) if need[2] else None
    return dh if need[0] else None, dw, db, *(None,) * 7


def _table_grad(ids: Tensor, rows: Tensor, shape, sparse: bool) -> Tensor:
    """The gradient of a table of ``shape`` from its rows at ``ids`` (repeated ids add up): sparse COO, or dense
    (zeros where no id points)."""
    if sparse:
        return torch.sparse_coo_tensor(ids.unsqueeze(0), rows, shape, check_invariants=False)
    return rows.new_zeros(shape).index_add_(0, ids, rows)


_sampled_softmax_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- the two directions at once
# bilm-tf's two directions each take a sampled softmax over the one table (their own samples). As two operators,
# autograd adds their sparse weight gradients in the table's input buffer: a zero-filled (N + S)·2 x P tensor and a
# copy of both (6.5 ms a B=16 step at the original sizes, 2 Xeon threads). The pair writes both directions' rows
# into one gradient: the same rows, in the same order (forward's targets and samples, then backward's).
@custom_op(qualname("sampled_softmax_pair_cpu"), mutates_args=())
def _pair_op(h_f: Tensor, h_b: Tensor, weight: Tensor, bias: Tensor, t_f: Tensor, t_b: Tensor, ids_f: Tensor,
             ids_b: Tensor, tq_f: Tensor, sq_f: Tensor, tq_b: Tensor, sq_b: Tensor, remove_hits: bool, reduction: str,
             sparse: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss_f, loss_b, then each direction's w_t, w_s, probs, p_true): two ``sampled_softmax_cpu`` forwards."""
    lf, *saved_f = _forward_one(h_f, weight, bias, t_f, ids_f, tq_f, sq_f, remove_hits, reduction)
    lb, *saved_b = _forward_one(h_b, weight, bias, t_b, ids_b, tq_b, sq_b, remove_hits, reduction)
    return (lf, lb, *saved_f, *saved_b)


@_pair_op.register_fake
def _(h_f, h_b, weight, bias, t_f, t_b, ids_f, ids_b, tq_f, sq_f, tq_b, sq_b, remove_hits, reduction, sparse):
    out = []
    for h, ids in ((h_f, ids_f), (h_b, ids_b)):
        out.append(_sampled_fake(h, weight, bias, None, ids, None, None, remove_hits, reduction, sparse))
    return (out[0][0], out[1][0], *out[0][1:], *out[1][1:])


@custom_op(qualname("sampled_softmax_pair_cpu_backward"), mutates_args=())
def _pair_backward(g_f: Tensor, g_b: Tensor, h_f: Tensor, h_b: Tensor, w_t_f: Tensor, w_s_f: Tensor,
                   probs_f: Tensor, pt_f: Tensor, w_t_b: Tensor, w_s_b: Tensor, probs_b: Tensor, pt_b: Tensor,
                   reduction: str, need_h_f: bool, need_h_b: bool, need_w: bool, need_b: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dh_f, dh_b, rows_w, rows_b): the rows of both directions in one (M, P) and one (M,), M = Σ (N + S)."""
    n_f = h_f.shape[0] + w_s_f.shape[0]
    M = n_f + h_b.shape[0] + w_s_b.shape[0]
    rows_w = h_f.new_empty(M, h_f.shape[1]) if need_w else nothing(h_f)
    rows_b = h_f.new_empty(M) if need_b else nothing(h_f)
    dh = []
    with denormals_flushed():
        for g, h, w_t, w_s, probs, pt, need_h, sl in ((g_f, h_f, w_t_f, w_s_f, probs_f, pt_f, need_h_f, slice(0, n_f)),
                                                      (g_b, h_b, w_t_b, w_s_b, probs_b, pt_b, need_h_b,
                                                       slice(n_f, M))):
            d, _, _ = _backward_rows(g, h, w_t, w_s, probs, pt, reduction, need_h, need_w, need_b,
                                     rows_w[sl] if need_w else None, rows_b[sl] if need_b else None)
            dh.append(d)
    return dh[0], dh[1], rows_w, rows_b


@_pair_backward.register_fake
def _(g_f, g_b, h_f, h_b, w_t_f, w_s_f, probs_f, pt_f, w_t_b, w_s_b, probs_b, pt_b, reduction, need_h_f, need_h_b,
      need_w, need_b):
    M = h_f.shape[0] + w_s_f.shape[0] + h_b.shape[0] + w_s_b.shape[0]
    return (h_f.new_empty(h_f.shape) if need_h_f else nothing(h_f), h_b.new_empty(h_b.shape) if need_h_b else
            nothing(h_b), h_f.new_empty(M, h_f.shape[1]) if need_w else nothing(h_f),
            h_f.new_empty(M) if need_b else nothing(h_f))


def _pair_setup_context(ctx, inputs, output):
    h_f, h_b, weight, bias, t_f, t_b, ids_f, ids_b, *_, remove_hits, reduction, sparse = inputs
    ctx.save_for_backward(h_f, h_b, t_f, t_b, ids_f, ids_b, *output[2:])
    ctx.flags = (reduction, sparse, weight.shape, bias.shape)
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)  # no zero gradients for the eight saved outputs (~56 MB of fills a step)
    ctx.loss_shapes = (output[0].shape, output[1].shape)


def _pair_backward_fn(ctx, g_f, g_b, *_):
    if g_f is None and g_b is None:
        return (None,) * 15
    # a loss that reached nothing differentiable: its hidden state gets no gradient, its rows of the table's zeros
    # (a scalar's worth of fill here)
    need = list(ctx.needs_input_grad)
    need[0], need[1] = need[0] and g_f is not None, need[1] and g_b is not None
    g_f, g_b = (g if g is not None else torch.zeros(shape, dtype=ctx.saved_tensors[0].dtype)
                for g, shape in zip((g_f, g_b), ctx.loss_shapes))
    h_f, h_b, t_f, t_b, ids_f, ids_b, *saved = ctx.saved_tensors
    reduction, sparse, w_shape, b_shape = ctx.flags
    dh_f, dh_b, rows_w, rows_b = _pair_backward(g_f, g_b, h_f, h_b, *saved, reduction, *need[:4])
    ids = torch.cat([t_f, ids_f, t_b, ids_b]) if need[2] or need[3] else None
    dw = _table_grad(ids, rows_w, w_shape, sparse) if need[2] else None
    db = _table_grad(ids, rows_b, b_shape, sparse) if need[3] else None
    return dh_f if need[0] else None, dh_b if need[1] else None, dw, db, *(None,) * 11


_pair_op.register_autograd(_pair_backward_fn, setup_context=_pair_setup_context)


def sampled_softmax_pair_loss_cpu(h_f, t_f, ids_f, tq_f, sq_f, h_b, t_b, ids_b, tq_b, sq_b, weight, bias, *,
                                  remove_accidental_hits=True, reduction="mean", sparse_grad=False):
    """Two :func:`sampled_softmax_loss_cpu` calls over one table (each direction's hidden, targets, samples and
    expected counts), as one operator: (loss_f, loss_b), the table's gradients one tensor each."""
    _check_reduction(reduction)
    dt = h_f.dtype
    out = _pair_op(h_f, h_b, weight, bias, t_f, t_b, ids_f, ids_b, torch.log(tq_f).to(dt), torch.log(sq_f).to(dt),
                   torch.log(tq_b).to(dt), torch.log(sq_b).to(dt), bool(remove_accidental_hits), reduction,
                   bool(sparse_grad))
    return out[0], out[1]


def _check_reduction(reduction: str) -> None:
    """The operators reduce for "mean" and "sum" and return the rows' losses otherwise: refuse any other name here,
    as the reference does, rather than return (N,) for a misspelt one."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def sampled_softmax_loss_cpu(hidden, targets, weight, bias, sampled_ids, true_expected, sampled_expected, *,
                             remove_accidental_hits=True, reduction="mean", sparse_grad=False):
    """Arguments and result of ``sampled_softmax_loss_reference`` (expected counts in float64, as there): the
    operator ``elmo_fast::sampled_softmax_cpu``, its backward ``elmo_fast::sampled_softmax_cpu_backward``."""
    _check_reduction(reduction)
    dt = hidden.dtype
    return _sampled_softmax_op(hidden, weight, bias, targets, sampled_ids, torch.log(true_expected).to(dt),
                               torch.log(sampled_expected).to(dt), bool(remove_accidental_hits), reduction,
                               bool(sparse_grad))[0]


# ----------------------------------------------------------------------------- full softmax
_CHUNK_LOGITS = 1 << 22  # logits computed at a time: 16 MiB of fp32, whatever the rows
_CHUNK_MIN_WORDS = 256  # a chunk's least width (many rows)


def _vocab_chunks(N: int, V: int):
    """(start, stop) of the vocabulary chunks for N rows: ~_CHUNK_LOGITS logits each, at least _CHUNK_MIN_WORDS."""
    width = max(_CHUNK_MIN_WORDS, _CHUNK_LOGITS // max(N, 1))
    return [(v, min(V, v + width)) for v in range(0, V, width)]


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor, v0: int, v1: int, buf: Tensor) -> Tensor:
    """hidden · weight[v0:v1]ᵀ + bias[v0:v1], written into the front of ``buf`` (contiguous)."""
    out = buf[: hidden.shape[0] * (v1 - v0)].view(hidden.shape[0], v1 - v0)
    return gemm(hidden, weight[v0:v1].t(), bias[v0:v1], out=out)


@custom_op(qualname("full_softmax_cpu"), mutates_args=())
def _full_softmax_op(hidden: Tensor, weight: Tensor, bias: Tensor, targets: Tensor, reduction: str
                     ) -> tuple[Tensor, Tensor]:
    """(loss, lse): the NLL over the whole vocabulary, and each row's log-sum-exp (N,), which backward reads. The
    running maximum, sum and lse are at least fp32 (bf16 inputs under autocast)."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(hidden)
    chunks = _vocab_chunks(N, V)
    buf = hidden.new_empty(N * (chunks[0][1] - chunks[0][0]))
    top = hidden.new_full((N, 1), torch.finfo(acc).min, dtype=acc)  # not −inf: a chunk of −inf logits gives no NaN
    total = hidden.new_zeros((N, 1), dtype=acc)
    with denormals_flushed():
        for v0, v1 in chunks:  # online log-sum-exp: the running sum rescaled to each new row maximum
            x = _chunk_logits(hidden, weight, bias, v0, v1, buf)
            new_top = torch.maximum(top, x.amax(1, keepdim=True))
            total.mul_(_exp_floored_(top.sub_(new_top)))
            total.add_(_exp_floored_(x.sub_(new_top)).sum(1, keepdim=True, dtype=acc))
            top = new_top
        lse = top.add_(total.log_()).squeeze(1)
        true = torch.einsum("np,np->n", hidden, weight.index_select(0, targets)) + bias.index_select(0, targets)
        loss = (lse - true).to(hidden.dtype)
    if reduction == "mean":
        loss = loss.mean()
    elif reduction == "sum":
        loss = loss.sum()
    return loss, lse


@_full_softmax_op.register_fake
def _(hidden, weight, bias, targets, reduction):
    N = hidden.shape[0]
    return (hidden.new_empty(N) if reduction == "none" else hidden.new_empty(())), hidden.new_empty(N,
                                                                                              dtype=_acc_dtype(hidden))


def _acc_dtype(hidden: Tensor) -> torch.dtype:
    """The full softmax's accumulation dtype: fp32 for bf16/fp16 inputs, else the inputs'."""
    return torch.promote_types(hidden.dtype, torch.float32)


@custom_op(qualname("full_softmax_cpu_backward"), mutates_args=())
def _full_softmax_backward(grad: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor, targets: Tensor, lse: Tensor,
                           reduction: str, need_h: bool, need_w: bool, need_b: bool
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, dweight, dbias), dense; placeholders where nothing is needed. d loss / d logits = g·(softmax − onehot),
    the softmax recomputed chunk by chunk from ``lse``; the one-hot part added at the target rows after."""
    N, V = hidden.shape[0], weight.shape[0]
    g = grad.expand(N) / N if reduction == "mean" else grad.expand(N)
    chunks = _vocab_chunks(N, V)
    buf = hidden.new_empty(N * (chunks[0][1] - chunks[0][0]))
    dh = hidden.new_zeros(hidden.shape, dtype=lse.dtype) if need_h else nothing(hidden)  # summed over chunks
    dw = weight.new_empty(weight.shape) if need_w else nothing(weight)
    db = bias.new_empty(bias.shape) if need_b else nothing(bias)
    with denormals_flushed():
        for v0, v1 in chunks:
            d = _exp_floored_(_chunk_logits(hidden, weight, bias, v0, v1, buf).sub_(lse.unsqueeze(1)))
            d.mul_(g.unsqueeze(1))
            if need_h and dh.dtype == d.dtype:
                dh = gemm_add(dh, d, weight[v0:v1], reuse=True)
            elif need_h:  # bf16 products, summed in fp32
                dh.add_(d @ weight[v0:v1])
            if need_w:
                gemm(d.t(), hidden, out=dw[v0:v1])
            if need_b:
                torch.sum(d, 0, out=db[v0:v1])
        if need_h:
            dh = dh.sub_(g.unsqueeze(1) * weight.index_select(0, targets)).to(hidden.dtype)
        if need_w:
            dw.index_add_(0, targets, hidden * g.unsqueeze(1), alpha=-1)
        if need_b:
            db.index_add_(0, targets, g.to(db.dtype), alpha=-1)
    return dh, dw, db


@_full_softmax_backward.register_fake
def _(grad, hidden, weight, bias, targets, lse, reduction, need_h, need_w, need_b):
    return (hidden.new_empty(hidden.shape) if need_h else nothing(hidden),
            weight.new_empty(weight.shape) if need_w else nothing(weight),
            bias.new_empty(bias.shape) if need_b else nothing(bias))


def _full_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, reduction = inputs
    ctx.save_for_backward(hidden, weight, bias, targets, output[1])
    ctx.reduction = reduction
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _full_backward(ctx, grad, _):
    if grad is None:  # as in _backward
        return (None,) * 5
    hidden, weight, bias, targets, lse = ctx.saved_tensors
    need = ctx.needs_input_grad
    dh, dw, db = _full_softmax_backward(grad, hidden, weight, bias, targets, lse, ctx.reduction, *need[:3])
    return dh if need[0] else None, dw if need[1] else None, db if need[2] else None, None, None


_full_softmax_op.register_autograd(_full_backward, setup_context=_full_setup_context)


def full_softmax_nll_cpu(hidden, targets, weight, bias, reduction="mean"):
    """Arguments and result of ``full_softmax_nll_reference``: the operator ``elmo_fast::full_softmax_cpu``, its
    backward ``elmo_fast::full_softmax_cpu_backward``."""
    _check_reduction(reduction)
    return _full_softmax_op(hidden, weight, bias, targets, reduction)[0]
