"""Loop graphs of the Triton LSTMP (``elmo_fast.kernels.lstmp_graphs``): the time loops replayed from a graph give
the eager results bit for bit, forward and every gradient, across calls whose inputs, lengths and weights change;
saved activations are leased to their backward and never overwritten under it.

On CPU the graphs run in ``ELMO_FAST_LOOP_GRAPHS=record`` mode: capture records each launch with its arguments and
a replay launches exactly those, so a buffer a call forgot to refill, or replaced instead of overwriting, shows up
as a wrong result here as it would in a CUDA graph. The ``gpu`` test does the same with real CUDA graphs.
"""
from __future__ import annotations

import gc

import pytest
import torch

from conftest import requires_triton, triton_device
from test_lstmp_triton import GRAD_NAMES, flags, make_case, upstream_grads

pytestmark = [pytest.mark.triton, requires_triton]

DEV = triton_device()


@pytest.fixture
def graphs(monkeypatch):
    from elmo_fast.kernels import lstmp_graphs

    lstmp_graphs.POOL.clear()
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "1" if DEV == "cuda" else "record")
    yield lstmp_graphs
    lstmp_graphs.POOL.clear()
    lstmp_graphs.OFF.clear()


def _lstmp(*args, **kw):
    from elmo_fast.kernels.lstmp import lstmp_triton

    return lstmp_triton(*args, **kw)


def _params(case, dtype):
    return {k: (case[k].to(DEV, dtype).clone().requires_grad_() if case[k] is not None else None) for k in GRAD_NAMES}


def _step(params, case, fl, seed, dtype):
    """One call with fresh x / h0 / c0 / lengths (as a new batch brings), then backward: outputs and grads."""
    g = torch.Generator().manual_seed(seed)
    B, T, _ = case["x"].shape
    inp = dict(params)
    for k in ("x", "h0", "c0"):
        inp[k] = torch.randn(params[k].shape, generator=g, dtype=torch.float64).to(DEV, dtype).requires_grad_()
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    y, h_n, c_n = _lstmp(*(inp[k] for k in GRAD_NAMES), lengths.to(DEV), **fl)
    gy, gh, gc = (u.to(DEV, dtype) for u in upstream_grads(seed)(y, h_n, c_n))
    torch.autograd.backward((y, h_n, c_n), (gy, gh, gc))
    out = {"y": y, "h_n": h_n, "c_n": c_n}
    out.update({f"d{k}": inp[k].grad for k in GRAD_NAMES if inp[k] is not None and inp[k].grad is not None})
    for p in params.values():
        if p is not None:
            p.grad = None
    return {k: v.detach().clone() for k, v in out.items()}


def _train(case, fl, dtype, steps=3):
    """``steps`` calls with an in-place weight update between them (what an optimizer does)."""
    params = _params(case, dtype)
    results = []
    for i in range(steps):
        results.append(_step(params, case, fl, seed=100 + i, dtype=dtype))
        with torch.no_grad():
            for p in params.values():
                if p is not None:
                    p.mul_(0.9).add_(0.01)
    return results


def _replays(graphs) -> int:
    return sum(s.replayed for slots in graphs.POOL.slots.values() for s in slots)


CASES = [
    (dict(), flags()),
    (dict(residual=True), flags(reverse=True, residual=True)),
    (dict(proj=False), flags(cell_clip=None, proj_clip=None, forget_bias=0.5)),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape,fl", CASES)
def test_training_replays_equal_eager(graphs, monkeypatch, shape, fl, dtype):
    _replays_equal_eager(graphs, monkeypatch, shape, fl, dtype)


def test_fused_cell_replays_equal_eager(graphs, monkeypatch):
    """The fused forward cell kernel (the GPU's 16-bit design) reads the gate-interleaved copy of w_rec, which each
    replay's refill must rewrite from the updated weights."""
    from elmo_fast.kernels import lstmp

    monkeypatch.setattr(lstmp, "FUSED_GATES", dict.fromkeys(lstmp.FUSED_GATES, True))
    _replays_equal_eager(graphs, monkeypatch, *CASES[1], torch.float64)


def _replays_equal_eager(graphs, monkeypatch, shape, fl, dtype):
    case = make_case(B=5, T=4, **shape)
    with_graphs = _train(case, fl, dtype)
    assert _replays(graphs) == 2 * 2  # call 1 eager (first sight); calls 2 and 3 replay forward and backward
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "0")
    eager = _train(case, fl, dtype)
    for i, (got, want) in enumerate(zip(with_graphs, eager)):
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), f"call {i}: {k} differs from the eager run"


