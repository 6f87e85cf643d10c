#!/usr/bin/env bash
# A/B of the benchmarks on the device machine: this checkout against another one (BASE, e.g. an
# earlier commit unpacked with `git archive REV | tar -x -C .ext/base` and carried), in ROUNDS
# alternating rounds (ABBA order), each tree with its own kernel cache. Both run this checkout's
# benchmark scripts (they use public functions only), so the measurement is the same:
#   BASE=.ext/base bash scripts/device_ab.sh
# Then prints, per figure, the median of the rounds for each tree and their ratio.
set -uo pipefail
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BASE=${BASE:?set BASE to the other checkout}
ROUNDS=${ROUNDS:-2}
GEMM_ARGS=${GEMM_ARGS:---models 30b,235b,v3 --routing uniform,skewed}
MOE_ARGS=${MOE_ARGS:---models 30b,235b,v3 --routing uniform,skewed --no-liger}
cp scripts/bench_gemm.py scripts/bench_mega_moe.py scripts/bench_common.py "$BASE/scripts/"
run() {  # tree, label, round
  local dir=$1 label=$2 round=$3
  (cd "$dir" && export DG_JIT_CACHE_DIR=${JIT_CACHE_PREFIX:-$PWD/.jit_cache}_$label &&
   timeout -k 10 -s ABRT ${GEMM_LIMIT:-200} python3 -X faulthandler scripts/bench_gemm.py $GEMM_ARGS > "$OUT/${label}_${round}_gemm.log" 2>&1;
   timeout -k 10 -s ABRT ${MOE_LIMIT:-150} python3 -X faulthandler scripts/bench_mega_moe.py $MOE_ARGS > "$OUT/${label}_${round}_moe.log" 2>&1)
  echo "round $round $label: $(grep -c ' ours\| fwd' "$OUT/${label}_${round}_gemm.log") gemm lines, $(grep -c ' ours ' "$OUT/${label}_${round}_moe.log") moe lines"
}
for round in $(seq 1 "$ROUNDS"); do
  if (( round % 2 )); then run . new "$round"; run "$BASE" base "$round"; else run "$BASE" base "$round"; run . new "$round"; fi
done
python3 scripts/ab_compare.py "$OUT" | tee "$OUT/ab.txt"
