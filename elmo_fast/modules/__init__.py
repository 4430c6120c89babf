from .lstm import LSTMPStack
from .scalar_mix import ScalarMix
from .token_encoder import CharCNNTokenEncoder

__all__ = ["CharCNNTokenEncoder", "LSTMPStack", "ScalarMix"]
