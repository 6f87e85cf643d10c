"""TorchTitan-style expert-parallel MoE: the baseline of the EP benchmarks and tests.

Per rank: dispatch the (token, slot) rows to the ranks owning their experts with
`all_to_all_single`, run the local experts with `torch._grouped_mm`, combine back with the
reverse all-to-all and the routing weights. Differentiable end to end.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..baseline import expert_mlps
from .alltoall import combine, dispatch


def all_to_all_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                   l2: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                   deterministic_combine: bool = False) -> torch.Tensor:
    """This rank's ``y [T, H]`` of an MoE layer whose experts are spread over `group`.

    Args:
        x: ``[T, H]`` this rank's tokens (T may differ between ranks, or be 0).
        topk_idx: ``[T, K]`` int64 *global* expert ids, ``-1`` = empty slot.
        topk_weights: ``[T, K]`` float routing weights.
        l1: ``[E_local, 2I, H]``, l2 ``[E_local, H, I]``: this rank's experts, global ids
            ``rank * E_local + j``.
        deterministic_combine: sum the K slots in fp32 in a fixed order instead of TorchTitan's
            weighted `index_add` in the output dtype.
    """
    group = group or dist.group.WORLD
    num_local = l1.shape[0]
    rows, expert, plan = dispatch(x, topk_idx, num_local, group)
    # Rows arrive grouped by source rank; regroup them by local expert for the grouped GEMMs.
    order = torch.argsort(expert, stable=True)
    offs = torch.cumsum(torch.bincount(expert, minlength=num_local), 0).to(torch.int32)
    out_sorted = expert_mlps(rows.index_select(0, order), offs, l1, l2)
    out = torch.zeros_like(out_sorted).index_copy(0, order, out_sorted)
    return combine(out, plan, topk_weights, x.shape[0], group, deterministic=deterministic_combine)
