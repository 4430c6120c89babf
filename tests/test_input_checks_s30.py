"""Input checks (audit s30): byte-order marks in text inputs, Batcher ids refused by the AllenNLP-style models,
the arguments of compat's dump functions, a diverged run never rotating good checkpoints out, finite layer-mix
weights, and the shared integer check."""
from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest
import torch

import elmo_fast
from elmo_fast import compat
from elmo_fast.chars import Batcher, Vocabulary, batch_to_ids
from elmo_fast.cli import main as cli_main
from elmo_fast.options import ElmoOptions
from elmo_fast.training import data as D
from elmo_fast.util import check_int

BOM = "\ufeff"
SENTS = [["The", "cat", "sat", "."], ["Hello", "world"], ["naïve"]]


def _pair(tmp_path, name: str, text: str):
    """The same text twice: ``name`` without and ``bom-name`` with a leading byte-order mark."""
    plain, bom = tmp_path / name, tmp_path / f"bom-{name}"
    plain.write_text(text, encoding="utf-8")
    bom.write_text(BOM + text, encoding="utf-8")
    assert bom.read_bytes().startswith(b"\xef\xbb\xbf")
    return str(plain), str(bom)


def _h5(path) -> dict:
    with h5py.File(path) as fh:
        return {k: fh[k][...] for k in fh}


def _assert_same_h5(a, b):
    da, db = _h5(a), _h5(b)
    assert sorted(da) == sorted(db)
    for k in da:
        np.testing.assert_array_equal(da[k], db[k], err_msg=k)


# ------------------------------------------------------------------------------------------- 1. byte-order marks
def test_embed_input_with_a_bom_gives_the_file_without_it(tiny_model, tmp_path):
    o, w = tiny_model
    text = "\n".join(" ".join(s) for s in SENTS) + "\n"
    outs = []
    for inp in _pair(tmp_path, "s.txt", text):
        out = tmp_path / f"{len(outs)}.hdf5"
        assert cli_main(["embed", "--options", o, "--weights", w, "--input", inp, "--output", str(out),
                         "--quiet"]) == 0
        outs.append(out)
    _assert_same_h5(*outs)
    with h5py.File(outs[1]) as fh:
        assert "The cat sat ." in json.loads(fh["sentence_to_index"][0])  # not "\ufeffThe cat sat ."


def test_vocabulary_file_with_a_bom(tmp_path):
    plain, bom = _pair(tmp_path, "vocab.txt", "<S>\n</S>\n<UNK>\nthe\n")
    assert Vocabulary(bom).words == Vocabulary(plain).words == ["<S>", "</S>", "<UNK>", "the"]
    assert Vocabulary(bom, validate_file=True).bos == 0
    assert D.load_training_vocab(bom).words == Vocabulary(plain).words


def test_dump_token_embeddings_vocab_with_a_bom(tiny_model, tmp_path):
    o, w = tiny_model
    outs = []
    for vocab in _pair(tmp_path, "vocab.txt", "the\ncat\n"):
        outs.append(tmp_path / f"{len(outs)}.hdf5")
        compat.dump_token_embeddings(vocab, o, w, outs[-1])
    _assert_same_h5(*outs)


def test_dump_bilm_embeddings_dataset_with_a_bom(tiny_model, tmp_path):
    o, w = tiny_model
    outs = []
    for data in _pair(tmp_path, "data.txt", "The cat\nsat .\n"):
        outs.append(tmp_path / f"{len(outs)}.hdf5")
        compat.dump_bilm_embeddings(None, data, o, w, outs[-1])
    _assert_same_h5(*outs)


def test_corpus_shard_with_a_bom(tmp_path):
    plain, bom = _pair(tmp_path, "train-0.txt", "the cat\na dog\n")
    assert D.read_shard(bom) == D.read_shard(plain) == [["the", "cat"], ["a", "dog"]]
    assert D.count_tokens([bom])[0] == D.count_tokens([plain])[0]


def test_options_file_with_a_bom(tiny_model, tmp_path):
    o, _ = tiny_model
    with open(o, encoding="utf-8") as fh:
        plain, bom = _pair(tmp_path, "options.json", fh.read())
    assert ElmoOptions.load(bom) == ElmoOptions.load(plain)


# ------------------------------------------------------------------------------------- 2. Batcher ids into Elmo
def test_elmo_refuses_batcher_ids(tiny_model):
    o, w = tiny_model
    elmo = elmo_fast.Elmo(o, w, 1, dropout=0.0)
    ids = Batcher().batch_sentences(SENTS)
    with pytest.raises(ValueError, match=r"Batcher.*batch_to_ids.*BidirectionalLanguageModel"):
        elmo(ids)
    padded = torch.cat([ids, torch.zeros_like(ids[:1])])  # an empty row does not hide it
    with pytest.raises(ValueError, match="already hold the sentence boundaries"):
        elmo.reset_states()
        elmo(padded)
    with pytest.raises(ValueError, match="already hold the sentence boundaries"):
        elmo_fast.ElmoBiLM(o, w)(ids)
    with pytest.raises(ValueError, match="already hold the sentence boundaries"):
        compat._ElmoCharacterEncoder(o, w)(ids)
    # the same ids are what the bilm-tf-style model takes
    assert compat.BidirectionalLanguageModel(o, w, max_batch_size=4)(ids)["lm_embeddings"].shape[0] == 3


