"""A process's towers in one model pass (``fuse_towers``): the step the towers compute one after the other, each
tower keeping its rows, data, sample sets, dropout masks and LSTM states; and ``ops.dropout.row_groups``, which
gives each tower its own masks inside the fused pass."""
from __future__ import annotations

import collections
import contextlib
import random
import warnings
from dataclasses import replace

import pytest
import torch

from conftest import requires_triton, triton_device
from elmo_fast.chars import Vocabulary
from elmo_fast.probes import probe
from elmo_fast.ops.dropout import RowGroups, dropout, rng_state, row_groups
from elmo_fast.training import data as D
from elmo_fast.training.configs import ConfigError, estimate_memory, fuses_towers, original, tiny
from elmo_fast.training.trainer import Trainer


def _corpus(tmp_path, n_lines=400, seed=0):
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(60)]
    d = tmp_path / "corpus"
    d.mkdir()
    for s in range(3):
        lines = [" ".join(rng.choices(words, weights=[1 / (i + 1) for i in range(60)], k=rng.randint(3, 12)))
                 for _ in range(n_lines)]
        (d / f"train-{s}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return D.resolve_shards(str(d / "train-*.txt"))


def _run(tmp_path, files, backend, device, fuse, steps=3, **over):
    counts, _, n_tok, _ = D.count_tokens(files)
    cfg = tiny()
    cfg.backend, cfg.n_train_tokens, cfg.n_negative_samples_batch = backend, n_tok, 16
    cfg.towers, cfg.batch_size, cfg.unroll_steps, cfg.fuse_towers, cfg.bf16 = 3, 2, 5, fuse, False
    for k, v in over.items():
        setattr(cfg, k, v)
    tr = Trainer(cfg, Vocabulary(words=D.build_vocab(counts)), files, None, str(tmp_path / f"run-{fuse}"),
                 device=torch.device(device))
    try:
        assert tr.fused == (fuse == "on")
        losses = [tr.train_step() for _ in range(steps)]
        tensors = {**{f"model.{k}": v for k, v in tr.model.state_dict().items()},
                   "softmax_W": tr.softmax_W, "softmax_b": tr.softmax_b, "acc_W": tr.acc_W,
                   **{f"acc.{i}": a for i, a in enumerate(tr.acc_dense)},
                   **{f"rows.{i}.{n}": t for i, pa in enumerate(tr.row_params) for n, t in zip("pa", pa)},
                   **{f"tower{tw.gid}.{n}": getattr(tw, n) for tw in tr.towers for n in ("h", "c")}}
        tensors["torch_rng"] = torch.get_rng_state()  # where the step leaves the global generator
        return [float(x) for x in losses], {k: v.detach().cpu().clone() for k, v in tensors.items()}
    finally:
        tr.close()


TRITON = [pytest.mark.triton, requires_triton]
BACKENDS = [pytest.param("reference", "cpu", id="reference"), pytest.param("cpu", "cpu", id="cpu"),
            pytest.param("cpu-packed", "cpu", id="cpu-packed"),
            pytest.param("triton", None, id="triton", marks=TRITON)]


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_fused_towers_step_as_the_towers_one_after_the_other(tmp_path, backend, device, monkeypatch):
    """Three towers in one pass against the same three one after the other, from the same weights: the losses step
    by step, every weight, Adagrad accumulator and tower state after three steps, and where the step leaves the
    global generator (dropout 0.1: each tower's masks must be its own, as ``row_groups`` draws them; sampled
    softmax: each tower's own sample sets). 'cpu-packed': the cpu backend timing its oneDNN packs on these small
    weights, as it does at real sizes the first time it sees a shape (that timing must not draw from the global
    generator between two dropout sites)."""
    if backend == "cpu-packed":
        from elmo_fast.cpu import packed

        if not packed.onednn_enabled():
            pytest.skip("oneDNN packing is off on this machine")
        backend = "cpu"
        monkeypatch.setattr(packed, "_MIN_ELEMENTS", 1)
        monkeypatch.setattr(packed, "_PAYS", {})
        monkeypatch.delenv("ELMO_FAST_CPU_TRAIN_PACK", raising=False)
    device = device or triton_device()
    files = _corpus(tmp_path)
    runs = {}
    for fuse in ("off", "on"):
        if backend == "cpu" and device == "cpu":
            from elmo_fast.cpu import packed

            packed._PAYS.clear()  # each run measures its shapes afresh, at its first step
        with probe() if backend == "triton" else contextlib.nullcontext() as counts:
            runs[fuse] = _run(tmp_path, files, backend, device, fuse)
        if backend == "triton":  # a step's sampled softmax: one call a tower, or one for all the towers fused
            softmax_calls = collections.Counter(la.kernel for la in counts.launches if "softmax" in la.kernel)
            assert softmax_calls == {"_softmax_lse_fwd_kernel": 3 * (3 if fuse == "off" else 1),
                                     "_softmax_dlogit_kernel": 3 * (3 if fuse == "off" else 1)}, fuse
    (l_off, t_off), (l_on, t_on) = runs["off"], runs["on"]
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-4, atol=1e-5)  # cuBLAS picks by rows
    torch.testing.assert_close(torch.tensor(l_on), torch.tensor(l_off), **tol)
    assert l_off[0] != l_off[-1]  # it trained
    for k in t_off:
        torch.testing.assert_close(t_on[k], t_off[k], **tol, msg=k)


