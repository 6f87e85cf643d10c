#!/usr/bin/env bash
# A/B of the benchmarks on the device machine: this checkout against another one (BASE, e.g. an
# earlier commit unpacked with `git archive REV | tar -x -C .ext/base` and carried), in ROUNDS
# rounds. Inside a round the two trees alternate model by model, in ABBA order across rounds,
# so that slow drifts of the GPU's clocks hit both alike; each tree has its own kernel cache.
# Both run this checkout's benchmark scripts (they use public functions only): the same
# measurement for both.
#   BASE=.ext/base bash scripts/device_ab.sh
# Then prints, per figure, the median of the rounds for each tree and their ratio.
set -uo pipefail
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BASE=${BASE:?set BASE to the other checkout}
ROUNDS=${ROUNDS:-2}
MODELS=${MODELS:-30b,235b,v3}
ROUTING=${ROUTING:-uniform,skewed}
cp scripts/bench_gemm.py scripts/bench_mega_moe.py scripts/bench_common.py "$BASE/scripts/"
run() {  # tree directory, label, round, model
  local dir=$1 label=$2 round=$3 model=$4 extra=""
  [[ $model == "${MODELS%%,*}" ]] && extra="--launch-overhead"  # once per tree and round
  (cd "$dir" && export DG_JIT_CACHE_DIR=${JIT_CACHE_PREFIX:-$PWD/.jit_cache}_$label &&
   timeout -k 10 -s ABRT ${GEMM_LIMIT:-120} python3 -X faulthandler scripts/bench_gemm.py --models "$model" \
     --routing "$ROUTING" $extra >> "$OUT/${label}_${round}_gemm.log" 2>&1;
   timeout -k 10 -s ABRT ${MOE_LIMIT:-120} python3 -X faulthandler scripts/bench_mega_moe.py --models "$model" \
     --routing "$ROUTING" --no-liger >> "$OUT/${label}_${round}_moe.log" 2>&1)
}
for round in $(seq 1 "$ROUNDS"); do
  for model in ${MODELS//,/ }; do
    if (( round % 2 )); then run . new "$round" "$model"; run "$BASE" base "$round" "$model"
    else run "$BASE" base "$round" "$model"; run . new "$round" "$model"; fi
  done
  echo "round $round done at ${SECONDS} s"
done
python3 scripts/ab_compare.py "$OUT" | tee "$OUT/ab.txt"
(cd "$OUT" && tar -czf ab_logs.tgz ./*_gemm.log ./*_moe.log && rm ./*_gemm.log ./*_moe.log)  # one file comes back
