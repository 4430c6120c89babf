"""Fused sampled softmax (TF semantics, spec §6.5) and full-softmax NLL (spec §6.7) in Triton.

One pair of kernels serves both ops. A "column" is a candidate class: for the sampled loss the S sampled ids
(rows of ``weight`` gathered through ``sampled_ids``), for the full softmax every vocabulary row.

* ``_softmax_lse_fwd_kernel`` — grid (row blocks, column splits). Each program computes logit tiles
  ``h · w_cᵀ + off_c`` (``off_c = b_c − log Q_c`` for samples, ``b_c`` for the full softmax) over a K loop on
  P, masks accidental hits, and keeps an online log-sum-exp (running max m, running sum l_sum, fp32) over its
  column range. Split 0 also computes the target logit ``h · w_y + off_y`` by a gathered dot. The (N × S) or
  (N × V) logits never leave registers; the host combines the per-split (m, l_sum) (a few numbers per row).
* ``_softmax_grad_kernel`` — grid (row blocks, column blocks), for backward. It recomputes one logit tile,
  forms ``dlogit = g_n · softmax`` (minus ``g_n`` at the target column for the full softmax) in registers, and
  accumulates ``dH += dlogit · W_c``, ``dW_c += dlogitᵀ · H`` and ``db_c += Σ_n dlogit`` into fp32 buffers with
  atomic adds (the Cut-Cross-Entropy pattern). Summation order on a GPU is therefore not deterministic.

For the sampled loss the true-class column is not a tile column: its gradient ``g_n (p_true − 1)`` is an O(N·P)
gather/scatter done on the host side in torch. The weight gradient is naturally sparse — rows
``sampled_ids ∪ targets`` — and comes out as a coalesced sparse COO tensor with ``sparse_grad=True``.

Numerics: dots accumulate in fp32 (fp32 inputs use IEEE fp32 dots, not TF32); log-sum-exp, softmax and the
gradient buffers are fp32; outputs are cast to the input dtype at the end. Accidental hits get −FLT_MAX in the
max and exactly zero probability, like TF's additive −FLT_MAX.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from elmo_fast.kernels._common import Launch, Target, dot_flags, pow2_between, target_of
from elmo_fast.kernels._common import dot as _dot

_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _logit_tile(H, W, rows, cols_w, row_ok, col_ok, P, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """(BLOCK_N, BLOCK_C) fp32 tile of H[rows] · W[cols_w]ᵀ, K loop over P."""
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    k0 = 0
    while k0 < P:  # while, not range(): runtime bounds must stay scalars under the interpreter
        k = k0 + ks
        k_ok = k < P
        h = tl.load(H + rows[:, None] * P + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols_w[:, None] * P + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _dot(h, tl.trans(w), UPCAST, IEEE)
        k0 += BLOCK_K
    return acc


@triton.jit
def _row_block(TGT, N, BLOCK_N: tl.constexpr):
    """This program's block of rows (axis 0 of the grid): int64 indices, in-range mask, targets (-1 outside)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    return rows64, row_ok, tl.load(TGT + rows64, mask=row_ok, other=-1)


