"""Whether a weight changed since a cached copy of it was made: one rule for every cache of derived weights
(the low-precision casts of ``ops._precision.cast_weight``, ``elmo_fast.LSTMP``'s TF-layout copies, the cpu
backend's oneDNN-packed weights).

A stamp is the weight's version counter (autograd bumps it on every in-place update), its storage (``.data =``
swaps it) and device, and on the CPU a sample of its values (64 runs of 256 elements spread evenly over the
storage; the whole weight where it is smaller): writes that bypass the version counter (``p.data.add_``, torch's
fused optimizers) change every element, so the sample catches them. Runs rather than every n-th element: the same
16,384 values read from 64 places instead of 16,384 (on a 2-core Xeon, 1.4 ms of cache and TLB misses per check
of a 32 MiB weight, four checks per biLM call). On a GPU the sample is not taken (comparing it would be a host
sync per call): there a write that bypasses the counter must bump it,
``torch.autograd.graph.increment_version(params)``, as elmo_fast's trainer does after its fused Adagrad step.
"""
from __future__ import annotations

import torch

SAMPLE_RUNS, RUN = 64, 256


def storage_order(w: torch.Tensor) -> torch.Tensor:
    """``w`` as a view in the order of its storage where that is a transpose (``elmo_fast.LSTMP`` passes column-major
    weights), so that sampling it reads a few elements instead of copying the whole weight."""
    return w.t() if w.dim() == 2 and not w.is_contiguous() and w.t().is_contiguous() else w


def _sample(w: torch.Tensor) -> torch.Tensor:
    """The values a stamp holds (a view): ``SAMPLE_RUNS`` runs of ``RUN`` consecutive elements in storage order."""
    flat = storage_order(w.detach()).reshape(-1)
    n = flat.numel()
    if n <= SAMPLE_RUNS * RUN:
        return flat
    return flat.as_strided((SAMPLE_RUNS, RUN), ((n - RUN) // (SAMPLE_RUNS - 1), 1), flat.storage_offset())


def stamp(w: torch.Tensor) -> tuple:
    sample = _sample(w).clone() if w.device.type == "cpu" else None
    return (w._version, w.data_ptr(), w.device, sample)


def unchanged(old: tuple | None, w: torch.Tensor) -> bool:
    """Whether ``w`` still matches ``old`` (a :func:`stamp` of it, or None)."""
    if old is None or old[:3] != (w._version, w.data_ptr(), w.device):
        return False
    return old[3] is None or torch.equal(old[3], _sample(w))
