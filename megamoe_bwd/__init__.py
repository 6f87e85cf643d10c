"""Backward pass of the fused Mega MoE layer (built on ``deep_gemm``)."""
from .baseline import grouped_mm_moe
from .reference import make_moe_inputs, reference_backward, reference_forward, relative_error

__all__ = [
    "grouped_mm_moe",
    "make_moe_inputs",
    "reference_backward",
    "reference_forward",
    "relative_error",
]
