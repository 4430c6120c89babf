"""End-to-end biLM embedding: throughput (64 sentences of ~25 tokens) and single-sentence latency (20 tokens).

Providers, in one run on one device (performance.md, "Baselines"):
* ``elmo_fast-auto``: ``ElmoBiLM`` as a user gets it (backend ``auto``); ``elmo_fast-auto+graph``: the same
  with ``cuda_graph=True`` (one CUDA-graph replay per call after the first two calls of a shape);
* ``elmo_fast-reference`` / ``elmo_fast-triton``: every op on that backend;
* ``elmo_fast-cuda``: the LSTMP chains on the CUDA extension (the only op it has), the token encoder on
  Triton -- only where the extension was built (``ELMO_FAST_BUILD_CUDA=1``);
* ``library``: the fastest composition of library parts — ``nn.Conv1d`` + torch highway + ``nn.LSTM(proj_size)``
  (cuDNN) per chain. It cannot clip and ignores lengths, so it computes a slightly different function: a speed
  bar, not an oracle;
* ``allennlp``: AllenNLP 2.10.1's ``_ElmoBiLm`` where it is importable (``bench/setup_allennlp.sh``).

CPU part (pytest-benchmark, tiny model): ``python -m pytest bench/bench_bilm.py --benchmark-only``.
GPU part: ``python bench/bench_bilm.py`` (or the ``gpu`` test below); rows, with device, versions, commit and
command, go to build/bench/bilm.csv, or to the committed bench/results/bilm.csv with ``ELMO_FAST_BENCH_RECORD=1``
(bench/common.py). ``python bench/bench_bilm.py --device cpu --tiny`` runs every provider
once on the CPU at the tiny model's size (a smoke run of this script; its timings mean nothing).
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import elmo_fast  # noqa: E402
from elmo_fast import add_sentence_boundary_token_ids  # noqa: E402
from elmo_fast.testing import ORIGINAL_OPTIONS, TINY_OPTIONS, write_random_model  # noqa: E402

SYLLABLES = ["ta", "re", "mo", "ki", "lu", "sen", "dor", "pa", "vi", "nel", "ost", "ra", "che", "ba", "tion", "ing"]


def sentences(n: int, mean_len: int, seed: int = 0) -> list[list[str]]:
    """Deterministic pseudo-English: Zipf-ish word choice, word lengths 1-12 characters."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice(SYLLABLES) for _ in range(rng.choice([1, 1, 2, 2, 2, 3, 4]))) for _ in range(5000)]
    weights = [1.0 / (k + 1) for k in range(len(vocab))]
    out = []
    for _ in range(n):
        length = max(3, int(rng.gauss(mean_len, mean_len / 3)))
        out.append(rng.choices(vocab, weights, k=length - 1) + ["."])
    return out


class LibraryBiLM(nn.Module):
    """Baseline 2: nn.Conv1d + highway with nn.Linear + nn.LSTM(proj_size) per chain (no clips, no lengths)."""

    def __init__(self, opts: dict):
        super().__init__()
        c, lo = opts["char_cnn"], opts["lstm"]
        d, P, H = c["embedding"]["dim"], lo["projection_dim"], lo["dim"]
        F_ = sum(n for _, n in c["filters"])
        self.embed = nn.Embedding(262, d, padding_idx=0)
        self.convs = nn.ModuleList([nn.Conv1d(d, n, w) for w, n in c["filters"]])
        self.highway = nn.ModuleList([nn.Linear(F_, 2 * F_) for _ in range(c["n_highway"])])
        self.proj = nn.Linear(F_, P)
        self.lstms = nn.ModuleList([nn.LSTM(P, H, proj_size=P, batch_first=True)
                                    for _ in range(2 * lo["n_layers"])])
        self.n_layers = lo["n_layers"]

    def forward(self, ids):  # (B, T, 50) with boundaries
        B, T, L = ids.shape
        x = self.embed(ids.view(-1, L)).transpose(1, 2)
        v = torch.cat([conv(x).amax(-1) for conv in self.convs], -1).relu()
        for hw in self.highway:
            t, g = hw(v).chunk(2, -1)
            g = torch.sigmoid(g)
            v = g * F.relu(t) + (1 - g) * v
        tok = self.proj(v).view(B, T, -1)
        outs = [torch.cat([tok, tok], -1)]
        f_in, b_in = tok, tok.flip(1)
        for layer in range(self.n_layers):
            f, _ = self.lstms[2 * layer](f_in)
            b, _ = self.lstms[2 * layer + 1](b_in)
            if layer:
                f, b = f + f_in, b + b_in
            outs.append(torch.cat([f, b.flip(1)], -1))
            f_in, b_in = f, b
        return outs


