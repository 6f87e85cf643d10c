"""Our expert-parallel MoE over NVLink: the token exchange overlaps the GEMMs.

Forward:  stage x, top-k ids and weights in this rank's buffer -> plan (token counts; one
          barrier) -> read every rank's top-k ids, build the layout of this rank's experts over
          all ranks' tokens in pass order (own tokens first) -> the copy engines pull the other
          ranks' x on a side stream while GEMM1 (gathering rows, SwiGLU epilogue) works pass by
          pass, its tiles of pass s waiting on that pass's arrival flag -> GEMM2 on the other
          ranks' rows -> their tokens summed over this rank's experts, and the copy engines
          write those sums into their owners' buffers while GEMM2 works on this rank's own rows
          -> one combine sums this rank's tokens over its own experts plus what the others sent
          (waiting for their flags on the GPU).
Backward: stage dy -> barrier -> the copy engines pull the other ranks' dy while dA's GEMM
          (gathering rows) works pass by pass on the same arrival flags -> the single-GPU
          backward's steps (dl1's GEMM on a side stream beside dx's), dx's GEMM sending the
          other ranks' dx sums (and routing-weight gradients) the same way as the forward's GEMM2.
Weight gradients stay with the expert's rank; dx and dtopk_weights return to the token's. No
NCCL, no host synchronisation, one barrier per exchange. The exchange itself: exchange.py.
With fp8 the expert GEMMs run in blockwise FP8 and x and dy travel quantized per 1 x 128
(`pull_fp8_tokens`); results travel back in bf16.
"""
from __future__ import annotations

import torch

from .._kernels import (DIM_MULTIPLE, FP8_DIM_MULTIPLE, Fp8Rows, MegaMoEHandle, RoutingLayout, build_routing_layout,
                        check_bool, check_expert_ids, check_moe_inputs, fp8_dgrad_weights, fp8_quantize_rows,
                        fp8_weights, gate_up_swiglu, kept_dgrad_weights, m_grouped_bf16_gemm_nn_contiguous,
                        m_grouped_bf16_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_contiguous, moe_gather_rows_bf16,
                        quant_kernels)

from ..backward import (SideStream, dl1_gemm, routing_weight_grad, swiglu_backward_and_dl2, weight_grads)
from .exchange import (BACKWARD, FP8, announce_call, check_calls, exchange_token_counts, gather_partials,
                       gemm_other_ranks_first, pull_fp8_tokens, pull_tokens, send_partials, stage_fp8_tokens)
from .fp8_steps import fp8_dgrad_and_dl2, fp8_gate_up_swiglu
from .symm import SymmBuffer


def _stage(region: torch.Tensor, t: torch.Tensor) -> None:
    if t.data_ptr() != region.data_ptr():  # the caller may have staged it already
        region[:t.shape[0]].copy_(t)


