"""Entry points under the original names (AllenNLP, bilm-tf)."""
import h5py
import numpy as np
import pytest
import torch

import elmo_fast
from elmo_fast import compat

SENTS = [["The", "first", "sentence", "."], ["The", "second"], ["Third"]]


def test_character_encoder_boundaries_equal_literal_tokens(tiny_model):
    o, w = tiny_model
    enc = compat._ElmoCharacterEncoder(o, w)
    out = enc(elmo_fast.batch_to_ids([["<S>", "</S>"], ["a"]]))
    emb, mask = out["token_embedding"], out["mask"]
    assert emb.shape == (2, 4, 16) and mask.tolist() == [[True] * 4, [True, True, True, False]]
    torch.testing.assert_close(emb[0, 0], emb[0, 1])  # added <S> == literal "<S>"
    torch.testing.assert_close(emb[0, 3], emb[0, 2])  # added </S> == literal "</S>"
    torch.testing.assert_close(emb[1, 2], emb[0, 3])


def test_token_embedder_projection(tiny_model):
    o, w = tiny_model
    emb = compat.ElmoTokenEmbedder(o, w, projection_dim=20, dropout=0.0)
    assert emb(elmo_fast.batch_to_ids(SENTS)).shape == (3, 4, 20) and emb.get_output_dim() == 20


def test_bilm_tf_char_and_token_inputs_agree(tiny_model, tmp_path):
    """bilm-tf's test_bilm_token: dump_token_embeddings + TokenBatcher == the char path."""
    o, w = tiny_model
    vocab = tmp_path / "vocab.txt"
    words = sorted({t for s in SENTS for t in s})
    vocab.write_text("\n".join(["<S>", "</S>"] + words) + "\n")
    emb_file = tmp_path / "emb.hdf5"
    compat.dump_token_embeddings(vocab, o, w, emb_file)
    char_model = compat.BidirectionalLanguageModel(o, w, max_batch_size=4)
    tok_model = compat.BidirectionalLanguageModel(o, w, use_character_inputs=False, embedding_weight_file=emb_file,
                                                  max_batch_size=4)
    for _ in range(3):  # stateful, several batches
        a = char_model(elmo_fast.Batcher(str(vocab)).batch_sentences(SENTS))
        b = tok_model(elmo_fast.TokenBatcher(str(vocab)).batch_sentences(SENTS))
        assert a["lengths"].tolist() == [4, 2, 1]
        valid = a["mask"][:, None, :, None].expand_as(a["lm_embeddings"])
        torch.testing.assert_close(a["lm_embeddings"][valid], b["lm_embeddings"][valid], atol=1e-6, rtol=1e-5)
        # padded positions, as in bilm-tf: the char CNN's output for the padding ids in the char model's layer 0,
        # the zero row of id 0 in the token model's
        assert a["lm_embeddings"][~valid].abs().max() > 0 and not b["lm_embeddings"][~valid].any()
    with pytest.raises(ValueError, match="max_batch_size=4"):
        char_model(elmo_fast.Batcher().batch_sentences(SENTS * 2))
    ids = elmo_fast.TokenBatcher(str(vocab)).batch_sentences(SENTS)
    ids[1, 1] = len(words) + 3  # one past the dumped rows (padding, <S>, </S>, the words)
    with pytest.raises(ValueError, match=rf"token ids \(TokenBatcher output: .*\) must lie in "
                                         rf"\[0, {len(words) + 2}\], got \[0, {len(words) + 3}\]"):
        tok_model(ids)


def test_dump_bilm_embeddings_one_sentence_per_batch(tiny_model, tmp_path):
    o, w = tiny_model
    data = tmp_path / "data.txt"
    data.write_text("\n".join(" ".join(s) for s in SENTS) + "\n")
    out = tmp_path / "out.hdf5"
    compat.dump_bilm_embeddings(None, data, o, w, out)
    model = compat.BidirectionalLanguageModel(o, w)
    with h5py.File(out) as fh:
        for i, s in enumerate(SENTS):
            ref = model(elmo_fast.Batcher().batch_sentences([s]))["lm_embeddings"][0].numpy()
            assert fh[str(i)].shape == (3, len(s), 32)
            np.testing.assert_allclose(fh[str(i)][...], ref, atol=1e-6)


