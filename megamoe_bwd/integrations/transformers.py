"""A transformers experts backend: Hugging Face MoE models run their experts through our fused
layer, on the model's own parameters.

    import megamoe_bwd.integrations.transformers  # registers "megamoe" and "megamoe_fp8"
    model.set_experts_implementation("megamoe")   # or experts_implementation="megamoe" in from_pretrained / the config

"megamoe_fp8" runs the same layer with its expert GEMMs in blockwise FP8 (`deep_gemm.fp8_mega_moe`;
H and I multiples of 128); the parameters and their gradients stay bf16.

transformers 5.x dispatches an experts module's forward through `ExpertsInterface` (models whose
experts class carries `@use_experts_implementation`): ``fn(experts, hidden_states [T, H],
top_k_index [T, K] int64, top_k_weights [T, K])``. Experts with `gate_up_proj [E, 2I, H]` (gate rows,
then up rows) and `down_proj [E, H, I]` are exactly our l1 and l2: no copy, and the gradients land
in the model's parameters; the router's gradient flows through `top_k_weights`. Slots whose id is
E or more (transformers marks other ranks' slots so under expert parallelism) are empty. What the
layer cannot run is refused with a ValueError: biases, transposed or interleaved weights, experts
without a gate, activations other than SiLU, custom gates (clamped SwiGLU). Works under
`torch.compile` (the layer is one custom op) and with gradient checkpointing (the forward is
re-run as a whole). Models with this layout, as their default configs have it: docs/DESIGN.md,
"Integrations".
"""
from __future__ import annotations

import torch
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from .. import autograd

NAME, FP8_NAME = "megamoe", "megamoe_fp8"


def unsupported(experts: torch.nn.Module, fp8: bool = False) -> list[str]:
    """What keeps `experts` (a transformers experts module) from running on the fused layer
    (with `fp8`: on its FP8 recipe)."""
    problems = []
    if getattr(experts, "has_bias", False):
        problems.append("expert biases")
    if getattr(experts, "is_transposed", False):
        problems.append("transposed expert weights")
    if not getattr(experts, "is_concatenated", True):
        problems.append("interleaved gate/up rows")
    act = getattr(experts, "act_fn", None)
    if not getattr(experts, "has_gate", True):
        problems.append("experts without a gate")
    elif getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        problems.append(f"a custom gate ({type(experts).__name__}._apply_gate, e.g. a clamped SwiGLU)")
    elif not (isinstance(act, (SiLUActivation, torch.nn.SiLU)) or act is torch.nn.functional.silu):
        problems.append(f"the activation {type(act).__name__} (the layer computes silu(gate) * up)")
    for name in ("gate_up_proj", "down_proj"):
        if not isinstance(getattr(experts, name, None), torch.Tensor):
            problems.append(f"no `{name}` tensor")
    down = getattr(experts, "down_proj", None)
    if fp8 and isinstance(down, torch.Tensor) and down.dim() == 3 and (down.shape[1] % 128 or down.shape[2] % 128):
        problems.append(f"hidden and intermediate sizes {down.shape[1]} and {down.shape[2]} (FP8 takes multiples of 128)")
    return problems


def megamoe_experts_forward(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, *, fp8: bool = False) -> torch.Tensor:
    """The experts' output ``[T, H]`` (in hidden_states' dtype) for ``hidden_states [T, H]``,
    ``top_k_index [T, K]`` (ids of `experts`' E experts; E or more: an empty slot) and
    ``top_k_weights [T, K]``, through `megamoe_bwd.mega_moe` (with `fp8`: in blockwise FP8) on
    `experts.gate_up_proj` and `experts.down_proj`."""
    problems = unsupported(experts, fp8)
    if problems:
        name = FP8_NAME if fp8 else NAME
        raise ValueError(f"the {name!r} experts backend cannot run {type(experts).__name__}: {'; '.join(problems)}")
    num_experts = experts.gate_up_proj.shape[0]
    topk_idx = torch.where((top_k_index >= 0) & (top_k_index < num_experts), top_k_index, -1)
    return autograd.mega_moe(hidden_states, topk_idx, top_k_weights, experts.gate_up_proj, experts.down_proj,
                             fp8=fp8)


def megamoe_fp8_experts_forward(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor:
    """`megamoe_experts_forward` in blockwise FP8."""
    return megamoe_experts_forward(experts, hidden_states, top_k_index, top_k_weights, fp8=True)


ExpertsInterface.register(NAME, megamoe_experts_forward)
ExpertsInterface.register(FP8_NAME, megamoe_fp8_experts_forward)
