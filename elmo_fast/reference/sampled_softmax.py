"""Sampled softmax (TF ``sampled_softmax_loss`` with the log-uniform sampler, spec §6.5) and the exact
full-softmax negative log-likelihood used for held-out perplexity (spec §6.7).

Shapes: N positions, P hidden width, V vocabulary, S samples. ``weight`` is (V, P), ``bias`` (V,).

This file is the oracle: plain, slow where that makes it obviously right, fp64-capable.

Sampler, TF semantics (``LogUniformSampler`` + ``RangeSamplerOp`` with ``unique=True``):
one draw is ``int64(exp(U·log(V+1))) − 1`` (then ``mod V``, a guard against round-off) with U ~ Uniform[0, 1)
in double precision; a draw equal to an id already kept is rejected; ``num_tries`` counts every draw, the
rejected ones included. The kept ids come out in draw order.

The stream of uniforms is ``torch.rand(chunk, dtype=float64, generator=g)`` repeated; the chunk length is a
deterministic function of (S, V) (:func:`sampler_chunk_size`), so the oracle below and the vectorised device
sampler in ``elmo_fast.ops.softmax`` consume the same stream and must keep the same ids.
"""
from __future__ import annotations

import functools
import math

import torch

FLT_MAX = 3.4028234663852886e38


