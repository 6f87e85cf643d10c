"""The JIT: every kernel variant a launcher can pick compiles for sm_90a without spills or
serialized WGMMAs (and the FP8 GEMMs' SASS holds FP8 MMAs), its parameter struct and shared memory
match what the launcher packs and asks for (or it does not compile), and the disk cache returns a
compiled kernel without recompiling. Needs nvcc (and for the SASS nvdisasm or cuobjdump), not a GPU."""
from __future__ import annotations

import os
import re
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from deep_gemm.gemm import m_grouped_bf16  # noqa: E402
from deep_gemm.jit import CompileError, compile_cubin  # noqa: E402
from deep_gemm.jit.compiler import cache_key, nvcc_path  # noqa: E402
from deep_gemm.jit.params import ParamsStruct  # noqa: E402
from deep_gemm.jit.runtime import build_kernel  # noqa: E402
from deep_gemm.precompile import all_kernels, resource_report  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from kloop_sass import disassemble, find_disassembler, fp8_gemm_kernels  # noqa: E402

try:
    nvcc_path()
    HAS_NVCC = True
except Exception:
    HAS_NVCC = False
requires_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")


@requires_nvcc
@pytest.mark.parametrize("label,build", all_kernels(), ids=[k for k, _ in all_kernels()])
def test_kernel_compiles_without_spills_or_serialized_mmas(label, build):
    report = resource_report(build())
    assert report["spill_bytes"] == 0 and report["stack_bytes"] == 0 and not report["serialized_wgmma"], report


DISASSEMBLER = find_disassembler()
FP8_GEMMS = list(fp8_gemm_kernels(deep_gemm).items())


@requires_nvcc
@pytest.mark.skipif(DISASSEMBLER is None, reason="needs nvdisasm or cuobjdump")
@pytest.mark.parametrize("label,build", FP8_GEMMS, ids=[k for k, _ in FP8_GEMMS])
def test_fp8_gemms_issue_fp8_mmas_and_use_no_local_memory(label, build):
    sass = disassemble(str(build().cubin), DISASSEMBLER)
    assert re.search(r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3", sass), "no e4m3 WGMMA in the SASS"
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory"


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
    with pytest.raises(CompileError, match="local memory"):
        compile_cubin("stack", source)


def test_params_struct_lays_fields_out_as_cpp_does():
    params = ParamsStruct("Example", [("n", "u32"), ("map", "tensor_map"), ("ptr", "ptr"), ("k", "u32")])
    assert params.offsets == {"n": 0, "map": 128, "ptr": 256, "k": 264}
    assert params.size == 384  # rounded up to the tensor map's 128-byte alignment
    data = params.pack(n=7, map=bytes(range(128)), ptr=2**40 + 3, k=9)
    assert data[:4] == (7).to_bytes(4, "little") and data[128:256] == bytes(range(128))
    assert data[256:264] == (2**40 + 3).to_bytes(8, "little") and data[264:268] == (9).to_bytes(4, "little")
    with pytest.raises(TypeError, match="missing fields \\['k'\\]"):
        params.pack(n=7, map=bytes(128), ptr=0)


@requires_nvcc
def test_a_launcher_that_disagrees_with_the_kernel_does_not_compile(tmp_path, monkeypatch):
    """The JIT asserts the parameter struct's layout and the shared-memory size in the kernel's
    source: a launcher whose idea of either is wrong gets a compile error, not a bad launch."""
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    config = m_grouped_bf16.get_config(256)
    kernel_type = (f"deep_gemm::Sm90BF16MGroupedGemm<256, {config.num_stages}, deep_gemm::mma::Major::kKMajor, "
                   "deep_gemm::producer::TmaRows, deep_gemm::epilogue::BF16TensorStore<256>>")
    fields = list(m_grouped_bf16.PARAMS.offsets.items())
    swapped = ParamsStruct(m_grouped_bf16.PARAMS.cpp_name,
                           [(name, m_grouped_bf16.PARAMS.kinds[name]) for name, _ in fields[:4]]
                           + [("act", "ptr"), ("d", "ptr")]
                           + [(name, m_grouped_bf16.PARAMS.kinds[name]) for name, _ in fields[6:]])
    header, entry = "sm90_bf16_m_grouped_gemm.cuh", "dg_sm90_bf16_m_grouped_gemm"
    with pytest.raises(CompileError, match="the launcher packs it at"):
        build_kernel(header, entry, kernel_type, swapped, 384, config.smem_bytes)
    with pytest.raises(CompileError, match="dynamic shared memory"):
        build_kernel(header, entry, kernel_type, m_grouped_bf16.PARAMS, 384, config.smem_bytes - 1024)


@requires_nvcc
def test_timeline_builds_of_the_fp8_gemms_compile(tmp_path, monkeypatch):
    """DG_JIT_TIMELINE=1 (scripts/timeline.py) builds the FP8 GEMMs with their clock records and
    summed waits: the forms timeline.py runs compile without spills; the default builds do not
    carry them."""
    from deep_gemm.gemm import k_grouped_fp8, m_grouped_fp8
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DG_JIT_TIMELINE", "1")
    # (__wrapped__: past the launchers' caches, which hold the default builds)
    for kernel in (k_grouped_fp8.get_kernel.__wrapped__(torch.float32, False),
                   m_grouped_fp8.get_kernel.__wrapped__(m_grouped_fp8.FP8_TMA_ROWS, 256),
                   m_grouped_fp8.get_kernel.__wrapped__(m_grouped_fp8.FP8_GATHERED_ROWS, 256)):
        report = resource_report(kernel)
        assert report["spill_bytes"] == 0 and report["stack_bytes"] == 0, report
    monkeypatch.setenv("DG_JIT_TIMELINE", "0")
    source = k_grouped_fp8.get_kernel.__wrapped__(torch.float32, False).cubin.with_suffix(".cu").read_text()
    assert "DG_TIMELINE" not in source


if __name__ == "__main__":
    print(f"{'kernel':<32} {'regs':>5} {'spill B':>8} {'stack B':>8}")
    for label, build in all_kernels():
        r = resource_report(build())
        print(f"{label:<32} {r['registers']:>5} {r['spill_bytes']:>8} {r['stack_bytes']:>8}")
