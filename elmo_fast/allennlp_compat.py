"""State-dict exchange with AllenNLP 2.10.1's ELMo modules (spec §2.3, §3.3).

elmo_fast keeps the published hdf5 (TF) layout; AllenNLP's ``_ElmoBiLm`` stores the same numbers differently:

* char embedding: (262, d) with an all-zero row 0 for padding (ours: the 261 real rows);
* convolutions: ``Conv1d`` weights (n, d, w) (ours: (w, d, n));
* each highway layer fused into one ``Linear(F, 2F)``: rows [W_transform^T ; -W_carry^T], bias
  [b_transform ; -b_carry] (AllenNLP's gate is the carry gate, the TF one gates the transform);
* projections transposed (``Linear`` weights);
* per LSTM layer, ``W_0`` split into ``input_linearity`` (rows 0..P-1 of W_0, transposed) and
  ``state_linearity`` (rows P..2P-1), gate blocks reordered i|j|f|o -> i|f|j|o, and the forget bias (+1)
  folded into ``state_linearity.bias``;
* a ``vocab_to_cache`` table as an ``Embedding`` (``_word_embedding.weight``).

Scalar mixes have the same keys on both sides. Modules with an AllenNLP counterpart (``ElmoBiLM``, and an
``ElmoCharacterEncoder`` that owns its encoder) list the correspondence as :class:`Link` s and register
:func:`load_allennlp_pre_hook`, so ``load_state_dict`` takes either layout, at any nesting depth;
:func:`to_allennlp_state_dict` writes AllenNLP's layout for a whole model.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from .modules.lstmp_layer import _swap_gates

# AllenNLP's ``ElmoLstm`` keeps its stateful LSTM state in ``_states``, a plain attribute: AllenNLP 2.10.1 never
# writes it into a state_dict nor restores it from one. Keys under this name (a patched AllenNLP, a user's own
# registration) are dropped on load: it is the previous batch's per-row state, not a model parameter, and a model
# loaded from a checkpoint starts from zero state, as a freshly built AllenNLP one does.
_IGNORED_STATE_KEY = "_elmo_lstm._states"


class AllenNLPStateDictError(ValueError):
    """An AllenNLP state_dict entry that elmo_fast cannot represent, or a model AllenNLP cannot represent."""


@dataclass(frozen=True)
class Link:
    """``ours`` tensors of a module <-> ``theirs`` AllenNLP keys (relative to the module), with the conversions
    between them (each takes the tensors of one side in order and returns those of the other).

    An ``ours`` tensor is a registered parameter (loaded by torch under its state_dict name) or a plain tensor
    attribute such as the ``vocab_to_cache`` table (copied in place on load)."""

    ours: tuple[torch.Tensor, ...]
    theirs: tuple[str, ...]
    to_theirs: Callable[..., tuple[torch.Tensor, ...]]
    to_ours: Callable[..., tuple[torch.Tensor, ...]]


def _same(x):
    return (x,)


def _transposed(x):
    return (x.t().contiguous(),)


def _conv_swap(w):  # (w, d, n) <-> (n, d, w)
    return (w.permute(2, 1, 0).contiguous(),)


def _char_embed_to_theirs(e):
    return (torch.cat([e.new_zeros(1, e.shape[1]), e]),)


def _char_embed_to_ours(e):
    if bool((e[0] != 0).any()):
        raise AllenNLPStateDictError("row 0 (character id 0, padding) must be all zeros as AllenNLP builds it; "
                                     "elmo_fast keeps that row fixed at zero")
    return (e[1:].clone(),)


def _highway_weight_to_theirs(w_transform, w_carry):
    return (torch.cat([w_transform.t(), -w_carry.t()]),)


def _highway_weight_to_ours(w):
    n = w.shape[1]
    return w[:n].t().contiguous(), (-w[n:]).t().contiguous()


def _highway_bias_to_theirs(b_transform, b_carry):
    return (torch.cat([b_transform, -b_carry]),)


def _highway_bias_to_ours(b):
    n = b.shape[0] // 2
    return b[:n].clone(), -b[n:]


def _lstm_links(stack, layer: int, theirs: str, export: bool) -> list[Link]:
    P, H, fb = stack.opts.projection_dim, stack.opts.dim, stack.forget_bias
    if export and stack.W_P_0 is None:
        raise AllenNLPStateDictError("AllenNLP's LSTM always has the projection W_P_0; this model has none "
                                     f"(projection_dim == dim == {P})")

    def w_to_theirs(w0):
        wt = w0.t()
        return _swap_gates(wt[:, :P]).contiguous(), _swap_gates(wt[:, P:]).contiguous()

    def w_to_ours(w_in, w_state):
        return (torch.cat([_swap_gates(w_in).t(), _swap_gates(w_state).t()]).contiguous(),)

    def b_to_theirs(b):
        b = b.clone()
        b[2 * H : 3 * H] += fb
        return (_swap_gates(b),)

    def b_to_ours(b):
        b = _swap_gates(b)
        b[2 * H : 3 * H] -= fb
        return (b,)

    links = [Link((stack.W_0[layer],), (f"{theirs}input_linearity.weight", f"{theirs}state_linearity.weight"),
                  w_to_theirs, w_to_ours),
             Link((stack.B[layer],), (f"{theirs}state_linearity.bias",), b_to_theirs, b_to_ours)]
    if stack.W_P_0 is not None:
        links.append(Link((stack.W_P_0[layer],), (f"{theirs}state_projection.weight",), _transposed, _transposed))
    return links


def encoder_links(enc, theirs: str = "", export: bool = False) -> list[Link]:
    """``CharCNNTokenEncoder`` <-> AllenNLP's ``_ElmoCharacterEncoder`` (keys under ``theirs``). ``export``: raise
    if AllenNLP cannot hold the model (on load, a part the model lacks leaves its AllenNLP keys unexpected)."""
    if export and enc.W_proj is None:
        raise AllenNLPStateDictError("AllenNLP's character encoder always has the projection CNN_proj; this model "
                                     f"has none (filters == projection_dim == {enc.output_dim})")
    links = [Link((enc.char_embed,), (f"{theirs}_char_embedding_weights",), _char_embed_to_theirs, _char_embed_to_ours)]
    for i, (w, b) in enumerate(zip(enc.conv_w, enc.conv_b)):
        links.append(Link((w,), (f"{theirs}char_conv_{i}.weight",), _conv_swap, _conv_swap))
        links.append(Link((b,), (f"{theirs}char_conv_{i}.bias",), _same, _same))
    for k, hw in enumerate(enc.highway):
        layer = f"{theirs}_highways._layers.{k}"
        links.append(Link((hw.W_transform, hw.W_carry), (f"{layer}.weight",),
                          _highway_weight_to_theirs, _highway_weight_to_ours))
        links.append(Link((hw.b_transform, hw.b_carry), (f"{layer}.bias",), _highway_bias_to_theirs,
                          _highway_bias_to_ours))
    if enc.W_proj is not None:
        links.append(Link((enc.W_proj,), (f"{theirs}_projection.weight",), _transposed, _transposed))
        links.append(Link((enc.b_proj,), (f"{theirs}_projection.bias",), _same, _same))
    return links


def bilm_links(bilm, word_embedding: torch.Tensor | None = None, export: bool = False) -> list[Link]:
    """``BiLM`` (+ the ``vocab_to_cache`` table, if any) <-> AllenNLP's ``_ElmoBiLm``."""
    links = encoder_links(bilm.token_encoder, "_token_embedder.", export)
    for layer in range(bilm.options.lstm.n_layers):
        links += _lstm_links(bilm.forward_lstm, layer, f"_elmo_lstm.forward_layer_{layer}.", export)
        links += _lstm_links(bilm.backward_lstm, layer, f"_elmo_lstm.backward_layer_{layer}.", export)
    if word_embedding is not None:
        links.append(Link((word_embedding,), ("_word_embedding.weight",), _same, _same))
    return links


