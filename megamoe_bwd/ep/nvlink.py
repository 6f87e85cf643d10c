"""Our expert-parallel MoE over NVLink, version 1: each token pushed once into the buffer of
every rank holding one of its experts, by our kernel (`deep_gemm.moe.glue.ep_push_rows_bf16`)
through the peers' symmetric-memory addresses; our single-GPU layer on each rank's received
tokens (with their top-k ids made local, -1 for experts elsewhere); each rank's partial
outputs pushed back into the token owners' buffers and summed there. No NCCL, no host
synchronisation. Not yet overlapped: each exchange completes (a barrier) before the kernels
that read it start.

Forward:  plan (counts all-gathered) -> push x (+ top-k ids, weights, origin) -> barrier ->
          the single-GPU experts' GEMMs -> combine over this rank's slots, written straight into
          the owners' buffers -> barrier -> sum over ranks.
Backward: push dy -> barrier -> the single-GPU backward (weight gradients on a side stream),
          its dx rows summed over this rank's slots straight into the owners' buffers -> push
          routing-weight gradients back -> barrier -> sum over ranks.
Weight gradients stay with the expert's rank; dx and dtopk_weights return to the token's.
"""
from __future__ import annotations

import torch

from deep_gemm.moe.ep import announce_call, build_ep_plan, check_calls
from deep_gemm.moe.forward import MegaMoEHandle, check_expert_ids, check_moe_inputs, moe_expert_rows
from deep_gemm.moe.glue import ep_push_rows_bf16, moe_combine_bf16, moe_combine_to_peers_bf16
from deep_gemm.moe.layout import RoutingLayout, build_routing_layout
from deep_gemm.moe.symm import SymmBuffer

from ..backward import mega_moe_backward


