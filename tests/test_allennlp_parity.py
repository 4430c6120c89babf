"""Parity with the real AllenNLP 2.10.1 ELMo (``allennlp.modules.elmo``) on random-weight models.

These tests need allennlp importable; they are skipped otherwise, except under `make test-parity`, which
requires it (``tests/oracles.py``). ``bash bench/setup_allennlp.sh`` builds the
``.venv-allennlp`` venv that has it (with elmo_fast installed editable), then:

    .venv-allennlp/bin/python -m pytest -q -s tests/test_allennlp_parity.py

``-s`` shows one ``PARITY <check> max_abs_diff=...`` line per comparison. Everything runs in float32 on CPU
(elmo_fast backend "reference") and must agree to ATOL; a float64 run checks that the remaining float32
difference is only rounding. AllenNLP only supports ``use_skip_connections: true``, so every model here has it.
"""
from __future__ import annotations

import copy
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from oracles import require  # noqa: E402

allennlp_elmo = require("allennlp.modules.elmo")

from elmo_fast import Elmo, ElmoBiLM, batch_to_ids  # noqa: E402
from elmo_fast.testing import TINY_OPTIONS, random_arrays, write_random_model  # noqa: E402
from elmo_fast.weights import write_weights  # noqa: E402

ATOL = 1e-5
ATOL_F64 = 1e-10

MID_OPTIONS = {
    "char_cnn": {"activation": "relu", "embedding": {"dim": 16},
                 "filters": [[1, 32], [2, 32], [3, 64], [4, 64], [5, 128], [6, 128], [7, 128]], "n_highway": 2,
                 "n_characters": 262, "max_characters_per_token": 50},
    "lstm": {"dim": 512, "projection_dim": 128, "n_layers": 2, "cell_clip": 3, "proj_clip": 3,
             "use_skip_connections": True},
}
# tanh CNN, one highway layer, three LSTM layers: shapes the released model does not have.
VARIANT_OPTIONS = copy.deepcopy(TINY_OPTIONS)
VARIANT_OPTIONS["char_cnn"].update({"activation": "tanh", "n_highway": 1})
VARIANT_OPTIONS["lstm"].update({"n_layers": 3, "cell_clip": 2.5, "proj_clip": 1.5})

MODELS = {"tiny": (TINY_OPTIONS, 11), "mid": (MID_OPTIONS, 12), "variant": (VARIANT_OPTIONS, 13)}


def _report(name: str, diff: float) -> float:
    print(f"PARITY {name} max_abs_diff={diff:.3e}")
    return diff


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("allennlp_parity")
    files = {name: write_random_model(root / name, opts, seed=seed) for name, (opts, seed) in MODELS.items()}
    # For the float64 check: LSTM biases on a 2**-20 grid, so that AllenNLP's load-time float32 `B + 1.0`
    # (forget bias folded in before any .double()) is exact and equals elmo_fast's run-time float64 `B + 1.0`.
    opt, _ = write_random_model(root / "mid_f64", MID_OPTIONS, seed=12)
    arrays = random_arrays(MID_OPTIONS, seed=12)
    for name in arrays:
        if name.endswith("LSTMCell/B"):
            arrays[name] = (np.round(arrays[name].astype(np.float64) * 2**20) / 2**20).astype(np.float32)
    write_weights(root / "mid_f64" / "weights.hdf5", arrays)
    files["mid_f64"] = (opt, str(root / "mid_f64" / "weights.hdf5"))
    return files


# ------------------------------------------------------------------ deterministic pseudo-English text
_WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have "
          "an they you were her she there been one all we their has would when if so no will more out up into do "
          "any your what some can other than then could time its only new about these two may first man also made "
          "river market engine garden signal window morning quietly carefully yesterday language committee").split()
_ODD = ["naïve", "café", "Straße", "日本語", "Привет", "🙂", "e\u0301", "Ünïcödé", "<S>", "</S>", "don't", "3.14",
        "a" * 60, "é" * 30, "x" * 47 + "é", "U.S.", "--", "\u00a0"]


