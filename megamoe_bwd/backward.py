"""Mega MoE backward on one GPU, bf16 and blockwise FP8.

dA = dy[rows] @ l2[e] (m-grouped nn) -> one pass for the SwiGLU backward, the weighted
activation w * a and the routing-weight gradient <dA, a> -> dl2 = dy[rows]^T @ (w * a)
(k-grouped) -> dx rows = dz @ l1[e] (m-grouped nn) -> combine over the K slots, with
dl1 = dz^T @ x[rows] (k-grouped) on a side stream beside the last two. Token rows of dy and x
are copied to routed order first: they feed two GEMMs each (docs/PERF.md, "Decisions": row gathers).

The steps are building blocks of the expert-parallel backward too (megamoe_bwd.ep), which
runs dA's GEMM and dx's GEMM in passes around the token exchange.

In FP8 (a handle of `deep_gemm.fp8_mega_moe`, `fp8_mega_moe_backward`): dy is quantized per
token as rows (dA's GEMM gathers them) and, its routed rows gathered by the quantization's
loads, as per-expert columns (dl2's); dA, dx's rows and both weight gradients run in FP8; the SwiGLU backward
(`moe_swiglu_bwd_fp8`) writes dz already quantized, as rows (dx's GEMM) and columns (dl1's),
and w * act as columns (dl2's); dl1 runs after dx's GEMM and combine, on the same stream, x's
columns in the consumed h's memory; the combine is bf16 as above. The weights' FP8 copies are the
forward's (the handle's `dgrad_weights`: their transposed halves).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from ._kernels import (Fp8Columns, Fp8Rows, MegaMoEHandle, RoutingLayout, check_bool, check_disjoint, check_tensor,
                       dense_rows, fp8_dgrad_weights, fp8_quantize_columns, fp8_quantize_rows, k_grouped_bf16,
                       k_grouped_bf16_gemm_tn_contiguous, k_grouped_fp8, k_grouped_fp8_gemm_tn_contiguous,
                       m_grouped_bf16, m_grouped_bf16_gemm_nn_contiguous, m_grouped_fp8,
                       m_grouped_fp8_gemm_nt_contiguous, moe_combine_bf16, moe_gather_rows_bf16, moe_kernels_fp8,
                       moe_swiglu_bwd_bf16, moe_swiglu_bwd_fp8, quant_kernels)
from ._kernels import moe_kernels as kernels

WEIGHT_GRAD_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class WeightGrads:
    """Where dl1 ``[E, 2I, H]`` and dl2 ``[E, H, I]`` go, and whether they are added to: the
    caller's tensors, or new ones of `dtype` that `get_dl1` / `get_dl2` allocate at first call, on
    the current stream, so that a new gradient is not alive through the backward's steps before
    its GEMM (less peak memory)."""

    like1: torch.Tensor  # (l1 and l2: the shapes and device)
    like2: torch.Tensor
    dtype: torch.dtype
    dl1: Optional[torch.Tensor]
    dl2: Optional[torch.Tensor]
    accumulate_dl1: bool
    accumulate_dl2: bool

    def get_dl1(self) -> torch.Tensor:
        self.dl1 = self._given_or_new(self.dl1, self.like1)
        return self.dl1

    def get_dl2(self) -> torch.Tensor:
        self.dl2 = self._given_or_new(self.dl2, self.like2)
        return self.dl2

    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """dl1's and dl2's dtypes, allocated or not."""
        return tuple(self.dtype if g is None else g.dtype for g in (self.dl1, self.dl2))

    def _given_or_new(self, grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        return grad if grad is not None else torch.empty(like.shape, dtype=self.dtype, device=like.device)


def _check_weight(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check_tensor(name, t, dtype, len(shape))
    if tuple(t.shape) != shape or t.device != device:
        raise ValueError(f"{name} must be {list(shape)} on {device} (the forward's), got {list(t.shape)} on {t.device}")


def check_backward_args(dy: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, handle: MegaMoEHandle,
                        weight_grad_dtype: torch.dtype, dl1: Optional[torch.Tensor], dl2: Optional[torch.Tensor],
                        keep_handle: bool) -> None:
    """Raises TypeError/ValueError unless `mega_moe_backward` can run on these arguments. Called
    before anything changes, so that a rejected call leaves the handle and the caller's
    tensors as they were."""
    if not isinstance(handle, MegaMoEHandle):
        raise TypeError(f"handle must be the MegaMoEHandle of bf16_mega_moe(..., training=True), got "
                        f"{type(handle).__name__}")
    if handle.h is None:
        raise ValueError("this handle was consumed by an earlier mega_moe_backward (pass keep_handle=True to reuse one)")
    if handle.recipe not in ("bf16", "fp8"):
        raise ValueError(f"handle.recipe must be 'bf16' or 'fp8', got {handle.recipe!r}")
    x = handle.x
    (num_tokens, hidden), inter = x.shape, handle.h.shape[1] // 2
    num_experts = handle.layout.offsets.numel() - 1
    if not isinstance(dy, torch.Tensor):
        raise TypeError(f"dy must be a torch.Tensor, got {type(dy).__name__}")
    if dy.dtype != x.dtype:
        raise TypeError(f"dy must have the forward's dtype {x.dtype}, got {dy.dtype}")
    if tuple(dy.shape) != (num_tokens, hidden) or dy.device != x.device:
        raise ValueError(f"dy must be [{num_tokens}, {hidden}] on {x.device} (the forward's), got "
                         f"{list(dy.shape)} on {dy.device}")
    _check_weight("l1", l1, (num_experts, 2 * inter, hidden), x.dtype, x.device)
    _check_weight("l2", l2, (num_experts, hidden, inter), x.dtype, x.device)
    # On a GPU the kernels write fp32 or bf16; the emulated kernels of the CPU tests float64 too.
    dtypes = WEIGHT_GRAD_DTYPES if x.is_cuda else (*WEIGHT_GRAD_DTYPES, torch.float64)
    if weight_grad_dtype not in dtypes:
        raise TypeError(f"weight_grad_dtype must be one of {dtypes}, got {weight_grad_dtype}")
    for name, grad, shape in (("dl1", dl1, l1.shape), ("dl2", dl2, l2.shape)):
        if grad is not None:
            check_tensor(name, grad, dtypes, 3)
            if tuple(grad.shape) != tuple(shape) or grad.device != x.device:
                raise ValueError(f"{name} must be {list(shape)} on {x.device}, got {list(grad.shape)} on {grad.device}")
    check_disjoint(dict(dl1=dl1, dl2=dl2), dict(dy=dy, l1=l1, l2=l2, x=x, h=handle.h))
    check_bool(keep_handle=keep_handle)


def weight_grads(l1: torch.Tensor, l2: torch.Tensor, dtype: torch.dtype, dl1: Optional[torch.Tensor] = None,
                 dl2: Optional[torch.Tensor] = None) -> WeightGrads:
    """New gradients of `dtype` (allocated at their GEMMs), or the given ones to accumulate into."""
    return WeightGrads(l1, l2, dtype, dl1, dl2, dl1 is not None, dl2 is not None)


def build_kernels(l1: torch.Tensor, l2: torch.Tensor, grads: WeightGrads) -> None:
    """Compiles (or reads from the disk cache) every kernel the single-GPU backward launches, so
    that a failing build stops it before it changes the handle or the gradients."""
    (two_inter, hidden), inter, device = l1.shape[1:], l2.shape[2], l1.device.index
    m_grouped_bf16.default_kernel(inter, True)  # dA
    m_grouped_bf16.default_kernel(hidden, True)  # dx's rows
    dtype1, dtype2 = grads.dtypes()
    k_grouped_bf16.default_kernel(hidden, inter, dtype2, grads.accumulate_dl2, device)
    k_grouped_bf16.default_kernel(two_inter, hidden, dtype1, grads.accumulate_dl1, device)
    for name in ("moe_gather_rows", "moe_swiglu_bwd", "moe_combine"):
        kernels.get_kernel(name)


def swiglu_backward_and_dl2(handle: MegaMoEHandle, dy_rows: torch.Tensor, d_act: torch.Tensor, grads: WeightGrads,
                            keep_handle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """From dA = dy_rows @ l2[e] (`d_act` ``[T * K, I]``, before the routing weights): the SwiGLU
    backward, then ``dl2 (+)= dy_rows^T @ (w * act)``. Returns ``(dz [T * K, 2I], row_dw
    [T * K])``, dz and ``w * act`` written over h and d_act (less peak memory) unless
    `keep_handle` (then dz is new). A consumed handle's h is None, and its autograd version is
    bumped so that a saved copy of it cannot be reused silently."""
    layout, h = handle.layout, handle.h
    dz, act_weighted, row_dw = moe_swiglu_bwd_bf16(h, d_act, layout, dz=None if keep_handle else h, act_weighted=d_act)
    if not keep_handle:
        handle.h = None
        torch.autograd.graph.increment_version(h)
    k_grouped_bf16_gemm_tn_contiguous(dy_rows, act_weighted, grads.get_dl2(), layout.offsets,
                                      accumulate=grads.accumulate_dl2)
    return dz, row_dw


def backward_to_dz(dy: torch.Tensor, l2: torch.Tensor, handle: MegaMoEHandle, grads: WeightGrads,
                   keep_handle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dA = dy[rows] @ l2[e] on dy's routed rows (copied first: they feed dl2's GEMM too), then
    `swiglu_backward_and_dl2`. Returns ``(dz [T * K, 2I], row_dw [T * K])``."""
    layout = handle.layout
    dy_rows = moe_gather_rows_bf16(dense_rows(dy), layout)
    d_act = dy_rows.new_empty(layout.num_slots, l2.shape[2])
    m_grouped_bf16_gemm_nn_contiguous(dy_rows, l2, d_act, layout.offsets)
    return swiglu_backward_and_dl2(handle, dy_rows, d_act, grads, keep_handle)


