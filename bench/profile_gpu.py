"""Where each fused op's GPU time goes: the ops that missed their targets on the H200 (bench/results/gpu_h200.md),
each called a few times under torch.profiler after a warm-up (``common.device_profile``): the kernels by device
time (CUDA-graph replays included), the host ops by self time, and the share of the wall time the GPU was busy.

    python3 bench/profile_gpu.py [--ops lstmp,softmax,encoder] [--calls 3]    # GPU: the bf16 target shapes
    python bench/profile_gpu.py --tiny                                       # CPU smoke (interpreter): tiny shapes

* ``lstmp``: one LSTMP chain forward+backward, B=384, T=20, 512 -> 4096 -> 512 (0.74x cuDNN there);
* ``softmax``: the sampled softmax forward+backward, N=7,680, S=8,192, V=793,471 (0.82x unfused torch; its three
  kernels' estimate is ~0.5 ms of the 4.0 measured);
* ``encoder``: the token encoder (char CNN, 2 highway, projection) forward+backward over 7,680 tokens.

Prints only; nothing is appended to a results table (the numbers under the profiler are not the benchmark's).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lstmp  # noqa: E402
import bench_softmax  # noqa: E402
import bench_token_encoder  # noqa: E402
import common  # noqa: E402

from elmo_fast.kernels.lstmp import lstmp_triton  # noqa: E402

OPS = ("lstmp", "softmax", "encoder")
FULL = dict(lstmp=dict(B=384, T=20, D=512, H=4096, P=512), softmax=dict(N=7680, P=512, V=793_471, S=8192),
            encoder=dict(tokens=7680, cfg=bench_token_encoder.ORIGINAL))
TINY = dict(lstmp=dict(B=3, T=4, D=16, H=32, P=16), softmax=dict(N=12, P=16, V=300, S=20),
            encoder=dict(tokens=10, cfg=bench_token_encoder.SMALL))


def lstmp_call(B, T, D, H, P, dtype, device):
    chain = bench_lstmp.make_chain(B, T, D, H, P, dtype, device, requires_grad=True)
    up = [torch.randn(B, T, P, device=device, dtype=dtype), torch.randn(B, P, device=device, dtype=dtype),
          torch.randn(B, H, device=device, dtype=dtype)]
    return lambda: bench_lstmp.fwd_bwd(lstmp_triton, chain, up)


def softmax_call(N, P, V, S, dtype, device):
    prob = bench_softmax.make_problem(N, P, V, S, dtype, device)
    return lambda: bench_softmax.sampled_step(*prob, "triton")


def encoder_call(tokens, cfg, dtype, device):
    ids = bench_token_encoder.token_ids(tokens).to(device)
    p = bench_token_encoder.make_params(cfg, dtype, device)
    params = [t.requires_grad_() for t in bench_token_encoder.leaves(p)]
    run = bench_token_encoder.elmo_fast_encoder("triton")
    g = torch.randn(tokens, p["W_proj"].shape[1], device=device, dtype=dtype)
    return lambda: bench_token_encoder._fwd_bwd(run, ids, p, params, g)


CALLS = dict(lstmp=lstmp_call, softmax=softmax_call, encoder=encoder_call)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    ap.add_argument("--calls", type=int, default=3, help="profiled calls per op (after 2 warm-up calls)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke run of this script)")
    a = ap.parse_args(argv)
    ops = a.ops.split(",")
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        ap.error(f"unknown op(s) {unknown}; the ops are: {', '.join(OPS)}")
    if not a.tiny and not torch.cuda.is_available():
        print("profile_gpu: no CUDA GPU; `--tiny` runs the smoke version on the CPU")
        return 0
    device = torch.device("cpu" if a.tiny else "cuda")
    dtype = torch.float32 if a.tiny else torch.bfloat16  # the interpreter's bf16 dots are slow; fp32 for the smoke
    for op in ops:
        shape = (TINY if a.tiny else FULL)[op]
        call = CALLS[op](**shape, dtype=dtype, device=device)
        for _ in range(2):
            call()
        what = shape if op != "encoder" else f"{shape['tokens']} tokens"
        common.print_device_profile(f"{op} {what} {str(dtype).split('.')[-1]} forward+backward",
                                    common.device_profile(call, a.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
