"""Loading cubins and launching them on PyTorch's current stream through the driver API.

Every kernel here takes one argument: a `__grid_constant__` parameter struct whose bytes the
launcher packs (`params.ParamsStruct`). Tensor maps inside it stay in kernel-parameter space,
which is where TMA wants them.
"""
from __future__ import annotations

import ctypes
import re
from typing import Optional

import torch
from cuda.bindings import driver as cu

from ..utils import device_num_sms, env_flag, get_num_sms
from .compiler import compile_cubin
from .params import ParamsStruct


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


def check(result):
    """Unwraps a cuda.bindings return tuple, raising on an error code."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, msg = cu.cuGetErrorString(err)
        raise DriverError(f"{err.name}: {msg.decode() if msg else ''}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_initialized = False


def _current_raw_stream(device: int) -> int:
    # The private accessor returns the handle as an int without building a Stream object
    # (several microseconds per launch); fall back to the public API where it is missing.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


_primary_contexts: dict[int, object] = {}


def _primary_context(device: int):
    """The device's primary context (the one PyTorch uses), retained once."""
    global _initialized
    ctx = _primary_contexts.get(device)
    if ctx is None:
        if not _initialized:
            check(cu.cuInit(0))
            _initialized = True
        torch.cuda.init()
        ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(device))))
        _primary_contexts[device] = ctx
    return ctx


class OnDevice:
    """Makes `device`'s primary context current for a driver call, and restores the thread's
    own afterwards. A thread may have none current (autograd's worker threads before their
    first runtime call: a launch there failed with CUDA_ERROR_INVALID_CONTEXT) or another
    device's (tensors on a device other than the current one)."""

    def __init__(self, device: int):
        self.ctx = _primary_context(device)
        self.pushed = False

    def __enter__(self):
        current = check(cu.cuCtxGetCurrent())
        if current is None or int(current) != int(self.ctx):
            check(cu.cuCtxPushCurrent(self.ctx))
            self.pushed = True

    def __exit__(self, *exc):
        if self.pushed:
            check(cu.cuCtxPopCurrent())


def stream_write_u32(address: int, value: int, device: int) -> None:
    """Writes the 32-bit `value` to device memory at `address`, in order on the device's current
    stream: after everything queued before it has finished and its writes are visible (the
    driver's stream memory operation; no SM runs it, so it can signal a kernel already running)."""
    with OnDevice(device):
        check(cu.cuStreamWriteValue32(cu.CUstream(_current_raw_stream(device)), cu.CUdeviceptr(address), value,
                                      cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT))


class Kernel:
    """A compiled kernel (entry `entry`), loaded once per device on first launch; with
    `cluster_size` > 1 launched in thread-block clusters of that many CTAs along x."""

    def __init__(self, name: str, source: str, num_threads: int, smem_bytes: int, entry: str = "kernel",
                 cluster_size: int = 1):
        self.name, self.entry = name, entry
        self.num_threads = num_threads
        self.smem_bytes = smem_bytes
        self.cluster_size = cluster_size
        self.cubin = compile_cubin(name, source)
        # (what the source was built with, not the environment at load time, decides what to attach)
        self.traced, self.timelined = _TRACE_DEFINE in source, _TIMELINE_DEFINE in source
        self._functions: dict[int, object] = {}
        self._configs: dict[tuple[int, int], cu.CUlaunchConfig] = {}
        self._max_resident: dict[int, int] = {}

    def _function(self, device: int):
        fn = self._functions.get(device)
        if fn is None:
            module = check(cu.cuModuleLoadData(self.cubin.read_bytes()))
            fn = check(cu.cuModuleGetFunction(module, self.entry.encode()))
            check(cu.cuFuncSetAttribute(
                fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem_bytes))
            if self.traced:  # pinned memory is device-addressable (UVA)
                _set_device_pointer(module, b"dg_trace", trace_buffer().data_ptr())
            if self.timelined:
                _set_device_pointer(module, b"dg_timeline", timeline_buffer(device).data_ptr())
            self._functions[device] = fn
        return fn

    def launch(self, params: bytes, num_blocks: int, device: int) -> None:
        """Launches `num_blocks` CTAs (a multiple of the cluster size) on the current stream of
        `device` with `params`."""
        with OnDevice(device):
            self._launch(params, num_blocks, device)

    def grid(self, num_units: int, device: int, persistent: bool) -> int:
        """CTAs to launch for `num_units` units of work (at least one): one a unit, or, when
        `persistent` or under `set_num_sms`' cap, at most those that fit at once (and eight an SM
        in use), each walking the units in turn."""
        if persistent or get_num_sms(device) < device_num_sms(device):
            num_units = min(num_units, self.max_resident_blocks(device), 8 * get_num_sms(device))
        return max(1, num_units)

    def max_resident_blocks(self, device: int) -> int:
        """How many CTAs of this kernel fit on the device at once, counted in whole clusters
        (a cluster must fit in one GPC, so with clusters this can be below one CTA per SM)."""
        count = self._max_resident.get(device)
        if count is None:
            with OnDevice(device):
                if self.cluster_size == 1:  # (the cluster query answers 1 for launches without clusters)
                    per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                        self._function(device), self.num_threads, self.smem_bytes))
                    count = per_sm * device_num_sms(device)
                else:
                    config = self._config(device, self.cluster_size)
                    count = self.cluster_size * check(cu.cuOccupancyMaxActiveClusters(self._function(device), config))
            self._max_resident[device] = count
        return count

    def _config(self, device: int, num_blocks: int) -> cu.CUlaunchConfig:
        config = self._configs.get((device, num_blocks))
        if config is None:
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = num_blocks, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = self.num_threads, 1, 1
            config.sharedMemBytes = self.smem_bytes
            config.numAttrs = 0
            if self.cluster_size > 1:
                attr = cu.CUlaunchAttribute()
                attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = self.cluster_size, 1, 1
                config.attrs, config.numAttrs = [attr], 1
            self._configs[(device, num_blocks)] = config
        return config

    def _launch(self, params: bytes, num_blocks: int, device: int) -> None:
        fn = self._function(device)
        config = self._config(device, num_blocks)
        config.hStream = _current_raw_stream(device)
        buffer = ctypes.create_string_buffer(params, len(params))
        arg_ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
        check(cu.cuLaunchKernelEx(config, fn, ctypes.addressof(arg_ptrs), 0))


