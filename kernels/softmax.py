"""Fused sampled softmax (TF semantics, spec §6.5) and full-softmax NLL (spec §6.7) in Triton.

The same kernels serve both ops. A "column" is a candidate class: for the sampled loss the S sampled ids
(rows of ``weight`` gathered through ``sampled_ids``), for the full softmax every vocabulary row.

* ``_softmax_lse_fwd_kernel`` — grid (row blocks, column splits, groups). Each program computes logit tiles
  ``h · w_cᵀ + off_c`` (``off_c = b_c − log Q_c`` for samples, ``b_c`` for the full softmax) over a K loop on
  P, masks accidental hits, and keeps an online log-sum-exp (running max m, running sum l_sum, fp32) over its
  column range. Split 0 also computes the target logit ``h · w_y + off_y`` by a gathered dot. The (N × S) or
  (N × V) logits never leave registers; the host combines the per-split (m, l_sum) (a few numbers per row).
* Backward, per chunk of columns (all S sampled columns at once; the full softmax's V in chunks of at most
  ``DLOGIT_BYTES``): ``_softmax_dlogit_kernel`` — grid (row blocks, column blocks, groups) — recomputes each logit tile
  once and writes ``dlogit = g_n · softmax`` (minus ``g_n`` at the target column for the full softmax) in the
  operand dtype, with the bias gradient's fp32 column sums per row block; then two cuBLAS GEMMs,
  ``dH += dlogit · W_chunk`` and ``dW_chunk = dlogitᵀ · H``, accumulate in fp32. One writer per element, partials
  added in a fixed order: deterministic, no atomics. The logits are computed twice in all (forward, backward),
  against 1 + 2 x (P chunks) times in the design before (a dH and a dW kernel that each recomputed them in
  64 x 64 tiles), for the chunk's N x columns in HBM (at the training shape 7,680 x 8,192 in bf16: 120 MiB
  written once and read by the two GEMMs).

The P loop of every logit tile is a ``range`` over the constexpr P: an scf.for that the compiler
software-pipelines (``num_stages``), and a plain Python loop under ``TRITON_INTERPRET=1``; the forward's loop
over its split's columns (a runtime bound) stays a ``while`` loop, which the interpreter needs.

For the sampled loss the true-class column is not a tile column: its gradient ``g_n (p_true − 1)`` is an O(N·P)
gather/scatter done on the host side in torch. The weight gradient is naturally sparse — rows
``sampled_ids ∪ targets`` — and comes out as a sparse COO tensor with ``sparse_grad=True`` (uncoalesced, so
that no host sync sizes it: repeated rows are pre-summed in fp32 into their first entry, the others are 0).

Numerics: dots accumulate in fp32 (fp32 inputs use IEEE fp32 dots, not TF32; the backward's two GEMMs are
cuBLAS, which follows ``torch.backends.cuda.matmul.allow_tf32``, off unless the user turns it on); log-sum-exp,
softmax and the gradient buffers are fp32, dlogit is rounded to the operand dtype for the GEMMs (to nearest even
in compiled code; the interpreter, which has no bf16 of its own, truncates every fp32 -> bf16 store, in every
kernel, even with ``fp_downcast_rounding="rtne"``: triton 3.6); outputs are cast to the input dtype at the end.
Accidental hits get −FLT_MAX in the max and exactly zero probability, like TF's additive −FLT_MAX.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from elmo_fast.kernels._common import Launch, Target, dot_flags, pow2_between, target_of, triton_operator
from elmo_fast.kernels._common import dot_acc
from elmo_fast.ops._library import nothing

_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _logit_tile(H, W, rows, cols_w, row_ok, col_ok, P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """(BLOCK_N, BLOCK_C) fp32 tile of H[rows] · W[cols_w]ᵀ. The K loop over the constexpr P is an scf.for that
    the compiler software-pipelines (``num_stages``); under the interpreter it is a plain Python range."""
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, P, BLOCK_K):
        k = k0 + ks
        k_ok = k < P
        h = tl.load(H + rows[:, None] * P + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols_w[:, None] * P + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = dot_acc(h, tl.trans(w), acc, UPCAST, IEEE)
    return acc


@triton.jit
def _group_rows(grp, N, BLOCK_N: tl.constexpr):
    """The global row indices of this program's row block of group ``grp`` (rows grp·N .. grp·N + N - 1; those
    past the group's end are masked by the callers' ``rows < (grp + 1)·N``)."""
    return grp * N + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _group_cols(COL_IDS, COL_OFF, grp, C, GATHER: tl.constexpr):
    """Group ``grp``'s column ids and offsets: C of each per group, one after the other (one group without
    GATHER: the full softmax's columns are the vocabulary rows themselves)."""
    if GATHER:
        COL_IDS += grp.to(tl.int64) * C
    return COL_IDS, COL_OFF + grp.to(tl.int64) * C


