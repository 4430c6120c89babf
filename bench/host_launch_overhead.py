"""Our own Python per eager LSTMP launch: the forward time loop (``kernels/lstmp._fwd_loop``) with every kernel's run
stubbed out, so what is timed is the host work of the loop and of the launch path up to Triton's run (arguments,
options, the tracing check), not Triton's launcher or the kernel. On a GPU an eager launch costs this plus Triton's
launcher (the H200 took ~42 µs a launch in all, bench/results/gpu_h200.md); loop-graph replays do not run it.

    TRITON_INTERPRET=1 python bench/host_launch_overhead.py [--B 1] [--T 20] [--calls 200] [--repeats 3]
    TRITON_INTERPRET=1 python bench/host_launch_overhead.py --train-step

``--train-step``: the host time of a whole ``Trainer.train_step`` (backend triton) at the original configuration's
structure and small widths (``bench_launches._trainer``: its torch operators compute little), kernels stubbed, each
loop-graph replay one call that launches nothing (as a CUDA graph's replay is one call): one tower and 3 towers
fused, loop graphs on and off. A floor of the host's share of a GPU training step on this CPU, beside Triton's
launcher and the driver, which it leaves out.

CPU only (the interpreter's kernels, stubbed); prints device, versions, commit and µs a launch (the best repeat).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # as a script only: an import (the tests) must not switch the interpreter on for the rest
    os.environ.setdefault("TRITON_INTERPRET", "1")  # of its process (on a GPU machine it turned PDL off, 2026-11-27)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


@contextlib.contextmanager
def kernels_stubbed():
    """Every interpreted kernel's run does nothing inside the block (the launch path up to it runs as usual)."""
    from triton.runtime.interpreter import InterpretedFunction

    from elmo_fast._backend import triton_interpret

    if not triton_interpret():
        raise RuntimeError("host_launch_overhead stubs the Triton interpreter's kernels: set TRITON_INTERPRET=1 "
                           "before Python starts (it measures the host's launch path on the CPU, not a GPU's)")

    real = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        InterpretedFunction.run = real


def measure(B: int = 1, T: int = 20, H: int = 4096, P: int = 512, calls: int = 200, repeats: int = 3) -> float:
    """µs of host time per launch of the forward time loop at (B, T, H, P) fp32 with the kernels stubbed: the best
    of ``repeats`` runs of ``calls`` loops."""
    from elmo_fast.kernels import lstmp as KL

    w_in, w_rec, w_proj = torch.randn(P, 4 * H), torch.randn(P, 4 * H), torch.randn(H, P)
    plan, bufs = KL.fwd_setup(torch.randn(B, T, P), w_in, w_rec, torch.randn(4 * H), w_proj, torch.zeros(B, P),
                              torch.zeros(B, H), torch.full((B,), T), cell_clip=3.0, proj_clip=3.0, forget_bias=1.0,
                              reverse=False, residual=False, save=False)
    launches = T * sum(k in plan for k in ("fwd_cell", "fwd_proj", "fwd_reduce"))
    best = float("inf")
    with kernels_stubbed():
        KL._fwd_loop(plan, bufs)  # warm
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                KL._fwd_loop(plan, bufs)
            best = min(best, (time.perf_counter() - t0) / calls / launches)
    return best * 1e6


def measure_train_step(towers: int = 1, graphs: bool = True, steps: int = 9, unroll: int | None = None) -> float:
    """ms of host time per training step (module docstring), the median of ``steps`` timed steps after 6 warm ones
    (3 with the kernels running: compiles, loop-graph captures); ``unroll`` steps a row (the original's 20)."""
    import bench_launches

    from elmo_fast.kernels import lstmp_graphs

    dev = torch.device("cpu")
    with bench_launches._trainer(dev, False, unroll or bench_launches.STEPS, towers) as tr, \
            common.loop_graphs(graphs, dev):
        for _ in range(3):
            tr.train_step()
        real = lstmp_graphs.launch_kernel
        lstmp_graphs.launch_kernel = lambda *a: None  # a replay launches nothing: one call, as a CUDA graph's
        try:
            with kernels_stubbed():
                for _ in range(3):
                    tr.train_step()
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    tr.train_step()
                    times.append(time.perf_counter() - t0)
        finally:
            lstmp_graphs.launch_kernel = real
    return sorted(times)[steps // 2] * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=20)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-step", action="store_true", help="host ms per training step instead (docstring)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    env = common.environment()
    if a.train_step:
        for towers in (1, 3):
            for graphs in (True, False):
                ms = measure_train_step(towers, graphs)
                print(f"{ms:.2f} ms of host time per training step ({towers} tower{'s fused' if towers > 1 else ''}, "
                      f"loop graphs {'on' if graphs else 'off'}, kernels stubbed, small widths); {env['device']}, "
                      f"torch {env.get('torch')}, commit {env['commit']}, {env['date']}")
        return 0
    us = measure(a.B, a.T, calls=a.calls, repeats=a.repeats)
    print(f"{us:.2f} µs of Python per eager LSTMP launch (forward loop, B={a.B}, T={a.T}, kernels stubbed); "
          f"{env['device']}, torch {env.get('torch')}, commit {env['commit']}, {env['date']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
