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
from test_lstmp_fused_reduce import _inputs
from test_lstmp_fused_reduce import _run as fused_reduce_run

pytestmark = [pytest.mark.triton, requires_triton]
DEV = triton_device()
ENV = KL.PDL_ENV


def _pretend_gpu(monkeypatch, major: int):
    monkeypatch.setattr(KL, "device_target", lambda device: KL.Target(interpret=False, sms=132, major=major))
    monkeypatch.setattr(KL, "triton_interpret", lambda: False)


def test_the_setting(monkeypatch):
    """Off unless set; anything but an on/off value refused by name. Off whatever the setting for CPU tensors, under
    the interpreter, while torch.compile traces, and on a GPU that cannot (before Hopper, ROCm): there with one
    warning a device, since it changes no result."""
    import warnings

    monkeypatch.delenv(ENV, raising=False)
    cpu = torch.device("cpu")
    assert KL.pdl_on(cpu) is False
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ValueError, match=r"ELMO_FAST_LSTMP_PDL='maybe': expected 1 or 0"):
        KL.pdl_on(cpu)
    monkeypatch.setenv(ENV, "1")
    assert KL.pdl_on(cpu) is False  # CPU tensors (the interpreter's target)
    _pretend_gpu(monkeypatch, 9)
    monkeypatch.setattr(KL, "triton_interpret", lambda: True)
    assert KL.pdl_on(cpu) is False  # TRITON_INTERPRET=1: the interpreter runs every kernel, a pretend GPU's too
    _pretend_gpu(monkeypatch, 9)
    assert KL.pdl_on(cpu) is True
    assert KL.pdl_on(cpu, traced=True) is False
    monkeypatch.setattr(KL, "_PDL_WARNED", set())
    for major, hip, why in ((8, None, "compute capability 8.x"), (9, "6.2", "ROCm")):
        _pretend_gpu(monkeypatch, major)
        monkeypatch.setattr(torch.version, "hip", hip)
        KL._PDL_WARNED.clear()
        with pytest.warns(RuntimeWarning, match=f"ELMO_FAST_LSTMP_PDL=1 has no effect on cpu \\({why}\\)"):
            assert KL.pdl_on(cpu) is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert KL.pdl_on(cpu) is False  # warned once a device
    monkeypatch.setenv(ENV, "0")
    assert KL.pdl_on(cpu) is False


def test_the_plan_builds_every_kernel_for_it():
    """Every launch of a chain call, forward and backward, with and without the fused reduce, carries PDL; none
    without the setting; the interpreter's plan refuses it. With it the 16-bit forward cell kernel of batches up to
    16 takes ``PDL_TUNED``'s stationary tile (its weight then loads ahead of the wait), where it fits (not at
    P = 1024: TUNED's K-loop tile then); fp32 and larger batches keep TUNED's tiles."""
    for fuse in (False, True):
        plan = KL.launch_plan(16, 4, 4096, 512, torch.bfloat16, training=True, pdl=True, fuse_reduce=fuse)
        assert plan and all(la.constexprs.get("PDL") is True for la in plan.values()), plan.keys()
        plan = KL.launch_plan(16, 4, 4096, 512, torch.bfloat16, training=True, fuse_reduce=fuse)
        assert not any("PDL" in la.constexprs for la in plan.values())
    with pytest.raises(ValueError, match="pdl needs compiled code on a GPU"):
        KL.launch_plan(16, 4, 64, 16, torch.float32, training=True, target=INTERPRETER, pdl=True)

    def cell(B, dtype, pdl, P=512):
        return KL.launch_plan(B, 4, 4096, P, dtype, training=False, pdl=pdl)["fwd_cell"].tile

    for B in (1, 16):
        assert cell(B, torch.bfloat16, True) == KL.Tile(16, 32, 0, 8, 1, fused=True, stationary=True)
        assert cell(B, torch.float16, True).stationary and not cell(B, torch.bfloat16, False).stationary
        assert cell(B, torch.float32, True) == cell(B, torch.float32, False)
        assert cell(B, torch.bfloat16, True, P=1024) == cell(B, torch.bfloat16, False, P=1024)  # 288 KiB: no fit
        small = KL.Target(interpret=False, sms=188, smem=99 * 1024, major=12)  # a Blackwell desktop's 99 KiB
        assert KL.launch_plan(B, 4, 4096, 512, torch.bfloat16, training=False, pdl=True, target=small)[
            "fwd_cell"].tile == KL.launch_plan(B, 4, 4096, 512, torch.bfloat16, training=False, target=small)[
            "fwd_cell"].tile
    for B in (64, 128, 384):
        assert cell(B, torch.bfloat16, True) == cell(B, torch.bfloat16, False)


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
        monkeypatch.setattr(KL, "pdl_on", lambda device, traced=False, on=on: on)
        ops.lstmp(*args, lengths, cell_clip=3.0, proj_clip=3.0, backend="triton")
    assert len(keys) == 2 and keys[0][:-1] == keys[1][:-1] and (keys[0][-1], keys[1][-1]) == (False, True)


