"""Token encoder (char CNN + 2 highway layers + projection): time and peak memory, forward and forward+backward.

Providers, in one run on one device (performance.md, "Baselines"; target: fwd+bwd >= 3x ``library`` with
<= 1/5 of its peak memory, 7,680 tokens):
* ``triton``: ``elmo_fast.ops.char_cnn`` / ``ops.highway`` with backend='triton' (fused kernels) + addmm projection;
* ``reference``: the same ops with backend='reference' (elmo_fast's PyTorch path, length-bucketed convolutions);
* ``library``: nn.Embedding + one nn.Conv1d per width over all 50 positions + max + relu, highway as
  nn.Linear(F, 2F) (allennlp layout), nn.Linear projection: the fastest plain composition. Same function.

Tokens: 7,680 words drawn from ``ENGLISH_WORD_LENGTHS``, an approximate distribution of the character length of
English running-text tokens (punctuation included, mean ~4.6), with random letters, so nearly all are distinct
(the module's dedup would only help further; it is not part of what is timed).

CPU part (pytest-benchmark, small size, reference path):
    python -m pytest -q bench/bench_token_encoder.py [--benchmark-disable]
GPU part (original sizes; rows with device, versions, commit, command appended to build/bench/token_encoder.csv,
or to the committed bench/results/token_encoder.csv with ``ELMO_FAST_BENCH_RECORD=1``; bench/common.py):
    python bench/bench_token_encoder.py            (or the ``gpu`` test below)
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from elmo_fast import ops  # noqa: E402
from elmo_fast.chars import word_to_char_ids  # noqa: E402

ORIGINAL = dict(d_c=16, filters=[[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]], n_highway=2,
                P=512, L=50)
SMALL = dict(d_c=4, filters=[[1, 4], [2, 8], [3, 16], [4, 32], [5, 64]], n_highway=2, P=16, L=50)

# length in characters -> relative frequency (approximate, for English running text with punctuation tokens)
ENGLISH_WORD_LENGTHS = {1: 14, 2: 16, 3: 19, 4: 15, 5: 10, 6: 8, 7: 7, 8: 5, 9: 3, 10: 2, 11: 1, 12: 0.6, 13: 0.3,
                        14: 0.15, 16: 0.1, 20: 0.05}
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:'-"


def token_ids(n: int, L: int = 50, seed: int = 0) -> torch.Tensor:
    rng = random.Random(seed)
    lengths = rng.choices(list(ENGLISH_WORD_LENGTHS), weights=list(ENGLISH_WORD_LENGTHS.values()), k=n)
    words = ["".join(rng.choice(_LETTERS) for _ in range(k)) for k in lengths]
    return torch.tensor([word_to_char_ids(w, L) for w in words], dtype=torch.int64)


def make_params(cfg: dict, dtype, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    d, L = cfg["d_c"], cfg["L"]
    F_ = sum(n for _, n in cfg["filters"])

    def rnd(*shape, s=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * s + shift).to(device=device, dtype=dtype)

    emb = rnd(262, d)
    emb[0] = 0
    return dict(
        char_embed=emb,
        conv_w=[rnd(w, d, n, s=(w * d) ** -0.5) for w, n in cfg["filters"]],
        conv_b=[rnd(n, s=0.1) for _, n in cfg["filters"]],
        highway=[[rnd(F_, F_, s=F_ ** -0.5), rnd(F_, s=0.1, shift=-1.0), rnd(F_, F_, s=F_ ** -0.5), rnd(F_, s=0.1)]
                 for _ in range(cfg["n_highway"])],
        W_proj=rnd(F_, cfg["P"], s=F_ ** -0.5), b_proj=rnd(cfg["P"], s=0.1), L=L,
    )


def leaves(p: dict) -> list[torch.Tensor]:
    return [p["char_embed"], *p["conv_w"], *p["conv_b"], *[t for layer in p["highway"] for t in layer],
            p["W_proj"], p["b_proj"]]


def elmo_fast_encoder(backend: str):
    def run(ids, p):
        v = ops.char_cnn(ids, p["char_embed"], p["conv_w"], p["conv_b"], "relu", backend=backend)
        for layer in p["highway"]:
            v = ops.highway(v, *layer, backend=backend)
        return torch.addmm(p["b_proj"], v, p["W_proj"])

    return run


class LibraryEncoder(nn.Module):
    """Baseline 2: nn.Embedding, nn.Conv1d per width (all positions), max, relu, Linear(F, 2F) highway, Linear."""

    def __init__(self, p: dict):
        super().__init__()
        emb = p["char_embed"]
        self.embed = nn.Embedding(emb.shape[0], emb.shape[1]).to(emb)
        self.convs = nn.ModuleList()
        for w in p["conv_w"]:
            self.convs.append(nn.Conv1d(w.shape[1], w.shape[2], w.shape[0]).to(w))
        F_ = sum(int(b.shape[0]) for b in p["conv_b"])
        self.highway = nn.ModuleList([nn.Linear(F_, 2 * F_).to(emb) for _ in p["highway"]])
        self.proj = nn.Linear(F_, p["W_proj"].shape[1]).to(emb)
        with torch.no_grad():
            self.embed.weight.copy_(emb)
            for conv, w, b in zip(self.convs, p["conv_w"], p["conv_b"]):
                conv.weight.copy_(w.permute(2, 1, 0))
                conv.bias.copy_(b)
            for lin, (wc, bc, wt, bt) in zip(self.highway, p["highway"]):  # allennlp's fused layout (spec §2.3)
                lin.weight.copy_(torch.cat([wt.t(), -wc.t()], 0))
                lin.bias.copy_(torch.cat([bt, -bc]))
            self.proj.weight.copy_(p["W_proj"].t())
            self.proj.bias.copy_(p["b_proj"])

    def forward(self, ids):
        x = self.embed(ids).transpose(1, 2)
        v = torch.relu(torch.cat([conv(x).amax(-1) for conv in self.convs], -1))
        for lin in self.highway:
            nonlin, gate = lin(v).chunk(2, -1)
            gate = torch.sigmoid(gate)
            v = gate * v + (1 - gate) * F.relu(nonlin)
        return self.proj(v)


# ------------------------------------------------------------------------------------------------- CPU


def _fwd_bwd(fn, ids, p, params, g):
    for t in params:
        t.grad = None
    fn(ids, p).backward(g)


def test_cpu_reference_forward(benchmark):
    p = make_params(SMALL, torch.float32, "cpu")
    ids = token_ids(256, seed=1)
    fn = elmo_fast_encoder("reference")
    with torch.no_grad():
        y = benchmark(fn, ids, p)
    assert y.shape == (256, SMALL["P"]) and torch.isfinite(y).all()


def test_cpu_reference_forward_backward(benchmark):
    p = make_params(SMALL, torch.float32, "cpu")
    params = [t.requires_grad_() for t in leaves(p)]
    ids = token_ids(256, seed=2)
    g = torch.randn(256, SMALL["P"])
    benchmark(_fwd_bwd, elmo_fast_encoder("reference"), ids, p, params, g)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in params)


# ------------------------------------------------------------------------------------------------- GPU


def check_triton(device="cuda") -> None:
    """Gate: triton == reference (fp32, original sizes, 512 tokens, every gradient) before any timing."""
    ids = token_ids(512, seed=3).to(device)
    outs = {}
    for be in ("reference", "triton"):
        p = make_params(ORIGINAL, torch.float32, device, seed=4)
        params = [t.requires_grad_() for t in leaves(p)]
        g = torch.randn(512, ORIGINAL["P"], generator=torch.Generator().manual_seed(5)).to(device)
        y = elmo_fast_encoder(be)(ids, p)
        y.backward(g)
        outs[be] = [y.detach()] + [t.grad[1:] if i == 0 else t.grad for i, t in enumerate(params)]
    for i, (a, b) in enumerate(zip(outs["reference"], outs["triton"])):
        err = float((a - b).abs().max())
        if err > 1e-4 * max(1.0, float(a.abs().max())):
            raise AssertionError(f"triton token encoder disagrees with the reference (tensor {i}): {err:.3g}; "
                                 "not timing it")


def bench_gpu(n_tokens=7680, dtypes=(torch.bfloat16, torch.float32), providers=("triton", "library", "reference"),
              modes=("fwd", "fwd+bwd"), device="cuda") -> list[dict]:
    from triton.testing import do_bench

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    check_triton(device)
    ids = token_ids(n_tokens, seed=0).to(device)
    cfg = ORIGINAL
    F_ = sum(n for _, n in cfg["filters"])
    rows = []
    for dtype in dtypes:
        for provider in providers:
            for mode in modes:
                p = make_params(cfg, dtype, device)
                if provider == "library":
                    mod = LibraryEncoder(p)
                    params = list(mod.parameters())
                    def fn(ids_, _p, mod=mod):
                        return mod(ids_)
                else:
                    params = leaves(p)
                    fn = elmo_fast_encoder(provider)
                g = torch.randn(n_tokens, cfg["P"], device=device, dtype=dtype)
                if mode == "fwd":
                    def call(fn=fn, p=p):
                        with torch.no_grad():
                            fn(ids, p)
                else:
                    for t in params:
                        t.requires_grad_()

                    def call(fn=fn, p=p, g=g):
                        fn(ids, p).backward(g)
                note = ""
                try:
                    call()
                    peak = common.peak_memory_mib(call)
                    p50, p20, p80 = do_bench(call, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8], grad_to_none=params)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory: record it, go on
                    p50 = p20 = p80 = peak = float("nan")
                    note = f"error: {type(exc).__name__}: {exc}"[:200]
                rows.append(dict(
                    op="token_encoder", provider=provider, mode=mode, tokens=n_tokens, d_c=cfg["d_c"], F=F_,
                    n_highway=cfg["n_highway"], P=cfg["P"], L=cfg["L"], dtype=str(dtype).split(".")[-1],
                    ms_p50=f"{p50:.4f}", ms_p20=f"{p20:.4f}", ms_p80=f"{p80:.4f}",
                    tokens_per_s=f"{n_tokens / (p50 * 1e-3):.0f}", peak_mem_mib=f"{peak:.1f}", note=note,
                ))
                print(f"{provider:>9} {mode:>7} {rows[-1]['dtype']:>8}: {p50:8.3f} ms  peak {peak:8.1f} MiB {note}",
                      flush=True)
                del p, params, g
                torch.cuda.empty_cache()
    return rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_token_encoder():
    rows = bench_gpu()
    print(f"wrote {len(rows)} rows to {common.append_rows('token_encoder', rows)}")


def main(argv=None) -> int:
    import argparse

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    ap.add_argument("--providers", default="triton,library,reference")
    ap.add_argument("--dry-run", action="store_true", help="check the arguments and print the plan (no GPU needed)")
    a = ap.parse_args(argv)
    names = [d for d in a.dtypes.split(",") if d]
    providers = [p for p in a.providers.split(",") if p]
    bad = [d for d in names if d not in dtypes] + [p for p in providers if p not in ("triton", "library", "reference")]
    if bad or not names or not providers:
        ap.error(f"unknown or missing dtypes/providers {bad}: dtypes from {sorted(dtypes)}, providers from "
                 "triton, library, reference")
    if a.dry_run:
        print(f"bench_token_encoder: would time {providers} x {names} x (fwd, fwd+bwd) at 7,680 tokens")
        return 0
    if not torch.cuda.is_available():
        sys.exit("bench_token_encoder: the GPU part needs CUDA; run the CPU part with pytest instead")
    rows = bench_gpu(dtypes=tuple(dtypes[d] for d in names), providers=tuple(providers))
    print(f"wrote rows to {common.append_rows('token_encoder', rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
