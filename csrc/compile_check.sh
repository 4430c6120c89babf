#!/usr/bin/env bash
# Compile-check csrc/ without a GPU (`make cuda-compile-check`):
#   1. every .cu under csrc/ -> sm_90a object with nvcc, warnings as errors (-Werror all-warnings, host -Wall -Wextra),
#      plus ptxas resource usage (registers, spills) in the log;
#   2. every .cpp under csrc/bindings/ -> object file against the torch headers of $PYTHON (the CPU wheel ships
#      the CUDA headers too: c10/cuda/CUDAGuard.h, ATen/cuda/CUDAContext.h), the CUDA toolkit headers and
#      Python.h, with g++ -Wall -Wextra -Werror. Nothing is linked: the CPU wheel has no libc10_cuda / libtorch_cuda.
# Env: NVCC (default nvcc), CXX (default g++), PYTHON (default .venv/bin/python, else python3),
#      ELMO_FAST_CC_OUT (object/log dir, default a temp dir), ELMO_FAST_CC_SKIP_BINDINGS=1 to check only the .cu.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
NVCC="${NVCC:-nvcc}"
CXX="${CXX:-g++}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUTDIR="${ELMO_FAST_CC_OUT:-$(mktemp -d)}"
mkdir -p "$OUTDIR"
command -v "$NVCC" >/dev/null || { echo "compile_check: nvcc not found (NVCC=$NVCC)" >&2; exit 2; }
CUDA_BIN="$(dirname "$(readlink -f "$(command -v "$NVCC")")")"
CUDA_INC=""
for cand in "${CUDA_HOME:-}/include" "$CUDA_BIN/../include" /usr/local/cuda/include; do
  if [[ -f "$cand/cuda_runtime.h" ]]; then CUDA_INC="$(cd "$cand" && pwd)"; break; fi
done

GENCODE="-gencode=arch=compute_90a,code=sm_90a"
status=0
pids=()
names=()

echo "== nvcc $("$NVCC" --version | tail -1)"
while IFS= read -r -d '' cu; do
  obj="$OUTDIR/$(basename "${cu%.cu}").o"
  log="$OUTDIR/$(basename "${cu%.cu}").nvcc.log"
  (
    "$NVCC" -std=c++17 -O3 $GENCODE -Werror all-warnings -Xcompiler=-Wall,-Wextra -Xptxas=-v \
      -Icsrc/include -c "$cu" -o "$obj" >"$log" 2>&1
  ) &
  pids+=($!)
  names+=("$cu:$log")
done < <(find csrc -name '*.cu' -print0 | sort -z)

if [[ "${ELMO_FAST_CC_SKIP_BINDINGS:-0}" != "1" ]]; then
  TORCH_INCS="$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join("-isystem " + p for p in include_paths()))')"
  PY_INC="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  [[ -n "$CUDA_INC" ]] || { echo "compile_check: no CUDA include dir with cuda_runtime.h" >&2; exit 2; }
  # The CPU wheel lacks one generated header of c10/cuda (CMake writes it in CUDA builds); a shim with the
  # content of a shared-library CUDA build stands in for it when missing. Only the compile check uses it.
  SHIM="$OUTDIR/shim"
  TORCH_INC0="$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(include_paths()[0])')"
  if [[ ! -f "$TORCH_INC0/c10/cuda/impl/cuda_cmake_macros.h" ]]; then
    mkdir -p "$SHIM/c10/cuda/impl"
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$SHIM/c10/cuda/impl/cuda_cmake_macros.h"
    TORCH_INCS="$TORCH_INCS -isystem $SHIM"
    echo "== note: c10/cuda/impl/cuda_cmake_macros.h missing from this torch (CPU wheel); using a shim"
  fi
  echo "== $CXX $("$CXX" --version | head -1); torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
  while IFS= read -r -d '' cpp; do
    obj="$OUTDIR/$(basename "${cpp%.cpp}").o"
    log="$OUTDIR/$(basename "${cpp%.cpp}").cxx.log"
    (
      # shellcheck disable=SC2086
      "$CXX" -std=c++17 -O0 -fPIC -Wall -Wextra -Werror $TORCH_INCS -isystem "$PY_INC" -isystem "$CUDA_INC" \
        -Icsrc/include -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -c "$cpp" -o "$obj" >"$log" 2>&1
    ) &
    pids+=($!)
    names+=("$cpp:$log")
  done < <(find csrc/bindings -name '*.cpp' -print0 | sort -z)
fi

for i in "${!pids[@]}"; do
  src="${names[$i]%%:*}"
  log="${names[$i]#*:}"
  if wait "${pids[$i]}"; then
    echo "ok    $src"
    grep -E "Used [0-9]+ registers|spill" "$log" | sed 's/^/      /' | sort -u || true
  else
    echo "FAIL  $src"
    sed 's/^/      /' "$log"
    status=1
  fi
done
[[ $status -eq 0 ]] && echo "compile_check: all sources compile (objects in $OUTDIR; nothing linked or run)"
exit $status
