#!/usr/bin/env bash
# GPU check (`make gpu-check`), for the GPU machine: python3 there has a CUDA torch, triton, nvcc, ninja, pytest;
# no network is needed. Steps, each logged under $OUT (default ./gpu_out):
#   1. build elmo_fast._C in place (setup.py build_ext --inplace, ELMO_FAST_BUILD_CUDA=1)  -> build.log
#   2. python3 -m pytest -m gpu tests                                                        -> pytest_gpu.log, junit
#   3. every bench/bench_*.py GPU benchmark (each appends CSV rows to $OUT/<name>.csv)        -> bench_<name>.log
# then prints a short summary table last. Exit status: non-zero if the build or the tests failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
declare -a SUMMARY=()
note() { SUMMARY+=("$(printf '%-34s %s' "$1" "$2")"); }

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain --untracked-files=no 2>/dev/null | head -c 1 | sed 's/./(dirty)/')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: n/a"
  nvcc --version 2>/dev/null | tail -1
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and torch.cuda.get_device_name())'
  "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. build
echo "== build elmo_fast._C (log: $OUT/build.log)"
start=$(date +%s)
if ELMO_FAST_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-8}" "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  build_ok=1
  note "build elmo_fast._C" "ok ($(( $(date +%s) - start ))s)"
else
  build_ok=0
  note "build elmo_fast._C" "FAILED ($(( $(date +%s) - start ))s), see build.log"
  tail -30 "$OUT/build.log"
fi
"$PY" -c 'import elmo_fast._C as C; print("elmo_fast._C:", C.__file__, [n for n in dir(C) if not n.startswith("_")])' \
  >>"$OUT/build.log" 2>&1 && tail -1 "$OUT/build.log"

# 2. GPU tests
echo "== pytest -m gpu (log: $OUT/pytest_gpu.log)"
start=$(date +%s)
"$PY" -m pytest -m gpu -rs -q --junitxml="$OUT/pytest_gpu.xml" tests >"$OUT/pytest_gpu.log" 2>&1
test_rc=$?
note "pytest -m gpu tests" "rc=$test_rc: $(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$OUT/pytest_gpu.log" | tail -1 | tr -d '=') ($(( $(date +%s) - start ))s)"
tail -25 "$OUT/pytest_gpu.log"

# 3. benchmarks
export ELMO_FAST_BENCH_DIR="$OUT"  # bench/common.py appends every CSV row under $OUT/<name>.csv
for b in bench/bench_*.py; do
  [[ -f "$b" ]] || continue
  [[ "$b" == bench/bench_cpu_embedding.py ]] && continue  # CPU-only (pytest-benchmark vs AllenNLP)
  name="$(basename "${b%.py}")"
  echo "== $b (log: $OUT/$name.log, csv: $OUT/${name#bench_}.csv)"
  start=$(date +%s)
  if "$PY" "$b" >"$OUT/$name.log" 2>&1; then
    note "$name" "ok ($(( $(date +%s) - start ))s)"
  else
    note "$name" "FAILED rc=$? ($(( $(date +%s) - start ))s), see $name.log"
  fi
  cat "$OUT/$name.log"
done

echo
echo "== summary (outputs in $OUT)"
head -3 "$OUT/env.txt"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
if [[ -f "$OUT/lstmp_cuda.csv" ]]; then
  echo "  lstmp chain, bf16, H=4096 P=512 T=20: per-step us (p50)"
  "$PY" - "$OUT/lstmp_cuda.csv" <<'PYEOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
keys = sorted({(r["mode"], int(r["B"])) for r in rows})
provs = sorted({r["provider"] for r in rows})
print("    " + f"{'mode':>8} {'B':>4} " + " ".join(f"{p:>11}" for p in provs))
for mode, B in keys:
    cells = []
    for p in provs:
        m = [r for r in rows if r["mode"] == mode and int(r["B"]) == B and r["provider"] == p]
        cells.append(f"{(m[-1]['us_per_step'] or 'err') if m else '-':>11}")
    print("    " + f"{mode:>8} {B:>4} " + " ".join(cells))
PYEOF
fi
[[ $build_ok -eq 1 && $test_rc -eq 0 ]]
