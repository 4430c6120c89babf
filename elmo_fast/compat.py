"""Entry points under the original projects' names, for ports of code (and tests) written against them.

AllenNLP: ``_ElmoBiLm``, ``_ElmoCharacterEncoder``, ``ElmoTokenEmbedder``; ``register_allennlp()`` (AllenNLP
configurations can then name ``"elmo_fast_token_embedder"``; it runs by itself when allennlp is imported first,
e.g. by ``allennlp train ... --include-package elmo_fast.compat``);
``to_allennlp_state_dict`` (AllenNLP's checkpoint layout; ``load_state_dict`` takes it as is).
bilm-tf: ``BidirectionalLanguageModel`` (inputs *with* boundaries, fixed ``max_batch_size`` state rows),
``weight_layers`` (and ``WeightLayers``, its module), ``dump_token_embeddings``, ``dump_bilm_embeddings``; its
data classes ``Vocabulary`` (``elmo_fast.chars``), ``UnicodeCharsVocabulary``, ``LMDataset``,
``BidirectionalLMDataset`` with bilm-tf's ids (raw character ids 0..260 where bilm-tf shows them; the inference
models take them + 1, as ``Batcher`` gives them).
"""
from __future__ import annotations

import math
import numbers
import sys
import warnings

import h5py
import numpy as np
import torch
import torch.nn as nn

from .allennlp_compat import to_allennlp_state_dict  # noqa: F401  (re-exported)
from .chars import (BOS_CHAR, BOS_TOKEN, BOW_CHAR, EOS_CHAR, EOS_TOKEN, EOW_CHAR, MAX_WORD_LENGTH, PAD_CHAR,
                    UNK_TOKEN, Batcher, Vocabulary, word_to_char_ids)
from .models.bilm import BiLM, check_ids
from .models.elmo import MAX_CHAR_ID, Elmo, ElmoBiLM, ElmoCharacterEncoder, check_allennlp_model
from .modules.scalar_mix import refuse_non_finite_pre_hook
from .reference.scalar_mix import scalar_mix_reference
from .util import check_input_file, check_int, check_output_not_input
from .weights import atomic_h5

_ElmoBiLm = ElmoBiLM


class _ElmoCharacterEncoder(ElmoCharacterEncoder):
    """``_ElmoCharacterEncoder(options_file, weight_file, requires_grad=False)``."""

    def __init__(self, options_file, weight_file, requires_grad: bool = False, backend: str | None = "auto"):
        bilm = BiLM.from_files(options_file, weight_file, backend=backend)
        check_allennlp_model(bilm)
        super().__init__(bilm.token_encoder)
        for p in self.parameters():
            p.requires_grad_(requires_grad)


class ElmoTokenEmbedder(nn.Module):
    """AllenNLP's ``ElmoTokenEmbedder``: one ELMo representation, optionally projected to ``projection_dim``."""

    def __init__(self, options_file, weight_file, do_layer_norm: bool = False, dropout: float = 0.5,
                 requires_grad: bool = False, projection_dim: int | None = None,
                 vocab_to_cache: list[str] | None = None, scalar_mix_parameters: list[float] | None = None,
                 backend: str | None = "auto"):
        super().__init__()
        self._elmo = Elmo(options_file, weight_file, 1, do_layer_norm=do_layer_norm, dropout=dropout,
                          requires_grad=requires_grad, vocab_to_cache=vocab_to_cache,
                          scalar_mix_parameters=scalar_mix_parameters, backend=backend)
        self._projection = nn.Linear(self._elmo.get_output_dim(), projection_dim) if projection_dim else None
        self.output_dim = projection_dim or self._elmo.get_output_dim()

    def get_output_dim(self) -> int:
        return self.output_dim

    def forward(self, elmo_tokens: torch.Tensor, word_inputs: torch.Tensor | None = None) -> torch.Tensor:
        rep = self._elmo(elmo_tokens, word_inputs)["elmo_representations"][0]
        return self._projection(rep) if self._projection is not None else rep


ALLENNLP_TOKEN_EMBEDDER_NAME = "elmo_fast_token_embedder"


