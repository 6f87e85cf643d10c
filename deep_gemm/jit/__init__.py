"""Run-time compilation of the CUDA kernels: nvcc -> cubin cache -> driver-API launch."""
from .compiler import CompileError, cache_dir, compile_cubin, nvcc_version
