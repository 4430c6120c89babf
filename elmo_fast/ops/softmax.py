"""Sampled softmax and full-softmax NLL ops. See ``elmo_fast.reference.sampled_softmax`` for the math.

* :func:`log_uniform_sample`: TF's unique log-uniform sampler, vectorised on the tensors' device (one host
  check per sample set, no host loop per draw).
* :func:`sampled_softmax_loss`: TF ``sampled_softmax_loss`` given a drawn sample set; the Triton backend is one
  fused kernel pair that never writes the (N × S) logits, with optional sparse weight/bias gradients.
* :func:`sampled_softmax_loss_groups` (and its two-group form :func:`sampled_softmax_loss_pair`): several
  sampled losses over one table, each group with its own rows and samples; on the Triton backend one launch of
  each kernel for all the groups.
* :func:`full_softmax_nll`: exact NLL over the vocabulary; the Triton backend never materialises N × V.
"""
from __future__ import annotations

import torch

from ._library import CompositeOp, backend_for, tracing
from ..cpu.sampled_softmax import (full_softmax_nll_cpu, sampled_softmax_loss_cpu,
                                   sampled_softmax_pair_loss_cpu)
from . import _precision as prec
from ..reference.sampled_softmax import (
    expected_count_reference,
    full_softmax_nll_reference,
    log_uniform_ids_from_uniform,
    sampled_softmax_loss_reference,
    sampler_chunk_size,
)

_REDUCTIONS = ("mean", "sum", "none")


def log_uniform_sample(num_sampled: int, vocab_size: int, *, generator: torch.Generator | None = None,
                       device: torch.device | str = "cpu", chunk: int | None = None) -> tuple[torch.Tensor, int]:
    """Draw ``num_sampled`` unique log-uniform ids on ``device`` with TF semantics (spec §6.5).

    Uniforms are drawn in rounds of ``chunk`` (default :func:`sampler_chunk_size`, sized so that one round
    almost always suffices). Within the stream of draws, the kept ids are the first occurrences, in draw
    order, and ``num_tries`` is the position of the S-th first occurrence + 1: exactly what TF's one-at-a-time
    rejection loop keeps from the same stream (and what ``log_uniform_sample_reference`` computes).

    Args:
        num_sampled: S, 1 ≤ S ≤ V.
        vocab_size: V.
        generator: a ``torch.Generator`` on ``device`` (``None``: the default generator).
        device: where the draws and the ids live.
    Returns:
        (ids (S,) int64 on ``device``, num_tries: int). One host sync per round: num_tries is a host int
        (TF's expected counts branch on it), and whether the round found S distinct ids decides another round.
    """
    if not 0 < num_sampled <= vocab_size:
        raise ValueError(f"num_sampled must be in [1, vocab_size={vocab_size}], got {num_sampled}")
    device = torch.device(device)
    chunk = chunk or sampler_chunk_size(num_sampled, vocab_size)
    draws = torch.empty(0, dtype=torch.long, device=device)
    big = torch.iinfo(torch.long).max
    while True:
        u = torch.rand(chunk, generator=generator, dtype=torch.float64, device=device)
        draws = torch.cat([draws, log_uniform_ids_from_uniform(u, vocab_size)])
        pos = torch.arange(draws.numel(), device=device)
        # first position at which each id appears; a draw is kept iff it is that first position
        first = torch.full((vocab_size,), big, dtype=torch.long, device=device)
        first.scatter_reduce_(0, draws, pos, reduce="amin")
        is_first = first.index_select(0, draws) == pos
        # the first S first-occurrence positions, in draw order, with no data-dependent shape
        kept_pos = torch.sort(torch.where(is_first, pos, big)).values[:num_sampled]
        n_unique, last = torch.stack([is_first.sum(), kept_pos[-1]]).tolist()  # the one host sync per round
        if n_unique >= num_sampled:
            return draws.index_select(0, kept_pos), int(last) + 1


