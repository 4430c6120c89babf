"""The AllenNLP-compatible API: shapes, statefulness rules, caching, options, bad input, backends."""
import os
import subprocess
import sys

import pytest
import torch

import elmo_fast
from elmo_fast import BackendUnavailableError

SENTS = [["The", "first", "sentence", "."], ["The", "second"], ["Third"]]


def test_shapes_and_boundaries(tiny_model):
    o, w = tiny_model
    ids = elmo_fast.batch_to_ids([["a"] * 7, ["b"] * 3])
    out = elmo_fast.Elmo(o, w, 2, dropout=0.0)(ids)
    assert len(out["elmo_representations"]) == 2
    assert out["elmo_representations"][0].shape == (2, 7, 32)
    assert out["mask"].tolist() == [[True] * 7, [True] * 3 + [False] * 4]
    out = elmo_fast.Elmo(o, w, 1, dropout=0.0, keep_sentence_boundaries=True)(ids)
    assert out["elmo_representations"][0].shape == (2, 9, 32)
    assert out["mask"].sum(1).tolist() == [9, 5]
    bilm = elmo_fast.ElmoBiLM(o, w)
    res = bilm(ids)
    assert len(res["activations"]) == 3 and all(a.shape == (2, 9, 32) for a in res["activations"])
    assert torch.all(res["activations"][0][1, 5:] == 0)  # layer 0 is masked (AllenNLP)
    assert bilm.get_output_dim() == 32


def test_mask_and_remove_boundaries(tiny_model):
    o, w = tiny_model
    out = elmo_fast.Elmo(o, w, 1, dropout=0.0)(elmo_fast.batch_to_ids(SENTS))
    assert out["mask"].tolist() == [[True] * 4, [True, True, False, False], [True, False, False, False]]
    rep = out["elmo_representations"][0]
    assert torch.all(rep[1, 2:] == 0) and torch.all(rep[2, 1:] == 0)


def test_add_and_remove_sentence_boundaries():
    t = torch.tensor([[1, 2, 3], [4, 5, 0]])
    new, mask = elmo_fast.add_sentence_boundary_token_ids(t, t > 0, 9, 10)
    assert new.tolist() == [[9, 1, 2, 3, 10], [9, 4, 5, 10, 0]]
    assert mask.tolist() == [[True] * 5, [True] * 4 + [False]]
    x = torch.arange(2 * 5 * 1, dtype=torch.float).view(2, 5, 1) + 1
    y, m = elmo_fast.remove_sentence_boundaries(x, mask)
    assert y.squeeze(-1).tolist() == [[2, 3, 4], [7, 8, 0]]
    assert m.tolist() == [[True] * 3, [True, True, False]]
    e = torch.randn(2, 3, 4)
    e3, m3 = elmo_fast.add_sentence_boundary_token_ids(e, torch.tensor([[1, 1, 1], [1, 0, 0]]).bool(),
                                                       torch.ones(4), -torch.ones(4))
    assert e3.shape == (2, 5, 4) and torch.equal(e3[1, 1], e[1, 0]) and torch.all(e3[1, 2] == -1)
    assert torch.all(e3[1, 3:] == 0)


def test_4d_input_equals_flattened(tiny_model):
    o, w = tiny_model
    ids = torch.randint(1, 262, (2, 3, 7, 50))
    ids[:, :, 5:] = 0
    elmo = elmo_fast.Elmo(o, w, 1, dropout=0.0)
    out4 = elmo(ids)
    elmo.reset_states()
    out3 = elmo(ids.view(6, 7, 50))
    assert out4["elmo_representations"][0].shape == (2, 3, 7, 32) and out4["mask"].shape == (2, 3, 7)
    torch.testing.assert_close(out4["elmo_representations"][0].view(6, 7, 32), out3["elmo_representations"][0])


