"""nvcc -> cubin, with an on-disk cache shared by processes.

A kernel is a generated `.cu` (an `extern "C"` entry that instantiates a header's template).
Its cubin is cached under ``$DG_JIT_CACHE_DIR`` (default ``~/.deep_gemm``) keyed by the
source, every header under ``deep_gemm/include``, the flags and the compiler version, and is
written to a temporary directory then renamed, so concurrent compiles of one kernel are safe.

Environment variables (upstream DeepGEMM names):
    DG_JIT_CACHE_DIR       cache directory
    DG_JIT_NVCC_COMPILER   nvcc to use (default: $CUDA_HOME/bin/nvcc, then PATH)
    DG_JIT_DEBUG           print compile commands and cache hits
    DG_JIT_PTXAS_VERBOSE   print ptxas' register / spill report of each compile
    DG_JIT_PTXAS_CHECK     fail when a kernel spills or uses a stack frame
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..utils import env_flag

INCLUDE_DIR = Path(__file__).resolve().parent.parent / "include"
ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)
NVCC_FLAGS = ("-std=c++17", "-O3", "-cubin", "--expt-relaxed-constexpr", "-Xptxas=-v", *ARCH_FLAGS)


class CompileError(RuntimeError):
    """nvcc failed, or the kernel broke the DG_JIT_PTXAS_CHECK rule."""


def cache_dir() -> Path:
    return Path(os.environ.get("DG_JIT_CACHE_DIR", Path.home() / ".deep_gemm"))


@functools.lru_cache(maxsize=None)
def nvcc_path() -> str:
    if "DG_JIT_NVCC_COMPILER" in os.environ:
        return os.environ["DG_JIT_NVCC_COMPILER"]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(cuda_home) / "bin" / "nvcc"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nvcc")
    if found is None:
        raise CompileError("nvcc not found: set DG_JIT_NVCC_COMPILER or CUDA_HOME")
    return found


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


@functools.lru_cache(maxsize=None)
def _headers_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(INCLUDE_DIR.rglob("*.cuh")):
        digest.update(str(path.relative_to(INCLUDE_DIR)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(name: str, source: str) -> str:
    digest = hashlib.sha256()
    for part in (name, source, _headers_digest(), " ".join(NVCC_FLAGS), nvcc_version()):
        digest.update(part.encode())
        digest.update(b"\0")
    return f"{name}_{digest.hexdigest()[:24]}"


def _check_ptxas_report(name: str, report: str) -> None:
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    stack = [int(v) for v in re.findall(r"(\d+) bytes stack frame", report)]
    if any(spills) or any(stack):
        raise CompileError(f"kernel {name} uses local memory (DG_JIT_PTXAS_CHECK):\n{report}")


_announced = False


def _announce_first_compile() -> None:
    """Says once per process why the first calls are slow."""
    global _announced
    if not _announced:
        _announced = True
        print(f"[deep_gemm] compiling CUDA kernels on first use (seconds each, once: cached in {cache_dir()}); "
              "`python -m deep_gemm.precompile` builds every variant ahead of time", file=sys.stderr, flush=True)


def compile_cubin(name: str, source: str) -> Path:
    """Returns the path of the cubin for `source`, compiling it on a cache miss."""
    key = cache_key(name, source)
    kernel_dir = cache_dir() / "cache" / key
    cubin = kernel_dir / "kernel.cubin"
    if cubin.exists():
        if env_flag("DG_JIT_DEBUG"):
            print(f"[deep_gemm.jit] cache hit {cubin}")
    else:
        _announce_first_compile()
        _compile_to(name, source, key, kernel_dir)
    if env_flag("DG_JIT_PTXAS_CHECK"):
        _check_ptxas_report(name, (kernel_dir / "ptxas.log").read_text())
    return cubin


def _compile_to(name: str, source: str, key: str, kernel_dir: Path) -> None:
    cubin = kernel_dir / "kernel.cubin"

    kernel_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".tmp_{key}_", dir=kernel_dir.parent))
    try:
        src = tmp_dir / "kernel.cu"
        src.write_text(source)
        cmd = [nvcc_path(), *NVCC_FLAGS, f"-I{INCLUDE_DIR}", str(src), "-o", str(tmp_dir / "kernel.cubin")]
        if env_flag("DG_JIT_DEBUG"):
            print(f"[deep_gemm.jit] {' '.join(cmd)}")
        result = subprocess.run(cmd, capture_output=True, text=True)
        report = result.stdout + result.stderr
        if result.returncode != 0:
            raise CompileError(f"nvcc failed for {name}:\n{report}")
        if env_flag("DG_JIT_PTXAS_VERBOSE"):
            print(f"[deep_gemm.jit] {name}:\n{report}")
        (tmp_dir / "ptxas.log").write_text(report)
        # Atomic publish: a directory rename either lands whole or loses to a concurrent twin.
        try:
            os.rename(tmp_dir, kernel_dir)
        except OSError:
            if not cubin.exists():
                raise
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)


__all__ = ["CompileError", "compile_cubin", "cache_dir", "nvcc_path", "nvcc_version"]