def _sentence(rng: random.Random, n: int) -> list[str]:
    words = [rng.choice(_WORDS) for _ in range(n)]
    if words:
        words[0] = words[0].capitalize()
        words.append(rng.choice([".", "?", "!", ","]))
    return words


def _stateful_batches() -> list[list[list[str]]]:
    """>= 5 batches whose sizes grow and shrink, with an empty sentence, a 60-char token and non-ASCII."""
    rng = random.Random(7)
    b = []
    b.append([_sentence(rng, n) for n in (9, 4, 13)])                                   # B=3
    b.append([_sentence(rng, 5), [], ["a" * 60, "and", "é" * 30], _ODD[:8], _sentence(rng, 21)])  # grow to 5
    b.append([_sentence(rng, 2), ["Ok"]])                                                # shrink to 2
    b.append([_sentence(rng, n) for n in (1, 27, 3, 0, 14, 8, 11)] + [_ODD[8:]])        # grow to 8
    b.append([["Alone"]])                                                                # B=1
    b.append([_sentence(rng, n) for n in (6, 30, 2, 17)] + [[]])                         # B=5, empty last row
    b.append([_sentence(rng, n) for n in (19, 23, 7)])                                   # B=3
    return b


# ------------------------------------------------------------------ checks
def test_batch_to_ids_equal():
    batches = _stateful_batches() + [[["<S>", "word", "</S>"]], [_ODD], [[], ["x"]]]
    for k, batch in enumerate(batches):
        ref = allennlp_elmo.batch_to_ids(batch)
        ours = batch_to_ids(batch)
        assert ours.dtype == ref.dtype
        assert torch.equal(ours, ref), f"batch {k}"
    _report("batch_to_ids", 0.0)


@pytest.mark.parametrize("model", list(MODELS))
def test_bilm_stateful_sequence(model, model_files):
    opt, wts = model_files[model]
    ref = allennlp_elmo._ElmoBiLm(opt, wts)
    ours = ElmoBiLM(opt, wts, backend="reference")
    worst = 0.0
    with torch.no_grad():
        for k, batch in enumerate(_stateful_batches()):
            ids = batch_to_ids(batch)
            r, o = ref(ids), ours(ids)
            assert torch.equal(o["mask"], r["mask"]), f"batch {k}: masks differ"
            assert len(o["activations"]) == len(r["activations"]) == MODELS[model][0]["lstm"]["n_layers"] + 1
            for layer, (a, b) in enumerate(zip(o["activations"], r["activations"])):
                d = _maxdiff(a, b)
                assert d <= ATOL, f"batch {k} (B={len(batch)}) layer {layer}: max abs diff {d:.3e}"
                worst = max(worst, d)
    _report(f"ElmoBiLM[{model}] 7 stateful batches, all layers", worst)


def test_bilm_stateful_sequence_float64(model_files):
    """Same sequence in float64: the float32 differences above must be rounding, not a semantic gap."""
    opt, wts = model_files["mid_f64"]
    ref = allennlp_elmo._ElmoBiLm(opt, wts).double()
    ours = ElmoBiLM(opt, wts, backend="reference").double()
    worst = 0.0
    with torch.no_grad():
        for k, batch in enumerate(_stateful_batches()):
            ids = batch_to_ids(batch)
            r, o = ref(ids), ours(ids)
            assert o["activations"][-1].dtype == torch.float64
            assert torch.equal(o["mask"], r["mask"])
            for layer, (a, b) in enumerate(zip(o["activations"], r["activations"])):
                d = _maxdiff(a, b)
                assert d <= ATOL_F64, f"batch {k} layer {layer}: {d:.3e}"
                worst = max(worst, d)
    _report("ElmoBiLM[mid] float64 7 stateful batches", worst)


@pytest.mark.parametrize("model", list(MODELS))
def test_char_encoder_token_embeddings(model, model_files):
    opt, wts = model_files[model]
    ref = allennlp_elmo._ElmoBiLm(opt, wts)
    ours = ElmoBiLM(opt, wts, backend="reference")
    worst = 0.0
    with torch.no_grad():
        for batch in _stateful_batches():
            ids = batch_to_ids(batch)
            r = ref._token_embedder(ids)
            o = ours._token_embedder(ids)
            assert torch.equal(o["mask"], r["mask"])
            worst = max(worst, _maxdiff(o["token_embedding"], r["token_embedding"]))
    assert worst <= ATOL
    _report(f"char encoder token_embedding[{model}] (padding positions included)", worst)


