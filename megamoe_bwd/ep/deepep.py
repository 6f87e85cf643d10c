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
beside the weight gradient of l1, which runs on a side stream in bf16 (the steps of
megamoe_bwd.backward) and after the combine's launch in FP8. The other exchanges have nothing to
overlap with: every expert kernel needs the dispatched tokens, and the forward's combine is its
last step. DeepEP reads the number of received tokens on the host (one sync per dispatch).

With fp8 the expert GEMMs run in blockwise FP8 (`deep_gemm.fp8_mega_moe`'s recipe) and x and dy
are dispatched quantized: e4m3 rows with their 1 x 128 scales, DeepEP's FP8 dispatch (H + H / 32
bytes a token against bf16's 2H). The received rows feed the FP8 steps the NVLink path runs
(`fp8_steps.py`), the weight gradients' column copies made from them dequantized, as there;
results and gradients travel back in bf16 (they are sums). Before its dispatch an FP8 forward
all-reduces the token counts each rank sends (one small collective and host read), so that every
rank checks every rank's received rows against the backward's quantization limit.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._kernels import (DIM_MULTIPLE, FP8_DIM_MULTIPLE, Fp8Rows, RoutingLayout, bf16_mega_moe, build_routing_layout,
                        check_bool, check_expert_ids, check_moe_inputs, fp8_dgrad_weights, fp8_quantize_rows,
                        fp8_weights, kept_dgrad_weights, m_grouped_fp8_gemm_nt_contiguous, moe_combine_bf16,
                        quant_kernels)

from ..backward import backward_to_dz, dx_rows_beside_dl1, routing_weight_grad, weight_grads
from .exchange import landed
from .fp8_steps import fp8_dgrad_and_dl2, fp8_gate_up_swiglu


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


def _received_fp8_rows(received: tuple[torch.Tensor, torch.Tensor]) -> Fp8Rows:
    """DeepEP's received FP8 rows (its scales row-major) as the FP8 GEMMs read them (scales
    column-major, a 16-byte aligned column stride)."""
    data, scales = received
    return Fp8Rows(data, quant_kernels.empty_row_scales(*data.shape, data.device).copy_(scales))


def _check_received_rows_fit(tokens_per_rank: torch.Tensor, buffer: Any, num_topk: int, width: int) -> None:
    """Before any exchange, on every rank alike: the backward quantizes each rank's received
    ``[R * K, width]`` routed rows in one pass (32-bit element counts). One all-reduce of the
    tokens each rank sends to each rank gives every rank R of all of them, so all raise or none
    (a rank raising alone would leave the others waiting in an exchange)."""
    received = tokens_per_rank.to(torch.int64)
    dist.all_reduce(received, group=buffer.group)
    most = int(received.max())
    if not quant_kernels.quantization_fits(most * num_topk, width):
        raise ValueError(f"fp8: a rank would receive {most} tokens, whose {most * num_topk} routed rows of "
                         f"{width} the backward quantizes in one pass: that takes fewer than 2^31 elements")


class _DeepEPMegaMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, l1, l2, buffer, num_experts: int, fp8: bool):
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        if fp8:
            _check_received_rows_fit(per_rank, buffer, topk_idx.shape[1], max(x.shape[1], l1.shape[1]))
        x_fp8 = fp8_quantize_rows(x) if fp8 else None
        recv_x, recv_idx, recv_weights, _, handle, _ = buffer.dispatch(
            (x_fp8.data, x_fp8.scales) if fp8 else x, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights.to(torch.float32))
        ctx.buffer, ctx.handle, ctx.weights_dtype, ctx.fp8 = buffer, handle, topk_weights.dtype, fp8
        if fp8:
            y_recv = _fp8_forward(ctx, _received_fp8_rows(recv_x), recv_idx, recv_weights, l1, l2)
        else:
            y_recv, ctx.moe_handle = bf16_mega_moe(recv_x, recv_idx, recv_weights, l1, l2, training=True)
            ctx.save_for_backward(l1, l2)
        y, _, _ = buffer.combine(y_recv, handle)
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.fp8:
            return _fp8_backward(ctx, dy)
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
        return dx, None, dtopk.to(ctx.weights_dtype), grads.get_dl1(), grads.get_dl2(), None, None, None


