"""AllenNLP-compatible ``ScalarMix``."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..reference.scalar_mix import scalar_mix_reference
from ..util import check_int, configuration_error


def mix_weights_problem(values) -> str | None:
    """Why ``values`` cannot be a layer mix's weights (softmax-normalised), or None: each must be a number, not NaN and
    not +inf; -inf is allowed (it leaves a layer out, as AllenNLP users do to select one), but not for every
    weight (the softmax would be 0/0)."""
    try:
        nums = [float(v) for v in values]
    except (TypeError, ValueError):
        return f"must be numbers, got {list(values)!r}"
    bad = [v for v in nums if math.isnan(v) or v == math.inf]
    if bad:
        return f"must not be NaN or +inf, got {bad[0]!r} in {nums!r}"
    if nums and all(v == -math.inf for v in nums):
        return f"must not all be -inf (the softmax would be 0/0), got {nums!r}"
    return None


def refuse_non_finite_pre_hook(module: nn.Module, state_dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook of a layer mix (``ScalarMix``, bilm-tf's ``WeightLayers``): a NaN or +inf mix
    weight, mix weights that are all -inf, or a non-finite ``gamma``, loaded from a file, would make every output NaN
    or infinite, so they are refused by key before anything of the module is loaded (-inf weights that leave layers
    out are kept)."""
    weights, keys = [], []
    for name, _ in module.named_parameters():
        value = state_dict.get(prefix + name)
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            continue
        if name.split(".")[-1] == "gamma":
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{prefix}{name}: the loaded state_dict holds non-finite values "
                                 f"{value.flatten()[:8].tolist()} for the layer mix's scale, expected finite numbers "
                                 "(a checkpoint of a run that diverged?)")
            continue
        weights += value.flatten().tolist()
        keys.append(prefix + name)
    problem = mix_weights_problem(weights) if weights else None
    if problem:
        raise ValueError(f"{', '.join(keys)}: the loaded layer-mix weights {problem} (a checkpoint of a run that "
                         "diverged?)")


class ScalarMix(nn.Module):
    """γ · Σ softmax(w)_j · N(layer_j); N is the masked whole-tensor normalisation when ``do_layer_norm``.

    ``initial_scalar_parameters`` are pre-softmax weights; ``trainable=False`` freezes them and γ (at 1.0).
    ``eps`` defaults to AllenNLP's 1e-13; bilm-tf used 1e-12 and boundary-free statistics.
    """

    def __init__(self, mixture_size: int, do_layer_norm: bool = False,
                 initial_scalar_parameters: list[float] | None = None, trainable: bool = True,
                 eps: float | None = None):
        super().__init__()
        mixture_size = check_int(mixture_size, "ScalarMix's mixture_size", 1, " (the number of layers)",
                                 error=configuration_error)
        if initial_scalar_parameters is None:
            initial_scalar_parameters = [0.0] * mixture_size
        if len(initial_scalar_parameters) != mixture_size:
            raise configuration_error(
                f"initial_scalar_parameters has {len(initial_scalar_parameters)} values, expected {mixture_size}"
            )
        problem = mix_weights_problem(initial_scalar_parameters)
        if problem:
            raise configuration_error(f"initial_scalar_parameters {problem}")
        self.mixture_size = mixture_size
        self.do_layer_norm = do_layer_norm
        self.eps = eps
        self.scalar_parameters = nn.ParameterList(
            [nn.Parameter(torch.tensor([float(v)]), requires_grad=trainable) for v in initial_scalar_parameters]
        )
        self.gamma = nn.Parameter(torch.tensor([1.0]), requires_grad=trainable)
        self.register_load_state_dict_pre_hook(refuse_non_finite_pre_hook)

    def forward(self, tensors: list[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
        if len(tensors) != self.mixture_size:
            raise configuration_error(f"ScalarMix has {self.mixture_size} weights but got {len(tensors)} tensors")
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors]
        if any(shape != shapes[0] or not isinstance(shape, tuple) for shape in shapes):
            raise ValueError(f"ScalarMix mixes tensors of one shape, got {shapes}")
        if self.do_layer_norm and mask is not None and tuple(mask.shape) != shapes[0][:-1]:
            raise ValueError(f"ScalarMix: the mask must have the layers' shape without the feature axis, "
                             f"{shapes[0][:-1]}, got {tuple(mask.shape)} (a broadcast mask would give the layer norm "
                             "wrong statistics)")
        w = torch.cat(list(self.scalar_parameters)).to(tensors[0].dtype)
        eps = self.eps
        if eps is None:
            eps = 1e-4 if tensors[0].dtype == torch.float16 else 1e-13
        return scalar_mix_reference(tensors, w, self.gamma.to(tensors[0].dtype), mask, self.do_layer_norm, eps)
