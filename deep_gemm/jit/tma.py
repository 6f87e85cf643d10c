"""Host-side TMA descriptors (`CUtensorMap`) for 2-D and 3-D bf16 / fp32 / fp8 tensors: operand tiles
with 128-byte swizzle, and plain (unswizzled) boxes of FP8 scales."""
from __future__ import annotations

import ctypes
import functools

import torch
from cuda.bindings import driver as cu

from .runtime import OnDevice, check

_DTYPES = {
    torch.bfloat16: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    torch.float32: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    torch.float8_e4m3fn: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,  # (TMA moves bytes)
}


@functools.lru_cache(maxsize=4096)
def _encode(device: int, dtype: torch.dtype, address: int, dims: tuple, strides_bytes: tuple,
            box: tuple, swizzle: bool = True) -> bytes:
    """dims and box innermost first; strides_bytes of every dimension but the innermost."""
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t  # some cuda-bindings versions reject plain ints here
    with OnDevice(device):  # the encoder wants a current context (autograd's threads may have none)
        tensor_map = check(cu.cuTensorMapEncodeTiled(
            _DTYPES[dtype], len(dims), address, [u64(d) for d in dims], [u64(s) for s in strides_bytes],
            [u32(b) for b in box], [u32(1)] * len(dims),
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle else cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    return ctypes.string_at(tensor_map.getPtr(), 128)


def make_tma_2d_desc(t: torch.Tensor, rows: int, cols: int, box_cols: int, box_rows: int) -> bytes:
    """The 128-byte CUtensorMap of `t` seen as a row-major [rows, cols] matrix.

    `box_cols` (the contiguous dimension) must be 64 for bf16 (one 128-byte swizzle row);
    elements outside the matrix read as zero. Encodings are cached: a descriptor depends only
    on these arguments, so re-encoding the same buffer in the next step costs a dict lookup.
    """
    assert box_cols * t.element_size() == 128
    return _encode(t.device.index, t.dtype, t.data_ptr(), (cols, rows), (cols * t.element_size(),),
                   (box_cols, box_rows))


def make_tma_3d_desc(t: torch.Tensor, box_cols: int, box_rows: int) -> bytes:
    """The CUtensorMap of a contiguous ``[G, rows, cols]`` tensor `t`, boxes of
    ``[1, box_rows, box_cols]`` (`box_cols` * element size = 128 bytes, swizzled). Stores
    through it are clipped at every dimension's end, so a box never spills into the next
    matrix of the batch."""
    assert box_cols * t.element_size() == 128 and t.dim() == 3 and t.is_contiguous()
    g, rows, cols = t.shape
    row_bytes = cols * t.element_size()
    return _encode(t.device.index, t.dtype, t.data_ptr(), (cols, rows, g), (row_bytes, rows * row_bytes),
                   (box_cols, box_rows, 1))


def make_tma_scales_desc(scales: torch.Tensor, box_rows: int = 128) -> bytes:
    """The CUtensorMap of FP8 scales ``[X, B]`` fp32 stored column-major with a 16-byte aligned
    column stride (`deep_gemm.quant.Fp8Rows.scales`, or the transpose of `Fp8Columns.scales`):
    boxes of `box_rows` consecutive scales of one block column, unswizzled; rows past X read as
    zeros."""
    m, num_k_blocks = scales.shape
    assert scales.dtype == torch.float32 and scales.stride(0) == 1 and scales.stride(1) % 4 == 0
    return _encode(scales.device.index, torch.float32, scales.data_ptr(), (m, num_k_blocks), (scales.stride(1) * 4,),
                   (box_rows, 1), swizzle=False)
