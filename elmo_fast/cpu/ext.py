"""The optional compiled CPU kernels ``elmo_fast._cpu`` (csrc/cpu/, built by setup.py when a C++ compiler is there).

Never compiled at import. Without it (no compiler at install, a failed build, ``ELMO_FAST_CPU_EXT=0``) the cpu
backend runs the same math as torch ops.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import warnings

import torch

from .._backend import env_flag, torch_build_mismatch


@functools.lru_cache(maxsize=None)
def _load():
    try:
        mod = importlib.import_module("elmo_fast._cpu")
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    why = torch_build_mismatch(mod)
    if why is not None:
        warnings.warn(f"elmo_fast: {why}, so the cpu backend runs the same math as torch ops. Rebuild it with this "
                      "torch: `pip install --no-build-isolation -e .` (or `make setup` after removing the venv's "
                      ".elmo_fast-setup stamp).", RuntimeWarning, stacklevel=3)
        return None
    return mod


def cpu_ext():
    """The ``elmo_fast._cpu`` module, or None (not built, or turned off with ELMO_FAST_CPU_EXT=0)."""
    if not env_flag("ELMO_FAST_CPU_EXT", True):
        return None
    return _load()


def cpu_ext_for(*tensors):
    """``elmo_fast._cpu`` where its fp32 kernels take these tensors (each contiguous fp32 on the CPU; None entries are
    skipped), else None: the caller runs the same math as torch ops."""
    for t in tensors:
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()):
            return None
    return cpu_ext()


@contextlib.contextmanager
def denormals_flushed():
    """Denormal results flushed to zero and denormal operands read as zero (FTZ and DAZ) on this thread and its
    OpenMP team while the block runs, as TensorFlow runs its CPU ops; then each thread's own state as before.
    Floats below 1.2e-38 (fp32) are rare in the biLM but costly: an x86 core takes a microcode assist for each, and
    a sampled softmax whose probabilities fell there ran its backward ~20x slower. Without the extension (or one
    built before csrc/cpu/fpenv.cpp) nothing changes: torch.set_flush_denormal reaches only this thread."""
    ext = cpu_ext()
    if not hasattr(ext, "restore_denormals"):
        yield
        return
    before = ext.flush_denormals(True)
    try:
        yield
    finally:
        ext.restore_denormals(before)
