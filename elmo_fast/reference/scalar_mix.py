"""Scalar mix of biLM layers (spec §5.1): γ · Σ_j softmax(w)_j · N_j(layer_j).

With ``do_layer_norm`` each layer is normalised by one mean and variance over the whole tensor (all valid
positions and all features), not per token: (x - mean) / sqrt(var + eps).
"""
from __future__ import annotations

import torch


def scalar_mix_reference(layers, weights, gamma, mask=None, do_layer_norm: bool = False, eps: float = 1e-13):
    """layers: list of (B, T, D); weights: (n_layers,) pre-softmax; gamma: scalar tensor; mask (B, T)."""
    if len(layers) != weights.numel():
        raise ValueError(f"scalar mix has {weights.numel()} weights but got {len(layers)} layers")
    s = torch.softmax(weights, dim=0)
    out = None
    if do_layer_norm:
        if mask is None:
            raise ValueError("do_layer_norm=True needs the mask")
        m = mask.to(layers[0].dtype).unsqueeze(-1)
        n = m.sum() * layers[0].shape[-1]
    for j, layer in enumerate(layers):
        if do_layer_norm:
            mean = (layer * m).sum() / n
            var = (((layer - mean) * m) ** 2).sum() / n
            layer = (layer - mean) / torch.sqrt(var + eps)
        term = s[j] * layer
        out = term if out is None else out + term
    return gamma * out