_TRACE_DEFINE, _TIMELINE_DEFINE = "#define DG_DEBUG_TRACE\n", "#define DG_TIMELINE\n"


def trace_enabled() -> bool:
    """DG_JIT_DEBUG_TRACE=1 builds kernels with DG_TRACE checkpoints (see ptx/trace.cuh)."""
    return env_flag("DG_JIT_DEBUG_TRACE")


_trace: Optional[torch.Tensor] = None


def trace_buffer() -> torch.Tensor:
    """The host-mapped int32 [16] checkpoint buffer traced kernels write (readable mid-kernel)."""
    global _trace
    if _trace is None:
        _trace = torch.zeros(16, dtype=torch.int32, pin_memory=True)
    return _trace


def _set_device_pointer(module, symbol: bytes, pointer: int) -> None:
    """Sets the module's `__device__` pointer `symbol` to `pointer`."""
    address, _ = check(cu.cuModuleGetGlobal(module, symbol))
    value = ctypes.c_uint64(pointer)
    check(cu.cuMemcpyHtoD(address, ctypes.addressof(value), 8))


def timeline_enabled() -> bool:
    """DG_JIT_TIMELINE=1 builds kernels that record per-tile clocks (see ptx/trace.cuh and
    scripts/timeline.py)."""
    return env_flag("DG_JIT_TIMELINE")


# ptx/trace.cuh's timeline::kCtas, kTracks, kRecords: int64 (clock, event << 24 | tag) pairs
TIMELINE_SHAPE = (8, 3, 4096, 2)
_TIMELINE_ASSERT = ("#include <deep_gemm/ptx/trace.cuh>\n"
                    "static_assert(deep_gemm::timeline::kCtas == {} and deep_gemm::timeline::kTracks == {} and "
                    "deep_gemm::timeline::kRecords == {}, \"the host's timeline_buffer shape\");\n"
                    .format(*TIMELINE_SHAPE[:3]))
_timelines: dict[int, torch.Tensor] = {}


def timeline_buffer(device: int) -> torch.Tensor:
    """The int64 [CTAs, tracks (warpgroups), records, 2] buffer timeline kernels on `device` write
    (zeros where nothing was recorded); zero it before a run to read that run alone."""
    if device not in _timelines:
        _timelines[device] = torch.zeros(TIMELINE_SHAPE, dtype=torch.int64, device=f"cuda:{device}")
    return _timelines[device]


_kernels: dict[tuple[str, str], Kernel] = {}


def get_kernel(name: str, source: str, num_threads: int, smem_bytes: int, entry: str = "kernel",
               cluster_size: int = 1) -> Kernel:
    """The kernel for `source`, compiled (or read from the disk cache) once per process."""
    key = (name, source)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = Kernel(name, source, num_threads, smem_bytes, entry, cluster_size)
    return kernel


def build_kernel(header: str, entry: str, kernel_type: str, params: ParamsStruct, num_threads: int,
                 smem_bytes: int = 0, cluster_size: int = 1, min_blocks_per_sm: int = 1) -> Kernel:
    """The kernel whose `extern "C"` entry `entry` runs ``kernel_type::run(params)``, `kernel_type`
    being a C++ kernel struct of ``deep_gemm/impls/<header>`` with its template arguments (e.g.
    ``deep_gemm::MoECombine<256>``); compiled once (disk-cached). The source asserts that the
    struct `params` describes is laid out as the launcher packs it and, for a kernel with dynamic
    shared memory, that it needs the `smem_bytes` the launch gives it (``Kernel::kSmemBytes``).
    `min_blocks_per_sm` is `__launch_bounds__`' second argument: ptxas caps the registers so that
    that many CTAs fit on an SM."""
    source = (
        (_TRACE_DEFINE if trace_enabled() else "") +
        (_TIMELINE_DEFINE if timeline_enabled() else "") +
        "#include <cstddef>\n"
        f"#include <deep_gemm/impls/{header}>\n\n"
        f"using Kernel = {kernel_type};\n"
        f"{params.static_asserts()}\n"
        + (f'static_assert(Kernel::kSmemBytes == {smem_bytes}, "the launcher gives {smem_bytes} bytes of dynamic '
           'shared memory");\n' if smem_bytes else "")
        + (_TIMELINE_ASSERT if timeline_enabled() else "") + "\n"
        f'extern "C" __global__ void __launch_bounds__({num_threads}, {min_blocks_per_sm})\n'
        f"{entry}(const __grid_constant__ {params.cpp_name} p) {{\n"
        f"    Kernel::run(p);\n"
        f"}}\n")
    # The cache entry's name: the entry and the template arguments, without namespaces.
    args = re.sub(r"\b\w+::", "", kernel_type.partition("<")[2].rpartition(">")[0])
    name = "_".join(filter(None, [entry.removeprefix("dg_"), *re.split(r"[^A-Za-z0-9]+", args)]))
    return get_kernel(name, source, num_threads, smem_bytes, entry, cluster_size)
