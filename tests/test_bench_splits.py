"""bench/bench_lstmp.py's split-K alternatives (``bench_splits``): the GPU run ranks the projection's and the
recurrent backward's tiles by timing each with its reduce kernel; here the same code runs at a small shape on
``triton_device()`` (under the interpreter in CI), so the first GPU run cannot fail on plumbing, and an alternative
whose result differs from the tuned tile's stops it."""
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_triton, triton_device

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = [pytest.mark.triton, requires_triton]

DIMS = dict(D=16, H=32, P=16)


def _alternatives():
    from elmo_fast.kernels.lstmp import Tile

    return {"fwd_proj": (None, Tile(16, 16, 16)), "bwd_rec": (None, Tile(16, 32, 16))}


def test_every_alternative_is_timed_and_checked_against_the_tuned_tile():
    import bench_lstmp

    rows = bench_lstmp.bench_splits(batches=(5,), dtypes=(torch.float32,), T=4, dims=DIMS, device=triton_device(),
                                    alternatives=_alternatives())
    assert [(r["kernel"], r["tile"].endswith("(tuned)")) for r in rows] == [
        ("fwd_proj+fwd_reduce", True), ("fwd_proj+fwd_reduce", False),
        ("bwd_rec+bwd_reduce", True), ("bwd_rec+bwd_reduce", False)]
    assert all(float(r["us_p50"]) > 0 and float(r["est_us"]) >= 0 and r["ratio"] for r in rows)
    assert set(bench_lstmp.KERNEL_FIELDS) >= set(rows[0]) - {"note"}


def test_an_alternative_with_a_different_result_stops_the_run(monkeypatch):
    import bench_lstmp

    from elmo_fast.kernels import lstmp as KL

    real = KL._run
    alternative = _alternatives()["fwd_proj"][1]

    def corrupt(launch, bufs, s, **kw):  # the alternative projection's partials come out scaled
        real(launch, bufs, s, **kw)
        if launch.kernel is KL._splitk_kernel and launch.tile == alternative:
            bufs["part"].mul_(3.0)

    monkeypatch.setattr(KL, "_run", corrupt)
    with pytest.raises(AssertionError, match="fwd_proj with Tile.*differs from the tuned tile's result"):
        bench_lstmp.bench_splits(batches=(5,), dtypes=(torch.float32,), T=4, dims=DIMS, device=triton_device(),
                                 alternatives=_alternatives())


# ------------------------------------------------------------------------------------- cell-kernel tiles
def _cell_tiles():
    from elmo_fast.kernels.lstmp import Tile

    return {"fwd_cell": (None, Tile(16, 16, 16, 4, 2)), "bwd_cell": (None, Tile(16, 16, 16, 4, 2))}


def test_every_cell_tile_is_timed_and_checked_against_the_tuned_tile():
    import bench_lstmp

    rows = bench_lstmp.bench_tiles(batches=(5,), dtypes=(torch.float32,), T=4, dims=DIMS, device=triton_device(),
                                   alternatives=_cell_tiles())
    assert [(r["kernel"], r["tile"].endswith("(tuned)")) for r in rows] == [
        ("fwd_cell", True), ("fwd_cell", False), ("bwd_cell", True), ("bwd_cell", False)]
    assert all(float(r["us_p50"]) > 0 and r["ratio"] for r in rows)


def test_a_cell_tile_with_a_different_result_stops_the_run(monkeypatch):
    import bench_lstmp

    from elmo_fast.kernels import lstmp as KL

    real = KL._run
    alternative = _cell_tiles()["bwd_cell"][1]

    def corrupt(launch, bufs, s, **kw):  # the alternative's gate gradients come out scaled
        real(launch, bufs, s, **kw)
        if launch.kernel is KL._bwd_cell_kernel and launch.tile == alternative:
            bufs["dz"].mul_(3.0)

    monkeypatch.setattr(KL, "_run", corrupt)
    with pytest.raises(AssertionError, match="bwd_cell with Tile.*differs from the tuned tile's result"):
        bench_lstmp.bench_tiles(batches=(5,), dtypes=(torch.float32,), T=4, dims=DIMS, device=triton_device(),
                                alternatives=_cell_tiles())


def test_the_gpu_short_list_comes_from_the_compile_search():
    import bench_lstmp

    tiles = bench_lstmp._tile_alternatives("fwd_cell", 384, torch.bfloat16, top=4)
    assert tiles[0] is None and len(tiles) == 5 and len(set(tiles[1:])) == 4
