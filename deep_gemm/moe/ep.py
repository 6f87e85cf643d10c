"""Exchange plan of the built-in expert-parallel path: where each (token, slot) row goes.

Every rank counts the rows it sends to each (rank, local expert), writes its counts into
every rank's buffer (so each rank sees the whole [src, dst, expert] matrix), and from that
matrix alone each sender computes the exact row its rows land on in the receiver's buffer:
received rows come out grouped by local expert (sources in rank order, tokens in order
inside), ready for the grouped GEMMs, with no host synchronisation and no second exchange.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import RoutingLayout
from .symm import SymmBuffer


@dataclass
class EpPlan:
    """This rank's side of one exchange.

    send_rank:    int32 ``[T * K]``: the rank owning each slot's expert (0 on empty slots).
    send_row:     int64 ``[T * K]``: the row the slot's token lands on in that rank's receive
                  region; -1 on empty slots (not sent).
    token:        int64 ``[T * K]``: the token of each slot.
    slots:        token-side layout for combining the K slots of each token (``slot_row`` is
                  the slot itself, ``slot_valid`` false on empty slots).
    recv_offsets: int32 ``[E_local + 1]``: this rank's local expert e receives rows
                  ``[recv_offsets[e], recv_offsets[e + 1])``.
    """

    send_rank: torch.Tensor
    send_row: torch.Tensor
    token: torch.Tensor
    slots: RoutingLayout
    recv_offsets: torch.Tensor


def _exclusive_cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.cumsum(dim) - t


def build_ep_plan(topk_idx: torch.Tensor, buffer: SymmBuffer) -> EpPlan:
    """Collective over the buffer's group (two barriers). `topk_idx` ``[T, K]`` int64 holds
    global expert ids (expert e on rank ``e // E_local``); ids outside ``[0, E)`` are empty."""
    num_tokens, num_topk = topk_idx.shape
    world, num_local, me = buffer.world, buffer.num_local_experts, buffer.rank
    num_experts, device = world * num_local, topk_idx.device
    flat = topk_idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # global id = dst rank * E_local + local expert
    # (not bincount: on CUDA it reads the largest key on the host)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=device).index_add_(
        0, key, torch.ones_like(key, dtype=torch.int32))[:num_experts]

    buffer.barrier()  # every rank is done with the buffer's previous contents
    for peer_counts in buffer.region("counts").tensors:
        peer_counts[me].copy_(counts.view(world, num_local))
    buffer.barrier()
    matrix = buffer.local["counts"].to(torch.int64)  # [src, dst, local expert]

    # Every rank checks every receiver's capacity (all see the same matrix, so all stop).
    fits = matrix.sum(dim=(0, 2)).le(buffer.max_recv_rows).all()
    message = f"an expert-parallel exchange exceeds the buffer's {buffer.max_recv_rows} receive rows per rank"
    if device.type == "cuda":
        torch._assert_async(fits, message)  # before any row moves: stream order stops the pushes
    elif not bool(fits):
        raise ValueError(message)

    # Receiver layout: expert-major, then source rank: block (dst, e, src) starts at
    # (rows of dst's experts before e) + (rows that earlier sources send to dst's expert e).
    totals = matrix.sum(0)  # [dst, e]
    block_start = (_exclusive_cumsum(totals, 1) + _exclusive_cumsum(matrix, 0)[me]).flatten()
    order = torch.argsort(key, stable=True)
    sorted_key = key.index_select(0, order)
    group = sorted_key.clamp(max=num_experts - 1)
    my_start = _exclusive_cumsum(counts.to(torch.int64), 0)
    rank_in_group = torch.arange(key.numel(), device=device) - my_start.index_select(0, group)
    row_sorted = torch.where(sorted_key < num_experts, block_start.index_select(0, group) + rank_in_group, -1)
    send_row = torch.empty_like(row_sorted).scatter_(0, order, row_sorted)

    slots = torch.arange(key.numel(), device=device)
    recv = totals[me]
    recv_offsets = torch.cat([recv.new_zeros(1), recv.cumsum(0)]).to(torch.int32)
    slot_layout = RoutingLayout(offsets=recv_offsets, row_token=slots // num_topk, row_weight=torch.empty(0, device=device),
                                slot_row=slots.view(num_tokens, num_topk),
                                slot_valid=valid.view(num_tokens, num_topk).contiguous())
    return EpPlan(send_rank=(torch.where(valid, flat, 0) // num_local).to(torch.int32), send_row=send_row,
                  token=slots // num_topk, slots=slot_layout, recv_offsets=recv_offsets)
