"""Autograd for the Mega MoE layer: `torch.library` custom ops (so `torch.compile` keeps them
whole instead of breaking the graph), a functional `mega_moe` and the `MegaMoE` module."""
from __future__ import annotations

import math
from typing import Any

import torch

from deep_gemm.moe import MegaMoEHandle, RoutingLayout, bf16_mega_moe

from .backward import mega_moe_backward

Tensor = torch.Tensor


@torch.library.custom_op("megamoe::forward", mutates_args=(), device_types="cuda")
def _forward_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                l2: torch.Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    y, handle = bf16_mega_moe(x, topk_idx, topk_weights, l1, l2, training=True)
    layout = handle.layout
    return (y, handle.h, layout.offsets, layout.row_token, layout.row_weight, layout.slot_row, layout.slot_valid)


@_forward_op.register_fake
def _(x, topk_idx, topk_weights, l1, l2):
    (num_tokens, hidden), (num_experts, two_inter, _) = x.shape, l1.shape
    num_slots = num_tokens * topk_idx.shape[1]
    return (x.new_empty(num_tokens, hidden), x.new_empty(num_slots, two_inter),
            x.new_empty(num_experts + 1, dtype=torch.int32), x.new_empty(num_slots, dtype=torch.int64),
            x.new_empty(num_slots, dtype=torch.float32), topk_idx.new_empty(topk_idx.shape),
            topk_idx.new_empty(topk_idx.shape, dtype=torch.bool))


@torch.library.custom_op("megamoe::backward", mutates_args=("h",), device_types="cuda")
def _backward_op(dy: torch.Tensor, x: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, h: torch.Tensor,
                 offsets: torch.Tensor, row_token: torch.Tensor, row_weight: torch.Tensor, slot_row: torch.Tensor,
                 slot_valid: torch.Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    handle = MegaMoEHandle(RoutingLayout(offsets, row_token, row_weight, slot_row, slot_valid), x, h)
    # Gradients take the parameters' dtype (autograd would cast them to it anyway).
    return mega_moe_backward(dy.contiguous(), l1, l2, handle, weight_grad_dtype=l1.dtype)


@_backward_op.register_fake
def _(dy, x, l1, l2, h, offsets, row_token, row_weight, slot_row, slot_valid):
    return (torch.empty_like(x), slot_row.new_empty(slot_row.shape, dtype=torch.float32), torch.empty_like(l1),
            torch.empty_like(l2))


def _setup_context(ctx, inputs, output):
    x, _, topk_weights, l1, l2 = inputs
    ctx.save_for_backward(x, l1, l2, *output[1:])
    ctx.topk_weights_dtype = topk_weights.dtype
    # Only y reaches users; zero gradients for the saved outputs (h alone is 2I bf16 per
    # routed slot) would be filled for nothing.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, *unused_grads):
    if dy is None:
        return None, None, None, None, None
    x, l1, l2, *saved = ctx.saved_tensors
    dx, dtopk_weights, dl1, dl2 = torch.ops.megamoe.backward(dy, x, l1, l2, *saved)
    return dx, None, dtopk_weights.to(ctx.topk_weights_dtype), dl1, dl2


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def mega_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
             l2: torch.Tensor) -> torch.Tensor:
    """Differentiable Mixture-of-Experts layer (see `deep_gemm.bf16_mega_moe` for the contract).

    Gradients flow to `x`, `topk_weights`, `l1` and `l2` (in their dtypes). Shapes:
    x ``[T, H]`` bf16, topk_idx ``[T, K]`` int64 (``-1`` = empty), topk_weights ``[T, K]``,
    l1 ``[E, 2I, H]`` bf16, l2 ``[E, H, I]`` bf16; returns y ``[T, H]`` bf16.
    """
    return torch.ops.megamoe.forward(x, topk_idx, topk_weights, l1, l2)[0]


class MegaMoE(torch.nn.Module):
    """The experts of an MoE layer (SwiGLU MLPs) as one fused, differentiable op.

    Holds ``l1 [E_local, 2I, H]`` (gate rows then up rows) and ``l2 [E_local, H, I]`` as bf16
    parameters; ``forward(x, topk_idx, topk_weights)`` runs `mega_moe`. Routing (the gate)
    stays outside. With a process `group`, the `num_experts` experts are spread over its
    ranks (rank r holds global experts ``[r * E_local, (r + 1) * E_local)``), `topk_idx` holds
    global ids, and tokens travel to their experts' ranks and back; gradients of `x` and
    `topk_weights` return to the token's rank, weight gradients stay with the expert's. The
    exchange (`backend`):
      - "nvlink": our kernels through `buffer` (`deep_gemm.get_symm_buffer_for_mega_moe`,
        `megamoe_bwd.ep.ep_mega_moe_nvlink`), one node;
      - "deep_ep": DeepEP, `buffer` a `deep_ep.Buffer` (`megamoe_bwd.ep.make_deep_ep_buffer`),
        also across nodes;
      - "nccl": `all_to_all_single` (`megamoe_bwd.ep.ep_mega_moe_nccl`), no buffer.
    The default picks "nvlink" with a buffer and "nccl" without.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, device=None,
                 group: "torch.distributed.ProcessGroup | None" = None, buffer: Any = None,
                 backend: str | None = None):
        super().__init__()
        backend = backend or ("nvlink" if buffer is not None else "nccl")
        if backend not in ("nvlink", "deep_ep", "nccl"):
            raise ValueError(f"unknown backend {backend!r}: pick 'nvlink', 'deep_ep' or 'nccl'")
        if group is None and (buffer is not None or backend != "nccl"):
            raise ValueError("a backend or buffer needs the process group the experts are spread over")
        if (buffer is None) != (backend == "nccl"):
            raise ValueError(f"backend {backend!r} {'takes no' if backend == 'nccl' else 'needs a'} buffer")
        self.group, self.buffer, self.backend = group, buffer, backend
        world = torch.distributed.get_world_size(group) if group is not None else 1
        if num_experts % world:
            raise ValueError(f"{num_experts} experts do not split evenly over {world} ranks")
        if buffer is not None and group is None:
            raise ValueError("a symmetric buffer needs the process group it was made for")
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
        if self.group is None:
            return mega_moe(x, topk_idx, topk_weights, self.l1, self.l2)
        from . import ep  # the EP package builds on this module
        if self.backend == "nvlink":
            return ep.ep_mega_moe_nvlink(x, topk_idx, topk_weights, self.l1, self.l2, self.buffer)
        if self.backend == "deep_ep":
            return ep.ep_mega_moe_deep_ep(x, topk_idx, topk_weights, self.l1, self.l2, self.buffer)
        return ep.ep_mega_moe_nccl(x, topk_idx, topk_weights, self.l1, self.l2, self.group)
