"""The Mega MoE backward, its autograd glue, expert parallelism (`megamoe_bwd.ep`), and the MoE
spec (reference) and baseline. Builds on `deep_gemm`; `deep_gemm.mega_moe_backward` and friends
are re-exported from here. `bf16_mega_moe` is the forward whose handle `mega_moe_backward`
takes: `deep_gemm.bf16_mega_moe` here, also where `deep_gemm` is a patched upstream install
(whose own `bf16_mega_moe` is another kernel)."""
from ._kernels import bf16_mega_moe
from .autograd import mega_moe
from .backward import mega_moe_backward
from .baseline import grouped_mm_moe
from .module import MegaMoE
from .reference import make_moe_inputs, reference_backward, reference_forward, relative_error

__all__ = [
    "MegaMoE",
    "bf16_mega_moe",
    "mega_moe",
    "mega_moe_backward",
    "grouped_mm_moe",
    "make_moe_inputs",
    "reference_backward",
    "reference_forward",
    "relative_error",
]
