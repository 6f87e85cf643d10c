"""The FP8 layouts, and the PyTorch reference of the quantization kernels: the same values, bit
for bit, on any device (the kernels' columns past the padded groups are left unwritten; here
they are zeros). Inputs must be finite: a NaN propagates into its block's scale here, while the
kernels' amax skips it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

BLOCK = 128  # a scale covers 128 contraction elements (and 128 x 128 for weights)
E4M3_MAX = 448.0


@dataclass
class Fp8Rows:
    """Rows quantized per 1 x 128: ``x[m, k] ~ data[m, k] * scales[m, k // 128]``.

    data ``[M, K]`` float8_e4m3fn, row-major; scales ``[M, K / 128]`` float32, column-major with
    its column stride rounded up to 4 (``stride() == (1, align(M, 4))``: what the GEMM's TMA
    loads read)."""
    data: torch.Tensor
    scales: torch.Tensor


@dataclass
class Fp8Columns:
    """Rows grouped by `group_offsets` (group g: rows ``[offsets[g], offsets[g+1])``), transposed
    and quantized per 128 x 1, each group padded with zeros to a multiple of 128 rows.

    data ``[K, Mp]`` float8_e4m3fn: row m of group g is column ``padded_offsets[g] + m -
    offsets[g]``; scales ``[Mp / 128, K]`` float32: one per 128 columns of data and row of it;
    padded_offsets ``[G + 1]`` int32, multiples of 128. ``Mp = padded_group_width(M, G)`` bounds
    ``padded_offsets[G]``; columns past it are not part of any group."""
    data: torch.Tensor
    scales: torch.Tensor
    padded_offsets: torch.Tensor


@dataclass
class Fp8Weights:
    """Weights quantized per 128 x 128 block, in both orientations with the same scales (or in
    the one asked for: the other is None, see `fp8_quantize_weights`' `which`).

    data ``[G, N, K]`` and data_t ``[G, K, N]`` float8_e4m3fn (``data_t[g] == data[g].T``);
    scales ``[G, N / 128, K / 128]`` float32: ``w[g, n, k] ~ data[g, n, k] * scales[g, n // 128, k // 128]``."""
    data: Optional[torch.Tensor]
    data_t: Optional[torch.Tensor]
    scales: torch.Tensor

    def transposed_operand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The data gradient's B for the FP8 GEMMs (both operands K-major): ``(data_t, scales
        [G, K / 128, N / 128])``, a view of the same scales."""
        if self.data_t is None:
            raise ValueError("these FP8 weights were quantized without their transposed copy (which='data')")
        return self.data_t, self.scales.transpose(1, 2)


def padded_group_width(num_rows: int, num_groups: int) -> int:
    """Columns of `Fp8Columns.data` for `num_rows` rows in `num_groups` groups: the most that
    rounding every group up to 128 rows can take, itself a multiple of 128."""
    return -(-(num_rows + (BLOCK - 1) * num_groups) // BLOCK) * BLOCK


MIN_SCALE = 2.0**-126  # the smallest normal fp32: a subnormal scale's reciprocal would be inf


def scale_of(amax: torch.Tensor, power_of_two: bool) -> torch.Tensor:
    """The scale mapping `amax` (float32) onto e4m3's largest value, at least MIN_SCALE, 1 where
    amax is 0; rounded up to a power of two with `power_of_two`. (The divisor is a tensor: with
    a Python scalar, CUDA's division multiplies by its reciprocal, one bit off the kernels' IEEE
    division.)"""
    scale = (amax / torch.full_like(amax, E4M3_MAX)).clamp(min=MIN_SCALE)
    scale = torch.where(amax > 0, scale, torch.ones_like(amax))
    if power_of_two:
        bits = scale.view(torch.int32)
        scale = ((bits + 0x7FFFFF) & -0x800000).view(torch.float32)  # (0xFF800000 as int32)
    return scale


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x times 1 / scale (float32, broadcast; the reciprocal rounded once, as the kernels do) as
    e4m3, round to nearest even, saturating at +-448."""
    return (x * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _scales_column_major(scales: torch.Tensor) -> torch.Tensor:
    """[M, KB] scales in the column-major layout of `Fp8Rows.scales`."""
    m, kb = scales.shape
    storage = torch.zeros(kb, -(-m // 4) * 4, dtype=torch.float32, device=scales.device)
    storage[:, :m] = scales.T
    return storage[:, :m].T


def fp8_quantize_rows_torch(x: torch.Tensor, *, power_of_two_scales: bool = False) -> Fp8Rows:
    """`deep_gemm.quant.fp8_quantize_rows` in PyTorch. x ``[M, K]``, K a multiple of 128."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    scales = scale_of(blocks.abs().amax(dim=2), power_of_two_scales)
    data = to_e4m3(blocks, scales[:, :, None]).reshape(m, k)
    return Fp8Rows(data, _scales_column_major(scales))


def group_bounds(group_offsets: torch.Tensor, num_rows: int) -> list[tuple[int, int]]:
    """Each group's rows as the kernels read the offsets: begin = offsets[g] clamped to [0, M],
    end = offsets[g + 1] clamped to [begin, M] (malformed offsets never reach past the rows)."""
    offsets = group_offsets.tolist()
    bounds = []
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        begin = min(max(lo, 0), num_rows)
        bounds.append((begin, min(max(hi, begin), num_rows)))
    return bounds


def padded_offsets_torch(group_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`Fp8Columns.padded_offsets`: each group's first column, every group rounded up to 128 rows."""
    padded = [0]
    for begin, end in group_bounds(group_offsets, num_rows):
        padded.append(padded[-1] + -(-(end - begin) // BLOCK) * BLOCK)
    return torch.tensor(padded, dtype=torch.int32)


def gather_rows(x: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """``x[row_index]``, zeros where an index lies outside x's rows."""
    valid = (row_index >= 0) & (row_index < x.shape[0])
    if x.shape[0] == 0:
        return x.new_zeros(row_index.numel(), x.shape[1])
    return torch.where(valid[:, None], x[row_index.clamp(0, x.shape[0] - 1)], 0)


def fp8_quantize_columns_torch(x: torch.Tensor, group_offsets: torch.Tensor, *, row_index: Optional[torch.Tensor] = None,
                               with_rows: bool = False, power_of_two_scales: bool = False
                               ) -> tuple[Optional[Fp8Rows], Fp8Columns]:
    """`deep_gemm.quant.fp8_quantize_columns` in PyTorch (rows outside every group are in no
    copy; rows that two malformed groups share are in both)."""
    if row_index is not None:
        x = gather_rows(x, row_index)
    m, k = x.shape
    num_groups = group_offsets.numel() - 1
    padded = padded_offsets_torch(group_offsets, m)
    width = padded_group_width(m, num_groups)
    xt = x.new_zeros(k, width, dtype=torch.float32)
    for g, (begin, end) in enumerate(group_bounds(group_offsets, m)):
        xt[:, int(padded[g]):int(padded[g]) + end - begin] = x[begin:end].float().T
    blocks = xt.reshape(k, width // BLOCK, BLOCK)
    scales = scale_of(blocks.abs().amax(dim=2), power_of_two_scales)  # [K, Mp / 128]
    data = to_e4m3(blocks, scales[:, :, None]).reshape(k, width)
    rows = fp8_quantize_rows_torch(x, power_of_two_scales=power_of_two_scales) if with_rows else None
    return rows, Fp8Columns(data, scales.T.contiguous(), padded.to(x.device))


def fp8_quantize_weights_torch(w: torch.Tensor, *, power_of_two_scales: bool = False,
                               which: str = "both") -> Fp8Weights:
    """`deep_gemm.quant.fp8_quantize_weights` in PyTorch. w ``[G, N, K]``, N and K multiples of 128."""
    g, n, k = w.shape
    blocks = w.float().reshape(g, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scales = scale_of(blocks.abs().amax(dim=(2, 4)), power_of_two_scales)
    data = to_e4m3(blocks, scales[:, :, None, :, None]).reshape(g, n, k)
    return Fp8Weights(data if which != "data_t" else None,
                      data.transpose(1, 2).contiguous() if which != "data" else None, scales)


def dequantize_rows(rows: Fp8Rows) -> torch.Tensor:
    """``[M, K]`` float32: each value times its scale."""
    return rows.data.float() * rows.scales.repeat_interleave(BLOCK, dim=1)


def dequantize_columns(columns: Fp8Columns, group_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[M, K]`` float32 in the rows' original order (rows outside every group: zeros)."""
    k = columns.data.shape[0]
    values = columns.data.float() * columns.scales.T.repeat_interleave(BLOCK, dim=1)
    out = values.new_zeros(num_rows, k)
    padded = columns.padded_offsets.tolist()
    for g, (begin, end) in enumerate(group_bounds(group_offsets, num_rows)):
        out[begin:end] = values[:, padded[g]:padded[g] + end - begin].T
    return out


def dequantize_weights(weights: Fp8Weights) -> torch.Tensor:
    """``[G, N, K]`` float32."""
    scales = weights.scales.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    return weights.data.float() * scales
