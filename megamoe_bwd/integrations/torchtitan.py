"""A TorchTitan-style experts module on the fused layer.

TorchTitan's MoE keeps the experts as `w1` (gate) and `w3` (up), ``[E, I, H]`` each, and `w2`
(down) ``[E, H, I]``, and applies the routing scores after the experts. `GroupedExperts` keeps
them in our layout once, so that no step pays for a copy: one parameter `w13` ``[E, 2I, H]``
holds w1's rows, then w3's (our l1), and `w2` is l2. `w1` and `w3` are views of `w13` (TorchTitan
style in-place initialisation of them works), and state dicts carry TorchTitan's keys `w1`,
`w2`, `w3`: a checkpoint's w1 and w3 are copied into w13 when it is loaded (the one-time layout).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..module import MegaMoE


class GroupedExperts(MegaMoE):
    """The experts of an MoE layer in TorchTitan's layout (see the module docstring).

    ``forward(x [T, H], scores [T, K], expert_ids [T, K])`` returns ``y [T, H]`` =
    ``sum_k scores[t, k] * w2[e] @ (silu(w1[e] @ x_t) * (w3[e] @ x_t))`` with ``e =
    expert_ids[t, k]`` (``-1``: an empty slot), bf16; gradients reach x, scores and the weights.
    `group`, `buffer`, `backend`: expert parallelism as in `MegaMoE`; `fp8`: the expert GEMMs in
    blockwise FP8, as `MegaMoE(fp8=True)` (dim and hidden_dim multiples of 128).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, device: torch.device | str | None = None,
                 group: Optional[dist.ProcessGroup] = None, buffer: Any = None, backend: Optional[str] = None,
                 fp8: bool = False):
        super().__init__(num_experts, dim, hidden_dim, device=device, group=group, buffer=buffer, backend=backend,
                         fp8=fp8)
        self.hidden_dim = hidden_dim
        self.register_state_dict_post_hook(_titan_state_dict)
        self.register_load_state_dict_pre_hook(_load_titan_state_dict)

    @property
    def w13(self) -> torch.nn.Parameter:
        return self.l1

    @property
    def w1(self) -> torch.Tensor:
        return self.l1[:, :self.hidden_dim]

    @property
    def w3(self) -> torch.Tensor:
        return self.l1[:, self.hidden_dim:]

    @property
    def w2(self) -> torch.nn.Parameter:
        return self.l2

    def forward(self, x: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """TorchTitan's argument order: x ``[T, dim]`` bf16, scores ``[T, K]`` float routing
        weights, expert_ids ``[T, K]`` int64 (``-1``: an empty slot); returns ``[T, dim]`` bf16."""
        return super().forward(x, expert_ids, scores)


def _titan_state_dict(module: GroupedExperts, state: dict, prefix: str, local_metadata) -> None:
    """l1, l2 -> TorchTitan's w1, w3 (views of l1's halves) and w2."""
    l1 = state.pop(prefix + "l1")
    state[prefix + "w1"], state[prefix + "w3"] = l1[:, :module.hidden_dim], l1[:, module.hidden_dim:]
    state[prefix + "w2"] = state.pop(prefix + "l2")


def _load_titan_state_dict(module: GroupedExperts, state: dict, prefix: str, *args) -> None:
    """TorchTitan's w1, w3, w2 -> l1 (w1's rows, then w3's) and l2, before the load."""
    if prefix + "w1" in state and prefix + "w3" in state:
        state[prefix + "l1"] = torch.cat([state.pop(prefix + "w1"), state.pop(prefix + "w3")], dim=1)
    if prefix + "w2" in state:
        state[prefix + "l2"] = state.pop(prefix + "w2")
