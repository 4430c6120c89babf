"""Training's dropout (the biLM's LSTM inputs and top outputs, spec §6.4): ``dropout(x, p, backend=...)``.

For the CPU backends (``cpu``, ``reference``, and ``auto`` on CPU tensors) the mask is a hash of (seed, element
index), ``elmo_fast.reference.dropout`` (the oracle, which says why), run by ``elmo_fast._cpu.dropout_apply`` where
the extension is built and x is fp32 (the reference's torch ops otherwise: the same bits); the seed is drawn from
torch's default CPU generator, so ``torch.manual_seed`` fixes the masks (under ``torch.compile`` too: the draw is in
the graph, the operator opaque). The GPU backends (``triton``, ``cuda``, and their CPU emulation under
TRITON_INTERPRET=1) take ``torch.nn.functional.dropout``, as on a GPU: no host read of a seed in their hot path.
One operator, ``elmo_fast::dropout_hash``, with a fake and its gradient (the same operator on the upstream gradient
with the same seed).

``row_groups``: inside it, an x whose rows stack several groups (the trainer's fused towers) gets each group's mask
from that group's own random state, the mask the group's rows would get alone after seeding with it.
"""
from __future__ import annotations

import contextlib
import numbers
import threading

import torch
import torch.nn.functional as F
from torch.library import custom_op

from .._backend import check_backend_name
from ..cpu.ext import cpu_ext_for
from ..reference.dropout import dropout_reference, dropout_threshold
from ._library import qualname

Tensor = torch.Tensor


@custom_op(qualname("dropout_hash"), mutates_args=())
def _dropout_op(x: Tensor, seed: Tensor, p: float) -> Tensor:
    """x · m, m from (seed, index) (``elmo_fast.reference.dropout``); seed: a 0-d CPU int64 tensor."""
    if seed.device.type != "cpu" or seed.dtype != torch.int64 or seed.dim() != 0:
        raise ValueError(f"dropout_hash: seed must be a 0-d CPU int64 tensor, got {seed.dtype} {tuple(seed.shape)} "
                         f"on {seed.device}")
    s = int(seed)  # a CPU tensor: no device synchronisation
    ext = cpu_ext_for(x)
    if ext is not None and hasattr(ext, "dropout_apply"):
        y = torch.empty_like(x)
        ext.dropout_apply(x, y, s, dropout_threshold(p), 1.0 / (1.0 - p))
        return y
    return dropout_reference(x, s, p)


@_dropout_op.register_fake
def _(x, seed, p):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    ctx.seed, ctx.p = inputs[1], inputs[2]


def _backward(ctx, dy):
    return _dropout_op(dy.contiguous(), ctx.seed, ctx.p), None, None


_dropout_op.register_autograd(_backward, setup_context=_setup_context)


_local = threading.local()


class RowGroups:
    """Groups of rows stacked along dim 0 (``rows``: their sizes), each with its random state: ``states[g]`` is
    (torch's CPU generator state, the CUDA default generator's state on ``device`` or None), advanced by each draw
    of the group, as the global generators would be by the group's rows run alone."""

    def __init__(self, rows: list[int], states: list[tuple[Tensor, Tensor | None]], device: torch.device):
        if len(rows) != len(states):
            raise ValueError(f"row_groups: {len(rows)} row counts but {len(states)} random states")
        self.rows, self.states, self.device = list(rows), list(states), device

    def draw(self, g: int, fn):
        """fn() with the global generators at group g's state; the state it leaves becomes group g's."""
        cpu, dev = self.states[g]
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.cuda.set_rng_state(dev, self.device)
        out = fn()
        self.states[g] = (torch.get_rng_state(),
                          torch.cuda.get_rng_state(self.device) if dev is not None else None)
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
    groups = getattr(_local, "groups", None)
    if groups is None:
        return _dropout(x, p, backend)
    if x.dim() == 0 or x.shape[0] != sum(groups.rows):
        raise ValueError(f"dropout inside row_groups: x's first dimension must stack the groups' "
                         f"{sum(groups.rows)} rows ({groups.rows}), got shape {tuple(x.shape)}")
    parts = x.split(groups.rows, 0)
    return torch.cat([groups.draw(g, lambda xg=xg: _dropout(xg.contiguous(), p, backend))
                      for g, xg in enumerate(parts)], 0)


def _dropout(x: Tensor, p: float, backend: str | None) -> Tensor:
    if dropout_threshold(p) >= 2 ** 32:  # p = 1, or so close that no 32-bit hash is kept: every element dropped
        return x * 0.0  # (a NaN stays NaN, as F.dropout's)
    hashed = check_backend_name(backend) in ("auto", "cpu", "reference") and x.device.type == "cpu"
    if not hashed or x.numel() >= 2 ** 32:
        return F.dropout(x, p, training=True)
    # torch's default CPU generator, on the CPU whatever the default device (a meta or CUDA seed would reach the
    # fake, or a device sync)
    seed = torch.randint(-(2 ** 63), 2 ** 63 - 1, (), dtype=torch.int64, device="cpu")
    return _dropout_op(x.contiguous(), seed, p)
