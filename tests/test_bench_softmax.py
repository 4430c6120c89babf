"""bench/bench_softmax.py's per-kernel rows (``kernel_rows``: each softmax Triton kernel alone, its time, its L2 count
and that count over the time). The GPU run times them at the training and evaluation shapes; here the same code runs
at small shapes on ``triton_device()`` (under the interpreter in CI), so the first GPU run cannot fail on plumbing."""
import csv
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_triton, triton_device

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = [pytest.mark.triton, requires_triton]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_rows_time_each_softmax_kernel_with_its_l2_count(dtype, tmp_path, monkeypatch):
    import bench_softmax
    import kernel_report

    from elmo_fast.kernels import softmax as KS
    from elmo_fast.kernels._common import target_of

    N_s, S, P, V, N_f = 37, 45, 40, 70, 21
    rows = bench_softmax.kernel_rows(N_s, S, P, V, N_f, dtype=dtype, device=triton_device(), reps=1)
    assert [(r["op"], r["mode"], r["kernel"]) for r in rows] == [
        ("sampled_softmax", "fwd", "_softmax_lse_fwd_kernel"), ("sampled_softmax", "bwd", "_softmax_dlogit_kernel"),
        ("full_softmax_nll", "fwd", "_softmax_lse_fwd_kernel")]
    e = dtype.itemsize
    dl = KS.dlogit_launch(N_s, S, P, dtype, target_of(torch.device(triton_device())), gather=True, mask_hits=True,
                          sub_target=False)
    want = kernel_report.softmax_l2_bytes(dl, N_s, S, P, e)  # the report's count (checked by hand there)
    assert rows[1]["l2_gb"] == f"{want / 1e9:.4g}" and rows[1]["grid"] == "x".join(map(str, dl.grid))
    assert all(float(r["us_p50"]) > 0 and float(r["l2_tbps"]) > 0 and float(r["l2_gb"]) > 0 for r in rows)
    monkeypatch.setenv("ELMO_FAST_BENCH_KERNEL_CSV", str(tmp_path / "k.csv"))
    bench_softmax._print_kernels(rows)  # what the GPU entry points do with them: print, then append
    with open(tmp_path / "k.csv") as fh:
        got = list(csv.DictReader(fh))
    assert len(got) == 3 and all(r["commit"] and r["device"] for r in got)  # where each row ran


def test_groups_rows_time_the_grouped_call_against_one_call_a_group(tmp_path, monkeypatch):
    """``groups_rows`` (the GPU run's comparison of the trainer's grouped call with one call a group) at a small
    shape on ``triton_device()``: both providers' rows, after their agreement check; printed and appended as the
    GPU entry points do."""
    import bench_softmax

    rows = bench_softmax.groups_rows(21, 40, 24, 300, groups=3, dtype=torch.float32, device=triton_device(), reps=1)
    assert [r["provider"] for r in rows] == ["triton-calls", "triton-groups"]
    assert all(r["shape"] == "groups=3,N=21,S=40,P=24,V=300" and float(r["ms_p50"]) > 0 for r in rows)
    monkeypatch.setenv("ELMO_FAST_BENCH_CSV", str(tmp_path / "s.csv"))
    bench_softmax._print(rows)
    bench_softmax.write_rows(rows)
    with open(tmp_path / "s.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 2
