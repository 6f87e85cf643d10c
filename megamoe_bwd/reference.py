"""Plain-PyTorch reference MoE layer: the spec every kernel is judged against.

Contract (docs/DESIGN.md, "The contract"), per rank with ``T`` tokens, hidden ``H``,
expert intermediate ``I``, ``K`` slots per token and ``E`` experts:

* ``x`` ``[T, H]``; ``topk_idx`` ``[T, K]`` int64 expert ids, ``-1`` = empty slot;
  ``topk_weights`` ``[T, K]`` float.
* ``l1`` ``[E, 2I, H]``: rows ``[0, I)`` are the gate projection, ``[I, 2I)`` the up one.
* ``l2`` ``[E, H, I]``.
* ``y[t] = sum_{k: idx[t,k] >= 0} w[t,k] * l2[e] @ (silu(g) * u)`` with
  ``g = l1[e, :I] @ x[t]``, ``u = l1[e, I:] @ x[t]``, ``e = idx[t,k]``.

The functions here compute in the dtype of their inputs: callers pass float64 on the CPU
or float32 on the GPU. They loop over experts (not tokens) and are written for clarity,
not speed; the host syncs they do (``nonzero``) are fine for a reference.
"""
from __future__ import annotations

import math
import os
from typing import Literal

import torch

from ._kernels import relative_error  # noqa: F401  (re-exported: part of the spec's toolkit)
import torch.nn.functional as F

__all__ = [
    "reference_forward",
    "reference_backward",
    "make_moe_inputs",
    "relative_error",
]

Routing = Literal["uniform", "skewed", "one_hot"]

# Exponent of the Zipf-like expert popularity used by ``routing="skewed"``.
_ZIPF_EXPONENT = 1.2


