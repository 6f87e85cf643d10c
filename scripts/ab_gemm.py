"""Grouped GEMMs of this checkout against another checkout's, in one process: the other
checkout's `deep_gemm` is imported under another name (the package imports itself only
relatively), and each case alternates the two, call for call, over many rounds, so that the
GPU's clock drifts hit both alike. The cases and inputs are `bench_gemm.py`'s. More checkouts
after BASE join the rotation (each round starts one tree later, and the rounds are rounded up to
a multiple of the trees, so that each tree takes each place in the order equally often), each
printed with its own time and ratio to BASE: several candidates in one run, and with BASE this
checkout's own kernels (a copy of it), new / base is the run's noise.

    python scripts/ab_gemm.py BASE_CHECKOUT [MORE_CHECKOUTS ...] [--models 30b,235b,v3] [--routing uniform,skewed]
                              [--rounds 10] [--precision bf16|fp8] [--only wgrad1,wgrad2] [--sustained SECONDS]

With `--precision fp8`, the blockwise-FP8 GEMMs of `bench_gemm.py --precision fp8` (the forward
and data gradients on m-grouped FP8, the weight gradients with bf16 and fp32 output on k-grouped
FP8) and the FP8 layer's variants of GEMM1's shape ("fwd1 gather": rows gathered from 1/8 as many
tokens; "fwd1 swiglu": SwiGLU with act written in e4m3; "fwd1 gather swiglu": both, the layer's
GEMM1), on operands this checkout quantizes once for both trees. Prints per case the medians (ms)
of each tree's per-round medians and new / base. With `--sustained SECONDS`, each round is SECONDS of
back-to-back calls (`deep_gemm.testing.sustained_ms`: the power-capped steady state a training
step runs in), and the rows add each tree's SM clock and power. Needs a Hopper GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from bench_common import import_deep_gemm, require_sm90, timed_in_rotation  # noqa: E402
from bench_gemm import FP8_CASES, all_cases  # noqa: E402
from deep_gemm.quant import empty_fp8_rows, fp8_quantize_columns, fp8_quantize_rows, fp8_quantize_weights  # noqa: E402
from deep_gemm.testing import offsets_from_sizes, warm_up_gpu  # noqa: E402


# The FP8 layer's forms of GEMM1's shape (rows gathered, SwiGLU with an e4m3 act, both), timed beside
# bench_gemm.py's FP8 cases.
FWD1_VARIANTS = ("fwd1 gather", "fwd1 swiglu", "fwd1 gather swiglu")


def make_call(lib, kind: str, d1: int, d2: int, sizes: list, out_dtype: torch.dtype, inputs: dict):
    """One GEMM of `bench_gemm.py`'s case through library `lib`, on shared inputs."""
    rows, num_groups = sum(sizes), len(sizes)
    if "offsets" not in inputs:
        inputs["offsets"] = offsets_from_sizes(sizes)
        if kind in ("nt", "nts", "ntg", "nn"):
            n, k = d1, d2
            inputs["a"] = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            inputs["b"] = torch.randn(num_groups, *((k, n) if kind == "nn" else (n, k)), device="cuda",
                                      dtype=torch.bfloat16)
            inputs["d"] = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            inputs["act"] = torch.empty(rows, n // 2, device="cuda", dtype=torch.bfloat16)
            inputs["source"] = torch.randn(max(rows // 8, 1), k, device="cuda", dtype=torch.bfloat16)
            inputs["index"] = torch.randint(0, inputs["source"].shape[0], (rows,), device="cuda")
        else:
            inputs["a"] = torch.randn(rows, d1, device="cuda", dtype=torch.bfloat16)
            inputs["b"] = torch.randn(rows, d2, device="cuda", dtype=torch.bfloat16)
            inputs["d"] = torch.empty(num_groups, d1, d2, device="cuda", dtype=out_dtype)
    a, b, d, offsets = inputs["a"], inputs["b"], inputs["d"], inputs["offsets"]
    if kind == "nt":
        return lambda: lib.m_grouped_bf16_gemm_nt_contiguous(a, b, d, offsets)
    if kind == "nn":
        return lambda: lib.m_grouped_bf16_gemm_nn_contiguous(a, b, d, offsets)
    if kind == "nts":
        return lambda: lib.m_grouped_bf16_gemm_nt_swiglu_contiguous(a, b, d, inputs["act"], offsets)
    if kind == "ntg":
        return lambda: lib.m_grouped_bf16_gemm_nt_contiguous(inputs["source"], b, d, offsets, a_row_index=inputs["index"])
    return lambda: lib.k_grouped_bf16_gemm_tn_contiguous(a, b, d, offsets)


def make_fp8_call(lib, label: str, d1: int, d2: int, sizes: list, out_dtype: torch.dtype, inputs: dict):
    """One FP8 GEMM of `bench_gemm.py`'s FP8 case `label` through library `lib`, on shared inputs
    (`out_dtype`: the weight gradients' output)."""
    rows, num_groups = sum(sizes), len(sizes)
    if "offsets" not in inputs:
        inputs["offsets"] = offsets = offsets_from_sizes(sizes)
        if label.startswith("wgrad"):
            (_, inputs["a"]), (_, inputs["b"]) = (fp8_quantize_columns(torch.randn(rows, dim, device="cuda",
                                                                                  dtype=torch.bfloat16), offsets)
                                                  for dim in (d1, d2))
            inputs["d"] = torch.empty(num_groups, d1, d2, device="cuda", dtype=out_dtype)
        else:
            n, k = d1, d2
            forward = label.startswith("fwd")
            gather, swiglu = label in ("fwd1 gather", "fwd1 gather swiglu"), label.endswith("swiglu")
            a_rows = max(rows // 8, 1) if gather else rows
            inputs["a"] = fp8_quantize_rows(torch.randn(a_rows, k, device="cuda", dtype=torch.bfloat16))
            if gather:
                inputs["index"] = torch.randint(0, a_rows, (rows,), device="cuda")
            if swiglu:
                inputs["act"] = empty_fp8_rows(rows, n // 2, "cuda")
            w = fp8_quantize_weights(torch.randn(num_groups, *((n, k) if forward else (k, n)), device="cuda",
                                                 dtype=torch.bfloat16) / k**0.5)
            inputs["b"] = (w.data, w.scales) if forward else w.transposed_operand()
            inputs["d"] = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    a, b, d, offsets = inputs["a"], inputs["b"], inputs["d"], inputs["offsets"]
    if label.startswith("wgrad"):
        return lambda: lib.k_grouped_fp8_gemm_tn_contiguous((a.data, a.scales), (b.data, b.scales), d, a.padded_offsets)
    index = inputs.get("index")
    if label.endswith("swiglu"):
        act = inputs["act"]
        return lambda: lib.m_grouped_fp8_gemm_nt_swiglu_contiguous((a.data, a.scales), b, d, (act.data, act.scales),
                                                                   offsets, a_row_index=index)
    return lambda: lib.m_grouped_fp8_gemm_nt_contiguous((a.data, a.scales), b, d, offsets, a_row_index=index)


def _cases(models: str, routings: str, gen: torch.Generator, precision: str):
    """`bench_gemm.all_cases`, and in FP8 the layer's GEMM1 ("fwd1 gather swiglu") after "fwd1 swiglu"."""
    for model, routing, sizes, case in all_cases(models, routings, gen):
        yield model, routing, sizes, case
        if precision == "fp8" and case[0] == "fwd1 swiglu":
            yield model, routing, sizes, ("fwd1 gather swiglu", *case[1:])


def _median_or_nan(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("more", nargs="*", help="more checkouts, each timed against BASE in the same rounds")
    parser.add_argument("--models", default="30b,235b,v3")
    parser.add_argument("--routing", default="uniform,skewed")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp8"))
    parser.add_argument("--only", default=None, help="comma-separated prefixes of the GEMM labels to run (e.g. wgrad)")
    parser.add_argument("--sustained", type=float, default=None, metavar="SECONDS",
                        help="time each round as SECONDS of back-to-back calls (`sustained_ms`), with clocks and power")
    args = parser.parse_args()
    only = tuple(args.only.split(",")) if args.only else ("",)
    require_sm90("ab_gemm.py")
    libs = {"new": deep_gemm, "base": import_deep_gemm(args.base, "deep_gemm_base")}
    for i, directory in enumerate(args.more):
        name = os.path.basename(os.path.normpath(directory))
        while name in libs:
            name += "'"
        libs[name] = import_deep_gemm(directory, f"deep_gemm_more{i}")
    more = list(libs)[2:]
    rounds = -(-args.rounds // len(libs)) * len(libs)
    if rounds != args.rounds:
        print(f"(rounds {args.rounds} -> {rounds}: a multiple of the {len(libs)} trees)")
    gen = torch.Generator().manual_seed(args.seed)
    warm_up_gpu()
    clocks = f" {'base MHz':>8} {'new MHz':>8} {'base W':>6} {'new W':>6}" if args.sustained else ""
    width = max([9] + [len(name) + 5 for name in more])
    extra = ("ms", "/base", "MHz", "W") if args.sustained else ("ms", "/base")
    columns = "".join(f" {name + (' ' if part[0] != '/' else '') + part:>{width}}" for name in more for part in extra)
    print(f"{'model':<5} {'route':<7} {'gemm':<12} {'base ms':>8} {'new ms':>8} {'new/base':>8}{clocks}{columns}",
          flush=True)
    worst = {name: 0.0 for name in libs if name != "base"}
    for model, routing, sizes, (label, kind, d1, d2, out_dtype) in _cases(args.models, args.routing, gen, args.precision):
        if args.precision == "fp8" and label not in FP8_CASES + FWD1_VARIANTS:
            continue
        if not label.startswith(only):
            continue
        inputs: dict = {}
        if args.precision == "fp8":
            calls = {name: make_fp8_call(lib, label, d1, d2, sizes, out_dtype, inputs) for name, lib in libs.items()}
        else:
            calls = {name: make_call(lib, kind, d1, d2, sizes, out_dtype, inputs) for name, lib in libs.items()}
        runs = dict(zip(libs, timed_in_rotation([calls[name] for name in libs], rounds, args.sustained)))
        ms = {name: statistics.median(t.ms for t in runs[name]) for name in libs}
        mhz = {name: _median_or_nan(t.sm_mhz for t in runs[name]) for name in libs}
        watts = {name: _median_or_nan(t.watts for t in runs[name]) for name in libs}
        b, n = ms["base"], ms["new"]
        for name in worst:
            worst[name] = max(worst[name], ms[name] / b)
        line = f"{model:<5} {routing:<7} {label:<12} {b:>8.3f} {n:>8.3f} {n / b:>8.3f}"
        if args.sustained:
            line += f" {mhz['base']:>8.0f} {mhz['new']:>8.0f} {watts['base']:>6.0f} {watts['new']:>6.0f}"
        for name in more:
            line += f" {ms[name]:>{width}.3f} {ms[name] / b:>{width}.3f}"
            if args.sustained:
                line += f" {mhz[name]:>{width}.0f} {watts[name]:>{width}.0f}"
        print(line, flush=True)
        del inputs, calls
        torch.cuda.empty_cache()
    print("worst against base: " + ", ".join(f"{name} {ratio:.3f}" for name, ratio in worst.items()))


if __name__ == "__main__":
    main()
