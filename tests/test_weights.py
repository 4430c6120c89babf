"""The published hdf5 layout: bit-exact round trip and clear errors for bad files."""
import copy
import json

import h5py
import numpy as np
import pytest
import torch

import elmo_fast
from elmo_fast.testing import TINY_OPTIONS, write_random_model
from elmo_fast.weights import WeightFileError


def _datasets(path):
    out = {}
    with h5py.File(path, "r") as fh:
        fh.visititems(lambda n, o: out.__setitem__(n, o[...]) if isinstance(o, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("variant", ["residual", "no_residual", "no_projections"])
def test_round_trip_bit_exact(tmp_path, variant):
    opts = copy.deepcopy(TINY_OPTIONS)
    if variant == "no_residual":
        opts["lstm"]["use_skip_connections"] = False
    if variant == "no_projections":  # F == P: no CNN_proj; P == H: no W_P_0 (bilm-tf rules)
        opts["char_cnn"]["filters"] = [[1, 8], [2, 8]]
        opts["char_cnn"]["n_highway"] = 1
        opts["lstm"]["projection_dim"] = 16
        opts["lstm"]["dim"] = 16
    o, w = write_random_model(tmp_path / "in", opts, seed=7)
    model = elmo_fast.BiLM.from_files(o, w)
    out_w, out_o = tmp_path / "out.hdf5", tmp_path / "out.json"
    model.save_weights(out_w, out_o)
    a, b = _datasets(w), _datasets(out_w)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == np.float32
        assert a[name].tobytes() == b[name].tobytes(), name
    if variant == "no_projections":
        assert "CNN_proj/W_proj" not in b and not any(k.endswith("W_P_0") for k in b)
    saved = json.loads(out_o.read_text())
    assert saved["char_cnn"]["n_characters"] == 262
    again = elmo_fast.BiLM.from_files(out_o, out_w)
    ids = elmo_fast.Batcher().batch_sentences([["round", "trip"]])
    torch.testing.assert_close(again(ids)["activations"][2], model(ids)["activations"][2], rtol=0, atol=0)


def _corrupt(src, dst, name, new=None):
    with h5py.File(src, "r") as fi, h5py.File(dst, "w") as fo:
        def copy_(n, o):
            if isinstance(o, h5py.Dataset) and n != name:
                fo.create_dataset(n, data=o[...])
        fi.visititems(copy_)
        if new is not None:
            fo.create_dataset(name, data=new)


def test_missing_dataset_named(tmp_path):
    o, w = write_random_model(tmp_path)
    bad = tmp_path / "bad.hdf5"
    name = "RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_0"
    _corrupt(w, bad, name)
    with pytest.raises(WeightFileError, match=r"RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_0.*missing.*\(32, 256\)"):
        elmo_fast.ElmoBiLM(o, bad)


def test_misshapen_dataset_named(tmp_path):
    o, w = write_random_model(tmp_path)
    bad = tmp_path / "bad.hdf5"
    _corrupt(w, bad, "CNN/W_cnn_2", np.zeros((1, 3, 4, 15), np.float32))
    with pytest.raises(WeightFileError, match=r"CNN/W_cnn_2.*\(1, 3, 4, 15\).*expected \(1, 3, 4, 16\)"):
        elmo_fast.ElmoBiLM(o, bad)


def test_options_that_do_not_match_weights(tmp_path):
    o, w = write_random_model(tmp_path)
    opts = copy.deepcopy(TINY_OPTIONS)
    opts["lstm"]["dim"] = 128
    o2 = tmp_path / "o2.json"
    o2.write_text(json.dumps(opts))
    with pytest.raises(WeightFileError, match=r"W_0.*has shape \(32, 256\), expected \(32, 512\)"):
        elmo_fast.ElmoBiLM(o2, w)


@pytest.mark.parametrize("mutate, msg", [
    (lambda d: d["lstm"].pop("dim"), "lstm.dim is missing"),
    (lambda d: d["char_cnn"].__setitem__("activation", "gelu"), "activation must be 'relu' or 'tanh'"),
    (lambda d: d["lstm"].__setitem__("projection_dim", 1000), "exceeds lstm.dim"),
    (lambda d: d["char_cnn"].__setitem__("filters", [[60, 2]]), "wider than max_characters_per_token"),
])
def test_bad_options(tmp_path, mutate, msg):
    o, w = write_random_model(tmp_path)
    d = copy.deepcopy(TINY_OPTIONS)
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(elmo_fast.OptionsError, match=msg):
        elmo_fast.ElmoBiLM(p, w)


def test_missing_and_unreadable_files(tmp_path):
    o, w = write_random_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="weight file not found"):
        elmo_fast.ElmoBiLM(o, tmp_path / "nope.hdf5")
    junk = tmp_path / "junk.hdf5"
    junk.write_bytes(b"not hdf5")
    with pytest.raises(WeightFileError, match="not a readable hdf5"):
        elmo_fast.ElmoBiLM(o, junk)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(elmo_fast.OptionsError, match="not valid JSON"):
        elmo_fast.ElmoBiLM(bad_json, w)