@triton.jit
def _rows_of(TGT, LSE, G, rows, N):
    """int64 row indices, in-range mask, targets (-1 outside), row LSE and upstream gradient."""
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    tgt = tl.load(TGT + rows64, mask=row_ok, other=-1)
    return rows64, row_ok, tgt, tl.load(LSE + rows64, mask=row_ok, other=0.0), tl.load(G + rows64, mask=row_ok,
                                                                                        other=0.0)


@triton.jit
def _cols_of(COL_IDS, cols, col_ok, GATHER: tl.constexpr):
    """Weight rows of the tile columns: the sampled ids (GATHER) or the columns themselves."""
    if GATHER:
        return tl.load(COL_IDS + cols, mask=col_ok, other=0).to(tl.int64)
    return cols.to(tl.int64)


@triton.jit
def _split_cols(COL_IDS, c_begin, c0, cols_per_split, C, BLOCK_C: tl.constexpr, GATHER: tl.constexpr):
    """Columns c0 .. c0 + BLOCK_C of the column split that starts at c_begin: indices, mask, weight rows."""
    offs = c0 + tl.arange(0, BLOCK_C)
    cols = c_begin + offs
    col_ok = (offs < cols_per_split) & (cols < C)
    return cols, col_ok, _cols_of(COL_IDS, cols, col_ok, GATHER)


