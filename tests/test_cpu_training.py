"""The training step's own code: no host synchronisation outside logging, fixed-shape softmax row sums, the row
and dense Adagrad updates, and the tower stream (samples drawn ahead, pinned batches, exact resume)."""
import os
import sys

import pytest
import torch

from elmo_fast.chars import Vocabulary
from elmo_fast.cpu.ext import cpu_ext
from elmo_fast.probes import SYNC_FUNCS, SYNC_METHODS
from elmo_fast.training import data as D
from elmo_fast.training.configs import tiny
from elmo_fast.training.trainer import Trainer, TowerStream, adagrad_dense, adagrad_rows, global_norm, sum_rows

TRAINER_FILE = os.path.abspath(sys.modules[Trainer.__module__].__file__)
WORDS = "the a of cat dog sat ran on mat big small red blue green yes no".split()


def _corpus(tmp_path, n=300):
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(n):
        k = int(torch.randint(3, 12, (1,), generator=g))
        lines.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g)))
    path = tmp_path / "train.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [str(path)]


def _trainer(tmp_path, backend="cpu", **over):
    files = _corpus(tmp_path)
    counts, _, n_tok, _ = D.count_tokens(files)
    cfg = tiny()
    cfg.backend, cfg.n_train_tokens, cfg.n_negative_samples_batch = backend, n_tok, 8
    for k, v in over.items():
        setattr(cfg, k, v)
    return Trainer(cfg, Vocabulary(words=D.build_vocab(counts)), files, None, str(tmp_path / "run"))


@pytest.mark.parametrize("backend, model", [("cpu", "chars"), ("reference", "chars"), ("cpu", "words, forward only")])
def test_train_step_code_never_syncs_with_the_host(tmp_path, monkeypatch, backend, model):
    """Reading a tensor's value on the host (every call elmo_fast.probes counts as a sync) from the trainer's own code
    would stall a GPU step; the trainer may do it only when it logs. (The ops check their own code.)"""
    over = {} if model == "chars" else {"char_inputs": False, "share_embedding_softmax": True, "bidirectional": False}
    tr = _trainer(tmp_path, backend, **over)
    calls = []

    def guard(name, fn):
        def wrapper(*a, **k):
            if os.path.abspath(sys._getframe(1).f_code.co_filename) == TRAINER_FILE:
                calls.append(f"{name} at line {sys._getframe(1).f_lineno}")
            return fn(*a, **k)
        return wrapper

    for name in SYNC_METHODS:  # the calls elmo_fast.probes counts as host syncs (unique, equal, ... included)
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    for name in SYNC_FUNCS:
        monkeypatch.setattr(torch, name, guard(f"torch.{name}", getattr(torch, name)))
    try:
        losses = [tr.train_step() for _ in range(3)]
    finally:
        monkeypatch.undo()
        tr.close()
    assert not calls, f"host reads in the training step: {calls}"
    assert all(torch.isfinite(x) for x in losses)


def test_sum_rows_sums_duplicates_in_fixed_shapes():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 9, (40,), generator=g)
    ids[:3] = 0  # id 0 is a real row too
    vals = torch.randn(40, 3, generator=g, dtype=torch.float64)
    rows, sums = sum_rows(ids, vals)
    assert rows.shape == ids.shape and sums.shape == vals.shape
    uniq, inv = torch.unique(ids, return_inverse=True)
    want = torch.zeros(len(uniq), 3, dtype=torch.float64).index_add_(0, inv, vals)
    u = len(uniq)
    assert torch.equal(rows[:u], uniq)
    torch.testing.assert_close(sums[:u], want)
    assert torch.equal(rows[u:], torch.zeros_like(rows[u:])) and not sums[u:].any()


def test_row_adagrad_equals_dense_adagrad():
    """Updating only the touched rows (with the padding rows of sum_rows) changes exactly what dense TF Adagrad
    with the clipped gradient changes."""
    g = torch.Generator().manual_seed(1)
    V, k, lr = 11, 4, 0.3
    ids = torch.tensor([3, 0, 3, 7, 10, 0, 3])
    vals = torch.randn(len(ids), k, generator=g, dtype=torch.float64)
    inv_factor = torch.tensor(2.5, dtype=torch.float64)
    w0 = torch.randn(V, k, generator=g, dtype=torch.float64)
    acc0 = torch.rand(V, k, generator=g, dtype=torch.float64) + 0.5
    dense_g = torch.zeros(V, k, dtype=torch.float64).index_add_(0, ids, vals) / 2.5
    want_acc = acc0 + dense_g * dense_g
    want_w = w0 - lr * dense_g / want_acc.sqrt()
    w, acc = w0.clone(), acc0.clone()
    adagrad_rows(w, acc, *sum_rows(ids, vals), lr, inv_factor)
    torch.testing.assert_close(acc, want_acc)
    torch.testing.assert_close(w, want_w)
    w, acc = [w0.clone()], [acc0.clone()]
    adagrad_dense(w, [dense_g * 2.5], acc, lr, inv_factor)
    torch.testing.assert_close(acc[0], want_acc)
    torch.testing.assert_close(w[0], want_w)


