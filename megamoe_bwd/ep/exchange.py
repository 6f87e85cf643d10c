"""The NVLink exchange of the built-in expert-parallel path (`nvlink.py` runs the layer on it):
which rows go where, and how ranks know that they have landed.

Every rank stages its tokens (the forward's x, the backward's dy) in its symmetric buffer;
every other rank copies them in whole with the copy engines (no SM) while its first GEMM works
on its own tokens. A receiver holds the tokens of all ranks in *pass order*: pass s holds the
tokens of rank ``(rank + s) % world`` in rows ``[s * M, (s + 1) * M)`` (M = the buffer's max
tokens per rank; rows past a rank's token count are empty), its own tokens first. Each rank's
token count goes into every rank's buffer, so no host synchronisation and no second exchange is
needed. Whole regions are copied, also the tokens that name no expert of the receiver (at EP = 2
with K = 8 of 128 experts, 0.3% of them; more at larger EP).

Results go back the same way round: the last GEMM computes passes 1..S-1 first; each other
rank's tokens are summed over this rank's experts into a local buffer (`send_partials`), and
the copy engines write those sums into the owner's buffer while the GEMM works on pass 0. The
owner waits on the GPU for the flags the senders set after their rows, then adds their sums to
its own in one combine (`gather_partials`). That wait also ends the exchange: a rank's reads of
the others' buffers (their top-k ids and weights, and the pulls) and of the counts and call
numbers the others wrote into its own all come before its sends, so once a rank has everyone's
partial sums, nobody reads its buffer any more and its next exchange may start.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .._kernels import Fp8Rows, RoutingLayout, ep_wait_flags, moe_combine_bf16, quant_kernels, stream_write_u32

from .symm import BARRIER_TIMEOUT_MS, SymmBuffer


FORWARD, BACKWARD, FP8 = 0, 1, 2  # an exchange's kind: its direction, plus FP8 for quantized tokens


def announce_call(buffer: SymmBuffer, kind: int) -> None:
    """Writes which exchange this rank is in (its count of exchanges, and `kind`: FORWARD or
    BACKWARD, plus FP8) into every rank's buffer at the start of an exchange, then `check_calls`
    after its first barrier. Ranks that disagree (one skipped a layer's backward, raised on its
    own, or staged bf16 tokens where the others read FP8) would otherwise pair up the wrong
    barriers or read each other's rows wrongly; this stops them with an error instead."""
    buffer.num_calls += 1
    for peer_calls in buffer.region("calls").tensors:
        peer_calls[buffer.rank:buffer.rank + 1].fill_(4 * buffer.num_calls + kind)


def check_calls(buffer: SymmBuffer) -> None:
    """Run after an exchange's barrier and before this rank's first send of it: once a rank has
    everyone's results it may announce its next exchange."""
    calls = buffer.local["calls"]
    same = (calls == calls[buffer.rank]).all()
    message = ("expert-parallel ranks are in different layer calls (one skipped a forward or backward, or ranks "
               "disagree on fp8?)")
    if calls.is_cuda:
        torch._assert_async(same, message)
    elif not bool(same):
        raise RuntimeError(message)


def exchange_token_counts(buffer: SymmBuffer, num_tokens: int, fp8: bool = False) -> torch.Tensor:
    """Starts a forward exchange: collective over the buffer's group (one barrier). Returns every
    rank's token count, int32 ``[world]`` on the GPU. Whatever a rank staged in its buffer before
    this call is readable by the others after it. The caller runs `check_calls` next."""
    # No barrier first: every exchange ends with `gather_partials`, which a rank passes only
    # once every other rank has sent its partial sums, after its last read of this rank's buffer.
    announce_call(buffer, FORWARD + (FP8 if fp8 else 0))
    for peer_tokens in buffer.region("num_tokens").tensors:
        peer_tokens[buffer.rank:buffer.rank + 1].fill_(num_tokens)
    buffer.barrier()
    return buffer.local["num_tokens"].clone()


@dataclass
class RowArrival:
    """Token rows still landing (`pull_tokens`): they come in S passes, pass s complete once
    ``ready_flags[s] != 0``; within each expert, the layout's rows are sorted by pass.

    run_offsets: int32 ``[E * S + 1]``: expert e's rows of pass s are
                 ``[run_offsets[e * S + s], run_offsets[e * S + s + 1])``.
    num_passes:  S.
    ready_flags: int32 ``[S]`` on the GPU, or None (the rows have landed: CPU buffers).
    join:        makes the current stream wait until every row has landed.
    """

    run_offsets: torch.Tensor
    num_passes: int
    ready_flags: Optional[torch.Tensor]
    join: Callable[[], None]


