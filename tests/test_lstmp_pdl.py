"""Programmatic dependent launch in the LSTMP time loops (kernels/lstmp.py ``pdl_on``, ``_pdl_wait``; opt-in,
``ELMO_FAST_LSTMP_PDL=1``): the setting, the plan and the loops' launch options on the CPU; what the interpreter
cannot run, the grid dependency control, in the code compiled for sm_90a (no GPU): every kernel lets the next launch
start, then waits for the one before, and touches nothing an earlier launch writes before that wait (a stationary
tile loads its weight ahead of it, nothing else); and on a GPU the same bits as without it (``gpu``)."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch

from conftest import requires_triton, triton_device
from elmo_fast import ops
from elmo_fast.kernels import lstmp as KL
from elmo_fast.kernels._common import INTERPRETER
from elmo_fast.probes import probe

pytestmark = [pytest.mark.triton, requires_triton]
DEV = triton_device()
ENV = KL.PDL_ENV


def _pretend_gpu(monkeypatch, major: int):
    monkeypatch.setattr(KL, "device_target", lambda device: KL.Target(interpret=False, sms=132, major=major))


def test_the_setting(monkeypatch):
    """Off unless set; 1 / 0 (and on / off ...); anything else refused by name. CPU tensors never use it (the
    interpreter has no grid dependency control); a GPU before Hopper cannot, and says how to go on."""
    monkeypatch.delenv(ENV, raising=False)
    cpu = torch.device("cpu")
    assert KL.pdl_on(cpu) is False
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ValueError, match=r"ELMO_FAST_LSTMP_PDL='maybe': expected 1 \(on\) or 0 \(off\)"):
        KL.pdl_on(cpu)
    monkeypatch.setenv(ENV, "1")
    assert KL.pdl_on(cpu) is False
    _pretend_gpu(monkeypatch, 8)
    with pytest.raises(RuntimeError, match=r"compute capability 9.0 or later \(Hopper\); cpu is 8.x\. Unset "
                                           r"ELMO_FAST_LSTMP_PDL"):
        KL.pdl_on(cpu)
    _pretend_gpu(monkeypatch, 9)
    assert KL.pdl_on(cpu) is True
    monkeypatch.setenv(ENV, "0")
    assert KL.pdl_on(cpu) is False


def test_the_plan_builds_every_kernel_for_it():
    """Every launch of a chain call, forward and backward, with and without the fused reduce, carries PDL; none
    without the setting; the interpreter's plan refuses it."""
    for fuse in (False, True):
        plan = KL.launch_plan(16, 4, 4096, 512, torch.bfloat16, training=True, pdl=True, fuse_reduce=fuse)
        assert plan and all(la.constexprs.get("PDL") is True for la in plan.values()), plan.keys()
        plan = KL.launch_plan(16, 4, 4096, 512, torch.bfloat16, training=True, fuse_reduce=fuse)
        assert not any("PDL" in la.constexprs for la in plan.values())
    with pytest.raises(ValueError, match="pdl needs compiled code on a GPU"):
        KL.launch_plan(16, 4, 64, 16, torch.float32, training=True, target=INTERPRETER, pdl=True)


def test_each_loop_launches_its_first_kernel_plainly_and_the_rest_dependent(monkeypatch):
    """The loops' launch options under a PDL plan: every launch gets ``launch_pdl`` but each loop's first (forward:
    step 0's cell kernel; backward: the prologue's reduce), which follows the copies into the loop's buffers, and
    every kernel is the PDL build (it waits either way). Without the setting no launch has the option."""
    from elmo_fast.kernels import lstmp_graphs

    g = torch.Generator().manual_seed(0)
    B, T, D, H, P = 3, 2, 8, 12, 5
    x, w_in, w_rec, bias = (torch.randn(*s, generator=g) for s in ((B, T, D), (D, 4 * H), (P, 4 * H), (4 * H,)))
    w_proj, h0, c0 = torch.randn(H, P, generator=g), torch.zeros(B, P), torch.zeros(B, H)
    lengths = torch.tensor([2, 1, 0])
    kw = dict(cell_clip=3.0, proj_clip=3.0, reverse=False, residual=False)
    _, fbufs = KL.fwd_setup(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, forget_bias=1.0, save=True, **kw)
    cache = (fbufs["z"], fbufs["cpre"], fbufs["hpre"], fbufs["hprev"], fbufs["m"], fbufs["lengths"])
    _, bbufs = KL.bwd_setup(torch.zeros(B, T, P), torch.zeros(B, P), torch.zeros(B, H), x, w_rec, w_proj, c0, cache,
                            **kw)
    for pdl in (True, False):
        plan = KL.launch_plan(B, T, H, P, torch.float32, training=True, pdl=pdl)  # the H100 target's plan
        for loop, bufs, n in ((KL._fwd_loop, fbufs, 3 * T), (KL._bwd_loop, bbufs, 1 + 3 * T)):
            calls = []
            monkeypatch.setattr(lstmp_graphs._rec, "calls", calls, raising=False)
            loop(plan, bufs)
            monkeypatch.setattr(lstmp_graphs._rec, "calls", None)
            assert len(calls) == n
            options = [kwargs.get("launch_pdl", False) for _, _, _, kwargs in calls]
            assert options == ([False] + [True] * (n - 1) if pdl else [False] * n)
            assert all(kwargs.get("PDL", False) is pdl for _, _, _, kwargs in calls)


