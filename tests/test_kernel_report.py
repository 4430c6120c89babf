"""The kernel report (bench/kernel_report.py) against the runtime.

* Spy tests (interpreter): every kernel launch a launcher makes, with its grid, constexprs/options and runtime
  argument dtypes and values, equals the case the report builds for the same problem and target. The report
  builds its H100 cases with the same functions, so what it compiles is what the runtime launches.
* The CI subset: one variant of every kernel function compiled for sm_90a (no GPU); any compile error, and any
  rule the report enforces that a kernel outside the pending ops breaks, fails the test.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import requires_triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture
def spy(monkeypatch):
    """Records (kernel name, grid, keyword arguments, runtime arguments) of every kernel launch."""
    from elmo_fast.kernels import char_cnn, dropout, highway, lstmp, softmax

    calls = []
    for mod in (char_cnn, dropout, highway, lstmp, softmax):
        for name in dir(mod):
            k = getattr(mod, name)
            if name.endswith("_kernel") and hasattr(k, "run"):
                def run(*args, grid, warmup, _k=k, _real=k.run, **kwargs):
                    calls.append((_k, tuple(grid), kwargs, list(args)))
                    return _real(*args, grid=grid, warmup=warmup, **kwargs)

                monkeypatch.setattr(k, "run", run)
    return calls


def _norm(kernel, grid, meta, args):
    """A launch as a comparable tuple; the LSTMP step index and the softmax backward's chunk offset (never
    specialised: multiples of the chunk width) are masked."""
    import kernel_report

    desc = kernel_report.describe(args)
    for name in ("s", "c0"):
        if name in kernel.arg_names:
            desc[kernel.arg_names.index(name)] = name
    return kernel.__name__, tuple(grid), tuple(sorted((k, str(v)) for k, v in meta.items())), tuple(map(str, desc))


def _check(spied, built):
    got = list(dict.fromkeys(_norm(*c) for c in spied))  # distinct, in launch order
    want = list(dict.fromkeys(_norm(launch.kernel, launch.grid, launch.meta, args)
                              for entry in built for _, launch, args, *_ in entry))
    assert got == want


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@requires_triton
@DTYPES
def test_char_cnn_launches_match_report(spy, dtype):
    import kernel_report
    from test_char_cnn_triton import make_ids, make_params

    from elmo_fast.kernels._common import INTERPRETER
    from elmo_fast.kernels.char_cnn import char_cnn_triton

    filters = [[1, 4], [2, 3], [3, 5], [5, 6], [4, 27]]  # F = 45: two filter blocks
    ids = make_ids(37, 10, seed=1)  # three token blocks
    emb, ws, bs, _ = make_params(filters=filters, seed=2)
    p = [t.to(dtype).requires_grad_() for t in (emb, *ws, *bs)]
    char_cnn_triton(ids, p[0], p[1:6], p[6:], "relu").float().sum().backward()
    _check(spy, kernel_report.char_cnn_cases(37, 10, filters, 4, 262, dtype, INTERPRETER, train=True))


@requires_triton
@DTYPES
def test_highway_launches_match_report(spy, dtype):
    import kernel_report

    from elmo_fast.kernels._common import INTERPRETER
    from elmo_fast.kernels.highway import highway_triton

    M, F = 37, 45
    p = [torch.randn(*s, dtype=dtype).requires_grad_() for s in ((M, F), (F, F), (F,), (F, F), (F,))]
    highway_triton(*p).float().sum().backward()
    _check(spy, kernel_report.highway_cases(M, F, dtype, INTERPRETER, train=True))


@requires_triton
@DTYPES
@pytest.mark.parametrize("groups", [1, 3])
def test_dropout_launches_match_report(spy, dtype, groups):
    import kernel_report

    from elmo_fast.kernels.dropout import dropout_hash_triton

    x = torch.randn(groups, 1100, dtype=dtype, requires_grad=True)  # two blocks of elements
    seeds = torch.arange(groups)  # the report's seeds and p: the spy compares scalars by value
    dropout_hash_triton(x, seeds, [1100] * groups, 0.1).float().sum().backward()
    _check(spy, kernel_report.dropout_cases(1100 * groups, dtype, groups))  # fwd and bwd: one launch, twice


@requires_triton
@DTYPES
@pytest.mark.parametrize("sampled,groups,budget", [(True, 1, None), (False, 1, None), (True, 3, None), (True, 3, 16)],
                         ids=["sampled", "full", "groups", "groups-over-budget"])
def test_softmax_launches_match_report(spy, dtype, sampled, groups, budget, monkeypatch):
    """The report's softmax launches are the runtime's; 'groups-over-budget': the backward's dlogit budget cut to 16
    columns, so the groups go one after the other, each in column chunks, in the runtime and in the report."""
    import kernel_report

    from elmo_fast.kernels import softmax as KS

    if budget:
        monkeypatch.setattr(KS, "dlogit_columns", lambda N, C, itemsize: min(C, budget))

    from elmo_fast import ops
    from elmo_fast.kernels._common import INTERPRETER

    N, P, V, S = 37, 20, 100, 45
    h = torch.randn(N, P, dtype=dtype, requires_grad=True)
    w = torch.randn(V, P, dtype=dtype, requires_grad=True)
    b = torch.randn(V, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (N,))
    if groups > 1:  # the trainer's call: every group its own rows and samples
        loss = sum(ops.sampled_softmax_loss_groups([(h * (k + 1), y, *ops.log_uniform_sample(S, V))
                                                    for k in range(groups)], w, b, backend="triton"))
    elif sampled:
        ids, tries = ops.log_uniform_sample(S, V)
        loss = ops.sampled_softmax_loss(h, y, w, b, ids, tries, backend="triton")
    else:
        loss = ops.full_softmax_nll(h, y, w, b, backend="triton")
    loss.backward()
    _check(spy, kernel_report.softmax_cases(N, S if sampled else V, P, dtype, INTERPRETER, sampled=sampled,
                                            train=True, groups=groups))


@requires_triton
@DTYPES
@pytest.mark.parametrize("reverse,residual", [(False, False), (True, True)])
def test_lstmp_launches_match_report(spy, dtype, reverse, residual):
    import kernel_report

    from elmo_fast.kernels._common import INTERPRETER
    from elmo_fast.kernels.lstmp import lstmp_triton

    B, T, H, P = 3, 4, 12, 5
    D = P if residual else 7

    def rnd(*shape):
        return (torch.randn(*shape) * 0.5).to(dtype).requires_grad_()

    x, w_in, w_rec, bias, w_proj, h0, c0 = rnd(B, T, D), rnd(D, 4 * H), rnd(P, 4 * H), rnd(4 * H), rnd(H, P), \
        rnd(B, P), rnd(B, H)
    y, h_n, c_n = lstmp_triton(x, w_in, w_rec, bias, w_proj, h0, c0, torch.full((B,), T), cell_clip=3.0,
                               proj_clip=3.0, reverse=reverse, residual=residual)
    (y.float().sum() + h_n.float().sum() + c_n.float().sum()).backward()
    _check(spy, kernel_report.lstmp_cases(B, T, H, P, dtype, INTERPRETER, reverse=reverse, residual=residual,
                                          train=True))



def test_the_h200_softmax_times_come_from_the_committed_rows():
    """The softmax L2 table's measured times are the H200's rows (gpu_h200.md's targets table: 4.00 and 7.45 ms)."""
    import kernel_report

    assert kernel_report.h200_softmax_ms() == 3.9986
    assert kernel_report.h200_softmax_ms("full_softmax_nll", "fwd", "N=2048,P=512,V=793471") == 7.4452


def test_softmax_l2_bytes_and_chunks_by_hand():
    """The sampled softmax's dlogit launch at the training shape (bf16, 128 x 128 tiles): 60 x 64 tiles each read
    (128 + 128) rows of 512, then dlogit (7680 x 8192, 2 bytes) and 60 x 8192 fp32 bias partials are written; the
    full softmax's backward covers V in whole chunks plus one partial chunk."""
    import kernel_report

    from elmo_fast.kernels import softmax as KS
    from elmo_fast.kernels._common import H100

    built = kernel_report.softmax_cases(7680, 8192, 512, torch.bfloat16, H100, sampled=True, train=True)
    (fwd,), (bwd,) = built
    assert bwd[1].kernel is KS._softmax_dlogit_kernel and bwd[1].grid == (60, 64, 1)
    assert bwd[7] == 60 * 64 * 256 * 512 * 2 + 7680 * 8192 * 2 + 60 * 8192 * 4 and bwd[8] == 1
    assert fwd[7] == 60 * 64 * 256 * 512 * 2 + fwd[1].grid[1] * 7680 * 8
    # the original config fused: 3 towers x 2 directions, 2,560 rows each, one call
    (fwd6,), (bwd6,) = kernel_report.softmax_cases(2560, 8192, 512, torch.bfloat16, H100, sampled=True, train=True,
                                                   groups=6)
    assert bwd6[1].grid == (20, 64, 6) and fwd6[1].grid[::2] == (20, 6)
    assert bwd6[7] == 6 * (20 * 64 * 256 * 512 * 2 + 2560 * 8192 * 2 + 20 * 8192 * 4) and bwd6[8] == 1
    assert bwd6[3] == 6 * 2.0 * 2560 * 8192 * 512 == bwd[3] * 2
    V = 793471
    full = kernel_report.softmax_cases(7680, V, 512, torch.bfloat16, H100, sampled=False, train=True)[1:]
    cw = KS.dlogit_columns(7680, V, 2)
    assert cw * 7680 * 2 <= KS.DLOGIT_BYTES and cw % 128 == 0
    assert sum(e[0][-1] * e[0][2][-2] for e in full) == V  # launches x columns each


def test_report_subset_compiles_for_sm90(tmp_path):
    """One variant of every kernel function compiled for sm_90a without a GPU (about a minute on 2 cores)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_report.py"), "--subset", "--check", "--out",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "kernel_report.csv") as fh:
        rows = list(csv.DictReader(fh))
    kernels = {r["kernel"] for r in rows}
    assert {"_char_cnn_fwd_kernel", "_highway_fused_kernel", "_softmax_dlogit_kernel", "_fwd_cell_kernel"} <= kernels
    assert all(r["regs"] and int(r["regs"]) > 0 for r in rows)
    assert all(r["target"].startswith("sm_90a") and r["compiled_on"] and r["commit"] for r in rows)  # where from


def test_warm_cache_compiles_into_tritons_own_cache(tmp_path):
    """``--warm-cache`` (gpu-check's precompile) leaves the compiled variants in triton's cache (TRITON_CACHE_DIR
    here), where a later compile of the same key finds them: a second run compiles nothing (no ptxas counts);
    without it the report compiles in a temporary cache and leaves nothing there."""
    pytest.importorskip("triton")
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)

    def report(*flags):
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_report.py"), "--subset", "--only", "highway",
                            "--jobs", "1", "--out", str(out), *flags], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        with open(out / "kernel_report.csv") as fh:
            return list(csv.DictReader(fh))

    rows = report()
    assert rows and all(int(r["regs"]) > 0 for r in rows) and not cache.exists()
    rows = report("--warm-cache")
    assert all(int(r["regs"]) > 0 for r in rows)  # compiled here, ptxas ran
    assert {r["kernel"] for r in rows} == {p.stem for p in cache.rglob("*.cubin")}
    assert all(int(r["regs"]) == 0 and r["hgmma"] == rows[i]["hgmma"]  # found in the cache: no ptxas, same SASS
               for i, r in enumerate(report("--warm-cache")))


def test_the_h200_chains_come_from_the_committed_rows():
    """The measured chains the calibrated table sets beside its estimates are the H200's rows (gpu_h200.md's table)."""
    import kernel_report

    got = kernel_report.h200_chain_ms()
    assert set(got) == {(f"train B={b}", d) for b in (128, 384) for d in ("bf16", "fp32")}
    assert got[("train B=384", "bf16")] == (1.4947, 4.2078, 1.2407, 3.11)  # triton fwd, fwd+bwd; cuDNN fwd, fwd+bwd


def test_tuned_times_each_candidate_once_per_key_and_keeps_the_fastest(monkeypatch):
    """The GPU autotune path of ``_common.tuned`` (timings faked: no GPU here)."""
    import triton.testing

    from elmo_fast.kernels import _common

    class Kernel:
        __name__ = "_fake_kernel"
        runs: list = []

        def __getitem__(self, grid):
            return lambda *args, **meta: self.runs.append((grid, meta["X"], args))

    k = Kernel()
    cands = [_common.Launch(k, (1,), {"X": 0}), _common.Launch(k, (2,), {"X": 1}), _common.Launch(k, (3,), {"X": 2})]
    times = iter([2.0, 1.0, 3.0])
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), next(times))[1])
    monkeypatch.setattr(_common, "CHOSEN", {})
    _common.tuned(cands, (7, "bf16"), "a")
    assert [r[1] for r in k.runs] == [0, 1, 2, 1]  # each timed once, then the fastest runs for real
    assert _common.CHOSEN[("_fake_kernel", 7, "bf16")]["index"] == 1
    k.runs.clear()
    _common.tuned(cands, (7, "bf16"), "b")
    assert k.runs == [((2,), 1, ("b",))]  # recorded per key: no second timing
    k.runs.clear()
    _common.tuned(cands[:1], (8, "bf16"), "c")
    assert k.runs == [((1,), 0, ("c",))] and len(_common.CHOSEN) == 1  # one candidate: launched, never timed