def _set_mix(mix, weights, gamma):
    with torch.no_grad():
        for p, v in zip(mix.scalar_parameters, weights):
            p.fill_(v)
        mix.gamma.fill_(gamma)


def _pair(opt, wts, **kw):
    ref = allennlp_elmo.Elmo(opt, wts, **kw)
    ours = Elmo(opt, wts, backend="reference", **kw)
    ref.eval()
    ours.eval()
    return ref, ours


def _compare_elmo(name, ref, ours, batches, word_batches=None):
    worst = 0.0
    with torch.no_grad():
        for k, batch in enumerate(batches):
            ids = batch if isinstance(batch, torch.Tensor) else batch_to_ids(batch)
            words = None if word_batches is None else word_batches[k]
            r, o = ref(ids, words), ours(ids, words)
            assert o["mask"].dtype == r["mask"].dtype == torch.bool
            assert torch.equal(o["mask"], r["mask"]), f"{name} batch {k}: masks differ"
            assert len(o["elmo_representations"]) == len(r["elmo_representations"])
            for j, (a, b) in enumerate(zip(o["elmo_representations"], r["elmo_representations"])):
                d = _maxdiff(a, b)
                assert d <= ATOL, f"{name} batch {k} representation {j}: {d:.3e}"
                worst = max(worst, d)
    return _report(name, worst)


@pytest.mark.parametrize("model", ["tiny", "mid"])
@pytest.mark.parametrize("do_layer_norm", [False, True])
@pytest.mark.parametrize("keep_sentence_boundaries", [False, True])
def test_elmo_two_representations(model, do_layer_norm, keep_sentence_boundaries, model_files):
    opt, wts = model_files[model]
    ref, ours = _pair(opt, wts, num_output_representations=2, do_layer_norm=do_layer_norm,
                      keep_sentence_boundaries=keep_sentence_boundaries, dropout=0.5)
    for side in (ref, ours):  # distinct, non-trivial trainable mixes
        _set_mix(side.scalar_mix_0, [0.3, -0.7, 1.1], 1.3)
        _set_mix(side.scalar_mix_1, [-0.2, 0.9, 0.1], 0.8)
    _compare_elmo(f"Elmo[{model}] 2 reps layer_norm={do_layer_norm} keep_boundaries={keep_sentence_boundaries}",
                  ref, ours, _stateful_batches())


@pytest.mark.parametrize("params", [[-9e10, 1.0, -9e10], [0.1, 0.2, 0.3]])
def test_elmo_scalar_mix_parameters(params, model_files):
    opt, wts = model_files["tiny"]
    ref, ours = _pair(opt, wts, num_output_representations=2, scalar_mix_parameters=params)
    for side in (ref, ours):
        for mix in (side.scalar_mix_0, side.scalar_mix_1):
            assert not mix.gamma.requires_grad and float(mix.gamma) == 1.0
            assert not any(p.requires_grad for p in mix.scalar_parameters)
    _compare_elmo(f"Elmo[tiny] scalar_mix_parameters={params}", ref, ours, _stateful_batches())


def test_wrong_arguments_raise_allennlp_s_configuration_error(model_files):
    """Where AllenNLP raises ConfigurationError (ScalarMix's counts, Elmo given a module and files), ported
    ``except ConfigurationError`` code catches elmo_fast's error too; it is still a ValueError, and pickles (a
    worker process's error) as one."""
    import pickle

    from allennlp.common.checks import ConfigurationError
    from allennlp.modules import ScalarMix as AllenNLPScalarMix

    from elmo_fast import ScalarMix

    opt, wts = model_files["tiny"]
    cases = [(lambda M: M(3)([torch.zeros(2)] * 5), "ScalarMix has 3 weights but got 5 tensors"),
             (lambda M: M(3, initial_scalar_parameters=[0.0]), "initial_scalar_parameters has 1 values, expected 3"),
             (lambda M: Elmo(opt, wts, 1, module=ElmoBiLM(opt, wts), backend="reference"),
              "pass either module or options_file/weight_file, not both")]
    for make, message in cases:
        with pytest.raises(ConfigurationError):
            make(AllenNLPScalarMix)  # AllenNLP's own (the Elmo case does not use it)
        with pytest.raises(ConfigurationError) as caught:
            make(ScalarMix)
        assert isinstance(caught.value, ValueError) and str(caught.value) == message
        again = pickle.loads(pickle.dumps(caught.value))
        assert isinstance(again, ConfigurationError) and isinstance(again, ValueError) and str(again) == message


