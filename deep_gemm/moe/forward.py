"""Mega MoE forward on one GPU, bf16: route -> GEMM1 -> SwiGLU -> GEMM2 -> weighted combine.

GEMM1 gathers the token rows in its loads (or reads a routed-order copy, see GATHER_ROWS),
SwiGLU runs in its epilogue, and a separate kernel does the weighted combine. No host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..gemm import m_grouped_bf16_gemm_nt_contiguous, m_grouped_bf16_gemm_nt_swiglu_contiguous
from .glue import moe_combine_bf16, moe_gather_rows_bf16, moe_swiglu_fwd_bf16
from .layout import RoutingLayout, build_routing_layout

# H and I must be multiples of this (the data-gradient GEMMs contract over H and 2I in 64-wide blocks).
DIM_MULTIPLE = 64

# Per pass, whether the GEMMs gather token rows inside their loads (True) or read permuted
# copies made first (False); both paths are kept so that benchmarks can compare them. Measured
# on an H200 (fwd / bwd ms, docs/PERF.md session 4): gathering is faster in the forward (30B
# 2.83 vs 3.08, 235B 9.46 vs 9.72: GEMM1 alone reads x's rows) and slower in the backward (30B
# 5.21 vs 5.11, 235B 20.25 vs 18.35: dy's rows feed two GEMMs, and the gathering
# weight-gradient GEMMs are slow), hence this default.
GATHER_ROWS = {"forward": True, "backward": False}
# SwiGLU in GEMM1's epilogue (when 2I % 256 == 0) or in a separate pass.
FUSED_SWIGLU = True


@dataclass
class MegaMoEHandle:
    """What `mega_moe_backward` needs from the forward.

    It keeps the routing layout and GEMM1's output `h` (``[T * K, 2I]`` bf16) of every routed
    slot: ``4 * I + 28`` bytes per (token, slot), e.g. 3100 bytes at I = 768. `x` is the
    caller's tensor (not copied); the SwiGLU output is recomputed from `h` in the backward.
    `mega_moe_backward` consumes the handle (it overwrites `h` with its gradient and sets it to
    None) unless called with ``keep_handle=True``.
    """

    layout: RoutingLayout
    x: torch.Tensor
    h: torch.Tensor


def check_moe_inputs(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                     l2: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Raises TypeError/ValueError on a malformed MoE problem; returns (T, H, I, E, K)."""
    for name, t in (("x", x), ("l1", l1), ("l2", l2)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be a bf16 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx must be int64, got {topk_idx.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if x.dim() != 2 or l1.dim() != 3 or l2.dim() != 3 or topk_idx.dim() != 2:
        raise ValueError("expected x [T, H], topk_idx [T, K], l1 [E, 2I, H], l2 [E, H, I]")
    (num_tokens, hidden), (num_experts, two_inter, hidden_l1) = x.shape, l1.shape
    inter = l2.shape[2]
    if hidden_l1 != hidden or tuple(l2.shape) != (num_experts, hidden, inter) or two_inter != 2 * inter:
        raise ValueError(f"weights do not match: x {tuple(x.shape)}, l1 {tuple(l1.shape)} (want [E, 2I, H]), "
                         f"l2 {tuple(l2.shape)} (want [E, H, I])")
    if topk_idx.shape[0] != num_tokens or tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T = {num_tokens}, K]")
    for name, value in (("H", hidden), ("I", inter)):
        if value % DIM_MULTIPLE:
            raise ValueError(f"{name} = {value} must be a multiple of {DIM_MULTIPLE}")
    devices = {t.device for t in (x, topk_idx, topk_weights, l1, l2)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")
    for name, t in (("l1", l1), ("l2", l2)):  # GEMM operands as they are; x and the routing get gathered
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return num_tokens, hidden, inter, num_experts, topk_idx.shape[1]


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int, sync: bool) -> None:
    """Expert ids must lie in [-1, E). With `sync`, a ValueError now (reads the ids on the
    host); otherwise an asynchronous device-side assert (no host sync, graph-safe)."""
    ok = ((topk_idx >= -1) & (topk_idx < num_experts)).all()
    if sync:
        if not bool(ok):
            raise ValueError(f"topk_idx has expert ids outside [-1, {num_experts})")
    else:
        torch._assert_async(ok, f"topk_idx has expert ids outside [-1, {num_experts})")


def routed_rows(t: torch.Tensor, layout: RoutingLayout, gather: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(rows, row_index)`` for a GEMM operand holding token `t`'s routed rows: `t` itself with
    the layout's row_token as index (gathered by the GEMM's loads) when `gather`, else a copy in
    routed order and no index."""
    if gather:
        return t, layout.row_token
    return moe_gather_rows_bf16(t, layout), None


@dataclass
class RowArrival:
    """Token rows still landing when the forward starts (expert parallelism): they come in S
    passes, pass s complete once ``ready_flags[s] != 0``; within each expert, the layout's rows
    are sorted by pass.

    run_offsets: int32 ``[E * S + 1]``: expert e's rows of pass s are
                 ``[run_offsets[e * S + s], run_offsets[e * S + s + 1])``.
    num_passes:  S.
    ready_flags: int32 ``[S]`` on the GPU, or None (nothing to wait on: `join` first).
    join:        makes the current stream wait until every row has landed.
    """

    run_offsets: torch.Tensor
    num_passes: int
    ready_flags: Optional[torch.Tensor]
    join: Callable[[], None]


def gemm_other_ranks_first(gemm: Callable, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, arrival: RowArrival,
                           early: Callable[[torch.Tensor], None]) -> None:
    """An m-grouped GEMM (`gemm(a, b, d, ...)`, nt or nn) over `arrival`'s (expert, pass) runs in
    two launches: passes 1..S-1 (other ranks' tokens), then ``early(d)``, then pass 0, so that
    what `early` starts with those rows (sending results to their ranks) overlaps the GEMM's
    work on this rank's own rows. Needs S > 1."""
    runs = dict(group_offsets=arrival.run_offsets, num_passes=arrival.num_passes)
    gemm(a, b, d, **runs, pass_range=(1, arrival.num_passes))
    early(d)
    gemm(a, b, d, **runs, pass_range=(0, 1))


def moe_expert_rows(x: torch.Tensor, layout: RoutingLayout, l1: torch.Tensor, l2: torch.Tensor,
                    arrival: Optional[RowArrival] = None,
                    early_results: Optional[Callable[[torch.Tensor], None]] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' work on a built layout: ``(h, out)``, GEMM1's output ``h [T * K, 2I]`` and
    GEMM2's unweighted rows ``out [T * K, H]``, in routed-row order (rows past offsets[E] unwritten).
    With `arrival`, GEMM1 gathering x's rows works pass by pass, each pass once its rows have
    landed (rows copied first wait for all of them). With `arrival` in S > 1 passes and
    `early_results`, GEMM2 computes the rows of passes 1..S-1 first (other ranks' tokens) and
    calls ``early_results(out)``, so that what it starts (a copy to another GPU) overlaps
    GEMM2's work on pass 0."""
    num_slots, hidden, two_inter = layout.num_slots, x.shape[1], l1.shape[1]
    h = x.new_empty(num_slots, two_inter)
    gather, offsets, passes = GATHER_ROWS["forward"], layout.offsets, {}
    waits = arrival is not None and gather and arrival.ready_flags is not None
    if arrival is not None and not waits:
        arrival.join()
    if arrival is not None and gather:
        offsets = arrival.run_offsets
        passes = dict(num_passes=arrival.num_passes, ready_flags=arrival.ready_flags if waits else None)
    a, index = routed_rows(x, layout, gather)
    if FUSED_SWIGLU and two_inter % 256 == 0:
        act = x.new_empty(num_slots, two_inter // 2)
        m_grouped_bf16_gemm_nt_swiglu_contiguous(a, l1, h, act, offsets, a_row_index=index, **passes)
    else:
        m_grouped_bf16_gemm_nt_contiguous(a, l1, h, offsets, a_row_index=index, **passes)
        act = moe_swiglu_fwd_bf16(h, layout)
    if waits:
        arrival.join()
    out = x.new_empty(num_slots, hidden)
    if early_results is not None and arrival is not None and arrival.num_passes > 1:
        gemm_other_ranks_first(m_grouped_bf16_gemm_nt_contiguous, act, l2, out, arrival, early_results)
    else:
        m_grouped_bf16_gemm_nt_contiguous(act, l2, out, layout.offsets)
    return h, out


def moe_forward(x: torch.Tensor, layout: RoutingLayout, topk_weights: torch.Tensor, l1: torch.Tensor,
                l2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The forward on a built layout: writes `y`, returns GEMM1's output h. Device- and
    dtype-agnostic given the kernels, so the orchestration is testable with emulations."""
    h, out = moe_expert_rows(x, layout, l1, l2)
    moe_combine_bf16(out, layout, topk_weights, y)
    return h


def bf16_mega_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                  l2: torch.Tensor, y: Optional[torch.Tensor] = None, *, training: bool = False,
                  check_ids: bool = False) -> tuple[torch.Tensor, Optional[MegaMoEHandle]]:
    """Mixture-of-Experts forward (DESIGN.md's contract), bf16, one GPU.

    ``y[t] = sum_{k: idx >= 0} w[t, k] * l2[e] @ (silu(g) * u)`` with ``g, u = l1[e] @ x_t``.

    Args:
        x: ``[T, H]`` bf16 tokens.
        topk_idx: ``[T, K]`` int64 expert ids, ``-1`` = empty slot.
        topk_weights: ``[T, K]`` float routing weights (ignored on empty slots).
        l1: ``[E, 2I, H]`` bf16, rows ``[0, I)`` gate and ``[I, 2I)`` up.
        l2: ``[E, H, I]`` bf16.
        y: optional ``[T, H]`` bf16 output to write into.
        training: also return the handle `mega_moe_backward` needs (see `MegaMoEHandle`).
        check_ids: check expert ids on the host (a sync, raises ValueError) instead of with an
            asynchronous device-side assert.

    Returns:
        ``(y, handle)``; handle is None unless `training`.

    H and I must be multiples of 64; all tensors on one CUDA device, l1 and l2 contiguous. No host
    synchronisation (unless `check_ids`); deterministic.
    """
    num_tokens, hidden, _, num_experts, _ = check_moe_inputs(x, topk_idx, topk_weights, l1, l2)
    if not x.is_cuda:
        raise ValueError("bf16_mega_moe runs on CUDA tensors")
    if y is None:
        y = x.new_empty(num_tokens, hidden)
    elif (y.dtype != torch.bfloat16 or tuple(y.shape) != (num_tokens, hidden) or y.device != x.device
          or not y.is_contiguous()):
        raise ValueError(f"y must be a contiguous bf16 [{num_tokens}, {hidden}] tensor on {x.device}")
    check_expert_ids(topk_idx, num_experts, check_ids)
    x = x.contiguous()  # its rows are copied or gathered as dense rows
    layout = build_routing_layout(topk_idx, topk_weights, num_experts)
    h = moe_forward(x, layout, topk_weights, l1, l2, y)
    return y, (MegaMoEHandle(layout=layout, x=x, h=h) if training else None)
