"""The biLM: token encoder + forward and backward LSTMP stacks, stateful across calls (spec §3.6, §4)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from .._backend import check_backend_name
from ..modules.lstm import LSTMPStack
from ..modules.token_encoder import CharCNNTokenEncoder
from ..ops import _precision as prec
from ..ops.lstmp import check_lengths, trusted_lengths
from ..options import ElmoOptions, OptionsError
from ..weights import WeightFileError, lstm_prefix, read_weights, write_weights
from . import _graphs


def check_ids(ids: torch.Tensor, mask: torch.Tensor, hi_max: int, what: str,
              boundaries: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``mask`` (..., T) of the positions holding a token, once ``ids`` are known to lie in [0, hi_max] and every row
    to be right-padded (a token after a padding position would end the sentence there and run the padding through
    the LSTMs as a token): one host read for both; inside torch.compile, asserts in the graph instead.

    ``boundaries``: the (L,) char ids of ``<S>`` and ``</S>``, for a model that adds them itself to char ids (B, T, L):
    ids whose every non-empty row already begins with ``<S>`` and ends with ``</S>`` (what bilm-tf's ``Batcher``
    gives) are refused in the same host read, as they would get each boundary twice."""
    holes = (mask[..., 1:] & ~mask[..., :-1]).any()
    checks = [holes]
    if boundaries is not None and ids.numel():
        bos, eos = boundaries
        lengths = mask.long().sum(-1)  # (B,)
        last = (lengths - 1).clamp_min(0)
        first_ids = ids[:, 0]
        last_ids = ids.gather(1, last.view(-1, 1, 1).expand(-1, 1, ids.shape[-1])).squeeze(1)
        wrapped = (first_ids == bos).all(-1) & (last_ids == eos).all(-1) & (lengths >= 2)
        nonempty = lengths > 0
        checks.append(nonempty.any() & (wrapped | ~nonempty).all())
    if torch.compiler.is_compiling():  # (on a GPU device-side asserts): no host sync
        torch._assert_async(((ids >= 0) & (ids <= hi_max)).all(), f"{what} must lie in [0, {hi_max}]")
        torch._assert_async(~holes, f"{what} must be right-padded")
        if len(checks) > 1:
            torch._assert_async(~checks[1], f"{what} already hold <S> and </S> (Batcher output); use batch_to_ids")
    elif ids.numel():
        lo, hi = torch.aminmax(ids)  # in ids' own dtype: no int64 copy of the whole tensor
        lo, hi, hole, *batcher = torch.stack([lo.long(), hi.long(), *(c.long() for c in checks)]).tolist()
        if lo < 0 or hi > hi_max:
            raise ValueError(f"{what} must lie in [0, {hi_max}], got [{lo}, {hi}]")
        if hole:
            raise ValueError(f"{what} must be right-padded: a row has a token after a padding position; each row holds "
                             "its tokens first, then padding")
        if batcher and batcher[0]:
            raise ValueError(f"{what} already hold the sentence boundaries: every sentence begins with <S> and ends "
                             "with </S>, as bilm-tf's Batcher makes them, and this AllenNLP-style model adds <S> and "
                             "</S> itself, so each sentence would get two of each. Make the ids with "
                             "elmo_fast.batch_to_ids(sentences) (no boundaries), or run Batcher ids through "
                             "elmo_fast.compat.BidirectionalLanguageModel; if the tokens themselves begin with '<S>' "
                             "and end with '</S>', leave those two out")
    return mask


