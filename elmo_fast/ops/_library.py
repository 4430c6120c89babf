"""The fused ops as ``torch.library`` operators, so that ``torch.compile`` and ``torch.export`` see them.

One namespace, ``elmo_fast::``. Every backend of every fused op is one operator (or a forward/backward pair):

* the Triton implementations are ``torch.library.triton_op``s whose kernel launches all go through
  ``torch.library.wrap_triton`` (``elmo_fast.kernels``): ``torch.compile`` on a GPU traces into them and sees the
  kernels; ``torch.export`` keeps them as operators;
* the others (``reference``, ``cpu``, the CUDA extension) are ``torch.library.custom_op``s: opaque to the
  compiler, which calls them with real tensors; so is the Triton dropout (``elmo_fast::dropout_hash_triton``),
  which reads its seeds, CPU tensors, on the host (``kernels/dropout.py`` says why);
* every operator has a fake (meta) implementation that gives the output shapes and dtypes from the input shapes,
  and its gradient through ``register_autograd``: the backward is a second operator (the backend's own backward
  through time, recomputation, ...) or, for the reference, autograd through the reference code.

Operators take only tensors and plain scalars. Data-dependent checks (ranges of ids and lengths) stay outside them,
in the Python functions of ``elmo_fast.ops`` that validate arguments once and then call the operator.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.library import custom_op, infer_schema

NAMESPACE = "elmo_fast"


def qualname(name: str) -> str:
    """``elmo_fast::name``: the operator's registered name."""
    return f"{NAMESPACE}::{name}"


def tracing(*tensors) -> bool:
    """True while ``torch.compile`` / ``torch.export`` / ``opcheck`` trace (dynamo is running, or the tensors are
    fake or functional ones): host caches, autotuning timers and Python-side state are then left alone."""
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(t, torch.Tensor) and _traced(t) for t in tensors)


def _traced(t: torch.Tensor) -> bool:
    # A plain, non-functional torch.Tensor is a real one: every kernel launch asks this of each argument, and
    # ``is_fake`` alone cost ~1 µs a tensor (a 15-argument LSTMP launch: 14.5 µs of host time on the CPU here)
    if torch._is_functional_tensor(t):
        return True
    return type(t) is not torch.Tensor and is_fake(t)


class ThreadFlag:
    """A per-thread switch: false, except in this thread inside ``with flag.on():``."""

    def __init__(self):
        self._local = threading.local()

    def __bool__(self) -> bool:
        return getattr(self._local, "on", False)

    def on(self):
        # while torch.compile traces, no traced code reads a flag (check_lengths asserts in the graph instead), and
        # torch 2.11's dynamo cannot trace this generator's bool(self): a graph break in every compiled LSTMP
        if torch.compiler.is_compiling():
            return contextlib.nullcontext()
        return self._on()

    @contextlib.contextmanager
    def _on(self):
        old = bool(self)
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = old


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will want a gradient of a call on ``tensors`` (None entries ignored): grad mode is on and
    one of them requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def nothing(like: torch.Tensor) -> torch.Tensor:
    """The placeholder an operator returns for an output it did not compute (an operator cannot return None, nor
    an alias of an input or of another output): a fresh empty tensor of ``like``'s dtype and device."""
    return like.new_empty(0)


# Triton kernels with no fp64 on a GPU (Triton 3.6 cannot compile the char CNN's fp64 backward; the softmax kernels
# take fp32/bf16/fp16 only): ``auto`` gives fp64 calls of these on a GPU to the reference, an explicit 'triton'
# raises with the fix.
NO_FP64_ON_GPU = frozenset({"char_cnn", "sampled_softmax", "full_softmax"})


@torch.compiler.assume_constant_result
def backend_for(backend: str | None, device: torch.device, op: str, dtype: torch.dtype | None = None) -> str:
    """``elmo_fast._backend.select_backend``, and ``auto``'s fp64 rule above (``dtype``: the op's floating dtype);
    while torch.compile traces, evaluated once per call site and treated as a constant of the graph (it reads the
    environment and probes imports, which dynamo cannot trace)."""
    from .._backend import _normalise, select_backend

    be = select_backend(backend, device, op)
    if (be == "triton" and dtype == torch.float64 and op in NO_FP64_ON_GPU and torch.device(device).type == "cuda"
            and _normalise(backend) == "auto"):
        return "reference"
    return be


