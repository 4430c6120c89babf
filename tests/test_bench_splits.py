"""bench/bench_lstmp.py's tile sweeps: ``bench_splits`` (the projection's and the recurrent backward's split-K
tiles, each timed with its reduce kernel) and ``bench_tiles`` (the cell kernels' tiles, each timed alone). The GPU
run ranks the alternatives by the clock; here the same code runs at a small shape on ``triton_device()`` (under the
interpreter in CI), so the first GPU run cannot fail on plumbing, and an alternative whose result differs from the
tuned tile's stops it."""
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_triton, triton_device

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = [pytest.mark.triton, requires_triton]

DIMS = dict(D=16, H=32, P=16)


def _alternatives(sweep: str) -> dict:
    from elmo_fast.kernels.lstmp import Tile

    if sweep == "splits":
        return {"fwd_proj": (None, Tile(16, 16, 16)), "bwd_rec": (None, Tile(16, 32, 16))}
    # fp32: the tuned forward cell kernel runs one dot per gate, the third alternative the fused design
    return {"fwd_cell": (None, Tile(16, 16, 16, 4, 2), Tile(16, 16, 16, 4, 2, fused=True)),
            "bwd_cell": (None, Tile(16, 16, 16, 4, 2))}


def _sweep(sweep: str):
    import bench_lstmp

    fn = bench_lstmp.bench_splits if sweep == "splits" else bench_lstmp.bench_tiles
    return fn(batches=(5,), dtypes=(torch.float32,), T=4, dims=DIMS, device=triton_device(),
              alternatives=_alternatives(sweep))


@pytest.mark.parametrize("sweep,kernels", [("splits", ["fwd_proj+fwd_reduce", "bwd_rec+bwd_reduce"]),
                                           ("tiles", ["fwd_cell", "bwd_cell"])])
def test_every_alternative_is_timed_and_checked_against_the_tuned_tile(sweep, kernels):
    import bench_lstmp

    rows = _sweep(sweep)
    alternatives = _alternatives(sweep)
    assert [(r["kernel"], r["tile"].endswith("(tuned)")) for r in rows] == [
        (k, t is None) for k in kernels for t in alternatives[k.split("+")[0]]]
    assert all(float(r["us_p50"]) > 0 and float(r["est_us"]) >= 0 and r["ratio"] for r in rows)
    assert set(bench_lstmp.KERNEL_FIELDS) >= set(rows[0]) - {"note"}


@pytest.mark.parametrize("sweep,name,kernel,buffer", [("splits", "fwd_proj", "_splitk_kernel", "part"),
                                                      ("tiles", "bwd_cell", "_bwd_cell_kernel", "dz")])
def test_an_alternative_with_a_different_result_stops_the_run(monkeypatch, sweep, name, kernel, buffer):
    from elmo_fast.kernels import lstmp as KL

    real = KL._bind
    alternative = _alternatives(sweep)[name][1]

    def corrupt(launch, bufs, **kw):  # the alternative's output (partials / gate gradients) comes out scaled
        run = real(launch, bufs, **kw)

        def step(s):
            run(s)
            if launch.kernel is getattr(KL, kernel) and launch.tile == alternative:
                bufs[buffer].mul_(3.0)
        return step

    monkeypatch.setattr(KL, "_bind", corrupt)  # every launch of the sweeps (``_run`` binds through it too)
    with pytest.raises(AssertionError, match=f"{name} with Tile.*differs from the tuned tile's result"):
        _sweep(sweep)


def test_tile_sweep_across_row_block_counts():
    """Alternatives whose row blocks differ in number from the tuned tile's (40 rows: 2 blocks of 32, 3 of 16, one
    stationary group over 3 blocks): the backward cell kernel's bias partials (a row per step and row block) get a
    buffer per tile and are compared as each step's column sums, so every alternative is timed."""
    import bench_lstmp

    from elmo_fast.kernels.lstmp import Tile

    alternatives = {"fwd_cell": (None, Tile(16, 16, 0, 4, 1, fused=True, stationary=True)),
                    "bwd_cell": (None, Tile(16, 16, 16, 4, 2), Tile(16, 16, 0, 4, 1, stationary=True))}
    rows = bench_lstmp.bench_tiles(batches=(40,), dtypes=(torch.float32,), T=4, dims=DIMS, device=triton_device(),
                                   alternatives=alternatives)
    assert [r["kernel"] for r in rows] == ["fwd_cell"] * 2 + ["bwd_cell"] * 3
    assert rows[1]["tile"].endswith("stationary g1") and rows[4]["grid"] == "1x2"


def test_the_gpu_short_list_comes_from_the_compile_search():
    """The tuned tile, for the forward cell kernel the same tile in the other design (for a stationary one, the
    fused tile it replaced), for a retuned kernel the tile it replaced, and the occupancy probe, each in place of the
    last of the ``top`` other candidates (in the tuned design)."""
    import dataclasses

    import bench_lstmp

    from elmo_fast.kernels import lstmp as KL

    tuned = KL._tile("fwd_cell", 128, torch.bfloat16, KL.H100)
    tiles = bench_lstmp._tile_alternatives("fwd_cell", 128, torch.bfloat16, top=4)
    assert not tuned.stationary and tiles[0] is None and len(tiles) == 5
    assert tiles[1] == dataclasses.replace(tuned, fused=not tuned.fused)
    assert len(set(tiles[2:])) == 3 and tuned not in tiles[2:] and all(t.fused == tuned.fused for t in tiles[2:])
    tuned = KL._tile("fwd_cell", 384, torch.bfloat16, KL.H100)
    tiles = bench_lstmp._tile_alternatives("fwd_cell", 384, torch.bfloat16, top=4)
    assert not tuned.stationary and tiles[0] is None and len(tiles) == 5 and len(set(tiles[1:])) == 4
    assert tiles[1] == dataclasses.replace(tuned, fused=not tuned.fused)  # the per-gate design
    assert tiles[2] == KL.Tile(64, 32, 0, 8, 1, fused=True, stationary=True)  # the stationary tile it replaced
    assert tiles[2] == KL.Tile(**bench_lstmp.REPLACED[("fwd_cell", "16bit", 384)], fused=True)
    assert tiles[3] == KL.Tile(**bench_lstmp.PROBES[("fwd_cell", "16bit", 384)], fused=tuned.fused)
    assert tuned not in tiles[1:] and all(t.fused for t in tiles[2:])
    tiles = bench_lstmp._tile_alternatives("bwd_cell", 384, torch.bfloat16, top=4)
    assert tiles[0] is None and len(tiles) == 5 and len(set(tiles[1:])) == 4
    assert tiles[1] == KL.Tile(**bench_lstmp.REPLACED[("bwd_cell", "16bit", 384)])  # the tile the tuned one replaced
    assert tiles[2] == KL.Tile(**bench_lstmp.PROBES[("bwd_cell", "16bit", 384)])  # more programs an SM
    assert KL._tile("bwd_cell", 384, torch.bfloat16, KL.H100) not in tiles[1:]
