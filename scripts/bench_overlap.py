"""Would overlapping the NVLink push with a GEMM pay? One measurement of the trade-off.

Our GEMMs are persistent (one CTA per SM holding its whole register file, static tile
schedule), so an exchange kernel beside one only runs on SMs the GEMM leaves free. Per rank,
at the EP=2 Qwen3-30B-A3B shape (16384 tokens, K = 8, 64 local experts), this times:
  - the x push of the built-in path with its default grid (4 CTAs per SM), and with S CTAs
    (S = 64, 32, 16, 8: one per SM, as a GEMM CTA leaves no room for a second kernel's);
  - GEMM1 (m-grouped nt, 2I x H, the rank's ~131072 routed rows) on all SMs and on the
    other SMs - S;
  - the push with S CTAs launched first on a side stream and GEMM1 on the other SMs on this
    one, and the same with GEMM1 on every SM;
and prints, for each S, what running them side by side saves against running them in turn.

    python scripts/bench_overlap.py [--num-processes 2] [--tokens 16384]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch.distributed as dist  # noqa: E402

import deep_gemm  # noqa: E402
from deep_gemm.moe.ep import build_ep_plan  # noqa: E402
from deep_gemm.moe.glue import ep_push_rows_bf16  # noqa: E402
from deep_gemm.moe.symm import get_symm_buffer_for_mega_moe  # noqa: E402
from deep_gemm.testing import bench_ms, warm_up_gpu  # noqa: E402
from deep_gemm.utils import set_num_sms  # noqa: E402
from megamoe_bwd.ep import launch  # noqa: E402
from megamoe_bwd.reference import make_moe_inputs  # noqa: E402

HIDDEN, INTER, EXPERTS, TOPK = 2048, 768, 128, 8


def worker(rank: int, world: int, tokens: int) -> None:
    num_sms = torch.cuda.get_device_properties(rank).multi_processor_count
    buffer = get_symm_buffer_for_mega_moe(None, EXPERTS, tokens, TOPK, HIDDEN, INTER)
    p = make_moe_inputs(tokens, HIDDEN, INTER, EXPERTS, TOPK, device="cuda", seed=rank)
    plan = build_ep_plan(p["topk_idx"], buffer)
    local = EXPERTS // world
    rows = tokens * TOPK  # about what each rank's experts receive under uniform routing
    a = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    l1 = torch.randn(local, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN ** 0.5
    h = torch.empty(rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    offsets = (torch.arange(local + 1, device="cuda", dtype=torch.int32) * (rows // local))
    side = torch.cuda.Stream()

    def push(ctas=None) -> None:
        ep_push_rows_bf16(p["x"], plan.token, plan.dst_rank, plan.dst_row, buffer.region("recv_x"), num_ctas=ctas)

    def gemm(sms: int) -> None:
        set_num_sms(sms)
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, l1, h, offsets)

    def side_by_side(push_ctas: int, gemm_sms: int) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            push(push_ctas)
        gemm(gemm_sms)
        torch.cuda.current_stream().wait_stream(side)

    def slowest(ms: float) -> float:
        value = torch.tensor([ms], device="cuda")
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.item()

    def timed(fn) -> float:
        dist.barrier()
        ms = bench_ms(fn, warmup=3, iters=10, flush_l2=False)
        buffer.barrier()  # no rank reads or rewrites the receive region while another still pushes
        return slowest(ms)

    warm_up_gpu()
    gemm_full = timed(lambda: gemm(num_sms))
    push_default = timed(push)
    lines = [f"GEMM1 alone on {num_sms} SMs: {gemm_full:.3f} ms; push with 4 CTAs per SM: {push_default:.3f} ms "
             "(slowest rank)",
             f"{'push CTAs':>9} {'push ms':>8} {'GEMM ms, rest':>13} {'in turn':>8} {'side by side':>12} "
             f"{'saved':>6} {'beside full GEMM':>16}"]
    for ctas in (64, 32, 16, 8):
        push_ms = timed(lambda: push(ctas))
        rest = num_sms - ctas
        gemm_rest = timed(lambda: gemm(rest))
        together = timed(lambda: side_by_side(ctas, rest))
        beside_full = timed(lambda: side_by_side(ctas, num_sms))
        in_turn = push_default + gemm_full
        lines.append(f"{ctas:>9} {push_ms:>8.3f} {gemm_rest:>13.3f} {in_turn:>8.3f} {together:>12.3f} "
                     f"{in_turn - together:>6.3f} {beside_full:>16.3f}")
    set_num_sms(num_sms)
    if rank == 0:
        print(f"EP={world}, {tokens} tokens per rank, x push of {tokens} x {HIDDEN} bf16 per rank pair")
        print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    launch(worker, args.num_processes, args.tokens, backend="nccl")


if __name__ == "__main__":
    main()
