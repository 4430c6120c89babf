"""CUDA graphs of the LSTMP time loops (forward and backward), for training as well as inference.

Why: a step of the chain is three small launches (``kernels/lstmp.py``); at B=384 bf16 their GPU work is ~20 µs
forward and ~26 µs backward, and each launch costs ~3 µs more when not replayed from a graph
(``bench/results/kernel_report.md``). ``ElmoBiLM(cuda_graph=True)`` captures a whole inference forward; a
training step cannot be captured whole (the sampler and the token encoder's dedup sync with the host), but the
time loops can: they launch kernels only, on buffers whose shapes follow from (B, T), with the step index a
launch argument.

How: a **slot** owns a full set of static buffers for one call signature (shapes, dtypes, flags) and the
replays captured on them: one of the forward loop, one of the backward loop. A call copies its inputs into the
slot (weights, states, lengths; the input projection is written there by its matmul directly), replays, and
clones the results it returns. What forward saves for backward (gate pre-activations, pre-clip cells, ...)
stays in the slot: it is **leased** to that forward's autograd node until its backward ran (or the node is
freed), and no other call can use the slot meanwhile; a call that finds every slot of its signature leased
gets a new one (at most ``MAX_SLOTS`` per signature) or runs without a graph. Each hand-over bumps the slot's
generation, so a backward whose forward's buffers were handed to a later forward (a second backward with
``retain_graph=True`` after another forward) raises instead of computing from overwritten values.

When: CUDA tensors, ``ELMO_FAST_LOOP_GRAPHS`` not ``0``, not while torch.compile / torch.export trace, and not
inside another capture (``ElmoBiLM(cuda_graph=True)`` records the loops itself). A signature is captured the
second time it is seen: the first call runs eagerly (it compiles the kernels and uploads their constants; a
shape seen once, like a last partial batch, never pays for a capture). A failed capture warns once and leaves
that signature eager. At most ``MAX_IDLE`` idle slots are kept (least recently used dropped first).

``ELMO_FAST_LOOP_GRAPHS=record`` (tests; works on CPU tensors under ``TRITON_INTERPRET=1``): "capture" records
each launch (kernel, grid, argument tensors and ints) without running it, and a replay launches exactly the
recorded list, so the buffers a replay touches are those of the capture, as in a CUDA graph. The CPU suite runs
every path of this module that way (``tests/test_loop_graphs.py``).
"""
from __future__ import annotations

import collections
import os
import threading
import warnings

import torch

from elmo_fast.kernels._common import launch as launch_kernel, launchable
from elmo_fast.models._graphs import StreamOrder
from elmo_fast.ops._library import ThreadFlag, tracing
from elmo_fast.probes import graph_replay

MAX_SLOTS = 2  # per call signature: two forwards outstanding before their backwards (e.g. a module used twice)
MAX_IDLE = 8  # idle slots kept over all signatures (each holds one chain's activations for one batch shape)

_rec = threading.local()
_suspended = ThreadFlag()
OFF: dict[str, str] = {}  # device -> why loop graphs are off there (``disable``: the self-check found a fault)


def mode(device: torch.device) -> str | None:
    """"cuda" (capture CUDA graphs), "record" (the CPU stand-in of the tests) or None (no graphs)."""
    env = os.environ.get("ELMO_FAST_LOOP_GRAPHS", "auto").strip().lower()
    if env in ("0", "off", "false", "no") or _suspended or str(device) in OFF:
        return None
    if env == "record":
        return "record"
    if env not in ("auto", "1", "on", "true", "yes"):
        raise ValueError(f"ELMO_FAST_LOOP_GRAPHS must be auto, 1, 0 or record, got {env!r}")
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    return "cuda"


def disable(device: torch.device, why: str) -> None:
    """No loop graphs on ``device`` from now on (warned once)."""
    OFF[str(device)] = why
    warnings.warn(f"elmo_fast: LSTMP loop graphs are off on {device}: {why}", RuntimeWarning, stacklevel=2)


def suspended():
    """No loop graphs in this thread inside the block (the self-check's eager baseline)."""
    return _suspended.on()


def launcher(kernel, grid, args, kwargs):
    """The loops' launch of ``kernel`` as a function of its arguments, settled once for a loop that launches the
    same tensors step after step (only ints change): one that records, where it is bound while a ``record``
    capture runs, else one that launches, the launch path's tracing check (``_common.launchable``) made for the
    tensors it is bound to. It lives as long as its loop call: a step's host work is then the kernel call."""
    calls = getattr(_rec, "calls", None)
    if calls is not None:
        return lambda a: calls.append((kernel, grid, list(a), dict(kwargs)))
    k = launchable(kernel, args)
    if k is None:
        return lambda a: None
    run = k[grid]
    return lambda a: run(*a, **kwargs)


def _record(loop):
    _rec.calls = calls = []
    try:
        loop()
    finally:
        _rec.calls = None

    def replay():
        for kernel, grid, args, kwargs in calls:
            launch_kernel(kernel, grid, args, kwargs)

    return replay


def _capture_cuda(loop):
    from elmo_fast.models._graphs import capture  # the inference graphs' capture (side-stream warm-up first)

    replay, _ = capture(lambda: loop(), ())
    return replay


