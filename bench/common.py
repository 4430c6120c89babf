"""Shared benchmark plumbing: environment facts for every result row, CSV appends, best-of-N timing on the CPU,
timing on GPU.

Where rows go (``append_rows``): ``$ELMO_FAST_BENCH_DIR`` when set; else, with ``ELMO_FAST_BENCH_RECORD=1``,
bench/results/ (the committed record: set it only to add measured rows to it); else the scratch folder
build/bench/ (ignored by git), so that ``make bench`` and smoke runs never change committed results.
``ELMO_FAST_BENCH_ROUNDS`` sets the timed rounds of the pytest-benchmark CPU benchmarks that read it.
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SCRATCH = ROOT / "build" / "bench"


def results_dir() -> Path:
    """The folder ``append_rows`` writes to by default (see the module docstring)."""
    if os.environ.get("ELMO_FAST_BENCH_DIR"):
        return Path(os.environ["ELMO_FAST_BENCH_DIR"])
    record = os.environ.get("ELMO_FAST_BENCH_RECORD", "0").strip()
    if record not in ("0", "1"):
        raise ValueError(f"ELMO_FAST_BENCH_RECORD={record!r}: expected 1 (append to bench/results/) or 0 (unset: "
                         f"append to {SCRATCH})")
    return RESULTS if record == "1" else SCRATCH


def env_rounds(default: int) -> int:
    """Timed rounds: ``$ELMO_FAST_BENCH_ROUNDS`` (a positive integer) or ``default``."""
    value = os.environ.get("ELMO_FAST_BENCH_ROUNDS", str(default))
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"ELMO_FAST_BENCH_ROUNDS={value!r}: expected a positive integer")
    return int(value)


def keep_going(exc: BaseException, dev, force: bool = False) -> str:
    """After a benchmark provider raised ``exc`` on ``dev``: where the run may go on with the next provider, the
    error text for that provider's row (the traceback printed, the failed provider's memory released); else
    ``exc`` raised again. It goes on only on CUDA (the CPU smoke runs hide nothing; ``force``: on any device, for
    tests) and only while the device still answers: after an illegal memory access every later provider would fail
    too, and be blamed."""
    cuda = torch.device(dev).type == "cuda"
    if not (cuda or force):
        raise exc
    import gc
    import traceback

    traceback.print_exception(exc)
    if cuda:
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a broken context: stop here, with the first error
            raise exc from None
        gc.collect()
        torch.cuda.empty_cache()
    return f"{type(exc).__name__}: {exc}"[:300]


def comma_list(flag: str, text: str | None, allowed) -> tuple | None:
    """A ``--flag a,b`` argument as a tuple, each value one of ``allowed`` (None: the flag not given). Raises
    ValueError naming the flag and what it takes: a short GPU lease cannot lose a step to a typo."""
    if text is None:
        return None
    vals = tuple(v for v in text.split(",") if v)
    if not vals or any(v not in allowed for v in vals) or len(set(vals)) < len(vals):
        raise ValueError(f"{flag} {text!r}: expected a comma-separated list of {', '.join(allowed)}, each once")
    return vals


@contextlib.contextmanager
def env_var(name: str, value: str | None):
    """``os.environ[name] = value`` inside the block (``None``: left as it is), restored after it."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def parse_variants(specs) -> list[tuple[str, str]]:
    """``--variant NAME=VALUE`` arguments -> [(NAME, VALUE)]: an extra elmo_fast provider that runs with the
    environment variable NAME set to VALUE around each of its calls, timed in turn with the others (a same-run A/B
    of a switch such as ELMO_FAST_CPU_TRAIN_PACK=0)."""
    out = []
    for spec in specs or ():
        name, sep, value = spec.partition("=")
        if not sep or not name.startswith("ELMO_FAST_"):
            raise ValueError(f"--variant {spec!r}: expected NAME=VALUE with an ELMO_FAST_* variable, e.g. "
                             "ELMO_FAST_CPU_TRAIN_PACK=0")
        out.append((name, value))
    return out


_PDL_LAST: dict = {}  # with_pdl's last call: its k_loop


