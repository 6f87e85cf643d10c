"""K-grouped bf16 GEMM (MoE weight gradients): contraction over each group's ragged rows.

Variants (`GemmConfig`): 128- or 256-wide tiles whose outputs leave through tensor stores
staged in 2 or 4 buffers per warpgroup, 256-wide ones also in 2-CTA clusters sharing B's tile
(B multicast); an accumulating bf16 output drains through row copies instead (tensor reduce-adds
serve fp32 here). `get_config` picks by shape and dtype from the measurements docs/PERF.md lists under
"Decisions".
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..jit.params import ParamsStruct
from ..jit.runtime import Kernel, build_kernel
from ..jit.tma import make_tma_2d_desc, make_tma_3d_desc
from ..utils import (check_bool, check_cuda_devices, check_disjoint, check_group_offsets, check_multiple, check_tensor,
                     get_num_sms, print_configs_enabled)
from .common import (BLOCK_K, BLOCK_M, NUM_THREADS, GemmConfig, grid_size, k_grouped_epilogue, make_config,
                     row_staging_bytes, swizzled_staging_bytes)

PARAMS = ParamsStruct("deep_gemm::KGroupedGemmParams", [
    ("tensor_map_a", "tensor_map"), ("tensor_map_b", "tensor_map"), ("tensor_map_d", "tensor_map"), ("d", "ptr"),
    ("group_offsets", "ptr"), ("m", "u32"), ("n", "u32"), ("rows", "u32"), ("num_groups", "u32")])



def _num_chunks(block_n: int, out_dtype: torch.dtype) -> int:
    """128-byte column chunks in a tile's row: the most tensor-store buffers a warpgroup uses."""
    return block_n * out_dtype.itemsize // 128


def make_k_grouped_config(block_n: int, store_buffers: int = 2, multicast_b: bool = False) -> GemmConfig:
    """Tensor stores through `store_buffers` staging buffers per warpgroup."""
    return make_config(block_n, swizzled_staging_bytes(store_buffers), store_buffers=store_buffers,
                       multicast_b=multicast_b)


def make_row_copy_config(block_n: int, out_dtype: torch.dtype) -> GemmConfig:
    return make_config(block_n, row_staging_bytes(block_n, out_dtype.itemsize), row_copies=True)


def all_configs(out_dtype: torch.dtype) -> list[GemmConfig]:
    """Every variant a caller may pass as `config` for this output dtype."""
    return [make_k_grouped_config(block_n, buffers, multicast)
            for block_n, buffers, multicast in ((128, 2, False), (128, 4, False), (256, 2, False), (256, 4, False),
                                                (256, 2, True))
            if buffers <= _num_chunks(block_n, out_dtype)]


@functools.lru_cache(maxsize=None)
def get_config(m: int, n: int, out_dtype: torch.dtype, multicast_b: bool = True) -> GemmConfig:
    """The variant the launcher picks for a group's output shape `m` x `n` and output dtype;
    `multicast_b=False` where clusters cannot run (fewer than two SMs allowed). With 256-wide
    tiles, B multicast for fp32 outputs and for bf16 outputs of at least 4M elements per group
    (where it measured faster or level); without it, four staging buffers from 4M elements on."""
    block_n = 256 if n > 128 else 128
    large = m * n >= 4 << 20
    if block_n == 256 and multicast_b and (out_dtype == torch.float32 or large):
        return make_k_grouped_config(block_n, multicast_b=True)
    return make_k_grouped_config(block_n, 4 if large and _num_chunks(block_n, out_dtype) >= 4 else 2)


def kernel_config(config: GemmConfig, out_dtype: torch.dtype, accumulate: bool) -> GemmConfig:
    """The variant that runs: an accumulating bf16 output drains through row copies' reduce-adds."""
    return make_row_copy_config(config.block_n, out_dtype) if accumulate and out_dtype != torch.float32 else config


@functools.lru_cache(maxsize=None)
def get_kernel(config: GemmConfig, out_dtype: torch.dtype, accumulate: bool) -> Kernel:
    config = kernel_config(config, out_dtype, accumulate)
    epilogue = k_grouped_epilogue(config, out_dtype, accumulate)
    kernel_type = f"deep_gemm::Sm90BF16KGroupedGemm<{config.block_n}, {config.num_stages}, {config.cluster_size}, {epilogue}>"
    return build_kernel("sm90_bf16_k_grouped_gemm.cuh", "dg_sm90_bf16_k_grouped_gemm", kernel_type, PARAMS, NUM_THREADS,
                        config.smem_bytes, config.cluster_size)