def landed(run_offsets: torch.Tensor) -> RowArrival:
    """The `RowArrival` of rows that are all in already (one pass, nothing to wait for), e.g. those
    DeepEP's dispatch returns."""
    return RowArrival(run_offsets, 1, None, lambda: None)


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

    def copy_pass(s: int) -> None:  # contiguous: a copy engine
        rows[s * max_tokens:(s + 1) * max_tokens].copy_(peers[(me + s) % world])

    return rows, _pull(buffer, own.device, run_offsets, copy_pass, (rows,))


def pull_fp8_tokens(own: Fp8Rows, buffer: SymmBuffer, region: str, run_offsets: torch.Tensor
                    ) -> tuple[Fp8Rows, RowArrival]:
    """`pull_tokens` for the FP8 exchange: every rank staged its rows of `region` quantized per
    1 x 128 (`SymmBuffer.fp8_region`), about half the bf16 bytes; returns them in pass order as
    `Fp8Rows` ``[world * M, H]`` (scales column-major, as the FP8 GEMMs read them) and their
    `RowArrival`. Each pass copies its data rows and its H / 128 rows of scales."""
    world, me, max_tokens = buffer.world, buffer.rank, buffer.max_tokens
    num_tokens, hidden = own.data.shape
    total = world * max_tokens
    data = own.data.new_empty(total, hidden)
    scales = quant_kernels.empty_row_scales(total, hidden, own.data.device).T  # [H / 128, total] rows of it
    data[:num_tokens].copy_(own.data)
    scales[:, :num_tokens].copy_(own.scales.T)
    peer_data, peer_scales = (r.tensors for r in buffer.fp8_region(region))

    def copy_pass(s: int) -> None:  # contiguous pieces: copy engines
        peer = (me + s) % world
        data[s * max_tokens:(s + 1) * max_tokens].copy_(peer_data[peer])
        for kb in range(hidden // 128):
            scales[kb, s * max_tokens:(s + 1) * max_tokens].copy_(peer_scales[peer][kb])

    arrival = _pull(buffer, own.data.device, run_offsets, copy_pass, (data, scales))
    return Fp8Rows(data, scales.T), arrival


def stage_fp8_tokens(rows: Fp8Rows, buffer: SymmBuffer, region: str) -> None:
    """Writes this rank's quantized rows into its own `region` for the others' `pull_fp8_tokens`."""
    data, scales = (r.tensors[buffer.rank] for r in buffer.fp8_region(region))
    num_tokens = rows.data.shape[0]
    data[:num_tokens].copy_(rows.data)
    scales[:, :num_tokens].copy_(rows.scales.T)


def _pull(buffer: SymmBuffer, device: torch.device, run_offsets: torch.Tensor, copy_pass: Callable[[int], None],
          outputs: tuple) -> RowArrival:
    """Runs ``copy_pass(s)`` for the passes s = 1..S-1 (the other ranks' rows) on the buffer's copy
    stream, each followed by its ready flag; synchronously on the CPU. `outputs` are the tensors
    the copies write (kept from reuse until they are done)."""
    world, stream, flags = buffer.world, buffer.copy_stream, buffer.ready_flags
    if stream is None:
        for s in range(1, world):
            copy_pass(s)
        return RowArrival(run_offsets, world, None, lambda: None)

    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)  # after the barrier: the peers' rows are staged
    with torch.cuda.stream(stream):
        for s in range(1, world):
            copy_pass(s)
            stream_write_u32(flags[s:].data_ptr(), 1, device.index)
    for t in outputs:
        t.record_stream(stream)  # not reused before the copies into it are done, whatever happens

    joined = []

    def join() -> None:  # once: callers also join in `finally`
        if not joined:
            joined.append(True)
            current.wait_stream(stream)
            flags.zero_()  # after the GEMM that waited on them, before the next exchange sets them

    return RowArrival(run_offsets, world, flags, join)


def _token_slots(layout: RoutingLayout, begin: int, end: int) -> RoutingLayout:
    """The layout seen from tokens ``[begin, end)`` of its token order (for a combine)."""
    return RoutingLayout(layout.offsets, layout.row_token, layout.row_weight, layout.slot_row[begin:end],
                         layout.slot_valid[begin:end])


