"""CUDA-graph inference (``ElmoBiLM(..., cuda_graph=True)``, ``elmo_fast.models._graphs``).

On the CPU a stand-in for ``capture`` runs the recorded function under ``probe(forbid=True)``, which raises at
any host sync or pageable upload, as a real CUDA graph capture fails on one: the graph path is taken, its
static-buffer plumbing and state handling give the eager results, and a function that syncs falls back
cleanly (the Triton model on ``triton_device()``: CUDA tensors on a GPU, CPU tensors under the interpreter). The
real capture runs under the ``gpu`` marker.
"""
import importlib
import warnings

import pytest
import torch

import elmo_fast
from conftest import requires_triton, triton_device
from elmo_fast.models import _graphs
from elmo_fast.probes import probe

BATCHES = [[["The", "cat", "sat", "."], ["Hi"]], [["a", "b"], ["naïve", "x" * 60, "<S>"]],
           [["The", "dog", "ran", "."], ["Yes"]]]  # shapes (2, 4), (2, 3), (2, 4)


def _fake_capture(log):
    def capture(fn, inputs):
        with probe(forbid=True):
            outputs = fn(*inputs)
        log.append(tuple(t.shape for t in inputs))

        def replay():
            with probe(forbid=True):
                new = fn(*inputs)
            for dst, src in zip(outputs, new):
                dst.copy_(src)
        return replay, outputs
    return capture


def _run(model, batches, device="cpu"):
    outs = []
    with torch.no_grad():
        for sents in batches + batches:
            res = model(elmo_fast.batch_to_ids(sents).to(device))
            outs.append([a.cpu().clone() for a in res["activations"]] + [res["mask"].cpu()])
    return outs


def _same(a, b, atol=1e-6):
    for xs, ys in zip(a, b):
        for x, y in zip(xs, ys):
            torch.testing.assert_close(x, y, atol=atol, rtol=0)


@pytest.mark.triton
@requires_triton
def test_graph_path_is_taken_and_matches_eager(tiny_model, monkeypatch):
    log = []
    monkeypatch.setattr(_graphs, "can_capture", lambda device: True)
    monkeypatch.setattr(_graphs, "capture", _fake_capture(log))
    # the fake capture is no CUDA capture, so on a GPU the LSTMP loop graphs would capture inside it, through the
    # same (faked) function (seen on an H200, 2026-11-26): they stay off here; a real capture turns them off itself
    monkeypatch.setenv("ELMO_FAST_LOOP_GRAPHS", "0")
    # Eager on the reference backend: a stale buffer or a lost state is off by O(0.1), Triton by < 1e-6 on this
    # model (7.2e-7 measured); an eager Triton run under the interpreter would add ~15 s.
    eager = elmo_fast.ElmoBiLM(*tiny_model, backend="reference")
    dev = triton_device()
    graphed = elmo_fast.ElmoBiLM(*tiny_model, backend="triton", cuda_graph=True).to(dev)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _run(graphed, BATCHES, dev)
    _same(got, _run(eager, BATCHES), atol=1e-5)
    # (2, 4) is seen at calls 1, 3, 4, 6: captured at call 3, replayed at 3, 4, 6; (2, 3) captured at call 5
    assert log == [((2, 4, 50), (2, 2, 2, 16), (2, 2, 2, 64), (0,)), ((2, 3, 50), (2, 2, 2, 16), (2, 2, 2, 64), (0,))]
    assert graphed._graphs.replays == 4
    torch.testing.assert_close(graphed._bilm._states[1].cpu(), eager._bilm._states[1], atol=1e-5, rtol=0)


def test_graph_capture_that_syncs_falls_back_with_one_warning(tiny_model, monkeypatch):
    lstmp_op = importlib.import_module("elmo_fast.ops.lstmp")

    monkeypatch.setattr(_graphs, "can_capture", lambda device: True)
    monkeypatch.setattr(_graphs, "capture", _fake_capture([]))
    real = lstmp_op.lstmp_reference

    def syncing(x, *args, **kwargs):  # a backend that reads a device value on the host, as capture cannot allow
        x.abs().max().item()
        return real(x, *args, **kwargs)

    monkeypatch.setattr(lstmp_op, "lstmp_reference", syncing)
    eager = elmo_fast.ElmoBiLM(*tiny_model, backend="reference")
    graphed = elmo_fast.ElmoBiLM(*tiny_model, backend="reference", cuda_graph=True)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed") as rec:
        got = _run(graphed, BATCHES)
    assert len(rec) == 2  # once per shape, then that shape stays eager
    assert graphed._graphs.replays == 0
    _same(got, _run(eager, BATCHES))


