"""Fused character-CNN token encoder in Triton: every filter width, max over positions, bias and activation in
one kernel over the tokens' embedded characters (one embedding launch before it), plus its backward (spec §2.2;
oracle ``elmo_fast.reference.char_cnn``).

Math, per token ``t`` and filter ``f`` of width ``w_f`` (E = char_embed[ids[t]], (L, d_c)):

    y[t, f] = act(b_f + max_{p <= L - w_f} sum_{k < w_f, c < d_c} E[p + k, c] · W_f[k, c])

Layout used by the kernels. Every filter group's weight (w_i, d_c, n_i) is flattened to (w_i·d_c, n_i) with
row index ``j = k·d_c + c``, zero-padded to ``KW·d_c`` rows (KW = the widest filter) and the groups are
concatenated along the filter axis: ``W_packed`` (KW·d_c, F). A filter of width w thus sees zero weights
for k >= w, and one program handles filters of different widths with one static K extent; ``wid[f]`` gives
each filter's own number of valid windows ``L - w_f + 1``.

The tokens' characters are embedded once by the host (``E = char_embed[ids]``, (N, L, d_c), one gather
launch), so the window matrix of position p for a block of tokens, ``A[t, j] = E[t, p + j // d_c, j % d_c]``,
is a contiguous run of KW·d_c values per token: one strided tile load (16-byte vectors, issued ahead by the
software pipeliner), not a gather of ids and then of table rows. It is multiplied with the weight tile, which
stays on chip for the whole position loop. The convolution maps are never written to memory; the running
max and its position (argmax, per token and filter) are kept in registers and only the argmax is saved
for backward (int8 when L < 128).

Exact shortcuts (none changes a value beyond float rounding order):

* ``klen[t]`` = 1 + index of the last character that is not the in-word padding id 261. Windows starting
  at p >= klen[t] hold only padding characters, so all give the same value for every token: it is computed
  once per filter (``pv[f]``, per program: one tiny product) and the token's explicit windows stop at
  ``klen[t]``. Tokens are visited sorted by ``klen`` (descending) so a block's loop bound, the klen of its
  first token, fits every token of the block: short words cost little.
* all-zero rows (padding tokens, id 0 everywhere) see a zero embedding, so every window is exactly the
  bias; they get ``klen = -1``, no windows at all, and argmax -1 (no gradient to the embedding or the
  weights, like the reference).

Backward (``_char_cnn_bwd_kernel``) walks the same positions: at position p the upstream gradient of the
(token, filter) pairs whose argmax is p, ``Gp``, gives the weight gradient ``A_p^T · Gp`` (accumulated in
registers, one atomic add per program) and the window gradient ``Gp · W^T`` (added atomically into a per
token, per character position fp32 scratch (N, L, d_c)). ``_embed_grad_kernel`` then reduces that scratch
into the (n_chars, d_c) table gradient with one-hot products (no per-element atomics on the tiny table).
Pad-window winners are stored with argmax = klen[t] (a real all-padding window of that token), so backward
needs no special case. Sums use fp32 atomics: the gradients are not bitwise deterministic. The atomics are
relaxed (``sem="relaxed"``): they are sums, read only by later launches, so they need no ordering; Triton's
default (acq_rel) put a GPU-wide memory barrier before every one of them (``MEMBAR.ALL.GPU`` in the sm_90a code).

Deterministic mode (``elmo_fast.determinism``) adds nothing atomically. The backward kernel stores each token
block's weight and bias gradient as a partial (summed in block order by torch); ``_char_cnn_win_grad_kernel``
gives every token's character slots their gradient, one program per token block looping over the filter
blocks in order, ``gwin[t, q] = sum_k G(window q - k) · W_k^T`` (no overlapping writes); ``_embed_grad_kernel``
stores one partial table per slot block. It costs one more launch, the partial buffers (n_tblocks x KWD x F
fp32) and a re-read of the upstream gradient per character slot (bench/results/kernel_report.md).

Ties between windows keep the first position. The reference (``amax``) splits the gradient between exact
ties; exact ties come from windows with the same characters, whose gradients are the same, so the two
agree.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from elmo_fast.determinism import is_deterministic
from elmo_fast.kernels._common import (Launch, Target, acc_dtype, device_constant, dot_flags, tanh, target_of,
                                      tl_acc_dtype, triton_operator)
from elmo_fast.kernels._common import dot as _dot
from elmo_fast.ops._library import nothing
from elmo_fast.reference.char_cnn import _activation

PAD_CHAR_ID = 261  # inference id of the in-word padding character (see elmo_fast.reference.char_cnn)

_ACTIVATIONS = {"relu": 0, "tanh": 1}


@triton.jit
def _act_grad(g, y, ACT: tl.constexpr):
    # gradient through the activation, from its output y: relu' = [y > 0], tanh' = 1 - y²
    if ACT == 0:
        return tl.where(y > 0.0, g, 0.0)
    else:
        return g * (1.0 - y * y)


@triton.jit
def _window_at(row, tmask, j, jk, jmask, p, L, DC: tl.constexpr):
    # (offsets, mask) of the window at position p in a per-token (L, DC) array (E, or the window gradient's
    # scratch): element [t, j] is [t, p + j // DC, j % DC], a contiguous run of KW·DC values a token (no gather:
    # vector loads the pipeliner can issue ahead)
    return row[:, None] * (L * DC) + (p * DC + j)[None, :], tmask[:, None] & (jmask & (p + jk < L))[None, :]


@triton.jit
def _fwd_step(e_ptr, row, tmask, klen, nwin, j, jk, jmask, wt, best, arg, p, L,
              DC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr):
    offs, m2 = _window_at(row, tmask, j, jk, jmask, p, L, DC)
    s = _dot(tl.load(e_ptr + offs, mask=m2, other=0.0), wt, UPCAST, IEEE).to(ACC)
    take = (p < klen)[:, None] & (p < nwin)[None, :] & (s > best)  # strict: ties keep the first window
    best = tl.where(take, s, best)
    arg = tl.where(take, p, arg)
    return best, arg


@triton.jit
def _bwd_step(e_ptr, gwin_ptr, row, tmask, arg, g, j, jk, jmask, wt, gw, p, L,
              DC: tl.constexpr, NEED_W: tl.constexpr, NEED_EMB: tl.constexpr,
              UPCAST: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr):
    gp = tl.where(arg == p, g, 0.0).to(wt.dtype)  # grads of the (token, filter) pairs won by window p
    offs, m2 = _window_at(row, tmask, j, jk, jmask, p, L, DC)
    if NEED_W:
        gw += _dot(tl.trans(tl.load(e_ptr + offs, mask=m2, other=0.0)), gp, UPCAST, IEEE).to(ACC)
    if NEED_EMB:
        gwin = _dot(gp, tl.trans(wt), UPCAST, IEEE).to(ACC)  # (BLOCK_T, KWC): grad of E[p + k, c]
        tl.atomic_add(gwin_ptr + offs, gwin, mask=m2, sem="relaxed")
    return gw


@triton.jit
def _char_cnn_fwd_kernel(
    e_ptr, emb_ptr, w_ptr, bias_ptr, wid_ptr, klen_ptr, perm_ptr, bound_ptr,
    out_ptr, arg_ptr,
    N, F, L, pad_id,
    DC: tl.constexpr, KWD: tl.constexpr, KWC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
    ACT: tl.constexpr, HAS_PAD: tl.constexpr, SAVE_ARG: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr, WHILE_LOOPS: tl.constexpr,
):
    """e (N, L, DC): the tokens' embedded characters; emb (V, DC): the table (for its padding row); w (KWD, F)
    packed; bias/wid (F,); klen/perm (N,); bound (n_tblocks,).

    Writes out (N, F) = act(max + bias) and, if SAVE_ARG, arg (N, F) = winning window start (-1: zero row).
    """
    pid_t = tl.program_id(0)
    pid_f = tl.program_id(1)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = rt < N
    row = tl.load(perm_ptr + rt, mask=tmask, other=0).to(tl.int64)
    klen = tl.load(klen_ptr + row, mask=tmask, other=-1)
    rf = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = rf < F
    wid = tl.load(wid_ptr + rf, mask=fmask, other=1)
    nwin = L - wid + 1  # valid window starts per filter
    j = tl.arange(0, KWC)
    jk = j // DC
    jc = j % DC
    jmask = j < KWD
    wt = tl.load(w_ptr + j[:, None] * F + rf[None, :], mask=jmask[:, None] & fmask[None, :], other=0.0)

    # Value of an all-padding window (without bias): one product per filter.
    if HAS_PAD:
        pe = tl.load(emb_ptr + pad_id * DC + jc, mask=jmask, other=0.0).to(ACC)
        pv = tl.sum(pe[:, None] * wt.to(ACC), axis=0)
    else:
        pv = tl.zeros((BLOCK_F,), ACC)

    best = tl.full((BLOCK_T, BLOCK_F), float("-inf"), ACC)
    arg = tl.zeros((BLOCK_T, BLOCK_F), tl.int32)
    # Explicit windows: p < klen[t] (they touch a real character) and p < nwin[f].
    p_end = tl.minimum(tl.load(bound_ptr + pid_t), L - tl.min(tl.where(fmask, wid, 1 << 20), axis=0) + 1)
    if WHILE_LOOPS:
        p = 0
        while p < p_end:
            best, arg = _fwd_step(e_ptr, row, tmask, klen, nwin, j, jk, jmask, wt, best, arg, p, L,
                                  DC, UPCAST, IEEE, ACC)
            p += 1
    else:
        for p in range(0, p_end):
            best, arg = _fwd_step(e_ptr, row, tmask, klen, nwin, j, jk, jmask, wt, best, arg, p, L,
                                  DC, UPCAST, IEEE, ACC)
    # All-padding windows (they exist for filter f iff klen[t] < nwin[f]); the winner is stored as klen[t].
    if HAS_PAD:
        take = (klen >= 0)[:, None] & (klen[:, None] < nwin[None, :]) & (pv[None, :] > best)
        best = tl.where(take, pv[None, :], best)
        arg = tl.where(take, klen[:, None], arg)
    zero = (klen < 0)[:, None]
    best = tl.where(zero, 0.0, best)
    arg = tl.where(zero, -1, arg)

    b = tl.load(bias_ptr + rf, mask=fmask, other=0.0).to(ACC)
    y = best + b[None, :]
    if ACT == 0:
        y = tl.maximum(y, 0.0)
    else:
        y = tanh(y)
    omask = tmask[:, None] & fmask[None, :]
    offs = row[:, None] * F + rf[None, :]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=omask)
    if SAVE_ARG:
        tl.store(arg_ptr + offs, arg.to(arg_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _char_cnn_bwd_kernel(
    e_ptr, w_ptr, wid_ptr, perm_ptr, bound_ptr,
    out_ptr, arg_ptr, gout_ptr,
    gw_ptr, gb_ptr, gwin_ptr,
    N, F, L,
    DC: tl.constexpr, KWD: tl.constexpr, KWC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
    ACT: tl.constexpr, NEED_W: tl.constexpr, NEED_EMB: tl.constexpr, ORDERED: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr, WHILE_LOOPS: tl.constexpr,
):
    """Grads: gw (KWD, F) fp32 += A_p^T Gp; gb (F,) fp32 += sum_t G; gwin (N, L, DC) fp32 += Gp W^T at p.

    ORDERED (deterministic mode; NEED_EMB off): gw (n_tblocks, KWD, F) and gb (n_tblocks, F) get this token
    block's partials, stored, not added."""
    pid_t = tl.program_id(0)
    pid_f = tl.program_id(1)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = rt < N
    row = tl.load(perm_ptr + rt, mask=tmask, other=0).to(tl.int64)
    rf = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = rf < F
    omask = tmask[:, None] & fmask[None, :]
    offs = row[:, None] * F + rf[None, :]
    g = _act_grad(tl.load(gout_ptr + offs, mask=omask, other=0.0).to(ACC),
                  tl.load(out_ptr + offs, mask=omask, other=0.0).to(ACC), ACT)
    if ORDERED:  # one partial row per token block, summed in block order by the host
        tl.store(gb_ptr + pid_t.to(tl.int64) * F + rf, tl.sum(g, axis=0), mask=fmask)
    else:
        tl.atomic_add(gb_ptr + rf, tl.sum(g, axis=0), mask=fmask, sem="relaxed")
    if NEED_W or NEED_EMB:
        arg = tl.load(arg_ptr + offs, mask=omask, other=-1).to(tl.int32)
        wid = tl.load(wid_ptr + rf, mask=fmask, other=1)
        j = tl.arange(0, KWC)
        jk = j // DC
        jmask = j < KWD
        wt = tl.load(w_ptr + j[:, None] * F + rf[None, :], mask=jmask[:, None] & fmask[None, :], other=0.0)
        gw = tl.zeros((KWC, BLOCK_F), ACC)
        # Winners sit at p <= klen[t] <= bound (pad winners at exactly klen[t]).
        p_end = tl.minimum(tl.load(bound_ptr + pid_t) + 1,
                           L - tl.min(tl.where(fmask, wid, 1 << 20), axis=0) + 1)
        if WHILE_LOOPS:
            p = 0
            while p < p_end:
                gw = _bwd_step(e_ptr, gwin_ptr, row, tmask, arg, g, j, jk, jmask, wt, gw, p, L,
                               DC, NEED_W, NEED_EMB, UPCAST, IEEE, ACC)
                p += 1
        else:
            for p in range(0, p_end):
                gw = _bwd_step(e_ptr, gwin_ptr, row, tmask, arg, g, j, jk, jmask, wt, gw, p, L,
                               DC, NEED_W, NEED_EMB, UPCAST, IEEE, ACC)
        if NEED_W:
            woffs = j[:, None] * F + rf[None, :]
            wmask = jmask[:, None] & fmask[None, :]
            if ORDERED:  # one partial tile per token block, as gb
                tl.store(gw_ptr + pid_t.to(tl.int64) * KWD * F + woffs, gw, mask=wmask)
            else:
                tl.atomic_add(gw_ptr + woffs, gw, mask=wmask, sem="relaxed")