def register_allennlp() -> type:
    """Register :class:`ElmoTokenEmbedder` with AllenNLP as the token embedder ``"elmo_fast_token_embedder"``
    (the arguments of AllenNLP's ``"elmo_token_embedder"``, plus ``backend``), so ``from_params`` and
    configuration files can use it. Needs allennlp importable; elmo_fast never depends on it. Idempotent;
    returns the registered class (a subclass of both ``ElmoTokenEmbedder`` and AllenNLP's ``TokenEmbedder``)."""
    try:
        from allennlp.modules.token_embedders import TokenEmbedder
    except ImportError as e:
        raise ImportError(f"register_allennlp() needs allennlp importable ({e}); elmo_fast itself does not") from e
    cls = globals().get("AllenNLPElmoTokenEmbedder")
    if cls is None:
        cls = type("AllenNLPElmoTokenEmbedder", (ElmoTokenEmbedder, TokenEmbedder),
                   {"__module__": __name__, "__doc__": "elmo_fast's ElmoTokenEmbedder as an AllenNLP TokenEmbedder "
                    f"(registered as {ALLENNLP_TOKEN_EMBEDDER_NAME!r})."})
        TokenEmbedder.register(ALLENNLP_TOKEN_EMBEDDER_NAME)(cls)
        globals()["AllenNLPElmoTokenEmbedder"] = cls  # importable by name, so a pickled model loads again
    return cls