def test_elmo_4d_input(model_files):
    opt, wts = model_files["tiny"]
    ref, ours = _pair(opt, wts, num_output_representations=1)
    rng = random.Random(3)
    flat = [_sentence(rng, n) for n in (4, 0, 6, 2, 5, 1)] + [["日本語", "a" * 60]] + [_sentence(rng, 3)]
    ids = batch_to_ids(flat)  # (8, T, 50)
    four_d = [ids.view(2, 4, *ids.shape[1:]), ids[:6].view(3, 2, *ids.shape[1:])]
    with torch.no_grad():
        for x in four_d:
            r, o = ref(x), ours(x)
            assert o["mask"].shape == r["mask"].shape == x.shape[:-1]
            assert o["elmo_representations"][0].shape == r["elmo_representations"][0].shape
    _compare_elmo("Elmo[tiny] 4-D input", *_pair(opt, wts, num_output_representations=1), four_d)


def _cache_vocab(batches):
    vocab = ["@@PADDING@@", "@@UNKNOWN@@"]
    seen = set(vocab)
    for batch in batches:
        for sent in batch:
            for tok in sent:
                if tok not in seen:
                    seen.add(tok)
                    vocab.append(tok)
    return vocab


def _word_ids(batch, vocab):
    index = {w: i for i, w in enumerate(vocab)}
    T = max((len(s) for s in batch), default=0)
    out = torch.zeros(len(batch), T, dtype=torch.long)
    for k, sent in enumerate(batch):
        for t, tok in enumerate(sent):
            out[k, t] = index.get(tok, 1)
    return out


@pytest.mark.parametrize("model", ["tiny", "mid"])
def test_elmo_vocab_to_cache_word_inputs(model, model_files):
    opt, wts = model_files[model]
    batches = _stateful_batches()
    vocab = _cache_vocab(batches)
    ref, ours = _pair(opt, wts, num_output_representations=2, vocab_to_cache=vocab)
    for side in (ref, ours):
        _set_mix(side.scalar_mix_1, [0.5, -0.5, 0.25], 1.2)
    # the cached tables themselves
    rb, ob = ref._elmo_lstm, ours._elmo_lstm
    d_table = max(_maxdiff(ob._word_embedding if isinstance(ob._word_embedding, torch.Tensor)
                           else ob._word_embedding.weight, rb._word_embedding.weight),
                  _maxdiff(ob._bos_embedding, rb._bos_embedding), _maxdiff(ob._eos_embedding, rb._eos_embedding))
    assert d_table <= ATOL
    _report(f"vocab_to_cache[{model}] cached table + <S>/</S> vectors", d_table)
    words = [_word_ids(b, vocab) for b in batches]
    _compare_elmo(f"Elmo[{model}] vocab_to_cache + word_inputs", ref, ours, batches, words)


def test_elmo_vocab_to_cache_out_of_range_word_ids_fall_back_to_chars(model_files):
    opt, wts = model_files["tiny"]
    batches = _stateful_batches()
    vocab = _cache_vocab(batches[:2])
    ref, ours = _pair(opt, wts, num_output_representations=1, vocab_to_cache=vocab)
    words = [_word_ids(b, vocab) for b in batches[:2]]
    words[1][0, 0] = len(vocab) + 5  # outside the cache: both back off to the char CNN for the whole batch
    with pytest.warns(UserWarning):
        _compare_elmo("Elmo[tiny] vocab_to_cache, out-of-range word id", ref, ours, batches[:2], words)


