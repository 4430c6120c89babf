"""Launches, host syncs and pageable uploads per biLM forward and per training step (the original configuration's
structure; also in deterministic mode) stay within the design's budget (bench/bench_launches.py, BUDGET at 20
tokens / unroll steps; ``budget(case, steps)`` scales the LSTMP launches): syncs and uploads at most the budget,
launches exactly the design's count (a launch that goes missing is a code path that stopped running). The tests
run 4 tokens / steps: under the interpreter a 20-step training step takes ~40 s on a slow 2-core machine, and
what the count checks (every path taken once per step, nothing per step that syncs) shows at any T."""
import functools
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_triton, triton_device

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_launches  # noqa: E402

# Where the Triton kernels' tensors live, chosen once at import (as test_lstmp_triton.py does): a test's
# device cannot change with the environment at run time.
DEV = triton_device()

pytestmark = [pytest.mark.triton, requires_triton]


STEPS = 4


@functools.lru_cache(maxsize=None)
def _train_steps(dev: torch.device) -> dict:
    return bench_launches.measure_train_steps(dev, STEPS)  # two cases from one trainer (the suite's slowest tests)


def test_budget_at_a_few_steps_is_the_designs_count_scaled():
    """The scaled budget is the design's formula: 4 chains x (steps + 2 boundaries) x 3 launches + char CNN and 2
    highway in a forward; 4 chains x (6 a step + 1) + 13 encoder and softmax launches + 12 dropout launches (6 sites,
    forward and backward) in a training step."""
    assert [bench_launches.budget(c, 20) for c in bench_launches.BUDGET] == list(bench_launches.BUDGET.values())
    assert bench_launches.budget("forward", STEPS)["launches"] == 4 * (STEPS + 2) * 3 + 3
    assert bench_launches.budget("train-step", STEPS)["launches"] == 4 * (6 * STEPS + 1) + 13 + 12
    assert bench_launches.budget("train-step-det", STEPS)["launches"] == 4 * (6 * STEPS + 1) + 14 + 12
    assert bench_launches.budget("train-step-loop-graphs", STEPS)["launches"] == 4 * 2 + 13 + 12


@pytest.mark.parametrize("case", ["forward", "train-step", "train-step-det", "train-step-loop-graphs",
                                  "train-step-towers3"])
def test_launches_and_syncs_within_budget(case):
    dev = torch.device(DEV)
    if case == "forward":
        row = bench_launches.measure_forward(dev, steps=STEPS)
    elif case == "train-step-det":
        row = bench_launches.measure_train_step(dev, deterministic=True, steps=STEPS)
    elif case == "train-step-towers3":  # the original config's towers fused: one tower's launches
        row = bench_launches.measure_train_step(dev, graphs=True, steps=STEPS, towers=3)
    else:
        row = _train_steps(dev)[case]
    budget = bench_launches.budget(case, STEPS)
    assert row["triton_launches"] == budget["launches"], row  # exact: fewer launches is a path not taken
    assert row["host_syncs"] <= budget["syncs"], row
    assert row["pageable_uploads"] <= budget["uploads"], row


# bench/host_launch_overhead.py measures the interpreter: it stubs InterpretedFunction.run and builds CPU tensors (it
# refuses without the interpreter). Until 77e66e1 its import set TRITON_INTERPRET=1 for the rest of the worker (on
# the H200 the later tests' triton_device() then said "cpu"); so these two run under the interpreter only.
interpreter_only = pytest.mark.skipif(
    DEV != "cpu", reason="measures the interpreter's launch path on CPU tensors (bench/host_launch_overhead.py); "
                         "TRITON_INTERPRET=1 only")


@interpreter_only
def test_host_launch_probe_times_the_loop_and_restores_the_kernels():
    """bench/host_launch_overhead.py (our Python per eager LSTMP launch, kernels stubbed) runs, and the kernels run
    again after it."""
    import host_launch_overhead
    from triton.runtime.interpreter import InterpretedFunction

    real = InterpretedFunction.run
    us = host_launch_overhead.measure(B=2, T=2, H=8, P=4, calls=2, repeats=1)
    assert 0 < us < 1e5 and InterpretedFunction.run is real


@interpreter_only
def test_host_time_of_a_training_step_runs_and_restores_the_launch_paths():
    """``--train-step``: a training step with the kernels stubbed and the loop-graph replays launching nothing; both
    run again after it."""
    import host_launch_overhead
    from triton.runtime.interpreter import InterpretedFunction

    from elmo_fast.kernels import lstmp_graphs

    real, real_launch = InterpretedFunction.run, lstmp_graphs.launch_kernel
    ms = host_launch_overhead.measure_train_step(towers=3, graphs=True, steps=1, unroll=2)
    assert 0 < ms < 1e5 and InterpretedFunction.run is real and lstmp_graphs.launch_kernel is real_launch