@pytest.mark.parametrize("over", [dict(bidirectional=False), dict(char_inputs=False),
                                  dict(char_inputs=False, share_embedding_softmax=True)],
                         ids=["forward-lm", "word-inputs", "word-inputs-shared"])
def test_fused_towers_forward_lm_alone_and_word_inputs(tmp_path, over):
    """The fused pass for bilm-tf's other models: the forward LM alone (one direction: one sample set and one loss a
    tower), a word-input biLM (its embedding's row gradients from every tower), and one whose softmax is that
    embedding: the towers one after the other again, step by step, weights and accumulators included."""
    files = _corpus(tmp_path)
    runs = {fuse: _run(tmp_path, files, "cpu", "cpu", fuse, steps=2, **over) for fuse in ("off", "on")}
    (l_off, t_off), (l_on, t_on) = runs["off"], runs["on"]
    torch.testing.assert_close(torch.tensor(l_on), torch.tensor(l_off), rtol=1e-5, atol=1e-6)
    assert l_off[0] != l_off[-1]
    assert set(t_on) == set(t_off)
    for k in t_off:
        torch.testing.assert_close(t_on[k], t_off[k], rtol=1e-5, atol=1e-6, msg=k)


def test_fused_towers_with_the_full_softmax_and_no_dropout(tmp_path):
    """The full softmax's dense gradients and a model without dropout take the fused pass too."""
    files = _corpus(tmp_path, n_lines=100)
    runs = {fuse: _run(tmp_path, files, "reference", "cpu", fuse, steps=2, sample_softmax=False, dropout=0.0)
            for fuse in ("off", "on")}
    torch.testing.assert_close(torch.tensor(runs["on"][0]), torch.tensor(runs["off"][0]), rtol=1e-5, atol=1e-6)
    for k, v in runs["off"][1].items():
        torch.testing.assert_close(runs["on"][1][k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("backend", ["cpu", "reference", pytest.param("triton", marks=TRITON), "torch"])
def test_row_groups_give_each_group_the_masks_it_gets_alone(monkeypatch, backend):
    """Two dropout sites over a batch stacking groups of 2 and 3 rows: each group's output and gradient equal what
    its rows alone get after seeding the generators with the group's seed (hashed masks: one call with a seed per
    group; "torch": F.dropout, the cuda backend's, a draw per group under the group's generator states)."""
    device = triton_device() if backend == "triton" else "cpu"
    if backend == "torch":
        import importlib

        monkeypatch.setattr(importlib.import_module("elmo_fast.ops.dropout"), "hash_impl", lambda b, d: "torch")
        backend = "cpu"
    x = torch.randn(5, 4, 6, dtype=torch.float64, device=device, requires_grad=True)
    seeds, rows = (11, 22), [2, 3]
    states = []
    for s in seeds:
        torch.manual_seed(s)
        states.append(rng_state(x.device))
    torch.manual_seed(99)
    with row_groups(RowGroups(rows, states, x.device)):
        y = dropout(dropout(x, 0.5, backend=backend), 0.3, backend=backend)
    (y * torch.arange(y.numel(), dtype=y.dtype, device=device).reshape(y.shape)).sum().backward()
    for g, (s, xg, yg, dg) in enumerate(zip(seeds, x.detach().split(rows), y.detach().split(rows),
                                             x.grad.split(rows))):
        torch.manual_seed(s)
        xa = xg.clone().requires_grad_(True)
        ya = dropout(dropout(xa, 0.5, backend=backend), 0.3, backend=backend)
        w = torch.arange(y.numel(), dtype=y.dtype, device=device).reshape(y.shape).split(rows)[g]
        (ya * w).sum().backward()
        assert torch.equal(yg, ya.detach()), g
        assert torch.equal(dg, xa.grad), g
        assert 0 < int((yg == 0).sum()) < yg.numel()  # a real mask
    # outside the block: the plain draw again
    torch.manual_seed(5)
    a = dropout(x.detach(), 0.5, backend=backend)
    torch.manual_seed(5)
    assert torch.equal(a, dropout(x.detach(), 0.5, backend=backend))


def test_row_groups_nest_and_end():
    """An inner block's groups apply inside it (each group's mask from its own state), the outer's again after it
    (their states where they were left), the global generator after both."""
    cpu = torch.device("cpu")

    def states(*seeds):
        out = []
        for s in seeds:
            torch.manual_seed(s)
            out.append(rng_state(cpu))
        return out

    def alone(seed, rows, draws=1):  # what a group's rows get alone: its draws after seeding with its seed
        torch.manual_seed(seed)
        return [dropout(torch.ones(rows, 2), 0.5) for _ in range(draws)][-1]

    outer, inner = RowGroups([1, 1], states(1, 2), cpu), RowGroups([2, 1], states(3, 4), cpu)
    torch.manual_seed(9)
    with row_groups(outer):
        a = dropout(torch.ones(2, 2), 0.5)
        with row_groups(inner):
            b = dropout(torch.ones(3, 2), 0.5)
        c = dropout(torch.ones(2, 2), 0.5)
        with pytest.raises(ValueError, match="must stack the groups' 2 rows"):
            dropout(torch.ones(3, 2), 0.5)
    d = dropout(torch.ones(7, 2), 0.5)
    assert torch.equal(a, torch.cat([alone(1, 1), alone(2, 1)]))
    assert torch.equal(b, torch.cat([alone(3, 2), alone(4, 1)]))
    assert torch.equal(c, torch.cat([alone(1, 1, draws=2), alone(2, 1, draws=2)]))  # the outer states, advanced
    # after both, the global generator, left where the last group's draw left it (a fused step's generators end where
    # the last tower's own step leaves them): the second outer group's third draw
    assert torch.equal(d, alone(2, 7, draws=3))


def test_row_groups_refuse_rows_that_are_not_the_groups():
    torch.manual_seed(0)
    groups = RowGroups([2, 3], [rng_state(torch.device("cpu"))] * 2, torch.device("cpu"))
    with row_groups(groups), pytest.raises(ValueError, match=r"must stack the groups' 5 rows \(\[2, 3\]\), got "
                                                             r"shape \(4, 3\)"):
        dropout(torch.ones(4, 3), 0.5)
    with pytest.raises(ValueError, match="2 row counts but 1 random states"):
        RowGroups([2, 3], [rng_state(torch.device("cpu"))], torch.device("cpu"))


def test_fuse_towers_setting():
    """'auto' fuses on a GPU only, 'on' anywhere, never one tower; the memory estimate then keeps every tower's
    activations (those of one pass over all rows); a bad value is refused by name."""
    cfg = original()  # 3 towers of 128 rows
    assert fuses_towers(cfg, cuda=True) and not fuses_towers(cfg, cuda=False)
    cfg.fuse_towers = "on"
    assert fuses_towers(cfg, cuda=False)
    cfg.fuse_towers = "off"
    assert not fuses_towers(cfg, cuda=True)
    one = original()
    one.towers, one.fuse_towers = 1, "on"
    assert not fuses_towers(one, cuda=True)
    fused, single = original(), original()
    single.towers, single.batch_size = 1, 3 * 128
    assert estimate_memory(fused, 793471, cuda=True) == estimate_memory(single, 793471, cuda=True)
    assert (estimate_memory(fused, 793471, cuda=False)["activations"]
            < estimate_memory(single, 793471, cuda=False)["activations"])  # not fused on the CPU: one tower at a time
    bad = tiny()
    bad.fuse_towers = "yes"
    with pytest.raises(ConfigError, match="fuse_towers must be auto, on or off, got 'yes'"):
        bad.validate()


def test_memory_check_unfuses_towers_that_fit_only_one_after_the_other(monkeypatch):
    """'auto' on a GPU with room for one tower's activations at a time but not for all at once: the towers run one
    after the other (warned); 'on' there is refused with the way out named; room for neither: refused."""
    from elmo_fast.training import configs

    cfg = original()
    fused = estimate_memory(cfg, 793471, cuda=True)["total"]
    apart = estimate_memory(replace(cfg, fuse_towers="off"), 793471, cuda=True)["total"]
    assert apart < fused
    monkeypatch.setattr(configs, "available_memory", lambda device: int((apart + fused) / 2 / 0.9))
    with pytest.warns(RuntimeWarning, match="3 towers fused in one pass would need .* they run one after the other"):
        est = configs.check_memory(cfg, 793471, "cuda:0")
    assert cfg.fuse_towers == "off" and est["total"] == apart
    quiet = original()  # another torchrun rank than the main one: the same fallback, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configs.check_memory(quiet, 793471, "cuda:0", warn=False)
    assert quiet.fuse_towers == "off"
    on = replace(original(), fuse_towers="on")
    with pytest.raises(ConfigError, match=rf"about {fused / 2**30:.1f} GiB .* a tower x 3 towers fused.* run the "
                                          rf"towers one after the other \(--fuse-towers off: about "
                                          rf"{apart / 2**30:.1f} GiB\), lower"):
        configs.check_memory(on, 793471, "cuda:0")
    monkeypatch.setattr(configs, "available_memory", lambda device: int(apart / 2))
    for mode in ("auto", "on"):  # room for neither: no --fuse-towers hint; auto quotes what it would fall back to
        cfg = replace(original(), fuse_towers=mode)
        with pytest.raises(ConfigError, match=rf"about {(apart if mode == 'auto' else fused) / 2**30:.1f} GiB") as e:
            configs.check_memory(cfg, 793471, "cuda:0")
        assert "--fuse-towers" not in str(e.value) and cfg.fuse_towers == mode
        assert ("towers fused" in str(e.value)) == (mode == "on")
    monkeypatch.setattr(configs, "available_memory", lambda device: 10 * fused)
    fits = original()
    assert configs.check_memory(fits, 793471, "cuda:0")["total"] == fused and fits.fuse_towers == "auto"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fused_towers_in_bf16_as_the_towers_one_after_the_other(tmp_path):
    """bf16 autocast on a GPU, the trainer's default there: three towers fused against one after the other, three
    steps from the same weights. The two orders of sums differ in bf16 (cuBLAS picks its kernels by the rows), so
    the losses are held to 2e-2, the weights and accumulators to 2e-2 of their largest entry (at least 1) and the
    towers' states to 5e-2: a tower's masks, samples or rows mixed up move them by far more."""
    files = _corpus(tmp_path)
    runs = {fuse: _run(tmp_path, files, "triton", "cuda", fuse, bf16=True) for fuse in ("off", "on")}
    (l_off, t_off), (l_on, t_on) = runs["off"], runs["on"]
    torch.testing.assert_close(torch.tensor(l_on), torch.tensor(l_off), rtol=2e-2, atol=0.0)
    for k in t_off:
        if k == "torch_rng":
            continue
        tol = 5e-2 if k.startswith("tower") else 2e-2  # the states run 3 x 5 steps of bf16 recurrence
        err = (t_on[k].float() - t_off[k].float()).abs().max().item()
        assert err <= tol * max(1.0, t_off[k].float().abs().max().item()), (k, err)