def default_kernel(m: int, n: int, out_dtype: torch.dtype, accumulate: bool, device: int) -> Kernel:
    """The kernel a call with outputs ``[G, m, n]`` of `out_dtype` runs without `config` on
    `device`, compiled (or read from the disk cache) now: callers that must not fail halfway
    build their kernels first."""
    return get_kernel(get_config(m, n, out_dtype, multicast_b=get_num_sms(device) >= 2), out_dtype, accumulate)


_printed: set = set()


def k_grouped_bf16_gemm_tn_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                      group_offsets: torch.Tensor, *, accumulate: bool = False,
                                      config: Optional[GemmConfig] = None) -> None:
    """Grouped ``D[g] (+)= A[rows of g].T @ B[rows of g]`` (MoE weight gradients), into `d`.

    Args:
        a: ``[R, M]`` bf16, row-major (e.g. output gradients of the routed rows).
        b: ``[R, N]`` bf16, row-major (e.g. the routed inputs).
        d: ``[G, M, N]`` float32 (default choice) or bf16. Every group is written; an empty
            group gives zeros (or leaves `d[g]` unchanged with ``accumulate=True``).
        group_offsets: ``[G + 1]`` int32 on the GPU: group g contracts over rows
            ``[group_offsets[g], group_offsets[g + 1])``. Non-decreasing, within ``[0, R]``;
            sizes are arbitrary. Read on the GPU: no host sync.
        accumulate: add into the existing `d` instead of overwriting it.
        config: force a kernel variant (one of
            `deep_gemm.gemm.k_grouped_bf16.all_configs(d.dtype)`); the default is `get_config`'s.

    Requires M and N multiples of 8 and 16-byte aligned tensors. Accumulates in fp32.
    """
    check_tensor("a", a, torch.bfloat16, 2)
    check_tensor("b", b, torch.bfloat16, 2)
    check_tensor("d", d, (torch.float32, torch.bfloat16), 3)
    num_groups = check_group_offsets(group_offsets)
    (rows, m), n = a.shape, b.shape[1]
    if b.shape[0] != rows:
        raise ValueError(f"a and b must have the same number of rows, got {rows} and {b.shape[0]}")
    if tuple(d.shape) != (num_groups, m, n):
        raise ValueError(f"d must have shape {(num_groups, m, n)}, got {tuple(d.shape)}")
    check_multiple("M", m, 8)
    check_multiple("N", n, 8)
    if max(rows, m, n) >= 2**31:
        raise ValueError("dimensions must stay below 2**31")
    check_bool(accumulate=accumulate)
    if config is not None and config not in all_configs(d.dtype):
        raise ValueError(f"unknown config {config} for {d.dtype} output; pick one of all_configs()")
    check_disjoint(dict(d=d), dict(a=a, b=b, group_offsets=group_offsets))
    device = check_cuda_devices(a=a, b=b, d=d, group_offsets=group_offsets)
    if m == 0 or n == 0 or num_groups == 0:
        return
    if rows == 0:  # every group is empty
        if not accumulate:
            d.zero_()
        return

    config = config or get_config(m, n, d.dtype, multicast_b=get_num_sms(device.index) >= 2)
    key = (m, n, rows, num_groups, d.dtype, accumulate)
    if print_configs_enabled() and key not in _printed:
        _printed.add(key)
        print(f"[deep_gemm] k_grouped_bf16_gemm_tn: M={m} N={n} rows={rows} G={num_groups} "
              f"out={d.dtype} accumulate={accumulate} -> {kernel_config(config, d.dtype, accumulate).label}")
    kernel = get_kernel(config, d.dtype, accumulate)
    params = PARAMS.pack(
        tensor_map_a=make_tma_2d_desc(a, rows, m, 64, BLOCK_K), tensor_map_b=make_tma_2d_desc(b, rows, n, 64, BLOCK_K),
        tensor_map_d=(bytes(128) if kernel_config(config, d.dtype, accumulate).row_copies
                      else make_tma_3d_desc(d, 128 // d.element_size(), 64)),
        d=d.data_ptr(), group_offsets=group_offsets.data_ptr(), m=m, n=n, rows=rows, num_groups=num_groups)
    tile_m = BLOCK_M * kernel.cluster_size  # a cluster's tile: its CTAs' M blocks together
    num_tiles = num_groups * -(-m // tile_m) * -(-n // config.block_n)
    kernel.launch(params, grid_size(kernel, num_tiles, device.index), device.index)
