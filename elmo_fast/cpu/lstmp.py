"""CPU backend of the LSTMP chain (one layer, one direction): forward and backward through time.

The math is ``elmo_fast.reference.lstmp.lstmp_reference`` (spec §3.2-§3.5), which is the oracle; this file only
changes the order of the work. Shapes: B batch, T padded steps, D input width, H cell, P projection, G = 4H gates,
N = Σ lengths (the valid (row, step) positions).

Design
------
*Packed rows.* Rows are visited in order of decreasing length, and at step ``s`` row ``r`` works on time position
``s`` (forward) or ``len_r - 1 - s`` (reverse: each row reversed within its own length). The rows still running
at step ``s`` are then a prefix ``0..n_s-1`` of the sorted batch in both directions, so padded positions cost
nothing and no step needs a mask. All per-position tensors live in "packed" buffers of N rows, step-major.

*Products.* The input projection ``x · w_in + bias`` (forget bias folded in) is one GEMM over the N positions
before the loop. Per step only the recurrent parts run: ``h · w_rec`` (added to the step's input projection in
the same oneDNN pass) and ``m · w_proj``, with the weights packed once per call (``packed.PackedLinear``; the
module's ``PackedWeightCache`` keeps them across calls while the weights do not change). The GEMMs over all
positions (input projection, weight gradients, ``dx``) go through ``gemm.gemm``: MKL or oneDNN, whichever this
machine runs faster for the shape.

*Training* (``_LSTMPFunction``). Forward writes, per position, the activated gates (σ(i), tanh(j), σ(f+1), σ(o)),
the pre-clip cell, tanh of the clipped cell, ``m`` and the pre-clip projection into preallocated (N, ·) buffers:
pre-clip values make the clip masks exact (torch.clamp's convention: gradient 1 on [-clip, clip]). Backward walks
the steps in reverse with two per-step products (``dh · w_projᵀ`` and ``dz · w_recᵀ``), and computes every weight
gradient as one GEMM over all N positions after the loop: ``dW_in = xᵀ dz``, ``dW_rec = h_prevᵀ dz``,
``db = Σ dz``, ``dW_proj = mᵀ dh``, ``dx = dz · W_inᵀ``. Nothing it allocates per step grows with T.

*Inference* saves nothing, and projects identical input rows once (layer 0's inputs are context-free token
vectors, so repeated words repeat rows).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from torch.library import custom_op

from .ext import cpu_ext_for, denormals_flushed
from .gemm import gemm, gemm_add, uses_onednn
from .._backend import BackendUnavailableError
from ..ops._library import nothing, qualname, tracing, wants_grad
from .packed import PackedLinear, PackedWeightCache, _Panels, bf16_supported, cache_by_id, pack_pays

_SAVED = ("xs", "gates", "c_pre", "tc", "m_all", "h_pre", "hs")  # the packed buffers training keeps for backward


@dataclass
class _Plan:
    """Where every valid (row, step) position goes; built on the host from the lengths (a CPU tensor)."""

    order: torch.Tensor  # (B,) sorted row -> original row
    inverse: torch.Tensor  # (B,) original row -> sorted row
    identity: bool  # order is 0..B-1 (nothing to permute)
    n: list[int]  # rows running at each step: non-increasing, n[0] = rows with length > 0
    off: list[int]  # first packed position of each step
    flat: torch.Tensor  # (N,) packed position -> original row * T + time position
    hprev: torch.Tensor  # (N,) row of cat([h0 sorted, packed h]) that is h_{s-1} of each position

    @property
    def N(self) -> int:
        return self.off[-1] + self.n[-1] if self.n else 0

    @classmethod
    def build(cls, lengths: torch.Tensor, T: int, reverse: bool) -> "_Plan":
        ln = lengths.numpy().astype(np.int64)  # CPU tensor: a view, no device synchronisation
        B = ln.shape[0]
        order = np.argsort(-ln, kind="stable")
        sl = ln[order]
        K = int(sl[0]) if B else 0
        n = B - np.cumsum(np.bincount(sl, minlength=K + 1))[:K]  # rows with length > s, s = 0..K-1
        off = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        step = np.repeat(np.arange(K), n)
        row = np.arange(off[-1]) - off[step]
        t = (sl[row] - 1 - step) if reverse else step
        hprev = np.where(step == 0, row, B + off[np.maximum(step, 1) - 1] + row)
        as_t = torch.from_numpy
        return cls(as_t(order), as_t(np.argsort(order)), bool((order == np.arange(B)).all()), n.tolist(),
                   off[:-1].tolist(), as_t(order[row] * T + t), as_t(hprev))

    def sort(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone() if self.identity else t.index_select(0, self.order)

    def unsort(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.identity else t.index_select(0, self.inverse)

    def scatter(self, rows: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """The (B*T, ·) tensor whose row ``flat[i]`` is packed row ``i``: zeros at the padded positions; uninitialised
        before the copy where there are none (every length is T, so ``flat`` is a permutation of all B*T rows)."""
        out = rows.new_empty if self.N == B * T else rows.new_zeros
        return out(B * T, rows.shape[1]).index_copy_(0, self.flat, rows)

    def ends(self, s: int) -> int:
        """Rows ``ends(s)..n[s]-1`` run their last step at step ``s``."""
        return self.n[s + 1] if s + 1 < len(self.n) else 0


def _weights(w_rec, w_proj, B, cache: PackedWeightCache | None, dtype=None, transposed=False, uses=None):
    """Per-step weights: forward (·w_rec, ·w_proj) or, with ``transposed``, backward (·w_recᵀ, ·w_projᵀ); packed
    for oneDNN, except that with ``uses`` (training's forward: the weights change before the next call, so a pack
    serves only this call's ``uses`` steps) each is packed only where that pays on this machine (``pack_pays``),
    else run by torch.mm.

    ``cache`` keeps the packed copies across calls, per weight version. Backward takes from it only the packs that
    copy a transposed view (column-major weights, as ``elmo_fast.LSTMP`` passes them: 40 MiB of transposing copy
    per chain at 512/4096/512), so that a weight version backpropagated more than once (gradient accumulation,
    weights shared by chains) is transposed and packed once; a row-major weight packs without a copy, and keeping
    its pack would only hold memory between training steps."""
    out = []
    for w, role in ((w_rec, "rec"), (w_proj, "proj")):
        if w is None:
            out.append(None)
            continue
        keep = cache is not None and (not transposed or not w.is_contiguous())
        if transposed:
            w, role = w.t(), role + "_t"
        pack = uses is None or pack_pays(w, B, uses)
        out.append(cache.get(w, B, dtype, role) if keep else PackedLinear(w, B, dtype, pack))
    return out


def _cell_forward(z, c_prev, cell_clip, g_out=None, c_pre_out=None, tc_out=None, m_out=None):
    """Gate nonlinearities and the cell update of one step.

    z (n, 4H): pre-activations i|j|f|o with every bias; c_prev (n, H): the clipped cell. Returns (c, m): the
    clipped cell (the next state) and m = σ(o)·tanh(c). With the ``*_out`` buffers (training) it also writes the
    activated gates, the pre-clip cell and tanh(c) there; without them z may be overwritten.
    """
    H = c_prev.shape[1]
    ext = cpu_ext_for(z, c_prev, g_out, c_pre_out, tc_out, m_out)
    if ext is not None:  # one pass instead of ~8
        c, m = torch.empty_like(c_prev), (m_out if m_out is not None else torch.empty_like(c_prev))
        ext.cell_forward(z, c_prev, cell_clip, g_out, c_pre_out, c, tc_out, m)
        return c, m
    g = z if g_out is None else g_out
    torch.tanh(z[:, H : 2 * H], out=g[:, H : 2 * H])
    torch.sigmoid(z[:, :H], out=g[:, :H])
    torch.sigmoid(z[:, 2 * H :], out=g[:, 2 * H :])
    i, j, f, o = g[:, :H], g[:, H : 2 * H], g[:, 2 * H : 3 * H], g[:, 3 * H :]
    c = torch.mul(f, c_prev, out=c_pre_out) if c_pre_out is not None else f * c_prev
    c.addcmul_(i, j)
    if cell_clip is not None:
        c = torch.clamp(c, -cell_clip, cell_clip) if c_pre_out is not None else c.clamp_(-cell_clip, cell_clip)
    if tc_out is None:
        return c, torch.tanh(c).mul_(o)
    return c, torch.mul(o, torch.tanh(c, out=tc_out), out=m_out)


def _cell_backward(dm, dc, g, c_pre, tc, c_prev, cell_clip, dz_out):
    """Backward of ``_cell_forward``: dm, dc (n, H) the gradients w.r.t. m and w.r.t. the clipped cell (from the
    next step). Writes dz (n, 4H) into ``dz_out``; returns the gradient w.r.t. c_prev."""
    H = c_prev.shape[1]
    ext = cpu_ext_for(dm, dc, g, c_pre, tc, c_prev, dz_out)
    if ext is not None:  # one pass instead of ~20
        ext.cell_backward(dm, dc, g, c_pre, tc, c_prev, cell_clip, dz_out, dc)
        return dc
    i, j, f, o = g[:, :H], g[:, H : 2 * H], g[:, 2 * H : 3 * H], g[:, 3 * H :]
    dc = torch.addcmul(dc, dm * o, 1.0 - tc * tc)  # through m = o·tanh(c)
    if cell_clip is not None:
        dc.masked_fill_(c_pre.abs() > cell_clip, 0.0)
    torch.mul(dc * j, i * (1.0 - i), out=dz_out[:, :H])
    torch.mul(dc * i, 1.0 - j * j, out=dz_out[:, H : 2 * H])
    torch.mul(dc * c_prev, f * (1.0 - f), out=dz_out[:, 2 * H : 3 * H])
    torch.mul(dm * tc, o * (1.0 - o), out=dz_out[:, 3 * H :])
    return dc.mul_(f)


def _clip(t: torch.Tensor, clip: float | None) -> torch.Tensor:
    return t if clip is None else torch.clamp(t, -clip, clip)


def _may_repeat(xs: torch.Tensor) -> bool:
    """Whether at least a quarter of the rows of ``xs`` (N, D) may repeat another row, what the inference's dedup needs
    to pay off: counts the distinct values of a random projection of the rows (equal rows project alike, so there
    are at least as many distinct rows as values; should a product round two equal rows apart, only a dedup is
    missed). 0.1 ms at 849 x 512, against ~3-6 ms for ``torch.unique(dim=0)``, which sorts rows; a layer's inputs
    other than the first (the LSTM outputs) never repeat."""
    keys = torch.mv(xs, _probe(xs.shape[1], xs.dtype))
    return _dedup_pays(torch.unique(keys).numel(), xs.shape[0])


def _dedup_pays(distinct: int, n: int) -> bool:
    """At most three quarters of the ``n`` rows are distinct: projecting only those pays for the dedup."""
    return distinct * 4 <= n * 3


@functools.lru_cache(maxsize=None)
def _probe(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).add_(0.5).to(dtype)


def _forward(x, w_in, w_rec, bias, w_proj, h0, c0, plan: _Plan, *, cell_clip, proj_clip, forget_bias, residual,
             cache, save: bool, dtype=None, buffers: PackedWeightCache | None = None):
    """The time loop. Returns (y, h_n, c_n, saved): ``saved`` holds the packed buffers backward needs (``_SAVED``:
    (B*T, ·) tensors whose first N rows are used, None for ``h_pre`` without a projection), or None. ``buffers``:
    the cache whose ``reusable`` buffers training's saved activations take (fresh tensors without it)."""
    B, T, D = x.shape
    H, P, N = c0.shape[1], h0.shape[1], plan.N
    bias_f = bias.clone()
    bias_f[2 * H : 3 * H] += forget_bias
    # Training keeps its packed buffers for backward in (B*T, ·) tensors of which the first N rows are used (the
    # others zero), so that their shapes follow from the arguments' (the operator's fake implementation).
    full = dict.fromkeys(_SAVED)

    def packed(name, width):
        rows = B * T if save else N
        full[name] = x.new_empty(rows, width) if buffers is None else buffers.reusable(name, (rows, width), x.dtype)
        full[name][N:].zero_()
        return full[name][:N]

    xs = torch.index_select(x.reshape(B * T, D), 0, plan.flat, out=packed("xs", D))  # (N, D) packed inputs
    if save and N == B * T and dtype is None and uses_onednn(xs, w_in, bias_f):
        # training, every row full length, the projection on oneDNN (which has no out=): its own result is the
        # saved buffer, not copied into a reused one (a 20 MiB copy, 1.6 ms a chain at the original sizes)
        out = full["gates"] = None
    else:  # the (N, 4H) input projections: saved for backward in training, a reused scratch buffer in inference
        out = cache.scratch((N, 4 * H), x.dtype) if cache is not None and not save else packed("gates", 4 * H)
    if dtype is None:
        def project(rows, out=None):
            return gemm(rows, w_in, bias_f, out)
    else:  # bf16 inference: the input projection packed like the per-step weights
        w_lin = PackedLinear(w_in, N, dtype) if cache is None else cache.get(w_in, N, dtype, "in")

        def project(rows, out=None):
            return out.copy_(w_lin(rows)).add_(bias_f) if out is not None else w_lin(rows).add_(bias_f)
    gates = None
    if not save and N > 1 and _may_repeat(xs):  # inference: project each distinct input row once where that pays
        uniq, inv = torch.unique(xs, dim=0, return_inverse=True)
        if _dedup_pays(uniq.shape[0], N):
            gates = torch.index_select(project(uniq), 0, inv, out=out)
    if gates is None:
        gates = project(xs, out)  # (N, 4H)
        if full["gates"] is None and save:
            full["gates"] = gates
    # Training's weights change every step: its forward packs a weight for this call only, and only where that pays
    # over the call's steps on this machine (packing w_rec is a 32 MiB transposing copy and a reorder: 13-30 ms
    # on the Xeon for 0.16 ms saved a step at B=16, 40-60 ms on the EPYC for 7.5 ms a step); backward's packing
    # is cheap.
    rec, proj = _weights(w_rec, w_proj, B, cache, dtype, uses=len(plan.n) if save else None)
    hs = packed("hs", P)  # the (clipped) outputs h_t, packed
    if save:
        c_pre, tc, m_all = (packed(k, H) for k in ("c_pre", "tc", "m_all"))
        h_pre = packed("h_pre", P) if proj is not None else None
    h_fin, c_fin = plan.sort(h0), plan.sort(c0)
    saved = (c_pre, tc, m_all, h_pre) if save else (None,) * 4
    loop = _loop_ext(rec, proj, gates, h_fin, c_fin, hs, *saved, forward=True)
    if loop is not None:  # the same steps, with no dispatch between the products (csrc/cpu/lstmp_loop.cpp)
        proj_t, proj_w = _proj_operands(proj)
        loop.forward_loop(plan.n, plan.off, gates, h_fin, c_fin, hs, *saved, rec.packed.t, proj_t, proj_w, cell_clip,
                          proj_clip)
    else:
        h, c = h_fin, c_fin
        for s, (n, o) in enumerate(zip(plan.n, plan.off)):
            blk = slice(o, o + n)
            z = rec(h[:n], add=gates[blk])
            if save:
                c, m = _cell_forward(z, c[:n], cell_clip, gates[blk], c_pre[blk], tc[blk], m_all[blk])
            else:
                c, m = _cell_forward(z, c[:n], cell_clip)
            if proj is None:
                h = hs[blk].copy_(m)
            else:
                hp = proj(m)
                if save:
                    h_pre[blk] = hp
                h = hs[blk].copy_(hp) if proj_clip is None else torch.clamp(hp, -proj_clip, proj_clip, out=hs[blk])
            e = plan.ends(s)
            if e < n:  # rows e..n-1 ran their last step: their state is final
                h_fin[e:n] = h[e:]
                c_fin[e:n] = c[e:]
    out = hs + xs if residual else hs
    y = plan.scatter(out, B, T).view(B, T, P)
    return y, plan.unsort(h_fin), plan.unsort(c_fin), tuple(full[k] for k in _SAVED) if save else None


# ------------------------------------------------------------------------------------------ the operators
Tensor = torch.Tensor


@custom_op(qualname("lstmp_cpu"), mutates_args=())
def _lstmp_cpu_op(x: Tensor, w_in: Tensor | None, w_rec: Tensor | None, w_stack: Tensor | None, bias: Tensor,
                  w_proj: Tensor | None, h0: Tensor, c0: Tensor, lengths: Tensor, cell_clip: float | None,
                  proj_clip: float | None, forget_bias: float, reverse: bool, residual: bool, save: bool,
                  cache_id: int, bf16: bool
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, h_n, c_n, *saved): ``saved`` are the packed buffers of ``_SAVED``, (B*T, ·) of which the first
    N = Σ lengths rows hold the positions (placeholders without ``save``, and ``h_pre`` without a projection).

    ``w_stack``: when w_in and w_rec are the two row blocks of one (D+P, 4H) tensor (the model's ``W_0``), that
    tensor instead (w_in and w_rec are then None): its gradient is then one GEMM, ``[x ; h_prev]ᵀ dz``, with no
    slice gradients to expand and add. ``cache_id``: the ``PackedWeightCache`` (by its id) that keeps packed
    weights across inference calls, -1 for none; ``bf16``: inference with bf16 products.

    Forward and backward run with denormals flushed (with ``elmo_fast._cpu``: ``ext.denormals_flushed``), as TF
    runs them: a saturated gate (pre-activation below -87) gives denormal states, and each product reading one takes
    microcode assists (bench/results/cpu_train.md: B=32, T=20, 4096/512, an output gate bias of -100: on 1% of the
    units 119 against 101 ms, on all 7.5 s against 0.10 s)."""
    if w_stack is not None:
        w_in, w_rec = w_stack[: x.shape[2]], w_stack[x.shape[2] :]
    plan = _Plan.build(lengths.cpu(), x.shape[1], reverse)
    kw = dict(cell_clip=cell_clip, proj_clip=proj_clip, forget_bias=forget_bias, residual=residual)
    with denormals_flushed():
        if save:  # weights change every training step: packed afresh, never from the inference cache
            y, h_n, c_n, saved = _forward(x, w_in, w_rec, bias, w_proj, h0, c0, plan, cache=None, save=True,
                                          buffers=cache_by_id(cache_id), **kw)
            saved = [nothing(x) if t is None else t for t in saved]
        else:
            y, h_n, c_n, _ = _forward(x, w_in, w_rec, bias, w_proj, h0, c0, plan, cache=cache_by_id(cache_id),
                                      save=False, dtype=torch.bfloat16 if bf16 else None, **kw)
            saved = [nothing(x) for _ in _SAVED]
    return (y, h_n, c_n, *saved)


@_lstmp_cpu_op.register_fake
def _(x, w_in, w_rec, w_stack, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip, forget_bias, reverse, residual,
      save, cache_id, bf16):
    B, T, D = x.shape
    H, P = c0.shape[1], h0.shape[1]
    widths = dict(xs=D, gates=4 * H, c_pre=H, tc=H, m_all=H, h_pre=P if w_proj is not None else None, hs=P)
    saved = [x.new_empty(B * T, widths[k]) if save and widths[k] is not None else nothing(x) for k in _SAVED]
    return (x.new_empty(B, T, P), h0.new_empty(B, P), c0.new_empty(B, H), *saved)


@custom_op(qualname("lstmp_cpu_backward"), mutates_args=())
def _lstmp_cpu_backward(dy: Tensor | None, dh_n: Tensor | None, dc_n: Tensor | None, w_in: Tensor | None,
                        w_rec: Tensor | None, w_stack: Tensor | None, w_proj: Tensor | None, h0: Tensor, c0: Tensor,
                        lengths: Tensor, xs: Tensor, gates: Tensor, c_pre: Tensor, tc: Tensor, m_all: Tensor,
                        h_pre: Tensor, hs: Tensor, T: int, cell_clip: float | None, proj_clip: float | None,
                        reverse: bool, residual: bool, cache_id: int, needs: list[bool]
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward through time (see the module docstring): (dx, dw_in, dw_rec, dw_stack, db, dw_proj, dh0, dc0);
    ``needs`` flags (x, w_in, w_rec, w_stack, bias, w_proj), a gradient not needed is a placeholder; ``cache_id``:
    the forward's ``PackedWeightCache`` (-1: none), see ``_weights``. Denormals flushed, as in the forward."""
    with denormals_flushed():
        return _backward_through_time(dy, dh_n, dc_n, w_in, w_rec, w_stack, w_proj, h0, c0, lengths, xs, gates,
                                      c_pre, tc, m_all, h_pre, hs, T, cell_clip, proj_clip, reverse, residual,
                                      cache_id, needs)


def _backward_through_time(dy, dh_n, dc_n, w_in, w_rec, w_stack, w_proj, h0, c0, lengths, xs, gates, c_pre, tc,
                           m_all, h_pre, hs, T, cell_clip, proj_clip, reverse, residual, cache_id, needs):
    plan = _Plan.build(lengths.cpu(), T, reverse)
    N = plan.N
    B, D, P = h0.shape[0], xs.shape[1], hs.shape[1]
    xs, gates, c_pre, tc, m_all, hs = (t[:N] for t in (xs, gates, c_pre, tc, m_all, hs))
    h_pre = h_pre[:N] if w_proj is not None else None
    if w_stack is not None:
        w_in, w_rec = w_stack[:D], w_stack[D:]
    dys = dy.reshape(B * T, P).index_select(0, plan.flat) if dy is not None else xs.new_zeros(N, P)  # packed
    # gradients w.r.t. the state after the current step
    carry_h = plan.sort(dh_n) if dh_n is not None else torch.zeros_like(h0)
    carry_c = plan.sort(dc_n) if dc_n is not None else torch.zeros_like(c0)
    c_init = plan.sort(c0)
    cache = cache_by_id(cache_id)
    dz = torch.empty_like(gates) if cache is None else cache.reusable("dz", tuple(gates.shape), gates.dtype)
    dh_all = torch.empty_like(hs) if w_proj is not None else None
    rec_t, proj_t = _weights(w_rec, w_proj, B, cache, transposed=True)
    loop = _loop_ext(rec_t, proj_t, dys, carry_h, carry_c, c_init, gates, c_pre, tc, h_pre, dh_all, dz)
    if loop is not None:  # the same steps, with no dispatch between the products (csrc/cpu/lstmp_loop.cpp)
        loop.backward_loop(plan.n, plan.off, dys, carry_h, carry_c, c_init, gates, c_pre, tc, h_pre, dh_all, dz,
                           rec_t.packed.t, None if proj_t is None else proj_t.packed.t, cell_clip, proj_clip)
    else:
        for s in range(len(plan.n) - 1, -1, -1):
            n, o = plan.n[s], plan.off[s]
            blk = slice(o, o + n)
            dh = dys[blk] + carry_h[:n]
            if proj_t is not None:
                if proj_clip is not None:
                    dh.masked_fill_(h_pre[blk].abs() > proj_clip, 0.0)
                dh_all[blk] = dh
                dh = proj_t(dh)
            po = plan.off[s - 1] if s else 0
            c_prev = _clip(c_pre[po : po + n], cell_clip) if s else c_init[:n]
            carry_c[:n] = _cell_backward(dh, carry_c[:n], gates[blk], c_pre[blk], tc[blk], c_prev, cell_clip, dz[blk])
            carry_h[:n] = rec_t(dz[blk])
    dx, dw_in, dw_rec, dw_stack, db, dw_proj = (nothing(xs) for _ in range(6))
    if needs[0]:
        dxs = gemm_add(dys, dz, w_in.t(), reuse=True) if residual else gemm(dz, w_in.t())  # dys: packed above
        dx = plan.scatter(dxs, B, T).view(B, T, D)
    h_prev = torch.cat([plan.sort(h0), hs]).index_select(0, plan.hprev) if any(needs[1:4]) else None
    if needs[3]:
        dw_stack = gemm(torch.cat([xs.t(), h_prev.t()]), dz)  # [x ; h_prev]ᵀ built row-major: one copy
    if needs[1]:
        dw_in = _weight_grad(w_in, xs, dz)
    if needs[2]:
        dw_rec = _weight_grad(w_rec, h_prev, dz)
    if needs[4]:
        db = dz.sum(0)
    if needs[5] and w_proj is not None:
        dw_proj = _weight_grad(w_proj, m_all, dh_all)
    return dx, dw_in, dw_rec, dw_stack, db, dw_proj, plan.unsort(carry_h), plan.unsort(carry_c)


def _loop_ext(rec, proj, *tensors, forward=False):
    """``elmo_fast._cpu`` where it runs a time loop itself: the recurrent product on its panels (``packed._Panels``),
    the projection too in backward (in forward also torch.mm: a fp32 weight left unpacked), and every buffer a
    contiguous fp32 CPU tensor (None entries skipped); else None."""
    if not isinstance(rec.packed, _Panels):
        return None
    if proj is not None and not isinstance(proj.packed, _Panels):
        if not forward or proj.packed is not None:
            return None
        tensors = (*tensors, proj.w)  # torch.mm's operand: fp32 and contiguous, as the buffers
    ext = cpu_ext_for(*tensors)
    return ext if ext is not None and hasattr(ext, "forward_loop" if forward else "backward_loop") else None


def _proj_operands(proj):
    """forward_loop's (proj, proj_w): the projection's panels, or its weight for torch.mm, or neither."""
    if proj is None:
        return None, None
    return (proj.packed.t, None) if isinstance(proj.packed, _Panels) else (None, proj.w)


def _weight_grad(w: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """aᵀ·b, the gradient of the weight ``w``, in ``w``'s layout: for a column-major ``w`` (``elmo_fast.LSTMP``
    passes nn.LSTM's weights as transposed views) the product is computed as (bᵀ·a) and returned transposed,
    the same FLOPs, and no transposing copy anywhere after it. The fake below (``empty_like``) has the same
    strides."""
    if w.dim() == 2 and not w.is_contiguous() and w.t().is_contiguous():
        return gemm(b.t(), a).t()
    return gemm(a.t(), b)


@_lstmp_cpu_backward.register_fake
def _(dy, dh_n, dc_n, w_in, w_rec, w_stack, w_proj, h0, c0, lengths, xs, gates, c_pre, tc, m_all, h_pre, hs, T,
      cell_clip, proj_clip, reverse, residual, cache_id, needs):
    B, D = h0.shape[0], xs.shape[1]
    like = [xs.new_empty(B, T, D), w_in, w_rec, w_stack, xs.new_empty(gates.shape[1]), w_proj]
    grads = [torch.empty_like(t) if need and t is not None else nothing(xs) for t, need in zip(like, needs)]
    return (*grads, torch.empty_like(h0), torch.empty_like(c0))


def _setup_context(ctx, inputs, output):
    (x, w_in, w_rec, w_stack, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip, forget_bias, reverse, residual,
     save, cache_id, bf16) = inputs
    ctx.flags = (x.shape[1], cell_clip, proj_clip, reverse, residual, cache_id)
    ctx.saved = save
    ctx.set_materialize_grads(False)
    if save:
        ctx.save_for_backward(w_in, w_rec, w_stack, w_proj, h0, c0, lengths, *output[3:])


def _backward(ctx, dy, dh_n, dc_n, *_):
    if not ctx.saved:
        raise RuntimeError("lstmp (cpu): this call ran without save=True and kept nothing for backward")
    needs = list(ctx.needs_input_grad[:6])  # x, w_in, w_rec, w_stack, bias, w_proj
    grads = _lstmp_cpu_backward(dy, dh_n, dc_n, *ctx.saved_tensors, *ctx.flags, needs)
    need = ctx.needs_input_grad
    return tuple(g if need[i] else None for i, g in enumerate(grads)) + (None,) * 9


_lstmp_cpu_op.register_autograd(_backward, setup_context=_setup_context)


def _stack_of(w_in: torch.Tensor, w_rec: torch.Tensor) -> torch.Tensor | None:
    """The contiguous (D+P, 4H) tensor whose first D rows are ``w_in`` and whose other rows are ``w_rec``, if they
    are views of one (the model passes ``W_0[:P]`` and ``W_0[P:]``), else None."""
    base = w_in._base
    if base is None or w_rec._base is not base or base.dim() != 2 or not base.is_contiguous():
        return None
    if base.requires_grad != w_in.requires_grad or base.requires_grad != w_rec.requires_grad:
        return None
    D = w_in.shape[0]
    if (base.shape[0] != D + w_rec.shape[0] or w_in.data_ptr() != base.data_ptr()
            or w_rec.data_ptr() != base[D:].data_ptr() or not (w_in.is_contiguous() and w_rec.is_contiguous())):
        return None
    return base


def lstmp_cpu(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, *, cell_clip=None, proj_clip=None, forget_bias=1.0,
              reverse=False, residual=False, weight_cache: PackedWeightCache | None = None, bf16: bool = False):
    """The CPU backend of ``elmo_fast.ops.lstmp`` (arguments and results of ``lstmp_reference``).

    Differentiable w.r.t. x, w_in, w_rec, bias, w_proj, h0 and c0. ``weight_cache``: the owning module's
    ``PackedWeightCache`` (packed weights survive across inference calls). ``bf16`` (opt-in, inference only, CPUs with
    AVX512-BF16 or AMX): the products with the packed weights (those of 1 MiB and more) take bf16 operands and
    accumulate in fp32; their results are rounded to bf16, the gates and the cell state stay fp32. Measured
    error: below that of the reference run in bf16 (tests/test_cpu_backend.py).
    """
    if bf16 and not bf16_supported():
        raise BackendUnavailableError("lstmp: bf16 on the cpu backend needs a CPU with AVX512-BF16 or AMX and "
                                      "torch's oneDNN (torch.ops.mkldnn._is_mkldnn_bf16_supported() is False "
                                      "here); unset ELMO_FAST_CPU_BF16 / cpu_bf16 to run in fp32")
    tensors = (x, w_in, w_rec, bias, w_proj, h0, c0)
    train = wants_grad(*tensors)
    if train and bf16:
        raise ValueError("lstmp: bf16 on the cpu backend is for inference only; run it under torch.no_grad()")
    stack = _stack_of(w_in, w_rec) if train and not tracing(x) else None
    if stack is not None:
        w_in = w_rec = None
    out = _lstmp_cpu_op(x, w_in, w_rec, stack, bias, w_proj, h0, c0, lengths, _opt_float(cell_clip),
                        _opt_float(proj_clip), float(forget_bias), bool(reverse), bool(residual), train,
                        -1 if weight_cache is None else weight_cache.id, bool(bf16))
    return out[0], out[1], out[2]


def _opt_float(v) -> float | None:
    return None if v is None else float(v)
