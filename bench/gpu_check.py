"""The GPU check (``make gpu-check``, ``bench/gpu_check.sh [STEP...]``): what to run on a lent GPU machine.

    bench/gpu_check.sh                      # install, then every step that fits in the budget (default 560 s)
    bench/gpu_check.sh selfcheck test-gpu   # install if needed, then these steps only
    bench/gpu_check.sh selfcheck bench-lstmp:200   # NAME:SECONDS caps a step below its own limit
    bench/gpu_check.sh --list               # the steps, their time limits and what they do; the lease plan
    bench/gpu_check.sh --lease 1            # the lease plan's first call (``make gpu-lease CALL=1``), then 2
    python bench/gpu_check.py --smoke       # every step on the CPU, from a fresh clone (CI: make test)

The GPU machine has python3 with a CUDA torch, triton, nvcc, ninja and pytest, and no network. ``install``
puts the package into that python without dependency resolution or build isolation (``pip install --no-deps
--no-build-isolation --no-index -e .``, pure Python: the CUDA extension is its own step, ``build-cuda``).
Every step runs in its own process group under its own time limit (killed at the limit: a killed step loses
only itself) with unbuffered output, and its output is appended line by line to ``$OUT/log.txt`` as it comes;
``$OUT/summary.txt`` gets the environment first and one line per step as each ends; the benchmarks' CSV rows
are packed into ``$OUT/bench_rows.jsonl`` (one JSON object per row, with its ``bench`` name) after each step.
Three files in all, ``train_trace.json.gz`` after ``bench-train-lease`` (its profiled steps' timeline;
"{out}" in a step's command or environment is ``$OUT``) and ``failures.txt`` where a test step had failures (each
one's message as it came): the device machine returns at most 8. A step that would not finish inside
the remaining budget is not started and is listed as such: run it in the next call.

A lease is short: 15 minutes of device time a session, the machine's start (a minute or two) and the idle
time between calls included (the device tool's README), against 10 minutes a command. ``LEASE`` is the plan that
fits: two calls of about six and five minutes, the second run at once while the machine is warm (it goes back
30 s after a call), each step capped so that every one starts; a third, optional, where device time is left. The
measurements that decide something come first: the training step and where its time goes, the LSTMP chain against
cuDNN with and without the opt-in programmatic dependent launch, the single-sentence latency with the opt-ins; the
GPU tests are the second call, the cell kernels' tile sweep at B = 384 the third.
tests/test_gpu_check.py checks that the caps fit each call's budget, and the calls, with the start, the transfers
and the gap between them, the lease.

``--smoke`` clones the committed HEAD into a temporary directory, makes a virtual environment that sees this
interpreter's packages but not the package itself (``elmo_fast`` must not import before ``install``), installs
the clone the same way, and runs every step on the CPU at the smallest sizes (Triton under the interpreter):
what would die on a GPU machine of an import, install or Python error dies here first.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Step:
    name: str
    timeout: int  # seconds on the GPU machine
    what: str
    gpu: tuple  # command lines (lists), run in order; "{py}" is the interpreter
    smoke: tuple  # the same step on the CPU at the smallest sizes
    smoke_env: tuple = (("TRITON_INTERPRET", "1"),)  # "{tmp}" in a value: the run's temporary folder
    lease: bool = False  # a narrowed benchmark of the lease plan (LEASE): not in the default list of steps


PY = "{py}"
_SELFCHECK = ("import sys, torch; from elmo_fast.ops._selfcheck import OPS, run_self_check; "
              "dev = torch.device(sys.argv[1]); errs = {op: run_self_check(op, dev) for op in OPS}; "
              "[print(f'self-check {op:16s} fp32 + bf16: {e or \"ok\"}') for op, e in errs.items()]; "
              "sys.exit(0 if all(e is None for e in errs.values()) else 1)")
_IMPORTS = ("import elmo_fast, elmo_fast.kernels, elmo_fast.probes, elmo_fast._backend as b; "
            "print('elmo_fast from', elmo_fast.__file__); print('triton:', b.triton_import_error() or 'ok'); "
            "print('elmo_fast._C:', b.cuda_ext_import_error() or 'ok'); print(b.status_table())")
_ENV = ("import platform, sys, torch; print('python', sys.version.split()[0], platform.platform()); "
        "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', "
        "torch.cuda.get_device_name() if torch.cuda.is_available() else None)\n"
        "try:\n import triton; print('triton', triton.__version__)\nexcept Exception as e: print('triton:', e)")


# the lease's narrowed benchmarks: the same arguments on the GPU and in the CPU smoke run
# (PDL is out of them since the H200 timed it slower in every case but the B=1 chain, 2026-11-27; the tiles at B=384
# were timed then too: the sweep is at B=128 now)
_TRAIN_LEASE = ("--batch", "384", "--providers", "elmo_fast,elmo_fast-towers,parts", "--profile", "3",
                "--trace", "{out}/train_trace.json.gz")
_LSTMP_LEASE = ("--parts", "sweep,kernels", "--batches", "384,1", "--dtypes", "bf16", "--providers", "triton,cudnn")
_TILES_LEASE = ("--parts", "tiles", "--batches", "128", "--dtypes", "bf16")
_BILM_LEASE = ("--dtypes", "bf16", "--providers", "auto+graph,auto+graph+fusedreduce,library")
_ENCODER_LEASE = ("--dtypes", "bf16", "--providers", "triton,library")


def _bench_import(name):  # smoke of a GPU-only benchmark that has no CPU mode: it imports
    return ((PY, "-c", f"import sys; sys.path.insert(0, 'bench'); import {name}; print('imported {name}')"),)


STEPS = (
    Step("env", 60, "versions, GPU, driver, commit",
         ((PY, "-c", _ENV), ("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                             "--format=csv,noheader"), ("git", "log", "-1", "--format=commit %H %s")),
         ((PY, "-c", _ENV), ("git", "log", "-1", "--format=commit %H %s"))),
    Step("install", 180, "pip install --no-deps --no-build-isolation --no-index -e . (pure Python), imports",
         ((PY, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e", "."),
          (PY, "-c", _IMPORTS)),
         ((PY, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e", "."),
          (PY, "-c", _IMPORTS))),
    Step("selfcheck", 240, "every Triton kernel against the reference at a small shape (auto's guard)",
         ((PY, "-c", _SELFCHECK, "cuda"),), ((PY, "-c", _SELFCHECK, "cpu"),)),
    Step("precompile", 120, "every kernel variant of the original model compiled in parallel (kernel_report "
         "--warm-cache), into Triton's cache, where the benchmarks' JIT may find them (keys from triton's own binder "
         "on the report's arguments; a hit on a GPU not seen yet)",
         ((PY, "bench/kernel_report.py", "--warm-cache", "--out", "{tmp}/kernel_report"),),
         ((PY, "bench/kernel_report.py", "--warm-cache", "--subset", "--only", "highway", "--out",
           "{tmp}/kernel_report"),),
         (("TRITON_INTERPRET", "1"), ("TRITON_CACHE_DIR", "{tmp}/triton_cache"))),  # the smoke's own cache
    Step("test-triton", 540, "the Triton tests on CUDA tensors (pytest -m 'triton and not slow')",
         # every failure in one call (no -x), 8 processes (pytest-xdist is on the GPU image): a lease is short; each
         # test's name and result as it ends, each failure's message in $OUT/failures.txt as it comes (STEP_ENV): the
         # 2026-11-27 lease's cap cut this step at 97% with 27 failures that -q had not yet named
         ((PY, "-m", "pytest", "-v", "-rf", "-n", "8", "-m", "triton and not slow", "tests"),),
         ((PY, "-m", "pytest", "-q", "--co", "-m", "triton and not slow", "tests"),)),
    Step("test-gpu", 540, "the GPU tests at the original sizes (pytest -m 'gpu and not cuda_ext')",
         # 4 processes, each test's name and result printed as it ends: a step cut by its time cap still says which
         # tests passed (the original-size char CNN test alone took 161 s on the H200)
         ((PY, "-m", "pytest", "-v", "-rs", "-n", "4", "-m", "gpu and not cuda_ext", "tests"),),
         ((PY, "-m", "pytest", "-q", "-rs", "-m", "gpu and not cuda_ext", "tests"),)),
    Step("bench-launches", 300, "launches, syncs and uploads per forward and training step",
         ((PY, "bench/bench_launches.py"),), ((PY, "bench/bench_launches.py", "--cases", "forward", "--steps", "4"),)),
    Step("bench-bilm", 540, "end-to-end embedding throughput and latency, every provider",
         ((PY, "bench/bench_bilm.py"),), ((PY, "bench/bench_bilm.py", "--device", "cpu", "--tiny"),), ()),
    Step("bench-lstmp", 540, "one LSTMP chain, Triton vs cuDNN, the sweep; every launch beside its estimate",
         ((PY, "bench/bench_lstmp.py", "--parts", "sweep,kernels"),),
         _bench_import("bench_lstmp")),
    Step("bench-lstmp-tiles", 300, "the cell kernels' and the split-K GEMMs' tile alternatives, each timed and "
         "checked against the tuned tile (the compile-time model's least trusted picks)",
         ((PY, "bench/bench_lstmp.py", "--parts", "splits,tiles"),), _bench_import("bench_lstmp")),
    Step("bench-lstmp-layer", 540, "the drop-in elmo_fast.LSTMP beside nn.LSTM(proj_size) (cuDNN), fp32 and bf16",
         ((PY, "bench/bench_lstmp_layer.py", "--device", "cuda"),
          (PY, "bench/bench_lstmp_layer.py", "--device", "cuda", "--dtype", "bfloat16")),
         _bench_import("bench_lstmp_layer")),
    Step("bench-token-encoder", 300, "char CNN + highway", ((PY, "bench/bench_token_encoder.py"),),
         _bench_import("bench_token_encoder")),
    Step("bench-softmax", 540, "sampled and full softmax", ((PY, "bench/bench_softmax.py"),),
         _bench_import("bench_softmax")),
    Step("bench-train", 540, "pretraining throughput, original config, 384 rows (performance.md's shape)",
         ((PY, "bench/bench_train.py", "--batch", "384", "--providers",
           "elmo_fast,elmo_fast-pdl,elmo_fast-towers,elmo_fast-towers-seq,elmo_fast-thread-data,elmo_fast-eager,"
           "parts"),),
         ((PY, "bench/bench_train.py"),)),
    # the lease's narrowed benchmarks (LEASE): the shapes and providers that decide the targets and the opt-ins
    Step("bench-train-lease", 300, "the training step at 384 rows: elmo_fast, with PDL, the original's 3 towers "
         "fused, the library parts; then 3 elmo_fast steps under torch.profiler (where the step's time goes)",
         ((PY, "bench/bench_train.py", *_TRAIN_LEASE, "--steps", "12", "--rounds", "3", "--warmup", "3"),),
         ((PY, "bench/bench_train.py", *_TRAIN_LEASE),),  # on the CPU: the arguments checked, nothing timed
         lease=True),
    Step("bench-lstmp-lease", 300, "the LSTMP chain at B = 384 and 1, bf16: Triton beside "
         "cuDNN; every launch beside its estimate",
         ((PY, "bench/bench_lstmp.py", *_LSTMP_LEASE),), ((PY, "bench/bench_lstmp.py", *_LSTMP_LEASE, "--dry-run"),),
         lease=True),
    Step("bench-lstmp-tiles-lease", 300, "the cell kernels' tile alternatives at B = 128, bf16 (the tuned tile, the "
         "ones it replaced, the occupancy probes), each checked against the tuned tile's outputs",
         ((PY, "bench/bench_lstmp.py", *_TILES_LEASE),), ((PY, "bench/bench_lstmp.py", *_TILES_LEASE, "--dry-run"),),
         lease=True),
    Step("bench-token-encoder-lease", 300, "the token encoder (char CNN + highway + projection), 7,680 tokens, bf16, "
         "forward and forward+backward: elmo_fast against the library composition (the char CNN's window tiles and "
         "relaxed atomics, the highway's bias gradient out of the dW loop: never timed)",
         ((PY, "bench/bench_token_encoder.py", *_ENCODER_LEASE),),
         ((PY, "bench/bench_token_encoder.py", *_ENCODER_LEASE, "--dry-run"),), lease=True),
    Step("bench-bilm-lease", 300, "embedding throughput and single-sentence latency, bf16: the model graph, "
         "plain and with the fused reduce, beside the library",
         ((PY, "bench/bench_bilm.py", *_BILM_LEASE),), ((PY, "bench/bench_bilm.py", *_BILM_LEASE, "--device", "cpu",
                                                         "--tiny"),), lease=True),
    Step("profile-train", 300, "a training step at 384 rows under torch.profiler: kernels by device time, host ops, "
         "how busy the GPU is (bench_train --profile)",
         ((PY, "bench/bench_train.py", "--batch", "384", "--steps", "6", "--rounds", "2", "--warmup", "3",
           "--providers", "elmo_fast", "--profile", "3"),),
         ((PY, "bench/bench_train.py", "--help"),)),
    Step("profile-ops", 240, "the LSTMP chain, sampled softmax and token encoder at their target shapes under "
         "torch.profiler: kernels by device time, host ops, how busy the GPU is (bench/profile_gpu.py)",
         ((PY, "bench/profile_gpu.py"),), ((PY, "bench/profile_gpu.py", "--tiny", "--calls", "1"),)),
    Step("build-cuda", 540, "the CUDA extension elmo_fast._C, in place (ELMO_FAST_BUILD_CUDA=1; opt-in)",
         ((PY, "setup.py", "-q", "build_ext", "--inplace"), (PY, "-c", _IMPORTS)),
         ((PY, "-c", "import setuptools"),), ()),
    Step("test-cuda-ext", 540, "the CUDA extension's tests (after build-cuda)",
         ((PY, "-m", "pytest", "-q", "-rs", "-m", "cuda_ext", "tests"),),
         ((PY, "-m", "pytest", "-q", "-rs", "-m", "cuda_ext", "tests"),)),
    Step("bench-lstmp-cuda", 540, "the persistent CUDA LSTMP beside Triton and cuDNN (after build-cuda)",
         ((PY, "bench/bench_lstmp_cuda.py"),), ((PY, "bench/bench_lstmp_cuda.py", "--batches", "1"),)),
)
BY_NAME = {s.name: s for s in STEPS}
# install: pure Python (the optional CPU extension elmo_fast._cpu is for the cpu backend: 10-20 s of a 2-core smoke
# run's compile, and nothing on the GPU steps runs it; the cpu backend works without it).
# test-gpu: the tests that decide the opt-ins first (tests/conftest.py tests_first), so that a lease's time cap cuts
# the others: PDL's and the fused reduce's bits, the LSTMP chain's original sizes, the dropout kernel, the fused towers.
# The test steps write each failure's message to $OUT/failures.txt as it comes (tests/conftest.py); "{out}" in a
# value is $OUT.
_FAILURES = {"ELMO_FAST_FAILURE_LOG": "{out}/failures.txt"}
STEP_ENV = {"install": {"ELMO_FAST_BUILD_CPU": "0"},
            "build-cuda": {"ELMO_FAST_BUILD_CUDA": "1", "MAX_JOBS": os.environ.get("MAX_JOBS", "16")},
            "test-gpu": {"ELMO_FAST_TESTS_FIRST": "test_lstmp_pdl.py,test_lstmp_fused_reduce.py,test_lstmp_triton.py,"
                                                  "test_dropout_triton.py,test_fused_towers.py", **_FAILURES},
            "test-triton": _FAILURES, "test-cuda-ext": _FAILURES}


@dataclass(frozen=True)
class Call:
    budget: int  # seconds for the whole call (its --budget)
    steps: tuple  # NAME or NAME:SECONDS, run in this order
    why: str
    optional: bool = False  # run only where the device time left allows (status's budget_left_s), not counted


# The device tool's limits (/work/.library/device/README.md as of 2026-11): 15 minutes of device time a session,
# start, idle time and every call counted; at most 10 minutes a command; warm for 30 s after a call.
DEVICE_SECONDS = 900
COMMAND_SECONDS = 600
START_SECONDS = 150  # a machine's start, allowed for (a minute or more)
TRANSFER_SECONDS = 30  # the working tree there and $OUT back, allowed for per call
GAP_SECONDS = 20  # between two calls, the machine warm and idle (counted)
STEP_MARGIN = 5  # main() starts a step only with its cap and this much of the call's budget left
CALL_SLACK = 10  # a step killed at its cap takes up to 5 s more (SIGTERM, then SIGKILL), and its rows are packed
LEASE = (
    # precompile first: every variant of the original model compiled on all cores at once (20 s on the H200) where
    # each benchmark process would otherwise compile its own, one at a time, inside its capped step
    Call(375, ("env:15", "install:30", "precompile:30", "selfcheck:40", "bench-train-lease:70",
               "bench-token-encoder-lease:25", "bench-lstmp-lease:35", "bench-bilm-lease:35", "bench-softmax:40"),
         "the targets: the training step (34.8 ms on the H200 of 2026-11-27, host-bound; since, no host sync) and "
         "its profile, the token encoder (char CNN and highway backward changed since), the LSTMP chain against "
         "cuDNN, the embedding and single-sentence latency with the fused reduce, the sampled softmax as redesigned "
         "(never timed since)"),
    Call(275, ("install:30", "test-gpu:80", "test-triton:140"),
         "the GPU tests (the opt-ins' bits against the plain launches', the original sizes), then every Triton "
         "test on CUDA; then give the machine back unless call 3 runs at once"),
    Call(120, ("install:20", "bench-lstmp-tiles-lease:80"),
         "only if the device time left (status's budget_left_s) is at least this call's budget and its transfers "
         "and the machine is still warm: the cell kernels' tiles at B = 128 bf16, the tuned against the "
         "occupancy probes (at B = 384 they won, 2026-11-27)", optional=True),
)


class Output:
    """summary.txt, log.txt and bench_rows.jsonl under ``out``, each written and flushed as results come."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.dir = out
        self.summary = open(out / "summary.txt", "a", buffering=1, encoding="utf-8")
        self.log = open(out / "log.txt", "a", buffering=1, encoding="utf-8")
        self.rows = out / "bench_rows.jsonl"

    def note(self, line: str) -> None:
        self.summary.write(line + "\n")
        self.log.write(line + "\n")
        print(line, flush=True)

    def pack_rows(self, staging: Path) -> int:
        """Move the CSV rows the benchmarks appended under ``staging`` into bench_rows.jsonl."""
        n = 0
        with open(self.rows, "a", encoding="utf-8") as fh:
            for path in sorted(staging.glob("*.csv")):
                with open(path, newline="", encoding="utf-8") as f:
                    for row in csv.DictReader(f):
                        fh.write(json.dumps({"bench": path.stem, **row}) + "\n")
                        n += 1
                path.unlink()
        return n