def test_dense_adagrad_falls_back_to_foreach_where_the_fused_kernel_is_missing(monkeypatch):
    """Where torch has no fused Adagrad kernel for the device (torch before 2.9 on a GPU), the optimizer warns once
    and takes the foreach ops, which give the fused kernel's update; it does not try the fused kernel again."""
    from elmo_fast.training import trainer as T

    g = torch.Generator().manual_seed(2)
    shapes = [(7, 5), (33,), (4, 3, 2)]
    p0 = [torch.randn(s, generator=g) for s in shapes]
    g0 = [torch.randn(s, generator=g) for s in shapes]
    a0 = [torch.rand(s, generator=g) + 0.5 for s in shapes]
    inv_factor, lr = torch.tensor(1.7), 0.2

    def run():
        p, a = [t.clone() for t in p0], [t.clone() for t in a0]
        T.adagrad_dense(p, [t.clone() for t in g0], a, lr, inv_factor)
        return p, a

    monkeypatch.setattr(T, "_FUSED_ADAGRAD", {})
    fused = run()
    assert T._FUSED_ADAGRAD == {"cpu": True}
    calls = []

    def missing(*a, **k):
        calls.append(1)
        raise NotImplementedError("Could not run 'aten::_fused_adagrad_' with arguments from the 'CUDA' backend")

    monkeypatch.setattr(torch, "_fused_adagrad_", missing)
    monkeypatch.setattr(T, "_FUSED_ADAGRAD", {})
    with pytest.warns(RuntimeWarning, match="fused Adagrad does not run here"):
        first = run()
    again = run()  # no second try, no second warning
    assert len(calls) == 1 and T._FUSED_ADAGRAD == {"cpu": False}
    for got in (first, again):
        for x, y in zip(got[0] + got[1], fused[0] + fused[1]):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-7)
        want_a = [a + (gr / inv_factor) ** 2 for a, gr in zip(a0, g0)]
        want_p = [p - lr * (gr / inv_factor) / a.sqrt() for p, gr, a in zip(p0, g0, want_a)]
        for x, y in zip(got[0] + got[1], want_p + want_a):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dense_adagrad_on_a_gpu_is_fused_and_matches_foreach(monkeypatch):
    """On a GPU the dense Adagrad runs torch's fused kernel where the torch build has it (skipped, naming the build,
    where it falls back), and its update is the foreach ops' to rounding."""
    import warnings

    from elmo_fast.training import trainer as T

    g = torch.Generator().manual_seed(3)
    shapes = [(4096, 1024), (513,), (2048, 4096)]
    p0, g0 = ([torch.randn(s, generator=g).cuda() for s in shapes] for _ in range(2))
    a0 = [(torch.rand(s, generator=g) + 0.5).cuda() for s in shapes]
    out = {}
    for mode in ("fused", "foreach"):
        monkeypatch.setattr(T, "_FUSED_ADAGRAD", {} if mode == "fused" else {"cuda": False})
        p, a = [t.clone() for t in p0], [t.clone() for t in a0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if mode == "fused" else "error")
            T.adagrad_dense(p, [t.clone() for t in g0], a, 0.2, torch.tensor(1.7, device="cuda"))
        out[mode] = p + a
        if mode == "fused" and not T._FUSED_ADAGRAD["cuda"]:
            pytest.skip(f"torch {torch.__version__} has no CUDA fused Adagrad here: the foreach ops run")
    for x, y in zip(out["fused"], out["foreach"]):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("path", ["extension", "torch"])
