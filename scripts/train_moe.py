"""Trains a Qwen3-MoE model from transformers with each experts backend in turn (transformers'
default, `grouped_mm`, and ours, `megamoe`), on the same seed, weights and batches, and
compares them.

The model is built from a config (no downloads): `--layers` decoder layers, each with the
Qwen3-30B-A3B MoE (H 2048, I 768, 128 experts, top-8, norm_topk_prob) and its SDPA attention
(32 heads, 4 KV heads, head dim 128), bf16 parameters, AdamW with a linear warm-up and gradient clipping. The text is real and offline:
the Python documentation CPython ships (`pydoc_data`), as UTF-8 bytes (a 256-symbol byte
tokenizer). Each step trains on `--tokens` tokens in sequences of `--seq`.

Prints per backend tokens/s, step ms (median, min, max; the first step, which compiles
kernels, apart: a repeated backend's finds them built), peak memory, the speed over the first
backend, and how far each loss curve is from the first backend's: at any step, and at any
logged step (the mean loss of each `--log-every` steps, as a training framework logs it); writes a PNG of the loss curves and step
times (`--plot`), and with `--json` each backend's per-step losses and step times. A backend
named twice in `--backends` runs twice (the second as name#2): its spread against itself.
`--compile` runs every backend's decoder layers under `torch.compile` (each layer compiled, as
TorchTitan compiles its blocks; the backward through AOTAutograd): the attention, norms and
router around the experts then run fused, the same for every backend. Needs a Hopper GPU.

    python scripts/train_moe.py [--steps 100] [--layers 4] [--tokens 16384] [--backends grouped_mm,megamoe] [--log-every 10] [--compile]
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import require_sm90  # noqa: E402


def load_text() -> torch.Tensor:
    """The bytes of CPython's documentation topics (about 0.47 MB of English), as int64 token ids."""
    import pydoc_data.topics
    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)


def batch(data: torch.Tensor, step: int, batch_size: int, seq: int) -> torch.Tensor:
    """The `step`-th batch ``[batch_size, seq]``: consecutive windows of the text, wrapping around."""
    starts = [((step * batch_size + b) * seq) % (data.numel() - seq) for b in range(batch_size)]
    return torch.stack([data[s:s + seq] for s in starts])


