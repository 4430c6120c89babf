"""AllenNLP state_dict exchange without allennlp installed: AllenNLP's layout is built here independently from the
hdf5 arrays by the spec's tables (§2.3, §3.3), and elmo_fast must write exactly it and load it back. The exchange
with the real AllenNLP 2.10.1 is in test_allennlp_parity.py."""
from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest
import torch
import torch.nn as nn

import elmo_fast
from elmo_fast import compat
from elmo_fast.allennlp_compat import AllenNLPStateDictError, to_allennlp_state_dict
from elmo_fast.testing import TINY_OPTIONS, write_random_model

SENTS = [["The", "first", "sentence", "."], ["The", "second"], ["Third"], []]
FIXTURE = os.path.join(os.environ.get("ELMO_FAST_FIXTURES", "/work/fixtures"), "allennlp", "test_fixtures", "elmo")
needs_fixture = pytest.mark.skipif(not os.path.isdir(FIXTURE), reason=f"golden fixture {FIXTURE} not present")


def allennlp_layout(options_file, weight_file) -> dict[str, torch.Tensor]:
    """AllenNLP ``_ElmoBiLm``'s state_dict (under ``_elmo_lstm.``) from the hdf5 arrays, by the spec's tables."""
    opts = json.load(open(options_file))
    P, H = opts["lstm"]["projection_dim"], opts["lstm"]["dim"]
    sd = {}
    with h5py.File(weight_file, "r") as f:
        a = {name: f[name][...] for name in _datasets(f)}
    te = "_elmo_lstm._token_embedder."
    sd[te + "_char_embedding_weights"] = np.concatenate([np.zeros((1, a["char_embed"].shape[1]), np.float32),
                                                         a["char_embed"]])
    for i in range(len(opts["char_cnn"]["filters"])):
        sd[te + f"char_conv_{i}.weight"] = a[f"CNN/W_cnn_{i}"][0].transpose(2, 1, 0)
        sd[te + f"char_conv_{i}.bias"] = a[f"CNN/b_cnn_{i}"]
    for k in range(opts["char_cnn"]["n_highway"]):
        g = f"CNN_high_{k}/"
        sd[te + f"_highways._layers.{k}.weight"] = np.concatenate([a[g + "W_transform"].T, -a[g + "W_carry"].T])
        sd[te + f"_highways._layers.{k}.bias"] = np.concatenate([a[g + "b_transform"], -a[g + "b_carry"]])
    sd[te + "_projection.weight"] = a["CNN_proj/W_proj"].T
    sd[te + "_projection.bias"] = a["CNN_proj/b_proj"]

    def ifjo(x):  # TF gate blocks i|j|f|o -> i|f|j|o
        i, j, f_, o = np.split(x, 4)
        return np.concatenate([i, f_, j, o])

    for d, direction in enumerate(("forward", "backward")):
        for layer in range(opts["lstm"]["n_layers"]):
            cell = f"RNN_{d}/RNN/MultiRNNCell/Cell{layer}/LSTMCell/"
            pre = f"_elmo_lstm._elmo_lstm.{direction}_layer_{layer}."
            wt = a[cell + "W_0"].T
            b = a[cell + "B"].copy()
            b[2 * H : 3 * H] += np.float32(1.0)
            sd[pre + "input_linearity.weight"] = ifjo(wt[:, :P])
            sd[pre + "state_linearity.weight"] = ifjo(wt[:, P:])
            sd[pre + "state_linearity.bias"] = ifjo(b)
            sd[pre + "state_projection.weight"] = a[cell + "W_P_0"].T
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in sd.items()}


def _datasets(f):
    names = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


def _scalar_mix_state(elmo):
    return {k: v for k, v in elmo.state_dict().items() if k.startswith("scalar_mix_")}


@pytest.fixture
def two_models(tmp_path):
    return write_random_model(tmp_path / "a", TINY_OPTIONS, seed=1), write_random_model(tmp_path / "b", TINY_OPTIONS,
                                                                                          seed=2)


def _outputs(model, batches):
    model.reset_states()
    with torch.no_grad():
        return [model(elmo_fast.batch_to_ids(b))["elmo_representations"] for b in batches]


def _assert_same_outputs(a, b, batches, atol=0.0):
    for ra, rb in zip(_outputs(a, batches), _outputs(b, batches)):
        for x, y in zip(ra, rb):
            torch.testing.assert_close(x, y, atol=atol, rtol=0)


def _model_sources(tmp_path, which):
    if which == "fixture":
        if not os.path.isdir(FIXTURE):
            pytest.skip(f"golden fixture {FIXTURE} not present")
        return os.path.join(FIXTURE, "options.json"), os.path.join(FIXTURE, "lm_weights.hdf5")
    return write_random_model(tmp_path / "m", TINY_OPTIONS, seed=3)