def send_partials(rows: torch.Tensor, layout: RoutingLayout, weights: Optional[torch.Tensor], buffer: SymmBuffer,
                  dw: Optional[torch.Tensor] = None) -> None:
    """Sends each other rank its tokens' results from this rank, once the rows of passes
    1..S-1 are computed: sums every token of those passes over its slots here
    (`moe_combine_bf16` of `rows` ``[*, H]`` in `layout`'s routed order, with `weights` ``[S * M,
    K]`` or unweighted) into a local buffer; then the copy engines write pass s's sums into rank
    ``(rank + s) % world``'s "back" region (block s - 1), with rows ``[s * M, (s + 1) * M)`` of
    `dw` (fp32 ``[S * M, K]``, routing-weight gradients) into its "back_dw", and set its
    ``arrived[s - 1]``. Whole blocks of M rows go (zeros past a rank's token count). Returns
    once the work is queued; `gather_partials` on the receiver waits for it."""
    world, me, max_tokens = buffer.world, buffer.rank, buffer.max_tokens
    if world == 1:
        return
    partial = rows.new_empty((world - 1) * max_tokens, rows.shape[1])
    moe_combine_bf16(rows, _token_slots(layout, max_tokens, world * max_tokens),
                     None if weights is None else weights[max_tokens:], partial)
    back, back_dw, arrived = (buffer.region(name).tensors for name in ("back", "back_dw", "arrived"))
    stream = buffer.copy_stream

    def copy_all() -> None:
        for s in range(1, world):
            peer, block = (me + s) % world, slice((s - 1) * max_tokens, s * max_tokens)
            back[peer][block].copy_(partial[block])  # to another GPU's memory: a copy engine
            if dw is not None:
                back_dw[peer][block].copy_(dw[s * max_tokens:(s + 1) * max_tokens])
            if stream is None:
                arrived[peer][s - 1] = 1
            else:  # after the rows: a stream memory operation with a system-wide fence
                stream_write_u32(arrived[peer][s - 1:].data_ptr(), 1, rows.device.index)

    if stream is None:  # CPU buffers: synchronous copies (`gather_partials` has a barrier)
        copy_all()
        return
    stream.wait_stream(torch.cuda.current_stream(rows.device))
    with torch.cuda.stream(stream):
        copy_all()
    for t in (partial, dw):  # not reused before the copies from them are done
        if t is not None:
            t.record_stream(stream)


def gather_partials(rows: torch.Tensor, layout: RoutingLayout, weights: Optional[torch.Tensor], buffer: SymmBuffer,
                    out: torch.Tensor) -> torch.Tensor:
    """Ends an exchange: ``out [T, H]`` = this rank's T tokens summed over their slots here
    (`rows`, `layout` and `weights` as in `send_partials`; pass 0 = tokens ``[0, T)``) plus the
    partial sums every other rank sent (`send_partials`), once their flags are set (waited for
    on the GPU by one thread; after DG_EP_BARRIER_TIMEOUT_MS it fails naming the rank that sent
    nothing). Afterwards this rank's "back_dw" holds the others' routing-weight gradients
    (block s - 1 from rank rank - s) until its next exchange; the flags are reset and the
    current stream has joined the copy stream."""
    world, me, max_tokens, num_tokens = buffer.world, buffer.rank, buffer.max_tokens, out.shape[0]
    own = _token_slots(layout, 0, num_tokens)
    own_weights = None if weights is None else weights[:num_tokens]
    if world == 1:
        return moe_combine_bf16(rows, own, own_weights, out)
    if buffer.copy_stream is None:  # CPU buffers: the others' writes are done once they reach this barrier
        buffer.barrier()
    sources = buffer.constant(("sources", out.device), lambda: (
        (me - 1 - torch.arange(world - 1, device=out.device)) % world).to(torch.int32))
    ep_wait_flags(buffer.local["arrived"], sources, BARRIER_TIMEOUT_MS)
    moe_combine_bf16(rows, own, own_weights, out, addend=buffer.local["back"].view(world - 1, max_tokens, -1))
    if buffer.copy_stream is not None:
        torch.cuda.current_stream(out.device).wait_stream(buffer.copy_stream)
    return out


def gemm_other_ranks_first(gemm: Callable, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, arrival: RowArrival,
                           send: Callable[[torch.Tensor], None]) -> None:
    """An m-grouped GEMM (`gemm(a, b, d, ...)`, nt or nn) over `arrival`'s (expert, pass) runs in
    two launches: passes 1..S-1 (other ranks' tokens), then ``send(d)``, then pass 0, so that what
    `send` starts with those rows (sending results to their ranks) overlaps the GEMM's work on
    this rank's own rows. With one pass (one rank), the GEMM and then `send`."""
    runs = dict(group_offsets=arrival.run_offsets, num_passes=arrival.num_passes)
    if arrival.num_passes == 1:
        gemm(a, b, d, **runs)
        send(d)
        return
    gemm(a, b, d, **runs, pass_range=(1, arrival.num_passes))
    send(d)
    gemm(a, b, d, **runs, pass_range=(0, 1))