def _check_common(hidden, targets, weight, bias, reduction):
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (N, P), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (V, P={hidden.shape[1]}), got shape {tuple(weight.shape)}")
    if bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be (V={weight.shape[0]},), got shape {tuple(bias.shape)}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be (N={hidden.shape[0]},), got shape {tuple(targets.shape)}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"targets must be an integer tensor (int32/int64), got {targets.dtype}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


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
    sparse_grad: bool = False,
) -> torch.Tensor:
    """TF ``sampled_softmax_loss`` given a drawn sample set (ids from :func:`log_uniform_sample`).

    Args:
        hidden: (N, P) fp32/bf16/fp16 (fp64 on the reference backend).
        targets: (N,) int, 0 ≤ y < V.
        weight: (V, P), same dtype as ``hidden``; bias: (V,).
        sampled_ids: (S,) int, unique; num_tries: draws the sampler made (≥ S).
        remove_accidental_hits: give a sample equal to the row's target logit −FLT_MAX (TF default).
        reduction: 'mean' (TF, per direction), 'sum' or 'none'.
        sparse_grad: the gradients of ``weight`` and ``bias`` are sparse COO tensors holding only the target
            and sample rows (for a sparse optimizer); the values are those of the dense gradient.
    Under autocast hidden and weight run in the autocast dtype (the table cast once per update), bias in fp32.
    Returns:
        scalar loss, or (N,) with reduction='none'.
    """
    hidden, targets, sampled_ids, true_q, samp_q = _sampled_inputs(hidden, targets, weight, bias, sampled_ids,
                                                                   num_tries, reduction)
    hidden, weight = _low_precision(weight, hidden)
    be = backend_for(backend, hidden.device, "sampled_softmax", hidden.dtype)
    kw = dict(remove_accidental_hits=remove_accidental_hits, reduction=reduction, sparse_grad=sparse_grad)
    with prec.no_autocast(hidden.device):
        if be == "triton":
            from ..kernels.softmax import sampled_softmax_loss_triton

            return sampled_softmax_loss_triton(hidden, targets, weight, bias, sampled_ids, true_q, samp_q, **kw)
        (bias,) = prec.reference_inputs(hidden.dtype, bias)
        if be == "cpu":
            return sampled_softmax_loss_cpu(hidden, targets, weight, bias, sampled_ids, true_q, samp_q, **kw)
        if sparse_grad and tracing(hidden):
            raise NotImplementedError("sampled_softmax_loss: sparse_grad=True on the reference backend cannot be "
                                      "compiled or exported (its operator's gradient is dense); use backend 'cpu' "
                                      "or 'triton', or sparse_grad=False")
        return _sampled_reference_op(hidden, targets, weight, bias, sampled_ids, true_q, samp_q,
                                     bool(remove_accidental_hits), reduction, bool(sparse_grad))


def _sampled_inputs(hidden, targets, weight, bias, sampled_ids, num_tries, reduction):
    """The checks of :func:`sampled_softmax_loss`; (hidden, targets and ids as int64, the expected counts)."""
    _check_common(hidden, targets, weight, bias, reduction)
    if sampled_ids.dim() != 1:
        raise ValueError(f"sampled_ids must be (S,), got shape {tuple(sampled_ids.shape)}")
    V = weight.shape[0]
    S = sampled_ids.numel()
    if num_tries < S:
        raise ValueError(f"num_tries ({num_tries}) must be at least the number of samples ({S})")
    targets = targets.long()
    sampled_ids = sampled_ids.long()
    return (hidden, targets, sampled_ids, expected_count_reference(targets, num_tries, S, V),
            expected_count_reference(sampled_ids, num_tries, S, V))


