"""Our expert-parallel MoE over NVLink, version 1: tokens pushed straight into the expert
owners' symmetric buffers by our kernel (`deep_gemm.moe.glue.ep_push_rows`), our fused
expert MLPs on the rows as they land (already grouped by expert), expert outputs pushed back
into the token owners' buffers, and the K slots combined there. No NCCL, no host
synchronisation. Not yet overlapped: each exchange completes (a barrier) before the GEMMs
that read it start.

Forward:  plan (counts all-gathered) -> push x rows (+ routing weight, origin) -> barrier ->
          GEMM1 + SwiGLU, GEMM2 -> push output rows back -> barrier -> weighted combine.
Backward: push dy rows and x rows -> barrier -> the single-GPU expert backward (weight
          gradients on a side stream) -> push dx rows and routing-weight gradients back ->
          barrier -> combine. Weight gradients stay with the expert's rank, dx and
          dtopk_weights return to the token's rank.
"""
from __future__ import annotations

import torch

from deep_gemm.moe.ep import build_ep_plan
from deep_gemm.moe.forward import check_moe_inputs, expert_mlps_forward
from deep_gemm.moe.glue import ep_push_rows, moe_combine_bf16
from deep_gemm.moe.layout import RoutingLayout, sorted_rows_layout
from deep_gemm.moe.symm import SymmBuffer

from ..backward import expert_mlps_backward


def _origin(buffer: SymmBuffer, recv_src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, slot) each received row came from."""
    return (recv_src // buffer.max_slots).to(torch.int32), (recv_src % buffer.max_slots).to(torch.int64)


class _NvlinkMegaMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, l1, l2, buffer: SymmBuffer):
        num_tokens, num_topk = topk_idx.shape
        num_slots = num_tokens * num_topk
        plan = build_ep_plan(topk_idx, buffer)
        origin = (buffer.rank * buffer.max_slots + torch.arange(num_slots, device=x.device)).to(torch.int32)
        ep_push_rows(x, plan.token, plan.send_rank, plan.send_row, buffer.region("recv_rows"),
                     f32=topk_weights.reshape(-1).to(torch.float32).contiguous(), dst_f32=buffer.region("recv_weight"),
                     i32=origin, dst_i32=buffer.region("recv_src"))
        buffer.barrier()
        # Copies: the next layer's exchange overwrites the buffer before this backward runs.
        recv_weight, recv_src = buffer.local["recv_weight"].clone(), buffer.local["recv_src"].clone()
        back_rank, back_row = _origin(buffer, recv_src)
        h, out = expert_mlps_forward(buffer.local["recv_rows"], None, sorted_rows_layout(plan.recv_offsets, recv_weight),
                                     l1, l2)
        ep_push_rows(out, None, back_rank, back_row, buffer.region("back_rows"), num_valid=plan.recv_offsets[-1:])
        buffer.barrier()
        y = moe_combine_bf16(buffer.local["back_rows"][:num_slots], plan.slots, topk_weights,
                             x.new_empty(num_tokens, x.shape[1]))
        ctx.buffer, ctx.weights_dtype = buffer, topk_weights.dtype
        ctx.save_for_backward(x, l1, l2, h, recv_weight, back_rank, back_row, plan.send_rank, plan.send_row,
                              plan.token, plan.slots.slot_row, plan.slots.slot_valid, plan.recv_offsets)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x, l1, l2, h, recv_weight, back_rank, back_row, send_rank, send_row, token, slot_row, slot_valid,
         recv_offsets) = ctx.saved_tensors
        buffer: SymmBuffer = ctx.buffer
        dy = dy.contiguous()
        buffer.barrier()  # every rank is done with the buffer's previous contents
        ep_push_rows(dy, token, send_rank, send_row, buffer.region("recv_rows"))
        ep_push_rows(x, token, send_rank, send_row, buffer.region("recv_rows2"))
        buffer.barrier()
        slots = RoutingLayout(offsets=recv_offsets, row_token=token, row_weight=recv_weight.new_empty(0),
                              slot_row=slot_row, slot_valid=slot_valid)
        num_slots = token.numel()

        def push_back_and_combine(dxs: torch.Tensor, row_dw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ep_push_rows(dxs, None, back_rank, back_row, buffer.region("back_rows"), f32=row_dw,
                         dst_f32=buffer.region("back_dw"), num_valid=recv_offsets[-1:])
            buffer.barrier()
            dx = moe_combine_bf16(buffer.local["back_rows"][:num_slots], slots, None, torch.empty_like(dy))
            dtopk_weights = torch.where(slot_valid, buffer.local["back_dw"][:num_slots].view_as(slot_valid), 0.0)
            return dx, dtopk_weights

        dl1, dl2 = torch.empty_like(l1), torch.empty_like(l2)
        dx, dtopk_weights = expert_mlps_backward(
            buffer.local["recv_rows"], None, lambda: (buffer.local["recv_rows2"], None), h,
            sorted_rows_layout(recv_offsets, recv_weight), l1, l2, (dl1, False), (dl2, False), push_back_and_combine)
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
    Expert ids outside ``[-1, E)`` fail an asynchronous device assert.
    """
    num_tokens, hidden, _, num_local, num_topk = check_moe_inputs(x, topk_idx, topk_weights, l1, l2)
    buffer.check_fits(num_tokens, num_topk, hidden)
    if num_local != buffer.num_local_experts:
        raise ValueError(f"l1 holds {num_local} experts; the buffer splits {buffer.num_experts} experts over "
                         f"{buffer.world} ranks ({buffer.num_local_experts} each)")
    ok = ((topk_idx >= -1) & (topk_idx < buffer.num_experts)).all()
    if x.is_cuda:
        torch._assert_async(ok, f"topk_idx has expert ids outside [-1, {buffer.num_experts})")
    return _NvlinkMegaMoE.apply(x.contiguous(), topk_idx, topk_weights, l1, l2, buffer)