@pytest.mark.parametrize("fused", [False, True], ids=["per_gate", "fused"])
def test_inference_replays_equal_eager_and_return_fresh_tensors(graphs, monkeypatch, fused):
    from elmo_fast.kernels import lstmp

    monkeypatch.setattr(lstmp, "FUSED_GATES", dict.fromkeys(lstmp.FUSED_GATES, fused))  # fused: no plain w_rec kept
    case = make_case(B=5, T=4)
    fl = flags()
    params = _params(case, torch.float32)

    def call(seed):
        x = torch.randn(params["x"].shape, generator=torch.Generator().manual_seed(seed)).to(DEV)
        with torch.no_grad():
            return _lstmp(x, *(params[k] for k in GRAD_NAMES[1:]), torch.tensor([4, 2, 0, 3, 1], device=DEV), **fl)

    outs = [call(s) for s in range(3)]
    assert _replays(graphs) == 2
    assert all(not s.leased for slots in graphs.POOL.slots.values() for s in slots)
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "0")
    for s, got in enumerate(outs):  # the results of calls 1 and 2 were not overwritten by call 3's replay
        for a, b in zip(got, call(s)):
            assert torch.equal(a, b)


def test_an_inference_slot_is_given_back_after_its_results_are_copied_out(graphs, monkeypatch):
    """Another thread may take a slot the moment it is given back and fill its buffers: a call's results must be
    copied out before. Here giving back poisons the output buffers, as that next call would overwrite them."""
    case = make_case(B=5, T=4)
    fl = flags()
    params = _params(case, torch.float32)
    real = graphs.POOL.give_back

    def give_back_and_overwrite(slot):
        real(slot)
        for name in ("y", "hn", "c"):
            slot.buffers("fwd")[name].fill_(float("nan"))

    monkeypatch.setattr(graphs.POOL, "give_back", give_back_and_overwrite)
    x = torch.randn(params["x"].shape, generator=torch.Generator().manual_seed(3)).to(DEV)
    with torch.no_grad():
        outs = [_lstmp(x, *(params[k] for k in GRAD_NAMES[1:]), torch.tensor([4, 2, 0, 3, 1], device=DEV), **fl)
                for _ in range(3)]
    assert _replays(graphs) == 2
    for got in outs[1:]:
        for a, b in zip(got, outs[0]):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_calls_on_two_streams_each_get_their_own_results(graphs, monkeypatch):
    """Alternating calls on two CUDA streams, queued without a sync, share the signature's slot: each waits for
    the previous use of its buffers (models._graphs.StreamOrder), so each gets the results of its own input."""
    case = make_case(B=64, T=12)
    fl = flags()
    params = _params(case, torch.float32)
    xs = [torch.randn(params["x"].shape, generator=torch.Generator().manual_seed(s)).to(DEV) for s in range(12)]
    lengths = torch.full((64,), 12, device=DEV)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    with torch.no_grad():
        for i, x in enumerate(xs):
            streams[i % 2].wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(streams[i % 2]):
                outs.append(_lstmp(x, *(params[k] for k in GRAD_NAMES[1:]), lengths, **fl))
        torch.cuda.synchronize()
        assert _replays(graphs) >= 10
        monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "0")
        for x, got in zip(xs, outs):
            for a, b in zip(got, _lstmp(x, *(params[k] for k in GRAD_NAMES[1:]), lengths, **fl)):
                assert torch.equal(a, b)


def test_a_slot_orders_each_use_across_streams(graphs):
    """The wiring of StreamOrder into a slot (its CUDA behaviour: tests/test_cuda_graphs.py): a run begins the use
    before it fills the buffers, and giving the slot back ends it (also when a dropped lease gives it back)."""
    log = []

    class Order:
        def begin(self, device):
            log.append(("begin", str(device)))

        def end(self):
            log.append("end")

    slot = graphs.Slot("key", "record", ({}, {"z": torch.zeros(1)}))
    slot.order = Order()
    slot.run("fwd", lambda plan, bufs: None, lambda bufs: log.append("fill"))
    graphs.POOL.give_back(slot)
    assert log == [("begin", "cpu"), "fill", "fill", "end"]  # filled again after the recording capture


