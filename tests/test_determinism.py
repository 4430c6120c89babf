"""Deterministic mode (elmo_fast.determinism): the ordered char-CNN backward, untuned launches, the trainer's option.

Under TRITON_INTERPRET=1 the programs of a launch run one after another, so atomics never race here. The
``programs_backwards`` context runs every grid backwards (the interpreter hands out the program ids last to
first): the ordered kernels must give the same bits either way, and the atomic ones do not (a check that the
context really changes the order). The ``atomics`` fixture records every atomic operation the interpreter
executes. On a GPU (``gpu`` marker): two deterministic training runs give the same bits.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import poison_allocations, programs_backwards, triton_available
from test_kernel_report import _check, spy  # noqa: F401 - spy: the launch-recording fixture

from elmo_fast._backend import triton_interpret
from elmo_fast.determinism import deterministic, is_deterministic, set_deterministic

# these tests run the kernels on CPU tensors and steer the interpreter's program order
requires_interpreter = pytest.mark.skipif(not (triton_available() and triton_interpret()),
                                          reason="needs triton and TRITON_INTERPRET=1 (make test sets it)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

FILTERS = [[1, 4], [2, 3], [3, 5], [5, 6], [4, 27]]  # F = 45: two 32-filter blocks, widths mixed in a block


@pytest.fixture
def atomics(monkeypatch):
    from triton.runtime import interpreter

    b = interpreter.interpreter_builder
    seen = []
    for name in ("create_atomic_rmw", "create_atomic_cas"):
        def record(*args, _real=getattr(b, name), **kwargs):
            seen.append(_real)
            return _real(*args, **kwargs)

        monkeypatch.setattr(b, name, record)
    return seen


@pytest.fixture
def small_blocks(monkeypatch):
    """Tiles smaller than the test sizes: several token, filter and slot blocks in every backward launch."""
    import elmo_fast.kernels.char_cnn as kc

    monkeypatch.setattr(kc, "_tiles", lambda dtype, target, backward: dict(BLOCK_T=16, BLOCK_F=16, num_warps=1))
    monkeypatch.setattr(kc, "_embed_tiles", lambda R, V, target: (64, 512, 3))


def _cnn_grads(ids, dtype=torch.float32, seed=2):
    """Output and every gradient of ``char_cnn_triton`` under a fixed upstream gradient."""
    from test_char_cnn_triton import _leaves, make_params

    from elmo_fast.kernels.char_cnn import char_cnn_triton

    emb, ws, bs, _ = make_params(filters=FILTERS, seed=seed)
    p = _leaves([emb, *ws, *bs], dtype, "cpu")
    y = char_cnn_triton(ids, p[0], p[1:1 + len(ws)], p[1 + len(ws):], "relu")
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype))
    return [y.detach()] + [t.grad for t in p]


# ------------------------------------------------------------------------------------------------ the switch


def test_switch_is_torchs_and_the_context_restores_it(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    try:
        with deterministic():
            assert is_deterministic() and torch.are_deterministic_algorithms_enabled()
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # cuBLAS's condition, set when unset
            with deterministic(False):
                assert not is_deterministic()
            assert is_deterministic()
        assert not is_deterministic()
        torch.use_deterministic_algorithms(True, warn_only=True)  # a user's own setting is honoured and restored
        assert is_deterministic()
        with deterministic():
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        set_deterministic(False)
        assert not is_deterministic()
    finally:
        torch.use_deterministic_algorithms(False)


def test_tuned_launches_the_first_candidate_untimed(monkeypatch):
    import triton.testing

    from elmo_fast.kernels import _common

    runs = []

    class Kernel:
        __name__ = "_fake_kernel"

        def __getitem__(self, grid):
            return lambda *args, **meta: runs.append(meta["X"])

    def no_timing(*a, **k):
        raise AssertionError("deterministic mode must not time candidates")

    monkeypatch.setattr(triton.testing, "do_bench", no_timing)
    monkeypatch.setattr(_common, "CHOSEN", {("_fake_kernel", 7): {"index": 1}})  # a choice timed earlier
    cands = [_common.Launch(Kernel(), (1,), {"X": i}) for i in range(3)]
    with deterministic():
        _common.tuned(cands, (7,), "a")
        _common.tuned(cands, (8,), "b")
    assert runs == [0, 0]


# ------------------------------------------------------------------------------------------------ char CNN


@requires_interpreter
@pytest.mark.parametrize("act", ["relu", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_ordered_backward_matches_reference(dtype, act, small_blocks):
    """Every gradient of the ordered backward against the fp64 reference (the budget of test_char_cnn_triton),
    with 37 tokens and 45 filters over 16 x 16 tiles (partial last blocks) and three slot blocks."""
    from test_char_cnn_triton import _check_cnn, make_ids, make_params

    with deterministic():
        _check_cnn(make_ids(37, 10, seed=1), make_params(filters=FILTERS, seed=2), act, dtype, "cpu")


@requires_interpreter
def test_ordered_backward_default_tiles_matches_reference():
    from test_char_cnn_triton import _check_cnn, make_ids, make_params

    with deterministic():
        _check_cnn(make_ids(12, 12, seed=3), make_params(seed=4), "relu", torch.float32, "cpu")


@requires_interpreter
def test_ordered_backward_is_bitwise_repeatable_in_any_program_order(small_blocks, atomics):
    from test_char_cnn_triton import make_ids

    ids = make_ids(37, 10, seed=5)
    with deterministic():
        forwards, again = _cnn_grads(ids), _cnn_grads(ids)
        with programs_backwards():
            backwards = _cnn_grads(ids)
    for i, (a, b, c) in enumerate(zip(forwards, again, backwards)):
        assert torch.equal(a, b), f"tensor {i} differs between two runs"
        assert torch.equal(a, c), f"tensor {i} depends on the order of the programs"
    assert not atomics


@requires_interpreter
def test_programs_backwards_does_change_atomic_sums(small_blocks):
    """The harness has teeth: the default (atomic) backward's bits change when the programs run backwards."""
    from test_char_cnn_triton import make_ids

    ids = make_ids(37, 10, seed=5)
    forwards = _cnn_grads(ids)
    with programs_backwards():
        backwards = _cnn_grads(ids)
    assert torch.equal(forwards[0], backwards[0])  # the forward has no atomics
    assert any(not torch.equal(a, b) for a, b in zip(forwards[1:], backwards[1:]))


