"""Plain-PyTorch reference of the FP8 layer's recipe (docs/DESIGN.md, "The FP8 layer"): the
spec's math (`megamoe_bwd.reference`) on the values the recipe quantizes, dequantized, in
float32. The FP8 layer's outputs are judged against the float64 spec by how far this reference
is from it: within 1.5x of its error (`megamoe_bwd.testing`).

What the recipe quantizes, per expert e with routed rows in token order:
  forward   x per token 1 x 128; l1, l2 per 128 x 128; the activation a per row 1 x 128;
  backward  dy's routed rows per row (for dA = dy @ l2[e]) and per 128 x 1 columns of the
            expert's rows (for dl2 = dy^T @ (w a)); w a per 128 x 1 columns; dz per row (for
            dx = dz @ l1[e]) and per 128 x 1 columns (for dl1 = dz^T @ x); x's rows per 128 x 1
            columns (for dl1). dA itself is not quantized: the SwiGLU backward reads it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._kernels import quant_reference as q
from .reference import _check_inputs, _expert_rows


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t ``[n, K]`` as the recipe's 1 x 128 quantization leaves it (float32)."""
    return q.dequantize_rows(q.fp8_quantize_rows_torch(t))


def _columns(t: torch.Tensor) -> torch.Tensor:
    """t ``[n, K]`` (one expert's rows) as its 128 x 1 column quantization leaves it (float32)."""
    offsets = torch.tensor([0, t.shape[0]], dtype=torch.int32)
    return q.dequantize_columns(q.fp8_quantize_columns_torch(t, offsets)[1], offsets, t.shape[0])


def _weights(w: torch.Tensor) -> torch.Tensor:
    return q.dequantize_weights(q.fp8_quantize_weights_torch(w))


def reference_forward_fp8(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                          l2: torch.Tensor) -> torch.Tensor:
    """y ``[T, H]`` float32 of the FP8 recipe; shapes as in `reference_forward` (H and I
    multiples of 128), any float inputs (quantized from their float32 values)."""
    T, H, I, E, _ = _check_inputs(x, topk_idx, topk_weights, l1, l2)
    xq, w1, w2 = _rows(x), _weights(l1), _weights(l2)
    weights = topk_weights.float()
    y = xq.new_zeros(T, H)
    for e in range(E):
        tok, slot = _expert_rows(topk_idx, e)
        if tok.numel():
            z = xq[tok] @ w1[e].T
            a = F.silu(z[:, :I]) * z[:, I:]
            y.index_add_(0, tok, (_rows(a) @ w2[e].T) * weights[tok, slot].unsqueeze(-1))
    return y


def reference_backward_fp8(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                           l2: torch.Tensor, dy: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dtopk_weights, dl1, dl2)`` float32 of the FP8 recipe (`reference_backward`'s
    formulas on the quantized operands)."""
    T, H, I, E, K = _check_inputs(x, topk_idx, topk_weights, l1, l2, dy)
    xq, w1, w2 = _rows(x), _weights(l1), _weights(l2)
    weights = topk_weights.float()
    dx, dw = xq.new_zeros(T, H), xq.new_zeros(T, K)
    dl1, dl2 = xq.new_zeros(l1.shape), xq.new_zeros(l2.shape)
    for e in range(E):
        tok, slot = _expert_rows(topk_idx, e)
        if tok.numel() == 0:
            continue
        w = weights[tok, slot].unsqueeze(-1)
        z = xq[tok] @ w1[e].T
        g, u = z[:, :I], z[:, I:]
        sig = torch.sigmoid(g)
        a = g * sig * u
        dy_e = dy[tok].float()
        dA = _rows(dy_e) @ w2[e]
        dw[tok, slot] = (dA * a).sum(-1)
        dl2[e] = _columns(dy_e).T @ _columns(w * a)
        da = w * dA
        dz = torch.cat([da * u * sig * (1 + g * (1 - sig)), da * g * sig], dim=-1)
        dl1[e] = _columns(dz).T @ _columns(x[tok].float())
        dx.index_add_(0, tok, _rows(dz) @ w1[e])
    return dx, dw, dl1, dl2
