"""The character-CNN token encoder (spec §2): char embedding, convolutions, max over positions,
activation, highway layers, projection.

Layouts are those of the bilm-tf hdf5 file:

* ``char_embed``: (n_chars, d_c) table indexed by *inference* ids; row 0 must be the zero "no token" row
  (the model prepends it to the file's 261 rows);
* ``conv_weights[i]``: (w_i, d_c, n_i) = ``CNN/W_cnn_i[0]``; ``conv_biases[i]``: (n_i,);
* highway: ``W_carry``/``W_transform`` (F, F), biases (F,), TF convention (the "carry" gate scales the
  transform branch);
* projection ``W_proj`` (F, P), ``b_proj`` (P,).

Exact shortcuts used here (they change no value beyond float rounding order):

* every distinct token of a batch is encoded once and scattered back (by the callers: the token-encoder module
  and ``token_encoder_reference``; ``char_cnn_reference`` itself takes the rows as given);
* all-zero rows (padding tokens) see a zero embedding, so every window gives exactly the conv bias;
* windows made only of in-word padding characters give one value per filter for every token; it is
  computed once, and each token's convolution only covers the windows that touch a real character.
  Tokens are processed in buckets of similar length so that short words cost little.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

PAD_CHAR_ID = 261  # inference id of the in-word padding character
_BUCKET = 512


def _activation(name: str):
    if name == "relu":
        return torch.relu
    if name == "tanh":
        return torch.tanh
    raise ValueError(f"char_cnn activation must be 'relu' or 'tanh', got {name!r}")


def _conv_max(emb: torch.Tensor, conv_weights, conv_biases) -> torch.Tensor:
    """Max over all VALID windows of each filter group; emb (N, L, d_c) -> (N, F) (before activation)."""
    inp = emb.transpose(1, 2)  # (N, d_c, L)
    outs = []
    for w, b in zip(conv_weights, conv_biases):
        width = w.shape[0]
        if inp.shape[-1] < width:
            raise ValueError(f"tokens of {inp.shape[-1]} characters are shorter than a filter of width {width}")
        conv = F.conv1d(inp, w.permute(2, 1, 0), b)  # (N, n_i, L - w + 1); cross-correlation, no flip
        outs.append(conv.amax(dim=-1))
    return torch.cat(outs, dim=-1)


def char_cnn_naive(char_ids, char_embed, conv_weights, conv_biases, activation: str = "relu"):
    """The plain definition (no shortcuts): every token, every window. Used by the tests as a second oracle."""
    emb = F.embedding(char_ids, char_embed)
    return _activation(activation)(_conv_max(emb, conv_weights, conv_biases))


@contextlib.contextmanager
def _no_tf32():
    """cuDNN convolutions default to TF32 on Ampere+; the fp32 reference must be strict fp32 (spec pitfall 15)."""
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = old


def char_cnn_reference(
    char_ids: torch.Tensor,
    char_embed: torch.Tensor,
    conv_weights: list[torch.Tensor],
    conv_biases: list[torch.Tensor],
    activation: str = "relu",
) -> torch.Tensor:
    """char_ids (N, L) int inference ids -> (N, F) = act(max_p conv(embed(ids)) + bias)."""
    if char_ids.is_cuda:
        with _no_tf32():
            return _char_cnn(char_ids, char_embed, conv_weights, conv_biases, activation)
    return _char_cnn(char_ids, char_embed, conv_weights, conv_biases, activation)


def _char_cnn(char_ids, char_embed, conv_weights, conv_biases, activation):
    act = _activation(activation)
    N, L = char_ids.shape
    Ftot = sum(int(b.shape[0]) for b in conv_biases)
    if N == 0:
        return char_embed.new_zeros(0, Ftot)
    nonpad = char_ids != PAD_CHAR_ID
    is_zero = ~(char_ids != 0).any(dim=1)
    # k = 1 + index of the last non-padding character: windows starting at p >= k are all padding.
    pos = torch.arange(1, L + 1, device=char_ids.device)
    k = (nonpad * pos).amax(dim=1)
    bias_all = torch.cat(conv_biases)
    out = bias_all.expand(char_ids.shape[0], Ftot)  # all-zero rows: every window is exactly the bias
    max_w = max(int(w.shape[0]) for w in conv_weights)

    # value of an all-padding window, per filter: computed once.
    pad_win = F.embedding(torch.full((1, max_w), PAD_CHAR_ID, device=char_ids.device, dtype=torch.long), char_embed)
    pad_vals = [F.conv1d(pad_win[:, :w.shape[0]].transpose(1, 2), w.permute(2, 1, 0), b)[:, :, 0]
                for w, b in zip(conv_weights, conv_biases)]

    real = torch.nonzero(~is_zero).squeeze(1)
    if real.numel():
        kr = k[real]
        order = torch.argsort(kr, descending=True)
        real, kr = real[order], kr[order]
        k_host = kr.tolist()
        pieces, rows = [], []
        for s in range(0, real.numel(), _BUCKET):
            idx = real[s : s + _BUCKET]
            kmax = int(k_host[s])
            emb = F.embedding(char_ids[idx], char_embed)  # (n, L, d_c)
            group = []
            for (w, b), pv in zip(zip(conv_weights, conv_biases), pad_vals):
                width = int(w.shape[0])
                n_win = L - width + 1
                if n_win < 1:
                    raise ValueError(f"max_characters_per_token={L} is shorter than a filter of width {width}")
                n_real = min(kmax, n_win)  # windows starting before kmax touch a real character
                seg = emb[:, : n_real + width - 1].transpose(1, 2)
                m = F.conv1d(seg, w.permute(2, 1, 0), b).amax(dim=-1)
                if n_real < n_win:  # the token also has all-padding windows
                    m = torch.maximum(m, pv.to(m.dtype))
                group.append(m)
            pieces.append(torch.cat(group, dim=-1))
            rows.append(idx)
        real_out = torch.cat(pieces, 0)
        out = out.index_put((torch.cat(rows),), real_out)
    return act(out)


def highway_reference(x, w_carry, b_carry, w_transform, b_transform):
    """One highway layer in the TF convention: g = σ(x·W_carry + b_carry) scales the transform branch."""
    g = torch.sigmoid(torch.matmul(x, w_carry) + b_carry)
    t = torch.relu(torch.matmul(x, w_transform) + b_transform)
    return g * t + (1.0 - g) * x


def token_encoder_reference(char_ids, params: dict, activation: str = "relu", dedup: bool = True):
    """char_ids (..., L) -> (..., P): char CNN, highway layers, projection.

    ``params`` keys: ``char_embed`` (with the zero row 0), ``conv_weights``, ``conv_biases``, ``highway`` (list of
    (W_carry, b_carry, W_transform, b_transform)), ``proj`` ((W_proj, b_proj) or None).
    With ``dedup`` each distinct token runs the highway and projection once too.
    """
    lead = char_ids.shape[:-1]
    ids = char_ids.reshape(-1, char_ids.shape[-1])
    if dedup and ids.shape[0]:
        ids, inverse = torch.unique(ids, dim=0, return_inverse=True)
    else:
        inverse = None
    v = char_cnn_reference(ids, params["char_embed"], params["conv_weights"], params["conv_biases"], activation)
    for layer in params.get("highway", ()):
        v = highway_reference(v, *layer)
    if params.get("proj") is not None:
        w, b = params["proj"]
        v = torch.matmul(v, w) + b
    if inverse is not None:
        v = v.index_select(0, inverse.reshape(-1))
    return v.reshape(*lead, v.shape[-1])
