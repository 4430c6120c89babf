"""The ``cpu`` backend: the fast CPU paths of the ops, one file per op, each tested against ``elmo_fast.reference``.

``auto`` picks it for CPU tensors. Ops it does not specialise (the highway layer, the full softmax) run the
reference code. Nothing here imports triton or a compiled extension.
"""
from .char_cnn import char_cnn_cpu
from .lstmp import lstmp_cpu
from .packed import PackedWeightCache

__all__ = ["char_cnn_cpu", "lstmp_cpu", "PackedWeightCache"]