class BidirectionalLanguageModel(nn.Module):
    """bilm-tf's ``BidirectionalLanguageModel`` in PyTorch: call it on ``Batcher`` char ids (B, T+2, 50), or on
    ``TokenBatcher`` word ids (B, T+2) with ``use_character_inputs=False`` and ``embedding_weight_file`` (the
    output of ``dump_token_embeddings``). Returns bilm-tf's ops as tensors: ``lm_embeddings`` (B, n_layers+1, T,
    2P), ``lengths`` (B,), ``mask`` (B, T) bool, ``token_embeddings`` (B, T+2, P) (boundaries kept).
    The state has ``max_batch_size`` rows; a larger batch is an error, as in the original."""

    def __init__(self, options_file, weight_file, use_character_inputs: bool = True,
                 embedding_weight_file: str | None = None, max_batch_size: int = 128, backend: str | None = "auto"):
        super().__init__()
        max_batch_size = check_int(max_batch_size, "max_batch_size", 1)
        self._bilm = BiLM.from_files(options_file, weight_file, backend=backend)
        self._bilm.requires_grad_(False)
        self.max_batch_size = max_batch_size
        self.use_character_inputs = use_character_inputs
        word_model = self._bilm.token_encoder is None
        if use_character_inputs and word_model:
            raise ValueError(f"{options_file}: the options have no char_cnn (a word-input biLM); load it with "
                             "use_character_inputs=False and call it on TokenBatcher ids")
        if use_character_inputs:
            self._embedding = None
        elif embedding_weight_file is None and word_model:
            self._embedding = None  # the model's own 'embedding' (bilm-tf asks for the weight file again here)
        else:
            if embedding_weight_file is None:
                raise ValueError("use_character_inputs=False needs embedding_weight_file (from dump_token_embeddings)")
            check_input_file(embedding_weight_file, "embedding_weight_file")
            with h5py.File(embedding_weight_file, "r") as fh:
                if not isinstance(fh.get("embedding"), h5py.Dataset) or fh["embedding"].dtype.kind != "f":
                    raise ValueError(f"{embedding_weight_file}: no float dataset 'embedding' (dump_token_embeddings "
                                     f"writes one); found {sorted(fh.keys())}")
                emb = torch.from_numpy(fh["embedding"][...].astype(np.float32))
            P = self._bilm.options.projection_dim
            if emb.dim() != 2 or emb.shape[1] != P:
                raise ValueError(
                    f"{embedding_weight_file}: 'embedding' has shape {tuple(emb.shape)}, expected (n, {P})")
            self.register_buffer("_embedding", torch.cat([emb.new_zeros(1, P), emb]))

    def reset_states(self, mask=None) -> None:
        self._bilm.reset_states(mask)

    def forward(self, ids: torch.Tensor) -> dict:
        dev = next(self._bilm.parameters()).device
        if isinstance(ids, np.ndarray):  # what bilm-tf's batchers return and its graph is fed (int32)
            ids = torch.from_numpy(np.ascontiguousarray(ids)).to(dev)  # the model's device: a numpy array has none
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or \
                ids.dtype == torch.bool:
            got = type(ids).__name__ + (f" {ids.dtype}" if isinstance(ids, torch.Tensor) else "")
            raise TypeError(f"ids must be an integer tensor or numpy array (Batcher or TokenBatcher output), got {got}")
        if ids.dtype not in (torch.int32, torch.int64):  # uint8 would index as a mask, int16 not at all
            ids = ids.long()
        B = ids.shape[0]
        if B > self.max_batch_size:
            raise ValueError(f"batch of {B} rows exceeds max_batch_size={self.max_batch_size}")
        if ids.device != dev:
            raise ValueError(f"ids are on {ids.device} but the model is on {dev}; move one of them")
        if self.use_character_inputs:
            L = self._bilm.options.char_cnn.max_characters_per_token
            if ids.dim() != 3 or ids.shape[-1] != L:
                raise ValueError(f"character inputs must be (batch, tokens + 2, {L}), got {tuple(ids.shape)}")
            mask = check_ids(ids, (ids > 0).any(-1), MAX_CHAR_ID, "char ids (Batcher output: raw ids + 1, 0 = padding)")
            out = self._bilm.forward_embeddings(self._bilm.token_encoder(ids), mask, mask_token_layer=False)
        else:
            if ids.dim() != 2:
                raise ValueError(f"token inputs must be (batch, tokens + 2), got {tuple(ids.shape)}")
            rows = self._bilm.word_embedding.shape[0] if self._embedding is None else self._embedding.shape[0] - 1
            mask = check_ids(ids, ids > 0, rows, "token ids (TokenBatcher output: vocabulary id + 1, 0 = padding)")
            emb = self._bilm._embed_words(ids.long()) if self._embedding is None else self._embedding[ids]  # checked
            out = self._bilm.forward_embeddings(emb, mask, mask_token_layer=False)
        lengths = mask.long().sum(1)
        layers = torch.stack(out["activations"], 1)  # (B, L+1, T+2, 2P)
        T2 = layers.shape[2]
        pos = torch.arange(max(T2 - 2, 0), device=ids.device)
        new_mask = pos.unsqueeze(0) < (lengths - 2).clamp(min=0).unsqueeze(1)
        # bilm-tf's _build_ops drops the boundaries with reverse_sequence(len − 1), a slice and reverse_sequence(len
        # − 2), and masks nothing: valid position q holds layer[q + 1], padded position q layer[q + 2], which is 0
        # in the LSTM layers and, in layer 0, the char CNN's output for the padding ids (spec §4)
        src = torch.where(new_mask, pos + 1, pos + 2)
        lm = layers.gather(2, src[:, None, :, None].expand(-1, layers.shape[1], -1, layers.shape[3]))
        return {"lm_embeddings": lm, "lengths": lengths - 2, "mask": new_mask,
                "token_embeddings": out["token_embedding"]}


