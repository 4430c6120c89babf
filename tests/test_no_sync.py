"""No host sync and no pageable upload inside any op's forward or backward (Triton path, on ``triton_device()``:
CUDA tensors on a GPU, CPU tensors under the interpreter): ``probe(forbid=True)`` makes Tensor.item / tolist /
__bool__ / nonzero / unique ... and ``torch.tensor(host data, device=)`` / ``from_numpy(...).to(device)`` raise
inside the block."""
import numpy as np
import pytest
import torch

import elmo_fast
from conftest import requires_triton, triton_device
from elmo_fast import ops
from elmo_fast.ops.lstmp import trusted_lengths
from elmo_fast.probes import HostSyncError, probe

pytestmark = [pytest.mark.triton, requires_triton]


def _leaves(*shapes, scale=0.3):
    """Leaf tensors on the Triton device (drawn on the CPU, so both devices get the same values)."""
    return [(torch.randn(*s) * scale).to(triton_device()).requires_grad_(True) for s in shapes]


@pytest.mark.parametrize("sync", [
    lambda t: t.sum().item(), lambda t: t.tolist(), lambda t: bool(t.sum() > 0), lambda t: torch.nonzero(t),
    lambda t: torch.unique(t), lambda t: int(t[0]), lambda t: torch.tensor([1.0, 2.0], device=t.device),
    lambda t: torch.from_numpy(np.ones(2)).to(t.device),
], ids=["item", "tolist", "bool", "nonzero", "unique", "int", "tensor-upload", "from_numpy-upload"])
def test_probe_catches_syncs_and_pageable_uploads(sync):
    t = torch.arange(4.0)
    with pytest.raises(HostSyncError):
        with probe(forbid=True):
            sync(t)
    with probe() as counts:
        sync(t)
    assert len(counts.syncs) + len(counts.uploads) == 1
    t.sum().item()  # restored after the block


def test_probe_counts_graph_replays_in_any_thread():
    """Autograd runs a GPU backward on its own thread: a loop-graph replay there is counted all the same (on the
    H200, 2026-11-26, the backward's four replays of a training step went uncounted)."""
    import threading

    from elmo_fast.probes import graph_replay

    def replay():
        with graph_replay("lstmp loop"):
            pass

    with probe() as counts:
        replay()
        worker = threading.Thread(target=replay)
        worker.start()
        worker.join()
    assert [launch.kernel for launch in counts.launches] == ["graph replay: lstmp loop"] * 2
    replay()  # no probe active after the block: nothing to count, nothing raised


@pytest.mark.parametrize("training,graphs", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["inference", "training", "inference-loop-graphs", "training-loop-graphs"])
def test_lstmp_forward_backward_has_no_sync(training, graphs, monkeypatch):
    from elmo_fast.kernels import lstmp_graphs

    lstmp_graphs.POOL.clear()
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "record" if graphs else "0")
    B, T, H, P = 3, 4, 16, 16
    x, w_in, w_rec, bias, w_proj, h0, c0 = _leaves((B, T, P), (P, 4 * H), (P, 4 * H), (4 * H,), (H, P), (B, P),
                                                   (B, H))
    lengths = torch.tensor([4, 2, 0]).to(triton_device())

    def step():
        y, h_n, c_n = ops.lstmp(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=3.0, proj_clip=3.0,
                                reverse=True, residual=True, backend="triton")
        if training:
            (y.sum() + h_n.sum() + c_n.sum()).backward()

    with torch.set_grad_enabled(training), trusted_lengths():
        for _ in range(2 if graphs else 1):  # the first call uploads the per-(device, dtype, values) constants;
            step()  # the second captures the loop graphs (a capture syncs once, per call shape)
        with probe(forbid=True):
            step()
    assert graphs == any(s.replayed for v in lstmp_graphs.POOL.slots.values() for s in v)
    lstmp_graphs.POOL.clear()
    # outside trusted_lengths the range check is the one sync of a call
    with torch.no_grad(), probe() as counts:
        ops.lstmp(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, backend="triton")
    assert counts.syncs == ["Tensor.tolist"]


def test_token_encoder_ops_have_no_sync():
    emb, w1, w2, b1, b2 = _leaves((262, 4), (1, 4, 16), (2, 4, 16), (16,), (16,))
    hw = _leaves((32, 32), (32,), (32, 32), (32,))
    ids = torch.randint(1, 262, (6, 8))
    ids[2] = 0
    ids = ids.to(triton_device())
    with probe(forbid=True):
        v = ops.char_cnn(ids, emb, [w1, w2], [b1, b2], backend="triton")
        ops.highway(v, *hw, backend="triton").sum().backward()


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_softmax_losses_have_no_sync(sparse):
    hidden, W, b = _leaves((7, 16), (30, 16), (30,))
    targets = torch.tensor([1, 2, 2, 5, 1, 0, 3]).to(triton_device())
    ids = torch.tensor([0, 2, 4, 6, 8, 9]).to(triton_device())
    with probe(forbid=True):
        loss = ops.sampled_softmax_loss(hidden, targets, W, b, ids, 11, backend="triton", sparse_grad=sparse)
        loss = loss + ops.full_softmax_nll(hidden, targets, W, b, backend="triton")
        loss.backward()
    dense = torch.autograd.grad(ops.sampled_softmax_loss(hidden, targets, W, b, ids, 11, backend="reference"), W)[0]
    got = W.grad.to_dense() if sparse else W.grad
    full = torch.autograd.grad(ops.full_softmax_nll(hidden, targets, W, b, backend="reference"), W)[0]
    torch.testing.assert_close(got, dense + full, atol=1e-5, rtol=1e-5)


def test_bilm_training_hot_path_has_no_sync(tiny_model):
    dev = triton_device()
    bilm = elmo_fast.ElmoBiLM(*tiny_model, backend="triton", requires_grad=True).to(dev)._bilm
    ids = elmo_fast.batch_to_ids([["The", "cat", "sat", "."], ["a", "b", "c", "d"]]).to(dev)
    B, T, L = ids.shape
    lengths = torch.full((B,), T, dtype=torch.long, device=dev)
    h0 = torch.zeros(2, 2, B, 16, device=dev)
    c0 = torch.zeros(2, 2, B, 64, device=dev)
    def step():
        emb = bilm.token_encoder.encode_unique(ids.reshape(-1, L)).reshape(B, T, -1)
        fwd, bwd, h_n, c_n = bilm.run_lstms(emb, lengths, h0, c0, dropout=0.1, token_embedding_bwd=emb.flip(1))
        (fwd[-1].sum() + bwd[-1].sum()).backward()

    with trusted_lengths():
        step()  # the first step uploads the kernels' per-device constants, once
        with probe(forbid=True):
            step()
    assert all(p.grad is not None for p in bilm.forward_lstm.parameters())
