"""Token exchange for expert parallelism over `all_to_all_single` (NCCL or gloo), shared by
the TorchTitan-style baseline and our interim expert-parallel path.

`dispatch` sends every (token, slot) pair's row to the rank owning its expert; `combine`
brings the expert outputs back and adds them into token order with the routing weights. Both
are differentiable (`all_to_all_single_autograd`). The split sizes are exchanged and read on
the host: one sync per layer, as TorchTitan does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor


@dataclass
class DispatchPlan:
    """How rows moved: this rank's sent (token, slot) pairs, in send order, and the split sizes."""

    slot: torch.Tensor  # int64 [S]: flat index t * K + k of each sent pair
    send_splits: list
    recv_splits: list
    num_topk: int


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, num_local_experts: int, group: dist.ProcessGroup
             ) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Returns (received rows [R, H], their local expert ids [R], the plan). Raises ValueError
    on every rank if any rank has an expert id outside [-1, world * E_local)."""
    world = dist.get_world_size(group)
    num_topk = topk_idx.shape[1]
    # Agree on bad ids before the first exchange: a lone raising rank would hang the others.
    bad = ((topk_idx < -1) | (topk_idx >= world * num_local_experts)).any().to(torch.int32).reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bad.item():
        raise ValueError(f"topk_idx has expert ids outside [-1, {world * num_local_experts}) on some rank")
    flat = topk_idx.reshape(-1)
    slot = (flat >= 0).nonzero().squeeze(1)
    expert = flat.index_select(0, slot)
    order = torch.argsort(expert, stable=True)  # by destination rank, then local expert
    slot, expert = slot.index_select(0, order), expert.index_select(0, order)

    send_counts = torch.bincount(expert // num_local_experts, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

    rows = wait_tensor(all_to_all_single_autograd(x.index_select(0, slot // num_topk), recv_splits, send_splits,
                                                  group))
    recv_expert = expert.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv_expert, expert % num_local_experts, recv_splits, send_splits, group=group)
    return rows, recv_expert, DispatchPlan(slot, send_splits, recv_splits, num_topk)


def combine(out: torch.Tensor, plan: DispatchPlan, topk_weights: torch.Tensor, num_tokens: int,
            group: dist.ProcessGroup, deterministic: bool = True) -> torch.Tensor:
    """``y[t] = sum_k w[t, k] * out_row(t, k)``: sends the expert outputs (in arrival order)
    back to their tokens' ranks and adds them up with the routing weights.

    `deterministic`: place each row at its slot and sum the K slots in fp32 (fixed order);
    otherwise weight in the output dtype and `index_add` (atomics), as TorchTitan does.
    """
    back = wait_tensor(all_to_all_single_autograd(out, plan.send_splits, plan.recv_splits, group))
    hidden, num_slots = out.shape[1], num_tokens * plan.num_topk
    if not deterministic:
        weights = topk_weights.reshape(-1).index_select(0, plan.slot).to(out.dtype).unsqueeze(-1)
        return out.new_zeros(num_tokens, hidden).index_add(0, plan.slot // plan.num_topk, back * weights)
    rows = out.new_zeros(num_slots, hidden).index_copy(0, plan.slot, back)  # slots are unique
    weights = topk_weights.new_zeros(num_slots, dtype=torch.float32).index_copy(
        0, plan.slot, topk_weights.reshape(-1).index_select(0, plan.slot).float())
    y = (rows.view(num_tokens, plan.num_topk, hidden).float() * weights.view(num_tokens, plan.num_topk, 1)).sum(1)
    return y.to(out.dtype)
