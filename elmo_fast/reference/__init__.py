"""Pure-PyTorch reference implementations: readable, fp64-capable, and the CPU path users run.

Every kernel in ``elmo_fast.kernels`` (Triton) and ``csrc/`` (CUDA) is tested against these functions.
Nothing here imports triton or the compiled extension.
"""
from .char_cnn import char_cnn_reference, highway_reference, token_encoder_reference
from .dropout import dropout_reference
from .lstmp import lstmp_reference
from .sampled_softmax import (
    expected_count_reference,
    full_softmax_nll_reference,
    log_uniform_probability,
    log_uniform_sample_reference,
    sampled_softmax_loss_reference,
)
from .scalar_mix import scalar_mix_reference

__all__ = [
    "char_cnn_reference",
    "dropout_reference",
    "highway_reference",
    "token_encoder_reference",
    "lstmp_reference",
    "log_uniform_probability",
    "log_uniform_sample_reference",
    "expected_count_reference",
    "sampled_softmax_loss_reference",
    "full_softmax_nll_reference",
    "scalar_mix_reference",
]
