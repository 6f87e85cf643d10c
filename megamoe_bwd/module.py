"""`MegaMoE`: the experts of an MoE layer as a torch module, on one GPU or spread over a process
group (expert parallelism through one of the exchanges of `megamoe_bwd.ep`)."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import ep
from ._kernels import check_bool
from .autograd import mega_moe

BACKENDS = ("nvlink", "deep_ep", "nccl")


class MegaMoE(torch.nn.Module):
    """The experts of an MoE layer (SwiGLU MLPs) as one fused, differentiable op.

    Holds ``l1 [E_local, 2I, H]`` (gate rows then up rows) and ``l2 [E_local, H, I]`` as bf16
    parameters; ``forward(x, topk_idx, topk_weights)`` runs `mega_moe`. Routing (the gate)
    stays outside. With a process `group`, the `num_experts` experts are spread over its
    ranks (rank r holds global experts ``[r * E_local, (r + 1) * E_local)``), `topk_idx` holds
    global ids, and tokens travel to their experts' ranks and back; gradients of `x` and
    `topk_weights` return to the token's rank, weight gradients stay with the expert's. The
    exchange (`backend`):
      - "nvlink": our kernels through `buffer` (`megamoe_bwd.ep.get_symm_buffer_for_mega_moe`,
        `megamoe_bwd.ep.ep_mega_moe_nvlink`), one node;
      - "deep_ep": DeepEP, `buffer` a `deep_ep.Buffer` (`megamoe_bwd.ep.make_deep_ep_buffer`),
        also across nodes;
      - "nccl": `all_to_all_single` (`megamoe_bwd.ep.ep_mega_moe_nccl`), no buffer.
    The default picks "nvlink" with a buffer and "nccl" without. `fp8` runs the expert GEMMs in
    blockwise FP8 (`mega_moe(..., fp8=True)`), on one GPU or over "nvlink" or "deep_ep", whose
    exchanges then move the tokens quantized (`ep_mega_moe_nvlink(..., fp8=True)`,
    `ep_mega_moe_deep_ep(..., fp8=True)`).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, device: torch.device | str | None = None,
                 group: Optional[dist.ProcessGroup] = None, buffer: Any = None, backend: Optional[str] = None,
                 fp8: bool = False):
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden", hidden), ("intermediate", intermediate)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_bool(fp8=fp8)
        if fp8 and (hidden % 128 or intermediate % 128):
            raise ValueError(f"fp8=True needs hidden and intermediate multiples of 128, got {hidden} and {intermediate}")
        backend = backend or ("nvlink" if buffer is not None else "nccl")
        if fp8 and group is not None and backend == "nccl":
            raise ValueError("fp8=True with expert parallelism runs over the 'nvlink' and 'deep_ep' backends (their FP8 "
                             "token exchanges), not 'nccl'")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: pick one of {BACKENDS}")
        if group is None and (buffer is not None or backend != "nccl"):
            raise ValueError("a backend or buffer needs the process group the experts are spread over")
        if group is not None and (buffer is None) != (backend == "nccl"):
            raise ValueError(f"backend {backend!r} {'takes no' if backend == 'nccl' else 'needs a'} buffer")
        self.group, self.buffer, self.backend, self.fp8 = group, buffer, backend, fp8
        world = dist.get_world_size(group) if group is not None else 1
        if num_experts % world:
            raise ValueError(f"{num_experts} experts do not split evenly over {world} ranks")
        factory = dict(device=device, dtype=torch.bfloat16)
        num_local = num_experts // world
        self.l1 = torch.nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden, **factory))
        self.l2 = torch.nn.Parameter(torch.empty(num_local, hidden, intermediate, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.l1, self.l2):
            bound = 1.0 / math.sqrt(weight.shape[-1])
            torch.nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``y [T, H]`` bf16 of this rank's tokens ``x [T, H]`` bf16, with ``topk_idx [T, K]``
        int64 (global expert ids, ``-1`` = empty slot) and ``topk_weights [T, K]`` float."""
        if self.group is None:
            return mega_moe(x, topk_idx, topk_weights, self.l1, self.l2, fp8=self.fp8)
        if self.backend == "nvlink":
            return ep.ep_mega_moe_nvlink(x, topk_idx, topk_weights, self.l1, self.l2, self.buffer, fp8=self.fp8)
        if self.backend == "deep_ep":
            return ep.ep_mega_moe_deep_ep(x, topk_idx, topk_weights, self.l1, self.l2, self.buffer, fp8=self.fp8)
        return ep.ep_mega_moe_nccl(x, topk_idx, topk_weights, self.l1, self.l2, self.group)
