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

import torch
import torch.nn.functional as F


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

    Exact speed-ups (no change to the math): the input projection of every step is one matrix product,
    and rows are visited in order of decreasing length so that step t only touches the rows still running
    (a contiguous prefix), which skips padded steps entirely.
    """
    B, T, _ = x.shape
    H = c0.shape[-1]
    lengths = lengths.to(device=x.device, dtype=torch.long)
    if residual and x.shape[-1] != h0.shape[-1]:
        raise ValueError(f"residual needs input width == projection size, got {x.shape[-1]} and {h0.shape[-1]}")

    order = torch.argsort(lengths, descending=True, stable=True)
    sorted_len = lengths[order]
    xs = x.index_select(0, order)
    h = h0.index_select(0, order)
    c = c0.index_select(0, order)
    gates_x = torch.matmul(xs, w_in) + bias  # (B, T, 4H): the hoisted input projection
    fbias = torch.zeros(4 * H, dtype=gates_x.dtype, device=x.device)
    fbias[2 * H : 3 * H] = forget_bias
    # active rows per step: a prefix of the sorted batch (host-side ints; lengths are tiny).
    steps_t = torch.arange(T, device=x.device).unsqueeze(1)
    n_active = [int(v) for v in (sorted_len.unsqueeze(0) > steps_t).sum(1).tolist()]

    outputs: list[torch.Tensor | None] = [None] * T
    steps = range(T - 1, -1, -1) if reverse else range(T)
    for t in steps:
        n = n_active[t]
        if n == 0:
            continue
        h_prev, c_prev = h[:n], c[:n]
        z = gates_x[:n, t] + torch.matmul(h_prev, w_rec)
        z = z + fbias
        i, j, f, o = z.chunk(4, dim=-1)
        c_new = torch.sigmoid(f) * c_prev + torch.sigmoid(i) * torch.tanh(j)
        if cell_clip is not None:
            c_new = torch.clamp(c_new, -cell_clip, cell_clip)
        m = torch.sigmoid(o) * torch.tanh(c_new)
        if w_proj is not None:
            h_new = torch.matmul(m, w_proj)
            if proj_clip is not None:
                h_new = torch.clamp(h_new, -proj_clip, proj_clip)
        else:
            h_new = m
        out = h_new + xs[:n, t] if residual else h_new
        outputs[t] = F.pad(out, (0, 0, 0, B - n)) if n < B else out
        if n < B:
            h = torch.cat([h_new, h[n:]], 0)
            c = torch.cat([c_new, c[n:]], 0)
        else:
            h, c = h_new, c_new

    P = h0.shape[-1]
    zero = x.new_zeros(B, P) if T else None
    y = torch.stack([o if o is not None else zero for o in outputs], 1) if T else x.new_zeros(B, 0, P)
    inv = torch.argsort(order)
    return y.index_select(0, inv), h.index_select(0, inv), c.index_select(0, inv)