@pytest.mark.parametrize("which", ["random", "fixture"])
def test_export_equals_allennlp_layout_from_the_spec(which, tmp_path):
    o, w = _model_sources(tmp_path, which)
    elmo = elmo_fast.Elmo(o, w, 2)
    expected = allennlp_layout(o, w) | _scalar_mix_state(elmo)
    got = elmo.allennlp_state_dict()
    assert list(got) == [k for k in got if k in expected] and set(got) == set(expected)
    for k, v in expected.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k


@pytest.mark.parametrize("which", ["random", "fixture"])
def test_load_allennlp_layout_from_the_spec(which, tmp_path):
    """AllenNLP's layout loads into a model with other weights through plain ``load_state_dict``; the weights then
    equal the file's (the LSTM bias to one float32 rounding: AllenNLP stores B + 1) and so do the outputs."""
    o, w = _model_sources(tmp_path, which)
    original = elmo_fast.Elmo(o, w, 2, dropout=0.0)
    other = elmo_fast.Elmo(*write_random_model(tmp_path / "other", json.load(open(o)), seed=9), 2, dropout=0.0)
    sd = allennlp_layout(o, w) | _scalar_mix_state(original)
    assert not other.load_state_dict(sd).missing_keys
    ref, got = original._elmo_lstm._bilm.state_arrays(), other._elmo_lstm._bilm.state_arrays()
    for name, a in ref.items():
        np.testing.assert_allclose(got[name], a, rtol=0, atol=1.2e-7 if name.endswith("/B") else 0, err_msg=name)
    _assert_same_outputs(original, other, [SENTS, SENTS[:2], [["x"] * 7]], atol=1e-6)


@needs_fixture
def test_exchanged_fixture_model_reproduces_golden_outputs(tmp_path):
    """The AllenNLP fixture model, moved through AllenNLP's layout into a random-weight model, still gives the
    golden TF outputs (10 stateful batches of 3 sentences, top layer)."""
    o, w = os.path.join(FIXTURE, "options.json"), os.path.join(FIXTURE, "lm_weights.hdf5")
    bilm = elmo_fast.ElmoBiLM(*write_random_model(tmp_path / "r", json.load(open(o)), seed=5))
    bilm.load_state_dict({k[len("_elmo_lstm."):]: v for k, v in allennlp_layout(o, w).items()})
    sentences = json.load(open(os.path.join(FIXTURE, "sentences.json")))
    golden = []
    for k in range(3):
        with h5py.File(os.path.join(FIXTURE, f"lm_embeddings_{k}.hdf5"), "r") as f:
            golden.append([np.concatenate([f[str(i)][0], f[str(i)][1]], -1) for i in range(10)])
    worst = 0.0
    with torch.no_grad():
        for i in range(10):
            batch = [sentences[k][i].split() for k in range(3)]
            out = bilm(elmo_fast.batch_to_ids(batch))
            top, mask = elmo_fast.remove_sentence_boundaries(out["activations"][2], out["mask"])
            for k in range(3):
                n = len(batch[k])
                assert int(mask[k].sum()) == n == golden[k][i].shape[0]
                worst = max(worst, float(np.abs(top[k, :n].numpy() - golden[k][i]).max()))
    assert worst <= 1e-5, worst


def test_own_layout_round_trip_and_unchanged_own_state_dict(two_models):
    (o1, w1), (o2, w2) = two_models
    a, b = elmo_fast.Elmo(o1, w1, 1, dropout=0.0), elmo_fast.Elmo(o2, w2, 1, dropout=0.0)
    own = a.state_dict()
    assert all(k.startswith(("_elmo_lstm._bilm.", "scalar_mix_")) for k in own)  # the hook adds nothing
    b.load_state_dict(a.allennlp_state_dict())
    _assert_same_outputs(a, b, [SENTS])
    c = elmo_fast.Elmo(o2, w2, 1, dropout=0.0)
    c.load_state_dict(own)  # elmo_fast's own layout passes the hook untouched
    for k, v in c.state_dict().items():
        assert torch.equal(v, own[k]), k


class Tagger(nn.Module):
    """A user's model: an ElmoTokenEmbedder (with projection) nested under a prefix, plus a head."""

    def __init__(self, o, w):
        super().__init__()
        self.encoder = nn.ModuleDict({"elmo": compat.ElmoTokenEmbedder(o, w, projection_dim=5, dropout=0.0)})
        self.head = nn.Linear(5, 3)

    def forward(self, ids):
        return self.head(self.encoder["elmo"](ids))