def test_cuda_graph_option_on_cpu_runs_eagerly(tiny_model):
    eager = elmo_fast.ElmoBiLM(*tiny_model, backend="reference")
    graphed = elmo_fast.Elmo(*tiny_model, 1, dropout=0.0, backend="reference", cuda_graph=True)._elmo_lstm
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _run(graphed, BATCHES)
    assert graphed._graphs.replays == 0 and not graphed._graphs.graphs
    _same(got, _run(eager, BATCHES))


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_gpu_graph_replay_matches_eager(tiny_model, autocast):
    eager = elmo_fast.ElmoBiLM(*tiny_model).cuda()
    graphed = elmo_fast.ElmoBiLM(*tiny_model, cuda_graph=True).cuda()
    batches = [[s for s in b] for b in BATCHES]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
        for sents in batches + batches:
            ids = elmo_fast.batch_to_ids(sents).cuda()
            a, b = eager(ids), graphed(ids)
            for x, y in zip(a["activations"], b["activations"]):  # eager deduplicates tokens: GEMM shapes differ
                torch.testing.assert_close(y, x, atol=3e-2 if autocast else 1e-4, rtol=3e-2 if autocast else 1e-4)
    assert graphed._graphs.replays == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graph_after_a_weight_update_under_autocast(tiny_model):
    """Under bf16 autocast a recorded graph reads the weights' bf16 copies, made once per version: after an
    in-place update the copies are made anew, and the graphs must be recorded again to read them."""
    eager = elmo_fast.ElmoBiLM(*tiny_model).cuda()
    graphed = elmo_fast.ElmoBiLM(*tiny_model, cuda_graph=True).cuda()
    ids = elmo_fast.batch_to_ids(BATCHES[0]).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        for _ in range(3):
            graphed(ids)
        for m in (eager, graphed):  # the same update to both; the states start again
            for p in m._bilm.parameters():
                p.mul_(1.5)
            m.reset_states()
        a, b = eager(ids), graphed(ids)
    for x, y in zip(a["activations"], b["activations"]):
        torch.testing.assert_close(y, x, atol=3e-2, rtol=3e-2)
    assert graphed._graphs.drops == 1


def test_stream_order_makes_a_use_on_another_stream_wait_for_the_last():
    """StreamOrder with stand-in streams and events: a use on another stream than the last one waits for the last
    one's end (an event recorded on the last one's stream, also when its end is marked later from elsewhere), a use
    on the same stream does not wait, and CPU tensors need nothing."""
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, ev):
            log.append(("wait", self.name, ev.where))

    class Event:
        where = None

        def record(self, stream):
            self.where = stream.name
            log.append(("record", stream.name))

    a, b = Stream("a"), Stream("b")
    current = [a]
    order = _graphs.StreamOrder(current_stream=lambda device: current[0], make_event=Event)
    cuda = torch.device("cuda", 0)
    order.begin(cuda)
    order.end()
    order.begin(cuda)  # same stream: ordered by its queue
    current[0] = b
    order.end()  # marked from elsewhere (a dropped lease): recorded on the use's own stream, a
    order.begin(cuda)
    order.end()
    order.begin(torch.device("cpu"))
    assert log == [("record", "a"), ("record", "a"), ("wait", "b", "a"), ("record", "b")]


