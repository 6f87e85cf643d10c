"""Timing on the GPU: short bursts (`bench_ms`), the steady state (`sustained_ms`), a warm-up, and
the median the benchmarks report (`upper_median`)."""
import statistics
import threading
import time
from typing import Callable, Iterable, NamedTuple, Optional

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


def upper_median(values: Iterable[float]) -> float:
    """The median of `values`, the upper of the two middle ones for an even count (a time that
    was measured, not an average of two); NaN when there are none."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


class SustainedTiming(NamedTuple):
    """`sustained_ms`' result: median milliseconds a call, and the median SM clock (MHz) and board
    power (W) while the calls ran (None where NVML cannot be read)."""
    ms: float
    sm_mhz: Optional[float]
    watts: Optional[float]


def _clock_and_power(device: int) -> tuple[Optional[float], Optional[float]]:
    try:
        return float(torch.cuda.clock_rate(device)), torch.cuda.power_draw(device) / 1e3  # (power in mW)
    except Exception:  # no NVML binding (pynvml) or no permission: time only
        return None, None


def sustained_ms(fn: Callable[[], object], seconds: float = 1.0, batch: int = 5) -> SustainedTiming:
    """Times `fn` called back to back for `seconds` (CUDA events over batches of `batch` calls, the
    next batch queued before the last one is waited for, no L2 flush), sampling the SM clock and
    power every 10 ms from another thread. This is the steady state of training: on an H200 the
    GEMMs then run at the 700 W cap, at lower clocks than `bench_ms`' short bursts (docs/PERF.md,
    "Decisions": decide in the steady state). Time, clock and power are medians over the last two
    thirds of the run, after the cap has set in."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    samples: list = []
    stop = threading.Event()
    device = torch.cuda.current_device()  # (the sampling thread has its own current device)

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic(), *_clock_and_power(device)))
            time.sleep(0.01)

    def queue_batch() -> tuple:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        return start, end

    for _ in range(2 * batch):
        fn()
    torch.cuda.synchronize()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    begin = time.monotonic()
    settled_from = begin + seconds / 3
    batches = []  # (host time its end was seen, ms a call)
    try:
        pending = queue_batch()
        while True:
            following = queue_batch()
            pending[1].synchronize()
            batches.append((time.monotonic(), pending[0].elapsed_time(pending[1]) / batch))
            pending = following
            if time.monotonic() - begin >= seconds:
                break
        pending[1].synchronize()
    finally:
        stop.set()
        sampler.join()
    ms = statistics.median([t for at, t in batches if at >= settled_from] or [t for _, t in batches])
    settled = [(c, w) for at, c, w in samples if at >= settled_from and c is not None]
    mhz = statistics.median(c for c, _ in settled) if settled else None
    watts = statistics.median(w for _, w in settled) if settled else None
    return SustainedTiming(ms, mhz, watts)