# ------------------------------------------------------------------------------------------ CPU (pytest-benchmark)
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny"), TINY_OPTIONS)


def test_cpu_tiny_embed(benchmark, tiny):
    model = elmo_fast.ElmoBiLM(*tiny, backend="reference", stateful=False)
    ids = elmo_fast.batch_to_ids(sentences(16, 20))
    with torch.no_grad():
        benchmark(model, ids)


# ------------------------------------------------------------------------------------------ GPU
# "+graph": the model CUDA graph; "+2streams": ELMO_FAST_BILM_STREAMS=2 (the two LSTM stacks on two streams);
# "+fusedreduce": ELMO_FAST_LSTMP_FUSED_REDUCE=16 (the forward's reduce in the projection's last split, opt-in);
# "+pdl": ELMO_FAST_LSTMP_PDL=1 (programmatic dependent launch in the LSTMP time loops, opt-in), "+kloop": with it, the
# tiles of TUNED (PDL alone, without PDL_TUNED's small-batch cell tile)
PROVIDERS = ("reference", "triton", "auto", "auto+2streams", "auto+graph", "auto+graph+2streams",
             "auto+graph+fusedreduce", "auto+graph+pdl", "auto+graph+pdl+kloop", "auto+graph+fusedreduce+pdl", "cuda")


def _elmo_fast(o, w, provider, dev, dtype):
    backend, *extras = provider.split("+")
    graph = "graph" in extras
    if backend == "cuda":  # the extension has the LSTMP chain only: the token encoder stays on Triton
        m = elmo_fast.ElmoBiLM(o, w, backend="triton", stateful=False, cuda_graph=graph)
        m._bilm.forward_lstm.backend = m._bilm.backward_lstm.backend = "cuda"
    else:
        m = elmo_fast.ElmoBiLM(o, w, backend=backend, stateful=False, cuda_graph=graph)
    m = m.to(dev, dtype).eval()
    if "fusedreduce" in extras:
        from elmo_fast.kernels.lstmp import FUSED_REDUCE_ENV

        m = common.with_env(m, FUSED_REDUCE_ENV, "16")
    if "pdl" in extras:
        m = common.with_pdl(m, k_loop="kloop" in extras)
    return common.with_env(m, "ELMO_FAST_BILM_STREAMS", "2") if "2streams" in extras else m


BASELINES = ("library", "allennlp")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = ("throughput", "latency")


def _providers(opts, o, w, dtype, dev, only=None):
    """The providers to time, by row name (``only``: a subset of ``PROVIDERS`` + ``BASELINES``). One that cannot be
    built or warmed up here is skipped and said so; named in ``only`` (asked for), it is a provider that raises
    its error when timed, so that the run keeps it as an error row (or, on the CPU, fails)."""
    provs = {}
    warm = elmo_fast.batch_to_ids([["warm", "up"]]).to(dev)
    for prov in PROVIDERS:
        if only is not None and prov not in only:
            continue
        try:
            m = _elmo_fast(o, w, prov, dev, dtype)
            with torch.no_grad():
                m(warm)
            provs[f"elmo_fast-{prov}"] = m
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run here is skipped, and said so
            print(f"skip elmo_fast-{prov}: {type(exc).__name__}: {exc}")
            if only is not None:
                def failed(ids, exc=exc):
                    raise exc

                provs[f"elmo_fast-{prov}"] = failed
    if only is None or "library" in only:
        lib = LibraryBiLM(opts).to(dev, dtype).eval()
        bos, eos = (torch.tensor(elmo_fast.word_to_char_ids(t), device=dev) for t in ("<S>", "</S>"))
        provs["library"] = lambda ids: lib(add_sentence_boundary_token_ids(ids, (ids > 0).any(-1), bos, eos)[0])
    if only is None or "allennlp" in only:
        try:
            from allennlp.modules.elmo import _ElmoBiLm

            al = _ElmoBiLm(o, w).to(dev).eval()
            if dtype == torch.float32:
                provs["allennlp"] = al
        except Exception as exc:  # noqa: BLE001
            print(f"skip allennlp: {type(exc).__name__}")
    return provs