class WeightLayers(nn.Module):
    """bilm-tf's ``weight_layers`` (``bilm/elmo.py``, spec §5.1) as a module, applied to the ops of
    ``BidirectionalLanguageModel``: ``γ · Σ_j softmax(W + 1/n)_j · N(layer_j)``, where N is the identity or, with
    ``do_layer_norm``, one mean and variance over the valid positions (the mask *without* boundaries) and all
    features, ε = 1e-12. Parameters as bilm-tf initialises them: ``W`` (n_lm_layers,) zeros (none with
    ``use_top_only``, whose output is γ · the top layer) and ``gamma`` (1,) ones. ``forward`` returns bilm-tf's
    dict: ``weighted_op`` (B, T, 2P) and ``regularization_op``, ``l2_coef · Σ W²`` (0.0 without ``l2_coef`` or with
    ``use_top_only``), which the caller adds to its loss as TF's regularization losses are."""

    def __init__(self, n_lm_layers: int, l2_coef: float | None = None, use_top_only: bool = False,
                 do_layer_norm: bool = False, name: str = ""):
        super().__init__()
        if n_lm_layers < 1:
            raise ValueError(f"n_lm_layers must be at least 1, got {n_lm_layers}")
        if l2_coef is not None and (isinstance(l2_coef, bool) or not isinstance(l2_coef, numbers.Real)
                                    or not math.isfinite(l2_coef) or l2_coef < 0):
            raise ValueError(f"l2_coef must be a finite number >= 0 (or None: no regularization), got {l2_coef!r}")
        self.n_lm_layers, self.l2_coef, self.name = n_lm_layers, l2_coef, name
        self.use_top_only, self.do_layer_norm = use_top_only, do_layer_norm
        self.W = None if use_top_only else nn.Parameter(torch.zeros(n_lm_layers))
        self.gamma = nn.Parameter(torch.ones(1))
        self.register_load_state_dict_pre_hook(refuse_non_finite_pre_hook)

    def tf_variables(self) -> dict[str, nn.Parameter]:
        """The parameters under bilm-tf's variable names: ``{name}_ELMo_W`` (unless top-only), ``{name}_ELMo_gamma``."""
        out = {} if self.W is None else {f"{self.name}_ELMo_W": self.W}
        return {**out, f"{self.name}_ELMo_gamma": self.gamma}

    def forward(self, bilm_ops: dict) -> dict:
        lm, mask = bilm_ops["lm_embeddings"], bilm_ops["mask"]
        if lm.dim() != 4 or lm.shape[1] != self.n_lm_layers or mask.shape != lm.shape[:1] + lm.shape[2:3]:
            raise ValueError(f"weight_layers: expected lm_embeddings (B, {self.n_lm_layers}, T, D) and mask (B, T), "
                             f"got {tuple(lm.shape)} and {tuple(mask.shape)}")
        gamma = self.gamma.to(lm.dtype)
        if self.use_top_only:
            return {"weighted_op": lm[:, -1] * gamma, "regularization_op": 0.0}
        w = (self.W + 1.0 / self.n_lm_layers).to(lm.dtype)  # bilm-tf's shift: it cancels in the softmax
        out = scalar_mix_reference(list(lm.unbind(1)), w, gamma, mask, self.do_layer_norm, eps=1e-12)
        reg = self.l2_coef * (self.W**2).sum() if self.l2_coef is not None else 0.0
        return {"weighted_op": out, "regularization_op": reg}


def weight_layers(name: str, bilm_ops: dict, l2_coef: float | None = None, use_top_only: bool = False,
                  do_layer_norm: bool = False) -> dict:
    """bilm-tf's ``weight_layers``: a fresh ``WeightLayers`` with bilm-tf's initial values, applied to ``bilm_ops``.
    bilm-tf's dict (``weighted_op``, ``regularization_op``), plus the module under ``module``: PyTorch has no
    graph to find variables in by name, so a caller keeps it to train or set them (``module.tf_variables()``)."""
    module = WeightLayers(bilm_ops["lm_embeddings"].shape[1], l2_coef, use_top_only, do_layer_norm, name)
    module = module.to(bilm_ops["lm_embeddings"].device)
    return {**module(bilm_ops), "module": module}


