"""Mega MoE backward on one GPU, bf16.

dA = dy[rows] @ l2[e] (m-grouped nn) -> one pass for the SwiGLU backward, the weighted
activation w * a and the routing-weight gradient <dA, a> (or all three in that GEMM's epilogue,
FUSED_SWIGLU_BWD) -> dl2 = dy[rows]^T @ (w * a) (k-grouped) -> dx rows = dz @ l1[e]
(m-grouped nn) -> combine over the K slots, with dl1 = dz^T @ x[rows] (k-grouped) on a side
stream beside the last two. Token rows of dy and x
are copied to routed order first, or gathered by the GEMMs' loads (GATHER_ROWS["backward"]).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

import torch

from deep_gemm.gemm import (k_grouped_bf16_gemm_tn_contiguous, m_grouped_bf16_gemm_nn_contiguous,
                            m_grouped_bf16_gemm_nn_swiglu_bwd_contiguous)
from deep_gemm.moe import forward as moe_forward_module
from deep_gemm.moe.forward import MegaMoEHandle, RowArrival
from deep_gemm.moe.layout import RoutingLayout
from deep_gemm.moe.glue import moe_combine_bf16, moe_swiglu_bwd_bf16


def _weight_grad_output(out: Optional[torch.Tensor], shape: tuple[int, int, int], dtype: torch.dtype,
                        device: torch.device) -> tuple[torch.Tensor, bool]:
    """(the tensor to write, whether to accumulate into it)."""
    if out is None:
        return torch.empty(shape, device=device, dtype=dtype), False
    if tuple(out.shape) != shape or out.device != device:
        raise ValueError(f"weight-gradient output must have shape {shape} on {device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out, True


# The SwiGLU backward and the routing-weight gradient in the epilogue of dA's GEMM (True), from
# its fp32 accumulators, or in a separate pass over dA stored in bf16 (False). Measured on an
# H200 (bwd ms, fused / separate, docs/PERF.md session 4): 30B 5.07 / 5.09 uniform, 5.39 / 5.24
# skewed; 235B 18.75 / 18.29 uniform, 19.44 / 19.43 skewed. The epilogue's loads of h and its
# three outputs are not hidden behind MMAs (one tile at a time per CTA), while the pass runs at
# HBM bandwidth; so the pass is the default.
FUSED_SWIGLU_BWD = False

_side_streams: dict = {}


def _side_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    if device.type != "cuda":
        return None
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def mega_moe_backward(dy: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, handle: MegaMoEHandle, *,
                      weight_grad_dtype: torch.dtype = torch.float32, dl1: Optional[torch.Tensor] = None,
                      dl2: Optional[torch.Tensor] = None, keep_handle: bool = False,
                      combine_dx: Optional[Callable[[torch.Tensor, RoutingLayout, torch.Tensor],
                                                    Optional[torch.Tensor]]] = None,
                      dy_arrival: Optional[RowArrival] = None,
                      send_dx_early: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None
                      ) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `deep_gemm.bf16_mega_moe` given ``dy = dL/dy``.

    Args:
        dy: ``[T, H]`` bf16.
        l1, l2: the forward's weights (``[E, 2I, H]``, ``[E, H, I]`` bf16).
        handle: from ``bf16_mega_moe(..., training=True)``.
        weight_grad_dtype: float32 (default) or bfloat16 for new dl1/dl2.
        dl1, dl2: optional existing gradients (fp32 or bf16) to accumulate into, in place.
        combine_dx: for expert parallelism: called with dx's routed rows ``[T * K, H]``, the
            layout and dtopk_weights in place of the local sum over slots, while dl1's GEMM may
            still run on a side stream (so an asynchronous exchange it starts overlaps that GEMM);
            what it returns is returned as dx.
        dy_arrival: for expert parallelism: dy's rows are still landing (see
            `deep_gemm.moe.forward.RowArrival`); dA's GEMM reads each pass once it has landed.
        send_dx_early: for expert parallelism, with `dy_arrival` in S > 1 passes: dx's GEMM
            computes the rows of passes 1..S-1 (other ranks' tokens) first and calls
            ``send_dx_early(dx_rows, dtopk_weights)``, so that what it starts overlaps the GEMM's
            work on pass 0; `combine_dx` follows.
        keep_handle: by default the handle is consumed: its ``h`` is overwritten by its own
            gradient (2I bf16 per routed slot less peak memory; h's autograd version is bumped,
            so a saved copy of it cannot be reused silently) and a second backward with it
            raises. True keeps it usable, at that memory cost.

    Returns:
        ``(dx [T, H] bf16, dtopk_weights [T, K] fp32 (0 on empty slots), dl1 [E, 2I, H],
        dl2 [E, H, I])``.
    """
    x, layout, h = handle.x, handle.layout, handle.h
    if h is None:
        raise ValueError("this handle was consumed by an earlier mega_moe_backward (pass keep_handle=True to reuse one)")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = l1.shape
    if dy.dtype != x.dtype or tuple(dy.shape) != (num_tokens, hidden) or dy.device != x.device:
        raise ValueError(f"dy must be a {x.dtype} [{num_tokens}, {hidden}] tensor on {x.device}")
    if weight_grad_dtype not in (torch.float32, torch.bfloat16) and x.is_cuda:
        raise TypeError(f"weight_grad_dtype must be float32 or bfloat16, got {weight_grad_dtype}")
    if dy_arrival is not None and not dy.is_contiguous():  # a copy would read rows still landing
        raise ValueError("dy must be contiguous when its rows are still arriving (dy_arrival)")
    dy, x = dy.contiguous(), x.contiguous()  # row gathers index them as dense rows
    offsets = layout.offsets
    l1_shape, l2_shape = (num_experts, two_inter, hidden), (num_experts, hidden, two_inter // 2)

    dl1, accumulate_dl1 = _weight_grad_output(dl1, l1_shape, weight_grad_dtype, x.device)
    dl2, accumulate_dl2 = _weight_grad_output(dl2, l2_shape, weight_grad_dtype, x.device)
    # The current stream waits for the side stream before returning, so no memory is reused
    # while the side stream reads it (what the side stream allocates comes from its own pool).
    side = _side_stream(x.device)
    on_side = torch.cuda.stream(side) if side is not None else nullcontext()

    gather = moe_forward_module.GATHER_ROWS["backward"]
    h_dense = h.contiguous()
    act_weighted = dy.new_empty(layout.num_slots, l2.shape[2])
    overlap = dy_arrival is not None and dy_arrival.ready_flags is not None and not FUSED_SWIGLU_BWD
    if overlap:  # dA's GEMM gathers dy's rows pass by pass as they land; dl2's reads them after
        m_grouped_bf16_gemm_nn_contiguous(dy, l2, act_weighted, dy_arrival.run_offsets, a_row_index=layout.row_token,
                                          num_passes=dy_arrival.num_passes, ready_flags=dy_arrival.ready_flags)
    if dy_arrival is not None:  # every row has landed before anything else reads dy
        dy_arrival.join()
    dy_rows, dy_index = moe_forward_module.routed_rows(dy, layout, gather)
    if FUSED_SWIGLU_BWD:  # dA = dy @ l2[e] stays in registers
        dz = h_dense.clone() if keep_handle else h_dense
        row_dw = m_grouped_bf16_gemm_nn_swiglu_bwd_contiguous(dy_rows, l2, act_weighted, dz, layout.row_weight,
                                                              offsets, a_row_index=dy_index)
    else:  # dA stored (in act_weighted's memory, which the pass then overwrites)
        if not overlap:
            m_grouped_bf16_gemm_nn_contiguous(dy_rows, l2, act_weighted, offsets, a_row_index=dy_index)
        dz, act_weighted, row_dw = moe_swiglu_bwd_bf16(h_dense, act_weighted, layout,
                                                       dz=None if keep_handle else h_dense, act_weighted=act_weighted)
    if not keep_handle:  # dz was written over h (an invalid argument above leaves the handle intact)
        handle.h = None
        torch.autograd.graph.increment_version(h)
    del h, h_dense

    # dl2[e] = dy_e^T @ (w * act)_e first, on this stream, so that its operands are freed before
    # dx's rows are allocated (measured peak with both alive: 0.4 GB above the baseline's at 30B).
    k_grouped_bf16_gemm_tn_contiguous(dy_rows, act_weighted, dl2, offsets, accumulate=accumulate_dl2,
                                      a_row_index=dy_index)
    del dy_rows, act_weighted

    # dl1 beside the dx chain: measured faster (30B 8.03 vs 8.20 ms, 235B 28.55 vs 29.33 ms
    # fwd+bwd) than after it at the same peak memory, and faster than gathering x in its loads.
    def dl1_on_side() -> None:  # dl1[e] = dz_e^T @ x_e
        with on_side:
            x_rows, x_index = moe_forward_module.routed_rows(x, layout, gather)  # a copy overlaps the dx GEMM
            k_grouped_bf16_gemm_tn_contiguous(dz, x_rows, dl1, offsets, accumulate=accumulate_dl1, b_row_index=x_index)

    if side is not None:
        side.wait_stream(torch.cuda.current_stream(x.device))
    try:
        dtopk_weights = torch.where(layout.slot_valid, row_dw.index_select(0, layout.slot_row.flatten())
                                    .view_as(layout.slot_row), 0.0)
        dxs = torch.empty(layout.num_slots, hidden, device=dy.device, dtype=dy.dtype)
        if send_dx_early is not None and dy_arrival is not None and dy_arrival.num_passes > 1:  # dz @ l1[e]
            def send(rows: torch.Tensor) -> None:
                send_dx_early(rows, dtopk_weights)
                dl1_on_side()  # queued after the sends' combine, which would otherwise wait for dl1's GEMM

            moe_forward_module.gemm_other_ranks_first(m_grouped_bf16_gemm_nn_contiguous, dz, l1, dxs, dy_arrival,
                                                      send)
        else:
            dl1_on_side()
            m_grouped_bf16_gemm_nn_contiguous(dz, l1, dxs, offsets)
        if combine_dx is None:
            dx = moe_combine_bf16(dxs, layout, None, torch.empty_like(dy))
        else:
            dx = combine_dx(dxs, layout, dtopk_weights)
        del dxs
    finally:  # join even on an error, before the side stream's inputs can be freed
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
    return dx, dtopk_weights, dl1, dl2
