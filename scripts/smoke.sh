#!/usr/bin/env bash
# Tiny cases of each kernel, each under a hard timeout (a hung kernel traps after ~10 s).
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$PWD/.jit_cache}
run() { timeout -s KILL 45 python3 scripts/smoke.py "$@" 2>&1 | tail -2; }
DG_JIT_DEBUG=1 run nt 128 128 64 128
run nt 128 128 512 128
run nt 300 256 512 256
run nt 0,1,127,128,129,300,0,1000 256 512 128
run nn 128 128 64 128
run nn 300,0,77 256 512 256
run tn 64 128 128 128
run tn 100,0,300 256 512 256
