"""The character-CNN token encoder (spec §2): char embedding, convolutions, max over positions,
activation, highway layers, projection. The oracle: the plain definition, every token and every window.

Layouts are those of the bilm-tf hdf5 file:

* ``char_embed``: (n_chars, d_c) table indexed by *inference* ids; row 0 must be the zero "no token" row
  (the model prepends it to the file's 261 rows);
* ``conv_weights[i]``: (w_i, d_c, n_i) = ``CNN/W_cnn_i[0]``; ``conv_biases[i]``: (n_i,);
* highway: ``W_carry``/``W_transform`` (F, F), biases (F,), TF convention (the "carry" gate scales the
  transform branch);
* projection ``W_proj`` (F, P), ``b_proj`` (P,).

The fast CPU path (each distinct token once, all-padding windows computed once, length buckets) is
``elmo_fast.cpu.char_cnn``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def _activation(name: str):
    if name == "relu":
        return torch.relu
    if name == "tanh":
        return torch.tanh
    raise ValueError(f"char_cnn activation must be 'relu' or 'tanh', got {name!r}")


@contextlib.contextmanager
def _no_tf32():
    """cuDNN convolutions default to TF32 on Ampere+; the fp32 reference must be strict fp32 (spec pitfall 15)."""
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = old


def char_cnn_reference(
    char_ids: torch.Tensor,
    char_embed: torch.Tensor,
    conv_weights: list[torch.Tensor],
    conv_biases: list[torch.Tensor],
    activation: str = "relu",
) -> torch.Tensor:
    """char_ids (N, L) int inference ids -> (N, F) = act(max_p conv(embed(ids)) + bias), every VALID window."""
    act = _activation(activation)
    emb = F.embedding(char_ids, char_embed).transpose(1, 2)  # (N, d_c, L)
    outs = []
    with _no_tf32() if char_ids.is_cuda else contextlib.nullcontext():
        for w, b in zip(conv_weights, conv_biases):
            if emb.shape[-1] < w.shape[0]:
                raise ValueError(f"tokens of {emb.shape[-1]} characters are shorter than a filter of width "
                                 f"{w.shape[0]}")
            outs.append(F.conv1d(emb, w.permute(2, 1, 0), b).amax(dim=-1))  # cross-correlation, no flip
    return act(torch.cat(outs, dim=-1))


def highway_reference(x, w_carry, b_carry, w_transform, b_transform):
    """One highway layer in the TF convention: g = σ(x·W_carry + b_carry) scales the transform branch."""
    g = torch.sigmoid(torch.matmul(x, w_carry) + b_carry)
    t = torch.relu(torch.matmul(x, w_transform) + b_transform)
    return g * t + (1.0 - g) * x


def token_encoder_reference(char_ids, params: dict, activation: str = "relu", dedup: bool = True):
    """char_ids (..., L) -> (..., P): char CNN, highway layers, projection.

    ``params`` keys: ``char_embed`` (with the zero row 0), ``conv_weights``, ``conv_biases``, ``highway`` (list of
    (W_carry, b_carry, W_transform, b_transform)), ``proj`` ((W_proj, b_proj) or None).
    With ``dedup`` each distinct token runs the highway and projection once too.
    """
    lead = char_ids.shape[:-1]
    ids = char_ids.reshape(-1, char_ids.shape[-1])
    if dedup and ids.shape[0]:
        ids, inverse = torch.unique(ids, dim=0, return_inverse=True)
    else:
        inverse = None
    v = char_cnn_reference(ids, params["char_embed"], params["conv_weights"], params["conv_biases"], activation)
    for layer in params.get("highway", ()):
        v = highway_reference(v, *layer)
    if params.get("proj") is not None:
        w, b = params["proj"]
        v = torch.matmul(v, w) + b
    if inverse is not None:
        v = v.index_select(0, inverse.reshape(-1))
    return v.reshape(*lead, v.shape[-1])