class UnicodeCharsVocabulary(Vocabulary):
    """bilm-tf's ``UnicodeCharsVocabulary``: a ``Vocabulary`` plus the *raw* character ids (0..260; training ids)
    of its words. ``<S>`` and ``</S>`` must be in the file: bilm-tf would otherwise give its last word the
    boundary characters (docs/data.md); the boundary arrays are ``bos_chars`` / ``eos_chars``."""

    bos_char, eos_char, bow_char, eow_char, pad_char = BOS_CHAR, EOS_CHAR, BOW_CHAR, EOW_CHAR, PAD_CHAR

    def __init__(self, filename=None, max_word_length: int = MAX_WORD_LENGTH, validate_file: bool = False, *,
                 words: list[str] | None = None):
        super().__init__(filename, validate_file, words=words)
        missing = [t for t, i in ((BOS_TOKEN, self.bos), (EOS_TOKEN, self.eos)) if i < 0]
        if missing:
            raise ValueError(f"vocabulary {filename or '<list>'} lacks {missing}; a character vocabulary needs <S> "
                             "and </S> (bilm-tf would silently give its last word their characters)")
        if max_word_length < 3:
            raise ValueError(f"max_word_length must be >= 3 (begin, end and one byte), got {max_word_length}")
        self._max_word_length = max_word_length
        self.bos_chars = self._raw(BOS_TOKEN)
        self.eos_chars = self._raw(EOS_TOKEN)
        self._word_char_ids = np.stack([self._raw(w) for w in self.words]) if self.words else \
            np.zeros((0, max_word_length), np.int32)

    def _raw(self, word: str) -> np.ndarray:
        return np.array(word_to_char_ids(word, self._max_word_length, shift=0), dtype=np.int32)

    @property
    def max_word_length(self) -> int:
        return self._max_word_length

    @property
    def word_char_ids(self) -> np.ndarray:
        """(size, max_word_length) int32 raw character ids of every word, in vocabulary order."""
        return self._word_char_ids

    def word_to_char_ids(self, word: str) -> np.ndarray:
        return self._raw(word)

    def encode_chars(self, sentence, reverse: bool = False, split: bool = True) -> np.ndarray:
        """(n + 2, max_word_length) raw ids: ``[bos_chars, words..., eos_chars]`` (``[eos_chars, ..., bos_chars]``
        with ``reverse``, the sentence being already reversed)."""
        words = sentence.split() if split else sentence
        ends = (self.eos_chars, self.bos_chars) if reverse else (self.bos_chars, self.eos_chars)
        return np.vstack([ends[0], *(self._raw(w) for w in words), ends[1]])


class LMDataset:
    """bilm-tf's ``LMDataset`` over elmo_fast's training stream (``training.data.LMStream``): the same packing
    (docs/data.md), bilm-tf's batch dicts ``token_ids``, ``tokens_characters``, ``next_token_id`` (int32; raw
    character ids, None for a plain ``Vocabulary``). Differences: shards are read in sorted order in test mode and
    shuffled with this dataset's own ``seed`` (bilm-tf uses the global ``random``); every ``iter_batches`` call
    starts a new pass; the end of test data ends iteration (bilm-tf raises RuntimeError there on Python >= 3.7)."""

    def __init__(self, filepattern, vocab: Vocabulary, reverse: bool = False, test: bool = False,
                 shuffle_on_load: bool = False, seed: int | str = 0):
        from .training.data import resolve_shards

        missing = [t for t, i in ((BOS_TOKEN, vocab.bos), (EOS_TOKEN, vocab.eos), (UNK_TOKEN, vocab.unk)) if i < 0]
        if missing:
            raise ValueError(f"the vocabulary lacks {missing}; language-model data needs <S>, </S> and <UNK> "
                             "(bilm-tf would emit the id -1 for them)")
        self._shards = resolve_shards(filepattern, "LMDataset")
        self._vocab = vocab
        self._reverse, self._test, self._shuffle, self._seed = reverse, test, shuffle_on_load, seed

    @property
    def vocab(self) -> Vocabulary:
        return self._vocab

    @property
    def max_word_length(self) -> int | None:
        return getattr(self._vocab, "max_word_length", None)

    def _stream(self, batch_size: int, num_steps: int):
        from .training.data import LMStream

        return LMStream(self._shards, self._vocab, batch_size, num_steps, self.max_word_length or MAX_WORD_LENGTH,
                        self._reverse, self._test, self._shuffle, self._seed)

    def iter_batches(self, batch_size: int, num_steps: int):
        # not a generator itself: the stream (which refuses a non-positive size) is made, and checked, at the call
        return _bilm_batches(self._stream(batch_size, num_steps), self.max_word_length is not None)


