"""Our expert-parallel MoE over DeepEP (optional: `pip install deep_ep`; its normal mode,
intranode over NVLink or across nodes with RDMA), version 1.

DeepEP's dispatch sends each token once to every rank holding one of its experts, with the
token's top-k ids turned into that rank's local ids (-1 for slots elsewhere) and weights
(0 there); each rank runs our single-GPU layer on what it received, and DeepEP's combine
sums the partial outputs back on the token's rank. The backward uses the adjoints: combine's
adjoint is a dispatch of dy with the cached handle, dispatch's adjoint a combine of the
received-token gradients (and of the routing-weight gradients, which are zero on slots
another rank holds, so summing gives each slot's gradient).

Overlap: the backward's combine of dx runs asynchronously (`async_finish`, on DeepEP's stream)
beside the weight gradient of l1, which runs on a side stream (the steps of megamoe_bwd.backward).
The other exchanges have nothing to overlap with: every expert kernel needs the dispatched
tokens, and the forward's combine is its last step. DeepEP reads the number of received tokens on the host
(one sync per dispatch).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._kernels import bf16_mega_moe, check_moe_inputs, moe_combine_bf16

from ..backward import backward_to_dz, dx_rows_beside_dl1, routing_weight_grad, weight_grads


def make_deep_ep_buffer(group: dist.ProcessGroup, hidden: int) -> Any:
    """A `deep_ep.Buffer` sized (DeepEP's own hints) for bf16 tokens of width `hidden` on
    `group`, NVLink only (no RDMA bytes; for multi-node, make the buffer with RDMA bytes as
    DeepEP documents and pass it instead)."""
    import deep_ep

    world = dist.get_world_size(group)
    num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden * 2, world)
                        for config in (deep_ep.Buffer.get_dispatch_config(world),
                                       deep_ep.Buffer.get_combine_config(world)))
    return deep_ep.Buffer(group, num_nvl_bytes, 0)


class _DeepEPMegaMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, l1, l2, buffer, num_experts: int):
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_weights, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights.to(torch.float32))
        y_recv, moe_handle = bf16_mega_moe(recv_x, recv_idx, recv_weights, l1, l2, training=True)
        y, _, _ = buffer.combine(y_recv, handle)
        ctx.buffer, ctx.handle, ctx.moe_handle, ctx.weights_dtype = buffer, handle, moe_handle, topk_weights.dtype
        ctx.save_for_backward(l1, l2)
        return y

    @staticmethod
    def backward(ctx, dy):
        l1, l2 = ctx.saved_tensors
        recv_dy = ctx.buffer.dispatch(dy.contiguous(), handle=ctx.handle)[0]
        handle, layout = ctx.moe_handle, ctx.moe_handle.layout
        grads = weight_grads(l1, l2, l1.dtype)
        dz, row_dw = backward_to_dz(recv_dy, l2, handle, grads, keep_handle=False)
        with dx_rows_beside_dl1(dz, l1, handle.x, layout, grads) as dx_rows:
            d_recv_x = moe_combine_bf16(dx_rows, layout, None, dx_rows.new_empty(recv_dy.shape))
            dx, dtopk, event = ctx.buffer.combine(d_recv_x, ctx.handle, topk_weights=routing_weight_grad(row_dw, layout),
                                                  async_finish=True)  # (records its tensors' streams)
        event.current_stream_wait()
        return dx, None, dtopk.to(ctx.weights_dtype), grads.get_dl1(), grads.get_dl2(), None, None


def ep_mega_moe_deep_ep(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                        l2: torch.Tensor, buffer: Any) -> torch.Tensor:
    """This rank's ``y [T, H]``, tokens exchanged by DeepEP (`buffer`: a `deep_ep.Buffer` on the
    expert-parallel group, e.g. from `make_deep_ep_buffer`). Same contract as
    `megamoe_bwd.ep.ep_mega_moe_nvlink`: global expert ids, this rank's experts in l1, l2;
    differentiable."""
    num_local = check_moe_inputs(x, topk_idx, topk_weights, l1, l2)[3]
    num_experts = num_local * buffer.group_size
    return _DeepEPMegaMoE.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), l1, l2, buffer,
                                num_experts)