def test_statefulness_rules(tiny_model):
    o, w = tiny_model
    ids = elmo_fast.batch_to_ids(SENTS)
    bilm = elmo_fast.ElmoBiLM(o, w)
    first = bilm(ids)["activations"][2]
    second = bilm(ids)["activations"][2]
    assert not torch.allclose(first, second)  # state carried: the same batch twice differs
    fresh = elmo_fast.ElmoBiLM(o, w)
    torch.testing.assert_close(fresh(ids)["activations"][2], first)
    # a smaller batch uses rows 0..B-1 and leaves the rest untouched
    h_before = [s.clone() for s in bilm._bilm._states]
    bilm(ids[:2])
    h_after = bilm._bilm._states
    assert torch.equal(h_after[0][:, :, 2], h_before[0][:, :, 2])
    assert torch.equal(h_after[1][:, :, 2], h_before[1][:, :, 2])
    assert not torch.equal(h_after[0][:, :, 0], h_before[0][:, :, 0])
    # a larger batch adds zero rows: row 3 behaves like a fresh model
    big = elmo_fast.batch_to_ids(SENTS + [["Fourth", "one"]])
    out = bilm(big)["activations"][2]
    fresh = elmo_fast.ElmoBiLM(o, w)
    torch.testing.assert_close(out[3], fresh(big)["activations"][2][3])
    # reset_states: all rows, or masked rows only
    bilm.reset_states(torch.tensor([True, False, False, False]))
    out = bilm(big)["activations"][2]
    ref = elmo_fast.ElmoBiLM(o, w)(big)["activations"][2]
    torch.testing.assert_close(out[0], ref[0])
    assert not torch.allclose(out[1], ref[1])
    bilm.reset_states()
    torch.testing.assert_close(bilm(big)["activations"][2], ref)
    # AllenNLP users' idiom, reaching into its _ElmoBiLm: elmo._elmo_lstm._elmo_lstm.reset_states(mask)
    elmo = elmo_fast.Elmo(o, w, 1, dropout=0.0)
    first = elmo(big)["elmo_representations"][0]
    elmo(big)
    elmo._elmo_lstm._elmo_lstm.reset_states(torch.tensor([False, True, False, False]))
    again = elmo(big)["elmo_representations"][0]
    torch.testing.assert_close(again[1], first[1])
    assert not torch.allclose(again[0], first[0])
    elmo._elmo_lstm._elmo_lstm.reset_states()
    torch.testing.assert_close(elmo(big)["elmo_representations"][0], first)


def test_zero_length_row_keeps_state(tiny_model):
    """bilm-tf inputs (boundaries included): an all-padding row has length 0 and keeps its state."""
    o, w = tiny_model
    bilm = elmo_fast.BiLM.from_files(o, w)
    ids = elmo_fast.Batcher().batch_sentences(SENTS)
    bilm(ids)
    before = [s.clone() for s in bilm._states]
    ids2 = ids.clone()
    ids2[1] = 0
    bilm(ids2)
    assert torch.equal(bilm._states[0][:, :, 1], before[0][:, :, 1])
    assert not torch.equal(bilm._states[0][:, :, 0], before[0][:, :, 0])


def test_stateless_mode(tiny_model):
    o, w = tiny_model
    bilm = elmo_fast.ElmoBiLM(o, w, stateful=False)
    ids = elmo_fast.batch_to_ids(SENTS)
    torch.testing.assert_close(bilm(ids)["activations"][2], bilm(ids)["activations"][2])


