"""The once-per-device self-check behind ``auto``'s choice of Triton (``elmo_fast._backend.triton_self_check``).

Each op runs through ``backend="triton"`` and ``backend="reference"`` at a small shape, on fixed random inputs
(drawn on the CPU, so every device checks the same values as CI does under the interpreter), forward and the
gradients of every float input under a fixed random upstream gradient, in the two variants the kernels run:

* fp32: the outputs and gradients must agree with the fp32 reference to ``TOL`` (max |a - b| over max |b|;
  fp32 IEEE kernels land near 1e-6);
* bf16, under ``torch.autocast`` (what bf16 training runs; skipped on a GPU without bf16): the accuracy budget
  of docs/performance.md per output and gradient, against the reference in fp64: ``||kernel - ref64|| <=
  2 ||ref_bf16 - ref64|| + SLACK_BF16 (||ref64|| + sqrt(n))``, where ref_bf16 is the reference under the same
  autocast (Frobenius norms, as in tests/test_char_cnn_triton.py: a bf16 rounding can move a max-pooling
  gradient between near-tied windows). The slack lets a 1-3% error of a bf16 output through (a 5% one fails:
  tests/test_selfcheck_bf16.py): the check is for broken variants, the tests hold the kernels to the budget.

The hashed dropout (``"dropout"``) is checked apart, bit for bit: its kernel's masks must be the CPU's for the same
seeds (fp32 and bf16, two groups, output and gradient).

The bf16 half makes about twice the launches of the fp32 half (two references: bf16 and fp64), all small; it
runs once per process and device. The first call also pays Triton's compilation of those kernels, which later
runs reuse from Triton's cache.
"""
from __future__ import annotations

import torch

TOL = 1e-3
SLACK_BF16 = 1e-2  # per-dtype slack of the accuracy budget for bf16 (the tests' value)


def _randn(g, dev, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dev)


def _lstmp(dev, g):
    from .lstmp import lstmp

    B, T, H, P = 3, 5, 16, 16
    lengths = torch.tensor([5, 3, 0], device=dev)
    floats = [_randn(g, dev, *s, scale=sc) for s, sc in
              (((B, T, P), 1.0), ((P, 4 * H), 0.3), ((P, 4 * H), 0.3), ((4 * H,), 0.1), ((H, P), 0.3),
               ((B, P), 0.5), ((B, H), 0.5))]

    def run(backend, x, w_in, w_rec, bias, w_proj, h0, c0):
        return lstmp(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip=1.0, proj_clip=0.8, reverse=True,
                     residual=True, backend=backend)
    return run, floats


def _char_cnn(dev, g):
    from .char_cnn import char_cnn

    ids = torch.randint(1, 262, (6, 8), generator=g)
    ids[1, 3:] = 261  # in-word padding
    ids[4] = 0  # an empty token
    ids = ids.to(dev)
    widths = ((1, 4), (2, 8), (3, 16))
    floats = [_randn(g, dev, 261, 4)]  # the 261 real rows; id 0 reads a zero row (§1.1)
    floats += [_randn(g, dev, w, 4, n, scale=0.3) for w, n in widths]
    floats += [_randn(g, dev, n, scale=0.1) for _, n in widths]

    def run(backend, emb, *params):
        emb = torch.nn.functional.pad(emb, (0, 0, 1, 0))  # as the token encoder does: no gradient to row 0
        return char_cnn(ids, emb, list(params[:3]), list(params[3:]), "relu", backend=backend)
    return run, floats


def _highway(dev, g):
    from .char_cnn import highway

    F = 32
    floats = [_randn(g, dev, 20, F), _randn(g, dev, F, F, scale=0.2), _randn(g, dev, F, scale=0.1),
              _randn(g, dev, F, F, scale=0.2), _randn(g, dev, F, scale=0.1)]

    def run(backend, *args):
        return highway(*args, backend=backend)
    return run, floats


