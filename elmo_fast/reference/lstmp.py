"""One LSTMP chain (one layer, one direction) with TF ``LSTMCell`` semantics (spec §3.2-§3.5): the oracle.

Shapes: B batch, T padded time steps, D input width, H cell size, P projection (= hidden) size.
Weights are in the TF (bilm-tf hdf5) layout, row-vector convention ``x · W``:

* ``w_in``  (D, 4H) = ``W_0[:D]``   multiplies the input u_t
* ``w_rec`` (P, 4H) = ``W_0[D:]``   multiplies h_{t-1}
* ``bias``  (4H,)   = ``B``         gate blocks in the order i | j | f | o
* ``w_proj`` (H, P) = ``W_P_0``     or None when there is no projection (then P == H)

The forget bias (1.0 in TF) is *not* stored in ``bias``; it is added at run time.

This is the plainest correct code: one step at a time over the whole padded batch, autograd for the
gradients, any dtype (fp64 too). The fast paths are the backends (``elmo_fast.cpu``, Triton, CUDA).
"""
from __future__ import annotations

import torch


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

    Walking t = T-1 .. 0 and updating only the rows with ``t < lengths[b]`` visits every row from its own last
    position down to 0, which is the reverse within each row's length.
    """
    B, T, _ = x.shape
    H = c0.shape[-1]
    if residual and x.shape[-1] != h0.shape[-1]:
        raise ValueError(f"residual needs input width == projection size, got {x.shape[-1]} and {h0.shape[-1]}")
    lengths = lengths.to(x.device)
    h, c = h0, c0
    ys = [None] * T
    for t in range(T - 1, -1, -1) if reverse else range(T):
        z = x[:, t] @ w_in + h @ w_rec + bias
        i, j, f, o = z[:, :H], z[:, H : 2 * H], z[:, 2 * H : 3 * H], z[:, 3 * H :]
        c_new = torch.sigmoid(f + forget_bias) * c + torch.sigmoid(i) * torch.tanh(j)
        if cell_clip is not None:
            c_new = torch.clamp(c_new, -cell_clip, cell_clip)
        h_new = torch.sigmoid(o) * torch.tanh(c_new)
        if w_proj is not None:
            h_new = h_new @ w_proj
            if proj_clip is not None:
                h_new = torch.clamp(h_new, -proj_clip, proj_clip)
        valid = (t < lengths).unsqueeze(1)  # (B, 1): rows still running at step t
        h = torch.where(valid, h_new, h)
        c = torch.where(valid, c_new, c)
        y = h_new + x[:, t] if residual else h_new
        ys[t] = torch.where(valid, y, torch.zeros_like(y))
    if T == 0:
        return x.new_zeros(B, 0, h0.shape[-1]), h0.clone(), c0.clone()
    return torch.stack(ys, 1), h, c
