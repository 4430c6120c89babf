"""The LSTMP time loops in elmo_fast._cpu (csrc/cpu/lstmp_loop.cpp): bit-identical to the Python loops they replace,
on every chain shape of the cpu backend's tests (panels forced: the test weights are small), in training (the
projection on panels or on torch.mm) and in inference."""
from __future__ import annotations

import pytest
import torch

from elmo_fast.cpu import lstmp as L
from elmo_fast.cpu import lstmp_cpu, packed
from elmo_fast.cpu.ext import cpu_ext
from elmo_fast.cpu.packed import PackedWeightCache

from conftest import poison_allocations
from test_cpu_backend import LSTMP_CASES, _chain, _run_lstmp

ext = cpu_ext()
pytestmark = pytest.mark.skipif(ext is None or not hasattr(ext, "backward_loop") or not ext.small_mm_available(),
                                reason="needs elmo_fast._cpu with csrc/cpu/lstmp_loop.cpp on an AVX-512 CPU")


@pytest.fixture
def panels(monkeypatch):
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    monkeypatch.setattr(packed, "_PANELS_OK", True)
    monkeypatch.setenv("ELMO_FAST_CPU_PANELS", "1")
    monkeypatch.setenv("ELMO_FAST_CPU_TRAIN_PACK", "1")


LOOP_CASES = [*LSTMP_CASES,  # and a projection clip without a cell clip
              pytest.param(4, 6, 5, 7, 3, [6, 2, 6, 1], False, False, True, None, 0.4, id="proj-clip-only")]


@pytest.mark.parametrize("B, T, D, H, P, lengths, reverse, residual, proj, cell_clip, proj_clip", LOOP_CASES)
@pytest.mark.parametrize("mode", ["train", "train-proj-mm", "inference", "inference-proj-mm", "train-y-only"])
def test_loops_are_bit_identical_to_the_python_loops(panels, monkeypatch, B, T, D, H, P, lengths, reverse,
                                                     residual, proj, cell_clip, proj_clip, mode):
    if residual:
        D = P
    kw = dict(cell_clip=cell_clip, proj_clip=proj_clip, reverse=reverse, residual=residual, forget_bias=1.0)
    args = _chain(B, T, D, H, P, proj, torch.float32, seed=B * 10 + T)
    g = torch.Generator().manual_seed(B + T)
    up = [torch.randn(B, T, P, generator=g), torch.randn(B, P, generator=g), torch.randn(B, H, generator=g)]
    if mode == "train-y-only":
        up[1], up[2] = torch.zeros(B, P), torch.zeros(B, H)
    if mode == "train-proj-mm":  # training's forward leaves w_proj unpacked where its pack does not pay
        monkeypatch.setattr(L, "pack_pays", lambda w, rows, uses: w.shape[1] == 4 * H)
    if mode == "inference-proj-mm":  # a w_proj below the packing size, a w_rec above it
        monkeypatch.setattr(packed, "_MIN_ELEMENTS", H * P + 1)
    calls = []
    real = L._loop_ext

    def spy(*a, **k):
        got = real(*a, **k)
        calls.append((k.get("forward", False), got is not None))
        return got

    def run():
        if mode.startswith("inference"):
            with torch.no_grad():
                return lstmp_cpu(*args, torch.tensor(lengths), weight_cache=PackedWeightCache(), **kw)
        return _run_lstmp(lstmp_cpu, args, lengths, up, **kw)

    monkeypatch.setattr(L, "_loop_ext", spy)
    with monkeypatch.context() as mp:
        poison_allocations(mp)  # an element the loops do not write fails
        fast = run()
    ran = {fwd for fwd, used in calls if used}
    want = {True} if mode.startswith("inference") else {True, False}
    assert ran == want, f"the extension's loops did not run: {calls}"
    monkeypatch.setattr(L, "_loop_ext", lambda *a, **k: None)
    slow = run()
    flat = (lambda r: list(r)) if mode.startswith("inference") else (lambda r: [*r[0], *r[1]])
    for i, (a, b) in enumerate(zip(flat(fast), flat(slow))):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), f"result {i}: the loops differ by {float((a - b).abs().max()):.3g}"


def test_loop_arguments_are_checked():
    B, P, H, N = 2, 3, 4, 3
    f = torch.zeros
    rec = ext.pack_panels(torch.zeros(4 * H, P), 16)
    good = dict(dys=f(N, P), carry_h=f(B, P), carry_c=f(B, H), c_init=f(B, H), gates=f(N, 4 * H), c_pre=f(N, H),
                tc=f(N, H), h_pre=None, dh_all=None, dz=f(N, 4 * H), rec=rec, proj=None, cell_clip=None,
                proj_clip=None)
    with pytest.raises(RuntimeError, match="without a projection P"):
        ext.backward_loop([2, 1], [0, 2], **good)
    good.update(carry_h=f(B, H), dys=f(N, H), rec=ext.pack_panels(torch.zeros(4 * H, H), 16))
    ext.backward_loop([2, 1], [0, 2], **good)
    with pytest.raises(RuntimeError, match=r"step 1 \(n = 1, off = 1\) does not follow the packed layout"):
        ext.backward_loop([2, 1], [0, 1], **good)
    with pytest.raises(RuntimeError, match="fewer than the 4 positions"):
        ext.backward_loop([2, 2], [0, 2], **good)
    with pytest.raises(RuntimeError, match="given together or not at all"):
        ext.backward_loop([2, 1], [0, 2], **{**good, "h_pre": f(N, H)})
    with pytest.raises(RuntimeError, match="given together"):
        ext.forward_loop([2, 1], [0, 2], f(N, 4 * H), f(B, H), f(B, H), f(N, H), f(N, H), None, None, None,
                         good["rec"], None, None, None, None)
    with pytest.raises(RuntimeError, match="proj or proj_w, not both"):
        ext.forward_loop([2, 1], [0, 2], f(N, 4 * H), f(B, H), f(B, H), f(N, H), None, None, None, None,
                         good["rec"], good["rec"], f(H, H), None, None)
