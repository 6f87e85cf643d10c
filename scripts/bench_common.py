"""What the benchmark and check scripts share: the standard MoE shapes and the GPU check."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

if TYPE_CHECKING:
    from deep_gemm.testing import SustainedTiming

MODELS = {  # name: (H, I, E, top-k, tokens per rank)
    "30b": (2048, 768, 128, 8, 16384),  # Qwen3-30B-A3B
    "235b": (4096, 1536, 128, 8, 16384),  # Qwen3-235B-A22B
    "v3": (7168, 2048, 256, 8, 8192),  # DeepSeek-V3
}


def require_sm90(script: str, num_gpus: int = 1) -> None:
    """Exits with one line on stderr (status 1) unless `num_gpus` Hopper GPUs (sm_90) are there."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < num_gpus:
        sys.exit(f"{script} needs {num_gpus} NVIDIA Hopper GPU{'s' if num_gpus > 1 else ''} (sm_90: H100, H200); "
                 f"{'this machine has no CUDA device' if found == 0 else f'found {found}'}")
    for i in range(num_gpus):
        if torch.cuda.get_device_capability(i) != (9, 0):
            major, minor = torch.cuda.get_device_capability(i)
            sys.exit(f"{script} needs NVIDIA Hopper GPUs (sm_90); GPU {i} is {torch.cuda.get_device_name(i)} "
                     f"(sm_{major}{minor})")


def import_deep_gemm(directory: str, name: str):
    """The `deep_gemm` package of the checkout at `directory`, imported as module `name`, so that it
    lives beside ours in one process (its modules import each other relatively)."""
    root = Path(directory).resolve() / "deep_gemm"
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_upstream_deep_gemm(directory: str):
    """Upstream DeepGEMM's package from `directory` (a checkout built in place by its develop.sh,
    e.g. one patched by scripts/apply_patches.sh), as `upstream_deep_gemm`."""
    return import_deep_gemm(directory, "upstream_deep_gemm")


def timed_in_rotation(fns: Sequence[Optional[Callable[[], object]]], rounds: int,
                      sustained: Optional[float] = None) -> list[list[SustainedTiming]]:
    """Times each of `fns` once a round for `rounds` rounds, round r starting at ``fns[r % n]`` and
    going round the list, so that slow drifts of the GPU's clock (the power cap setting in) hit every
    side alike; with `rounds` a multiple of n, each side takes each place in the order equally often.
    A round times a side by `sustained_ms(fn, sustained)`, or without `sustained` by a burst
    (`bench_ms(fn, warmup=2, iters=10)`, clock and power None). Returns each side's timings in round
    order; a None in `fns` is skipped (its list stays empty). (Here, not in `deep_gemm.testing`:
    `device_ab.sh` runs these scripts against older checkouts' libraries.)"""
    from deep_gemm.testing import SustainedTiming, bench_ms, sustained_ms  # (the caller's deep_gemm, imported first)

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    timings: list[list[SustainedTiming]] = [[] for _ in fns]
    for r in range(rounds):
        for i in range(len(fns)):
            side = (r + i) % len(fns)
            fn = fns[side]
            if fn is not None:
                timings[side].append(sustained_ms(fn, sustained) if sustained
                                     else SustainedTiming(bench_ms(fn, warmup=2, iters=10), None, None))
    return timings
