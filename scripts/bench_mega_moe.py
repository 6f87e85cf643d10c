"""Mega MoE layer, forward and backward, against the torch._grouped_mm MoE in the same run.

For each standard shape (docs/DESIGN.md) and routing: fwd, bwd and fwd+bwd ms (medians of CUDA
event timings), TFLOPS (forward 6*T*K*H*I FLOPs, backward twice that) and the peak memory
above the inputs, allocated (tensors alive) and reserved (what the caching allocator holds:
a block freed on a side stream stays there while that stream may still use it), and "step GB":
a later step's peak allocated above what the first left held (what an implementation caches
across steps, such as the FP8 weight copies cached per optimizer step, left out), for
    ours     megamoe_bwd.mega_moe (autograd; weight gradients in the weights' dtype)
    ours fp8 megamoe_bwd.mega_moe(..., fp8=True): the expert GEMMs in blockwise FP8, bf16 in
             and out (TFLOPS counted as for bf16); `--no-fp8` leaves it and the next out;
             `--fp8-copies per_call,per_gemm` adds "ours fp8 per call" and "ours fp8 per gemm",
             its weight copies under those `deep_gemm.Fp8WeightCopies` policies
    torch fp8 rowwise  megamoe_bwd.baseline.fp8_rowwise_moe: the torch MoE with its GEMMs on
             torch._scaled_grouped_mm, rowwise scales, torch's quantization (torchao-style; its
             weight gradients read the group sizes on the host)
    torch    megamoe_bwd.grouped_mm_moe (sort, torch._grouped_mm, SwiGLU, torch._grouped_mm,
             weighted index_add; autograd backward)
    liger    liger_kernel's LigerFusedMoEFunction, when the package is installed
and writes a PNG bar chart next to the table (`--plot`). The one-GPU mode uses only
`megamoe_bwd.mega_moe`, `grouped_mm_moe` and `make_moe_inputs`, so it also times another
checkout of the library on the same terms (an A/B: put this script in that checkout's scripts/).

    python scripts/bench_mega_moe.py [--models 30b,235b,v3] [--routing uniform,skewed] [--plot PATH]

`--host` adds a line per implementation with the host's time to issue one fwd and one bwd (when
it exceeds the GPU's, the GPU waits for the host); `--profile` prints our kernels' GPU times.
`--sustained SECONDS` adds a line per implementation timed over SECONDS of steps back to back
(after all the shape's bursts), with the SM clock and board power: on an H200 the steady state of
training runs at the 700 W cap, at lower clocks than the short bursts of the main table
(docs/PERF.md, "Decisions": decide in the steady state).

With --num-processes N (expert parallelism, one GPU per rank, `tokens` per rank), it times the
TorchTitan-style all-to-all baseline (`megamoe_bwd.ep.all_to_all_moe`), our NVLink path
(`ep_mega_moe_nvlink`: x and dy pulled by the copy engines while GEMM1 and dA's GEMM start on
the rank's own tokens; "ours, nvlink fp8": the same in blockwise FP8, tokens exchanged quantized),
ours over DeepEP when it is installed (`ep_mega_moe_deep_ep`; "ours, deep_ep fp8": in blockwise
FP8, tokens dispatched quantized), ours
with the all-to-all exchange (`ep_mega_moe_nccl`) and the compute-only time of each rank's work
(torch._grouped_mm on uniform groups, and our single-GPU layer on T tokens routed over the
local experts), and reports per-GPU numbers (the slowest rank's median), each path's speed-up
over the all-to-all baseline and its time over our compute-only time (the share of
communication left unhidden). Needs Hopper GPUs.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from bench_common import MODELS, require_sm90  # noqa: E402
from deep_gemm.testing import SustainedTiming, sustained_ms, upper_median, warm_up_gpu  # noqa: E402
from megamoe_bwd import grouped_mm_moe, make_moe_inputs, mega_moe  # noqa: E402
from megamoe_bwd.baseline import fp8_rowwise_moe  # noqa: E402


def deep_ep_available() -> bool:
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return False
    return True


def liger_impl():
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction  # type: ignore
    except ImportError:
        return None
    # Liger takes (x, gate_up_proj [E, 2I, H], down_proj [E, H, I], int32 top-k ids, weights).
    return lambda x, idx, w, l1, l2: LigerFusedMoEFunction.apply(x, l1, l2, idx.to(torch.int32), w)


def profile(fn, inputs, dy, title: str, show: bool = True) -> None:
    """GPU time per kernel of one fwd+bwd (after a warm-up), largest first, and the host's time
    to issue the fwd and the bwd (when it exceeds the GPU's, the GPU waits for the host).
    Collective when `fn` is; `show` False profiles without printing (other ranks)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    fn(*leaves).backward(dy)
    for t in leaves:  # as in the timed steps: gradients are created, not accumulated
        t.grad = None
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        y = fn(*leaves)
        issued_fwd = time.perf_counter()
        y.backward(dy)
        issued_bwd = time.perf_counter()
        torch.cuda.synchronize()
    if not show:
        return
    print(f"-- {title}: GPU time per op (with input shapes), one fwd+bwd; host issued the fwd in "
          f"{(issued_fwd - start) * 1e3:.2f} ms, the bwd in {(issued_bwd - issued_fwd) * 1e3:.2f} ms (profiled) --")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=25,
                                                             max_name_column_width=40, max_shapes_column_width=70),
          flush=True)
    print_gpu_gaps(prof)
    if os.environ.get("BENCH_TIMELINE"):
        print_timeline(prof)


