from .lstm import LSTMPStack
from .sampled_softmax import SampledSoftmaxLoss
from .scalar_mix import ScalarMix
from .token_encoder import CharCNNTokenEncoder

__all__ = ["CharCNNTokenEncoder", "LSTMPStack", "SampledSoftmaxLoss", "ScalarMix"]