def sampled_softmax_loss_pair(forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
                              backward: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
                              weight: torch.Tensor, bias: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Two :func:`sampled_softmax_loss` calls over one table, bilm-tf's two directions: ``forward`` and
    ``backward`` are each ``(hidden, targets, sampled_ids, num_tries)``; returns (loss_f, loss_b), the same values
    and gradients as two calls (up to a rounding of the 16-bit table gradients): :func:`sampled_softmax_loss_groups`
    of the two, whose keyword ``options`` these are (remove_accidental_hits, reduction, backend, sparse_grad)."""
    return sampled_softmax_loss_groups([forward, backward], weight, bias, **options)


def sampled_softmax_loss_groups(
    groups,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    remove_accidental_hits: bool = True,
    reduction: str = "mean",
    backend: str | None = "auto",
    sparse_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`sampled_softmax_loss` of each group over one table: ``groups`` a sequence of ``(hidden, targets,
    sampled_ids, num_tries)`` (the trainer's: every tower's two directions); returns their losses, the same values
    and gradients as one call per group (the table's gradients summed).

    How: on the ``triton`` backend, where the groups share the row count, the sample count and the dtype, one
    operator call for all of them (each kernel launched once, batched GEMMs; the argument checks and the expected
    counts, a few torch ops, still run per group); on the ``cpu`` backend, where the groups come in pairs (an even
    count, the trainer's directions), each consecutive pair as one operator (one gradient tensor for the table
    instead of two that autograd adds); elsewhere, or under autocast on the cpu, one call per group. The values are
    those of one call per group; in 16-bit the table's gradients may differ by a rounding (summed in fp32 and
    rounded once, where separate calls round each group's before autograd adds them)."""
    groups = [tuple(g) for g in groups]
    if not groups or any(len(g) != 4 for g in groups):
        raise ValueError("sampled_softmax_loss_groups: groups is a non-empty sequence of (hidden, targets, "
                         f"sampled_ids, num_tries), got {len(groups)} groups of lengths {[len(g) for g in groups]}")
    kw = dict(remove_accidental_hits=remove_accidental_hits, reduction=reduction, sparse_grad=sparse_grad)
    h0 = groups[0][0]
    be = backend_for(backend, h0.device, "sampled_softmax", prec.compute_dtype(h0) or h0.dtype)
    alike = all(g[0].dtype == h0.dtype and g[0].dim() == h0.dim() == 2 and g[0].shape[0] == h0.shape[0]
                and g[2].numel() == groups[0][2].numel() for g in groups)
    if be == "triton" and len(groups) > 1 and alike:
        return _triton_groups(groups, weight, bias, **kw)
    if (be == "cpu" and len(groups) % 2 == 0 and weight.dtype == h0.dtype and all(g[0].dtype == h0.dtype
                                                                                  for g in groups)
            and prec.compute_dtype(h0) is None):  # autocast, mixed dtypes: calls cast as one does
        out: tuple = ()
        for f, b in zip(groups[::2], groups[1::2]):
            args = [_sampled_inputs(h, t, weight, bias, ids, tries, reduction) for h, t, ids, tries in (f, b)]
            with prec.no_autocast(h0.device):
                (b32,) = prec.reference_inputs(h0.dtype, bias)
                out += sampled_softmax_pair_loss_cpu(*args[0], *args[1], weight, b32, **kw)
        return out
    return tuple(sampled_softmax_loss(h, t, weight, bias, ids, tries, backend=backend, **kw)
                 for h, t, ids, tries in groups)


def _triton_groups(groups, weight, bias, *, remove_accidental_hits, reduction, sparse_grad):
    """The groups' hidden, targets and expected counts side by side, their sample sets stacked: one call of the
    Triton operator in its grouped form (``kernels.softmax.sampled_softmax_loss_triton``), its losses split."""
    args = [_sampled_inputs(h, t, weight, bias, ids, tries, reduction) for h, t, ids, tries in groups]
    # under autocast each group cast before the stacking (half its bytes)
    *hidden, weight = _low_precision(weight, *(a[0] for a in args))
    hidden = torch.cat(hidden)
    with prec.no_autocast(hidden.device):
        from ..kernels.softmax import sampled_softmax_loss_triton

        loss = sampled_softmax_loss_triton(hidden, torch.cat([a[1] for a in args]), weight, bias,
                                           torch.stack([a[2] for a in args]), torch.cat([a[3] for a in args]),
                                           torch.stack([a[4] for a in args]),
                                           remove_accidental_hits=remove_accidental_hits, reduction=reduction,
                                           sparse_grad=sparse_grad)
    n = args[0][0].shape[0]
    return tuple(loss.split([n] * len(args))) if reduction == "none" else tuple(loss.unbind(0))


def _low_precision(weight, *hidden):
    """Under autocast (read from the first of ``hidden``): every hidden and the (V, P) table in the autocast dtype,
    the table cast once per update; returns (*hidden, weight)."""
    low = prec.compute_dtype(hidden[0])
    return (*prec.activations(low, *hidden), prec.cast_weight(weight, low))


def full_softmax_nll(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     reduction: str = "mean", *, backend: str | None = "auto") -> torch.Tensor:
    """Exact NLL over the whole vocabulary (held-out perplexity, spec §6.7); differentiable.

    hidden (N, P), targets (N,), weight (V, P), bias (V,). The Triton backend tiles the vocabulary with an
    online log-sum-exp and recomputes logits per tile in backward: memory O(N·P + V·P), never N × V.
    Under autocast hidden and weight run in the autocast dtype (the table cast once per update).
    """
    _check_common(hidden, targets, weight, bias, reduction)
    targets = targets.long()
    hidden, weight = _low_precision(weight, hidden)
    be = backend_for(backend, hidden.device, "full_softmax", hidden.dtype)
    with prec.no_autocast(hidden.device):
        if be == "triton":
            from ..kernels.softmax import full_softmax_nll_triton

            return full_softmax_nll_triton(hidden, targets, weight, bias, reduction=reduction)
        (bias,) = prec.reference_inputs(hidden.dtype, bias)
        if be == "cpu":
            return full_softmax_nll_cpu(hidden, targets, weight, bias, reduction)
        return _full_reference_op(hidden, targets, weight, bias, reduction)


# ----------------------------------------------------------------------------- the reference as operators
Tensor = torch.Tensor


def _sampled_reference_fn(hidden: Tensor, targets: Tensor, weight: Tensor, bias: Tensor, sampled_ids: Tensor,
                          true_expected: Tensor, sampled_expected: Tensor, remove_accidental_hits: bool,
                          reduction: str, sparse_grad: bool) -> Tensor:
    return sampled_softmax_loss_reference(hidden, targets, weight, bias, sampled_ids, true_expected,
                                          sampled_expected, remove_accidental_hits=remove_accidental_hits,
                                          reduction=reduction, sparse_grad=sparse_grad)


def _full_reference_fn(hidden: Tensor, targets: Tensor, weight: Tensor, bias: Tensor, reduction: str) -> Tensor:
    return full_softmax_nll_reference(hidden, targets, weight, bias, reduction=reduction)


_sampled_reference_op = CompositeOp("sampled_softmax_reference", _sampled_reference_fn)
_full_reference_op = CompositeOp("full_softmax_reference", _full_reference_fn)


def _loss_fake(hidden, targets, *args):
    reduction = next(a for a in args if isinstance(a, str))
    return hidden.new_empty(hidden.shape[0]) if reduction == "none" else hidden.new_empty(())


_sampled_reference_op.op.register_fake(_loss_fake)
_full_reference_op.op.register_fake(_loss_fake)
