"""The FP8 layer's steps on exchanged token rows, shared by the expert-parallel paths that move
tokens quantized (`nvlink.py`'s pulls, `deepep.py`'s dispatches): GEMM1 on the rows as they land,
and the backward up to dx's GEMM. `arrival` is the rows' `RowArrival` (`exchange.landed` for rows
that have all arrived)."""
from __future__ import annotations

import torch

from .._kernels import (Fp8Rows, MegaMoEHandle, RoutingLayout, empty_fp8_rows, fp8_quantize_columns,
                        m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_swiglu_contiguous)
from ..backward import fp8_data_gradient, fp8_dl1_gemm, fp8_swiglu_backward_and_dl2


def fp8_gate_up_swiglu(recv_x: Fp8Rows, w1, w2, run_offsets: torch.Tensor, layout: RoutingLayout, arrival):
    """The FP8 forward's GEMM1 on the landing rows (gathered pass by pass; SwiGLU and the
    activation's per-row quantization in its epilogue, as on one GPU; w1, w2 the weights' FP8
    copies); returns h, act's FP8 operand, GEMM2 and its B."""
    h = recv_x.data.new_empty(layout.num_slots, w1.data.shape[1], dtype=torch.bfloat16)
    act = empty_fp8_rows(layout.num_slots, w1.data.shape[1] // 2, h.device)
    try:
        m_grouped_fp8_gemm_nt_swiglu_contiguous((recv_x.data, recv_x.scales), (w1.data, w1.scales), h,
                                                (act.data, act.scales), run_offsets, a_row_index=layout.row_token,
                                                num_passes=arrival.num_passes, ready_flags=arrival.ready_flags)
    finally:  # (also when it raised: the copies write into recv_x)
        arrival.join()
    return h, (act.data, act.scales), m_grouped_fp8_gemm_nt_contiguous, (w2.data, w2.scales)


def fp8_dgrad_and_dl2(recv_dy: Fp8Rows, recv_x: Fp8Rows, h: torch.Tensor, l2_t: tuple[torch.Tensor, torch.Tensor],
                      layout: RoutingLayout, arrival, grads):
    """The FP8 backward up to dx's GEMM: dA's GEMM on the landing dy rows (`l2_t`: the forward's
    copy of l2 as `Fp8Weights.transposed_operand()` gives it), then the single-GPU steps (the
    SwiGLU backward writing dz quantized, dl2); returns (dz's FP8 rows, row_dw, dl1's GEMM to run
    beside dx's)."""
    d_act = h.new_empty(layout.num_slots, l2_t[0].shape[1])
    try:  # dA's GEMM gathers dy's rows pass by pass as they land
        fp8_data_gradient(recv_dy, l2_t, d_act, arrival.run_offsets, a_row_index=layout.row_token,
                          num_passes=arrival.num_passes, ready_flags=arrival.ready_flags)
    finally:
        arrival.join()
    # (the weight gradients' column copies from the exchanged FP8 rows, dequantized in the loads:
    # the only copy of the other ranks' tokens here, docs/DESIGN.md "The FP8 layer")
    _, dy_cols = fp8_quantize_columns(recv_dy, layout.offsets, row_index=layout.row_token)
    dz_rows, dz_cols, row_dw = fp8_swiglu_backward_and_dl2(MegaMoEHandle(layout, recv_x, h), d_act, dy_cols, grads,
                                                           keep_handle=False)
    return (dz_rows.data, dz_rows.scales), row_dw, lambda: fp8_dl1_gemm(dz_cols, recv_x, layout, grads)
