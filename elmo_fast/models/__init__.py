from .bilm import BiLM
from .elmo import Elmo, ElmoBiLM

__all__ = ["BiLM", "ElmoBiLM", "Elmo"]