def _softmax(sampled: bool):
    def make(dev, g):
        from .softmax import full_softmax_nll, sampled_softmax_loss, sampled_softmax_loss_groups

        N, P, V, S = 10, 16, 50, 8
        targets = torch.randint(0, V, (N,), generator=g)
        ids = torch.randperm(V, generator=g)[:S]
        ids2 = torch.randperm(V, generator=g)[:S]
        targets[0], targets[N // 2] = ids[0], ids2[1]  # an accidental hit in each group
        targets, ids, ids2 = targets.to(dev), ids.to(dev), ids2.to(dev)
        floats = [_randn(g, dev, N, P), _randn(g, dev, V, P, scale=0.3), _randn(g, dev, V, scale=0.1)]

        def run(backend, hidden, weight, bias):
            if sampled:  # as the trainer calls it: two groups (rows and samples of their own) in one call; and
                # one call alone (its backward's host path differs: the one-group chunk loop)
                h = hidden.split(N // 2)
                t = targets.split(N // 2)
                return (*sampled_softmax_loss_groups([(h[0], t[0], ids, S + 3), (h[1], t[1], ids2, S + 5)], weight,
                                                     bias, reduction="none", backend=backend),
                        sampled_softmax_loss(hidden, targets, weight, bias, ids, S + 3, reduction="none",
                                             backend=backend))
            return full_softmax_nll(hidden, targets, weight, bias, "none", backend=backend)
        return run, floats
    return make


CHECKS = {"lstmp": _lstmp, "char_cnn": _char_cnn, "highway": _highway, "sampled_softmax": _softmax(True),
          "full_softmax": _softmax(False)}
OPS = (*CHECKS, "dropout")  # every op the self-check knows: CHECKS by tolerance, the dropout bit for bit


def _outputs_and_grads(run, backend, floats, upstream_seed):
    leaves = [t.detach().clone().requires_grad_(True) for t in floats]
    outs = run(backend, *leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(upstream_seed)
    loss = sum((o * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in outs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in outs] + [gr for gr in grads if gr is not None]


def _variants(op: str, device: torch.device, variants: dict) -> dict:
    """The outputs and gradients of ``op`` per variant: name -> (backend, float dtype, autocast dtype or None)."""
    run, floats = CHECKS[op](device, torch.Generator().manual_seed(0))
    out = {}
    with torch.enable_grad():
        for name, (backend, dtype, low) in variants.items():
            ctx = torch.autocast(device.type, dtype=low) if low else torch.autocast(device.type, enabled=False)
            with ctx:
                out[name] = _outputs_and_grads(run, backend, [t.to(dtype) for t in floats], 1)
    return out


def op_error(op: str, device: torch.device) -> float:
    """Worst relative disagreement between the fp32 Triton and reference paths of ``op`` (outputs and grads)."""
    r = _variants(op, device, {"got": ("triton", torch.float32, None), "want": ("reference", torch.float32, None)})
    got, want = r["got"], r["want"]
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


def bf16_excess(op: str, device: torch.device) -> float:
    """The bf16 (autocast) Triton path of ``op`` against its accuracy budget (module doc): the worst ratio, over
    outputs and gradients, of its error to the budget's bound; at most 1 within the budget."""
    bf16 = torch.bfloat16
    r = _variants(op, device, {"kernel": ("triton", torch.float32, bf16), "ref": ("reference", torch.float32, bf16),
                               "ref64": ("reference", torch.float64, None)})
    if not len(r["kernel"]) == len(r["ref"]) == len(r["ref64"]):
        return float("inf")
    worst = 0.0
    for c, b, a in zip(r["kernel"], r["ref"], r["ref64"]):
        c, b = c.double(), b.double()
        bound = 2 * float((b - a).norm()) + SLACK_BF16 * (float(a.norm()) + a.numel() ** 0.5)
        err = float((c - a).norm())
        if err != err:  # NaN
            return float("nan")
        worst = max(worst, err / bound)
    return worst


def _bf16_autocast(device: torch.device) -> bool:
    """Whether bf16 autocast can run on ``device`` (not on GPUs without bf16: there is no bf16 variant to check)."""
    return device.type != "cuda" or torch.cuda.is_bf16_supported()


def run_self_check(op: str, device: torch.device) -> str | None:
    """None when both Triton variants of ``op`` (fp32, bf16 autocast) agree with the reference on ``device``,
    else what went wrong."""
    if op == "dropout":
        return _dropout_check(device)
    try:
        err = op_error(op, device)
        if not err <= TOL:
            return f"fp32: relative error {err:.3g} > {TOL:g} against the reference"
        excess = bf16_excess(op, device) if _bf16_autocast(device) else 0.0
        if not excess <= 1.0:
            return (f"bf16 (autocast): error {excess:.3g}x the accuracy budget (2x the bf16 reference's error + "
                    f"{SLACK_BF16:g} slack, against the fp64 reference)")
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel path is a failed check
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    if op == "lstmp":
        check_loop_graphs(device)
    return None


def _dropout_check(device: torch.device) -> str | None:
    """The hashed dropout's kernel against the CPU's masks (``elmo_fast::dropout_hash``), bit for bit: fp32 and
    bf16, two groups of rows with their own seeds, the output and the gradient."""
    import importlib

    from ..kernels.dropout import dropout_hash_triton

    cpu = importlib.import_module("elmo_fast.ops.dropout")._dropout_op
    g = torch.Generator().manual_seed(0)
    seeds = torch.tensor([0x1234_5678_9ABC_DEF0, -7], dtype=torch.int64)
    numels = [2 * 5 * 7, 3 * 5 * 7]
    try:
        for dtype in (torch.float32, torch.bfloat16) if _bf16_autocast(device) else (torch.float32,):
            x, up = (torch.randn(5, 5, 7, generator=g).to(dtype) for _ in range(2))
            leaf = x.to(device).requires_grad_(True)
            with torch.enable_grad():
                y = dropout_hash_triton(leaf, seeds, numels, 0.3)
                (dx,) = torch.autograd.grad(y, leaf, up.to(device))
            for name, got, want in (("output", y, cpu(x, seeds, numels, 0.3)), ("gradient", dx, cpu(up, seeds, numels,
                                                                                                     0.3))):
                if not torch.equal(got.detach().cpu(), want):
                    return f"{dtype}: the {name} differs from the CPU's masks"
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel path is a failed check
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def check_loop_graphs(device: torch.device) -> None:
    """The LSTMP loop graphs (``kernels/lstmp_graphs.py``) where they are on: three training calls of the fp32
    check replay bit for bit what the same call gives without them (at least two of the three replay). On a
    difference or an error they are turned off on ``device`` with a warning; the kernels themselves passed."""
    from ..kernels import lstmp_graphs

    if lstmp_graphs.mode(device) is None:
        return
    run, floats = _lstmp(device, torch.Generator().manual_seed(0))
    try:
        with torch.enable_grad():
            with lstmp_graphs.suspended():
                want = _outputs_and_grads(run, "triton", floats, 1)
            for _ in range(3):
                got = _outputs_and_grads(run, "triton", floats, 1)
                if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
                    lstmp_graphs.disable(device, "a replay differs from the same call without the graph")
                    return
    except Exception as exc:  # noqa: BLE001 - any failure: no graphs on this device
        lstmp_graphs.disable(device, f"{type(exc).__name__}: {str(exc)[:200]}")
