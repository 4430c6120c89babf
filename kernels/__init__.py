"""Triton kernels of elmo_fast, installed as ``elmo_fast.kernels``.

Importing ``elmo_fast.kernels`` requires triton; ``elmo_fast._backend`` treats an ImportError here as "triton
backend unavailable". Kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
One file per op: ``lstmp.py``, ``char_cnn.py``, ``highway.py``, ``softmax.py``, ``dropout.py``.

From the repository root this folder is also importable as a top-level ``kernels`` package, where it shadows the
PyPI package of that name (which transformers probes for). Imported under that name it does nothing: it imports
no triton and exposes nothing, so the probe sees a package without the PyPI API.
"""
if __name__ == "elmo_fast.kernels":
    import triton  # noqa: F401  (availability probe)