def test_nested_model_with_projection_exchanges_under_its_prefix(two_models):
    (o1, w1), (o2, w2) = two_models
    a, b = Tagger(o1, w1), Tagger(o2, w2)
    sd = to_allennlp_state_dict(a)
    pre = "encoder.elmo._elmo._elmo_lstm."
    assert pre + "_token_embedder._highways._layers.1.weight" in sd and pre + "_elmo_lstm.backward_layer_1." \
        "state_projection.weight" in sd and "encoder.elmo._projection.weight" in sd and "head.bias" in sd
    assert not any("_bilm" in k for k in sd)
    b.load_state_dict(sd)
    ids = elmo_fast.batch_to_ids(SENTS)
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_vocab_cache_table_is_exchanged(two_models):
    (o1, w1), (o2, w2) = two_models
    vocab = ["@@PADDING@@", "The", "first", "sentence", ".", "second", "Third"]
    a = elmo_fast.Elmo(o1, w1, 1, vocab_to_cache=vocab)
    b = elmo_fast.Elmo(o2, w2, 1, vocab_to_cache=vocab)
    sd = a.allennlp_state_dict()
    assert torch.equal(sd["_elmo_lstm._word_embedding.weight"], a._elmo_lstm._word_embedding)
    b.load_state_dict(sd)
    assert torch.equal(b._elmo_lstm._word_embedding, a._elmo_lstm._word_embedding)
    plain = elmo_fast.Elmo(o2, w2, 1)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\).*"_elmo_lstm._word_embedding.weight"'):
        plain.load_state_dict(sd)


def test_missing_key_named_and_rest_loaded(two_models):
    (o1, w1), (o2, w2) = two_models
    a, b = elmo_fast.Elmo(o1, w1, 1), elmo_fast.Elmo(o2, w2, 1)
    sd = a.allennlp_state_dict()
    gone = "_elmo_lstm._elmo_lstm.forward_layer_0.state_linearity.weight"
    del sd[gone]
    with pytest.raises(RuntimeError, match=f'Missing key.*"{gone}"'):
        elmo_fast.Elmo(o2, w2, 1).load_state_dict(sd)
    w0_before = b._elmo_lstm._bilm.forward_lstm.W_0[0].detach().clone()
    result = b.load_state_dict(sd, strict=False)
    assert result.missing_keys == [gone] and not result.unexpected_keys
    w0, w0_a = b._elmo_lstm._bilm.forward_lstm.W_0[0], a._elmo_lstm._bilm.forward_lstm.W_0[0]
    P = w0.shape[0] // 2
    assert torch.equal(w0[:P], w0_a[:P])  # the input half came from the checkpoint
    assert torch.equal(w0[P:], w0_before[P:])  # the absent recurrent half stayed as it was
    torch.testing.assert_close(b._elmo_lstm._bilm.forward_lstm.B[0], a._elmo_lstm._bilm.forward_lstm.B[0],
                               atol=1.2e-7, rtol=0)  # one float32 rounding: AllenNLP stores B + 1 on the f block


def test_unmapped_key_is_named(two_models):
    (o1, w1), _ = two_models
    a = elmo_fast.Elmo(o1, w1, 1)
    sd = a.allennlp_state_dict()
    extra = "_elmo_lstm._elmo_lstm.forward_layer_2.input_linearity.weight"  # the model has 2 layers
    sd[extra] = torch.zeros(256, 16)
    with pytest.raises(RuntimeError, match=f'Unexpected key.*"{extra}"'):
        a.load_state_dict(sd)
    assert a.load_state_dict(sd, strict=False).unexpected_keys == [extra]


def test_shape_mismatch_names_the_allennlp_key(two_models):
    (o1, w1), _ = two_models
    a = elmo_fast.Elmo(o1, w1, 1)
    sd = a.allennlp_state_dict()
    key = "_elmo_lstm._token_embedder._highways._layers.0.weight"
    sd[key] = sd[key][:10]
    with pytest.raises(RuntimeError, match=rf"size mismatch for {key}: the AllenNLP checkpoint has shape "
                                           r"\(10, 124\), this model needs \(248, 124\)") as err:
        a.load_state_dict(sd, strict=False)
    assert str(err.value).count("size mismatch") == 1  # reported once, under the checkpoint's name


def test_nonzero_padding_row_and_mixed_layouts_are_errors(two_models):
    (o1, w1), _ = two_models
    a = elmo_fast.Elmo(o1, w1, 1)
    sd = a.allennlp_state_dict()
    key = "_elmo_lstm._token_embedder._char_embedding_weights"
    sd[key] = sd[key].clone()
    sd[key][0, 1] = 0.5
    with pytest.raises(RuntimeError, match=f"{key}: row 0 .* must be all zeros"):
        a.load_state_dict(sd)
    mixed = a.allennlp_state_dict() | {"_elmo_lstm._bilm.token_encoder.b_proj": torch.zeros(16)}
    with pytest.raises(RuntimeError, match="mixes AllenNLP keys and elmo_fast keys under '_elmo_lstm.'"):
        a.load_state_dict(mixed)


