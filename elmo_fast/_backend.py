"""Backend selection: ``backend=`` argument, then ``ELMO_FAST_BACKEND``, then auto.

Nothing here runs at import time; every probe is lazy and cached.

* ``reference``: pure PyTorch (``elmo_fast.reference``), the plain oracle. Runs everywhere, any dtype, fp64 too.
* ``cpu``: the fast CPU path (``elmo_fast.cpu``): packed oneDNN weights, sorted rows, deduplicated tokens, own
  backward through time. CPU tensors only; any float dtype (ops it does not specialise run the reference).
* ``triton``: Triton kernels (``elmo_fast.kernels``). Needs ``triton`` and CUDA tensors, or CPU tensors
  with ``TRITON_INTERPRET=1`` set before Python started (that is how CI checks the kernels).
* ``cuda``: the compiled extension ``elmo_fast._C`` and CUDA tensors.
* ``auto``: ``cuda`` only once ``BACKEND_STATUS`` records its GPU tests as passed on real hardware (not yet), else
  ``triton`` on CUDA tensors when its once-per-device self-check agrees with the reference for that op (the
  interpreter is a correctness tool, never picked silently); ``cpu`` for CPU tensors; else ``reference``.

``BACKEND_STATUS`` is the one record of what each backend has been verified on (shown in the README).
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import Literal, NamedTuple

import torch

Backend = Literal["auto", "reference", "cpu", "triton", "cuda"]
BACKENDS = ("auto", "reference", "cpu", "triton", "cuda")
ENV_VAR = "ELMO_FAST_BACKEND"


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here; the message says why and how to get it."""


_TRITON_TRUE = ("1", "true", "on", "yes", "y")  # what Triton's own getenv_bool takes as on (any case), else off


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRITON_TRUE


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment switch of elmo_fast's (ELMO_FAST_CPU_EXT, ..._CPU_ONEDNN, ..._CPU_BF16): 1/true/yes/on
    or 0/false/no/off in any case, unset or empty for ``default``; any other value is refused by name rather than
    read as one or the other."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1 or 0 (also true/false, yes/no, on/off)")


@functools.lru_cache(maxsize=None)
def triton_import_error() -> str | None:
    try:
        importlib.import_module("triton")
        importlib.import_module("elmo_fast.kernels")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return f"{type(exc).__name__}: {exc}"
    return None


def torch_build_mismatch(mod) -> str | None:
    """Why the compiled module ``mod`` (elmo_fast._cpu, elmo_fast._C) must not run under this torch, or None. A
    module built against another torch imports, then crashes in its first call (a segmentation fault: elmo_fast._cpu
    built for torch 2.11 under 2.13, 2026-11-26; editable installs of two venvs share the in-tree module), so each
    build records its torch (csrc/include/elmo_fast/built_with.h) and only that one runs it."""
    built = getattr(mod, "torch_version", None)
    if built == torch.__version__:
        return None
    return (f"{mod.__name__} ({mod.__file__}) was built against torch "
            f"{built or 'of an unknown version (built before elmo_fast recorded it)'}, and this process runs torch "
            f"{torch.__version__}: its kernels would crash here")


@functools.lru_cache(maxsize=None)
def cuda_ext_import_error() -> str | None:
    try:
        mod = importlib.import_module("elmo_fast._C")
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return torch_build_mismatch(mod)


def cuda_ext():
    """The compiled extension module; raises BackendUnavailableError with the fix when missing."""
    err = cuda_ext_import_error()
    if err is not None:
        raise BackendUnavailableError(
            "backend 'cuda' needs the compiled extension elmo_fast._C, which did not import "
            f"({err}). Build it on a machine with nvcc and a CUDA build of torch: "
            "`ELMO_FAST_BUILD_CUDA=1 pip install -e .` (see README, 'CUDA extension')."
        )
    return importlib.import_module("elmo_fast._C")


def _normalise(backend: str | None) -> str:
    if backend is None or backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env:
            if env not in BACKENDS:
                raise ValueError(f"{ENV_VAR}={env!r} is not a backend; expected one of {BACKENDS}")
            return env
        return "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not a backend; expected one of {BACKENDS}")
    return backend


def check_backend_name(backend: str | None) -> str:
    """Validate a backend name early (module construction) without probing devices."""
    return _normalise(backend)