def dl1_gemm(dz: torch.Tensor, x: torch.Tensor, layout: RoutingLayout, grads: WeightGrads) -> None:
    """``dl1 (+)= dz^T @ x[rows]``: x's routed rows copied first."""
    x_rows = moe_gather_rows_bf16(dense_rows(x), layout)
    k_grouped_bf16_gemm_tn_contiguous(dz, x_rows, grads.get_dl1(), layout.offsets, accumulate=grads.accumulate_dl1)


def routing_weight_grad(row_dw: torch.Tensor, layout: RoutingLayout) -> torch.Tensor:
    """dtopk_weights ``[T, K]`` fp32 from each routed row's gradient (0 on empty slots)."""
    return torch.where(layout.slot_valid, row_dw.index_select(0, layout.slot_row.flatten()).view_as(layout.slot_row), 0.0)


_side_streams: dict = {}


class SideStream:
    """Work beside the current stream, as a block: entering it makes a side stream wait for what
    the current stream has queued so far (the fork); `run(fn)` queues `fn` on the side stream;
    leaving the block makes the current stream wait for the side stream, also on an error, so
    nothing the side stream reads is freed early (what it allocates comes from its own pool).
    On a CPU `run` just calls `fn`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream: Optional[torch.cuda.Stream] = None
        if device.type == "cuda":
            if device not in _side_streams:
                _side_streams[device] = torch.cuda.Stream(device=device)
            self.stream = _side_streams[device]

    def run(self, fn: Callable[[], None]) -> None:
        if self.stream is None:
            fn()
            return
        with torch.cuda.stream(self.stream):
            fn()

    def __enter__(self) -> "SideStream":
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return self

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


@contextmanager
def dx_rows_beside_dl1(dz: torch.Tensor, l1: torch.Tensor, x: torch.Tensor, layout: RoutingLayout,
                       grads: WeightGrads) -> Iterator[torch.Tensor]:
    """Yields dx's routed rows ``[T * K, H] = dz @ l1[e]`` while dl1's GEMM runs on a side stream
    (faster than after it at the same peak memory: docs/PERF.md, "Decisions"); the block's end
    joins it."""
    grads.get_dl1()  # (allocated on this stream, which the caller uses it on)
    with SideStream(dz.device) as side:
        side.run(lambda: dl1_gemm(dz, x, layout, grads))
        dx_rows = dz.new_empty(layout.num_slots, l1.shape[2])
        m_grouped_bf16_gemm_nn_contiguous(dz, l1, dx_rows, layout.offsets)
        yield dx_rows


def build_fp8_kernels(grads: WeightGrads) -> None:
    """Compiles (or reads from the disk cache) every kernel the FP8 backward launches, before it
    changes anything."""
    for producer, n in ((m_grouped_fp8.FP8_GATHERED_ROWS, grads.like2.shape[2]),  # dA (N = I), gathering dy's rows
                        (m_grouped_fp8.FP8_TMA_ROWS, grads.like1.shape[2])):  # dx (N = H)
        m_grouped_fp8.get_kernel(producer, m_grouped_fp8.get_config(n).block_n)
    for dtype, accumulate in zip(grads.dtypes(), (grads.accumulate_dl1, grads.accumulate_dl2)):
        k_grouped_fp8.get_kernel(dtype, accumulate)
    quant_kernels.get_kernel("rows", False)  # dy rows
    quant_kernels.get_kernel("activations", False)  # dy and x columns
    quant_kernels.get_kernel("weights_data_t", False)  # data gradients' copies the forward did not keep
    moe_kernels_fp8.get_kernel(False)
    kernels.get_kernel("moe_combine")


def fp8_data_gradient(rows, weights_t: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor, offsets: torch.Tensor,
                      **gemm_args) -> torch.Tensor:
    """``out[rows of e] = rows @ w[e]`` for FP8 `rows` and w ``[E, N, K]`` as
    `Fp8Weights.transposed_operand()` gives it; `gemm_args` go to the GEMM (row gathers, passes)."""
    m_grouped_fp8_gemm_nt_contiguous((rows.data, rows.scales), weights_t, out, offsets, **gemm_args)
    return out


def fp8_swiglu_backward_and_dl2(handle: MegaMoEHandle, d_act: torch.Tensor, dy_cols: Fp8Columns, grads: WeightGrads,
                                keep_handle: bool) -> tuple[Fp8Rows, Fp8Columns, torch.Tensor]:
    """`swiglu_backward_and_dl2` in FP8: the SwiGLU backward with its outputs quantized in the same
    pass (`moe_swiglu_bwd_fp8` on h ``[T * K, 2I]`` and `d_act` ``[T * K, I]``, bf16), then ``dl2
    (+)= dy^T @ (w * act)`` on `dy_cols` (dy's per-expert `Fp8Columns` of the layout's offsets).
    Returns ``(dz_rows Fp8Rows [T * K, 2I], dz_cols Fp8Columns, row_dw [T * K] fp32)``. No bf16 dz
    is written: a consumed handle's h (and its weights' copies) are released (None) here, h's
    memory for x's columns (`x_columns_storage`)."""
    layout = handle.layout
    dz_rows, dz_cols, act_cols, row_dw = moe_swiglu_bwd_fp8(handle.h, d_act, layout)
    if not keep_handle:
        handle.h = handle.dgrad_weights = None
    k_grouped_fp8_gemm_tn_contiguous((dy_cols.data, dy_cols.scales), (act_cols.data, act_cols.scales), grads.get_dl2(),
                                     dy_cols.padded_offsets, accumulate=grads.accumulate_dl2)
    return dz_rows, dz_cols, row_dw


