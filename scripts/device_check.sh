#!/usr/bin/env bash
# One full GPU check, run on the device machine from the repository root:
#   bash scripts/device_check.sh
# Steps (STEPS=install,precompile,tests,sass,sanitizer,bench,fp8_bench,quant_bench,moe_bench,train by
# default, and ncu_fp8 and microbench on request; TEST_GROUPS picks test groups): the offline editable install, imported from another
# directory; every kernel variant compiled in parallel (python -m deep_gemm.precompile); the GPU
# tests; WGMMA / local-memory check of every cached GEMM; compute-sanitizer memcheck and
# racecheck on a small case; the GEMM benchmark (BENCH_ARGS), its FP8 rows (FP8_BENCH_ARGS);
# the FP8 quantization benchmark; the MoE-layer benchmark (MOE_BENCH_ARGS) with its plot;
# scripts/train_moe.py (TRAIN_ARGS; transformers' eager backend as well by default, whose loss
# curve against grouped_mm's shows how far two bf16 implementations drift apart anyway).
# Every step runs under a hard timeout so a hung kernel cannot eat the device lease. Logs go
# under $OUT (or ./device_out); the benchmark table is printed last. Benchmarks that outrun their
# limit get SIGABRT first, so faulthandler prints where every thread stood.
set -uo pipefail
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$PWD/.jit_cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-install,precompile,tests,sass,sanitizer,bench,fp8_bench,quant_bench,moe_bench,train}

has() { [[ ",$STEPS," == *",$1,"* ]]; }
python3 -c "import sys; sys.path.insert(0, 'scripts'); from bench_common import require_sm90; require_sm90('device_check.sh')" || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
nvcc --version | tail -1

if has install; then  # as a user without network would: no dependencies, no build isolation
  python3 -m pip install -e . --no-deps --no-build-isolation -q 2>&1 | grep -v WARNING
  (cd /tmp && python3 -c "import deep_gemm, megamoe_bwd; print('installed:', deep_gemm.__file__, deep_gemm.mega_moe_backward.__module__)")
fi
if has precompile; then
  python3 -m deep_gemm.precompile > "$OUT/precompile.log" 2>&1 || tail -20 "$OUT/precompile.log"
  tail -1 "$OUT/precompile.log"
fi
if has tests; then
  # Groups run in separate processes under their own hard limits: a kernel that traps poisons
  # its CUDA context and a hang kills its process, and neither should take later groups along.
  run_tests() {
    local name=$1 limit=$2; shift 2
    [[ ",${TEST_GROUPS:-gemm,gather,swiglu,moe,integ,fp8,other}," == *",$name,"* ]] || return 0
    timeout -s KILL "$limit" python3 -m pytest -q -rf --maxfail=30 --timeout 60 --timeout-method=thread \
      -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest_$name.log" | tail -${TEST_TAIL:-6} | sed "s/^/[$name] /"
  }
  run_tests gemm 120 tests/test_grouped_gemm.py -k "not gathered_rows and not swiglu"
  run_tests gather 90 tests/test_grouped_gemm.py -k "gathered_rows and not swiglu"
  run_tests swiglu 60 tests/test_grouped_gemm.py -k swiglu
  run_tests moe 210 tests/test_mega_moe.py
  run_tests integ 420 tests/test_integrations.py  # (torch.compile of three models)
  run_tests fp8 360 tests/test_fp8_gemm.py tests/test_fp8_quant.py tests/test_mega_moe_fp8.py
  run_tests other 240 tests --ignore=tests/test_grouped_gemm.py --ignore=tests/test_mega_moe.py \
    --ignore=tests/test_integrations.py --ignore=tests/test_fp8_gemm.py --ignore=tests/test_fp8_quant.py \
    --ignore=tests/test_mega_moe_fp8.py
