"""The once-per-device self-check behind ``auto``'s choice of Triton (``elmo_fast._backend.triton_self_check``).

Each op runs once through ``backend="triton"`` and once through ``backend="reference"`` at a small shape, in
fp32, on fresh random inputs; the outputs and the gradients of every float input under a random upstream
gradient must agree to ``TOL`` (max |a - b| over max |b|; fp32 IEEE kernels land near 1e-6). A few small
launches per op; the first call also pays Triton's compilation of those kernels, which later runs reuse from
Triton's cache.
"""
from __future__ import annotations

import torch

TOL = 1e-3


def _lstmp(dev, g):
    from .lstmp import lstmp

    B, T, H, P = 3, 5, 16, 16
    lengths = torch.tensor([5, 3, 0], device=dev)
    floats = [torch.randn(*s, generator=g, device=dev) * sc for s, sc in
              (((B, T, P), 1.0), ((P, 4 * H), 0.3), ((P, 4 * H), 0.3), ((4 * H,), 0.1), ((H, P), 0.3),
               ((B, P), 0.5), ((B, H), 0.5))]

    def run(backend, x, w_in, w_rec, bias, w_proj, h0, c0):
        return lstmp(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=1.0, proj_clip=0.8, reverse=True,
                     residual=True, backend=backend)
    return run, floats


def _char_cnn(dev, g):
    from .char_cnn import char_cnn

    ids = torch.randint(1, 262, (6, 8), generator=g, device=dev)
    ids[1, 3:] = 261  # in-word padding
    ids[4] = 0  # an empty token
    widths = ((1, 4), (2, 8), (3, 16))
    floats = [torch.randn(261, 4, generator=g, device=dev)]  # the 261 real rows; id 0 reads a zero row (§1.1)
    floats += [torch.randn(w, 4, n, generator=g, device=dev) * 0.3 for w, n in widths]
    floats += [torch.randn(n, generator=g, device=dev) * 0.1 for _, n in widths]

    def run(backend, emb, *params):
        emb = torch.nn.functional.pad(emb, (0, 0, 1, 0))  # as the token encoder does: no gradient to row 0
        return char_cnn(ids, emb, list(params[:3]), list(params[3:]), "relu", backend=backend)
    return run, floats


def _highway(dev, g):
    from .char_cnn import highway

    F = 32
    floats = [torch.randn(20, F, generator=g, device=dev), torch.randn(F, F, generator=g, device=dev) * 0.2,
              torch.randn(F, generator=g, device=dev) * 0.1, torch.randn(F, F, generator=g, device=dev) * 0.2,
              torch.randn(F, generator=g, device=dev) * 0.1]

    def run(backend, *args):
        return highway(*args, backend=backend)
    return run, floats


def _softmax(sampled: bool):
    def make(dev, g):
        from .softmax import full_softmax_nll, sampled_softmax_loss

        N, P, V, S = 10, 16, 50, 8
        targets = torch.randint(0, V, (N,), generator=g, device=dev)
        ids = torch.randperm(V, generator=g, device=dev)[:S]
        targets[0] = ids[0]  # an accidental hit
        floats = [torch.randn(N, P, generator=g, device=dev), torch.randn(V, P, generator=g, device=dev) * 0.3,
                  torch.randn(V, generator=g, device=dev) * 0.1]

        def run(backend, hidden, weight, bias):
            if sampled:
                return sampled_softmax_loss(hidden, targets, weight, bias, ids, S + 3, reduction="none",
                                            backend=backend)
            return full_softmax_nll(hidden, targets, weight, bias, "none", backend=backend)
        return run, floats
    return make


CHECKS = {"lstmp": _lstmp, "char_cnn": _char_cnn, "highway": _highway, "sampled_softmax": _softmax(True),
          "full_softmax": _softmax(False)}


def _outputs_and_grads(run, backend, floats, upstream_seed):
    leaves = [t.detach().clone().requires_grad_(True) for t in floats]
    outs = run(backend, *leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator(device=outs[0].device).manual_seed(upstream_seed)
    loss = sum((o * torch.randn(o.shape, generator=g, device=o.device)).sum() for o in outs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in outs] + [gr for gr in grads if gr is not None]


def op_error(op: str, device: torch.device) -> float:
    """Worst relative disagreement between the Triton and the reference path of ``op`` (outputs and grads)."""
    g = torch.Generator(device=device).manual_seed(0)
    run, floats = CHECKS[op](device, g)
    with torch.autocast(device.type, enabled=False), torch.enable_grad():
        got = _outputs_and_grads(run, "triton", floats, 1)
        want = _outputs_and_grads(run, "reference", floats, 1)
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for a, b in zip(got, want):
        scale = float(b.abs().max()) if b.numel() else 0.0
        err = float((a - b).abs().max()) if b.numel() else 0.0
        if err != err:  # NaN
            return float("nan")
        worst = max(worst, err / max(scale, 1e-30))
    return worst


def run_self_check(op: str, device: torch.device) -> str | None:
    """None when the Triton path of ``op`` agrees with the reference on ``device``, else what went wrong."""
    try:
        err = op_error(op, device)
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel path is a failed check
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    if not err <= TOL:
        return f"relative error {err:.3g} > {TOL:g} against the reference"
    return None