def test_allennlp_lstm_states_are_ignored(two_models):
    """AllenNLP keeps ``_states`` out of its state_dict; should a checkpoint hold it, it is dropped and the model
    starts from zero state, like a freshly built AllenNLP model."""
    (o1, w1), (o2, w2) = two_models
    a, b = elmo_fast.Elmo(o1, w1, 1, dropout=0.0), elmo_fast.Elmo(o2, w2, 1, dropout=0.0)
    sd = a.allennlp_state_dict()
    sd["_elmo_lstm._elmo_lstm._states.0"] = torch.ones(2, 4, 32)
    sd["_elmo_lstm._elmo_lstm._states.1"] = torch.ones(2, 4, 128)
    assert b.load_state_dict(sd) is not None
    ids = elmo_fast.batch_to_ids(SENTS)
    with torch.no_grad():  # no reset_states() first: b must start from zero state, as the fresh a does
        for x, y in zip(a(ids)["elmo_representations"], b(ids)["elmo_representations"]):
            torch.testing.assert_close(y, x, atol=0.0, rtol=0)


def test_float64_model_loads_float32_checkpoint(two_models):
    (o1, w1), (o2, w2) = two_models
    a = elmo_fast.Elmo(o1, w1, 1, dropout=0.0)
    b = elmo_fast.Elmo(o2, w2, 1, dropout=0.0).double()
    b.load_state_dict(a.allennlp_state_dict())
    assert b._elmo_lstm._bilm.forward_lstm.W_0[0].dtype == torch.float64
    ids = elmo_fast.batch_to_ids(SENTS)
    with torch.no_grad():
        torch.testing.assert_close(b(ids)["elmo_representations"][0].float(), a(ids)["elmo_representations"][0],
                                   atol=1e-5, rtol=0)


def test_character_encoder_exchange(two_models):
    (o1, w1), (o2, w2) = two_models
    a, b = compat._ElmoCharacterEncoder(o1, w1), compat._ElmoCharacterEncoder(o2, w2)
    sd = to_allennlp_state_dict(a)
    assert set(sd) == {k[len("_elmo_lstm._token_embedder."):] for k in allennlp_layout(o1, w1)
                       if k.startswith("_elmo_lstm._token_embedder.")}
    b.load_state_dict(sd)
    ids = elmo_fast.batch_to_ids(SENTS)
    with torch.no_grad():
        assert torch.equal(a(ids)["token_embedding"], b(ids)["token_embedding"])


@pytest.mark.parametrize("lstm, message", [({"projection_dim": 124, "dim": 256}, "projection CNN_proj"),
                                           ({"projection_dim": 16, "dim": 16}, "projection W_P_0")])
def test_export_refuses_a_model_allennlp_cannot_hold(lstm, message, tmp_path):
    """bilm-tf writes no CNN_proj when the CNN width equals projection_dim, no W_P_0 when dim equals it."""
    opts = json.loads(json.dumps(TINY_OPTIONS))
    opts["lstm"].update(lstm)
    elmo = elmo_fast.Elmo(*write_random_model(tmp_path, opts), 1)
    with pytest.raises(AllenNLPStateDictError, match=f"always has the {message}; this model has none"):
        elmo.allennlp_state_dict()


def test_word_inputs_ignored_without_cache(tiny_model):
    """AllenNLP's Elmo drops word_inputs when it has no vocab_to_cache (whatever their shape)."""
    o, w = tiny_model
    ids = elmo_fast.batch_to_ids(SENTS)
    a, b = elmo_fast.Elmo(o, w, 1, dropout=0.0), elmo_fast.Elmo(o, w, 1, dropout=0.0)
    with pytest.warns(UserWarning, match="no vocab_to_cache: ignored"):
        got = a(ids, torch.zeros(7, 2, dtype=torch.long))["elmo_representations"][0]
    assert torch.equal(got, b(ids)["elmo_representations"][0])
    bilm_a, bilm_b = elmo_fast.ElmoBiLM(o, w), elmo_fast.ElmoBiLM(o, w)
    with pytest.warns(UserWarning, match="no vocab_to_cache: ignored"):
        got = bilm_a(ids, torch.full((4, 4), 0.5))["activations"][2]
    assert torch.equal(got, bilm_b(ids)["activations"][2])


def test_register_allennlp_needs_allennlp():
    try:
        import allennlp  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"register_allennlp\(\) needs allennlp importable"):
            compat.register_allennlp()
    else:
        pytest.skip("allennlp is importable here; the registration is tested in test_allennlp_parity.py")