def load_allennlp_pre_hook(module: nn.Module, state_dict, prefix: str, local_metadata, strict, missing_keys,
                           unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` pre-hook: when the keys under ``prefix`` are AllenNLP's, convert them in place to the
    module's own (a state_dict in elmo_fast's layout passes untouched). An AllenNLP key absent from the
    state_dict is reported under its AllenNLP name in ``missing_keys`` and leaves its parameters as they are
    (torch's rule); keys that map to nothing are left for torch to report as unexpected."""
    links = module.allennlp_links()
    theirs_names = {n for link in links for n in link.theirs}
    rel = [k[len(prefix):] for k in state_dict if k.startswith(prefix)]
    if not any(r in theirs_names for r in rel):
        return
    param_name = {id(p): n for n, p in module.named_parameters()}
    ours_names = {param_name[id(t)] for link in links for t in link.ours if id(t) in param_name}
    mixed = [prefix + r for r in rel if r in ours_names]
    if mixed:
        error_msgs.append(f"the state_dict mixes AllenNLP keys and elmo_fast keys under '{prefix}' "
                          f"(e.g. {mixed[0]}); give one layout")
        return
    for r in rel:
        if r == _IGNORED_STATE_KEY or r.startswith(_IGNORED_STATE_KEY + "."):
            del state_dict[prefix + r]
    for link in links:
        meta = link.to_theirs(*(t.detach().to("meta") for t in link.ours))
        given, ok = {}, True
        for name, want in zip(link.theirs, meta):
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict.pop(key)
            if tuple(value.shape) != tuple(want.shape):
                error_msgs.append(f"size mismatch for {key}: the AllenNLP checkpoint has shape {tuple(value.shape)}, "
                                  f"this model needs {tuple(want.shape)}")
                ok = False
            given[name] = value
        if not given or not ok:
            continue
        if len(given) < len(link.theirs):  # fill the absent part from the module's current values
            like = next(iter(given.values()))
            current = link.to_theirs(*(t.detach().to(like) for t in link.ours))
            given = {n: given.get(n, c) for n, c in zip(link.theirs, current)}
        try:
            values = link.to_ours(*(given[n] for n in link.theirs))
        except AllenNLPStateDictError as e:
            error_msgs.append(f"{prefix}{link.theirs[0]}: {e}")
            continue
        for tensor, value in zip(link.ours, values):
            if id(tensor) in param_name:
                state_dict[prefix + param_name[id(tensor)]] = value
            else:
                with torch.no_grad():
                    tensor.copy_(value)


def to_allennlp_state_dict(model: nn.Module) -> OrderedDict:
    """``model.state_dict()`` with every elmo_fast module that has an AllenNLP counterpart (``ElmoBiLM``, also
    inside ``Elmo``, ``ElmoTokenEmbedder`` or any model of yours) in AllenNLP 2.10.1's layout, so that the
    same model built with AllenNLP's classes loads it with ``load_state_dict`` (strict)."""
    state = model.state_dict()
    groups: dict[str, OrderedDict] = {}
    owner: dict[str, str] = {}  # elmo_fast key -> the module prefix whose AllenNLP keys replace it
    for name, module in model.named_modules():
        links = module.allennlp_links(export=True) if hasattr(module, "allennlp_links") else []
        if not links:
            continue
        prefix = f"{name}." if name else ""
        param_name = {id(p): n for n, p in module.named_parameters()}
        group = OrderedDict()
        for link in links:
            ours = []
            for t in link.ours:
                if id(t) in param_name:
                    key = prefix + param_name[id(t)]
                    owner[key] = prefix
                    ours.append(state[key])
                else:
                    ours.append(t.detach())
            group.update((prefix + n, v) for n, v in zip(link.theirs, link.to_theirs(*ours)))
        groups[prefix] = group
    out = OrderedDict()
    for key, value in state.items():
        if key not in owner:
            out[key] = value
        elif owner[key] in groups:  # the module's AllenNLP keys go where its first own key was
            out.update(groups.pop(owner[key]))
    return out