PTX_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
import torch, triton
import kernel_report as KR
from elmo_fast.kernels import lstmp as KL
from elmo_fast.kernels._common import Launch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INSTR = re.compile(r"^(?:@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*)$")
REG = re.compile(r"%[a-z]+\d+\b")  # virtual registers of every kind (%r, %rd, %rs, %rq, %f, %fd, %p, %b, %h, ...)
SPECIAL = re.compile(r"%(?:tid|ntid|ctaid|nctaid|laneid|warpid|nwarpid|smid|nsmid|gridid|clusterid|cluster_ctaid)"
                     r"(?:\.[xyz])?\b")
NUMBER = re.compile(r"^(?:-?\d+|0[xX][0-9a-fA-F]+|0[fFdD][0-9a-fA-F]+|-?\d+\.\d*(?:[eE][-+]?\d+)?)$")
HARMLESS = re.compile(r"(?:ld\.param|ld\.shared|st\.shared)\b")
NO_DEST = ("st.", "atom.", "red.", "cp.", "prefetch.", "bra", "bar.", "griddepcontrol", "ret", "exit", "call", "brx",
           "trap", "multimem.", "fence", "membar")
BRANCH = re.compile(r"(?:bra|brx|ret|exit|call|trap)\b")


def memory_op(op, rest):
    # anything that touches memory but parameter and shared memory: an address operand, or a memory opcode
    return not HARMLESS.match(op) and ("[" in rest or re.match(r"(?:ld|ldu|st|atom|red|cp|prefetch|multimem|tex|suld|"
                                                                r"sust|tensormap)\b", op) is not None)


def instructions(lines):
    # one (opcode, predicated, destination registers, sources, parameter of an ld.param, rest) per instruction, in
    # order: a line split at ';', comments, directives and labels dropped. Sources: registers, and "?" for an operand
    # that is neither a register, an immediate nor a special register (a symbol: its value is not traced)
    out = []
    for ln in lines:
        for piece in ln.split("//")[0].split(";"):
            piece = piece.strip()
            if not piece or piece.startswith((".", "{", "}", "$")) or piece.endswith(":"):
                continue
            m = INSTR.match(piece)
            if not m:
                out.append(("?", False, [], ["?"], None, piece))
                continue
            op, rest = m.group(1), m.group(2)
            param = re.search(r"\[\s*\w+_param_(\d+)\s*\]", rest) if op.startswith("ld.param") else None
            if op.startswith(NO_DEST):
                dst, src = "", rest
            elif rest.startswith("{"):
                dst, _, src = rest.partition("}")
            else:
                dst, _, src = rest.partition(",")
            sources = REG.findall(src)
            if param is None:
                for tok in re.split(r"[\s,{}\[\]+]+", SPECIAL.sub(" ", REG.sub(" ", src))):
                    if tok and not NUMBER.match(tok):
                        sources.append("?")
            out.append((op, piece.startswith("@"), REG.findall(dst), sources, int(param.group(1)) if param else None,
                        rest))
    return out


def params_of(ins, reg, before, seen):
    # the parameters the value of `reg` as read by instruction `before` is computed from; "?" where the trace does
    # not end in parameters, immediates and special registers (a register never defined, a symbol, a value loaded)
    if (reg, before) in seen:
        return set()
    seen.add((reg, before))
    out = set()
    for i in range(before - 1, -1, -1):
        op, predicated, dst, src, param, rest = ins[i]
        if reg not in dst:
            continue
        if param is not None:
            out.add(str(param))
        elif memory_op(op, rest) or op == "?":
            out.add("?")
        else:
            for r in src:
                out |= {"?"} if r == "?" else params_of(ins, r, i, seen)
        if not predicated:  # a predicated definition may not happen: the one before it counts too
            return out
    return out | {"?"}


def check(lines, args, stationary):
    waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "{"), 0)
    pre = lines[start:waits[0]] if waits else lines
    ins = instructions(pre)
    memory = [(i, op, src) for i, (op, _, dst, src, _, rest) in enumerate(ins) if memory_op(op, rest)]
    loads = [(i, src) for i, op, src in memory if op.startswith("ld.global")]
    traced = set()
    for i, src in loads:
        addr = re.search(r"\[\s*(%[a-z]+\d+)", ins[i][5])
        traced |= params_of(ins, addr.group(1), i, set()) if addr else {"?"}
    return dict(
        stationary=stationary, waits=len(waits), triggers=len(trig),
        trigger_first=bool(trig and waits and trig[0] < waits[0]),
        wait_predicated=bool(waits and re.match(r"\s*@", lines[waits[0]])),
        branches=sum(bool(BRANCH.match(op)) for op, *_ in ins) + sum(bool(re.match(r"\s*\$L__BB\w*:", ln))
                                                                       for ln in pre),
        other_memory=[op for i, op, _ in memory if not op.startswith("ld.global")], pre_loads=len(loads),
        weight=[str(i) for i, (n, _) in enumerate(args) if n in ("w_rec", "w_rec_g", "w_proj")],
        load_params=sorted(traced))


