"""Fused highway layer in Triton (spec §2.2 step 5, TF convention; oracle ``elmo_fast.reference.char_cnn``).

    zc = x·W_carry + b_carry,  zt = x·W_transform + b_transform,  g = σ(zc)
    y  = g ⊙ relu(zt) + (1 − g) ⊙ x

Forward (``_highway_fused_kernel``, MODE 0): one program computes both products for an output tile,
sharing the x tile of every K step, and applies bias, sigmoid, relu and the combine in the epilogue; zc and
zt never reach memory. Only the inputs are saved for backward (no (N, F) activations): backward recomputes
the two products in the same kernel (MODE 1), whose epilogue writes

    dzc = dy ⊙ (relu(zt) − x) ⊙ g(1 − g)   and   dzt = dy ⊙ g ⊙ [zt > 0]   into dz (N, 2F), x's dtype,
    dy ⊙ (1 − g)                                                        into dxd (N, F), fp32.

Then ``_mm_kernel`` computes dx = dxd + dzc·W_carryᵀ + dzt·W_transformᵀ (one kernel, two K loops, the
add in the epilogue) and dW = xᵀ·dz for both weights (one launch, grid axis 2 picks the weight). The bias
gradients (column sums of dz) are one torch reduction: summed inside dW's K loop they cost every program a
shared-memory read and a cross-thread reduction of each dz tile (about a third more instructions in the sm_90a
code; only the first row tile's sums were kept).

dtypes: fp32 (IEEE products, no TF32), bf16/fp16 (fp32 accumulation), fp64 (for near-exact tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from elmo_fast.kernels._common import (Launch, Target, acc_dtype, dot_acc, dot_flags, target_of, tl_acc_dtype,
                                       triton_operator, tuned)
from elmo_fast.ops._library import nothing


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row tiles share the B column tiles while they are in L2.
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _pair_step(x_ptr, wc_ptr, wt_ptr, rm64, rn, mmask, nmask, k0, F, acc_c, acc_t,
               BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # One K step of both products; the x tile is loaded once for the two.
    rk = k0 + tl.arange(0, BLOCK_K)
    kmask = rk < F
    a = tl.load(x_ptr + rm64[:, None] * F + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
    bmask = kmask[:, None] & nmask[None, :]
    bc_t = tl.load(wc_ptr + rk[:, None] * F + rn[None, :], mask=bmask, other=0.0)
    bt_t = tl.load(wt_ptr + rk[:, None] * F + rn[None, :], mask=bmask, other=0.0)
    acc_c = dot_acc(a, bc_t, acc_c, UPCAST, IEEE)
    acc_t = dot_acc(a, bt_t, acc_t, UPCAST, IEEE)
    return acc_c, acc_t


@triton.jit
def _mm_step(a_ptr, b_ptr, a2_ptr, b2_ptr, rm64, rn, mmask, nmask, k0, K, s_am, s_ak, s_bk, s_bn, acc,
             DUAL: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    rk = k0 + tl.arange(0, BLOCK_K)
    kmask = rk < K
    amask = mmask[:, None] & kmask[None, :]
    bmask = kmask[:, None] & nmask[None, :]
    a_offs = rm64[:, None] * s_am + rk[None, :].to(tl.int64) * s_ak
    b_offs = rk[:, None].to(tl.int64) * s_bk + rn[None, :] * s_bn
    a = tl.load(a_ptr + a_offs, mask=amask, other=0.0)
    b = tl.load(b_ptr + b_offs, mask=bmask, other=0.0)
    acc = dot_acc(a, b, acc, UPCAST, IEEE)
    if DUAL:
        a2 = tl.load(a2_ptr + a_offs, mask=amask, other=0.0)
        b2 = tl.load(b2_ptr + b_offs, mask=bmask, other=0.0)
        acc = dot_acc(a2, b2, acc, UPCAST, IEEE)
    return acc


@triton.jit
def _highway_fused_kernel(
    x_ptr, wc_ptr, bc_ptr, wt_ptr, bt_ptr, dy_ptr, y_ptr, dz_ptr, dxd_ptr,
    M, F,
    MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
):
    """x (M, F); wc, wt (F, F) row-major (x·W); bc, bt (F,). MODE 0: y (M, F). MODE 1: dz (M, 2F), dxd (M, F)."""
    pid_m, pid_n = _tile_ids(M, F, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < F
    rm64 = rm.to(tl.int64)
    acc_c = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    acc_t = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    if WHILE_LOOPS:
        k0 = 0
        while k0 < F:
            acc_c, acc_t = _pair_step(x_ptr, wc_ptr, wt_ptr, rm64, rn, mmask, nmask, k0, F, acc_c, acc_t,
                                      BLOCK_K, UPCAST, IEEE)
            k0 += BLOCK_K
    else:
        for k0 in range(0, F, BLOCK_K):
            acc_c, acc_t = _pair_step(x_ptr, wc_ptr, wt_ptr, rm64, rn, mmask, nmask, k0, F, acc_c, acc_t,
                                      BLOCK_K, UPCAST, IEEE)
    zc = acc_c + tl.load(bc_ptr + rn, mask=nmask, other=0.0).to(ACC)[None, :]
    zt = acc_t + tl.load(bt_ptr + rn, mask=nmask, other=0.0).to(ACC)[None, :]
    g = 1.0 / (1.0 + tl.exp(-zc))
    t = tl.maximum(zt, 0.0)
    omask = mmask[:, None] & nmask[None, :]
    offs = rm64[:, None] * F + rn[None, :]
    xr = tl.load(x_ptr + offs, mask=omask, other=0.0).to(ACC)
    if MODE == 0:
        y = g * t + (1.0 - g) * xr
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=omask)
    else:
        dy = tl.load(dy_ptr + offs, mask=omask, other=0.0).to(ACC)
        dzt = tl.where(zt > 0.0, dy * g, 0.0)
        dzc = dy * (t - xr) * g * (1.0 - g)
        zoffs = rm64[:, None] * (2 * F) + rn[None, :]
        tl.store(dz_ptr + zoffs, dzc.to(dz_ptr.dtype.element_ty), mask=omask)
        tl.store(dz_ptr + zoffs + F, dzt.to(dz_ptr.dtype.element_ty), mask=omask)
        tl.store(dxd_ptr + offs, (dy * (1.0 - g)).to(dxd_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _mm_kernel(
    a_ptr, b_ptr, a2_ptr, b2_ptr, c_ptr, add_ptr,
    M, N, K,
    s_am, s_ak, s_bk, s_bn, s_cm,
    s_az, s_bz, s_cz,
    DUAL: tl.constexpr, HAS_ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr, WHILE_LOOPS: tl.constexpr,
):
    """c[z] (M, N) = a[z]·b[z] (+ a2·b2 if DUAL) (+ add, same layout as c); any strides for a and b."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    z = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    rm64 = rm.to(tl.int64)
    a_ptr += z * s_az
    b_ptr += z * s_bz
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    if WHILE_LOOPS:
        k0 = 0
        while k0 < K:
            acc = _mm_step(a_ptr, b_ptr, a2_ptr, b2_ptr, rm64, rn, mmask, nmask, k0, K, s_am, s_ak, s_bk, s_bn,
                           acc, DUAL, BLOCK_K, UPCAST, IEEE)
            k0 += BLOCK_K
    else:
        for k0 in range(0, K, BLOCK_K):
            acc = _mm_step(a_ptr, b_ptr, a2_ptr, b2_ptr, rm64, rn, mmask, nmask, k0, K, s_am, s_ak, s_bk, s_bn,
                           acc, DUAL, BLOCK_K, UPCAST, IEEE)
    omask = mmask[:, None] & nmask[None, :]
    offs = rm64[:, None] * s_cm + rn[None, :]
    if HAS_ADD:
        acc += tl.load(add_ptr + offs, mask=omask, other=0.0).to(ACC)
    tl.store(c_ptr + z * s_cz + offs, acc.to(c_ptr.dtype.element_ty), mask=omask)


