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
