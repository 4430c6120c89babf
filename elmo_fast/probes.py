"""Counting instruments for tests and benchmarks, usable on the CPU (with ``TRITON_INTERPRET=1``):

* :func:`probe` counts, inside a ``with`` block, Triton kernel launches (by wrapping the launch path,
  ``JITFunction.run`` / the interpreter's ``InterpretedFunction.run``, with each launch's tensor dtypes and
  constexpr flags), host synchronisations and pageable host->device uploads (by patching the calls that would
  make them on a GPU), and torch operator calls that launch work (each about one kernel on a GPU; views,
  metadata and factory-free reshapes excluded).
* ``probe(forbid=True)`` raises :class:`HostSyncError` at the first sync or pageable upload instead.

What counts as a sync: ``Tensor.item / tolist / __bool__ / __int__ / __float__ / __index__ / cpu / numpy``,
``torch.nonzero``, ``torch.unique`` (and ``unique_consecutive``), ``torch.equal``, ``torch.masked_select`` and
``torch.cuda.synchronize`` -- each reads a device value on the host or sizes an output from device data. What
counts as a pageable upload: ``torch.tensor`` / ``torch.as_tensor`` of host data with a ``device=``, and
``.to(device)`` / ``.cuda()`` of a tensor made from host data (``torch.from_numpy``, ``torch.tensor`` without a
device) that was not pinned first. With "cuda" mapped to the CPU these are the calls that would sync or copy on
a GPU. Work inside a Triton launch (the interpreter's own numpy traffic) is not counted.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
                 "unique", "unique_consecutive", "masked_select")
SYNC_FUNCS = ("nonzero", "unique", "unique_consecutive", "equal", "masked_select")


class HostSyncError(RuntimeError):
    """A host sync or pageable upload inside a region that must have none."""


@dataclass
class Launch:
    kernel: str
    dtypes: dict  # tensor argument name -> dtype
    flags: dict  # keyword (constexpr) arguments that are bools or strings


@dataclass
class Counts:
    launches: list = field(default_factory=list)
    syncs: list = field(default_factory=list)  # what synced, e.g. "Tensor.item"
    uploads: list = field(default_factory=list)
    torch_ops: int = 0

    @property
    def n_launches(self) -> int:
        return len(self.launches)


_state = threading.local()  # depth: inside a counted call (its inner work is not counted again), per thread
_active: list = [None]  # the probe's Counts: process-wide, as its patches are, so that work autograd runs on its
# own device thread (backward on a GPU) is counted too


def _depth() -> int:
    return getattr(_state, "depth", 0)


@contextlib.contextmanager
def _inside():
    _state.depth = _depth() + 1
    try:
        yield
    finally:
        _state.depth -= 1


@contextlib.contextmanager
def graph_replay(name: str):
    """A graph replay (the LSTMP loop graphs', CUDA or ``record`` mode): counted by an active :func:`probe` as
    one launch, in any thread, as the replay of a CUDA graph is one; the launches inside are not counted."""
    counts = _active[0]
    if counts is not None and _depth() == 0:
        counts.launches.append(Launch(f"graph replay: {name}", {}, {}))
    with _inside():
        yield


def host_values(t: torch.Tensor) -> list:
    """The values of a CPU tensor (``tolist``) as a host read, which no probe counts as a sync: on a GPU it syncs
    nothing (the dropout seeds, drawn from torch's CPU generator, are read this way inside their operators)."""
    if t.device.type != "cpu":
        raise ValueError(f"host_values reads CPU tensors only (a device tensor's values would sync), got {t.device}")
    with _inside():
        return t.tolist()


def _mark_host(t):
    if isinstance(t, torch.Tensor):
        t._elmo_fast_host = True
    return t


def _is_device_arg(a) -> bool:
    return isinstance(a, (torch.device, str)) and not (isinstance(a, str) and a.startswith("torch."))


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _depth() == 0 and not func.is_view and "view" not in func.__name__:
            self.counts.torch_ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def probe(forbid: bool = False, count_ops: bool = False):
    """Count launches, syncs and uploads in the block (``forbid``: raise at the first sync or upload).

    Not thread-safe: it patches ``torch`` and triton classes for the duration of the block.
    """
    counts = Counts()
    patches: list[tuple[object, str, object]] = []

    def note(kind: str, what: str):
        if _depth():
            return
        if forbid:
            raise HostSyncError(f"{kind} in a hot path: {what}")
        (counts.syncs if kind == "host sync" else counts.uploads).append(what)

    def patch(owner, name, make):
        orig = getattr(owner, name)
        patches.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, make(orig))

    def sync_wrapper(what):
        def make(orig):
            def wrapped(*a, **k):
                note("host sync", what)
                with _inside():
                    return orig(*a, **k)
            return wrapped
        return make

    for name in SYNC_METHODS:
        patch(torch.Tensor, name, sync_wrapper(f"Tensor.{name}"))
    for name in SYNC_FUNCS:
        patch(torch, name, sync_wrapper(f"torch.{name}"))
    patch(torch.cuda, "synchronize", sync_wrapper("torch.cuda.synchronize"))

    def factory(orig, name):
        def wrapped(data, *a, **k):
            dev = k.get("device")
            with _inside():
                out = orig(data, *a, **k)
            if not isinstance(data, torch.Tensor):
                if dev is not None:
                    note("pageable upload", f"torch.{name}(host data, device={dev})")
                else:
                    _mark_host(out)
            return out
        return wrapped

    patch(torch, "tensor", lambda orig: factory(orig, "tensor"))
    patch(torch, "as_tensor", lambda orig: factory(orig, "as_tensor"))
    patch(torch, "from_numpy", lambda orig: lambda a: _mark_host(orig(a)))

    def mover(orig, name):
        def wrapped(self, *a, **k):
            moves = name == "cuda" or "device" in k or any(_is_device_arg(x) for x in a)
            if moves and getattr(self, "_elmo_fast_host", False):
                note("pageable upload", f"Tensor.{name}(device) of host data")
            with _inside():
                return orig(self, *a, **k)
        return wrapped

    patch(torch.Tensor, "to", lambda orig: mover(orig, "to"))
    patch(torch.Tensor, "cuda", lambda orig: mover(orig, "cuda"))

    def launcher(orig):
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup and _depth() == 0:
                names = getattr(self, "arg_names", None) or [p.name for p in getattr(self, "params", [])]
                dtypes = {n: a.dtype for n, a in zip(names, args) if isinstance(a, torch.Tensor)}
                dtypes.update({n: a.dtype for n, a in kwargs.items() if isinstance(a, torch.Tensor)})
                flags = {n: a for n, a in kwargs.items() if isinstance(a, (bool, str))}
                counts.launches.append(Launch(getattr(self, "__name__", "?"), dtypes, flags))
            with _inside():
                return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        return run

    try:
        from triton.runtime.jit import JITFunction

        patch(JITFunction, "run", launcher)
        from triton.runtime.interpreter import InterpretedFunction

        patch(InterpretedFunction, "run", launcher)
    except ImportError:
        pass
    mode = _OpCounter(counts) if count_ops else contextlib.nullcontext()
    outer, _active[0] = _active[0], counts
    try:
        with mode:
            yield counts
    finally:
        _active[0] = outer
        for owner, name, own in reversed(patches):
            if own is None:  # inherited (e.g. from torch._C.TensorBase): drop the override
                delattr(owner, name)
            else:
                setattr(owner, name, own)
