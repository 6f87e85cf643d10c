"""A stand-in for `deep_ep.Buffer` on CPU processes (gloo): the normal-mode dispatch and combine
that `megamoe_bwd.ep.ep_mega_moe_deep_ep` calls, with DeepEP's documented semantics, over
`all_to_all_single`, so that the EP spec test runs our FP8 DeepEP path where DeepEP cannot (the
bf16 path's single-GPU layer takes CUDA tensors only). What it does not model: DeepEP's kernels, streams and buffers (its events are no-ops).

- `get_dispatch_layout(topk_idx, E)`: tokens per rank, None (no RDMA ranks), tokens per expert,
  is_token_in_rank ``[T, R]``, an event.
- `dispatch(x, ...)`: each token once to every rank holding one of its experts; a receiver gets
  them grouped by source rank, in rank order, each rank's in token order, with their top-k ids
  made local (-1 for slots on other ranks; their weights 0). `x` is bf16 ``[T, H]`` or an FP8
  pair ``(e4m3 [T, H], fp32 scales [T, H / 128])`` (any strides; received scales row-major). With
  `handle`, the rows go as the handle's dispatch sent them, and only the rows are returned.
- `combine(x, handle, topk_weights=None)`: each received row back to its token's rank, summed
  per token in fp32 (and `topk_weights` likewise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _Handle:
    send_tokens: torch.Tensor  # this rank's tokens in send order (grouped by destination rank)
    send_splits: list
    recv_splits: list
    num_tokens: int


class _NoEvent:
    def current_stream_wait(self) -> None:
        pass


def _exchange(t: torch.Tensor, send_splits: list, recv_splits: list, group) -> torch.Tensor:
    """`all_to_all_single` of rows of any dtype (as bytes: gloo moves no bf16 or float8)."""
    width = math.prod(t.shape[1:]) * t.element_size()  # bytes a row
    raw = t.contiguous().view(torch.uint8).reshape(t.shape[0], width)
    out = raw.new_empty(sum(recv_splits), width)
    dist.all_to_all_single(out, raw, recv_splits, send_splits, group=group)
    return out.view(t.dtype).view(-1, *t.shape[1:])


class EmulatedDeepEPBuffer:
    """`deep_ep.Buffer`'s normal-mode dispatch and combine on `group` (module docstring)."""

    def __init__(self, group) -> None:
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        world, per_rank = self.group_size, num_experts // self.group_size
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        rank_of = torch.where(valid, topk_idx // per_rank, -1)
        in_rank = torch.stack([(rank_of == r).any(1) for r in range(world)], 1)
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, _NoEvent()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, **_):
        data, scales = x if isinstance(x, tuple) else (x, None)
        if handle is None:
            send_tokens = torch.cat([is_token_in_rank[:, r].nonzero().flatten() for r in range(self.group_size)])
            send_splits = is_token_in_rank.sum(0).tolist()
            recv_splits = _exchange(torch.tensor(send_splits).view(-1, 1), [1] * self.group_size,
                                    [1] * self.group_size, self.group).flatten().tolist()
            handle = _Handle(send_tokens, send_splits, recv_splits, data.shape[0])
        send = (handle.send_tokens, handle.send_splits, handle.recv_splits, self.group)
        recv = _exchange(data[send[0]], *send[1:])
        if scales is not None:
            recv = (recv, _exchange(scales[send[0]].contiguous(), *send[1:]))
        if topk_idx is None:
            return recv, None, None, None, handle, _NoEvent()
        per_rank = num_tokens_per_expert.numel() // self.group_size
        dest = torch.repeat_interleave(torch.arange(self.group_size), torch.tensor(handle.send_splits))
        ids = topk_idx[send[0]]
        local = ids - dest.view(-1, 1) * per_rank  # (ids as the destination rank numbers them)
        mine = (ids >= 0) & (local >= 0) & (local < per_rank)
        recv_idx = _exchange(torch.where(mine, local, -1), *send[1:])
        recv_weights = _exchange(torch.where(mine, topk_weights[send[0]], 0.0), *send[1:])
        per_expert = torch.bincount(recv_idx[recv_idx >= 0], minlength=per_rank).tolist()
        return recv, recv_idx, recv_weights, per_expert, handle, _NoEvent()

    def combine(self, x: torch.Tensor, handle: _Handle, topk_weights=None, async_finish: bool = False, **_):
        back = (handle.recv_splits, handle.send_splits, self.group)

        def summed(rows: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(handle.num_tokens, *rows.shape[1:], dtype=torch.float32)
            return out.index_add_(0, handle.send_tokens, _exchange(rows, *back).float()).to(rows.dtype)

        return summed(x), None if topk_weights is None else summed(topk_weights), _NoEvent()