def print_timeline(prof, limit: int = 120) -> None:
    """Every GPU activity of the profile in start order: offset, duration, name (BENCH_TIMELINE=1)."""
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not events:
        return
    t0 = events[0][0]
    for start, end, name in events[:limit]:
        print(f"  {(start - t0) / 1e3:8.3f} ms  {(end - start) / 1e3:7.3f}  {name[:70]}")


def print_gpu_gaps(prof, top: int = 8) -> None:
    """How long the GPU ran no kernel between the first and the last kernel of the profile,
    and the longest such gaps with the kernels around them."""
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not kernels:
        return
    gaps, busy_until, last_name = [], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, start - kernels[0][0], last_name, name))
        if end > busy_until:
            busy_until, last_name = end, name
    wall = busy_until - kernels[0][0]
    idle = sum(g[0] for g in gaps)
    print(f"GPU idle {idle / 1e3:.2f} ms of {wall / 1e3:.2f} ms between the first and last kernel; longest gaps:")
    for length, at, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {length / 1e3:6.3f} ms at {at / 1e3:7.3f} ms: after {before[:50]}, before {after[:50]}")


def _leaves(inputs) -> list:
    """The inputs as new autograd leaves (floating-point ones requiring gradients)."""
    return [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]


def _fwd_bwd_steps(fn, inputs, dy, iters: int, warmup: int, mark) -> list[tuple]:
    """`warmup + iters` fwd+bwd steps of `fn` with no sync between them (gradients created, not
    accumulated); `mark()` is taken before the fwd, between and after the bwd. Returns the timed
    steps' three marks each, after a final sync."""
    leaves = _leaves(inputs)
    steps = []
    for i in range(warmup + iters):
        for t in leaves:
            t.grad = None
        start = mark()
        y = fn(*leaves)
        issued_fwd = mark()
        y.backward(dy)
        steps.append((start, issued_fwd, mark()))
        del y
    torch.cuda.synchronize()
    return steps[warmup:]


def _recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def time_fwd_bwd(fn, inputs, dy, iters: int = 10, warmup: int = 3):
    """Median fwd ms, median bwd ms, and bytes: the peak allocated and the peak reserved above the
    inputs over every step, and the peak allocated of a later step above what the earlier ones
    left held (`fn`'s caches: the FP8 weight copies under PER_STEP; the step's own memory)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.empty_cache()  # blocks cached by an earlier impl would hide this one's reservations
    base_reserved = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    _fwd_bwd_steps(fn, inputs, dy, 1, 0, _recorded_event)  # (its leaves and gradients are gone after it)
    held = torch.cuda.memory_allocated()
    first_peak, first_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    steps = _fwd_bwd_steps(fn, inputs, dy, iters, max(warmup - 1, 0), _recorded_event)
    peak = max(first_peak, torch.cuda.max_memory_allocated()) - base
    peak_reserved = max(first_reserved, torch.cuda.max_memory_reserved()) - base_reserved
    step_peak = torch.cuda.max_memory_allocated() - held
    return (upper_median(a.elapsed_time(b) for a, b, _ in steps),
            upper_median(b.elapsed_time(c) for _, b, c in steps), peak, peak_reserved, step_peak)


def host_issue_ms(fn, inputs, dy, iters: int = 10, warmup: int = 3) -> tuple[float, float]:
    """Median host milliseconds to issue one fwd and one bwd of `fn`, stepped as `time_fwd_bwd`
    steps it: when their sum exceeds the step's GPU time, the GPU waits for the host."""
    steps = _fwd_bwd_steps(fn, inputs, dy, iters, warmup, time.perf_counter)
    return upper_median((b - a) * 1e3 for a, b, _ in steps), upper_median((c - b) * 1e3 for _, b, c in steps)


