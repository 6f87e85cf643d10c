"""Exchange plan of the built-in expert-parallel path: which rows go where.

Every rank stages its tokens (the forward's x, the backward's dy) in its symmetric buffer;
every other rank copies them in whole with the copy engines (no SM) while its first GEMM works
on its own tokens. A receiver holds the tokens of all ranks in *pass order*: pass s holds the
tokens of rank ``(rank + s) % world`` in rows ``[s * M, (s + 1) * M)`` (M = the buffer's max
tokens per rank; rows past a rank's token count are empty), its own tokens first. Each rank's
token count goes into every rank's buffer, so no host synchronisation and no second exchange is
needed. Whole regions are copied, also the tokens that name no expert of the receiver (at EP = 2
with K = 8 of 128 experts, 0.3% of them; more at larger EP).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..jit.runtime import stream_write_u32
from .forward import RowArrival
from .layout import RoutingLayout
from .symm import SymmBuffer


@dataclass
class EpPlan:
    """Where this rank's tokens went.

    pairs:         token-side layout over the (token, rank) pairs p = t * world + r, for summing
                   each token's results over the ranks it went to (``slot_row`` [T, world] is
                   the pair, ``slot_valid`` whether one of the token's experts lives on r).
    source_tokens: int32 ``[world]`` on the GPU: the token count of every rank.
    """

    pairs: RoutingLayout
    source_tokens: torch.Tensor


def announce_call(buffer: SymmBuffer, kind: int) -> None:
    """Writes which exchange this rank is in (its count of exchanges, and `kind`: 0 forward,
    1 backward) into every rank's buffer at the start of an exchange, then `check_calls` after
    its first barrier. Ranks that disagree (one skipped a layer's backward,
    or raised on its own) would otherwise pair up the wrong barriers and read each other's
    half-written rows; this stops them with an error instead."""
    buffer.num_calls += 1
    for peer_calls in buffer.region("calls").tensors:
        peer_calls[buffer.rank:buffer.rank + 1].fill_(2 * buffer.num_calls + kind)


def check_calls(buffer: SymmBuffer) -> None:
    calls = buffer.local["calls"]
    same = (calls == calls[buffer.rank]).all()
    message = "expert-parallel ranks are in different layer calls (one skipped a forward or backward?)"
    if calls.is_cuda:
        torch._assert_async(same, message)
    elif not bool(same):
        raise RuntimeError(message)


def exchange_token_counts(buffer: SymmBuffer, num_tokens: int) -> torch.Tensor:
    """Starts a forward exchange: collective over the buffer's group (one barrier). Returns every
    rank's token count, int32 ``[world]`` on the GPU. Whatever a rank staged in its buffer before
    this call is readable by the others after it. The caller runs `check_calls` before the
    exchange's last barrier (it may come later: the check is asynchronous anyway)."""
    # No barrier first: every exchange ends with one that each rank reaches only after its last
    # read of the others' buffers, and the counts were read before that.
    announce_call(buffer, 0)
    for peer_tokens in buffer.region("num_tokens").tensors:
        peer_tokens[buffer.rank:buffer.rank + 1].fill_(num_tokens)
    buffer.barrier()
    return buffer.local["num_tokens"].clone()


def build_ep_plan(topk_idx: torch.Tensor, buffer: SymmBuffer, source_tokens: torch.Tensor) -> EpPlan:
    """Which ranks each token goes to; no communication. `topk_idx` ``[T, K]`` int64 holds global
    expert ids (expert e on rank ``e // E_local``; ids outside ``[0, E)`` are empty),
    `source_tokens` is from `exchange_token_counts`."""
    num_tokens, world, device = topk_idx.shape[0], buffer.world, topk_idx.device
    pair = buffer.constant(("pairs", device), lambda: torch.arange(buffer.max_tokens * world, device=device)
                           .view(buffer.max_tokens, world))[:num_tokens]
    ranks = buffer.constant(("ranks", device), lambda: torch.arange(world, device=device))
    # Floor division sends empty slots (-1) to rank -1 and ids >= E to ranks >= world: neither matches.
    in_rank = (topk_idx.div(buffer.num_local_experts, rounding_mode="floor").unsqueeze(2) == ranks).any(1)
    pairs = RoutingLayout(offsets=pair.new_empty(0, dtype=torch.int32), row_token=pair.flatten(),
                          row_weight=pair.new_empty(0, dtype=torch.float32), slot_row=pair, slot_valid=in_rank)
    return EpPlan(pairs=pairs, source_tokens=source_tokens)


# Whether GEMM1 starts on this rank's own tokens while the others' are copied in (True), or the
# copies finish first (False; kept so that benchmarks can show what the overlap saves).
OVERLAP_PULL = True


def pull_tokens(own: torch.Tensor, buffer: SymmBuffer, region: str, run_offsets: torch.Tensor) -> tuple[torch.Tensor, RowArrival]:
    """All ranks' staged rows of `region` (each rank's ``[M, C]`` rows, staged before a barrier
    of this exchange), in pass order: ``[world * M, C]``, this rank's `own` ``[T, C]``
    first, copied on the current stream; the others' copied in by the copy engines (no SM) on the
    buffer's copy stream, each pass setting ``buffer.ready_flags[s]`` once it has landed.

    Returns the rows and their `RowArrival` (with `run_offsets`, the layout's per-(expert, pass)
    offsets), whose ``join`` the caller must reach before the rows are read other than by a
    GEMM that waits on the flags, and also when it raises (``join`` resets the flags; calls
    after the first do nothing). On the CPU the copies are synchronous."""
    world, me, max_tokens = buffer.world, buffer.rank, buffer.max_tokens
    rows = own.new_empty(world * max_tokens, own.shape[1])
    rows[:own.shape[0]].copy_(own)
    peers = buffer.region(region).tensors
    stream, flags = buffer.copy_stream, buffer.ready_flags
    if stream is None:
        for s in range(1, world):
            rows[s * max_tokens:(s + 1) * max_tokens].copy_(peers[(me + s) % world])
        return rows, RowArrival(run_offsets, world, None, lambda: None)

    current = torch.cuda.current_stream(own.device)
    stream.wait_stream(current)  # after the barrier: the peers' rows are staged
    with torch.cuda.stream(stream):
        for s in range(1, world):
            rows[s * max_tokens:(s + 1) * max_tokens].copy_(peers[(me + s) % world])  # contiguous: a copy engine
            stream_write_u32(flags[s:].data_ptr(), 1, own.device.index)
    rows.record_stream(stream)  # not reused before the copies into it are done, whatever happens

    joined = []

    def join() -> None:  # once: callers also join in `finally`
        if not joined:
            joined.append(True)
            current.wait_stream(stream)
            flags.zero_()  # after the GEMM that waited on them, before the next exchange sets them

    return rows, RowArrival(run_offsets, world, flags if OVERLAP_PULL else None, join)