def with_pdl(fn, k_loop: bool = False):
    """``fn`` with ELMO_FAST_LSTMP_PDL=1 around each call (programmatic dependent launch in the LSTMP time loops);
    ``k_loop``: with ``kernels/lstmp.PDL_TUNED`` emptied as well, so that the plans keep TUNED's tiles and PDL's own
    share shows apart from its small-batch tile's. Loop graphs are keyed by the setting, not by the tiles: where a
    call's ``k_loop`` differs from the last one's, the loop-graph pool is emptied first, so that neither variant
    replays the other's plan."""
    from elmo_fast.kernels import lstmp as KL

    def call(*args, **kwargs):
        if _PDL_LAST.get("k_loop", k_loop) != k_loop:
            KL.graphs.POOL.clear()
        _PDL_LAST["k_loop"] = k_loop
        saved = dict(KL.PDL_TUNED)
        if k_loop:
            KL.PDL_TUNED.clear()
        try:
            with env_var(KL.PDL_ENV, "1"):
                return fn(*args, **kwargs)
        finally:
            KL.PDL_TUNED.update(saved)
    return call


def with_env(fn, name: str, value: str):
    """``fn`` called with os.environ[name] = value (restored after each call).

    An A/B through it sees only what the variable changes while ``fn`` runs: a setting read once per process
    (``ELMO_FAST_CPU_ONEDNN``) does not change, nor does one applied when a weight is packed into a cache that the
    variants share (a module's packed weights), unless the cache's key holds it (``ELMO_FAST_CPU_PANELS`` does);
    compare two modules or two processes for those."""
    def call(*args, **kwargs):
        with env_var(name, value):
            return fn(*args, **kwargs)
    return call


def loop_graphs(on: bool, device: torch.device):
    """LSTMP loop graphs on (CUDA graphs on a GPU, their recorded stand-in on the CPU) or off inside the block."""
    return env_var("ELMO_FAST_LOOP_GRAPHS", ("1" if device.type == "cuda" else "record") if on else "0")


def git_commit() -> str:
    """Short HEAD, with ``-dirty`` when the tree has uncommitted changes to the code."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kernels", "elmo_fast", "csrc"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (head or "unknown") + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - a row without a commit is still a row
        return "unknown"


def versions() -> dict[str, str]:
    """torch, triton and CUDA versions (``"none"`` where triton is not importable or torch has no CUDA)."""
    try:
        import triton

        triton_v = triton.__version__
    except Exception:  # noqa: BLE001
        triton_v = "none"
    return {"torch": torch.__version__, "triton": triton_v, "cuda": torch.version.cuda or "none"}


_ISA = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"))


def cpu_name() -> str:
    """The CPU's model name and the vector extensions that decide its speed (from /proc/cpuinfo where there is
    one), e.g. "Intel(R) Xeon(R) Processor (x86_64; AVX2, AVX-512, AVX512-BF16, AMX-BF16)"."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    isa = ", ".join(name for flag, name in _ISA if flag in flags)
    arch = platform.machine()
    return f"{model or platform.processor() or arch} ({arch}{'; ' + isa if isa else ''})"


def environment() -> dict[str, str]:
    """Device, versions, commit and command: what every committed result must carry."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"cpu: {cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        **versions(),
        "commit": git_commit(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


def report_rows(name: str, rows: list[dict], line, fields: list[str] | None = None,
                path: str | os.PathLike | None = None) -> Path:
    """Print ``line(row)`` for every row, then append the rows to the ``name`` table (:func:`append_rows`) and say
    where they went: what every benchmark's ``report`` does."""
    for r in rows:
        print(line(r), flush=True)
    out = append_rows(name, rows, fields, path)
    print(f"appended to {out}")
    return out


