"""Kernel report: what the Triton compiler makes of every elmo_fast kernel for an H100, without a GPU.

    make kernel-report                       # the full report -> bench/results/kernel_report.{md,csv}
    python bench/kernel_report.py --subset   # one variant per kernel (CI: fails on any compile error)

Every kernel variant that the launchers would launch for the published original model (spec §0,
../shared/docs/performance.md: H=4096, P=512, filters 1..7 (2048), 2 highway layers of 2048, char dim 16,
L=50, V=793,471, S=8,192) is compiled for sm_90a (``GPUTarget("cuda", 90, 32)``; triton's own binder
specialises the arguments as a real launch would, with ``MockTensor`` stand-ins): inference at B = 1, 16, 64
sentences, training at B = 128 and 384 rows x 20 steps, bf16 and fp32, every op forward and backward.

The launches come from the same launch-configuration functions the launchers call (``fwd_launch`` & co. in
kernels/*.py, evaluated for ``_common.H100``), so report and runtime cannot drift apart;
tests/test_kernel_report.py spies on real interpreter launches and compares them with the cases built here.

Per variant: registers, spill bytes and stack (``ptxas -v``, the log of the very ptxas run that made the
cubin), shared memory, warps and stages, programs against 132 SMs and programs per SM (occupancy from
registers, shared memory and warps), tensor-core instructions (HGMMA = wgmma, HMMA = mma.sync, counted in the
SASS), asynchronous copies (LDGSTS = cp.async, UTMALDG/UBLKCP = TMA) and local-memory instructions, and a
roofline estimate per launch (``estimate_us``). The sums add the estimates per LSTM step, per biLM forward and
per training step, with the torch (cuBLAS / elementwise) launches around the kernels modelled the same way.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels (JITFunction), not the interpreter's

import argparse  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import io  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import MockTensor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import kernel_fit  # noqa: E402
import lstmp_compile  # noqa: E402

from elmo_fast.kernels import _common as KX  # noqa: E402
from elmo_fast.kernels import char_cnn as KC  # noqa: E402
from elmo_fast.kernels import dropout as KD  # noqa: E402
from elmo_fast.kernels import highway as KH  # noqa: E402
from elmo_fast.kernels import lstmp as KL  # noqa: E402
from elmo_fast.kernels import softmax as KS  # noqa: E402
from elmo_fast.training.configs import ORIGINAL_TOWERS  # noqa: E402

BF16, FP32, I64, I32, I8 = torch.bfloat16, torch.float32, torch.int64, torch.int32, torch.int8

# ------------------------------------------------------------------------------------------ the workload
H, P = 4096, 512
FILTERS = [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]]
NF = sum(n for _, n in FILTERS)
DC, L, N_CHARS, N_HIGHWAY = 16, 50, 262, 2
V, S = 793471, 8192
N_PARAMS = 93_600_848  # spec §0, without the softmax
FUSED_REDUCE = "fwd fusedreduce"  # lstmp_cases with the forward's reduce in the projection's last split
PDL = "fwd pdl"  # lstmp_cases built for programmatic dependent launch (opt-in: kernels/lstmp.py pdl_on)
PDL_SIZES = ("infer B=1", "train B=384")  # where the PDL builds are compiled (bf16): the latency and the chain targets
DROPOUT_SITES = 6  # the trainer's dropout sites a step: every LSTM layer's input in both directions, both top outputs
MEAN_WINDOWS = 8  # assumed mean char-CNN position-loop length (sorted tokens: BOW + ~5 bytes + EOW + slack)


@dataclass(frozen=True)
class Size:
    name: str
    B: int  # sentences (inference) or rows (training)
    T: int  # LSTM steps: tokens + 2 boundaries (inference) or unroll steps (training)
    train: bool

    @property
    def tokens(self) -> int:
        """Rows through the token encoder: every position (no deduplication assumed, an upper bound); the
        trainer encodes the forward and the backward stream together."""
        return self.B * self.T * (2 if self.train else 1)

    @property
    def softmax_rows(self) -> int:
        return self.B * self.T


SIZES = [Size("infer B=1", 1, 22, False), Size("infer B=16", 16, 27, False), Size("infer B=64", 64, 27, False),
         Size("train B=128", 128, 20, True), Size("train B=384", 384, 20, True)]
TOWERS_SIZE = "train B=384"  # the original config's rows a step: ORIGINAL_TOWERS towers of 128
DTYPES = [BF16, FP32]

# ------------------------------------------------------------------------------------------ H100 SXM model
SMS = KX.H100.sms
HBM = 3.35e12  # B/s
PEAK_TC = 990e12  # dense bf16 with tensor cores
PEAK_FMA = 67e12  # fp32 without tensor cores
# launch terms: common.EAGER_LAUNCH_US / GRAPH_LAUNCH_US / TORCH_LAUNCH_US (measured on an H200)
SMEM_PER_BLOCK = 227 * 1024


def dt_name(dt: torch.dtype) -> str:
    return {BF16: "bf16", FP32: "fp32", I64: "i64", I32: "i32", I8: "i8", torch.float16: "fp16",
            torch.float64: "fp64"}[dt]


def es(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


# ------------------------------------------------------------------------------------------ cases
@dataclass
class Case:
    """One kernel launch of the workload: which op, where, the launch (from the launcher's own config
    function), the runtime arguments as a real launch passes them, and the roofline inputs."""

    op: str
    phase: str  # fwd | bwd
    size: str
    dtype: torch.dtype
    launch: KX.Launch
    args: tuple
    flops: float = 0.0
    bytes: float = 0.0
    variant: str = ""
    slot: int = 0  # which launch of the op (its candidates share it)
    choice: int = 0  # which autotune candidate of that launch
    once: bool = False  # launched once per op call, not once per step (the sums' ``times`` does not apply)
    scratch: float = 0.0  # of ``bytes``: the LSTMP split-K partials (re-used every step; may stay in L2)
    l2: float = 0.0  # what its programs move through L2 (LSTMP: lstmp_compile.l2_bytes, for the calibrated model;
    # softmax: softmax_l2_bytes); 0 where not modelled
    repeat: int = 1  # launched this many times in a row per op call, the same variant (the full softmax's chunks)
    stats: dict = field(default_factory=dict)

    @property
    def kernel(self) -> str:
        return self.launch.kernel.__name__

    @property
    def programs(self) -> int:
        return math.prod(self.launch.grid)

    @property
    def label(self) -> str:
        return (f"{self.kernel}{' ' + self.variant if self.variant else ''}"
                + (f" (x{self.repeat} launches)" if self.repeat > 1 else ""))


def M(dt):  # a tensor argument of dtype dt
    return MockTensor(dt)


def describe(args) -> list:
    """Runtime arguments as the report and the spy test compare them: tensors by dtype, scalars by value."""
    return [("tensor", a.dtype) if isinstance(a, (torch.Tensor, MockTensor)) else a for a in args]


def _entry(phase, launches, args, cost) -> list[tuple]:
    """One logical launch: ``launches`` is a Launch or the autotune candidates of a launch-configuration
    function; ``cost(launch)`` gives (FLOPs, bytes) for a candidate."""
    return [(phase, lc, args, *cost(lc)) for lc in (launches if isinstance(launches, list) else [launches])]


def char_cnn_cases(N, L_, filters, dc, n_chars, dtype, target, *, train, windows=MEAN_WINDOWS, activation="relu",
                   ordered=False):
    """The launches of ``char_cnn_triton`` (forward; with ``train`` the backward of every input too; ``ordered``:
    the backward of deterministic mode)."""
    F = sum(n for _, n in filters)
    kwd = max(w for w, _ in filters) * dc
    acc = KX.acc_dtype(dtype)
    fwd = KC.fwd_launch(N, F, L_, dc, kwd, dtype, target, activation=activation, has_pad=n_chars > KC.PAD_CHAR_ID,
                        save_arg=train)
    kwc, e = fwd.meta["KWC"], es(dtype)
    arg = (I8 if L_ < 128 else I32) if train else dtype
    flops = 2.0 * N * windows * kwc * F
    io_bytes = N * L_ * dc * e + kwd * F * e + N * F * e  # the embedded characters E (N, L, dc), weights, output
    out = [_entry("fwd", fwd, (M(dtype), M(dtype), M(dtype), M(dtype), M(I32), M(I32), M(I32), M(I32), M(dtype),
                               M(arg), N, F, L_, KC.PAD_CHAR_ID),
                  lambda lc: (flops, io_bytes + (N * F if train else 0)))]
    if train:
        bwd = KC.bwd_launch(N, F, L_, dc, kwd, dtype, target, activation=activation, need_w=True,
                            need_emb=not ordered, ordered=ordered)
        g_bytes = N * F * (2 * e + 1)  # upstream gradient, output, argmax
        # atomics: the weight tile once per token block, the window gradient once per filter block; ordered: the
        # weight and bias partials stored once per token block, the weight product only
        out.append(_entry("bwd", bwd, (M(dtype), M(dtype), M(I32), M(I32), M(I32), M(dtype), M(arg),
                                       M(dtype), M(acc), M(acc), M(acc), N, F, L_),
                          lambda lc: ((1 if ordered else 2) * flops, N * L_ * dc * e + g_bytes
                                      + lc.grid[0] * kwd * F * 4
                                      + (0 if ordered else lc.grid[1] * N * windows * kwc * 4))))
        if ordered:
            win = KC.win_grad_launch(N, F, L_, dc, kwd, dtype, target, activation=activation)
            kw, dcp, slots = win.meta["KW"], win.meta["DCP"], windows + win.meta["KW"]
            # per slot of the loop: KW products of (tokens x filters) x (filters x DCP); the program re-reads its
            # tokens' gradient tiles and the weights once per slot (from L2, mostly: counted as traffic)
            out.append(_entry("bwd", win, (M(dtype), M(I32), M(I32), M(dtype), M(arg), M(dtype), M(acc), N, F, L_),
                              lambda lc: (2.0 * N * slots * F * kw * dcp,
                                          slots * (g_bytes + lc.grid[0] * kwd * F * e) + N * L_ * dc * 4)))
        R = N * L_
        eg, rpp = KC.embed_grad_launch(R, n_chars, dc, dtype, target, ordered=ordered)
        out.append(_entry("bwd", eg, (M(I64), M(acc), M(acc), R, n_chars, rpp),
                          lambda lc: (2.0 * R * lc.meta["BLOCK_V"] * lc.grid[1] * lc.meta["DCP"], R * (8 + dc * 4))))
    return out


def highway_cases(M_, F, dtype, target, *, train):
    """The launches of one ``highway_triton`` layer."""
    acc, e = KX.acc_dtype(dtype), es(dtype)
    gemm = 2.0 * M_ * F * F
    out = [_entry("fwd", KH.fused_launch(M_, F, dtype, target, backward=False), (M(dtype),) * 9 + (M_, F),
                  lambda lc: (2 * gemm, (2 * M_ * F + 2 * F * F) * e))]
    if train:
        out.append(_entry("bwd", KH.fused_launch(M_, F, dtype, target, backward=True),
                          (M(dtype),) * 8 + (M(acc), M_, F),
                          lambda lc: (2 * gemm, (3 * M_ * F + 2 * F * F + 2 * M_ * F) * e + M_ * F * 4)))
        out.append(_entry("bwd", KH.dx_launch(M_, F, dtype, target),
                          (M(dtype),) * 5 + (M(acc), M_, F, F, 2 * F, 1, 1, F, F, 0, 0, 0),
                          lambda lc: (2 * gemm, (2 * M_ * F + 2 * F * F + M_ * F) * e + M_ * F * 4)))
        out.append(_entry("bwd", KH.dw_launch(M_, F, dtype, target),
                          (M(dtype),) * 6 + (F, F, M_, 1, F, 2 * F, 1, F, 0, F, F * F),
                          lambda lc: (2 * gemm, (3 * M_ * F + 2 * F * F) * e)))
    return out


def dropout_cases(n: int, dtype, groups: int = 1) -> list:
    """One dropout site of training over ``n`` elements in ``groups`` groups (the fused towers' rows): the forward
    launch, and the backward, the same kernel on the gradient (``kernels/dropout.py``). Bytes: x read, y written."""
    numels = [n // groups] * (groups - 1) + [n - (n // groups) * (groups - 1)]
    args = (M(dtype), M(dtype), M(FP32), *KD.scalar_args(numels, list(range(groups)), 0.1))
    lc = KD.dropout_launch(n, groups, dtype)
    return [_entry(phase, lc, args, lambda lc: (0.0, 2 * n * es(dtype))) for phase in ("fwd", "bwd")]


def softmax_l2_bytes(lc, N: int, C: int, P_: int, e: int) -> float:
    """What a softmax kernel's programs move through L2: each logit tile's K loop reads its BLOCK_N rows of H and
    its BLOCK_C rows of W, P wide (the re-reads of one tiling: every row block reads every column tile's weights
    and the other way round), plus what the kernel writes: the dlogit kernel its N x C dlogit in the operand dtype
    and its fp32 bias partials per row block, the forward its row statistics (m, l) per column split."""
    m = lc.meta
    rows, tiles = triton.cdiv(N, m["BLOCK_N"]), triton.cdiv(C, m["BLOCK_C"])
    written = N * C * e + rows * C * 4 if lc.kernel is KS._softmax_dlogit_kernel else lc.grid[1] * N * 8
    return rows * tiles * (m["BLOCK_N"] + m["BLOCK_C"]) * P_ * e + written


def softmax_cases(N, C, P_, dtype, target, *, sampled, train, num_splits=None, groups=1):
    """The launches of the sampled (C = S samples) or the full (C = V) softmax; ``groups`` sampled softmaxes of N
    rows and C samples each in one call (``ops.sampled_softmax_loss_groups``: a launch's grid covers them all)."""
    e = es(dtype)
    flags = dict(gather=sampled, mask_hits=sampled)
    fw, cps = KS.lse_fwd_launch(N, C, P_, dtype, target, num_splits=num_splits, groups=groups, **flags)
    ids = M(I64) if sampled else M(FP32)
    gemm = 2.0 * N * C * P_ * groups
    out = [[("fwd", fw, (M(dtype), M(dtype), ids, M(FP32), M(I64), M(FP32), M(FP32), M(FP32), M(FP32), N, P_, C,
                         cps), gemm, ((N * P_ + C * P_) * e + C * 12) * groups, False, 0.0,
             softmax_l2_bytes(fw, N, C, P_, e) * groups)]]
    if train:
        flags["sub_target"] = not sampled
        calls = groups if groups > 1 and softmax_one_by_one(N, C, groups, e) else 1  # softmax_grad: one by one
        groups //= calls
        cw = KS.dlogit_columns(N * groups, C, e)
        inputs = (M(dtype), M(dtype), ids, M(FP32), M(I64), M(FP32), M(FP32))
        for w in sorted({cw, C % cw} - {0}, reverse=True):  # full chunks, then a partial last one
            dl = KS.dlogit_launch(N, w, P_, dtype, target, groups=groups, **flags)
            count = (C // cw if w == cw else 1) * calls
            # the logit tile once; dlogit written in the operand dtype, the bias partials in fp32
            nbytes = ((N * P_ + w * P_) * e + N * w * e + dl.grid[0] * w * 4) * groups
            out.append([("bwd", dl, inputs + (M(dtype), M(FP32), N, P_, 0, w, C), 2.0 * N * w * P_ * groups, nbytes,
                         False, 0.0, softmax_l2_bytes(dl, N, w, P_, e) * groups, count)])
    return out


def softmax_one_by_one(N: int, C: int, groups: int, e: int) -> bool:
    """Whether ``groups`` groups' dlogit (N x C each, ``e`` bytes) pass the backward's budget together, so that
    ``softmax_grad`` runs them group after group (the forward stays one launch)."""
    return KS.dlogit_columns(N * groups, C, e) < C


def lstmp_cases(B, T, H_, P_, dtype, target, *, reverse, residual, train, fuse_reduce=False, pdl=False):
    """The launches of one step of an LSTMP chain (both clips, with projection), from ``launch_plan`` (the
    launcher's own plan), in launch order. Backward starts with one extra ``bwd_reduce`` launch (the first
    step's prologue, ``HAS_PART=False``) that runs once per call, not per step. Bytes count the split-K partials
    as HBM traffic (an upper bound: at 8.7/17.3 MiB per step at B=384 they may well stay in L2)."""
    plan = KL.launch_plan(B, T, H_, P_, dtype, training=train, target=target, reverse=reverse, residual=residual,
                          fuse_reduce=fuse_reduce, pdl=pdl)
    s = min(3, T - 1)  # the step index (never specialised)
    out = []
    for name, lc in plan.items():
        if name == "bwd_cell":  # the prologue launches before the first bwd_cell: no partials to read
            out.append(_lstmp_entry("bwd", plan["bwd_reduce"], s, plan["bwd_reduce"].bytes, dict(HAS_PART=False),
                                    once=True))
        # a PDL plan's launches carry the attribute (part of triton's compile key: gpu-check's precompile then warms
        # what the loops launch); the backward's prologue goes plainly, as does step 0's cell launch (its plain build
        # is left to its first call)
        out.append(_lstmp_entry(name.split("_")[0], lc, s, lstmp_compile.l2_bytes(name, lc, B, dtype),
                                dict(launch_pdl=True) if pdl else None))
    return out


def _lstmp_entry(phase, lc, s, l2, override=None, once=False) -> list[tuple]:
    meta = dict(lc.constexprs, **(override or {}), num_warps=lc.num_warps, num_stages=lc.num_stages)
    args = tuple(M(v) if isinstance(v, torch.dtype) else (s if n == "s" else v) for n, v in lc.args)
    scratch = 0 if once else lc.scratch_bytes  # the prologue (the one launch once a call) reads no partials
    return [(phase, KX.Launch(lc.kernel, lc.grid, meta), args, float(lc.flops), float(lc.bytes + scratch), once,
             float(scratch), float(l2))]


def _cases(size: Size, op: str, dtype, built, variant="") -> list[Case]:
    return [Case(op, phase, size.name, dtype, launch, args, flops, nbytes, variant, slot=slot, choice=choice,
                 once=bool(rest and rest[0]), scratch=rest[1] if len(rest) > 1 else 0.0,
                 l2=rest[2] if len(rest) > 2 else 0.0, repeat=rest[3] if len(rest) > 3 else 1)
            for slot, entry in enumerate(built)
            for choice, (phase, launch, args, flops, nbytes, *rest) in enumerate(entry)]


def workload_cases(sizes=SIZES, dtypes=DTYPES) -> list[Case]:
    """Every launch variant of the workload, for the H100 target."""
    tg = KX.H100
    out: list[Case] = []
    for size in sizes:
        for dt in dtypes:
            out += _cases(size, "char_cnn", dt, char_cnn_cases(size.tokens, L, FILTERS, DC, N_CHARS, dt, tg,
                                                               train=size.train))
            if size.train:  # deterministic mode's backward (its forward is the same)
                out += [c for c in _cases(size, "char_cnn", dt, char_cnn_cases(
                    size.tokens, L, FILTERS, DC, N_CHARS, dt, tg, train=True, ordered=True), "det")
                    if c.phase == "bwd"]
            out += _cases(size, "highway", dt, highway_cases(size.tokens, NF, dt, tg, train=size.train))
            for reverse in (False, True):
                for residual in (False, True):
                    v = ("rev" if reverse else "fwd") + (" resid" if residual else "")
                    out += _cases(size, "lstmp", dt, lstmp_cases(size.B, size.T, H, P, dt, tg, reverse=reverse,
                                                                 residual=residual, train=size.train), v)
            if size.B <= 16 and not size.train:  # the reduce in the projection's last split (opt-in, kernels/lstmp)
                out += _cases(size, "lstmp", dt, lstmp_cases(size.B, size.T, H, P, dt, tg, reverse=False,
                                                             residual=False, train=False, fuse_reduce=True),
                              FUSED_REDUCE)
            if size.name in PDL_SIZES and dt == BF16:  # programmatic dependent launch (opt-in, kernels/lstmp)
                out += _cases(size, "lstmp", dt, lstmp_cases(size.B, size.T, H, P, dt, tg, reverse=False,
                                                             residual=False, train=size.train, pdl=True), PDL)
            if size.train:  # every dropout site's launch (one group; the fused towers' three: same bytes)
                out += _cases(size, "dropout", dt, dropout_cases(size.B * size.T * P, dt))
            if size.name == TOWERS_SIZE:
                out += _cases(size, "dropout", dt, dropout_cases(size.B * size.T * P, dt, ORIGINAL_TOWERS), "towers")
            if size.train:  # both directions in one call (the trainer's sampled_softmax_loss_groups)
                out += _cases(size, "sampled_softmax", dt, softmax_cases(size.softmax_rows, S, P, dt, tg, sampled=True,
                                                                         train=True, groups=2))
            if size.name == TOWERS_SIZE:  # the original config fused: every tower's two directions in one call
                out += _cases(size, "sampled_softmax", dt, softmax_cases(
                    size.softmax_rows // ORIGINAL_TOWERS, S, P, dt, tg, sampled=True, train=True,
                    groups=2 * ORIGINAL_TOWERS), "towers")
            out += _cases(size, "full_softmax", dt,
                          softmax_cases(size.softmax_rows, V, P, dt, tg, sampled=False, train=size.train))
    return out


# ------------------------------------------------------------------------------------------ compiling
def compile_key(case: Case):
    """What triton's JITFunction.run computes before compiling: (options, signature, constexprs, attrs)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = case.launch.kernel
    backend = make_backend(GPUTarget("cuda", 90, 32))
    kwargs = dict(case.launch.meta, debug=False, instrumentation_mode="")
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, _ = binder(*case.args, **kwargs)
    return fn._pack_args(backend, kwargs, bound, specialization, None)


_PTXAS = {k: re.compile(rx) for k, rx in dict(regs=r"Used (\d+) registers", stack=r"(\d+) bytes stack frame",
                                                spill_st=r"(\d+) bytes spill stores",
                                                spill_ld=r"(\d+) bytes spill loads").items()}
_SASS = {"hgmma": r"\bHGMMA\.", "hmma": r"\bHMMA\.", "ldgsts": r"\bLDGSTS\b", "tma": r"\b(?:UTMALDG|UBLKCP)\b",
         "local": r"\b(?:LDL|STL)\b", "atom": r"\b(?:REDG?|ATOMG?)\b",
         "membar_gpu": r"\bMEMBAR\.(?:[A-Z]+\.)*GPU\b"}
_PTX = {"ptx_wgmma": r"wgmma\.mma_async", "ptx_mma": r"\bmma\.sync", "ptx_cp_async": r"cp\.async\.(?:ca|cg)",
        "ptx_tma": r"cp\.async\.bulk", "ptx_gdc_wait": r"griddepcontrol\.wait"}
_JOBS: list = []  # (case, key) per distinct variant; forked workers read it


def _compile_one(i: int) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    case, (options, signature, constexprs, attrs) = _JOBS[i]
    t0 = time.time()
    triton.knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            ck = triton.compile(ASTSource(case.launch.kernel, signature, constexprs, attrs),
                                target=GPUTarget("cuda", 90, 32), options=options.__dict__)
    except Exception as exc:  # noqa: BLE001 - a compile error is a result of the report
        return dict(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300], compile_s=time.time() - t0)
    st = {k: int(m.group(1)) if (m := rx.search(log.getvalue())) else 0 for k, rx in _PTXAS.items()}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout
    st.update({k: len(re.findall(rx, sass)) for k, rx in _SASS.items()})
    st.update({k: len(re.findall(rx, ck.asm["ptx"])) for k, rx in _PTX.items()})
    md = ck.metadata
    st.update(smem=md.shared, warps=md.num_warps, stages=md.num_stages, compile_s=time.time() - t0)
    return st


def compile_all(cases: list[Case], jobs: int, warm: bool = False) -> float:
    """Compile every distinct variant once (in ``jobs`` processes) and attach the stats to every case. Into a fresh
    temporary cache (every variant compiled, so ptxas reports on each), or with ``warm`` into triton's own cache
    (``triton.knobs.cache.dir``: ``TRITON_CACHE_DIR``, else ~/.triton/cache), where a JIT launch with the same key
    finds it (gpu-check's precompile); a variant found there is not compiled again and has no ptxas counts."""
    global _JOBS
    keys: dict[str, int] = {}
    index = []
    _JOBS = []
    for c in cases:
        key = compile_key(c)
        k = repr((c.kernel, key[1], sorted(key[2].items(), key=repr), sorted(key[3].items(), key=repr),
                  sorted(key[0].__dict__.items(), key=repr)))
        if k not in keys:
            keys[k] = len(_JOBS)
            _JOBS.append((c, key))
        index.append(keys[k])
    t0 = time.time()
    with (contextlib.nullcontext(triton.knobs.cache.dir) if warm else
          tempfile.TemporaryDirectory(prefix="kreport_cache_")) as cache:
        triton.knobs.cache.dir = cache
        if jobs > 1:
            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                results = pool.map(_compile_one, range(len(_JOBS)), chunksize=1)
        else:
            results = [_compile_one(i) for i in range(len(_JOBS))]
    for c, i in zip(cases, index):
        c.stats = dict(results[i], variant_id=i)
    return time.time() - t0


# ------------------------------------------------------------------------------------------ model and rules
occupancy = kernel_fit.occupancy


def tensor_cores(st: dict) -> bool:
    return st["hgmma"] + st["hmma"] > 0


def estimate_us(case: Case, scratch_in_l2: bool = False, graph: bool = False) -> float:
    """max(bytes / HBM, FLOPs / peak), slowed by the share of SMs the grid keeps busy (a grid of n < 132
    programs uses n SMs; a last partial wave idles the rest); launched eagerly at least the host's launch time
    (``common.launched_us``), from a CUDA graph (``graph``) plus a graph launch's cost.
    ``scratch_in_l2``: the split-K partials (``case.scratch``) taken as L2 traffic, not HBM (the lower bound).

    The peak is the tensor-core one when the SASS has tensor-core instructions, else the fp32 FMA one."""
    st = case.stats
    if "error" in st:  # did not compile: never the preferred candidate, and no estimate to add up
        return math.inf
    peak = PEAK_TC if tensor_cores(st) else PEAK_FMA
    nbytes = case.bytes - (case.scratch if scratch_in_l2 else 0.0)
    busy = kernel_fit.busy(case.programs, occupancy(st))
    return common.launched_us(max(nbytes / HBM, case.flops / peak) / busy * 1e6, graph)


def h200_chain_ms(path: Path = kernel_fit.H200_ROWS) -> dict:
    """(size, dtype) -> ms per chain (fwd, fwd+bwd of elmo_fast with loop graphs; the same of cuDNN's
    nn.LSTM(512, 4096, proj_size=512)), B rows x 20 steps, from the H200's committed rows (2026-11-26, bench `lstmp`,
    `bench_lstmp.py`, call 1: the code of c17f5ba) at the training sizes of the report."""
    got: dict = {}
    for r in kernel_fit.h200_rows("lstmp", path):
        if r.get("call") == "call 1" and r["provider"] in ("triton", "cudnn"):
            key = (f"train B={r['B']}", {"bfloat16": "bf16", "float32": "fp32"}[r["dtype"]])
            got.setdefault(key, {})[(r["provider"], r["mode"])] = float(r["ms_p50"])
    return {k: tuple(v[(p, m)] for p in ("triton", "cudnn") for m in ("fwd", "fwd+bwd"))
            for k, v in got.items() if len(v) == 4 and k[0] in {s.name for s in SIZES if s.train}}


def h200_softmax_ms(op: str = "sampled_softmax", mode: str = "fwd+bwd",
                    shape: str = "N=7680,S=8192,P=512,V=793471", path: Path = kernel_fit.H200_ROWS) -> float:
    """The H200's Triton softmax time in ms (bf16; the softmax bench ran in the lease's call 2): by default the
    sampled softmax forward+backward at the training shape."""
    for r in kernel_fit.h200_rows("softmax", path):
        if (r.get("op"), r.get("provider"), r.get("dtype"), r.get("call"), r.get("mode"),
                r.get("shape")) == (op, "triton", "bfloat16", "call 2", mode, shape):
            return float(r["ms_p50"])
    return math.nan


def calibrated_gpu_us(case: Case) -> float | None:
    """An LSTMP kernel's GPU time under the model calibrated on the H200's per-kernel timings (bench/kernel_fit.py:
    L2 traffic, compulsory bytes and FLOPs at fitted rates, the compiled occupancy's idle SMs charged); None for the
    other ops (no GPU timings of theirs to fit) and for a variant that did not compile."""
    st = case.stats
    if case.op != "lstmp" or "error" in st:
        return None
    return kernel_fit.calibrated_us(case.l2, case.bytes, case.flops, case.programs, occupancy(st),
                                    kernel_fit.cls_of(dt_name(case.dtype)), spill_bytes=st["spill_st"] + st["spill_ld"],
                                    passes=kernel_fit.launch_passes(case.launch.meta, case.launch.grid,
                                                                    next(s.B for s in SIZES if s.name == case.size)))


def calibrated_us(case: Case, graph: bool = True) -> float:
    """``calibrated_gpu_us`` with the launch terms of ``common.launched_us`` (LSTMP launches only; inf for a variant
    that did not compile, as ``estimate_us``)."""
    gpu = calibrated_gpu_us(case)
    return math.inf if gpu is None else common.launched_us(gpu, graph)


GEMM_LIKE = {"_char_cnn_fwd_kernel", "_char_cnn_bwd_kernel", "_char_cnn_win_grad_kernel", "_highway_fused_kernel",
             "_mm_kernel",
             "_softmax_lse_fwd_kernel", "_softmax_dlogit_kernel", "_fwd_cell_kernel",
             "_bwd_cell_kernel", "_splitk_kernel", "_splitk_out_kernel"}
# Kernels that may launch fewer than 132 programs at B >= 128, and why (none today).
FEW_PROGRAMS_OK: dict[str, str] = {}
NOTES = {
    "_embed_grad_kernel": "not GEMM-like: a one-hot reduction of the fp32 window gradients into the 262-row "
                          "character table, exact IEEE fp32 on purpose (its products are 0 or 1 times a value)",
    "_char_cnn_bwd_kernel": "the window gradient is added with fp32 atomics (relaxed: no memory barrier), once per "
                            "64-filter block (32-way at F=2048): most of its estimated bytes; variant 'det' "
                            "(deterministic mode) stores per-token-block partials of the weight and bias gradients "
                            "instead",
    "_char_cnn_win_grad_kernel": "deterministic mode's window gradient (one writer per element): each program re-reads "
                                 "its tokens' gradient tiles and the weights once per character slot; counted as "
                                 "traffic, though most of it should hit L2",
}
# Kernels without a K loop, so with nothing to software-pipeline (the async-load rule does not apply), and why.
NO_K_LOOP = {
    "_fwd_reduce_kernel": "LSTMP split-K epilogue: an unrolled, ordered sum of the SPLITS partial tiles (every load "
                          "issued up front), then clip, residual and state writes",
    "_bwd_reduce_kernel": "LSTMP split-K epilogue of the recurrent backward: an unrolled, ordered sum of the "
                          "partials into the carry, then the next step's projection-clip mask",
    "_dropout_hash_kernel": "elementwise dropout: one block of elements a program, loaded once (no loop)",
}
# Kernels that order memory at GPU scope on purpose (a MEMBAR.*.GPU in their code), and why. Anywhere else such a
# barrier is a fault: Triton's atomics default to acq_rel, which puts one before every atomic (the char-CNN backward
# had one per window-gradient tile until its sums became relaxed).
GPU_FENCED = {
    "_splitk_out_kernel": "the split-K ticket (fused reduce): partials stored, then an acq_rel ticket at GPU scope, so "
                          "the split that draws last sees every partial",
}
PENDING: dict[str, str] = {}  # op -> why its violations are not (yet) enforced


def violations(case: Case) -> list[str]:
    """The report's rules (performance.md, 'Without a GPU') that this variant breaks."""
    st = case.stats
    if "error" in st:
        return [f"compile error: {st['error']}"]
    out = []
    spills = st["spill_st"] + st["spill_ld"]
    big_fp32 = case.dtype == FP32 and case.size == "train B=384"
    if spills and not big_fp32:
        out.append(f"spills {st['spill_st']}/{st['spill_ld']} B")
    if case.dtype == BF16 and case.kernel in GEMM_LIKE and not tensor_cores(st):
        out.append("no tensor-core instruction")
    stationary = bool(case.launch.meta.get("STATIONARY"))  # exempt from these two: KL.STATIONARY_EXEMPT
    if case.size.startswith("train") and case.programs < SMS and case.kernel not in FEW_PROGRAMS_OK \
            and not stationary:
        out.append(f"{case.programs} programs < {SMS}")
    if st["ldgsts"] + st["tma"] == 0 and case.kernel not in NO_K_LOOP and not stationary:
        out.append("no pipelined (async) loads")
    if st["smem"] > SMEM_PER_BLOCK:
        out.append(f"shared memory {st['smem']} B > {SMEM_PER_BLOCK}")
    if st.get("membar_gpu") and case.kernel not in GPU_FENCED:
        out.append(f"{st['membar_gpu']} GPU-scope memory barriers (an atomic sum without sem='relaxed'?)")
    return out


# ------------------------------------------------------------------------------------------ sums
def chosen(cases: list[Case]) -> list[Case]:
    """Per launch, the autotune candidate the model prefers: the fastest estimate among those that break no
    rule (among all when every one breaks one)."""
    groups: dict = {}
    for c in cases:
        groups.setdefault((c.size, c.dtype, c.op, c.variant, c.slot), []).append(c)
    return [min(g, key=lambda c: (bool(violations(c)), estimate_us(c, graph=True))) for g in groups.values()]


@dataclass
class TorchOp:
    """A launch group outside the Triton kernels (cuBLAS GEMMs, torch elementwise/sort ops), modelled with the
    same roofline; ``launches`` are counted from the host code (approximate for composite torch calls)."""

    name: str
    flops: float
    bytes: float
    launches: int
    tensor_cores: bool

    def estimate_us(self) -> float:
        peak = PEAK_TC if self.tensor_cores else PEAK_FMA
        return max(self.bytes / HBM, self.flops / peak) * 1e6 + common.TORCH_LAUNCH_US * self.launches


def gemm(name, m, n, k, dt, launches=1) -> TorchOp:
    return TorchOp(name, 2.0 * m * n * k, (m * k + k * n + m * n) * es(dt), launches, dt == BF16)


def torch_ops(size: Size, dt) -> dict[str, list[TorchOp]]:
    """The torch launches of each op at this size, by op and phase ("op/phase")."""
    N, nt = size.tokens, size.B * size.T
    ops = {
        "char_cnn/fwd": [TorchOp("token dedup (torch.unique rows) + gather", 0, 3 * N * L * 8, 8, False),
                         TorchOp("char_cnn prep: packed weights, lengths, argsort", 0, 4 * N * L * 8, 16, False),
                         TorchOp("char_cnn embedded characters E = table[ids] (embedding)", 0,
                                 N * L * (8 + DC * es(dt)), 1, False)],
        "highway/fwd": [gemm("token projection 2048->512 (addmm)", N, P, NF, dt)],
        "lstmp/fwd": [gemm("input projection x·W_in (all steps)", nt, 4 * H, P, dt),
                      TorchOp("lstmp state copies, consts, zero fill", 0, size.B * (H + P) * 8, 6, False),
                      *_interleave_op(size, dt)],
    }
    if size.train:
        embedded = TorchOp("char_cnn embedded characters again (embedding)", 0, N * L * (8 + DC * es(dt)), 1, False)
        ops["char_cnn/bwd"] = [TorchOp("grad zero-fill, unpack, casts", 0, N * L * DC * 4, 12, False), embedded]
        kwd = max(w for w, _ in FILTERS) * DC
        tblocks = KC.bwd_launch(N, NF, L, DC, kwd, dt, KX.H100, activation="relu", need_w=True, need_emb=False,
                                ordered=True).grid[0]
        rblocks = KC.embed_grad_launch(N * L, N_CHARS, DC, dt, KX.H100, ordered=True)[0].grid[0]
        ops["char_cnn/bwd det"] = [TorchOp("unpack, casts; partial sums (weights, bias, table) in block order", 0,
                                           tblocks * (kwd + 1) * NF * 4 + rblocks * N_CHARS * DC * 4, 12, False),
                                   embedded]
        ops["highway/bwd"] = [gemm("token projection dX, dW", N, NF, P, dt, 2),
                              TorchOp("highway bias grads: column sums of dz, each layer", 0,
                                      N_HIGHWAY * N * 2 * NF * es(dt), N_HIGHWAY, False)]
        ops["lstmp/bwd"] = [gemm("dW_in, dW_rec, dW_proj, dx (4 GEMMs)", nt, 4 * H, P, dt, 1),
                            gemm("", P, 4 * H, nt, dt, 1), gemm("", H, P, nt, dt, 1), gemm("", nt, P, 4 * H, dt, 1),
                            TorchOp("dbias (the sum of the bwd cell kernel's per-block partials), the residual's dy "
                                    "added to dx (counted for every chain), casts, state copies",
                                    0, size.T * triton.cdiv(size.B, KL.launch_plan(
                                        size.B, size.T, H, P, dt, training=True)["bwd_cell"].tile.BM) * 4 * H * 4
                                    + 3 * nt * P * es(dt) + 4 * size.B * (P + H) * 4, 6, False)]
        calls = [("sampled_softmax", nt, 2)]  # both directions in one call
        if size.name == TOWERS_SIZE:  # and the original config's towers fused: every tower's two directions
            calls.append(("sampled_softmax towers", nt // ORIGINAL_TOWERS, 2 * ORIGINAL_TOWERS))
        for key, rows, groups in calls:
            for phase, o in sampled_softmax_ops(rows, groups, dt).items():
                ops[f"{key}/{phase}"] = o
        dense = TorchOp("grad norm + dense Adagrad over 93.6M params (fp32 state)", 0, 6 * N_PARAMS * 4, 8 * 40,
                        False)
        # the softmax rows a step touches, at most: every sample set's S and both directions' targets
        ops["optimizer/step"] = [dense, TorchOp("sparse Adagrad on the touched softmax rows (2 sample sets, 2 x "
                                                "B x T targets)", 0, 6 * (2 * S + 2 * nt) * P * 4, 12, False)]
        if size.name == TOWERS_SIZE:  # the original config's towers: 2 sample sets each, one optimizer step
            ops["optimizer towers/step"] = [dense, TorchOp(
                "sparse Adagrad on the touched softmax rows (2 sample sets a tower)", 0,
                6 * (2 * ORIGINAL_TOWERS * S + 2 * nt) * P * 4, 12, False)]
    return ops


def sampled_softmax_ops(nt: int, groups: int, dt) -> dict[str, list[TorchOp]]:
    """The torch launches around the Triton kernels of one grouped sampled-softmax call (``groups`` sample sets
    of S, ``nt`` rows each; the trainer's: every tower's two directions), by phase: the bytes grow with the
    groups, the launches do not (batched GEMMs, one gather, one merge of the table's rows), but the sampler's,
    once per sample set."""
    dl_rows = KS.dlogit_launch(nt, S, P, dt, KX.H100, gather=True, mask_hits=True, sub_target=False).grid[0]
    calls = groups if softmax_one_by_one(nt, S, groups, es(dt)) else 1  # the backward's calls
    return {
        "fwd": [TorchOp("sampler: log-uniform draws, first-occurrence dedup (V scratch)", 0, 3 * V * 8 * groups,
                        15 * groups, False),
                TorchOp("group stacking, offsets, split LSE merge, loss", 0, (nt * 16 + S * 16) * groups, 14, False)],
        "bwd": [TorchOp("dH = dlogit·W_s (cuBLAS, batched over the groups, fp32 out)", 2.0 * nt * P * S * groups,
                        (nt * S + S * P + nt * P) * es(dt) * groups, calls, dt == BF16),
                TorchOp("dW_s = dlogitᵀ·H (cuBLAS, batched over the groups, fp32 out)", 2.0 * nt * P * S * groups,
                        (nt * S + S * P + nt * P) * es(dt) * groups, calls, dt == BF16),
                TorchOp("gather W_s rows, sum the bias partials", 0, (2 * S * P * es(dt) + dl_rows * S * 4) * groups,
                        2 * calls, False),
                TorchOp("true-class column, unique/index_add rows, sparse grads", 0, 4 * nt * P * 4 * groups, 15,
                        False)],
    }


def _interleave_op(size: Size, dt) -> list[TorchOp]:
    """The gate-interleaved copy of w_rec that the fused forward cell kernel reads (16-bit operands), once per chain
    call: eagerly a fresh tensor, in a loop graph a refill of its static buffer."""
    if not KL._tile("fwd_cell", size.B, dt, KL.H100).fused:
        return []
    return [TorchOp("w_rec gate-interleaved copy (fused cell kernel)", 0, 2 * 4 * H * P * es(dt), 1, False)]


def loop_graph_ops(size: Size, dt) -> dict[str, list[TorchOp]]:
    """What a chain call adds around a loop-graph replay (``kernels/lstmp_graphs.py``): the refill of the static
    buffers, the replay's own launch, the clones of the returned tensors."""
    isz, nt, B = es(dt), size.B * size.T, size.B
    return {
        # (the fused kernel's interleaved copy of w_rec, refilled in a replay too, is torch_ops' lstmp/fwd entry,
        # which the sums add in both modes)
        "lstmp/fwd": [TorchOp("loop graph: refill x, bias, weights, states, lengths; replay; clone y, h_n, c_n", 0,
                              2 * ((4 * H * P + H * P + 4 * H) * isz + nt * P * isz + B * (2 * P + H) * 4)
                              + 2 * (nt * P * isz + B * (P + H) * 4), 12, False)],
        "lstmp/bwd": [TorchOp("loop graph: refill dy, dh_n, dc_n, c0; replay; clone dh0, dc0", 0,
                              2 * (nt * P * isz + 2 * B * (P + H) * 4) + 2 * B * (P + H) * 4, 7, False)],
    }


def scenario_sums(cases: list[Case]) -> list[dict]:
    """Estimated µs per LSTM step, per biLM forward and per training step, by dtype: as launched (no CUDA graph),
    and with the LSTMP time loops replayed from loop graphs (``*_graph_*``: their kernels without the per-launch
    overhead, plus ``loop_graph_ops``)."""
    by = {}
    for c in chosen(cases):
        by.setdefault((c.size, c.dtype, c.op, c.phase, c.variant), []).append(c)

    def kern(size, dt, op, phase, variant="", times=1, graph=False, l2=False, cal=False):
        return sum((calibrated_us(c, graph) if cal else estimate_us(c, l2, graph)) * (1 if c.once else times)
                   * c.repeat for c in by.get((size.name, dt, op, phase, variant), []))

    def loop_graph_us(size, dt, phase):
        return sum(o.estimate_us() for o in loop_graph_ops(size, dt)[f"lstmp/{phase}"])

    def chains_graph_us(size, dt, phases):  # the 4 chains' loops replayed from loop graphs, with the ops around
        return sum(kern(size, dt, "lstmp", ph, v, size.T, graph=True) + loop_graph_us(size, dt, ph)
                   for v in chains for ph in phases) + 4 * torch_us(size, dt, [f"lstmp/{ph}" for ph in phases])

    def torch_us(size, dt, keys):
        ops = torch_ops(size, dt)
        return sum(o.estimate_us() for k in keys for o in ops.get(k, []))

    chains = ["fwd", "fwd resid", "rev", "rev resid"]
    rows = []
    for size in SIZES:
        for dt in DTYPES:
            step = kern(size, dt, "lstmp", "fwd", "fwd")
            step_g = kern(size, dt, "lstmp", "fwd", "fwd", graph=True)
            step_l2 = kern(size, dt, "lstmp", "fwd", "fwd", graph=True, l2=True)
            row = dict(size=size.name, dtype=dt_name(dt), lstm_step_fwd_us=step, lstm_step_fwd_graph_us=step_g,
                       lstm_step_fwd_graph_l2_us=step_l2)
            # calibrated (bench/kernel_fit.py), loop graphs: a step's kernels, and one chain call with the
            # replay's own ops and the torch launches around the loop (cuBLAS GEMMs at the roofline)
            row["lstm_step_fwd_cal_us"] = kern(size, dt, "lstmp", "fwd", "fwd", graph=True, cal=True)
            if by.get((size.name, dt, "lstmp", "fwd", FUSED_REDUCE)):  # the reduce in the projection's last split
                row.update(fused_step_fwd_graph_us=kern(size, dt, "lstmp", "fwd", FUSED_REDUCE, graph=True),
                           fused_step_fwd_cal_us=kern(size, dt, "lstmp", "fwd", FUSED_REDUCE, graph=True, cal=True))
            row["chain_fwd_cal_us"] = (kern(size, dt, "lstmp", "fwd", "fwd", size.T, graph=True, cal=True)
                                       + loop_graph_us(size, dt, "fwd") + torch_us(size, dt, ["lstmp/fwd"]))
            if size.train:
                row["lstm_step_fwd_bwd_cal_us"] = row["lstm_step_fwd_cal_us"] + kern(
                    size, dt, "lstmp", "bwd", "fwd", graph=True, cal=True)
                row["chain_fwd_bwd_cal_us"] = row["chain_fwd_cal_us"] + (
                    kern(size, dt, "lstmp", "bwd", "fwd", size.T, graph=True, cal=True)
                    + loop_graph_us(size, dt, "bwd") + torch_us(size, dt, ["lstmp/bwd"]))
            if size.train:
                row["lstm_step_fwd_bwd_us"] = step + kern(size, dt, "lstmp", "bwd", "fwd")
                row["lstm_step_fwd_bwd_graph_us"] = step_g + kern(size, dt, "lstmp", "bwd", "fwd", graph=True)
                row["lstm_step_fwd_bwd_graph_l2_us"] = step_l2 + kern(size, dt, "lstmp", "bwd", "fwd", graph=True,
                                                                       l2=True)
            enc = (kern(size, dt, "char_cnn", "fwd") + N_HIGHWAY * kern(size, dt, "highway", "fwd")
                   + torch_us(size, dt, ["char_cnn/fwd", "highway/fwd"]))
            lstm = sum(kern(size, dt, "lstmp", "fwd", v, size.T) for v in chains) + 4 * torch_us(size, dt,
                                                                                               ["lstmp/fwd"])
            row["bilm_forward_us"] = enc + lstm
            # the same with the LSTMP time loops replayed from loop graphs (the encoder and the ops around as launched)
            row["bilm_forward_graph_us"] = enc + chains_graph_us(size, dt, ("fwd",))
            if size.train:
                enc_b = (kern(size, dt, "char_cnn", "bwd") + N_HIGHWAY * kern(size, dt, "highway", "bwd")
                         + torch_us(size, dt, ["char_cnn/bwd", "highway/bwd"]))
                lstm_b = sum(kern(size, dt, "lstmp", "bwd", v, size.T) for v in chains) + 4 * torch_us(
                    size, dt, ["lstmp/bwd"])
                soft = (kern(size, dt, "sampled_softmax", "fwd") + kern(size, dt, "sampled_softmax", "bwd")
                        + torch_us(size, dt, ["sampled_softmax/fwd", "sampled_softmax/bwd"]))
                if size.name == TOWERS_SIZE:
                    row["softmax_towers_us"] = (kern(size, dt, "sampled_softmax", "fwd", "towers")
                                                + kern(size, dt, "sampled_softmax", "bwd", "towers")
                                                + torch_us(size, dt, ["sampled_softmax towers/fwd",
                                                                      "sampled_softmax towers/bwd"]))
                    row["optimizer_towers_us"] = torch_us(size, dt, ["optimizer towers/step"])
                opt = torch_us(size, dt, ["optimizer/step"])
                drop = DROPOUT_SITES * (kern(size, dt, "dropout", "fwd") + kern(size, dt, "dropout", "bwd"))
                total = enc + lstm + enc_b + lstm_b + soft + opt + drop
                total_g = total - lstm - lstm_b + chains_graph_us(size, dt, ("fwd", "bwd"))
                cnn_det = kern(size, dt, "char_cnn", "bwd", "det") + torch_us(size, dt, ["char_cnn/bwd det"])
                cnn = kern(size, dt, "char_cnn", "bwd") + torch_us(size, dt, ["char_cnn/bwd"])
                row.update(encoder_fwd_bwd_us=enc + enc_b, lstm_fwd_bwd_us=lstm + lstm_b, softmax_us=soft,
                           dropout_us=drop, optimizer_us=opt, train_step_us=total,
                           train_tokens_per_s=size.B * size.T / (total * 1e-6),
                           train_step_det_us=total - cnn + cnn_det, train_step_graph_us=total_g,
                           train_tokens_per_s_graph=size.B * size.T / (total_g * 1e-6))
            rows.append(row)
    _original_config(rows)
    return rows


def _original_config(rows: list[dict]) -> None:
    """The original config's step on one GPU (``--config original``: 3 towers of 128 rows), with loop graphs, on
    the B=384 rows: the towers one after the other (3 x the B=128 step) and fused (``fuse_towers``: encoder and
    LSTMs over the 384 rows at once, every tower's two directions in one softmax call); either way one optimizer
    step over every tower's rows (``optimizer towers/step``: 6 sample sets)."""
    by = {(r["size"], r["dtype"]): r for r in rows}
    n = ORIGINAL_TOWERS  # 3 x 128 = the B=384 rows
    for (name, dt), big in by.items():
        small = by.get(("train B=128", dt))
        if name != TOWERS_SIZE or small is None or "train_step_graph_us" not in big:
            continue
        opt = big["optimizer_towers_us"]
        seq = n * (small["train_step_graph_us"] - small["optimizer_us"]) + opt
        fused = big["train_step_graph_us"] - big["softmax_us"] - big["optimizer_us"] + big["softmax_towers_us"] + opt
        size = next(z for z in SIZES if z.name == "train B=128")
        tokens = n * size.B * size.T
        big.update(towers_seq_graph_us=seq, towers_seq_tokens_per_s=tokens / (seq * 1e-6),
                   towers_fused_graph_us=fused, towers_fused_tokens_per_s=tokens / (fused * 1e-6))


def softmax_l2_table(cases: list[Case]) -> list[str]:
    """The sampled softmax's Triton kernels by their L2 traffic (``softmax_l2_bytes``) beside the roofline, at
    the training sizes."""
    md = ["## The sampled softmax's L2 traffic", "",
          "One direction's sampled softmax (N = B x T rows, S = 8192 samples, P = 512; the trainer runs both "
          "directions as two groups of one call, twice these bytes), its Triton kernels: the bytes their "
          "programs move through L2 (each logit tile's K loop reads its rows of H and of W) and that traffic at the "
          "L2 rate fitted to the LSTMP kernels for the operand class (bench/kernel_fit.py: "
          f"{kernel_fit.FIT['16bit']['bw_l2'] / 1e12:.2f} TB/s 16-bit, {kernel_fit.FIT['fp32']['bw_l2'] / 1e12:.2f} "
          "fp32; not fitted to these kernels: their time if they are bound the same way). Backward's two cuBLAS "
          "GEMMs are outside (`torch_ops`, at the roofline). The H200 measured the design before this one (dH and "
          "dW kernels that each recomputed the logits, 64 x 64 tiles: by the same count 11.6 GB at B=384 bf16, the "
          "forward 1.5 and each backward kernel 5.0, from that design's grids) at "
          f"{h200_softmax_ms():.2f} ms forward+backward, bf16, B=384 (gpu_h200_rows.jsonl, bench `softmax`, "
          f"provider triton, call 2): {11.58e9 / h200_softmax_ms() / 1e9:.1f} TB/s of this count, near the LSTMP "
          "rate. Its full-softmax forward (N=2,048, 64 x 128 tiles: 32 x 6,199 tiles, 39.0 GB by this count) took "
          f"{h200_softmax_ms('full_softmax_nll', 'fwd', 'N=2048,P=512,V=793471'):.2f} ms, "
          f"{39.0e9 / h200_softmax_ms('full_softmax_nll', 'fwd', 'N=2048,P=512,V=793471') / 1e9:.1f} TB/s: the rate "
          "is a kernel's, not the GPU's.", "",
          "| size | dtype | fwd L2 GB | bwd (dlogit) L2 GB | fwd+bwd roofline µs | fwd+bwd at the L2 rate µs |",
          "|---|---|---|---|---|---|"]
    for size in [s for s in SIZES if s.train]:
        for dt in DTYPES:
            rate = kernel_fit.FIT[kernel_fit.cls_of(dt_name(dt))]["bw_l2"]
            cs = [c for c in cases if c.op == "sampled_softmax" and c.size == size.name and c.dtype == dt
                  and c.choice == 0 and not c.variant]
            if not cs:
                continue
            per = 1 / next(c for c in cs if c.phase == "fwd").launch.grid[2]  # one direction: one group (the
            # forward's grid has them all; a backward that goes group after group has one a launch)
            fwd = sum(c.l2 * c.repeat for c in cs if c.phase == "fwd") * per
            bwd = sum(c.l2 * c.repeat for c in cs if c.phase == "bwd") * per
            est = sum(estimate_us(c, graph=True) * c.repeat for c in cs) * per
            md.append(f"| {size.name} | {dt_name(dt)} | {fwd / 1e9:.2f} | {bwd / 1e9:.2f} | {est:.0f} | "
                      f"{(fwd + bwd) / rate * 1e6:.0f} |")
    return md + [""]


# ------------------------------------------------------------------------------------------ output
COLUMNS = ["op", "phase", "size", "dtype", "kernel", "variant", "slot", "choice", "chosen", "config", "grid",
           "launches", "programs", "regs", "spill_st", "spill_ld", "stack", "smem", "warps", "stages", "blocks_per_sm",
           "hgmma", "hmma", "ldgsts", "tma", "local", "atom", "membar_gpu", "gflop", "mbytes", "est_us", "cal_gpu_us",
           "violations", "variant_id", "compile_s"]
_CONFIG_KEYS = ("BLOCK", "BB", "BH", "BP", "BK", "GROUP", "KWC", "SPLIT", "FUSED", "STATIONARY", "PK", "num_")


def row_of(c: Case, picked: bool) -> dict:
    st = c.stats
    cfg = " ".join(f"{k}={v}" for k, v in c.launch.meta.items() if k.startswith(_CONFIG_KEYS))
    r = dict(op=c.op, phase=c.phase, size=c.size, dtype=dt_name(c.dtype), kernel=c.kernel, variant=c.variant,
             label=c.label + ("" if picked else " (candidate)"), slot=c.slot, choice=c.choice,
             chosen=int(picked), config=cfg, grid="x".join(map(str, c.launch.grid)), launches=c.repeat,
             programs=c.programs,
             gflop=round(c.flops / 1e9, 3), mbytes=round(c.bytes / 2**20, 2), variant_id=st.get("variant_id"),
             violations="; ".join(violations(c)))
    if "error" not in st:
        r.update({k: st[k] for k in ("regs", "spill_st", "spill_ld", "stack", "smem", "warps", "stages", "hgmma",
                                     "hmma", "ldgsts", "tma", "local", "atom", "membar_gpu")},
                 blocks_per_sm=occupancy(st), est_us=round(estimate_us(c), 2), compile_s=round(st["compile_s"], 1))
        cal = calibrated_gpu_us(c)
        r["cal_gpu_us"] = "" if cal is None else round(cal, 2)
    return r


def prewait_bytes(c: Case) -> int:
    """What a PDL build loads before its wait: a stationary tile's weight slice, over its grid (kernels/lstmp.py
    ``_pdl_wait``); nothing in any other kernel."""
    if not c.launch.meta.get("PDL") or not c.launch.meta.get("STATIONARY"):
        return 0
    return (P * 4 * H if c.kernel == "_fwd_cell_kernel" else H * P) * es(c.dtype)


def pdl_table(cases: list[Case]) -> list[str]:
    """The PDL builds (``PDL``) beside the default ones: registers, spills, shared memory, the wait in the PTX, and
    the bytes loaded ahead of it."""
    pdl = [c for c in cases if c.op == "lstmp" and c.variant == PDL and "error" not in c.stats]
    if not pdl:
        return []
    base = {(c.size, c.dtype, c.phase, c.kernel, c.once): c for c in cases
            if c.op == "lstmp" and c.variant == "fwd" and "error" not in c.stats}
    md = ["Programmatic dependent launch (`launch_plan(pdl=True)`; opt-in, "
          f"`{KL.PDL_ENV}=1`, until a GPU has timed it: bench_lstmp's `triton-pdl`, bench_bilm's `+pdl`, bench_train's "
          "`elmo_fast-pdl`): every launch of a time loop but its first carries the PDL attribute, and each kernel lets "
          "the next launch of its stream start, then waits for the one before (`griddepcontrol`). The graph-replayed "
          "launch gap (2.6 µs on the H200) and, in a stationary tile, the weight's load can then overlap the kernel "
          "before it; the model prices neither. With PDL the 16-bit forward cell of batches up to 16 takes a "
          "stationary tile (`PDL_TUNED`) for that reason: at infer B=1 the two columns of registers are two tiles. "
          "The PDL builds beside the default ones:", "",
          "| size | dtype | phase | kernel | regs: default / PDL | spill st/ld (PDL) | smem B (PDL) | "
          "griddepcontrol.wait | loaded before the wait, MiB a step |", "|---|---|---|---|---|---|---|---|---|"]
    for c in pdl:
        b, st = base.get((c.size, c.dtype, c.phase, c.kernel, c.once)), c.stats
        md.append(f"| {c.size} | {dt_name(c.dtype)} | {c.phase} | {c.kernel}{' (once a call)' if c.once else ''} | "
                  f"{b.stats['regs'] if b else '?'} / {st['regs']} | {st['spill_st']}/{st['spill_ld']} | "
                  f"{st['smem']} | {st['ptx_gdc_wait']} | {prewait_bytes(c) / 2**20:.1f} |")
    return md + [""]


def write_report(cases: list[Case], out_dir: Path, seconds: float, jobs: int, subset: bool) -> tuple[Path, Path]:
    env = common.environment()
    n_var = len({c.stats["variant_id"] for c in cases})
    picked = {id(c) for c in chosen(cases)}
    rows = [row_of(c, id(c) in picked) for c in cases]
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "kernel_report.csv"
    with open(csv_path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS + ["target", "compiled_on", "date", "triton", "torch", "commit",
                                                     "command"], extrasaction="ignore")
        w.writeheader()
        where = dict(target="sm_90a (H100 model): compiled, no GPU ran it", compiled_on=env["device"])
        w.writerows({**r, **env, **where} for r in rows)
    md = [f"# Kernel report{' (CI subset)' if subset else ''}: elmo_fast Triton kernels compiled for an H100 "
          "(sm_90a), no GPU",
          "",
          f"Commit `{env['commit']}`, triton {env['triton']}, torch {env['torch']}, {env['date']}. Command: "
          f"`{env['command']}`. Compiled on {env['device']}: {n_var} distinct variants ({len(cases)} launches of "
          f"the workload) in {seconds:.0f} s with {jobs} processes. Nothing here ran on a GPU: every time below "
          "is an estimate.",
          "",
          "Model (bench/kernel_report.py): per launch `max(max(bytes / 3.35 TB/s, FLOPs / peak) / busy, 42 µs)` "
          "launched eagerly, `+ 2.6 µs` instead of the max when replayed from a CUDA graph (launch terms measured on "
          "an H200, 2026-11-26: bench/results/gpu_h200.md, where the kernels themselves ran at 2-4x this model), peak "
          "990 TFLOP/s when the SASS has tensor-core instructions (HGMMA/HMMA) else 67 TFLOP/s, `busy` = share of "
          "the 132 SMs the grid keeps busy; bytes = compulsory HBM traffic + atomic reduction traffic; FLOPs as "
          f"executed (padded tiles included); char-CNN position loops of {MEAN_WINDOWS} windows. Token encoder "
          "over every position (no deduplication). Rules: no spill in bf16, none in fp32 up to B=128; "
          "tensor-core instructions in every bf16 GEMM-like kernel; >= 132 programs at B >= 128; async "
          "(pipelined) loads in every kernel; no GPU-scope memory barrier (MEMBAR.*.GPU, what an acq_rel atomic "
          "costs) outside the kernels that order memory on purpose.",
          ""]
    sums = scenario_sums(cases) if not subset else []
    if sums:
        md += ["## Sums (estimated µs, no CUDA graph)", "",
               "| size | dtype | LSTM step fwd | LSTM step fwd+bwd | biLM forward | train: encoder | train: LSTMs | "
               "train: softmax | train: dropout | train: optimizer | training step | tokens/s | deterministic training "
               "step |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        def cell(s, k, fmt="{:.0f}"):
            return fmt.format(s[k]) if k in s else ""

        for s in sums:
            md.append("| " + " | ".join([s["size"], s["dtype"], cell(s, "lstm_step_fwd_us", "{:.1f}"),
                                         cell(s, "lstm_step_fwd_bwd_us", "{:.1f}")]
                                        + [cell(s, k) for k in ("bilm_forward_us", "encoder_fwd_bwd_us",
                                                                "lstm_fwd_bwd_us", "softmax_us", "dropout_us",
                                                                "optimizer_us",
                                                                "train_step_us")]
                                        + [cell(s, "train_tokens_per_s", "{:,.0f}"), cell(s, "train_step_det_us")])
                      + " |")
        md += ["", "biLM forward = token encoder + 4 chains x T steps (+ the torch launches around them); training "
               "step = encoder, 4 chains and the sampled softmax of both directions (one call: two groups) forward and "
               f"backward, the {DROPOUT_SITES} dropout sites (each one hashed-dropout launch forward and one backward, "
               "eager: their launch term binds), sampler, optimizer. "
               "Under bf16 autocast the trainer feeds the softmax bf16 rows (its bf16 variant, fp32 sums). "
               "Deterministic training step: the same with the char-CNN backward of deterministic mode (variant "
               "'det'; torch's deterministic algorithms and the untuned launch configurations not modelled).",
               ""]
        md += ["With loop graphs (`kernels/lstmp_graphs.py`, on by default on a GPU: each chain's forward and "
               "backward time loops replay from a CUDA graph from the second call of a shape on):", "",
               "| size | dtype | LSTM step fwd | LSTM step fwd+bwd | same, partials in L2: fwd | fwd+bwd | "
               "biLM forward | training step | tokens/s |",
               "|---|---|---|---|---|---|---|---|---|"]
        md += ["| " + " | ".join([s["size"], s["dtype"], cell(s, "lstm_step_fwd_graph_us", "{:.1f}"),
                                  cell(s, "lstm_step_fwd_bwd_graph_us", "{:.1f}"),
                                  cell(s, "lstm_step_fwd_graph_l2_us", "{:.1f}"),
                                  cell(s, "lstm_step_fwd_bwd_graph_l2_us", "{:.1f}"), cell(s, "bilm_forward_graph_us"),
                                  cell(s, "train_step_graph_us"),
                                  cell(s, "train_tokens_per_s_graph", "{:,.0f}")]) + " |" for s in sums]
        md += ["", "Loop-graph rows: the LSTMP kernels of the time loops at 2.6 µs a launch, plus per chain "
               "call the replay's launch, the refill of the graph's static buffers (weights, x, states, lengths, dy) "
               "and the clones of what it returns (`loop_graph_ops`). The split-K partials (8.7 MB forward, 17.3 MB "
               "backward per step at B=384) are written and read back within a step: counted as HBM traffic (the "
               "upper bound, every other column) or as L2 traffic, not in the HBM term (the 'partials in L2' "
               "columns: the lower bound; an H100 has 50 MB of L2). The training step and tokens/s use the upper "
               "bound.", ""]
        one = next((s for s in sums if s["size"] == "infer B=1" and s["dtype"] == "bf16"), None)
        if one is not None:
            md += ["The biLM forward column: the four chains' loops replayed, the token encoder and the ops around "
                   f"the loops as launched (eager). One sentence (infer B=1, bf16): {one['bilm_forward_graph_us']:.0f}"
                   " µs, against performance.md's single-sentence target of 1 ms on an H100. The H200 measured "
                   "1.044 ms with the whole forward in one CUDA graph (`auto+graph`, 2026-11-26, gpu_h200.md), "
                   "which this table does not model (every launch of the encoder there at the graph's 2.6 µs).", ""]
        fused = [s for s in sums if "fused_step_fwd_graph_us" in s]
        if fused:
            md += ["The forward's reduce in the projection's last split (`launch_plan(fuse_reduce=True)`, "
                   "`_splitk_out_kernel`: two launches a forward step; opt-in, "
                   f"`{KL.FUSED_REDUCE_ENV}=16`, until a GPU has run it: bench_bilm's `auto+graph+fusedreduce`), a "
                   "forward step with loop graphs against the three launches', and the four chains' change to a biLM "
                   "forward (T steps each):", "",
                   "| size | dtype | 3 launches: step µs | fused reduce | calibrated: 3 launches | fused reduce | "
                   "biLM forward change µs (roofline / calibrated) |", "|---|---|---|---|---|---|---|"]
            for r in fused:
                T_ = next(z.T for z in SIZES if z.name == r["size"])
                d, dc = (r["fused_step_fwd_graph_us"] - r["lstm_step_fwd_graph_us"],
                         r["fused_step_fwd_cal_us"] - r["lstm_step_fwd_cal_us"])
                md.append(f"| {r['size']} | {r['dtype']} | {r['lstm_step_fwd_graph_us']:.1f} | "
                          f"{r['fused_step_fwd_graph_us']:.1f} | {r['lstm_step_fwd_cal_us']:.1f} | "
                          f"{r['fused_step_fwd_cal_us']:.1f} | {4 * T_ * d:+.0f} / {4 * T_ * dc:+.0f} |")
            md += ["", "The last split's tail (a ticket at L2, the partials read back, the epilogue) is counted as "
                   "bytes only (the partials twice); what the model saves is the reduce launch's 2.6 µs and its own "
                   "time.", ""]
        md += pdl_table(cases)
        orig = [s for s in sums if "towers_fused_graph_us" in s]
        if orig:
            md += [f"The original config on one GPU (`--config original`: {ORIGINAL_TOWERS} towers of 128 rows, 384 "
                   "a step), loop graphs, the upper bound: its towers one after the other (each a B=128 step; one "
                   "optimizer step) or fused in one pass (`fuse_towers`, the GPU default: token encoder and LSTMs "
                   "over the 384 rows, each tower's sampled softmax over its own 128 rows with its own samples, every "
                   "tower's two directions in one call: six groups):", "",
                   "| dtype | towers one after the other µs | tokens/s | fused µs | tokens/s |",
                   "|---|---|---|---|---|"]
            md += [f"| {s['dtype']} | {s['towers_seq_graph_us']:.0f} | {s['towers_seq_tokens_per_s']:,.0f} | "
                   f"{s['towers_fused_graph_us']:.0f} | {s['towers_fused_tokens_per_s']:,.0f} |" for s in orig]
            md += [""]
        md += ["## The LSTMP chain under the calibrated model", "",
               "`bench/kernel_fit.py`: the LSTMP kernels' L2 traffic, compulsory bytes and FLOPs at rates fitted to "
               "the H200's per-kernel timings (bench/results/kernel_fit.md: 16-bit within x1.2 of the timed launches "
               "rms, fp32 within x1.45; the roofline above was 2-12x short), loop graphs on, the ops around the loop "
               "(cuBLAS GEMMs, the replay's refill) at the roofline. Beside it, what one NVIDIA H200 measured on "
               "2026-11-26 (torch 2.11.0+cu130, triton 3.6.0, CUDA 13.0; gpu_h200_rows.jsonl, bench `lstmp`, "
               "`python3 bench/bench_lstmp.py`, call 1, the code of c17f5ba: before the backward cell kernel's wider "
               "tiles) and cuDNN's `nn.LSTM(512, 4096, proj_size=512)` in the same run. One chain = 20 steps, "
               "one layer, one direction.", "",
               "| size | dtype | step fwd µs | step fwd+bwd µs | chain fwd ms | chain fwd+bwd ms | H200 chain fwd | "
               "fwd+bwd | cuDNN fwd | fwd+bwd | fwd+bwd: calibrated / cuDNN |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        chains = h200_chain_ms()
        for srow in sums:
            if "chain_fwd_bwd_cal_us" not in srow:
                continue
            meas = chains.get((srow["size"], srow["dtype"]), ("",) * 4)
            ratio = (f"{srow['chain_fwd_bwd_cal_us'] / 1e3 / meas[3]:.2f}" if meas[3] else "")
            md.append("| " + " | ".join([srow["size"], srow["dtype"], f"{srow['lstm_step_fwd_cal_us']:.1f}",
                                         f"{srow['lstm_step_fwd_bwd_cal_us']:.1f}",
                                         f"{srow['chain_fwd_cal_us'] / 1e3:.3f}",
                                         f"{srow['chain_fwd_bwd_cal_us'] / 1e3:.3f}", *map(str, meas), ratio]) + " |")
        md += [""]
        md += softmax_l2_table(cases)
    bad = [r for r in rows if r["violations"]]
    md += ["## Rule violations", ""]
    pending = [r for r in bad if r["op"] in PENDING]
    own = [r for r in bad if r["op"] not in PENDING]
    md += [f"- {r['op']} {r['label']} [{r['size']} {r['dtype']}, {r['phase']}]: {r['violations']}"
           for r in own] or (["- none outside the pending ops"] if PENDING else ["- none"])
    for op, why in PENDING.items():
        n = sum(r["op"] == op for r in pending)
        md.append(f"- {op}: {n} variants break a rule; {why}.")
    md += [""] + [f"- {k}: {v}" for k, v in {**FEW_PROGRAMS_OK, **NO_K_LOOP, **NOTES}.items()]
    stationary = sorted({c.kernel for c in cases if c.launch.meta.get("STATIONARY")})
    if stationary:
        md.append(f"- {', '.join(stationary)} with STATIONARY=True (the programs and async-load rules): "
                  f"{KL.STATIONARY_EXEMPT}")
    md += ["", "## Variants", "",
           "Every launch of the workload, from the launchers' own configuration functions; '(candidate)' marks an "
           "autotune candidate the model does not pick (the runtime times them on a GPU). 'est µs': the roofline as "
           "launched eagerly; 'calibrated GPU µs': an LSTMP kernel's GPU time under bench/kernel_fit.py's model (no "
           "launch term).", "",
           "| op | phase | size | dtype | kernel | config | grid | regs | spill st/ld | stack | smem | w | st | "
           "blk/SM | HGMMA | HMMA | LDGSTS | TMA | local | GFLOP | MiB | est µs | calibrated GPU µs |",
           "|" + "---|" * 23]
    for r in rows:
        if "regs" not in r:
            md.append(f"| {r['op']} | {r['phase']} | {r['size']} | {r['dtype']} | {r['label']} | "
                      f"{r['config']} | {r['grid']} | {r['violations']} |" + " |" * 15)
            continue
        md.append(f"| {r['op']} | {r['phase']} | {r['size']} | {r['dtype']} | {r['label']} | "
                  f"{r['config']} | {r['grid']} | {r['regs']} | {r['spill_st']}/{r['spill_ld']} | {r['stack']} | "
                  f"{r['smem']} | {r['warps']} | {r['stages']} | {r['blocks_per_sm']} | {r['hgmma']} | {r['hmma']} | "
                  f"{r['ldgsts']} | {r['tma']} | {r['local']} | {r['gflop']} | {r['mbytes']} | {r['est_us']} | "
                  f"{r.get('cal_gpu_us', '')} |")
    md_path = out_dir / "kernel_report.md"
    md_path.write_text("\n".join(md) + "\n")
    return md_path, csv_path


def subset_cases() -> list[Case]:
    """CI: the first variant of every kernel function (training B=128, bf16: forward and backward of all ops; then
    inference B=1 for a kernel only it launches: the fused reduce)."""
    seen, out = set(), []
    for c in workload_cases([s for s in SIZES if s.name in ("train B=128", "infer B=1")], [BF16]):
        if c.kernel not in seen:
            seen.add(c.kernel)
            out.append(c)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subset", action="store_true", help="one variant per kernel function (CI)")
    ap.add_argument("--out", default=str(common.RESULTS), help="directory for kernel_report.md/.csv")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    ap.add_argument("--check", action="store_true", help="exit 1 when a rule is broken outside the pending ops")
    ap.add_argument("--only", nargs="*", default=[],
                    help="keep the cases whose 'op kernel variant size dtype' contains every one of these words")
    ap.add_argument("--warm-cache", action="store_true",
                    help="compile into triton's own cache (TRITON_CACHE_DIR, else ~/.triton/cache) instead of a fresh "
                    "temporary one, for later JIT launches to find (gpu-check's precompile); variants already there "
                    "are not compiled again and have no register counts")
    a = ap.parse_args(argv)
    cases = subset_cases() if a.subset else workload_cases()
    cases = [c for c in cases if all(w in f"{c.op} {c.label} {c.size} {dt_name(c.dtype)}" for w in a.only)]
    seconds = compile_all(cases, a.jobs, warm=a.warm_cache)
    md, csv_path = write_report(cases, Path(a.out), seconds, a.jobs, a.subset)
    errors = [c for c in cases if "error" in c.stats]
    broken = [c for c in cases if c.op not in PENDING and violations(c)]
    print(f"{len(cases)} launches, {len({c.stats['variant_id'] for c in cases})} variants compiled in "
          f"{seconds:.0f} s; {len(errors)} compile errors, {len(broken)} rule violations outside pending ops; "
          f"wrote {md} and {csv_path}")
    for c in errors:
        print(f"compile error: {c.label} [{c.size} {dt_name(c.dtype)}]: {c.stats['error']}")
    return 1 if errors or (a.check and broken) else 0


if __name__ == "__main__":
    sys.exit(main())