class CompositeOp:
    """An implementation written as differentiable PyTorch (the reference paths, the cpu char CNN) together with
    its operator ``elmo_fast::name`` and that operator's backward ``elmo_fast::name_backward``.

    Calling it runs the function itself eagerly: autograd records it, nothing is computed twice. While
    torch.compile / torch.export trace, it calls the operator, which the compiler keeps whole (the cpu char CNN
    reads data on the host; the reference LSTMP would unroll its time loop). The operator's gradient is the
    backward operator: autograd through the same function, run again from the saved inputs (opaque too).
    ``fn``'s annotations give the schema; its arguments are tensors, lists of tensors and plain scalars, its
    result a tensor or a tuple of tensors. Register the fake implementation of the forward on ``.op``.
    """

    def __init__(self, name: str, fn):
        self.fn = fn
        self.op = custom_op(qualname(name), fn, mutates_args=())
        self.op.register_autograd(self._backward, setup_context=_setup_context)
        args = infer_schema(fn, mutates_args=())
        args = args[1 : args.rindex(") ->")]
        self.backward_op = custom_op(qualname(f"{name}_backward"), self._vjp, mutates_args=(),
                                     schema=f"(Tensor[] grads, bool[] needs, {args}) -> Tensor[]")
        self.backward_op.register_fake(_vjp_fake)

    def __call__(self, *args):
        if tracing(*_tensors(args)):
            return self.op(*args)
        return self.fn(*args)

    def _vjp(self, grads, needs, *args):
        """The gradients of the tensors of ``args`` that ``needs`` flags, in order (zeros for those the outputs do
        not depend on, dense and contiguous), an empty placeholder for the others."""
        leaves = []

        def leaf(t, need):
            t = t.detach()
            if need:
                leaves.append(t.requires_grad_())
            return t

        flags = iter(needs)
        # inside an operator autograd is switched off below the dispatcher: switch it back on for the recomputation
        with _autograd_on(), torch.enable_grad():
            args = _map_tensors(args, lambda t: leaf(t, next(flags)))
            out = self.fn(*args)
            got = torch.autograd.grad(out, leaves, grads, allow_unused=True) if leaves else ()
        got = iter(got)

        def grad(t, need):
            if not need:
                return nothing(t)
            g = next(got)
            if g is None:
                return torch.zeros_like(t)
            return g.to_dense() if g.is_sparse else g.contiguous()  # the layout the fake implementation gives

        return [grad(t, need) for t, need in zip(_tensors(args), needs)]

    def _backward(self, ctx, *grads):
        saved = iter(ctx.saved_tensors)
        args = [[next(saved) if v is _SAVED else v for v in a] if isinstance(a, list) else
                next(saved) if a is _SAVED else a for a in ctx.args]
        needs = [bool(n) and t.is_floating_point() for t, n in zip(_tensors(args), _flags(ctx.needs_input_grad))]
        got = zip(self.backward_op(list(grads), needs, *args), needs)

        def grad(_):
            g, need = next(got)
            return g if need else None

        return tuple(_map_tensors(args, grad, keep=None))


def _tensors(args) -> list:
    return [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor)]


def _flags(needs) -> list:
    return [n for a in needs for n in (a if isinstance(a, (list, tuple)) else (a,))]


def _map_tensors(args, fn, keep=True) -> list:
    """``args`` with every tensor (also inside lists) replaced by ``fn(tensor)``; other values kept (or, with
    ``keep=None``, replaced by None). Needs and results are matched to the tensors in this order."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return fn(v)
        return v if keep else None

    return [[one(v) for v in a] if isinstance(a, (list, tuple)) else one(a) for a in args]


def _setup_context(ctx, inputs, output):
    ctx.args = _map_tensors(inputs, lambda _: _SAVED)
    ctx.save_for_backward(*_tensors(inputs))


def _vjp_fake(grads, needs, *args):
    return [torch.empty_like(t) if need else nothing(t) for t, need in zip(_tensors(args), needs)]


def _autograd_on():
    """Autograd keys out of the thread's excluded dispatch keys (an operator's implementation runs with them
    excluded, see torch._library.autograd)."""
    guard = contextlib.ExitStack()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther):
        guard.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
    return guard


_SAVED = object()