class BidirectionalLMDataset(LMDataset):
    """bilm-tf's ``BidirectionalLMDataset``: forward and reverse ``LMDataset`` batches in one dict, the reverse
    keys with a ``_reverse`` suffix; the two directions are shuffled independently."""

    def __init__(self, filepattern, vocab: Vocabulary, test: bool = False, shuffle_on_load: bool = False,
                 seed: int | str = 0):
        super().__init__(filepattern, vocab, False, test, shuffle_on_load, seed)

    def _stream(self, batch_size: int, num_steps: int):
        from .training.data import BidirectionalStream

        return BidirectionalStream(self._shards, self._vocab, batch_size, num_steps,
                                   self.max_word_length or MAX_WORD_LENGTH, self._test, self._shuffle, self._seed)


def _bilm_batches(stream, chars: bool):
    """elmo_fast's batches (int64, inference char ids = raw + 1) as bilm-tf's (int32, raw ids or None)."""
    while True:
        try:
            batch = stream.next_batch()
        except StopIteration:
            return
        out = {}
        for key, value in batch.items():
            if key.startswith("tokens_characters"):
                out[key] = (value - 1).astype(np.int32) if chars else None
            else:
                out[key] = value.astype(np.int32)
        yield out


def _check_dump_files(outfile, **inputs) -> None:
    """Every input file (None: not given) exists and is readable, and ``outfile`` is none of them."""
    for name, path in inputs.items():
        if path is not None:
            check_input_file(path, name)
    check_output_not_input(outfile, inputs.items(), "outfile")


@torch.no_grad()
def dump_token_embeddings(vocab_file, options_file, weight_file, outfile, batch_size: int = 4096,
                          device: str | torch.device = "cpu", backend: str | None = "auto") -> int:
    """bilm-tf's ``dump_token_embeddings``: dataset ``embedding`` (n_vocab, P), vocabulary order. Returns n_vocab."""
    batch_size = check_int(batch_size, "batch_size", 1)
    _check_dump_files(outfile, vocab_file=vocab_file, options_file=options_file, weight_file=weight_file)
    vocab = Vocabulary(vocab_file)
    if len(vocab) == 0:
        raise ValueError(f"vocabulary {vocab_file} is empty")
    bilm = BiLM.from_files(options_file, weight_file, backend=backend).to(device).eval()
    if bilm.token_encoder is None:
        raise ValueError(f"{options_file}: a word-input biLM (no char_cnn): its token vectors are the weight file's "
                         "'embedding' dataset already, one row per vocabulary line of its training")
    L = bilm.options.char_cnn.max_characters_per_token  # as bilm-tf: the model's own token width
    ids = torch.tensor([word_to_char_ids(w, L) for w in vocab.words], dtype=torch.long)
    emb = torch.cat([bilm.token_encoder(ids[s : s + batch_size].to(device)).float().cpu()
                     for s in range(0, len(ids), batch_size)])
    with atomic_h5(outfile) as fh:
        fh.create_dataset("embedding", data=emb.numpy().astype(np.float32))
    return emb.shape[0]


@torch.no_grad()
def dump_bilm_embeddings(vocab_file, dataset_file, options_file, weight_file, outfile) -> None:
    """bilm-tf's ``dump_bilm_embeddings``: one sentence per batch, in file order, stateful; dataset per line
    index, shape (n_layers+1, n_tokens, 2P). A byte-order mark at the start of ``dataset_file`` is dropped."""
    _check_dump_files(outfile, vocab_file=vocab_file, dataset_file=dataset_file, options_file=options_file,
                      weight_file=weight_file)
    model = BidirectionalLanguageModel(options_file, weight_file)
    batcher = Batcher(vocab_file, model._bilm.options.char_cnn.max_characters_per_token)
    with open(dataset_file, encoding="utf-8-sig") as fin, atomic_h5(outfile) as fout:
        for i, line in enumerate(fin):
            sent = line.strip().split()
            out = model(batcher.batch_sentences([sent]))
            fout.create_dataset(str(i), data=out["lm_embeddings"][0, :, : len(sent)].numpy().astype(np.float32))


if "allennlp" in sys.modules:  # allennlp was imported first (`--include-package elmo_fast.compat`): register now
    try:
        register_allennlp()
    except ImportError as e:  # a broken allennlp must not make elmo_fast unimportable
        warnings.warn(f"allennlp is imported but elmo_fast could not register its token embedder: {e}", stacklevel=2)
