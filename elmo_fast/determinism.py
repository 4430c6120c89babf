"""Deterministic mode: the same bits from run to run on the same hardware and software.

``set_deterministic(True)`` turns on ``torch.use_deterministic_algorithms(True)``, and elmo_fast follows torch's
switch however it was turned on. While it is on:

* the Triton char-CNN backward sums its gradients in a fixed order (per-block partial buffers added in block
  order; each window-gradient element written by one program) instead of with fp32 atomics
  (``elmo_fast.kernels.char_cnn``); the other Triton kernels use no atomics in either mode;
* ``elmo_fast.kernels._common.tuned`` launches the first of its candidate launch configurations instead of
  the one it timed fastest (timings differ from run to run, and the candidates' tiles round differently);
* the ``cpu`` backend makes no timed choice: training's forward does not pack its weights
  (``elmo_fast.cpu.packed.pack_pays``) and every large GEMM, plain or accumulating, runs on MKL
  (``elmo_fast.cpu.gemm.uses_onednn``; unless ``ELMO_FAST_CPU_GEMM`` names a library, which is no timing either);
* torch's CUDA ops on elmo_fast's paths take their deterministic implementations: ``index_add_`` (the
  sparse softmax rows, the token encoder's scatter back), the backward of ``index_select`` and ``gather``,
  ``scatter_``; elmo_fast calls none of the ops that torch refuses in this mode (README, "Determinism").

cuBLAS is deterministic under torch's switch only with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``), and
torch raises at the first matmul without it. ``set_deterministic(True)`` sets ``:4096:8`` when the variable is
unset; set it in the environment before Python starts to have it before any cuBLAS handle exists.
"""
from __future__ import annotations

import contextlib
import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic(mode: bool = True) -> None:
    """Deterministic mode on (``True``) or off for the whole process (it is torch's global switch)."""
    if mode:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(bool(mode))


def is_deterministic() -> bool:
    """True while deterministic mode (``torch.are_deterministic_algorithms_enabled()``) is on."""
    return torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def deterministic(mode: bool = True):
    """Deterministic mode ``mode`` inside the block; torch's previous setting (and its ``warn_only``) after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    set_deterministic(mode)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