def test_elmo_takes_batch_to_ids_ids_unchanged(tiny_model):
    o, w = tiny_model
    bilm = elmo_fast.ElmoBiLM(o, w, stateful=False)
    ids = batch_to_ids(SENTS)
    out = bilm(ids)
    assert out["mask"].shape == (3, 6)
    # a literal "<S>" first token, or some sentences wrapped in literal <S> ... </S>, is text: still taken, as in
    # AllenNLP (only a batch whose every sentence is wrapped, which is Batcher's output, is refused)
    for batch in ([["<S>", "a", "b"], ["c"]], [["<S>", "</S>"], ["a"]], [["<S>", "x", "</S>"], ["y"], []]):
        assert bilm(batch_to_ids(batch))["mask"].shape[0] == len(batch)
    with pytest.raises(ValueError, match="already hold the sentence boundaries"):
        bilm(batch_to_ids([["<S>", "x", "</S>"], []]))


# ------------------------------------------------------------------------------- 3. dump functions' arguments
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8", None])
def test_dump_token_embeddings_batch_size(tiny_model, tmp_path, bad):
    o, w = tiny_model
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("the\n")
    with pytest.raises(ValueError, match=f"batch_size must be an integer >= 1, got {bad!r}"):
        compat.dump_token_embeddings(vocab, o, w, tmp_path / "out.hdf5", batch_size=bad)
    assert not (tmp_path / "out.hdf5").exists()


def test_dump_token_embeddings_takes_a_numpy_batch_size(tiny_model, tmp_path):
    o, w = tiny_model
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("the\ncat\na\n")
    assert compat.dump_token_embeddings(vocab, o, w, tmp_path / "out.hdf5", batch_size=np.int64(2)) == 3


def test_dump_functions_name_a_missing_file(tiny_model, tmp_path):
    o, w = tiny_model
    vocab, data, missing = tmp_path / "vocab.txt", tmp_path / "data.txt", tmp_path / "nope.txt"
    vocab.write_text("the\n")
    data.write_text("the cat\n")
    out = tmp_path / "out.hdf5"
    calls = [
        (lambda: compat.dump_token_embeddings(missing, o, w, out), "vocab_file"),
        (lambda: compat.dump_token_embeddings(vocab, missing, w, out), "options_file"),
        (lambda: compat.dump_token_embeddings(vocab, o, missing, out), "weight_file"),
        (lambda: compat.dump_bilm_embeddings(missing, data, o, w, out), "vocab_file"),
        (lambda: compat.dump_bilm_embeddings(vocab, missing, o, w, out), "dataset_file"),
        (lambda: compat.dump_bilm_embeddings(None, data, missing, w, out), "options_file"),
    ]
    for call, name in calls:
        with pytest.raises(ValueError, match=f"{name} {missing}: no such file"):
            call()
    assert not out.exists()


def test_dump_functions_never_write_over_an_input(tiny_model, tmp_path):
    o, w = tiny_model
    vocab, data = tmp_path / "vocab.txt", tmp_path / "data.txt"
    vocab.write_text("the\n")
    data.write_text("the cat\n")
    before = {p: open(p, "rb").read() for p in (vocab, data, o, w)}
    calls = [
        (lambda out: compat.dump_token_embeddings(vocab, o, w, out), [("vocab_file", vocab), ("options_file", o),
                                                                      ("weight_file", w)]),
        (lambda out: compat.dump_bilm_embeddings(vocab, data, o, w, out), [("vocab_file", vocab),
                                                                           ("dataset_file", data),
                                                                           ("options_file", o), ("weight_file", w)]),
    ]
    for call, inputs in calls:
        for name, path in inputs:
            with pytest.raises(ValueError, match=f"outfile {path} is the {name} file .*would replace it"):
                call(path)
    assert {p: open(p, "rb").read() for p in before} == before


