"""Weights packed once for oneDNN, and the module-owned cache that keeps them across calls.

``torch.mm`` sends the small-M products of an LSTM step (M = batch rows) to MKL's sgemm. oneDNN with a weight
reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) runs the same IEEE fp32
products faster on these shapes (measured on the 2-core AVX-512 machine of bench/results/cpu_lstmp.md: M=32,
K=512, N=16384 in 1.9 ms against 2.4 ms), and ``_linear_pointwise.binary(..., "add")`` adds the precomputed
input projection in the same pass. Only the summation order differs from ``torch.mm``.

Where ``elmo_fast._cpu`` runs AVX-512, the products of at most 16 rows, and of 17-32 rows with a short inner
dimension (at most 1024: ``h·W_rec``, 512 x 16384), take the extension's own kernel instead (``small_mm``,
csrc/cpu/small_gemm.cpp: the weight in panels of 16 columns for up to 16 rows, of 32 for more, streamed from memory
while the FMAs run). On the 2-core AVX-512 Xeon of bench/results/cpu_train.md, alone with the weight out of cache as
in a step, 16 rows: 0.96-1.03 against oneDNN's 1.36-1.41 ms, 32 rows: 1.58-1.83 against 2.22-2.26 ms; in same-run
A/Bs against ``ELMO_FAST_CPU_PANELS=0``, the LSTMP chain's forward 4-10% and the 32-sentence embedding 5% faster, the
B=16 training step 2%. Since the kernel runs every row block on a k block of 256 before the next (one read of a long
panel from memory), at 16 rows the long inner dimensions are faster too (four weights in turn, 04:09 UTC, a /tmp
script: ``dz·W_recᵀ`` 2.02-2.16 against oneDNN's 2.20-2.25 ms, ``dh·W_projᵀ`` 0.30 against 0.39-0.41 ms,
``m·W_proj`` 0.34-0.36 against 0.39-0.42 ms); at 32 rows oneDNN keeps them (``dz·W_recᵀ`` 4.0-4.1 against
3.2-3.3 ms). ``ELMO_FAST_CPU_PANELS`` = auto (that rule) / 1 (every packed fp32 product) / 0 (oneDNN only).

``ELMO_FAST_CPU_ONEDNN=0`` turns the packed path off (plain ``torch.mm``/``addmm``, no panels either); a failed pack
or probe also turns it off for the rest of the process, so a torch build without a working oneDNN still computes.

Packing costs a reorder of the whole weight (plus a transposing copy for a row-major one): inference keeps the
packs across calls, but training's weights change every step. Whether a pack pays for itself over one training
call's T products is a property of the machine, not of the shape alone: on the AVX-512/AMX Xeon of
bench/results/cpu_lstmp.md MKL's small-M sgemm is within 15% of oneDNN (h·W_rec at B=16: 1.36 against 1.20 ms,
the pack ~13-30 ms), on the AVX2 EPYC of the same file it is 2.4x slower (12.7 against 5.2 ms, the pack ~40-60
ms). :func:`pack_pays` measures it once per process and shape (``ELMO_FAST_CPU_TRAIN_PACK`` overrides it).
"""
from __future__ import annotations

import itertools
import os
import time
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._backend import env_flag
from .._stamp import stamp, unchanged

_ONEDNN_OK = True  # False once a pack failed: the plain path for the rest of the process


class PackedLinear:
    """``x -> x · w (+ other)`` for a (K, N) weight ``w``, through oneDNN when it can, else torch.mm.

    ``w`` is the logical right operand; the packed copy (N, K) lives in oneDNN's layout and never changes.
    With ``dtype=torch.bfloat16`` the weight is packed in bf16 and each call rounds ``x`` to bf16, accumulates in
    fp32 (AMX / AVX512-BF16) and returns the result, rounded to bf16 by oneDNN, in ``x``'s dtype.
    """

    def __init__(self, w: torch.Tensor, rows: int, dtype: torch.dtype | None = None, pack: bool = True):
        self.shape = tuple(w.shape)
        self.dtype = dtype or w.dtype
        self.w = w  # the fallback path's operand; holding it also keeps its storage (the cache key) alive
        self.packed = _pack(w, rows, self.dtype) if pack else None

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.packed, _Panels):
            return self.packed(x, add)
        if self.packed is None:
            return torch.mm(x, self.w) if add is None else torch.addmm(add, x, self.w)
        if self.dtype == x.dtype:
            if add is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, add, self.packed, None, "add")
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        out = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, None, "none", [], "").to(x.dtype)
        return out if add is None else out.add_(add)


