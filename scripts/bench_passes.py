"""What running GEMM1 in passes costs and what overlapping the token copy saves, on one GPU.

The expert-parallel forward (megamoe_bwd.ep.nvlink) runs GEMM1 (m-grouped nt with gathered
rows and the SwiGLU epilogue) in passes: rows of each expert sorted by the rank they came from,
the rank's own tokens first, so that it starts while the copy engines bring the other ranks'
tokens. At the EP=2 Qwen3-30B-A3B shape (2 x T tokens, K = 8 of 128 experts, this rank's 64),
this times:
    plain     GEMM1 over the expert-sorted layout (one run per expert)
    passes    the same rows in (expert, pass) runs, flags already set
    + copy    passes while T x H bf16 come from the second GPU over NVLink (a copy engine, as in
              the EP forward) on another stream, the flags set after it: the EP forward's overlap
    copy, then plain   the copy first, then plain GEMM1: no overlap
Each is the median of CUDA-event timings with the L2 flushed. Needs 2 GPUs: the copy must use
no SM (a copy within one GPU runs on SMs, which the waiting GEMM holds: it would trap).

    python scripts/bench_passes.py [--tokens 16384] [--world 2]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from bench_common import require_sm90  # noqa: E402
from deep_gemm.jit.runtime import stream_write_u32  # noqa: E402
from deep_gemm.moe import build_routing_layout  # noqa: E402
from deep_gemm.testing import bench_ms, warm_up_gpu  # noqa: E402

HIDDEN, INTER, EXPERTS, TOPK = 2048, 768, 128, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    require_sm90("bench_passes.py", 2)  # the copy must come from another GPU (see above)
    world, tokens = args.world, args.tokens
    local = EXPERTS // world
    warm_up_gpu()
    # Every rank's tokens in pass order; uniform routing over all experts, this rank's kept.
    scores = torch.rand(world * tokens, EXPERTS, device="cuda")
    expert = scores.topk(TOPK, dim=1).indices
    mine = expert < local
    weights = torch.where(mine, 1.0 / TOPK, 0.0)
    pass_of = torch.arange(world * tokens, device="cuda").unsqueeze(1) // tokens
    plain = build_routing_layout(torch.where(mine, expert, -1), weights, local)
    runs = build_routing_layout(torch.where(mine, expert * world + pass_of, -1), weights, local * world)
    x = torch.randn(world * tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    l1 = torch.randn(local, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5
    h = torch.empty(runs.num_slots, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(runs.num_slots, INTER, device="cuda", dtype=torch.bfloat16)
    flags = torch.ones(world, dtype=torch.int32, device="cuda")
    src, dst = torch.empty(tokens, HIDDEN, device="cuda:1", dtype=torch.bfloat16), x[tokens:2 * tokens]
    side = torch.cuda.Stream()

    def gemm(layout, offsets, **passes) -> None:
        deep_gemm.m_grouped_bf16_gemm_nt_swiglu_contiguous(x, l1, h, act, offsets, a_row_index=layout.row_token,
                                                            **passes)

    def overlapped() -> None:
        flags[1:].zero_()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst.copy_(src)
            for s in range(1, world):
                stream_write_u32(flags[s:].data_ptr(), 1, x.device.index)
        gemm(runs, runs.offsets, num_passes=world, ready_flags=flags)
        torch.cuda.current_stream().wait_stream(side)

    def copy_then_plain() -> None:
        dst.copy_(src)
        gemm(plain, plain.offsets)

    rows = int(plain.offsets[-1])
    print(f"GEMM1 (nt, SwiGLU epilogue, gathered rows) on {rows} rows, {local} experts, {world} passes; "
          f"copy of {tokens} x {HIDDEN} bf16 from GPU 1")
    timings = {
        "plain": bench_ms(lambda: gemm(plain, plain.offsets)),
        "passes": bench_ms(lambda: gemm(runs, runs.offsets, num_passes=world, ready_flags=flags)),
        "passes + copy (overlap)": bench_ms(overlapped),
        "copy, then plain": bench_ms(copy_then_plain),
        "copy alone": bench_ms(lambda: dst.copy_(src)),
    }
    flops = 2 * rows * 2 * INTER * HIDDEN
    for name, ms in timings.items():
        print(f"  {name:<24} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOPS")


if __name__ == "__main__":
    main()
