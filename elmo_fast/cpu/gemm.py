"""Plain (unpacked) fp32 products through MKL or oneDNN, whichever this machine runs faster for the shape.

``torch.mm``/``addmm`` send fp32 products to MKL's sgemm; ``torch.ops.mkldnn._linear_pointwise`` with a plain
(not reordered) weight runs the same product through oneDNN's matmul. Which is faster depends on the CPU and the
shape: on the 2-vCPU AVX2 EPYC of bench/results/cpu_train.md oneDNN was 1.1-1.5x faster on the training step's
products with a short inner dimension and a wide output (the input projection 320x512 by 512x16384: 37.5
against 49.7 ms; the weight gradient 1024x320 by 320x16384: 73.7 against 82.0 ms; the sampled-softmax logits
320x512 by 512x8192: 19.1 against 28.0 ms) and MKL on long inner dimensions (a 2048^3 product: 111 against 133
ms). So :func:`gemm` measures both once per process and shape class (:func:`uses_onednn`) and keeps the faster.

``ELMO_FAST_CPU_GEMM`` = ``auto`` (default) / ``mkl`` / ``onednn`` fixes the choice; under deterministic mode
(``elmo_fast.determinism``) it is always MKL, as a timing must not choose between two summation orders there.
Products below ``MIN_FLOP`` stay on MKL without a measurement in ``auto``. :func:`gemm_timings` and
:func:`restore_gemm_timings` carry the measurements through a training checkpoint, so a resumed run makes the
interrupted run's choices (``elmo_fast.cpu.packed.pack_timings`` does the same for packing).
"""
from __future__ import annotations

import os

import torch

from . import packed

_MODES = ("auto", "mkl", "onednn")
MIN_FLOP = 1 << 27  # ~134 MFLOP: below, a measurement costs more than the choice can save
_TIMES: dict = {}  # _key(...) -> (MKL seconds, oneDNN seconds), measured once per process


def gemm_mode() -> str:
    """``ELMO_FAST_CPU_GEMM``: ``auto`` (default) measures, ``mkl`` / ``onednn`` fix the library."""
    mode = os.environ.get("ELMO_FAST_CPU_GEMM", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"ELMO_FAST_CPU_GEMM={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


def _applies(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """oneDNN's matmul can run this product: fp32 CPU matrices, none of them empty (it builds no kernel for an
    empty dimension), a bias of the output's width or none (a broadcast one, of length 1, stays on MKL)."""
    ts = (a, b) if bias is None else (a, b, bias)
    return (packed.onednn_enabled() and a.dim() == 2 and b.dim() == 2
            and (bias is None or (bias.dim() == 1 and bias.shape[0] == b.shape[-1]))
            and a.numel() > 0 and b.numel() > 0
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _key(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What a measurement holds for: the three dimensions rounded up to powers of two, which operands are
    row-major, the bias, and the intra-op threads. Rounded, so that a dimension that follows the data (the
    highway's weight gradients sum over the batch's distinct tokens, a different count every step) does not
    make every call a new shape, measured again (six extra products a call)."""
    M, K = a.shape
    return (_pow2(M), _pow2(K), _pow2(b.shape[1]), a.is_contiguous(), b.is_contiguous(), bias is not None,
            torch.get_num_threads())


def _mkl(a, b, bias, out=None):
    if bias is None:
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b) if out is None else torch.addmm(bias, a, b, out=out)


def _onednn(a, b, bias):
    # the linear's weight is (N, K): b's transposed view, read in place by its strides; the bias is read as
    # contiguous whatever its stride (a strided one gave wrong sums), so it is made so
    return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.t(), None if bias is None else bias.contiguous(),
                                              "none", [], "")


def uses_onednn(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`gemm` runs this product through oneDNN (see the module docstring); measures it the first
    time its shape class is seen in this process (a warm-up and the best of two calls each way)."""
    from elmo_fast.determinism import is_deterministic

    if not _applies(a, b, bias):
        return False
    mode = gemm_mode()
    if mode != "auto":
        return mode == "onednn"
    if is_deterministic() or 2 * a.shape[0] * a.shape[1] * b.shape[1] < MIN_FLOP:
        return False
    key = _key(a, b, bias)
    if key not in _TIMES:
        try:
            _onednn(a, b, bias)  # warm-ups: oneDNN builds its kernel on the first call of a shape
        except Exception:  # noqa: BLE001 - oneDNN cannot run it here: MKL, and no measurement
            _TIMES[key] = (0.0, float("inf"))
            return False
        _mkl(a, b, bias)
        _TIMES[key] = (packed.best_seconds(lambda: _mkl(a, b, bias), 2),
                       packed.best_seconds(lambda: _onednn(a, b, bias), 2))
    t_mkl, t_onednn = _TIMES[key]
    return t_onednn < t_mkl


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``a · b`` (+ ``bias``, broadcast over rows), (M, K) by (K, N), into ``out`` when given (any strides), through
    MKL (``torch.mm``/``addmm``) or oneDNN, whichever :func:`uses_onednn` picks. The same IEEE fp32 products;
    the two libraries sum in different orders."""
    if not uses_onednn(a, b, bias):
        return _mkl(a, b, bias, out)
    r = _onednn(a, b, bias)
    return r if out is None else out.copy_(r)


def gemm_add(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, reuse: bool = False) -> torch.Tensor:
    """``c + a · b``, (M, N), through the library :func:`gemm` picks for ``a · b``: MKL sums into ``c`` (beta = 1;
    in place with ``reuse``, which says ``c`` is the caller's scratch: no copy of it first), oneDNN adds ``c`` in
    its product's epilogue (a binary post-op, ``c`` of any strides, a new tensor: ``c`` is left as it was). The
    accumulating products of the backward passes (a residual's dx, the highway's dx, the softmax's dh) go through
    here: on a CPU where MKL runs a slower code path (an AMD EPYC with AVX-512, 2026-11-27: a (320, 16384) by
    (16384, 512) ``addmm`` 26 ms, oneDNN 13) they would otherwise stay on MKL."""
    if c.shape != (a.shape[0], b.shape[1]) or c.dtype != a.dtype:
        raise ValueError(f"gemm_add: c of {tuple(c.shape)} {c.dtype}, expected ({a.shape[0]}, {b.shape[1]}) {a.dtype}"
                         " (no broadcast)")
    if not uses_onednn(a, b, None):
        return c.addmm_(a, b) if reuse else torch.addmm(c, a, b)
    return torch.ops.mkldnn._linear_pointwise.binary(a.contiguous(), c, b.t(), None, "add")


def gemm_timings() -> list[list]:
    """:func:`uses_onednn`'s measurements so far, as plain data (``[M, K and N buckets, a row-major, b row-major,
    bias, threads, t_mkl, t_onednn]`` rows) for a training checkpoint; :func:`restore_gemm_timings` puts them
    back."""
    return [[*k, *t] for k, t in sorted(_TIMES.items(), key=lambda kv: str(kv[0]))]


def restore_gemm_timings(rows: list[list] | None) -> None:
    """Put back measurements from :func:`gemm_timings` (they replace this process's for the same keys)."""
    for row in rows or ():
        if len(row) != 9:
            raise ValueError(f"a gemm timing row of {len(row)} fields, expected 9: {row}")
        m, k, n, ac, bc, bias, th, t_mkl, t_onednn = row
        # rounded as _key rounds (a checkpoint written before K and N were rounded has their exact values)
        _TIMES[(_pow2(int(m)), _pow2(int(k)), _pow2(int(n)), bool(ac), bool(bc), bool(bias), int(th))] = (
            float(t_mkl), float(t_onednn))
