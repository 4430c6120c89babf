"""Launches, host syncs and pageable uploads per biLM forward (batch 1 x 20 tokens) and per training step (the
original configuration's structure; also in deterministic mode) stay within the design's budget
(bench/bench_launches.py, BUDGET): syncs and uploads at most the budget, launches exactly the design's count (a
launch that goes missing is a code path that stopped running)."""
import functools
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_launches  # noqa: E402

pytestmark = [pytest.mark.triton, requires_triton]


@functools.lru_cache(maxsize=None)
def _train_steps(dev: torch.device) -> dict:
    return bench_launches.measure_train_steps(dev)  # two cases from one trainer (the suite's slowest tests)


@pytest.mark.parametrize("case", ["forward", "train-step", "train-step-det", "train-step-loop-graphs"])
def test_launches_and_syncs_within_budget(case):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if case == "forward":
        row = bench_launches.measure_forward(dev)
    elif case == "train-step-det":
        row = bench_launches.measure_train_step(dev, deterministic=True)
    else:
        row = _train_steps(dev)[case]
    budget = bench_launches.BUDGET[case]
    assert row["triton_launches"] == budget["launches"], row  # exact: fewer launches is a path not taken
    assert row["host_syncs"] <= budget["syncs"], row
    assert row["pageable_uploads"] <= budget["uploads"], row
