"""Pieces the Triton kernel files share (installed as ``elmo_fast.kernels._common``): a dot with the CPU
interpreter's bf16 workaround, the host-side flags and accumulation dtypes the launchers pass in, and the
launch descriptions (``Target``, ``Launch``) that the launchers and ``bench/kernel_report.py`` both use.

Kernels run compiled on CUDA tensors or under ``TRITON_INTERPRET=1`` on CPU tensors; the workarounds here
are for the interpreter and change no value there (bf16 products are exact in fp32).

Every launcher computes its launch configuration (constexprs, ``num_warps``, ``num_stages``, grid) with a
pure function of the problem shape, the dtype and a ``Target``, and launches exactly what that function
returns. The kernel report calls the same functions for ``H100`` (no GPU needed), so the compiled variants
it measures are the ones the runtime launches (``tests/test_kernel_report.py`` checks it).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op, wrap_triton

from elmo_fast._backend import triton_interpret
from elmo_fast.determinism import is_deterministic
from elmo_fast.ops._library import qualname, tracing


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # fp32-accumulating dot. IEEE: fp32 operands use exact fp32 products (not TF32). UPCAST (interpreter only):
    # numpy has no bf16 matmul, so low-precision operands are widened to fp32 there (exact for bf16 values).
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # acc + a·b with acc's dtype (fp32, or fp64 for fp64 tests); UPCAST and IEEE as in ``dot``.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=acc.dtype)
    else:
        return tl.dot(a, b, acc, out_dtype=acc.dtype)


@triton.jit
def tanh(x):
    # tanh(|x|) = (1 - e) / (1 + e), e = exp(-2|x|) <= 1 (never overflows), the sign put back. In fp32, below
    # |x| = 0.4, where 1 - e cancels (tanh(1e-6) came out 1.3% off), the odd Taylor series to x^13 (the next term is
    # under 0.1 ulp there): a few ulp of the result everywhere, and -0.0 stays -0.0. fp64 (the fp64 tests' accumulator)
    # keeps the quotient, right to ~1e-16 absolute. (tl.exp takes fp32 and fp64 only: callers pass their accumulator.)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x >= 0, t, -t)
    if x.dtype != tl.float64:
        x2 = x * x
        p = x2 * 3.5921280365724811e-3 - 8.8632355299021973e-3  # 21844/6081075, -1382/155925
        p = p * x2 + 2.1869488536155203e-2  # 62/2835
        p = p * x2 - 5.3968253968253971e-2  # -17/315
        p = p * x2 + 1.3333333333333333e-1  # 2/15
        p = p * x2 - 3.3333333333333333e-1  # -1/3
        t = tl.where(tl.abs(x) < 0.4, tl.where(x == 0.0, x, x + x * (x2 * p)), t)
    return t


@dataclass(frozen=True)
class Target:
    """What a launch configuration depends on besides the problem: the CPU interpreter, or compiled CUDA code
    on a GPU with ``sms`` multiprocessors."""

    interpret: bool
    sms: int = 1
    smem: int = 227 * 1024  # shared memory a block may opt into (an H100's; the GPU's own on a GPU)
    major: int = 0  # compute capability's major number (0: unknown; the GPU's own on a GPU): PDL needs 9


INTERPRETER = Target(interpret=True)
H100 = Target(interpret=False, sms=132, major=9)  # H100 SXM (and H200): the report's target


def target_from(props) -> Target:
    """The compiled-code target of a GPU with these ``torch.cuda.get_device_properties``: its SMs, the shared memory
    a block may opt into (``shared_memory_per_block_optin`` where torch has it, else the 48 KiB default) and its
    compute capability's major number."""
    smem = getattr(props, "shared_memory_per_block_optin", None) or props.shared_memory_per_block
    return Target(interpret=False, sms=props.multi_processor_count, smem=smem, major=props.major)


@functools.lru_cache(maxsize=None)
def cuda_target(index: int) -> Target:
    return target_from(torch.cuda.get_device_properties(index))


def target_of(device: torch.device) -> Target:
    """The target kernels on ``device``'s tensors run on (the interpreter for CPU tensors)."""
    if device.type != "cuda" or triton_interpret():
        return INTERPRETER
    return cuda_target(device.index if device.index is not None else torch.cuda.current_device())


@dataclass
class Launch:
    """One kernel launch: the kernel, its grid and its keyword arguments (constexprs, ``num_warps``,
    ``num_stages``). Calling it with the runtime arguments launches it."""

    kernel: Any
    grid: tuple[int, ...]
    meta: dict = field(default_factory=dict)

    def __call__(self, *args):
        launch(self.kernel, self.grid, args, self.meta)


def launch(kernel, grid: tuple, args, kwargs: dict) -> None:
    """Every kernel launch of the package goes through here, or through ``launchable`` (the LSTMP time loops ask
    it once per loop: ``lstmp_graphs.launcher``).

    Eagerly it is the plain launch (``torch.library.wrap_triton`` returns the kernel itself inside a triton_op
    called with real tensors). While ``torch.compile`` / ``torch.export`` trace an operator the launch goes through
    ``wrap_triton``, which records it in the graph. The interpreter's kernels (``TRITON_INTERPRET=1``) cannot be
    recorded: there the operators stay opaque to the compiler (``triton_operator``), and a launch on fake tensors
    (their fake implementation, which only needs the output shapes) does nothing."""
    k = launchable(kernel, args)
    if k is not None:
        k[grid](*args, **kwargs)


