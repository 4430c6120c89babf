"""Fused LSTMP chain (one layer, one direction) in Triton: forward and backward through time.

The math is ``elmo_fast.reference.lstmp.lstmp_reference`` (spec §3.2-§3.5); that function is the oracle.
Shapes: B batch, T padded steps, D input width, H cell, P projection (= hidden), G = 4H gate width.

Design (and why)
----------------
*Work split.* Per time step the LSTMP needs two all-to-all exchanges: every gate column needs all of
``h_{t-1}`` (K = P) and every projected output needs all of ``m_t`` (K = H). A kernel boundary is the
grid-wide barrier between them (a persistent kernel would need a spin barrier, which deadlocks under
``TRITON_INTERPRET=1`` where programs run one after another, so CI could not check it). Forward, per step:

1. ``_fwd_cell_kernel``, grid (B/BB, H/BH): ``h_{t-1} · w_rec`` for the four gate tiles of one H slice
   (tensor cores for 16-bit operands), gates, cell update + clip, ``m = σ(o) tanh(c)``; writes ``m_t``. With
   16-bit operands (``FUSED_GATES``) it reads a gate-interleaved copy of ``w_rec`` (``interleave_gates``, made
   with the call's other buffers) so that one (BK, 4·BH) tile and one dot per k step cover the four gates.
   *Stationary* tiles (``Tile.stationary``, 16-bit at B > 128 where the slice fits the GPU's shared memory):
   grid (groups, H/BH) instead (TUNED: one group), each program loads its slice's whole (P, 4·BH) weight once (the
   compiler keeps it in shared memory) and walks every groups-th row block with one dot of K = P: the weight
   crosses L2 once per step and group rather than once per row block (sm_90a, B=384, 64x32 w8: 108 against 142 MB
   of L2 a step at 192 KiB of shared memory, 194-217 registers, no spill; 128 programs).
2. ``_splitk_kernel``, grid (B/BB, P/BP, S): split-K ``m_t · w_proj``: split k of S sums K-rows
   [k·KS, (k+1)·KS) of H=4096 and writes an fp32 partial (S, B, P). Without the split the projection has
   (B/BB)·(P/BP) programs (a dozen at B=384) each walking K=4096 serially.
3. ``_fwd_reduce_kernel``, grid (B/BB, P/BP): sums the S partials in split order (deterministic: no
   atomics anywhere here), clips, writes y, the h state and the step caches.
   Opt-in at small batches (``ELMO_FAST_LSTMP_FUSED_REDUCE``, a row count: ``fused_reduce_rows``):
   ``_splitk_out_kernel`` does 2. and 3. in one launch. Each split takes a ticket of its tile's counter after
   storing its partial; the split that draws the last one sums the partials in split order (the same bits) and
   runs the reduce's epilogue, so a step is two launches: one kernel boundary fewer, which is most of a small
   batch's step in a loop graph (the H200's B=1 chain: 14.0 µs a step for 6.3 µs of roofline). Deterministic still
   (one writer, a fixed order); it relies on release/acquire ordering at GPU scope, which only a GPU exercises.

Backward walks the steps in reverse with the mirror image:

1. ``_bwd_cell_kernel``, grid (B/BB, H/BH): ``dm = dh_pre · w_projᵀ``, then the gate/cell chain rule with
   the cell-clip mask; writes ``dz_t`` (zero for inactive rows) and the cell-gradient carry.
2. ``_splitk_kernel`` again, grid (B/BB, P/BP, S): split-K ``dz_t · w_recᵀ`` over K = 4H = 16384.
3. ``_bwd_reduce_kernel``, grid (B/BB, P/BP): sums the partials in split order into the carry
   ``dL/dh_{t-1}`` of the rows that ran step t, then (already the next step's prologue) adds ``dy`` of the
   next step, applies its projection-clip mask and writes ``dh_pre`` in the operand dtype: the A operand of
   the next ``_bwd_cell_kernel`` and of the dW_proj GEMM. One extra launch before the loop does that
   prologue for the first step; after the loop the carry is dh0.

*Programmatic dependent launch* (Hopper and later; opt-in, ``ELMO_FAST_LSTMP_PDL=1``: ``pdl_on``). The plan's
kernels are built with ``PDL``: each one's first statement lets the next launch of its stream start (``_pdl_start``:
its programs are scheduled as SMs free up, once every program of this one has started), and each then waits, in
``_pdl_wait``, until the launch before it has finished and its writes are visible. Ahead of that wait a kernel reads
only what no launch of the loop writes: a stationary tile's weight slice (the forward's 128 KiB a program, 16 MiB a
step, can then load while the step before still runs; with PDL the 16-bit forward cell of batches up to 16 takes
such a tile too, ``PDL_TUNED``), and nothing at all elsewhere; it writes nothing. Every launch of a loop but its
first carries the attribute; the first follows whatever the stream ran before (the copies into a loop graph's
buffers, the weights among them; eagerly, the caller's own work on its tensors), so it is launched plainly. Every
program waits, unconditionally, so the order is transitive: a launch's wait returning means every earlier launch has
finished. The wait is a no-op for a plain launch. The interpreter has no grid dependency control: the CPU suite
checks the plan, the launch options and, in the code compiled for sm_90a, that nothing but the weight is touched
before the wait (``tests/test_lstmp_pdl.py``).

Three launches per step (two forward without a projection), all with shapes fixed by (B, T): the time loop
allocates nothing that depends on data and never syncs with the host, so it can be captured in a CUDA graph
(after one warm-up call: the first call per (device, dtype, forget bias, clips) uploads those constants). On
CUDA tensors both loops replay from such graphs by default, in training too (``kernels/lstmp_graphs.py``:
static buffers per call shape, leased to the forward's autograd node until its backward).

*Input projection* of all steps is one matmul (``x · w_in``) before the time loop (cuBLAS); the weight
gradients are matmuls over all B·T tokens after it: ``dW_in = xᵀ dz``, ``dW_rec = h_prevᵀ dz``,
``dW_proj = mᵀ dh_pre``, ``dx = dz · W_inᵀ`` (+ dy for the residual). ``db = Σ dz`` is not a pass over dz: the
backward cell kernel writes each (step, row block)'s column sums of dz in fp32 (``dbp``, T x B/BB x 4H: 7.9 MB at
B=384 where dz is 252 MB) and the sum of those follows the loop.

*Padding and direction.* All T steps run; at step ``s`` row ``b`` is active iff ``s < len_b`` (rows mask
themselves, so the host never reads the lengths). Its time position is ``s`` (forward) or
``len_b - 1 - s`` (reverse, each row reversed within its own length). An inactive row at step ``s`` sits on
the padded position ``s``, so writing zeros there writes every padded position exactly once: every element
of y and of the work buffers the weight-gradient GEMMs read is written by a kernel. Inactive rows keep
their state, so empty rows return h0/c0. A program whose rows are all inactive masks its weight loads
(no memory traffic) and still writes its zeros.

*State.* ``h`` lives twice: an operand-dtype copy ``hop`` (B, P) that the next cell kernel reads (bf16 at
bf16: half the bytes of the fp32 state it read before, times the H/BH programs that read it), and the fp32
``h_n`` written only at each row's last step. The fp32 cell state ``c`` (B, H) is read and written every
step in inference; in training the cell kernel reads ``c_{t-1}`` from the pre-clip cache of the previous
step instead (clipping it again) and writes ``c`` only at each row's last step, which saves one (B, H)
fp32 stream per step.

*What forward saves for backward* (training only). Per token: the four gate pre-activations ``z`` (with
the forget bias added), written over the step's ``gx`` once the cell kernel has read it (no extra buffer);
backward recomputes σ / tanh from them in fp32 (storing the activations in bf16 would lose ``1 - σ`` where σ
is near 1). Then the **pre-clip** cell ``c_t`` (fp32: the cell state stays fp32), the pre-clip projection
``h_t`` (fp32), ``h_{t-1}`` (a GEMM operand only) and ``m_t``. ``z``, ``h_{t-1}`` and ``m_t`` are in the
operand dtype: half the bytes at bf16 (the reference run in bf16 keeps everything there), exact at fp32.
Pre-clip values make the clip masks exact (torch.clamp's convention: gradient 1 on [-clip, clip] inclusive,
0 outside). Saving instead of recomputing avoids a second recurrent product over all steps in backward.

*Precision.* GEMM operands are in the weights' dtype (bf16/fp16: tensor cores; fp32: ``input_precision=
"ieee"``, plain FMA, no TF32, so fp32 matches the reference to rounding; fp64 for near-exact tests).
Accumulation, gates, cell state, partial sums and carries are fp32 (fp64 for fp64 inputs). ``dz`` is
stored in the operand dtype: it is a GEMM operand only (db sums its fp32 values, before that rounding).

*Configuration.* One pure function decides every launch:

    launch_plan(B, T, H, P, dtype, *, training, target=H100, has_proj=True, cell_clip=True,
                proj_clip=True, reverse=False, residual=False, tiles=None, fuse_reduce=False,
                pdl=False) -> dict[str, Launch]

It returns ``fwd_cell``, ``fwd_proj`` (absent without a projection), ``fwd_reduce`` and, when ``training``,
``bwd_cell``, ``bwd_rec``, ``bwd_reduce``. A ``Launch`` holds the kernel, its grid, every constexpr (tiles,
split counts, pipeline depth, dtype and behaviour flags), ``num_warps``/``num_stages``, the runtime
arguments in order as ``(name, torch dtype)`` for tensors and ``(name, value)`` for ints (``s``, the step,
is an example), ``count`` (launches per chain call), and the roofline terms: ``bytes`` (every operand read
once, every result written once), ``scratch_bytes`` (the split-K partials) and ``flops``. ``target`` is a
``Target(interpret, sms, smem, major)``; ``device_target(device)`` gives the launchers' one. The launchers
(``fwd_setup``/``bwd_setup`` build the plan and the buffers) launch nothing else and check once per call
that every tensor has the dtype the plan names, so a compile report that calls ``launch_plan`` compiles
exactly what runs. ``tiles`` overrides the per-kernel ``Tile`` (the tuning tool's hook). Tiles come from
``TUNED``, one entry per (kernel, operand class, batch size), chosen with ``bench/lstmp_compile.py
--search`` (compile for sm_90a, drop candidates that spill, miss the tensor cores or async copies, or
launch fewer than ``sms`` programs at B >= 128; rank the rest by the roofline estimate, then L2 traffic);
the interpreter uses fixed tiles. Split counts follow from the tiles and the SM count: the fewest splits
that give every SM a program.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from elmo_fast._backend import env_flag, triton_interpret
from elmo_fast.kernels import lstmp_graphs as graphs
from elmo_fast.kernels._common import (H100, Target, acc_dtype, device_constant, tanh, target_of, tl_acc_dtype,
                                      triton_operator)
from elmo_fast.ops._library import nothing, tracing
from elmo_fast.reference.lstmp import lstmp_reference

__all__ = ["lstmp_triton", "lstmp_fwd", "lstmp_bwd", "launch_plan", "Launch", "Tile", "Target",
           "device_target", "fwd_setup", "bwd_setup", "H100", "TUNED"]


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr, ACC: tl.constexpr, EMU: tl.constexpr):
    """acc + a·b. EMU: the CPU interpreter multiplies bf16 tiles as raw uint16 bits, so there we widen the
    bf16 operands to fp32 first, which is the same math (bf16 products are exact in fp32, fp32 accumulate)."""
    if EMU:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=ACC)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=ACC)
    return tl.dot(a, b, acc, out_dtype=ACC)


@triton.jit
def _clamp(x, clip):
    return tl.minimum(tl.maximum(x, -clip), clip)


@triton.jit
def _in_clip(x, clip):
    # torch.clamp's backward: gradient passes where min <= x <= max (inclusive).
    return (x >= -clip) & (x <= clip)


@triton.jit
def _rows(len_ptr, s, B, T, BB: tl.constexpr, REVERSE: tl.constexpr):
    """Rows of this program's row block (program_id(0)): see ``_rows_at``."""
    return _rows_at(tl.program_id(0) * BB, len_ptr, s, B, T, BB, REVERSE)