def run_step(cmds, env: dict, cwd: Path, timeout: float, log) -> tuple[str, float]:
    """Run the command lines in order, each in its own process group, under one time limit for the step.
    Output goes to ``log`` line by line. Returns ("ok" | "FAILED rc=N" | "TIMEOUT", seconds)."""
    t0 = time.monotonic()
    for cmd in cmds:
        left = timeout - (time.monotonic() - t0)
        if left <= 0:
            return "TIMEOUT", time.monotonic() - t0
        log.write(f"$ {' '.join(cmd)}\n")
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1,
                                    start_new_session=True)
        except OSError as exc:
            log.write(f"cannot start: {exc}\n")
            return f"FAILED ({exc.strerror})", time.monotonic() - t0
        killer = _Killer(proc, left)
        for line in proc.stdout:
            log.write(line)
        rc = proc.wait()
        killer.cancel()
        if killer.fired:
            log.write(f"-- killed after {timeout:.0f} s\n")
            return "TIMEOUT", time.monotonic() - t0
        if rc:
            return f"FAILED rc={rc}", time.monotonic() - t0
    return "ok", time.monotonic() - t0


class _Killer:
    """Kills a process group when its time is up (SIGTERM, then SIGKILL 5 s later)."""

    def __init__(self, proc, seconds: float):
        import threading

        self.proc = proc
        self.fired = False
        self.timer = threading.Timer(seconds, self._kill)
        self.timer.daemon = True
        self.timer.start()

    def _kill(self):
        self.fired = True
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def cancel(self):
        self.timer.cancel()