def device_constant(cache: dict, key, make, like: torch.Tensor) -> torch.Tensor:
    """``make(device)``, a small tensor of constants on ``like``'s device, made once per (``key``, device) in
    ``cache`` and then reused: no host-to-device copy per call (a constant of the graph while torch.compile /
    torch.export trace). Made afresh and not kept while ``like`` (the op's input) is traced (a fake or functional
    tensor: opcheck, make_fx, AOT autograd without dynamo), since a traced launch refuses a real tensor among fake
    ones (the H200, 2026-11-27), or while a CUDA graph is being captured (a tensor filled inside a capture holds
    nothing until its replay)."""
    dev = like.device
    if tracing(like) or (like.is_cuda and torch.cuda.is_current_stream_capturing()):
        return make(dev)
    key = (key, dev)
    t = cache.get(key)
    if t is None:
        t = make(dev)
        if not tracing(t):  # made under an active fake mode: never kept
            cache[key] = t
    return t


def launchable(kernel, args):
    """What ``launch`` calls for these arguments: the kernel; its ``wrap_triton`` while torch.compile traces; None
    where a trace cannot record it (the interpreter's kernels on fake tensors). A loop that launches with the same
    tensors step after step asks once (``lstmp_graphs.launcher``)."""
    if tracing(*args):
        return None if triton_interpret() else wrap_triton(kernel)
    return kernel


# Operators kept whole under torch.compile on a GPU too (``kept_whole``): the LSTMP time loops launch T steps of
# kernels that mutate buffers aliasing one another (z is gx, unused buffers alias used ones) and, eagerly, replay
# loop graphs; traced into on the H200 (2026-11-27), opcheck's AOT dispatch gave other outputs than eager and the
# stateful biLM compiled to other numbers (0.48 off). Whole, the compiled graph calls them with real tensors.
KEPT_WHOLE = frozenset({"lstmp_triton", "lstmp_triton_backward"})


def kept_whole(name: str) -> bool:
    """Whether torch.compile keeps the operator ``name`` whole (``triton_operator``): every operator under the
    interpreter (its kernels cannot be recorded in a trace), the ``KEPT_WHOLE`` ones everywhere."""
    return triton_interpret() or name in KEPT_WHOLE


def triton_operator(name: str, fn):
    """``fn`` as the ``torch.library.triton_op`` ``elmo_fast::name`` (fn's own tracing is its fake implementation).

    Where ``kept_whole``, the operator is kept whole where torch.compile would trace into it, like a ``custom_op``:
    the compiled graph calls it with real tensors."""
    op = triton_op(qualname(name), fn, mutates_args=())
    if kept_whole(name):
        op.register_torch_dispatch(FunctionalTensorMode, _opaque)
    return op


def _opaque(mode, op, types, args, kwargs):
    return mode.__torch_dispatch__(op, types, args, kwargs)


CHOSEN: dict[tuple, dict] = {}  # (kernel, shape key) -> the configuration ``tuned`` picked on this GPU


def tuned(candidates: list[Launch], key: tuple, *args) -> None:
    """Launch the best of ``candidates`` (a launch-configuration function's autotune space; the kernel report compiles
    every member and holds it to its rules) with ``args``. With one candidate (always so under the interpreter) that
    one; on a GPU each candidate is timed once per ``key`` on these arguments (``triton.testing.do_bench``) and the
    fastest is kept and recorded in ``CHOSEN``; callers bucket the row count in ``key`` (next power of 2: the token
    count changes from batch to batch, the choice need not). Only kernels that write (never accumulate into) their
    outputs are tuned, so the timing runs leave the right values behind. In deterministic mode
    (``elmo_fast.determinism``) the first candidate, untimed: timings vary from run to run, and candidates with
    other tiles round differently. While torch.compile / torch.export trace (nothing can be timed) the choice
    already made for ``key``, else the first candidate."""
    choice = 0
    if len(candidates) > 1 and not is_deterministic():
        k = (candidates[0].kernel.__name__, *key)
        if k not in CHOSEN and not tracing(*args):
            from triton.testing import do_bench

            times = [do_bench(lambda c=c: c(*args), warmup=3, rep=15) for c in candidates]
            best = min(range(len(times)), key=times.__getitem__)
            CHOSEN[k] = dict(candidates[best].meta, index=best, grid=candidates[best].grid, ms=times[best])
        choice = CHOSEN[k]["index"] if k in CHOSEN else 0
    candidates[choice](*args)


def dot_flags(dtype: torch.dtype, target: Target) -> dict:
    """``UPCAST``: bf16/fp16 under the interpreter (its numpy dot mishandles bf16); ``IEEE``: fp32 inputs."""
    return dict(UPCAST=target.interpret and dtype in (torch.bfloat16, torch.float16), IEEE=dtype == torch.float32)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs (used by the tests for near-exact checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_acc_dtype(dtype: torch.dtype):
    """``acc_dtype`` as a Triton dtype, for the kernels' ``ACC`` argument."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def pow2_between(n: int, lo: int, hi: int) -> int:
    """The power of two >= n, clamped to [lo, hi] (tile sizes: ``tl.dot`` needs every dim >= 16)."""
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))
