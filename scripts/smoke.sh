#!/usr/bin/env bash
# Tiny cases of every kernel variant, each under a hard timeout (a hung kernel traps after
# ~10 s; with DG_JIT_DEBUG_TRACE=1 each case also prints where CTA 0 stopped).
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$PWD/.jit_cache}
python3 -c "import sys; sys.path.insert(0, 'scripts'); from bench_common import require_sm90; require_sm90('smoke.sh')" || exit 1
run() { timeout -s KILL 30 python3 scripts/smoke.py "$@" 2>&1 | grep -E "rel.err|Error|trace" | tail -3; }
for cfg in 0 1; do
  run nt 0,1,127,128,129,300,0,1000 256 512 $cfg
  run nn 300,0,77 256 512 $cfg
done
for cfg in 0 1 2 3 4; do run tn 100,0,300 256 512 $cfg; done
