"""The Mega MoE backward, its autograd glue, and the MoE spec (reference) and baseline."""
from .autograd import MegaMoE, mega_moe
from .backward import mega_moe_backward
from .baseline import grouped_mm_moe
from .reference import make_moe_inputs, reference_backward, reference_forward, relative_error

__all__ = [
    "MegaMoE",
    "mega_moe",
    "mega_moe_backward",
    "grouped_mm_moe",
    "make_moe_inputs",
    "reference_backward",
    "reference_forward",
    "relative_error",
]
