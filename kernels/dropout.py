"""Training's hashed dropout in Triton: the masks of ``elmo_fast.reference.dropout`` (the oracle) on the GPU.

Element ``i`` of group ``g`` (counted from the group's first element) is kept iff
``fmix32(fmix32(fmix32(i) ^ k1_g) + k2_g) >= threshold``, ``k1_g``/``k2_g`` the low and high halves of the group's
seed: the reference's function, so one seed gives one mask on every device and backend (the CPU extension, the
reference's torch ops, this kernel), bit for bit. Kept elements are multiplied by ``1 / (1 - p)`` rounded to x's
dtype, dropped ones by 0 (a NaN stays NaN), with one rounding to x's dtype, as the reference's product: the product
is formed in fp32 (fp64 for fp64), exact for 16-bit x, and rounded to nearest even (by hand for bf16,
``_round_bf16``: the interpreter truncates its fp32 -> bf16 stores, and CI runs this code there).

Groups are consecutive element ranges of one contiguous x (the trainer's fused towers stack their rows along dim 0,
so each tower's rows are one range): one launch draws every group's mask from its own seed, up to ``MAX_GROUPS`` a
launch (more take one launch per ``MAX_GROUPS``). Nothing is saved for backward: the gradient is the same launch on
``dy`` with the same seeds (the mask is a function of (seed, index)).

Why a ``custom_op`` and not a ``triton_op`` like the other kernels' operators: the seeds are CPU int64 tensors drawn
from torch's CPU generator (``elmo_fast.ops.dropout``), read on the host inside the operator (a CPU read, no device
sync) and passed to the kernel as scalars. ``torch.compile`` tracing into a ``triton_op`` would read them as fake
tensors; as an opaque operator it gets real ones (elementwise work: nothing a compiler would fuse it into).

Seeds and the threshold reach the kernel as int64 scalars biased by 2^32: Triton types an int argument by its value
(i32 below 2^31, i64 above) and would compile a variant per type pattern; biased, every value is an i64, and
``do_not_specialize`` drops the divisibility variants, so one compiled kernel serves every seed. The element count
and the group ends (shapes, fixed in training) stay specialised: without, the 3-group variant took 41-42 registers
instead of 31-32 (sm_90a, kernel report).
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from elmo_fast.kernels._common import Launch, device_constant
from elmo_fast.ops.dropout import check_hash_args, hashed_dropout_op
from elmo_fast.reference.dropout import dropout_threshold, seed_keys

__all__ = ["dropout_hash_triton", "dropout_launch", "scalar_args", "MAX_GROUPS", "BLOCK"]

MAX_GROUPS = 4  # groups one launch takes (each its seed pair and end as scalars)
BLOCK = 1024
_BIAS = 1 << 32  # added to every 32-bit scalar so that Triton types it int64 whatever its value
_SEED_ARGS = [f"{k}{g}" for g in range(MAX_GROUPS) for k in ("ka", "kb")]


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _key(k):
    """A biased int64 scalar (value + 2^32) back to its 32-bit word."""
    return (k - 4294967296).to(tl.uint32)


@triton.jit
def _round_bf16(y):
    """fp32 y rounded to the nearest bf16 (ties to even), still in fp32: the store's conversion is then exact. By
    hand because the interpreter truncates fp32 -> bf16 stores (triton 3.6); compiled code rounds to nearest
    itself, and this gives it the same value. NaN stays NaN (its bits are not rounded into an infinity)."""
    b = y.to(tl.uint32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(y != y, y, r)


@triton.jit(do_not_specialize=["thr", *_SEED_ARGS])
def _dropout_hash_kernel(x_ptr, y_ptr, scale_ptr, N, e0, e1, e2, thr, ka0, kb0, ka1, kb1, ka2, kb2, ka3, kb3,
                         GROUPS: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    # Groups: [0, e0), [e0, e1), [e1, e2), [e2, N), the first GROUPS of them (the last ends at N).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    start = tl.zeros([BLOCK], dtype=tl.int64)
    ka = tl.zeros([BLOCK], dtype=tl.int64) + ka0
    kb = tl.zeros([BLOCK], dtype=tl.int64) + kb0
    if GROUPS > 1:
        g = offs >= e0
        start = tl.where(g, e0, start)
        ka = tl.where(g, ka1, ka)
        kb = tl.where(g, kb1, kb)
    if GROUPS > 2:
        g = offs >= e1
        start = tl.where(g, e1, start)
        ka = tl.where(g, ka2, ka)
        kb = tl.where(g, kb2, kb)
    if GROUPS > 3:
        g = offs >= e2
        start = tl.where(g, e2, start)
        ka = tl.where(g, ka3, ka)
        kb = tl.where(g, kb3, kb)
    i = (offs - start).to(tl.uint32)  # the index within its group (< 2^32: checked by the caller)
    h = _fmix32(_fmix32(_fmix32(i) ^ _key(ka)) + _key(kb))
    keep = h.to(tl.int64) >= thr - 4294967296
    x = tl.load(x_ptr + offs, mask=inb)
    s = tl.load(scale_ptr)  # fp32 (fp64 for fp64 x) holding 1 / (1 - p) rounded to x's dtype
    y = x.to(s.dtype) * tl.where(keep, s, 0.0)  # exact for 16-bit x (8- or 11-bit significands): one rounding, below
    if BF16:
        y = _round_bf16(y)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inb)


def _scale(p: float, like: torch.Tensor) -> torch.Tensor:
    """``1 / (1 - p)`` rounded once to ``dtype`` (the reference's factor), held in fp32 (fp64 for fp64: the value
    is exact there), ``dtype`` and device ``like``'s (the op's input), made once per (p, dtype, device):
    ``device_constant``."""
    dtype = like.dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return device_constant(_SCALES, (p, dtype), lambda dev: torch.full(
        (1,), 1.0 / (1.0 - p), dtype=dtype, device=dev).to(wide), like)


_SCALES: dict = {}


def _keys(seed: int) -> tuple[int, int]:
    """The seed's two 32-bit keys (the reference's ``seed_keys``), biased."""
    k1, k2 = seed_keys(seed)
    return k1 + _BIAS, k2 + _BIAS


def dropout_launch(n: int, groups: int, dtype: torch.dtype) -> Launch:
    """The launch of one call over ``n`` elements in ``groups`` groups (<= MAX_GROUPS): the launcher's and the kernel
    report's one configuration."""
    if not 1 <= groups <= MAX_GROUPS:
        raise ValueError(f"dropout_launch: 1 to {MAX_GROUPS} groups a launch, got {groups}")
    return Launch(_dropout_hash_kernel, (triton.cdiv(n, BLOCK),),
                  dict(GROUPS=groups, BF16=dtype == torch.bfloat16, BLOCK=BLOCK, num_warps=4))