def test_reset_states(model_files):
    opt, wts = model_files["tiny"]
    ref = allennlp_elmo._ElmoBiLm(opt, wts)
    ours = ElmoBiLM(opt, wts, backend="reference")
    batches = _stateful_batches()
    worst = 0.0

    def step(batch):
        nonlocal worst
        ids = batch_to_ids(batch)
        r, o = ref(ids), ours(ids)
        assert torch.equal(o["mask"], r["mask"])
        for a, b in zip(o["activations"], r["activations"]):
            worst = max(worst, _maxdiff(a, b))
        return o

    with torch.no_grad():
        for batch in batches[:4]:  # stored state now has 8 rows
            step(batch)
        # partial reset: AllenNLP needs a mask as long as the stored state
        mask = torch.tensor([True, False, True, False, False, True, False, True])
        ref._elmo_lstm.reset_states(mask)
        ours.reset_states(mask)
        step(batches[3])
        step(batches[1])
        # full reset: both must equal a fresh model
        ref._elmo_lstm.reset_states()
        ours.reset_states()
        o = step(batches[0])
        fresh = ElmoBiLM(opt, wts, backend="reference")(batch_to_ids(batches[0]))
        for a, b in zip(o["activations"], fresh["activations"]):
            assert torch.equal(a, b)
    assert worst <= ATOL
    _report("reset_states (partial mask, then full)", worst)


def test_all_empty_batch(model_files):
    """A batch whose sentences are all empty. Known divergence in ``batch_to_ids`` only: AllenNLP 2.10.1 returns
    a 2-D (n, 0) tensor (its padding loses the 50-id axis when no sentence has a token), which its own
    ``_ElmoBiLm``/``Elmo`` then reject with an IndexError; elmo_fast returns (n, 0, 50) as documented (spec
    §1.3). On that (n, 0, 50) input both models agree (<S> </S> only; empty representations)."""
    batch = [[], []]
    assert tuple(allennlp_elmo.batch_to_ids(batch).shape) == (2, 0)
    ids = batch_to_ids(batch)
    assert tuple(ids.shape) == (2, 0, 50)
    opt, wts = model_files["tiny"]
    ref = allennlp_elmo._ElmoBiLm(opt, wts)
    ours = ElmoBiLM(opt, wts, backend="reference")
    worst = 0.0
    with torch.no_grad():
        for _ in range(2):  # stateful: the second call starts from the state the first one left
            r, o = ref(ids), ours(ids)
            assert torch.equal(o["mask"], r["mask"])
            worst = max([worst] + [_maxdiff(a, b) for a, b in zip(o["activations"], r["activations"])])
    assert worst <= ATOL
    ref_e, ours_e = _pair(opt, wts, num_output_representations=1)
    with torch.no_grad():
        r, o = ref_e(ids), ours_e(ids)
    assert o["elmo_representations"][0].shape == r["elmo_representations"][0].shape == (2, 0, 32)
    assert o["mask"].shape == r["mask"].shape == (2, 0)
    _report("all-empty batch (n, 0, 50)", worst)


# ------------------------------------------------------------------ checkpoint exchange, both ways (issue 14)
FIXTURE = os.path.join(os.environ.get("ELMO_FAST_FIXTURES", "/work/fixtures"), "allennlp", "test_fixtures", "elmo")


def _exchange_files(model, model_files):
    if model != "fixture":
        return model_files[model]
    if not os.path.isdir(FIXTURE):
        pytest.skip(f"golden fixture {FIXTURE} not present")
    return os.path.join(FIXTURE, "options.json"), os.path.join(FIXTURE, "lm_weights.hdf5")


