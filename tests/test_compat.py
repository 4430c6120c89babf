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
        torch.testing.assert_close(a["lm_embeddings"], b["lm_embeddings"], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="max_batch_size=4"):
        char_model(elmo_fast.Batcher().batch_sentences(SENTS * 2))
    ids = elmo_fast.TokenBatcher(str(vocab)).batch_sentences(SENTS)
    ids[1, 1] = len(words) + 3  # one past the dumped rows (padding, <S>, </S>, the words)
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {len(words) + 2}\], got ids from 0 to "
                                         rf"{len(words) + 3}"):
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