def test_two_forwards_before_backward_get_two_slots(graphs, monkeypatch):
    """A module used twice in one loss: the second forward must not overwrite what the first saved."""
    case = make_case(B=4, T=3)
    fl = flags()

    def run():
        params = _params(case, torch.float64)
        rest = [params[k] for k in GRAD_NAMES[1:]]
        lengths = torch.tensor([3, 1, 2, 0], device=DEV)
        loss = 0
        for i in range(4):  # call 1 eager, calls 2 and 3 each take a slot, call 4 finds both leased: eager
            x = (case["x"] * (i + 1)).to(DEV).requires_grad_()
            y, _, _ = _lstmp(x, *rest, lengths, **fl)
            loss = loss + (y * (i + 1)).sum()
        loss.backward()
        return [params[k].grad.clone() for k in GRAD_NAMES[1:] if params[k] is not None]

    got = run()
    slots = graphs.POOL.slots
    assert [len(v) for v in slots.values()] == [graphs.MAX_SLOTS]
    assert all(not s.leased for s in next(iter(slots.values())))  # released by their backwards
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "0")
    for a, b in zip(got, run()):
        assert torch.equal(a, b)


def test_backward_after_the_buffers_were_reused_raises(graphs):
    case = make_case(B=4, T=3)
    params = _params(case, torch.float64)
    lengths = torch.tensor([3, 1, 2, 0], device=DEV)

    def fwd():
        return _lstmp(*(params[k] for k in GRAD_NAMES), lengths, **flags())[0].sum()

    fwd().backward()  # first sight: eager
    loss = fwd()  # takes the slot
    loss.backward(retain_graph=True)  # releases it
    loss.backward(retain_graph=True)  # nothing reused it yet: fine
    fwd()  # the same slot, handed to a new forward: its refill bumps the saved buffers' version counters
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_lease_checks_its_generation(graphs):
    slot = graphs.Slot("key", "record", ({}, {"z": torch.zeros(1)}))
    slot.leased, slot.generation = True, 1
    lease = graphs.Lease(slot)
    assert lease.check() is slot
    slot.generation += 1  # handed to another forward
    with pytest.raises(RuntimeError, match="handed to a later forward"):
        lease.check()
    lease.release()
    assert slot.leased  # a stale lease releases nothing


def test_a_forward_without_backward_frees_its_slot(graphs):
    case = make_case(B=4, T=3)
    params = _params(case, torch.float64)
    lengths = torch.tensor([3, 1, 2, 0], device=DEV)
    for _ in range(2):
        y = _lstmp(*(params[k] for k in GRAD_NAMES), lengths, **flags())[0]
    (slot,) = next(iter(graphs.POOL.slots.values()))
    assert slot.leased
    del y
    gc.collect()
    assert not slot.leased


def test_failed_capture_warns_and_runs_eagerly(graphs, monkeypatch):
    case = make_case(B=4, T=3)
    fl = flags()

    def broken(loop):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_record", broken)
    monkeypatch.setattr(graphs, "_capture_cuda", broken)
    with pytest.warns(RuntimeWarning, match="capturing the LSTMP time loop in a CUDA graph failed"):
        got = _train(case, fl, torch.float64, steps=3)
    assert len(graphs.POOL.failed) == 1 and not any(graphs.POOL.slots.values())
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "0")
    for a, b in zip(got, _train(case, fl, torch.float64, steps=3)):
        assert all(torch.equal(a[k], b[k]) for k in b)


def test_failed_backward_capture_runs_that_backward_eagerly(graphs, monkeypatch):
    """The forward replayed from its graph; the backward's capture fails: that backward runs eagerly from the
    slot's saved caches, the signature stays eager afterwards, every result as without graphs."""
    case = make_case(B=4, T=3)
    fl = flags()
    real = graphs._record
    captures = []

    def second_fails(loop):
        captures.append(loop)
        if len(captures) == 2:  # the forward loop's capture is the first, the backward's the second
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(loop)

    monkeypatch.setattr(graphs, "_record", second_fails)
    monkeypatch.setattr(graphs, "_capture_cuda", second_fails)
    with pytest.warns(RuntimeWarning, match="capturing the LSTMP time loop"):
        got = _train(case, fl, torch.float64, steps=3)
    assert len(captures) == 2 and len(graphs.POOL.failed) == 1 and not any(graphs.POOL.slots.values())
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "0")
    for a, b in zip(got, _train(case, fl, torch.float64, steps=3)):
        assert all(torch.equal(a[k], b[k]) for k in b)