# --------------------------------------------------------------------------------------------- host side


def _tiles(dtype: torch.dtype, target: Target) -> list[dict]:
    """The autotune space (first = default). fp32 takes smaller tiles: its IEEE products run on the FMA units
    with both operands in registers."""
    if target.interpret:  # interpreter: few, mid-sized numpy ops
        return [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=1, num_stages=1)]
    if dtype == torch.float64:  # near-exact tests on a GPU: the bf16 tiles need 256-576 KB of shared memory
        return [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=8, num_warps=4, num_stages=2)]
    if dtype == torch.float32:
        return [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)]
    return [dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
            dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)]


def _flags(dtype: torch.dtype, target: Target) -> dict:
    return dict(**dot_flags(dtype, target), ACC=tl_acc_dtype(dtype), WHILE_LOOPS=target.interpret)


def fused_launch(M: int, F: int, dtype: torch.dtype, target: Target, *, backward: bool) -> list[Launch]:
    """``_highway_fused_kernel`` over M rows of width F: MODE 0 (forward) or MODE 1 (recompute + dz)."""
    return [Launch(_highway_fused_kernel, (triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(F, t["BLOCK_N"]),),
                   dict(MODE=int(backward), **t, **_flags(dtype, target))) for t in _tiles(dtype, target)]