def x_columns_storage(buffer: Optional[torch.Tensor], x: torch.Tensor | Fp8Rows,
                      layout: RoutingLayout) -> Optional[torch.Tensor]:
    """`buffer` (a dead tensor, e.g. a consumed handle's h) if x's columns for dl1 (``[H, T * K]``
    padded per expert, e4m3) can go into its memory (`fp8_quantize_columns`' `out_storage`), else
    None. Taken, its autograd version is bumped, so that a saved copy of it cannot be read
    silently."""
    if buffer is None:
        return None
    data = x.data if isinstance(x, Fp8Rows) else x
    nbytes = quant_kernels.fp8_columns_nbytes(data.shape[1], layout.num_slots, layout.offsets.numel() - 1)
    try:
        quant_kernels.check_storage(buffer, nbytes, data.device, dict(x=data, row_token=layout.row_token))
    except ValueError:
        return None
    torch.autograd.graph.increment_version(buffer)
    return buffer


def fp8_dl1_gemm(dz_cols: Fp8Columns, x: torch.Tensor | Fp8Rows, layout: RoutingLayout, grads: WeightGrads,
                 x_cols_storage: Optional[torch.Tensor] = None) -> None:
    """``dl1 (+)= dz^T @ x[rows]`` in FP8: x (bf16 tokens, or `Fp8Rows`) quantized per expert's
    columns, its routed rows gathered by the quantization's loads; with `x_cols_storage` (from
    `x_columns_storage`), those columns are written into its memory."""
    _, x_cols = fp8_quantize_columns(x, layout.offsets, row_index=layout.row_token, out_storage=x_cols_storage)
    k_grouped_fp8_gemm_tn_contiguous((dz_cols.data, dz_cols.scales), (x_cols.data, x_cols.scales), grads.get_dl1(),
                                     dz_cols.padded_offsets, accumulate=grads.accumulate_dl1)


