"""The ``cpu`` backend: the fast CPU paths of the ops, one file per op, each tested against ``elmo_fast.reference``.

``auto`` picks it for CPU tensors. Ops it does not specialise run the reference code. The compiled kernels
(``elmo_fast._cpu``) are optional and loaded lazily (``ext.py``); ``memory.keep_freed_memory`` is the allocator
setting the trainer uses on the CPU. Nothing here imports triton.
"""
from .char_cnn import char_cnn_cpu
from .highway import highway_cpu
from .lstmp import lstmp_cpu
from .packed import PackedWeightCache
from .sampled_softmax import full_softmax_nll_cpu, sampled_softmax_loss_cpu

__all__ = ["char_cnn_cpu", "full_softmax_nll_cpu", "highway_cpu", "lstmp_cpu", "sampled_softmax_loss_cpu",
           "PackedWeightCache"]