def _fp8_forward(ctx, recv_x: Fp8Rows, recv_idx: torch.Tensor, recv_weights: torch.Tensor, l1: torch.Tensor,
                 l2: torch.Tensor) -> torch.Tensor:
    """The FP8 layer on the received rows (their experts made local by DeepEP, -1 elsewhere):
    returns their partial outputs ``[R, H]`` bf16 and keeps on `ctx` what the backward needs."""
    layout = build_routing_layout(recv_idx, recv_weights, l1.shape[0])
    w1, w2 = fp8_weights(l1), fp8_weights(l2)
    h, act, gemm2, l2_operand = fp8_gate_up_swiglu(recv_x, w1, w2, layout.offsets, layout, landed(layout.offsets))
    rows = h.new_empty(layout.num_slots, l2.shape[1])
    gemm2(act, l2_operand, rows, layout.offsets)
    del act
    y_recv = moe_combine_bf16(rows, layout, recv_weights, h.new_empty(recv_x.data.shape))
    # (the data gradients multiply by the forward's weight copies, quantized once a step)
    ctx.dgrad_weights = kept_dgrad_weights(w1, w2)
    ctx.save_for_backward(l1, l2, h, recv_x.data, recv_x.scales, layout.offsets, layout.row_token, layout.row_weight,
                          layout.slot_row, layout.slot_valid)
    return y_recv


def _fp8_backward(ctx, dy: torch.Tensor) -> tuple:
    """dy dispatched quantized like x; dA's and dx's GEMMs, the SwiGLU backward and the weight
    gradients in FP8 on the received rows; dx's partial rows and the routing weights' gradients
    combined back in bf16 and fp32."""
    l1, l2, h, x_data, x_scales, *layout_tensors = ctx.saved_tensors
    layout, recv_x = RoutingLayout(*layout_tensors), Fp8Rows(x_data, x_scales)
    dy_fp8 = fp8_quantize_rows(dy.contiguous())
    recv_dy = _received_fp8_rows(ctx.buffer.dispatch((dy_fp8.data, dy_fp8.scales), handle=ctx.handle)[0])
    grads = weight_grads(l1, l2, l1.dtype)
    kept1, kept2 = ctx.dgrad_weights or (None, None)  # (None: Fp8WeightCopies.PER_GEMM)
    dz, row_dw, dl1_gemm = fp8_dgrad_and_dl2(recv_dy, recv_x, h, fp8_dgrad_weights(l2, kept2), layout,
                                             landed(layout.offsets), grads)
    del h
    dx_rows = dy.new_empty(layout.num_slots, l1.shape[2])
    m_grouped_fp8_gemm_nt_contiguous(dz, fp8_dgrad_weights(l1, kept1), dx_rows, layout.offsets)
    d_recv_x = moe_combine_bf16(dx_rows, layout, None, dx_rows.new_empty(recv_dy.data.shape))
    dx, dtopk, event = ctx.buffer.combine(d_recv_x, ctx.handle, topk_weights=routing_weight_grad(row_dw, layout),
                                          async_finish=True)  # (records its tensors' streams)
    dl1_gemm()  # (beside the combine, which runs on DeepEP's stream)
    event.current_stream_wait()
    return dx, None, dtopk.to(ctx.weights_dtype), grads.get_dl1(), grads.get_dl2(), None, None, None


def ep_mega_moe_deep_ep(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                        l2: torch.Tensor, buffer: Any, *, fp8: bool = False) -> torch.Tensor:
    """This rank's ``y [T, H]``, tokens exchanged by DeepEP (`buffer`: a `deep_ep.Buffer` on the
    expert-parallel group, e.g. from `make_deep_ep_buffer`). Same contract as
    `megamoe_bwd.ep.ep_mega_moe_nvlink`: global expert ids, this rank's experts in l1, l2;
    differentiable. `fp8`: the expert GEMMs in blockwise FP8 and x and dy dispatched quantized
    (H and I multiples of 128; parameters, inputs and outputs stay bf16)."""
    check_bool(fp8=fp8)
    num_local = check_moe_inputs(x, topk_idx, topk_weights, l1, l2, FP8_DIM_MULTIPLE if fp8 else DIM_MULTIPLE)[3]
    if fp8 and num_local > quant_kernels.MAX_GROUPS:  # (the column quantization's group scan)
        raise ValueError(f"fp8: at most {quant_kernels.MAX_GROUPS} experts a rank, got {num_local}")
    num_experts = num_local * buffer.group_size
    check_expert_ids(topk_idx, num_experts, sync=not x.is_cuda)  # (DeepEP would route an id past them out of range)
    return _DeepEPMegaMoE.apply(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), l1, l2, buffer,
                                num_experts, fp8)
