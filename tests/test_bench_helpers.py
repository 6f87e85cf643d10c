"""The timing helpers the benchmarks share (deep_gemm.testing.bench)."""
import pytest
import torch

import math

from deep_gemm.testing import SustainedTiming, bench_ms, sustained_ms, upper_median

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
def test_sustained_timing_gives_ms_a_call_and_the_clock_and_power_it_ran_at():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    run = sustained_ms(lambda: a @ a, seconds=0.3)
    assert isinstance(run, SustainedTiming)
    assert 0 < run.ms < 100
    # NVML may be unreadable (no pynvml): then both are None, never a made-up number
    assert (run.sm_mhz is None) == (run.watts is None)
    if run.sm_mhz is not None:
        assert 100 <= run.sm_mhz <= 3000 and 10 <= run.watts <= 2000
    burst = bench_ms(lambda: a @ a, warmup=2, iters=5)
    assert 0.2 < run.ms / burst < 5


@gpu
def test_sustained_timing_runs_at_least_one_batch():
    a = torch.randn(256, 256, device="cuda")
    assert sustained_ms(lambda: a @ a, seconds=0.0, batch=1).ms > 0


def test_sustained_timing_refuses_an_empty_batch_before_touching_the_gpu():
    with pytest.raises(ValueError, match="batch"):
        sustained_ms(lambda: None, batch=0)


def test_upper_median_is_a_measured_value():
    assert upper_median([3.0, 1.0, 2.0]) == 2.0
    assert upper_median(iter([4.0, 1.0, 3.0, 2.0])) == 3.0  # the upper middle, not 2.5
    assert math.isnan(upper_median([]))
