"""Large CPU buffers without page faults: glibc malloc tuning for the training loop.

A training step allocates and frees the same large tensors every step (weight gradients of 64 MiB, gate
buffers of 20 MiB at the original sizes). glibc serves blocks above its mmap threshold (at most 32 MiB by
default) with fresh ``mmap`` pages and unmaps them on free, so every step pays the kernel for zeroed pages
again: measured on the 2-core machine of bench/results/cpu_train.md, a 1024x16384 ``torch.mm`` takes 96 ms
into a fresh tensor and 67 ms into a reused one. Raising the mmap and trim thresholds keeps those blocks in
the heap for reuse (the cost: up to 2 GiB of freed memory stays with the process). What jemalloc/tcmalloc
(``LD_PRELOAD``) would also give.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LIMIT = (1 << 31) - 1  # mallopt takes an int


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to 2 GiB (once per process). False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _LIMIT)) and bool(mallopt(_M_TRIM_THRESHOLD, _LIMIT))
