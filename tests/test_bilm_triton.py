"""The whole biLM on the triton backend (char CNN, highway, LSTMP kernels; on ``triton_device()``) reproduces the
reference engine (on the CPU)."""
import pytest
import torch

import elmo_fast
from conftest import requires_triton, triton_device

pytestmark = [pytest.mark.triton, requires_triton]


def test_elmo_bilm_triton_matches_reference_stateful(tiny_model):
    o, w = tiny_model
    ref = elmo_fast.ElmoBiLM(o, w, backend="reference")
    dev = triton_device()
    tri = elmo_fast.ElmoBiLM(o, w, backend="triton").to(dev)
    batches = [[["The", "cat", "sat", "."], ["Hi"]], [["naïve", "x" * 60, "<S>"], [], ["ok", "then"]]]
    for sents in batches:  # stateful: the second batch starts from the first one's final states
        ids = elmo_fast.batch_to_ids(sents)
        a, b = ref(ids), tri(ids.to(dev))
        assert torch.equal(a["mask"], b["mask"].cpu())
        for x, y in zip(a["activations"], (t.cpu() for t in b["activations"])):
            torch.testing.assert_close(y, x, atol=1e-4, rtol=0)
            assert (y - x).abs().max() < 1e-5


def test_elmo_triton_gradients_match_reference(tiny_model):
    o, w = tiny_model
    ids = elmo_fast.batch_to_ids([["fine", "tune", "me"], ["a"]])
    grads = {}
    for be in ("reference", "triton"):
        dev = triton_device() if be == "triton" else "cpu"
        torch.manual_seed(0)
        elmo = elmo_fast.Elmo(o, w, 1, requires_grad=True, dropout=0.0, backend=be).to(dev)
        rep = elmo(ids.to(dev))["elmo_representations"][0]
        (rep * torch.linspace(-1, 1, rep.numel(), device=dev).view_as(rep)).sum().backward()
        grads[be] = {n: p.grad.cpu().clone() for n, p in elmo.named_parameters() if p.grad is not None}
    assert grads["reference"].keys() == grads["triton"].keys() and len(grads["reference"]) > 10
    for name, g in grads["reference"].items():
        torch.testing.assert_close(grads["triton"][name], g, atol=1e-4, rtol=1e-4, msg=name)