def make_model(layers: int, backend: str, seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device("cuda"):  # the same seed and device give every backend the same weights
        model = Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.set_experts_implementation(backend)
    return model.train()


def train(backend: str, label: str, args, data: torch.Tensor) -> dict:
    """Losses, step ms and peak memory of `args.steps` steps with experts `backend` (`label` in
    the progress line)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = make_model(args.layers, backend, args.seed)
    if args.compile:  # each decoder layer, as TorchTitan compiles its blocks
        for layer in model.model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup))
    batch_size = args.tokens // args.seq
    losses, times = [], []
    for step in range(args.steps):
        tokens = batch(data, step, batch_size, args.seq).cuda(non_blocking=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss  # (training: no KV cache)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        losses.append(loss.item())  # (synchronises: the same for every backend)
        times.append(start.elapsed_time(end))
        print(f"\r{label:<12} step {step + 1:>4}/{args.steps}  loss {losses[-1]:.4f}  {times[-1]:7.1f} ms",
              end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    gc.collect()
    return {"losses": losses, "times": times, "peak": peak}


def logged(losses: list, every: int) -> list:
    """The mean loss of each full window of `every` steps (what a trainer logs every `every` steps)."""
    return [statistics.fmean(losses[i:i + every]) for i in range(0, len(losses) - every + 1, every)]


def max_relative_diff(values: list, base: list) -> float:
    """NaN when there is nothing to compare (fewer steps than a logged window)."""
    return max((abs(a - b) / abs(b) for a, b in zip(values, base)), default=float("nan"))


def plot(results: dict, path: str, every: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for backend, r in results.items():
        line, = loss_ax.plot(range(1, len(r["losses"]) + 1), r["losses"], linewidth=0.6, alpha=0.6)
        means = logged(r["losses"], every)
        loss_ax.plot([every * (i + 1) for i in range(len(means))], means, "o-", color=line.get_color(),
                     markersize=3, label=f"{backend} (mean of {every})")
        time_ax.plot(range(2, len(r["times"]) + 1), r["times"][1:], label=backend)
    loss_ax.set(xlabel="step", ylabel="training loss", title="loss")
    time_ax.set(xlabel="step", ylabel="ms per step (forward, backward, AdamW)", title="step time (first step left out)")
    for ax in (loss_ax, time_ax):
        ax.legend()
    fig.suptitle(f"Qwen3-MoE, 30B-A3B MoE shape, on {torch.cuda.get_device_name()}")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (divides --tokens)")
    parser.add_argument("--backends", default="grouped_mm,megamoe",
                        help="experts backends, the first is the baseline: megamoe, megamoe_fp8 or one of transformers' "
                             "(grouped_mm, eager, batched_mm); one named twice runs twice (name#2), its spread against itself")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate, after a linear warm-up")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10, help="steps a logged loss averages")
    parser.add_argument("--plot", default="train_moe.png")
    parser.add_argument("--json", default=None, help="write each backend's per-step losses and step times here")
    parser.add_argument("--compile", action="store_true",
                        help="each backend's decoder layers under torch.compile (the first step, which compiles, is left out as always)")
    parser.add_argument("--fp8-weight-copies", default="per_step", choices=("per_step", "per_call", "per_gemm"),
                        help="how long megamoe_fp8's FP8 weight copies live (deep_gemm.Fp8WeightCopies)")
    args = parser.parse_args()
    require_sm90("train_moe.py")
    if args.tokens % args.seq:
        sys.exit(f"--tokens {args.tokens} is not a multiple of --seq {args.seq}")
    if args.log_every < 1:
        sys.exit(f"--log-every must be at least 1, got {args.log_every}")
    import megamoe_bwd.integrations.transformers  # noqa: F401  (registers "megamoe" and "megamoe_fp8")
    import deep_gemm
    deep_gemm.set_fp8_weight_copies(deep_gemm.Fp8WeightCopies(args.fp8_weight_copies))

    data = load_text()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  text: {data.numel()} bytes (pydoc_data)")
    results, runs = {}, collections.Counter()
    for backend in args.backends.split(","):
        # a backend named again runs again, as "name#2": its spread against itself (nondeterministic kernels)
        runs[backend] += 1
        label = backend if runs[backend] == 1 else f"{backend}#{runs[backend]}"
        wall = time.perf_counter()
        results[label] = train(backend, label, args, data)
        results[label]["wall"] = time.perf_counter() - wall
    base = args.backends.split(",")[0]
    base_median = statistics.median(results[base]["times"][1:])
    width = max(12, *map(len, results))
    lines = [f"{'backend':<{width}} {'tokens/s':>9} {'median ms':>10} {'min':>8} {'max':>8} {'first ms':>9} {'peak GB':>8} "
             f"{'speed':>6} {'final loss':>10} {'max step diff':>13} {'max logged diff':>15}"]
    for backend, r in results.items():
        median = statistics.median(r["times"][1:])
        diff = max_relative_diff(r["losses"], results[base]["losses"])
        logged_diff = max_relative_diff(logged(r["losses"], args.log_every), logged(results[base]["losses"], args.log_every))
        lines.append(f"{backend:<{width}} {args.tokens / median * 1e3:>9.0f} {median:>10.1f} {min(r['times'][1:]):>8.1f} "
                     f"{max(r['times'][1:]):>8.1f} {r['times'][0]:>9.1f} {r['peak'] / 2**30:>8.2f} "
                     f"{base_median / median:>5.2f}x {r['losses'][-1]:>10.4f} {100 * diff:>12.2f}% {100 * logged_diff:>14.2f}%")
    print(f"{args.layers} layers, {args.tokens} tokens per step ({args.tokens // args.seq} x {args.seq}), {args.steps} "
          f"steps{', torch.compile' if args.compile else ', eager'}; max step / logged diff: the largest relative difference from {base}'s loss at any step / "
          f"in any mean of {args.log_every} steps")
    print("\n".join(lines))
    if args.plot:
        plot(results, args.plot, args.log_every)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({label: {"losses": r["losses"], "step_ms": r["times"], "peak_bytes": r["peak"]}
                       for label, r in results.items()}, f)


if __name__ == "__main__":
    main()