def log_uniform_probability(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """P(k) = (log(k+2) - log(k+1)) / log(V+1), in float64."""
    k = ids.to(torch.float64)
    return torch.log1p(1.0 / (k + 1.0)) / math.log(vocab_size + 1.0)


def log_uniform_ids_from_uniform(u: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Map float64 uniforms in [0, 1) to log-uniform ids exactly as TF does: ``int64(exp(u·log(V+1))) − 1``,
    then ``mod V`` (TF's guard: round-off can give V when u is within an ulp of 1)."""
    x = torch.exp(u.to(torch.float64) * math.log(vocab_size + 1.0))
    return torch.remainder(x.floor().long() - 1, vocab_size)


@functools.lru_cache(maxsize=64)
def sampler_chunk_size(num_sampled: int, vocab_size: int) -> int:
    """Number of uniforms drawn per round by the samplers: the number of draws n at which the expected number
    of distinct ids ``Σ_k 1 − (1 − P(k))^n`` reaches S, plus a margin of ~10% + 6σ, so that one round
    almost always suffices (one host check per sample set). Deterministic in (S, V)."""
    p = log_uniform_probability(torch.arange(vocab_size), vocab_size)
    log1m_p = torch.log1p(-p)

    def distinct(n: float) -> float:
        return float((-torch.expm1(n * log1m_p)).sum())

    lo, hi = float(num_sampled), float(num_sampled)
    while distinct(hi) < num_sampled and hi < 2.0**40:
        lo, hi = hi, hi * 2.0
    while hi - lo > 0.01 * hi:  # 1% is plenty for a chunk size
        mid = 0.5 * (lo + hi)
        if distinct(mid) < num_sampled:
            lo = mid
        else:
            hi = mid
    n = hi
    chunk = int(math.ceil(1.1 * n + 6.0 * math.sqrt(n) + 32))
    return max(num_sampled, min(chunk, 1 << 26))


def log_uniform_sample_reference(
    num_sampled: int,
    vocab_size: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    chunk: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Draw ``num_sampled`` unique log-uniform ids with TF's rejection loop, one draw at a time on the host
    (slow; the oracle for ``elmo_fast.ops.log_uniform_sample``).

    Returns (ids (S,) int64 on ``device`` in draw order, num_tries).
    """
    if not 0 < num_sampled <= vocab_size:
        raise ValueError(f"num_sampled must be in [1, vocab_size={vocab_size}], got {num_sampled}")
    chunk = chunk or sampler_chunk_size(num_sampled, vocab_size)
    kept: list[int] = []
    seen: set[int] = set()
    tries = 0
    while True:
        u = torch.rand(chunk, generator=generator, dtype=torch.float64, device=device)
        for v in log_uniform_ids_from_uniform(u, vocab_size).tolist():
            tries += 1
            if v not in seen:
                seen.add(v)
                kept.append(v)
                if len(kept) == num_sampled:
                    return torch.tensor(kept, dtype=torch.long, device=device), tries


def expected_count_reference(ids: torch.Tensor, num_tries: int, num_sampled: int, vocab_size: int) -> torch.Tensor:
    """TF's expected count (float64): ``P·S`` when no draw was rejected (num_tries == S), else
    ``1 − (1 − P)^num_tries = −expm1(num_tries·log1p(−P))``."""
    p = log_uniform_probability(ids, vocab_size)
    if int(num_tries) == int(num_sampled):
        return p * num_sampled
    return -torch.expm1(float(num_tries) * torch.log1p(-p))


class _GatherRows(torch.autograd.Function):
    """``table[ids]`` whose gradient w.r.t. ``table`` is a sparse COO tensor (rows ``ids``) when asked."""

    @staticmethod
    def forward(ctx, table, ids, sparse):
        ctx.save_for_backward(ids)
        ctx.shape = table.shape
        ctx.sparse = sparse
        return table.index_select(0, ids)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        if ctx.sparse:
            return torch.sparse_coo_tensor(ids.unsqueeze(0), grad, ctx.shape, check_invariants=False), None, None
        return grad.new_zeros(ctx.shape).index_add_(0, ids, grad), None, None


def gather_rows(table: torch.Tensor, ids: torch.Tensor, sparse: bool = False) -> torch.Tensor:
    """Rows of ``table`` (any rank ≥ 1) at ``ids``; with ``sparse=True`` the table's gradient is sparse COO."""
    if sparse:
        return _GatherRows.apply(table, ids, True)
    return table.index_select(0, ids)


def sampled_softmax_loss_reference(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    sampled_ids: torch.Tensor,
    true_expected: torch.Tensor,
    sampled_expected: torch.Tensor,
    *,
    remove_accidental_hits: bool = True,
    reduction: str = "mean",
    sparse_grad: bool = False,
) -> torch.Tensor:
    """Per position: ``logsumexp([true, samples]) − true`` with logits ``x·w + b − log Q``.

    hidden (N, P); targets (N,) int; sampled_ids (S,); true_expected (N,); sampled_expected (S,) (float64 from
    :func:`expected_count_reference`). Accidental hits (a sample equal to the row's target) get −FLT_MAX, as TF
    adds −FLT_MAX to them (other dtypes: their most negative finite value, the same zero probability).
    With ``sparse_grad`` the gradients of ``weight`` and ``bias`` are sparse COO tensors over the target and
    sample rows.
    """
    dt = hidden.dtype
    w_t = gather_rows(weight, targets, sparse_grad)
    b_t = gather_rows(bias, targets, sparse_grad)
    true_logit = (hidden * w_t).sum(-1) + b_t - torch.log(true_expected).to(dt)
    w_s = gather_rows(weight, sampled_ids, sparse_grad)
    b_s = gather_rows(bias, sampled_ids, sparse_grad)
    s_logit = hidden @ w_s.t() + b_s - torch.log(sampled_expected).to(dt)
    if remove_accidental_hits:
        hits = targets.unsqueeze(1) == sampled_ids.unsqueeze(0)
        # −FLT_MAX in fp32 (TF); the most negative finite value in other dtypes (bf16 cannot hold −FLT_MAX)
        s_logit = s_logit.masked_fill(hits, torch.finfo(dt).min)
    row = torch.cat([true_logit.unsqueeze(1), s_logit], dim=1)
    loss = torch.logsumexp(row, dim=1) - true_logit
    return _reduce(loss, reduction)


def full_softmax_nll_reference(hidden, targets, weight, bias, reduction: str = "mean"):
    """Exact NLL over the whole vocabulary: ``logsumexp(x·Wᵀ + b) − (x·w_y + b_y)``. Materialises N × V."""
    logits = hidden @ weight.t() + bias
    loss = torch.logsumexp(logits, dim=1) - logits.gather(1, targets.view(-1, 1)).squeeze(1)
    return _reduce(loss, reduction)


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
