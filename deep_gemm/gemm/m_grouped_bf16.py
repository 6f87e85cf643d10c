"""M-grouped bf16 GEMMs (MoE forward and data gradients), contiguous layout, ragged groups.

One launcher per public function; they share the checks of the problem (`MGroupedProblem`)
and the launch (`_launch`), and pick the kernel's policies: how A's rows are loaded (by TMA, or
gathered through `a_row_index`) and how the epilogue stores (plain bf16, or SwiGLU).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..jit.params import ParamsStruct
from ..jit.runtime import Kernel, build_kernel
from ..jit.tma import make_tma_2d_desc, make_tma_3d_desc
from ..utils import (check_cuda_devices, check_disjoint, check_group_offsets, check_multiple, check_tensor,
                     print_configs_enabled)
from .common import (BLOCK_K, BLOCK_M, NUM_THREADS, GemmConfig, grid_size, make_config, staged_bf16_bytes,
                     swizzled_staging_bytes)

MAX_PASSES = 32  # comm::PassGate keeps one bit per pass

PARAMS = ParamsStruct("deep_gemm::MGroupedGemmParams", [
    ("tensor_map_a", "tensor_map"), ("tensor_map_b", "tensor_map"), ("tensor_map_d", "tensor_map"),
    ("tensor_map_act", "tensor_map"), ("d", "ptr"), ("act", "ptr"), ("group_offsets", "ptr"), ("a_row_index", "ptr"),
    ("a", "ptr"), ("ready_flags", "ptr"), ("m", "u32"), ("n", "u32"), ("k", "u32"), ("num_groups", "u32"),
    ("a_rows", "u32"), ("num_passes", "u32"), ("pass_begin", "u32"), ("pass_end", "u32")])

# Producer policies (producer/rows.cuh) and epilogue policies (epilogue/m_grouped.cuh).
TMA_ROWS, GATHERED_ROWS = "TmaRows", "GatheredRows"
BF16_STORE, SWIGLU_STORE = "BF16TensorStore", "SwiGLUTensorStore"
_KERNEL_B_MAJOR = {False: "deep_gemm::mma::Major::kKMajor", True: "deep_gemm::mma::Major::kMNMajor"}


def tensor_store_staging_bytes(block_n: int) -> int:
    """epilogue::kTensorStoreStagingBytes (one warpgroup): tensor-store buffers, or the
    synchronous staging of a group's last rows, whichever is larger, rounded up to 1024 bytes
    (the swizzle's alignment)."""
    staging = max(staged_bf16_bytes(block_n), swizzled_staging_bytes(2))
    return -(-staging // 1024) * 1024


def make_m_grouped_config(block_n: int) -> GemmConfig:
    return make_config(block_n, tensor_store_staging_bytes(block_n))


def all_configs() -> list[GemmConfig]:
    """Every variant a caller may pass as `config`: 128- or 256-wide tiles."""
    return [make_m_grouped_config(128), make_m_grouped_config(256)]


@functools.lru_cache(maxsize=None)
def get_config(n: int) -> GemmConfig:
    """The variant the launchers pick for output width `n`."""
    return make_m_grouped_config(256 if n > 128 else 128)


SWIGLU_CONFIG = make_m_grouped_config(256)  # a tile pairs 128 gate with 128 up columns


@functools.lru_cache(maxsize=None)
def get_kernel(config: GemmConfig, b_mn_major: bool, producer: str, epilogue: str) -> Kernel:
    kernel_type = (f"deep_gemm::Sm90BF16MGroupedGemm<{config.block_n}, {config.num_stages}, {_KERNEL_B_MAJOR[b_mn_major]}, "
                   f"deep_gemm::producer::{producer}, deep_gemm::epilogue::{epilogue}<{config.block_n}>>")
    return build_kernel("sm90_bf16_m_grouped_gemm.cuh", "dg_sm90_bf16_m_grouped_gemm", kernel_type, PARAMS,
                        NUM_THREADS, config.smem_bytes)


def default_kernel(n: int, b_mn_major: bool, producer: str = TMA_ROWS, epilogue: str = BF16_STORE) -> Kernel:
    """The kernel a call of output width `n` runs without `config`, compiled (or read from the
    disk cache) now: callers that must not fail halfway build their kernels first."""
    return get_kernel(SWIGLU_CONFIG if epilogue == SWIGLU_STORE else get_config(n), b_mn_major, producer, epilogue)


@dataclass
class MGroupedProblem:
    """A checked m-grouped problem: D [m, n] = rows of A [a_rows, k] (or gathered) times B[g]."""

    a: torch.Tensor
    b: torch.Tensor
    d: torch.Tensor
    group_offsets: torch.Tensor
    a_row_index: Optional[torch.Tensor]
    b_mn_major: bool
    m: int
    n: int
    k: int
    num_groups: int
    num_passes: int
    pass_range: tuple[int, int]
    ready_flags: Optional[torch.Tensor]
    device: Optional[torch.device]  # (set by check_devices)

    @staticmethod
    def check(a, b, d, group_offsets, b_mn_major: bool, a_row_index, num_passes: int, ready_flags,
              pass_range, act: Optional[torch.Tensor] = None) -> "MGroupedProblem":
        """Raises TypeError/ValueError on anything the bf16 kernels cannot take, devices last.
        `act`: the SwiGLU epilogue's second output."""
        problem = MGroupedProblem.check_shapes(a, b, d, group_offsets, b_mn_major, a_row_index, num_passes,
                                               ready_flags, pass_range, act)
        problem.check_disjoint(act=act)
        problem.check_devices(act=act)
        return problem

    @staticmethod
    def check_shapes(a, b, d, group_offsets, b_mn_major: bool, a_row_index, num_passes: int, ready_flags,
                     pass_range, act: Optional[torch.Tensor] = None,
                     operand_dtype: torch.dtype = torch.bfloat16,
                     act_dtype: torch.dtype = torch.bfloat16) -> "MGroupedProblem":
        """`check` without the devices (`check_devices`, which a caller with more tensors to check
        runs after them); `operand_dtype`: a's and b's; `act_dtype`: act's."""
        check_tensor("a", a, operand_dtype, 2)
        check_tensor("b", b, operand_dtype, 3)
        check_tensor("d", d, torch.bfloat16, 2)
        if act is not None:
            check_tensor("act", act, act_dtype, 2)
        if not isinstance(num_passes, int) or not 1 <= num_passes <= MAX_PASSES:
            raise ValueError(f"num_passes must be in [1, {MAX_PASSES}], got {num_passes!r}")
        num_runs = check_group_offsets(group_offsets)
        if num_runs % num_passes:
            raise ValueError(f"group_offsets describes {num_runs} runs, not a multiple of num_passes = {num_passes}")
        num_groups = num_runs // num_passes
        pass_range = (0, num_passes) if pass_range is None else tuple(pass_range)
        if len(pass_range) != 2 or not 0 <= pass_range[0] < pass_range[1] <= num_passes:
            raise ValueError(f"pass_range must satisfy 0 <= begin < end <= num_passes = {num_passes}, got {pass_range}")
        if ready_flags is not None:
            check_tensor("ready_flags", ready_flags, torch.int32, 1)
            if ready_flags.numel() < num_passes:
                raise ValueError(f"ready_flags needs {num_passes} entries, has {ready_flags.numel()}")
        m, k = a.shape
        if a_row_index is not None:
            check_tensor("a_row_index", a_row_index, torch.int64, 1)
            m = a_row_index.numel()
        if b_mn_major:
            g, k_b, n = b.shape
            check_multiple("K (nn layout: groups of B are stacked along K)", k, BLOCK_K)
        else:
            g, n, k_b = b.shape
        if g != num_groups:
            raise ValueError(f"b has {g} groups but group_offsets describes {num_groups}"
                             + (f" ({num_passes} passes each)" if num_passes > 1 else ""))
        if k_b != k:
            raise ValueError(f"contraction sizes differ: a has K = {k}, b has K = {k_b}")
        if tuple(d.shape) != (m, n):
            raise ValueError(f"{'h' if act is not None else 'd'} must have shape {(m, n)}, got {tuple(d.shape)}")
        if act is not None:
            check_multiple("N = 2I (the SwiGLU epilogue pairs 128 gate with 128 up columns)", n, 256)
            if tuple(act.shape) != (m, n // 2):
                raise ValueError(f"act must have shape {(m, n // 2)}, got {tuple(act.shape)}")
        check_multiple("K", k, 8)
        check_multiple("N", n, 8)
        if max(m, a.shape[0], n, k) >= 2**31 or g * max(n, k) >= 2**31:
            raise ValueError("dimensions must stay below 2**31")
        if m and n and num_groups and (k == 0 or a.shape[0] == 0):
            raise ValueError("K must be positive, and a non-empty when rows are gathered from it")
        return MGroupedProblem(a, b, d, group_offsets, a_row_index, b_mn_major, m, n, k, num_groups, num_passes,
                               pass_range, ready_flags, None)

    def check_devices(self, **more: Optional[torch.Tensor]) -> None:
        """Raises ValueError unless every tensor of the problem (and of `more`, None skipped) is on
        one CUDA device; sets `device`."""
        tensors = dict(a=self.a, b=self.b, d=self.d, group_offsets=self.group_offsets, a_row_index=self.a_row_index,
                       ready_flags=self.ready_flags, **more)
        self.device = check_cuda_devices(**{name: t for name, t in tensors.items() if t is not None})

    def check_disjoint(self, inputs: Optional[dict] = None, **outputs: Optional[torch.Tensor]) -> None:
        """Raises ValueError if d (SwiGLU's h) or `outputs` share memory with an input (a, b, the
        offsets, the row index, the ready flags, `inputs`) or with each other."""
        check_disjoint({"d" if outputs.get("act") is None else "h": self.d, **outputs},
                       dict(a=self.a, b=self.b, group_offsets=self.group_offsets, a_row_index=self.a_row_index,
                            ready_flags=self.ready_flags, **(inputs or {})))

    @property
    def empty(self) -> bool:
        return self.m == 0 or self.n == 0 or self.num_groups == 0


def _check_config(config: Optional[GemmConfig], n: int) -> GemmConfig:
    if config is not None and config not in all_configs():
        raise ValueError(f"unknown config {config}; pick one of all_configs()")
    return config or get_config(n)


_printed: set = set()


def _launch(problem: MGroupedProblem, config: GemmConfig, epilogue: str, act: Optional[torch.Tensor] = None) -> None:
    """Launches the kernel of `problem` with `config` and the `epilogue` policy (SwiGLU: `act`
    [m, n / 2] its second output)."""
    p = problem
    if print_configs_enabled():
        name = "nt_swiglu" if epilogue == SWIGLU_STORE else ("nn" if p.b_mn_major else "nt")
        if (name, p.m, p.n, p.k, p.num_groups) not in _printed:
            _printed.add((name, p.m, p.n, p.k, p.num_groups))
            print(f"[deep_gemm] m_grouped_bf16_gemm_{name}: M={p.m} N={p.n} K={p.k} G={p.num_groups} -> {config.label}")
    boxes = 2 if epilogue == SWIGLU_STORE else 1  # the SwiGLU tile's gate and up rows of B
    params = PARAMS.pack(
        tensor_map_a=make_tma_2d_desc(p.a, p.a.shape[0], p.k, 64, BLOCK_M),  # (gathered rows: prefetched, unused)
        tensor_map_b=(make_tma_2d_desc(p.b, p.num_groups * p.k, p.n, 64, BLOCK_K) if p.b_mn_major
                      else make_tma_2d_desc(p.b, p.num_groups * p.n, p.k, 64, config.block_n // boxes)),
        tensor_map_d=make_tma_3d_desc(p.d.unsqueeze(0), 64, 64),
        tensor_map_act=bytes(128) if act is None else make_tma_3d_desc(act.unsqueeze(0), 64, 64),
        d=p.d.data_ptr(), act=0 if act is None else act.data_ptr(), group_offsets=p.group_offsets.data_ptr(),
        a_row_index=0 if p.a_row_index is None else p.a_row_index.data_ptr(), a=p.a.data_ptr(),
        ready_flags=0 if p.ready_flags is None else p.ready_flags.data_ptr(),
        m=p.m, n=p.n, k=p.k, num_groups=p.num_groups, a_rows=p.a.shape[0], num_passes=p.num_passes,
        pass_begin=p.pass_range[0], pass_end=p.pass_range[1])
    kernel = get_kernel(config, p.b_mn_major, TMA_ROWS if p.a_row_index is None else GATHERED_ROWS, epilogue)
    num_runs = p.num_groups * p.num_passes
    num_tiles_bound = (p.m // BLOCK_M + num_runs) * -(-p.n // config.block_n)
    kernel.launch(params, grid_size(kernel, num_tiles_bound, p.device.index), p.device.index)


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                      group_offsets: torch.Tensor, *, a_row_index: Optional[torch.Tensor] = None,
                                      config: Optional[GemmConfig] = None, num_passes: int = 1,
                                      ready_flags: Optional[torch.Tensor] = None,
                                      pass_range: Optional[tuple[int, int]] = None) -> None:
    """Grouped ``D[rows of g] = A[rows of g] @ B[g].T`` (MoE forward), in place into `d`.

    Args:
        a: ``[M, K]`` bf16, row-major; groups of rows back to back.
        b: ``[G, N, K]`` bf16, row-major (each group's matrix is K-major, like nn.Linear weights).
        d: ``[M, N]`` bf16 output. Only rows inside a group are written.
        group_offsets: ``[G + 1]`` int32 on the GPU: group g owns rows
            ``[group_offsets[g], group_offsets[g + 1])``. Non-decreasing, within ``[0, M]``;
            sizes are arbitrary (zero, not multiples of any tile). Read on the GPU: no host sync.
        a_row_index: optional int64 ``[M]``: row i of A is ``a[a_row_index[i]]``, gathered by the
            kernel's loads (no permuted copy of `a`); `a` is then ``[T, K]`` for any T and `d`
            has M rows. Indices outside ``[0, T)`` read zeros.
        config: force a kernel variant (one of `deep_gemm.gemm.m_grouped_bf16.all_configs()`);
            the default picks by N.
        num_passes: S, 1 <= S <= 32. With S > 1, each group's rows come in S runs back to back and
            `group_offsets` has ``G * S + 1`` entries: run (g, s) owns rows
            ``[group_offsets[g * S + s], group_offsets[g * S + s + 1])``. The kernel works pass by
            pass (every group's run s before any run s + 1).
        ready_flags: optional int32 ``[>= S]`` on the GPU: tiles of pass s > 0 read A only once
            ``ready_flags[s] != 0``, so that rows still being copied in (by another stream, e.g.
            a copy engine, which then sets the flag) are read after they land while earlier
            passes already run. The writer must need no SM: this kernel may hold every SM
            while it waits (copy engines and stream memory operations qualify, e.g. a copy
            from another GPU's memory or from pinned host memory; a kernel, or a copy whose
            source and destination both lie in this GPU's memory, does not). A wait of ~10 s
            traps.
        pass_range: optional ``(begin, end)``: this launch computes only the runs of passes
            ``begin <= s < end`` (rows of other passes are left as they are), so that a caller
            can act on some passes' results before the others are computed.

    Requires K and N multiples of 8 and 16-byte aligned tensors. Accumulates in fp32.
    """
    problem = MGroupedProblem.check(a, b, d, group_offsets, False, a_row_index, num_passes, ready_flags, pass_range)
    config = _check_config(config, problem.n)
    if not problem.empty:
        _launch(problem, config, BF16_STORE)


def m_grouped_bf16_gemm_nn_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                      group_offsets: torch.Tensor, *, a_row_index: Optional[torch.Tensor] = None,
                                      config: Optional[GemmConfig] = None, num_passes: int = 1,
                                      ready_flags: Optional[torch.Tensor] = None,
                                      pass_range: Optional[tuple[int, int]] = None) -> None:
    """Grouped ``D[rows of g] = A[rows of g] @ B[g]`` (MoE data gradient), in place into `d`.

    Args:
        a: ``[M, K]`` bf16, row-major; groups of rows back to back.
        b: ``[G, K, N]`` bf16, row-major (e.g. the forward's ``[G, N_fwd, K_fwd]`` weights,
            whose transpose is applied without a copy).
        d: ``[M, N]`` bf16 output. Only rows inside a group are written.
        group_offsets: ``[G + 1]`` int32 on the GPU, as in `m_grouped_bf16_gemm_nt_contiguous`.
        a_row_index: optional int64 ``[M]`` row gather of `a`, as in the nt version.
        config: force a kernel variant (one of `all_configs()`); the default picks by N.
        num_passes, ready_flags, pass_range: rows in passes (that wait for their data, that
            one launch computes), as in `m_grouped_bf16_gemm_nt_contiguous`.

    Requires K a multiple of 64, N a multiple of 8 and 16-byte aligned tensors.
    """
    problem = MGroupedProblem.check(a, b, d, group_offsets, True, a_row_index, num_passes, ready_flags, pass_range)
    config = _check_config(config, problem.n)
    if not problem.empty:
        _launch(problem, config, BF16_STORE)


def m_grouped_bf16_gemm_nt_swiglu_contiguous(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor, act: torch.Tensor,
                                             group_offsets: torch.Tensor, *,
                                             a_row_index: Optional[torch.Tensor] = None, num_passes: int = 1,
                                             ready_flags: Optional[torch.Tensor] = None) -> None:
    """The MoE's first GEMM with SwiGLU in its epilogue: ``h = A @ B[g].T`` and
    ``act = silu(h[:, :I]) * h[:, I:]`` (from the fp32 accumulators), per group of rows.

    Args:
        a: ``[M, K]`` bf16 (or any number of rows with `a_row_index`, as in the nt GEMM).
        b: ``[G, 2I, K]`` bf16: rows ``[0, I)`` gate, ``[I, 2I)`` up of each group (natural
            layout, no interleaving needed).
        h: ``[M, 2I]`` bf16 output (GEMM result, gate then up columns).
        act: ``[M, I]`` bf16 output.
        group_offsets: ``[G + 1]`` int32 on the GPU, as in `m_grouped_bf16_gemm_nt_contiguous`.
        a_row_index: optional int64 ``[M]`` row gather of `a`.
        num_passes, ready_flags: rows in passes that wait for their data, as in
            `m_grouped_bf16_gemm_nt_contiguous`.

    Requires I a multiple of 128 and K a multiple of 8. Only rows inside a group are written.
    """
    problem = MGroupedProblem.check(a, b, h, group_offsets, False, a_row_index, num_passes, ready_flags, None, act)
    if not problem.empty:
        _launch(problem, SWIGLU_CONFIG, SWIGLU_STORE, act)
