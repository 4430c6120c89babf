"""The whole biLM on the triton backend (char CNN, highway, LSTMP kernels) reproduces the reference engine."""
import pytest
import torch

import elmo_fast
from conftest import requires_triton

pytestmark = [pytest.mark.triton, requires_triton]


def test_elmo_bilm_triton_matches_reference_stateful(tiny_model):
    o, w = tiny_model
    ref = elmo_fast.ElmoBiLM(o, w, backend="reference")
    tri = elmo_fast.ElmoBiLM(o, w, backend="triton")
    batches = [[["The", "cat", "sat", "."], ["Hi"]], [["naïve", "x" * 60, "<S>"], [], ["ok", "then"]]]
    for sents in batches:  # stateful: the second batch starts from the first one's final states
        ids = elmo_fast.batch_to_ids(sents)
        a, b = ref(ids), tri(ids)
        assert torch.equal(a["mask"], b["mask"])
        for x, y in zip(a["activations"], b["activations"]):
            torch.testing.assert_close(y, x, atol=1e-4, rtol=0)
            assert (y - x).abs().max() < 1e-5


def test_elmo_triton_gradients_match_reference(tiny_model):
    o, w = tiny_model
    ids = elmo_fast.batch_to_ids([["fine", "tune", "me"], ["a"]])
    grads = {}
    for be in ("reference", "triton"):
        torch.manual_seed(0)
        elmo = elmo_fast.Elmo(o, w, 1, requires_grad=True, dropout=0.0, backend=be)
        rep = elmo(ids)["elmo_representations"][0]
        (rep * torch.linspace(-1, 1, rep.numel()).view_as(rep)).sum().backward()
        grads[be] = {n: p.grad.clone() for n, p in elmo.named_parameters() if p.grad is not None}
    assert grads["reference"].keys() == grads["triton"].keys() and len(grads["reference"]) > 10
    for name, g in grads["reference"].items():
        torch.testing.assert_close(grads["triton"][name], g, atol=1e-4, rtol=1e-4, msg=name)