def test_global_norm_is_exact_at_the_original_sizes(monkeypatch, path):
    """The clipping norm of gradients as large as the original model's (W_0 of one LSTM layer: 16.8M elements), a
    column-major one, and tails that fill no whole row, within 2e-7 of fp64: torch's fp32 norm on the CPU comes
    out 6.5e-4 low on the first alone. Both ways: the extension's double sums, and rows of 4,096 without it."""
    from elmo_fast.training import trainer as T

    if path == "extension" and (cpu_ext() is None or not hasattr(cpu_ext(), "sum_squares")):
        pytest.skip("needs elmo_fast._cpu with sum_squares")
    if path == "torch":
        monkeypatch.setattr(T, "cpu_ext_for", lambda *ts: None)
    else:  # the extension's sums, not a silent fallback to the rows (torch's norm is not called at all)
        monkeypatch.setattr(T.torch.linalg, "vector_norm", lambda *a, **k: pytest.fail("fell back to the rows"))
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(1024, 16384, generator=g), torch.randn(700, 9, generator=g).t(),
          torch.randn(4096 * 3 + 5, generator=g) * 40, torch.randn(3, 5, generator=g)]
    exact = sum(float((t.double() ** 2).sum()) for t in ts) ** 0.5
    got = global_norm(ts)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(float(got) - exact) <= 2e-7 * exact, (float(got), exact)
    assert float(global_norm([ts[3]])) == pytest.approx(float((ts[3].double() ** 2).sum()) ** 0.5, rel=1e-7)
    with pytest.raises(ValueError, match="no tensors"):
        global_norm([])
    if path == "extension":  # one tensor the extension cannot take (fp64) leaves the others to it
        monkeypatch.undo()
        mixed = [ts[0], ts[2].double()]
        want = (float((ts[0].double() ** 2).sum()) + float((ts[2].double() ** 2).sum())) ** 0.5
        assert global_norm(mixed).dtype == torch.float32
        assert abs(float(global_norm(mixed)) - want) <= 2e-7 * want
    if path == "extension":  # squares past fp32's range, and what the clip must see: NaN and inf propagate
        assert float(global_norm([torch.full((5,), 1e30)])) == pytest.approx(5 ** 0.5 * 1e30, rel=1e-7)
        assert float(global_norm([ts[3], torch.tensor([float("inf")])])) == float("inf")
        assert global_norm([torch.tensor([1.0, float("nan")]), ts[3]]).isnan()


@pytest.mark.skipif(cpu_ext() is None or not hasattr(cpu_ext(), "sum_squares"), reason="needs elmo_fast._cpu")
def test_sum_squares_is_the_fp64_sum_whatever_the_threads_and_length():
    """The extension's Σ t² (global_norm's): within 1e-13 of an fp64 sum at lengths around its 32-lane loop, its
    runs of 16,384 and their thread split, with the same bits on 1, 2 and 3 threads; refuses a non-contiguous or
    non-float32 tensor."""
    ext = cpu_ext()
    g = torch.Generator().manual_seed(4)
    threads = torch.get_num_threads()
    try:
        for n in (0, 1, 31, 32, 33, 16383, 16384, 16385, 3 * 16384 + 77, 200_001):
            t = torch.randn(n, generator=g) * 3
            want = float((t.double() ** 2).sum())
            bits = set()
            for k in (1, 2, 3):
                torch.set_num_threads(k)
                got = ext.sum_squares(t)
                bits.add(got)
                assert got == pytest.approx(want, rel=1e-13, abs=0.0), (n, k)
            assert len(bits) == 1, (n, bits)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.sum_squares(torch.zeros(4, 6)[:, :3])
    with pytest.raises(RuntimeError, match="float32"):
        ext.sum_squares(torch.zeros(4, dtype=torch.float64))


def test_updates_reach_the_packed_weights(tmp_path, monkeypatch):
    """After an optimizer step, inference through the cpu backend (packed weights cached across calls) sees the
    new weights: the fused Adagrad bumps the version counters it bypasses."""
    from elmo_fast.cpu import packed

    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)  # pack the tiny model's weights
    tr = _trainer(tmp_path)
    ids = torch.randint(1, 262, (2, 5, 50))
    try:
        tr.model.eval()
        with torch.no_grad():
            tr.model(ids)  # fills the packed-weight cache
        versions = [p._version for p in tr.dense_params]
        tr.train_step()
        assert all(p._version > v for p, v in zip(tr.dense_params, versions))
        tr.model.eval()
        with torch.no_grad():
            got = tr.model(ids)["activations"][2]
            for stack in (tr.model.forward_lstm, tr.model.backward_lstm):
                stack.backend = "reference"
            want = tr.model(ids)["activations"][2]
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    finally:
        tr.close()