def smoke_setup(work: Path) -> tuple[Path, Path]:
    """A fresh clone of HEAD and a venv seeing this interpreter's packages but not elmo_fast: (clone, python)."""
    clone, venv = work / "clone", work / "venv"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site_dir = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
    # plain path lines: this interpreter's packages (torch, triton, pip, setuptools, ...) become importable, but
    # the .pth files there are not processed, so the editable elmo_fast of the working tree stays invisible
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site_dir, "_gpu_check_smoke.pth").write_text("\n".join(sorted(paths)) + "\n")
    probe = subprocess.run([str(py), "-c", "import elmo_fast"], cwd=work, capture_output=True, text=True)
    if probe.returncode == 0:
        raise SystemExit("gpu_check --smoke: elmo_fast is importable before the install step; the smoke run "
                         "would not test the install")
    return clone, py


def parse_step(arg: str) -> tuple[str, float | None]:
    """'NAME' -> (NAME, None); 'NAME:SECONDS' -> (NAME, SECONDS), a cap on that step's time limit."""
    name, sep, secs = arg.partition(":")
    if not sep:
        return name, None
    try:
        cap = float(secs)
    except ValueError:
        cap = 0.0
    if cap <= 0:
        raise ValueError(f"step {arg!r}: expected NAME:SECONDS with SECONDS a positive number")
    return name, cap


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", nargs="*", help="steps to run (default: all), each NAME or NAME:SECONDS (a cap "
                    "below the step's own limit); install runs first unless skipped")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "gpu_out"))
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole call (default: $GPU_CHECK_BUDGET, else 560; with --lease, the "
                    "call's own; the device machine allows 600 per command)")
    ap.add_argument("--smoke", action="store_true", help="every step on the CPU, from a fresh clone")
    ap.add_argument("--no-install", action="store_true", help="the package is installed already")
    ap.add_argument("--lease", type=int, choices=range(1, len(LEASE) + 1), metavar="CALL",
                    help=f"call CALL (1-{len(LEASE)}) of the lease plan, its steps in its order, under its budget")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for s in STEPS:
            print(f"{s.name:20s} {s.timeout:4d} s  {s.what}")
        for n, call in enumerate(LEASE, 1):
            print(f"lease call {n}{' (optional)' if call.optional else ''} ({call.budget} s): "
                  f"{' '.join(call.steps)}\n    {call.why}")
        return 0
    if args.lease and args.steps:
        ap.error("--lease CALL runs the plan's steps: name no steps beside it")
    call = LEASE[args.lease - 1] if args.lease else None
    try:
        caps = dict(parse_step(a) for a in (call.steps if call else args.steps))
    except ValueError as exc:
        ap.error(str(exc))
    unknown = [n for n in caps if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown step(s) {unknown}; the steps are: {', '.join(BY_NAME)}")
    names = list(caps) or [s.name for s in STEPS if not s.lease]  # the lease's narrowed runs repeat others
    if not args.no_install and "install" not in names:
        names = ["install", *names]
    if call:  # the plan's order (the decisive measurements first)
        names = [n for n in names if n != "install" or not args.no_install]
        if args.budget is None:
            args.budget = float(call.budget)
    else:
        names = [s.name for s in STEPS if s.name in names]  # the order of STEPS: env, install, ... build-cuda last
    if args.budget is None:
        args.budget = float(os.environ.get("GPU_CHECK_BUDGET", 560))

    start = time.monotonic()
    out = Output(Path(args.out).resolve())
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        tmp = Path(tmp)
        cwd, py = (smoke_setup(tmp) if args.smoke else (ROOT, Path(os.environ.get("PYTHON", "python3"))))
        staging = tmp / "csv"
        staging.mkdir()
        out.note(f"== gpu_check {'--smoke ' if args.smoke else ''}{' '.join(names)}  "
                 f"(budget {args.budget:.0f} s, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})")
        failed = False
        for name in names:
            step = BY_NAME[name]
            left = args.budget - (time.monotonic() - start)
            own = min(step.timeout, caps.get(name) or step.timeout)
            limit = min(own, left - STEP_MARGIN)
            if limit < min(60, own):
                out.note(f"{name:20s} NOT STARTED (budget: {left:.0f} s left); run it in the next call")
                continue
            env = dict(os.environ, PYTHONUNBUFFERED="1", ELMO_FAST_BENCH_DIR=str(staging),
                       PIP_DISABLE_PIP_VERSION_CHECK="1",
                       **{k: v.replace("{out}", str(out.dir)) for k, v in STEP_ENV.get(name, {}).items()})
            if args.smoke:
                env.update({k: v.replace("{tmp}", str(tmp)) for k, v in step.smoke_env})
                env.pop("ELMO_FAST_BUILD_CUDA", None)
            cmds = [[str(py) if a == PY else a.replace("{tmp}", str(tmp)).replace("{out}", str(out.dir)) for a in cmd]
                    for cmd in (step.smoke if args.smoke else step.gpu)]
            out.log.write(f"\n==== {name} (limit {limit:.0f} s)\n")
            status, secs = run_step(cmds, env, cwd, limit, out.log)
            rows = out.pack_rows(staging)
            out.note(f"{name:20s} {status:14s} {secs:6.1f} s" + (f"  {rows} bench rows" if rows else ""))
            failed |= status != "ok"
            if name == "install" and status != "ok":
                out.note("install failed: the other steps would test another copy of elmo_fast; stopping")
                break
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
