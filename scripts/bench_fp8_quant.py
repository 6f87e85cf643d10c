"""FP8 quantization kernels (deep_gemm.quant) at the standard MoE shapes, in GB/s (bytes read plus
bytes written, over the median time), against torch.compile'd PyTorch doing the same
quantization and against an HBM copy of the input (the roofline), measured in one run:
    rows      x [T, H]            -> fp8 [T, H], 1 x 128 scales        (GEMM1's A)
    cols x gather  x [T, H], rows gathered by a routing layout (each expert's tokens in token order)
              -> the transposed copy per 128 x 1 (the FP8 backward's dl1 operand; GB/s counts every
              routed row as read, the bytes a kernel without reuse in L2 moves; torch: the rows of
              the gathered rows)
    rows+cols dy [T * K, H]       -> rows, and the transposed copy per 128 x 1 in E ragged groups
              act [T * K, I]         (the weight gradients' operands; torch: rows only, no transpose)
    weights   l1 [E, 2I, H], l2   -> fp8 in both orientations, 128 x 128 scales; "data" and
              "data_t" rows: one orientation only (`Fp8WeightCopies.PER_GEMM`)
    swiglu bwd h [T * K, 2I], d_act -> the FP8 backward's SwiGLU backward with its outputs quantized
              (deep_gemm.moe.kernels_fp8: dz rows and columns, w * act columns; "torch" here is
              the unfused chain, our bf16 SwiGLU backward and two column quantizations)
Times are medians of CUDA-event timings with the L2 flushed before each run. Each kernel is also
checked bit for bit against the PyTorch reference on the same input.

    python scripts/bench_fp8_quant.py [--models 30b,235b,v3] [--routing uniform,skewed]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import MODELS, require_sm90  # noqa: E402
from deep_gemm.moe.kernels import moe_swiglu_bwd_bf16  # noqa: E402
from deep_gemm.moe.kernels_fp8 import moe_swiglu_bwd_fp8  # noqa: E402
from deep_gemm.moe.layout import RoutingLayout, build_routing_layout_torch  # noqa: E402
from deep_gemm.quant import fp8_quantize_columns, fp8_quantize_rows, fp8_quantize_weights, reference  # noqa: E402
from deep_gemm.testing import (bench_ms, offsets_from_sizes, random_group_sizes, same_bits,  # noqa: E402
                              same_written_columns, warm_up_gpu)
from megamoe_bwd import make_moe_inputs  # noqa: E402


def _gbps(num_bytes: int, ms: float) -> float:
    return num_bytes / ms / 1e6


def _rows_bytes(m: int, k: int) -> int:
    return 2 * m * k + m * k + 4 * m * k // 128  # bf16 in, fp8 and fp32 scales out


def cases(model: str, routing: str, gen: torch.Generator):
    """(label, input bytes, our bytes, ours, torch's bytes, torch's, check) for one model and
    routing; the checks compare with the PyTorch reference run on the GPU."""
    hidden, inter, experts, topk, tokens = MODELS[model]
    routed = tokens * topk
    sizes = random_group_sizes(routed, experts, routing, max_size=tokens, generator=gen)
    offsets = offsets_from_sizes(sizes)
    torch_rows = torch.compile(reference.fp8_quantize_rows_torch)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    yield ("rows x", 2 * x.numel(), _rows_bytes(tokens, hidden), lambda: fp8_quantize_rows(x),
           _rows_bytes(tokens, hidden), lambda: torch_rows(x),
           lambda: same_bits(fp8_quantize_rows(x).data, reference.fp8_quantize_rows_torch(x).data))
    yield gathered_columns_case(x, experts, topk, routing, torch_rows)
    for name, width in (("dy", hidden), ("act", inter)):
        rows = torch.randn(routed, width, device="cuda", dtype=torch.bfloat16)
        padded = reference.padded_group_width(routed, experts)

        def check(rows=rows):
            ours_rows, ours = fp8_quantize_columns(rows, offsets, with_rows=True)
            ref_rows, ref = reference.fp8_quantize_columns_torch(rows, offsets, with_rows=True)
            used = int(ref.padded_offsets[-1])
            return same_bits(ours.data[:, :used], ref.data[:, :used]) and same_bits(ours_rows.data, ref_rows.data)

        yield (f"rows+cols {name}", 2 * rows.numel(), _rows_bytes(routed, width) + width * padded * (1 + 4 / 128),
               lambda rows=rows: fp8_quantize_columns(rows, offsets, with_rows=True),
               _rows_bytes(routed, width), lambda rows=rows: torch_rows(rows), check)
    yield swiglu_bwd_case(routed, inter, offsets)
    torch_weights = torch.compile(reference.fp8_quantize_weights_torch)
    for name, shape in (("l1", (experts, 2 * inter, hidden)), ("l2", (experts, hidden, inter))):
        w = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        num_bytes = 4 * w.numel() + 4 * w.numel() // 128**2
        yield (f"weights {name}", 2 * w.numel(), num_bytes, lambda w=w: fp8_quantize_weights(w), num_bytes,
               lambda w=w: torch_weights(w),
               lambda w=w: same_bits(fp8_quantize_weights(w).data_t, reference.fp8_quantize_weights_torch(w).data_t))
        for which in ("data", "data_t"):  # one orientation (Fp8WeightCopies.PER_GEMM's copies)
            def check(w=w, which=which):
                return same_bits(getattr(fp8_quantize_weights(w, which=which), which),
                                 getattr(reference.fp8_quantize_weights_torch(w), which))
            yield (f"weights {name} {which}", 2 * w.numel(), num_bytes - w.numel(),
                   lambda w=w, which=which: fp8_quantize_weights(w, which=which), num_bytes,
                   lambda w=w: torch_weights(w), check)


def gathered_columns_case(x: torch.Tensor, experts: int, topk: int, routing: str, torch_rows):
    """x's columns gathered by the routing layout of a random top-k routing (`make_moe_inputs`'
    law: uniform or skewed), as the FP8 backward quantizes them for dl1 (`torch_rows`: the
    compiled torch rows quantization, its baseline)."""
    tokens, hidden = x.shape
    p = make_moe_inputs(tokens, 128, 128, experts, topk, device="cuda", routing=routing, seed=1)  # (its routing only)
    layout = build_routing_layout_torch(p["topk_idx"], p["topk_weights"], experts)
    offsets, index = layout.offsets, layout.row_token
    routed = index.numel()
    our_bytes = 2 * routed * hidden + hidden * reference.padded_group_width(routed, experts) * (1 + 4 / 128)

    def check():
        _, ours = fp8_quantize_columns(x, offsets, row_index=index)
        _, ref = reference.fp8_quantize_columns_torch(x, offsets, row_index=index)
        return same_written_columns(ours, ref)

    return ("cols x gather", 2 * x.numel(), our_bytes, lambda: fp8_quantize_columns(x, offsets, row_index=index),
            4 * routed * hidden + _rows_bytes(routed, hidden), lambda: torch_rows(x.index_select(0, index)), check)


def swiglu_bwd_case(routed: int, inter: int, offsets: torch.Tensor):
    """The fused FP8 SwiGLU backward against the unfused chain, on random h and d_act (the kernels
    read only the layout's offsets and routing weights)."""
    layout = RoutingLayout(offsets, torch.zeros(routed, dtype=torch.int64, device="cuda"),
                           torch.rand(routed, device="cuda"), torch.zeros(0, 1, dtype=torch.int64, device="cuda"),
                           torch.zeros(0, 1, dtype=torch.bool, device="cuda"))
    h = torch.randn(routed, 2 * inter, device="cuda", dtype=torch.bfloat16)
    d_act = torch.randn(routed, inter, device="cuda", dtype=torch.bfloat16)
    padded = reference.padded_group_width(routed, offsets.numel() - 1)
    # bf16 in; dz rows (fp8 + scales), dz and w * act columns (fp8 + scales), row_dw out
    fused_bytes = 2 * 3 * routed * inter + 2 * routed * inter * (1 + 4 / 128) + 3 * inter * padded * (1 + 4 / 128)
    chain_bytes = fused_bytes + 2 * 2 * 3 * routed * inter  # + dz and w * act written and read back in bf16

    def chain():
        dz, act_weighted, _ = moe_swiglu_bwd_bf16(h, d_act, layout)
        return fp8_quantize_columns(dz, offsets, with_rows=True), fp8_quantize_columns(act_weighted, offsets)

    def check():
        (ref_rows, ref_dz), (_, ref_act) = chain()
        rows, dz, act, _ = moe_swiglu_bwd_fp8(h, d_act, layout)
        used = int(ref_dz.padded_offsets[-1])
        return (same_bits(rows.data, ref_rows.data) and same_bits(dz.data[:, :used], ref_dz.data[:, :used])
                and same_bits(act.data[:, :used], ref_act.data[:, :used]))

    return ("swiglu bwd", 2 * 3 * routed * inter, fused_bytes, lambda: moe_swiglu_bwd_fp8(h, d_act, layout),
            chain_bytes, chain, check)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="30b,235b,v3")
    parser.add_argument("--routing", default="uniform,skewed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    require_sm90("bench_fp8_quant.py")
    gen = torch.Generator().manual_seed(args.seed)
    warm_up_gpu()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'model':<6} {'routing':<8} {'kernel':<14} {'ours ms':>8} {'GB/s':>6} {'torch ms':>9} {'GB/s':>6} "
          f"{'copy GB/s':>9} {'exact':>5}")
    for model in args.models.split(","):
        for i, routing in enumerate(args.routing.split(",")):
            for label, in_bytes, our_bytes, ours, torch_bytes, theirs, check in cases(model, routing, gen):
                if i > 0 and not label.startswith(("rows+cols", "cols", "swiglu")):
                    continue  # no groups there: one routing is enough
                ours_ms, theirs_ms = bench_ms(ours), bench_ms(theirs)
                src = torch.empty(in_bytes, dtype=torch.uint8, device="cuda")
                copy_ms = bench_ms(lambda src=src: src.clone())
                print(f"{model:<6} {routing:<8} {label:<14} {ours_ms:>8.3f} {_gbps(our_bytes, ours_ms):>6.0f} "
                      f"{theirs_ms:>9.3f} {_gbps(torch_bytes, theirs_ms):>6.0f} {_gbps(2 * in_bytes, copy_ms):>9.0f} "
                      f"{'yes' if check() else 'NO':>5}")
                del src
    print("GB/s: bytes read and written over the median time; torch: torch.compile'd deep_gemm.quant.reference "
          "(for rows+cols the rows only; for swiglu bwd our unfused chain); copy: a clone of the input")

if __name__ == "__main__":
    main()
