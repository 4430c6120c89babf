"""One LSTMP chain (one layer, one direction) with TF ``LSTMCell`` semantics (spec §3.2-§3.5).

Shapes: B batch, T padded time steps, D input width, H cell size, P projection (= hidden) size.
Weights are in the TF (bilm-tf hdf5) layout, row-vector convention ``x · W``:

* ``w_in``  (D, 4H) = ``W_0[:D]``   multiplies the input u_t
* ``w_rec`` (P, 4H) = ``W_0[D:]``   multiplies h_{t-1}
* ``bias``  (4H,)   = ``B``         gate blocks in the order i | j | f | o
* ``w_proj`` (H, P) = ``W_P_0``     or None when there is no projection (then P == H)

The forget bias (1.0 in TF) is *not* stored in ``bias``; it is added at run time.
"""
from __future__ import annotations

import os

import torch

# CPU float32 inference: the per-step products (h · w_rec, m · w_proj) go through oneDNN with the weight
# packed once per call. Plain IEEE fp32 (no bf16/TF32: torch's mkldnn fp32 precision stays at its default),
# only the summation order differs from MKL's sgemm, which on small-M products is about 2x slower on CPUs
# where MKL does not take its best path (measured: AMD EPYC, M=32, K=512, N=16384: 9.5 ms -> 4.5 ms on 2
# threads). ELMO_FAST_CPU_ONEDNN=0 turns it off; any failure falls back to torch.addmm / torch.mm for good.
_ONEDNN_OK = os.environ.get("ELMO_FAST_CPU_ONEDNN", "1").strip() != "0"


def _packed_cpu_linear(w: torch.Tensor, rows: int, cache: dict | None = None):
    """x -> x · w through oneDNN with ``w`` (K, N) packed once, or None where that path does not apply.

    ``cache`` (owned by the module that owns ``w``) keeps the packed weight across calls, one entry per weight
    storage, valid while the weight's version counter (bumped by every in-place update) is unchanged."""
    global _ONEDNN_OK
    if not _ONEDNN_OK or w.device.type != "cpu" or w.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    stamp = w._version
    if cache is not None:
        hit = cache.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
    lin = _pack(w, rows)
    if cache is not None and lin is not None:
        cache[key] = (stamp, lin)
    return lin


