"""Fused LSTMP chain (one layer, one direction) in Triton: forward and backward through time.

The math is ``elmo_fast.reference.lstmp.lstmp_reference`` (spec §3.2-§3.5); that function is the oracle.
Shapes: B batch, T padded steps, D input width, H cell, P projection (= hidden), G = 4H gate width.

Design (and why)
----------------
*Work split.* Per time step the LSTMP needs two all-to-all exchanges: every gate column needs all of
``h_{t-1}`` (K = P) and every projected output needs all of ``m_t`` (K = H). We run **two kernels per step**:

1. ``_fwd_cell_kernel``, grid (B/BB, H/BH): recurrent product ``h_{t-1} · w_rec`` for the four gate tiles of
   one H-slice, gates, cell update + clip, ``m = σ(o) tanh(c)``; writes ``m_t`` to global memory.
2. ``_fwd_proj_kernel``, grid (B/BB, P/BP): ``m_t · w_proj`` + clip, masking of finished rows, output ``y``.

The kernel boundary is the grid-wide barrier between the two exchanges. We did not write a persistent
kernel that loops over time inside one launch because that needs a grid-wide barrier inside the kernel
(spin on a global counter). That cannot be checked on CPU: ``TRITON_INTERPRET=1`` runs programs one after
another, so a spin barrier deadlocks, and CI could then never test the kernel. The other persistent design,
one program owning whole batch rows and walking all of H and P itself, is checkable but puts one SM per 16
rows on the whole 20 MiB weight stream every step (1 busy SM at batch 1). Two launches per step spread every
step over (B/BB)·(H/BH) programs. At T=20 that is 40 launches forward and 40 backward (a few µs each, and
CUDA-graph friendly). The weights-on-chip persistent kernel for small batches (performance.md) belongs in
the CUDA backend, where cluster barriers exist.

*Input projection* of all steps is one matmul (``x · w_in``) before the time loop (cuBLAS). The bias and the
forget bias are added in the kernel in fp32.

*Padding and direction.* At step ``s`` row ``b`` is active iff ``s < len_b``. Its time position is ``s``
(forward) or ``len_b - 1 - s`` (reverse, each row reversed within its own length). An inactive row at step
``s`` sits on a padded position (``s >= len_b``), so writing zeros there writes each padded position exactly
once. Every element of ``y`` and of the zero-padded work buffers is therefore written by a kernel;
positions at or beyond ``max(len)`` (no kernel step reaches them) are zero-filled on the host. Inactive rows
keep their state, so empty rows return h0/c0.

*What forward saves for backward.* In fp32 (fp64 for fp64 inputs), per token: the four gate activations
(σ(i), tanh(j), σ(f+fb), σ(o)), the **pre-clip** cell ``c_t``, the pre-clip projection ``h_t`` and the
state ``h_{t-1}`` that fed the step, plus ``m_t`` (in the operand dtype; forward has to write it anyway for
the projection exchange). Pre-clip values make the clip masks exact (torch.clamp's convention: gradient 1
on [-clip, clip] inclusive, 0 outside), which clipped values cannot give at the boundary. Saving the
activations instead of recomputing them avoids a second recurrent product over all steps in backward
(16.8 MFLOP/token at ELMo size, ~30% of backward's math), at 6H+2P floats per token (~0.75 GB per chain at
384x20 tokens, H=4096): affordable on an 80 GB GPU, and the recompute would also need that memory for
``z``. In inference (no grad needed) the caches are not written at all.

*Backward* mirrors forward, two kernels per step, walking the steps in reverse:

1. ``_bwd_cell_kernel``, grid (B/BB, H/BH): ``dh_t = dy_t + dh_carry`` masked by the projection-clip mask,
   ``dm = dh · w_projᵀ``, then the gate/cell chain rule with the cell-clip mask; writes ``dz_t`` (zeros for
   inactive rows) and updates the cell-gradient carry in place.
2. ``_bwd_rec_kernel``, grid (B/BB, P/BP): ``dh_{t-1} = dz_t · w_recᵀ`` for active rows (inactive rows pass
   the carry through unchanged).

Weight gradients are large matmuls after the loop over all B·T tokens:
``dW_in = xᵀ dz``, ``dW_rec = h_prevᵀ dz``, ``db = Σ dz``, ``dW_proj = mᵀ dh_pre``, ``dx = dz · W_inᵀ`` (+ dy
for the residual).

*Specialisation.* H and P are ``constexpr``: they bound the K loops, and the model's sizes never change
between calls, so compiling per (H, P) is free. (It is also required under the interpreter: it keeps scalar
arguments as 1-element numpy arrays, which recent numpy refuses as ``range`` bounds.) B, T and the step index
are runtime arguments (``do_not_specialize`` on the step) so a new batch shape never recompiles.

*Precision.* The operands of every product are in the weights' dtype (bf16/fp16/fp32/fp64). Accumulation,
gates, the cell state and the h state are fp32 (fp64 for fp64 inputs). fp32 products use
``input_precision="ieee"`` (no TF32), so fp32 results match the reference to rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from elmo_fast.kernels._common import Launch, Target, acc_dtype, target_of, tl_acc_dtype
from elmo_fast.reference.lstmp import lstmp_reference

__all__ = ["lstmp_triton", "lstmp_fwd", "lstmp_bwd", "LSTMPFunction"]


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # exp of a non-positive argument never overflows; absolute error ~1 ulp of 1.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _mma(a, b, acc, prec: tl.constexpr, ACC: tl.constexpr, EMU: tl.constexpr):
    """acc + a·b. EMU: the CPU interpreter multiplies bf16 tiles as raw uint16 bits, so there we widen the
    bf16 operands to fp32 first, which is the same math (bf16 products are exact in fp32, fp32 accumulate)."""
    if EMU:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=ACC)
    return tl.dot(a, b, acc, input_precision=prec, out_dtype=ACC)


@triton.jit
def _clamp(x, clip):
    return tl.minimum(tl.maximum(x, -clip), clip)


@triton.jit
def _in_clip(x, clip):
    # torch.clamp's backward: gradient passes where min <= x <= max (inclusive).
    return (x >= -clip) & (x <= clip)


@triton.jit
def _gate_input(gx_ptr, bias_ptr, tok, rh, g: tl.constexpr, vm, hmask, H: tl.constexpr, ACC: tl.constexpr):
    """Hoisted input projection of gate block g (i|j|f|o) at this step, plus its bias, in ACC."""
    col = g * H + rh
    gx = tl.load(gx_ptr + tok[:, None] * (4 * H) + col[None, :], mask=vm, other=0.0).to(ACC)
    return gx + tl.load(bias_ptr + col, mask=hmask, other=0.0).to(ACC)[None, :]


@triton.jit
def _rows(len_ptr, s, B, T, BB: tl.constexpr, REVERSE: tl.constexpr):
    """Rows of this program, their activity at step s, and the flat token index (b*T + pos) they touch."""
    rb = tl.program_id(0) * BB + tl.arange(0, BB)
    rmask = rb < B
    L = tl.load(len_ptr + rb, mask=rmask, other=0).to(tl.int32)
    valid = (s < L) & rmask
    if REVERSE:
        pos = tl.where(valid, L - 1 - s, s)
        prev = pos + 1
    else:
        pos = tl.zeros([BB], tl.int32) + s
        prev = pos - 1
    tok = rb.to(tl.int64) * T + pos
    ptok = rb.to(tl.int64) * T + prev
    return rb, rmask, valid, tok, ptok


@triton.jit(do_not_specialize=["s"])
def _fwd_cell_kernel(
    gx_ptr, bias_ptr, w_rec_ptr, h_ptr, c_ptr, len_ptr,
    m_ptr, gates_ptr, cpre_ptr,
    s, B, T, H: tl.constexpr, P: tl.constexpr, consts_ptr,
    HAS_CELL_CLIP: tl.constexpr, REVERSE: tl.constexpr, SAVE: tl.constexpr,
    ACC: tl.constexpr, IEEE: tl.constexpr, EMU: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
):
    """Gates, cell and m for one (row block, H slice) at step s. State buffers h (B,P), c (B,H) are ACC."""
    forget_bias = tl.load(consts_ptr)
    cell_clip = tl.load(consts_ptr + 1)
    rb, rmask, valid, tok, ptok = _rows(len_ptr, s, B, T, BB, REVERSE)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = rh < H
    G = 4 * H
    wdt = w_rec_ptr.dtype.element_ty
    prec: tl.constexpr = "ieee" if IEEE else None

    acc_i = tl.zeros([BB, BH], ACC)
    acc_j = tl.zeros([BB, BH], ACC)
    acc_f = tl.zeros([BB, BH], ACC)
    acc_o = tl.zeros([BB, BH], ACC)
    # Rows that are inactive still run the product (masked to zero); their results are discarded.
    for k0 in range(0, P, BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < P
        hp = tl.load(h_ptr + rb[:, None] * P + rk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        hp = hp.to(wdt)
        wp = w_rec_ptr + rk[:, None].to(tl.int64) * G + rh[None, :]
        wm = kmask[:, None] & hmask[None, :]
        acc_i = _mma(hp, tl.load(wp, mask=wm, other=0.0), acc_i, prec, ACC, EMU)
        acc_j = _mma(hp, tl.load(wp + H, mask=wm, other=0.0), acc_j, prec, ACC, EMU)
        acc_f = _mma(hp, tl.load(wp + 2 * H, mask=wm, other=0.0), acc_f, prec, ACC, EMU)
        acc_o = _mma(hp, tl.load(wp + 3 * H, mask=wm, other=0.0), acc_o, prec, ACC, EMU)

    vm = valid[:, None] & hmask[None, :]
    zi = acc_i + _gate_input(gx_ptr, bias_ptr, tok, rh, 0, vm, hmask, H, ACC)
    zj = acc_j + _gate_input(gx_ptr, bias_ptr, tok, rh, 1, vm, hmask, H, ACC)
    zf = acc_f + _gate_input(gx_ptr, bias_ptr, tok, rh, 2, vm, hmask, H, ACC)
    zo = acc_o + _gate_input(gx_ptr, bias_ptr, tok, rh, 3, vm, hmask, H, ACC)
    gi = _sigmoid(zi)
    gj = _tanh(zj)
    gf = _sigmoid(zf + forget_bias)
    go = _sigmoid(zo)

    cptr = c_ptr + rb[:, None] * H + rh[None, :]
    c_prev = tl.load(cptr, mask=vm, other=0.0)
    c_new = gf * c_prev + gi * gj
    cc = c_new
    if HAS_CELL_CLIP:
        cc = _clamp(c_new, cell_clip)
    tl.store(cptr, cc, mask=vm)
    m = go * _tanh(cc)
    # m is zero at inactive rows: that fills the padded positions of the m buffer.
    am = rmask[:, None] & hmask[None, :]
    tl.store(m_ptr + tok[:, None] * H + rh[None, :], tl.where(vm, m, 0.0).to(m_ptr.dtype.element_ty), mask=am)
    if SAVE:
        sp = gates_ptr + tok[:, None] * G + rh[None, :]
        tl.store(sp, gi, mask=vm)
        tl.store(sp + H, gj, mask=vm)
        tl.store(sp + 2 * H, gf, mask=vm)
        tl.store(sp + 3 * H, go, mask=vm)
        tl.store(cpre_ptr + tok[:, None] * H + rh[None, :], c_new, mask=vm)


@triton.jit(do_not_specialize=["s"])
def _fwd_proj_kernel(
    m_ptr, w_proj_ptr, x_ptr, h_ptr, len_ptr,
    y_ptr, hpre_ptr, hprev_ptr,
    s, B, T, H: tl.constexpr, P: tl.constexpr, consts_ptr,
    HAS_PROJ: tl.constexpr, HAS_PROJ_CLIP: tl.constexpr, RESIDUAL: tl.constexpr, REVERSE: tl.constexpr,
    SAVE: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr, EMU: tl.constexpr,
    BB: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr,
):
    """h_t = clip(m_t · w_proj) for one (row block, P slice); updates the h state and writes y at step s."""
    proj_clip = tl.load(consts_ptr + 2)
    rb, rmask, valid, tok, ptok = _rows(len_ptr, s, B, T, BB, REVERSE)
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    pmask = rp < P
    prec: tl.constexpr = "ieee" if IEEE else None
    vm = valid[:, None] & pmask[None, :]
    am = rmask[:, None] & pmask[None, :]

    if HAS_PROJ:
        acc = tl.zeros([BB, BP], ACC)
        for k0 in range(0, H, BK):
            rk = k0 + tl.arange(0, BK)
            kmask = rk < H
            mt = tl.load(m_ptr + tok[:, None] * H + rk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            wt = tl.load(w_proj_ptr + rk[:, None].to(tl.int64) * P + rp[None, :],
                         mask=kmask[:, None] & pmask[None, :], other=0.0)
            acc = _mma(mt.to(wt.dtype), wt, acc, prec, ACC, EMU)
    else:  # P == H: the state is m itself
        acc = tl.load(m_ptr + tok[:, None] * H + rp[None, :], mask=vm, other=0.0).to(ACC)

    hptr = h_ptr + rb[:, None] * P + rp[None, :]
    h_old = tl.load(hptr, mask=am, other=0.0)
    h_new = acc
    if HAS_PROJ_CLIP:
        h_new = _clamp(acc, proj_clip)
    tl.store(hptr, h_new, mask=vm)
    out = h_new
    if RESIDUAL:  # D == P
        out = out + tl.load(x_ptr + tok[:, None] * P + rp[None, :], mask=vm, other=0.0).to(ACC)
    tl.store(y_ptr + tok[:, None] * P + rp[None, :], tl.where(vm, out, 0.0).to(y_ptr.dtype.element_ty), mask=am)
    if SAVE:
        tl.store(hpre_ptr + tok[:, None] * P + rp[None, :], acc, mask=vm)
        # zeros at padded positions: this buffer feeds dW_rec as a matmul over all tokens.
        tl.store(hprev_ptr + tok[:, None] * P + rp[None, :], tl.where(vm, h_old, 0.0), mask=am)


@triton.jit(do_not_specialize=["s"])
def _bwd_cell_kernel(
    dy_ptr, dh_ptr, dc_ptr, w_proj_ptr, hpre_ptr, gates_ptr, cpre_ptr, c0_ptr, len_ptr,
    dz_ptr, dhpre_ptr,
    s, B, T, H: tl.constexpr, P: tl.constexpr, consts_ptr,
    HAS_PROJ: tl.constexpr, HAS_CELL_CLIP: tl.constexpr, HAS_PROJ_CLIP: tl.constexpr, REVERSE: tl.constexpr,
    ACC: tl.constexpr, IEEE: tl.constexpr, EMU: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
):
    """Backward of gates and cell for one (row block, H slice) at step s.

    dh (B,P) holds dL/dh_t (state, from later steps and h_n); dc (B,H) holds dL/dc_t (post-clip) and is
    updated in place to dL/dc_{t-1}. Writes dz_t (B,T,4H), zero for inactive rows, and (H slice 0 only)
    the masked dL/dh_pre_t (B,T,P) for dW_proj.
    """
    cell_clip = tl.load(consts_ptr + 1)
    proj_clip = tl.load(consts_ptr + 2)
    rb, rmask, valid, tok, ptok = _rows(len_ptr, s, B, T, BB, REVERSE)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = rh < H
    G = 4 * H
    prec: tl.constexpr = "ieee" if IEEE else None
    vm = valid[:, None] & hmask[None, :]
    am = rmask[:, None] & hmask[None, :]

    if HAS_PROJ:
        dm = tl.zeros([BB, BH], ACC)
        first_slice = tl.program_id(1) == 0
        for k0 in range(0, P, BK):
            rk = k0 + tl.arange(0, BK)
            kmask = rk < P
            vk = valid[:, None] & kmask[None, :]
            dht = tl.load(dh_ptr + rb[:, None] * P + rk[None, :], mask=vk, other=0.0)
            dht += tl.load(dy_ptr + tok[:, None] * P + rk[None, :], mask=vk, other=0.0).to(ACC)
            if HAS_PROJ_CLIP:
                hp = tl.load(hpre_ptr + tok[:, None] * P + rk[None, :], mask=vk, other=0.0)
                dht = tl.where(_in_clip(hp, proj_clip), dht, 0.0)
            tl.store(dhpre_ptr + tok[:, None] * P + rk[None, :], dht,
                     mask=rmask[:, None] & kmask[None, :] & first_slice)
            # (w_proj)ᵀ tile: element [k, h] = w_proj[h, k]
            wt = tl.load(w_proj_ptr + rh[None, :].to(tl.int64) * P + rk[:, None],
                         mask=kmask[:, None] & hmask[None, :], other=0.0)
            dm = _mma(dht.to(wt.dtype), wt, dm, prec, ACC, EMU)
    else:  # h_t = m_t (P == H)
        dm = tl.load(dh_ptr + rb[:, None] * P + rh[None, :], mask=vm, other=0.0)
        dm += tl.load(dy_ptr + tok[:, None] * P + rh[None, :], mask=vm, other=0.0).to(ACC)

    gp = gates_ptr + tok[:, None] * G + rh[None, :]
    gi = tl.load(gp, mask=vm, other=0.0)
    gj = tl.load(gp + H, mask=vm, other=0.0)
    gf = tl.load(gp + 2 * H, mask=vm, other=0.0)
    go = tl.load(gp + 3 * H, mask=vm, other=0.0)
    cpre = tl.load(cpre_ptr + tok[:, None] * H + rh[None, :], mask=vm, other=0.0)
    # c_{t-1}: the (clipped) cell of the previous step of this row, or c0 at the row's first step.
    cp = tl.load(cpre_ptr + ptok[:, None] * H + rh[None, :], mask=vm & (s > 0), other=0.0)
    cc = cpre
    if HAS_CELL_CLIP:
        cp = _clamp(cp, cell_clip)
        cc = _clamp(cpre, cell_clip)
    c0 = tl.load(c0_ptr + rb[:, None] * H + rh[None, :], mask=vm & (s == 0), other=0.0).to(ACC)
    c_prev = tl.where(s > 0, cp, c0)

    tc = _tanh(cc)
    dcptr = dc_ptr + rb[:, None] * H + rh[None, :]
    dc = tl.load(dcptr, mask=vm, other=0.0) + dm * go * (1.0 - tc * tc)
    if HAS_CELL_CLIP:
        dc = tl.where(_in_clip(cpre, cell_clip), dc, 0.0)
    d_i = dc * gj * gi * (1.0 - gi)
    d_j = dc * gi * (1.0 - gj * gj)
    d_f = dc * c_prev * gf * (1.0 - gf)
    d_o = dm * tc * go * (1.0 - go)
    tl.store(dcptr, dc * gf, mask=vm)
    zp = dz_ptr + tok[:, None] * G + rh[None, :]
    tl.store(zp, tl.where(vm, d_i, 0.0), mask=am)
    tl.store(zp + H, tl.where(vm, d_j, 0.0), mask=am)
    tl.store(zp + 2 * H, tl.where(vm, d_f, 0.0), mask=am)
    tl.store(zp + 3 * H, tl.where(vm, d_o, 0.0), mask=am)


@triton.jit(do_not_specialize=["s"])
def _bwd_rec_kernel(
    dz_ptr, w_rec_ptr, dh_ptr, len_ptr,
    s, B, T, H: tl.constexpr, P: tl.constexpr,
    REVERSE: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr, EMU: tl.constexpr,
    BB: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr,
):
    """dL/dh_{t-1} = dz_t · w_recᵀ for active rows (in place into dh (B,P)); inactive rows keep the carry."""
    rb, rmask, valid, tok, ptok = _rows(len_ptr, s, B, T, BB, REVERSE)
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    pmask = rp < P
    G = 4 * H
    prec: tl.constexpr = "ieee" if IEEE else None
    wdt = w_rec_ptr.dtype.element_ty
    acc = tl.zeros([BB, BP], ACC)
    for g in tl.static_range(4):
        for k0 in range(0, H, BK):
            rk = k0 + tl.arange(0, BK)
            kmask = rk < H
            dzt = tl.load(dz_ptr + tok[:, None] * G + g * H + rk[None, :],
                          mask=valid[:, None] & kmask[None, :], other=0.0)
            # (w_rec)ᵀ tile: element [k, p] = w_rec[p, g*H + k]
            wt = tl.load(w_rec_ptr + rp[None, :].to(tl.int64) * G + g * H + rk[:, None],
                         mask=kmask[:, None] & pmask[None, :], other=0.0)
            acc = _mma(dzt.to(wdt), wt, acc, prec, ACC, EMU)
    tl.store(dh_ptr + rb[:, None] * P + rp[None, :], acc, mask=valid[:, None] & pmask[None, :])


# ------------------------------------------------------------------------------------------ host side
def _pow2(n: int, lo: int = 16, hi: int = 64) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def _consts(forget_bias, cell_clip, proj_clip, acc, dev) -> torch.Tensor:
    # Scalars go through memory in the accumulation dtype: a float kernel argument is fp32, which would
    # round e.g. a clip of 0.3 and break fp64 agreement.
    vals = [forget_bias, 0.0 if cell_clip is None else cell_clip, 0.0 if proj_clip is None else proj_clip]
    return torch.tensor([float(v) for v in vals], dtype=acc, device=dev)


def _blocks(B: int, H: int, P: int) -> tuple[int, int, int]:
    # tl.dot needs every block dim >= 16. BB covers small batches in one block; H/P slices of 64.
    return _pow2(B), _pow2(H), _pow2(P)


def fwd_launches(B: int, H: int, P: int, dtype: torch.dtype, acc: torch.dtype, target: Target, *,
                 has_cell_clip: bool, has_proj: bool, has_proj_clip: bool, reverse: bool, residual: bool,
                 save: bool) -> tuple[Launch, Launch]:
    """The two launches of one forward step (cell, projection); weights in ``dtype``, state in ``acc``."""
    BB, BH, BP = _blocks(B, H, P)
    common = dict(REVERSE=bool(reverse), SAVE=save, ACC=tl_acc_dtype(acc),
                  IEEE=dtype in (torch.float32, torch.float64), EMU=dtype == torch.bfloat16 and target.interpret, BB=BB)
    cell = Launch(_fwd_cell_kernel, (triton.cdiv(B, BB), triton.cdiv(H, BH)),
                  dict(HAS_CELL_CLIP=has_cell_clip, **common, BH=BH, BK=_pow2(P)))
    proj = Launch(_fwd_proj_kernel, (triton.cdiv(B, BB), triton.cdiv(P, BP)),
                  dict(HAS_PROJ=has_proj, HAS_PROJ_CLIP=has_proj_clip, RESIDUAL=bool(residual), **common, BP=BP,
                       BK=_pow2(H)))
    return cell, proj


def bwd_launches(B: int, H: int, P: int, dtype: torch.dtype, acc: torch.dtype, target: Target, *,
                 has_cell_clip: bool, has_proj: bool, has_proj_clip: bool, reverse: bool) -> tuple[Launch, Launch]:
    """The two launches of one backward step (cell, recurrent product)."""
    BB, BH, BP = _blocks(B, H, P)
    common = dict(REVERSE=bool(reverse), ACC=tl_acc_dtype(acc), IEEE=dtype in (torch.float32, torch.float64),
                  EMU=dtype == torch.bfloat16 and target.interpret, BB=BB)
    cell = Launch(_bwd_cell_kernel, (triton.cdiv(B, BB), triton.cdiv(H, BH)),
                  dict(HAS_PROJ=has_proj, HAS_CELL_CLIP=has_cell_clip, HAS_PROJ_CLIP=has_proj_clip, **common,
                       BH=BH, BK=_pow2(P)))
    rec = Launch(_bwd_rec_kernel, (triton.cdiv(B, BB), triton.cdiv(P, BP)), dict(**common, BP=BP, BK=_pow2(H)))
    return cell, rec


def lstmp_fwd(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, *, cell_clip, proj_clip, forget_bias, reverse,
              residual, save: bool):
    """Host launcher of the forward pass. Returns (y, h_n, c_n, cache) where cache is None unless ``save``."""
    B, T, D = x.shape
    G = w_in.shape[1]
    H = G // 4
    P = h0.shape[1]
    dev = x.device
    acc = acc_dtype(x.dtype)
    len_i = lengths.to(device=dev, dtype=torch.int32).contiguous()
    T_run = int(len_i.max()) if B else 0  # steps beyond the longest row only produce zeros

    # Hoisted input projection of every step: one GEMM in the operand dtype (fp32 accumulation inside).
    gx = torch.matmul(x[:, :T_run].reshape(-1, D), w_in).reshape(B, T_run, G)
    if T_run < T:
        gx = torch.cat([gx, gx.new_zeros(B, T - T_run, G)], 1) if T_run else gx.new_zeros(B, T, G)
    gx = gx.contiguous()

    h = h0.to(acc).contiguous().clone()
    c = c0.to(acc).contiguous().clone()
    y = torch.empty(B, T, P, dtype=x.dtype, device=dev)
    m = torch.empty(B, T, H, dtype=w_rec.dtype, device=dev)
    if save:
        gates = torch.empty(B, T, G, dtype=acc, device=dev)
        cpre = torch.empty(B, T, H, dtype=acc, device=dev)
        hpre = torch.empty(B, T, P, dtype=acc, device=dev)
        hprev = torch.empty(B, T, P, dtype=acc, device=dev)
    else:
        gates = cpre = hpre = hprev = m  # never touched (SAVE=False)
    if T_run < T:
        y[:, T_run:].zero_()
        m[:, T_run:].zero_()

    has_proj = w_proj is not None
    wp = w_proj if has_proj else w_rec  # dummy pointer when there is no projection
    cell, proj = fwd_launches(B, H, P, w_rec.dtype, acc, target_of(dev), has_cell_clip=cell_clip is not None,
                              has_proj=has_proj, has_proj_clip=has_proj and proj_clip is not None, reverse=reverse,
                              residual=residual, save=save)
    consts = _consts(forget_bias, cell_clip, proj_clip, acc, dev)
    for s in range(T_run):
        cell(gx, bias, w_rec, h, c, len_i, m, gates, cpre, s, B, T, H, P, consts)
        proj(m, wp, x, h, len_i, y, hpre, hprev, s, B, T, H, P, consts)
    cache = (gates, cpre, hpre, hprev, m, len_i, T_run) if save else None
    return y, h.to(h0.dtype), c.to(c0.dtype), cache


def lstmp_bwd(dy, dh_n, dc_n, x, w_in, w_rec, w_proj, c0, cache, *, cell_clip, proj_clip, reverse, residual,
              needs=(True,) * 5):
    """Host launcher of backward through time. Returns (dx, dw_in, dw_rec, dbias, dw_proj, dh0, dc0).

    ``needs`` flags (x, w_in, w_rec, bias, w_proj): the after-loop GEMM of a gradient nobody needs is skipped
    (None returned); the time loop itself always runs, every gradient depends on it.
    """
    gates, cpre, hpre, hprev, m, len_i, T_run = cache
    B, T, D = x.shape
    G = w_in.shape[1]
    H = G // 4
    P = hprev.shape[2]
    dev = x.device
    acc = gates.dtype
    has_proj = w_proj is not None

    dy = dy.contiguous()
    dh = dh_n.to(acc).contiguous().clone()
    dc = dc_n.to(acc).contiguous().clone()
    # Work buffers share the caches' (b, t) indexing (row stride T); only t < T_run is ever written or read.
    dz = torch.empty(B, T, G, dtype=acc, device=dev)
    dhpre = torch.empty(B, T, P, dtype=acc, device=dev) if has_proj else dz
    c0 = c0.contiguous()

    wp = w_proj if has_proj else w_rec
    cell, rec = bwd_launches(B, H, P, w_rec.dtype, acc, target_of(dev), has_cell_clip=cell_clip is not None,
                             has_proj=has_proj, has_proj_clip=has_proj and proj_clip is not None, reverse=reverse)
    consts = _consts(0.0, cell_clip, proj_clip, acc, dev)
    for s in range(T_run - 1, -1, -1):
        cell(dy, dh, dc, wp, hpre, gates, cpre, c0, len_i, dz, dhpre, s, B, T, H, P, consts)
        rec(dz, w_rec, dh, len_i, s, B, T, H, P)
    dz = dz[:, :T_run]
    dhpre = dhpre[:, :T_run] if has_proj else None

    # Weight gradients: one GEMM each over all B*T_run tokens, operands in the weights' dtype.
    cdt = w_rec.dtype
    dz2 = dz.reshape(-1, G)
    dz2c = dz2.to(cdt)
    dx = dw_in = dw_rec = dbias = dw_proj = None
    if needs[1]:
        dw_in = torch.matmul(x[:, :T_run].reshape(-1, D).to(cdt).t(), dz2c)
    if needs[2]:
        dw_rec = torch.matmul(hprev[:, :T_run].reshape(-1, P).to(cdt).t(), dz2c)
    if needs[3]:
        dbias = dz2.sum(0)
    if has_proj and needs[4]:
        dw_proj = torch.matmul(m[:, :T_run].reshape(-1, H).t(), dhpre.reshape(-1, P).to(cdt))
    if needs[0]:
        dx = torch.zeros(B, T, D, dtype=x.dtype, device=dev)
        if T_run:
            dxr = torch.matmul(dz2c, w_in.t()).reshape(B, T_run, D)
            if residual:
                steps = torch.arange(T_run, device=dev)
                valid = (steps[None, :] < len_i[:, None].long()).unsqueeze(-1)
                dxr = dxr + torch.where(valid, dy[:, :T_run], torch.zeros((), dtype=dy.dtype, device=dev))
            dx[:, :T_run] = dxr
    return dx, dw_in, dw_rec, dbias, dw_proj, dh, dc


# -------------------------------------------------------------------------------------- autograd glue
class LSTMPFunction(torch.autograd.Function):
    """Autograd wrapper: forward saves the fp32 step caches (see the module docstring), backward runs BPTT."""

    @staticmethod
    def forward(ctx, x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip, forget_bias, reverse,
                residual):
        y, h_n, c_n, cache = lstmp_fwd(
            x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=cell_clip, proj_clip=proj_clip,
            forget_bias=forget_bias, reverse=reverse, residual=residual, save=True,
        )
        gates, cpre, hpre, hprev, m, len_i, T_run = cache
        ctx.save_for_backward(x, w_in, w_rec, w_proj, h0, c0, gates, cpre, hpre, hprev, m, len_i)
        ctx.T_run = T_run
        ctx.flags = dict(cell_clip=cell_clip, proj_clip=proj_clip, reverse=reverse, residual=residual)
        ctx.bias_dtype = bias.dtype
        return y, h_n, c_n

    @staticmethod
    @once_differentiable  # backward is not itself differentiable: double backward raises instead of lying
    def backward(ctx, dy, dh_n, dc_n):
        x, w_in, w_rec, w_proj, h0, c0, gates, cpre, hpre, hprev, m, len_i = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros(x.shape[0], x.shape[1], h0.shape[1], dtype=x.dtype, device=x.device)
        if dh_n is None:
            dh_n = torch.zeros_like(h0)
        if dc_n is None:
            dc_n = torch.zeros_like(c0)
        cache = (gates, cpre, hpre, hprev, m, len_i, ctx.T_run)
        dx, dw_in, dw_rec, dbias, dw_proj, dh0, dc0 = lstmp_bwd(
            dy, dh_n, dc_n, x, w_in, w_rec, w_proj, c0, cache, needs=ctx.needs_input_grad[:5], **ctx.flags,
        )

        def cast(i, g, dtype):
            return g.to(dtype) if ctx.needs_input_grad[i] and g is not None else None

        return (
            cast(0, dx, x.dtype),
            cast(1, dw_in, w_in.dtype),
            cast(2, dw_rec, w_rec.dtype),
            cast(3, dbias, ctx.bias_dtype),
            cast(4, dw_proj, w_proj.dtype if w_proj is not None else None),
            cast(5, dh0, h0.dtype),
            cast(6, dc0, c0.dtype),
            None, None, None, None, None, None,
        )


def lstmp_triton(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, *, cell_clip=None, proj_clip=None,
                 forget_bias=1.0, reverse=False, residual=False):
    """Triton LSTMP chain with the arguments and results of ``lstmp_reference`` (see there for shapes).

    Differentiable w.r.t. x, w_in, w_rec, bias, w_proj, h0 and c0. Inference (no grad needed) skips the
    backward caches.
    """
    B, T, _ = x.shape
    if B == 0 or T == 0:  # nothing for a kernel to do; the reference handles the degenerate shapes
        return lstmp_reference(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=cell_clip,
                               proj_clip=proj_clip, forget_bias=forget_bias, reverse=reverse, residual=residual)
    if residual and x.shape[-1] != h0.shape[-1]:
        raise ValueError(f"residual needs input width == projection size, got {x.shape[-1]} and {h0.shape[-1]}")
    x, w_in, w_rec, bias, h0, c0 = (t.contiguous() for t in (x, w_in, w_rec, bias, h0, c0))
    w_proj = w_proj.contiguous() if w_proj is not None else None
    tensors = [t for t in (x, w_in, w_rec, bias, w_proj, h0, c0) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return LSTMPFunction.apply(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip,
                                 forget_bias, reverse, residual)
    y, h_n, c_n, _ = lstmp_fwd(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=cell_clip,
                               proj_clip=proj_clip, forget_bias=forget_bias, reverse=reverse, residual=residual,
                               save=False)
    return y, h_n, c_n

