#!/usr/bin/env bash
# One full GPU check: install, GPU tests, SASS check, sanitizer, benchmarks. Prints a short
# table last. Run on the device machine from the repository root:
#   bash scripts/device_check.sh [pytest-args...]
# Writes logs under $OUT (or ./device_out).
set -uo pipefail
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$PWD/.jit_cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-install,tests,sass,sanitizer,bench}

has() { [[ ",$STEPS," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
nvcc --version | tail -1

if has install; then
  pip install -e . --no-deps --no-build-isolation -q 2>&1 | tail -2
fi
if has tests; then
  python3 -m pytest -q -x tests "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
  python3 tests/test_grouped_gemm.py 2>&1 | tee "$OUT/gemm_cases.log" | tail -60
fi
if has sass; then
  for d in "$DG_JIT_CACHE_DIR"/cache/sm90_*; do
    n=$(cuobjdump --dump-sass "$d/kernel.cubin" | grep -c HGMMA)
    l=$(cuobjdump --dump-sass "$d/kernel.cubin" | grep -cE '\b(LDL|STL)\b')
    echo "SASS $(basename "$d"): HGMMA=$n local=$l"
  done | tee "$OUT/sass.log"
fi
if has sanitizer; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --print-limit 5 python3 scripts/sanitize_case.py 2>&1 | tail -4 | sed "s/^/[$tool] /"
  done | tee "$OUT/sanitizer.log"
fi
if has bench; then
  python3 scripts/bench_gemm.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
fi