class _NvlinkMegaMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, l1, l2, buffer: SymmBuffer):
        (num_tokens, hidden), num_topk = x.shape, topk_idx.shape[1]
        me, world, num_local = buffer.rank, buffer.world, buffer.num_local_experts
        plan = build_ep_plan(topk_idx, buffer)
        origin = me * buffer.max_tokens + torch.arange(num_tokens, device=x.device)
        meta = torch.cat([topk_idx, origin.unsqueeze(1)], 1).to(torch.int32)
        ep_push_rows_bf16(x, plan.token, plan.dst_rank, plan.dst_row, buffer.region("recv_x"),
                     f32=topk_weights.to(torch.float32).contiguous(), dst_f32=buffer.region("recv_weights"),
                     i32=meta, dst_i32=buffer.region("recv_meta"))
        buffer.barrier()

        # Received tokens with their experts made local (-1: elsewhere, or no token in that row).
        recv_meta = buffer.local["recv_meta"].to(torch.int64)  # a copy: the buffer is reused
        arrived = torch.arange(recv_meta.shape[0], device=x.device) < plan.num_recv
        expert = recv_meta[:, :num_topk] - me * num_local
        local_idx = torch.where(arrived.unsqueeze(1) & (expert >= 0) & (expert < num_local), expert, -1)
        local_weights = torch.where(local_idx >= 0, buffer.local["recv_weights"], 0.0)
        back_rank = (recv_meta[:, num_topk] // buffer.max_tokens).to(torch.int32)
        back_row = recv_meta[:, num_topk] % buffer.max_tokens * world + me
        recv_x = buffer.local["recv_x"].clone()  # kept for the weight gradient of l1
        layout = build_routing_layout(local_idx, local_weights, num_local)
        h, rows = moe_expert_rows(recv_x, layout, l1, l2)
        # Each received token's weighted sum over this rank's experts goes straight to its owner.
        moe_combine_to_peers_bf16(rows, layout, local_weights, back_rank, back_row, buffer.region("back"),
                                  plan.num_recv)
        del rows
        buffer.barrier()
        y = moe_combine_bf16(buffer.local["back"][:num_tokens * world], plan.pairs, None, x.new_empty(num_tokens, hidden))
        ctx.buffer, ctx.weights_dtype = buffer, topk_weights.dtype
        ctx.save_for_backward(l1, l2, recv_x, h, layout.offsets, layout.row_token, layout.row_weight, layout.slot_row,
                              layout.slot_valid, back_rank, back_row, plan.token, plan.dst_rank, plan.dst_row,
                              plan.pairs.slot_row, plan.pairs.slot_valid, plan.num_recv)
        return y

    @staticmethod
    def backward(ctx, dy):
        (l1, l2, recv_x, h, offsets, row_token, row_weight, slot_row, slot_valid, back_rank, back_row, token, dst_rank,
         dst_row, pair_row, pair_valid, num_recv) = ctx.saved_tensors
        buffer: SymmBuffer = ctx.buffer
        (num_tokens, world), num_topk = pair_row.shape, slot_row.shape[1]
        dy = dy.contiguous()
        announce_call(buffer, 1)  # (no barrier before: see build_ep_plan)
        ep_push_rows_bf16(dy, token, dst_rank, dst_row, buffer.region("recv_x"))
        buffer.barrier()
        check_calls(buffer)

        handle = MegaMoEHandle(RoutingLayout(offsets, row_token, row_weight, slot_row, slot_valid), recv_x, h)
        def to_owners(rows: torch.Tensor, layout: RoutingLayout) -> None:  # each token's dx rows, summed
            moe_combine_to_peers_bf16(rows, layout, None, back_rank, back_row, buffer.region("back"), num_recv)

        _, d_recv_weights, dl1, dl2 = mega_moe_backward(buffer.local["recv_x"], l1, l2, handle,
                                                        weight_grad_dtype=l1.dtype, combine_dx=to_owners)
        ep_push_rows_bf16(None, None, back_rank, back_row, None, f32=d_recv_weights, dst_f32=buffer.region("back_dw"),
                          num_valid=num_recv)
        buffer.barrier()
        pairs = RoutingLayout(offsets, token, row_weight.new_empty(0), pair_row, pair_valid)
        dx = moe_combine_bf16(buffer.local["back"][:num_tokens * world], pairs, None, dy.new_empty(dy.shape))
        # Each slot's gradient comes from the rank holding its expert; the others sent zeros.
        partial_dw = buffer.local["back_dw"][:num_tokens * world].view(num_tokens, world, num_topk)
        dtopk_weights = torch.where(pair_valid.unsqueeze(2), partial_dw, 0.0).sum(1)
        return dx, None, dtopk_weights.to(ctx.weights_dtype), dl1, dl2, None


def ep_mega_moe_nvlink(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                       l2: torch.Tensor, buffer: SymmBuffer) -> torch.Tensor:
    """This rank's ``y [T, H]`` of an MoE layer whose experts are spread over the buffer's
    group, exchanging tokens through `buffer` (`deep_gemm.get_symm_buffer_for_mega_moe`).
    Differentiable: gradients reach x and topk_weights (on this rank) and this rank's l1, l2.

    Args:
        x: ``[T, H]`` bf16, this rank's tokens (T <= the buffer's max tokens; may differ between
            ranks, or be 0).
        topk_idx: ``[T, K]`` int64 *global* expert ids, ``-1`` = empty slot.
        topk_weights: ``[T, K]`` float.
        l1: ``[E_local, 2I, H]``, l2 ``[E_local, H, I]`` bf16: this rank's experts, global ids
            ``rank * E_local + j``.

    Collective: every rank of the group calls it for the same layer, in the same order.
    Expert ids outside ``[-1, E)`` fail an asynchronous device assert (a ValueError on the CPU).
    """
    num_tokens, hidden, _, num_local, num_topk = check_moe_inputs(x, topk_idx, topk_weights, l1, l2)
    buffer.check_fits(num_tokens, num_topk, hidden)
    if num_local != buffer.num_local_experts:
        raise ValueError(f"l1 holds {num_local} experts; the buffer splits {buffer.num_experts} experts over "
                         f"{buffer.world} ranks ({buffer.num_local_experts} each)")
    check_expert_ids(topk_idx, buffer.num_experts, sync=not x.is_cuda)
    return _NvlinkMegaMoE.apply(x.contiguous(), topk_idx, topk_weights, l1, l2, buffer)
