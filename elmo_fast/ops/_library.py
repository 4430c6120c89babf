"""The fused ops as ``torch.library`` operators, so that ``torch.compile`` and ``torch.export`` see them.

One namespace, ``elmo_fast::``. Every backend of every fused op is one operator (or a forward/backward pair):

* the Triton implementations are ``torch.library.triton_op``s whose kernel launches all go through
  ``torch.library.wrap_triton`` (``elmo_fast.kernels``): ``torch.compile`` on a GPU traces into them and sees the
  kernels; ``torch.export`` keeps them as operators;
* the others (``reference``, ``cpu``, the CUDA extension) are ``torch.library.custom_op``s: opaque to the
  compiler, which calls them with real tensors;
* every operator has a fake (meta) implementation that gives the output shapes and dtypes from the input shapes,
  and its gradient through ``register_autograd``: the backward is a second operator (the backend's own backward
  through time, recomputation, ...) or, for the reference, autograd through the reference code.

Operators take only tensors and plain scalars. Data-dependent checks (ranges of ids and lengths) stay outside them,
in the Python functions of ``elmo_fast.ops`` that validate arguments once and then call the operator.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

NAMESPACE = "elmo_fast"


def qualname(name: str) -> str:
    """``elmo_fast::name``: the operator's registered name."""
    return f"{NAMESPACE}::{name}"


def tracing(*tensors) -> bool:
    """True while ``torch.compile`` / ``torch.export`` / ``opcheck`` trace (dynamo is running, or the tensors are
    fake or functional ones): host caches, autotuning timers and Python-side state are then left alone."""
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(t, torch.Tensor) and (is_fake(t) or torch._is_functional_tensor(t)) for t in tensors)


def nothing(like: torch.Tensor) -> torch.Tensor:
    """The placeholder an operator returns for an output it did not compute (an operator cannot return None, nor
    an alias of an input or of another output): a fresh empty tensor of ``like``'s dtype and device."""
    return like.new_empty(0)


@torch.compiler.assume_constant_result
def backend_for(backend: str | None, device: torch.device, op: str) -> str:
    """``elmo_fast._backend.select_backend``; while torch.compile traces, evaluated once per call site and
    treated as a constant of the graph (it reads the environment and probes imports, which dynamo cannot trace)."""
    from .._backend import select_backend

    return select_backend(backend, device, op)
