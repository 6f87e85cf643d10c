"""Helpers shared by tests and benchmarks: error metrics, timing, group-size generators."""
from .bench import bench_ms, warm_up_gpu
from .numeric import relative_error
from .groups import offsets_from_sizes, random_group_sizes
