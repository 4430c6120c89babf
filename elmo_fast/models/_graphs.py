"""CUDA-graph replay of a biLM inference forward at fixed shapes (``ElmoBiLM(..., cuda_graph=True)``).

A forward of the original model at batch 1 is ~180 small kernel launches (two per LSTM step per chain): on a
GPU their host-side launch cost is several times the GPU work. A CUDA graph records them once and replays
them with one launch. The recorded function must not sync with the host (no value read back, no
data-dependent shape): the biLM's inference path is written that way (see ``BiLM.stateless_forward``).

:class:`GraphCache` keeps one graph per input shape, captured the second time that shape is seen (the first
call runs eagerly: it compiles the Triton kernels, runs their self-checks and uploads their constants, and a
shape seen once, like a last partial batch, never pays for a capture). Inputs are copied into the graph's
static buffers before each replay and outputs are cloned out after it. Where a graph cannot be used -- the
tensors are not on a GPU, or the capture fails (a backend that syncs, such as the reference path) -- the
call runs eagerly; a failed capture warns once and that shape stays eager.
"""
from __future__ import annotations

import collections
import os
import threading
import warnings

import torch

from .._stamp import stamp, unchanged


_registrations = 0  # parameters and buffers (re)registered on any module since the hooks went in
_hooked = False


def _count_registration(*_):
    global _registrations
    _registrations += 1


def _hook_registrations() -> None:
    """Count every registration of a parameter, buffer or submodule: where a module's tensors can live (its
    slots: ``ModuleTensors``) is then listed again only after one."""
    global _hooked
    if not _hooked:
        from torch.nn.modules import module

        module.register_module_parameter_registration_hook(_count_registration)
        module.register_module_buffer_registration_hook(_count_registration)
        module.register_module_module_registration_hook(_count_registration)
        _hooked = True


class ModuleTensors:
    """The parameters and buffers of ``modules``, as a function (``GraphCache``'s ``watch``). The slots they live in
    (each submodule's ``_parameters`` / ``_buffers`` entry) are listed once, and again after a registration anywhere
    (``_hook_registrations``); every call reads the tensors now in the slots, so a tensor put there without a
    registration (``torch.func.functional_call``, a conversion that makes new Parameters) is seen too. The
    listing through ``parameters()`` would cost a biLM ~22 µs a call on a 2-core EPYC, the slots ~3 µs."""

    def __init__(self, *modules):
        self.modules = modules
        self._slots: tuple | None = None  # (registration count, [(dict, name)])
        _hook_registrations()

    def __call__(self) -> list[torch.Tensor]:
        if self._slots is None or self._slots[0] != _registrations:
            count = _registrations  # read before listing: a registration during it lists again next time
            self._slots = (count, [(d, name) for m in self.modules for sub in m.modules()
                                   for d in (sub._parameters, sub._buffers) for name in d])
        return [t for t in (d.get(name) for d, name in self._slots[1]) if t is not None]


def can_capture(device: torch.device) -> bool:
    """CUDA graphs exist for CUDA tensors only."""
    return torch.device(device).type == "cuda"


