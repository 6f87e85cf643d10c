from typing import Callable

import torch


def bench_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 20, flush_l2: bool = True) -> float:
    """Median milliseconds of `fn` over `iters` runs timed with CUDA events, after `warmup`.

    With `flush_l2`, a 256 MB buffer is overwritten before each run so inputs come from HBM.
    """
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[len(times) // 2]


def warm_up_gpu(seconds: float = 1.0) -> None:
    """Keeps the tensor cores busy for `seconds` so that the first timed case does not run at
    idle clocks (measured: the first case of a cold run took 2.8x its later time)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return
