"""M-grouped blockwise-FP8 GEMM (MoE forward and data gradient), contiguous layout, ragged groups.

The kernel (impls/sm90_fp8_m_grouped_gemm.cuh) shares the bf16 kernel's scheduler, pass gate,
row producers and epilogue; the problem checks are the bf16 launcher's (`MGroupedProblem`) plus
the scales'. Operands come from `deep_gemm.quant` (docs/DESIGN.md, "Blockwise FP8").
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..jit.params import ParamsStruct
from ..jit.runtime import Kernel, build_kernel
from ..jit.tma import make_tma_2d_desc, make_tma_3d_desc, make_tma_scales_desc
from ..utils import check_multiple, print_configs_enabled
from .common import BLOCK_M, NUM_THREADS, fp8_operand, grid_size, make_config, swizzled_staging_bytes
from .m_grouped_bf16 import BF16_STORE, SWIGLU_STORE, MGroupedProblem, tensor_store_staging_bytes

BLOCK_K = 128  # one scale block of K a stage
PARAMS = ParamsStruct("deep_gemm::MGroupedFp8GemmParams", [
    ("tensor_map_a", "tensor_map"), ("tensor_map_b", "tensor_map"), ("tensor_map_d", "tensor_map"),
    ("tensor_map_scales_a", "tensor_map"), ("tensor_map_act", "tensor_map"), ("d", "ptr"), ("act", "ptr"),
    ("act_fp8", "ptr"), ("act_scales", "ptr"), ("group_offsets", "ptr"), ("a_row_index", "ptr"), ("a", "ptr"),
    ("a_scales", "ptr"), ("b_scales", "ptr"), ("ready_flags", "ptr"), ("m", "u32"), ("n", "u32"), ("k", "u32"),
    ("num_groups", "u32"), ("a_rows", "u32"), ("num_passes", "u32"), ("pass_begin", "u32"), ("pass_end", "u32"),
    ("a_scales_ld", "u32"), ("b_scales_stride_g", "u32"), ("b_scales_stride_n", "u32"), ("b_scales_stride_k", "u32"),
    ("act_scales_ld", "u32")])
FP8_TMA_ROWS, FP8_GATHERED_ROWS = "Fp8TmaRows", "Fp8GatheredRows"  # producer/rows.cuh
# SwiGLU with act quantized in the epilogue (epilogue/m_grouped.cuh), and each epilogue's name suffix.
SWIGLU_FP8_ACT_STORE = "SwiGLUFp8ActTensorStore"
EPILOGUE_LABELS = {BF16_STORE: "", SWIGLU_STORE: "_swiglu", SWIGLU_FP8_ACT_STORE: "_swiglu_fp8act"}


# Tiles of 128 rows x 128 or 256 columns (one B scale block per 128 columns and k-block), with A's
# row scales in each stage: 132 of them (the TMA box starts at the tile's first row rounded down
# to 4), 640 bytes (producer::kFp8ScaleStageBytes). 256 columns when N allows: A's tile is read once for
# twice the columns, and a tile's fixed costs (epilogue, drain) weigh half as much.
# The bf16 output stages a warpgroup's whole tile (epilogue::WholeTileTma: BLOCK_N / 64 buffers of
# 8 KB; docs/PERF.md, "Decisions": whole-tile staging), and so does the SwiGLU epilogue with an
# e4m3 act (h's four chunks and the act: five buffers); the bf16-act SwiGLU epilogue has two.
SCALE_BOX_ROWS, SCALE_STAGE_BYTES = 132, 640
CONFIGS = {n: make_config(n, max(tensor_store_staging_bytes(n), swizzled_staging_bytes(n // 64)),
                          scale_bytes_per_stage=SCALE_STAGE_BYTES) for n in (128, 256)}
SWIGLU_CONFIGS = {  # (256-wide tiles)
    SWIGLU_STORE: make_config(256, tensor_store_staging_bytes(256), scale_bytes_per_stage=SCALE_STAGE_BYTES),
    SWIGLU_FP8_ACT_STORE: make_config(256, max(tensor_store_staging_bytes(256), swizzled_staging_bytes(5)),
                                      scale_bytes_per_stage=SCALE_STAGE_BYTES),
}


def get_config(n: int):
    """The tile width for N (a multiple of 128): 256 where it divides N."""
    return CONFIGS[256 if n % 256 == 0 else 128]


@functools.lru_cache(maxsize=None)
def get_kernel(producer: str, block_n: int, epilogue: str = BF16_STORE) -> Kernel:
    """`epilogue`: BF16_STORE (bf16 D, a warpgroup's whole tile staged at once), SWIGLU_STORE
    (256-wide tiles of 128 gate and 128 up columns), or SWIGLU_FP8_ACT_STORE (SWIGLU_STORE with act
    in e4m3, scaled as `fp8_quantize_rows` does by default)."""
    config = CONFIGS[block_n] if epilogue == BF16_STORE else SWIGLU_CONFIGS[epilogue]
    args = {BF16_STORE: f"{block_n}, deep_gemm::epilogue::WholeTileTma",
            SWIGLU_FP8_ACT_STORE: f"{block_n}, deep_gemm::ptx::Fp32Scale"}.get(epilogue, f"{block_n}")
    # The math warpgroups issue their MMAs in turns where A's rows come by TMA; with gathered rows
    # turns measured slower (docs/PERF.md, "Decisions": MMA turns).
    turns = "IssueTurns" if producer == FP8_TMA_ROWS else "NoTurns"
    kernel_type = (f"deep_gemm::Sm90FP8MGroupedGemm<{block_n}, {config.num_stages}, "
                   f"deep_gemm::producer::{producer}, deep_gemm::epilogue::{epilogue}<{args}>, "
                   f"deep_gemm::mma::{turns}>")
    return build_kernel("sm90_fp8_m_grouped_gemm.cuh", "dg_sm90_fp8_m_grouped_gemm", kernel_type, PARAMS, NUM_THREADS,
                        config.smem_bytes)


def all_kernels() -> list[tuple[str, int, str]]:
    """(producer policy, tile width, epilogue) of every variant (for `get_kernel`)."""
    return ([(producer, n, BF16_STORE) for producer in (FP8_TMA_ROWS, FP8_GATHERED_ROWS) for n in CONFIGS] +
            [(producer, 256, epilogue) for epilogue in (SWIGLU_STORE, SWIGLU_FP8_ACT_STORE)
             for producer in (FP8_TMA_ROWS, FP8_GATHERED_ROWS)])


def _check_fp32(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must have dtype torch.float32, got {t.dtype}")


def _check_row_scales(name: str, scales: torch.Tensor, rows: int, k: int) -> None:
    """1 x 128 scales of `rows` rows of width `k` in the layout of `Fp8Rows.scales`: ``[rows, k /
    128]`` fp32, column-major with a column stride that is a multiple of 4 (16 bytes), 16-byte aligned
    (the GEMMs read them by TMA, hence stricter than `quant.kernels`' check, whose kernel loads them
    one by one)."""
    _check_fp32(name, scales)
    if tuple(scales.shape) != (rows, k // BLOCK_K):
        raise ValueError(f"{name} must have shape {(rows, k // BLOCK_K)} (one per 1 x 128), got {tuple(scales.shape)}")
    if rows and (scales.stride(0) != 1 or scales.stride(1) % 4 or not rows <= scales.stride(1) < 2**31
                 or scales.data_ptr() % 16):
        raise ValueError(f"{name} must be column-major with a column stride that is a multiple of 4 (16 bytes), "
                         "16-byte aligned: the layout of deep_gemm.quant.Fp8Rows.scales (as fp8_quantize_rows "
                         "returns it, or empty_fp8_rows allocates it)")


def _check_scales(a_scales: torch.Tensor, b_scales: torch.Tensor, a_rows: int, k: int, g: int, n: int) -> None:
    """A's 1 x 128 scales column-major with a 16-byte aligned column stride (`Fp8Rows.scales`);
    B's 128 x 128 scales in any strides (e.g. the transposed view for the data gradient)."""
    _check_row_scales("a_scales", a_scales, a_rows, k)
    _check_fp32("b_scales", b_scales)
    if tuple(b_scales.shape) != (g, n // 128, k // 128):
        raise ValueError(f"b_scales must have shape {(g, n // 128, k // 128)} (one per 128 x 128), "
                         f"got {tuple(b_scales.shape)}")
    if any(s < 0 or s >= 2**31 for s in b_scales.stride()):
        raise ValueError(f"b_scales' strides must be in [0, 2**31), got {b_scales.stride()}")


_printed: set = set()


def m_grouped_fp8_gemm_nt_contiguous(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                     d: torch.Tensor, group_offsets: torch.Tensor, *,
                                     a_row_index: Optional[torch.Tensor] = None, num_passes: int = 1,
                                     ready_flags: Optional[torch.Tensor] = None,
                                     pass_range: Optional[tuple[int, int]] = None) -> None:
    """Grouped blockwise-FP8 ``D[rows of g] = A[rows of g] @ B[g].T``, bf16 out, in place into `d`:
    the MoE forward on the weights, its data gradient on their transposed copy.

    Args:
        a: ``(data, scales)``: data ``[M, K]`` float8_e4m3fn, row-major; scales ``[M, K / 128]``
            fp32, one per 1 x 128, column-major with a column stride that is a multiple of 4
            (``deep_gemm.quant.fp8_quantize_rows(x)``'s ``(data, scales)``).
        b: ``(data, scales)``: data ``[G, N, K]`` float8_e4m3fn, row-major; scales
            ``[G, N / 128, K / 128]`` fp32, one per 128 x 128, any strides. For weights ``w`` quantized
            by ``deep_gemm.quant.fp8_quantize_weights``: the forward passes ``(w.data, w.scales)``,
            the data gradient ``w.transposed_operand()`` (``(w.data_t, w.scales.transpose(1, 2))``).
        d: ``[M, N]`` bf16 output. Only rows inside a group are written.
        group_offsets: ``[G + 1]`` int32 on the GPU: group g owns rows ``[offsets[g], offsets[g+1])``;
            sizes are arbitrary (zero, one row, not multiples of 128: no padding). No host sync.
        a_row_index: optional int64 ``[M]``: row i of A is row ``a_row_index[i]`` of the data (and
            its scales), gathered by the kernel's loads; the data then has any number of rows.
            Indices outside the data read zeros.
        num_passes, ready_flags, pass_range: rows in passes that wait for their data, computed by
            one launch or several, as in `deep_gemm.m_grouped_bf16_gemm_nt_contiguous`.

    Requires K and N multiples of 128 and 16-byte aligned tensors. Each 128-deep block of K is
    multiplied into fresh fp32 registers, then added to the sum times its A and B scales.
    """
    _launch(a, b, d, group_offsets, a_row_index, num_passes, ready_flags, pass_range)


def m_grouped_fp8_gemm_nt_swiglu_contiguous(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                            h: torch.Tensor, act: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                                            group_offsets: torch.Tensor, *, a_row_index: Optional[torch.Tensor] = None,
                                            num_passes: int = 1, ready_flags: Optional[torch.Tensor] = None) -> None:
    """The MoE's first GEMM in blockwise FP8 with SwiGLU in its epilogue: ``h = A @ B[g].T`` in
    bf16 and ``act = silu(h[:, :I]) * h[:, I:]`` (from the fp32 sums), in bf16 or quantized to
    e4m3 per 1 x 128, per group of rows.

    Args:
        a, group_offsets, a_row_index, num_passes, ready_flags: as in
            `m_grouped_fp8_gemm_nt_contiguous`.
        b: ``(data, scales)`` of ``[G, 2I, K]``: rows ``[0, I)`` gate, ``[I, 2I)`` up (the
            weights' natural layout, as `fp8_quantize_weights` quantizes them).
        h: ``[M, 2I]`` bf16 output.
        act: ``[M, I]`` bf16 output, or a ``(data, scales)`` pair of outputs in the layout of
            `deep_gemm.quant.Fp8Rows` (as ``deep_gemm.quant.empty_fp8_rows(M, I, device)``
            allocates it): data ``[M, I]`` float8_e4m3fn, row-major; scales ``[M, I / 128]``
            fp32, column-major with a column stride that is a multiple of 4 and at least M
            (``empty_fp8_rows`` gives ``stride() == (1, align(M, 4))``), 16-byte aligned. The pair equals
            ``fp8_quantize_rows(act)`` of the bf16 act bit for bit (fp32 scales) and is the A
            operand of the second GEMM: no bf16 act is written, no quantization pass reads it.

    Only rows inside a group are written (of h, act, and act's scales). Requires I and K
    multiples of 128. A tile holds 128 gate and the matching 128 up columns, so its act columns
    are one scale block.
    """
    _launch(a, b, h, group_offsets, a_row_index, num_passes, ready_flags, None, act)


def _act_outputs(act) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """SwiGLU's act as (data, scales): scales None for a bf16 act."""
    if isinstance(act, (tuple, list)):
        return fp8_operand("act", act)
    if isinstance(act, torch.Tensor) and act.dtype == torch.float8_e4m3fn:
        raise TypeError("an e4m3 act needs its scales: pass act as a (data, scales) pair")
    return act, None


def _launch(a, b, d, group_offsets, a_row_index, num_passes, ready_flags, pass_range, act=None) -> None:
    """Checks everything, then launches (with `act`, a bf16 tensor or an e4m3 (data, scales) pair:
    the SwiGLU epilogue, 256-wide tiles)."""
    (a_data, a_scales), (b_data, b_scales) = fp8_operand("a", a), fp8_operand("b", b)
    swiglu = act is not None
    act_data, act_scales = _act_outputs(act) if swiglu else (None, None)
    fp8_act = act_scales is not None
    problem = MGroupedProblem.check_shapes(a_data, b_data, d, group_offsets, False, a_row_index, num_passes,
                                           ready_flags, pass_range, act_data, operand_dtype=torch.float8_e4m3fn,
                                           act_dtype=torch.float8_e4m3fn if fp8_act else torch.bfloat16)
    check_multiple("K", problem.k, BLOCK_K)
    check_multiple("N", problem.n, 128)
    _check_scales(a_scales, b_scales, a_data.shape[0], problem.k, problem.num_groups, problem.n)
    if fp8_act:
        _check_row_scales("act's scales", act_scales, problem.m, problem.n // 2)
    problem.check_disjoint(dict(a_scales=a_scales, b_scales=b_scales), act=act_data, act_scales=act_scales)
    problem.check_devices(a_scales=a_scales, b_scales=b_scales, act=act_data, act_scales=act_scales)
    if problem.empty:
        return
    p = problem
    epilogue = SWIGLU_FP8_ACT_STORE if fp8_act else SWIGLU_STORE if swiglu else BF16_STORE
    config = SWIGLU_CONFIGS[epilogue] if swiglu else get_config(p.n)
    name = "nt" + EPILOGUE_LABELS[epilogue]
    if print_configs_enabled() and (name, p.m, p.n, p.k, p.num_groups) not in _printed:
        _printed.add((name, p.m, p.n, p.k, p.num_groups))
        print(f"[deep_gemm] m_grouped_fp8_gemm_{name}: M={p.m} N={p.n} K={p.k} G={p.num_groups} -> {config.label}")
    boxes = 2 if swiglu else 1  # the SwiGLU tile's gate and up rows of B
    params = PARAMS.pack(
        tensor_map_a=make_tma_2d_desc(a_data, a_data.shape[0], p.k, 128, BLOCK_M),  # (gathered rows: unused)
        tensor_map_b=make_tma_2d_desc(b_data, p.num_groups * p.n, p.k, 128, config.block_n // boxes),
        tensor_map_d=make_tma_3d_desc(d.unsqueeze(0), 64, 64),
        tensor_map_scales_a=make_tma_scales_desc(a_scales, SCALE_BOX_ROWS),
        # (act's boxes: 64 rows x 128 bytes, bf16 or e4m3)
        tensor_map_act=make_tma_3d_desc(act_data.unsqueeze(0), 128 // act_data.element_size(), 64) if swiglu
        else bytes(128),
        d=d.data_ptr(), act=act_data.data_ptr() if swiglu and not fp8_act else 0,
        act_fp8=act_data.data_ptr() if fp8_act else 0, act_scales=act_scales.data_ptr() if fp8_act else 0,
        group_offsets=group_offsets.data_ptr(),
        a_row_index=0 if a_row_index is None else a_row_index.data_ptr(), a=a_data.data_ptr(),
        a_scales=a_scales.data_ptr(), b_scales=b_scales.data_ptr(),
        ready_flags=0 if ready_flags is None else ready_flags.data_ptr(),
        m=p.m, n=p.n, k=p.k, num_groups=p.num_groups, a_rows=a_data.shape[0], num_passes=p.num_passes,
        pass_begin=p.pass_range[0], pass_end=p.pass_range[1], a_scales_ld=a_scales.stride(1),
        b_scales_stride_g=b_scales.stride(0), b_scales_stride_n=b_scales.stride(1), b_scales_stride_k=b_scales.stride(2),
        act_scales_ld=act_scales.stride(1) if fp8_act else 0)
    kernel = get_kernel(FP8_TMA_ROWS if a_row_index is None else FP8_GATHERED_ROWS, config.block_n, epilogue)
    num_tiles_bound = (p.m // BLOCK_M + p.num_groups * p.num_passes) * (p.n // config.block_n)
    kernel.launch(params, grid_size(kernel, num_tiles_bound, p.device.index), p.device.index)
