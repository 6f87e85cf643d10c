"""Our expert-parallel MoE, interim version: the token exchange over `all_to_all_single`
(NCCL), our fused single-GPU layer on each rank's received rows. Communication is not yet
overlapped with compute (the built-in NVLink path will do that)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..autograd import mega_moe
from .alltoall import combine, dispatch


def ep_mega_moe_nccl(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                     l2: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This rank's ``y [T, H]``; same contract as `megamoe_bwd.ep.all_to_all_moe`. Each
    received row is one token routed to one local expert with weight 1; the routing weights
    are applied when combining, so their gradient flows there."""
    group = group or dist.group.WORLD
    rows, expert, plan = dispatch(x, topk_idx, l1.shape[0], group)
    ones = torch.ones(rows.shape[0], 1, device=rows.device, dtype=torch.float32)
    out = mega_moe(rows, expert.unsqueeze(1), ones, l1, l2)
    return combine(out, plan, topk_weights, x.shape[0], group)