def test_vocab_cache_equals_char_path(tiny_model):
    o, w = tiny_model
    vocab = ["@@PADDING@@", "The", "first", "sentence", ".", "second", "Third"]
    cached = elmo_fast.ElmoBiLM(o, w, vocab_to_cache=vocab)
    plain = elmo_fast.ElmoBiLM(o, w)
    ids = elmo_fast.batch_to_ids(SENTS)
    word_ids = torch.tensor([[vocab.index(t) for t in s] + [0] * (4 - len(s)) for s in SENTS])
    a, b = cached(ids, word_ids), plain(ids)
    assert torch.equal(a["mask"], b["mask"])
    for x, y in zip(a["activations"], b["activations"]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    with pytest.warns(UserWarning, match="outside the cached vocabulary"):
        cached(ids, word_ids + 100)
    with pytest.raises(ValueError, match="does not match"):
        cached(ids, word_ids[:, :2])


def test_requires_grad_and_frozen_mix(tiny_model):
    o, w = tiny_model
    frozen = elmo_fast.Elmo(o, w, 1)
    assert not any(p.requires_grad for p in frozen._elmo_lstm.parameters())
    tuned = elmo_fast.Elmo(o, w, 1, requires_grad=True, dropout=0.0)
    out = tuned(elmo_fast.batch_to_ids(SENTS))["elmo_representations"][0]
    out.sum().backward()
    assert tuned._elmo_lstm._bilm.forward_lstm.W_0[0].grad is not None
    assert tuned._elmo_lstm._bilm.token_encoder.char_embed.grad is not None
    fixed = elmo_fast.Elmo(o, w, 1, scalar_mix_parameters=[-9e10, 1, -9e10], dropout=0.0)
    assert not fixed.scalar_mix_0.gamma.requires_grad
    rep = fixed(elmo_fast.batch_to_ids(SENTS))["elmo_representations"][0]
    ref = elmo_fast.ElmoBiLM(o, w)(elmo_fast.batch_to_ids(SENTS))
    layer1, _ = elmo_fast.remove_sentence_boundaries(ref["activations"][1], ref["mask"])
    torch.testing.assert_close(rep, layer1)


def test_dropout_only_in_training(tiny_model):
    o, w = tiny_model
    elmo = elmo_fast.Elmo(o, w, 2, dropout=0.5)
    ids = elmo_fast.batch_to_ids(SENTS)
    elmo.train()
    reps = elmo(ids)["elmo_representations"]
    assert (reps[0] == 0).sum() > (elmo_fast.Elmo(o, w, 1, dropout=0.0)(ids)["elmo_representations"][0] == 0).sum()
    assert not torch.equal(reps[0] == 0, reps[1] == 0)  # an independent mask per representation
    elmo.eval()
    elmo.reset_states()
    a = elmo(ids)["elmo_representations"]
    torch.testing.assert_close(a[0], a[1])


@pytest.mark.parametrize("make, err, msg", [
    (lambda: torch.zeros(2, 3, 50), TypeError, "integer tensor"),
    (lambda: torch.zeros(3, 50, dtype=torch.long), ValueError, "shape"),
    (lambda: torch.zeros(2, 3, 49, dtype=torch.long), ValueError, "50 ids per token"),
    (lambda: torch.full((2, 3, 50), 300), ValueError, r"\[0, 261\]"),
    (lambda: torch.full((2, 3, 50), -1), ValueError, r"\[0, 261\]"),
    (lambda: torch.zeros(0, 3, 50, dtype=torch.long), ValueError, "empty batch"),
    (lambda: torch.zeros(2, 3, 50, dtype=torch.long, device="meta"), ValueError, "on meta but the model is on cpu"),
    (lambda: [[1, 2]], TypeError, "batch_to_ids"),
])
def test_bad_char_ids(tiny_model, make, err, msg):
    o, w = tiny_model
    with pytest.raises(err, match=msg):
        elmo_fast.ElmoBiLM(o, w)(make())


def test_long_token_and_unicode_run(tiny_model):
    o, w = tiny_model
    out = elmo_fast.Elmo(o, w, 1, dropout=0.0)(elmo_fast.batch_to_ids([["x" * 300, "naïve", "日本", "a\udc80"], []]))
    rep = out["elmo_representations"][0]
    assert rep.shape == (2, 4, 32) and torch.isfinite(rep).all() and out["mask"][1].sum() == 0


def test_backend_selection_errors(tiny_model, monkeypatch):
    o, w = tiny_model
    with pytest.raises(ValueError, match="not a backend"):
        elmo_fast.ElmoBiLM(o, w, backend="fastest")
    monkeypatch.setenv("ELMO_FAST_BACKEND", "nope")
    with pytest.raises(ValueError, match="ELMO_FAST_BACKEND"):
        elmo_fast.ElmoBiLM(o, w)
    monkeypatch.setenv("ELMO_FAST_BACKEND", "cuda")
    bilm = elmo_fast.ElmoBiLM(o, w)
    with pytest.raises(BackendUnavailableError, match="ELMO_FAST_BUILD_CUDA=1"):
        bilm(elmo_fast.batch_to_ids(SENTS))
    monkeypatch.setenv("ELMO_FAST_BACKEND", "reference")
    elmo_fast.ElmoBiLM(o, w)(elmo_fast.batch_to_ids(SENTS))


def test_triton_on_cpu_without_interpreter_explains(tiny_model, monkeypatch):
    from elmo_fast._backend import select_backend, triton_import_error

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if triton_import_error() is not None:
        with pytest.raises(BackendUnavailableError, match="pip install triton"):
            select_backend("triton", torch.device("cpu"))
    else:
        with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
            select_backend("triton", torch.device("cpu"))
    assert select_backend("auto", torch.device("cpu")) == "cpu"  # the interpreter is never picked silently


def test_imports_and_runs_without_triton_or_extension(tiny_model):
    o, w = tiny_model
    code = f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == 'triton' or name.startswith('triton.') or name == 'elmo_fast._C':
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
import elmo_fast
from elmo_fast._backend import select_backend
import torch
assert select_backend('auto', torch.device('cpu')) == 'cpu'
out = elmo_fast.Elmo({str(o)!r}, {str(w)!r}, 1)(elmo_fast.batch_to_ids([['ok']]))
assert 'triton' not in sys.modules
print('OK', tuple(out['elmo_representations'][0].shape))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "OK (1, 1, 32)" in res.stdout


def test_forward_keyword_names(tiny_model):
    """The issue's names (char_ids, word_ids) and AllenNLP's (inputs, word_inputs) both work."""
    o, w = tiny_model
    ids = elmo_fast.batch_to_ids(SENTS)
    a = elmo_fast.ElmoBiLM(o, w)(char_ids=ids)["activations"][2]
    b = elmo_fast.ElmoBiLM(o, w)(inputs=ids, word_inputs=None)["activations"][2]
    torch.testing.assert_close(a, b)
    e1 = elmo_fast.Elmo(o, w, 1, dropout=0.0)(inputs=ids)["elmo_representations"][0]
    e2 = elmo_fast.Elmo(o, w, 1, dropout=0.0)(char_ids=ids)["elmo_representations"][0]
    torch.testing.assert_close(e1, e2)
    with pytest.raises(TypeError, match="not both"):
        elmo_fast.ElmoBiLM(o, w)(ids, inputs=ids)


def test_rows_must_be_right_padded(tiny_model):
    """A padding position (all ids 0) before a token would end the sentence there and run the padding through the
    LSTMs as a token: refused, for Elmo and ElmoBiLM, 3-d and 4-d; empty rows anywhere in the batch are fine."""
    o, w = tiny_model
    elmo, bilm = elmo_fast.Elmo(o, w, 1, dropout=0.0), elmo_fast.ElmoBiLM(o, w)
    good = elmo_fast.batch_to_ids([["The", "cat", "sat"], [], ["a"]])
    assert elmo(good)["mask"].tolist() == [[True] * 3, [False] * 3, [True, False, False]]
    hole, left = good.clone(), good.clone()
    hole[0, 1] = 0
    left[2] = torch.roll(left[2], 2, 0)  # left-padded: the token at the end
    for bad in (hole, left, hole.view(1, 3, 3, 50)):
        for model in (elmo, bilm):
            if bad.dim() == 4 and model is bilm:
                continue
            with pytest.raises(ValueError, match="char ids must be right-padded: a row has a token after a padding"):
                model(bad)


def test_reset_states_takes_a_bool_mask_of_the_batch_rows(tiny_model):
    """reset_states(mask): a 1-d bool tensor (or list), at most the stored rows. Row indices [0, 2] were read as
    bools (row 1 reset), and other shapes were cut or padded: refused by name."""
    o, w = tiny_model
    bilm = elmo_fast.ElmoBiLM(o, w)
    ids = elmo_fast.batch_to_ids(SENTS)
    bilm(ids)
    for bad in (torch.tensor([0, 2]), torch.ones(3), torch.ones(3, 1, dtype=torch.bool),
                torch.ones(len(SENTS) + 1, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"reset_states: mask must be a 1-d bool tensor of at most 3 rows"):
            bilm.reset_states(bad)
    bilm.reset_states([True, False])  # a list, shorter than the stored rows: row 2 keeps its state
    fresh = elmo_fast.ElmoBiLM(o, w)(ids)["activations"][2]
    again = bilm(ids)["activations"][2]
    torch.testing.assert_close(again[0], fresh[0])
    assert not torch.allclose(again[2], fresh[2])


def test_elmo_arguments_are_checked_by_name(tiny_model):
    """num_output_representations an integer >= 1 (a numpy integer too), module an ElmoBiLM, word inputs an integer
    tensor: each wrong one is named (they failed deep inside with raw TypeError/AttributeError/IndexError)."""
    import numpy as np

    o, w = tiny_model
    assert len(elmo_fast.Elmo(o, w, np.int64(2))._scalar_mixes) == 2
    for bad in (0, 1.5, "2", True):
        with pytest.raises(ValueError, match=f"num_output_representations must be an integer >= 1, got {bad!r}"):
            elmo_fast.Elmo(o, w, bad)
    with pytest.raises(TypeError, match="module must be the biLM of another Elmo .* got Linear"):
        elmo_fast.Elmo(None, None, 1, module=torch.nn.Linear(2, 2))
    cached = elmo_fast.ElmoBiLM(o, w, vocab_to_cache=["The", "first"])
    ids = elmo_fast.batch_to_ids([["The", "first"]])
    with pytest.raises(TypeError, match="word_inputs must be an integer tensor of shape .* got Tensor torch.bool"):
        cached(ids, torch.ones(1, 2, dtype=torch.bool))
