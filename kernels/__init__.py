"""Triton kernels of elmo_fast, installed as ``elmo_fast.kernels``.

Importing this package requires triton; ``elmo_fast._backend`` treats an ImportError here as "triton
backend unavailable". Kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
One file per op: ``lstmp.py``, ``char_cnn.py``, ``highway.py``, ``softmax.py``.
"""
import triton  # noqa: F401  (availability probe)
