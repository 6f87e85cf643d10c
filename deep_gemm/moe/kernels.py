"""Launchers of the memory-bound MoE kernels around the GEMMs (impls/moe_*.cuh): the routing
layout, the routed-row copy, SwiGLU forward, SwiGLU backward with the routing-weight gradient,
the weighted combine (which can also add partial sums that other GPUs computed for the same
tokens), and the wait for such sums to land (impls/ep_wait_flags.cuh). bf16 rows with fp32 math and 16-byte accesses; no host sync (routed-row counts
are read on the GPU, from the last entry of the layout's offsets); deterministic (the routing
counts' shared-memory atomics only add integers)."""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from ..jit.params import ParamsStruct
from ..jit.runtime import Kernel, build_kernel
from ..utils import check_cuda_devices, check_tensor, get_num_sms
from .layout import RoutingLayout, build_routing_layout_torch

_ROUTING = ParamsStruct("deep_gemm::MoERoutingParams", [
    ("topk_idx", "ptr"), ("topk_weights", "ptr"), ("chunk_counts", "ptr"), ("key_totals", "ptr"), ("offsets", "ptr"),
    ("row_token", "ptr"), ("row_weight", "ptr"), ("slot_row", "ptr"), ("slot_valid", "ptr"), ("num_slots", "u32"),
    ("num_topk", "u32"), ("num_experts", "u32"), ("slots_per_chunk", "u32"), ("num_chunks", "u32")])
_COMBINE = ParamsStruct("deep_gemm::MoECombineParams", [
    ("rows", "ptr"), ("slot_row", "ptr"), ("slot_valid", "ptr"), ("weights", "ptr"), ("out", "ptr"), ("addend", "ptr"),
    ("num_tokens", "u32"), ("hidden", "u32"), ("num_topk", "u32"), ("num_addends", "u32"), ("addend_stride", "u32")])
_GATHER_ROWS = ParamsStruct("deep_gemm::MoEGatherRowsParams", [
    ("src", "ptr"), ("row_token", "ptr"), ("out", "ptr"), ("num_rows", "ptr"), ("hidden", "u32")])
_SWIGLU_FWD = ParamsStruct("deep_gemm::MoESwiGLUFwdParams", [
    ("num_rows", "ptr"), ("h", "ptr"), ("act", "ptr"), ("inter", "u32")])
_WAIT_FLAGS = ParamsStruct("deep_gemm::EpWaitFlagsParams", [
    ("flags", "ptr"), ("sources", "ptr"), ("num_flags", "u32"), ("timeout_ms", "u32")])
_SWIGLU_BWD = ParamsStruct("deep_gemm::MoESwiGLUBwdParams", [
    ("h", "ptr"), ("d_act", "ptr"), ("row_weight", "ptr"), ("dz", "ptr"), ("act_weighted", "ptr"), ("row_dw", "ptr"),
    ("num_rows", "ptr"), ("inter", "u32")])

class _KernelSpec(NamedTuple):
    header: str
    struct: str  # the C++ struct, templated on the threads per CTA
    params: ParamsStruct
    num_threads: int  # threads per CTA
    ctas_per_sm: Optional[int]  # the grid, CTAs an SM; None: the launch gives it
    min_ctas_per_sm: int = 1  # CTAs an SM that its registers must allow (launch bounds)


# The combine's bound fits its three CTAs an SM: its slot groups and prefetched slots would otherwise
# take ~83 registers, two CTAs an SM (docs/PERF.md, "Decisions": combine).
_KERNELS = {
    "moe_routing_count": _KernelSpec("moe_routing_layout.cuh", "MoERoutingCount", _ROUTING, 256, None),
    "moe_routing_scan": _KernelSpec("moe_routing_layout.cuh", "MoERoutingScan", _ROUTING, 256, None),
    "moe_routing_place": _KernelSpec("moe_routing_layout.cuh", "MoERoutingPlace", _ROUTING, 256, None),
    "moe_combine": _KernelSpec("moe_combine.cuh", "MoECombine", _COMBINE, 256, 3, min_ctas_per_sm=3),
    "moe_swiglu_fwd": _KernelSpec("moe_swiglu_fwd.cuh", "MoESwiGLUFwd", _SWIGLU_FWD, 256, 8),
    "moe_swiglu_bwd": _KernelSpec("moe_swiglu_bwd.cuh", "MoESwiGLUBwd", _SWIGLU_BWD, 128, 16),
    "moe_gather_rows": _KernelSpec("moe_gather_rows.cuh", "MoEGatherRows", _GATHER_ROWS, 256, 4),
    "ep_wait_flags": _KernelSpec("ep_wait_flags.cuh", "EpWaitFlags", _WAIT_FLAGS, 32, None),
}
# The routing kernels' warps each sort one chunk of slots; their per-warp key counters in shared
# memory bound the experts (impls/moe_routing_layout.cuh).
ROUTING_MAX_EXPERTS = 1024
_ROUTING_WARPS_PER_CTA = 8


