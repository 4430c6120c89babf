"""AllenNLP-compatible ``ElmoBiLM`` (``_ElmoBiLm``) and ``Elmo``: same arguments, same outputs."""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from ..allennlp_compat import bilm_links, encoder_links, load_allennlp_pre_hook, to_allennlp_state_dict
from ..chars import BOS_TOKEN, EOS_TOKEN, MAX_WORD_LENGTH, word_to_char_ids
from ..modules.scalar_mix import ScalarMix
from ..options import OptionsError
from ..ops import _precision as prec
from ..util import add_sentence_boundary_token_ids, check_int, configuration_error, remove_sentence_boundaries
from ._graphs import GraphCache, ModuleTensors
from .bilm import BiLM, check_ids

MAX_CHAR_ID = 261


def _check_char_ids(char_ids: torch.Tensor, device: torch.device, min_dims: int = 3, exact: bool = True,
                    boundaries: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Refuse char ids that are not ``batch_to_ids`` output; given ``boundaries`` (the ids of <S> and </S>, on
    ``device``), also ids that already hold them, as bilm-tf's ``Batcher`` makes them (``check_ids``)."""
    if not isinstance(char_ids, torch.Tensor):
        raise TypeError(f"char ids must be a torch.LongTensor, got {type(char_ids).__name__}; use batch_to_ids")
    if char_ids.dtype.is_floating_point or char_ids.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise TypeError(f"char ids must be an integer tensor (torch.long), got {char_ids.dtype}")
    if (exact and char_ids.dim() != min_dims) or char_ids.dim() < min_dims:
        want = "(batch, tokens, 50)" if exact else "(..., batch, tokens, 50)"
        raise ValueError(f"char ids must have shape {want}, got {tuple(char_ids.shape)}")
    if char_ids.shape[-1] != MAX_WORD_LENGTH:
        raise ValueError(f"char ids need {MAX_WORD_LENGTH} ids per token in the last axis, got {char_ids.shape[-1]}")
    if char_ids.numel() == 0 and char_ids.shape[0] == 0:
        raise ValueError("empty batch: char ids have 0 sentences")
    if char_ids.device != device:
        raise ValueError(f"char ids are on {char_ids.device} but the model is on {device}; move one of them")
    return check_ids(char_ids, (char_ids > 0).any(-1), MAX_CHAR_ID, "char ids",  # inference ids, 0 = padding
                     boundaries=boundaries)


def check_allennlp_model(bilm: BiLM) -> None:
    """AllenNLP's API reads characters, 50 ids a token (``batch_to_ids``): refuse a word-input biLM or another
    width by name, with the bilm-tf API that reads it."""
    if bilm.token_encoder is None:
        raise OptionsError("the options have no char_cnn: a word-input biLM, and this AllenNLP-style API takes "
                           "characters (batch_to_ids); run it through elmo_fast.compat.BidirectionalLanguageModel"
                           "(options_file, weight_file, use_character_inputs=False) on TokenBatcher ids")
    L = bilm.options.char_cnn.max_characters_per_token
    if L != MAX_WORD_LENGTH:
        raise OptionsError(f"the options give char_cnn.max_characters_per_token={L}, and this AllenNLP-style API "
                           f"takes the {MAX_WORD_LENGTH} ids a token of batch_to_ids; run the model through "
                           f"elmo_fast.compat.BidirectionalLanguageModel on Batcher(vocab_file, {L}) ids")


_BOS_IDS = torch.tensor(word_to_char_ids(BOS_TOKEN), dtype=torch.long)
_EOS_IDS = torch.tensor(word_to_char_ids(EOS_TOKEN), dtype=torch.long)


class ElmoCharacterEncoder(nn.Module):
    """AllenNLP's ``_ElmoCharacterEncoder``: char ids (B, T, 50) without boundaries -> ``{"mask": (B, T+2),
    "token_embedding": (B, T+2, P)}`` with ``<S>``/``</S>`` added (the token layer is not masked)."""

    def __init__(self, token_encoder, owns_encoder: bool = True):
        super().__init__()
        self._owns_encoder = owns_encoder
        if owns_encoder:
            self.encoder = token_encoder
            self.register_load_state_dict_pre_hook(load_allennlp_pre_hook)  # AllenNLP's keys load too
        else:  # shared with a module that registers it already: keep it out of this one's state_dict
            object.__setattr__(self, "encoder", token_encoder)
        self.register_buffer("bos_ids", _BOS_IDS.clone(), persistent=False)
        self.register_buffer("eos_ids", _EOS_IDS.clone(), persistent=False)

    def get_output_dim(self) -> int:
        return self.encoder.output_dim

    def allennlp_links(self, export: bool = False) -> list:
        """The correspondence with AllenNLP's ``_ElmoCharacterEncoder`` state_dict (see ``allennlp_compat``)."""
        return encoder_links(self.encoder, "", export) if self._owns_encoder else []

    def add_boundaries(self, inputs: torch.Tensor):
        """char ids (B, T, 50) -> (ids (B, T+2, 50) with <S>/</S>, mask (B, T+2))."""
        mask = _check_char_ids(inputs, self.encoder.char_embed.device, boundaries=(self.bos_ids, self.eos_ids))
        return self._add_boundaries(inputs, mask)

    def _add_boundaries(self, inputs: torch.Tensor, mask: torch.Tensor | None = None):  # inputs already checked
        mask = (inputs > 0).any(-1) if mask is None else mask  # the positions holding a token
        return add_sentence_boundary_token_ids(inputs, mask, self.bos_ids, self.eos_ids)

    def forward(self, inputs: torch.Tensor) -> dict:
        ids, mask = self.add_boundaries(inputs)
        return {"mask": mask, "token_embedding": self.encoder(ids)}


class _StatesHandle:
    """What ``ElmoBiLM._elmo_lstm`` gives: ``reset_states(mask=None)``, as AllenNLP's ``ElmoLstm`` has."""

    def __init__(self, owner: "ElmoBiLM"):
        self._owner = owner

    def reset_states(self, mask: torch.Tensor | None = None) -> None:
        self._owner.reset_states(mask)


class ElmoBiLM(nn.Module):
    """AllenNLP's ``_ElmoBiLm``: char ids (B, T, 50) *without* boundaries (from ``batch_to_ids``) ->
    ``{"activations": [(B, T+2, 2P)] * 3, "mask": (B, T+2) bool}``. Stateful across calls; ``reset_states()``.

    ``vocab_to_cache``: words whose token-layer vectors are precomputed; ``forward`` then also takes
    ``word_ids`` (B, T) indexing that list (index 0 is the padding word and gives a zero vector).
    ``backend``: "auto" | "reference" | "triton" | "cuda" (else ``ELMO_FAST_BACKEND``, else auto).
    ``cuda_graph``: inference (no gradient) on CUDA tensors replays a CUDA graph per (B, T) seen twice
    (``elmo_fast.models._graphs``): one launch instead of ~180 per call at the original size. Elsewhere, or
    where capture fails, the call runs eagerly with the same results; after a weight changes the graphs are
    recorded again.
    """

    def __init__(self, options_file, weight_file, requires_grad: bool = False, vocab_to_cache: list[str] | None = None,
                 backend: str | None = "auto", stateful: bool = True, cuda_graph: bool = False):
        super().__init__()
        self._bilm = BiLM.from_files(options_file, weight_file, backend=backend, stateful=stateful)
        check_allennlp_model(self._bilm)
        self._token_embedder = ElmoCharacterEncoder(self._bilm.token_encoder, owns_encoder=False)
        # what a recorded forward reads besides its inputs: the biLM's weights and the boundary ids
        reads = ModuleTensors(self._bilm, self._token_embedder)
        self._graphs = GraphCache(self._graph_forward, max_graphs=8, watch=reads) if cuda_graph else None
        self._requires_grad = requires_grad
        for p in self._bilm.parameters():
            p.requires_grad_(requires_grad)
        if requires_grad and vocab_to_cache:
            warnings.warn("fine-tuning the biLM with a vocab cache: the cached token vectors are not updated",
                          stacklevel=2)
        self._word_embedding = None
        self._bos_embedding = None
        self._eos_embedding = None
        if vocab_to_cache:
            self.create_cached_cnn_embeddings(vocab_to_cache)
        self.register_load_state_dict_pre_hook(load_allennlp_pre_hook)  # AllenNLP's _ElmoBiLm keys load too

    def allennlp_links(self, export: bool = False) -> list:
        """The correspondence with AllenNLP's ``_ElmoBiLm`` state_dict (see ``allennlp_compat``)."""
        return bilm_links(self._bilm, self._word_embedding, export)

    @property
    def num_layers(self) -> int:
        return self._bilm.num_layers

    def get_output_dim(self) -> int:
        return self._bilm.output_dim

    def reset_states(self, mask: torch.Tensor | None = None) -> None:
        self._bilm.reset_states(mask)

    @property
    def _elmo_lstm(self) -> "_StatesHandle":
        """AllenNLP's ``_ElmoBiLm._elmo_lstm`` as far as user code reaches into it: the idiom
        ``elmo._elmo_lstm._elmo_lstm.reset_states()`` resets this model's states."""
        return _StatesHandle(self)

    @property
    def token_encoder(self):
        return self._bilm.token_encoder

    def _device(self) -> torch.device:
        return self._bilm.token_encoder.char_embed.device

    @torch.no_grad()
    def create_cached_cnn_embeddings(self, tokens: list[str], batch_size: int = 4096) -> None:
        """Precompute the token layer of ``[<S>, </S>] + tokens``; row 0 of the word table is zeroed."""
        words = [BOS_TOKEN, EOS_TOKEN] + list(tokens)
        ids = torch.tensor([word_to_char_ids(w) for w in words], dtype=torch.long, device=self._device())
        embs = torch.cat([self._bilm.token_encoder(ids[s : s + batch_size]) for s in range(0, len(words), batch_size)])
        self._bos_embedding = embs[0].clone()
        self._eos_embedding = embs[1].clone()
        table = embs[2:].clone()
        table[0] = 0.0
        self._word_embedding = table

    def forward(self, char_ids: torch.Tensor | None = None, word_ids: torch.Tensor | None = None, *,
                inputs: torch.Tensor | None = None, word_inputs: torch.Tensor | None = None) -> dict:
        """char_ids (B, T, 50) from ``batch_to_ids``; word_ids (B, T) into ``vocab_to_cache`` (optional).
        AllenNLP's keyword names ``inputs`` / ``word_inputs`` are accepted too."""
        inputs, word_inputs = _alias(char_ids, inputs, "char_ids", "inputs"), _alias(word_ids, word_inputs,
                                                                                         "word_ids", "word_inputs")
        if inputs is None:
            raise TypeError("ElmoBiLM.forward() needs the char ids (batch_to_ids output)")
        dev = self._device()
        in_mask = _check_char_ids(inputs, dev, boundaries=(self._token_embedder.bos_ids, self._token_embedder.eos_ids))
        token_embedding = None
        if word_inputs is not None and self._word_embedding is None:
            warnings.warn("word_inputs given but the model has no vocab_to_cache: ignored, the char ids are used "
                          "(as AllenNLP does)", stacklevel=2)
            word_inputs = None
        if word_inputs is not None:
            if not isinstance(word_inputs, torch.Tensor) or word_inputs.dtype.is_floating_point or \
                    word_inputs.dtype in (torch.bool, torch.complex64, torch.complex128):
                got = type(word_inputs).__name__ + (f" {word_inputs.dtype}" if isinstance(word_inputs, torch.Tensor)
                                                    else "")
                raise TypeError(f"word_inputs must be an integer tensor of shape (batch, tokens), got {got}")
            if tuple(word_inputs.shape) != tuple(inputs.shape[:2]):
                raise ValueError(f"word_inputs shape {tuple(word_inputs.shape)} does not match the char ids' "
                                 f"(batch, tokens) = {tuple(inputs.shape[:2])}")
            if word_inputs.device != dev:
                raise ValueError(f"word_inputs are on {word_inputs.device} but the model is on {dev}")
            if word_inputs.numel() and (int(word_inputs.min()) < 0
                                          or int(word_inputs.max()) >= self._word_embedding.shape[0]):
                warnings.warn("word_inputs hold ids outside the cached vocabulary; using the char ids "
                              "(as AllenNLP does)", stacklevel=2)
            else:
                mask_wo = word_inputs > 0
                emb = self._word_embedding[word_inputs]
                token_embedding, mask = add_sentence_boundary_token_ids(
                    emb, mask_wo, self._bos_embedding, self._eos_embedding)
        if token_embedding is None:
            if self._graphs is not None and not (torch.is_grad_enabled() and self._requires_grad):
                return self._replay(inputs)
            ids, mask = self._token_embedder._add_boundaries(inputs, in_mask)
            token_embedding = self._bilm.token_encoder(ids)
        out = self._bilm.forward_embeddings(token_embedding, mask)
        return {"activations": out["activations"], "mask": out["mask"]}

    def _graph_forward(self, inputs: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, _tag: torch.Tensor):
        """Checked char ids and explicit states -> (*activations, mask, h_n, c_n), with no host sync: every token
        is encoded (no deduplication, whose size would be read back), the LSTM lengths come from the mask."""
        ids, mask = self._token_embedder._add_boundaries(inputs)
        B, T2, L = ids.shape
        emb = self._bilm.token_encoder.encode_unique(ids.reshape(-1, L)).reshape(B, T2, -1)
        acts, h_n, c_n = self._bilm.stateless_forward(emb, mask, h0, c0)
        return (*acts, mask, h_n, c_n)

    def _replay(self, inputs: torch.Tensor) -> dict:
        dev = inputs.device
        state = prec.state_dtype(self._bilm.token_encoder.char_embed.dtype)
        h0, c0 = self._bilm.initial_states(inputs.shape[0], dev, state)
        # the autocast state is part of the graph's identity: an empty tensor of that dtype joins the shape key
        tag = torch.empty(0, dtype=prec.autocast_dtype(dev) or torch.float32, device=dev)
        *acts, mask, h_n, c_n = self._graphs(inputs, h0, c0, tag)
        if self._bilm.stateful:
            self._bilm._store_states(h_n, c_n)
        return {"activations": acts, "mask": mask}


def _alias(a, b, name_a: str, name_b: str):
    if a is not None and b is not None:
        raise TypeError(f"pass either {name_a} or {name_b}, not both")
    return a if a is not None else b




class Elmo(nn.Module):
    """AllenNLP's ``Elmo``: ``{"elmo_representations": [(B, T, 2P)] * num_output_representations, "mask"}``.
    ``cuda_graph``: see ``ElmoBiLM`` (the biLM replays CUDA graphs; the scalar mixes run eagerly)."""

    def __init__(self, options_file, weight_file, num_output_representations: int, requires_grad: bool = False,
                 do_layer_norm: bool = False, dropout: float = 0.5, vocab_to_cache: list[str] | None = None,
                 keep_sentence_boundaries: bool = False, scalar_mix_parameters: list[float] | None = None,
                 module: nn.Module | None = None, backend: str | None = "auto", cuda_graph: bool = False):
        super().__init__()
        # checked before the weights load: an int or anything int-like (a numpy integer), not a float, str or bool
        num_output_representations = check_int(num_output_representations, "num_output_representations", 1)
        if module is not None:
            if options_file is not None or weight_file is not None:
                raise configuration_error("pass either module or options_file/weight_file, not both")
            if not (isinstance(module, nn.Module) and hasattr(module, "num_layers")
                    and hasattr(module, "get_output_dim")):
                raise TypeError(f"module must be the biLM of another Elmo (an ElmoBiLM: num_layers, get_output_dim), "
                                f"got {type(module).__name__}")
            self._elmo_lstm = module
        else:
            self._elmo_lstm = ElmoBiLM(options_file, weight_file, requires_grad=requires_grad,
                                       vocab_to_cache=vocab_to_cache, backend=backend, cuda_graph=cuda_graph)
        self._has_cached_vocab = vocab_to_cache is not None
        self._keep_sentence_boundaries = keep_sentence_boundaries
        self._dropout = nn.Dropout(p=dropout)
        self._scalar_mixes: list[ScalarMix] = []
        for k in range(num_output_representations):
            mix = ScalarMix(self._elmo_lstm.num_layers, do_layer_norm=do_layer_norm,
                            initial_scalar_parameters=scalar_mix_parameters,
                            trainable=scalar_mix_parameters is None)
            self.add_module(f"scalar_mix_{k}", mix)
            self._scalar_mixes.append(mix)

    def get_output_dim(self) -> int:
        return self._elmo_lstm.get_output_dim()

    def allennlp_state_dict(self) -> dict:
        """This model's state_dict in AllenNLP 2.10.1's layout: ``allennlp.modules.elmo.Elmo`` built with the same
        arguments loads it (``load_state_dict``, strict). Loading goes the other way through ``load_state_dict``
        itself, which takes either layout."""
        return to_allennlp_state_dict(self)

    def reset_states(self, mask=None) -> None:
        self._elmo_lstm.reset_states(mask)

    def forward(self, inputs: torch.Tensor | None = None, word_inputs: torch.Tensor | None = None, *,
                char_ids: torch.Tensor | None = None, word_ids: torch.Tensor | None = None) -> dict:
        """inputs (..., T, 50) from ``batch_to_ids``; word_inputs (..., T) into ``vocab_to_cache`` (optional).
        ``char_ids`` / ``word_ids`` are accepted as keyword aliases."""
        inputs, word_inputs = _alias(inputs, char_ids, "inputs", "char_ids"), _alias(word_inputs, word_ids,
                                                                                     "word_inputs", "word_ids")
        if word_inputs is not None and not self._has_cached_vocab:
            warnings.warn("word_inputs given but Elmo has no vocab_to_cache: ignored (as AllenNLP does)", stacklevel=2)
            word_inputs = None
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"inputs must be a torch.LongTensor from batch_to_ids, got {type(inputs).__name__}")
        if inputs.dim() < 3:
            raise ValueError(
                f"inputs must have shape (batch, tokens, 50) or (..., tokens, 50), got {tuple(inputs.shape)}")
        original_shape = inputs.shape
        if inputs.dim() > 3:
            reshaped = inputs.reshape(-1, *original_shape[-2:])
        else:
            reshaped = inputs
        reshaped_words = None
        if word_inputs is not None:
            if tuple(word_inputs.shape) != tuple(original_shape[:-1]):
                raise ValueError(f"word_inputs shape {tuple(word_inputs.shape)} does not match inputs' "
                                 f"{tuple(original_shape[:-1])}")
            reshaped_words = word_inputs.reshape(-1, original_shape[-2]) if word_inputs.dim() > 2 else word_inputs
        bilm_output = self._elmo_lstm(reshaped, reshaped_words)
        layers, mask_with_bos_eos = bilm_output["activations"], bilm_output["mask"]
        representations = []
        mask = mask_with_bos_eos
        for mix in self._scalar_mixes:
            rep = mix(layers, mask_with_bos_eos)
            if self._keep_sentence_boundaries:
                processed, mask = rep, mask_with_bos_eos
            else:
                processed, mask = remove_sentence_boundaries(rep, mask_with_bos_eos)
            representations.append(self._dropout(processed))
        if inputs.dim() > 3:
            mask = mask.reshape(*original_shape[:-2], mask.shape[-1])
            representations = [r.reshape(*original_shape[:-2], *r.shape[-2:]) for r in representations]
        return {"elmo_representations": representations, "mask": mask}
