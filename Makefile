# elmo_fast: `make test` and `make demo` do all set-up themselves on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.elmo_fast-setup
# CPU build of torch (from local disk here); the GPU machine brings its own CUDA torch (see gpu-check).
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0
PYTEST_ARGS ?=
# Test processes for the main suite (pytest-xdist, whole files per process: module fixtures stay shared);
# 0 or 1 runs it in this process.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile,)

.PHONY: setup test test-parity demo bench lint gpu-check gpu-lease gpu-check-smoke clean cuda-compile-check kernel-report \
	kernel-report-subset

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) -m pip install -q "setuptools>=77" wheel "$(TORCH_SPEC)" "$(TRITON_SPEC)" numpy h5py tqdm pytest pytest-benchmark pytest-xdist ninja pybind11
	ELMO_FAST_BUILD_CUDA=0 $(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

# The parity suites run against the original implementations from their own venv (.venv-allennlp).
PARITY_TESTS := tests/test_allennlp_parity.py tests/test_bilm_parity.py
RESULTS := $(VENV)/test-results

# The whole suite; Triton kernels run on CPU tensors under the interpreter. Real sizes are `slow`/`gpu`.
# Then the parity suites (test-parity); the last line totals both runs (tests/junit_total.py).
test: setup
	@mkdir -p $(RESULTS)
	@rm -f $(RESULTS)/main.xml $(RESULTS)/parity.xml
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) -m "not slow and not gpu" $(addprefix --ignore=,$(PARITY_TESTS)) \
		--junitxml=$(RESULTS)/main.xml $(PYTEST_ARGS) tests; main=$$?; \
	$(MAKE) --no-print-directory test-parity; parity=$$?; \
	$(PY) tests/junit_total.py main=$(RESULTS)/main.xml parity=$(RESULTS)/parity.xml; total=$$?; \
	exit $$(( main || parity || total ))

# Parity with the real AllenNLP 2.10.1 ELMo and bilm-tf's data code, from their own venv (bench/setup_allennlp.sh
# builds it). ELMO_FAST_REQUIRE_PARITY=1: a missing oracle fails the run instead of skipping it.
test-parity:
	bash bench/setup_allennlp.sh
	@mkdir -p $(RESULTS)
	ELMO_FAST_REQUIRE_PARITY=1 .venv-allennlp/bin/python -m pytest -q --junitxml=$(RESULTS)/parity.xml $(PARITY_TESTS)

demo: setup
	$(PY) -m elmo_fast.demo

# CSV rows go to build/bench/ (scratch); `ELMO_FAST_BENCH_RECORD=1 make bench` appends them to the committed
# bench/results/ (bench/common.py).
bench: setup
	$(PY) -m pytest -q bench --benchmark-only --benchmark-columns=min,median,mean,rounds $(PYTEST_ARGS)

lint: setup
	$(PY) -m pip install -q ruff >/dev/null 2>&1 || true
	$(VENV)/bin/ruff check elmo_fast kernels tests bench

# Every Triton kernel variant of the original model compiled for sm_90a without a GPU (registers, spills, tensor
# cores, async copies, roofline sums) -> bench/results/kernel_report.{md,csv}. A few minutes on 2 cores.
kernel-report: setup
	$(PY) bench/kernel_report.py

# The CI subset (also run by `make test` via tests/test_kernel_report.py): one variant per kernel, rules enforced.
kernel-report-subset: setup
	$(PY) bench/kernel_report.py --subset --check --out build/kernel_report

# Every .cu file compiles for sm_90a with warnings as errors (no GPU needed).
cuda-compile-check:
	bash csrc/compile_check.sh

# On the GPU machine (python3 there has CUDA torch, triton, nvcc, ninja; no network): install, then named steps,
# each under its own time limit, results in 3 files under $OUT (4 with the lease's trace). `make gpu-check STEPS="selfcheck test-gpu"`
# runs a subset; `bash bench/gpu_check.sh --list` names them.
STEPS ?=
gpu-check:
	bash bench/gpu_check.sh $(STEPS)

# A lease's plan (bench/gpu_check.py LEASE): `make gpu-lease CALL=1`, then at once `make gpu-lease CALL=2`; each
# call about six and five minutes, both inside the device tool's 15 minutes a session with the machine's start.
CALL ?= 1
gpu-lease:
	bash bench/gpu_check.sh --lease $(CALL)

# Every gpu-check step on the CPU at the smallest sizes, from a fresh clone of HEAD (tests/test_gpu_check.py runs
# it in `make test`).
gpu-check-smoke: setup
	$(PY) bench/gpu_check.py --smoke --out $${OUT:-gpu_out_smoke} --budget 1200

clean:
	rm -rf build *.egg-info .pytest_cache gpu_out gpu_out_smoke