class _NvlinkMegaMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, l1, l2, buffer: SymmBuffer, fp8: bool):
        with buffer.exchange():
            num_tokens, num_topk = topk_idx.shape
            me, world, num_local, max_tokens = buffer.rank, buffer.world, buffer.num_local_experts, buffer.max_tokens
            # In FP8 each rank quantizes its tokens once and the others pull them quantized.
            x_fp8 = fp8_quantize_rows(x) if fp8 else None
            if fp8:  # (the weights' copies before the barrier: GEMM1 then follows the pulls' start at once)
                stage_fp8_tokens(x_fp8, buffer, "x")
                weights_fp8 = fp8_weights(l1), fp8_weights(l2)
            for name, t in ((("x", x),) if not fp8 else ()) + (("topk_idx", topk_idx),
                                                                ("topk_weights", topk_weights.to(torch.float32))):
                _stage(buffer.local[name], t)
            source_tokens = exchange_token_counts(buffer, num_tokens, fp8)
            check_calls(buffer)

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
            keys = torch.where(mine, expert * world + pass_ids, -1).view(-1, num_topk)
            runs = build_routing_layout(keys, local_weights, num_local * world)
            layout = RoutingLayout(runs.offsets[::world].contiguous(), runs.row_token, runs.row_weight, runs.slot_row,
                                   runs.slot_valid)
            if fp8:
                recv_x, arrival = pull_fp8_tokens(x_fp8, buffer, "x", runs.offsets)
                h, act, gemm2, l2_operand = fp8_gate_up_swiglu(recv_x, *weights_fp8, runs.offsets, layout, arrival)
            else:
                recv_x, arrival = pull_tokens(x, buffer, "x", runs.offsets)
                try:  # GEMM1 gathers x's rows pass by pass as they land
                    h, act = gate_up_swiglu(recv_x, l1, runs.offsets, layout.row_token, num_passes=world,
                                            ready_flags=arrival.ready_flags)
                finally:  # (also when it raised: the copies write into recv_x)
                    arrival.join()
                gemm2, l2_operand = m_grouped_bf16_gemm_nt_contiguous, l2
            rows = x.new_empty(layout.num_slots, x.shape[1])
            gemm_other_ranks_first(gemm2, act, l2_operand, rows, arrival,
                                   lambda rows: send_partials(rows, layout, local_weights, buffer))
            del act
            y = gather_partials(rows, layout, local_weights, buffer, x.new_empty(x.shape))
            del rows
            ctx.buffer, ctx.weights_dtype, ctx.fp8 = buffer, topk_weights.dtype, fp8
            # (FP8: the data gradients multiply by the forward's weight copies, quantized once a step)
            ctx.dgrad_weights = kept_dgrad_weights(*weights_fp8) if fp8 else None
            saved_x = (recv_x.data, recv_x.scales) if fp8 else (recv_x,)
            ctx.save_for_backward(l1, l2, h, runs.offsets, layout.offsets, layout.row_token, layout.row_weight,
                                  layout.slot_row, layout.slot_valid, *saved_x)
            return y

    @staticmethod
    def backward(ctx, dy):
        l1, l2, h, run_offsets, offsets, row_token, row_weight, slot_row, slot_valid, *saved_x = ctx.saved_tensors
        buffer: SymmBuffer = ctx.buffer
        world, max_tokens = buffer.world, buffer.max_tokens
        num_tokens, num_topk = dy.shape[0], slot_row.shape[1]
        with buffer.exchange():
            dy = dy.contiguous()
            dy_fp8 = fp8_quantize_rows(dy) if ctx.fp8 else None
            if ctx.fp8:
                stage_fp8_tokens(dy_fp8, buffer, "dy")
            else:
                _stage(buffer.local["dy"], dy)  # the last pulls of this region ended before their exchange's end
            announce_call(buffer, BACKWARD + (FP8 if ctx.fp8 else 0))  # (no barrier before: see exchange_token_counts)
            buffer.barrier()
            check_calls(buffer)
            layout = RoutingLayout(offsets, row_token, row_weight, slot_row, slot_valid)
            grads = weight_grads(l1, l2, l1.dtype)
            if ctx.fp8:
                recv_x = Fp8Rows(*saved_x)
                recv_dy, arrival = pull_fp8_tokens(dy_fp8, buffer, "dy", run_offsets)
                kept1, kept2 = ctx.dgrad_weights or (None, None)  # (None: Fp8WeightCopies.PER_GEMM)
                dz, row_dw, dl1_gemm_fp8 = fp8_dgrad_and_dl2(recv_dy, recv_x, h, fp8_dgrad_weights(l2, kept2), layout,
                                                             arrival, grads)
                l1_operand = fp8_dgrad_weights(l1, kept1)
                dx_gemm, dz_operand = m_grouped_fp8_gemm_nt_contiguous, dz
            else:
                (recv_x,) = saved_x
                recv_dy, arrival = pull_tokens(dy, buffer, "dy", run_offsets)
                d_act = recv_dy.new_empty(layout.num_slots, l2.shape[2])
                try:  # dA's GEMM gathers dy's rows pass by pass as they land
                    m_grouped_bf16_gemm_nn_contiguous(recv_dy, l2, d_act, run_offsets, a_row_index=row_token,
                                                      num_passes=world, ready_flags=arrival.ready_flags)
                finally:
                    arrival.join()
                dy_rows = moe_gather_rows_bf16(recv_dy, layout)  # dl2's operand
                dz, row_dw = swiglu_backward_and_dl2(MegaMoEHandle(layout, recv_x, h), dy_rows, d_act, grads,
                                                     keep_handle=False)
                del dy_rows, d_act
                dx_gemm, dz_operand, l1_operand = m_grouped_bf16_gemm_nn_contiguous, dz, l1
            del h
            d_recv_weights = routing_weight_grad(row_dw, layout)
            dx_rows = dy.new_empty(layout.num_slots, l1.shape[2])
            grads.get_dl1()  # (on this stream, which returns it; its GEMM runs on the side stream)
            with SideStream(dy.device) as side:
                def send(rows: torch.Tensor) -> None:
                    send_partials(rows, layout, None, buffer, dw=d_recv_weights)
                    # Queued after the sends' combine, which would otherwise wait for dl1's GEMM.
                    side.run(dl1_gemm_fp8 if ctx.fp8 else lambda: dl1_gemm(dz, recv_x, layout, grads))

                gemm_other_ranks_first(dx_gemm, dz_operand, l1_operand, dx_rows, arrival, send)
                dx = gather_partials(dx_rows, layout, None, buffer, dy.new_empty(dy.shape))
            del dx_rows
            # Each slot's gradient comes from the rank holding its expert; the others' are zeros.
            dtopk_weights = d_recv_weights[:num_tokens]
            if world > 1:
                from_others = buffer.local["back_dw"].view(world - 1, max_tokens, num_topk)[:, :num_tokens]
                dtopk_weights = dtopk_weights + from_others.sum(0)
            return dx, None, dtopk_weights.to(ctx.weights_dtype), grads.get_dl1(), grads.get_dl2(), None, None