def dx_launch(M: int, F: int, dtype: torch.dtype, target: Target) -> list[Launch]:
    """``_mm_kernel`` for dx = dxd + dzc·W_carryᵀ + dzt·W_transformᵀ (M, F)."""
    return [Launch(_mm_kernel, (triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(F, t["BLOCK_N"]), 1),
                   dict(DUAL=True, HAS_ADD=True, **t, **_flags(dtype, target)))
            for t in _tiles(dtype, target)]


def dw_launch(M: int, F: int, dtype: torch.dtype, target: Target) -> list[Launch]:
    """``_mm_kernel`` for dW = xᵀ·dz of both weights (F, F), K = M rows."""
    return [Launch(_mm_kernel, (triton.cdiv(F, t["BLOCK_M"]) * triton.cdiv(F, t["BLOCK_N"]), 2),
                   dict(DUAL=False, HAS_ADD=False, **t, **_flags(dtype, target)))
            for t in _tiles(dtype, target)]


def highway_fwd(x, wc, bc, wt, bt):
    M, F = x.shape
    Mb = triton.next_power_of_2(M)  # the autotune key's row bucket
    y = torch.empty_like(x)
    tuned(fused_launch(M, F, x.dtype, target_of(x.device), backward=False), ("fwd", Mb, F, x.dtype),
          x, wc, bc, wt, bt, x, y, y, y, M, F)
    return y


def highway_bwd(x, wc, bc, wt, bt, dy, need_x: bool, need_w: bool, w_grad_dtype: torch.dtype | None = None):
    """Returns (dx or None, dW (2, F, F) = (dWc, dWt), db (2, F) = (dbc, dbt)) (weights' grads None unless need_w).

    dx has x's dtype; the weight and bias grads ``w_grad_dtype`` (default x's).
    """
    M, F = x.shape
    Mb = triton.next_power_of_2(M)  # the autotune key's row bucket
    dev = x.device
    target = target_of(dev)
    acc = acc_dtype(x.dtype)
    dz = torch.empty((M, 2 * F), device=dev, dtype=x.dtype)
    dxd = torch.empty((M, F), device=dev, dtype=acc)
    tuned(fused_launch(M, F, x.dtype, target, backward=True), ("bwd", Mb, F, x.dtype),
          x, wc, bc, wt, bt, dy, x, dz, dxd, M, F)
    dx = None
    if need_x:
        dx = torch.empty_like(x)
        # dx[m, n] = dxd + sum_k dz[m, k] Wc[n, k] + sum_k dz[m, F + k] Wt[n, k]   (b[k, n] = W[n, k])
        tuned(dx_launch(M, F, x.dtype, target), ("dx", Mb, F, x.dtype), dz, wc, dz[:, F:], wt, dx, dxd,
              M, F, F, 2 * F, 1, 1, F, F, 0, 0, 0)
    dw = db = None
    if need_w:
        gdt = w_grad_dtype or x.dtype
        dw = torch.empty((2, F, F), device=dev, dtype=gdt)
        # dW[z][i, n] = sum_m x[m, i] dz[m, z·F + n]; db[z][n] = sum_m dz[m, z·F + n] (a torch reduction)
        tuned(dw_launch(M, F, x.dtype, target), ("dw", Mb, F, x.dtype, gdt), x, dz, x, dz, dw, dw,
              F, F, M, 1, F, 2 * F, 1, F, 0, F, F * F)
        db = dz.view(M, 2, F).sum(0, dtype=gdt)  # one launch; 16-bit sums accumulate in fp32 (torch's reduce)
    return dx, dw, db