@triton.jit
def _win_grad_block(gout_ptr, out_ptr, arg_ptr, w_ptr, row, tmask, c, cmask, q, f0, F, acc,
                    DC: tl.constexpr, KW: tl.constexpr, BLOCK_F: tl.constexpr, ACT: tl.constexpr,
                    UPCAST: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr):
    # acc (BLOCK_T, DCP) += the gradient of slot q from the filters f0 .. f0 + BLOCK_F: a filter won by the
    # window starting at p = q - k reaches slot q through its weight row k (zero when the filter is narrower).
    rf = f0 + tl.arange(0, BLOCK_F)
    fmask = rf < F
    m = tmask[:, None] & fmask[None, :]
    offs = row[:, None] * F + rf[None, :]
    g = _act_grad(tl.load(gout_ptr + offs, mask=m, other=0.0).to(ACC),
                  tl.load(out_ptr + offs, mask=m, other=0.0).to(ACC), ACT)
    arg = tl.load(arg_ptr + offs, mask=m, other=-1).to(tl.int32)
    wmask = fmask[:, None] & cmask[None, :]
    for k in tl.static_range(KW):
        wk = tl.load(w_ptr + (k * DC + c)[None, :] * F + rf[:, None], mask=wmask, other=0.0)  # W_k^T (BLOCK_F, DCP)
        gk = tl.where((arg == q - k) & (q >= k), g, 0.0).to(wk.dtype)
        acc += _dot(gk, wk, UPCAST, IEEE).to(ACC)
    return acc