fi
if has sass; then
  for d in "$DG_JIT_CACHE_DIR"/cache/sm90_*; do
    sass=$(cuobjdump --dump-sass "$d/kernel.cubin")
    echo "SASS $(basename "$d"): GMMA=$(grep -cE '[HQ]GMMA' <<<"$sass") local=$(grep -cE '\b(LDL|STL)\b' <<<"$sass")"
  done > "$OUT/sass.log"
  echo "SASS: $(wc -l < "$OUT/sass.log") GEMM cubins, $(grep -cE 'GMMA=0 |local=[1-9]' "$OUT/sass.log") lack WGMMA (HGMMA bf16, QGMMA fp8) or use local memory"
fi
if has sanitizer; then
  for tool in memcheck racecheck; do
    timeout -s KILL 120 compute-sanitizer --tool $tool --report-api-errors no python3 scripts/sanitize_case.py 2>&1 \
      | grep -E "SUMMARY|Invalid|hazard" | head -5 | sed "s/^/[$tool] /"
  done | tee "$OUT/sanitizer.log"
fi
if has bench; then
  timeout -k 10 -s ABRT ${BENCH_LIMIT:-400} python3 -X faulthandler scripts/bench_gemm.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -50
fi
if has fp8_bench; then
  timeout -k 10 -s ABRT ${FP8_BENCH_LIMIT:-400} python3 -X faulthandler scripts/bench_gemm.py --precision fp8 \
    ${FP8_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_fp8.log" | tail -40
fi
if has quant_bench; then
  timeout -k 10 -s ABRT ${QUANT_BENCH_LIMIT:-200} python3 -X faulthandler scripts/bench_fp8_quant.py 2>&1 \
    | tee "$OUT/bench_fp8_quant.log" | tail -16
fi
if has moe_bench; then
  timeout -k 10 -s ABRT ${MOE_BENCH_LIMIT:-300} python3 -X faulthandler scripts/bench_mega_moe.py --plot "$OUT/mega_moe.png" ${MOE_BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench_mega_moe.log" | tail -20
fi
if has ncu_fp8; then  # (not in the default steps) Nsight Compute on the 30B forward GEMM: ours, and upstream's with NCU_UPSTREAM=DIR
  sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy"
  # (L2 reads from the SMs: the FP8 GEMM's time follows them, docs/PERF.md session 26)
  sections="$sections --metrics lts__t_sectors_srcunit_tex_op_read.sum.per_second,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__m_xbar2l1tex_read_bytes.sum.per_second"
  for who in ours ${NCU_UPSTREAM:+upstream}; do
    if [[ $who == ours ]]; then kernel=dg_sm90_fp8_m_grouped; extra=; else kernel=fp8_gemm_1d2d; extra="--upstream $NCU_UPSTREAM"; fi
    timeout -s KILL 240 ncu --target-processes all -k "regex:$kernel" --launch-skip 3 --launch-count 1 $sections \
      python3 scripts/bench_gemm.py --precision fp8 --models 30b --routing uniform --only fwd1 $extra > "$OUT/ncu_fp8_$who.log" 2>&1
    echo "[ncu $who] $(grep -E '^  [a-z_]+.*\(' "$OUT/ncu_fp8_$who.log" | head -1)"
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Achieved Occupancy|Issue Slots Busy|No Eligible|Registers Per Thread|lts__t_sectors_srcunit|xbar2l1tex" \
      "$OUT/ncu_fp8_$who.log" | head -18 | sed "s/^/[ncu $who] /"
  done
fi
if has microbench; then  # (not in the default steps) the FP8 mainloop's MMA structure and its stage-ring skeleton (docs/PERF.md, session 42)
  for bench in fp8_mma_structure fp8_mainloop_ring; do
    nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I deep_gemm/include \
      scripts/microbench/$bench.cu -o "$OUT/$bench" -lcuda || continue
    for ms in 5 400; do timeout -s KILL 120 "$OUT/$bench" $ms; done 2>&1 | tee -a "$OUT/microbench.log"
  done
fi
if has train; then
  timeout -k 10 -s ABRT ${TRAIN_LIMIT:-300} python3 -X faulthandler scripts/train_moe.py --plot "$OUT/train_moe.png" \
    ${TRAIN_ARGS:---backends grouped_mm,megamoe,eager} 2>&1 | tee "$OUT/train_moe.log" | tail -8
fi
