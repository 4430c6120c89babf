"""Sampled softmax and full-softmax NLL ops. See ``elmo_fast.reference.sampled_softmax`` for the math."""
from __future__ import annotations

import torch

from .._backend import select_backend
from ..reference.sampled_softmax import (
    expected_count_reference,
    full_softmax_nll_reference,
    log_uniform_sample_reference,
    sampled_softmax_loss_reference,
)


def log_uniform_sample(num_sampled: int, vocab_size: int, *, generator=None, device="cpu"):
    """Unique log-uniform ids drawn on ``device`` (TF semantics); returns (ids (S,), num_tries)."""
    return log_uniform_sample_reference(num_sampled, vocab_size, generator=generator, device=device)


def sampled_softmax_loss(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    sampled_ids: torch.Tensor,
    num_tries: int,
    *,
    remove_accidental_hits: bool = True,
    reduction: str = "mean",
    backend: str | None = "auto",
) -> torch.Tensor:
    """TF ``sampled_softmax_loss`` given a drawn sample set (ids from ``log_uniform_sample``)."""
    V = weight.shape[0]
    S = sampled_ids.numel()
    true_q = expected_count_reference(targets, num_tries, S, V)
    samp_q = expected_count_reference(sampled_ids, num_tries, S, V)
    be = select_backend(backend, hidden.device, "sampled_softmax")
    if be == "triton":
        from ..kernels.softmax import sampled_softmax_loss_triton

        return sampled_softmax_loss_triton(hidden, targets, weight, bias, sampled_ids, true_q, samp_q,
                                           remove_accidental_hits=remove_accidental_hits, reduction=reduction)
    return sampled_softmax_loss_reference(hidden, targets, weight, bias, sampled_ids, true_q, samp_q,
                                          remove_accidental_hits=remove_accidental_hits, reduction=reduction)


def full_softmax_nll(hidden, targets, weight, bias, reduction: str = "mean", *, backend: str | None = "auto"):
    """Exact NLL over the whole vocabulary (held-out perplexity)."""
    be = select_backend(backend, hidden.device, "full_softmax")
    if be == "triton":
        from ..kernels.softmax import full_softmax_nll_triton

        return full_softmax_nll_triton(hidden, targets, weight, bias, reduction=reduction)
    return full_softmax_nll_reference(hidden, targets, weight, bias, reduction=reduction)
