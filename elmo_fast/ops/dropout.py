"""Training's dropout (the biLM's LSTM inputs and top outputs, spec §6.4): ``dropout(x, p, backend=...)``.

The mask is a hash of (seed, element index), ``elmo_fast.reference.dropout`` (the oracle, which says why), on every
backend that can run it, so one seed gives one mask on every device: ``elmo_fast._cpu.dropout_apply`` where the
extension is built and x is an fp32 CPU tensor, the Triton kernel (``elmo_fast.kernels.dropout``) for the ``triton``
backend (CUDA tensors, or CPU ones under TRITON_INTERPRET=1) and for ``auto`` on CUDA tensors (behind its
self-check), the reference's torch ops otherwise (``reference`` on any device, CPU tensors without the extension).
The seed is drawn from torch's default CPU generator, so ``torch.manual_seed`` fixes the masks on the GPU too (under
``torch.compile`` the draw is in the graph, the operators opaque); reading it is a host read, no device sync.
``torch.nn.functional.dropout`` (the CUDA generator's masks) remains only where no hash can run: the ``cuda``
backend (its extension has no dropout), ``auto`` on a GPU without a working Triton, and a group (an x, outside
``row_groups``) of 2^32 elements or more. Two operators, ``elmo_fast::dropout_hash`` (CPU extension or reference) and
``elmo_fast::dropout_hash_triton``, each with a fake and its gradient (the same operator on the upstream gradient
with the same seeds: nothing is saved).

``row_groups``: inside it, an x whose rows stack several groups (the trainer's fused towers) gets each group's mask
from that group's own random state, the mask the group's rows would get alone after seeding with it: one operator
call with a seed per group (the torch fallback: one draw per group under its saved generator states, and a cat).
"""
from __future__ import annotations

import contextlib
import numbers
import threading

import torch
import torch.nn.functional as F
from torch.library import custom_op

from .._backend import check_backend_name, select_backend, triton_import_error, triton_self_check
from ..cpu.ext import cpu_ext_for
from ..reference.dropout import dropout_reference, dropout_threshold
from ..probes import host_values
from ._library import qualname

Tensor = torch.Tensor


def hashed_dropout_op(name: str, fn):
    """``fn(x, seeds, numels, p) -> y`` as the operator ``elmo_fast::name``, with its fake and its gradient: the same
    operator on the upstream gradient with the same seeds (the mask is a function of them: nothing is saved). The
    CPU's operator below and the Triton kernel's (``kernels/dropout.py``)."""
    op = custom_op(qualname(name), fn, mutates_args=())
    op.register_fake(lambda x, seeds, numels, p: torch.empty_like(x))

    def backward(ctx, dy):
        return op(dy.contiguous(), ctx.seeds, ctx.numels, ctx.p), None, None, None

    op.register_autograd(backward, setup_context=_setup_context)
    return op


def _setup_context(ctx, inputs, output):
    ctx.seeds, ctx.numels, ctx.p = inputs[1], inputs[2], inputs[3]


def check_hash_args(x: Tensor, seeds: Tensor, numels: list[int]) -> list[int]:
    """The seeds' values, after checking the operators' arguments: one seed per group, a 1-d CPU int64 tensor; groups
    that cover x exactly, each under 2^32 elements (the hash's index is 32-bit)."""
    if seeds.device.type != "cpu" or seeds.dtype != torch.int64 or seeds.dim() != 1 or len(seeds) != len(numels):
        raise ValueError(f"dropout_hash: seeds must be a 1-d CPU int64 tensor of one seed per group "
                         f"({len(numels)}), got {seeds.dtype} {tuple(seeds.shape)} on {seeds.device}")
    if sum(numels) != x.numel() or any(not 0 <= n < 2 ** 32 for n in numels):
        raise ValueError(f"dropout_hash: the groups' element counts {list(numels)} must cover x's {x.numel()} "
                         "elements, each in [0, 2^32)")
    return host_values(seeds)


def _hash_cpu(x: Tensor, seeds: Tensor, numels: list[int], p: float) -> Tensor:
    """x · m over consecutive groups of ``numels[g]`` elements of the contiguous x, group g's m from (seeds[g], index
    within the group) (``elmo_fast.reference.dropout``); seeds: a 1-d CPU int64 tensor, one per group. The CPU
    extension for fp32 CPU tensors, else the reference's torch ops (any device: the reference backend on a GPU)."""
    values = check_hash_args(x, seeds, numels)
    y = torch.empty_like(x)
    xf, yf = x.view(-1), y.view(-1)
    ext = cpu_ext_for(x)
    ext = ext if ext is not None and hasattr(ext, "dropout_apply") else None
    thr, scale = dropout_threshold(p), 1.0 / (1.0 - p)
    off = 0
    for s, n in zip(values, numels):
        if ext is not None:
            ext.dropout_apply(xf[off:off + n], yf[off:off + n], s, thr, scale)
        else:
            yf[off:off + n] = dropout_reference(xf[off:off + n], s, p)
        off += n
    return y


_dropout_op = hashed_dropout_op("dropout_hash", _hash_cpu)


