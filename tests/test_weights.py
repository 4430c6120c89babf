"""The published hdf5 layout: bit-exact round trip and clear errors for bad files."""
import copy
import json
import re

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


@pytest.mark.parametrize("residual", [True, False])
def test_save_weights_writes_the_options_and_the_residual_flag(tmp_path, residual):
    from elmo_fast.options import ElmoOptions
    from elmo_fast.weights import RESIDUAL_ATTR

    opts = copy.deepcopy(TINY_OPTIONS)
    opts["lstm"]["use_skip_connections"] = residual
    opts["char_cnn"]["n_characters"] = 261  # training options; the inference file says 262 (spec §7.1)
    o, w = write_random_model(tmp_path / "in", opts, seed=3)
    model = elmo_fast.BiLM.from_files(o, w, backend="reference")
    out_w, out_o = tmp_path / "out.hdf5", tmp_path / "out.json"
    model.save_weights(out_w, out_o)
    with h5py.File(out_w, "r") as fh:
        assert fh.attrs[RESIDUAL_ATTR] == residual
    c = model.options.char_cnn
    expected = ElmoOptions(lstm=model.options.lstm, char_cnn=type(c)(**{**c.__dict__, "n_characters": 262}))
    assert ElmoOptions.load(out_o) == expected
    again = elmo_fast.BiLM.from_files(out_o, out_w, backend="reference")
    ids = elmo_fast.Batcher().batch_sentences([["save", "and", "load"], ["again"]])
    for a, b in zip(again(ids)["activations"], model(ids)["activations"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    flipped = {**opts, "lstm": {**opts["lstm"], "use_skip_connections": not residual}}
    (tmp_path / "flipped.json").write_text(json.dumps(flipped))
    with pytest.raises(WeightFileError, match="residual connections but the options say"):
        elmo_fast.BiLM.from_files(tmp_path / "flipped.json", out_w)


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


# ------------------------------------------------------------------------------------- atomic writing
def _write_partial(path, fail: bool):
    from elmo_fast.weights import atomic_h5

    with atomic_h5(path) as fh:
        fh.create_dataset("new", data=np.ones(3, np.float32))
        if fail:
            raise RuntimeError("disk died mid-write")


@pytest.mark.parametrize("old", [True, False], ids=["old file", "no old file"])
def test_atomic_writer_failing_mid_write_keeps_the_old_file(tmp_path, old):
    path = tmp_path / "out.hdf5"
    if old:
        with h5py.File(path, "w") as fh:
            fh.create_dataset("old", data=np.zeros(2, np.float32))
    with pytest.raises(RuntimeError, match="mid-write"):
        _write_partial(path, fail=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out.hdf5"] if old else [])  # no temporary file
    if old:
        assert list(_datasets(path)) == ["old"]
    _write_partial(path, fail=False)
    assert list(_datasets(path)) == ["new"] and [p.name for p in tmp_path.iterdir()] == ["out.hdf5"]


def test_embed_failing_mid_run_keeps_the_old_output(tiny_model, tmp_path, monkeypatch):
    from elmo_fast.cli import main
    from elmo_fast.models.elmo import ElmoBiLM

    o, w = tiny_model
    inp = tmp_path / "s.txt"
    inp.write_text("a b\nc d\ne\n")
    out = tmp_path / "out.hdf5"
    with h5py.File(out, "w") as fh:
        fh.create_dataset("old", data=np.zeros(2, np.float32))
    calls = []
    forward = ElmoBiLM.forward

    def failing(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the device fell over")
        return forward(self, *a, **k)

    monkeypatch.setattr(ElmoBiLM, "forward", failing)
    with pytest.raises(RuntimeError, match="fell over"):
        main(["embed", "--options", o, "--weights", w, "--input", str(inp), "--output", str(out), "--batch-size",
              "1", "--quiet", "--device", "cpu"])
    assert len(calls) == 2  # it failed after the first sentence had been written to the temporary file
    assert list(_datasets(out)) == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.hdf5", "s.txt", "tiny"]


# ------------------------------------------------------------------------------------- residual connections
def test_written_weights_record_residual_and_reading_checks_it(tmp_path):
    from elmo_fast.options import ElmoOptions
    from elmo_fast.testing import random_arrays
    from elmo_fast.weights import read_weights, write_weights

    res = ElmoOptions.from_dict(TINY_OPTIONS)
    plain = ElmoOptions.from_dict({**TINY_OPTIONS, "lstm": {**TINY_OPTIONS["lstm"], "use_skip_connections": False}})
    write_weights(tmp_path / "w.hdf5", random_arrays(TINY_OPTIONS), res)
    read_weights(tmp_path / "w.hdf5", res)
    with pytest.raises(WeightFileError, match="with residual connections but the options say"):
        read_weights(tmp_path / "w.hdf5", plain)
    write_weights(tmp_path / "published.hdf5", random_arrays(TINY_OPTIONS))  # no flag: the file cannot tell
    read_weights(tmp_path / "published.hdf5", plain)


def test_options_without_the_residual_key_warn():
    from elmo_fast.options import ElmoOptions

    lstm = {k: v for k, v in TINY_OPTIONS["lstm"].items() if k != "use_skip_connections"}
    with pytest.warns(UserWarning, match="use_skip_connections is missing"):
        opts = ElmoOptions.from_dict({**TINY_OPTIONS, "lstm": lstm})
    assert opts.lstm.use_skip_connections is False


def test_word_input_weights_round_trip_and_name_a_missing_table(tmp_path):
    """bilm-tf's other kind of biLM, options without char_cnn: an 'embedding' (vocabulary, P) dataset in place of the
    CNN, read back by from_files (which sizes the table from it); TokenBatcher ids index it + 1 (0: padding, a zero
    vector); a file without the table, or ids past it, are named."""
    from elmo_fast import BiLM, ElmoOptions

    opts = {k: v for k, v in TINY_OPTIONS.items() if k != "char_cnn"}
    torch.manual_seed(0)
    model = BiLM(ElmoOptions.from_dict(opts), backend="reference", n_tokens_vocab=9)
    w, o = tmp_path / "w.hdf5", tmp_path / "o.json"
    model.save_weights(w, o)
    back = BiLM.from_files(o, w, backend="reference")
    assert torch.equal(back.word_embedding, model.word_embedding) and back.token_encoder is None
    ids = torch.tensor([[1, 5, 9, 0]])
    out = back(ids)
    assert torch.equal(out["mask"], ids > 0) and torch.equal(out["token_embedding"][0, 3], torch.zeros(16))
    torch.testing.assert_close(out["token_embedding"][0, 1], model.word_embedding[4].detach())
    with pytest.raises(ValueError, match=r"TokenBatcher ids in \[0, 9\]"):
        back(torch.tensor([[1, 10]]))
    with h5py.File(w, "a") as fh:
        del fh["embedding"]
    with pytest.raises(WeightFileError, match=r"an 'embedding' dataset of shape \(vocabulary, 16\); it is missing"):
        BiLM.from_files(o, w)


# ------------------------------------------------------------------------------------- what the reader refuses
def _options_file(tmp_path, mutate, name="o.json"):
    d = copy.deepcopy(TINY_OPTIONS)
    mutate(d)
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize("mutate, msg", [
    (lambda d: d["char_cnn"].__setitem__("n_highway", 1),
     r"'CNN_high_1/W_carry', 'CNN_high_1/W_transform', 'CNN_high_1/b_carry', 'CNN_high_1/b_transform' "
     r"\(char_cnn.n_highway is 1: CNN_high_0 only\)"),
    (lambda d: d["char_cnn"].__setitem__("n_highway", 0),
     r"'CNN_high_0/W_carry'.*and 2 more \(char_cnn.n_highway is 0: no highway layers\)"),
    (lambda d: d["lstm"].__setitem__("n_layers", 1),
     r"'RNN_0/RNN/MultiRNNCell/Cell1/LSTMCell/B'.*'RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0' "
     r"\(lstm.n_layers is 1: MultiRNNCell/Cell0 only\)"),
    (lambda d: d["char_cnn"].__setitem__("filters", [[1, 4], [2, 8], [3, 16], [4, 32]]),
     r"'CNN/W_cnn_4', 'CNN/b_cnn_4' \(char_cnn.filters has 4 entries: CNN/W_cnn_0 .. CNN/W_cnn_3 and "),
    (lambda d: d.pop("char_cnn"), r"'CNN/W_cnn_0'.*\(the options have no char_cnn \(a word-input biLM\)"),
], ids=["n_highway 1", "n_highway 0", "n_layers 1", "4 filters", "no char_cnn"])
def test_options_describing_less_than_the_file_are_refused(tmp_path, mutate, msg):
    """Reading only the datasets the options name would run a smaller model silently: the file's datasets of the
    layout's families that the options leave out are named, with the option. Other datasets (bilm-tf's softmax, an
    'embedding' table) are left alone."""
    o, w = write_random_model(tmp_path / "m")
    with h5py.File(w, "a") as fh:  # what bilm-tf's dump_weights also writes; a word-input model's table
        fh.create_dataset("softmax/W", data=np.zeros((9, 16), np.float32))
        fh.create_dataset("softmax/b", data=np.zeros(9, np.float32))
        fh.create_dataset("embedding", data=np.zeros((9, 16), np.float32))
    elmo_fast.BiLM.from_files(o, w, backend="reference")
    with pytest.raises(WeightFileError, match=rf"{re.escape(w)} holds datasets the options do not account for: {msg}"):
        elmo_fast.BiLM.from_files(_options_file(tmp_path, mutate), w, backend="reference")


@pytest.mark.parametrize("dtype", ["int32", "bool", "complex64", "strings"])
def test_non_float_datasets_are_refused(tmp_path, dtype):
    from elmo_fast.options import ElmoOptions
    from elmo_fast.weights import read_weights

    o, w = write_random_model(tmp_path)
    opts = ElmoOptions.load(o)
    name = "CNN_high_0/b_carry"
    for ok in (np.float16, np.float64):  # converted to float32
        _corrupt(w, tmp_path / "ok.hdf5", name, np.full(124, 0.5, ok))
        assert read_weights(tmp_path / "ok.hdf5", opts)[name].dtype == np.float32
    new = (np.array(["1.0"] * 124, dtype=h5py.string_dtype()) if dtype == "strings"
           else np.ones(124, dtype=np.dtype(dtype)))
    bad = tmp_path / "bad.hdf5"
    _corrupt(w, bad, name, new)
    found = r"object \(strings\)" if dtype == "strings" else dtype
    msg = rf"{re.escape(str(bad))}: dataset '{name}' has dtype {found}, expected floating point"
    with pytest.raises(WeightFileError, match=msg):
        read_weights(bad, opts)


def test_a_non_float_word_embedding_is_refused(tmp_path):
    from elmo_fast import BiLM, ElmoOptions

    opts = {k: v for k, v in TINY_OPTIONS.items() if k != "char_cnn"}
    w, o = tmp_path / "w.hdf5", tmp_path / "o.json"
    BiLM(ElmoOptions.from_dict(opts), backend="reference", n_tokens_vocab=9).save_weights(w, o)
    with h5py.File(w, "a") as fh:
        del fh["embedding"]
        fh.create_dataset("embedding", data=np.ones((9, 16), np.int64))
    with pytest.raises(WeightFileError, match=r"dataset 'embedding' has dtype int64, expected floating point"):
        BiLM.from_files(o, w)


@pytest.mark.parametrize("value", ["false", b"false", "true", 2, 1.0], ids=repr)
def test_a_residual_flag_that_is_not_a_boolean_is_refused(tmp_path, value):
    from elmo_fast.options import ElmoOptions
    from elmo_fast.weights import RESIDUAL_ATTR, read_weights

    o, w = write_random_model(tmp_path)  # options: use_skip_connections true
    opts = ElmoOptions.load(o)
    for ok in (True, np.bool_(True), 1, np.int64(1)):
        with h5py.File(w, "a") as fh:
            fh.attrs[RESIDUAL_ATTR] = ok
        read_weights(w, opts)
    with h5py.File(w, "a") as fh:
        fh.attrs[RESIDUAL_ATTR] = value
    msg = rf"{re.escape(w)}: the root attribute '{re.escape(RESIDUAL_ATTR)}' is .*expected a boolean"
    with pytest.raises(WeightFileError, match=msg):
        read_weights(w, opts)


@pytest.mark.parametrize("mutate, msg", [
    (lambda d: d["lstm"].__setitem__("use_skip_connections", "false"),
     r"lstm.use_skip_connections must be true or false \(a JSON boolean\), got 'false'"),
    (lambda d: d["lstm"].__setitem__("use_skip_connections", 0), r"lstm.use_skip_connections must be .*got 0"),
    (lambda d: d["lstm"].__setitem__("cell_clip", float("nan")), r"lstm.cell_clip must be a non-negative .*got nan"),
    (lambda d: d["lstm"].__setitem__("proj_clip", float("nan")), r"lstm.proj_clip must be a non-negative .*got nan"),
    (lambda d: d.__setitem__("lstm", [64, 16]), r"lstm must be a JSON object, got list"),
    (lambda d: d.__setitem__("char_cnn", "filters embedding activation"), r"char_cnn must be a JSON object"),
    (lambda d: d.__setitem__("char_cnn", 3), r"char_cnn must be a JSON object or null, got int 3"),
    (lambda d: d["char_cnn"].__setitem__("filters", {"1": 4}), r"char_cnn.filters must be a list .*got dict"),
    (lambda d: d["char_cnn"].__setitem__("filters", 4), r"char_cnn.filters must be a list .*got int 4"),
], ids=["skip 'false'", "skip 0", "cell_clip NaN", "proj_clip NaN", "lstm list", "char_cnn str", "char_cnn int",
        "filters dict", "filters int"])
def test_bad_option_types(tmp_path, mutate, msg):
    o, w = write_random_model(tmp_path)
    p = _options_file(tmp_path, mutate, "bad.json")
    with pytest.raises(elmo_fast.OptionsError, match=rf"{re.escape(str(p))}: {msg}"):
        elmo_fast.BiLM.from_files(p, w)


def test_infinite_clips_and_a_null_residual_key(tmp_path):
    """Infinity is a clip that never clips (as null); a null use_skip_connections is read as a missing one: false,
    with the warning."""
    from elmo_fast.options import ElmoOptions

    o, w = write_random_model(tmp_path)
    ids = elmo_fast.Batcher().batch_sentences([["no", "clip"]])
    outs = []
    for clip in (None, float("inf")):
        p = _options_file(tmp_path, lambda d: d["lstm"].update(cell_clip=clip, proj_clip=clip))
        outs.append(elmo_fast.BiLM.from_files(p, w, backend="reference")(ids)["activations"][2])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    with pytest.warns(UserWarning, match="use_skip_connections is null, so the model is taken to have no residual"):
        opts = ElmoOptions.from_dict({**TINY_OPTIONS, "lstm": {**TINY_OPTIONS["lstm"], "use_skip_connections": None}})
    assert opts.lstm.use_skip_connections is False


@pytest.mark.parametrize("kind", ["the weight file", "latin-1", "a directory"])
def test_options_files_that_are_not_utf8_json_text(tmp_path, kind):
    from elmo_fast.options import ElmoOptions

    o, w = write_random_model(tmp_path / "m")
    if kind == "the weight file":
        p, msg = w, "is not UTF-8 JSON text"
    elif kind == "latin-1":
        p, msg = tmp_path / "latin1.json", "is not UTF-8 JSON text"
        p.write_bytes(json.dumps({**TINY_OPTIONS, "comment": "caf\u00e9"}, ensure_ascii=False).encode("latin-1"))
    else:
        p, msg = tmp_path / "m", "is a directory, expected an options.json file"
    with pytest.raises(elmo_fast.OptionsError, match=rf"options file {re.escape(str(p))} {msg}"):
        ElmoOptions.load(p)