if sys.argv[2] == "selftest":  # hand-written PTX: the weight's load (parameter 0) and one other, each case a way
    # a second parameter's address could hide; the last two cases: an early return, two instructions on a line
    head = [".entry k(.param .u64 k_param_0, .param .u64 k_param_1)", "{", "ld.param.b64 %rd1, [k_param_0];",
            "ld.param.b64 %rd7, [k_param_1];", "mov.u32 %r8, %tid.x;", "mul.wide.u32 %rd8, %r8, 16;",
            "add.s64 %rd9, %rd1, %rd8;", "@%p1 ld.global.v4.b32 { %r3, %r4, %r5, %r6 }, [ %rd9 + 0 ];"]
    tail = ["griddepcontrol.launch_dependents;", "griddepcontrol.wait;", "}"]
    hide = {"pair": ["mov.b64 {%r1, %r2}, %rd7;", "mov.b64 %rd2, {%r1, %r2};", "ld.global.b32 %r9, [ %rd2 + 0 ];"],
            "predicated": ["mov.b64 %rd2, %rd7;", "@%p2 mov.b64 %rd2, %rd1;", "ld.global.b32 %r9, [ %rd2 + 0 ];"],
            "symbol": ["mov.u64 %rd2, k_param_1;", "ld.global.b32 %r9, [ %rd2 + 0 ];"],
            "q-register": ["mov.b64 %rq2, %rd7;", "mov.b64 %rd2, %rq2;", "ld.global.b32 %r9, [ %rd2 + 0 ];"],
            "one-line": ["mov.b64 %rd2, %rd1; ld.global.b32 %r9, [ %rd7 + 0 ];"],
            "return": ["@%p3 ret;"]}
    out = []
    for name, body in hide.items():
        c = check(head + body + tail, (("w_rec", None), ("hop", None)), True)
        out.append(dict(c, name=name))
    print(json.dumps(out))
    sys.exit()

cases = []
for B, dt, train, fuse, rev, tiles in (
        (384, torch.bfloat16, True, False, False, None), (1, torch.bfloat16, True, True, False, None),
        (384, torch.bfloat16, True, False, True, {"bwd_cell": KL.Tile(64, 64, 0, 8, 1, stationary=True, groups=2)}),
        (1, torch.float32, True, False, False, None), (384, torch.bfloat16, True, False, True, None),
        (1, torch.bfloat16, False, False, False, None), (16, torch.bfloat16, False, False, True, None)):
    plan = KL.launch_plan(B, 20, 4096, 512, dt, training=train, pdl=True, fuse_reduce=fuse, tiles=tiles,
                          reverse=rev, residual=rev)
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
        cases.append(dict(check(ck.asm["ptx"].splitlines(), la.args, bool(la.constexprs.get("STATIONARY"))),
                          launch_pdl=ck.metadata.launch_pdl,
                          name=f"{name} B={B} {dt} train={train} fuse={fuse} rev={rev} tiles={bool(tiles)}"))
