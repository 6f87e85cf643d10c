"""Our expert-parallel MoE over NVLink, version 2: the forward's token exchange overlaps GEMM1.

Forward:  stage x, top-k ids and weights in this rank's buffer -> plan (token counts; one
          barrier) -> read every rank's top-k ids, build the layout of this rank's experts over
          all ranks' tokens in pass order (own tokens first) -> the copy engines pull the other
          ranks' x on a side stream while GEMM1 (gathering rows, SwiGLU epilogue) works pass by
          pass, its tiles of pass s waiting on that pass's arrival flag -> GEMM2 -> combine over
          this rank's slots, written straight into the owners' buffers -> barrier -> sum over
          ranks.
Backward: stage dy -> barrier -> the copy engines pull the other ranks' dy while dA's GEMM
          (gathering rows) works pass by pass on the same arrival flags -> the rest of the
          single-GPU backward (weight gradients on a side stream), its dx rows summed over this
          rank's slots straight into the owners' buffers -> push routing-weight gradients back
          -> barrier -> sum over ranks.
Weight gradients stay with the expert's rank; dx and dtopk_weights return to the token's. No
NCCL, no host synchronisation. See deep_gemm.moe.ep for the pass order.
"""
from __future__ import annotations

import torch

from deep_gemm.moe.ep import announce_call, build_ep_plan, check_calls, exchange_token_counts, pull_tokens
from deep_gemm.moe.forward import MegaMoEHandle, check_expert_ids, check_moe_inputs, moe_expert_rows
from deep_gemm.moe.glue import ep_push_rows_bf16, moe_combine_bf16, moe_combine_to_peers_bf16
from deep_gemm.moe.layout import RoutingLayout, build_routing_layout
from deep_gemm.moe.symm import SymmBuffer

from ..backward import mega_moe_backward


def _stage(region: torch.Tensor, t: torch.Tensor) -> None:
    if t.data_ptr() != region.data_ptr():  # the caller may have staged it already
        region[:t.shape[0]].copy_(t)


class _NvlinkMegaMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, l1, l2, buffer: SymmBuffer):
        num_tokens, num_topk = topk_idx.shape
        me, world, num_local, max_tokens = buffer.rank, buffer.world, buffer.num_local_experts, buffer.max_tokens
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights.to(torch.float32))):
            _stage(buffer.local[name], t)
        source_tokens = exchange_token_counts(buffer, num_tokens)

        # Every rank's tokens in pass order (pass s: rank (me + s) % world), [pass, token, slot],
        # with their experts made local (-1: elsewhere, or no token in that row). GEMM1 is launched
        # with as few host-side ops before it as possible: the GPU would wait for them.
        recv_idx = torch.stack([buffer.region("topk_idx").tensors[(me + s) % world] for s in range(world)])
        recv_weights = torch.stack([buffer.region("topk_weights").tensors[(me + s) % world] for s in range(world)])
        token_ids, pass_ids = buffer.constant(("recv", x.device), lambda: (
            torch.arange(max_tokens, device=x.device), torch.arange(world, device=x.device).view(world, 1, 1)))
        arrived = token_ids < source_tokens.roll(-me).unsqueeze(1)  # [pass, token]
        expert = recv_idx - me * num_local
        mine = (expert >= 0) & (expert < num_local) & arrived.unsqueeze(2)
        local_weights = torch.where(mine, recv_weights, 0.0).view(-1, num_topk)
        # Sorted by (expert, pass): GEMM1 runs pass by pass; the other kernels see experts only.
        runs = build_routing_layout(torch.where(mine, expert * world + pass_ids, -1).view(-1, num_topk), local_weights,
                                    num_local * world)
        layout = RoutingLayout(runs.offsets[::world].contiguous(), runs.row_token, runs.row_weight, runs.slot_row,
                               runs.slot_valid)
        recv_x, arrival = pull_tokens(x, buffer, "x", runs.offsets)
        try:
            h, rows = moe_expert_rows(recv_x, layout, l1, l2, arrival)
        finally:  # (joined already unless it raised)
            arrival.join()
        check_calls(buffer)
        plan = build_ep_plan(topk_idx, buffer, source_tokens)

        # Each received token's weighted sum over this rank's experts goes straight to its owner.
        back_rank, row_if_mine, num_recv = buffer.constant(("back", x.device), lambda: (
            ((pass_ids.flatten() + me) % world).to(torch.int32).repeat_interleave(max_tokens),
            token_ids.repeat(world) * world + me,
            torch.full((1,), world * max_tokens, dtype=torch.int32, device=x.device)))
        back_row = torch.where(mine.any(2).flatten(), row_if_mine, -1)
        moe_combine_to_peers_bf16(rows, layout, local_weights, back_rank, back_row, buffer.region("back"), num_recv)
        del rows
        buffer.barrier()
        y = moe_combine_bf16(buffer.local["back"][:num_tokens * world], plan.pairs, None, x.new_empty(x.shape))
        ctx.buffer, ctx.weights_dtype = buffer, topk_weights.dtype
        ctx.save_for_backward(l1, l2, recv_x, h, runs.offsets, layout.offsets, layout.row_token, layout.row_weight,
                              layout.slot_row, layout.slot_valid, back_rank, back_row, num_recv, plan.pairs.slot_row,
                              plan.pairs.slot_valid)
        return y

    @staticmethod
    def backward(ctx, dy):
        (l1, l2, recv_x, h, run_offsets, offsets, row_token, row_weight, slot_row, slot_valid, back_rank, back_row,
         num_recv, pair_row, pair_valid) = ctx.saved_tensors
        buffer: SymmBuffer = ctx.buffer
        (num_tokens, world), num_topk = pair_row.shape, slot_row.shape[1]
        dy = dy.contiguous()
        _stage(buffer.local["dy"], dy)  # the last pulls of this region ended before their exchange's last barrier
        announce_call(buffer, 1)  # (no barrier before: see exchange_token_counts)
        buffer.barrier()
        recv_dy, arrival = pull_tokens(dy, buffer, "dy", run_offsets)

        handle = MegaMoEHandle(RoutingLayout(offsets, row_token, row_weight, slot_row, slot_valid), recv_x, h)
        def to_owners(rows: torch.Tensor, layout: RoutingLayout, _dtopk: torch.Tensor) -> None:  # dx rows, summed
            moe_combine_to_peers_bf16(rows, layout, None, back_rank, back_row, buffer.region("back"), num_recv)

        try:
            _, d_recv_weights, dl1, dl2 = mega_moe_backward(recv_dy, l1, l2, handle, weight_grad_dtype=l1.dtype,
                                                            combine_dx=to_owners, dy_arrival=arrival)
        finally:  # (joined already unless it raised)
            arrival.join()
        check_calls(buffer)
        ep_push_rows_bf16(None, None, back_rank, back_row, None, f32=d_recv_weights, dst_f32=buffer.region("back_dw"),
                          num_valid=num_recv)
        buffer.barrier()
        pairs = RoutingLayout(offsets, pair_row.flatten(), row_weight.new_empty(0), pair_row, pair_valid)
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
