"""Grouped GEMMs of the standard MoE shapes: ours vs torch._grouped_mm, measured in one run.

For each model (the standard shapes of docs/DESIGN.md) and routing (uniform, skewed), the six
grouped GEMMs of one MoE layer's training step:
    fwd1   x @ l1[e].T        m-grouped nt   N = 2I, K = H
           ("fwd1 gather": x's rows gathered by our loads vs index_select + torch._grouped_mm;
            "fwd1 swiglu": with act = silu(gate) * up in our epilogue vs torch's elementwise ops)
    fwd2   a @ l2[e].T        m-grouped nt   N = H,  K = I
    dgrad1 dz @ l1[e]         m-grouped nn   N = H,  K = 2I
    dgrad2 dy @ l2[e]         m-grouped nn   N = I,  K = H
    wgrad1 dz.T @ x           k-grouped tn   [E, 2I, H]
    wgrad2 dy.T @ a           k-grouped tn   [E, H, I]
Both sides write bf16. "wgrad1 fp32" and "wgrad2 fp32" time our fp32 weight-gradient output
against torch's bf16 GEMM plus the copy into an fp32 tensor (torch's grouped GEMM has no fp32
output); the "wgrad1" and "wgrad2" rows of the same run have torch's bf16 GEMM alone.
Times are medians of CUDA-event timings with the L2 flushed before each run, ours and
torch's interleaved in rounds, each round starting one side later, so clock drift hits both alike.

`--precision fp8` times the blockwise-FP8 GEMMs of the same six (weight gradients with bf16
output, as the layer writes them for bf16 parameters, and with fp32 output) on operands quantized
beforehand (scripts/bench_fp8_quant.py times the quantization),
against our bf16 GEMM of the same shape and torch._scaled_grouped_mm with rowwise e4m3 scales
and fast accumulation, all three in one run. torch's weight-gradient form refuses empty groups
and groups that are not multiples of 16, so it gets every group padded with zero rows to a
multiple of 16 (at least 16); its TFLOPS count our unpadded FLOPs. It writes bf16 only (it refuses
other output dtypes), so on the fp32 weight-gradient rows "ratio" sets our fp32 output against its
bf16 one, which writes half the bytes, and "+fp32" against its bf16 output copied into an fp32
gradient (timed in the same rounds as ours and its GEMM alone), as the bf16 table's fp32 rows time
torch._grouped_mm. Errors: against the fp32
product of the original bf16 operands (weight gradients: over the first four groups).
`--upstream DIR` (a DeepGEMM checkout built in place) adds upstream's FP8 m-grouped GEMM to the
forward and data-gradient rows, on groups padded to its alignment with its own casts (per token
1 x 128, per block 128 x 128): what its users must do; its TFLOPS count our unpadded FLOPs too.
On the fp32 weight-gradient rows it adds upstream's k-grouped FP8 GEMM (groups padded to 128,
per-channel casts, each group's operands K-major; it accumulates into its fp32 output, which it
thus reads as well, and takes the group sizes on the host every call).

    python scripts/bench_gemm.py [--models 30b,235b,v3] [--sweep] [--launch-overhead] [--only wgrad1,fwd1]
                                 [--precision bf16,fp8] [--upstream DEEPGEMM_DIR] [--sustained SECONDS]

`--sustained SECONDS` times every side over SECONDS of back-to-back calls a round
(`deep_gemm.testing.sustained_ms`, no L2 flush) instead of bursts: the power-capped steady state
a training step runs its GEMMs in (docs/PERF.md, "Decisions": decide in the steady state).

It uses the public GEMM functions only, so it also times another checkout of the library on
the same terms (an A/B: put this script in that checkout's scripts/). Needs a Hopper GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from bench_common import MODELS, load_upstream_deep_gemm, require_sm90, timed_in_rotation  # noqa: E402
from deep_gemm.gemm import k_grouped_bf16, m_grouped_bf16  # noqa: E402
from deep_gemm.quant import fp8_quantize_columns, fp8_quantize_rows, fp8_quantize_weights  # noqa: E402
from deep_gemm.testing import (offsets_from_sizes, random_group_sizes, relative_error,  # noqa: E402
                               upper_median, warm_up_gpu)
from deep_gemm.testing.fp8_baseline import quantize_rowwise, torch_fp8_rowwise_wgrad  # noqa: E402


def gemm_cases(hidden: int, inter: int):
    """(label, kind, N, K, output dtype) for m-grouped and (label, kind, M, N, output dtype) for k-grouped."""
    bf16, fp32 = torch.bfloat16, torch.float32
    return [
        ("fwd1", "nt", 2 * inter, hidden, bf16),
        ("fwd2", "nt", hidden, inter, bf16),
        ("dgrad1", "nn", hidden, 2 * inter, bf16),
        ("dgrad2", "nn", inter, hidden, bf16),
        ("wgrad1", "tn", 2 * inter, hidden, bf16),
        ("wgrad2", "tn", hidden, inter, bf16),
        ("fwd1 gather", "ntg", 2 * inter, hidden, bf16),
        ("fwd1 swiglu", "nts", 2 * inter, hidden, bf16),
        ("wgrad1 fp32", "tn", 2 * inter, hidden, fp32),
        ("wgrad2 fp32", "tn", hidden, inter, fp32),
    ]


def all_cases(models: str, routings: str, gen: torch.Generator):
    """Every (model, routing, group sizes, case of `gemm_cases`) of the comma-separated lists."""
    for model in models.split(","):
        hidden, inter, experts, topk, tokens = MODELS[model]
        for routing in routings.split(","):
            sizes = random_group_sizes(tokens * topk, experts, routing, max_size=tokens, generator=gen)
            for case in gemm_cases(hidden, inter):
                yield model, routing, sizes, case


def run_case(kind, d1, d2, sizes, out_dtype=torch.bfloat16, sweep=False, sustained: Optional[float] = None):
    """Returns (ours_ms, torch_ms, rel_err_ours_vs_torch, flops, {config: ms} when sweeping)."""
    rows, num_groups = sum(sizes), len(sizes)
    offsets = offsets_from_sizes(sizes)
    ends = offsets[1:].contiguous()
    if kind == "ntg":  # rows gathered from 1/8 as many tokens: ours in the loads, torch by a copy
        n, k = d1, d2
        source = torch.randn(max(rows // 8, 1), k, device="cuda", dtype=torch.bfloat16)
        index = torch.randint(0, source.shape[0], (rows,), device="cuda")
        b = torch.randn(num_groups, n, k, device="cuda", dtype=torch.bfloat16)
        d = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        ours = lambda config=None: deep_gemm.m_grouped_bf16_gemm_nt_contiguous(  # noqa: E731
            source, b, d, offsets, a_row_index=index, config=config)
        configs = m_grouped_bf16.all_configs()
        theirs = lambda: torch._grouped_mm(source.index_select(0, index), b.transpose(1, 2), offs=ends)  # noqa: E731
        flops = 2 * rows * n * k
    elif kind == "nts":  # the MoE's first GEMM: h and act = silu(gate) * up
        n, k = d1, d2
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(num_groups, n, k, device="cuda", dtype=torch.bfloat16)
        d = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        act = torch.empty(rows, n // 2, device="cuda", dtype=torch.bfloat16)
        ours = lambda: deep_gemm.m_grouped_bf16_gemm_nt_swiglu_contiguous(a, b, d, act, offsets)  # noqa: E731
        configs = []  # one variant

        def theirs():
            h = torch._grouped_mm(a, b.transpose(1, 2), offs=ends)
            gate, up = h.chunk(2, dim=-1)
            torch.nn.functional.silu(gate) * up
            return h
        flops = 2 * rows * n * k
    elif kind in ("nt", "nn"):
        n, k = d1, d2
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(num_groups, *((n, k) if kind == "nt" else (k, n)), device="cuda", dtype=torch.bfloat16)
        d = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        fn = deep_gemm.m_grouped_bf16_gemm_nt_contiguous if kind == "nt" else deep_gemm.m_grouped_bf16_gemm_nn_contiguous
        ours = lambda config=None: fn(a, b, d, offsets, config=config)  # noqa: E731
        configs = m_grouped_bf16.all_configs()
        b_torch = b.transpose(1, 2) if kind == "nt" else b
        theirs = lambda: torch._grouped_mm(a, b_torch, offs=ends)  # noqa: E731
        flops = 2 * rows * n * k
    else:
        m, n = d1, d2
        a = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        d = torch.empty(num_groups, m, n, device="cuda", dtype=out_dtype)
        ours = lambda config=None: deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, b, d, offsets, config=config)  # noqa: E731
        configs = k_grouped_bf16.all_configs(out_dtype)
        a_t = a.t()
        if out_dtype == torch.bfloat16:
            theirs = lambda: torch._grouped_mm(a_t, b, offs=ends)  # noqa: E731
        else:  # torch's grouped GEMM has no fp32 output: its bf16 one, copied into an fp32 gradient
            d_torch = torch.empty_like(d)
            theirs = lambda: d_torch.copy_(torch._grouped_mm(a_t, b, offs=ends))  # noqa: E731
        flops = 2 * rows * m * n
    ours()
    try:
        ref = theirs()
    except Exception as e:  # a torch version without this layout: report, keep going
        print(f"torch._grouped_mm failed for {kind}: {e}", flush=True)
        ref, theirs = None, None
    # Error on a slice: the full fp64 copies of the largest outputs would not fit in memory.
    err = (relative_error(d.flatten()[:1 << 24].float(), ref.flatten()[:1 << 24].float())
           if ref is not None and ref.shape == d.shape else float("nan"))
    ours_ms, torch_ms = interleaved_ms(ours, theirs, sustained=sustained)
    swept = {c: interleaved_ms(lambda c=c: ours(c), sustained=sustained)[0] for c in configs} if sweep else {}
    return ours_ms, torch_ms, err, flops, swept


FP8_CASES = ("fwd1", "fwd2", "dgrad1", "dgrad2", "wgrad1", "wgrad2", "wgrad1 fp32", "wgrad2 fp32")


def _sliced_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """relative_error on the first 16M elements (fp64 copies of the largest outputs would not fit)."""
    return relative_error(out.flatten()[:1 << 24].float(), ref.flatten()[:1 << 24].float())


def _upstream_m_grouped(upstream, x: torch.Tensor, b_nk: torch.Tensor, sizes: list[int]):
    """Upstream DeepGEMM's FP8 ``D = A @ B[g].T`` on our problem, set up as its users must: every
    group padded with zero rows to its alignment (``m_indices`` -1 there), its own casts."""
    upstream.set_mk_alignment_for_contiguous_layout(upstream.get_theoretical_mk_alignment_for_contiguous_layout())
    align = upstream.get_mk_alignment_for_contiguous_layout()
    padded = [-(-s // align) * align for s in sizes]
    a = x.new_zeros(sum(padded), x.shape[1])
    m_indices = torch.full((sum(padded),), -1, dtype=torch.int32, device=x.device)
    src = dst = 0
    for g, (s, p) in enumerate(zip(sizes, padded)):
        a[dst:dst + s], m_indices[dst:dst + s] = x[src:src + s], g
        src, dst = src + s, dst + p
    a_fp8 = upstream.per_token_cast_to_fp8(a, use_ue8m0=False)
    blocks = [upstream.per_block_cast_to_fp8(b_nk[g], use_ue8m0=False) for g in range(b_nk.shape[0])]
    b_fp8 = (torch.stack([q for q, _ in blocks]), torch.stack([sf for _, sf in blocks]))
    d = torch.empty(sum(padded), b_nk.shape[1], device=x.device, dtype=torch.bfloat16)
    return lambda: upstream.m_grouped_fp8_fp4_gemm_nt_contiguous(a_fp8, b_fp8, d, m_indices, disable_ue8m0_cast=True)


def _upstream_k_grouped(upstream, a: torch.Tensor, b: torch.Tensor, sizes: list[int]):
    """Upstream DeepGEMM's FP8 weight gradient ``D[g] = C[g] + A[g].T @ B[g]`` (fp32; its Hopper
    form has no overwrite, so C = D and every call reads D too) on our problem, set up as its users
    must: every group padded with zero rows to 128, its own per-channel casts (128 x 1), each
    group's operand K-major and contiguous; ``ks`` on the host, as its Hopper form asks."""
    padded = [-(-s // 128) * 128 for s in sizes]

    def operand(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data, scales, src = [], [], 0
        for s, p in zip(sizes, padded):
            if p:
                group = x.new_zeros(p, x.shape[1])
                group[:s] = x[src:src + s]
                q, sf = upstream.per_channel_cast_to_fp8(group, use_ue8m0=False)
                data.append(q.T.contiguous().flatten())
                scales.append(sf)
            src += s
        return torch.cat(data), torch.cat(scales).T

    a_fp8, b_fp8 = operand(a), operand(b)
    d = torch.zeros(len(sizes), a.shape[1], b.shape[1], device=a.device, dtype=torch.float32)
    ks = torch.tensor(padded, dtype=torch.int32, device=a.device)
    return lambda: upstream.k_grouped_fp8_gemm_nt_contiguous(a_fp8, b_fp8, d, padded, ks, d)


def run_fp8_case(label: str, d1: int, d2: int, sizes: list[int], out_dtype: torch.dtype, upstream=None,
                 sustained: Optional[float] = None) -> dict:
    """ms of ours (FP8), our bf16 GEMM, torch's FP8 rowwise GEMM and (with `upstream`: m-grouped,
    and the fp32 weight gradients) upstream DeepGEMM's, FLOPs, and the two FP8 errors against the
    fp32 product of the bf16 operands; `out_dtype`: the weight gradients' output (the m-grouped
    GEMMs write bf16)."""
    upstream_fn = theirs_fp32 = None
    rows, num_groups = sum(sizes), len(sizes)
    offsets = offsets_from_sizes(sizes)
    if label.startswith("wgrad"):
        m, n = d1, d2
        a = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        (_, qa), (_, qb) = fp8_quantize_columns(a, offsets), fp8_quantize_columns(b, offsets)
        d = torch.empty(num_groups, m, n, device="cuda", dtype=out_dtype)
        d_bf16 = torch.empty_like(d)  # (our bf16 GEMM, the same output dtype)
        ours = lambda: deep_gemm.k_grouped_fp8_gemm_tn_contiguous((qa.data, qa.scales), (qb.data, qb.scales), d,  # noqa: E731
                                                                  qa.padded_offsets)
        bf16 = lambda: deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, b, d_bf16, offsets)  # noqa: E731
        theirs, _ = torch_fp8_rowwise_wgrad(a, b, sizes)
        if out_dtype == torch.float32:  # torch's FP8 grouped GEMM writes bf16 alone: its output copied into fp32 too
            d_torch = torch.empty_like(d)
            theirs_fp32 = lambda: d_torch.copy_(theirs())  # noqa: E731
        bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))[:4]  # errors over the first 4 groups
        exact = lambda: torch.stack([a[lo:hi].float().T @ b[lo:hi].float() for lo, hi in bounds])  # noqa: E731
        theirs_out = lambda: theirs()[:4]  # noqa: E731
        out = lambda: d[:4]  # noqa: E731
        flops = 2 * rows * m * n
        if upstream is not None and out_dtype == torch.float32:
            upstream_fn = _upstream_k_grouped(upstream, a, b, sizes)
    else:
        n, k = d1, d2
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        forward = label.startswith("fwd")
        # b as the GEMM reads it: [G, N, K] (the forward's weights, or the data gradient's transposed copy)
        w = torch.randn(num_groups, *((n, k) if forward else (k, n)), device="cuda", dtype=torch.bfloat16) / k**0.5
        qx, qw = fp8_quantize_rows(x), fp8_quantize_weights(w)
        b_fp8 = (qw.data, qw.scales) if forward else qw.transposed_operand()
        b_nk = w if forward else w.transpose(1, 2).contiguous()
        d, d_bf16 = (torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ours = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous((qx.data, qx.scales), b_fp8, d, offsets)  # noqa: E731
        bf16_fn = deep_gemm.m_grouped_bf16_gemm_nt_contiguous if forward else deep_gemm.m_grouped_bf16_gemm_nn_contiguous
        bf16 = lambda: bf16_fn(x, w, d_bf16, offsets)  # noqa: E731
        qa, sa = quantize_rowwise(x)
        qb, sb = quantize_rowwise(b_nk)
        ends = offsets[1:].contiguous()
        theirs = lambda: torch._scaled_grouped_mm(qa, qb.transpose(-2, -1), sa, sb, offs=ends,  # noqa: E731
                                                  out_dtype=torch.bfloat16, use_fast_accum=True)
        exact = lambda: torch.cat([x[lo:hi].float() @ b_nk[g].float().T  # noqa: E731
                                   for g, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))])
        theirs_out, out = theirs, (lambda: d)
        flops = 2 * rows * n * k
        if upstream is not None:
            upstream_fn = _upstream_m_grouped(upstream, x, b_nk, sizes)
    ours()
    ref = exact()
    err = _sliced_error(out(), ref)
    try:
        torch_err = _sliced_error(theirs_out(), ref)
    except Exception as e:  # a torch version without this layout: report, keep going
        print(f"torch._scaled_grouped_mm failed for {label}: {e}", flush=True)
        theirs, torch_err = None, float("nan")
    del ref
    ours_ms, torch_ms, torch_fp32_ms = interleaved_ms(ours, theirs, theirs_fp32 if theirs else None, sustained=sustained)
    bf16_ms, = interleaved_ms(bf16, sustained=sustained)
    upstream_ms = float("nan")
    if upstream_fn is not None:
        try:
            upstream_ms, = interleaved_ms(upstream_fn, sustained=sustained)
        except Exception as e:  # report, keep going
            print(f"upstream DeepGEMM failed for {label}: {e}", flush=True)
    return dict(ours=ours_ms, bf16=bf16_ms, torch=torch_ms, torch_fp32=torch_fp32_ms, upstream=upstream_ms, flops=flops,
                err=err, torch_err=torch_err)