def test_mode(monkeypatch):
    from elmo_fast.kernels.lstmp_graphs import mode

    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "auto")
    assert mode(torch.device("cpu")) is None  # graphs are for CUDA tensors; record mode is the tests' choice
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "0")
    assert mode(torch.device("cuda")) is None
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="ELMO_FAST_LOOP_GRAPHS must be"):
        mode(torch.device("cpu"))


def test_idle_slots_are_bounded(graphs, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_IDLE", 2)
    params = None
    for B in (2, 3, 4, 5):  # four signatures, each seen twice: four slots made, two kept
        case = make_case(B=B, T=2)
        params = _params(case, torch.float64)
        for _ in range(2):
            with torch.no_grad():
                _lstmp(*(params[k] for k in GRAD_NAMES), case["lengths"].to(DEV), **flags())
    assert sum(len(v) for v in graphs.POOL.slots.values()) == 2


def test_elmo_fine_tuning_with_loop_graphs_equals_eager(graphs, monkeypatch, tiny_model):
    """Through the model API: stateful biLM, a backward and an optimizer step per batch, batches of one shape.
    In deterministic mode: on a GPU the char-CNN backward's fp32 atomics otherwise change the last bits from run
    to run, graphs or not (seen on an H200, 2026-11-26)."""
    import elmo_fast
    from elmo_fast.determinism import deterministic

    o, w = tiny_model
    batches = [[["The", "cat", "sat"], ["Hi", "there"]], [["naïve", "x" * 60, "<S>"], ["ok", "then", "so"]]]

    def fine_tune():
        torch.manual_seed(0)
        elmo = elmo_fast.Elmo(o, w, 1, requires_grad=True, dropout=0.0, backend="triton").to(DEV)
        opt = torch.optim.SGD(elmo.parameters(), lr=0.1)
        reps = []
        for sents in batches:
            rep = elmo(elmo_fast.batch_to_ids(sents).to(DEV))["elmo_representations"][0]
            (rep * torch.linspace(-1, 1, rep.numel(), device=DEV).view_as(rep)).sum().backward()
            opt.step()
            opt.zero_grad()
            reps.append(rep.detach().clone())
        return reps, [p.detach().clone() for p in elmo.parameters()]

    with deterministic():
        got = fine_tune()
        assert _replays(graphs) == 2 * 4  # batch 2: four chains, forward and backward
        monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "0")
        want = fine_tune()
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)


def test_self_check_keeps_sound_graphs_on(graphs, recwarn):
    from elmo_fast.ops._selfcheck import check_loop_graphs

    check_loop_graphs(torch.device(DEV))
    assert not graphs.OFF and _replays(graphs) >= 2 * 2
    assert not [w for w in recwarn if "loop graphs" in str(w.message)]


def test_self_check_turns_faulty_graphs_off(graphs, monkeypatch):
    """A replay that does not redo the recorded work (a capture gone wrong) is caught, and graphs go off."""
    from elmo_fast.ops._selfcheck import check_loop_graphs

    def hollow(loop):  # records nothing: its replays leave the buffers as the refill left them
        return lambda: None

    monkeypatch.setattr(graphs, "_record", hollow)
    monkeypatch.setattr(graphs, "_capture_cuda", hollow)
    with pytest.warns(RuntimeWarning, match="LSTMP loop graphs are off on .*a replay differs"):
        check_loop_graphs(torch.device(DEV))
    assert graphs.mode(torch.device(DEV)) is None


def test_a_bound_launch_decides_for_its_own_tensors():
    """The loops settle each launch once per loop (``lstmp_graphs.launcher``): the launch-or-skip choice (skipped
    under the interpreter for fake tensors: a trace cannot record the interpreter's kernels) is made for the tensors
    it is bound to, binding after binding, not remembered per kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from elmo_fast._backend import triton_interpret
    from elmo_fast.kernels import lstmp_graphs

    if not triton_interpret():
        pytest.skip("the skip for fake tensors is the interpreter's (on a GPU the launch is recorded by wrap_triton)")
    calls = []

    class Kernel:  # a stand-in: kernel[grid](*args, **kwargs)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args[1], kwargs))

    kernel, real = Kernel(), torch.ones(2)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
    for tensor, launched in ((real, True), (fake, False), (real, True)):
        calls.clear()
        go = lstmp_graphs.launcher(kernel, (3,), [tensor, None], {"BB": 16})
        go([tensor, 7])
        assert calls == ([((3,), 7, {"BB": 16})] if launched else []), tensor
