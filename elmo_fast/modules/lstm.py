"""One direction's stack of LSTMP layers; parameters keep the hdf5 (TF) layout."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import ops
from .._backend import env_flag
from ..cpu.packed import PackedWeightCache
from ..options import LSTMOptions


class LSTMPStack(nn.Module):
    """``n_layers`` LSTMP layers of one direction. Per layer ``l``: ``W_0[l]`` (2P, 4H) with rows 0..P-1 for the
    input and P..2P-1 for h, gate blocks i|j|f|o; ``B[l]`` (4H,) without the forget bias; ``W_P_0[l]`` (H, P)."""

    def __init__(self, opts: LSTMOptions, reverse: bool, with_projection: bool | None = None,
                 backend: str | None = "auto", forget_bias: float = 1.0):
        super().__init__()
        self.opts = opts
        self.reverse = reverse
        self.backend = backend
        self.forget_bias = forget_bias
        P, H = opts.projection_dim, opts.dim
        if with_projection is None:
            with_projection = opts.has_projection
        if not with_projection and P != H:
            raise ValueError(f"an LSTM without projection needs projection_dim == dim, got {P} and {H}")
        self.W_0 = nn.ParameterList([nn.Parameter(torch.empty(2 * P, 4 * H)) for _ in range(opts.n_layers)])
        self.B = nn.ParameterList([nn.Parameter(torch.zeros(4 * H)) for _ in range(opts.n_layers)])
        self.W_P_0 = (nn.ParameterList([nn.Parameter(torch.empty(H, P)) for _ in range(opts.n_layers)])
                      if with_projection else None)
        # cpu backend: packed weights kept across calls (dropped on pickling, rebuilt lazily); bf16 inference opt-in
        self._cpu_weight_cache = PackedWeightCache()
        self.cpu_bf16 = env_flag("ELMO_FAST_CPU_BF16", False)
        self.reset_parameters()

    def _apply(self, fn, *args, **kwargs):
        self._cpu_weight_cache.clear()  # .to() / .float() / ... give the weights new storage
        return super()._apply(fn, *args, **kwargs)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # TF's default for LSTMCell kernels (glorot uniform) and zero biases.
        for w in self.W_0:
            bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
            nn.init.uniform_(w, -bound, bound)
        for b in self.B:
            b.zero_()
        if self.W_P_0 is not None:
            for w in self.W_P_0:
                bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
                nn.init.uniform_(w, -bound, bound)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, states: list[tuple[torch.Tensor, torch.Tensor]],
                dropout: float = 0.0):
        """x (B, T, P); states: per layer (h0 (B, P), c0 (B, H)). Returns (outputs per layer, final states).

        ``dropout`` (training) is applied to every layer's input with a fresh mask per element and step; the
        residual of layers >= 1 adds the dropped-out input, as TF's Dropout(Residual(LSTMCell)) wrapping does.
        """
        P = self.opts.projection_dim
        outs, finals = [], []
        inp = x
        for layer in range(self.opts.n_layers):
            if dropout > 0.0 and self.training:
                inp = ops.dropout(inp, dropout, backend=self.backend)
            W = self.W_0[layer]
            h0, c0 = states[layer]
            y, hn, cn = ops.lstmp(
                inp, W[:P], W[P:], self.B[layer], self.W_P_0[layer] if self.W_P_0 is not None else None, h0, c0,
                lengths, cell_clip=self.opts.cell_clip, proj_clip=self.opts.proj_clip, forget_bias=self.forget_bias,
                reverse=self.reverse, residual=self.opts.use_skip_connections and layer > 0, backend=self.backend,
                cpu_weight_cache=self._cpu_weight_cache, cpu_bf16=self.cpu_bf16,
            )
            outs.append(y)
            finals.append((hn, cn))
            inp = y
        return outs, finals