# Below this many weight elements (1 MiB in fp32) torch.mm is at least as fast: oneDNN runs every call in parallel,
# and on a busy 2-core machine each parallel region can wait for a scheduler slice.
_MIN_ELEMENTS = 1 << 18


def onednn_enabled() -> bool:
    """oneDNN's products are on: torch has oneDNN, and neither ``ELMO_FAST_CPU_ONEDNN=0`` nor a failed pack turned
    them off."""
    return _ONEDNN_OK and env_flag("ELMO_FAST_CPU_ONEDNN", True) and torch.backends.mkldnn.is_available()


def onednn_usable(t: torch.Tensor) -> bool:
    return onednn_enabled() and t.device.type == "cpu" and t.dtype == torch.float32 and t.numel() >= _MIN_ELEMENTS


def bf16_supported() -> bool:
    """Whether oneDNN runs bf16 products natively here (AVX512-BF16 or AMX)."""
    return onednn_enabled() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _pack(w: torch.Tensor, rows: int, dtype: torch.dtype):
    """The oneDNN-packed (N, K) weight, or None where that path does not apply (then torch.mm is used).

    ``w`` is packed as ``w.t()``: for a row-major ``w`` that view is column-major, and torch's
    ``_reorder_linear_weight`` makes it contiguous itself (an ``aten::contiguous`` inside the op, torch 2.13)
    before oneDNN reorders it into its blocked layout; torch exposes no reorder from a strided source."""
    global _ONEDNN_OK
    if not onednn_usable(w):
        return None
    if dtype == torch.float32 and panels_apply(w, rows):
        try:
            return _Panels(w, rows)
        except Exception:  # noqa: BLE001 - the kernel or its probe failed: oneDNN from now on
            _panels_off()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().t().to(dtype), max(1, rows))
        if dtype not in _VERIFIED:
            _self_test(w, lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), dtype,
                       "oneDNN linear")
            _VERIFIED.add(dtype)
        return packed
    except Exception:  # noqa: BLE001 - any problem: the plain path from now on
        _ONEDNN_OK = False
        return None


_VERIFIED: set = set()  # packing dtypes whose packed product passed ``_self_test`` in this process

_PANEL_CHOICES = ("auto", "0", "1")
_PANELS_OK = True  # False once a panel product failed its probe: oneDNN for the rest of the process
PANEL_ANY_K_ROWS, PANEL_MAX_ROWS, PANEL_MAX_K = 16, 32, 1024  # auto's rule (module docstring)


def panels_mode() -> str:
    """``ELMO_FAST_CPU_PANELS``: ``auto`` (default), ``1`` or ``0``."""
    mode = os.environ.get("ELMO_FAST_CPU_PANELS", "auto").strip().lower() or "auto"
    if mode not in _PANEL_CHOICES:
        raise ValueError(f"ELMO_FAST_CPU_PANELS={mode!r}: expected one of {', '.join(_PANEL_CHOICES)}")
    return mode


def _panels_off() -> None:
    global _PANELS_OK
    _PANELS_OK = False


def panels_apply(w: torch.Tensor, rows: int) -> bool:
    """Whether products of ``rows`` rows with the fp32 weight ``w`` (K, N) run on ``elmo_fast._cpu``'s ``small_mm``."""
    from .ext import cpu_ext

    mode = panels_mode()
    if mode == "0" or not _PANELS_OK or w.dtype != torch.float32 or w.dim() != 2:
        return False
    ext = cpu_ext()
    if ext is None or not hasattr(ext, "small_mm") or not ext.small_mm_available():
        return False
    return mode == "1" or rows <= PANEL_ANY_K_ROWS or (rows <= PANEL_MAX_ROWS and w.shape[0] <= PANEL_MAX_K)


class _Panels:
    """``w`` (K, N) packed for ``small_mm``: panels of 16 columns for at most 16 rows, else of 32 (14-row blocks of
    two vectors); checked once per process against ``w`` itself."""

    def __init__(self, w: torch.Tensor, rows: int):
        from .ext import cpu_ext

        self.ext, self.n = cpu_ext(), w.shape[1]
        self.t = self.ext.pack_panels(w.detach(), 16 if rows <= 16 else 32)
        if "panels" not in _VERIFIED:
            _self_test(w, lambda x: self(x, None), torch.float32, "elmo_fast._cpu small_mm")
            _VERIFIED.add("panels")

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.n)
        if add is not None and add.stride(-1) != 1:
            add = add.contiguous()
        self.ext.small_mm(x, self.t, self.n, add, out)
        return out

