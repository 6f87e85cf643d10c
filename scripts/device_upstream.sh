#!/usr/bin/env bash
# The patch workflow end to end on the GPU machine (README, "Patch an upstream checkout"), on an
# upstream DeepGEMM checkout at the pinned commit with its submodules' include trees, carried in
# (UPSTREAM, default .ext/deepgemm; never committed):
#   bash scripts/device_upstream.sh
# 1. the image's default compilers: what each links, and the apply script's verdict;
# 2. apply_patches.sh with the system gcc (upstream's develop.sh builds in place);
# 3. from the patched checkout: tests/test_mega_moe_bwd.py;
# 4. bench_gemm.py --precision fp8 with upstream's FP8 m-grouped GEMM beside ours;
# 5. upstream's own Hopper tests, one process per test function, UPSTREAM_JOBS at a time (UPSTREAM_TEST_LIMIT each).
# Logs under $OUT (or ./device_out).
set -uo pipefail
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
repo=$PWD
src=${UPSTREAM:-.ext/deepgemm}
dg=/tmp/deepgemm_patched
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$repo/.jit_cache}
command -v python >/dev/null || { mkdir -p /tmp/pybin && ln -sf "$(command -v python3)" /tmp/pybin/python && export PATH=/tmp/pybin:$PATH; }

rm -rf "$dg" && cp -r "$src" "$dg"
echo "CC=${CC:-} CXX=${CXX:-}; python loads $(python3 -c "import torch; print(next(l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l))")"
for c in "${CC:-gcc}" "${CXX:-g++}" /usr/bin/g++; do echo "  $c links $(readlink -f "$($c -print-file-name=libstdc++.so.6)")"; done
echo "[default compilers] $(bash scripts/apply_patches.sh "$dg" --no-build 2>&1 | tail -2 | tr '\n' ' ')"

CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared" timeout "${BUILD_LIMIT:-600}" bash scripts/apply_patches.sh "$dg" \
  > "$OUT/upstream_build.log" 2>&1
echo "[system gcc] apply + develop.sh: rc $? ($(tail -1 "$OUT/upstream_build.log"))"

cd "$dg" || exit 1
export PYTHONPATH=$dg
python -c "import deep_gemm, megamoe_bwd; print('patched install:', deep_gemm.__file__, deep_gemm.__version__,
deep_gemm.mega_moe_backward.__module__, megamoe_bwd._kernels.PACKAGE.__name__)" 2>&1 | tail -2
timeout -k 10 300 python "$repo/tests/test_mega_moe_bwd.py" > "$OUT/test_mega_moe_bwd.log" 2>&1
echo "[ours, from the patched checkout] rc $? ($(tail -1 "$OUT/test_mega_moe_bwd.log"))"

# 4. upstream's FP8 m-grouped GEMM beside ours and torch's, in one process (UPSTREAM_BENCH=0 skips it).
[[ ${UPSTREAM_BENCH:-1} == 0 ]] || (cd "$repo" && PYTHONPATH= timeout -k 10 -s ABRT 400 python3 -X faulthandler \
  scripts/bench_gemm.py --precision fp8 --routing uniform --only fwd1,fwd2,dgrad1,dgrad2 --upstream "$dg" 2>&1 \
  | tee "$OUT/bench_vs_deepgemm.log" | tail -16)
# 5. upstream's own Hopper tests on the patched checkout, each test function in its own process,
# UPSTREAM_JOBS (default 3) at a time: JIT compiles dominate their time (~3.5 s a case, one CPU
# core each), and nine at once ran out of GPU memory. Their perf lines are printed under that
# contention and are not measurements. UPSTREAM_TEST_LIMIT seconds each; UPSTREAM_CASES picks
# "module.function" cases (default: all nine).
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
export OUT UPSTREAM_TEST_LIMIT=${UPSTREAM_TEST_LIMIT:-300}
printf '%s\n' ${UPSTREAM_CASES:-$cases} | xargs -P "${UPSTREAM_JOBS:-3}" -I{} bash -c \
  'c={}; timeout -k 10 "$UPSTREAM_TEST_LIMIT" python /tmp/upstream_case.py ${c%.*} ${c#*.} > "$OUT/upstream_$c.log" 2>&1;
   echo "rc $?" >> "$OUT/upstream_$c.log"' 
for f in "$OUT"/upstream_test_*.log; do
  echo "[upstream $(basename "$f" .log | cut -d_ -f2-)] $(tail -1 "$f"), $(grep -c '> Perf' "$f") perf lines; $(tail -2 "$f" | head -1 | cut -c1-110)"
done
