"""The Mega MoE forward on one GPU (bf16 and blockwise FP8), its routing layout and the memory-bound kernels around its GEMMs."""
from .forward import MegaMoEHandle, bf16_mega_moe
from .fp8 import Fp8WeightCopies, fp8_mega_moe, get_fp8_weight_copies, set_fp8_weight_copies
from .kernels import build_routing_layout
from .layout import RoutingLayout
