"""TorchTitan-style expert-parallel MoE: the baseline of the EP benchmarks and tests.

Per rank: sort the (token, slot) pairs by expert, exchange the split sizes (a host sync),
`all_to_all_single` the token rows to the ranks owning their experts, run the local experts
with `torch._grouped_mm`, send the results back with the reverse all-to-all, and add them
into token order with the routing weights. Differentiable through
`all_to_all_single_autograd` (as TorchTitan uses).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from ..baseline import expert_mlps


def all_to_all_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                   l2: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This rank's ``y [T, H]`` of an MoE layer whose experts are spread over `group`.

    Args:
        x: ``[T, H]`` this rank's tokens (T may differ between ranks, or be 0).
        topk_idx: ``[T, K]`` int64 *global* expert ids, ``-1`` = empty slot.
        topk_weights: ``[T, K]`` float routing weights.
        l1: ``[E_local, 2I, H]``, l2 ``[E_local, H, I]``: this rank's experts, global ids
            ``rank * E_local + j``.
    """
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    num_tokens, hidden = x.shape
    num_topk, num_local = topk_idx.shape[1], l1.shape[0]

    flat = topk_idx.reshape(-1)
    slot = (flat >= 0).nonzero().squeeze(1)  # a host sync, like the split sizes below
    expert = flat.index_select(0, slot)
    order = torch.argsort(expert, stable=True)  # by destination rank, then local expert
    slot, expert = slot.index_select(0, order), expert.index_select(0, order)

    send_counts = torch.bincount(expert // num_local, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    num_recv = sum(recv_splits)

    recv_rows = wait_tensor(all_to_all_single_autograd(x.index_select(0, slot // num_topk), recv_splits,
                                                       send_splits, group))
    recv_expert = expert.new_empty(num_recv)
    dist.all_to_all_single(recv_expert, expert % num_local, recv_splits, send_splits, group=group)

    # Rows arrive grouped by source rank; regroup them by local expert for the grouped GEMMs.
    local_order = torch.argsort(recv_expert, stable=True)
    offs = torch.cumsum(torch.bincount(recv_expert, minlength=num_local), 0).to(torch.int32)
    out_sorted = expert_mlps(recv_rows.index_select(0, local_order), offs, l1, l2)
    out = torch.zeros_like(out_sorted).index_copy(0, local_order, out_sorted)

    back = wait_tensor(all_to_all_single_autograd(out, send_splits, recv_splits, group))
    weights = topk_weights.reshape(-1).index_select(0, slot).to(x.dtype).unsqueeze(-1)
    return x.new_zeros(num_tokens, hidden).index_add(0, slot // num_topk, back * weights)