@triton.jit
def _softmax_lse_fwd_kernel(
    H, W, COL_IDS, COL_OFF, TGT, TGT_OFF,  # inputs
    OUT_M, OUT_L, OUT_TGT,  # outputs: (SPLITS, N) fp32 ×2, (N,) fp32
    N, P, C, cols_per_split,
    GATHER: tl.constexpr, MASK_HITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_s = tl.program_id(1)
    rows64, row_ok, tgt = _row_block(TGT, N, BLOCK_N)

    m = tl.full((BLOCK_N,), -_FLT_MAX, dtype=tl.float32)
    l_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    c_begin = pid_s * cols_per_split
    c0 = 0
    while c0 < cols_per_split:
        offs = c0 + tl.arange(0, BLOCK_C)
        cols = c_begin + offs
        col_ok = (offs < cols_per_split) & (cols < C)
        if GATHER:
            cid = tl.load(COL_IDS + cols, mask=col_ok, other=0).to(tl.int64)
        else:
            cid = cols.to(tl.int64)
        logit = _logit_tile(H, W, rows64, cid, row_ok, col_ok, P, BLOCK_N, BLOCK_C, BLOCK_K, UPCAST, IEEE)
        logit += tl.load(COL_OFF + cols, mask=col_ok, other=0.0)[None, :]
        keep = col_ok[None, :]
        if MASK_HITS:
            keep = keep & (cid[None, :] != tgt[:, None])
        logit = tl.where(keep, logit, -_FLT_MAX)
        m_new = tl.maximum(m, tl.max(logit, axis=1))
        p = tl.where(keep, tl.exp(logit - m_new[:, None]), 0.0)
        l_sum = l_sum * tl.exp(m - m_new) + tl.sum(p, axis=1)
        m = m_new
        c0 += BLOCK_C
    tl.store(OUT_M + pid_s * N + rows64, m, mask=row_ok)
    tl.store(OUT_L + pid_s * N + rows64, l_sum, mask=row_ok)

    if pid_s == 0:
        # target logit h·w_y + off_y by a gathered dot
        t64 = tl.where(row_ok, tgt, 0).to(tl.int64)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        ks = tl.arange(0, BLOCK_K)
        k0 = 0
        while k0 < P:
            k = k0 + ks
            msk = row_ok[:, None] & (k < P)[None, :]
            h = tl.load(H + rows64[:, None] * P + k[None, :], mask=msk, other=0.0).to(tl.float32)
            w = tl.load(W + t64[:, None] * P + k[None, :], mask=msk, other=0.0).to(tl.float32)
            acc += tl.sum(h * w, axis=1)
            k0 += BLOCK_K
        acc += tl.load(TGT_OFF + rows64, mask=row_ok, other=0.0)
        tl.store(OUT_TGT + rows64, acc, mask=row_ok)


@triton.jit
def _softmax_grad_kernel(
    H, W, COL_IDS, COL_OFF, TGT, LSE, G,  # inputs
    DH, DWC, DOFF,  # fp32 accumulators: (N, P), (C, P) by column position, (C,)
    N, P, C,
    GATHER: tl.constexpr, MASK_HITS: tl.constexpr, SUB_TARGET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_c = tl.program_id(1)
    rows64, row_ok, tgt = _row_block(TGT, N, BLOCK_N)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    cols64 = cols.to(tl.int64)
    if GATHER:
        cid = tl.load(COL_IDS + cols64, mask=col_ok, other=0).to(tl.int64)
    else:
        cid = cols64
    lse = tl.load(LSE + rows64, mask=row_ok, other=0.0)
    g = tl.load(G + rows64, mask=row_ok, other=0.0)

    logit = _logit_tile(H, W, rows64, cid, row_ok, col_ok, P, BLOCK_N, BLOCK_C, BLOCK_K, UPCAST, IEEE)
    logit += tl.load(COL_OFF + cols64, mask=col_ok, other=0.0)[None, :]
    keep = row_ok[:, None] & col_ok[None, :]
    if MASK_HITS:
        keep = keep & (cid[None, :] != tgt[:, None])
    dlogit = tl.where(keep, tl.exp(logit - lse[:, None]), 0.0) * g[:, None]
    if SUB_TARGET:
        dlogit -= tl.where(keep & (cid[None, :] == tgt[:, None]), g[:, None], 0.0)

    tl.atomic_add(DOFF + cols64, tl.sum(dlogit, axis=0), mask=col_ok)
    d = dlogit.to(W.dtype.element_ty)
    ks = tl.arange(0, BLOCK_K)
    k0 = 0
    while k0 < P:
        k = k0 + ks
        k_ok = k < P
        h_msk = row_ok[:, None] & k_ok[None, :]
        w_msk = col_ok[:, None] & k_ok[None, :]
        h = tl.load(H + rows64[:, None] * P + k[None, :], mask=h_msk, other=0.0)
        w = tl.load(W + cid[:, None] * P + k[None, :], mask=w_msk, other=0.0)
        dh = _dot(d, w, UPCAST, IEEE)
        tl.atomic_add(DH + rows64[:, None] * P + k[None, :], dh, mask=h_msk)
        dw = _dot(tl.trans(d), h, UPCAST, IEEE)
        tl.atomic_add(DWC + cols64[:, None] * P + k[None, :], dw, mask=w_msk)
        k0 += BLOCK_K


# ------------------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------------------

def _tiles(N: int, C: int, P: int, target: Target) -> dict:
    if target.interpret:  # small tiles keep the numpy emulation fast and exercise the masks
        return dict(BLOCK_N=pow2_between(N, 16, 16), BLOCK_C=pow2_between(C, 16, 32),
                    BLOCK_K=pow2_between(P, 16, 16), num_warps=4, num_stages=1)
    return dict(BLOCK_N=pow2_between(N, 16, 64), BLOCK_C=pow2_between(C, 16, 128),
                BLOCK_K=pow2_between(P, 16, 64), num_warps=8, num_stages=3)


def lse_fwd_launch(N: int, C: int, P: int, dtype: torch.dtype, target: Target, *, gather: bool, mask_hits: bool,
                   num_splits: int | None = None) -> tuple[Launch, int]:
    """``_softmax_lse_fwd_kernel`` over N rows and C columns, and its columns per split: the columns are split
    (split-K over columns, partial log-sum-exps combined on the host) so few row blocks still fill the GPU."""
    t = _tiles(N, C, P, target)
    col_tiles = triton.cdiv(C, t["BLOCK_C"])
    if num_splits is None:
        num_splits = 2 if target.interpret else triton.cdiv(2 * target.sms, triton.cdiv(N, t["BLOCK_N"]))
    splits = max(1, min(int(num_splits), col_tiles))
    tiles_per_split = triton.cdiv(col_tiles, splits)
    splits = triton.cdiv(col_tiles, tiles_per_split)  # no empty split
    return Launch(_softmax_lse_fwd_kernel, (triton.cdiv(N, t["BLOCK_N"]), splits), dict(
        GATHER=gather, MASK_HITS=mask_hits, **dot_flags(dtype, target), **t)), tiles_per_split * t["BLOCK_C"]


def grad_launch(N: int, C: int, P: int, dtype: torch.dtype, target: Target, *, gather: bool, mask_hits: bool,
                sub_target: bool) -> Launch:
    """``_softmax_grad_kernel``: one program per (row block, column block) logit tile."""
    t = _tiles(N, C, P, target)
    return Launch(_softmax_grad_kernel, (triton.cdiv(N, t["BLOCK_N"]), triton.cdiv(C, t["BLOCK_C"])), dict(
        GATHER=gather, MASK_HITS=mask_hits, SUB_TARGET=sub_target, **dot_flags(dtype, target), **t))


def _check_inputs(hidden, weight, bias):
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton softmax kernels take fp32/bf16/fp16, got {hidden.dtype}; "
                        "use backend='reference' for fp64")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    if hidden.device != weight.device or bias.device != weight.device:
        raise ValueError(f"hidden, weight and bias must share a device, got {hidden.device}, {weight.device}, "
                         f"{bias.device}")


def softmax_lse_fwd(hidden, weight, col_ids, col_off, targets, tgt_off, *, mask_hits: bool,
                    num_splits: int | None = None):
    """Returns (lse over the columns (N,) fp32, target logit (N,) fp32). ``col_ids`` None = all V rows."""
    N, P = hidden.shape
    C = col_off.numel()
    gather = col_ids is not None
    launch, cols_per_split = lse_fwd_launch(N, C, P, hidden.dtype, target_of(hidden.device), gather=gather,
                                            mask_hits=mask_hits, num_splits=num_splits)
    splits = launch.grid[1]
    out_m = torch.empty((splits, N), dtype=torch.float32, device=hidden.device)
    out_l = torch.empty((splits, N), dtype=torch.float32, device=hidden.device)
    out_t = torch.empty((N,), dtype=torch.float32, device=hidden.device)
    launch(hidden, weight, col_ids if gather else col_off, col_off, targets, tgt_off,
           out_m, out_l, out_t, N, P, C, cols_per_split)
    # log l may be −inf for a split holding only accidental hits; the max term keeps the sum finite
    lse = torch.logsumexp(out_m + torch.log(out_l), dim=0)
    return lse, out_t


def softmax_grad(hidden, weight, col_ids, col_off, targets, lse, g, *, mask_hits: bool, sub_target: bool):
    """fp32 (dH (N, P), dW_cols (C, P), d_off (C,)) of Σ_n g_n·(lse_n − …) w.r.t. the tile columns."""
    N, P = hidden.shape
    C = col_off.numel()
    dh = torch.zeros((N, P), dtype=torch.float32, device=hidden.device)
    dwc = torch.zeros((C, P), dtype=torch.float32, device=hidden.device)
    doff = torch.zeros((C,), dtype=torch.float32, device=hidden.device)
    gather = col_ids is not None
    grad_launch(N, C, P, hidden.dtype, target_of(hidden.device), gather=gather, mask_hits=mask_hits,
                sub_target=sub_target)(hidden, weight, col_ids if gather else col_off, col_off, targets, lse, g,
                                       dh, dwc, doff, N, P, C)
    return dh, dwc, doff


def _row_scale(grad_out: torch.Tensor, N: int, reduction: str) -> torch.Tensor:
    """Per-row upstream gradient g_n (fp32, (N,)), without a host sync."""
    g = grad_out.to(torch.float32)
    if reduction == "none":
        return g.reshape(N).contiguous()
    g = g.reshape(1).expand(N)
    if reduction == "mean":
        g = g / N
    return g.contiguous()


def _reduce(loss: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean().to(dtype)
    if reduction == "sum":
        return loss.sum().to(dtype)
    return loss.to(dtype)


def _merge_rows(ids: torch.Tensor, values: torch.Tensor, V: int):
    """Sum fp32 ``values`` of duplicate row ids; returns (sorted unique ids, summed values)."""
    uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
    out = values.new_zeros((uniq.numel(),) + values.shape[1:]).index_add_(0, inv, values)
    return uniq, out


def _rows_grad(ids, values, V, shape, dtype, sparse):
    uniq, vals = _merge_rows(ids, values, V)
    vals = vals.to(dtype)
    if sparse:
        return torch.sparse_coo_tensor(uniq.unsqueeze(0), vals, shape, is_coalesced=True, check_invariants=False)
    return torch.zeros(shape, dtype=dtype, device=vals.device).index_copy_(0, uniq, vals)


class SampledSoftmaxFunction(torch.autograd.Function):
    """Fused TF sampled softmax. Saves hidden, the sample/target ids, fp32 offsets and the row LSE; backward
    recomputes logit tiles (no N × S tensor is ever stored)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, sampled_ids, true_expected, sampled_expected,
                remove_accidental_hits, reduction, sparse_grad):
        _check_inputs(hidden, weight, bias)
        hidden = hidden.contiguous()
        weight = weight.contiguous()
        targets = targets.contiguous()
        sampled_ids = sampled_ids.contiguous()
        bias32 = bias.to(torch.float32)
        samp_off = (bias32.index_select(0, sampled_ids) - torch.log(sampled_expected).to(torch.float32))
        true_off = (bias32.index_select(0, targets) - torch.log(true_expected).to(torch.float32))
        lse_s, true_logit = softmax_lse_fwd(hidden, weight, sampled_ids, samp_off.contiguous(), targets,
                                            true_off.contiguous(), mask_hits=remove_accidental_hits)
        lse = torch.logaddexp(lse_s, true_logit)  # the true class is column 0 of TF's logit row
        loss = lse - true_logit
        ctx.save_for_backward(hidden, weight, targets, sampled_ids, samp_off, lse, true_logit)
        ctx.flags = (remove_accidental_hits, reduction, sparse_grad, bias.dtype, bias.shape[0])
        return _reduce(loss, reduction, hidden.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, sampled_ids, samp_off, lse, true_logit = ctx.saved_tensors
        mask_hits, reduction, sparse, bias_dtype, V = ctx.flags
        N, P = hidden.shape
        g = _row_scale(grad_out, N, reduction)
        dh, dws, doff = softmax_grad(hidden, weight, sampled_ids, samp_off, targets, lse, g,
                                     mask_hits=mask_hits, sub_target=False)
        # the true column: dlogit_true = g (p_true − 1), an O(N·P) gather/scatter
        d_true = g * torch.expm1(true_logit - lse)
        w_t = weight.index_select(0, targets).to(torch.float32)
        dh.addcmul_(d_true.unsqueeze(1), w_t)
        grad_h = dh.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            ids = torch.cat([sampled_ids, targets])
            vals = torch.cat([dws, d_true.unsqueeze(1) * hidden.to(torch.float32)])
            grad_w = _rows_grad(ids, vals, V, (V, P), weight.dtype, sparse)
        if ctx.needs_input_grad[2]:
            ids = torch.cat([sampled_ids, targets])
            grad_b = _rows_grad(ids, torch.cat([doff, d_true]), V, (V,), bias_dtype, sparse)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


class FullSoftmaxNLLFunction(torch.autograd.Function):
    """Exact NLL over V in vocabulary tiles; backward recomputes logits per tile (memory O(N·P + V·P))."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, reduction):
        _check_inputs(hidden, weight, bias)
        hidden = hidden.contiguous()
        weight = weight.contiguous()
        targets = targets.contiguous()
        off = bias.to(torch.float32).contiguous()
        true_off = off.index_select(0, targets).contiguous()
        lse, tgt_logit = softmax_lse_fwd(hidden, weight, None, off, targets, true_off, mask_hits=False)
        ctx.save_for_backward(hidden, weight, targets, off, lse)
        ctx.flags = (reduction, bias.dtype)
        return _reduce(lse - tgt_logit, reduction, hidden.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, off, lse = ctx.saved_tensors
        reduction, bias_dtype = ctx.flags
        N = hidden.shape[0]
        g = _row_scale(grad_out, N, reduction)
        dh, dw, db = softmax_grad(hidden, weight, None, off, targets, lse, g, mask_hits=False, sub_target=True)
        return (dh.to(hidden.dtype) if ctx.needs_input_grad[0] else None,
                dw.to(weight.dtype) if ctx.needs_input_grad[1] else None,
                db.to(bias_dtype) if ctx.needs_input_grad[2] else None, None, None)


def sampled_softmax_loss_triton(hidden, targets, weight, bias, sampled_ids, true_expected, sampled_expected, *,
                                remove_accidental_hits: bool = True, reduction: str = "mean",
                                sparse_grad: bool = False) -> torch.Tensor:
    """TF sampled softmax loss, fused (see module docstring). hidden (N, P), targets (N,), weight (V, P),
    bias (V,), sampled_ids (S,), true_expected (N,), sampled_expected (S,) expected counts (any float dtype).
    With ``sparse_grad`` the weight and bias gradients are coalesced sparse COO tensors over
    ``sampled_ids ∪ targets``."""
    return SampledSoftmaxFunction.apply(hidden, weight, bias, targets.long(), sampled_ids.long(), true_expected,
                                        sampled_expected, bool(remove_accidental_hits), reduction,
                                        bool(sparse_grad))


def full_softmax_nll_triton(hidden, targets, weight, bias, *, reduction: str = "mean") -> torch.Tensor:
    """Exact NLL over the whole vocabulary without materialising N × V; differentiable."""
    return FullSoftmaxNLLFunction.apply(hidden, weight, bias, targets.long(), reduction)


__all__ = ["sampled_softmax_loss_triton", "full_softmax_nll_triton", "SampledSoftmaxFunction",
           "FullSoftmaxNLLFunction", "softmax_lse_fwd", "softmax_grad"]
