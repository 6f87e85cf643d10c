"""Launchers of the FP8 quantization kernels (impls/fp8_quantize.cuh). Every check runs before
any launch; nothing syncs with the host (group offsets are read on the GPU)."""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from ..jit.params import ParamsStruct
from ..jit.runtime import Kernel, build_kernel
from ..utils import check_bool, check_cuda_devices, check_disjoint, check_group_offsets, check_multiple, check_tensor
from .reference import (BLOCK, Fp8Columns, Fp8Rows, Fp8Weights, dequantize_rows, fp8_quantize_columns_torch,
                        fp8_quantize_rows_torch, fp8_quantize_weights_torch, padded_group_width)

_ACTIVATIONS = ParamsStruct("deep_gemm::Fp8QuantizeActivationsParams", [
    ("x", "ptr"), ("x_scales", "ptr"), ("row_index", "ptr"), ("offsets", "ptr"), ("q", "ptr"), ("scales", "ptr"),
    ("qt", "ptr"), ("scales_t", "ptr"), ("padded_offsets", "ptr"), ("m", "u32"), ("k", "u32"), ("num_groups", "u32"),
    ("scales_ld", "u32"), ("mp", "u32"), ("x_rows", "u32"), ("x_scales_ld", "u32")])
_WEIGHTS = ParamsStruct("deep_gemm::Fp8QuantizeWeightsParams", [
    ("w", "ptr"), ("q", "ptr"), ("qt", "ptr"), ("scales", "ptr"), ("num_groups", "u32"), ("n", "u32"), ("k", "u32")])
_NUM_THREADS = 256
MAX_GROUPS = 1024  # the kernel scans the group sizes in shared memory (fp8_quantize::kMaxGroups)
MAX_ELEMENTS = 2**31  # (exclusive) the kernels count elements in 32 bits


def quantization_fits(rows: int, cols: int, num_groups: int = 1) -> bool:
    """Whether one quantization pass takes ``[rows, cols]`` in `num_groups` groups: fewer than
    MAX_ELEMENTS elements, at most MAX_GROUPS groups."""
    return rows * cols < MAX_ELEMENTS and num_groups <= MAX_GROUPS


# The weights' kernel: a 128 x 128 bf16 tile, its transposed e4m3 copy and 8 fp32 warp maxima of
# dynamic shared memory.
_WEIGHTS_SMEM_BYTES = BLOCK * BLOCK * 2 + BLOCK * BLOCK + 8 * 4


class _KernelSpec(NamedTuple):
    struct: str  # the C++ struct, and its template arguments after the scale rule
    source: str
    params: ParamsStruct
    smem_bytes: int  # dynamic shared memory
    blocks_per_sm: int  # CTAs an SM that its registers must allow
    persistent: bool  # a grid of resident CTAs walking the tiles, else one CTA a tile


# Each kernel holds one tile in registers at a time. The activations' kernels (columns through
# shared memory) and the rows' kernel run four CTAs an SM (<= 64 registers a thread), the weights'
# kernel two (<= 128: its staged transposed copy takes 150 uncapped); the activations' kernels
# walk the tiles with resident CTAs (each first scans the groups), the others one CTA a tile
# (docs/PERF.md, "Decisions": FP8 quantization grids).
_KERNELS = {
    "activations": _KernelSpec("Fp8QuantizeActivations", "", _ACTIVATIONS, 0, 4, True),
    # the same from e4m3 rows and their scales, dequantized in the loads
    "activations_from_fp8": _KernelSpec("Fp8QuantizeActivations", ", deep_gemm::fp8_quantize::Fp8RowsSource",
                                        _ACTIVATIONS, 0, 4, True),
    "rows": _KernelSpec("Fp8QuantizeRows", "", _ACTIVATIONS, 0, 4, False),
    "weights": _KernelSpec("Fp8QuantizeWeights", "", _WEIGHTS, _WEIGHTS_SMEM_BYTES, 2, False),
    # one orientation of the weights: the forward's, or the data gradient's transpose
    "weights_data": _KernelSpec("Fp8QuantizeWeights", ", deep_gemm::fp8_quantize::ForwardWeightCopy", _WEIGHTS,
                                _WEIGHTS_SMEM_BYTES, 2, False),
    "weights_data_t": _KernelSpec("Fp8QuantizeWeights", ", deep_gemm::fp8_quantize::TransposedWeightCopy", _WEIGHTS,
                                  _WEIGHTS_SMEM_BYTES, 2, False),
}
_WEIGHT_KERNELS = {"both": "weights", "data": "weights_data", "data_t": "weights_data_t"}