@triton.jit
def _rows_at(r0, len_ptr, s, B, T, BB: tl.constexpr, REVERSE: tl.constexpr):
    """Rows r0..r0+BB-1, their activity at step s (False for s < 0), whether s is their last step, and the flat
    token index (b*T + pos) of step s and of the step before it."""
    rb = r0 + tl.arange(0, BB)
    rmask = rb < B
    L = tl.load(len_ptr + rb, mask=rmask, other=0).to(tl.int32)
    valid = (s < L) & (s >= 0) & rmask
    if REVERSE:
        pos = tl.where(valid, L - 1 - s, s)
        prev = pos + 1
    else:
        pos = tl.zeros([BB], tl.int32) + s
        prev = pos - 1
    tok = rb.to(tl.int64) * T + pos
    ptok = rb.to(tl.int64) * T + prev
    return rb, rmask, valid, valid & (s == L - 1), tok, ptok


@triton.jit
def _any(valid):
    """True when at least one row of the block is active: weight loads of idle blocks are masked off."""
    return tl.max(valid.to(tl.int32), 0) > 0


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """Programmatic dependent launch (opt-in, ``pdl_on``; Hopper and later), a kernel's first statement: the stream's
    next launch may start its programs now (once every program of this one has called this); they stop in their own
    ``_pdl_wait``."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Wait until the launch before this one has finished and its writes are visible. Unconditional in every program
    of every kernel (so the order is transitive); nothing an earlier launch writes is touched before it: only a
    stationary tile's weight is loaded ahead of it, and nothing is written."""
    if PDL:
        gdc_wait()


@triton.jit
def _gate_input(gx_ptr, bias_ptr, tok, rh, g: tl.constexpr, vm, hmask, H: tl.constexpr, ACC: tl.constexpr):
    """Hoisted input projection of gate block g (i|j|f|o) at this step, plus its bias, in ACC."""
    col = g * H + rh
    gx = tl.load(gx_ptr + tok[:, None] * (4 * H) + col[None, :], mask=vm, other=0.0).to(ACC)
    return gx + tl.load(bias_ptr + col, mask=hmask, other=0.0).to(ACC)[None, :]


@triton.jit
def _h_tile(hop_ptr, rb, valid, k0, P: tl.constexpr, BK: tl.constexpr):
    """The A tile of the recurrent product: rows rb of h (zero at inactive rows), columns k0..k0+BK-1 of P; and those
    columns with their mask."""
    rk = k0 + tl.arange(0, BK)
    kmask = rk < P
    return tl.load(hop_ptr + rb[:, None] * P + rk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0), rk, kmask


@triton.jit
def _split_gates(acc, BB: tl.constexpr, BH: tl.constexpr):
    """The four gate tiles of a gate-interleaved (BB, 4·BH) product: column 4h + g -> (h, g1, g0) with
    g = 2 g1 + g0: g0 = 0 holds i (g=0) and f (g=2), g0 = 1 holds j and o."""
    even, odd = tl.split(tl.reshape(acc, [BB, BH, 2, 2]))
    acc_i, acc_f = tl.split(even)
    acc_j, acc_o = tl.split(odd)
    return acc_i, acc_j, acc_f, acc_o


@triton.jit
def _fwd_cell_tail(acc_i, acc_j, acc_f, acc_o, gx_ptr, bias_ptr, c_ptr, m_ptr, z_ptr, cpre_ptr, forget_bias, cell_clip,
                   rb, rmask, valid, last, tok, ptok, rh, hmask, s, H: tl.constexpr,
                   HAS_CELL_CLIP: tl.constexpr, SAVE: tl.constexpr, ACC: tl.constexpr):
    """Everything after the recurrent product for rows rb of one H slice: gates, cell update + clip, m, and in
    training the saved z and pre-clip c."""
    G = 4 * H
    vm = valid[:, None] & hmask[None, :]
    zi = acc_i + _gate_input(gx_ptr, bias_ptr, tok, rh, 0, vm, hmask, H, ACC)
    zj = acc_j + _gate_input(gx_ptr, bias_ptr, tok, rh, 1, vm, hmask, H, ACC)
    zf = acc_f + _gate_input(gx_ptr, bias_ptr, tok, rh, 2, vm, hmask, H, ACC) + forget_bias
    zo = acc_o + _gate_input(gx_ptr, bias_ptr, tok, rh, 3, vm, hmask, H, ACC)
    cptr = c_ptr + rb[:, None] * H + rh[None, :]
    if SAVE:
        sp = z_ptr + tok[:, None] * G + rh[None, :]
        zdt = z_ptr.dtype.element_ty
        tl.store(sp, zi.to(zdt), mask=vm)
        tl.store(sp + H, zj.to(zdt), mask=vm)
        tl.store(sp + 2 * H, zf.to(zdt), mask=vm)
        tl.store(sp + 3 * H, zo.to(zdt), mask=vm)
        # c_{t-1}: the clipped pre-clip cache of the row's previous step, or c (= c0) at its first step.
        cp = tl.load(cpre_ptr + ptok[:, None] * H + rh[None, :], mask=vm & (s > 0), other=0.0)
        if HAS_CELL_CLIP:
            cp = _clamp(cp, cell_clip)
        c_prev = tl.where(s > 0, cp, tl.load(cptr, mask=vm & (s == 0), other=0.0))
    else:
        c_prev = tl.load(cptr, mask=vm, other=0.0)
    c_new = _sigmoid(zf) * c_prev + _sigmoid(zi) * tanh(zj)
    cc = c_new
    if HAS_CELL_CLIP:
        cc = _clamp(c_new, cell_clip)
    if SAVE:
        tl.store(cpre_ptr + tok[:, None] * H + rh[None, :], c_new, mask=vm)
        tl.store(cptr, cc, mask=last[:, None] & hmask[None, :])
    else:
        tl.store(cptr, cc, mask=vm)
    m = _sigmoid(zo) * tanh(cc)
    # m is zero at inactive rows: that fills the padded positions of the m buffer.
    am = rmask[:, None] & hmask[None, :]
    tl.store(m_ptr + tok[:, None] * H + rh[None, :], tl.where(vm, m, 0.0).to(m_ptr.dtype.element_ty), mask=am)


@triton.jit
def _a_tile(a_ptr, rb, tok, valid, rk, kmask, P: tl.constexpr, PER_TOKEN: tl.constexpr):
    """The stationary design's A tile: rows rb (zero at inactive rows and past B), columns rk, of a (B, P) state (h)
    or, PER_TOKEN, of a (B, T, P) buffer at each row's token ``tok`` (dh_pre)."""
    row = tok if PER_TOKEN else rb.to(tl.int64)
    return tl.load(a_ptr + row[:, None] * P + rk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)


@triton.jit(do_not_specialize=["s"])
def _fwd_cell_kernel(
    gx_ptr, bias_ptr, w_rec_ptr, hop_ptr, c_ptr, len_ptr, m_ptr, z_ptr, cpre_ptr, consts_ptr,
    s, B, T, H: tl.constexpr, P: tl.constexpr,
    HAS_CELL_CLIP: tl.constexpr, REVERSE: tl.constexpr, SAVE: tl.constexpr,
    ACC: tl.constexpr, IEEE: tl.constexpr, EMU: tl.constexpr,
    BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, FUSED: tl.constexpr,
    STATIONARY: tl.constexpr = False, PK: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """Gates, cell and m for one (row block, H slice) at step s. hop (B,P) is h in the operand dtype; c (B,H)
    is the ACC cell state (inference: read and written every step; training: c0 at s == 0, c_{t-1} comes
    from the pre-clip cache, and c is written only at a row's last step). FUSED: w_rec is in the gate-interleaved
    layout (``interleave_gates``: column 4h + g holds gate g of unit h), so one (BK, 4·BH) tile and one dot per k
    step give the four gates of the slice, split apart after the loop.

    STATIONARY (with FUSED; grid (groups, H/BH)): the program holds its slice's whole (P, 4·BH) weight, P padded to
    PK, loaded once, and walks the row blocks pid0, pid0 + groups, ..., one dot of K = PK per block: the weight
    crosses L2 once per step and group instead of once per row block (the compiler keeps it in shared memory across
    the row loop)."""
    _pdl_start(PDL)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = rh < H
    G = 4 * H

    if STATIONARY:
        rn = tl.program_id(1) * (4 * BH) + tl.arange(0, 4 * BH)
        rk = tl.arange(0, PK)
        kmask = rk < P
        # the weight (written before the time loop only) ahead of the wait: with PDL it loads while the step
        # before this one finishes
        w = tl.load(w_rec_ptr + rk[:, None].to(tl.int64) * G + rn[None, :], mask=kmask[:, None] & (rn < G)[None, :],
                    other=0.0)
    _pdl_wait(PDL)
    forget_bias = tl.load(consts_ptr)
    cell_clip = tl.load(consts_ptr + 1)
    if STATIONARY:
        r0 = tl.program_id(0) * BB  # row blocks pid0, pid0 + groups, ... (groups = the grid's first dimension)
        step = tl.num_programs(0) * BB
        rb, rmask, valid, last, tok, ptok = _rows_at(r0, len_ptr, s, B, T, BB, REVERSE)
        hp = _a_tile(hop_ptr, rb, tok, valid, rk, kmask, P, False)
        while r0 < B:  # not `range(r0, B, step)`: the interpreter (numpy 2) cannot take a runtime bound there
            acc = _mma(hp, w, tl.zeros([BB, 4 * BH], ACC), IEEE, ACC, EMU)
            # the next row block's rows and h, loaded by hand ahead of this block's epilogue (the row loop is not
            # software-pipelined: a second h buffer would not fit in shared memory beside the weight)
            nb, nmask, nvalid, nlast, ntok, nptok = _rows_at(r0 + step, len_ptr, s, B, T, BB, REVERSE)
            hp = _a_tile(hop_ptr, nb, ntok, nvalid, rk, kmask, P, False)
            acc_i, acc_j, acc_f, acc_o = _split_gates(acc, BB, BH)
            _fwd_cell_tail(acc_i, acc_j, acc_f, acc_o, gx_ptr, bias_ptr, c_ptr, m_ptr, z_ptr, cpre_ptr, forget_bias,
                           cell_clip, rb, rmask, valid, last, tok, ptok, rh, hmask, s, H, HAS_CELL_CLIP, SAVE, ACC)
            rb, rmask, valid, last, tok, ptok = nb, nmask, nvalid, nlast, ntok, nptok
            r0 += step
    else:
        rb, rmask, valid, last, tok, ptok = _rows(len_ptr, s, B, T, BB, REVERSE)
        live = _any(valid)
        if FUSED:
            rn = tl.program_id(1) * (4 * BH) + tl.arange(0, 4 * BH)  # interleaved columns 4h + g of this slice
            nmask = rn < G
            acc = tl.zeros([BB, 4 * BH], ACC)
            for k0 in tl.range(0, P, BK, num_stages=STAGES):
                hp, rk, kmask = _h_tile(hop_ptr, rb, valid, k0, P, BK)
                w = tl.load(w_rec_ptr + rk[:, None].to(tl.int64) * G + rn[None, :],
                            mask=kmask[:, None] & nmask[None, :] & live, other=0.0)
                acc = _mma(hp, w, acc, IEEE, ACC, EMU)
            acc_i, acc_j, acc_f, acc_o = _split_gates(acc, BB, BH)
        else:
            acc_i = tl.zeros([BB, BH], ACC)
            acc_j = tl.zeros([BB, BH], ACC)
            acc_f = tl.zeros([BB, BH], ACC)
            acc_o = tl.zeros([BB, BH], ACC)
            for k0 in tl.range(0, P, BK, num_stages=STAGES):
                hp, rk, kmask = _h_tile(hop_ptr, rb, valid, k0, P, BK)
                wp = w_rec_ptr + rk[:, None].to(tl.int64) * G + rh[None, :]
                wm = kmask[:, None] & hmask[None, :] & live
                acc_i = _mma(hp, tl.load(wp, mask=wm, other=0.0), acc_i, IEEE, ACC, EMU)
                acc_j = _mma(hp, tl.load(wp + H, mask=wm, other=0.0), acc_j, IEEE, ACC, EMU)
                acc_f = _mma(hp, tl.load(wp + 2 * H, mask=wm, other=0.0), acc_f, IEEE, ACC, EMU)
                acc_o = _mma(hp, tl.load(wp + 3 * H, mask=wm, other=0.0), acc_o, IEEE, ACC, EMU)
        _fwd_cell_tail(acc_i, acc_j, acc_f, acc_o, gx_ptr, bias_ptr, c_ptr, m_ptr, z_ptr, cpre_ptr, forget_bias,
                       cell_clip, rb, rmask, valid, last, tok, ptok, rh, hmask, s, H, HAS_CELL_CLIP, SAVE, ACC)


@triton.jit
def _sum_partials(part_ptr, rb, mask, rn, B, N: tl.constexpr, SPLITS: tl.constexpr, ACC: tl.constexpr,
                  BB: tl.constexpr, BN: tl.constexpr):
    """Σ_k part[k, rb, rn] in split order: the same bits on every run. Unrolled: no K loop to pipeline, every
    partial's load can issue before the first add (the adds keep their order)."""
    acc = tl.zeros([BB, BN], ACC)
    for k in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + (k * B + rb)[:, None].to(tl.int64) * N + rn[None, :], mask=mask, other=0.0)
    return acc