def test_tower_stream_draws_ahead_pins_and_resumes(tmp_path, monkeypatch):
    """The GPU mode: samples drawn in the data thread, tensors pinned; the state covers the sampler."""
    files = _corpus(tmp_path)
    counts, _, _, _ = D.count_tokens(files)
    vocab = Vocabulary(words=D.build_vocab(counts))

    def make():
        gen = torch.Generator().manual_seed(5)
        return TowerStream(D.BidirectionalStream(files, vocab, 4, 6, 50, seed=1), gen, 8, len(vocab), ahead=True)

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t)  # no accelerator here
    a = make()
    a.next_batch()
    state = a.get_state()
    want = a.next_batch()
    assert len(pinned) == 2 * 5  # the targets, the distinct tokens (rows, inverse), the sample sets, per batch
    assert not set(TowerStream.KEYS[:2]) & want.keys()  # the distinct tokens replace the char ids
    assert want["sampled_ids"].shape == (2, 8) and len(want["num_tries"]) == 2
    b = make()
    b.set_state(state)
    got = b.next_batch()
    for key in (*TowerStream.KEYS[2:], "char_rows", "char_inverse", "sampled_ids"):
        assert torch.equal(got[key], want[key]), key
    assert got["num_tries"] == want["num_tries"]


def test_tower_stream_in_a_loader_process_is_pinned_in_this_process(tmp_path, monkeypatch):
    """The GPU mode with data_worker 'process': the worker draws the samples (its copy of the generator) and does
    not pin; this process pins what it receives; batches and positions are those of the stream run here."""
    files = _corpus(tmp_path)
    counts, _, _, _ = D.count_tokens(files)
    vocab = Vocabulary(words=D.build_vocab(counts))

    def make(pin):
        gen = torch.Generator().manual_seed(5)
        return TowerStream(D.BidirectionalStream(files, vocab, 4, 6, 50, seed=1), gen, 8, len(vocab), ahead=True,
                           pin=pin)

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t)  # no accelerator here
    ref = make(True)
    process = D.ProcessLoader(make(False), prepare=TowerStream.pinned)
    try:
        for _ in range(3):
            want, got = ref.next_batch(), next(process)
            for key in (*TowerStream.KEYS[2:], "char_rows", "char_inverse", "sampled_ids"):
                assert torch.equal(got[key], want[key]), key
                assert any(t is got[key] for t in pinned), f"{key} not pinned here"
            assert got["num_tries"] == want["num_tries"]
        assert str(process.position) == str(ref.get_state())
    finally:
        process.close()


@pytest.mark.skipif(cpu_ext() is None, reason="needs elmo_fast._cpu (csrc/cpu/fpenv.cpp)")
def test_cpu_steps_run_with_denormals_flushed_and_restore(tmp_path, monkeypatch):
    """As TensorFlow runs its CPU ops, a training step runs with denormals flushed; the caller's state after."""
    tr = _trainer(tmp_path)
    seen, real = [], Trainer._tower_step

    def spy(self, *a):
        seen.append(cpu_ext().denormals_flushed())
        return real(self, *a)

    monkeypatch.setattr(Trainer, "_tower_step", spy)
    try:
        tr.train_step()
        assert seen == [True] and not cpu_ext().denormals_flushed()
    finally:
        tr.close()


def test_the_streams_distinct_tokens_rebuild_its_batch(tmp_path):
    """``BidirectionalStream.next_batch_and_tokens``: ``rows[inverse]`` is the batch's forward input tokens, then its
    reverse ones; the rows are distinct, as many as torch.unique finds, and in the same order whatever order the
    stream's token cache met the words in (a resumed run rebuilds it); the batch is ``next_batch``'s."""
    import numpy as np

    files = _corpus(tmp_path)
    counts, _, _, _ = D.count_tokens(files)
    vocab = Vocabulary(words=D.build_vocab(counts))
    stream, plain, primed = (D.BidirectionalStream(files, vocab, 4, 6, 50, seed=1) for _ in range(3))
    primed.fwd.tokens.rows(sorted(counts, reverse=True))  # its cache holds every word, in another order
    for _ in range(3):
        b, rows, inverse = stream.next_batch_and_tokens()
        want = plain.next_batch()
        assert b.keys() == want.keys() and all(np.array_equal(b[k], want[k]) for k in b)
        lean, rows2, inverse2 = primed.next_batch_and_tokens(chars=False)  # the batch without its char ids
        assert lean.keys() == want.keys() - {"tokens_characters", "tokens_characters_reverse"}
        assert all(np.array_equal(lean[k], want[k]) for k in lean)
        assert np.array_equal(rows2, rows) and np.array_equal(inverse2, inverse)
        flat = np.concatenate([b["tokens_characters"].reshape(-1, 50), b["tokens_characters_reverse"].reshape(-1, 50)])
        assert rows.dtype == np.int32 and inverse.dtype == np.int64 and inverse.shape == (48,)
        assert np.array_equal(rows[inverse], flat)
        assert len(rows) == len(torch.unique(torch.from_numpy(flat), dim=0)) < 48


