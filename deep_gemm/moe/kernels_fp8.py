"""Launcher of the FP8 layer's fused SwiGLU backward (impls/moe_swiglu_bwd_fp8.cuh): the SwiGLU
backward of `moe_swiglu_bwd_bf16` with its outputs quantized in the same pass, as the FP8
backward's GEMMs read them. Checks run before the launch; no host sync."""
from __future__ import annotations

import functools

import torch

from ..jit.params import ParamsStruct
from ..jit.runtime import Kernel, build_kernel
from ..quant.kernels import MAX_ELEMENTS, MAX_GROUPS, empty_fp8_columns, empty_fp8_rows
from ..quant.reference import BLOCK, Fp8Columns, Fp8Rows
from ..utils import check_cuda_devices, check_tensor
from .layout import RoutingLayout

_PARAMS = ParamsStruct("deep_gemm::MoESwiGLUBwdFp8Params", [
    ("h", "ptr"), ("d_act", "ptr"), ("row_weight", "ptr"), ("offsets", "ptr"), ("dz_q", "ptr"), ("dz_scales", "ptr"),
    ("dz_qt", "ptr"), ("dz_scales_t", "ptr"), ("act_qt", "ptr"), ("act_scales_t", "ptr"), ("padded_offsets", "ptr"),
    ("row_dw", "ptr"), ("m", "u32"), ("inter", "u32"), ("num_groups", "u32"), ("scales_ld", "u32"), ("mp", "u32")])
_NUM_THREADS = 256
# Three fp8_quantize::ColumnSmem (a 128 x 128 bf16 tile and 4 x 128 fp32 column amaxes each) and
# the 128 rows' weights.
_SMEM_BYTES = 3 * (BLOCK * BLOCK * 2 + 4 * BLOCK * 4) + BLOCK * 4


@functools.lru_cache(maxsize=None)
def get_kernel(power_of_two_scales: bool) -> Kernel:
    # Two CTAs an SM (registers capped at 128), each with its three tiles in shared memory.
    rule = "deep_gemm::ptx::Pow2Scale" if power_of_two_scales else "deep_gemm::ptx::Fp32Scale"
    return build_kernel("moe_swiglu_bwd_fp8.cuh", "dg_moe_swiglu_bwd_fp8", f"deep_gemm::MoESwiGLUBwdFp8<{rule}>",
                        _PARAMS, _NUM_THREADS, _SMEM_BYTES, min_blocks_per_sm=2)


def all_kernels() -> list[bool]:
    """`power_of_two_scales` of every variant (for `get_kernel`)."""
    return [False, True]


def moe_swiglu_bwd_fp8(h: torch.Tensor, d_act: torch.Tensor, layout: RoutingLayout, *,
                       power_of_two_scales: bool = False) -> tuple[Fp8Rows, Fp8Columns, Fp8Columns, torch.Tensor]:
    """`moe_swiglu_bwd_bf16` (h ``[T * K, 2I]``, d_act ``[T * K, I]``, both bf16, I a multiple of
    128, at most 1024 experts) with its outputs quantized in one pass, for the FP8 backward.

    Returns ``(dz_rows, dz_columns, act_columns, row_dw)``: dz per 1 x 128 (`Fp8Rows`, rows of
    empty slots unwritten) and per expert's 128 x 1 (`Fp8Columns` of the layout's offsets),
    ``act_weighted`` per expert's 128 x 1 (sharing dz_columns' padded offsets), and
    ``row_dw [T * K]`` fp32 (empty slots unwritten). The FP8 tensors equal
    ``fp8_quantize_columns(dz, layout.offsets, with_rows=True)`` and
    ``fp8_quantize_columns(act_weighted, layout.offsets)[1]`` of the bf16 kernel's outputs bit
    for bit; row_dw equals its row_dw up to the order of the fp32 sum. No bf16 dz or
    act_weighted is written."""
    for name, t in (("h", h), ("d_act", d_act)):
        check_tensor(name, t, torch.bfloat16, 2)
    rows, inter = d_act.shape
    if tuple(h.shape) != (rows, 2 * inter) or rows != layout.num_slots:
        raise ValueError(f"h must be [{layout.num_slots}, 2I] and d_act [{layout.num_slots}, I], got "
                         f"{tuple(h.shape)} and {tuple(d_act.shape)}")
    if inter % BLOCK:
        raise ValueError(f"the FP8 SwiGLU backward takes I a multiple of {BLOCK}, got {inter}")
    num_groups = layout.offsets.numel() - 1
    if not 1 <= num_groups <= MAX_GROUPS:
        raise ValueError(f"the FP8 SwiGLU backward takes 1 to {MAX_GROUPS} experts, got {num_groups}")
    if h.numel() >= MAX_ELEMENTS:
        raise ValueError(f"h has {h.numel()} elements: the kernel indexes rows with 32-bit counts")
    device = check_cuda_devices(h=h, d_act=d_act, offsets=layout.offsets, row_weight=layout.row_weight).index
    dz_rows = empty_fp8_rows(rows, 2 * inter, h.device)
    dz_columns = empty_fp8_columns(2 * inter, rows, num_groups, h.device)
    act_columns = empty_fp8_columns(inter, rows, num_groups, h.device, dz_columns.padded_offsets)
    row_dw = torch.empty(rows, device=h.device, dtype=torch.float32)
    width = dz_columns.data.shape[1]
    kernel = get_kernel(power_of_two_scales)
    # (a launch even with no rows: it writes the padded offsets)
    # one CTA a block of 128 rows (docs/PERF.md, "Decisions": FP8 quantization grids)
    num_blocks = kernel.grid(width // BLOCK, device, persistent=False)
    kernel.launch(_PARAMS.pack(
        h=h.data_ptr(), d_act=d_act.data_ptr(), row_weight=layout.row_weight.data_ptr(),
        offsets=layout.offsets.data_ptr(), dz_q=dz_rows.data.data_ptr(), dz_scales=dz_rows.scales.data_ptr(),
        dz_qt=dz_columns.data.data_ptr(), dz_scales_t=dz_columns.scales.data_ptr(),
        act_qt=act_columns.data.data_ptr(), act_scales_t=act_columns.scales.data_ptr(),
        padded_offsets=dz_columns.padded_offsets.data_ptr(), row_dw=row_dw.data_ptr(), m=rows, inter=inter,
        num_groups=num_groups, scales_ld=dz_rows.scales.stride(1), mp=width), num_blocks, device)
    return dz_rows, dz_columns, act_columns, row_dw