@requires_interpreter
def test_ordered_kernels_write_every_element(monkeypatch, small_blocks):
    """torch.empty* NaN-filled (ints 99): the ordered partials, window and table gradients are all written."""
    from test_char_cnn_triton import make_ids, make_params

    from elmo_fast.reference.char_cnn import char_cnn_reference

    poison_allocations(monkeypatch, ("empty", "empty_like"), int_fill=99)
    ids = make_ids(37, 10, seed=6)
    with deterministic():
        got = _cnn_grads(ids, torch.float64, seed=7)
    monkeypatch.undo()
    emb, ws, bs, _ = make_params(filters=FILTERS, seed=7)
    p = [t.clone().requires_grad_() for t in (emb, *ws, *bs)]
    y = char_cnn_reference(ids, p[0], p[1:6], p[6:], "relu")
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
    want = [y.detach(), p[0].grad] + [t.grad for t in p[1:]]
    want[1] = want[1].clone()
    want[1][0] = got[1][0]  # row 0 (the zero row) is no parameter of the model
    for i, (a, b) in enumerate(zip(got, want)):
        assert not torch.isnan(a).any(), f"tensor {i} has unwritten elements"
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ordered_launches_match_report(dtype, spy):  # noqa: F811 - the fixture
    """What deterministic mode launches is what bench/kernel_report.py compiles as its 'det' variant."""
    import kernel_report
    from test_char_cnn_triton import make_ids, make_params

    from elmo_fast.kernels import char_cnn
    from elmo_fast.kernels._common import INTERPRETER

    emb, ws, bs, _ = make_params(filters=FILTERS, seed=2)
    p = [t.to(dtype).requires_grad_() for t in (emb, *ws, *bs)]
    with deterministic():
        char_cnn.char_cnn_triton(make_ids(37, 10, seed=1), p[0], p[1:6], p[6:], "relu").float().sum().backward()
    _check(spy, kernel_report.char_cnn_cases(37, 10, FILTERS, 4, 262, dtype, INTERPRETER, train=True,
                                               ordered=True))


# ------------------------------------------------------------------------------------------------ every op


