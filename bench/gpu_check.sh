#!/usr/bin/env bash
# The GPU check (`make gpu-check`): bench/gpu_check.py does the work; see its docstring or `--list`.
#   bench/gpu_check.sh [STEP...] [--budget SECONDS] [--no-install]     results under $OUT (default ./gpu_out)
# Uses $PYTHON (default python3: on the GPU machine the one that holds the CUDA torch).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
exec "${PYTHON:-python3}" -u bench/gpu_check.py "$@"
