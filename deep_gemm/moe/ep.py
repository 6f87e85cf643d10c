"""Exchange plan of the built-in expert-parallel path: where each token goes.

A token goes once to every rank that holds at least one of its experts (not once per slot:
at EP=2 with K=8 that is about a quarter of the rows). Every rank counts the tokens it sends
to each rank, writes its counts into every rank's buffer (so each rank sees the whole
[src, dst] matrix), and from that matrix alone each sender computes the exact row each of its
tokens lands on in each receiver's buffer (receivers hold their tokens by source rank, in
token order). No host synchronisation and no second exchange.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import RoutingLayout
from .symm import SymmBuffer


@dataclass
class EpPlan:
    """This rank's side of one exchange, over its (token, rank) pairs p = t * world + r.

    token:    int64 ``[T * world]``: the pair's token.
    dst_rank: int32 ``[T * world]``: the pair's rank r.
    dst_row:  int64 ``[T * world]``: the row the token lands on in rank r's receive region;
              -1 if none of the token's experts lives on r (not sent).
    pairs:    token-side layout for summing each token's results over the ranks it went to
              (``slot_row`` is the pair, ``slot_valid`` whether the token went there).
    num_recv: int32 ``[1]`` on the GPU: the tokens this rank receives.
    """

    token: torch.Tensor
    dst_rank: torch.Tensor
    dst_row: torch.Tensor
    pairs: RoutingLayout
    num_recv: torch.Tensor


def announce_call(buffer: SymmBuffer, kind: int) -> None:
    """Writes which exchange this rank is in (its count of exchanges, and `kind`: 0 forward,
    1 backward) into every rank's buffer at the start of an exchange, then `check_calls` after
    its first barrier. Ranks that disagree (one skipped a layer's backward,
    or raised on its own) would otherwise pair up the wrong barriers and read each other's
    half-written rows; this stops them with an error instead."""
    buffer.num_calls += 1
    tag = torch.full((1,), 2 * buffer.num_calls + kind, dtype=torch.int64, device=buffer.local["calls"].device)
    for peer_calls in buffer.region("calls").tensors:
        peer_calls[buffer.rank:buffer.rank + 1].copy_(tag)


def check_calls(buffer: SymmBuffer) -> None:
    calls = buffer.local["calls"]
    same = (calls == calls[buffer.rank]).all()
    message = "expert-parallel ranks are in different layer calls (one skipped a forward or backward?)"
    if calls.is_cuda:
        torch._assert_async(same, message)
    elif not bool(same):
        raise RuntimeError(message)


def build_ep_plan(topk_idx: torch.Tensor, buffer: SymmBuffer) -> EpPlan:
    """Collective over the buffer's group (one barrier; also checks that every rank is in the
    same exchange). `topk_idx` ``[T, K]`` int64 holds
    global expert ids (expert e on rank ``e // E_local``); ids outside ``[0, E)`` are empty."""
    num_tokens = topk_idx.shape[0]
    world, me, device = buffer.world, buffer.rank, topk_idx.device
    valid = (topk_idx >= 0) & (topk_idx < buffer.num_experts)
    rank_of = torch.where(valid, topk_idx // buffer.num_local_experts, world)  # world: nowhere
    in_rank = torch.zeros(num_tokens, world + 1, dtype=torch.bool, device=device).scatter_(1, rank_of, True)
    in_rank = in_rank[:, :world].contiguous()
    counts = in_rank.sum(0, dtype=torch.int32)

    # No barrier first: every exchange ends with one that each rank reaches only after its last
    # read of the receive regions, and counts and calls were read before that.
    announce_call(buffer, 0)
    for peer_counts in buffer.region("counts").tensors:
        peer_counts[me].copy_(counts)
    buffer.barrier()
    check_calls(buffer)
    matrix = buffer.local["counts"].to(torch.int64)  # [src, dst]

    # Every rank checks every receiver's capacity (all see the same matrix, so all stop).
    fits = matrix.sum(0).le(buffer.max_recv_tokens).all()
    message = f"an expert-parallel exchange exceeds the buffer's {buffer.max_recv_tokens} receive tokens per rank"
    if device.type == "cuda":
        torch._assert_async(fits, message)  # before any token moves: stream order stops the pushes
    elif not bool(fits):
        raise ValueError(message)

    # Receiver r holds its tokens by source rank: this rank's block starts after the tokens of
    # the ranks before it, and a token's place in the block is its order among those sent to r.
    block_start = (matrix.cumsum(0) - matrix)[me]  # [dst]
    # Scanned along the inner dimension: torch's scan down the columns of a [T, world] tensor
    # took 1.7 ms at T = 16384 on an H200 (measured), more than the exchange itself.
    position = in_rank.t().to(torch.int64).contiguous().cumsum(1).t() - 1
    dst_row = torch.where(in_rank, block_start + position, -1).flatten()
    pair = torch.arange(num_tokens * world, device=device)
    token = pair // world
    pairs = RoutingLayout(offsets=torch.zeros(1, dtype=torch.int32, device=device), row_token=token,
                          row_weight=torch.empty(0, device=device), slot_row=pair.view(num_tokens, world),
                          slot_valid=in_rank)
    return EpPlan(token=token, dst_rank=(pair % world).to(torch.int32), dst_row=dst_row, pairs=pairs,
                  num_recv=matrix[:, me].sum().to(torch.int32).reshape(1))
