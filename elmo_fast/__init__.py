"""elmo_fast: a fast and faithful ELMo engine.

Public API (AllenNLP names and contracts; code written for AllenNLP ports by changing the import):
``batch_to_ids``, ``Elmo``, ``ElmoBiLM``, ``ScalarMix``, ``remove_sentence_boundaries``,
``add_sentence_boundary_token_ids``; bilm-tf's ``Batcher``, ``TokenBatcher``, ``Vocabulary``,
``UnicodeCharsVocabulary``, ``LMDataset``, ``BidirectionalLMDataset``, ``weight_layers``; the biLM itself
(``BiLM``), its options and weight files; ``LSTMP``, a drop-in ``torch.nn.LSTM`` on elmo_fast's LSTMP chain.
Importing this package never imports triton or compiles anything.
"""
from ._backend import BackendUnavailableError
from .chars import Batcher, TokenBatcher, Vocabulary, batch_to_ids, word_to_char_ids
from .compat import (BidirectionalLanguageModel, BidirectionalLMDataset, ElmoTokenEmbedder, LMDataset,
                     UnicodeCharsVocabulary, WeightLayers, dump_bilm_embeddings, dump_token_embeddings, weight_layers)
from .determinism import deterministic, is_deterministic, set_deterministic
from .models.bilm import BiLM
from .models.elmo import Elmo, ElmoBiLM
from .modules.lstmp_layer import LSTMP
from .modules.scalar_mix import ScalarMix
from .options import ElmoOptions, OptionsError
from .util import add_sentence_boundary_token_ids, remove_sentence_boundaries
from .weights import WeightFileError, read_weights, write_weights

__version__ = "0.1.0"

__all__ = [
    "batch_to_ids",
    "word_to_char_ids",
    "Batcher",
    "TokenBatcher",
    "Vocabulary",
    "UnicodeCharsVocabulary",
    "LMDataset",
    "BidirectionalLMDataset",
    "Elmo",
    "ElmoBiLM",
    "BiLM",
    "LSTMP",
    "BidirectionalLanguageModel",
    "ElmoTokenEmbedder",
    "dump_token_embeddings",
    "dump_bilm_embeddings",
    "weight_layers",
    "WeightLayers",
    "ScalarMix",
    "ElmoOptions",
    "OptionsError",
    "WeightFileError",
    "BackendUnavailableError",
    "set_deterministic",
    "is_deterministic",
    "deterministic",
    "read_weights",
    "write_weights",
    "add_sentence_boundary_token_ids",
    "remove_sentence_boundaries",
    "__version__",
]
