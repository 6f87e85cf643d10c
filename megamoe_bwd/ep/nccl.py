"""Our expert-parallel MoE over `all_to_all_single` (NCCL): the token exchange around our fused
single-GPU layer on each rank's received rows, not overlapped with compute (the NVLink path
overlaps it)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .._kernels import check_moe_inputs

from ..autograd import mega_moe
from .alltoall import combine, dispatch


def ep_mega_moe_nccl(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                     l2: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This rank's ``y [T, H]``; same contract as `megamoe_bwd.ep.all_to_all_moe`. Each
    received row is one token routed to one local expert with weight 1; the routing weights
    are applied when combining, so their gradient flows there. Inputs are checked before the
    first collective."""
    check_moe_inputs(x, topk_idx, topk_weights, l1, l2)
    group = group or dist.group.WORLD
    rows, expert, plan = dispatch(x, topk_idx, l1.shape[0], group)
    ones = torch.ones(rows.shape[0], 1, device=rows.device, dtype=torch.float32)
    out = mega_moe(rows, expert.unsqueeze(1), ones, l1, l2)
    return combine(out, plan, topk_weights, x.shape[0], group)