@functools.lru_cache(maxsize=None)
def get_kernel(name: str) -> Kernel:
    spec = _KERNELS[name]
    return build_kernel(spec.header, f"dg_{name}", f"deep_gemm::{spec.struct}<{spec.num_threads}>", spec.params,
                        spec.num_threads, min_blocks_per_sm=spec.min_ctas_per_sm)


def _launch(name: str, device: int, num_blocks: Optional[int] = None, **values) -> None:
    spec = _KERNELS[name]
    if num_blocks is None:
        num_blocks = spec.ctas_per_sm * get_num_sms(device)
    get_kernel(name).launch(spec.params.pack(**values), num_blocks, device)


def all_kernels() -> list[str]:
    """Names of every kernel here (for `get_kernel`)."""
    return list(_KERNELS)


def _routed_rows_ptr(offsets: torch.Tensor) -> int:
    """Address of the last offset, the routed-row count, which the kernels read on the GPU."""
    return offsets.data_ptr() + 4 * (offsets.numel() - 1)


def _check_bf16(**tensors: torch.Tensor) -> None:
    """The kernels use 16-byte vector accesses on flat, contiguous bf16 rows of one device."""
    for name, t in tensors.items():
        check_tensor(name, t, torch.bfloat16, t.dim() if isinstance(t, torch.Tensor) else 2)
    check_cuda_devices(**tensors)