@triton.jit(do_not_specialize=["s"])
def _splitk_kernel(
    a_ptr, b_ptr, part_ptr, len_ptr,
    s, B, T, K: tl.constexpr, P: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
    REVERSE: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr, EMU: tl.constexpr,
    BB: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Split k = program_id(2) of a_t · b at step s for one (row block, P slice): the sum over K-rows
    [k·KS, (k+1)·KS), into part (S, B, P). a (B, T, K) per token: m_t (K = H, the forward projection, b =
    w_proj (K, P) row-major) or dz_t (K = 4H, the recurrent backward, b = w_recᵀ: element [k, p] = w_rec[p, k])."""
    _pdl_start(PDL)
    _pdl_wait(PDL)
    acc, rb, rmask, valid, last, tok, rp, pmask = _splitk_tile(a_ptr, b_ptr, len_ptr, s, B, T, K, P, B_ROW_MAJOR,
                                                               REVERSE, ACC, IEEE, EMU, BB, BP, BK, KS, STAGES)
    tl.store(part_ptr + (tl.program_id(2) * B + rb)[:, None].to(tl.int64) * P + rp[None, :], acc,
             mask=rmask[:, None] & pmask[None, :])


@triton.jit
def _splitk_tile(a_ptr, b_ptr, len_ptr, s, B, T, K: tl.constexpr, P: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
                 REVERSE: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr, EMU: tl.constexpr, BB: tl.constexpr,
                 BP: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, STAGES: tl.constexpr):
    """Split k = program_id(2)'s sum over K-rows [k·KS, (k+1)·KS) for this program's (row block, P slice), with the
    rows' masks (``_splitk_kernel``; ``_splitk_out_kernel``)."""
    rb, rmask, valid, last, tok, ptok = _rows(len_ptr, s, B, T, BB, REVERSE)
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    pmask = rp < P
    live = _any(valid)
    kb = tl.program_id(2) * KS
    acc = tl.zeros([BB, BP], ACC)
    for k0 in tl.range(0, KS, BK, num_stages=STAGES):
        rk = kb + k0 + tl.arange(0, BK)
        kmask = rk < K
        a = tl.load(a_ptr + tok[:, None] * K + rk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        if B_ROW_MAJOR:
            bp = b_ptr + rk[:, None].to(tl.int64) * P + rp[None, :]
        else:
            bp = b_ptr + rp[None, :].to(tl.int64) * K + rk[:, None]
        b = tl.load(bp, mask=kmask[:, None] & pmask[None, :] & live, other=0.0)
        acc = _mma(a, b, acc, IEEE, ACC, EMU)
    return acc, rb, rmask, valid, last, tok, rp, pmask


@triton.jit(do_not_specialize=["s"])
def _fwd_reduce_kernel(
    part_ptr, m_ptr, x_ptr, hop_ptr, hn_ptr, len_ptr, y_ptr, hpre_ptr, hprev_ptr, consts_ptr,
    s, B, T, H: tl.constexpr, P: tl.constexpr, SPLITS: tl.constexpr,
    HAS_PROJ: tl.constexpr, HAS_PROJ_CLIP: tl.constexpr, RESIDUAL: tl.constexpr, REVERSE: tl.constexpr,
    SAVE: tl.constexpr, ACC: tl.constexpr, BB: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr = False,
):
    """h_t = clip(Σ partials) (or m_t without a projection) for one (row block, P slice): ``_fwd_out``."""
    _pdl_start(PDL)
    _pdl_wait(PDL)
    rb, rmask, valid, last, tok, ptok = _rows(len_ptr, s, B, T, BB, REVERSE)
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    pmask = rp < P
    vm = valid[:, None] & pmask[None, :]
    if HAS_PROJ:
        acc = _sum_partials(part_ptr, rb, vm, rp, B, P, SPLITS, ACC, BB, BP)
    else:  # P == H: the state is m itself
        acc = tl.load(m_ptr + tok[:, None] * H + rp[None, :], mask=vm, other=0.0).to(ACC)
    _fwd_out(acc, x_ptr, hop_ptr, hn_ptr, y_ptr, hpre_ptr, hprev_ptr, consts_ptr, rb, rmask, valid, last, tok, rp,
             pmask, P, HAS_PROJ_CLIP, RESIDUAL, SAVE, ACC)


@triton.jit
def _fwd_out(acc, x_ptr, hop_ptr, hn_ptr, y_ptr, hpre_ptr, hprev_ptr, consts_ptr, rb, rmask, valid, last, tok, rp,
             pmask, P: tl.constexpr, HAS_PROJ_CLIP: tl.constexpr, RESIDUAL: tl.constexpr, SAVE: tl.constexpr,
             ACC: tl.constexpr):
    """The forward step's end for one (row block, P slice), given h_pre = acc: h_t = clip(acc); updates hop and, at
    a row's last step, h_n; writes y (zeros at padded positions) and, in training, the h_pre / h_prev caches."""
    proj_clip = tl.load(consts_ptr + 2)
    vm = valid[:, None] & pmask[None, :]
    am = rmask[:, None] & pmask[None, :]
    h_new = acc
    if HAS_PROJ_CLIP:
        h_new = _clamp(acc, proj_clip)
    hptr = hop_ptr + rb[:, None] * P + rp[None, :]
    tok_p = tok[:, None] * P + rp[None, :]
    if SAVE:
        tl.store(hpre_ptr + tok_p, acc, mask=vm)
        # zeros at padded positions: this buffer feeds dW_rec as a matmul over all tokens.
        tl.store(hprev_ptr + tok_p, tl.where(vm, tl.load(hptr, mask=vm, other=0.0), 0.0), mask=am)
    tl.store(hptr, h_new.to(hop_ptr.dtype.element_ty), mask=vm)
    tl.store(hn_ptr + rb[:, None] * P + rp[None, :], h_new, mask=last[:, None] & pmask[None, :])
    out = h_new
    if RESIDUAL:  # D == P
        out = out + tl.load(x_ptr + tok_p, mask=vm, other=0.0).to(ACC)
    tl.store(y_ptr + tok_p, tl.where(vm, out, 0.0).to(y_ptr.dtype.element_ty), mask=am)


@triton.jit(do_not_specialize=["s"])
def _splitk_out_kernel(
    m_ptr, w_ptr, part_ptr, ticket_ptr, x_ptr, hop_ptr, hn_ptr, len_ptr, y_ptr, hpre_ptr, hprev_ptr, consts_ptr,
    s, B, T, H: tl.constexpr, P: tl.constexpr, SPLITS: tl.constexpr,
    HAS_PROJ_CLIP: tl.constexpr, RESIDUAL: tl.constexpr, REVERSE: tl.constexpr, SAVE: tl.constexpr,
    ACC: tl.constexpr, IEEE: tl.constexpr, EMU: tl.constexpr,
    BB: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``_splitk_kernel``'s forward projection and ``_fwd_reduce_kernel``'s work in one launch (``fuse_reduce``:
    small batches). Split k = program_id(2) writes its fp32 partial of the (row block, P slice) tile, then takes a
    ticket of the tile's counter; the split that draws the last ticket sums the tile's SPLITS partials in split order
    (the reduce kernel's order: the same bits), zeroes the counter for the next step and runs ``_fwd_out``. The
    partials are stored before a CTA barrier and an acq_rel atomic at GPU scope, and the last split reads them past
    L1 (``.cg``) after its own acquire: the pattern of inductor's grid barrier, without the spin (so the interpreter,
    whose programs run one after another, runs it too)."""
    _pdl_start(PDL)
    _pdl_wait(PDL)
    acc, rb, rmask, valid, last, tok, rp, pmask = _splitk_tile(m_ptr, w_ptr, len_ptr, s, B, T, H, P, True, REVERSE,
                                                               ACC, IEEE, EMU, BB, BP, BK, KS, STAGES)
    am = rmask[:, None] & pmask[None, :]
    tl.store(part_ptr + (tl.program_id(2) * B + rb)[:, None].to(tl.int64) * P + rp[None, :], acc, mask=am)
    tl.debug_barrier()  # every thread's partial stored before the ticket releases them
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")
    if ticket == SPLITS - 1:
        tl.debug_barrier()
        vm = valid[:, None] & pmask[None, :]
        total = tl.zeros([BB, BP], ACC)
        for k in tl.static_range(SPLITS):
            total += tl.load(part_ptr + (k * B + rb)[:, None].to(tl.int64) * P + rp[None, :], mask=vm, other=0.0,
                             cache_modifier=".cg")
        tl.atomic_xchg(ticket_ptr + tile, 0)  # every split of this step has drawn: ready for the next step
        _fwd_out(total, x_ptr, hop_ptr, hn_ptr, y_ptr, hpre_ptr, hprev_ptr, consts_ptr, rb, rmask, valid, last, tok,
                 rp, pmask, P, HAS_PROJ_CLIP, RESIDUAL, SAVE, ACC)


@triton.jit
def _dz_out(dzp, dbp, val, vm, am, hmask, ddt):
    """Store one gate's dz tile (zero at inactive rows) and its column sum over the block's rows (fp32, before the
    rounding to the operand dtype): the bias gradient's partial of this (step, row block)."""
    val = tl.where(vm, val, 0.0)
    tl.store(dzp, val.to(ddt), mask=am)
    tl.store(dbp, tl.sum(val, axis=0), mask=hmask)


@triton.jit
def _bwd_cell_tail(dm, z_ptr, cpre_ptr, c0_ptr, dc_ptr, dz_ptr, dbp_ptr, cell_clip, rb, rmask, valid, tok, ptok, rh,
                   hmask, s, B, BB: tl.constexpr, H: tl.constexpr, HAS_CELL_CLIP: tl.constexpr, ACC: tl.constexpr):
    """The gate/cell chain rule for rows rb of one H slice, given dm = dL/dm_t: writes dz_t (zero at inactive rows)
    and its column sums over the block's rows into dbp (T, row blocks, 4H) at (s, rb[0] // BB), and updates the
    cell-gradient carry dc in place."""
    G = 4 * H
    vm = valid[:, None] & hmask[None, :]
    am = rmask[:, None] & hmask[None, :]
    zp = z_ptr + tok[:, None] * G + rh[None, :]
    dzp = dz_ptr + tok[:, None] * G + rh[None, :]
    ddt = dz_ptr.dtype.element_ty
    dbp = dbp_ptr + (s * tl.cdiv(B, BB) + tl.min(rb, axis=0) // BB).to(tl.int64) * G + rh
    # one gate at a time, each stored as soon as it is known: fewer whole tiles live at once (sm_90a, B=384: 78
    # registers at 128x16 where loading all four gates first took 144, and 64x64 compiles without spills)
    cpre = tl.load(cpre_ptr + tok[:, None] * H + rh[None, :], mask=vm, other=0.0)
    cc = cpre
    if HAS_CELL_CLIP:
        cc = _clamp(cpre, cell_clip)
    tc = tanh(cc)
    go = _sigmoid(tl.load(zp + 3 * H, mask=vm, other=0.0).to(ACC))
    _dz_out(dzp + 3 * H, dbp + 3 * H, dm * tc * go * (1.0 - go), vm, am, hmask, ddt)
    dcptr = dc_ptr + rb[:, None] * H + rh[None, :]
    dc = tl.load(dcptr, mask=vm, other=0.0) + dm * go * (1.0 - tc * tc)
    if HAS_CELL_CLIP:
        dc = tl.where(_in_clip(cpre, cell_clip), dc, 0.0)
    gf = _sigmoid(tl.load(zp + 2 * H, mask=vm, other=0.0).to(ACC))
    tl.store(dcptr, dc * gf, mask=vm)
    # c_{t-1}: the (clipped) cell of the previous step of this row, or c0 at the row's first step.
    cp = tl.load(cpre_ptr + ptok[:, None] * H + rh[None, :], mask=vm & (s > 0), other=0.0)
    if HAS_CELL_CLIP:
        cp = _clamp(cp, cell_clip)
    c0 = tl.load(c0_ptr + rb[:, None] * H + rh[None, :], mask=vm & (s == 0), other=0.0).to(ACC)
    c_prev = tl.where(s > 0, cp, c0)
    _dz_out(dzp + 2 * H, dbp + 2 * H, dc * c_prev * gf * (1.0 - gf), vm, am, hmask, ddt)
    gi = _sigmoid(tl.load(zp, mask=vm, other=0.0).to(ACC))
    gj = tanh(tl.load(zp + H, mask=vm, other=0.0).to(ACC))
    _dz_out(dzp, dbp, dc * gj * gi * (1.0 - gi), vm, am, hmask, ddt)
    _dz_out(dzp + H, dbp + H, dc * gi * (1.0 - gj * gj), vm, am, hmask, ddt)


@triton.jit(do_not_specialize=["s"])
def _bwd_cell_kernel(
    dhpre_ptr, w_proj_ptr, z_ptr, cpre_ptr, c0_ptr, dc_ptr, len_ptr, dz_ptr, dbp_ptr, consts_ptr,
    s, B, T, H: tl.constexpr, P: tl.constexpr,
    HAS_PROJ: tl.constexpr, HAS_CELL_CLIP: tl.constexpr, REVERSE: tl.constexpr,
    ACC: tl.constexpr, IEEE: tl.constexpr, EMU: tl.constexpr,
    BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    STATIONARY: tl.constexpr = False, PK: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """Backward of gates and cell for one (row block, H slice) at step s.

    dhpre (B,T,P) holds dL/dh_pre_t (written by the reduce kernel); dc (B,H) holds dL/dc_t (post-clip) and
    is updated in place to dL/dc_{t-1}. Writes dz_t (B,T,4H), zero for inactive rows, and the bias gradient's
    partials dbp (T, row blocks, 4H): each block's column sums of dz_t in ACC (db is their sum after the loop).

    STATIONARY (with HAS_PROJ; grid (groups, H/BH)): the program loads its slice's (P, BH) of w_projᵀ once, P padded
    to PK, and walks the row blocks pid0, pid0 + groups, ..., one dot of K = PK per block (as the forward's).
    """
    _pdl_start(PDL)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = rh < H

    if STATIONARY:
        rk = tl.arange(0, PK)
        kmask = rk < P
        # (w_proj)ᵀ slice: element [k, h] = w_proj[h, k]; ahead of the wait, as the forward's
        wt = tl.load(w_proj_ptr + rh[None, :].to(tl.int64) * P + rk[:, None], mask=kmask[:, None] & hmask[None, :],
                     other=0.0)
    _pdl_wait(PDL)
    cell_clip = tl.load(consts_ptr + 1)
    if STATIONARY:
        r0 = tl.program_id(0) * BB
        step = tl.num_programs(0) * BB
        rb, rmask, valid, last, tok, ptok = _rows_at(r0, len_ptr, s, B, T, BB, REVERSE)
        dht = _a_tile(dhpre_ptr, rb, tok, valid, rk, kmask, P, True)
        while r0 < B:
            dm = _mma(dht, wt, tl.zeros([BB, BH], ACC), IEEE, ACC, EMU)
            nb, nmask, nvalid, nlast, ntok, nptok = _rows_at(r0 + step, len_ptr, s, B, T, BB, REVERSE)
            dht = _a_tile(dhpre_ptr, nb, ntok, nvalid, rk, kmask, P, True)
            _bwd_cell_tail(dm, z_ptr, cpre_ptr, c0_ptr, dc_ptr, dz_ptr, dbp_ptr, cell_clip, rb, rmask, valid, tok,
                           ptok, rh, hmask, s, B, BB, H, HAS_CELL_CLIP, ACC)
            rb, rmask, valid, last, tok, ptok = nb, nmask, nvalid, nlast, ntok, nptok
            r0 += step
    else:
        rb, rmask, valid, last, tok, ptok = _rows(len_ptr, s, B, T, BB, REVERSE)
        if HAS_PROJ:
            live = _any(valid)
            dm = tl.zeros([BB, BH], ACC)
            for k0 in tl.range(0, P, BK, num_stages=STAGES):
                rk = k0 + tl.arange(0, BK)
                kmask = rk < P
                dht = tl.load(dhpre_ptr + tok[:, None] * P + rk[None, :], mask=valid[:, None] & kmask[None, :],
                              other=0.0)
                # (w_proj)ᵀ tile: element [k, h] = w_proj[h, k]
                wt = tl.load(w_proj_ptr + rh[None, :].to(tl.int64) * P + rk[:, None],
                             mask=kmask[:, None] & hmask[None, :] & live, other=0.0)
                dm = _mma(dht, wt, dm, IEEE, ACC, EMU)
        else:  # h_t = m_t (P == H); dhpre is ACC here
            dm = tl.load(dhpre_ptr + tok[:, None] * P + rh[None, :], mask=valid[:, None] & hmask[None, :],
                         other=0.0)
        _bwd_cell_tail(dm, z_ptr, cpre_ptr, c0_ptr, dc_ptr, dz_ptr, dbp_ptr, cell_clip, rb, rmask, valid, tok, ptok,
                       rh, hmask, s, B, BB, H, HAS_CELL_CLIP, ACC)


@triton.jit(do_not_specialize=["s"])
def _bwd_reduce_kernel(
    part_ptr, dh_ptr, dy_ptr, hpre_ptr, dhpre_ptr, len_ptr, consts_ptr,
    s, B, T, P: tl.constexpr, SPLITS: tl.constexpr,
    HAS_PART: tl.constexpr, HAS_PROJ_CLIP: tl.constexpr, REVERSE: tl.constexpr,
    ACC: tl.constexpr, BB: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr = False,
):
    """Between the steps s+1 and s of backward, for one (row block, P slice).

    HAS_PART: rows that ran step s+1 get the carry dL/dh = Σ partials of the split-K GEMM (in split order);
    the other rows keep theirs (dh_n, or what an earlier step left). Then, for the rows active at step s:
    dh_pre_s = (carry + dy_s) masked by the projection clip, written (zeros for inactive rows) into dhpre,
    which the cell kernel of step s and the dW_proj GEMM read. s = -1 only finishes the carry (dh0).
    """
    _pdl_start(PDL)
    _pdl_wait(PDL)
    proj_clip = tl.load(consts_ptr + 2)
    rb, rmask, valid, last, tok, ptok = _rows(len_ptr, s, B, T, BB, REVERSE)
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    pmask = rp < P
    dptr = dh_ptr + rb[:, None] * P + rp[None, :]
    am = rmask[:, None] & pmask[None, :]
    carry = tl.load(dptr, mask=am, other=0.0)
    if HAS_PART:
        L = tl.load(len_ptr + rb, mask=rmask, other=0).to(tl.int32)
        ran = (s + 1 < L)[:, None] & am
        carry = tl.where(ran, _sum_partials(part_ptr, rb, ran, rp, B, P, SPLITS, ACC, BB, BP), carry)
        tl.store(dptr, carry, mask=ran)
    vm = valid[:, None] & pmask[None, :]
    tok_p = tok[:, None] * P + rp[None, :]
    dht = carry + tl.load(dy_ptr + tok_p, mask=vm, other=0.0).to(ACC)
    if HAS_PROJ_CLIP:
        dht = tl.where(_in_clip(tl.load(hpre_ptr + tok_p, mask=vm, other=0.0), proj_clip), dht, 0.0)
    tl.store(dhpre_ptr + tok_p, tl.where(vm, dht, 0.0).to(dhpre_ptr.dtype.element_ty), mask=am & (s >= 0))


# ------------------------------------------------------------------------------------- launch planning
@dataclass(frozen=True)
class Tile:
    """Tiling of one kernel: BM rows x BN columns per program, K steps of BK, ``warps``, pipeline ``stages``;
    ``fused`` (``fwd_cell`` only): one dot per k step over the gate-interleaved weight (``interleave_gates``) instead
    of one per gate; ``stationary`` (``fwd_cell`` with ``fused``, ``bwd_cell``): each program holds its H slice's
    whole weight and walks every ``groups``-th row block (grid (groups, H/BN); BK = 0: no K loop, one dot of K = P
    padded to a power of two per row block)."""

    BM: int
    BN: int
    BK: int = 0
    warps: int = 4
    stages: int = 1
    fused: bool = False
    stationary: bool = False
    groups: int = 1


@dataclass(frozen=True)
class Launch:
    """One kernel launch of the chain, fully decided (see the module docstring)."""

    kernel: object
    grid: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    args: tuple  # ((name, torch.dtype of a tensor | the value of an int (s: an example)), ...) in order
    count: int  # launches per chain call
    bytes: int  # every operand read once and every result written once, the split-K partials aside
    scratch_bytes: int  # the split-K partials written (GEMM) or read (reduce); re-used every step
    flops: int
    tile: Tile


KERNELS = ("fwd_cell", "fwd_proj", "fwd_reduce", "bwd_cell", "bwd_rec", "bwd_reduce")
BATCHES = (1, 16, 64, 128, 384)  # the listed sizes; TUNED has one entry per (kernel, class, size)

# (kernel, "16bit" | "fp32", batch) -> Tile. Chosen by `bench/lstmp_compile.py --search` for sm_90a at
# H=4096, P=512 (results and rules: bench/results/lstmp_compile.md). A batch uses the entry of the
# smallest listed size >= B (the largest beyond 384). Inference sizes also carry training entries (and the
# other way round) so any B works in both modes. The 16-bit bwd_cell entries at 128 and 384 come from the search's
# calibrated ranking (2026-11-27, bench/kernel_fit.py: L2 traffic set the H200's timings), once the kernel's epilogue
# stopped holding every gate tile at once (wider tiles compiled without spills; 128x16 before, 164 -> 101 MB of L2
# traffic a step at 384). The other 16-bit entries at 128 and 384 are the roofline ranking's; each ties with the
# calibrated search's pick (same estimate; its tie-break, fewest registers, takes other warps or BK there): kept.
# The 16-bit cell entries at 384 are the H200's, timed (bench_lstmp --parts tiles, 2026-11-27 21:42 UTC, commit
# 1aca4d1, bench/results/gpu_h200_s42.md): the occupancy probes 64x32x32 w4 s4 (3 programs an SM resident where the
# tiles they replaced kept 1) ran the forward cell kernel in 43.0 µs a step against 50.7 for the calibrated search's
# stationary pick (64x32, 8 warps, no K loop) and 54.4 for 128x32x32 w8 s4, and the backward in 53.6 against 72.2 for
# 64x64x32 w8 s4 and 60.4 for 128x16x64 w8 s4; the calibrated model had ranked them the other way round by their L2
# bytes (forward 192 against 142 MB a step): latency hiding matters more there than the model's L2 charge. At 128
# and below a 128-row tile covers the batch in one block (untimed).
TUNED: dict[tuple[str, str, int], Tile] = {
    ("fwd_cell", "16bit", 1): Tile(16, 32, 32, 4, 4),
    ("fwd_proj", "16bit", 1): Tile(16, 32, 32, 4, 4),
    ("fwd_reduce", "16bit", 1): Tile(16, 16, 0, 4, 1),
    ("bwd_cell", "16bit", 1): Tile(16, 32, 32, 4, 4),
    ("bwd_rec", "16bit", 1): Tile(16, 64, 32, 4, 4),
    ("bwd_reduce", "16bit", 1): Tile(16, 16, 0, 4, 1),
    ("fwd_cell", "16bit", 16): Tile(16, 32, 32, 4, 4),
    ("fwd_proj", "16bit", 16): Tile(16, 32, 32, 4, 4),
    ("fwd_reduce", "16bit", 16): Tile(16, 16, 0, 4, 1),
    ("bwd_cell", "16bit", 16): Tile(16, 32, 32, 4, 4),
    ("bwd_rec", "16bit", 16): Tile(16, 64, 32, 4, 4),
    ("bwd_reduce", "16bit", 16): Tile(16, 16, 0, 4, 1),
    ("fwd_cell", "16bit", 64): Tile(64, 16, 32, 4, 4),
    ("fwd_proj", "16bit", 64): Tile(64, 32, 32, 4, 4),
    ("fwd_reduce", "16bit", 64): Tile(16, 16, 0, 4, 1),
    ("bwd_cell", "16bit", 64): Tile(64, 16, 32, 4, 4),
    ("bwd_rec", "16bit", 64): Tile(64, 64, 32, 4, 4),
    ("bwd_reduce", "16bit", 64): Tile(16, 16, 0, 4, 1),
    ("fwd_cell", "16bit", 128): Tile(128, 16, 32, 4, 4),
    ("fwd_proj", "16bit", 128): Tile(64, 64, 32, 4, 4),
    ("fwd_reduce", "16bit", 128): Tile(16, 16, 0, 4, 1),
    ("bwd_cell", "16bit", 128): Tile(32, 64, 32, 8, 4),
    ("bwd_rec", "16bit", 128): Tile(64, 128, 32, 4, 4),
    ("bwd_reduce", "16bit", 128): Tile(16, 16, 0, 4, 1),
    ("fwd_cell", "16bit", 384): Tile(64, 32, 32, 4, 4),
    ("fwd_proj", "16bit", 384): Tile(128, 128, 32, 4, 4),
    ("fwd_reduce", "16bit", 384): Tile(16, 16, 0, 4, 1),
    ("bwd_cell", "16bit", 384): Tile(64, 32, 32, 4, 4),
    ("bwd_rec", "16bit", 384): Tile(128, 256, 32, 8, 4),
    ("bwd_reduce", "16bit", 384): Tile(16, 16, 0, 4, 1),
    ("fwd_cell", "fp32", 1): Tile(16, 16, 16, 4, 4),
    ("fwd_proj", "fp32", 1): Tile(16, 32, 32, 4, 4),
    ("fwd_reduce", "fp32", 1): Tile(16, 16, 0, 4, 1),
    ("bwd_cell", "fp32", 1): Tile(16, 16, 32, 4, 4),
    ("bwd_rec", "fp32", 1): Tile(16, 64, 16, 4, 4),
    ("bwd_reduce", "fp32", 1): Tile(16, 16, 0, 4, 1),
    ("fwd_cell", "fp32", 16): Tile(16, 16, 16, 4, 4),
    ("fwd_proj", "fp32", 16): Tile(16, 32, 32, 4, 4),
    ("fwd_reduce", "fp32", 16): Tile(16, 16, 0, 4, 1),
    ("bwd_cell", "fp32", 16): Tile(16, 16, 32, 4, 4),
    ("bwd_rec", "fp32", 16): Tile(16, 64, 16, 4, 4),
    ("bwd_reduce", "fp32", 16): Tile(16, 16, 0, 4, 1),
    ("fwd_cell", "fp32", 64): Tile(64, 16, 16, 4, 4),
    ("fwd_proj", "fp32", 64): Tile(64, 32, 16, 4, 4),
    ("fwd_reduce", "fp32", 64): Tile(16, 16, 0, 4, 1),
    ("bwd_cell", "fp32", 64): Tile(64, 16, 32, 4, 4),
    ("bwd_rec", "fp32", 64): Tile(64, 64, 16, 4, 4),
    ("bwd_reduce", "fp32", 64): Tile(16, 16, 0, 4, 1),
    ("fwd_cell", "fp32", 128): Tile(64, 32, 16, 4, 4),
    ("fwd_proj", "fp32", 128): Tile(64, 64, 16, 4, 4),
    ("fwd_reduce", "fp32", 128): Tile(16, 16, 0, 4, 1),
    ("bwd_cell", "fp32", 128): Tile(64, 32, 16, 8, 4),
    ("bwd_rec", "fp32", 128): Tile(64, 128, 32, 4, 4),
    ("bwd_reduce", "fp32", 128): Tile(16, 16, 0, 4, 1),
    ("fwd_cell", "fp32", 384): Tile(128, 32, 32, 8, 4),
    ("fwd_proj", "fp32", 384): Tile(128, 128, 32, 8, 4),
    ("fwd_reduce", "fp32", 384): Tile(16, 16, 0, 4, 1),
    ("bwd_cell", "fp32", 384): Tile(128, 32, 16, 8, 4),
    ("bwd_rec", "fp32", 384): Tile(128, 128, 16, 8, 4),
    ("bwd_reduce", "fp32", 384): Tile(16, 16, 0, 4, 1),
}
FUSED_REDUCE_ENV = "ELMO_FAST_LSTMP_FUSED_REDUCE"


def fused_reduce_rows() -> int:
    """The largest batch whose forward steps run the reduce in the projection's last split (``_splitk_out_kernel``:
    two launches a step instead of three), from ``ELMO_FAST_LSTMP_FUSED_REDUCE`` (a row count; unset or 0: never).
    Opt-in until a GPU has run it: its last-split ticket relies on the GPU's memory ordering, which the interpreter
    (programs one after another) cannot exercise; bench_bilm's ``auto+graph+fusedreduce`` times it and
    ``test_gpu_fused_reduce_is_the_reduce_kernel_bit_for_bit`` checks it there."""
    value = os.environ.get(FUSED_REDUCE_ENV, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"{FUSED_REDUCE_ENV}={value!r}: expected a row count (0: off), e.g. 16")
    return int(value)


PDL_ENV = "ELMO_FAST_LSTMP_PDL"


_PDL_WARNED: set = set()


def pdl_on(device: torch.device, traced: bool = False) -> bool:
    """Whether the time loops on ``device`` use programmatic dependent launch, from ``ELMO_FAST_LSTMP_PDL`` (1: on,
    unset or 0: off), read at each call's forward and at its backward (a loop-graph slot keeps the backward plan of
    its first backward). Each launch of a loop but its first then
    carries the PDL attribute, and its kernel (``PDL``) lets the next launch start at once and waits in ``_pdl_wait``
    for the one before: the gap between two launches, and a stationary tile's weight load, can overlap the kernel
    before. Opt-in until a GPU has timed it (bench_lstmp's ``triton-pdl``, bench_bilm's ``+pdl``, bench_train's
    ``elmo_fast-pdl``; ``test_gpu_pdl_gives_the_same_bits`` checks the bits there). Off, whatever the setting, for
    CPU tensors and under ``TRITON_INTERPRET=1`` (the interpreter has no grid dependency control), while
    torch.compile / torch.export trace (``traced``: inductor would launch the builds plainly anyway), and on a GPU
    that cannot (compute capability below 9.0, or ROCm): there with a warning, once a device, since it changes no
    result, only how launches overlap."""
    if not env_flag(PDL_ENV, False) or traced or triton_interpret():
        return False
    target = device_target(device)
    if target.interpret:
        return False
    why = ("ROCm" if torch.version.hip else f"compute capability {target.major}.x" if target.major < 9 else None)
    if why is None:
        return True
    if str(device) not in _PDL_WARNED:
        _PDL_WARNED.add(str(device))
        warnings.warn(f"elmo_fast: {PDL_ENV}=1 has no effect on {device} ({why}): programmatic dependent launch needs "
                      "an NVIDIA GPU of compute capability 9.0 or later (Hopper)", RuntimeWarning, stacklevel=3)
    return False


# Under the interpreter: fixed tiles (its cost grows with the number of programs) and splits of 64 K rows, so
# that the tests' small shapes cross tile boundaries and get several splits.
_INTERPRET_TILE = {k: Tile(32, 32, 32) for k in KERNELS}
_INTERPRET_KS = 64


def _low(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


# The forward cell kernel's design per operand class: one dot over the gate-interleaved weight (``Tile.fused``) or one
# per gate. Compiled for sm_90a at the tuned tiles (2026-11-26; SASS rows in bench/results/kernel_report_fused_cell.md),
# the 16-bit fused kernel's loop body has a quarter of the tensor-core instructions (per k16 one m64n(4·BN) wgmma
# instead of four m64nBN) and fewer, wider async copies (PTX at B=384: 2 against 8 wgmma, 16 against 24 cp.async), and
# the epilogue fewer shared-memory round trips (26 against 40 st.shared, 4 against 12 layout conversions), at the same
# shared memory, no spills, 174 against 186 registers at B=384 (168 against 144 at B=128); ptxas then unrolls its
# whole K loop (32 HGMMA in the SASS). In fp32 (FMA dots) it reads more operands from shared memory (241 against 133
# ld.shared at B=128) with up to 255 registers: fp32 keeps one dot per gate. Unmeasured on a GPU: the tile sweep
# (bench_lstmp.py --parts tiles) times the tuned tile in both designs.
FUSED_GATES = {"16bit": True, "fp32": False}


# Why a stationary cell launch may break two of the report's rules (bench/kernel_report.py and bench/lstmp_compile.py
# exempt it, and say so): it launches one program per (row group, H slice) (the forward's 1 x 128 at the original
# model, 4 SMs of an H100 idle) because each program keeps its slice's weight in shared memory across its row blocks,
# which is what cuts the weight's L2 re-reads; and it has no K loop to software-pipeline (one dot of K = P per row
# block; the next block's A tile is loaded by hand before the epilogue instead).
STATIONARY_EXEMPT = ("one program per (row group, H slice), each holding its slice's weight in shared memory "
                     "across its row blocks (fewer programs than SMs: groups x H/BN); no K loop (one dot of K = P per "
                     "row block, the next block's A tile loaded ahead by hand, not by async copies)")


def tuned_size(B: int) -> int:
    """The listed size whose ``TUNED`` entries a batch of B rows uses: the smallest >= B (the largest beyond it)."""
    return next((b for b in BATCHES if b >= B), BATCHES[-1])


def _tile(kernel: str, B: int, dtype: torch.dtype, target: Target, pdl: bool = False) -> Tile:
    """The tile of ``kernel`` at batch ``B``: ``TUNED``'s (``PDL_TUNED``'s first with ``pdl``; the interpreter's fixed
    one under it), with the forward cell kernel's design from ``FUSED_GATES``, so the interpreter runs the GPU's design
    for each operand dtype."""
    cls = "16bit" if _low(dtype) else "fp32"
    key = (kernel, cls, tuned_size(B))
    t = _INTERPRET_TILE[kernel] if target.interpret else (pdl and PDL_TUNED.get(key)) or TUNED[key]
    return replace(t, fused=_fused(kernel, _low(dtype))) if kernel == "fwd_cell" else t


# With programmatic dependent launch (``launch_plan(pdl=True)``) the 16-bit forward cell kernel of small batches takes a
# stationary tile: each program's whole weight slice (128 KiB; 16 MiB a step) then loads ahead of its wait, while the
# step before still runs (its projection and reduce let the next launches start at once), where the K-loop tile can
# stream the weight only after the wait. At B <= 16 a step is mostly that stream (the H200's B=1 cell kernel: 15.3 µs
# alone, 2026-11-26). sm_90a, compiled here 2026-11-27: 16x32, 8 warps, 204 registers, no spill, 128 KiB of shared
# memory, 128 programs (4 warps: 255 registers and 392 B of spills). Without PDL the K-loop tile stays: the model has
# the same bytes for both, and only the overlap would set them apart. Timed on the H200 (2026-11-27,
# bench/results/gpu_h200_s42.md): slower than PDL with TUNED's K-loop tile (the B=1 chain's forward 0.497 against
# 0.421 ms), and its bf16 bias gradient 1.4% over the budget of test_pdl_small_batch_tile[bf16-1] there.
PDL_TUNED: dict[tuple[str, str, int], Tile] = {
    ("fwd_cell", "16bit", 1): Tile(16, 32, 0, 8, 1, stationary=True),
    ("fwd_cell", "16bit", 16): Tile(16, 32, 0, 8, 1, stationary=True),
}


def _k_loop_tile(kernel: str, dtype: torch.dtype, B: int, t: Tile) -> Tile:
    """The K-loop tile a stationary tuned tile ``t`` falls back to where the stationary design does not apply (its
    weight slice does not fit the GPU's shared memory at this P, e.g. P = H without a projection or a GPU before
    Hopper; or the per-gate design): a PDL_TUNED tile falls back to TUNED's own, a stationary TUNED entry (none since
    the H200 timed them, 2026-11-27) to itself with a K loop."""
    tuned = TUNED[(kernel, "16bit" if _low(dtype) else "fp32", tuned_size(B))]
    k = tuned if not tuned.stationary else replace(t, BK=32, stages=4)
    return replace(k, fused=t.fused, stationary=False, groups=1)


def _stationary_pk(P: int) -> int:
    """K of a stationary tile's one dot: P padded to a power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(P))


def _stationary_smem(kernel: str, t: Tile, P: int, isz: int) -> int:
    """Shared memory of a stationary tile: its weight slice (PK x 4·BN forward, PK x BN backward) and one A tile,
    or the epilogue's fp32 (BM, BN) scratch where that is larger (sm_90a, 12 variants compiled: the compiled size
    never above this, equal to it at the tuned tile, 196608 B)."""
    pk = _stationary_pk(P)
    return pk * (4 if kernel == "fwd_cell" else 1) * t.BN * isz + max(t.BM * pk * isz, t.BM * t.BN * 4)


def _stationary_fits(kernel: str, t: Tile, P: int, isz: int, target: Target) -> bool:
    return _stationary_smem(kernel, t, P, isz) <= target.smem


def _fused(kernel: str, low: bool) -> bool:
    """Whether ``kernel`` runs the gate-interleaved design for this operand class: the forward cell kernel's
    ``FUSED_GATES`` choice, no other kernel's."""
    return kernel == "fwd_cell" and FUSED_GATES["16bit" if low else "fp32"]


def _splits(K: int, BK: int, tiles: int, sms: int) -> tuple[int, int]:
    """(S, KS): the fewest K splits (of KS rows, a multiple of BK) that give ``sms`` programs."""
    steps = triton.cdiv(K, BK)
    want = max(1, min(steps, triton.cdiv(sms, tiles)))
    ks = triton.cdiv(steps, want) * BK
    return triton.cdiv(K, ks), ks


def launch_plan(B: int, T: int, H: int, P: int, dtype: torch.dtype, *, training: bool, target: Target = H100,
                has_proj: bool = True, cell_clip: bool = True, proj_clip: bool = True, reverse: bool = False,
                residual: bool = False, tiles: dict | None = None, fuse_reduce: bool = False,
                pdl: bool = False) -> dict[str, Launch]:
    """Every launch of one chain call (see the module docstring). Pure: no device is touched. ``fuse_reduce``: the
    forward's reduce in the projection's last split (``_splitk_out_kernel``; no ``fwd_reduce`` launch: opt-in,
    ``fused_reduce_rows``). ``pdl``: every kernel built for programmatic dependent launch (``PDL``: it waits for the
    launch before it in ``_pdl_wait``; opt-in, ``pdl_on``)."""
    for name, flag in (("training", training), ("has_proj", has_proj), ("cell_clip", cell_clip),
                       ("proj_clip", proj_clip), ("reverse", reverse), ("residual", residual), ("pdl", pdl)):
        if not isinstance(flag, bool):  # e.g. a clip value where "is there a clip" is asked: under the interpreter
            # it would pass, compiled it fails (a float in a constexpr `if`)
            raise TypeError(f"launch_plan: {name} is a flag (bool), got {flag!r}")
    if pdl and target.interpret:
        raise ValueError("launch_plan: pdl needs compiled code on a GPU (the interpreter has no grid dependency "
                         "control)")
    cdiv = triton.cdiv
    op = dtype
    acc = acc_dtype(dtype)
    dhpre = op if has_proj else acc
    lo = _low(dtype)
    isz, asz = op.itemsize, acc.itemsize
    flags = dict(ACC=tl_acc_dtype(acc), IEEE=not lo, EMU=dtype == torch.bfloat16 and target.interpret)
    G = 4 * H
    proj_clip = has_proj and proj_clip
    ints = (("s", 1), ("B", B), ("T", T))
    i64 = torch.int64

    def tile(name):
        """The tile ``name`` runs: ``tiles``' (checked: refused where it cannot run) or TUNED's (PDL_TUNED's first with
        ``pdl``; a stationary entry falls back to its K-loop tile where it does not apply). ``stationary`` set iff the
        launch is stationary."""
        explicit = (tiles or {}).get(name)
        t = explicit or _tile(name, B, dtype, target, pdl)
        if t.stationary and name == "bwd_cell" and not has_proj:  # no product to hold a weight for: the plain tile
            t = replace(t, stationary=False, groups=1)
        if t.stationary:
            if name not in ("fwd_cell", "bwd_cell") or t.groups < 1 or (name == "fwd_cell" and not t.fused):
                why = "is for fwd_cell (gate-interleaved: fused) or bwd_cell, with groups >= 1"
            elif not _stationary_fits(name, t, P, isz, target):
                why = (f"needs {_stationary_smem(name, t, P, isz)} B of shared memory at P={P}, {dtype}; the target "
                       f"allows {target.smem} B a block")
            else:
                why = None
            if why and explicit:
                raise ValueError(f"launch_plan: the stationary {name} tile {t} {why}")
            if why:  # TUNED's entry in the per-gate design, or too big at this P / on this GPU
                t = _k_loop_tile(name, dtype, B, t)
        k_loop = name in ("fwd_cell", "fwd_proj", "bwd_rec") or (name == "bwd_cell" and has_proj)
        if k_loop and not t.stationary and t.BK < 1:
            raise ValueError(f"launch_plan: {name} runs a K loop: its tile needs BK >= 1, got {t}")
        return t

    def split(K, t):  # (S, KS) of a split-K GEMM with P-wide output
        if target.interpret:
            return cdiv(K, _INTERPRET_KS), _INTERPRET_KS
        return _splits(K, t.BK, cdiv(B, t.BM) * cdiv(P, t.BN), target.sms)

    def launch(kernel, grid, consts, args, count, nbytes, flops, t, scratch=0, stages=True):
        ce = dict(consts, BB=t.BM)
        if stages:
            ce["STAGES"] = t.stages
        if pdl:
            ce["PDL"] = True
        return Launch(kernel, tuple(grid), ce, t.warps, t.stages, tuple(args) + ints, count, int(nbytes),
                      int(scratch), int(flops), t)

    plan = {}
    # Bytes: every operand read once, every output written once (the roofline's memory term); a per-row
    # buffer touched only at some steps (h_n, c_n) is not counted.
    def rows_grid(t):  # the grid's first dimension: row blocks, or a stationary tile's row groups
        return min(t.groups, cdiv(B, t.BM)) if t.stationary else cdiv(B, t.BM)

    def stationary_consts(t):
        return dict(STATIONARY=True, PK=_stationary_pk(P)) if t.stationary else {}

    t = tile("fwd_cell")
    plan["fwd_cell"] = launch(
        _fwd_cell_kernel, (rows_grid(t), cdiv(H, t.BN)),
        dict(H=H, P=P, HAS_CELL_CLIP=cell_clip, REVERSE=reverse, SAVE=training, BH=t.BN, BK=t.BK, FUSED=t.fused,
             **stationary_consts(t), **flags),
        (("gx", op), ("bias", op), ("w_rec_g" if t.fused else "w_rec", op), ("hop", op), ("c", acc),
         ("lengths", i64), ("m", op), ("z", op), ("cpre", acc), ("consts", acc)),
        # w_rec, gx, h; c_{t-1} (state or cache) and c_t; m; z
        T, P * G * isz + B * G * isz + B * P * isz + 2 * B * H * asz + B * H * isz + (B * G * isz if training else 0),
        2 * B * P * G, t)
    def splitk(name, K, a, b, b_row_major):  # (the split-K launch of a P-wide GEMM over K, its split count)
        t = tile(name)
        S, KS = split(K, t)
        return launch(_splitk_kernel, (cdiv(B, t.BM), cdiv(P, t.BN), S),
                      dict(K=K, P=P, B_ROW_MAJOR=b_row_major, REVERSE=reverse, BP=t.BN, BK=t.BK, KS=KS, **flags),
                      ((a, op), (b, op), ("part", acc), ("lengths", i64)),
                      T, B * K * isz + K * P * isz, 2 * B * K * P, t, S * B * P * asz), S

    out_bytes = B * P * (2 * isz + (isz if residual else 0) + (asz + 2 * isz if training else 0))
    out_args = (("x", op), ("hop", op), ("hn", acc), ("lengths", i64), ("y", op), ("hpre", acc), ("hprev", op),
                ("consts", acc))
    if has_proj and fuse_reduce:  # the reduce in the projection's last split (_splitk_out_kernel): two launches a step
        t = tile("fwd_proj")
        S, KS = split(H, t)
        plan["fwd_proj"] = launch(
            _splitk_out_kernel, (cdiv(B, t.BM), cdiv(P, t.BN), S),
            dict(H=H, P=P, SPLITS=S, HAS_PROJ_CLIP=proj_clip, RESIDUAL=residual, REVERSE=reverse, SAVE=training,
                 BP=t.BN, BK=t.BK, KS=KS, **flags),
            (("m", op), ("w_proj", op), ("part", acc), ("tickets", torch.int32), *out_args),
            T, B * H * isz + H * P * isz + out_bytes, 2 * B * H * P, t, 2 * S * B * P * asz)
    else:
        S = 0
        if has_proj:
            plan["fwd_proj"], S = splitk("fwd_proj", H, "m", "w_proj", True)
        t = tile("fwd_reduce")
        plan["fwd_reduce"] = launch(
            _fwd_reduce_kernel, (cdiv(B, t.BM), cdiv(P, t.BN)),
            dict(H=H, P=P, SPLITS=S, HAS_PROJ=has_proj, HAS_PROJ_CLIP=proj_clip, RESIDUAL=residual,
                 REVERSE=reverse, SAVE=training, ACC=flags["ACC"], BP=t.BN),
            (("part", acc), ("m", op), *out_args), T, out_bytes, 0, t, S * B * P * asz, stages=False)
    if not training:
        return plan

    t = tile("bwd_cell")
    plan["bwd_cell"] = launch(
        _bwd_cell_kernel, (rows_grid(t), cdiv(H, t.BN)),
        dict(H=H, P=P, HAS_PROJ=has_proj, HAS_CELL_CLIP=cell_clip, REVERSE=reverse, BH=t.BN, BK=t.BK,
             **stationary_consts(t), **flags),
        (("dhpre", dhpre), ("w_proj", op), ("z", op), ("cpre", acc), ("c0", acc), ("dc", acc),
         ("lengths", i64), ("dz", op), ("dbp", acc), ("consts", acc)),
        T, (B * P * dhpre.itemsize + (H * P * isz if has_proj else 0) + B * G * isz + 2 * B * H * asz
            + 2 * B * H * asz + B * G * isz + cdiv(B, t.BM) * G * asz), 2 * B * P * H if has_proj else 0, t)
    plan["bwd_rec"], S = splitk("bwd_rec", G, "dz", "w_rec", False)
    t = tile("bwd_reduce")
    plan["bwd_reduce"] = launch(
        _bwd_reduce_kernel, (cdiv(B, t.BM), cdiv(P, t.BN)),
        dict(P=P, SPLITS=S, HAS_PART=True, HAS_PROJ_CLIP=proj_clip, REVERSE=reverse, ACC=flags["ACC"], BP=t.BN),
        (("part", acc), ("dh", acc), ("dy", op), ("hpre", acc), ("dhpre", dhpre), ("lengths", i64),
         ("consts", acc)),
        T + 1, B * P * (2 * asz + isz + (asz if proj_clip else 0) + dhpre.itemsize), 0, t, S * B * P * asz,
        stages=False)
    return plan


def device_target(device: torch.device) -> Target:
    """The launchers' target: every op's (``_common.target_of``: the interpreter on CPU tensors, else the GPU's SMs
    and shared memory, read once per GPU), under a name of this module that the tests swap for a pretend GPU."""
    return target_of(device)


def _bind(launch: Launch, bufs: dict, *, dependent: bool = False, **constexprs):
    """``launch`` with the tensors named in ``launch.args`` as a function of the step ``s``; ``constexprs``
    override (bwd_reduce's HAS_PART). The arguments, the options and the launch path (``graphs.launcher``) are
    settled once per loop: a step's host work is the kernel call (bench/host_launch_overhead.py times it; the
    interpreter's or the GPU launcher's own time comes on top). ``dependent``: a launch that follows one of the
    loop's own (every one but the loop's first) gets the PDL attribute where the plan has ``PDL``; the first follows
    whatever the stream ran before (the copies into the loop's buffers, the caller's own work), which a kernel's loads
    ahead of its wait must not race, so it is launched plainly (its ``_pdl_wait`` then returns at once)."""
    args = [None if name == "s" else bufs[name] if isinstance(v, torch.dtype) else v for name, v in launch.args]
    at = [name for name, _ in launch.args].index("s")
    pdl = {"launch_pdl": True} if dependent and launch.constexprs.get("PDL") else {}
    go = graphs.launcher(launch.kernel, launch.grid, args, {**launch.constexprs, **constexprs,
                                                            "num_warps": launch.num_warps,
                                                            "num_stages": launch.num_stages, **pdl})

    def run(s: int) -> None:
        args[at] = s
        go(args)

    return run


def _run(launch: Launch, bufs: dict, s: int, **constexprs) -> None:
    """One launch at step ``s`` (``_bind``'s, for a single call: the benchmarks time launches one at a time)."""
    _bind(launch, bufs, **constexprs)(s)


def _fwd_loop(plan: dict, bufs: dict) -> None:
    """The forward time loop: every launch of every step (what a loop graph captures)."""
    names = [k for k in ("fwd_cell", "fwd_proj", "fwd_reduce") if k in plan]
    steps = [_bind(plan[k], bufs, dependent=True) for k in names]
    first = _bind(plan[names[0]], bufs) if plan[names[0]].constexprs.get("PDL") else steps[0]  # (the same without)
    for s in range(bufs["y"].shape[1]):
        for i, run in enumerate(steps):
            (first if s == 0 and i == 0 else run)(s)


def _bwd_loop(plan: dict, bufs: dict) -> None:
    """The backward time loop (what a loop graph captures)."""
    cell, rec, red = (_bind(plan[k], bufs, dependent=True) for k in ("bwd_cell", "bwd_rec", "bwd_reduce"))
    T = bufs["dz"].shape[1]
    _bind(plan["bwd_reduce"], bufs, HAS_PART=False)(T - 1)  # dh_pre of the first step from dh_n
    for s in range(T - 1, -1, -1):
        cell(s)
        rec(s)
        red(s - 1)


def _check_dtypes(plan: dict, bufs: dict, prefix: str) -> None:
    # Once per call, not per step: the tensors are those the plan (and so a compile report) describes.
    for launch in (v for k, v in plan.items() if k.startswith(prefix)):
        for name, want in launch.args:
            if isinstance(want, torch.dtype) and bufs[name].dtype != want:
                raise AssertionError(f"lstmp: buffer {name} is {bufs[name].dtype}, the launch plan says {want}")


# ------------------------------------------------------------------------------------------ host side
_CONSTS: dict = {}


def _consts(forget_bias, cell_clip, proj_clip, acc, like: torch.Tensor) -> torch.Tensor:
    """(forget bias, cell clip, projection clip) as a device tensor in the accumulation dtype (a float kernel
    argument is fp32, which would round e.g. a clip of 0.3 and break fp64 agreement), uploaded once per
    (device, dtype, values): ``device_constant`` (on the device of ``like``, the op's input)."""
    vals = tuple(float(v) for v in (forget_bias, 0.0 if cell_clip is None else cell_clip,
                                    0.0 if proj_clip is None else proj_clip))
    return device_constant(_CONSTS, (acc, vals), lambda dev: torch.tensor(vals, dtype=acc, device=dev), like)


def _lengths(lengths: torch.Tensor, dev) -> torch.Tensor:
    return lengths.to(device=dev, dtype=torch.int64).contiguous()


def _plan_for(B, T, H, P, dtype, dev, training, w_proj, cell_clip, proj_clip, reverse, residual, traced) -> dict:
    return launch_plan(B, T, H, P, dtype, training=training, target=device_target(dev), has_proj=w_proj is not None,
                       cell_clip=cell_clip is not None, proj_clip=proj_clip is not None, reverse=bool(reverse),
                       residual=bool(residual), fuse_reduce=B <= fused_reduce_rows(), pdl=pdl_on(dev, traced))


def interleave_gates(w_rec: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """w_rec (P, 4H), gate blocks i|j|f|o, as the fused cell kernel reads it: column 4h + g holds gate g of unit h,
    so one slice of units is one run of columns (a strided copy, into ``out`` when given)."""
    P, G = w_rec.shape
    src = w_rec.reshape(P, 4, G // 4).transpose(1, 2)
    if out is None:
        return src.contiguous().view(P, G)
    out.view(P, G // 4, 4).copy_(src)
    return out


def fwd_setup(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, *, cell_clip, proj_clip, forget_bias, reverse,
              residual, save: bool) -> tuple[dict, dict]:
    """(plan, buffers) of a forward call: the input projection done, the state initialised, every buffer the
    launches name allocated (``bench/bench_lstmp.py`` times single launches with these)."""
    B, T, D = x.shape
    G = w_in.shape[1]
    H, P = G // 4, h0.shape[1]
    dev, op = x.device, w_rec.dtype
    acc = acc_dtype(op)
    plan = _plan_for(B, T, H, P, op, dev, save, w_proj, cell_clip, proj_clip, reverse, residual, tracing(x))
    xo = x.to(op)
    # Hoisted input projection of every step: one GEMM in the operand dtype (fp32 accumulation inside). In
    # training the cell kernel overwrites each step's gx with that step's z, which backward reads.
    gx = torch.matmul(xo.reshape(-1, D), w_in.to(op)).reshape(B, T, G)
    hn = h0.to(acc).contiguous().clone()
    c = c0.to(acc).contiguous().clone()
    hop = h0.to(op).contiguous().clone()
    fused = plan["fwd_cell"].tile.fused
    bufs = dict(
        gx=gx, z=gx, bias=bias.to(op).contiguous(), w_proj=w_rec if w_proj is None else w_proj, x=xo,
        # w_rec as the cell kernel reads it, and as training's backward does (no copy of it where nothing reads it:
        # a loop graph would refill it every call)
        **({"w_rec_g": interleave_gates(w_rec)} if fused else {}), **({"w_rec": w_rec} if save or not fused else {}),
        hop=hop, hn=hn, c=c, lengths=_lengths(lengths, dev),
        consts=_consts(forget_bias, cell_clip, proj_clip, acc, x),
        y=torch.empty(B, T, P, dtype=op, device=dev), m=torch.empty(B, T, H, dtype=op, device=dev),
        # Buffers a variant never touches (no projection: HAS_PROJ=False; inference: SAVE=False) alias others.
        part=torch.empty(plan["fwd_proj"].grid[2], B, P, dtype=acc, device=dev) if "fwd_proj" in plan else hn,
        # the fused reduce's counters, one a (row block, P slice): zero between steps (the last split resets its own)
        **({"tickets": torch.zeros(plan["fwd_proj"].grid[0] * plan["fwd_proj"].grid[1], dtype=torch.int32,
                                   device=dev)} if "fwd_reduce" not in plan else {}),
        # zeros: the kernels leave the padded positions of these two caches unwritten, and an operator's outputs
        # (they are outputs of elmo_fast::lstmp_triton) must not depend on what memory held before
        cpre=torch.zeros(B, T, H, dtype=acc, device=dev) if save else c,
        hpre=torch.zeros(B, T, P, dtype=acc, device=dev) if save else hn,
        hprev=torch.empty(B, T, P, dtype=op, device=dev) if save else hop,
    )
    _check_dtypes(plan, bufs, "fwd")
    return plan, bufs


def lstmp_fwd(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, *, cell_clip, proj_clip, forget_bias, reverse,
              residual, save: bool):
    """Host launcher of the forward pass. Returns (y, h_n, c_n, cache) where cache is None unless ``save``.

    No host sync: all T steps run (rows mask themselves); every tensor's shape follows from the arguments'.
    On CUDA the time loop replays from a CUDA graph once its call signature was seen (``lstmp_graphs``); the
    cache then lives in the graph's slot, leased to the caller until its backward.
    """
    kw = dict(cell_clip=cell_clip, proj_clip=proj_clip, forget_bias=forget_bias, reverse=reverse, residual=residual)
    how = None if tracing(x) else graphs.mode(x.device)
    slot = None
    if how is not None:
        key = (tuple(x.shape), x.dtype, tuple(w_in.shape), w_rec.dtype, w_proj is not None, tuple(h0.shape), h0.dtype,
               c0.dtype, x.device, tuple(sorted(kw.items())), save, x.shape[0] <= fused_reduce_rows(),
               pdl_on(x.device))
        slot = graphs.POOL.acquire(key, how, lambda: _static(*fwd_setup(x, w_in, w_rec, bias, w_proj, h0, c0, lengths,
                                                                        save=save, **kw), _FWD_INPUTS))
    if slot is None:
        plan, bufs = fwd_setup(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, save=save, **kw)
        _fwd_loop(plan, bufs)
        fresh = False
    else:
        try:
            bufs = slot.run("fwd", _fwd_loop, lambda b: _fill_fwd(b, x, w_in, w_rec, bias, w_proj, h0, c0, lengths))
        except Exception as exc:  # noqa: BLE001 - a capture that fails: this signature runs eagerly from now on
            graphs.POOL.fail(slot, exc)
            return lstmp_fwd(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, save=save, **kw)
        fresh = True  # y, h_n, c_n must not be the slot's buffers, which the next replay overwrites
    cache = (bufs["z"], bufs["cpre"], bufs["hpre"], bufs["hprev"], bufs["m"], bufs["lengths"]) if save else None
    if save and fresh:  # aliases (sharing the version counters): autograd must not attach its node to the slot's own
        cache = tuple(t.detach() for t in cache)  # tensors, which would keep the node, and so the lease, alive
    out = (bufs["y"].to(x.dtype, copy=fresh), bufs["hn"].to(h0.dtype, copy=fresh), bufs["c"].to(c0.dtype, copy=fresh),
           cache)
    if slot is not None and not save:  # given back only once its results are copied out: another thread may take
        graphs.POOL.give_back(slot)  # it next and fill its buffers
    return out


def _static(plan: dict, bufs: dict, inputs: tuple[str, ...]) -> tuple[dict, dict]:
    """A loop graph's (plan, buffers) from a setup's: the ``inputs`` buffers, which may alias the caller's tensors,
    are copied (the setup allocated the rest), aliases among the buffers kept (``w_proj`` is ``w_rec`` without a
    projection)."""
    own = {}
    for name, t in bufs.items():
        if name in inputs and id(t) not in own:
            own[id(t)] = t.clone()
    return plan, {name: own.get(id(t), t) for name, t in bufs.items()}


_FWD_INPUTS = ("x", "bias", "w_rec", "w_proj", "lengths")  # forward buffers that may alias the caller's tensors
_BWD_INPUTS = ("dy", "c0")  # the same of backward (its weights, caches and lengths are the forward slot's)


def _fill_fwd(bufs, x, w_in, w_rec, bias, w_proj, h0, c0, lengths) -> None:
    """The call's inputs into a loop graph's forward buffers (what ``fwd_setup`` computes, in place)."""
    D, G, op = x.shape[2], w_in.shape[1], bufs["gx"].dtype
    torch.matmul(x.reshape(-1, D).to(op), w_in.to(op), out=bufs["gx"].view(-1, G))
    for name, t in (("x", x), ("bias", bias), ("w_rec", w_rec), ("w_proj", w_proj), ("hop", h0), ("hn", h0),
                    ("c", c0), ("lengths", lengths)):
        if t is not None and name in bufs:
            bufs[name].copy_(t)
    if "w_rec_g" in bufs:
        interleave_gates(w_rec, out=bufs["w_rec_g"])


def bwd_setup(dy, dh_n, dc_n, x, w_rec, w_proj, c0, cache, *, cell_clip, proj_clip, reverse, residual
              ) -> tuple[dict, dict]:
    """(plan, buffers) of a backward call (see ``fwd_setup``)."""
    z, cpre, hpre, hprev, m, lengths = cache
    B, T, _ = x.shape
    H, P = cpre.shape[2], hprev.shape[2]
    dev, op, acc = x.device, w_rec.dtype, cpre.dtype
    plan = _plan_for(B, T, H, P, op, dev, True, w_proj, cell_clip, proj_clip, reverse, residual, tracing(x))
    bufs = dict(
        dy=dy.to(op).contiguous(), dh=dh_n.to(acc).contiguous().clone(), dc=dc_n.to(acc).contiguous().clone(),
        w_rec=w_rec, w_proj=w_rec if w_proj is None else w_proj, z=z, cpre=cpre, hpre=hpre,
        c0=c0.to(acc).contiguous(), lengths=lengths, consts=_consts(0.0, cell_clip, proj_clip, acc, x),
        part=torch.empty(plan["bwd_rec"].grid[2], B, P, dtype=acc, device=dev),
        dz=torch.empty(B, T, 4 * H, dtype=op, device=dev),
        dbp=torch.empty(T, triton.cdiv(B, plan["bwd_cell"].tile.BM), 4 * H, dtype=acc, device=dev),
        dhpre=torch.empty(B, T, P, dtype=plan["bwd_cell"].args[0][1], device=dev),
    )
    _check_dtypes(plan, bufs, "bwd")
    return plan, bufs


def lstmp_bwd(dy, dh_n, dc_n, x, w_in, w_rec, w_proj, c0, cache, *, cell_clip, proj_clip, reverse, residual,
              needs=(True,) * 5, slot=None):
    """Host launcher of backward through time. Returns (dx, dw_in, dw_rec, dbias, dw_proj, dh0, dc0).

    ``needs`` flags (x, w_in, w_rec, bias, w_proj): the after-loop GEMM of a gradient nobody needs is skipped
    (None returned); the time loop itself always runs, every gradient depends on it. ``slot``: the loop-graph
    slot whose buffers hold ``cache`` (its forward ran from a graph): the loop then replays from the slot's graph.
    """
    kw = dict(cell_clip=cell_clip, proj_clip=proj_clip, reverse=reverse, residual=residual)
    if slot is None:
        plan, bufs = bwd_setup(dy, dh_n, dc_n, x, w_rec, w_proj, c0, cache, **kw)
        _bwd_loop(plan, bufs)
        dh0, dc0 = bufs["dh"], bufs["dc"]
    else:
        fwd = slot.buffers("fwd")
        cache = (*cache[:5], fwd["lengths"])  # the saved caches are the slot's (its lease checked that)
        if "bwd" not in slot.phases:
            w_p = None if w_proj is None else fwd["w_proj"]
            slot.phases["bwd"] = _static(*bwd_setup(dy, dh_n, dc_n, x, fwd["w_rec"], w_p, c0, cache, **kw), _BWD_INPUTS)
        try:
            bufs = slot.run("bwd", _bwd_loop, lambda b: _fill_bwd(b, dy, dh_n, dc_n, c0))
        except Exception as exc:  # noqa: BLE001 - a capture that fails: eager from the same saved caches
            graphs.POOL.fail(slot, exc)
            return lstmp_bwd(dy, dh_n, dc_n, x, w_in, w_rec, w_proj, c0, cache, needs=needs, **kw)
        dh0, dc0 = bufs["dh"].clone(), bufs["dc"].clone()
    return (*_after_loop(bufs, x, w_in, w_proj, cache, residual, needs), dh0, dc0)


def _fill_bwd(bufs, dy, dh_n, dc_n, c0) -> None:
    for name, t in (("dy", dy), ("dh", dh_n), ("dc", dc_n), ("c0", c0)):
        bufs[name].copy_(t)


def _after_loop(bufs, x, w_in, w_proj, cache, residual, needs) -> tuple:
    """(dx, dw_in, dw_rec, dbias, dw_proj): one GEMM each over all B*T tokens, operands in the weights' dtype
    (zeros at padding), into fresh tensors; dbias the sum of the backward cell kernel's partials."""
    B, T, D = x.shape
    op = bufs["dz"].dtype
    _, _, _, hprev, m, lengths = cache
    dz2 = bufs["dz"].reshape(B * T, -1)
    dx = dw_in = dw_rec = dbias = dw_proj = None
    if needs[1]:
        dw_in = torch.matmul(x.reshape(-1, D).to(op).t(), dz2)
    if needs[2]:
        dw_rec = torch.matmul(hprev.reshape(B * T, -1).t(), dz2)
    if needs[3]:  # the bwd cell kernel's column sums of dz (fp32 values, before their rounding to the operand dtype)
        dbias = bufs["dbp"].sum((0, 1))
    if w_proj is not None and needs[4]:
        dw_proj = torch.matmul(m.reshape(B * T, -1).t(), bufs["dhpre"].reshape(B * T, -1))
    if needs[0]:
        dx = torch.matmul(dz2, w_in.to(op).t()).reshape(B, T, D)
        if residual:
            valid = (torch.arange(T, device=x.device)[None, :] < lengths[:, None]).unsqueeze(-1)
            dx = dx + torch.where(valid, bufs["dy"], torch.zeros((), dtype=op, device=x.device))
    return dx, dw_in, dw_rec, dbias, dw_proj


# ------------------------------------------------------------------------------------------ operators
Tensor = torch.Tensor


def _forward_op(x: Tensor, w_in: Tensor, w_rec: Tensor, bias: Tensor, w_proj: Tensor | None, h0: Tensor,
                c0: Tensor, lengths: Tensor, cell_clip: float | None, proj_clip: float | None, forget_bias: float,
                reverse: bool, residual: bool, save: bool
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, h_n, c_n, z, cpre, hpre, hprev, m): the step caches of training (placeholders without ``save``)."""
    y, h_n, c_n, cache = lstmp_fwd(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=cell_clip,
                                   proj_clip=proj_clip, forget_bias=forget_bias, reverse=reverse, residual=residual,
                                   save=save)
    return (y, h_n, c_n, *(cache[:5] if save else (nothing(x) for _ in range(5))))


def _backward_op(dy: Tensor | None, dh_n: Tensor | None, dc_n: Tensor | None, x: Tensor, w_in: Tensor,
                 w_rec: Tensor, w_proj: Tensor | None, h0: Tensor, c0: Tensor, lengths: Tensor, z: Tensor,
                 cpre: Tensor, hpre: Tensor, hprev: Tensor, m: Tensor, cell_clip: float | None,
                 proj_clip: float | None, reverse: bool, residual: bool, needs: list[bool]
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw_in, dw_rec, dbias, dw_proj, dh0, dc0) in the operand / accumulation dtypes; ``needs`` flags
    (x, w_in, w_rec, bias, w_proj): a gradient not needed is a placeholder."""
    return _backward_grads(dy, dh_n, dc_n, x, w_in, w_rec, w_proj, h0, c0, lengths, z, cpre, hpre, hprev, m,
                           cell_clip, proj_clip, reverse, residual, needs)


def _backward_grads(dy, dh_n, dc_n, x, w_in, w_rec, w_proj, h0, c0, lengths, z, cpre, hpre, hprev, m, cell_clip,
                    proj_clip, reverse, residual, needs, slot=None):
    """``_backward_op``; with ``slot`` (see ``lstmp_bwd``) called directly, as the operator takes tensors only."""
    if dy is None:
        dy = torch.zeros(x.shape[0], x.shape[1], h0.shape[1], dtype=x.dtype, device=x.device)
    dh_n = torch.zeros_like(h0) if dh_n is None else dh_n
    dc_n = torch.zeros_like(c0) if dc_n is None else dc_n
    cache = (z, cpre, hpre, hprev, m, _lengths(lengths, x.device))
    grads = lstmp_bwd(dy, dh_n, dc_n, x, w_in, w_rec, w_proj, c0, cache, cell_clip=cell_clip, proj_clip=proj_clip,
                      reverse=reverse, residual=residual, needs=needs, slot=slot)
    return tuple(nothing(x) if g is None else g for g in grads)


_lstmp_op = triton_operator("lstmp_triton", _forward_op)
_lstmp_backward_op = triton_operator("lstmp_triton_backward", _backward_op)


def _setup_context(ctx, inputs, output):
    x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip, forget_bias, reverse, residual, save = inputs
    ctx.saved = save
    ctx.flags = (cell_clip, proj_clip, reverse, residual)
    ctx.dtypes = [None if t is None else t.dtype for t in (x, w_in, w_rec, bias, w_proj, h0, c0)]
    ctx.set_materialize_grads(False)
    if save:
        ctx.save_for_backward(x, w_in, w_rec, w_proj, h0, c0, lengths, *output[3:])
        ctx.lease = graphs.POOL.lease(output[3])  # the loop graph's slot holding the caches (None: eager)


def _backward(ctx, dy, dh_n, dc_n, *_):
    """Backward through time from the step caches of forward (see the module docstring); gradients in the
    inputs' dtypes."""
    if not ctx.saved:
        raise RuntimeError("lstmp (triton): this call ran without save=True and kept nothing for backward")
    need = ctx.needs_input_grad
    lease = ctx.lease
    if lease is not None and not tracing(*ctx.saved_tensors):  # the caches are a loop graph's buffers
        grads = _backward_grads(dy, dh_n, dc_n, *ctx.saved_tensors, *ctx.flags, list(need[:5]), slot=lease.check())
        lease.release()
    else:
        grads = _lstmp_backward_op(dy, dh_n, dc_n, *ctx.saved_tensors, *ctx.flags, list(need[:5]))
    grads = [g.to(dt) if need[i] and dt is not None else None for i, (g, dt) in enumerate(zip(grads, ctx.dtypes))]
    return (*grads, *(None,) * 7)


_lstmp_op.register_autograd(_backward, setup_context=_setup_context)


def lstmp_triton(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, *, cell_clip=None, proj_clip=None,
                 forget_bias=1.0, reverse=False, residual=False):
    """Triton LSTMP chain with the arguments and results of ``lstmp_reference`` (see there for shapes).

    Differentiable w.r.t. x, w_in, w_rec, bias, w_proj, h0 and c0 (the operator ``elmo_fast::lstmp_triton``,
    its backward ``elmo_fast::lstmp_triton_backward``). Inference (no grad needed) skips the backward caches.
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
    train = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    out = _lstmp_op(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, None if cell_clip is None else float(cell_clip),
                    None if proj_clip is None else float(proj_clip), float(forget_bias), bool(reverse),
                    bool(residual), train)
    return out[0], out[1], out[2]
