"""The Mega MoE forward on one GPU, its routing layout and the memory-bound kernels around its GEMMs."""
from .forward import MegaMoEHandle, bf16_mega_moe
from .kernels import build_routing_layout
from .layout import RoutingLayout
