"""Test support: the accuracy bar (docs/DESIGN.md, "Accuracy bar") as a function, a layer's
relative errors against the float64 reference next to the baseline MoE's (megamoe_bwd.baseline)
on the same inputs."""
from __future__ import annotations

from typing import Callable

import torch

from .baseline import grouped_mm_moe
from .reference import make_moe_inputs, reference_backward, reference_forward, relative_error

OUTPUTS = ("y", "dx", "dtopk_weights", "dl1", "dl2")


def _one_draw(forward: Callable, backward: Callable, T, H, I, E, K, routing, empty, device):
    """(ours, baseline, float64 reference) outputs y, dx, dtopk_weights, dl1, dl2 on fresh inputs."""
    p = make_moe_inputs(T, H, I, E, K, dtype=torch.bfloat16, device=device, routing=routing, empty_slot_frac=empty)
    x, idx, w, l1, l2, dy = p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"], p["dy"]
    y, handle = forward(x, idx, w, l1, l2, training=True)
    ours = (y, *backward(dy, l1, l2, handle))

    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in (x, idx, w, l1, l2)]
    y_base = grouped_mm_moe(*leaves)
    y_base.backward(dy)
    base = (y_base, leaves[0].grad, leaves[2].grad, leaves[3].grad, leaves[4].grad)

    f64 = [t.detach().double() if t.is_floating_point() else t for t in (x, idx, w, l1, l2, dy)]
    ref = (reference_forward(*f64[:5]), *reference_backward(*f64))
    return ours, base, ref


def accuracy(forward: Callable, backward: Callable, T: int, H: int, I: int, E: int, K: int, routing: str = "uniform",
             empty_slot_frac: float = 0.0, device: str = "cuda") -> dict[str, tuple[float, float]]:
    """``{output: (ours, baseline)}`` relative errors against float64 for the layer whose forward
    is ``forward(x, topk_idx, topk_weights, l1, l2, training=True) -> (y, handle)`` and whose
    backward is ``backward(dy, l1, l2, handle) -> (dx, dtopk_weights, dl1, dl2)``, on fresh
    bf16 inputs of the shape given. The bar: ours <= 1.5x baseline. A tiny problem has few
    outputs (T = 1: K routing-weight gradients), whose error ratio is noise, so small problems
    pool the outputs of several draws (up to 16) into one error."""
    draws = [_one_draw(forward, backward, T, H, I, E, K, routing, empty_slot_frac, device)
             for _ in range(min(16, max(1, 64 // max(T, 1))))]
    pooled = lambda which, i: torch.cat([d[which][i].detach().flatten().double() for d in draws])  # noqa: E731
    return {name: (relative_error(pooled(0, i), pooled(2, i)), relative_error(pooled(1, i), pooled(2, i)))
            for i, name in enumerate(OUTPUTS)}
