"""Training's dropout on the CPU, as a pure function of a seed: the oracle of ``elmo_fast._cpu.dropout_apply``.

``y = x · m``: element ``i`` of the contiguous ``x`` (``i < 2^32``) is kept, ``m = 1 / (1 - p)``, iff

    h = fmix32(fmix32(fmix32(i) ^ k1) + k2) >= round(p · 2^32)

with ``k1``, ``k2`` the low and high 32 bits of the seed and ``fmix32`` murmur3's finalizer (a bijection of 32-bit
words with full avalanche). The index is mixed before the key enters: with ``fmix32(i ^ k1)`` first, seeds whose low
halves differ in low bits only permute the same set of indices, so their masks, though placed independently, drop
exactly as many elements. Dropped elements are multiplied by 0 (a NaN stays NaN, as torch's dropout multiplies).
Why not ``torch.bernoulli_``: it drew the six (16, 20, 512) masks of a B = 16 pretraining step in 0.8-0.9 ms each
on 2 Xeon cores, where this hash runs at memory speed in the extension; and as a function of (seed, index) the
backward regenerates the mask (``y``'s gradient is the same function of ``dy``) instead of keeping it. The seed is
drawn from torch's default CPU generator (``elmo_fast.ops.dropout``), so ``torch.manual_seed`` fixes the masks.
TF's masks come from TF's own generator: no implementation can reproduce them, nor do the spec's checks need it.

Everything here is int64 arithmetic on values below 2^32 (products split so that none overflows), in any dtype of x.
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h · c) mod 2^32 for int64 h in [0, 2^32) and a 32-bit constant c, with no int64 overflow: the low and high
    16 bits of h apart."""
    lo, hi = h & 0xFFFF, h >> 16
    return (lo * c + (((hi * (c & 0xFFFF)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def dropout_threshold(p: float) -> int:
    """round(p · 2^32): hashes below it are dropped (2^32, for p = 1 or next to it: every one)."""
    return int(round(p * 2.0 ** 32))


def seed_keys(seed: int) -> tuple[int, int]:
    """(k1, k2): the low and high 32 bits of the seed taken as an unsigned 64-bit word (the Triton kernel's too)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s & _MASK32, s >> 32


def dropout_keep_reference(numel: int, seed: int, p: float, device=None) -> torch.Tensor:
    """(numel,) bool: which elements are kept."""
    if numel >= 2 ** 32:
        raise ValueError(f"dropout: at most 2^32 - 1 elements in one call, got {numel}")
    k1, k2 = seed_keys(seed)
    i = torch.arange(numel, dtype=torch.int64, device=device)
    h = _fmix32((_fmix32(_fmix32(i) ^ k1) + k2) & _MASK32)
    return h >= dropout_threshold(p)


def dropout_reference(x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """x · m (module docstring), differentiable by autograd (the gradient is dy · m)."""
    keep = dropout_keep_reference(x.numel(), seed, p, x.device).view(x.shape)
    kept = torch.tensor(1.0 / (1.0 - p), dtype=x.dtype, device=x.device)  # 1 / (1 - p) rounded once to x's dtype
    return x * torch.where(keep, kept, torch.zeros((), dtype=x.dtype, device=x.device))