def test_bilm_two_streams_fork_before_the_forward_stack_and_join_after(tiny_model, monkeypatch):
    """ELMO_FAST_BILM_STREAMS=2, its plumbing on the CPU with a stand-in side stream: forked before the forward
    stack is queued (or the side stream would wait for it), the backward stack inside, its results handed over,
    joined on exit; the results are the one-stream run's. The real side stream is for CUDA tensors only."""
    log = []

    class Fork:
        def __init__(self, x):
            log.append("fork")

        def __enter__(self):
            log.append("enter")
            return self

        def hand_over(self, *tensors):
            log.append(("hand_over", len(tensors)))

        def __exit__(self, *exc):
            log.append("exit")

    model = elmo_fast.ElmoBiLM(*tiny_model, backend="reference", stateful=False)
    want = _run(model, BATCHES[:1])
    for name in ("forward_lstm", "backward_lstm"):
        getattr(model._bilm, name).register_forward_hook(lambda *a, name=name: log.append(name))
    monkeypatch.setattr(_graphs, "side_stream", Fork)
    got = _run(model, BATCHES[:1])
    _same(got, want, atol=0)
    L = model._bilm.options.lstm.n_layers
    assert log == ["fork", "forward_lstm", "enter", "backward_lstm", ("hand_over", 3 * L), "exit"] * 2
    monkeypatch.undo()
    monkeypatch.setenv("ELMO_FAST_BILM_STREAMS", "2")
    assert _graphs.side_stream(torch.zeros(1)) is None  # CPU tensors: one stream
    monkeypatch.setenv("ELMO_FAST_BILM_STREAMS", "3")
    with pytest.raises(ValueError, match="ELMO_FAST_BILM_STREAMS must be 1 or 2"):
        _graphs.side_stream(torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graph"])
def test_gpu_bilm_two_streams_equal_one(tiny_model, monkeypatch, cuda_graph):
    """The two stacks on two streams give the bits of one stream: inference (eagerly with the loop graphs, and
    captured whole), and the gradients of a fine-tuning step."""
    runs = {}
    for streams in ("1", "2"):
        monkeypatch.setenv("ELMO_FAST_BILM_STREAMS", streams)
        m = elmo_fast.ElmoBiLM(*tiny_model, cuda_graph=cuda_graph).cuda()
        runs[streams] = _run(m, BATCHES, "cuda")
    _same(runs["2"], runs["1"], atol=0)
    from elmo_fast.determinism import deterministic

    grads = {}
    for streams in ("1", "2"):
        monkeypatch.setenv("ELMO_FAST_BILM_STREAMS", streams)
        elmo = elmo_fast.Elmo(*tiny_model, 1, dropout=0.0, requires_grad=True).cuda()
        with deterministic():  # the char-CNN backward's atomics would change the last bits from run to run
            for sents in BATCHES:
                out = elmo(elmo_fast.batch_to_ids(sents).cuda())["elmo_representations"][0]
                out.square().sum().backward()
        grads[streams] = {n: p.grad.clone() for n, p in elmo.named_parameters() if p.grad is not None}
    assert grads["1"].keys() == grads["2"].keys() and grads["1"]
    for n in grads["1"]:
        assert torch.equal(grads["2"][n], grads["1"][n]), n


def test_graphs_are_recorded_again_when_a_watched_weight_changes(monkeypatch):
    """A recorded graph reads the memory its kernels read at capture (a weight's storage, or a derived copy made
    once per version of it: the bf16 casts under autocast). The stand-in capture here replays with the weight as
    it was at capture, as such a graph would: after an in-place update, a storage swap, or a new tensor object in
    the module's slot (registered, or put there directly as ``torch.func.functional_call`` does) the cache drops
    its graphs and records again, so the result is the new weight's; a cache that watches nothing keeps the
    stale one."""
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.tensor([2.0]), requires_grad=False)

    def fn(x):
        return (x * holder.w,)

    def capture(f, inputs):
        frozen = holder.w.detach().clone()  # what the recorded kernels would read
        (out,) = f(*inputs)

        def replay():
            out.copy_(inputs[0] * frozen)
        return replay, (out,)

    monkeypatch.setattr(_graphs, "can_capture", lambda device: True)
    monkeypatch.setattr(_graphs, "capture", capture)
    x = torch.tensor([1.0, 3.0])
    cache, unwatched = _graphs.GraphCache(fn, watch=_graphs.ModuleTensors(holder)), _graphs.GraphCache(fn)
    for _ in range(3):  # eager, then recorded and replayed
        torch.testing.assert_close(cache(x)[0], x * 2)
        unwatched(x)
    assert cache.replays == 2 and cache.drops == 0
    steps = [("in place", lambda: holder.w.mul_(5), 10.0),
             ("storage swap", lambda: setattr(holder.w, "data", torch.tensor([-1.0])), -1.0),
             ("registered anew", lambda: setattr(holder, "w", torch.nn.Parameter(torch.tensor([4.0]))), 4.0),
             ("slot written directly", lambda: holder._parameters.__setitem__("w", torch.tensor([6.0])), 6.0)]
    for n, (what, change, value) in enumerate(steps, 1):
        with torch.no_grad():
            change()
        torch.testing.assert_close(cache(x)[0], x * value, msg=what)
        assert cache.drops == n, what
    torch.testing.assert_close(unwatched(x)[0], x * 2)  # stale: the weight of its capture
    holder.extra = torch.nn.Linear(1, 1)  # a new submodule: its tensors are watched from the next call on
    assert {id(t) for t in holder.extra.parameters()} <= {id(t) for t in cache.watch()}


def test_the_bilm_graphs_watch_every_weight_in_its_slot(tiny_model):
    m = elmo_fast.ElmoBiLM(*tiny_model, backend="reference", cuda_graph=True)
    watched = {id(t) for t in m._graphs.watch()}
    assert {id(p) for p in m._bilm.parameters()} <= watched and {id(b) for b in m._token_embedder.buffers()} <= watched
    enc = m._bilm.token_encoder
    new = torch.nn.Parameter(enc.char_embed.detach().clone())
    enc._parameters["char_embed"] = new  # no registration: what functional_call does
    assert any(t is new for t in m._graphs.watch())
