"""K-grouped bf16 GEMM (MoE weight gradients): contraction over each group's ragged rows."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..jit.runtime import pack_params
from ..jit.tma import make_tma_2d_desc, make_tma_3d_desc
from ..utils import (check_cuda_devices, check_group_offsets, check_multiple, check_tensor, get_num_sms,
                     print_configs_enabled)
from .common import (BLOCK_K, BLOCK_M, GemmConfig, build_gemm_kernel, grid_size, make_config,
                     row_staging_bytes, swizzled_staging_bytes)

_BLOCK_NS = (128, 256)
_OUT_TYPES = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16"}


def make_k_grouped_config(block_n: int, out_dtype: torch.dtype, async_store: bool = False,
                          tma_store: bool = False, store_buffers: int = 2, multicast_b: bool = False) -> GemmConfig:
    if tma_store:
        if async_store:
            raise ValueError("tma_store and async_store exclude each other")
        return make_config(block_n, False, swizzled_staging_bytes(store_buffers), tma_store=True,
                           store_buffers=store_buffers, multicast_b=multicast_b)
    if multicast_b:
        raise ValueError("B multicast comes with tensor stores only")
    staging = row_staging_bytes(block_n, out_dtype.itemsize) if async_store else 0
    return make_config(block_n, async_store, staging)


def _num_chunks(block_n: int, out_dtype: torch.dtype) -> int:
    """128-byte column chunks in a tile's row: the most tensor-store buffers a warpgroup uses."""
    return block_n * out_dtype.itemsize // 128


@functools.lru_cache(maxsize=None)
def get_config(m: int, n: int, out_dtype: torch.dtype, multicast_b: bool = True) -> GemmConfig:
    """The variant the launcher picks for a group's output shape `m` x `n` and output dtype;
    `multicast_b=False` where the call rules out clusters sharing B (B's rows gathered, or
    fewer than two SMs). Outputs drain through tensor TMA stores that overlap the next tile's
    MMAs, measured the fastest variant on an H200 for bf16 (5-15% over row bulk copies) and fp32
    (5-20% over direct stores). With 256-wide tiles, B multicast in 2-CTA clusters (`256tm`)
    measured 2-8% faster than the best unclustered variant for fp32 on every standard shape but
    DeepSeek-V3 with uniform routing (4% slower), and level (within 2%) for bf16 where a group's
    output holds at least 4M elements (235B, V3); 7% slower for bf16 below that (30B). Without
    multicast, four staging buffers (one stage fewer) beat two by 2-9% from 4M elements on and
    lose up to 9% below (session 8's and 9's sweeps, PERF.md)."""
    block_n = 256 if n > 128 else 128
    large = m * n >= 4 << 20
    if block_n == 256 and multicast_b and (out_dtype == torch.float32 or large):
        return make_k_grouped_config(block_n, out_dtype, tma_store=True, multicast_b=True)
    buffers = 4 if large and _num_chunks(block_n, out_dtype) >= 4 else 2
    return make_k_grouped_config(block_n, out_dtype, tma_store=True, store_buffers=buffers)


def all_configs(out_dtype: torch.dtype) -> list[GemmConfig]:
    """Every variant a caller may pass as `config` for this output dtype: direct, row-copy and
    tensor stores, the last with 2, 4 or 8 staging buffers (up to one per 128-byte column chunk
    of the tile), 256-wide ones also with B multicast in 2-CTA clusters."""
    configs = []
    for block_n in _BLOCK_NS:
        configs += [make_k_grouped_config(block_n, out_dtype), make_k_grouped_config(block_n, out_dtype, True)]
        for multicast in (False, True) if block_n == 256 else (False,):
            configs += [make_k_grouped_config(block_n, out_dtype, tma_store=True, store_buffers=buffers,
                                              multicast_b=multicast)
                        for buffers in (2, 4, 8) if buffers <= _num_chunks(block_n, out_dtype)]
    return configs


def kernel_config(config: GemmConfig, out_dtype: torch.dtype, accumulate: bool) -> GemmConfig:
    """The variant that runs: bf16 accumulating calls of a TMA-store config drain through the
    row copies' reduce-add instead (the tensor reduce-add is used for fp32 only), without B
    multicast."""
    if config.tma_store and accumulate and out_dtype != torch.float32:
        return make_k_grouped_config(config.block_n, out_dtype, async_store=True)
    return config


@functools.lru_cache(maxsize=None)
def get_kernel(config: GemmConfig, out_dtype: torch.dtype, accumulate: bool, gather_a: bool = False,
               gather_b: bool = False):
    config = kernel_config(config, out_dtype, accumulate)
    flag = lambda v: str(v).lower()  # noqa: E731
    return build_gemm_kernel("sm90_bf16_k_grouped_gemm.cuh", "KGroupedGemmParams", "sm90_bf16_k_grouped_gemm_impl",
                             [config.block_n, config.num_stages, _OUT_TYPES[out_dtype], flag(accumulate),
                              flag(config.async_store), flag(config.tma_store), flag(gather_a), flag(gather_b),
                              config.store_buffers, flag(config.multicast_b)],
                             config.smem_bytes, config.cluster_size)