def test_weight_layers_trains_and_names_bad_inputs():
    """bilm-tf's weight_layers as a module: W, gamma and the L2 term get gradients; its variable names; a wrong
    number of layers is named."""
    import elmo_fast

    g = torch.Generator().manual_seed(0)
    ops = {"lm_embeddings": torch.randn(2, 3, 4, 6, generator=g),
           "mask": torch.tensor([[True, True, True, False], [True, True, False, False]])}
    out = elmo_fast.weight_layers("x", ops, l2_coef=0.5, do_layer_norm=True)
    m = out["module"]
    (out["weighted_op"].square().sum() + out["regularization_op"]).backward()
    assert m.W.grad is not None and m.W.grad.abs().sum() > 0 and m.gamma.grad is not None
    assert set(m.tf_variables()) == {"x_ELMo_W", "x_ELMo_gamma"}
    assert set(elmo_fast.WeightLayers(3, use_top_only=True, name="t").tf_variables()) == {"t_ELMo_gamma"}
    with pytest.raises(ValueError, match=r"lm_embeddings \(B, 3, T, D\) and mask \(B, T\), got \(2, 4, 4, 6\)"):
        m({"lm_embeddings": torch.randn(2, 4, 4, 6), "mask": ops["mask"]})


def _reverse_sequence(x: np.ndarray, lengths) -> np.ndarray:
    """tf.reverse_sequence(x, lengths, seq_axis=1, batch_axis=0): each row's first ``lengths[b]`` steps reversed."""
    y = x.copy()
    for b, n in enumerate(lengths):
        y[b, :n] = x[b, :n][::-1]
    return y


@pytest.mark.parametrize("do_layer_norm", [False, True])
def test_bilm_tf_padded_positions_are_bilm_tf_s(tiny_model, do_layer_norm):
    """bilm-tf's _build_ops removes <S>/</S> with reverse_sequence(len - 1), a slice, reverse_sequence(len - 2),
    and masks nothing. Emulated here in numpy on the unmasked layers of a fresh copy of the model: lm_embeddings
    equal it at every position, padded ones included (layer 0 there: the char CNN of the padding ids, not 0), and
    so does weight_layers, whose layer norm takes its statistics over the valid positions only."""
    o, w = tiny_model
    ids = elmo_fast.Batcher().batch_sentences(SENTS)  # lengths 6, 4, 3 with the boundaries
    model = compat.BidirectionalLanguageModel(o, w, max_batch_size=4, backend="reference")
    fresh = compat.BidirectionalLanguageModel(o, w, max_batch_size=4, backend="reference")
    with torch.no_grad():
        got = model(ids)
        mask2 = (ids > 0).any(-1)
        raw = fresh._bilm.forward_embeddings(fresh._bilm.token_encoder(ids), mask2, mask_token_layer=False)
        weighted = compat.weight_layers("x", got, do_layer_norm=do_layer_norm)
        m = weighted["module"]
        m.W.copy_(torch.tensor([0.3, -0.2, 0.5]))
        m.gamma.fill_(1.3)
        weighted = m(got)["weighted_op"].numpy()
    n = mask2.sum(1).numpy()
    expected = []
    for layer in raw["activations"]:
        x = _reverse_sequence(layer.numpy()[:, 1:], n - 1)[:, 1:]
        expected.append(_reverse_sequence(x, n - 2))
    expected = np.stack(expected, 1)
    lm, mask = got["lm_embeddings"].numpy(), got["mask"].numpy()
    assert mask.tolist() == [[True] * 4, [True, True, False, False], [True, False, False, False]]
    np.testing.assert_array_equal(lm, expected)
    assert np.abs(lm[:, 0][~mask]).min() > 0  # the padding ids' CNN output, as bilm-tf leaves it
    assert not lm[:, 1:][np.broadcast_to(~mask[:, None], lm[:, 1:].shape[:3])].any()  # LSTM layers: 0
    # bilm-tf's weight_layers (bilm/elmo.py) on those lm_embeddings: softmax(W + 1/3), _do_ln, gamma
    s = np.exp(np.array([0.3, -0.2, 0.5]) + 1 / 3)
    s /= s.sum()
    fm = mask[..., None].astype(np.float64)
    total = 0.0
    for j in range(3):
        x = expected[:, j].astype(np.float64)
        if do_layer_norm:
            count = fm.sum() * x.shape[-1]
            mean = (x * fm).sum() / count
            var = (((x * fm - mean) * fm) ** 2).sum() / count
            x = (x - mean) / np.sqrt(var + 1e-12)
        total = total + s[j] * x
    np.testing.assert_allclose(weighted, 1.3 * total, rtol=1e-5, atol=1e-6)