def _fine_tune(model, outputs, steps: int = 2, lr: float = 1e-2) -> None:
    """Adam steps on a random linear function of ``outputs(batch)`` (a list of tensors), over the stateful
    batches; every parameter tensor must change."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for batch in _stateful_batches()[:steps]:
        loss = sum((y * torch.randn(y.shape, generator=gen)).sum() for y in outputs(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert not unchanged, f"fine-tuning left {unchanged} unchanged"


def _through_file(state_dict, tmp_path):
    torch.save(state_dict, tmp_path / "checkpoint.th")
    return torch.load(tmp_path / "checkpoint.th")


def _reset(ref_elmo, ours_elmo):
    ref_elmo._elmo_lstm._elmo_lstm.reset_states()
    ours_elmo.reset_states()


ELMO_KW = dict(num_output_representations=2, requires_grad=True, do_layer_norm=True, dropout=0.0)
EXCHANGE_BATCHES = _stateful_batches()[:4]  # the state grows and shrinks; the other checks run all 7


@pytest.mark.parametrize("model", ["tiny", "variant", "fixture"])
def test_checkpoint_from_allennlp_after_fine_tuning(model, model_files, tmp_path):
    """A fine-tuned AllenNLP Elmo's state_dict (saved, reloaded) goes into elmo_fast's Elmo by plain
    load_state_dict (strict); outputs then agree over the stateful batches."""
    opt, wts = _exchange_files(model, model_files)
    ref = allennlp_elmo.Elmo(opt, wts, **ELMO_KW)
    _fine_tune(ref, lambda batch: ref(batch_to_ids(batch))["elmo_representations"])
    assert not any("_states" in k for k in ref.state_dict())  # AllenNLP keeps the LSTM state out of it
    ours = Elmo(opt, wts, backend="reference", **ELMO_KW)
    _reset(ref, ours)
    with torch.no_grad():
        ids = batch_to_ids(_stateful_batches()[0])
        assert _maxdiff(ref(ids)["elmo_representations"][0], ours(ids)["elmo_representations"][0]) > 1e-3
    result = ours.load_state_dict(_through_file(ref.state_dict(), tmp_path))
    assert not result.missing_keys and not result.unexpected_keys
    _reset(ref, ours)
    _compare_elmo(f"checkpoint AllenNLP -> elmo_fast [{model}] after fine-tuning", ref, ours, EXCHANGE_BATCHES)


@pytest.mark.parametrize("model", ["tiny", "variant"])
def test_checkpoint_to_allennlp_after_fine_tuning(model, model_files, tmp_path):
    """elmo_fast's fine-tuned Elmo, saved with allennlp_state_dict(), loads into AllenNLP's Elmo (strict)."""
    opt, wts = _exchange_files(model, model_files)
    ours = Elmo(opt, wts, backend="reference", **ELMO_KW)
    _fine_tune(ours, lambda batch: ours(batch_to_ids(batch))["elmo_representations"])
    ref = allennlp_elmo.Elmo(opt, wts, **ELMO_KW)
    ref.load_state_dict(_through_file(ours.allennlp_state_dict(), tmp_path))
    _reset(ref, ours)
    _compare_elmo(f"checkpoint elmo_fast -> AllenNLP [{model}] after fine-tuning", ref, ours, EXCHANGE_BATCHES)


def test_checkpoint_exchange_with_vocab_cache(model_files):
    """The vocab_to_cache table (AllenNLP's _word_embedding.weight) goes both ways; <S>/</S> cached vectors stay
    those computed at construction on both sides (AllenNLP does not save them)."""
    opt, wts = model_files["tiny"]
    batches = EXCHANGE_BATCHES
    vocab = _cache_vocab(batches)
    words = [_word_ids(b, vocab) for b in batches]
    kw = dict(num_output_representations=1, requires_grad=True, dropout=0.0, vocab_to_cache=vocab)
    ref = allennlp_elmo.Elmo(opt, wts, **kw)
    # both paths, so that the char CNN and the cached table are trained
    _fine_tune(ref, lambda batch: ref(batch_to_ids(batch))["elmo_representations"]
               + ref(batch_to_ids(batch), _word_ids(batch, vocab))["elmo_representations"])
    ours = Elmo(opt, wts, backend="reference", **kw)
    ours.load_state_dict(ref.state_dict())
    _reset(ref, ours)
    _compare_elmo("checkpoint AllenNLP -> elmo_fast with vocab_to_cache", ref, ours, batches, words)
    back = allennlp_elmo.Elmo(opt, wts, **kw)
    back.load_state_dict(ours.allennlp_state_dict())
    _reset(back, ours)
    _compare_elmo("checkpoint elmo_fast -> AllenNLP with vocab_to_cache", back, ours, batches, words)


class _Tagger(torch.nn.Module):
    """A user's model: a text-field embedder holding the ELMo token embedder (so its keys sit under
    ``embedder.token_embedder_elmo._elmo.``), then a linear head."""

    def __init__(self, embedder):
        super().__init__()
        self.embedder = embedder
        torch.manual_seed(5)
        self.head = torch.nn.Linear(embedder.get_output_dim(), 3)

    def forward(self, ids):
        return self.head(self.embedder({"elmo": {"elmo_tokens": ids}}))


def _tagger(embedder_type, opt, wts, **extra):
    from allennlp.common import Params
    from allennlp.modules.text_field_embedders import TextFieldEmbedder

    params = {"type": embedder_type, "options_file": opt, "weight_file": wts, "projection_dim": 7, "dropout": 0.0,
              "requires_grad": True, **extra}
    return _Tagger(TextFieldEmbedder.from_params(Params({"token_embedders": {"elmo": params}})))


def _compare_taggers(name, ref, ours):
    worst = 0.0
    ref.embedder.token_embedder_elmo._elmo._elmo_lstm._elmo_lstm.reset_states()
    ours.embedder.token_embedder_elmo._elmo.reset_states()
    with torch.no_grad():
        for batch in EXCHANGE_BATCHES:
            ids = batch_to_ids(batch)
            worst = max(worst, _maxdiff(ours(ids), ref(ids)))
    assert worst <= ATOL, f"{name}: {worst:.3e}"
    _report(name, worst)


def test_registered_token_embedder_from_params_and_nested_checkpoints(model_files, tmp_path):
    """AllenNLP configurations name "elmo_fast_token_embedder" (from_params through a real TextFieldEmbedder);
    a whole model's checkpoint with AllenNLP's ElmoTokenEmbedder (projection_dim, under a prefix) loads into
    the same model built with elmo_fast's, and back, after fine-tuning each side."""
    from allennlp.modules.token_embedders import TokenEmbedder

    from elmo_fast.compat import ElmoTokenEmbedder, register_allennlp, to_allennlp_state_dict

    cls = register_allennlp()
    assert register_allennlp() is cls and issubclass(cls, TokenEmbedder) and issubclass(cls, ElmoTokenEmbedder)
    opt, wts = model_files["tiny"]
    ref = _tagger("elmo_token_embedder", opt, wts)
    ours = _tagger("elmo_fast_token_embedder", opt, wts, backend="reference")
    assert type(ours.embedder.token_embedder_elmo) is cls
    _fine_tune(ref, lambda batch: [ref(batch_to_ids(batch))])
    ours.load_state_dict(_through_file(ref.state_dict(), tmp_path))
    _compare_taggers("nested checkpoint AllenNLP -> elmo_fast (token embedder, projection_dim=7)", ref, ours)
    _fine_tune(ours, lambda batch: [ours(batch_to_ids(batch))])
    back = _tagger("elmo_token_embedder", opt, wts)
    back.load_state_dict(_through_file(to_allennlp_state_dict(ours), tmp_path))
    _compare_taggers("nested checkpoint elmo_fast -> AllenNLP (token embedder, projection_dim=7)", back, ours)


def test_registration_runs_at_import_when_allennlp_is_loaded_first():
    code = ("from allennlp.common.util import import_module_and_submodules as include; "
            "include('elmo_fast.compat'); "  # what `allennlp train --include-package elmo_fast.compat` does
            "from allennlp.modules.token_embedders import TokenEmbedder as T; "
            "print(T.by_name('elmo_fast_token_embedder').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "AllenNLPElmoTokenEmbedder"


def test_word_inputs_without_cache_are_ignored_like_allennlp(model_files):
    opt, wts = model_files["tiny"]
    ref, ours = _pair(opt, wts, num_output_representations=1)
    batches = _stateful_batches()[:3]
    junk = [torch.zeros(len(b), 3, dtype=torch.long) for b in batches]  # any shape: neither side looks at them
    with pytest.warns(UserWarning, match="no vocab_to_cache: ignored"):
        _compare_elmo("Elmo word_inputs without vocab_to_cache (ignored)", ref, ours, batches, junk)