@triton.jit
def _dlogit_tile(H, W, COL_OFF, rows64, row_ok, tgt, lse, g, cols, cid, col_ok, P: tl.constexpr,
                 MASK_HITS: tl.constexpr, SUB_TARGET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """(BLOCK_N, BLOCK_C) fp32 gradient of the loss w.r.t. the logit tile: g·softmax (− g at the target)."""
    logit = _logit_tile(H, W, rows64, cid, row_ok, col_ok, P, BLOCK_N, BLOCK_C, BLOCK_K, UPCAST, IEEE)
    logit += tl.load(COL_OFF + cols, mask=col_ok, other=0.0)[None, :]
    keep = row_ok[:, None] & col_ok[None, :]
    if MASK_HITS:
        keep = keep & (cid[None, :] != tgt[:, None])
    d = tl.where(keep, tl.exp(logit - lse[:, None]), 0.0) * g[:, None]
    if SUB_TARGET:
        d -= tl.where(keep & (cid[None, :] == tgt[:, None]), g[:, None], 0.0)
    return d


@triton.jit
def _softmax_dlogit_kernel(
    H, W, COL_IDS, COL_OFF, TGT, LSE, G,  # inputs
    DL, DB,  # outputs: (N, CW) in the operand dtype, (groups x row blocks, CW) fp32
    N, P: tl.constexpr, c0, CW, C,
    GATHER: tl.constexpr, MASK_HITS: tl.constexpr, SUB_TARGET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Grid (row blocks, column blocks, groups) over the CW columns c0 .. c0 + CW: DL[n, j] = dlogit[n, c0 + j]
    rounded to the operand dtype (the GEMM operand backward multiplies with), DB[row block, j] = the row block's
    fp32 sum of dlogit[:, c0 + j] (the bias gradient's partial, before rounding). One writer per element:
    deterministic. Groups (``_group_rows``, ``_group_cols``): N rows and C columns (ids, offsets) each, one after
    the other."""
    grp = tl.program_id(2)
    rows = _group_rows(grp, N, BLOCK_N)
    COL_IDS, COL_OFF = _group_cols(COL_IDS, COL_OFF, grp, C, GATHER)
    rows64, row_ok, tgt, lse, g = _rows_of(TGT, LSE, G, rows, (grp + 1) * N)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = offs < CW
    cols = c0 + offs
    cid = _cols_of(COL_IDS, cols, col_ok, GATHER)
    d = _dlogit_tile(H, W, COL_OFF, rows64, row_ok, tgt, lse, g, cols, cid, col_ok, P, MASK_HITS, SUB_TARGET,
                     BLOCK_N, BLOCK_C, BLOCK_K, UPCAST, IEEE)
    offs64 = offs.to(tl.int64)
    tl.store(DL + rows64[:, None] * CW + offs64[None, :], d.to(DL.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
    block = grp.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    tl.store(DB + block * CW + offs64, tl.sum(d, axis=0), mask=col_ok)


@triton.jit
def _softmax_lse_fwd_kernel(
    H, W, COL_IDS, COL_OFF, TGT, TGT_OFF,  # inputs
    OUT_M, OUT_L, OUT_TGT,  # outputs: (SPLITS, groups x N) fp32 ×2, (groups x N,) fp32
    N, P: tl.constexpr, C, cols_per_split,
    GATHER: tl.constexpr, MASK_HITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid (row blocks, column splits, groups); a group's N rows against its own C columns (``_group_rows``,
    ``_group_cols``)."""
    pid_s = tl.program_id(1)
    grp = tl.program_id(2)
    rows = _group_rows(grp, N, BLOCK_N)
    COL_IDS, COL_OFF = _group_cols(COL_IDS, COL_OFF, grp, C, GATHER)
    NT = N * tl.num_programs(2)  # every group's rows: the outputs' row count
    row_ok = rows < (grp + 1) * N
    rows64 = rows.to(tl.int64)
    tgt = tl.load(TGT + rows64, mask=row_ok, other=-1)

    m = tl.full((BLOCK_N,), -_FLT_MAX, dtype=tl.float32)
    l_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    c_begin = pid_s * cols_per_split
    c0 = 0
    while c0 < cols_per_split:  # runtime bound: a while loop (the interpreter takes no runtime range bounds)
        cols, col_ok, cid = _split_cols(COL_IDS, c_begin, c0, cols_per_split, C, BLOCK_C, GATHER)
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
    tl.store(OUT_M + pid_s * NT + rows64, m, mask=row_ok)
    tl.store(OUT_L + pid_s * NT + rows64, l_sum, mask=row_ok)

    if pid_s == 0:
        # target logit h·w_y + off_y by a gathered dot
        t64 = tl.where(row_ok, tgt, 0).to(tl.int64)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(0, P, BLOCK_K):
            k = k0 + ks
            msk = row_ok[:, None] & (k < P)[None, :]
            h = tl.load(H + rows64[:, None] * P + k[None, :], mask=msk, other=0.0).to(tl.float32)
            w = tl.load(W + t64[:, None] * P + k[None, :], mask=msk, other=0.0).to(tl.float32)
            acc += tl.sum(h * w, axis=1)
        acc += tl.load(TGT_OFF + rows64, mask=row_ok, other=0.0)
        tl.store(OUT_TGT + rows64, acc, mask=row_ok)


# ------------------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------------------

def _tiles(N: int, C: int, P: int, dtype: torch.dtype, target: Target) -> dict:
    """The logit tile of the forward and of the backward's dlogit kernel (one K loop over P per tile). 16-bit:
    128 x 128 (sm_90a: 204-241 registers in the forward, 182-234 in the dlogit kernel across the report's
    variants, no spill; the forward's 64 x 128 before had 127-184). A tile's K loop reads (BLOCK_N + BLOCK_C) x P
    operands for BLOCK_N x BLOCK_C x P products, so 128 x 128 moves a third fewer bytes through L2 per FLOP than
    64 x 128 and half of what 64 x 64 moved. fp32 (IEEE products on the FMA units, operands in registers) keeps
    64 x 128 (128 registers in the dlogit kernel)."""
    if target.interpret:  # small tiles keep the numpy emulation fast and exercise the masks
        return dict(BLOCK_N=pow2_between(N, 16, 16), BLOCK_C=pow2_between(C, 16, 32),
                    BLOCK_K=pow2_between(P, 16, 16), num_warps=4, num_stages=1)
    wide = dtype != torch.float32
    return dict(BLOCK_N=pow2_between(N, 16, 128 if wide else 64), BLOCK_C=pow2_between(C, 16, 128),
                BLOCK_K=pow2_between(P, 16, 64 if wide else 32), num_warps=8, num_stages=3)


def _splits(n_tiles: int, programs: int, target: Target, requested: int | None) -> tuple[int, int]:
    """(splits, tiles per split) of ``n_tiles`` column tiles over ``programs`` row blocks (every group's):
    ``requested``, else the count, from 2 to 16 programs an SM, whose last wave of one program an SM is the
    fullest (the fewest splits on a tie; at least 2 programs an SM where a split count gives them): one direction at
    the training shape, 60 row blocks x 11 splits = 5 x 132 programs; the trainer's two directions in one call (or
    the original config's six groups of 2,560 rows), 120 row blocks x 11 splits = 10 x 132 (up to 8 an SM the best
    was 3 splits, 0.91 of 3 waves)."""
    def split(want: int) -> tuple[int, int]:
        if n_tiles == 0:  # no columns: one split of none (its log-sum-exp is -inf)
            return 1, 0
        per = triton.cdiv(n_tiles, max(1, min(int(want), n_tiles)))
        return triton.cdiv(n_tiles, per), per  # no empty split

    if requested is not None or target.interpret:
        return split(2 if requested is None else requested)
    sms, programs = target.sms, max(1, programs)  # no rows: an empty grid either way
    best = None
    for want in range(triton.cdiv(2 * sms, programs), triton.cdiv(16 * sms, programs) + 1):
        got = split(want)
        n = programs * got[0]
        # an uneven split may fall short of 2 an SM; plain bool and float where the shapes are symbolic (AOT dispatch
        # of dynamic shapes: the pick guards on them, SymBools do not order)
        key = (bool(n >= 2 * sms), float(n / (triton.cdiv(n, sms) * sms)))
        if best is None or key[0] > best[0][0] or (key[0] == best[0][0] and key[1] > best[0][1] + 1e-9):
            best = (key, got)
    return best[1]


def lse_fwd_launch(N: int, C: int, P: int, dtype: torch.dtype, target: Target, *, gather: bool, mask_hits: bool,
                   num_splits: int | None = None, groups: int = 1) -> tuple[Launch, int]:
    """``_softmax_lse_fwd_kernel`` over ``groups`` groups of N rows and C columns, and its columns per split: the
    columns are split (split-K over columns, partial log-sum-exps combined on the host) so few row blocks still
    fill the GPU."""
    t = _tiles(N, C, P, dtype, target)
    row_blocks = triton.cdiv(N, t["BLOCK_N"])
    splits, per_split = _splits(triton.cdiv(C, t["BLOCK_C"]), row_blocks * groups, target, num_splits)
    return Launch(_softmax_lse_fwd_kernel, (row_blocks, splits, groups), dict(
        GATHER=gather, MASK_HITS=mask_hits, **dot_flags(dtype, target), **t)), per_split * t["BLOCK_C"]


def dlogit_launch(N: int, CW: int, P: int, dtype: torch.dtype, target: Target, *, gather: bool, mask_hits: bool,
                  sub_target: bool, groups: int = 1) -> Launch:
    """``_softmax_dlogit_kernel`` over ``groups`` groups of N rows and a chunk of CW columns (grid: row blocks x
    column blocks x groups)."""
    t = _tiles(N, CW, P, dtype, target)
    return Launch(_softmax_dlogit_kernel, (triton.cdiv(N, t["BLOCK_N"]), triton.cdiv(CW, t["BLOCK_C"]), groups),
                  dict(GATHER=gather, MASK_HITS=mask_hits, SUB_TARGET=sub_target, **dot_flags(dtype, target), **t))


DLOGIT_BYTES = 256 << 20  # the most the backward's dlogit chunk (N x columns, operand dtype) may take


def dlogit_columns(N: int, C: int, itemsize: int, budget: int = DLOGIT_BYTES) -> int:
    """Columns per backward chunk: all C when N x C fits ``budget`` bytes (the sampled softmax: 7680 x 8192 in
    bf16 is 120 MiB), else the most that fit, a multiple of 128 (the full softmax: never N x V at once)."""
    fit = budget // max(1, N * itemsize)
    return C if fit >= C else max(128, fit // 128 * 128)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 accumulation and an fp32 result. fp32 operands: torch.mm (IEEE unless the user turned
    on TF32 for matmuls). 16-bit operands on CUDA: cuBLAS with an fp32 output, as a batch of one
    (``bmm(..., out_dtype=float32)``: torch.compile traces it, where its ``mm`` twin failed to in torch 2.8-2.9,
    pytorch#163275) where this torch build has it (2.8 on), else the 16-bit product widened (one more rounding);
    on CPU (the interpreter's tests): the fp32 product of the widened operands, the same sums."""
    return _bmm_f32(a.unsqueeze(0), b.unsqueeze(0))[0]


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``_mm_f32`` of a batch: (G, M, K) @ (G, K, N) -> (G, M, N) fp32."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda:
        if _BMM_OUT_DTYPE:
            return torch.bmm(a, b, out_dtype=torch.float32)
        return torch.bmm(a, b).float()
    return torch.bmm(a.float(), b.float())


def _has_cuda_kernel(op: str, overload: str) -> bool:
    """Whether ``aten::op.overload`` exists in this torch and has a CUDA kernel (False on older versions)."""
    if not hasattr(getattr(torch.ops.aten, op), overload):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}.{overload}", "CUDA")


_BMM_OUT_DTYPE = _has_cuda_kernel("bmm", "dtype")


def _check_inputs(hidden, weight, bias):
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton softmax kernels take fp32/bf16/fp16, got {hidden.dtype}; "
                        "use backend='reference' for fp64")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    if hidden.device != weight.device or bias.device != weight.device:
        raise ValueError(f"hidden, weight and bias must share a device, got {hidden.device}, {weight.device}, "
                         f"{bias.device}")


def _group_sizes(hidden, col_ids, col_off, groups: int) -> tuple[int, int]:
    """(rows, columns) per group: ``hidden``'s rows and ``col_off``'s entries are ``groups`` equal runs."""
    if not isinstance(groups, int) or groups < 1 or hidden.shape[0] % groups or col_off.numel() % groups:
        raise ValueError(f"groups must be a positive int dividing the rows ({hidden.shape[0]}) and the columns "
                         f"({col_off.numel()}), got {groups!r}")
    if groups > 1 and col_ids is None:
        raise ValueError("groups > 1 are for gathered columns (the sampled softmax: each group its own ids)")
    return hidden.shape[0] // groups, col_off.numel() // groups


def softmax_lse_fwd(hidden, weight, col_ids, col_off, targets, tgt_off, *, mask_hits: bool,
                    num_splits: int | None = None, groups: int = 1):
    """Returns (lse over the columns (N,) fp32, target logit (N,) fp32) for ``hidden``'s N rows. ``col_ids`` None
    = all V rows. ``groups``: the rows are that many equal runs, each against its own run of ``col_ids`` /
    ``col_off`` (C / groups entries each)."""
    NT, P = hidden.shape
    N, C = _group_sizes(hidden, col_ids, col_off, groups)
    gather = col_ids is not None
    launch, cols_per_split = lse_fwd_launch(N, C, P, hidden.dtype, target_of(hidden.device), gather=gather,
                                            mask_hits=mask_hits, num_splits=num_splits, groups=groups)
    splits = launch.grid[1]
    out_m = torch.empty((splits, NT), dtype=torch.float32, device=hidden.device)
    out_l = torch.empty((splits, NT), dtype=torch.float32, device=hidden.device)
    out_t = torch.empty((NT,), dtype=torch.float32, device=hidden.device)
    launch(hidden, weight, col_ids if gather else col_off, col_off, targets, tgt_off,
           out_m, out_l, out_t, N, P, C, cols_per_split)
    # log l may be −inf for a split holding only accidental hits; the max term keeps the sum finite
    lse = torch.logsumexp(out_m + torch.log(out_l), dim=0)
    return lse, out_t


def softmax_grad(hidden, weight, col_ids, col_off, targets, lse, g, *, mask_hits: bool, sub_target: bool,
                 chunk_cols: int | None = None, groups: int = 1):
    """fp32 (dH (N, P), dW_cols (C, P), d_off (C,)) of Σ_n g_n·(lse_n − …) w.r.t. the tile columns (N: every
    group's rows, C: every group's columns).

    Per chunk of columns (``dlogit_columns``, or ``chunk_cols``): ``_softmax_dlogit_kernel`` writes the chunk's
    dlogit in the operand dtype and the bias gradient's per-row-block fp32 partials; two cuBLAS GEMMs give
    dH += dlogit · W_chunk and dW_chunk = dlogitᵀ · H (fp32 accumulation, ``_mm_f32``). Deterministic: one
    writer per element, chunks and row-block partials added in order, no atomics.

    ``groups`` (``softmax_lse_fwd``'s): where every group's dlogit fits one chunk, one launch over all of them
    and batched GEMMs; else group after group."""
    NT, P = hidden.shape
    N, C = _group_sizes(hidden, col_ids, col_off, groups)
    if chunk_cols is not None and (not isinstance(chunk_cols, int) or chunk_cols < 1):
        raise ValueError(f"softmax_grad: chunk_cols is a positive number of columns, got {chunk_cols!r}")
    if groups > 1:
        if chunk_cols is None and dlogit_columns(NT, C, hidden.dtype.itemsize) == C and N * C:
            return _grouped_grad(hidden, weight, col_ids, col_off, targets, lse, g, groups, N, C,
                                 dict(mask_hits=mask_hits, sub_target=sub_target))
        parts = [softmax_grad(hidden[k * N:(k + 1) * N], weight, col_ids[k * C:(k + 1) * C], col_off[k * C:(k + 1) * C],
                              targets[k * N:(k + 1) * N], lse[k * N:(k + 1) * N], g[k * N:(k + 1) * N],
                              mask_hits=mask_hits, sub_target=sub_target, chunk_cols=chunk_cols)
                 for k in range(groups)]
        return tuple(torch.cat(t) for t in zip(*parts))
    target = target_of(hidden.device)
    gather = col_ids is not None
    ids = col_ids if gather else col_off
    flags = dict(gather=gather, mask_hits=mask_hits, sub_target=sub_target)
    if N == 0 or C == 0:  # nothing to launch: the sums over no rows or no columns
        zeros = functools.partial(torch.zeros, dtype=torch.float32, device=hidden.device)
        return zeros((N, P)), zeros((C, P)), zeros((C,))
    cw = min(C, chunk_cols or dlogit_columns(N, C, hidden.dtype.itemsize))
    full = dlogit_launch(N, cw, P, hidden.dtype, target, **flags)  # every chunk's but a shorter last one's
    rows = full.grid[0]
    dl_buf = torch.empty((N * cw,), dtype=hidden.dtype, device=hidden.device)
    db_buf = torch.empty((rows * cw,), dtype=torch.float32, device=hidden.device)
    dh = dwc = doff = None
    for c0 in range(0, C, cw):
        w = min(cw, C - c0)
        dl, db = dl_buf[:N * w].view(N, w), db_buf[:rows * w].view(rows, w)
        launch = full if w == cw else dlogit_launch(N, w, P, hidden.dtype, target, **flags)
        launch(hidden, weight, ids, col_off, targets, lse, g, dl, db, N, P, c0, w, C)
        w_chunk = weight.index_select(0, col_ids[c0:c0 + w]) if gather else weight[c0:c0 + w]
        part = _mm_f32(dl, w_chunk)
        dh = part if dh is None else dh.add_(part)
        if w == C:  # one chunk (the sampled softmax): the products are the outputs
            dwc, doff = _mm_f32(dl.t(), hidden), db.sum(0)
            continue
        if dwc is None:
            dwc = torch.empty((C, P), dtype=torch.float32, device=hidden.device)
            doff = torch.empty((C,), dtype=torch.float32, device=hidden.device)
        dwc[c0:c0 + w] = _mm_f32(dl.t(), hidden)
        doff[c0:c0 + w] = db.sum(0)
    return dh, dwc, doff


def _grouped_grad(hidden, weight, col_ids, col_off, targets, lse, g, groups: int, N: int, C: int, flags: dict):
    """``softmax_grad`` of ``groups`` groups (gathered columns: ``col_ids``) in one chunk: one dlogit launch over
    all of them (its grid's third dimension), then per group dH = dlogit · W_group and dW_group = dlogitᵀ · H as
    two batched GEMMs (fp32 accumulation, ``_bmm_f32``), the bias partials summed per group in row-block order."""
    NT, P = hidden.shape
    launch = dlogit_launch(N, C, P, hidden.dtype, target_of(hidden.device), gather=True, groups=groups, **flags)
    rows = launch.grid[0]
    dl = torch.empty((NT, C), dtype=hidden.dtype, device=hidden.device)
    db = torch.empty((groups * rows, C), dtype=torch.float32, device=hidden.device)
    launch(hidden, weight, col_ids, col_off, targets, lse, g, dl, db, N, P, 0, C, C)
    w_cols = weight.index_select(0, col_ids)
    dl3 = dl.view(groups, N, C)
    dh = _bmm_f32(dl3, w_cols.view(groups, C, P)).view(NT, P)
    dwc = _bmm_f32(dl3.transpose(1, 2), hidden.view(groups, N, P)).view(groups * C, P)
    return dh, dwc, db.view(groups, rows, C).sum(1).view(groups * C)


def _row_scale(grad_out: torch.Tensor, N: int, reduction: str, groups: int = 1) -> torch.Tensor:
    """Per-row upstream gradient g_n (fp32, (N,)), without a host sync; ``groups``: the loss is one value per
    group of N / groups rows (``_reduce``'s)."""
    g = grad_out.to(torch.float32)
    if reduction == "none":
        return g.reshape(N).contiguous()
    g = g.reshape(groups, 1).expand(groups, N // groups)
    if reduction == "mean":
        g = g / (N // groups)
    return g.reshape(N).contiguous()


def _reduce(loss: torch.Tensor, reduction: str, dtype: torch.dtype, groups: int | None = None) -> torch.Tensor:
    """The rows' losses reduced: to a scalar, or with ``groups`` to one value per group (equal runs of rows)."""
    if reduction != "none" and groups is not None:
        loss = loss.view(groups, -1)
    if reduction == "mean":
        return loss.mean(-1).to(dtype)
    if reduction == "sum":
        return loss.sum(-1).to(dtype)
    return loss.to(dtype)


def _merge_rows(ids: torch.Tensor, values: torch.Tensor):
    """Sum fp32 ``values`` of duplicate row ids without a host sync (no ``torch.unique``, whose output size
    lives on the device). Returns (ids sorted, values) of the same length, where the first entry of each run of
    equal ids holds the run's fp32 sum and the others hold zeros."""
    sorted_ids, order = torch.sort(ids)
    vals = values.index_select(0, order)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    run = torch.cumsum(first, 0) - 1  # run index of every entry
    sums = torch.zeros_like(vals).index_add_(0, run, vals)
    keep = first.view(-1, *([1] * (vals.dim() - 1)))
    return sorted_ids, torch.where(keep, sums.index_select(0, run), torch.zeros((), dtype=vals.dtype,
                                                                                 device=vals.device))


def _rows_grad(ids, values, V, shape, dtype, sparse):
    """The gradient of a (V, ...) table from fp32 row contributions at possibly repeated ``ids``: dense, or an
    uncoalesced sparse COO tensor whose repeated rows beyond the first are zero (duplicates summed in fp32)."""
    ids, vals = _merge_rows(ids, values)
    vals = vals.to(dtype)
    if sparse:
        return torch.sparse_coo_tensor(ids.unsqueeze(0), vals, shape, check_invariants=False)
    return torch.zeros(shape, dtype=dtype, device=vals.device).index_add_(0, ids, vals)


# ------------------------------------------------------------------------------------------ operators
Tensor = torch.Tensor


def _sampled_fwd(hidden: Tensor, weight: Tensor, bias: Tensor, targets: Tensor, sampled_ids: Tensor,
                 true_expected: Tensor, sampled_expected: Tensor, remove_accidental_hits: bool, reduction: str,
                 sparse_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, samp_off, lse, true_logit): the fp32 sample offsets and the row statistics backward reads (it
    recomputes logit tiles; no N × S tensor is ever stored). ``sparse_grad`` is for backward only.

    ``sampled_ids`` (S,), or (G, S): G groups, each a run of N / G rows with its own samples (``sampled_expected``
    of the same shape), the loss then one per group ((G,); (N,) with 'none')."""
    _check_inputs(hidden, weight, bias)
    hidden, weight, targets, sampled_ids = (t.contiguous() for t in (hidden, weight, targets, sampled_ids))
    groups = _groups_of(hidden, targets, sampled_ids, sampled_expected, true_expected)
    bias32 = bias.to(torch.float32)
    ids = sampled_ids.view(-1)
    samp_off = (bias32.index_select(0, ids) - torch.log(sampled_expected.reshape(-1)).to(torch.float32))
    true_off = (bias32.index_select(0, targets) - torch.log(true_expected).to(torch.float32))
    lse_s, true_logit = softmax_lse_fwd(hidden, weight, ids, samp_off.contiguous(), targets,
                                        true_off.contiguous(), mask_hits=remove_accidental_hits, groups=groups)
    lse = torch.logaddexp(lse_s, true_logit)  # the true class is column 0 of TF's logit row
    return (_reduce(lse - true_logit, reduction, hidden.dtype, groups if sampled_ids.dim() == 2 else None),
            samp_off, lse, true_logit)


def _groups_of(hidden, targets, sampled_ids, sampled_expected, true_expected) -> int:
    """The group count of ``_sampled_fwd``'s arguments, their shapes checked."""
    N = hidden.shape[0]
    groups = _n_groups(sampled_ids)
    if sampled_ids.dim() not in (1, 2) or sampled_expected.shape != sampled_ids.shape or N % groups \
            or targets.shape != (N,) or true_expected.shape != (N,):
        raise ValueError(f"sampled softmax: sampled_ids (S,) or (groups, S) with sampled_expected of its shape, "
                         f"the rows ({N}) a multiple of the groups, targets and true_expected (N,); got ids "
                         f"{tuple(sampled_ids.shape)}, sampled_expected {tuple(sampled_expected.shape)}, targets "
                         f"{tuple(targets.shape)}, true_expected {tuple(true_expected.shape)}")
    return groups


def _n_groups(sampled_ids: Tensor) -> int:
    """Sample sets (S,): one group; (G, S): G groups."""
    return sampled_ids.shape[0] if sampled_ids.dim() == 2 else 1


def _sampled_bwd(grad_out: Tensor, hidden: Tensor, weight: Tensor, targets: Tensor, sampled_ids: Tensor,
                 samp_off: Tensor, lse: Tensor, true_logit: Tensor, remove_accidental_hits: bool, reduction: str,
                 need_rows: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dh fp32 (N, P), rows_w fp32, rows_b fp32): the weight / bias gradient rows of ``cat(sampled_ids,
    targets)`` (placeholders unless ``need_rows``)."""
    hidden, weight, targets, sampled_ids = (t.contiguous() for t in (hidden, weight, targets, sampled_ids))
    N, P = hidden.shape
    groups = _n_groups(sampled_ids)
    g = _row_scale(grad_out, N, reduction, groups)
    dh, dws, doff = softmax_grad(hidden, weight, sampled_ids.view(-1), samp_off, targets, lse, g,
                                 mask_hits=remove_accidental_hits, sub_target=False, groups=groups)
    # the true column: dlogit_true = g (p_true − 1), an O(N·P) gather/scatter
    d_true = g * torch.expm1(true_logit - lse)
    w_t = weight.index_select(0, targets).to(torch.float32)
    dh.addcmul_(d_true.unsqueeze(1), w_t)
    if not need_rows:
        return dh, nothing(dh), nothing(dh)
    return dh, torch.cat([dws, d_true.unsqueeze(1) * hidden.to(torch.float32)]), torch.cat([doff, d_true])


def _full_fwd(hidden: Tensor, weight: Tensor, bias: Tensor, targets: Tensor, reduction: str
              ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, off, lse): the fp32 bias and the row log-sum-exp, which backward reads."""
    _check_inputs(hidden, weight, bias)
    hidden, weight, targets = (t.contiguous() for t in (hidden, weight, targets))
    off = bias.to(torch.float32).contiguous()
    if off is bias:  # an output must not be an input
        off = off.clone()
    true_off = off.index_select(0, targets).contiguous()
    lse, tgt_logit = softmax_lse_fwd(hidden, weight, None, off, targets, true_off, mask_hits=False)
    return _reduce(lse - tgt_logit, reduction, hidden.dtype), off, lse


def _full_bwd(grad_out: Tensor, hidden: Tensor, weight: Tensor, targets: Tensor, off: Tensor, lse: Tensor,
              reduction: str) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 (dh (N, P), dW (V, P), db (V,))."""
    hidden, weight, targets = (t.contiguous() for t in (hidden, weight, targets))
    g = _row_scale(grad_out, hidden.shape[0], reduction)
    return softmax_grad(hidden, weight, None, off, targets, lse, g, mask_hits=False, sub_target=True)


_sampled_op = triton_operator("sampled_softmax_triton", _sampled_fwd)
_sampled_backward_op = triton_operator("sampled_softmax_triton_backward", _sampled_bwd)
_full_op = triton_operator("full_softmax_triton", _full_fwd)
_full_backward_op = triton_operator("full_softmax_triton_backward", _full_bwd)


def _sampled_setup(ctx, inputs, output):
    hidden, weight, bias, targets, sampled_ids, _, _, remove_hits, reduction, sparse = inputs
    ctx.save_for_backward(hidden, weight, targets, sampled_ids, *output[1:])
    ctx.flags = (remove_hits, reduction, sparse, bias.dtype, bias.shape[0])
    ctx.mark_non_differentiable(*output[1:])


def _sampled_backward(ctx, grad_out, *_):
    hidden, weight, targets, sampled_ids, samp_off, lse, true_logit = ctx.saved_tensors
    mask_hits, reduction, sparse, bias_dtype, V = ctx.flags
    need = ctx.needs_input_grad
    dh, rows_w, rows_b = _sampled_backward_op(grad_out, hidden, weight, targets, sampled_ids, samp_off, lse,
                                              true_logit, mask_hits, reduction, need[1] or need[2])
    ids = torch.cat([sampled_ids.reshape(-1), targets])
    grad_w = _rows_grad(ids, rows_w, V, (V, hidden.shape[1]), weight.dtype, sparse) if need[1] else None
    grad_b = _rows_grad(ids, rows_b, V, (V,), bias_dtype, sparse) if need[2] else None
    return dh.to(hidden.dtype) if need[0] else None, grad_w, grad_b, *(None,) * 7


def _full_setup(ctx, inputs, output):
    hidden, weight, bias, targets, reduction = inputs
    ctx.save_for_backward(hidden, weight, targets, *output[1:])
    ctx.flags = (reduction, bias.dtype)
    ctx.mark_non_differentiable(*output[1:])


def _full_backward(ctx, grad_out, *_):
    hidden, weight, targets, off, lse = ctx.saved_tensors
    reduction, bias_dtype = ctx.flags
    need = ctx.needs_input_grad
    dh, dw, db = _full_backward_op(grad_out, hidden, weight, targets, off, lse, reduction)
    return (dh.to(hidden.dtype) if need[0] else None, dw.to(weight.dtype) if need[1] else None,
            db.to(bias_dtype) if need[2] else None, None, None)


_sampled_op.register_autograd(_sampled_backward, setup_context=_sampled_setup)
_full_op.register_autograd(_full_backward, setup_context=_full_setup)


def sampled_softmax_loss_triton(hidden, targets, weight, bias, sampled_ids, true_expected, sampled_expected, *,
                                remove_accidental_hits: bool = True, reduction: str = "mean",
                                sparse_grad: bool = False) -> torch.Tensor:
    """TF sampled softmax loss, fused (see module docstring). hidden (N, P), targets (N,), weight (V, P),
    bias (V,), sampled_ids (S,), true_expected (N,), sampled_expected (S,) expected counts (any float dtype).
    With ``sparse_grad`` the weight and bias gradients are sparse COO tensors (uncoalesced) over
    ``sampled_ids ∪ targets``. The operator ``elmo_fast::sampled_softmax_triton`` and its backward.

    Groups: ``sampled_ids`` and ``sampled_expected`` (G, S) make G losses at once, group k the rows
    k·N/G .. (k+1)·N/G − 1 against its own samples (one launch of each kernel for all; the loss (G,), or (N,)
    with 'none'): the values and gradients of G calls, the table's gradients summed."""
    return _sampled_op(hidden, weight, bias, targets.long(), sampled_ids.long(), true_expected, sampled_expected,
                       bool(remove_accidental_hits), reduction, bool(sparse_grad))[0]


def full_softmax_nll_triton(hidden, targets, weight, bias, *, reduction: str = "mean") -> torch.Tensor:
    """Exact NLL over the whole vocabulary without materialising N × V; differentiable (the operator
    ``elmo_fast::full_softmax_triton`` and its backward)."""
    return _full_op(hidden, weight, bias, targets.long(), reduction)[0]


__all__ = ["sampled_softmax_loss_triton", "full_softmax_nll_triton", "softmax_lse_fwd", "softmax_grad"]