class BiLM(nn.Module):
    """Token encoder (shared by both directions) plus two independent LSTMP stacks.

    Inputs carry the sentence boundaries already (bilm-tf convention): char ids (B, T+2, L), a position is valid
    iff any id > 0, rows right-padded. A word-input biLM (options without ``char_cnn``, bilm-tf's other kind) has
    a (vocabulary, P) ``word_embedding`` instead of the character CNN, dataset ``embedding`` in the weight file;
    it takes ``TokenBatcher`` ids (vocabulary id + 1, 0 = padding). ``n_tokens_vocab`` sizes it where no weight
    file does (training); ``from_files`` reads it from the file. The LSTM state is kept per (direction, layer,
    batch row) across calls: a batch of B rows starts from rows 0..B-1 of the stored state (zero rows are added
    when B grows), rows of length 0 keep their state, rows >= B are untouched; ``reset_states`` clears all or
    some rows.
    """

    def __init__(self, options: ElmoOptions, backend: str | None = "auto", stateful: bool = True,
                 cnn_projection: bool | None = None, lstm_projection: bool | None = None,
                 n_tokens_vocab: int | None = None):
        super().__init__()
        self.options = options
        self.backend = check_backend_name(backend)
        self.stateful = stateful
        P = options.projection_dim
        if options.char_cnn is not None:
            self.token_encoder = CharCNNTokenEncoder(options.char_cnn, P, cnn_projection, backend=backend)
            self.word_embedding = None
        else:
            if n_tokens_vocab is None or n_tokens_vocab < 1:
                raise OptionsError("a word-input biLM (options without 'char_cnn') needs its vocabulary size "
                                   "(n_tokens_vocab, or an 'embedding' dataset in the weight file)")
            self.token_encoder = None
            # bilm-tf: tf.get_variable's default initializer, Glorot uniform
            bound = (6.0 / (n_tokens_vocab + P)) ** 0.5
            self.word_embedding = nn.Parameter(torch.empty(n_tokens_vocab, P).uniform_(-bound, bound))
        self.forward_lstm = LSTMPStack(options.lstm, reverse=False, with_projection=lstm_projection, backend=backend)
        self.backward_lstm = LSTMPStack(options.lstm, reverse=True, with_projection=lstm_projection, backend=backend)
        self._states: list[torch.Tensor] | None = None  # [h (2, n_layers, B, P), c (2, n_layers, B, H)]

    @property
    def num_layers(self) -> int:
        return self.options.lstm.n_layers + 1

    @property
    def output_dim(self) -> int:
        return 2 * self.options.projection_dim

    # ---------------------------------------------------------------- state
    def reset_states(self, mask: torch.Tensor | None = None) -> None:
        """Zero all stored LSTM states, or only the rows where ``mask`` (B,) is True."""
        if self._states is None:
            return
        if mask is None:
            self._states = None
            return
        mask = mask if isinstance(mask, torch.Tensor) else torch.as_tensor(mask)
        rows = self._states[0].shape[2]
        if mask.dtype != torch.bool or mask.dim() != 1 or mask.numel() > rows:
            raise ValueError(f"reset_states: mask must be a 1-d bool tensor of at most {rows} rows (True: reset that "
                             f"batch row; rows past it keep their state), got {mask.dtype} of shape "
                             f"{tuple(mask.shape)}")
        mask = mask.to(self._states[0].device)
        keep = (~torch.nn.functional.pad(mask, (0, rows - mask.numel()))).to(self._states[0].dtype)
        self._states = [s * keep.view(1, 1, -1, 1) for s in self._states]

    def initial_states(self, batch_size: int, device, dtype):
        L, P, H = self.options.lstm.n_layers, self.options.projection_dim, self.options.lstm.dim
        if not self.stateful or self._states is None:
            h = torch.zeros(2, L, batch_size, P, device=device, dtype=dtype)
            c = torch.zeros(2, L, batch_size, H, device=device, dtype=dtype)
            return h, c
        h, c = self._states
        h, c = h.to(device=device, dtype=dtype), c.to(device=device, dtype=dtype)
        if h.shape[2] < batch_size:
            pad = batch_size - h.shape[2]
            h = torch.nn.functional.pad(h, (0, 0, 0, pad))
            c = torch.nn.functional.pad(c, (0, 0, 0, pad))
        return h[:, :, :batch_size], c[:, :, :batch_size]

    def _store_states(self, h_new: torch.Tensor, c_new: torch.Tensor) -> None:
        B = h_new.shape[2]
        h_new, c_new = h_new.detach(), c_new.detach()
        if self._states is None or self._states[0].shape[2] <= B:
            self._states = [h_new, c_new]
        else:
            h, c = self._states
            self._states = [torch.cat([h_new, h[:, :, B:].to(h_new)], 2), torch.cat([c_new, c[:, :, B:].to(c_new)], 2)]

    # ---------------------------------------------------------------- forward
    def run_lstms(self, token_embedding: torch.Tensor, lengths: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor,
                  dropout: float = 0.0, token_embedding_bwd: torch.Tensor | None = None, bidirectional: bool = True):
        """Both stacks over (B, T, P) inputs. h0 (2, L, B, P), c0 (2, L, B, H). Returns
        (forward outputs per layer, backward outputs per layer, h_n, c_n) with states stacked like h0/c0. Without
        ``bidirectional`` (bilm-tf's forward-only LM) the forward stack alone runs: no backward outputs, and the
        backward rows of h_n/c_n are those of h0/c0.

        ``lengths`` (B,) must lie in [0, T]: checked here once (one host sync) unless the caller runs this under
        ``elmo_fast.ops.lstmp.trusted_lengths()`` (lengths made from a mask, as ``forward_embeddings`` does)."""
        check_lengths(lengths, token_embedding.shape[1], "run_lstms")
        with trusted_lengths():
            return self._run_lstms(token_embedding, lengths, h0, c0, dropout, token_embedding_bwd, bidirectional)

    def _run_lstms(self, token_embedding, lengths, h0, c0, dropout, token_embedding_bwd, bidirectional=True):
        x_b = token_embedding if token_embedding_bwd is None else token_embedding_bwd
        L = self.options.lstm.n_layers
        if not bidirectional:
            fwd, f_fin = self.forward_lstm(token_embedding, lengths, [(h0[0, i], c0[0, i]) for i in range(L)], dropout)
            bwd, b_fin = [], [(h0[1, i], c0[1, i]) for i in range(L)]
            return fwd, bwd, *self._stack_states(f_fin, b_fin)
        # ELMO_FAST_BILM_STREAMS=2: on a GPU the backward stack on a side stream forked here, before the forward
        # stack is queued, so that the two run at once
        fork = _graphs.side_stream(token_embedding)
        fwd, f_fin = self.forward_lstm(token_embedding, lengths, [(h0[0, i], c0[0, i]) for i in range(L)], dropout)
        if fork is None:
            bwd, b_fin = self.backward_lstm(x_b, lengths, [(h0[1, i], c0[1, i]) for i in range(L)], dropout)
        else:
            with fork:
                bwd, b_fin = self.backward_lstm(x_b, lengths, [(h0[1, i], c0[1, i]) for i in range(L)], dropout)
                fork.hand_over(*bwd, *(t for state in b_fin for t in state))
        return fwd, bwd, *self._stack_states(f_fin, b_fin)

    @staticmethod
    def _stack_states(f_fin, b_fin):
        """(h_n, c_n) stacked like h0/c0 from the two stacks' final (h, c) per layer."""
        h_n = torch.stack([torch.stack([s[0] for s in f_fin]), torch.stack([s[0] for s in b_fin])])
        c_n = torch.stack([torch.stack([s[1] for s in f_fin]), torch.stack([s[1] for s in b_fin])])
        return h_n, c_n

    def forward_embeddings(self, token_embedding: torch.Tensor, mask: torch.Tensor,
                           mask_token_layer: bool = True) -> dict:
        """Run the LSTMs on a token layer (B, T+2, P) with boundaries, mask (B, T+2). Layer 0 is zero at padded
        positions when ``mask_token_layer`` (AllenNLP); bilm-tf leaves the CNN output of the empty token there."""
        B = token_embedding.shape[0]
        h0, c0 = self.initial_states(B, token_embedding.device, prec.state_dtype(token_embedding.dtype))
        acts, h_n, c_n = self.stateless_forward(token_embedding, mask, h0, c0, mask_token_layer)
        if self.stateful:
            self._store_states(h_n, c_n)
        return {"activations": acts, "mask": mask, "token_embedding": token_embedding}

    def stateless_forward(self, token_embedding: torch.Tensor, mask: torch.Tensor, h0: torch.Tensor,
                          c0: torch.Tensor, mask_token_layer: bool = True):
        """The LSTMs from explicit states: (activations, h_n, c_n). No host sync (lengths come from ``mask``), so
        it can be captured in a CUDA graph. States stay fp32 for bf16/fp16 activations (``state_dtype``)."""
        lengths = mask.long().sum(1)
        with trusted_lengths():
            fwd, bwd, h_n, c_n = self._run_lstms(token_embedding, lengths, h0, c0, 0.0, None)
        acts = [torch.cat([token_embedding, token_embedding], -1)]
        if mask_token_layer:
            acts[0] = acts[0] * mask.unsqueeze(-1).to(token_embedding.dtype)
        acts += [torch.cat([f, b], -1) for f, b in zip(fwd, bwd)]
        return acts, h_n, c_n

    def forward(self, char_ids: torch.Tensor) -> dict:
        """char ids with boundaries (B, T+2, L) -> {"activations": [(B, T+2, 2P)] * (n_layers+1), "mask",
        "token_embedding" (B, T+2, P) (unmasked, as bilm-tf returns it)}. A word-input biLM takes ``TokenBatcher``
        ids (B, T+2) instead."""
        if self.token_encoder is None:
            return self.forward_embeddings(self.embed_words(char_ids), char_ids > 0)
        mask = (char_ids > 0).any(-1)
        return self.forward_embeddings(self.token_encoder(char_ids), mask)

    def embed_words(self, ids: torch.Tensor) -> torch.Tensor:
        """A word-input biLM's token layer of ``TokenBatcher`` ids (..., T) (vocabulary id + 1; 0: padding, a zero
        vector, as bilm-tf's loader prepends a zero row)."""
        V = self.word_embedding.shape[0]
        lo, hi = torch.stack(torch.aminmax(ids)).tolist() if ids.numel() and ids.dtype == torch.long else (0, 0)
        if ids.dtype != torch.long or not 0 <= lo <= hi <= V:  # one host read for both bounds
            raise ValueError(f"word ids must be int64 TokenBatcher ids in [0, {V}] (vocabulary id + 1, 0 = padding)")
        return self._embed_words(ids)

    def _embed_words(self, ids: torch.Tensor) -> torch.Tensor:  # ids already checked
        rows = self.word_embedding[(ids - 1).clamp_min(0)]  # no padded copy of the whole table
        return torch.where((ids > 0).unsqueeze(-1), rows, rows.new_zeros(()))

    # ---------------------------------------------------------------- weights
    def _param_map(self) -> dict[str, tuple[nn.Parameter, bool]]:
        """hdf5 dataset name -> (parameter, has the leading 1 axis of W_cnn)."""
        m: dict[str, tuple[nn.Parameter, bool]] = {}
        enc = self.token_encoder
        if enc is None:
            m["embedding"] = (self.word_embedding, False)
            return self._lstm_params(m)
        m["char_embed"] = (enc.char_embed, False)
        for i, (w, b) in enumerate(zip(enc.conv_w, enc.conv_b)):
            m[f"CNN/W_cnn_{i}"] = (w, True)
            m[f"CNN/b_cnn_{i}"] = (b, False)
        for k, layer in enumerate(enc.highway):
            for name in ("W_carry", "b_carry", "W_transform", "b_transform"):
                m[f"CNN_high_{k}/{name}"] = (getattr(layer, name), False)
        if enc.W_proj is not None:
            m["CNN_proj/W_proj"] = (enc.W_proj, False)
            m["CNN_proj/b_proj"] = (enc.b_proj, False)
        return self._lstm_params(m)

    def _lstm_params(self, m: dict) -> dict:
        for d, stack in enumerate((self.forward_lstm, self.backward_lstm)):
            for layer in range(self.options.lstm.n_layers):
                pre = lstm_prefix(d, layer)
                m[f"{pre}/W_0"] = (stack.W_0[layer], False)
                m[f"{pre}/B"] = (stack.B[layer], False)
                if stack.W_P_0 is not None:
                    m[f"{pre}/W_P_0"] = (stack.W_P_0[layer], False)
        return m

    @torch.no_grad()
    def load_arrays(self, arrays: dict[str, np.ndarray], source: str = "weights") -> None:
        for name, (param, lead1) in self._param_map().items():
            if name not in arrays:
                raise WeightFileError(f"{source}: dataset '{name}' is missing")
            a = arrays[name]
            a = a[0] if lead1 else a
            if tuple(a.shape) != tuple(param.shape):
                raise WeightFileError(f"{source}: dataset '{name}' has shape {tuple(arrays[name].shape)}, "
                                      f"expected {((1,) if lead1 else ()) + tuple(param.shape)}")
            param.copy_(torch.from_numpy(np.ascontiguousarray(a)).to(param.dtype))

    def state_arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for name, (param, lead1) in self._param_map().items():
            a = param.detach().to("cpu", torch.float32).numpy()
            out[name] = a[None] if lead1 else a
        return out

    @classmethod
    def from_files(cls, options_file, weight_file, backend: str | None = "auto", stateful: bool = True) -> "BiLM":
        opts = ElmoOptions.load(options_file)
        arrays = read_weights(weight_file, opts)
        model = cls(opts, backend=backend, stateful=stateful,
                    cnn_projection="CNN_proj/W_proj" in arrays,
                    lstm_projection=f"{lstm_prefix(0, 0)}/W_P_0" in arrays,
                    n_tokens_vocab=arrays["embedding"].shape[0] if "embedding" in arrays else None)
        model.load_arrays(arrays, source=str(weight_file))
        return model

    def save_weights(self, weight_file, options_file=None) -> None:
        """Write the weights in the published layout, recording whether the model is residual
        (``weights.RESIDUAL_ATTR``), and, if ``options_file`` is given, the inference options.json (n_characters
        262) that loads them back; both files are written together or not at all."""
        write_weights(weight_file, self.state_arrays(), self.options, options_file)