def select_backend(backend: str | None, device: torch.device, op: str = "op") -> str:
    """Resolve ``backend`` for tensors on ``device``; explicit choices that cannot run raise."""
    choice = _normalise(backend)
    dev = torch.device(device)
    if choice == "reference":
        return "reference"
    if choice == "cpu":
        if dev.type != "cpu":
            raise BackendUnavailableError(
                f"backend 'cpu' for {op} needs CPU tensors, got {dev}; move the model to the CPU "
                "(`model.cpu()`) or pass backend='auto' (or 'triton' / 'cuda' for GPU tensors)."
            )
        return "cpu"
    if choice == "triton":
        err = triton_import_error()
        if err is not None:
            raise BackendUnavailableError(
                f"backend 'triton' for {op} needs triton ({err}); install it with `pip install triton==3.6.0` "
                "or `pip install elmo_fast[triton]`, or pass backend='reference'."
            )
        if dev.type != "cuda" and not triton_interpret():
            raise BackendUnavailableError(
                f"backend 'triton' for {op} got tensors on {dev}; Triton kernels run on CUDA tensors, or on CPU "
                "tensors only with TRITON_INTERPRET=1 set before Python starts (slow; for testing). "
                "Move the model to a GPU or pass backend='reference'."
            )
        return "triton"
    if choice == "cuda":
        mod = cuda_ext()
        if dev.type != "cuda":
            raise BackendUnavailableError(
                f"backend 'cuda' for {op} needs CUDA tensors, got {dev}; move the model to a GPU or pass "
                "backend='reference'."
            )
        if not hasattr(mod, op):
            raise BackendUnavailableError(
                f"backend 'cuda' has no kernel for {op} in this build of elmo_fast._C; use backend='triton'."
            )
        return "cuda"
    # auto
    if dev.type == "cuda":
        if verified_on_gpu("cuda") and cuda_ext_import_error() is None and hasattr(cuda_ext(), op):
            return "cuda"
        if triton_import_error() is None and triton_self_check(op, dev):
            return "triton"
    if dev.type == "cpu":
        return "cpu"
    return "reference"


# ------------------------------------------------------------------------------------------ what is verified
class BackendStatus(NamedTuple):
    backend: str
    device: str
    status: str  # "verified on <GPU> at <commit>", "verified on CPU", "interpreter-only", "compiled-only", ...
    evidence: str


# One row per (backend, device). A GPU row becomes "verified on <GPU> at <commit>" only when `make gpu-check`
# passed there and its results are committed under bench/results/; `auto` reads this table.
BACKEND_STATUS: tuple[BackendStatus, ...] = (
    BackendStatus("reference", "cpu", "verified on CPU",
                  "the whole suite in CI, every commit; parity with AllenNLP 2.10.1 (make test-parity)"),
    BackendStatus("reference", "cuda", "run on an H200 (2026-11-26, 2026-11-27)",
                  "plain PyTorch ops, same code as on the CPU; the oracle of the GPU tests there"),
    BackendStatus("cpu", "cpu", "verified on CPU", "its tests in CI, every commit"),
    BackendStatus("triton", "cpu", "interpreter-only",
                  "every kernel against the reference under TRITON_INTERPRET=1 in CI (a test tool, never auto)"),
    BackendStatus("triton", "cuda", "run on an H200 (2026-11-26, 2026-11-27), not yet verified",
                  "self-check passed for every op, fp32 and bf16, the dropout kernel included (2026-11-27); the GPU "
                  "tests at the original sizes passed but one test's own fault, PDL's and the fused reduce's bits "
                  "equal to the plain launches'; 331 of 357 Triton tests on CUDA passed (2026-11-27, at 1aca4d1): 16 "
                  "failed from one test module's leaked `TRITON_INTERPRET=1`, 7 from traced calls (cached constants, "
                  "SymBools), 2 from test assumptions, fixed since on the CPU; then the LSTMP operator traced under "
                  "torch.compile gave other numbers than eager, kept whole since (8027b69, not re-run); one opt-in "
                  "PDL tile's bf16 gradient 1.4% over its budget (open); auto uses it behind a once-per-device "
                  "self-check"),
    BackendStatus("cuda", "cuda", "run on an H200 (2026-11-26), not yet verified",
                  "built there; 18 of 19 tests passed (the test fixed since); slower than Triton from B=16 "
                  "(bench/results/gpu_h200.md); opt-in build; auto skips it"),
)


def verified_on_gpu(backend: str) -> bool:
    """True once ``BACKEND_STATUS`` records ``backend``'s GPU tests as passed on real hardware."""
    return any(r.backend == backend and r.device == "cuda" and r.status.startswith("verified on")
               for r in BACKEND_STATUS)


def status_table() -> str:
    """``BACKEND_STATUS`` as the Markdown table the README shows."""
    lines = ["| backend | device | status | evidence |", "|---|---|---|---|"]
    lines += [f"| `{r.backend}` | {r.device} | {r.status} | {r.evidence} |" for r in BACKEND_STATUS]
    return "\n".join(lines)


_SELF_CHECKED: dict[tuple[str, str], bool] = {}


def triton_self_check(op: str, device: torch.device) -> bool:
    """Once per (op, device): the Triton kernel of ``op`` against the reference at a small shape (forward and
    gradients, fp32 and bf16 under autocast: ``elmo_fast.ops._selfcheck``). On disagreement or error: one warning
    naming the op and the error, and False (auto then takes the reference path for that op on that device; for
    the dropout, whose self-check is bit for bit, ``F.dropout``)."""
    key = (op, str(torch.device(device)))
    ok = _SELF_CHECKED.get(key)
    if ok is None:
        from .ops._selfcheck import run_self_check

        err = run_self_check(op, torch.device(device))
        ok = err is None
        if not ok:
            fallback = "torch's F.dropout" if op == "dropout" else f"the reference path for {op}"
            warnings.warn(f"elmo_fast: the Triton kernel of {op} failed its self-check on {key[1]} ({err}); "
                          f"auto uses {fallback} there", RuntimeWarning, stacklevel=3)
        _SELF_CHECKED[key] = ok
    return ok