class Slot:
    """Static buffers of one call signature and the loops captured on them."""

    def __init__(self, key, how: str, fwd: tuple[dict, dict]):
        self.key, self.how = key, how
        self.phases = {"fwd": fwd}  # phase -> (launch plan, static buffers); "bwd" added at the first backward
        self.replays: dict[str, object] = {}
        self.leased = False
        self.dropped = False  # out of the pool (evicted, or its capture failed); a lease may still hold it
        self.generation = 0
        self.replayed = 0  # replays run (tests and benches check that the graphs are used)
        self.order = StreamOrder() if how == "cuda" else None  # uses of the buffers from several streams

    def buffers(self, phase: str) -> dict:
        return self.phases[phase][1]

    def run(self, phase: str, loop, fill) -> dict:
        """``fill(bufs)`` (the call's inputs into the phase's static buffers), then ``loop(plan, bufs)`` from its
        graph, captured the first time (the capture's warm-up run may leave anything in the buffers: they are
        filled again). Returns the buffers, which then hold the results."""
        plan, bufs = self.phases[phase]
        if self.order is not None:
            self.order.begin(bufs["z"].device)
        fill(bufs)
        replay = self.replays.get(phase)
        if replay is None:
            capture = _record if self.how == "record" else _capture_cuda
            replay = self.replays[phase] = capture(lambda: loop(plan, bufs))
            fill(bufs)
        with graph_replay("lstmp loop"):  # one launch to elmo_fast.probes (the launch budget), in either mode
            replay()
        self.replayed += 1
        return bufs


class Lease:
    """A forward's claim on its slot's saved activations, held by its autograd node (``ctx.lease``)."""

    def __init__(self, slot: Slot):
        self.slot, self.generation = slot, slot.generation

    def check(self) -> Slot:
        if self.slot.generation != self.generation:
            raise RuntimeError(
                "lstmp: the CUDA-graph buffers this forward saved for backward were handed to a later forward "
                "(a second backward through the same graph after another forward). Run with "
                "ELMO_FAST_LOOP_GRAPHS=0 to backward more than once across forwards.")
        return self.slot

    def release(self) -> None:
        if self.slot.generation == self.generation and self.slot.leased:
            POOL.give_back(self.slot)

    def __del__(self):  # the autograd node went without a backward
        if POOL is not None:  # None while the interpreter shuts down
            self.release()


class Pool:
    """Slots by call signature; ``acquire`` hands out a free one (None: run eagerly)."""

    def __init__(self):
        self.slots: dict = collections.defaultdict(list)
        self.idle: collections.OrderedDict = collections.OrderedDict()  # slot id -> slot, least recently used first
        self.seen: set = set()
        self.failed: set = set()
        self.by_ptr: dict[int, Slot] = {}  # data_ptr of a slot's z buffer -> slot (the forward's lease lookup)
        self.lock = threading.RLock()

    def acquire(self, key, how: str, setup) -> Slot | None:
        """A free slot for ``key`` (``setup()`` gives a new slot's forward plan and static buffers), leased to
        the caller; None: run eagerly (first sight of ``key``, its capture failed, or every slot is leased)."""
        with self.lock:  # threads (nn.DataParallel replicas) share the pool
            return self._acquire(key, how, setup)

    def _acquire(self, key, how: str, setup) -> Slot | None:
        if key in self.failed:
            return None
        if key not in self.seen:
            self.seen.add(key)
            return None
        slot = next((s for s in self.slots[key] if not s.leased), None)
        if slot is None:
            if len(self.slots[key]) >= MAX_SLOTS:
                return None
            slot = Slot(key, how, setup())
            self.slots[key].append(slot)
            self.by_ptr[slot.buffers("fwd")["z"].data_ptr()] = slot
        self.idle.pop(id(slot), None)
        slot.leased = True
        slot.generation += 1
        return slot

    def give_back(self, slot: Slot) -> None:
        """The call is done with ``slot`` (every use of its buffers queued, results copied out) unless a lease keeps
        it (training: until backward)."""
        with self.lock:
            if slot.order is not None:
                slot.order.end()
            slot.leased = False
            if not slot.dropped:
                self.park(slot)

    def park(self, slot: Slot) -> None:
        self.idle.pop(id(slot), None)  # most recently used last
        self.idle[id(slot)] = slot
        while len(self.idle) > MAX_IDLE:
            _, old = self.idle.popitem(last=False)
            if not old.leased:
                self.drop(old)

    def drop(self, slot: Slot) -> None:
        slot.dropped = True
        self.slots[slot.key].remove(slot)
        self.by_ptr.pop(slot.buffers("fwd")["z"].data_ptr(), None)
        self.idle.pop(id(slot), None)

    def fail(self, slot: Slot, exc: Exception) -> None:
        """A capture failed: this signature runs eagerly from now on (warned once)."""
        self.drop(slot)
        self.failed.add(slot.key)
        warnings.warn(f"elmo_fast: capturing the LSTMP time loop in a CUDA graph failed ({type(exc).__name__}: "
                      f"{str(exc)[:200]}); this call signature runs without a graph", RuntimeWarning, stacklevel=4)

    def lease(self, z: torch.Tensor) -> Lease | None:
        """The lease of the slot whose saved activations ``z`` is (None for a call that ran eagerly)."""
        if not self.by_ptr or not z.numel() or tracing(z):  # a fake z (opcheck, torch.compile) has no storage
            return None
        slot = self.by_ptr.get(z.data_ptr())
        return None if slot is None or not slot.leased else Lease(slot)

    def clear(self) -> None:
        self.__init__()


POOL = Pool()