def run_gpu(opts=ORIGINAL_OPTIONS, device: str = "cuda", providers=None, dtypes=("fp32", "bf16"),
            cases=CASES, keep_going: bool | None = None) -> list[dict]:
    """Every case x dtype x provider (``providers``: a subset of ``PROVIDERS`` + ``BASELINES``; None: all), each row
    appended to the CSV as it is timed. A provider that raises is kept as an error row and the next one runs where
    ``common.keep_going`` allows it (on CUDA, the device still answering: a failing opt-in must not take the
    baseline's numbers with it); on the CPU it raises. ``keep_going`` True / False: always / never (tests)."""
    dev = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False  # the library provider's cuDNN LSTM in fp32 too (IEEE, like elmo_fast)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        o, w = write_random_model(d, opts)
        small = dev.type != "cuda"  # smoke run: a few short sentences
        texts = {"throughput": sentences(3 if small else 64, 6 if small else 25, seed=1),
                 "latency": [sentences(1, 20, seed=2)[0][:4 if small else 19] + ["."]]}
        for dtype in (DTYPES[d] for d in dtypes):
            provs = _providers(opts, o, w, dtype, dev, providers)
            for case, sents in ((c, texts[c]) for c in cases):
                ids = elmo_fast.batch_to_ids(sents).to(dev)
                n_tok = sum(len(s) for s in sents)
                for name, fn in provs.items():
                    row = {"case": case, "provider": name, "dtype": str(dtype).replace("torch.", ""),
                           "sentences": len(sents), "tokens": n_tok}
                    try:
                        with torch.no_grad():
                            p50, p20, p80 = common.time_ms(lambda fn=fn, ids=ids: fn(ids), dev, reps=1)
                            mem = common.peak_memory_mib(lambda fn=fn, ids=ids: fn(ids))
                        row.update(ms_p50=round(p50, 4), ms_p20=round(p20, 4), ms_p80=round(p80, 4),
                                   tokens_per_s=round(n_tok / (p50 / 1e3)), peak_mem_mib=round(mem, 1))
                        print(f"{case:10s} {row['dtype']:8s} {name:30s} {p50:9.3f} ms "
                              f"{row['tokens_per_s']:>10d} tok/s", flush=True)
                    except Exception as exc:  # noqa: BLE001 - kept as the row, then the next provider
                        if keep_going is False:
                            raise
                        row["error"] = common.keep_going(exc, dev, force=bool(keep_going))
                        print(f"{case:10s} {row['dtype']:8s} {name:30s} FAILED ({row['error']})", flush=True)
                    rows.append(row)
                    common.append_rows_or_say("bilm", [row])  # as it comes: a run killed at its cap keeps its rows
    return rows


@pytest.mark.gpu
def test_gpu_bilm_benchmark():
    assert not [r for r in run_gpu() if "error" in r]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny test model instead of the original's sizes")
    ap.add_argument("--providers", help="comma-separated, of " + ", ".join(PROVIDERS + BASELINES) + " (default: all)")
    ap.add_argument("--dtypes", help="comma-separated, of fp32, bf16 (default: both)")
    ap.add_argument("--cases", help="comma-separated, of throughput, latency (default: both)")
    a = ap.parse_args(argv)
    try:
        providers = common.comma_list("--providers", a.providers, PROVIDERS + BASELINES)
        dtypes = common.comma_list("--dtypes", a.dtypes, tuple(DTYPES)) or tuple(DTYPES)
        cases = common.comma_list("--cases", a.cases, CASES) or CASES
    except ValueError as exc:
        ap.error(str(exc))
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_bilm: no CUDA device; `--device cpu --tiny` runs a smoke pass of this script")
    rows = run_gpu(TINY_OPTIONS if a.tiny else ORIGINAL_OPTIONS, a.device, providers, dtypes, cases)
    return 1 if any("error" in r for r in rows) else 0  # every provider ran; the step still says one failed


if __name__ == "__main__":
    sys.exit(main())
