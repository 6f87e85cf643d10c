from .forward import MegaMoEHandle, bf16_mega_moe
from .layout import RoutingLayout, build_routing_layout
