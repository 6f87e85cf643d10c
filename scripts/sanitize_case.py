"""A small run of every kernel variant (the grouped GEMMs with and without row gathers, in
passes, the MoE layer forward and backward, the wait for other GPUs' partial sums and the
combine that adds them, the FP8 quantization and GEMMs, the FP8 layer) for compute-sanitizer memcheck and racecheck:

    compute-sanitizer --tool memcheck python scripts/sanitize_case.py

Needs a Hopper GPU.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from bench_common import require_sm90  # noqa: E402
from deep_gemm.gemm import k_grouped_bf16, m_grouped_bf16  # noqa: E402
from deep_gemm.moe import build_routing_layout  # noqa: E402
from deep_gemm.moe.kernels import ep_wait_flags, moe_combine_bf16  # noqa: E402
from deep_gemm.moe.kernels_fp8 import moe_swiglu_bwd_fp8  # noqa: E402
from deep_gemm.quant import empty_fp8_rows, fp8_quantize_columns, fp8_quantize_rows, fp8_quantize_weights  # noqa: E402
from deep_gemm.testing import offsets_from_sizes  # noqa: E402
from deep_gemm.utils import num_sms_capped  # noqa: E402
from megamoe_bwd import make_moe_inputs, mega_moe_backward  # noqa: E402

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
require_sm90("sanitize_case.py")
sizes = [0, 1, 130, 64, 70]
offsets = offsets_from_sizes(sizes)
rows = sum(sizes)
a = torch.randn(rows, 192, device="cuda", dtype=torch.bfloat16)
index = torch.randint(0, rows, (rows,), device="cuda")
b = torch.randn(len(sizes), 264, 192, device="cuda", dtype=torch.bfloat16)
d = torch.empty(rows, 264, device="cuda", dtype=torch.bfloat16)
for config in m_grouped_bf16.all_configs():
    for row_index in (None, index):
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, offsets, a_row_index=row_index, config=config)
        deep_gemm.m_grouped_bf16_gemm_nn_contiguous(a, b.view(len(sizes), 192, 264), d, offsets,
                                                    a_row_index=row_index, config=config)
b_swiglu = torch.randn(len(sizes), 256, 192, device="cuda", dtype=torch.bfloat16)  # 2I = 256
h, act = torch.empty(rows, 256, device="cuda", dtype=torch.bfloat16), torch.empty(rows, 128, device="cuda", dtype=torch.bfloat16)
for row_index in (None, index):
    deep_gemm.m_grouped_bf16_gemm_nt_swiglu_contiguous(a, b_swiglu, h, act, offsets, a_row_index=row_index)
# The same rows as runs (group, pass) of 5 groups x 2 passes, flags already set (nothing to wait for).
flags = torch.ones(2, dtype=torch.int32, device="cuda")
run_offsets = offsets_from_sizes([0, 0, 1, 0, 60, 70, 30, 34, 0, 70])
deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, run_offsets, a_row_index=index, num_passes=2, ready_flags=flags)
for pass_range in ((1, 2), (0, 1)):  # one pass per launch
    deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, run_offsets, num_passes=2, pass_range=pass_range)
for dtype in (torch.float32, torch.bfloat16):
    w = torch.zeros(len(sizes), 192, 264, device="cuda", dtype=dtype)
    for config in k_grouped_bf16.all_configs(dtype):
        for accumulate in (False, True):
            deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, d, w, offsets, accumulate=accumulate, config=config)

p = make_moe_inputs(100, 256, 128, 8, 4, device="cuda", empty_slot_frac=0.2)
y, handle = deep_gemm.bf16_mega_moe(p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"], training=True)
mega_moe_backward(p["dy"], p["l1"], p["l2"], handle)
p = make_moe_inputs(100, 256, 64, 8, 4, device="cuda", empty_slot_frac=0.2)  # I = 64: SwiGLU after GEMM1
y, handle = deep_gemm.bf16_mega_moe(p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"], training=True)
mega_moe_backward(p["dy"], p["l1"], p["l2"], handle, weight_grad_dtype=torch.bfloat16)
# The end of an exchange: the wait for other GPUs' flags (set already here), then the combine
# adding their partial sums.
ep_wait_flags(flags, flags.clone(), 1000)
layout = build_routing_layout(p["topk_idx"], p["topk_weights"], 8)
moe_combine_bf16(torch.randn(400, 256, device="cuda", dtype=torch.bfloat16), layout, p["topk_weights"],
                 torch.empty(100, 256, device="cuda", dtype=torch.bfloat16),
                 addend=torch.randn(2, 120, 256, device="cuda", dtype=torch.bfloat16))
# FP8 quantization (ragged, empty and one-row groups, both scale rules) and the FP8 GEMMs.
x8 = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
for pow2 in (False, True):
    fp8_quantize_rows(x8, power_of_two_scales=pow2)
    fp8_quantize_columns(x8, offsets, with_rows=True, power_of_two_scales=pow2)
    fp8_quantize_weights(torch.randn(3, 256, 384, device="cuda", dtype=torch.bfloat16), power_of_two_scales=pow2)
a8 = fp8_quantize_rows(x8)
w8 = fp8_quantize_weights(torch.randn(len(sizes), 384, 256, device="cuda", dtype=torch.bfloat16))
d8 = torch.empty(rows, 384, device="cuda", dtype=torch.bfloat16)
for row_index in (None, index):
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a8.data, a8.scales), (w8.data, w8.scales), d8, offsets,
                                               a_row_index=row_index)
# FP8 GEMM1's forms: SwiGLU with act in bf16 and in e4m3, rows by TMA and gathered; then passes
# with their flags (already set) and one pass per launch, as the NVLink exchange runs them.
w8_swiglu = fp8_quantize_weights(torch.randn(len(sizes), 256, 256, device="cuda", dtype=torch.bfloat16))  # 2I = 256
h8 = torch.empty(rows, 256, device="cuda", dtype=torch.bfloat16)
act8 = empty_fp8_rows(rows, 128, "cuda")
for row_index in (None, index):
    for act in (torch.empty(rows, 128, device="cuda", dtype=torch.bfloat16), (act8.data, act8.scales)):
        deep_gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous((a8.data, a8.scales), (w8_swiglu.data, w8_swiglu.scales),
                                                          h8, act, offsets, a_row_index=row_index)
ready = torch.ones(2, dtype=torch.int32, device="cuda")  # (ep_wait_flags above reset `flags` to zeros)
deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a8.data, a8.scales), (w8.data, w8.scales), d8, run_offsets,
                                           a_row_index=index, num_passes=2, ready_flags=ready)
for pass_range in ((1, 2), (0, 1)):
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a8.data, a8.scales), (w8.data, w8.scales), d8, run_offsets,
                                               num_passes=2, pass_range=pass_range)
# Columns from FP8 rows (dequantized in the loads), gathered or not; the weights in one orientation.
for row_index in (None, index):
    fp8_quantize_columns(a8, offsets, row_index=row_index, with_rows=True)
for which in ("data", "data_t"):
    fp8_quantize_weights(torch.randn(3, 256, 384, device="cuda", dtype=torch.bfloat16), which=which)
dx8 = torch.empty(rows, 256, device="cuda", dtype=torch.bfloat16)
_, c1 = fp8_quantize_columns(torch.randn(rows, 384, device="cuda", dtype=torch.bfloat16), offsets)
for with_rows in (True, False):  # rows gathered in the loads, some out of range
    fp8_quantize_columns(x8[:100], offsets, row_index=index, with_rows=with_rows)
_, c2 = fp8_quantize_columns(x8, offsets)
dy8 = fp8_quantize_rows(d8)  # the data gradient, on the weights' transposed copy
deep_gemm.m_grouped_fp8_gemm_nt_contiguous((dy8.data, dy8.scales), w8.transposed_operand(), dx8, offsets)
for dtype in (torch.float32, torch.bfloat16):
    for accumulate in (False, True):
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous((c1.data, c1.scales), (c2.data, c2.scales),
                                                   torch.zeros(len(sizes), 384, 256, device="cuda", dtype=dtype),
                                                   c1.padded_offsets, accumulate=accumulate)
# One CTA walks every tile: the weights' and the rows' quantization, and the weight gradient (its
# next tile found during the current one's first MMAs).
with num_sms_capped(1):
    fp8_quantize_weights(torch.randn(3, 256, 384, device="cuda", dtype=torch.bfloat16))
    fp8_quantize_rows(d8)
    fp8_quantize_columns(x8, offsets)  # (the activations' kernel walking every tile)
    deep_gemm.k_grouped_fp8_gemm_tn_contiguous((c1.data, c1.scales), (c2.data, c2.scales),
                                               torch.zeros(len(sizes), 384, 256, device="cuda"), c1.padded_offsets)
# The FP8 layer, forward and backward.
p = make_moe_inputs(100, 256, 128, 8, 4, device="cuda", empty_slot_frac=0.2)
y, handle = deep_gemm.fp8_mega_moe(p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"], training=True)
mega_moe_backward(p["dy"], p["l1"], p["l2"], handle)
with num_sms_capped(1):  # one CTA a kernel: each GEMM epilogue runs beside the next tile's first product
    deep_gemm.fp8_mega_moe(p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"])
# The FP8 SwiGLU backward over three column blocks (I = 384; the layer above has one), one CTA a
# block and one CTA walking every block.
p = make_moe_inputs(100, 128, 384, 8, 4, device="cuda", empty_slot_frac=0.2)
layout = build_routing_layout(p["topk_idx"], p["topk_weights"], 8)
h_bwd = torch.randn(layout.num_slots, 2 * 384, device="cuda", dtype=torch.bfloat16)
d_act_bwd = torch.randn(layout.num_slots, 384, device="cuda", dtype=torch.bfloat16)
moe_swiglu_bwd_fp8(h_bwd, d_act_bwd, layout)
with num_sms_capped(1):
    moe_swiglu_bwd_fp8(h_bwd, d_act_bwd, layout)
torch.cuda.synchronize()
print("sanitize case done")