@triton.jit
def _char_cnn_win_grad_kernel(
    w_ptr, perm_ptr, bound_ptr, out_ptr, arg_ptr, gout_ptr, gwin_ptr,
    N, F, L,
    DC: tl.constexpr, DCP: tl.constexpr, KW: tl.constexpr, BLOCK_T: tl.constexpr, BOUND_T: tl.constexpr,
    BLOCK_F: tl.constexpr, ACT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr, WHILE_LOOPS: tl.constexpr,
):
    """Deterministic mode's window gradient: gwin (N, L, DC) fp32, every element written once, by the program
    of its token, summed over the filters in block order (no atomics):

        gwin[t, q, c] = sum_f sum_{k < KW} [arg[t, f] = q - k] G[t, f] W[k·DC + c, f]

    Tokens in the forward's order (perm); ``bound`` holds the forward's per-block loop bounds (BOUND_T tokens a
    block; winners start at p <= bound, so slots q >= bound + KW get zeros)."""
    pid = tl.program_id(0)
    rt = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = rt < N
    row = tl.load(perm_ptr + rt, mask=tmask, other=0).to(tl.int64)
    c = tl.arange(0, DCP)
    cmask = c < DC
    smask = tmask[:, None] & cmask[None, :]
    slot = gwin_ptr + row[:, None] * (L * DC) + c[None, :]
    q_end = tl.minimum(tl.load(bound_ptr + (pid * BLOCK_T) // BOUND_T) + KW, L)
    zero = tl.zeros((BLOCK_T, DCP), ACC)
    if WHILE_LOOPS:  # the interpreter takes no runtime range() bounds
        q = 0
        while q < q_end:
            acc = zero
            f0 = 0
            while f0 < F:
                acc = _win_grad_block(gout_ptr, out_ptr, arg_ptr, w_ptr, row, tmask, c, cmask, q, f0, F, acc,
                                      DC, KW, BLOCK_F, ACT, UPCAST, IEEE, ACC)
                f0 += BLOCK_F
            tl.store(slot + q * DC, acc, mask=smask)
            q += 1
        while q < L:
            tl.store(slot + q * DC, zero, mask=smask)
            q += 1
    else:
        for q in range(0, q_end):
            acc = zero
            for f0 in range(0, F, BLOCK_F):
                acc = _win_grad_block(gout_ptr, out_ptr, arg_ptr, w_ptr, row, tmask, c, cmask, q, f0, F, acc,
                                      DC, KW, BLOCK_F, ACT, UPCAST, IEEE, ACC)
            tl.store(slot + q * DC, acc, mask=smask)
        for q in range(q_end, L):
            tl.store(slot + q * DC, zero, mask=smask)


@triton.jit
def _embed_grad_step(ids_ptr, gwin_ptr, rv, c, r0, stop, acc, DC: tl.constexpr, BLOCK_R: tl.constexpr,
                     ACC: tl.constexpr):
    rr = r0 + tl.arange(0, BLOCK_R)
    rmask = rr < stop
    cid = tl.load(ids_ptr + rr, mask=rmask, other=-1)
    onehot = tl.where(cid[None, :] == rv[:, None], 1.0, 0.0).to(ACC)
    d = tl.load(gwin_ptr + rr[:, None].to(tl.int64) * DC + c[None, :], mask=rmask[:, None] & (c < DC)[None, :],
                other=0.0)
    return acc + tl.dot(onehot, d, input_precision="ieee")


@triton.jit
def _embed_grad_kernel(
    ids_ptr, gwin_ptr, gemb_ptr, R, V, rows_per_prog,
    DC: tl.constexpr, DCP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
    ORDERED: tl.constexpr, WHILE_LOOPS: tl.constexpr,
):
    """gemb (V, DC) fp32 += sum over character slots r with ids[r] == v of gwin[r, :] (R = N·L slots).

    Each program owns ``rows_per_prog`` slots and ``BLOCK_V`` table rows; it reduces with one-hot products
    in registers (exact fp32 products: the one-hot factor is 0 or 1) and adds to the table once. ORDERED
    (deterministic mode): gemb (n_rblocks, V, DC) gets each slot block's partial table, stored, not added.
    """
    pid_r = tl.program_id(0)
    pid_v = tl.program_id(1)
    rv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    c = tl.arange(0, DCP)
    acc = tl.zeros((BLOCK_V, DCP), ACC)
    start = pid_r * rows_per_prog
    stop = tl.minimum(start + rows_per_prog, R)
    if WHILE_LOOPS:  # the interpreter takes no runtime range() bounds
        r0 = start
        while r0 < stop:
            acc = _embed_grad_step(ids_ptr, gwin_ptr, rv, c, r0, stop, acc, DC, BLOCK_R, ACC)
            r0 += BLOCK_R
    else:  # an scf.for: software-pipelined loads
        for r0 in range(start, stop, BLOCK_R):
            acc = _embed_grad_step(ids_ptr, gwin_ptr, rv, c, r0, stop, acc, DC, BLOCK_R, ACC)
    offs = rv[:, None] * DC + c[None, :]
    mask = (rv < V)[:, None] & (c < DC)[None, :]
    if ORDERED:  # summed in block order by the host
        tl.store(gemb_ptr + pid_r.to(tl.int64) * V * DC + offs, acc, mask=mask)
    else:
        tl.atomic_add(gemb_ptr + offs, acc, mask=mask, sem="relaxed")


# --------------------------------------------------------------------------------------------- host side


def _tiles(dtype: torch.dtype, target: Target, backward: bool) -> dict:
    """Token and filter tiles. The backward holds more live tiles (weights, their gradient, the window
    gradient) than the forward: twice the warps. fp32 takes half the filters per program (its operands are
    twice as wide) and 8 warps in the forward too: its products run on the FMA units with the (64 x 128) window
    tile in registers, which spilled with 4 warps (255 registers, 32 B a thread at sm_90a). BLOCK_T is the same
    in both: backward reuses the forward's per-block loop bounds."""
    if target.interpret:  # interpreter: small tiles, few numpy ops
        return dict(BLOCK_T=16, BLOCK_F=32, num_warps=1)
    if dtype == torch.float32:
        return dict(BLOCK_T=64, BLOCK_F=32, num_warps=8)
    return dict(BLOCK_T=64, BLOCK_F=64, num_warps=8 if backward else 4)


def _kwc(kwd: int) -> int:
    return max(16, triton.next_power_of_2(kwd))


def fwd_launch(N: int, F: int, L: int, dc: int, kwd: int, dtype: torch.dtype, target: Target, *,
               activation: str, has_pad: bool, save_arg: bool) -> Launch:
    """Launch of ``_char_cnn_fwd_kernel`` for N tokens of L characters, F filters, packed weights (kwd, F)."""
    t = _tiles(dtype, target, backward=False)
    return Launch(_char_cnn_fwd_kernel, (triton.cdiv(N, t["BLOCK_T"]), triton.cdiv(F, t["BLOCK_F"])), dict(
        DC=dc, KWD=kwd, KWC=_kwc(kwd), **t, ACT=_ACTIVATIONS[activation], HAS_PAD=has_pad, SAVE_ARG=save_arg,
        ACC=tl_acc_dtype(dtype), WHILE_LOOPS=target.interpret, **dot_flags(dtype, target)))


def bwd_launch(N: int, F: int, L: int, dc: int, kwd: int, dtype: torch.dtype, target: Target, *,
               activation: str, need_w: bool, need_emb: bool, ordered: bool = False) -> Launch:
    """Launch of ``_char_cnn_bwd_kernel`` (same tiling as the forward: its token order and ``bound``)."""
    t = _tiles(dtype, target, backward=True)
    return Launch(_char_cnn_bwd_kernel, (triton.cdiv(N, t["BLOCK_T"]), triton.cdiv(F, t["BLOCK_F"])), dict(
        DC=dc, KWD=kwd, KWC=_kwc(kwd), **t, ACT=_ACTIVATIONS[activation], NEED_W=need_w, NEED_EMB=need_emb,
        ORDERED=ordered, ACC=tl_acc_dtype(dtype), WHILE_LOOPS=target.interpret, **dot_flags(dtype, target)))


def win_grad_launch(N: int, F: int, L: int, dc: int, kwd: int, dtype: torch.dtype, target: Target, *,
                    activation: str) -> Launch:
    """Launch of ``_char_cnn_win_grad_kernel`` (deterministic mode) over the forward's token order and bounds.
    Each program owns its tokens' slots and loops over all the filters, re-reading the weights once per slot: on
    a GPU 64 tokens a program (wgmma; half the weight traffic) where that still gives every SM a program, else 32
    (fp32: always 32, 64 spills)."""
    t = _tiles(dtype, target, backward=True)
    bound_t = t["BLOCK_T"]
    if not target.interpret:
        wide = dtype != torch.float32 and triton.cdiv(N, 64) >= target.sms
        t = dict(BLOCK_T=64 if wide else 32, BLOCK_F=32, num_warps=4)
    return Launch(_char_cnn_win_grad_kernel, (triton.cdiv(N, t["BLOCK_T"]),), dict(
        DC=dc, DCP=max(16, triton.next_power_of_2(dc)), KW=kwd // dc, BOUND_T=bound_t, **t,
        ACT=_ACTIVATIONS[activation], ACC=tl_acc_dtype(dtype), WHILE_LOOPS=target.interpret,
        **dot_flags(dtype, target)))


def _embed_tiles(R: int, V: int, target: Target) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_V, slot blocks) of ``_embed_grad_kernel``."""
    if target.interpret:  # few, large numpy ops
        return 256, max(16, triton.next_power_of_2(V)), 1
    return 64, 64, min(triton.cdiv(R, 64), 128)


def embed_grad_launch(R: int, V: int, dc: int, dtype: torch.dtype, target: Target,
                      ordered: bool = False) -> tuple[Launch, int]:
    """Launch of ``_embed_grad_kernel`` over R = N·L character slots and V table rows, and its rows per program."""
    block_r, block_v, n_r = _embed_tiles(R, V, target)
    rows_per_prog = triton.cdiv(triton.cdiv(R, n_r), block_r) * block_r
    return Launch(_embed_grad_kernel, (triton.cdiv(R, rows_per_prog), triton.cdiv(V, block_v)), dict(
        DC=dc, DCP=max(16, triton.next_power_of_2(dc)), BLOCK_R=block_r, BLOCK_V=block_v,
        ACC=tl_acc_dtype(dtype), ORDERED=ordered, WHILE_LOOPS=target.interpret)), rows_per_prog


def _pack_weights(conv_weights: list[torch.Tensor], kw: int, dc: int) -> torch.Tensor:
    cols = []
    for w in conv_weights:
        wi = w.reshape(w.shape[0] * dc, w.shape[2])
        if wi.shape[0] < kw * dc:
            wi = torch.cat([wi, wi.new_zeros(kw * dc - wi.shape[0], wi.shape[1])], 0)
        cols.append(wi)
    return torch.cat(cols, 1).contiguous()


def _token_lengths(ids: torch.Tensor, has_pad: bool) -> torch.Tensor:
    """klen (N,) int32: 1 + index of the last non-padding character; 0 if all padding; -1 for all-zero rows."""
    N, L = ids.shape
    if has_pad:
        pos = torch.arange(1, L + 1, device=ids.device, dtype=torch.int32)
        klen = torch.where(ids != PAD_CHAR_ID, pos, 0).amax(dim=1).to(torch.int32)
    else:
        klen = torch.full((N,), L, device=ids.device, dtype=torch.int32)
    zero = (ids == 0).all(dim=1)
    return torch.where(zero, -1, klen).to(torch.int32)


def _embedded(ids: torch.Tensor, char_embed: torch.Tensor) -> torch.Tensor:
    """E (N, L, d_c) = char_embed[ids]: every token's characters embedded, so that a window is a contiguous run of
    E (the kernels load it as one tile instead of gathering ids, then table rows). One gather launch; an id outside
    the table is torch's index error (CPU) or device-side assert (GPU), not a silent out-of-bounds read in a
    kernel."""
    return torch.nn.functional.embedding(ids, char_embed)


def char_cnn_fwd(ids, char_embed, w_packed, bias, wid, activation: str, save_arg: bool):
    """Host launcher. Returns (out (N, F), arg (N, F) or None, perm, bound) where perm/bound order tokens."""
    N, L = ids.shape
    F = w_packed.shape[1]
    dc = char_embed.shape[1]
    kwd = w_packed.shape[0]
    has_pad = char_embed.shape[0] > PAD_CHAR_ID
    launch = fwd_launch(N, F, L, dc, kwd, char_embed.dtype, target_of(ids.device), activation=activation,
                        has_pad=has_pad, save_arg=save_arg)
    bt = launch.meta["BLOCK_T"]
    klen = _token_lengths(ids, has_pad)
    perm = torch.argsort(klen, descending=True, stable=True).to(torch.int32)
    bound = klen[perm.long()[::bt]].clamp_min(0).to(torch.int32).contiguous()
    out = torch.empty((N, F), device=ids.device, dtype=char_embed.dtype)
    arg_dtype = torch.int8 if L < 128 else torch.int32
    arg = torch.empty((N, F), device=ids.device, dtype=arg_dtype) if save_arg else out
    launch(_embedded(ids, char_embed), char_embed, w_packed, bias, wid, klen, perm, bound, out, arg, N, F, L,
           PAD_CHAR_ID)
    return out, (arg if save_arg else None), perm, bound


def char_cnn_bwd(ids, char_embed, w_packed, wid, out, arg, perm, bound, grad_out, activation: str,
                 need_w: bool, need_emb: bool):
    """Returns (grad char_embed (V, d_c) or None, grad w_packed (KWD, F) or None, grad bias (F,)).

    All in fp32 (fp64 for fp64 inputs); the caller casts them to the parameters' dtypes. Sums use fp32 atomics
    (the order of the additions varies from run to run), except in deterministic mode
    (``elmo_fast.determinism``): partial sums per block, added in block order, and the window gradient from
    ``_char_cnn_win_grad_kernel`` (one writer per element).
    """
    N, L = ids.shape
    F = w_packed.shape[1]
    V, dc = char_embed.shape
    kwd = w_packed.shape[0]
    dev = ids.device
    target = target_of(dev)
    acc = acc_dtype(char_embed.dtype)
    ordered = is_deterministic()
    new = torch.empty if ordered else torch.zeros  # ordered kernels write every element they own
    launch = bwd_launch(N, F, L, dc, kwd, char_embed.dtype, target, activation=activation, need_w=need_w,
                        need_emb=need_emb and not ordered, ordered=ordered)
    parts = launch.grid[:1] if ordered else ()
    gw = new((*parts, kwd, F) if need_w else (1,), device=dev, dtype=acc)
    gb = new((*parts, F), device=dev, dtype=acc)
    gwin = new((N, L, dc) if need_emb else (1,), device=dev, dtype=acc)
    e = _embedded(ids, char_embed) if need_w else char_embed  # the windows: only the weight gradient reads them
    launch(e, w_packed, wid, perm, bound, out, arg, grad_out, gw, gb, gwin, N, F, L)
    if ordered:
        gw, gb = (gw.sum(0) if need_w else gw), gb.sum(0)
        if need_emb:
            win_grad_launch(N, F, L, dc, kwd, char_embed.dtype, target, activation=activation)(
                w_packed, perm, bound, out, arg, grad_out, gwin, N, F, L)
    gemb = None
    if need_emb:
        R = N * L
        launch, rows_per_prog = embed_grad_launch(R, V, dc, char_embed.dtype, target, ordered=ordered)
        gemb = new((*(launch.grid[:1] if ordered else ()), V, dc), device=dev, dtype=acc)
        launch(ids, gwin, gemb, R, V, rows_per_prog)
        if ordered:
            gemb = gemb.sum(0)
    return gemb, (gw if need_w else None), gb


_WIDTHS: dict = {}


def _filter_widths(groups: tuple, like: torch.Tensor) -> torch.Tensor:
    """wid (F,) int32 on the device of ``like`` (the op's input): each filter's width, for groups ((width,
    n_filters), ...), made once per filter layout and device: ``device_constant``."""
    return device_constant(_WIDTHS, groups, lambda dev: torch.cat(
        [torch.full((n,), wi, dtype=torch.int32, device=dev) for wi, n in groups]), like)


# ------------------------------------------------------------------------------------------ operators
Tensor = torch.Tensor


def _groups(conv_weights) -> tuple:
    return tuple((int(w.shape[0]), int(w.shape[2])) for w in conv_weights)


def _forward_op(char_ids: Tensor, char_embed: Tensor, conv_weights: list[Tensor], conv_biases: list[Tensor],
                activation: str, save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out (N, F), w_packed, arg, perm, bound): with ``save`` what backward needs besides the inputs (the packed
    weights, the argmax (int8), the token order), else placeholders. Never the convolution maps."""
    ids = char_ids.contiguous()
    emb = char_embed.contiguous()
    dtype = emb.dtype
    groups = _groups(conv_weights)
    w_packed = _pack_weights([w.to(dtype) for w in conv_weights], max(g[0] for g in groups), emb.shape[1])
    bias = torch.cat([b.to(dtype) for b in conv_biases]).contiguous()
    wid = _filter_widths(groups, ids)
    out, arg, perm, bound = char_cnn_fwd(ids, emb, w_packed, bias, wid, activation, save_arg=save)
    if not save:
        return out, *(nothing(out) for _ in range(4))
    return out, w_packed, arg, perm, bound


def _backward_op(char_ids: Tensor, char_embed: Tensor, w_packed: Tensor, out: Tensor, arg: Tensor, perm: Tensor,
                 bound: Tensor, grad_out: Tensor, groups: list[int], activation: str, need_w: bool, need_emb: bool
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """(grad char_embed (V, d_c), grad w_packed (KWD, F), grad bias (F,)) in fp32 (fp64 for fp64 inputs); the
    first two are placeholders unless needed. ``groups``: (width, n_filters) of each filter group, flattened."""
    wid = _filter_widths(tuple(zip(groups[::2], groups[1::2])), char_ids)
    gemb, gw, gb = char_cnn_bwd(char_ids.contiguous(), char_embed.contiguous(), w_packed, wid, out, arg, perm, bound,
                                grad_out.contiguous(), activation, need_w, need_emb)
    return (nothing(gb) if gemb is None else gemb), (nothing(gb) if gw is None else gw), gb


_char_cnn_op = triton_operator("char_cnn_triton", _forward_op)
_char_cnn_backward_op = triton_operator("char_cnn_triton_backward", _backward_op)


def _setup_context(ctx, inputs, output):
    char_ids, char_embed, conv_weights, conv_biases, activation, save = inputs
    ctx.saved = save
    ctx.activation = activation
    ctx.groups = [v for g in _groups(conv_weights) for v in g]
    ctx.dtypes = [(w.dtype, b.dtype) for w, b in zip(conv_weights, conv_biases)]
    if save:
        ctx.save_for_backward(char_ids, char_embed, output[0], *output[1:])


def _backward(ctx, grad_out, *_):
    if not ctx.saved:
        raise RuntimeError("char_cnn (triton): this call ran without save=True and kept nothing for backward")
    ids, emb, out, w_packed, arg, perm, bound = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_emb, need_w = need[1], any(need[2])
    gemb, gw, gb = _char_cnn_backward_op(ids, emb, w_packed, out, arg, perm, bound, grad_out, ctx.groups,
                                         ctx.activation, need_w, need_emb)
    dc = emb.shape[1]
    gws, gbs = [], []
    col = 0
    for i, ((w_i, n_i), (wdt, bdt)) in enumerate(zip(zip(ctx.groups[::2], ctx.groups[1::2]), ctx.dtypes)):
        gws.append(gw[: w_i * dc, col:col + n_i].reshape(w_i, dc, n_i).to(wdt) if need[2][i] else None)
        gbs.append(gb[col:col + n_i].to(bdt) if need[3][i] else None)
        col += n_i
    return None, gemb.to(emb.dtype) if need_emb else None, gws, gbs, None, None


_char_cnn_op.register_autograd(_backward, setup_context=_setup_context)


def char_cnn_triton(
    char_ids: torch.Tensor,
    char_embed: torch.Tensor,
    conv_weights: list[torch.Tensor],
    conv_biases: list[torch.Tensor],
    activation: str = "relu",
) -> torch.Tensor:
    """char_ids (N, L) int inference ids -> (N, F) = act(max_p conv(embed(ids)) + bias), fused (see module doc).

    char_embed (n_chars, d_c) with the zero row 0; conv_weights[i] (w_i, d_c, n_i); conv_biases[i] (n_i,).
    Output dtype = char_embed's (fp32, bf16, fp16; fp64 under the interpreter only); products accumulate in
    fp32. The operator ``elmo_fast::char_cnn_triton``, its backward ``elmo_fast::char_cnn_triton_backward``.
    """
    _activation(activation)  # validates the name (ValueError), like the reference
    if char_embed.dtype == torch.float64 and not target_of(char_embed.device).interpret:
        # Triton 3.6 cannot compile the backward's fp64 products for a GPU ("fp64 don't support largeK MMA")
        raise TypeError("the Triton char-CNN kernels take fp32/bf16/fp16 on a GPU (fp64 runs only under the "
                        "interpreter, for tests); use backend='reference' for fp64")
    N, L = char_ids.shape
    F = sum(int(b.shape[0]) for b in conv_biases)
    for w in conv_weights:
        if int(w.shape[0]) > L:
            raise ValueError(f"tokens of {L} characters are shorter than a filter of width {int(w.shape[0])}")
    if N == 0:
        return char_embed.new_zeros(0, F)
    params = (char_embed, *conv_weights, *conv_biases)
    save = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    return _char_cnn_op(char_ids, char_embed, list(conv_weights), list(conv_biases), activation, save)[0]