def test_loop_graphs_keep_the_two_plans_apart(monkeypatch):
    """The setting is part of a loop graph's key: a signature captured without it is not replayed for a call with
    it. (Here the two calls differ in the key only: the plan is built without PDL, which the CPU cannot run.)"""
    keys = []
    real_acquire, real_plan = KL.graphs.POOL.acquire, KL.launch_plan
    monkeypatch.setattr(KL.graphs.POOL, "acquire", lambda key, how, setup: keys.append(key) or real_acquire(key, how,
                                                                                                          setup))
    monkeypatch.setattr(KL, "launch_plan", lambda *a, pdl=False, **k: real_plan(*a, **k))
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "record" if DEV == "cpu" else "1")
    g = torch.Generator().manual_seed(1)
    args = [t.to(DEV) for t in (torch.randn(2, 3, 8, generator=g), torch.randn(8, 48, generator=g),
                                torch.randn(5, 48, generator=g), torch.randn(48, generator=g),
                                torch.randn(12, 5, generator=g), torch.zeros(2, 5), torch.zeros(2, 12))]
    lengths = torch.tensor([3, 2], device=DEV)
    for on in (False, True):
        monkeypatch.setattr(KL, "pdl_on", lambda device, on=on: on)
        ops.lstmp(*args, lengths, cell_clip=3.0, proj_clip=3.0, backend="triton")
    assert len(keys) == 2 and keys[0][:-1] == keys[1][:-1] and (keys[0][-1], keys[1][-1]) == (False, True)


PTX_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
import torch, triton
import kernel_report as KR
from elmo_fast.kernels import lstmp as KL
from elmo_fast.kernels._common import INTERPRETER
from elmo_fast.kernels._common import Launch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

REG = re.compile(r"%(?:rd|r|p|f|fd|h|hh|rs)\d+")


def params_of(lines, reg, seen=None):
    # the kernel parameters a register's value is computed from (the defining instructions above the wait)
    seen = set() if seen is None else seen
    if reg in seen:
        return set()
    seen.add(reg)
    for ln in reversed(lines):
        m = re.match(r"\s*(?:@!?%p\d+\s+)?([\w.:]+)\s+(.*);", ln)
        if not m or not m.group(2).startswith(reg + ",") and not m.group(2).startswith(reg + " "):
            continue
        if m.group(1).startswith("ld.param"):
            return {int(re.search(r"_param_(\d+)", ln).group(1))}
        out = set()
        for src in REG.findall(m.group(2))[1:]:
            out |= params_of(lines, src, seen)
        return out
    return set()


