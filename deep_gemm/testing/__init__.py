"""Helpers shared by tests and benchmarks: error metrics, timing, group-size generators, CUDA-graph replay,
poisoned allocations, PyTorch's rowwise FP8 grouped GEMM (a baseline)."""
from .bench import SustainedTiming, bench_ms, sustained_ms, upper_median, warm_up_gpu
from .numeric import relative_error, same_bits, same_written_columns, view_of_memory
from .graphs import eager_and_graph_replay
from .groups import offsets_from_sizes, random_group_sizes
from .poison import poisoned_allocations
from .fp8_baseline import torch_fp8_rowwise_grouped_mm, torch_fp8_rowwise_wgrad