def fp8_mega_moe_backward(dy: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, handle: MegaMoEHandle,
                          grads: WeightGrads, keep_handle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`mega_moe_backward` for a handle of recipe "fp8", its arguments already checked: fills
    `grads`, returns ``(dx [T, H] bf16, dtopk_weights [T, K] fp32)``."""
    layout, x = handle.layout, handle.x
    offsets, inter = layout.offsets, l2.shape[2]
    if dy.is_cuda:
        build_fp8_kernels(grads)
    # the forward's copies, or (a handle without them: Fp8WeightCopies.PER_GEMM, or made by hand)
    # each made just before its GEMM and dropped after it
    kept1, kept2 = handle.dgrad_weights or (None, None)
    # (dy's and x's routed rows are gathered by the quantization's loads: no routed bf16 copy)
    # dy quantized per token as rows (dA's GEMM gathers them: T rows written, not T * K) and, from
    # its routed rows gathered by the loads, per expert as columns (dl2's)
    dy_dense = dense_rows(dy)
    dy_rows = fp8_quantize_rows(dy_dense)
    _, dy_cols = fp8_quantize_columns(dy_dense, offsets, row_index=layout.row_token)
    d_act = fp8_data_gradient(dy_rows, fp8_dgrad_weights(l2, kept2), dy.new_empty(layout.num_slots, inter), offsets,
                              a_row_index=layout.row_token)
    del dy_rows, dy_dense, kept2
    # (a consumed handle's h is dead once the SwiGLU backward has read it)
    x_cols_storage = x_columns_storage(None if keep_handle else handle.h, x, layout)
    dz_rows, dz_cols, row_dw = fp8_swiglu_backward_and_dl2(handle, d_act, dy_cols, grads, keep_handle)
    del dy_cols, d_act
    # dx's GEMM and combine, then dl1, on this stream (side by side the two ran one after the other
    # anyway: each grid fills the GPU), so that dz's rows and dx's are freed before dl1 is
    # allocated, and x's columns take h's memory (docs/PERF.md, "Decisions": the FP8 backward's dl1)
    dx_rows = fp8_data_gradient(dz_rows, fp8_dgrad_weights(l1, kept1), dy.new_empty(layout.num_slots, x.shape[1]),
                                offsets)
    del dz_rows, kept1
    dx = moe_combine_bf16(dx_rows, layout, None, torch.empty_like(dy, memory_format=torch.contiguous_format))
    del dx_rows
    fp8_dl1_gemm(dz_cols, x, layout, grads, x_cols_storage)
    return dx, routing_weight_grad(row_dw, layout)


def mega_moe_backward(dy: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, handle: MegaMoEHandle, *,
                      weight_grad_dtype: torch.dtype = torch.float32, dl1: Optional[torch.Tensor] = None,
                      dl2: Optional[torch.Tensor] = None, keep_handle: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `deep_gemm.bf16_mega_moe` (or of `deep_gemm.fp8_mega_moe`: the handle's
    recipe, then the backward runs in FP8 too) given ``dy = dL/dy``.

    Args:
        dy: ``[T, H]`` bf16.
        l1, l2: the forward's weights (``[E, 2I, H]``, ``[E, H, I]`` bf16, contiguous, 16-byte
            aligned).
        handle: from ``bf16_mega_moe(..., training=True)``.
        weight_grad_dtype: float32 (default) or bfloat16 for new dl1/dl2.
        dl1, dl2: optional existing gradients (fp32 or bf16, contiguous, 16-byte aligned) to
            accumulate into, in place.
        keep_handle: by default the handle is consumed and a second backward with it raises:
            in bf16 its ``h`` is overwritten by its own gradient (2I bf16 per routed slot less
            peak memory; h's autograd version is bumped, so a saved copy of it cannot be reused
            silently); in FP8 h's memory takes x's columns for dl1 once the SwiGLU backward has
            read it (where they fit; its version bumped alike). True keeps it usable: in bf16 at
            the memory of a second h, in FP8 at x's columns' own.

    Returns:
        ``(dx [T, H] bf16, dtopk_weights [T, K] fp32 (0 on empty slots), dl1 [E, 2I, H],
        dl2 [E, H, I])``.

    Every argument is checked, and every kernel built, before any work: a call that raises leaves
    the handle and the caller's tensors as they were. New weight gradients are allocated at their
    GEMMs; dl2's GEMM runs before dx's rows are allocated, so that its operands are freed first;
    dl1's runs on a side stream beside the dx GEMM and combine in bf16, after them in FP8, where x's
    columns for it take the memory of the consumed handle's h (peak memory)."""
    check_backward_args(dy, l1, l2, handle, weight_grad_dtype, dl1, dl2, keep_handle)
    layout, x = handle.layout, handle.x
    grads = weight_grads(l1, l2, weight_grad_dtype, dl1, dl2)
    if handle.recipe == "fp8":
        dx, dtopk_weights = fp8_mega_moe_backward(dy, l1, l2, handle, grads, keep_handle)
        return dx, dtopk_weights, grads.get_dl1(), grads.get_dl2()
    if dy.is_cuda:
        build_kernels(l1, l2, grads)
    dz, row_dw = backward_to_dz(dy, l2, handle, grads, keep_handle)
    with dx_rows_beside_dl1(dz, l1, x, layout, grads) as dx_rows:
        dx = moe_combine_bf16(dx_rows, layout, None, torch.empty_like(dy, memory_format=torch.contiguous_format))
    return dx, routing_weight_grad(row_dw, layout), grads.get_dl1(), grads.get_dl2()