def build_routing_layout(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> RoutingLayout:
    """Sorts the (token, slot) pairs by expert, stably (token order within an expert, so the
    layout and every result built on it are deterministic). topk_idx ``[T, K]`` integer (ids
    outside ``[0, E)`` are empty slots), topk_weights ``[T, K]`` float. On a GPU with int64 ids
    and ``E <= ROUTING_MAX_EXPERTS``, by our counting-sort kernels (three launches, no host
    sync); otherwise by PyTorch ops (`build_routing_layout_torch`), with the same result."""
    if topk_idx.is_cuda and topk_idx.dtype == torch.int64 and 1 <= num_experts <= ROUTING_MAX_EXPERTS:
        return moe_routing_layout(topk_idx, topk_weights, num_experts)
    return build_routing_layout_torch(topk_idx, topk_weights, num_experts)


def moe_routing_layout(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> RoutingLayout:
    """`build_routing_layout` by our counting-sort kernels: the same layout, element for
    element, as the PyTorch ops of `build_routing_layout_torch`. topk_idx ``[T, K]`` int64 on a
    CUDA device (ids outside ``[0, E)`` are empty slots), topk_weights ``[T, K]`` float,
    ``1 <= E <= ROUTING_MAX_EXPERTS``."""
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or not topk_idx.is_cuda:
        raise ValueError("topk_idx must be a 2-D int64 CUDA tensor")
    if topk_weights.shape != topk_idx.shape or not topk_weights.is_floating_point():
        raise ValueError("topk_weights must be a float tensor shaped like topk_idx")
    if not 1 <= num_experts <= ROUTING_MAX_EXPERTS:
        raise ValueError(f"the routing kernels sort 1 to {ROUTING_MAX_EXPERTS} experts, got {num_experts}")
    check_cuda_devices(topk_idx=topk_idx, topk_weights=topk_weights)
    (num_tokens, num_topk), device = topk_idx.shape, topk_idx.device
    num_slots = num_tokens * num_topk
    if num_slots >= 2**31:
        raise ValueError(f"{num_slots} routed slots: the routing kernels index them with int32")
    topk_idx = topk_idx.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    layout = RoutingLayout(offsets=torch.empty(num_experts + 1, dtype=torch.int32, device=device),
                           row_token=torch.empty(num_slots, dtype=torch.int64, device=device),
                           row_weight=torch.empty(num_slots, dtype=torch.float32, device=device),
                           slot_row=torch.empty(num_tokens, num_topk, dtype=torch.int64, device=device),
                           slot_valid=torch.empty(num_tokens, num_topk, dtype=torch.bool, device=device))
    if not num_slots:
        layout.offsets.zero_()
        return layout
    # Chunks of at least 256 slots, at most ~512 chunks: the scan stays short, each warp's walk too.
    per_chunk = 32 * max(8, -(-num_slots // (32 * 512)))
    num_chunks = -(-num_slots // per_chunk)
    counts = torch.empty(num_experts + 1, num_chunks, dtype=torch.int32, device=device)
    totals = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    values = dict(topk_idx=topk_idx.data_ptr(), topk_weights=weights.data_ptr(), chunk_counts=counts.data_ptr(),
                  key_totals=totals.data_ptr(), offsets=layout.offsets.data_ptr(), row_token=layout.row_token.data_ptr(),
                  row_weight=layout.row_weight.data_ptr(), slot_row=layout.slot_row.data_ptr(),
                  slot_valid=layout.slot_valid.data_ptr(), num_slots=num_slots, num_topk=num_topk,
                  num_experts=num_experts, slots_per_chunk=per_chunk, num_chunks=num_chunks)
    grid = -(-num_chunks // _ROUTING_WARPS_PER_CTA)
    _launch("moe_routing_count", device.index, grid, **values)
    _launch("moe_routing_scan", device.index, num_experts + 1, **values)
    _launch("moe_routing_place", device.index, grid, **values)
    return layout


def moe_combine_bf16(rows: torch.Tensor, layout: RoutingLayout, weights: Optional[torch.Tensor],
                     out: torch.Tensor, *, addend: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[t] = sum_{valid k} w[t, k] * rows[slot_row[t, k]] (+ sum_j addend[j, t])``
    (w = 1 if `weights` is None), summed in fp32 in slot order, then j order.

    rows ``[T * K, H]`` bf16 in routed-row order (rows of empty slots are never read), out
    ``[T, H]`` bf16, weights ``[T, K]``. H must be a multiple of 8. `addend` ``[J, T', H]``
    bf16 (T' >= T, contiguous): partial sums of the same tokens from J other GPUs (expert
    parallelism; wait for them to land first).
    """
    (num_tokens, num_topk), hidden = layout.slot_row.shape, rows.shape[1]
    _check_bf16(rows=rows, out=out)
    if hidden % 8:
        raise ValueError(f"H = {hidden} must be a multiple of 8")
    if tuple(out.shape) != (num_tokens, hidden):
        raise ValueError(f"out must be [{num_tokens}, {hidden}]")
    if weights is not None:
        if tuple(weights.shape) != (num_tokens, num_topk):
            raise ValueError(f"weights must be [{num_tokens}, {num_topk}], got {tuple(weights.shape)}")
        weights = weights.to(torch.float32).contiguous()
    num_addends, addend_stride = 0, 0
    if addend is not None:
        _check_bf16(addend=addend)
        if addend.dim() != 3 or addend.shape[1] < num_tokens or addend.shape[2] != hidden:
            raise ValueError(f"addend must be [J, >= {num_tokens}, {hidden}], got {tuple(addend.shape)}")
        num_addends, addend_stride = addend.shape[0], addend.shape[1]
    if num_tokens:
        _launch("moe_combine", out.device.index, rows=rows.data_ptr(), slot_row=layout.slot_row.data_ptr(),
                slot_valid=layout.slot_valid.data_ptr(), weights=0 if weights is None else weights.data_ptr(),
                out=out.data_ptr(), addend=0 if addend is None else addend.data_ptr(), num_tokens=num_tokens,
                hidden=hidden, num_topk=num_topk, num_addends=num_addends, addend_stride=addend_stride)
    return out


def moe_gather_rows_bf16(src: torch.Tensor, layout: RoutingLayout) -> torch.Tensor:
    """``out[r] = src[row_token[r]]`` for the routed rows r < offsets[-1] of ``out [T * K, H]``
    (rows of empty slots are left unwritten: they cost nothing). src ``[T, H]`` bf16."""
    _check_bf16(src=src)
    out = src.new_empty(layout.num_slots, src.shape[1])
    if layout.num_slots and src.shape[1]:
        if src.shape[1] % 8:
            raise ValueError(f"H = {src.shape[1]} must be a multiple of 8")
        _launch("moe_gather_rows", src.device.index, src=src.data_ptr(), row_token=layout.row_token.data_ptr(),
                out=out.data_ptr(), num_rows=_routed_rows_ptr(layout.offsets), hidden=src.shape[1])
    return out


def moe_swiglu_fwd_bf16(h: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``act = silu(h[:, :I]) * h[:, I:]`` (``[R, I]``) for the routed rows r < offsets[-1] of
    ``h [R, 2I]`` (`offsets`: the int32 group offsets of the GEMM that wrote h)."""
    _check_bf16(h=h)
    inter = h.shape[1] // 2
    act = h.new_empty(h.shape[0], inter)
    if h.shape[0]:
        _launch("moe_swiglu_fwd", h.device.index, h=h.data_ptr(), act=act.data_ptr(), num_rows=_routed_rows_ptr(offsets),
                inter=inter)
    return act


def moe_swiglu_bwd_bf16(h: torch.Tensor, d_act: torch.Tensor, layout: RoutingLayout, *,
                        dz: Optional[torch.Tensor] = None, act_weighted: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SwiGLU backward of the routed rows, one pass.

    Given ``h = [g | u]`` ``[T * K, 2I]`` and ``d_act = dy @ l2[e]`` ``[T * K, I]`` (before the
    routing weight w), returns ``(dz [T * K, 2I], act_weighted [T * K, I], row_dw [T * K] fp32)``
    with ``act_weighted = w * silu(g) * u`` (so that ``dl2[e] = dy_e^T @ act_weighted_e``),
    ``row_dw = <d_act, silu(g) * u>`` (the routing-weight gradient of each row) and ``dz`` the
    gradient of ``[g | u]`` for ``w * d_act``. `dz` and `act_weighted`, when given, are written
    (contiguous, shaped like h and d_act); they may be h and d_act themselves (each element is
    read before it is overwritten, by the same thread).
    """
    _check_bf16(h=h, d_act=d_act)
    rows, inter = d_act.shape
    if h.dim() != 2 or tuple(h.shape) != (rows, 2 * inter) or inter % 8 or rows != layout.num_slots:
        raise ValueError(f"h must be [{layout.num_slots}, 2I] and d_act [{layout.num_slots}, I] with I a multiple of 8, "
                         f"got {tuple(h.shape)} and {tuple(d_act.shape)}")
    dz = torch.empty_like(h) if dz is None else dz
    act_weighted = torch.empty_like(d_act) if act_weighted is None else act_weighted
    _check_bf16(dz=dz, act_weighted=act_weighted)
    if dz.shape != h.shape or act_weighted.shape != d_act.shape:
        raise ValueError(f"dz must be shaped like h {tuple(h.shape)}, act_weighted like d_act {tuple(d_act.shape)}")
    row_dw = torch.empty(rows, device=h.device, dtype=torch.float32)
    if rows:
        _launch("moe_swiglu_bwd", h.device.index, h=h.data_ptr(), d_act=d_act.data_ptr(),
                row_weight=layout.row_weight.data_ptr(), dz=dz.data_ptr(), act_weighted=act_weighted.data_ptr(),
                row_dw=row_dw.data_ptr(), num_rows=_routed_rows_ptr(layout.offsets), inter=inter)
    return dz, act_weighted, row_dw


def ep_wait_flags(flags: torch.Tensor, sources: torch.Tensor, timeout_ms: int) -> None:
    """Stream-ordered: waits on the GPU until every int32 ``flags[j]`` is non-zero, then zeroes
    them; what the current stream runs next sees the data each flag guards. One thread waits
    (every other SM stays free). The flags' writers must need no SM of this GPU (another GPU's
    copy engine and stream memory operation qualify), and must not be issued after a kernel's
    first launch in this process while the wait runs (lazy module loading makes that launch
    wait for running kernels). After `timeout_ms` the kernel fails with a message naming
    ``sources[j]`` (int32, the rank that should have set flag j)."""
    for name, t in (("flags", flags), ("sources", sources)):
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or t.numel() != flags.numel():
            raise ValueError(f"{name} must be a contiguous int32 vector of {flags.numel()} elements")
    if not 0 < timeout_ms < 2**32:
        raise ValueError(f"timeout_ms must be in (0, 2**32), got {timeout_ms}")
    device = check_cuda_devices(flags=flags, sources=sources)
    if flags.numel():
        _launch("ep_wait_flags", device.index, 1, flags=flags.data_ptr(), sources=sources.data_ptr(),
                num_flags=flags.numel(), timeout_ms=timeout_ms)