def interleaved_ms(*fns, rounds: int = 3, sustained: Optional[float] = None) -> list[float]:
    """Each of `fns`' median over `rounds` rounds, the sides timed in rotation (`timed_in_rotation`:
    each round starts one side later), so that slow drifts of the GPU's clock hit all alike (NaN
    for a None). Bursts, or with `sustained`, that many seconds of back-to-back calls a round."""
    return [upper_median(t.ms for t in timings) for timings in timed_in_rotation(fns, rounds, sustained)]


def launch_overhead_us() -> tuple[float, float]:
    """Host time per call of a tiny cached GEMM, ours and torch._grouped_mm."""
    a = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 128, 128, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(256, 128, device="cuda", dtype=torch.bfloat16)
    offsets = offsets_from_sizes([100, 156])
    ends = offsets[1:].contiguous()
    results = []
    for fn in (lambda: deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, offsets),
               lambda: torch._grouped_mm(a, b.transpose(1, 2), offs=ends)):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(2000):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        results.append(elapsed / 2000 * 1e6)
    return results[0], results[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="30b,235b,v3")
    parser.add_argument("--routing", default="uniform,skewed")
    parser.add_argument("--sweep", action="store_true", help="also time every kernel variant (config)")
    parser.add_argument("--launch-overhead", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="comma-separated GEMM labels to run (e.g. wgrad1), for profilers")
    parser.add_argument("--precision", default="bf16", help="bf16 (ours vs torch._grouped_mm), fp8 (see above), or both")
    parser.add_argument("--upstream", default=None, help="an upstream DeepGEMM checkout built in place (fp8 rows)")
    parser.add_argument("--sustained", type=float, default=None, metavar="SECONDS",
                        help="time SECONDS of back-to-back calls a round (the power-capped steady state)")
    args = parser.parse_args()
    require_sm90("bench_gemm.py")
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    warm_up_gpu()
    lines = []
    if "bf16" in args.precision.split(","):
        header = (f"{'model':<5} {'route':<7} {'gemm':<12} {'shape (rows,N,K | M,N)':<24} {'ours ms':>8} {'TFLOPS':>7} "
                  f"{'torch ms':>9} {'TFLOPS':>7} {'ratio':>6} {'err':>8}")
        if args.sweep:
            header += "  sweep ms: config label (GemmConfig.label)"
        lines.append(header)
        print(header, flush=True)
        for model, routing, sizes, (label, kind, d1, d2, out_dtype) in all_cases(args.models, args.routing, gen):
            if args.only and label not in args.only.split(","):
                continue
            ours, theirs, err, flops, swept = run_case(kind, d1, d2, sizes, out_dtype, args.sweep, args.sustained)
            shape = f"{sum(sizes)},{d1},{d2}" if kind != "tn" else f"{d1},{d2}"
            line = (f"{model:<5} {routing:<7} {label:<12} {shape:<24} {ours:>8.3f} {flops / ours / 1e9:>7.0f} "
                    f"{theirs:>9.3f} {flops / theirs / 1e9:>7.0f} {theirs / ours:>6.2f} {err:>8.1e}")
            if swept:
                line += "  " + " ".join(f"{c.label}:{ms:.3f}" for c, ms in swept.items())
            lines.append(line)
            print(line, flush=True)
    if "fp8" in args.precision.split(","):
        upstream = load_upstream_deep_gemm(args.upstream) if args.upstream else None
        header = (f"{'model':<5} {'route':<7} {'fp8 gemm':<12} {'shape':<18} {'ours ms':>8} {'TFLOPS':>7} {'vs bf16':>7} "
                  f"{'torch fp8':>9} {'TFLOPS':>7} {'ratio':>6} {'+fp32':>6} {'err':>8} {'torch err':>9}"
                  + (f" {'DeepGEMM':>8} {'TFLOPS':>7} {'ratio':>6}" if upstream else ""))
        lines.append(header)
        print(header, flush=True)
        for model, routing, sizes, (label, kind, d1, d2, out_dtype) in all_cases(args.models, args.routing, gen):
            if label not in FP8_CASES or (args.only and label not in args.only.split(",")):
                continue
            r = run_fp8_case(label, d1, d2, sizes, out_dtype, upstream, args.sustained)
            shape = f"{sum(sizes)},{d1},{d2}" if kind != "tn" else f"{d1},{d2}"
            line = (f"{model:<5} {routing:<7} {label:<12} {shape:<18} {r['ours']:>8.3f} {r['flops'] / r['ours'] / 1e9:>7.0f} "
                    f"{r['bf16'] / r['ours']:>6.2f}x {r['torch']:>9.3f} {r['flops'] / r['torch'] / 1e9:>7.0f} "
                    f"{r['torch'] / r['ours']:>6.2f} {r['torch_fp32'] / r['ours']:>6.2f} {r['err']:>8.1e} {r['torch_err']:>9.1e}"
                    + (f" {r['upstream']:>8.3f} {r['flops'] / r['upstream'] / 1e9:>7.0f} {r['upstream'] / r['ours']:>6.2f}"
                       if upstream else ""))
            lines.append(line)
            print(line, flush=True)
    if args.launch_overhead:
        ours_us, torch_us = launch_overhead_us()
        lines.append(f"host launch overhead per call: ours {ours_us:.1f} us, torch._grouped_mm {torch_us:.1f} us")
        print(lines[-1])
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