def sustained_fwd_bwd(fn, inputs, dy, seconds: float) -> SustainedTiming:
    """fwd+bwd steps of `fn` back to back for `seconds` (`sustained_ms`: ms a step, SM clock, power)."""
    leaves = _leaves(inputs)

    def step() -> None:
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dy)

    return sustained_ms(step, seconds, batch=2)


def _fp8_with_copies(policy: str):
    """Our FP8 layer with its weight copies under `deep_gemm.Fp8WeightCopies(policy)` (the policy
    the forward runs under decides what its backward makes)."""
    import deep_gemm

    def layer(*inputs) -> torch.Tensor:
        previous = deep_gemm.get_fp8_weight_copies()
        deep_gemm.set_fp8_weight_copies(deep_gemm.Fp8WeightCopies(policy))
        try:
            return mega_moe(*inputs, fp8=True)
        finally:
            deep_gemm.set_fp8_weight_copies(previous)
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="30b,235b,v3")
    parser.add_argument("--routing", default="uniform,skewed")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart of fwd+bwd ms here")
    parser.add_argument("--num-processes", type=int, default=1, help="expert parallelism over this many GPUs")
    parser.add_argument("--tokens", default=None, help="tokens per rank, comma-separated (default: the model's)")
    parser.add_argument("--profile", action="store_true", help="also print ours' GPU time per kernel (one fwd+bwd)")
    parser.add_argument("--host", action="store_true", help="also print each implementation's host time to issue "
                        "one fwd and one bwd (one GPU)")
    parser.add_argument("--no-liger", action="store_true", help="leave Liger out (its autotuning takes minutes)")
    parser.add_argument("--no-fp8", action="store_true", help="leave our FP8 layer out (one GPU; with --num-processes "
                        "use --impls)")
    parser.add_argument("--fp8-copies", default="", help="also time our FP8 layer with its weight copies under "
                        "these deep_gemm.Fp8WeightCopies policies, comma-separated (per_call: made by every forward, "
                        "none outlives its backward; per_gemm: each made just before its GEMMs, none kept from the "
                        "forward to the backward)")
    parser.add_argument("--sustained", type=float, default=None, metavar="SECONDS",
                        help="also time each implementation's steps back to back for SECONDS (one GPU): the "
                             "power-capped steady state of training, with the SM clock and power")
    parser.add_argument("--impls", default=None,
                        help="with --num-processes: implementations to time, separated by ';' (names hold commas; "
                             "default: all; 'ours compute only' is always timed, the ratios' reference)")
    args = parser.parse_args()
    require_sm90("bench_mega_moe.py", args.num_processes)
    if args.num_processes > 1:
        from megamoe_bwd.ep import launch
        launch(ep_worker, args.num_processes, args.models, args.routing, args.tokens, args.profile, args.impls,
               backend="nccl")
        return

    impls = {"torch": grouped_mm_moe, "ours": mega_moe}
    if not args.no_fp8:
        impls["torch fp8 rowwise"] = fp8_rowwise_moe
        impls["ours fp8"] = lambda *inputs: mega_moe(*inputs, fp8=True)
        for policy in filter(None, args.fp8_copies.split(",")):
            impls[f"ours fp8 {policy.replace('_', ' ')}"] = _fp8_with_copies(policy)
    if liger_impl() is not None and not args.no_liger:
        impls["liger"] = liger_impl()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    warm_up_gpu()
    header = (f"{'model':<5} {'route':<7} {'impl':<21} {'fwd ms':>8} {'bwd ms':>8} {'total':>8} {'TFLOPS':>7} "
              f"{'vs torch':>8} {'peak GB':>8} {'reserved':>8} {'step GB':>8}")
    lines, results = [header], []
    print(header, flush=True)
    for model in args.models.split(","):
        hidden, inter, experts, topk, tokens = MODELS[model]
        flops = 6 * tokens * topk * hidden * inter * 3  # forward + backward
        for routing in args.routing.split(","):
            p = make_moe_inputs(tokens, hidden, inter, experts, topk, device="cuda", routing=routing, seed=0)
            inputs = [p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"]]
            torch_total = torch_sustained = None
            for name, fn in impls.items():  # torch first: every line is printed as soon as it is timed
                fwd, bwd, peak, peak_reserved, step_peak = time_fwd_bwd(fn, inputs, p["dy"])
                torch_total = torch_total or fwd + bwd
                total = fwd + bwd
                line = (f"{model:<5} {routing:<7} {name:<21} {fwd:>8.2f} {bwd:>8.2f} {total:>8.2f} "
                        f"{flops / total / 1e9:>7.0f} {torch_total / total:>7.2f}x {peak / 2**30:>8.2f} "
                        f"{peak_reserved / 2**30:>8.2f} {step_peak / 2**30:>8.2f}")
                lines.append(line)
                results.append((f"{model}\n{routing}", name, total))
                print(line, flush=True)
                if args.host:
                    host_fwd, host_bwd = host_issue_ms(fn, inputs, p["dy"])
                    print(f"{'':<5} {'':<7} {name + ' (host)':<21} {host_fwd:>8.2f} {host_bwd:>8.2f} "
                          f"{host_fwd + host_bwd:>8.2f}", flush=True)
            # (after every burst: a burst right after seconds at the power cap runs slower)
            for name, fn in impls.items() if args.sustained else ():
                run = sustained_fwd_bwd(fn, inputs, p["dy"], args.sustained)
                torch_sustained = torch_sustained or run.ms
                line = (f"{model:<5} {routing:<7} {name + ' (sustained)':<21} {'':>8} {'':>8} {run.ms:>8.2f} "
                        f"{flops / run.ms / 1e9:>7.0f} {torch_sustained / run.ms:>7.2f}x "
                        f"{run.sm_mhz or float('nan'):>6.0f} MHz {run.watts or float('nan'):>4.0f} W")
                lines.append(line)
                print(line, flush=True)
            if args.profile:
                profile(mega_moe, inputs, p["dy"], f"{model} {routing}")
            del p, inputs
            torch.cuda.empty_cache()
    print("\n" + "\n".join(lines))
    if args.plot:
        plot(results, args.plot)


def ep_worker(rank: int, world: int, models: str, routings: str, tokens_arg, profile_nvlink: bool = False,
              impls: str | None = None) -> None:
    """One rank of the expert-parallel benchmark; rank 0 prints the slowest rank's numbers
    (and, with `profile_nvlink`, its kernel profile of the NVLink path). `impls`: a
    ';'-separated subset of the implementations (default: all)."""
    from megamoe_bwd.baseline import expert_mlps
    from megamoe_bwd.ep import (all_to_all_moe, ep_mega_moe_deep_ep, ep_mega_moe_nccl, ep_mega_moe_nvlink,
                                get_symm_buffer_for_mega_moe, make_deep_ep_buffer)
    from megamoe_bwd.ep.nvlink import fp8_exchange_fits

    def slowest(ms: float) -> float:
        value = torch.tensor([ms], device="cuda")
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.item()

    if rank == 0:
        print(f"EP over {world} x {torch.cuda.get_device_name()}; per-GPU numbers, slowest rank")
        print(f"{'model':<5} {'route':<7} {'tokens':>6} {'impl':<18} {'fwd ms':>8} {'bwd ms':>8} {'total':>8} "
              f"{'TFLOPS/GPU':>10} {'vs a2a':>7} {'/ ours compute':>14}", flush=True)
    for model in models.split(","):
        hidden, inter, experts, topk, default_tokens = MODELS[model]
        token_counts = [int(t) for t in tokens_arg.split(",")] if tokens_arg else [default_tokens]
        buffer = get_symm_buffer_for_mega_moe(None, experts, max(token_counts), topk, hidden, inter)
        deep_ep_buffer = make_deep_ep_buffer(dist.group.WORLD, hidden) if deep_ep_available() else None
        for tokens in token_counts:
            flops = 18 * tokens * topk * hidden * inter
            for routing in routings.split(","):
                p = make_moe_inputs(tokens, hidden, inter, experts, topk, device="cuda", routing=routing,
                                    seed=1000 + rank)
                local = slice(rank * experts // world, (rank + 1) * experts // world)
                l1, l2 = p["l1"][local].clone(), p["l2"][local].clone()
                inputs = [p["x"], p["topk_idx"], p["topk_weights"], l1, l2]
                del p["l1"], p["l2"]
                rows = torch.randn(tokens * topk, hidden, device="cuda", dtype=torch.bfloat16)
                local_work = make_moe_inputs(tokens, hidden, inter, l1.shape[0], topk, device="cuda", seed=2000 + rank)
                del local_work["l1"], local_work["l2"]  # the rank's own experts are used
                per_expert = tokens * topk // l1.shape[0]
                offs = torch.arange(1, l1.shape[0] + 1, device="cuda", dtype=torch.int32) * per_expert
                runs = {
                    "torchtitan a2a": lambda: time_fwd_bwd(all_to_all_moe, inputs, p["dy"]),
                    "ours, nvlink": lambda: time_fwd_bwd(lambda *a: ep_mega_moe_nvlink(*a, buffer), inputs, p["dy"]),
                    **({"ours, nvlink fp8": lambda: time_fwd_bwd(lambda *a: ep_mega_moe_nvlink(*a, buffer, fp8=True),
                                                                 inputs, p["dy"])}
                       if fp8_exchange_fits(buffer, l1.shape[0], inter) else {}),
                    "ours, a2a": lambda: time_fwd_bwd(ep_mega_moe_nccl, inputs, p["dy"]),
                    **({"ours, deep_ep": lambda: time_fwd_bwd(lambda *a: ep_mega_moe_deep_ep(*a, deep_ep_buffer),
                                                              inputs, p["dy"]),
                        "ours, deep_ep fp8": lambda: time_fwd_bwd(
                            lambda *a: ep_mega_moe_deep_ep(*a, deep_ep_buffer, fp8=True), inputs, p["dy"])}
                       if deep_ep_buffer is not None else {}),
                    "torch compute only": lambda: time_fwd_bwd(lambda r, a, b: expert_mlps(r, offs, a, b),
                                                               [rows, l1, l2], torch.randn_like(rows)),
                    # our single-GPU layer on the same per-rank work: T tokens, K slots over the local experts
                    "ours compute only": lambda: time_fwd_bwd(
                        mega_moe, [local_work[k] for k in ("x", "topk_idx", "topk_weights")] + [l1, l2],
                        local_work["dy"]),
                }
                if rank == 0 and "ours, nvlink fp8" not in runs:
                    print(f"(ours, nvlink fp8: {world} x {max(token_counts)} tokens x K {topk} rows exceed what its "
                          f"backward's quantization takes in one pass; not timed)", flush=True)
                wanted = set(runs) if impls is None else set(impls.split(";")) | {"ours compute only"}
                if wanted - set(runs):
                    raise ValueError(f"unknown implementations {sorted(wanted - set(runs))}; known: {sorted(runs)}")
                timings = {name: run() for name, run in runs.items() if name in wanted}
                slow = {name: (slowest(fwd), slowest(bwd)) for name, (fwd, bwd, *_) in timings.items()}
                totals = {name: fwd + bwd for name, (fwd, bwd) in slow.items()}
                for name, (fwd, bwd) in slow.items():
                    total = fwd + bwd
                    if rank == 0:
                        print(f"{model:<5} {routing:<7} {tokens:>6} {name:<18} {fwd:>8.2f} {bwd:>8.2f} {total:>8.2f} "
                              f"{flops / total / 1e9:>10.0f} {totals.get('torchtitan a2a', math.nan) / total:>6.2f}x "
                              f"{total / totals['ours compute only']:>13.2f}x", flush=True)
                if profile_nvlink:
                    profile(lambda *a: ep_mega_moe_nvlink(*a, buffer), inputs, p["dy"],
                            f"rank 0 of {world}, nvlink, {model} {routing} {tokens} tokens", show=rank == 0)
                del inputs, rows, local_work
                torch.cuda.empty_cache()


def plot(results, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r[0] for r in results))
    names = list(dict.fromkeys(r[1] for r in results))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(1.6 * len(shapes) + 2, 4))
    for i, name in enumerate(names):
        values = [next(t for s, n, t in results if s == shape and n == name) for shape in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], values, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(shapes))], shapes)
    ax.set_ylabel("fwd + bwd ms (lower is better)")
    ax.set_title(f"MoE layer on {torch.cuda.get_device_name()}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")  # beside the bars, not over them
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
