"""The JIT: every kernel variant a launcher can pick compiles for sm_90a without spills, and
the disk cache returns a compiled kernel without recompiling. Needs nvcc, not a GPU."""
from __future__ import annotations

import os
import re
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deep_gemm.gemm import k_grouped_bf16, m_grouped_bf16  # noqa: E402
from deep_gemm.moe import glue  # noqa: E402
from deep_gemm.jit import compile_cubin  # noqa: E402
from deep_gemm.jit.compiler import cache_key, nvcc_path  # noqa: E402

try:
    nvcc_path()
    HAS_NVCC = True
except Exception:
    HAS_NVCC = False
requires_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")


def all_kernels():
    """(label, builder) for every variant the launchers can choose."""
    out = []
    for config in m_grouped_bf16.all_configs():
        for mn_major in (False, True):
            for gather in (False, True):
                out.append((f"m_grouped_{'nn' if mn_major else 'nt'}_{config.label}{'_gather' if gather else ''}",
                            lambda c=config, mn=mn_major, g=gather: m_grouped_bf16.get_kernel(c, mn, g)))
    for config in m_grouped_bf16.SWIGLU_CONFIGS:
        for gather in (False, True):
            out.append((f"m_grouped_nt_swiglu_{config.label}{'_gather' if gather else ''}",
                        lambda c=config, g=gather: m_grouped_bf16.get_kernel(c, False, g, True)))
    for block_n in (128, 256):  # the SwiGLU-backward epilogue: get_swiglu_bwd_config(N)
        for gather in (False, True):
            out.append((f"m_grouped_nn_swiglu_bwd_{block_n}{'_gather' if gather else ''}",
                        lambda b=block_n, g=gather: m_grouped_bf16.get_kernel(
                            m_grouped_bf16.make_m_grouped_config(b), True, g, False, True)))
    for dtype in (torch.float32, torch.bfloat16):
        for config in k_grouped_bf16.all_configs(dtype):
            for accumulate in (False, True):
                for gather in ("", "a") if config.multicast_b else ("", "a", "b"):  # which operand's rows are gathered
                    out.append((f"k_grouped_{config.label}_{str(dtype)[6:]}_{'acc' if accumulate else 'set'}"
                                f"{'_gather_' + gather if gather else ''}",
                                lambda c=config, t=dtype, a=accumulate, g=gather:
                                k_grouped_bf16.get_kernel(c, t, a, g == "a", g == "b")))
    out += glue.all_kernels()
    return out


def resource_report(kernel) -> dict:
    log = (kernel.cubin.parent / "ptxas.log").read_text()
    return {
        "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill", log)),
        "stack_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes stack frame", log)),
    }


@requires_nvcc
@pytest.mark.parametrize("label,build", all_kernels(), ids=[k for k, _ in all_kernels()])
def test_kernel_compiles_without_spills(label, build):
    report = resource_report(build())
    assert report["spill_bytes"] == 0 and report["stack_bytes"] == 0, report


@requires_nvcc
def test_cache_hit_skips_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    source = 'extern "C" __global__ void kernel(int* x) { *x = 1; }\n'
    start = time.perf_counter()
    first = compile_cubin("tiny", source)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    second = compile_cubin("tiny", source)
    hit_s = time.perf_counter() - start
    assert first == second and first.exists()
    assert hit_s < min(compile_s, 0.05)
    assert cache_key("tiny", source) != cache_key("tiny", source + "\n")


def _compile_in_subprocess(cache: str, source: str) -> str:
    os.environ["DG_JIT_CACHE_DIR"] = cache
    return str(compile_cubin("race", source))


@requires_nvcc
def test_concurrent_compiles_share_one_cache_entry(tmp_path):
    # Several processes compiling the same new kernel at once: each gets a complete cubin,
    # one entry lands in the cache, and no temporary directory is left behind.
    import multiprocessing as mp
    source = 'extern "C" __global__ void kernel(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    with mp.get_context("spawn").Pool(4) as pool:
        paths = pool.starmap(_compile_in_subprocess, [(str(tmp_path), source)] * 4)
    assert len(set(paths)) == 1
    entries = list((tmp_path / "cache").iterdir())
    assert [e.name for e in entries] == [os.path.basename(os.path.dirname(paths[0]))]
    cubin = open(paths[0], "rb").read()
    assert cubin[:4] == b"\x7fELF"


@requires_nvcc
def test_ptxas_check_rejects_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DG_JIT_PTXAS_CHECK", "1")
    # A runtime-indexed local array must live in local memory (a stack frame).
    source = ('extern "C" __global__ void kernel(int* x, int i) {\n'
              '    int buf[64];\n    for (int j = 0; j < 64; ++j) buf[x[j] & 63] = j;\n    x[0] = buf[i & 63];\n}\n')
    from deep_gemm.jit import CompileError
    with pytest.raises(CompileError, match="local memory"):
        compile_cubin("stack", source)


if __name__ == "__main__":
    print(f"{'kernel':<32} {'regs':>5} {'spill B':>8} {'stack B':>8}")
    for label, build in all_kernels():
        r = resource_report(build())
        print(f"{label:<32} {r['registers']:>5} {r['spill_bytes']:>8} {r['stack_bytes']:>8}")