print(json.dumps(cases))
"""


def _ptx(what: str) -> list[dict]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", PTX_SCRIPT, str(root / "bench"), what], env=env, capture_output=True,
                       text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_ptx_check_follows_an_address_to_its_parameter():
    """The check below on hand-written PTX: beside the weight's load (parameter 0, its address offset by the thread
    index) a load whose address is parameter 1's, hidden five ways (through a register pair, behind a predicated
    definition, as a symbol, through a register kind of its own, on the line of another instruction), is found every
    time; and an early return before the wait counts as a branch."""
    cases = {c["name"]: c for c in _ptx("selftest")}
    for name in ("pair", "predicated", "symbol", "q-register", "one-line"):
        c = cases[name]
        assert c["pre_loads"] == 2 and c["weight"] == ["0"] and c["load_params"] != ["0"], c
    assert cases["pair"]["load_params"] == ["0", "1"] and cases["return"]["branches"] == 1, cases
    assert cases["return"]["load_params"] == ["0"] and cases["pair"]["branches"] == 0, cases


def test_the_compiled_kernels_wait_before_touching_what_a_launch_before_wrote():
    """Compiled for sm_90a (no GPU): every kernel of a PDL plan (a training chain call at B=384 forward, and reverse
    with the residual; one in fp32 at B=1; the fused reduce and PDL_TUNED's stationary forward cell tile at B=1, in
    training and in inference, and in reverse at B=16; a stationary backward cell tile) is built with the launch
    attribute, lets the next launch start (``griddepcontrol.launch_dependents``) once, before it waits
    (``griddepcontrol.wait``) once, unconditionally (no branch, return or call before it, not predicated), and before
    the wait writes nothing and reads no memory but, in a stationary tile, its weight: every address loaded ahead of
    the wait traces back to the weight's parameter alone."""
    cases = _ptx("kernels")
    assert len(cases) == 6 + 5 + 1 + 6 + 6 + 3 + 3
    for c in cases:
        assert c["launch_pdl"] and c["waits"] == 1 and c["triggers"] == 1 and c["trigger_first"], c
        assert not c["wait_predicated"] and c["branches"] == 0 and c["other_memory"] == [], c
        if c["stationary"]:
            assert c["pre_loads"] > 0 and c["load_params"] == c["weight"], c
        else:
            assert c["pre_loads"] == 0, c
    # the forward cell at 1 (twice) and 16 (PDL_TUNED's), the backward one; at 384 a K-loop tile since the H200 timed it
    assert sum(c["stationary"] for c in cases) == 4


def _run(monkeypatch, on: bool, fused: bool, floats, lengths, *, grads: bool, backend="triton"):
    """test_lstmp_fused_reduce's run (reverse with the residual, both clips, its fixed upstream gradients) with the
    setting on or off."""
    monkeypatch.setenv(ENV, "1" if on else "0")
    return fused_reduce_run(monkeypatch, "16" if fused else "0", floats, lengths, reverse=True, residual=True,
                            grads=grads, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("B,dtype,fused", [(1, torch.bfloat16, False), (1, torch.bfloat16, True),
                                           (1, torch.float32, False), (384, torch.bfloat16, False)],
                         ids=["B1-bf16", "B1-bf16-fusedreduce", "B1-fp32", "B384-bf16"])
def test_gpu_pdl_gives_the_same_bits(monkeypatch, request, B, dtype, fused):
    """On a GPU (Hopper or later), at the original model's sizes (the latency target's batch in both dtypes, also with
    the fused reduce, and the training batch; both bf16 batches with a forward cell tile that loads its weight ahead
    of the wait): with programmatic dependent launch, loop graphs on (the default) and off, 20 calls each, forward
    and training (every gradient), the bits of the plain launches (a kernel reading before its wait, or a missing
    wait, would race the step before it); eagerly, every launch but each loop's first carried the attribute. Those
    plain launches run PDL_TUNED's tiles too, so in bf16 they are checked against the fp64 reference (within the
    budget of the reference run in bf16)."""
    from test_lstmp_triton import assert_low_precision

    from elmo_fast.kernels import lstmp_graphs

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    for key, tile in KL.PDL_TUNED.items():  # the same tiles with and without PDL: the launches are all that differ
        monkeypatch.setitem(KL.TUNED, key, tile)
    # loop graphs are keyed by the setting, not the tiles: none captured at other tiles is replayed here, or after
    lstmp_graphs.POOL.clear()
    request.addfinalizer(lstmp_graphs.POOL.clear)
    floats, lengths = _inputs(B, 20, 512, 4096, 512, dtype, "cuda", seed=B)
    T = 20
    for grads in (False, True):
        want = _run(monkeypatch, False, fused, floats, lengths, grads=grads)
        if grads and dtype == torch.bfloat16:
            exact = _run(monkeypatch, False, fused, [t.double() for t in floats], lengths, grads=True,
                         backend="reference")
            low = _run(monkeypatch, False, fused, floats, lengths, grads=True, backend="reference")
            assert_low_precision(dict(enumerate(want)), dict(enumerate(exact)), dict(enumerate(low)), dtype,
                                 "[plain launches, PDL_TUNED tiles] ")
        for graphs in (True, False):
            with lstmp_graphs.suspended() if not graphs else contextlib.nullcontext():
                with probe() as counts:
                    _run(monkeypatch, True, fused, floats, lengths, grads=grads)
                # eager either way (a first call of the PDL signature, or no graphs): every launch but each loop's
                # first carries the attribute (forward: 3 or, fused, 2 a step; backward: 3 a step and its prologue)
                dependent = (2 if fused else 3) * T - 1 + (3 * T if grads else 0)
                assert sum(bool(la.flags.get("launch_pdl")) for la in counts.launches) == dependent, counts.launches
                for i in range(20):
                    got = _run(monkeypatch, True, fused, floats, lengths, grads=grads)
                    assert all(torch.equal(a, b) for a, b in zip(got, want)), (grads, graphs, i)
