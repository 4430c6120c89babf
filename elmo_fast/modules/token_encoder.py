"""The character-CNN token encoder as an nn.Module; parameters keep the hdf5 (TF) layout."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from ..options import CharCNNOptions


class CharCNNTokenEncoder(nn.Module):
    """char ids (..., L) inference ids -> token layer (..., P).

    Parameters (names mirror the hdf5 datasets): ``char_embed`` (261, d_c) — the zero row for id 0 is
    prepended at run time, so training updates only the 261 real rows; ``conv_w[i]`` (w_i, d_c, n_i);
    ``conv_b[i]``; ``highway[k].{W_carry,b_carry,W_transform,b_transform}``; ``W_proj`` (F, P), ``b_proj``.
    Each distinct token of a batch is encoded once and scattered back (forward and backward); under
    torch.compile / torch.export every token is encoded (the same values: the encoder is context-free).
    """

    def __init__(self, opts: CharCNNOptions, projection_dim: int, with_projection: bool | None = None,
                 backend: str | None = "auto"):
        super().__init__()
        self.opts = opts
        self.backend = backend
        d, F_ = opts.embedding_dim, opts.n_filters
        self.char_embed = nn.Parameter(torch.empty(261, d))
        self.conv_w = nn.ParameterList([nn.Parameter(torch.empty(w, d, n)) for w, n in opts.filters])
        self.conv_b = nn.ParameterList([nn.Parameter(torch.zeros(n)) for _, n in opts.filters])
        self.highway = nn.ModuleList()
        for _ in range(opts.n_highway):
            layer = nn.Module()
            layer.W_carry = nn.Parameter(torch.empty(F_, F_))
            layer.b_carry = nn.Parameter(torch.full((F_,), -2.0))
            layer.W_transform = nn.Parameter(torch.empty(F_, F_))
            layer.b_transform = nn.Parameter(torch.zeros(F_))
            self.highway.append(layer)
        if with_projection is None:
            with_projection = F_ != projection_dim
        if not with_projection and F_ != projection_dim:
            raise ValueError(f"without a projection the CNN width ({F_}) must equal projection_dim ({projection_dim})")
        if with_projection:
            self.W_proj = nn.Parameter(torch.empty(F_, projection_dim))
            self.b_proj = nn.Parameter(torch.zeros(projection_dim))
        else:
            self.W_proj = None
            self.b_proj = None
        self.output_dim = projection_dim
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """bilm-tf's training initialisation (spec §2.4)."""
        o = self.opts
        nn.init.uniform_(self.char_embed, -1.0, 1.0)
        for (w, _), p in zip(o.filters, self.conv_w):
            if o.activation == "relu":
                nn.init.uniform_(p, -0.05, 0.05)
            else:
                nn.init.normal_(p, 0.0, math.sqrt(1.0 / (w * o.embedding_dim)))
        for b in self.conv_b:
            b.zero_()
        std = math.sqrt(1.0 / o.n_filters)
        for layer in self.highway:
            nn.init.normal_(layer.W_carry, 0.0, std)
            nn.init.normal_(layer.W_transform, 0.0, std)
            layer.b_carry.fill_(-2.0)
            layer.b_transform.zero_()
        if self.W_proj is not None:
            nn.init.normal_(self.W_proj, 0.0, std)
            self.b_proj.zero_()

    def padded_char_embed(self) -> torch.Tensor:
        return F.pad(self.char_embed, (0, 0, 1, 0))  # row 0 = "no token here"

    def encode_unique(self, ids: torch.Tensor) -> torch.Tensor:
        """(N, L) ids, assumed distinct -> (N, P)."""
        be = self.backend
        v = ops.char_cnn(ids, self.padded_char_embed(), list(self.conv_w), list(self.conv_b),
                         self.opts.activation, backend=be)
        for layer in self.highway:
            v = ops.highway(v, layer.W_carry, layer.b_carry, layer.W_transform, layer.b_transform, backend=be)
        if self.W_proj is not None:
            v = ops.projection(v, self.W_proj, self.b_proj, backend=be)
        return v

    def encode_tokens(self, rows: torch.Tensor, inverse: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
        """Tokens given as their distinct char-id rows (U, L) and ``inverse`` (N,), ``rows[inverse]`` the N tokens in
        order -> (*lead, output_dim), each distinct token encoded once. ``forward`` finds them with ``torch.unique`` (a
        host sync on a GPU); the trainer's data stream brings them with its batches."""
        L = self.opts.max_characters_per_token
        n = math.prod(lead)
        if rows.dim() != 2 or rows.shape[1] != L or inverse.shape != (n,):
            raise ValueError(f"rows (U, {L}) and an inverse of the {n} tokens of {tuple(lead)} expected, got "
                             f"{tuple(rows.shape)} and {tuple(inverse.shape)}")
        return self.encode_unique(rows).index_select(0, inverse).reshape(*lead, self.output_dim)

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        L = self.opts.max_characters_per_token
        if char_ids.shape[-1] != L:
            raise ValueError(f"char ids must have {L} characters per token in the last axis, got {char_ids.shape[-1]}")
        lead = char_ids.shape[:-1]
        flat = char_ids.reshape(-1, L)
        if flat.shape[0] == 0:
            return self.char_embed.new_zeros(*lead, self.output_dim)
        if torch.compiler.is_compiling():  # the number of distinct tokens would be a data-dependent shape
            return self.encode_unique(flat).reshape(*lead, self.output_dim)
        uniq, inverse = torch.unique(flat, dim=0, return_inverse=True)
        return self.encode_tokens(uniq, inverse.reshape(-1), tuple(lead))
