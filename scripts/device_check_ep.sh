#!/usr/bin/env bash
# Expert-parallel checks on a machine with >= 2 GPUs (e.g. nvidia-h200-x2), from the repo root:
#   NUM_PROCESSES=2 bash scripts/device_check_ep.sh
# The EP spec test, then the EP benchmark. NVLink multicast stays off.
set -uo pipefail
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$PWD/.jit_cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=${NUM_PROCESSES:-2}
nvidia-smi --query-gpu=index,name --format=csv,noheader
nvidia-smi topo -m 2>&1 | head -5
pip install -e . --no-deps --no-build-isolation -q 2>&1 | grep -v WARNING
timeout -k 10 -s ABRT ${EP_TEST_LIMIT:-300} python3 -X faulthandler tests/test_mega_moe_ep.py --num-processes "$N" 2>&1 | tee "$OUT/ep_test.log" | tail -8
timeout -k 10 -s ABRT ${EP_BENCH_LIMIT:-400} python3 -X faulthandler scripts/bench_mega_moe.py --num-processes "$N" ${EP_BENCH_ARGS:---models 30b --routing uniform} \
  2>&1 | tee "$OUT/ep_bench.log" | tail -10