def capture(fn, inputs: tuple[torch.Tensor, ...]):
    """Record ``fn(*inputs)`` in a CUDA graph: returns (replay, outputs), where ``replay()`` re-runs the recorded
    work on whatever ``inputs`` then hold and leaves the results in ``outputs``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as CUDA graph capture requires
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: only this thread's CUDA calls are checked during the capture, so that another thread's work
    # (a data loader pinning memory, say) neither fails the capture nor is failed by it.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = fn(*inputs)
    return graph.replay, outputs


class StreamOrder:
    """Orders the uses of one set of static graph buffers across CUDA streams. A use is everything a call queues
    on them, from the copy of its inputs in to the copy of its results out; the host may hand the buffers to the
    next call as soon as the last of that is queued, before the GPU ran it. On one stream the queue orders the
    uses; on another the next use would overwrite buffers the previous one is still reading (a silent wrong
    result). So ``begin`` makes the current stream wait for the previous use's end where that was another
    stream, and ``end`` marks that end on the stream the use ran on (also when called later, from elsewhere: a
    lease dropped by the garbage collector)."""

    def __init__(self, current_stream=None, make_event=None):
        self._current = current_stream or torch.cuda.current_stream
        self._make_event = make_event or torch.cuda.Event
        self.stream = None
        self.event = None

    def begin(self, device) -> None:
        if torch.device(device).type != "cuda":  # CPU tensors (tests' stand-in captures): one queue, the host's
            return
        cur = self._current(device)
        if self.event is not None and self.stream != cur:
            cur.wait_event(self.event)
        self.stream = cur

    def end(self) -> None:
        if self.stream is not None:
            if self.event is None:
                self.event = self._make_event()
            self.event.record(self.stream)


class SideStream:
    """A block run on a second CUDA stream, forked from the current one where this object is made (so work queued
    on the current stream after that, the biLM's forward stack, runs beside the block) and joined back to it when
    the block exits: the biLM's backward stack (``ELMO_FAST_BILM_STREAMS=2``; opt-in until measured on a GPU). The
    tensors given to ``hand_over`` (the block's results, read later on the current stream) are recorded on it, so
    the allocator does not hand their memory to the side stream while the current one may still read it (not
    during a capture, where the graph's private pool holds them). Captured in a CUDA graph, fork and join become
    two branches that run at once."""

    _streams: dict = {}  # device index -> its side stream

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device)
        key = torch.device(device).index
        if key not in SideStream._streams:
            SideStream._streams[key] = torch.cuda.Stream(device)
        self.side = SideStream._streams[key]
        self.side.wait_stream(self.main)  # the fork: the side stream starts from what is queued so far
        self._results: list = []

    def __enter__(self):
        self._ctx = torch.cuda.stream(self.side)
        self._ctx.__enter__()
        return self

    def hand_over(self, *tensors: torch.Tensor) -> None:
        self._results.extend(tensors)

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        self.main.wait_stream(self.side)
        if not torch.cuda.is_current_stream_capturing():
            for t in self._results:
                t.record_stream(self.main)


def side_stream(x: torch.Tensor) -> SideStream | None:
    """A :class:`SideStream` for ``x``'s device where ``ELMO_FAST_BILM_STREAMS=2`` asks for one and can have it
    (CUDA tensors, not while torch.compile traces), else None: one stream."""
    env = os.environ.get("ELMO_FAST_BILM_STREAMS", "1").strip()
    if env not in ("1", "2"):
        raise ValueError(f"ELMO_FAST_BILM_STREAMS must be 1 or 2, got {env!r}")
    if env == "1" or x.device.type != "cuda" or torch.compiler.is_compiling():
        return None
    return SideStream(x.device)


class GraphCache:
    """Graph replay of ``fn`` (tensors in, a tuple of tensors out) per input shape; at most ``max_graphs`` kept.

    ``watch``: the tensors the recorded work reads besides its inputs (a module's weights), as a function. A graph
    replays the kernels it recorded on the memory they read then: a weight updated in place still reads right, but
    one whose storage was swapped (``.data =``, ``load_state_dict(assign=True)``, ``.to()``) or whose derived copy
    was renewed (the bf16 casts under autocast, ``ops._precision.cast_weight``, made once per version of the
    weight and read by the graph) would be read from memory that no longer holds it. So every graph is dropped,
    and the call captures afresh, when a watched tensor changed since the graphs were recorded (its version
    counter, storage or device: ``elmo_fast._stamp``; a biLM's 39 tensors in ~14 µs a call on a 2-core EPYC with
    ``ModuleTensors``). The stamps are taken before the capture, so a write during it is seen at the next call."""

    def __init__(self, fn, max_graphs: int = 4, watch=None):
        self.fn = fn
        self.max_graphs = max_graphs
        self.watch = watch
        self.stamps: list | None = None  # of the watched tensors when the kept graphs were recorded
        self.graphs: collections.OrderedDict = collections.OrderedDict()  # key -> (inputs, replay, outputs)
        self.seen: set = set()
        self.eager_keys: set = set()
        self.replays = 0
        self.drops = 0
        self.lock = threading.Lock()

    def __call__(self, *inputs: torch.Tensor):
        with self.lock:  # one call at a time on the static buffers (threads sharing a model)
            return self._call(inputs)

    def _call(self, inputs):
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)
        if self.graphs and not self._watched_unchanged():
            self.graphs.clear()  # they read the weights of before: record again
            self.stamps = None
            self.drops += 1
        entry = self.graphs.get(key)
        if entry is None:
            if key in self.eager_keys or key not in self.seen or not can_capture(inputs[0].device):
                self.seen.add(key)
                return self.fn(*inputs)
            entry = self._capture(key, inputs)
            if entry is None:
                return self.fn(*inputs)
        self.graphs.move_to_end(key)
        static_in, replay, static_out, order = entry
        order.begin(inputs[0].device)
        for dst, src in zip(static_in, inputs):
            dst.copy_(src)
        replay()
        self.replays += 1
        out = tuple(t.clone() for t in static_out)
        order.end()
        return out

    def _watched_unchanged(self) -> bool:
        if self.watch is None:
            return True
        ts = list(self.watch())
        return self.stamps is not None and len(self.stamps) == len(ts) and all(
            unchanged(s, t) for s, t in zip(self.stamps, ts))

    def _capture(self, key, inputs):
        static_in = tuple(t.clone() for t in inputs)
        # what the graph reads, before it records: a write during the capture then shows at the next call
        before = [stamp(t) for t in self.watch()] if self.watch is not None and not self.graphs else None
        try:
            replay, static_out = capture(self.fn, static_in)
        except Exception as exc:  # noqa: BLE001 - any capture failure: run this shape eagerly from now on
            self.eager_keys.add(key)
            warnings.warn(f"elmo_fast: CUDA graph capture failed ({type(exc).__name__}: {str(exc)[:200]}); "
                          "this input shape runs without a graph", RuntimeWarning, stacklevel=4)
            return None
        entry = (static_in, replay, tuple(static_out), StreamOrder())
        if before is not None:  # the first graph kept: what the graphs read from now on
            self.stamps = before
        self.graphs[key] = entry
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return entry