_local = threading.local()


class RowGroups:
    """Groups of rows stacked along dim 0 (``rows``: their sizes), each with its random state: ``states[g]`` is
    (torch's CPU generator state, the CUDA default generator's state on ``device`` or None), advanced by each draw
    of the group, as the global generators would be by the group's rows run alone."""

    def __init__(self, rows: list[int], states: list[tuple[Tensor, Tensor | None]], device: torch.device):
        if len(rows) != len(states):
            raise ValueError(f"row_groups: {len(rows)} row counts but {len(states)} random states")
        self.rows, self.states, self.device = list(rows), list(states), device

    def draw(self, g: int, fn, cuda: bool = True):
        """fn() with the global generators at group g's state; the state it leaves becomes group g's. ``cuda``:
        whether fn draws from the CUDA generator too (the hashed masks' seeds come from the CPU one alone)."""
        cpu, dev = self.states[g]
        cuda = cuda and dev is not None
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state(dev, self.device)
        out = fn()
        self.states[g] = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else dev)
        return out


def rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    """The global generators' state that ``RowGroups`` takes for one group: the CPU one, and on a CUDA ``device``
    its default generator's (a host-side seed and offset: no device sync)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def row_groups(groups: RowGroups):
    """In this thread inside the block, ``dropout`` of an x with ``sum(groups.rows)`` rows (dim 0) draws each
    group's mask from the group's state (``RowGroups``); any other x is refused (its rows are not the groups')."""
    prev = getattr(_local, "groups", None)
    _local.groups = groups
    try:
        yield groups
    finally:
        _local.groups = prev


def dropout(x: Tensor, p: float, training: bool = True, backend: str | None = None) -> Tensor:
    """Inverted dropout: each element kept with probability 1 - p and scaled by 1 / (1 - p) (as
    ``F.dropout(x, p, training)``); x itself when not training or p == 0. ``backend``: the model's (module
    docstring: which masks). Inside ``row_groups`` each group of rows is dropped out with its own random state."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be a number in [0, 1], got {p!r}")
    p = float(p)
    if not training or p == 0:
        return x
    if not x.is_floating_point():  # as F.dropout refuses them: a scaled integer would be a silent truncation
        raise TypeError(f"dropout: x must be a floating-point tensor, got {x.dtype}")
    groups = getattr(_local, "groups", None)
    if groups is not None and (x.dim() == 0 or x.shape[0] != sum(groups.rows)):
        raise ValueError(f"dropout inside row_groups: x's first dimension must stack the groups' "
                         f"{sum(groups.rows)} rows ({groups.rows}), got shape {tuple(x.shape)}")
    if dropout_threshold(p) >= 2 ** 32:  # p = 1, or so close that no 32-bit hash is kept: every element dropped
        return x * 0.0  # (a NaN stays NaN, as F.dropout's)
    if groups is None:
        numels = [x.numel()]
    else:
        per_row = x[0].numel() if x.shape[0] else 0
        numels = [r * per_row for r in groups.rows]
    impl = hash_impl(backend, x.device) if max(numels, default=0) < 2 ** 32 else "torch"
    if impl == "torch":  # F.dropout, from the CUDA generator where x is on a GPU
        if groups is None:
            return F.dropout(x, p, training=True)
        return torch.cat([groups.draw(g, lambda xg=xg: F.dropout(xg, p, training=True))
                          for g, xg in enumerate(x.split(groups.rows, 0))], 0)
    if groups is None:
        seeds = _seed().reshape(1)
    else:
        seeds = torch.stack([groups.draw(g, _seed, cuda=False) for g in range(len(groups.rows))])
    if impl == "triton":
        from ..kernels.dropout import dropout_hash_triton

        return dropout_hash_triton(x, seeds, numels, p)
    return _dropout_op(x.contiguous(), seeds, numels, p)


@torch.compiler.assume_constant_result
def hash_impl(backend: str | None, device: torch.device) -> str:
    """Which implementation ``dropout`` runs on ``device`` under ``backend``: "triton" (the kernel), "op" (the CPU
    extension or the reference's torch ops: ``elmo_fast::dropout_hash``) or "torch" (``F.dropout``: the ``cuda``
    backend, ``auto`` on a GPU where Triton is missing or failed its self-check). An explicit ``triton`` that cannot
    run raises. While torch.compile traces, a constant of the graph (it reads the environment and probes imports, as
    ``_library.backend_for``). A group of 2^32 elements or more takes "torch" whatever this says."""
    b = check_backend_name(backend)
    dev = torch.device(device)
    if b == "cuda":
        return "torch"
    if b == "triton":
        select_backend("triton", dev, "dropout")
        return "triton"
    if b == "auto" and dev.type == "cuda":
        return "triton" if triton_import_error() is None and triton_self_check("dropout", dev) else "torch"
    return "op"


def _seed() -> Tensor:
    """A seed from torch's default CPU generator, on the CPU whatever the default device (a meta or CUDA seed would
    reach the fake, or a device sync)."""
    return torch.randint(-(2 ** 63), 2 ** 63 - 1, (), dtype=torch.int64, device="cpu")