# ------------------------------------------------------------------------------------------ operators
Tensor = torch.Tensor


def _forward_op(x: Tensor, wc: Tensor, bc: Tensor, wt: Tensor, bt: Tensor) -> Tensor:
    """x (M, F) -> y (M, F); the parameters run in x's dtype."""
    dt = x.dtype
    return highway_fwd(x.contiguous(), *(t.to(dt).contiguous() for t in (wc, bc, wt, bt)))


def _backward_op(x: Tensor, wc: Tensor, bc: Tensor, wt: Tensor, bt: Tensor, dy: Tensor, need_x: bool, need_w: bool,
                 w_grad_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(dx or a placeholder, dW (2, F, F) = (dW_carry, dW_transform), db (2, F)) -- the weight gradients in
    ``w_grad_dtype``, placeholders unless ``need_w``. Backward recomputes both products in its fused kernel."""
    dt = x.dtype
    ws = [t.to(dt).contiguous() for t in (wc, bc, wt, bt)]
    dx, dw, db = highway_bwd(x.contiguous(), *ws, dy.contiguous().to(dt), need_x, need_w, w_grad_dtype)
    return tuple(nothing(x) if g is None else g for g in (dx, dw, db))


_highway_op = triton_operator("highway_triton", _forward_op)
_highway_backward_op = triton_operator("highway_triton_backward", _backward_op)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # only the inputs


def _backward(ctx, dy):
    x, wc, bc, wt, bt = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dw, db = _highway_backward_op(x, wc, bc, wt, bt, dy, need[0], any(need[1:]), wc.dtype)
    # dw (2, F, F) and db (2, F) hold the carry and transform gradients; placeholders when no weight needs one
    grads = [(dw, 0, wc), (db, 0, bc), (dw, 1, wt), (db, 1, bt)]
    return (dx if need[0] else None, *(g[i].to(p.dtype) if n else None for (g, i, p), n in zip(grads, need[1:])))


_highway_op.register_autograd(_backward, setup_context=_setup_context)


def highway_triton(
    x: torch.Tensor,
    w_carry: torch.Tensor,
    b_carry: torch.Tensor,
    w_transform: torch.Tensor,
    b_transform: torch.Tensor,
) -> torch.Tensor:
    """x (..., F) -> (..., F): g = σ(x·W_carry + b_carry); y = g·relu(x·W_transform + b_transform) + (1−g)·x.

    W_carry, W_transform (F, F) in the TF layout (x·W); fused forward and backward (see module doc): the
    operator ``elmo_fast::highway_triton``, its backward ``elmo_fast::highway_triton_backward``.
    """
    lead = x.shape[:-1]
    F = x.shape[-1]
    x2 = x.reshape(-1, F)
    if x2.shape[0] == 0:
        return x.clone()
    return _highway_op(x2, w_carry, b_carry, w_transform, b_transform).reshape(*lead, F)