def _pack(w: torch.Tensor, rows: int):
    global _ONEDNN_OK
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), rows)

        def linear(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

        probe = w.new_zeros(1, w.shape[0])
        probe[0, 0] = 1.0
        if not torch.equal(linear(probe)[0], w[0]):  # sanity: one row of the identity reads one weight row
            raise RuntimeError("oneDNN linear returned unexpected values")
        return linear
    except Exception:  # noqa: BLE001 - any problem: keep the plain path from now on
        _ONEDNN_OK = False
        return None


def lstmp_reference(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_rec: torch.Tensor,
    bias: torch.Tensor,
    w_proj: torch.Tensor | None,
    h0: torch.Tensor,
    c0: torch.Tensor,
    lengths: torch.Tensor,
    *,
    cell_clip: float | None = None,
    proj_clip: float | None = None,
    forget_bias: float = 1.0,
    reverse: bool = False,
    residual: bool = False,
    cpu_weight_cache: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run one LSTMP chain over a right-padded batch.

    Args:
        x: (B, T, D) inputs; positions ``t >= lengths[b]`` are ignored.
        h0: (B, P), c0: (B, H) initial state.
        lengths: (B,) int valid steps per row (0 allowed: that row keeps its state and outputs zeros).
        cell_clip / proj_clip: clip c / the projected h to [-clip, clip] when not None (TF: any value, 0 too).
        reverse: process each row right to left *within its own length* (the backward LM).
        residual: output ``h_t + x_t`` (needs D == P); the recurrent state stays the pure ``h_t``.

    Returns:
        y: (B, T, P) outputs, exactly 0 at padded positions;
        h_n: (B, P), c_n: (B, H) the state after each row's last valid step (h0/c0 for empty rows).

    Exact speed-ups (no change to the math; results differ from the plain per-step loop only by float rounding):

    * rows are visited in order of decreasing length, so step t only touches the rows still running (a
      contiguous prefix) and padded steps are skipped entirely;
    * the input projection ``u_t · w_in + bias`` (forget bias folded in once) is one matrix product over the
      valid (row, step) positions only, packed in visiting order; in inference (no autograd needed) identical
      input rows -- e.g. repeated words at layer 0, whose input is context-free -- are projected once;
    * CPU float32 inference runs the per-step products through oneDNN with packed weights (see
      ``_packed_cpu_linear``: fp32 throughout, only the summation order differs);
    * each step is a handful of large ops (addmm, one sigmoid over all gate blocks, addcmul, ...), the state is
      re-assembled only when the number of running rows changes, and the outputs are scattered into the padded
      result once at the end. (On a busy 2-core machine every parallel op can cost a scheduler slice, so the
      op count per step matters as much as the flops.)
    """
    B, T, _ = x.shape
    H = c0.shape[-1]
    lengths = lengths.to(device=x.device, dtype=torch.long)
    if residual and x.shape[-1] != h0.shape[-1]:
        raise ValueError(f"residual needs input width == projection size, got {x.shape[-1]} and {h0.shape[-1]}")
    P = h0.shape[-1]
    if B == 0 or T == 0:
        return x.new_zeros(B, T, P), h0.clone(), c0.clone()

    order = torch.argsort(lengths, descending=True, stable=True)
    inv = torch.argsort(order)
    sorted_len = lengths[order]
    h_init = h0.index_select(0, order)
    c_init = c0.index_select(0, order)
    # active rows per step: a prefix of the sorted batch (host-side ints; lengths are tiny).
    steps_t = torch.arange(T, device=x.device)
    valid = sorted_len.unsqueeze(1) > steps_t.unsqueeze(0)  # (B, T) in sorted row order
    n_active = [int(v) for v in valid.sum(0).tolist()]
    steps = [t for t in (range(T - 1, -1, -1) if reverse else range(T)) if n_active[t] > 0]
    if not steps:
        return x.new_zeros(B, T, P), h0.clone(), c0.clone()

    # packed positions in visiting order: for each step t, rows 0..n_t-1 (flat index row * T + t).
    vt = valid.t()
    if reverse:
        vt = vt.flip(0)
    tb = vt.nonzero()  # (N, 2) [step position, row], step-major, rows ascending
    t_idx = (T - 1 - tb[:, 0]) if reverse else tb[:, 0]
    flat = tb[:, 1] * T + t_idx
    xs_packed = x.index_select(0, order).reshape(B * T, -1).index_select(0, flat)  # (N, D)

    bias_f = bias.clone()
    bias_f[2 * H : 3 * H] += forget_bias
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, w_in, w_rec, bias, w_proj, h0, c0))
    in_lin = rec_lin = proj_lin = None
    if not needs_grad and x.device.type == "cpu" and x.dtype == torch.float32:
        in_lin = _packed_cpu_linear(w_in, xs_packed.shape[0], cpu_weight_cache)
        rec_lin = _packed_cpu_linear(w_rec, B, cpu_weight_cache)
        if rec_lin is not None and w_proj is not None:
            proj_lin = _packed_cpu_linear(w_proj, B, cpu_weight_cache)

    def project_input(rows: torch.Tensor) -> torch.Tensor:
        return in_lin(rows).add_(bias_f) if in_lin is not None else torch.addmm(bias_f, rows, w_in)

    gates_x = None
    if not needs_grad and xs_packed.shape[0] > 1:
        uniq, u_inv = torch.unique(xs_packed, dim=0, return_inverse=True)
        if uniq.shape[0] * 4 <= xs_packed.shape[0] * 3:  # pays off: project each distinct row once
            gates_x = project_input(uniq).index_select(0, u_inv)
    if gates_x is None:
        gates_x = project_input(xs_packed)  # (N, 4H)

    h, c = h_init[: n_active[steps[0]]], c_init[: n_active[steps[0]]]
    done_h: list[torch.Tensor] = []  # forward: rows that finished, kept in row order at the end
    done_c: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    off = 0
    for t in steps:
        n = n_active[t]
        n_cur = h.shape[0]
        if n < n_cur:  # rows n..n_cur-1 have run their last step (forward direction)
            done_h.insert(0, h[n:])
            done_c.insert(0, c[n:])
            h, c = h[:n], c[:n]
        elif n > n_cur:  # rows n_cur..n-1 start now from their initial state (backward direction)
            h = torch.cat([h, h_init[n_cur:n]], 0)
            c = torch.cat([c, c_init[n_cur:n]], 0)
        if rec_lin is not None:
            z = rec_lin(h).add_(gates_x[off : off + n])
        else:
            z = torch.addmm(gates_x[off : off + n], h, w_rec)
        s = torch.sigmoid(z)  # i | (j, unused) | f | o
        c = torch.addcmul(s[:, 2 * H : 3 * H] * c, s[:, :H], torch.tanh(z[:, H : 2 * H]))
        if cell_clip is not None:
            c = torch.clamp(c, -cell_clip, cell_clip)
        m = s[:, 3 * H :] * torch.tanh(c)
        if w_proj is not None:
            h = proj_lin(m) if proj_lin is not None else torch.mm(m, w_proj)
            if proj_clip is not None:
                h = torch.clamp(h, -proj_clip, proj_clip)
        else:
            h = m
        outs.append(h + xs_packed[off : off + n] if residual else h)
        off += n

    n_run = h.shape[0]
    n_started = max(n_active)
    h_fin = torch.cat([h, *done_h, h_init[n_started:]], 0) if n_run < B else h
    c_fin = torch.cat([c, *done_c, c_init[n_started:]], 0) if n_run < B else c
    packed = torch.cat(outs, 0) if len(outs) > 1 else outs[0]
    y = packed.new_zeros(B * T, P).index_copy(0, flat, packed).view(B, T, P)
    return y.index_select(0, inv), h_fin.index_select(0, inv), c_fin.index_select(0, inv)
