import contextlib
import math
import os
import random

import numpy as np
import pytest
import torch


_XDIST_WORKER = False  # set in a pytest-xdist worker (pytest_configure)


def pytest_configure(config):
    global _XDIST_WORKER
    _XDIST_WORKER = hasattr(config, "workerinput")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_gpu:
            item.add_marker(skip_gpu)
    items[:] = tests_first(items, os.environ.get("ELMO_FAST_TESTS_FIRST", ""))


def tests_first(items: list, spec: str) -> list:
    """``items`` with those whose node id contains one of the comma-separated words of ``spec`` first, in the order
    of the words, the rest after, each group in collection order. gpu-check's test-gpu step names the checks that
    decide the opt-ins: under a lease's time cap they run first (pytest-xdist hands tests out in this order)."""
    words = [w for w in spec.split(",") if w]

    def rank(item):
        return next((i for i, w in enumerate(words) if w in item.nodeid), len(words))

    return sorted(items, key=rank)  # stable: collection order within a rank


FAILURE_LOG_HEAD, FAILURE_LOG_TAIL = 4000, 5000  # characters of a long message kept from its start and its end


def pytest_runtest_logreport(report):
    """With ``ELMO_FAST_FAILURE_LOG`` set (gpu-check's test steps: ``$OUT/failures.txt``), each failure's node id,
    phase and message appended to that file as it comes (the controlling process only, under pytest-xdist): a step cut
    by a lease's time cap keeps what failed and why, where pytest prints the messages only at its end."""
    path = os.environ.get("ELMO_FAST_FAILURE_LOG")
    if not path or not report.failed or _XDIST_WORKER:
        return
    text = report.longreprtext
    if len(text) > FAILURE_LOG_HEAD + FAILURE_LOG_TAIL:
        text = f"{text[:FAILURE_LOG_HEAD]}\n[... {len(text) - FAILURE_LOG_HEAD - FAILURE_LOG_TAIL} characters ...]\n" \
               f"{text[-FAILURE_LOG_TAIL:]}"
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{text}\n")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    yield


@pytest.fixture
def tiny_model(tmp_path):
    from elmo_fast.testing import write_random_model

    return write_random_model(tmp_path / "tiny")


def triton_available() -> bool:
    from elmo_fast._backend import triton_import_error, triton_interpret

    return triton_import_error() is None and (torch.cuda.is_available() or triton_interpret())


def triton_device() -> str:
    """Where the Triton tests put the tensors they hand to backend="triton": "cuda" when a CUDA GPU is present and
    the interpreter is off (gpu-check's test-triton step), else "cpu" (the kernels run on CPU tensors only under
    TRITON_INTERPRET=1, as ``make test`` runs them)."""
    from elmo_fast._backend import triton_interpret

    return "cuda" if torch.cuda.is_available() and not triton_interpret() else "cpu"


requires_triton = pytest.mark.skipif(
    not triton_available(), reason="needs triton and a GPU, or TRITON_INTERPRET=1 (make test sets it)"
)


@contextlib.contextmanager
def programs_backwards():
    """Every Triton grid run backwards under the interpreter (program ids handed out from the last to the first):
    a bit-equality test whose second run goes through this can fail where the result depends on program order,
    which two runs in the interpreter's fixed order never show."""
    from triton.runtime import interpreter

    b = interpreter.interpreter_builder
    real = type(b).set_grid_idx
    b.set_grid_idx = lambda x, y, z: real(b, *(n - 1 - i for n, i in zip(b.grid_dim, (x, y, z))))
    try:
        yield
    finally:
        del b.set_grid_idx


_ALLOCATORS = {"empty": (torch, "empty"), "empty_like": (torch, "empty_like"), "new_empty": (torch.Tensor, "new_empty")}


def poison_allocations(monkeypatch, allocators=("empty", "empty_like", "new_empty"), int_fill=None) -> None:
    """Every floating tensor from ``allocators`` (of torch.empty, torch.empty_like, Tensor.new_empty) starts as NaN,
    and every integer one as ``int_fill`` when given (bool untouched), so an element no kernel writes cannot pass a
    comparison. Undone with the monkeypatch."""
    for name in allocators:
        owner, attr = _ALLOCATORS[name]
        real = getattr(owner, attr)

        def poisoned(*args, _real=real, **kwargs):
            t = _real(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(math.nan)
            elif int_fill is not None and t.dtype != torch.bool:
                t.fill_(int_fill)
            return t

        monkeypatch.setattr(owner, attr, poisoned)


@contextlib.contextmanager
def isa_chosen(ext, name: str):
    """elmo_fast._cpu's kernels in the instruction set ``name`` ("scalar", "avx2", "avx512") inside the block, the
    CPU's best again after it; skips the test where this CPU cannot run ``name``."""
    best = ext.isa()
    try:
        ext.set_isa(name)
    except RuntimeError:
        pytest.skip(f"this CPU cannot run {name}")
    try:
        yield name
    finally:
        ext.set_isa(best)
