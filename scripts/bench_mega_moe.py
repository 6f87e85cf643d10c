"""Mega MoE layer, forward and backward, against the torch._grouped_mm MoE in the same run.

For each standard shape (DESIGN.md) and routing: fwd, bwd and fwd+bwd ms (medians of CUDA
event timings), TFLOPS (forward 6*T*K*H*I FLOPs, backward twice that) and the peak memory
above the inputs, for
    ours     megamoe_bwd.mega_moe (autograd; weight gradients in the weights' dtype)
    torch    megamoe_bwd.grouped_mm_moe (sort, torch._grouped_mm, SwiGLU, torch._grouped_mm,
             weighted index_add; autograd backward)
    liger    liger_kernel's LigerFusedMoEFunction, when the package is installed
and writes a PNG bar chart next to the table (`--plot`).

    python scripts/bench_mega_moe.py [--models 30b,235b,v3] [--routing uniform,skewed] [--plot PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megamoe_bwd import grouped_mm_moe, mega_moe  # noqa: E402
from megamoe_bwd.reference import make_moe_inputs  # noqa: E402

MODELS = {  # name: (H, I, E, top-k, tokens)
    "30b": (2048, 768, 128, 8, 16384),
    "235b": (4096, 1536, 128, 8, 16384),
    "v3": (7168, 2048, 256, 8, 8192),
}


def liger_impl():
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction  # type: ignore
    except ImportError:
        return None
    return lambda x, idx, w, l1, l2: LigerFusedMoEFunction.apply(x, idx, w, l1, l2)


def time_fwd_bwd(fn, inputs, dy, iters: int = 10, warmup: int = 3):
    """Median fwd ms, median bwd ms, peak bytes above the inputs."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd, bwd = [], []
    for i in range(warmup + iters):
        for t in leaves:
            t.grad = None
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        y = fn(*leaves)
        events[1].record()
        y.backward(dy)
        events[2].record()
        if i >= warmup:
            fwd.append(events[:2])
            bwd.append(events[1:])
        del y
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    median = lambda pairs: sorted(a.elapsed_time(b) for a, b in pairs)[len(pairs) // 2]  # noqa: E731
    return median(fwd), median(bwd), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="30b,235b,v3")
    parser.add_argument("--routing", default="uniform,skewed")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart of fwd+bwd ms here")
    args = parser.parse_args()

    impls = {"ours": mega_moe, "torch": grouped_mm_moe}
    if liger_impl() is not None:
        impls["liger"] = liger_impl()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    header = (f"{'model':<5} {'route':<7} {'impl':<6} {'fwd ms':>8} {'bwd ms':>8} {'total':>8} {'TFLOPS':>7} "
              f"{'vs torch':>8} {'peak GB':>8}")
    lines, results = [header], []
    print(header, flush=True)
    for model in args.models.split(","):
        hidden, inter, experts, topk, tokens = MODELS[model]
        flops = 6 * tokens * topk * hidden * inter * 3  # forward + backward
        for routing in args.routing.split(","):
            p = make_moe_inputs(tokens, hidden, inter, experts, topk, device="cuda", routing=routing, seed=0)
            inputs = [p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"]]
            timings = {name: time_fwd_bwd(fn, inputs, p["dy"]) for name, fn in impls.items()}
            torch_total = sum(timings["torch"][:2])
            for name, (fwd, bwd, peak) in timings.items():
                total = fwd + bwd
                line = (f"{model:<5} {routing:<7} {name:<6} {fwd:>8.2f} {bwd:>8.2f} {total:>8.2f} "
                        f"{flops / total / 1e9:>7.0f} {torch_total / total:>7.2f}x {peak / 2**30:>8.2f}")
                lines.append(line)
                results.append((f"{model}\n{routing}", name, total))
                print(line, flush=True)
            del p, inputs
            torch.cuda.empty_cache()
    print("\n" + "\n".join(lines))
    if args.plot:
        plot(results, args.plot)


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
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
