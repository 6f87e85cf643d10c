"""The timing helpers the benchmarks share (deep_gemm.testing.bench, scripts/bench_common.py)."""
import math
import os
import sys

import pytest
import torch

import deep_gemm.testing as testing
from deep_gemm.testing import SustainedTiming, bench_ms, sustained_ms, upper_median

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from bench_common import timed_in_rotation  # noqa: E402

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


def _record_order(monkeypatch) -> list:
    """Stand-ins for the two timers: each call records its side and returns its place in the run."""
    order: list = []

    def timer(fn, *args, **kwargs):
        order.append(fn())
        return len(order)

    monkeypatch.setattr(testing, "bench_ms", timer)
    monkeypatch.setattr(testing, "sustained_ms", lambda fn, seconds: SustainedTiming(timer(fn), 1500.0, 700.0))
    return order


def test_sides_timed_in_rotation_take_each_place_equally_often(monkeypatch):
    order = _record_order(monkeypatch)
    timings = timed_in_rotation([lambda: "a", lambda: "b", lambda: "c"], rounds=6)
    assert order == list("abc" "bca" "cab") * 2  # each round starts one side later
    places = {side: [order[r * 3:r * 3 + 3].index(side) for r in range(6)] for side in "abc"}
    assert all(sorted(p) == [0, 0, 1, 1, 2, 2] for p in places.values())
    # each side's timings in round order: a burst has no clock or power
    assert [t.ms for t in timings[0]] == [i + 1 for i, side in enumerate(order) if side == "a"]
    assert all(t.sm_mhz is None and t.watts is None for side in timings for t in side)


def test_rotation_skips_a_missing_side_and_times_sustained_when_asked(monkeypatch):
    order = _record_order(monkeypatch)
    timings = timed_in_rotation([lambda: "a", None], rounds=2, sustained=0.5)
    assert order == ["a", "a"]
    assert len(timings[0]) == 2 and timings[1] == []
    assert timings[0][0].sm_mhz == 1500.0


def test_rotation_refuses_zero_rounds():
    with pytest.raises(ValueError, match="rounds"):
        timed_in_rotation([lambda: None], rounds=0)