def _check_inputs(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1: torch.Tensor,
    l2: torch.Tensor,
    dy: torch.Tensor | None = None,
) -> tuple[int, int, int, int, int]:
    """Validate shapes/dtypes/devices; return ``(T, H, I, E, K)``."""
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_weights.dim() != 2:
        raise ValueError(
            f"expected x [T,H], topk_idx [T,K], topk_weights [T,K]; got "
            f"{tuple(x.shape)}, {tuple(topk_idx.shape)}, {tuple(topk_weights.shape)}"
        )
    if l1.dim() != 3 or l2.dim() != 3:
        raise ValueError(
            f"expected l1 [E,2I,H] and l2 [E,H,I]; got {tuple(l1.shape)}, {tuple(l2.shape)}"
        )
    T, H = x.shape
    E, H2, I = l2.shape
    K = topk_idx.shape[1]
    if topk_idx.shape != (T, K) or topk_weights.shape != (T, K):
        raise ValueError(
            f"topk_idx {tuple(topk_idx.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [T={T}, K]"
        )
    if l1.shape != (E, 2 * I, H) or H2 != H:
        raise ValueError(
            f"l1 {tuple(l1.shape)} / l2 {tuple(l2.shape)} do not match [E,2I,H] / [E,H,I] "
            f"with H={H}"
        )
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx must be int64, got {topk_idx.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    others = {"l1": l1, "l2": l2} if dy is None else {"l1": l1, "l2": l2, "dy": dy}
    if dy is not None and dy.shape != x.shape:
        raise ValueError(f"dy {tuple(dy.shape)} must have the shape of x {tuple(x.shape)}")
    # Same compute dtype everywhere: mixing silently would make the "reference" only as
    # precise as its least precise operand.
    for name, t in others.items():
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, expected x's dtype {x.dtype}")
    for name, t in {"topk_idx": topk_idx, "topk_weights": topk_weights, **others}.items():
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected x's device {x.device}")
    if topk_idx.numel() > 0:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= E:
            raise ValueError(f"topk_idx values must lie in [-1, {E}); got range [{lo}, {hi}]")
    return T, H, I, E, K


def _expert_rows(topk_idx: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, slot) index pairs routed to expert ``e``, in token order."""
    tok, slot = (topk_idx == e).nonzero(as_tuple=True)
    return tok, slot


def reference_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1: torch.Tensor,
    l2: torch.Tensor,
) -> torch.Tensor:
    """Forward pass of the MoE layer.

    Args:
        x: ``[T, H]`` activations (float64 on CPU or float32 on GPU, typically).
        topk_idx: ``[T, K]`` int64 expert ids in ``[0, E)``, ``-1`` for an empty slot.
        topk_weights: ``[T, K]`` routing weights, any float dtype (cast to ``x.dtype``);
            ignored on empty slots.
        l1: ``[E, 2I, H]`` gate (rows ``[0, I)``) and up (rows ``[I, 2I)``) weights,
            ``x.dtype``.
        l2: ``[E, H, I]`` down weights, ``x.dtype``.

    Returns:
        ``y`` ``[T, H]`` in ``x.dtype`` on ``x.device``. Differentiable with autograd.
    """
    T, H, I, E, _ = _check_inputs(x, topk_idx, topk_weights, l1, l2)
    w_all = topk_weights.to(x.dtype)
    y = x.new_zeros(T, H)
    for e in range(E):
        tok, slot = _expert_rows(topk_idx, e)
        if tok.numel() == 0:
            continue
        z = x[tok] @ l1[e].T  # [n, 2I]
        g, u = z[:, :I], z[:, I:]
        a = F.silu(g) * u  # [n, I]
        out = (a @ l2[e].T) * w_all[tok, slot].unsqueeze(-1)  # [n, H]
        # index_add (not index_put) so two slots of one token to one expert still add up.
        y = y.index_add(0, tok, out)
    return y


def reference_backward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1: torch.Tensor,
    l2: torch.Tensor,
    dy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward pass of the MoE layer with explicit formulas (no autograd).

    Per expert ``e`` with routed rows ``x_e`` ``[n, H]``, weights ``w`` ``[n, 1]`` and
    output gradients ``dy_e`` ``[n, H]``::

        g, u  = split(x_e @ l1[e].T)            # [n, I] each
        a     = silu(g) * u
        dA    = dy_e @ l2[e]                    # [n, I]  (= d y / d a, unweighted)
        dw    = rowsum(dA * a)                  # routing-weight gradient
        da    = w * dA
        dl2[e] = (w * dy_e).T @ a               # [H, I]
        dg    = da * u * dsilu(g),  du = da * silu(g)
        dl1[e] = [dg, du].T @ x_e               # [2I, H]
        dx[tok] += [dg, du] @ l1[e]             # [n, H]

    with ``dsilu(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))``.

    Args:
        x, topk_idx, topk_weights, l1, l2: as in :func:`reference_forward`.
        dy: ``[T, H]`` gradient of the output, ``x.dtype``.

    Returns:
        ``(dx, dtopk_weights, dl1, dl2)``: ``dx`` ``[T, H]`` in ``x.dtype``,
        ``dtopk_weights`` ``[T, K]`` in ``topk_weights.dtype`` (exactly 0 on empty
        slots), ``dl1`` ``[E, 2I, H]`` in ``l1.dtype``, ``dl2`` ``[E, H, I]`` in
        ``l2.dtype`` (zero for experts that received no tokens). Everything is computed
        in ``x.dtype``.
    """
    T, H, I, E, K = _check_inputs(x, topk_idx, topk_weights, l1, l2, dy)
    w_all = topk_weights.to(x.dtype)
    dx = torch.zeros_like(x)
    dw = x.new_zeros(T, K)
    dl1 = torch.zeros_like(l1)
    dl2 = torch.zeros_like(l2)
    for e in range(E):
        tok, slot = _expert_rows(topk_idx, e)
        if tok.numel() == 0:
            continue
        x_e, dy_e = x[tok], dy[tok]
        w = w_all[tok, slot].unsqueeze(-1)  # [n, 1]

        z = x_e @ l1[e].T
        g, u = z[:, :I], z[:, I:]
        sig = torch.sigmoid(g)
        silu = g * sig
        a = silu * u

        dA = dy_e @ l2[e]  # [n, I]
        # dw[t,k] = <dy_t, l2[e] @ a> = <dy_t @ l2[e], a>: no need for the expert output.
        dw[tok, slot] = (dA * a).sum(-1)
        dl2[e] = (w * dy_e).T @ a

        da = w * dA
        dg = da * u * sig * (1 + g * (1 - sig))
        du = da * silu
        dz = torch.cat([dg, du], dim=-1)  # [n, 2I], same row layout as l1
        dl1[e] = dz.T @ x_e
        dx.index_add_(0, tok, dz @ l1[e])
    return dx, dw.to(topk_weights.dtype), dl1, dl2


def _draw_topk_idx(
    T: int, E: int, K: int, routing: Routing, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """``[T, K]`` int64: K distinct experts per token under the given routing law."""
    if routing == "uniform":
        # argsort of iid uniforms = a random permutation per row; its first K are a
        # uniformly random K-subset.
        return torch.rand(T, E, generator=gen, device=device).argsort(dim=1)[:, :K]
    if routing == "skewed":
        ranks = torch.arange(1, E + 1, device=device, dtype=torch.float64)
        p = ranks.pow(-_ZIPF_EXPONENT).to(torch.float32)
        return torch.multinomial(p.expand(T, E), K, replacement=False, generator=gen)
    if routing == "one_hot":
        # Expert 0 in every token's set (the worst hot spot); the rest uniform over 1..E-1.
        rest = torch.rand(T, E - 1, generator=gen, device=device).argsort(dim=1)[:, : K - 1] + 1
        idx = torch.cat([torch.zeros(T, 1, dtype=torch.int64, device=device), rest], dim=1)
        # Shuffle slot positions so kernels cannot rely on expert 0 sitting in slot 0.
        perm = torch.rand(T, K, generator=gen, device=device).argsort(dim=1)
        return idx.gather(1, perm)
    raise ValueError(f"unknown routing {routing!r}; expected 'uniform', 'skewed' or 'one_hot'")


def make_moe_inputs(
    T: int,
    H: int,
    I: int,
    E: int,
    K: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    routing: Routing = "uniform",
    empty_slot_frac: float = 0.0,
    seed: int | None = None,
) -> dict[str, torch.Tensor]:
    """Draw a random MoE problem.

    Weights are scaled by ``1/sqrt(fan_in)`` so activations stay O(1) at any size.
    Each call draws fresh data unless ``seed`` is given (same seed + device = same data).

    Args:
        T, H, I, E, K: tokens, hidden size, expert intermediate size, experts, slots
            per token (``1 <= K <= E``).
        dtype: dtype of ``x``, ``l1``, ``l2`` and ``dy``.
        device: where every tensor is drawn (the generator lives there too).
        routing: ``"uniform"`` (K distinct experts uniformly at random), ``"skewed"``
            (Zipf-like popularity ``p_e ∝ 1/(e+1)^1.2``, sampled without replacement),
            or ``"one_hot"`` (expert 0 in every token's set, the rest uniform).
        empty_slot_frac: probability that each slot is set to ``-1`` (independently).
        seed: RNG seed; ``None`` draws one from the OS.

    Returns:
        dict with ``x`` ``[T,H]`` dtype, ``topk_idx`` ``[T,K]`` int64,
        ``topk_weights`` ``[T,K]`` float32 (softmax over slots; left random on empty
        slots since kernels must ignore them), ``l1`` ``[E,2I,H]`` dtype,
        ``l2`` ``[E,H,I]`` dtype and ``dy`` ``[T,H]`` dtype.
    """
    if min(T, H, I, E, K) < 0 or min(H, I, E, K) == 0:
        raise ValueError(f"need T >= 0 and H, I, E, K >= 1; got {(T, H, I, E, K)}")
    if K > E:
        raise ValueError(f"K={K} distinct experts per token need E >= K, got E={E}")
    if not 0.0 <= empty_slot_frac <= 1.0:
        raise ValueError(f"empty_slot_frac must be in [0, 1], got {empty_slot_frac}")
    device = torch.device(device)
    if seed is None:
        # From the OS, not torch's global RNG: no side effect on the caller's RNG state.
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        # Drawn straight in the target dtype: big weights never need a float32 copy.
        t = torch.randn(*shape, generator=gen, device=device, dtype=dtype)
        return t.mul_(scale) if scale != 1.0 else t

    x = randn(T, H)
    l1 = randn(E, 2 * I, H, scale=1.0 / math.sqrt(H))
    l2 = randn(E, H, I, scale=1.0 / math.sqrt(I))
    topk_idx = _draw_topk_idx(T, E, K, routing, gen, device)
    if empty_slot_frac > 0.0:
        empty = torch.rand(T, K, generator=gen, device=device) < empty_slot_frac
        topk_idx = topk_idx.masked_fill(empty, -1)
    logits = torch.randn(T, K, generator=gen, device=device, dtype=torch.float32)
    topk_weights = logits.softmax(dim=-1)
    dy = randn(T, H)
    return {
        "x": x,
        "topk_idx": topk_idx,
        "topk_weights": topk_weights,
        "l1": l1,
        "l2": l2,
        "dy": dy,
    }
