"""Compiles every kernel variant the launchers can pick, in parallel, so that first calls do not
wait for nvcc (a GPU session then spends no device time compiling):

    python -m deep_gemm.precompile [--jobs N]

Kernels land in the JIT cache (``$DG_JIT_CACHE_DIR``, default ``~/.deep_gemm``), keyed by their
source, the headers, the flags and the nvcc version. Needs nvcc, not a GPU.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from .gemm import k_grouped_bf16, k_grouped_fp8, m_grouped_bf16, m_grouped_fp8
from .jit.runtime import Kernel
from .moe import kernels as moe_kernels
from .moe import kernels_fp8 as moe_kernels_fp8
from .quant import kernels as quant_kernels


def all_kernels() -> list[tuple[str, Callable[[], Kernel]]]:
    """(label, builder) of every kernel variant the launchers can choose."""
    mg = m_grouped_bf16
    out = []
    for config in mg.all_configs():
        for layout, mn_major in (("nt", False), ("nn", True)):
            for rows, producer in (("", mg.TMA_ROWS), ("_gathered", mg.GATHERED_ROWS)):
                out.append((f"m_grouped_{layout}_{config.label}{rows}",
                            functools.partial(mg.get_kernel, config, mn_major, producer, mg.BF16_STORE)))
    for rows, producer in (("", mg.TMA_ROWS), ("_gathered", mg.GATHERED_ROWS)):
        out.append((f"m_grouped_nt_swiglu_{mg.SWIGLU_CONFIG.label}{rows}",
                    functools.partial(mg.get_kernel, mg.SWIGLU_CONFIG, False, producer, mg.SWIGLU_STORE)))
    seen = set()
    for dtype in (torch.float32, torch.bfloat16):
        for config in k_grouped_bf16.all_configs(dtype):
            for accumulate in (False, True):
                label = (f"k_grouped_{k_grouped_bf16.kernel_config(config, dtype, accumulate).label}_"
                         f"{str(dtype)[6:]}_{'acc' if accumulate else 'set'}")
                if label not in seen:  # bf16 accumulation runs one row-copy variant per tile width
                    seen.add(label)
                    out.append((label, functools.partial(k_grouped_bf16.get_kernel, config, dtype, accumulate)))
    out += [(f"m_grouped_fp8_nt{m_grouped_fp8.EPILOGUE_LABELS[epilogue]}_{m_grouped_fp8.CONFIGS[n].label}"
             f"{'' if producer == m_grouped_fp8.FP8_TMA_ROWS else '_gathered'}",
             functools.partial(m_grouped_fp8.get_kernel, producer, n, epilogue))
            for producer, n, epilogue in m_grouped_fp8.all_kernels()]
    out += [(f"k_grouped_fp8_{str(dtype)[6:]}_{'acc' if accumulate else 'set'}",
             functools.partial(k_grouped_fp8.get_kernel, dtype, accumulate)) for dtype, accumulate in k_grouped_fp8.all_kernels()]
    out += [(name, functools.partial(moe_kernels.get_kernel, name)) for name in moe_kernels.all_kernels()]
    out += [(f"moe_swiglu_bwd_fp8{'_pow2' if pow2 else ''}", functools.partial(moe_kernels_fp8.get_kernel, pow2))
            for pow2 in moe_kernels_fp8.all_kernels()]
    out += [(f"fp8_quantize_{name}{'_pow2' if pow2 else ''}", functools.partial(quant_kernels.get_kernel, name, pow2))
            for name, pow2 in quant_kernels.all_kernels()]
    return out


def resource_report(kernel: Kernel) -> dict:
    """ptxas' registers, spill and stack-frame bytes of a compiled kernel, and whether ptxas
    serialized its WGMMAs (its note C7520: each MMA then waits for the one before)."""
    log = (kernel.cubin.parent / "ptxas.log").read_text()
    return {
        "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill", log)),
        "stack_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes stack frame", log)),
        "serialized_wgmma": "(C7520)" in log,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="nvcc processes at once")
    args = parser.parse_args()
    kernels = all_kernels()
    print(f"compiling {len(kernels)} kernels with {args.jobs} jobs", flush=True)
    start = time.perf_counter()

    def build(item: tuple[int, tuple[str, Callable[[], Kernel]]]) -> None:
        i, (label, builder) = item
        report = resource_report(builder())
        print(f"[{i + 1}/{len(kernels)}] {label:<36} {report}", flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(build, enumerate(kernels)))
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