_TRAIN_PACK_CHOICES = ("auto", "0", "1")
_PAYS: dict = {}  # (rows, shape, strides) -> (pack s, torch.mm s, packed product s), measured once per process


def train_pack_mode() -> str:
    """``ELMO_FAST_CPU_TRAIN_PACK``: ``auto`` (default) measures, ``1`` always packs, ``0`` never does."""
    mode = os.environ.get("ELMO_FAST_CPU_TRAIN_PACK", "auto").strip().lower() or "auto"
    if mode not in _TRAIN_PACK_CHOICES:
        raise ValueError(f"ELMO_FAST_CPU_TRAIN_PACK={mode!r}: expected one of {', '.join(_TRAIN_PACK_CHOICES)}")
    return mode


def best_seconds(fn, reps: int) -> float:
    """The shortest of ``reps`` calls of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def pack_pays(w: torch.Tensor, rows: int, uses: int) -> bool:
    """Whether packing ``w`` (K, N) for oneDNN and running ``uses`` products of ``rows`` rows with it beats ``uses``
    plain ``torch.mm`` products on this machine (a training call: the weight changes before the next one).

    Measured the first time a (rows, shape, strides, dtype, intra-op threads) is seen in this process, on ``w``
    itself: two packs (the first also runs the self-test) and the best of three products each way, about the cost
    of two packs; then ``uses · (t_mm − t_packed) > t_pack`` decides. Under deterministic mode
    (``elmo_fast.determinism``) never: a timing must not choose between two summation orders there.
    ``ELMO_FAST_CPU_TRAIN_PACK`` = 1 / 0 fixes it."""
    from elmo_fast.determinism import is_deterministic

    if not onednn_usable(w):
        return False
    mode = train_pack_mode()
    if mode != "auto":
        return mode == "1"
    if is_deterministic():
        return False
    key = _pays_key(w, rows)
    if key not in _PAYS:
        # a private generator: a draw from the global one would shift the dropout masks drawn after it (which
        # must not depend on when this process first measured a shape: fused towers, towers over processes)
        x = torch.randn(max(1, rows), w.shape[0], dtype=w.dtype, generator=torch.Generator().manual_seed(rows))
        w = w.detach()
        lin = PackedLinear(w, rows)
        if lin.packed is None:  # the pack failed: oneDNN is off from now on
            return False
        t_pack = best_seconds(lambda: PackedLinear(w, rows), 1)
        t_mm = best_seconds(lambda: torch.mm(x, w), 3)
        t_packed = best_seconds(lambda: lin(x), 3)
        _PAYS[key] = (t_pack, t_mm, t_packed)
    t_pack, t_mm, t_packed = _PAYS[key]
    return uses * (t_mm - t_packed) > t_pack


def pack_timings() -> list[list]:
    """:func:`pack_pays`'s measurements so far, as plain data (``[rows, shape, strides, dtype name, threads, panels,
    t_pack, t_mm, t_packed]`` rows; ``panels``: the pack was elmo_fast._cpu's) for a training checkpoint: a resumed
    run restores them with :func:`restore_pack_timings` and makes the choices the interrupted one made, bit for
    bit."""
    return [[r, list(sh), list(st), str(dt).removeprefix("torch."), th, pn, *t]
            for (r, sh, st, dt, th, pn), t in sorted(_PAYS.items(), key=lambda kv: str(kv[0]))]


def restore_pack_timings(rows: list[list] | None) -> None:
    """Put back measurements from :func:`pack_timings` (they replace this process's for the same keys); rows of 8
    fields, from checkpoints written before the panels, were timed with oneDNN's packs."""
    for row in rows or ():
        if len(row) not in (8, 9):
            raise ValueError(f"a pack timing row of {len(row)} fields, expected 9 (or 8, without panels): {row}")
        r, sh, st, dt, th, *rest = row
        pn, t = (rest[0], rest[1:]) if len(row) == 9 else (False, rest)
        _PAYS[(int(r), tuple(sh), tuple(st), getattr(torch, dt), int(th), bool(pn))] = tuple(float(x) for x in t)


def _pays_key(w: torch.Tensor, rows: int) -> tuple:
    """What :func:`pack_pays`'s measurement holds for: the product's rows, the weight's shape, strides and dtype, the
    intra-op threads that run both ways, and whether the pack is elmo_fast._cpu's panels or oneDNN's."""
    return rows, tuple(w.shape), tuple(w.stride()), w.dtype, torch.get_num_threads(), panels_apply(w, rows)


def _self_test(w: torch.Tensor, product, dtype: torch.dtype, what: str) -> None:
    """One product with the first packed weight of each kind, once per process: a row of the identity through
    ``product`` must read back the first row of ``w`` (the layout the packing and torch agree on); raises
    otherwise."""
    probe = torch.zeros(1, w.shape[0], dtype=dtype)
    probe[0, 0] = 1.0
    got = product(probe)
    if not torch.equal(got[0].float(), w[0].detach().to(dtype).float()):
        raise RuntimeError(f"{what} returned unexpected values")


class PackedWeightCache:
    """Packed copies of a module's weights, kept across calls; owned by the module that owns them.

    An entry is keyed by the weight's storage, shape, strides, role and packing dtype, and is valid while the
    weight is unchanged by ``elmo_fast._stamp``'s rule (its version counter, and a sample of its values, which
    catches writes that bypass the counter: ``.data``, torch's fused optimizers). Training's forward packs
    nothing across calls (it packs a weight for one call where :func:`pack_pays`); its backward keeps here only the
    packs that copy a transposed view (``elmo_fast.cpu.lstmp._weights``)
    and packs the others afresh. Pickling (``pickle``, ``torch.save``, ``copy.deepcopy``, a
    spawned worker) drops the entries: they hold oneDNN tensors that cannot be pickled, and they are rebuilt on
    the next call.

    ``id``: the number by which the cpu backend's operator (``elmo_fast::lstmp_cpu``, which takes only tensors and
    plain scalars) finds the cache (:func:`cache_by_id`) while the cache lives.
    """

    def __init__(self):
        self._entries: dict = {}
        self._scratch: torch.Tensor | None = None
        self._kept: dict[str, list[_Kept]] = {}
        self.id = next(_IDS)
        _LIVE[self.id] = self

    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``shape`` reused across calls (grown when too small): for temporaries that never leave a
        call, such as inference's gate pre-activations (42 MiB at 640 tokens, H=4096), which would otherwise come
        back from the kernel as fresh zeroed pages on every call."""
        n = 1
        for d in shape:
            n *= d
        if self._scratch is None or self._scratch.dtype != dtype or self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=dtype)
        return self._scratch[:n].view(shape)

    def reusable(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer for ``name`` that may outlive the call (training's saved activations, backward's dz): one of
        those handed out before, once nothing but this cache references its storage any more (its backward ran
        or its graph was freed), else a new one, kept for later calls (at most ``KEEP`` per name: as many as
        are in use at once, e.g. one per chain of a module between forward and backward). Returned as an alias,
        so autograd's metadata never lands on the kept tensor. Reused pages are mapped already: a fresh 40 MiB
        buffer costs ~8 ms of page faults on 2 cores (bench/results/cpu_lstmp.md), a reused one nothing."""
        kept = self._kept.setdefault(name, [])
        for k in kept:
            if k.t.dtype == dtype and tuple(k.t.shape) == tuple(shape) and k.free():
                return k.t.detach()
        t = torch.empty(shape, dtype=dtype)
        if len(kept) >= KEEP:  # the oldest not in use goes; if every one is in use, this buffer is not kept
            idle = next((k for k in kept if k.free()), None)
            if idle is None:
                return t
            kept.remove(idle)
        kept.append(_Kept(t))
        return t.detach()

    def get(self, w: torch.Tensor, rows: int, dtype: torch.dtype | None = None, role: str = "") -> PackedLinear:
        key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()), role, dtype, panels_mode())
        hit = self._entries.get(key)
        if hit is not None and unchanged(hit[0], w):
            return hit[1]
        lin = PackedLinear(w, rows, dtype)
        self._entries[key] = (stamp(w), lin)
        return lin

    def clear(self) -> None:
        self._entries.clear()
        self._scratch = None
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


KEEP = 8  # reusable buffers kept per name


class _Kept:
    """A buffer and the count of references to its storage when only the cache holds it."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.ref = StorageWeakRef(t.untyped_storage())
        self.alone = self.uses()

    def uses(self) -> int:
        return torch._C._storage_Use_Count(self.ref.cdata)

    def free(self) -> bool:
        return self.uses() == self.alone


_IDS = itertools.count()
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def cache_by_id(cache_id: int) -> PackedWeightCache | None:
    """The live cache with this ``id`` (None for -1, or for a cache that no longer exists)."""
    return _LIVE.get(cache_id)
