"""``lstmp``: one LSTMP chain (one layer, one direction). See ``elmo_fast.reference.lstmp`` for the math."""
from __future__ import annotations

import torch

from .._backend import BackendUnavailableError, check_backend_name, triton_import_error
from ..cpu.lstmp import lstmp_cpu
from ..cpu.packed import PackedWeightCache
from ..reference.lstmp import lstmp_reference
from . import _precision as prec
from ._library import CompositeOp, ThreadFlag, backend_for

_trusted = ThreadFlag()


def trusted_lengths():
    """Inside this block the caller guarantees ``0 <= lengths <= T`` (lengths it derived from a mask, or checked
    once itself), so :func:`lstmp` skips its own range check, the one host sync it would otherwise make."""
    return _trusted.on()


def check_lengths(lengths: torch.Tensor, T: int, what: str = "lstmp") -> None:
    """lengths must lie in [0, T]: one host sync (the only one of a call; skipped under :func:`trusted_lengths`).
    While ``torch.compile`` / ``torch.export`` trace, the check is an assert in the graph instead (no host sync;
    on a GPU a device-side assert)."""
    if torch.compiler.is_compiling():
        torch._assert_async(((lengths >= 0) & (lengths <= T)).all(), f"{what}: lengths must lie in [0, T]")
        return
    if lengths.numel() and not _trusted:
        lo, hi = (int(v) for v in torch.stack(torch.aminmax(lengths)).tolist())
        if lo < 0 or hi > T:
            raise ValueError(f"{what}: lengths must lie in [0, T={T}], got [{lo}, {hi}]")


def lstmp(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_rec: torch.Tensor,
    bias: torch.Tensor,
    w_proj: torch.Tensor | None,
    h0: torch.Tensor,
    c0: torch.Tensor,
    lengths: torch.Tensor,
    *,
    cell_clip: float | None = None,
    proj_clip: float | None = None,
    forget_bias: float = 1.0,
    reverse: bool = False,
    residual: bool = False,
    backend: str | None = "auto",
    cpu_weight_cache: PackedWeightCache | None = None,
    cpu_bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LSTMP chain over a right-padded batch; returns (y (B,T,P), h_n (B,P), c_n (B,H)).

    x (B, T, D); w_in (D, 4H); w_rec (P, 4H); bias (4H,) gate order i|j|f|o without the forget bias;
    w_proj (H, P) or None; h0 (B, P); c0 (B, H); lengths (B,) integer.
    ``cpu_weight_cache``: a ``PackedWeightCache`` owned by the caller (the module owning the weights) in which the
    cpu backend keeps packed copies of the weights across calls; ``cpu_bf16``: the cpu backend runs inference
    with bf16 products (opt-in; see ``elmo_fast.cpu.lstmp``). Other backends ignore both.

    Precision (``elmo_fast.ops._precision``): under autocast x and the three weight matrices run in the autocast
    dtype (weights cast once per update), bias and states keep their dtype; h_n/c_n come back in h0/c0's dtype.
    Host syncs: one, the range check of ``lengths``, skipped under :func:`trusted_lengths`.
    """
    _check(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, residual)
    low = prec.compute_dtype(x)
    (x,) = prec.activations(low, x)
    w_in, w_rec, w_proj = prec.weights(low, w_in, w_rec, w_proj)
    _check_dtypes(x, w_in, w_rec, w_proj)
    check_lengths(lengths, x.shape[1])
    be = backend_for(backend, x.device, "lstmp")
    kw = dict(cell_clip=cell_clip, proj_clip=proj_clip, forget_bias=forget_bias, reverse=reverse, residual=residual)
    with prec.no_autocast(x.device):
        if be == "cuda":
            from ._lstmp_cuda import lstmp_cuda, unsupported_reason

            reason = unsupported_reason(x, w_in, w_proj, h0)
            if reason is None:
                return lstmp_cuda(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, **kw)
            if check_backend_name(backend) == "cuda":  # asked for explicitly: say why it cannot run
                raise BackendUnavailableError(f"backend 'cuda' for lstmp cannot run this call: {reason}")
            be = "triton" if triton_import_error() is None else "reference"  # auto: fall back
        if be == "triton":
            from ..kernels.lstmp import lstmp_triton

            return lstmp_triton(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, **kw)
        # the cpu backend and the reference mix no dtypes: everything in x's dtype, the states handed back in theirs
        b, s0, s1 = prec.reference_inputs(x.dtype, bias, h0, c0)
        if be == "cpu":
            y, h_n, c_n = lstmp_cpu(x, w_in, w_rec, b, w_proj, s0, s1, lengths, weight_cache=cpu_weight_cache,
                                    bf16=cpu_bf16, **kw)
        else:
            y, h_n, c_n = _lstmp_reference_op(x, w_in, w_rec, b, w_proj, s0, s1, lengths, _opt(cell_clip),
                                              _opt(proj_clip), float(forget_bias), bool(reverse), bool(residual))
        return y, h_n.to(h0.dtype), c_n.to(c0.dtype)


# --------------------------------------------------------------------------- the reference as an operator
Tensor = torch.Tensor


def _opt(v) -> float | None:
    return None if v is None else float(v)


def _lstmp_reference_fn(x: Tensor, w_in: Tensor, w_rec: Tensor, bias: Tensor, w_proj: Tensor | None, h0: Tensor,
                       c0: Tensor, lengths: Tensor, cell_clip: float | None, proj_clip: float | None,
                       forget_bias: float, reverse: bool, residual: bool) -> tuple[Tensor, Tensor, Tensor]:
    return lstmp_reference(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=cell_clip,
                           proj_clip=proj_clip, forget_bias=forget_bias, reverse=reverse, residual=residual)


_lstmp_reference_op = CompositeOp("lstmp_reference", _lstmp_reference_fn)


@_lstmp_reference_op.op.register_fake
def _(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip, forget_bias, reverse, residual):
    B, T, _ = x.shape
    return x.new_empty(B, T, h0.shape[1]), torch.empty_like(h0), torch.empty_like(c0)


def _check_dtypes(x, w_in, w_rec, w_proj):
    for name, w in (("w_in", w_in), ("w_rec", w_rec), ("w_proj", w_proj)):
        if w is not None and w.dtype != x.dtype:
            raise TypeError(f"lstmp: {name} must have x's dtype {x.dtype} (or run under torch.autocast), got {w.dtype}")


def _check(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, residual):
    if x.dim() != 3:
        raise ValueError(f"lstmp: x must be (B, T, D), got shape {tuple(x.shape)}")
    B, T, D = x.shape
    if w_in.dim() != 2 or w_in.shape[0] != D or w_in.shape[1] % 4:
        raise ValueError(f"lstmp: w_in must be (D={D}, 4H), got {tuple(w_in.shape)}")
    G = w_in.shape[1]
    H = G // 4
    P = h0.shape[-1]
    expect = {
        "w_rec": (w_rec, (P, G)),
        "bias": (bias, (G,)),
        "h0": (h0, (B, P)),
        "c0": (c0, (B, H)),
        "lengths": (lengths, (B,)),
    }
    if w_proj is not None:
        expect["w_proj"] = (w_proj, (H, P))
    elif P != H:
        raise ValueError(f"lstmp: without a projection h must be the cell size H={H}, got h0 width {P}")
    for name, (t, shape) in expect.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"lstmp: {name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"lstmp: {name} is on {t.device} but x is on {x.device}")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise TypeError(f"lstmp: lengths must be an integer tensor, got {lengths.dtype}")
    if residual and D != P:
        raise ValueError(f"lstmp: residual needs D == P, got D={D}, P={P}")
