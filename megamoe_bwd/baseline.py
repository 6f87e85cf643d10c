"""``torch._grouped_mm`` MoE baseline (TorchTitan style).

This is what users run today, and the yardstick of the accuracy bar (docs/DESIGN.md): a kernel's
error against the float64 reference must be no worse than 1.5x this baseline's. It is
built from differentiable torch ops only, so autograd provides its backward.

Notes on ``torch._grouped_mm`` as found in torch 2.13
(schema ``_grouped_mm(Tensor self, Tensor mat2, Tensor? offs=None, Tensor? bias=None,
ScalarType? out_dtype=None) -> Tensor``; there is no docstring, the checks live in
``torch/_meta_registrations.py``):

* 2D ``[n, K]`` x 3D ``[G, K, N]`` with ``offs`` gives ``[n, N]``: group ``g`` is rows
  ``[offs[g-1], offs[g])`` times ``mat2[g]``. ``offs`` are *cumulative end* offsets,
  1D int32 of length ``G``. Empty groups are fine on sm90.
* Rows at or past ``offs[-1]`` are not computed: their output (and the gradient of those
  input rows) is uninitialised memory, so every row must belong to some group.
* Leading strides must be multiples of 16 bytes (``H`` and ``I`` multiples of 8 in bf16),
  with the last or second-to-last stride 1; a transposed view of a contiguous weight is
  accepted as-is (no copy).
* On CUDA the fast (CUTLASS) path is sm90+ and bf16; the meta function insists on bf16.
  This CPU build also runs it (a fallback, bf16/fp16/fp32), but the tests only run the
  baseline on CUDA.
* Group sizes need no padding for bf16 (old TorchTitan padded to 8/16; that is only
  needed for fp8/mxfp8 weight-gradient scaling).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ._kernels import testing

__all__ = ["grouped_mm_moe", "expert_mlps", "fp8_rowwise_moe"]


def _bf16_grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a [n, K] @ w[g].T`` per group for w ``[G, N, K]``: torch._grouped_mm."""
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)


class _Fp8RowwiseGroupedMM(torch.autograd.Function):
    """torchao-style FP8 grouped GEMM ``a [n, K] @ w[g].T`` on torch._scaled_grouped_mm, rowwise
    e4m3 scales (torch's quantization), fast accumulation, bf16 out; the backward the same: dA on
    w's transposed copy, dW by the 2d-2d form on groups padded to 16 rows (which reads the group
    sizes on the host: a sync)."""

    @staticmethod
    def forward(ctx, a, w, offs):
        ctx.save_for_backward(a, w, offs)
        return testing.torch_fp8_rowwise_grouped_mm(a, w, torch.cat([offs.new_zeros(1), offs]))

    @staticmethod
    def backward(ctx, dy):
        a, w, offs = ctx.saved_tensors
        group_offsets = torch.cat([offs.new_zeros(1), offs])
        da = testing.torch_fp8_rowwise_grouped_mm(dy.contiguous(), w.transpose(1, 2).contiguous(), group_offsets)
        sizes = (offs - torch.cat([offs.new_zeros(1), offs[:-1]])).tolist()
        dw, _ = testing.torch_fp8_rowwise_wgrad(dy, a, sizes)
        return da, dw().to(w.dtype), None


def _fp8_rowwise_grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _Fp8RowwiseGroupedMM.apply(a, w, offs)


def expert_mlps(xs: torch.Tensor, offs: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor,
                grouped_mm=_bf16_grouped_mm) -> torch.Tensor:
    """SwiGLU expert MLPs of expert-sorted rows: ``xs [n, H]``, ``offs`` int32 ``[E]``
    cumulative end rows (every row in some group), ``l1 [E, 2I, H]``, ``l2 [E, H, I]``;
    `grouped_mm(a, w, offs)` computes ``a @ w[g].T`` per group."""
    h = grouped_mm(xs, l1, offs)  # [n, 2I]
    g, u = h.chunk(2, dim=-1)
    return grouped_mm(F.silu(g) * u, l2, offs)  # [n, H]


def grouped_mm_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1: torch.Tensor,
    l2: torch.Tensor,
    grouped_mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = _bf16_grouped_mm,
) -> torch.Tensor:
    """MoE forward with two ``torch._grouped_mm`` calls (or `grouped_mm(a, w, offs)`, ``a @ w[g].T``
    per group); differentiable via autograd.

    Args:
        x: ``[T, H]`` bf16 activations.
        topk_idx: ``[T, K]`` int64 expert ids in ``[0, E)``, ``-1`` = empty slot.
        topk_weights: ``[T, K]`` float routing weights (cast to ``x.dtype`` before the
            multiply, as TorchTitan does); ignored on empty slots, whose gradient is 0.
        l1: ``[E, 2I, H]`` bf16, rows ``[0, I)`` gate, ``[I, 2I)`` up.
        l2: ``[E, H, I]`` bf16.

    Returns:
        ``y`` ``[T, H]`` in ``x.dtype``.

    No host sync: empty slots are not filtered out (that needs ``nonzero``); they are
    routed to the last expert with a zero input row and a zero weight instead, so they
    cost a few wasted rows of GEMM and add exactly nothing to any output or gradient.
    """
    T, H = x.shape
    K = topk_idx.shape[1]
    E = l1.shape[0]

    flat_idx = topk_idx.reshape(-1)  # pair p = t * K + k
    valid = flat_idx >= 0
    expert = torch.where(valid, flat_idx, E - 1)
    # Stable sort keeps token order inside each expert group (deterministic combine).
    order = torch.argsort(expert, stable=True)
    token = order // K
    counts = torch.bincount(expert, minlength=E)
    offs = torch.cumsum(counts, dim=0).to(torch.int32)

    keep = valid[order].unsqueeze(-1)
    xs = torch.where(keep, x.index_select(0, token), 0)  # [n, H], expert-major
    o = expert_mlps(xs, offs, l1, l2, grouped_mm)

    # where (not multiply by a mask) so the empty slots' weight gradient is exactly 0.
    w = torch.where(valid, topk_weights.reshape(-1), 0)
    o = o * w.index_select(0, order).to(x.dtype).unsqueeze(-1)
    return x.new_zeros(T, H).index_add(0, token, o)


def fp8_rowwise_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                    l2: torch.Tensor) -> torch.Tensor:
    """`grouped_mm_moe` with its four expert GEMMs (and their gradients) in FP8 the torchao way:
    torch._scaled_grouped_mm with rowwise scales from torch's own quantization (the FP8 layer's
    baseline in scripts/bench_mega_moe.py). CUDA only; H and I multiples of 16."""
    return grouped_mm_moe(x, topk_idx, topk_weights, l1, l2, grouped_mm=_fp8_rowwise_grouped_mm)
