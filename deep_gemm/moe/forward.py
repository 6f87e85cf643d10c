"""Mega MoE forward on one GPU, bf16: route -> GEMM1 (token rows gathered in its loads, SwiGLU in
its epilogue) -> GEMM2 -> weighted combine back to token order. No host sync.

`gate_up_swiglu` (GEMM1 with its activation) is also a building block of the expert-parallel
forward (megamoe_bwd.ep), which runs it over rows that arrive in passes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..gemm import m_grouped_bf16_gemm_nt_contiguous, m_grouped_bf16_gemm_nt_swiglu_contiguous
from ..utils import check_bool, check_disjoint, check_tensor
from .kernels import build_routing_layout, moe_combine_bf16, moe_swiglu_fwd_bf16
from .layout import RoutingLayout

# H and I must be multiples of this (the data-gradient GEMMs contract over H and 2I in 64-wide blocks).
DIM_MULTIPLE = 64


@dataclass
class MegaMoEHandle:
    """What `mega_moe_backward` needs from the forward.

    It keeps the routing layout and GEMM1's output `h` (``[T * K, 2I]`` bf16) of every routed
    slot: ``4 * I + 21`` bytes per (token, slot), e.g. 3093 bytes at I = 768. `x` is the
    caller's tensor (copied only if its rows were not dense and 16-byte aligned); the SwiGLU
    output is recomputed from `h` in the backward.
    `mega_moe_backward` consumes the handle (it overwrites `h` with its gradient and sets it to
    None) unless called with ``keep_handle=True``.

    With recipe "fp8" (`deep_gemm.fp8_mega_moe`), `dgrad_weights` holds the forward's FP8 copies
    of l1 and l2 as the data gradients read them (each `Fp8Weights.transposed_operand()`): the
    backward multiplies by the weights the forward used and quantizes none again (under CUDA-graph
    capture, where the copies are not cached, the weights are quantized once a step, not twice).
    """

    layout: RoutingLayout
    x: torch.Tensor
    h: Optional[torch.Tensor]
    recipe: str = "bf16"  # "bf16", or "fp8" from `deep_gemm.fp8_mega_moe` (the backward follows it)
    dgrad_weights: Optional[tuple] = None  # recipe "fp8": ((l1's data_t, scales_t), (l2's ...)) or None


def check_moe_inputs(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                     l2: torch.Tensor, dim_multiple: int = DIM_MULTIPLE) -> tuple[int, int, int, int, int]:
    """Raises TypeError/ValueError on a malformed MoE problem (H and I must be multiples of
    `dim_multiple`); returns (T, H, I, E, K)."""
    for name, t in (("x", x), ("l1", l1), ("l2", l2)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be a bf16 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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
        if value % dim_multiple:
            raise ValueError(f"{name} = {value} must be a multiple of {dim_multiple}")
    devices = {t.device for t in (x, topk_idx, topk_weights, l1, l2)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")
    for name, t in (("l1", l1), ("l2", l2)):  # GEMM operands as they are; x and the routing get copied if need be
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned")
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


def dense_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if its rows are dense and 16-byte aligned (what row gathers index), else a copy."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def gate_up_swiglu(x: torch.Tensor, l1: torch.Tensor, offsets: torch.Tensor, row_index: torch.Tensor, *,
                   num_passes: int = 1, ready_flags: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 of the routed rows and its activation: ``h [R, 2I] = x[row_index] @ l1[e].T`` (x's
    rows gathered in the GEMM's loads) and ``act [R, I] = silu(h[:, :I]) * h[:, I:]``, in the
    GEMM's epilogue when I is a multiple of 128, else in a pass after it. `offsets`, `num_passes`
    and `ready_flags` as in `deep_gemm.m_grouped_bf16_gemm_nt_contiguous` (R = row_index's
    length; rows past offsets[-1] are left unwritten)."""
    num_rows, two_inter = row_index.numel(), l1.shape[1]
    h = x.new_empty(num_rows, two_inter)
    passes = dict(num_passes=num_passes, ready_flags=ready_flags)
    if two_inter % 256 == 0:
        act = x.new_empty(num_rows, two_inter // 2)
        m_grouped_bf16_gemm_nt_swiglu_contiguous(x, l1, h, act, offsets, a_row_index=row_index, **passes)
    else:
        m_grouped_bf16_gemm_nt_contiguous(x, l1, h, offsets, a_row_index=row_index, **passes)
        act = moe_swiglu_fwd_bf16(h, offsets)
    return h, act


def moe_forward(x: torch.Tensor, layout: RoutingLayout, topk_weights: torch.Tensor, l1: torch.Tensor,
                l2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The forward on a built layout: writes `y`, returns GEMM1's output h. Device- and
    dtype-agnostic given the kernels, so the orchestration is testable with emulations."""
    h, act = gate_up_swiglu(x, l1, layout.offsets, layout.row_token)
    out = x.new_empty(layout.num_slots, x.shape[1])
    m_grouped_bf16_gemm_nt_contiguous(act, l2, out, layout.offsets)
    moe_combine_bf16(out, layout, topk_weights, y)
    return h


def bf16_mega_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                  l2: torch.Tensor, y: Optional[torch.Tensor] = None, *, training: bool = False,
                  check_ids: bool = False) -> tuple[torch.Tensor, Optional[MegaMoEHandle]]:
    """Mixture-of-Experts forward (docs/DESIGN.md, "The contract"), bf16, one GPU.

    ``y[t] = sum_{k: idx >= 0} w[t, k] * l2[e] @ (silu(g) * u)`` with ``g, u = l1[e] @ x_t``.

    Args:
        x: ``[T, H]`` bf16 tokens.
        topk_idx: ``[T, K]`` int64 expert ids, ``-1`` = empty slot.
        topk_weights: ``[T, K]`` float routing weights (ignored on empty slots).
        l1: ``[E, 2I, H]`` bf16, rows ``[0, I)`` gate and ``[I, 2I)`` up.
        l2: ``[E, H, I]`` bf16.
        y: optional ``[T, H]`` bf16 output to write into (contiguous, 16-byte aligned), sharing
            no memory with the other arguments; without `training` it may be x itself (written
            after every read of x).
        training: also return the handle `mega_moe_backward` needs (see `MegaMoEHandle`).
        check_ids: check expert ids on the host (a sync, raises ValueError) instead of with an
            asynchronous device-side assert.

    Returns:
        ``(y, handle)``; handle is None unless `training`.

    H and I must be multiples of 64; all tensors on one CUDA device, l1 and l2 contiguous and
    16-byte aligned. No host synchronisation (unless `check_ids`); deterministic.
    """
    x, y, layout = prepare_forward(x, topk_idx, topk_weights, l1, l2, y, training, check_ids, "bf16_mega_moe")
    h = moe_forward(x, layout, topk_weights, l1, l2, y)
    return y, (MegaMoEHandle(layout=layout, x=x, h=h) if training else None)


def prepare_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                    l2: torch.Tensor, y: Optional[torch.Tensor], training: bool, check_ids: bool, name: str,
                    dim_multiple: int = DIM_MULTIPLE, check_more: Optional[Callable[[], None]] = None
                    ) -> tuple[torch.Tensor, torch.Tensor, RoutingLayout]:
    """The forwards' common start: every argument checked (H and I multiples of
    `dim_multiple`; `check_more`, a recipe's own checks, once the arguments are well-formed), then
    ``(x with dense rows, y, the routing layout)``."""
    num_tokens, hidden, _, num_experts, _ = check_moe_inputs(x, topk_idx, topk_weights, l1, l2, dim_multiple)
    if check_more is not None:
        check_more()
    check_bool(training=training, check_ids=check_ids)
    if y is not None:
        check_tensor("y", y, torch.bfloat16, 2)
        if tuple(y.shape) != (num_tokens, hidden) or y.device != x.device:
            raise ValueError(f"y must be [{num_tokens}, {hidden}] on {x.device}, got {list(y.shape)} on {y.device}")
        # y may be x in inference (the combine writes y after every read of x), not in training,
        # where the handle keeps x itself for the backward
        inputs = dict(x=x if training else None, topk_idx=topk_idx, topk_weights=topk_weights, l1=l1, l2=l2)
        check_disjoint(dict(y=y), inputs)
    if not x.is_cuda:
        raise ValueError(f"{name} runs on CUDA tensors")
    if y is None:
        y = x.new_empty(num_tokens, hidden)
    check_expert_ids(topk_idx, num_experts, check_ids)
    x = dense_rows(x)
    return x, y, build_routing_layout(topk_idx, topk_weights, num_experts)