# ------------------------------------------------------------------------ 4. no checkpoint of a diverged run
def test_a_nan_parameter_keeps_the_existing_checkpoints(tmp_path):
    from elmo_fast.training.configs import tiny
    from elmo_fast.training.trainer import Trainer, list_checkpoints

    shard = tmp_path / "train-0.txt"
    shard.write_text("the cat sat .\na dog ran .\nthe dog sat .\n" * 4)
    files = [str(shard)]
    counts, _, n_tok, _ = D.count_tokens(files)
    cfg = tiny()
    cfg.backend, cfg.n_train_tokens, cfg.n_negative_samples_batch, cfg.keep_checkpoints = "reference", n_tok, 4, 1
    tr = Trainer(cfg, Vocabulary(words=D.build_vocab(counts)), files, None, str(tmp_path / "run"))
    try:
        first = tr.save_checkpoint()
        kept = open(first, "rb").read()
        tr.step = 7
        with torch.no_grad():
            tr.model.forward_lstm.W_0[0].view(-1)[3] = math.nan
        with pytest.raises(RuntimeError, match=r"step 7: .*NaN or inf.*forward_lstm.*existing checkpoints .* kept"):
            tr.save_checkpoint()
        assert list_checkpoints(tr.save_dir) == [first] and open(first, "rb").read() == kept
        with torch.no_grad():
            tr.model.forward_lstm.W_0[0].view(-1)[3] = 0.0
            tr.softmax_b[0] = math.inf
        with pytest.raises(RuntimeError, match="softmax_b"):
            tr.save_checkpoint()
        assert list_checkpoints(tr.save_dir) == [first]
    finally:
        tr.close()


# --------------------------------------------------------------------------------- 5. finite layer-mix weights
@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.1, True, "0.1"])
def test_weight_layers_l2_coef(bad):
    with pytest.raises(ValueError, match=f"l2_coef must be a finite number >= 0 .*got {bad!r}"):
        compat.WeightLayers(3, l2_coef=bad)
    ops = {"lm_embeddings": torch.zeros(1, 3, 2, 4), "mask": torch.ones(1, 2, dtype=torch.bool)}
    with pytest.raises(ValueError, match="l2_coef"):
        compat.weight_layers("x", ops, l2_coef=bad)
    assert compat.weight_layers("x", ops, l2_coef=0.0)["regularization_op"] == 0.0
    assert compat.WeightLayers(3, l2_coef=np.float32(1e-3)).l2_coef == np.float32(1e-3)


def test_scalar_mix_refuses_nan_and_plus_inf_weights_but_keeps_minus_inf():
    with pytest.raises(ValueError, match="initial_scalar_parameters must not be NaN or \\+inf, got nan"):
        elmo_fast.ScalarMix(3, initial_scalar_parameters=[0.0, math.nan, 1.0])
    with pytest.raises(ValueError, match="must not all be -inf"):
        elmo_fast.ScalarMix(2, initial_scalar_parameters=[-math.inf, -math.inf])
    mix = elmo_fast.ScalarMix(2)
    sd = {k: v.clone() for k, v in mix.state_dict().items()}
    sd["scalar_parameters.1"] = torch.tensor([math.inf])
    with pytest.raises(ValueError, match=r"scalar_parameters\.0, scalar_parameters\.1: .*NaN or \+inf"):
        mix.load_state_dict(sd)
    assert [p.item() for p in mix.scalar_parameters] == [0.0, 0.0] and mix.gamma.item() == 1.0
    # -inf leaves a layer out (AllenNLP users select a layer so): accepted, saved and loaded again
    pick = elmo_fast.ScalarMix(3, initial_scalar_parameters=[-math.inf, 1.0, -math.inf], trainable=False)
    layers = [torch.randn(2, 4) for _ in range(3)]
    assert torch.allclose(pick(layers), layers[1])
    again = elmo_fast.ScalarMix(3, trainable=False)
    again.load_state_dict(pick.state_dict())
    assert torch.equal(again(layers), pick(layers))
    sd = pick.state_dict()
    sd["scalar_parameters.1"] = torch.tensor([-math.inf])
    with pytest.raises(ValueError, match="must not all be -inf"):
        again.load_state_dict(sd)


def test_elmo_checkpoint_with_a_nan_mix_weight_is_refused_by_name(tiny_model):
    o, w = tiny_model
    elmo = elmo_fast.Elmo(o, w, 2, dropout=0.0)
    sd = elmo.state_dict()
    sd["scalar_mix_1.gamma"] = torch.tensor([math.nan])
    with pytest.raises(ValueError, match=r"scalar_mix_1\.gamma: .*non-finite"):
        elmo.load_state_dict(sd)
    assert elmo.scalar_mix_1.gamma.item() == 1.0
    layers = compat.WeightLayers(3, name="t")
    sd = layers.state_dict()
    sd["W"] = torch.tensor([0.0, math.nan, 0.0])
    with pytest.raises(ValueError, match=r"^W: .*NaN or \+inf"):
        layers.load_state_dict(sd)
    assert layers.W.tolist() == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------------------------ 6. the shared int check
def test_check_int_messages_are_those_of_batcher_and_elmo(tiny_model):
    assert check_int(np.int64(4), "n", 1) == 4 and type(check_int(np.int64(4), "n", 1)) is int
    for bad in (True, 2, 3.0, "3", None):
        with pytest.raises(ValueError, match=r"^max_token_length must be an integer >= 3 \(begin, end and one "
                                             rf"byte\), got {bad!r}$"):
            Batcher(max_token_length=bad)
    o, w = tiny_model
    for bad in (0, False, 1.0):
        with pytest.raises(ValueError, match=rf"^num_output_representations must be an integer >= 1, got {bad!r}$"):
            elmo_fast.Elmo(o, w, bad)
