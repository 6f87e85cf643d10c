"""K-grouped blockwise-FP8 GEMM (MoE weight gradients) on the column copies of
`deep_gemm.quant.fp8_quantize_columns`: contraction over each group's tokens, padded to 128.

The kernel (impls/sm90_fp8_k_grouped_gemm.cuh) shares the bf16 kernel's scheduler and epilogue
policies: tensor stores for fp32 and bf16 outputs (fp32 accumulation by tensor reduce-adds),
row copies for an accumulating bf16 output.
"""
from __future__ import annotations

import functools

import torch

from ..jit.params import ParamsStruct
from ..jit.runtime import Kernel, build_kernel
from ..jit.tma import make_tma_2d_desc, make_tma_3d_desc, make_tma_scales_desc
from ..utils import (check_bool, check_cuda_devices, check_disjoint, check_group_offsets, check_multiple, check_tensor,
                     print_configs_enabled)
from .common import (BLOCK_M, NUM_THREADS, GemmConfig, fp8_operand, grid_size, k_grouped_epilogue, make_config,
                     row_staging_bytes, swizzled_staging_bytes)

BLOCK_K = 128  # tokens a stage: one scale block
BLOCK_N = 128
PARAMS = ParamsStruct("deep_gemm::KGroupedFp8GemmParams", [
    ("tensor_map_a", "tensor_map"), ("tensor_map_b", "tensor_map"), ("tensor_map_d", "tensor_map"),
    ("tensor_map_scales_a", "tensor_map"), ("tensor_map_scales_b", "tensor_map"), ("d", "ptr"),
    ("group_offsets", "ptr"), ("m", "u32"), ("n", "u32"), ("rows", "u32"), ("num_groups", "u32")])
# A stage's TF32 tiles of the scales (16 bytes a row and a column) and the next tile's slot (128
# bytes; Sm90FP8KGroupedGemm::kTileSlotBytes); outside the stages a zero tile and the scales' ring of
# eight k-blocks, with its full and empty barriers (mma::tc_scales)
_SCALE_BYTES = (BLOCK_M + BLOCK_N) * 16 + 128
_TC_SCALES_EXTRA = 128 * 16 + 8 * (BLOCK_M + BLOCK_N) * 4 + 2 * 8 * 8


@functools.lru_cache(maxsize=None)
def get_config(out_dtype: torch.dtype, accumulate: bool) -> GemmConfig:
    """128 x 128 tiles; tensor stores through staging buffers (fp32: four a warpgroup, a tile's
    four 32-column chunks in two batches, docs/PERF.md "Decisions"; bf16: two, its two 64-column
    chunks), or row copies where a bf16 output accumulates (tensor reduce-adds serve fp32 here)."""
    if accumulate and out_dtype != torch.float32:
        return make_config(BLOCK_N, row_staging_bytes(BLOCK_N, out_dtype.itemsize), _SCALE_BYTES,
                           row_copies=True, extra_bytes=_TC_SCALES_EXTRA)
    buffers = 4 if out_dtype == torch.float32 else 2
    return make_config(BLOCK_N, swizzled_staging_bytes(buffers), _SCALE_BYTES, store_buffers=buffers,
                       extra_bytes=_TC_SCALES_EXTRA)


@functools.lru_cache(maxsize=None)
def get_kernel(out_dtype: torch.dtype, accumulate: bool) -> Kernel:
    config = get_config(out_dtype, accumulate)
    epilogue = k_grouped_epilogue(config, out_dtype, accumulate)
    kernel_type = f"deep_gemm::Sm90FP8KGroupedGemm<{BLOCK_N}, {config.num_stages}, {epilogue}>"
    return build_kernel("sm90_fp8_k_grouped_gemm.cuh", "dg_sm90_fp8_k_grouped_gemm", kernel_type, PARAMS, NUM_THREADS,
                        config.smem_bytes)


def all_kernels() -> list[tuple[torch.dtype, bool]]:
    """(output dtype, accumulate) of every variant (for `get_kernel`)."""
    return [(dtype, accumulate) for dtype in (torch.float32, torch.bfloat16) for accumulate in (False, True)]


