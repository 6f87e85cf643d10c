"""Where an FP8 GEMM's tiles spend their clocks: one launch built with per-tile clock records
(`DG_JIT_TIMELINE=1`, ptx/trace.cuh), read back and summed up per warpgroup. A profiling aid.

    python scripts/timeline.py [--model 30b] [--gemm wgrad1] [--routing uniform]

For CTAs 0-7, each math warpgroup's mean SM clocks per tile: tile start -> its first stage landed
(waiting for loads), first stage -> mainloop end (per k-block too), the epilogue, and epilogue
end -> the next tile's start; and the producer's mean clocks between two stages it could refill.
Then, per k-block, what the FP8 mainloop's math warpgroups spent their clocks on, summed over the
launch (ptx/trace.cuh's Waits): waiting for a stage, for their MMAs, for the other warpgroup's
turn, the work beside a tile's first MMAs (the next tile, the last tile's epilogue), issuing
the MMAs (fence to commit), and the rest (promoting, the scales' reads).
`--gemm`: fwd1, fwd2, dgrad1, dgrad2 (m-grouped, bf16 out), wgrad1, wgrad2 (k-grouped, fp32 out),
at `bench_gemm.py`'s shapes (its `gemm_cases`), or "fwd1 gather" (`ab_gemm.py`'s GEMM1 with rows
gathered in its loads). Needs a Hopper GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ["DG_JIT_TIMELINE"] = "1"  # before deep_gemm builds any kernel

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from ab_gemm import FWD1_VARIANTS, make_fp8_call  # noqa: E402
from bench_common import MODELS, require_sm90  # noqa: E402
from bench_gemm import gemm_cases  # noqa: E402
from deep_gemm.jit.runtime import timeline_buffer  # noqa: E402
from deep_gemm.testing import random_group_sizes  # noqa: E402

# ptx/trace.cuh's timeline::Event
TILE_START, STAGE_LANDED, MAINLOOP_END, EPILOGUE_END, LOADS_ISSUED = 1, 2, 3, 4, 5
WAITS_BASE = 16  # its Wait sums: event WAITS_BASE + index
# bench_gemm.py's (fp32 out for wgrad), and GEMM1 with gathered rows; the SwiGLU forms with an e4m3
# act do not launch with the timeline's shared counters (their shared memory is within 1 KB of the limit)
GEMMS = ("fwd1", "fwd2", "dgrad1", "dgrad2", "wgrad1", "wgrad2", "fwd1 gather")


def make_gemm(gemm: str, model: str, routing: str):
    """A closure running `gemm` once at `model`'s shape on random operands (`ab_gemm.py`'s)."""
    hidden, inter, experts, topk, tokens = MODELS[model]
    label = f"{gemm} fp32" if gemm.startswith("wgrad") else gemm
    shape = "fwd1" if label in FWD1_VARIANTS else label
    d1, d2, out_dtype = next((d1, d2, dtype) for name, _, d1, d2, dtype in gemm_cases(hidden, inter) if name == shape)
    sizes = random_group_sizes(tokens * topk, experts, routing, max_size=tokens,
                               generator=torch.Generator().manual_seed(0))
    return make_fp8_call(deep_gemm, label, d1, d2, sizes, out_dtype, {})


def summarize(records: torch.Tensor) -> list[str]:
    """Lines of mean clocks per phase, from the [CTAs, tracks, records, 2] buffer."""
    phases = {"start -> first stage": [], "mainloop": [], "per k-block": [], "epilogue": [], "-> next tile": []}
    refills = []
    for cta in records:
        for track, rows in enumerate(cta.tolist()):
            events = [(clock, tag >> 24, tag & 0xFFFFFF) for clock, tag in rows if tag]
            if track == 2:  # the producer: clocks between the stages it was let refill
                issued = [clock for clock, event, _ in events if event == LOADS_ISSUED]
                refills += [b - a for a, b in zip(issued, issued[1:])]
                continue
            start = first = end = mainloop_end = None
            for clock, event, tag in events:
                if event == TILE_START:
                    if end is not None:
                        phases["-> next tile"].append(clock - end)
                    start, first, mainloop_end, blocks = clock, None, None, tag
                elif event == STAGE_LANDED and first is None:
                    first = clock
                    phases["start -> first stage"].append(first - start)
                elif event == MAINLOOP_END and first is not None:
                    phases["mainloop"].append(clock - first)
                    phases["per k-block"].append((clock - first) / max(blocks, 1))
                    mainloop_end = clock
                elif event == EPILOGUE_END and mainloop_end is not None:
                    phases["epilogue"].append(clock - mainloop_end)
                    end = clock
    lines = [f"{name:<22} {statistics.fmean(v):>9.0f} clocks (over {len(v)})" for name, v in phases.items() if v]
    if refills:
        lines.append(f"{'producer, per stage':<22} {statistics.fmean(refills):>9.0f} clocks (over {len(refills)})")
    return lines


def waits(records: torch.Tensor) -> list[str]:
    """Lines of the math warpgroups' summed waits (ptx/trace.cuh's Waits), per k-block."""
    names = ("waiting for a stage", "waiting for MMAs", "waiting for the turn", "beside the first MMAs",
             "inside the mainloop", "k-blocks", "the scheduler's walk", "issuing MMAs")
    sums = [0] * len(names)
    for cta in records:
        for rows in cta.tolist()[:2]:
            for _, tag in rows:
                event, value = tag >> 24, tag & 0xFFFFFF
                if WAITS_BASE <= event < WAITS_BASE + len(names):
                    sums[event - WAITS_BASE] += value
    issue = sums.pop()
    walk = sums.pop()
    k_blocks = sums.pop()
    if not k_blocks:
        return []
    lines = [f"math warpgroups, per k-block (over {k_blocks}):"]
    lines += [f"  {name:<24} {total / k_blocks:8.1f} clocks" for name, total in zip(names, sums)]
    lines.append(f"  {'  of it the next tile':<24} {walk / k_blocks:8.1f} clocks (the walk, or its read)")
    lines.append(f"  {'issuing MMAs':<24} {issue / k_blocks:8.1f} clocks (fence to commit)")
    rest = sums[-1] - sum(sums[:-1]) - issue
    lines.append(f"  {'the rest (promote, scales)':<24} {rest / k_blocks:8.1f} clocks")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="30b", choices=sorted(MODELS))
    parser.add_argument("--gemm", default="wgrad1", choices=GEMMS)
    parser.add_argument("--routing", default="uniform")
    args = parser.parse_args()
    require_sm90("timeline.py")
    run = make_gemm(args.gemm, args.model, args.routing)
    run()  # compiles, and warms the caches
    buffer = timeline_buffer(torch.cuda.current_device())
    buffer.zero_()
    torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    print(f"{args.model} {args.gemm} ({args.routing}), CTAs 0-7, math warpgroups' means:")
    records = buffer.cpu()
    print("\n".join(summarize(records)))
    print("\n".join(waits(records)))


if __name__ == "__main__":
    main()