def append_rows(name: str, rows: list[dict], fields: list[str] | None = None,
                path: str | os.PathLike | None = None) -> Path:
    """Append rows to ``path`` (default ``<results_dir()>/<name>.csv``: see the module docstring). Each row is
    completed with ``environment()``; keys the row already has win. Columns: ``fields`` when given (keys outside
    it are dropped), else the first row's keys. A file written before with other columns is rewritten with the
    union of both (its columns first; empty where a row has no value), so no value lands under another column."""
    path = Path(path) if path else results_dir() / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    rows = [{**r, **{k: v for k, v in env.items() if k not in r}} for r in rows]
    fields = list(fields or rows[0].keys())
    old: list[dict] = []
    if path.exists():
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            header = list(reader.fieldnames or [])
            extra = [f for f in fields if f not in header]
            if extra:  # new columns: the old rows are rewritten under the union of both
                old = list(reader)
            fields = header + extra
    if old or not path.exists():  # a new file, or the old rows under the new columns: whole, then renamed over
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(old + rows)
        os.replace(tmp, path)
    else:
        with open(path, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore").writerows(rows)
    return path


def append_rows_or_say(name: str, rows: list[dict]) -> None:
    """``append_rows`` where the rows were printed already: a failure to write the CSV is said, not raised (the
    numbers are in the log; the CSV is a bonus)."""
    try:
        append_rows(name, rows)
    except Exception as exc:  # noqa: BLE001
        print(f"(not appended to CSV: {exc})")


def best_times(fns: dict, rounds: int, warmup: int = 1, calls: int = 1) -> dict:
    """Best-of-``rounds`` wall-clock seconds per call for each callable of ``fns`` (name -> callable): ``warmup``
    calls of each first, then ``rounds`` rounds in which the callables run in turn, ``calls`` calls each (a round's
    time is their mean). The best round is the least disturbed one on a shared machine."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, math.inf)
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return best


def gpu_time_ms(fn, warmup_ms: int = 50, rep_ms: int = 300, grad_to_none=None) -> tuple[float, float, float]:
    """Median, p20, p80 in ms with CUDA events (triton.testing.do_bench; ``grad_to_none``: tensors whose
    ``.grad`` is reset between repetitions)."""
    from triton.testing import do_bench

    p50, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8], grad_to_none=grad_to_none)
    return p50, p20, p80


def time_ms(fn, device: torch.device, reps: int = 5) -> tuple[float, float, float]:
    """(p50, p20, p80) ms: CUDA events on a GPU (:func:`gpu_time_ms`); on the CPU a plain clock over ``reps``
    calls after one warm-up, none with ``reps=1`` (for the smoke runs of the GPU benchmarks, where one call shows
    that the path runs: not for numbers to report)."""
    if torch.device(device).type == "cuda":
        return gpu_time_ms(fn)
    if reps > 1:
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    times.sort()
    return tuple(times[min(reps - 1, int(q * reps))] for q in (0.5, 0.2, 0.8))


def peak_memory_mib(fn) -> float:
    """Peak device memory (MiB) that ``fn`` allocates beyond what was allocated before; NaN off CUDA, where ``fn``
    is not called (a smoke run has nothing to read and need not pay for a second call)."""
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def op_profile(fn, steps: int = 2, top: int = 25) -> list[dict]:
    """Where ``fn``'s time goes: ``steps`` calls under torch.profiler (CPU), grouped by op and input shapes, the
    ``top`` rows by self time, as per-call figures (self ms per call of ``fn``, op calls per call of ``fn``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            fn()
    rows = [{"op": e.key, "shapes": str(e.input_shapes), "self_ms": e.self_cpu_time_total / 1000.0 / steps,
             "calls": e.count / steps} for e in prof.key_averages(group_by_input_shape=True)]
    rows.sort(key=lambda r: -r["self_ms"])
    total = sum(r["self_ms"] for r in rows)
    for r in rows:
        r["share"] = r["self_ms"] / total if total else 0.0
    return rows[:top]


# Launch terms of the compile-time models (bench/kernel_report.py, bench/lstmp_compile.py), measured on an H200
# (bench/results/gpu_h200.md, 2026-11-26; 3 µs per eager launch and 0 in a graph were assumed before). An eager
# Triton launch costs ~42 µs of host time (the B=1 bf16 chain: 2.533 ms for its ~60 launches), which overlaps the
# GPU work of the kernels before it: an eager launch costs max(kernel, 42 µs). A kernel replayed from a CUDA graph
# costs 2.6 µs on top of its roofline time (the B=1 graph chain: 14.0 µs a step against 6.3 µs of roofline for its
# three kernels). Torch's own launches (cuBLAS, elementwise) were not measured: 3 µs each.
EAGER_LAUNCH_US = 42.0
GRAPH_LAUNCH_US = 2.6
TORCH_LAUNCH_US = 3.0


def launched_us(gpu_us: float, graph: bool) -> float:
    """A kernel's time as launched: ``gpu_us`` of GPU work from a CUDA graph, or eagerly behind the host."""
    return gpu_us + GRAPH_LAUNCH_US if graph else max(gpu_us, EAGER_LAUNCH_US)


def device_profile(fn, steps: int = 2, top: int = 20, trace: str | None = None) -> dict:
    """Where a GPU call's time goes: ``steps`` calls of ``fn`` under torch.profiler (CPU and, with CUDA, the device).
    Returns per call: ``wall_ms``; ``kernel_ms``, the device time of every kernel (CUDA-graph replays included);
    ``busy`` = kernel_ms / wall_ms (well under 1: the host, not the GPU, sets the pace); ``kernels``, the ``top``
    kernels by device time (name, ms, launches); ``host_ops``, the ``top`` CPU ops by self time (name, ms, calls);
    ``phases``, the training step's named ranges in the order of ``PHASES``: (name, host ms inside the range, device
    ms of the kernels launched inside it, device span ms of its GPU-side annotation, entries). On the CPU the device
    columns are 0. User annotations (these ranges' GPU side and any other) are not kernels: never summed as such.
    ``trace``: also write the profile as a gzipped Chrome trace there (chrome://tracing, ui.perfetto.dev): the
    timeline, gaps included."""
    from torch.profiler import ProfilerActivity, profile

    from elmo_fast.training.trainer import PHASE_PREFIX, PHASES

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0) / steps
    kernels, host, phases = [], [], {}
    for e in prof.key_averages():
        on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
        if e.key.startswith(PHASE_PREFIX):  # a range, not a kernel or an op: its totals hold its children's
            ph = phases.setdefault(e.key[len(PHASE_PREFIX):], [0.0, 0.0, 0.0, 0.0])
            if on_device:  # the range's GPU-side annotation: from its first kernel's start to its last's end
                ph[2] += getattr(e, "device_time_total", 0) / 1e3 / steps
            else:
                ph[0] += e.cpu_time_total / 1e3 / steps
                ph[1] += getattr(e, "device_time_total", 0) / 1e3 / steps
                ph[3] += e.count / steps
        elif getattr(e, "is_user_annotation", False):
            continue
        elif on_device:
            kernels.append((e.key, getattr(e, "self_device_time_total", 0) / 1e3 / steps, e.count / steps))
        else:
            host.append((e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps))
    kernels.sort(key=lambda k: -k[1])
    host.sort(key=lambda k: -k[1])
    kernel_ms = sum(k[1] for k in kernels)
    order = {n: i for i, n in enumerate(PHASES)}
    if trace:
        _write_trace(prof, trace)
    return {"wall_ms": wall, "kernel_ms": kernel_ms, "busy": kernel_ms / wall if wall else 0.0,
            "kernels": kernels[:top], "host_ops": host[:top],
            "phases": [(n, *v) for n, v in sorted(phases.items(), key=lambda kv: order.get(kv[0], len(order)))]}


def _write_trace(prof, path: str) -> None:
    """``prof``'s Chrome trace at ``path`` (torch gzips it for a ``.gz`` path)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(path)


def print_device_profile(name: str, prof: dict) -> None:
    print(f"\n{name}: {prof['wall_ms']:.2f} ms a call, {prof['kernel_ms']:.2f} ms of it in kernels "
          f"(busy {100 * prof['busy']:.0f}%)")
    if prof.get("phases"):
        print(f"  {'phases (ms: host inside the range, its kernels, its device span)':<80} {'host':>8} "
              f"{'kernels':>8} {'span':>8} {'calls':>7}")
        for key, host_ms, kern_ms, span_ms, n in prof["phases"]:
            print(f"    {key:<78} {host_ms:8.3f} {kern_ms:8.3f} {span_ms:8.3f} {n:7.1f}")
        rest = prof["kernel_ms"] - sum(ph[2] for ph in prof["phases"])
        # on a GPU the backward's kernels are launched from autograd's device thread, outside the main thread's
        # ranges: they land here, not in "backward" (whose host time is right)
        print(f"    {'(kernels in no range: the backward on autograd device thread, ...)':<78} {'':>8} "
              f"{rest:8.3f}")
    for title, rows in (("kernels by device time", prof["kernels"]), ("host ops by self time", prof["host_ops"])):
        if rows:
            print(f"  {title}: {'ms':>8} {'count':>7}")
            for key, ms, n in rows:
                print(f"    {key[:90]:<90} {ms:8.3f} {n:7.1f}")


def print_op_profile(name: str, rows: list[dict]) -> None:
    print(f"\n{name}: self time per call, by op and input shapes (torch.profiler)")
    print(f"{'ms':>9} {'share':>6} {'calls':>7}  op  shapes")
    for r in rows:
        print(f"{r['self_ms']:9.2f} {100 * r['share']:5.1f}% {r['calls']:7.1f}  {r['op']}  {r['shapes'][:110]}")
