"""Pieces the Triton kernel files share (installed as ``elmo_fast.kernels._common``): a dot with the CPU
interpreter's bf16 workaround, and the host-side flags and accumulation dtypes the launchers pass in.

Kernels run compiled on CUDA tensors or under ``TRITON_INTERPRET=1`` on CPU tensors; the workarounds here
are for the interpreter and change no value there (bf16 products are exact in fp32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from elmo_fast._backend import triton_interpret


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


def dot_flags(dtype: torch.dtype, device: torch.device) -> dict:
    """``UPCAST``: bf16 under the interpreter (its numpy dot mishandles bf16); ``IEEE``: fp32 inputs."""
    return dict(UPCAST=dtype == torch.bfloat16 and device.type != "cuda" and triton_interpret(),
                IEEE=dtype == torch.float32)


def while_loops(device: torch.device) -> bool:
    """The interpreter (with numpy >= 2.4) cannot use runtime ints as range() bounds, so kernels take a
    ``while`` loop there; compiled code keeps ``for`` loops, which Triton can software-pipeline."""
    return device.type != "cuda"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs (used by the tests for near-exact checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_acc_dtype(dtype: torch.dtype):
    """``acc_dtype`` as a Triton dtype, for the kernels' ``ACC`` argument."""
    return tl.float64 if dtype == torch.float64 else tl.float32