cases = []
for B, dt, fuse, tiles in ((384, torch.bfloat16, False, None), (1, torch.bfloat16, True, None),
                           (384, torch.bfloat16, False, {"bwd_cell": KL.Tile(64, 64, 0, 8, 1, stationary=True,
                                                                            groups=2)})):
    plan = KL.launch_plan(B, 20, 4096, 512, dt, training=True, pdl=True, fuse_reduce=fuse, tiles=tiles)
    for name, la in plan.items():
        if tiles and name != "bwd_cell":
            continue
        case = type("Case", (), {})()
        case.launch = Launch(la.kernel, la.grid, dict(la.constexprs, num_warps=la.num_warps,
                                                      num_stages=la.num_stages, launch_pdl=True))
        case.args = tuple(KR.M(v) if isinstance(v, torch.dtype) else (3 if n == "s" else v) for n, v in la.args)
        options, signature, constexprs, attrs = KR.compile_key(case)
        ck = triton.compile(ASTSource(la.kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options.__dict__)
        lines = ck.asm["ptx"].splitlines()
        waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
        trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
        pre = lines[:waits[0]] if waits else lines
        loads = [ln for ln in pre if re.search(r"\bld\.global", ln)]
        weight = [i for i, (n, _) in enumerate(la.args) if n in ("w_rec", "w_rec_g", "w_proj")]
        cases.append(dict(
            name=f"{name} B={B}" + (" stationary" if tiles else ""), launch_pdl=ck.metadata.launch_pdl,
            stationary=bool(la.constexprs.get("STATIONARY")), waits=len(waits), triggers=len(trig),
            trigger_first=bool(trig and waits and trig[0] < waits[0]),
            pre_writes=sum(bool(re.search(r"\b(?:st\.global|atom\.|red\.|cp\.async)", ln)) for ln in pre),
            pre_loads=len(loads), weight=weight,
            load_params=sorted(set().union(*[params_of(pre, re.search(r"\[\s*(%rd\d+)", ln).group(1))
                                             for ln in loads]))))
print(json.dumps(cases))
"""


def test_the_compiled_kernels_wait_before_touching_what_a_launch_before_wrote():
    """Compiled for sm_90a (no GPU): every kernel of a PDL plan (the six of a training chain call at B=384, the fused
    reduce at B=1, a stationary backward cell tile) is built with the launch attribute, lets the next launch start
    (``griddepcontrol.launch_dependents``) once, before it waits (``griddepcontrol.wait``) once, and before the wait
    writes nothing and loads nothing but, in a stationary tile, its weight: every address loaded ahead of the wait
    is computed from the weight's parameter alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", PTX_SCRIPT, str(root / "bench")], env=env, capture_output=True,
                       text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    cases = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(cases) == 6 + 5 + 1  # B=1 fused: fwd_cell, fwd_proj (the fused reduce), bwd_cell, bwd_rec, bwd_reduce
    for c in cases:
        assert c["launch_pdl"] and c["waits"] == 1 and c["triggers"] == 1 and c["trigger_first"], c
        assert c["pre_writes"] == 0, c
        if c["stationary"]:
            assert c["pre_loads"] > 0 and c["load_params"] == c["weight"], c
        else:
            assert c["pre_loads"] == 0, c
    assert sum(c["stationary"] for c in cases) == 2  # the forward cell at 384 and the stationary backward tile


def _inputs(B, T, D, H, P, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to("cuda", dtype)

    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    if B > 1:
        lengths[-1] = 0
    return [r(B, T, D), r(D, 4 * H, scale=0.3), r(P, 4 * H, scale=0.3), r(4 * H, scale=0.1), r(H, P, scale=0.3),
            r(B, P, scale=0.5), r(B, H, scale=0.5)], lengths.to("cuda")


def _run(monkeypatch, on: bool, floats, lengths, *, grads: bool):
    monkeypatch.setenv(ENV, "1" if on else "0")
    leaves = [t.detach().clone().requires_grad_(grads) for t in floats]
    y, hn, cn = ops.lstmp(*leaves, lengths, cell_clip=3.0, proj_clip=3.0, reverse=True, residual=True,
                          backend="triton")
    out = [y.detach(), hn.detach(), cn.detach()]
    if grads:
        g = torch.Generator().manual_seed(7)
        loss = sum((t * torch.randn(t.shape, generator=g).to(t.device, t.dtype)).sum() for t in (y, hn, cn))
        out += list(torch.autograd.grad(loss, leaves))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B", [1, 384])
def test_gpu_pdl_gives_the_same_bits(monkeypatch, B, dtype):
    """On a GPU (Hopper or later), at the original model's sizes: with programmatic dependent launch, loop graphs on
    (the default) and off, 20 calls each, forward and training (every gradient), the bits of the plain launches (a
    kernel reading before its wait, or a missing wait, would race the step before it)."""
    from elmo_fast.kernels import lstmp_graphs

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    floats, lengths = _inputs(B, 20, 512, 4096, 512, dtype, seed=B)
    for grads in (False, True):
        want = _run(monkeypatch, False, floats, lengths, grads=grads)
        for graphs in (True, False):
            with lstmp_graphs.suspended() if not graphs else contextlib.nullcontext():
                with probe() as counts:
                    _run(monkeypatch, True, floats, lengths, grads=grads)
                assert counts.launches
                for i in range(20):
                    got = _run(monkeypatch, True, floats, lengths, grads=grads)
                    assert all(torch.equal(a, b) for a, b in zip(got, want)), (grads, graphs, i)
