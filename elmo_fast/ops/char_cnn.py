"""``char_cnn`` and ``highway``: the token encoder ops. See ``elmo_fast.reference.char_cnn`` for the math."""
from __future__ import annotations

import torch

from ._library import CompositeOp, backend_for
from ..cpu.char_cnn import char_cnn_cpu
from ..cpu.highway import highway_cpu, highway_cpu_applies
from ..cpu.linear import linear_cpu, linear_cpu_applies
from ..reference.char_cnn import char_cnn_reference, highway_reference
from . import _precision as prec


def char_cnn(
    char_ids: torch.Tensor,
    char_embed: torch.Tensor,
    conv_weights: list[torch.Tensor],
    conv_biases: list[torch.Tensor],
    activation: str = "relu",
    *,
    backend: str | None = "auto",
) -> torch.Tensor:
    """char_ids (N, L) inference ids -> (N, F): embedding, every filter width, max over positions, bias, act.

    char_embed (n_chars, d_c) with the zero row 0; conv_weights[i] (w_i, d_c, n_i); conv_biases[i] (n_i,).
    Under autocast the table and the filters run in the autocast dtype (``elmo_fast.ops._precision``); the
    output has the table's (cast) dtype.
    """
    if char_ids.dim() != 2:
        raise ValueError(f"char_cnn: char_ids must be (N, L), got shape {tuple(char_ids.shape)}")
    if char_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"char_cnn: char_ids must be int64 or int32, got {char_ids.dtype}")
    if len(conv_weights) != len(conv_biases) or not conv_weights:
        raise ValueError("char_cnn: need one bias per conv weight and at least one filter group")
    for i, (w, b) in enumerate(zip(conv_weights, conv_biases)):
        if w.dim() != 3 or w.shape[1] != char_embed.shape[1] or b.shape != (w.shape[2],):
            raise ValueError(
                f"char_cnn: filter group {i}: weight must be (w, d_c={char_embed.shape[1]}, n) and bias (n,), "
                f"got {tuple(w.shape)} and {tuple(b.shape)}"
            )
    low = prec.compute_dtype(char_embed)
    char_embed, *conv_weights = prec.weights(low, char_embed, *conv_weights)
    be = backend_for(backend, char_ids.device, "char_cnn", char_embed.dtype)
    with prec.no_autocast(char_ids.device):
        if be == "triton":
            from ..kernels.char_cnn import char_cnn_triton

            return char_cnn_triton(char_ids, char_embed, conv_weights, conv_biases, activation)
        conv_biases = list(prec.reference_inputs(char_embed.dtype, *conv_biases))
        op = _char_cnn_cpu_op if be == "cpu" else _char_cnn_reference_op
        return op(char_ids.long(), char_embed, list(conv_weights), conv_biases, activation)


def highway(
    x: torch.Tensor,
    w_carry: torch.Tensor,
    b_carry: torch.Tensor,
    w_transform: torch.Tensor,
    b_transform: torch.Tensor,
    *,
    backend: str | None = "auto",
) -> torch.Tensor:
    """One highway layer, TF convention: g = σ(x·W_carry + b_carry); x' = g·relu(x·W_transform + b_t) + (1-g)·x.

    Under autocast x and both matrices run in the autocast dtype (``elmo_fast.ops._precision``)."""
    F_ = x.shape[-1]
    for name, t, shape in (("w_carry", w_carry, (F_, F_)), ("b_carry", b_carry, (F_,)),
                           ("w_transform", w_transform, (F_, F_)), ("b_transform", b_transform, (F_,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"highway: {name} must have shape {shape}, got {tuple(t.shape)}")
    low = prec.compute_dtype(x)
    (x,) = prec.activations(low, x)
    w_carry, w_transform = prec.weights(low, w_carry, w_transform)
    be = backend_for(backend, x.device, "highway")
    with prec.no_autocast(x.device):
        if be == "triton":
            from ..kernels.highway import highway_triton

            return highway_triton(x, w_carry, b_carry, w_transform, b_transform)
        args = prec.reference_inputs(x.dtype, w_carry, b_carry, w_transform, b_transform)
        rows = x.reshape(-1, F_)
        if be == "cpu" and highway_cpu_applies(rows, *args):
            return highway_cpu(rows, *args).view(x.shape)
        return _highway_reference_op(x, *args)


def projection(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, *, backend: str | None = "auto") -> torch.Tensor:
    """The token encoder's projection, ``x · w + b`` for (N, F) ``x``: ``torch.addmm(b, x, w)`` (the reference),
    except in training on the cpu backend (a gradient wanted, ``backend`` resolving to cpu as for the highway layers
    before it, fp32 CPU matrices, no CPU autocast): there the operator ``elmo_fast::linear_cpu``, whose three
    products take the faster of MKL and oneDNN (no double backward, as the cpu char CNN). Inference keeps addmm
    (MKL): it is the token layer users compare with AllenNLP's, and oneDNN's fp32 sums over K = 2048 land 2-3x
    further from the exact product (max 5.2e-6 against 1.6e-6 at 244 x 2048 by 2048 x 512, AMD EPYC, 2026-11-27)."""
    if linear_cpu_applies(x, w, b) and backend_for(backend, x.device, "highway") == "cpu":
        return linear_cpu(x, w, b)
    return torch.addmm(b, x, w)


# ----------------------------------------------------------------------------- composite paths as operators
Tensor = torch.Tensor


def _char_cnn_reference_fn(char_ids: Tensor, char_embed: Tensor, conv_weights: list[Tensor],
                           conv_biases: list[Tensor], activation: str) -> Tensor:
    return char_cnn_reference(char_ids, char_embed, conv_weights, conv_biases, activation)


def _char_cnn_cpu_fn(char_ids: Tensor, char_embed: Tensor, conv_weights: list[Tensor], conv_biases: list[Tensor],
                     activation: str) -> Tensor:
    return char_cnn_cpu(char_ids, char_embed, conv_weights, conv_biases, activation)


def _highway_reference_fn(x: Tensor, w_carry: Tensor, b_carry: Tensor, w_transform: Tensor,
                          b_transform: Tensor) -> Tensor:
    return highway_reference(x, w_carry, b_carry, w_transform, b_transform)


_char_cnn_reference_op = CompositeOp("char_cnn_reference", _char_cnn_reference_fn)
_char_cnn_cpu_op = CompositeOp("char_cnn_cpu", _char_cnn_cpu_fn)
_highway_reference_op = CompositeOp("highway_reference", _highway_reference_fn)


def _char_cnn_fake(char_ids, char_embed, conv_weights, conv_biases, activation):
    F_ = sum(b.shape[0] for b in conv_biases)
    return char_embed.new_empty(char_ids.shape[0], F_, dtype=torch.promote_types(char_embed.dtype,
                                                                                 conv_weights[0].dtype))


_char_cnn_reference_op.op.register_fake(_char_cnn_fake)
_char_cnn_cpu_op.op.register_fake(_char_cnn_fake)
_highway_reference_op.op.register_fake(lambda x, *params: torch.empty_like(x))
