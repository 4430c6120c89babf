"""CPU backend of the char CNN (``elmo_fast.reference.char_cnn.char_cnn_reference`` is the oracle).

Exact shortcuts (no value changes beyond float rounding order), differentiable by autograd:

* all-zero rows (padding tokens) see a zero embedding, so every window gives exactly the conv bias;
* windows made only of in-word padding characters give one value per filter for every token: it is computed
  once, and each token's convolution covers only the windows that touch one of its real characters;
* tokens run in buckets of similar length, so a short word costs a short convolution (most words are far
  shorter than the 50 positions: the CNN work drops 3-4x on real text).

In training, with ``elmo_fast._cpu``, a bucket's max over windows runs in the extension (``_ConvMax``,
csrc/cpu/char_cnn.cpp): its backward visits only the windows that hold each maximum (ties share the gradient evenly,
as TF's reduce_max and torch's amax do) instead of autograd's transposed convolution over every window.

The callers (the token-encoder module) pass distinct tokens: each distinct token is encoded once per batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops._library import wants_grad
from ..reference.char_cnn import _activation
from .ext import cpu_ext

PAD_CHAR_ID = 261  # inference id of the in-word padding character
_BUCKET = 512


def char_cnn_cpu(char_ids, char_embed, conv_weights, conv_biases, activation: str = "relu") -> torch.Tensor:
    """char_ids (N, L) int inference ids -> (N, F), as ``char_cnn_reference``."""
    act = _activation(activation)
    N, L = char_ids.shape
    dtype = torch.promote_types(char_embed.dtype, conv_weights[0].dtype)
    bias_all = torch.cat(conv_biases).to(dtype)
    if N == 0:
        return act(bias_all.new_zeros(0, bias_all.shape[0]))
    max_w = max(int(w.shape[0]) for w in conv_weights)
    if L < max_w:
        raise ValueError(f"tokens of {L} characters are shorter than a filter of width {max_w}")
    nonpad = char_ids != PAD_CHAR_ID
    # k = 1 + index of the last non-padding character: windows starting at p >= k are all padding.
    k = (nonpad * torch.arange(1, L + 1)).amax(dim=1)
    real = torch.nonzero((char_ids != 0).any(dim=1)).squeeze(1)
    # value of an all-padding window, per filter: computed once.
    pad_win = F.embedding(torch.full((1, max_w), PAD_CHAR_ID, dtype=torch.long), char_embed).transpose(1, 2)
    pad_vals = [F.conv1d(pad_win[:, :, : w.shape[0]], w.permute(2, 1, 0), b)[:, :, 0]
                for w, b in zip(conv_weights, conv_biases)]
    out = bias_all.expand(N, bias_all.shape[0])  # all-zero rows: every window is exactly the bias
    if real.numel():
        kr = k[real]
        order = torch.argsort(kr, descending=True)
        real, kr = real[order], kr[order].tolist()  # CPU tensors: host reads, no device sync
        pieces = []
        grad = wants_grad(char_embed, *conv_weights, *conv_biases)
        sparse = _sparse_backward(char_embed, conv_weights, conv_biases, L)
        if sparse:  # _ConvMax's arguments besides the bucket
            pv = [v[0].detach() for v in pad_vals]
            wb = [t for pair in zip(conv_weights, conv_biases) for t in pair]
        for s in range(0, real.numel(), _BUCKET):
            kmax = kr[s]
            if sparse and kmax > 0:
                pieces.append(_ConvMax.apply(char_ids[real[s : s + _BUCKET]], char_embed, kmax, pv, *wb))
                continue
            emb = F.embedding(char_ids[real[s : s + _BUCKET]], char_embed).transpose(1, 2)  # (n, d_c, L)
            group = []
            for (w, b), pv in zip(zip(conv_weights, conv_biases), pad_vals):
                width = int(w.shape[0])
                n_win = L - width + 1
                n_real = min(kmax, n_win)  # windows starting before kmax touch a real character
                if n_real == 0:  # tokens of padding characters only (raw ids): every window is all padding
                    m = pv.to(emb.dtype).expand(emb.shape[0], -1)
                else:
                    win = F.conv1d(emb[:, :, : n_real + width - 1], w.permute(2, 1, 0), b)  # (n, C, n_real)
                    if n_real < n_win and grad:  # the bucket's tokens also have n_win - n_real all-padding
                        # windows, each pv: in the max as windows of their own, so that a tie shares the gradient
                        # evenly among all the tied windows (amax's, TF's reduce_max's), not half to the real ones
                        # and half to the padding ones (torch.maximum's)
                        pad = pv.to(win.dtype)[:, :, None].expand(win.shape[0], -1, n_win - n_real)
                        win = torch.cat([win, pad], dim=-1)
                    m = win.amax(dim=-1)
                    if n_real < n_win and not grad:  # inference: the same value, no (n, C, n_win) tensor
                        m = torch.maximum(m, pv.to(m.dtype))
                group.append(m)
            pieces.append(torch.cat(group, dim=-1))
        real_out = torch.cat(pieces, 0)
        out = out.to(real_out.dtype).index_put((real,), real_out)
    return act(out)


_MAX_WINDOWS = 64  # conv_max's masks: one bit per window


def _sparse_backward(char_embed, conv_weights, conv_biases, L: int) -> bool:
    """Whether ``_ConvMax`` runs the buckets: a gradient is wanted, every tensor is fp32, every filter has at most 64
    windows over tokens of ``L`` characters, and the extension has the kernels."""
    tensors = [char_embed, *conv_weights, *conv_biases]
    if not wants_grad(*tensors):
        return False
    if any(t.dtype != torch.float32 for t in tensors):
        return False
    if L - min(int(w.shape[0]) for w in conv_weights) + 1 > _MAX_WINDOWS:  # the narrowest filter has the most windows
        return False
    ext = cpu_ext()
    return ext is not None and hasattr(ext, "conv_max_backward")


class _ConvMax(torch.autograd.Function):
    """One bucket, every filter group: max over windows of conv(embed(ids)) + bias (before the activation), for
    tokens whose windows from ``kmax`` on are all padding (their value is ``pv``, per group). The forward keeps,
    per token and filter, the windows that hold the maximum; the backward gives the gradient to those windows only
    (shared evenly among ties): the weight, bias and char-table gradients of csrc/cpu/char_cnn.cpp."""

    @staticmethod
    def forward(ctx, ids, table, kmax, pv, *wb):
        ext = cpu_ext()
        ws, bs = wb[0::2], wb[1::2]
        n, L = ids.shape
        emb = F.embedding(ids, table).transpose(1, 2)  # (n, d_c, L)
        outs, masks = [], []
        for w, b, pad in zip(ws, bs, pv):
            width = int(w.shape[0])
            n_win = L - width + 1
            n_real = min(kmax, n_win)
            y = F.conv1d(emb[:, :, : n_real + width - 1], w.permute(2, 1, 0), b).contiguous()
            m = y.new_empty(n, y.shape[1])
            bits = torch.empty(y.shape[1], n, dtype=torch.long)
            ext.conv_max(y, pad.contiguous() if n_real < n_win else None, n_win, m, bits)
            outs.append(m)
            masks.append(bits)
        ctx.save_for_backward(ids.to(torch.int32).contiguous(), table, *ws, *masks)
        return torch.cat(outs, dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients have no graph: a double backward raises
    def backward(ctx, dm):
        ext = cpu_ext()
        ids, table, *rest = ctx.saved_tensors
        k = len(rest) // 2
        ws, masks = rest[:k], rest[k:]
        g = dm.t().contiguous()  # (F, n): a filter's gradients are one row
        table = table.contiguous()
        dtable = torch.zeros_like(table)
        grads, off = [], 0
        for w, bits in zip(ws, masks):
            n_f = int(w.shape[2])
            wt = w.permute(2, 0, 1).contiguous()  # (F, w, d_c): a filter's weights are one row
            dwt, db = torch.empty_like(wt), w.new_empty(n_f)
            ext.conv_max_backward(ids, table, PAD_CHAR_ID, wt, g[off : off + n_f], bits, dwt, dtable, db)
            grads += [dwt.permute(1, 2, 0).contiguous(), db]
            off += n_f
        return None, dtable, None, None, *grads
