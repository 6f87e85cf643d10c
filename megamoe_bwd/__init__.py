"""The Mega MoE backward, its autograd glue, expert parallelism (`megamoe_bwd.ep`), and the MoE
spec (reference) and baseline. Builds on `deep_gemm`; `deep_gemm.mega_moe_backward` and friends
are re-exported from here."""
from .autograd import mega_moe
from .backward import mega_moe_backward
from .baseline import grouped_mm_moe
from .module import MegaMoE
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