def fp8_exchange_fits(buffer: SymmBuffer, num_local_experts: int, inter: int) -> bool:
    """Whether the FP8 path takes a layer on `buffer`: its backward quantizes all
    ``world * max_tokens * K`` routed rows of ``max(H, 2I)`` in one pass (32-bit element counts),
    over at most MAX_GROUPS local experts."""
    rows = buffer.world * buffer.max_tokens * buffer.num_topk
    return quant_kernels.quantization_fits(rows, max(buffer.hidden, 2 * inter), num_local_experts)


def ep_mega_moe_nvlink(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                       l2: torch.Tensor, buffer: SymmBuffer, *, fp8: bool = False) -> torch.Tensor:
    """This rank's ``y [T, H]`` of an MoE layer whose experts are spread over the buffer's
    group, exchanging tokens through `buffer` (`megamoe_bwd.ep.get_symm_buffer_for_mega_moe`).
    Differentiable: gradients reach x and topk_weights (on this rank) and this rank's l1, l2.

    Args:
        x: ``[T, H]`` bf16, this rank's tokens (T <= the buffer's max tokens; may differ between
            ranks, or be 0).
        topk_idx: ``[T, K]`` int64 *global* expert ids, ``-1`` = empty slot.
        topk_weights: ``[T, K]`` float.
        l1: ``[E_local, 2I, H]``, l2 ``[E_local, H, I]`` bf16: this rank's experts, global ids
            ``rank * E_local + j``.
        fp8: the expert GEMMs in blockwise FP8 (`deep_gemm.fp8_mega_moe`'s recipe; H and I
            multiples of 128), and the exchange moves tokens quantized per 1 x 128: x in the
            forward, dy in the backward, about half the bf16 bytes. The weight gradients' column
            copies are then made from those FP8 rows dequantized, the only copy of the other
            ranks' tokens here (docs/DESIGN.md, "The FP8 layer"). An x staged in the buffer's
            region by the caller is overwritten there by its quantized rows.

    Collective: every rank of the group calls it for the same layer, in the same order.
    Expert ids outside ``[-1, E)`` fail an asynchronous device assert (a ValueError on the CPU).
    """
    check_bool(fp8=fp8)
    num_tokens, hidden, inter, num_local, num_topk = check_moe_inputs(x, topk_idx, topk_weights, l1, l2,
                                                                      FP8_DIM_MULTIPLE if fp8 else DIM_MULTIPLE)
    if not isinstance(buffer, SymmBuffer):
        raise TypeError(f"buffer must be a SymmBuffer (get_symm_buffer_for_mega_moe), got {type(buffer).__name__}")
    if x.device != buffer.local["x"].device:
        raise ValueError(f"the inputs are on {x.device}, the buffer on {buffer.local['x'].device}")
    buffer.check_fits(num_tokens, num_topk, hidden)
    if num_local != buffer.num_local_experts:
        raise ValueError(f"l1 holds {num_local} experts; the buffer splits {buffer.num_experts} experts over "
                         f"{buffer.world} ranks ({buffer.num_local_experts} each)")
    if fp8 and not fp8_exchange_fits(buffer, num_local, inter):
        raise ValueError(f"fp8: the backward quantizes [world * max tokens * K, max(H, 2I)] = [{buffer.world} * "
                         f"{buffer.max_tokens} * {num_topk}, {max(hidden, 2 * inter)}] in one pass, which takes fewer "
                         f"than 2^31 elements, and at most {quant_kernels.MAX_GROUPS} local experts")
    check_expert_ids(topk_idx, buffer.num_experts, sync=not x.is_cuda)
    return _NvlinkMegaMoE.apply(x.contiguous(), topk_idx, topk_weights, l1, l2, buffer, fp8)