def test_fused_towers_distinct_tokens_follow_the_fused_rows():
    """``_fused_chars``: the towers' distinct tokens for their rows side by side (every tower's forward inputs,
    then every tower's backward ones), each inverse shifted past the rows before it; None if a tower has none."""
    from elmo_fast.training.trainer import _fused_chars

    g = torch.Generator().manual_seed(1)
    towers = [[torch.randint(0, 2, (n, 4, 5), generator=g) for _ in range(2)] for n in (2, 3)]  # (fwd, bwd) each
    per = [torch.unique(torch.cat([f.reshape(-1, 5), b.reshape(-1, 5)]), dim=0, return_inverse=True)
           for f, b in towers]
    rows, inverse = _fused_chars(per, [f.shape[0] * f.shape[1] for f, _ in towers])
    want = torch.cat([f.reshape(-1, 5) for f, _ in towers] + [b.reshape(-1, 5) for _, b in towers])
    assert torch.equal(rows[inverse], want)
    assert _fused_chars([per[0], None], [8, 12]) is None


@pytest.mark.parametrize("backend, bidirectional", [("cpu", True), ("reference", True), ("cpu", False)])
def test_train_step_encodes_the_distinct_tokens_its_stream_found(tmp_path, monkeypatch, backend, bidirectional):
    """A char model's training step (both directions, or the forward LM alone) takes its batch's distinct tokens
    from the data stream (no torch.unique in the step: on a GPU it synced the host 6 times a step), and its loss and
    every gradient are those of the step that deduplicates in the token encoder."""
    tr = _trainer(tmp_path, backend, bidirectional=bidirectional)
    try:
        tw = tr.towers[0]
        batch = next(tw.loader)  # (its stream is its loader's thread's)
        assert batch["char_rows"].shape[0] < batch["char_inverse"].shape[0] == 2 * batch["next_token_id"].numel()
        inputs, samples, chars = tr.batch_tensors(batch), tw.stream.draw(), tr.char_tensors(batch)
        assert inputs[0] is None and inputs[1] is None  # the batch brings its distinct tokens instead of its char ids
        B, T = inputs[2].shape
        rows, inverse = chars
        assert rows.dtype == torch.int16 and inverse.dtype == torch.int32  # narrower than the char ids they replace
        plain = tuple(rows[inverse[d * B * T:(d + 1) * B * T].long()].long().reshape(B, T, -1) for d in (0, 1))
        params = [p for p in tr.model.parameters() if p.requires_grad]

        def run(chars):
            torch.manual_seed(3)  # the same dropout masks
            loss, _, _ = tr.model_loss(*(plain if chars is None else inputs[:2]), *inputs[2:], tw.h, tw.c, samples,
                                       chars)
            return [loss, *torch.autograd.grad(loss, params, allow_unused=True)]

        want = run(None)  # the char ids rebuilt: the token encoder deduplicates them itself
        real = torch.unique
        monkeypatch.setattr(torch, "unique", lambda *a, **k: pytest.fail("torch.unique in the step"))
        got = run(chars)
        tr.train_step()
        monkeypatch.setattr(torch, "unique", real)
        for i, (a, b) in enumerate(zip(got, want)):
            assert (a is None) == (b is None), i
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"item {i}: {m}")
    finally:
        tr.close()


def test_encode_tokens_is_forward_on_the_tokens_and_checks_its_arguments(tmp_path):
    """``encode_tokens`` (rows, inverse, lead): each of the tokens ``rows[inverse]`` encoded as it is alone; rows of
    another width or an inverse of another token count are refused with what was expected."""
    tr = _trainer(tmp_path)
    try:
        te = tr.model.token_encoder
        L = te.opts.max_characters_per_token
        g = torch.Generator().manual_seed(0)
        rows = torch.randint(1, 200, (3, L), generator=g)
        inverse = torch.tensor([0, 2, 1, 0, 2, 2])
        with torch.no_grad():
            got = te.encode_tokens(rows, inverse, (2, 3))
            want = te.encode_unique(rows[inverse]).reshape(2, 3, -1)  # every token encoded, none deduplicated
        assert got.shape == (2, 3, te.output_dim)
        torch.testing.assert_close(got, want)
        with pytest.raises(ValueError, match="an inverse of the 6 tokens"):
            te.encode_tokens(rows, inverse[:5], (2, 3))
        with pytest.raises(ValueError, match=f"rows \\(U, {L}\\)"):
            te.encode_tokens(rows[:, :-1], inverse, (2, 3))
    finally:
        tr.close()
