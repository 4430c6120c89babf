"""Benchmark one LSTMP chain on a GPU: the persistent CUDA kernel (backend='cuda') beside the Triton path
(backend='triton') and torch.nn.LSTM(proj_size=P) (cuDNN; no clipping, so a speed bar, not an oracle).

    python bench/bench_lstmp_cuda.py [--csv bench_out/lstmp_cuda.csv] [--batches 1,16,64,384] [--steps 20]

Shapes: H=4096, P=512, D=512 (ELMo's chain), bf16, T=20, all rows full length. Modes: fwd (inference,
no_grad) and fwd+bwd (random upstream gradient on y). Per provider and shape: p50/p20/p80 ms, per-step µs
(= p50 / T) and TFLOP/s with FLOP = 2*B*T*(D*4H + P*4H + H*P) for fwd, 3x that for fwd+bwd.
Rows carry the device, torch/triton/CUDA versions, git commit and the command; they go to ``--csv``, else
build/bench/lstmp_cuda.csv, or the committed bench/results/lstmp_cuda.csv with ``ELMO_FAST_BENCH_RECORD=1``
(bench/common.py). Without a GPU it prints a
skip line and exits 0. Importing this file runs nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

FIELDS = ["op", "provider", "mode", "B", "T", "D", "H", "P", "dtype", "ms_p50", "ms_p20", "ms_p80", "us_per_step",
          "tflops", "status", "device", "torch", "triton", "cuda", "commit", "command"]


def _timer():
    import torch

    try:
        import triton.testing  # noqa: F401

        def run(fn):
            return common.gpu_time_ms(fn, warmup_ms=25, rep_ms=200)
        return run
    except Exception:  # noqa: BLE001
        def run(fn):
            for _ in range(5):
                fn()
            times = []
            for _ in range(30):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            times.sort()
            q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
            return q(0.5), q(0.2), q(0.8)
        return run


def _bench_shape(B, T, args, timer, meta) -> list[dict]:
    import torch

    from elmo_fast.ops.lstmp import lstmp

    dev, dtype = torch.device("cuda"), torch.bfloat16
    D, H, P = 512, 4096, 512
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s, sc=1.0):
        return (torch.randn(*s, generator=g, device=dev) * sc).to(dtype)

    x = r(B, T, D)
    w_in, w_rec, bias = r(D, 4 * H, sc=D ** -0.5), r(P, 4 * H, sc=P ** -0.5), r(4 * H, sc=0.1)
    w_proj, h0, c0 = r(H, P, sc=H ** -0.5), r(B, P, sc=0.1), r(B, H, sc=0.1)
    lengths = torch.full((B,), T, dtype=torch.long, device=dev)
    dy = r(B, T, P)
    flops_fwd = 2.0 * B * T * (D * 4 * H + P * 4 * H + H * P)
    for provider in args.providers.split(","):
        if provider == "torch_lstm":
            mod = torch.nn.LSTM(D, H, proj_size=P, batch_first=True).to(dev, dtype)
            hc = (h0.unsqueeze(0).contiguous(), c0.unsqueeze(0).contiguous())

            def call(xx, _m=mod, _hc=hc):
                return _m(xx, _hc)[0]
            params = list(mod.parameters())
        else:
            def call(xx, _p=provider, **_):
                return lstmp(xx, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=3.0, proj_clip=3.0,
                             backend=_p)[0]
            params = [w_in, w_rec, bias, w_proj]
        for mode in args.modes.split(","):
            row = dict(op="lstmp", provider=provider, mode=mode, B=B, T=T, D=D, H=H, P=P, dtype="bf16", **meta)
            try:
                if mode == "fwd":
                    def fn(_c=call):
                        with torch.no_grad():
                            _c(x)
                    flops = flops_fwd
                else:
                    xg = x.detach().requires_grad_(True)
                    for p_ in params:
                        p_.requires_grad_(True)

                    def fn(_c=call, _xg=xg, _ps=params):
                        for t_ in [_xg, *_ps]:
                            t_.grad = None
                        _c(_xg).backward(dy)
                    flops = 3 * flops_fwd
                fn()
                torch.cuda.synchronize()
                p50, p20, p80 = timer(fn)
                row.update(ms_p50=f"{p50:.4f}", ms_p20=f"{p20:.4f}", ms_p80=f"{p80:.4f}",
                           us_per_step=f"{1000 * p50 / T:.2f}", tflops=f"{flops / (p50 * 1e-3) / 1e12:.2f}",
                           status="ok")
            except Exception as exc:  # noqa: BLE001 - a provider that cannot run is reported, not fatal
                row.update(ms_p50="", ms_p20="", ms_p80="", us_per_step="", tflops="",
                           status=f"error: {type(exc).__name__}: {str(exc)[:160]}")
            finally:
                for p_ in params:
                    p_.requires_grad_(False)
            rows.append(row)
            print(f"{provider:>10} {mode:>8} B={B:<4} p50={row['ms_p50'] or '-':>9} ms "
                  f"step={row['us_per_step'] or '-':>8} us  {row['tflops'] or '-':>6} TFLOP/s  {row['status']}",
                  flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default=None,
                    help="CSV to append to (default: lstmp_cuda.csv where bench/common.py's results_dir() says)")
    ap.add_argument("--batches", default="1,16,64,384")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--providers", default="cuda,triton,torch_lstm")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench_lstmp_cuda: skipped (no CUDA GPU)")
        return 0
    meta = {k: v for k, v in common.environment().items() if k in FIELDS}
    timer = _timer()
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        rows += _bench_shape(B, args.steps, args, timer, meta)
    common.append_rows("lstmp_cuda", rows, FIELDS, args.csv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
