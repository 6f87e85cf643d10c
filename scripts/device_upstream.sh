#!/usr/bin/env bash
# The patch workflow end to end on the GPU machine (README, "Patch an upstream checkout"), on an
# upstream DeepGEMM checkout at the pinned commit with its submodules' include trees, carried in
# (UPSTREAM, default .ext/deepgemm; never committed):
#   bash scripts/device_upstream.sh
# 1. the image's default compilers: what each links, and the apply script's verdict;
# 2. apply_patches.sh with the system gcc (upstream's develop.sh builds in place);
# 3. from the patched checkout: tests/test_mega_moe_bwd.py;
# 4. bench_gemm.py --precision fp8 with upstream's FP8 m-grouped GEMM beside ours;
# 5. upstream's own Hopper tests on the patched checkout, each test function in its own process, all at
# once (JIT compiles dominate their time: ~3.5 s a case, one CPU core each); their perf lines are
# printed under that contention and are not measurements. UPSTREAM_TEST_LIMIT seconds in all.
cat > /tmp/upstream_case.py <<'PY'
import random, sys
import torch
sys.path.insert(0, "tests")
module = __import__(sys.argv[1])
torch.manual_seed(0)
random.seed(0)
getattr(module, sys.argv[2])()
print(f"{sys.argv[1]}.{sys.argv[2]}: done")
PY
cases="test_bf16.test_cublaslt_gemm"
for t in test_bf16 test_fp8_fp4; do
  for fn in test_gemm test_m_grouped_gemm_contiguous test_m_grouped_gemm_masked test_k_grouped_gemm_contiguous; do
    cases+=" $t.$fn"
  done
done
for c in $cases; do
  (timeout -k 10 "${UPSTREAM_TEST_LIMIT:-300}" python /tmp/upstream_case.py ${c%.*} ${c#*.} > "$OUT/upstream_$c.log" 2>&1
   echo "rc $?" >> "$OUT/upstream_$c.log") &
done
wait
for f in "$OUT"/upstream_test_*.log; do
  echo "[upstream $(basename "$f" .log | cut -d_ -f2-)] $(tail -1 "$f"), $(grep -c '> Perf' "$f") perf lines; $(tail -2 "$f" | head -1 | cut -c1-110)"
done