_printed: set = set()


def k_grouped_bf16_gemm_tn_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                      group_offsets: torch.Tensor, *, accumulate: bool = False,
                                      a_row_index: Optional[torch.Tensor] = None,
                                      b_row_index: Optional[torch.Tensor] = None,
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
        a_row_index: optional int64 ``[R]``: row r of A is ``a[a_row_index[r]]``, gathered by the
            kernel's loads (no permuted copy of `a`); `a` is then ``[T, M]`` for any T.
            Indices outside ``[0, T)`` read zeros.
        b_row_index: optional int64 ``[R]``, the same for B (`b` is then ``[T', N]``); at most
            one of the two.
        config: force a kernel variant (one of
            `deep_gemm.gemm.k_grouped_bf16.all_configs(d.dtype)`); the default is `get_config`'s.

    Requires M and N multiples of 8 and 16-byte aligned tensors. Accumulates in fp32.
    """
    check_tensor("a", a, torch.bfloat16, 2)
    check_tensor("b", b, torch.bfloat16, 2)
    check_tensor("d", d, (torch.float32, torch.bfloat16), 3)
    num_groups = check_group_offsets(group_offsets)
    rows, m = a.shape
    if a_row_index is not None:
        check_tensor("a_row_index", a_row_index, torch.int64, 1)
        rows = a_row_index.numel()
    b_rows = b.shape[0]
    if b_row_index is not None:
        check_tensor("b_row_index", b_row_index, torch.int64, 1)
        b_rows = b_row_index.numel()
    if b_rows != rows:
        raise ValueError(f"a (or a_row_index) and b (or b_row_index) must have the same number of rows, "
                         f"got {rows} and {b_rows}")
    n = b.shape[1]
    if tuple(d.shape) != (num_groups, m, n):
        raise ValueError(f"d must have shape {(num_groups, m, n)}, got {tuple(d.shape)}")
    check_multiple("M", m, 8)
    check_multiple("N", n, 8)
    if max(rows, m, n, a.shape[0], b.shape[0]) >= 2**31:
        raise ValueError("dimensions must stay below 2**31")
    if a_row_index is not None and b_row_index is not None:
        raise ValueError("gather the rows of one operand, not both (copy the other first)")
    if config is not None and config not in all_configs(d.dtype):
        raise ValueError(f"unknown config {config} for {d.dtype} output; pick one of all_configs()")
    if config is not None and kernel_config(config, d.dtype, accumulate).multicast_b and b_row_index is not None:
        raise ValueError("a B-multicast config loads B's rows by TMA: gather A's rows instead, or pick another config")
    index = {name: t for name, t in (("a_row_index", a_row_index), ("b_row_index", b_row_index)) if t is not None}
    device = check_cuda_devices(a=a, b=b, d=d, group_offsets=group_offsets, **index)
    if m == 0 or n == 0 or num_groups == 0:
        return
    if rows == 0 or a.shape[0] == 0 or b.shape[0] == 0:  # all groups empty or all rows read zeros
        if not accumulate:
            d.zero_()
        return

    config = config or get_config(m, n, d.dtype, multicast_b=b_row_index is None and get_num_sms(device.index) >= 2)
    key = (m, n, rows, num_groups, d.dtype, accumulate)
    if print_configs_enabled() and key not in _printed:
        _printed.add(key)
        print(f"[deep_gemm] k_grouped_bf16_gemm_tn: M={m} N={n} rows={rows} G={num_groups} "
              f"out={d.dtype} accumulate={accumulate} -> {config}")
    # With a row index the kernel reads that operand directly; its tensor map goes unused.
    tma_a = make_tma_2d_desc(a, a.shape[0], m, 64, BLOCK_K)
    tma_b = make_tma_2d_desc(b, b.shape[0], n, 64, BLOCK_K)
    tma_d = (make_tma_3d_desc(d, 128 // d.element_size(), 64) if kernel_config(config, d.dtype, accumulate).tma_store
             else bytes(128))
    pointers = [d.data_ptr(), group_offsets.data_ptr(), 0 if a_row_index is None else a_row_index.data_ptr(),
                0 if b_row_index is None else b_row_index.data_ptr(), a.data_ptr(), b.data_ptr()]
    params = pack_params([tma_a, tma_b, tma_d], pointers, [m, n, rows, num_groups, a.shape[0], b.shape[0]])
    kernel = get_kernel(config, d.dtype, accumulate, a_row_index is not None, b_row_index is not None)
    tile_m = BLOCK_M * kernel.cluster_size  # a cluster's tile: its CTAs' M blocks together
    num_tiles = num_groups * ((m + tile_m - 1) // tile_m) * ((n + config.block_n - 1) // config.block_n)
    kernel.launch(params, grid_size(kernel, num_tiles, device.index), device.index)