@requires_interpreter
def test_deterministic_mode_reaches_every_op(atomics):
    """Every Triton op forward and backward (char CNN, highway, LSTMP, sampled and full softmax) executes no
    atomic operation in deterministic mode; outside it the char CNN does (the spy works)."""
    from test_char_cnn_triton import make_ids

    from elmo_fast import ops

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).requires_grad_()

    def run_all():
        ids = make_ids(20, 10, seed=1)
        emb, w1, w2, b1, b2 = rnd(262, 4), rnd(1, 4, 8), rnd(3, 4, 8), rnd(8), rnd(8)
        v = ops.char_cnn(ids, emb, [w1, w2], [b1, b2], "relu", backend="triton")
        v = ops.highway(v, rnd(16, 16), rnd(16), rnd(16, 16), rnd(16), backend="triton")
        B, T, H = 2, 3, 8
        x = v[:B * T].reshape(B, T, 16)
        y, h, c = ops.lstmp(x, rnd(16, 4 * H), rnd(16, 4 * H), rnd(4 * H), rnd(H, 16), rnd(B, 16), rnd(B, H),
                            torch.tensor([3, 2]), cell_clip=1.0, proj_clip=1.0, backend="triton")
        hid = y.reshape(B * T, 16)
        tgt = torch.tensor([1, 2, 3, 4, 5, 1])
        sids, tries = ops.log_uniform_sample(8, 40)
        loss = ops.sampled_softmax_loss(hid, tgt, rnd(40, 16), rnd(40), sids, tries, backend="triton")
        loss = loss + ops.full_softmax_nll(hid, tgt, rnd(40, 16), rnd(40), backend="triton")
        (loss + h.sum() + c.sum()).backward()

    with deterministic():
        run_all()
    assert not atomics, f"{len(atomics)} atomic operations in deterministic mode"
    run_all()
    assert atomics, "the spy saw no atomic operation outside deterministic mode"


# ------------------------------------------------------------------------------------------------ the trainer


def test_trainer_config_and_cli_option():
    from elmo_fast.training import cli, configs

    assert configs.TrainConfig().deterministic is False
    p = argparse.ArgumentParser()
    cli.add_train_arguments(p)
    assert cli._overrides(p.parse_args(["--save-dir", "x", "--deterministic"]))["deterministic"] is True
    assert cli._overrides(p.parse_args(["--save-dir", "x", "--no-deterministic"]))["deterministic"] is False
    assert "deterministic" not in cli._overrides(p.parse_args(["--save-dir", "x"]))
    assert "deterministic" in cli.RESUMABLE  # a run may be resumed with or without it
    assert "(default: --no-deterministic)" in " ".join(p.format_help().split())


def _trainer(d, device="cpu"):
    from elmo_fast.chars import Vocabulary
    from elmo_fast.training import configs
    from elmo_fast.training.trainer import Trainer

    cfg = configs.tiny()
    cfg.backend, cfg.check_memory, cfg.deterministic = "triton", False, True
    words = [f"w{i}" for i in range(60)]
    corpus = Path(d) / "train.txt"
    corpus.write_text("\n".join(" ".join(words[(7 * i + j * j) % 60] for j in range(9)) for i in range(100)))
    return Trainer(cfg, Vocabulary(words=["<S>", "</S>", "<UNK>"] + words), [str(corpus)], None, d,
                   device=torch.device(device))


def _state(tr) -> list[torch.Tensor]:
    return [p.detach().clone() for p in tr.model.parameters()] + [tr.softmax_W.detach().clone(), *tr.acc_dense,
                                                                   tr.acc_W.clone()]


@requires_interpreter
def test_trainer_step_in_deterministic_mode_is_order_free(monkeypatch, atomics):
    """A Triton training step with ``deterministic: true``: torch's switch is on during the step (and off after),
    no atomic runs, and the step's parameters and accumulators are bit-identical when every grid runs backwards."""
    import elmo_fast.training.trainer as trainer_mod

    seen = []
    real_sum_rows = trainer_mod.sum_rows

    def mode_at_sum_rows(*a):
        seen.append(is_deterministic())
        return real_sum_rows(*a)

    monkeypatch.setattr(trainer_mod, "sum_rows", mode_at_sum_rows)
    results = []
    for order in (contextlib.nullcontext, programs_backwards):
        with tempfile.TemporaryDirectory() as d, order():
            tr = _trainer(d)
            try:
                tr.train_step()
                results.append(_state(tr))
            finally:
                tr.close()
        assert not is_deterministic()
    assert seen and all(seen) and not atomics
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"tensor {i} depends on the order of the programs"


@pytest.mark.gpu
def test_gpu_deterministic_training_runs_are_bit_identical():
    """On a GPU: two runs of three Triton training steps (bf16 autocast) in deterministic mode, the same bits; no
    op raises under torch's deterministic algorithms."""
    results = []
    for _ in range(2):
        with tempfile.TemporaryDirectory() as d:
            tr = _trainer(d, "cuda")
            try:
                for _ in range(3):
                    tr.train_step()
                results.append(_state(tr))
            finally:
                tr.close()
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"tensor {i} differs between two deterministic runs"