def scalar_args(numels: list[int], seeds: list[int], p: float) -> tuple:
    """The kernel's scalar arguments for one launch over groups of ``numels`` elements (at most ``MAX_GROUPS``) with
    ``seeds``: the element count, the groups' ends, the threshold and the seeds' halves, every 32-bit value biased
    (module docstring). The launcher's and the kernel report's."""
    *ends, total = itertools.accumulate(numels)
    ends += [total] * (MAX_GROUPS - 1 - len(ends))
    keys = [k for seed in seeds for k in _keys(seed)]
    keys += [_BIAS] * (2 * MAX_GROUPS - len(keys))
    return (total, *ends, dropout_threshold(p) + _BIAS, *keys)


def _launch_groups(x: torch.Tensor, y: torch.Tensor, seeds: list[int], numels: list[int], p: float) -> None:
    """y = dropout of the contiguous x, group g (``numels[g]`` elements) with ``seeds[g]``: one launch per
    ``MAX_GROUPS`` groups, on flat views of x and y."""
    xf, yf = x.view(-1), y.view(-1)
    scale = _scale(p, x)
    off = 0
    for c in range(0, len(numels), MAX_GROUPS):
        n = numels[c:c + MAX_GROUPS]
        total = sum(n)
        if total:
            dropout_launch(total, len(n), x.dtype)(xf[off:off + total], yf[off:off + total], scale,
                                                   *scalar_args(n, seeds[c:c + MAX_GROUPS], p))
        off += total


def _hash_triton(x: torch.Tensor, seeds: torch.Tensor, numels: list[int], p: float) -> torch.Tensor:
    """x · m, m from (seeds[g], index within group g) over consecutive groups of ``numels[g]`` elements (module
    docstring); seeds: a 1-d CPU int64 tensor, one per group."""
    values = check_hash_args(x, seeds, numels)
    y = torch.empty_like(x)
    _launch_groups(x, y, values, list(numels), p)
    return y


_dropout_op = hashed_dropout_op("dropout_hash_triton", _hash_triton)


def dropout_hash_triton(x: torch.Tensor, seeds: torch.Tensor, numels: list[int], p: float) -> torch.Tensor:
    """The operator on a contiguous x (it checks its arguments: ``elmo_fast.ops.dropout.check_hash_args``)."""
    return _dropout_op(x.contiguous(), seeds, numels, p)
