"""Routing layout: which routed row of the expert-sorted buffers holds which (token, slot).

Built on the GPU by our counting-sort kernels (`kernels.build_routing_layout`), or by the
PyTorch ops here, with no host synchronisation: the number of routed rows is never read on the
host, buffers are sized for all T * K slots and the rows past the last expert (empty `-1`
slots) belong to no group, so the grouped GEMMs skip them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoutingLayout:
    """Expert-major order of the T * K (token, slot) pairs.

    offsets:    int32 ``[E + 1]``: expert e owns routed rows ``[offsets[e], offsets[e + 1])``;
                rows from ``offsets[E]`` on are empty slots.
    row_token:  int64 ``[T * K]``: the token of each routed row.
    row_weight: float32 ``[T * K]``: the routing weight of each routed row (0 on empty slots).
    slot_row:   int64 ``[T, K]``: the routed row of each (token, slot).
    slot_valid: bool ``[T, K]``: False on empty slots.
    """

    offsets: torch.Tensor
    row_token: torch.Tensor
    row_weight: torch.Tensor
    slot_row: torch.Tensor
    slot_valid: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.row_token.numel()


def build_routing_layout_torch(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> RoutingLayout:
    """The routing layout by PyTorch ops (a stable argsort), on any device: the (token, slot)
    pairs sorted by expert, stably (token order within an expert). topk_idx ``[T, K]``
    integer (ids outside ``[0, E)`` are empty slots), topk_weights ``[T, K]`` float."""
    num_tokens, num_topk = topk_idx.shape
    # Out-of-range ids act as empty (and are reported). Contiguous: kernels index it flat.
    valid = ((topk_idx >= 0) & (topk_idx < num_experts)).contiguous()
    key = torch.where(valid, topk_idx, num_experts).flatten()  # empty slots sort last
    order = torch.argsort(key, stable=True)
    sorted_key = key.index_select(0, order)
    boundaries = torch.arange(num_experts + 1, device=key.device, dtype=key.dtype)
    offsets = torch.searchsorted(sorted_key, boundaries).to(torch.int32)
    weights = topk_weights.flatten().to(torch.float32)  # the kernels read fp32
    row_weight = torch.where(sorted_key < num_experts, weights.index_select(0, order), 0.0)
    slot_row = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return RoutingLayout(offsets=offsets, row_token=order // num_topk, row_weight=row_weight,
                         slot_row=slot_row.view(num_tokens, num_topk), slot_valid=valid)