@functools.lru_cache(maxsize=None)
def get_kernel(name: str, power_of_two_scales: bool) -> Kernel:
    """`name`: a key of `_KERNELS`."""
    spec = _KERNELS[name]
    rule = "deep_gemm::ptx::Pow2Scale" if power_of_two_scales else "deep_gemm::ptx::Fp32Scale"
    return build_kernel("fp8_quantize.cuh", f"dg_fp8_quantize_{name}", f"deep_gemm::{spec.struct}<{rule}{spec.source}>",
                        spec.params, _NUM_THREADS, spec.smem_bytes, min_blocks_per_sm=spec.blocks_per_sm)


def all_kernels() -> list[tuple[str, bool]]:
    """Arguments of every kernel here (for `get_kernel`)."""
    return [(name, pow2) for name in _KERNELS for pow2 in (False, True)]


def _launch(name: str, power_of_two_scales: bool, device: int, num_tiles: int, **values) -> None:
    kernel, spec = get_kernel(name, power_of_two_scales), _KERNELS[name]
    kernel.launch(spec.params.pack(**values), kernel.grid(num_tiles, device, spec.persistent), device)


def _check_rows(x: torch.Tensor) -> None:
    check_tensor("x", x, torch.bfloat16, 2)
    check_multiple("K (x.shape[1])", x.shape[1], BLOCK)
    if x.numel() >= MAX_ELEMENTS:
        raise ValueError(f"x has {x.numel()} elements: the kernels index rows with 32-bit counts")


