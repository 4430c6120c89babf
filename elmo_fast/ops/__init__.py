"""Functional ops: typed API, input validation, backend dispatch (reference / triton / cuda)."""
from .char_cnn import char_cnn, highway, projection
from .dropout import dropout
from .lstmp import lstmp
from .softmax import (full_softmax_nll, log_uniform_sample, sampled_softmax_loss, sampled_softmax_loss_groups,
                      sampled_softmax_loss_pair)

__all__ = ["lstmp", "char_cnn", "highway", "projection", "dropout", "sampled_softmax_loss", "sampled_softmax_loss_pair",
           "sampled_softmax_loss_groups", "full_softmax_nll", "log_uniform_sample"]
