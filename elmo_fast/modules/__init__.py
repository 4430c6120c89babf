from .lstm import LSTMPStack
from .lstmp_layer import LSTMP
from .sampled_softmax import SampledSoftmaxLoss
from .scalar_mix import ScalarMix
from .token_encoder import CharCNNTokenEncoder

__all__ = ["CharCNNTokenEncoder", "LSTMP", "LSTMPStack", "SampledSoftmaxLoss", "ScalarMix"]