def empty_row_scales(m: int, k: int, device: torch.device | str) -> torch.Tensor:
    """Uninitialised 1 x 128 scales of ``[m, k]`` rows in `Fp8Rows.scales`' layout: ``[m, k / 128]``
    fp32, column-major, the column stride m rounded up to 4 (16 bytes, as the GEMMs' TMA reads it)."""
    return torch.empty(k // BLOCK, -(-m // 4) * 4, dtype=torch.float32, device=device)[:, :m].T


def empty_fp8_rows(m: int, k: int, device: torch.device | str) -> Fp8Rows:
    """Uninitialised `Fp8Rows` of ``[m, k]`` (k a multiple of 128), for a kernel to write rows
    quantized per 1 x 128 into: data ``[m, k]`` e4m3 row-major, scales ``[m, k / 128]`` fp32
    column-major with the column stride m rounded up to 4 (the layout the GEMMs read)."""
    return Fp8Rows(torch.empty(m, k, dtype=torch.float8_e4m3fn, device=device), empty_row_scales(m, k, device))


def fp8_columns_nbytes(k: int, m: int, num_groups: int) -> int:
    """Bytes of `Fp8Columns.data` for `m` rows of width `k` in `num_groups` groups: the size
    `fp8_quantize_columns`' `out_storage` must have at least."""
    return k * padded_group_width(m, num_groups)


def empty_fp8_columns(k: int, m: int, num_groups: int, device: torch.device,
                      padded_offsets: Optional[torch.Tensor] = None,
                      storage: Optional[torch.Tensor] = None) -> Fp8Columns:
    """Uninitialised `Fp8Columns` of `m` rows of width `k` in `num_groups` groups (the kernels
    write the padded offsets: `padded_offsets`, when given, is shared with another copy of the
    same groups). With `storage`, the data is a view of its first `fp8_columns_nbytes` bytes
    (see `fp8_quantize_columns`)."""
    width = padded_group_width(m, num_groups)
    if padded_offsets is None:
        padded_offsets = torch.empty(num_groups + 1, dtype=torch.int32, device=device)
    if storage is None:
        data = torch.empty(k, width, dtype=torch.float8_e4m3fn, device=device)
    else:
        data = storage.view(-1).view(torch.uint8)[:k * width].view(torch.float8_e4m3fn).view(k, width)
    return Fp8Columns(data, torch.empty(width // BLOCK, k, dtype=torch.float32, device=device), padded_offsets)


def check_storage(storage: torch.Tensor, nbytes: int, device: torch.device, inputs: dict) -> None:
    """Raises TypeError/ValueError unless `storage` can hold `nbytes` of `fp8_quantize_columns`'
    output on `device`: a contiguous, 16-byte aligned tensor there (any dtype) of at least `nbytes`
    bytes, sharing no memory with the tensors of `inputs`."""
    if not isinstance(storage, torch.Tensor):
        raise TypeError(f"out_storage must be a torch.Tensor, got {type(storage).__name__}")
    check_tensor("out_storage", storage, storage.dtype, storage.dim())
    if storage.device != device:
        raise ValueError(f"out_storage is on {storage.device}, the columns on {device}")
    size = storage.numel() * storage.element_size()
    if size < nbytes:
        raise ValueError(f"out_storage holds {size} bytes, the columns need {nbytes}")
    check_disjoint({"out_storage": storage.view(-1).view(torch.uint8)[:nbytes]}, inputs)


def fp8_quantize_rows(x: torch.Tensor, *, power_of_two_scales: bool = False) -> Fp8Rows:
    """x ``[M, K]`` bf16 (K a multiple of 128) quantized per 1 x 128: the A operand of
    `m_grouped_fp8_gemm_nt_contiguous` (see `Fp8Rows`). Each 128 elements' scale maps their
    largest magnitude onto 448 (1 for all zeros; `power_of_two_scales` rounds it up to a power
    of two, which multiplies exactly)."""
    _check_rows(x)
    check_bool(power_of_two_scales=power_of_two_scales)
    if not x.is_cuda:
        return fp8_quantize_rows_torch(x, power_of_two_scales=power_of_two_scales)
    check_cuda_devices(x=x)
    out = empty_fp8_rows(*x.shape, x.device)
    m, k = x.shape
    if m:
        _launch("rows", power_of_two_scales, x.device.index, -(-m // BLOCK) * (k // BLOCK), x=x.data_ptr(),
                x_scales=0, row_index=0, offsets=0, q=out.data.data_ptr(), scales=out.scales.data_ptr(), qt=0,
                scales_t=0, padded_offsets=0, m=m, k=k, num_groups=0, scales_ld=out.scales.stride(1), mp=0, x_rows=m,
                x_scales_ld=0)
    return out


def fp8_quantize_columns(x: torch.Tensor | Fp8Rows, group_offsets: torch.Tensor, *,
                         row_index: Optional[torch.Tensor] = None, with_rows: bool = False,
                         power_of_two_scales: bool = False, out_storage: Optional[torch.Tensor] = None
                         ) -> tuple[Optional[Fp8Rows], Fp8Columns]:
    """x ``[M, K]`` bf16 (K a multiple of 128) in row groups (`group_offsets` ``[G + 1]`` int32,
    G <= 1024), transposed and quantized per 128 x 1 within each group: an operand of
    `k_grouped_fp8_gemm_tn_contiguous` (see `Fp8Columns`; its padded offsets are written on the
    GPU). With `row_index` (int64 ``[M]``), row m is ``x[row_index[m]]`` (x then has any number of
    rows; an index outside them reads zeros), gathered by the kernel's loads: no gathered copy.
    `with_rows` also returns the rows quantized per 1 x 128 (`fp8_quantize_rows`), from the same
    pass: rows outside every group are left unwritten there.

    x may also be `Fp8Rows` (rows already quantized per 1 x 128, e.g. received in FP8 from
    another GPU): they are dequantized in the loads and rounded to bf16, the values
    ``reference.dequantize_rows(x).bfloat16()``, then quantized as above (a second rounding: use
    it only where the bf16 rows are gone).

    `power_of_two_scales` rounds each scale up to a power of two (as `fp8_quantize_rows`).
    `out_storage` (a contiguous, 16-byte aligned tensor of any dtype on x's device, at least
    `fp8_columns_nbytes(K, M, G)` bytes, overlapping no input) holds the columns' data instead of
    a new tensor: its contents are overwritten (a dead buffer's memory, reused).

    Returns ``(rows, columns)``: `Fp8Rows` ``[M, K]`` with `with_rows`, else None; `Fp8Columns`
    (data ``[K, Mp]`` e4m3, Mp the groups' rows each padded to a multiple of 128, scales
    ``[Mp / 128, K]`` fp32, the padded offsets ``[G + 1]`` int32)."""
    from_fp8 = isinstance(x, Fp8Rows)
    if from_fp8:
        _check_fp8_rows(x)
    else:
        _check_rows(x)
    data = x.data if from_fp8 else x
    check_bool(with_rows=with_rows, power_of_two_scales=power_of_two_scales)
    num_groups = check_group_offsets(group_offsets)
    if not 1 <= num_groups <= MAX_GROUPS:
        raise ValueError(f"the column quantization takes 1 to {MAX_GROUPS} groups, got {num_groups}")
    if row_index is not None:
        check_tensor("row_index", row_index, torch.int64, 1)
        if row_index.numel() * data.shape[1] >= MAX_ELEMENTS:
            raise ValueError(f"row_index picks {row_index.numel()} rows of {data.shape[1]}: the kernels index rows "
                             f"with 32-bit counts")
    tensors = dict(x=data, group_offsets=group_offsets)
    if from_fp8:
        tensors["x_scales"] = x.scales
    if row_index is not None:
        tensors["row_index"] = row_index
    m, k = (data.shape[0] if row_index is None else row_index.numel()), data.shape[1]
    if out_storage is not None:
        check_storage(out_storage, fp8_columns_nbytes(k, m, num_groups), data.device, tensors)
    if not data.is_cuda:
        for name, t in tensors.items():  # (the GPU path's check_cuda_devices, for the CPU)
            if t.device != data.device:
                raise ValueError(f"{name} is on {t.device}, x on {data.device}")
        source = dequantize_rows(x).to(torch.bfloat16) if from_fp8 else x
        rows, columns = fp8_quantize_columns_torch(source, group_offsets, row_index=row_index, with_rows=with_rows,
                                                   power_of_two_scales=power_of_two_scales)
        if out_storage is not None:
            placed = empty_fp8_columns(k, m, num_groups, data.device, columns.padded_offsets, out_storage)
            placed.data.copy_(columns.data)
            columns = Fp8Columns(placed.data, columns.scales, columns.padded_offsets)
        return rows, columns
    check_cuda_devices(**tensors)
    columns = empty_fp8_columns(k, m, num_groups, data.device, storage=out_storage)
    width = columns.data.shape[1]
    rows = empty_fp8_rows(m, k, data.device) if with_rows else None
    # (a launch even with M = 0: it writes the padded offsets)
    _launch("activations_from_fp8" if from_fp8 else "activations", power_of_two_scales, data.device.index,
            width // BLOCK * (k // BLOCK), x=data.data_ptr(), x_scales=x.scales.data_ptr() if from_fp8 else 0,
            row_index=0 if row_index is None else row_index.data_ptr(), offsets=group_offsets.data_ptr(),
            q=rows.data.data_ptr() if rows else 0, scales=rows.scales.data_ptr() if rows else 0,
            qt=columns.data.data_ptr(), scales_t=columns.scales.data_ptr(),
            padded_offsets=columns.padded_offsets.data_ptr(), m=m, k=k, num_groups=num_groups,
            scales_ld=rows.scales.stride(1) if rows else 0, mp=width, x_rows=data.shape[0],
            x_scales_ld=x.scales.stride(1) if from_fp8 else 0)
    return rows, columns


def _check_fp8_rows(x: Fp8Rows) -> None:
    """`Fp8Rows` as the kernels read them: data ``[M, K]`` e4m3 (K a multiple of 128), scales
    ``[M, K / 128]`` fp32 column-major (``stride() == (1, ld)``, ld >= M; plain loads, so no TMA
    alignment as the GEMMs' check asks)."""
    check_tensor("x.data", x.data, torch.float8_e4m3fn, 2)
    m, k = x.data.shape
    check_multiple("K (x.data.shape[1])", k, BLOCK)
    if x.data.numel() >= MAX_ELEMENTS:
        raise ValueError(f"x has {x.data.numel()} elements: the kernels index rows with 32-bit counts")
    scales = x.scales
    if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != (m, k // BLOCK)
            or scales.stride(0) != 1 or (k > BLOCK and scales.stride(1) < m)):
        raise ValueError(f"x.scales must be [{m}, {k // BLOCK}] float32, column-major (stride (1, >= {m})), got "
                         f"{getattr(scales, 'dtype', type(scales).__name__)} {tuple(getattr(scales, 'shape', ()))} "
                         f"strides {scales.stride() if isinstance(scales, torch.Tensor) else None}")


def fp8_quantize_weights(w: torch.Tensor, *, power_of_two_scales: bool = False, which: str = "both") -> Fp8Weights:
    """w ``[G, N, K]`` bf16 (N and K multiples of 128) quantized per 128 x 128 block (see
    `Fp8Weights`): ``data`` is B of the forward (`m_grouped_fp8_gemm_nt_contiguous`), ``data_t``
    B of the data gradient. `which`: "both" (the default) writes both orientations from one read
    of w; "data" or "data_t" only that one (the other is None), the same bits.
    `power_of_two_scales` rounds each block's scale up to a power of two."""
    check_tensor("w", w, torch.bfloat16, 3)
    check_bool(power_of_two_scales=power_of_two_scales)
    if which not in _WEIGHT_KERNELS:
        raise ValueError(f"which must be one of {tuple(_WEIGHT_KERNELS)}, got {which!r}")
    num_groups, n, k = w.shape
    check_multiple("N (w.shape[1])", n, BLOCK)
    check_multiple("K (w.shape[2])", k, BLOCK)
    if not w.is_cuda:
        return fp8_quantize_weights_torch(w, power_of_two_scales=power_of_two_scales, which=which)
    check_cuda_devices(w=w)
    e4m3 = torch.float8_e4m3fn
    out = Fp8Weights(torch.empty(num_groups, n, k, dtype=e4m3, device=w.device) if which != "data_t" else None,
                     torch.empty(num_groups, k, n, dtype=e4m3, device=w.device) if which != "data" else None,
                     torch.empty(num_groups, n // BLOCK, k // BLOCK, dtype=torch.float32, device=w.device))
    num_tiles = num_groups * (n // BLOCK) * (k // BLOCK)
    if num_tiles:
        _launch(_WEIGHT_KERNELS[which], power_of_two_scales, w.device.index, num_tiles, w=w.data_ptr(),
                q=0 if out.data is None else out.data.data_ptr(), qt=0 if out.data_t is None else out.data_t.data_ptr(),
                scales=out.scales.data_ptr(), num_groups=num_groups, n=n, k=k)
    return out
