"""Sampled softmax (TF ``sampled_softmax_loss`` with the log-uniform sampler, spec §6.5) and the exact
full-softmax negative log-likelihood used for held-out perplexity.

Shapes: N positions, P hidden width, V vocabulary, S samples. ``weight`` is (V, P), ``bias`` (V,).
"""
from __future__ import annotations

import math

import torch

FLT_MAX = 3.4028234663852886e38


def log_uniform_probability(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """P(k) = (log(k+2) - log(k+1)) / log(V+1), in float64."""
    k = ids.to(torch.float64)
    return (torch.log(k + 2.0) - torch.log(k + 1.0)) / math.log(vocab_size + 1.0)


def log_uniform_sample_reference(
    num_sampled: int,
    vocab_size: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    chunk: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Draw ``num_sampled`` unique ids from the log-uniform law the way TF does: independent draws
    ``floor(exp(U·log(V+1))) - 1``, duplicates rejected, ``num_tries`` counting every draw.

    Draws are made in vectorised chunks on ``device``; the result is the same sequence TF's rejection loop
    would keep from the same stream of draws (first occurrences, in draw order).
    Returns (ids (S,) int64 in draw order, num_tries).
    """
    if not 0 < num_sampled <= vocab_size:
        raise ValueError(f"num_sampled must be in [1, vocab_size={vocab_size}], got {num_sampled}")
    log_range = math.log(vocab_size + 1.0)
    chunk = chunk or max(2 * num_sampled, 1024)
    draws = torch.empty(0, dtype=torch.long, device=device)
    while True:
        u = torch.rand(chunk, generator=generator, dtype=torch.float64, device=device)
        new = (torch.exp(u * log_range).floor().long() - 1).clamp_(0, vocab_size - 1)
        draws = torch.cat([draws, new])
        # first occurrence of each value, in draw order
        vals, inv = torch.unique(draws, return_inverse=True)
        pos = torch.arange(draws.numel(), device=device)
        first = torch.full((vals.numel(),), draws.numel(), dtype=torch.long, device=device)
        first = first.scatter_reduce(0, inv, pos, reduce="amin")
        if vals.numel() >= num_sampled:
            first_sorted = torch.sort(first).values
            last_pos = int(first_sorted[num_sampled - 1])
            ids = draws[first_sorted[:num_sampled]]
            return ids, last_pos + 1


def expected_count_reference(ids: torch.Tensor, num_tries: int, num_sampled: int, vocab_size: int) -> torch.Tensor:
    """TF's expected count: P·S when no draw was rejected, else 1 - (1 - P)^num_tries (float64)."""
    p = log_uniform_probability(ids, vocab_size)
    if num_tries == num_sampled:
        return p * num_sampled
    return -torch.expm1(num_tries * torch.log1p(-p))


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
) -> torch.Tensor:
    """Per position: logsumexp([true, samples]) - true, with logits ``x·w + b - log Q``.

    hidden (N, P); targets (N,) int; sampled_ids (S,); true_expected (N,); sampled_expected (S,).
    Accidental hits (a sample equal to the row's target) get -FLT_MAX added, as TF does.
    """
    w_t = weight.index_select(0, targets)
    true_logit = (hidden * w_t).sum(-1) + bias.index_select(0, targets) - torch.log(true_expected).to(hidden.dtype)
    w_s = weight.index_select(0, sampled_ids)
    s_logit = hidden @ w_s.t() + bias.index_select(0, sampled_ids) - torch.log(sampled_expected).to(hidden.dtype)
    if remove_accidental_hits:
        hits = targets.unsqueeze(1) == sampled_ids.unsqueeze(0)
        s_logit = s_logit.masked_fill(hits, -FLT_MAX if hidden.dtype != torch.float64 else -1.0e300)
    row = torch.cat([true_logit.unsqueeze(1), s_logit], dim=1)
    loss = torch.logsumexp(row, dim=1) - true_logit
    return _reduce(loss, reduction)


def full_softmax_nll_reference(hidden, targets, weight, bias, reduction: str = "mean"):
    """Exact NLL over the whole vocabulary: logsumexp(x·Wᵀ + b) - (x·w_y + b_y)."""
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