def test_bilm_tf_model_takes_numpy_ids_and_names_wrong_ones(tiny_model):
    """bilm-tf's graph is fed numpy arrays (int32 from its batchers): the same numbers as a tensor; float ids are
    refused by name."""
    o, w = tiny_model
    ids = elmo_fast.Batcher().batch_sentences(SENTS)
    a = compat.BidirectionalLanguageModel(o, w, backend="reference")(ids.numpy().astype(np.int32))
    b = compat.BidirectionalLanguageModel(o, w, backend="reference")(ids)
    torch.testing.assert_close(a["lm_embeddings"], b["lm_embeddings"], rtol=0, atol=0)
    flipped = compat.BidirectionalLanguageModel(o, w, backend="reference")(ids.numpy()[::-1])  # a negative stride
    torch.testing.assert_close(flipped["lm_embeddings"], b["lm_embeddings"].flip(0), rtol=1e-6, atol=1e-6)
    small = compat.BidirectionalLanguageModel(o, w, backend="reference")(ids.to(torch.int16))  # any integer dtype
    torch.testing.assert_close(small["lm_embeddings"], b["lm_embeddings"], rtol=0, atol=0)
    with pytest.raises(TypeError, match="ids must be an integer tensor or numpy array .* got Tensor torch.float32"):
        compat.BidirectionalLanguageModel(o, w, backend="reference")(ids.float())
    with pytest.raises(TypeError, match="got list"):
        compat.BidirectionalLanguageModel(o, w, backend="reference")(ids.tolist())


def test_bilm_tf_model_names_bad_ids_and_files(tiny_model, tmp_path):
    """Out-of-range ids, rows not right-padded, another token width, ids on another device, max_batch_size < 1 and
    a missing or empty embedding file: named, where they were raw IndexErrors / KeyErrors or silent (a hole ran the
    padding through the LSTMs as a token)."""
    o, w = tiny_model
    model = compat.BidirectionalLanguageModel(o, w, backend="reference")
    ids = elmo_fast.Batcher().batch_sentences(SENTS)
    for bad, match in ((ids.clone().fill_(262), r"char ids \(Batcher output.*\) must lie in \[0, 261\], got "
                                                r"\[262, 262\]"),
                       (ids[:, :, :49], r"character inputs must be \(batch, tokens \+ 2, 50\), got \(3, 6, 49\)"),
                       (ids.to("meta"), "ids are on meta but the model is on cpu")):
        with pytest.raises(ValueError, match=match):
            model(bad)
    hole = ids.clone()
    hole[1, 1] = 0
    with pytest.raises(ValueError, match="must be right-padded: a row has a token after a padding position"):
        model(hole)
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1, got 0"):
        compat.BidirectionalLanguageModel(o, w, max_batch_size=0)
    with pytest.raises(ValueError, match=r"embedding_weight_file .*: no such file"):
        compat.BidirectionalLanguageModel(o, w, use_character_inputs=False, embedding_weight_file=tmp_path / "no.h5")
    empty = tmp_path / "empty.hdf5"
    h5py.File(empty, "w").close()
    with pytest.raises(ValueError, match="no float dataset 'embedding'"):
        compat.BidirectionalLanguageModel(o, w, use_character_inputs=False, embedding_weight_file=empty)