def _check_operand(name: str, data: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """A column copy: data [X, Mp] e4m3 (X a multiple of 128), scales [Mp / 128, X] fp32; (X, Mp)."""
    check_tensor(f"{name}'s data", data, torch.float8_e4m3fn, 2)
    check_tensor(f"{name}'s scales", scales, torch.float32, 2)
    width, rows = data.shape
    check_multiple(f"{name}'s padded rows (data.shape[1])", rows, BLOCK_K)
    check_multiple(f"{name}'s columns (data.shape[0])", width, 128)
    if tuple(scales.shape) != (rows // BLOCK_K, width):
        raise ValueError(f"{name}'s scales must have shape {(rows // BLOCK_K, width)} (one per 128 x 1), "
                         f"got {tuple(scales.shape)}")
    return width, rows


_printed: set = set()


def k_grouped_fp8_gemm_tn_contiguous(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                     d: torch.Tensor, padded_offsets: torch.Tensor, *, accumulate: bool = False) -> None:
    """Grouped blockwise-FP8 ``D[g] (+)= A_g.T @ B_g`` (MoE weight gradients), contracting over
    group g's rows, into `d`.

    Args:
        a: ``(data, scales)`` of the rows ``[R, M]`` quantized by
            ``deep_gemm.quant.fp8_quantize_columns`` (its ``Fp8Columns``): data ``[M, Mp]``
            float8_e4m3fn, scales ``[Mp / 128, M]`` fp32.
        b: the same for the rows ``[R, N]``, quantized with the same group offsets.
        d: ``[G, M, N]`` float32 or bf16. Every group is written; an empty group gives zeros (or
            leaves ``d[g]`` unchanged with ``accumulate=True``).
        padded_offsets: ``[G + 1]`` int32 on the GPU: ``Fp8Columns.padded_offsets``, multiples
            of 128 (read on the GPU, no host sync). Not the token offsets the copies were made
            with: an offset that is not a multiple of 128 traps the kernel (the launch fails).
        accumulate: add into the existing `d` instead of overwriting it.

    Requires M and N multiples of 128. Each 128-token block is multiplied into fresh fp32
    registers, then added to the sum times its rows' and columns' scales.
    """
    (a_data, a_scales), (b_data, b_scales) = fp8_operand("a", a), fp8_operand("b", b)
    m, rows = _check_operand("a", a_data, a_scales)
    n, b_rows = _check_operand("b", b_data, b_scales)
    check_tensor("d", d, (torch.float32, torch.bfloat16), 3)
    num_groups = check_group_offsets(padded_offsets)
    if b_rows != rows:
        raise ValueError(f"a and b must have the same padded rows (quantized with the same groups), got {rows} and "
                         f"{b_rows}")
    if tuple(d.shape) != (num_groups, m, n):
        raise ValueError(f"d must have shape {(num_groups, m, n)}, got {tuple(d.shape)}")
    if max(rows, m, n) >= 2**31:
        raise ValueError("dimensions must stay below 2**31")
    check_bool(accumulate=accumulate)
    check_disjoint(dict(d=d), dict(a=a_data, a_scales=a_scales, b=b_data, b_scales=b_scales,
                                   padded_offsets=padded_offsets))
    device = check_cuda_devices(a=a_data, a_scales=a_scales, b=b_data, b_scales=b_scales, d=d,
                                padded_offsets=padded_offsets)
    if m == 0 or n == 0 or num_groups == 0:
        return
    if rows == 0:  # every group is empty
        if not accumulate:
            d.zero_()
        return

    config = get_config(d.dtype, accumulate)
    key = (m, n, rows, num_groups, d.dtype, accumulate)
    if print_configs_enabled() and key not in _printed:
        _printed.add(key)
        print(f"[deep_gemm] k_grouped_fp8_gemm_tn: M={m} N={n} rows={rows} G={num_groups} out={d.dtype} "
              f"accumulate={accumulate} -> {config.label}")
    kernel = get_kernel(d.dtype, accumulate)
    params = PARAMS.pack(
        tensor_map_a=make_tma_2d_desc(a_data, m, rows, 128, BLOCK_M),
        tensor_map_b=make_tma_2d_desc(b_data, n, rows, 128, BLOCK_N),
        tensor_map_d=bytes(128) if config.row_copies else make_tma_3d_desc(d, 128 // d.element_size(), 64),
        tensor_map_scales_a=make_tma_scales_desc(a_scales.T, BLOCK_M),
        tensor_map_scales_b=make_tma_scales_desc(b_scales.T, BLOCK_N),
        d=d.data_ptr(), group_offsets=padded_offsets.data_ptr(), m=m, n=n, rows=rows, num_groups=num_groups)
    num_tiles = num_groups * (m // BLOCK_M) * (n // BLOCK_N)
    kernel.launch(params, grid_size(kernel, num_tiles, device.index), device.index)
