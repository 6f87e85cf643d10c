"""M-grouped bf16 GEMMs (MoE forward and data gradients), contiguous layout, ragged groups."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..jit.runtime import pack_params
from ..jit.tma import make_tma_2d_desc, make_tma_3d_desc
from ..utils import (check_cuda_devices, check_group_offsets, check_multiple, check_tensor, get_num_sms,
                     print_configs_enabled)
from .common import (BLOCK_K, BLOCK_M, GemmConfig, build_gemm_kernel, make_config, row_staging_bytes,
                     swizzled_staging_bytes)

_BLOCK_NS = (128, 256)
MAX_PASSES = 32  # the kernel's producer keeps one bit per pass


def _staging_bytes(block_n: int, async_store: bool, tma_store: bool) -> int:
    if async_store:
        return row_staging_bytes(block_n, 2)
    # Mirrors epilogue::StagedBF16: two warpgroups x 64 rows x (<=128 columns + 16-byte pad).
    staged = 2 * 64 * (min(block_n, 128) * 2 + 16)
    if not tma_store:
        return staged
    # Tensor stores, and staged stores for a group's last rows: the larger, per warpgroup
    # rounded up to 1024 bytes (the swizzle's alignment).
    per_warpgroup = max(staged, swizzled_staging_bytes()) // 2
    return 2 * (-(-per_warpgroup // 1024) * 1024)


def make_m_grouped_config(block_n: int, async_store: bool = False, tma_store: bool = False) -> GemmConfig:
    if async_store and tma_store:
        raise ValueError("tma_store and async_store exclude each other")
    return make_config(block_n, async_store, _staging_bytes(block_n, async_store, tma_store), tma_store)


@functools.lru_cache(maxsize=None)
def get_config(n: int) -> GemmConfig:
    """The variant the launchers pick for output width `n`: outputs drain through tensor stores
    that overlap the next tile's MMAs (session 7's sweep: 1-14% faster than staged stores by
    the math threads on 11 of 12 shapes, PERF.md)."""
    return make_m_grouped_config(256 if n > 128 else 128, tma_store=True)


@functools.lru_cache(maxsize=None)
def get_swiglu_bwd_config(n: int) -> GemmConfig:
    """The SwiGLU-backward epilogue's variant: `get_config`'s tile width, stores by the math
    threads (that epilogue writes its outputs from registers)."""
    return make_m_grouped_config(get_config(n).block_n)


def all_configs() -> list[GemmConfig]:
    """Every variant a caller may pass as `config`."""
    return [make_m_grouped_config(block_n, async_store, tma_store) for block_n in _BLOCK_NS
            for async_store, tma_store in ((False, False), (True, False), (False, True))]


@functools.lru_cache(maxsize=None)
def get_kernel(config: GemmConfig, b_mn_major: bool, gather_a: bool = False, swiglu: bool = False,
               swiglu_bwd: bool = False):
    major = "deep_gemm::mma::Major::kMNMajor" if b_mn_major else "deep_gemm::mma::Major::kKMajor"
    if swiglu_bwd and config.tma_store:
        raise ValueError("the SwiGLU-backward epilogue stores from registers: pick a config without tma_store")
    flag = lambda v: str(v).lower()  # noqa: E731
    args = [config.block_n, config.num_stages, major, flag(config.async_store), flag(gather_a), flag(swiglu),
            flag(swiglu_bwd), flag(config.tma_store)]
    return build_gemm_kernel("sm90_bf16_m_grouped_gemm.cuh", "MGroupedGemmParams", "sm90_bf16_m_grouped_gemm_impl",
                             args, config.smem_bytes)


# The SwiGLU epilogue's variants: 256-wide tiles (128 gate + 128 up columns), outputs by tensor
# stores (the default) or staged stores.
SWIGLU_CONFIGS = (make_m_grouped_config(256, tma_store=True), make_m_grouped_config(256))
SWIGLU_CONFIG = SWIGLU_CONFIGS[0]


_printed: set = set()


def _launch(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, group_offsets: torch.Tensor, b_mn_major: bool,
            config: Optional[GemmConfig], a_row_index: Optional[torch.Tensor],
            act: Optional[torch.Tensor] = None, swiglu_bwd: Optional[tuple] = None, num_passes: int = 1,
            ready_flags: Optional[torch.Tensor] = None, pass_range: Optional[tuple[int, int]] = None) -> None:
    """`act`: the SwiGLU forward epilogue's second output; `swiglu_bwd`: (h, row_weight,
    row_dw_part) of the SwiGLU backward epilogue, whose `d` is act_weighted; `num_passes`,
    `ready_flags`, `pass_range`: see `m_grouped_bf16_gemm_nt_contiguous`."""
    layout = "nn_swiglu_bwd" if swiglu_bwd is not None else ("nn" if b_mn_major else
                                                            ("nt_swiglu" if act is not None else "nt"))
    check_tensor("a", a, torch.bfloat16, 2)
    check_tensor("b", b, torch.bfloat16, 3)
    check_tensor("d", d, torch.bfloat16, 2)
    if not 1 <= num_passes <= MAX_PASSES:
        raise ValueError(f"num_passes must be in [1, {MAX_PASSES}], got {num_passes}")
    num_runs = check_group_offsets(group_offsets)
    if num_runs % num_passes:
        raise ValueError(f"group_offsets describes {num_runs} runs, not a multiple of num_passes = {num_passes}")
    num_groups = num_runs // num_passes
    pass_begin, pass_end = (0, num_passes) if pass_range is None else pass_range
    if not 0 <= pass_begin < pass_end <= num_passes:
        raise ValueError(f"pass_range must satisfy 0 <= begin < end <= num_passes = {num_passes}, got {pass_range}")
    if ready_flags is not None:
        check_tensor("ready_flags", ready_flags, torch.int32, 1)
        if ready_flags.numel() < num_passes:
            raise ValueError(f"ready_flags needs {num_passes} entries, has {ready_flags.numel()}")
    a_rows, k = a.shape
    m = a_rows
    if a_row_index is not None:
        check_tensor("a_row_index", a_row_index, torch.int64, 1)
        m = a_row_index.numel()
    if b_mn_major:
        g, k_b, n = b.shape
        check_multiple("K (nn layout: groups of B are stacked along K)", k, BLOCK_K)
    else:
        g, n, k_b = b.shape
    if g != num_groups:
        raise ValueError(f"b has {g} groups but group_offsets describes {num_groups}"
                         + (f" ({num_passes} passes each)" if num_passes > 1 else ""))
    if k_b != k:
        raise ValueError(f"contraction sizes differ: a has K = {k}, b has K = {k_b}")
    if tuple(d.shape) != (m, n):
        raise ValueError(f"d must have shape {(m, n)}, got {tuple(d.shape)}")
    if act is not None:
        check_tensor("act", act, torch.bfloat16, 2)
        check_multiple("N = 2I (the SwiGLU epilogue pairs 128 gate with 128 up columns)", n, 256)
        if tuple(act.shape) != (m, n // 2):
            raise ValueError(f"act must have shape {(m, n // 2)}, got {tuple(act.shape)}")
        if config is not None and config not in SWIGLU_CONFIGS:
            raise ValueError(f"the SwiGLU epilogue runs only as one of {SWIGLU_CONFIGS}")
        config = config or SWIGLU_CONFIG
    if swiglu_bwd is not None:
        h, row_weight, row_dw_part = swiglu_bwd
        check_tensor("h", h, torch.bfloat16, 2)
        check_tensor("row_weight", row_weight, torch.float32, 1)
        check_tensor("row_dw_part", row_dw_part, torch.float32, 2)
        if tuple(h.shape) != (m, 2 * n) or row_weight.numel() != m:
            raise ValueError(f"h must be [{m}, {2 * n}] and row_weight [{m}], got {tuple(h.shape)} and "
                             f"{tuple(row_weight.shape)}")
        config = config or get_swiglu_bwd_config(n)
        if tuple(row_dw_part.shape) != (m, -(-n // config.block_n)) or config.async_store or config.tma_store:
            raise ValueError(f"row_dw_part must be [{m}, ceil(N / {config.block_n})] (a synchronous-store config)")
    check_multiple("K", k, 8)
    check_multiple("N", n, 8)
    if max(m, a_rows, n, k) >= 2**31 or g * max(n, k) >= 2**31:
        raise ValueError("dimensions must stay below 2**31")
    if config is not None and config not in all_configs():
        raise ValueError(f"unknown config {config}; pick one of all_configs()")
    extra = {} if a_row_index is None else {"a_row_index": a_row_index}
    if act is not None:
        extra["act"] = act
    if swiglu_bwd is not None:
        extra.update(h=h, row_weight=row_weight, row_dw_part=row_dw_part)
    if ready_flags is not None:
        extra["ready_flags"] = ready_flags
    device = check_cuda_devices(a=a, b=b, d=d, group_offsets=group_offsets, **extra)
    if m == 0 or n == 0 or num_groups == 0:
        return
    if k == 0 or a_rows == 0:
        raise ValueError("K must be positive and a non-empty when rows are gathered from it")

    config = config or get_config(n)
    if print_configs_enabled() and (layout, m, n, k, g) not in _printed:
        _printed.add((layout, m, n, k, g))
        print(f"[deep_gemm] m_grouped_bf16_gemm_{layout}: M={m} N={n} K={k} G={g} -> {config}")
    tma_a = make_tma_2d_desc(a, a_rows, k, 64, BLOCK_M)  # with a_row_index the kernel reads `a` directly
    if b_mn_major:
        tma_b = make_tma_2d_desc(b, g * k, n, 64, BLOCK_K)
    else:  # the SwiGLU epilogue loads a tile's gate and up rows as two half-height boxes
        tma_b = make_tma_2d_desc(b, g * n, k, 64, config.block_n // (2 if act is not None else 1))
    aux = act if act is not None else (h if swiglu_bwd is not None else None)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    tma_d = make_tma_3d_desc(d.unsqueeze(0), 64, 64) if config.tma_store else bytes(128)
    tma_aux = make_tma_3d_desc(act.unsqueeze(0), 64, 64) if config.tma_store and act is not None else bytes(128)
    params = pack_params([tma_a, tma_b, tma_d, tma_aux], [d.data_ptr(), ptr(aux), group_offsets.data_ptr(), ptr(a_row_index),
                                          a.data_ptr(), ptr(row_weight if swiglu_bwd else None),
                                          ptr(row_dw_part if swiglu_bwd else None), ptr(ready_flags)],
                         [m, n, k, num_groups, a_rows, num_passes, pass_begin, pass_end])
    num_tiles_bound = (m // BLOCK_M + num_runs) * ((n + config.block_n - 1) // config.block_n)
    num_sms = min(get_num_sms(device.index), max(num_tiles_bound, 1))
    get_kernel(config, b_mn_major, a_row_index is not None, act is not None,
               swiglu_bwd is not None).launch(params, num_sms, device.index)


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                      group_offsets: torch.Tensor, *, a_row_index: Optional[torch.Tensor] = None,
                                      config: Optional[GemmConfig] = None, num_passes: int = 1,
                                      ready_flags: Optional[torch.Tensor] = None,
                                      pass_range: Optional[tuple[int, int]] = None) -> None:
    """Grouped ``D[rows of g] = A[rows of g] @ B[g].T`` (MoE forward), in place into `d`.

    Args:
        a: ``[M, K]`` bf16, row-major; groups of rows back to back.
        b: ``[G, N, K]`` bf16, row-major (each group's matrix is K-major, like nn.Linear weights).
        d: ``[M, N]`` bf16 output. Only rows inside a group are written.
        group_offsets: ``[G + 1]`` int32 on the GPU: group g owns rows
            ``[group_offsets[g], group_offsets[g + 1])``. Non-decreasing, within ``[0, M]``;
            sizes are arbitrary (zero, not multiples of any tile). Read on the GPU: no host sync.
        a_row_index: optional int64 ``[M]``: row i of A is ``a[a_row_index[i]]``, gathered by the
            kernel's loads (no permuted copy of `a`); `a` is then ``[T, K]`` for any T and `d`
            has M rows. Indices outside ``[0, T)`` read zeros.
        config: force a kernel variant (one of `deep_gemm.gemm.m_grouped_bf16.all_configs()`);
            the default picks by N.
        num_passes: S >= 1. With S > 1, each group's rows come in S runs back to back and
            `group_offsets` has ``G * S + 1`` entries: run (g, s) owns rows
            ``[group_offsets[g * S + s], group_offsets[g * S + s + 1])``. The kernel works pass by
            pass (every group's run s before any run s + 1).
        ready_flags: optional int32 ``[>= S]`` on the GPU: tiles of pass s > 0 read A only once
            ``ready_flags[s] != 0``, so that rows still being copied in (by another stream, e.g.
            a copy engine, which then sets the flag) are read after they land while earlier
            passes already run. The writer must need no SM: this kernel may hold every SM
            while it waits (copy engines and stream memory operations qualify, e.g. a copy
            from another GPU's memory or from pinned host memory; a kernel, or a copy whose
            source and destination both lie in this GPU's memory, does not). A wait of ~10 s
            traps.
        pass_range: optional ``(begin, end)``: this launch computes only the runs of passes
            ``begin <= s < end`` (rows of other passes are left as they are), so that a caller
            can act on some passes' results before the others are computed.

    Requires K and N multiples of 8 and 16-byte aligned tensors. Accumulates in fp32.
    """
    _launch(a, b, d, group_offsets, False, config, a_row_index, num_passes=num_passes, ready_flags=ready_flags,
            pass_range=pass_range)


def m_grouped_bf16_gemm_nn_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                      group_offsets: torch.Tensor, *, a_row_index: Optional[torch.Tensor] = None,
                                      config: Optional[GemmConfig] = None, num_passes: int = 1,
                                      ready_flags: Optional[torch.Tensor] = None,
                                      pass_range: Optional[tuple[int, int]] = None) -> None:
    """Grouped ``D[rows of g] = A[rows of g] @ B[g]`` (MoE data gradient), in place into `d`.

    Args:
        a: ``[M, K]`` bf16, row-major; groups of rows back to back.
        b: ``[G, K, N]`` bf16, row-major (e.g. the forward's ``[G, N_fwd, K_fwd]`` weights,
            whose transpose is applied without a copy).
        d: ``[M, N]`` bf16 output. Only rows inside a group are written.
        group_offsets: ``[G + 1]`` int32 on the GPU, as in `m_grouped_bf16_gemm_nt_contiguous`.
        a_row_index: optional int64 ``[M]`` row gather of `a`, as in the nt version.
        config: force a kernel variant (one of `all_configs()`); the default picks by N.
        num_passes, ready_flags, pass_range: rows in passes (that wait for their data, that
            one launch computes), as in `m_grouped_bf16_gemm_nt_contiguous`.

    Requires K a multiple of 64, N a multiple of 8 and 16-byte aligned tensors.
    """
    _launch(a, b, d, group_offsets, True, config, a_row_index, num_passes=num_passes, ready_flags=ready_flags,
            pass_range=pass_range)


def m_grouped_bf16_gemm_nt_swiglu_contiguous(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor, act: torch.Tensor,
                                             group_offsets: torch.Tensor, *,
                                             a_row_index: Optional[torch.Tensor] = None, num_passes: int = 1,
                                             ready_flags: Optional[torch.Tensor] = None,
                                             config: Optional[GemmConfig] = None) -> None:
    """The MoE's first GEMM with SwiGLU in its epilogue: ``h = A @ B[g].T`` and
    ``act = silu(h[:, :I]) * h[:, I:]`` (from the fp32 accumulators), per group of rows.

    Args:
        a: ``[M, K]`` bf16 (or any number of rows with `a_row_index`, as in the nt GEMM).
        b: ``[G, 2I, K]`` bf16: rows ``[0, I)`` gate, ``[I, 2I)`` up of each group (natural
            layout, no interleaving needed).
        h: ``[M, 2I]`` bf16 output (GEMM result, gate then up columns).
        act: ``[M, I]`` bf16 output.
        group_offsets: ``[G + 1]`` int32 on the GPU, as in `m_grouped_bf16_gemm_nt_contiguous`.
        a_row_index: optional int64 ``[M]`` row gather of `a`.
        num_passes, ready_flags: rows in passes that wait for their data, as in
            `m_grouped_bf16_gemm_nt_contiguous`.
        config: one of `deep_gemm.gemm.m_grouped_bf16.SWIGLU_CONFIGS` (default: the first).

    Requires I a multiple of 128 and K a multiple of 8. Only rows inside a group are written.
    """
    _launch(a, b, h, group_offsets, False, config, a_row_index, act, num_passes=num_passes, ready_flags=ready_flags)


def m_grouped_bf16_gemm_nn_swiglu_bwd_contiguous(a: torch.Tensor, b: torch.Tensor, act_weighted: torch.Tensor,
                                                 h: torch.Tensor, row_weight: torch.Tensor,
                                                 group_offsets: torch.Tensor, *,
                                                 a_row_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The MoE backward's first GEMM with the SwiGLU backward in its epilogue: per group of rows,
    ``D = A @ B[g]`` (= dL/d(act) before the routing weight w), kept in fp32 registers, then

    - ``h = [g | u]`` is overwritten by its gradient ``dz`` for ``w * D``,
    - ``act_weighted = w * silu(g) * u`` (dl2's operand),
    - returns ``row_dw [M]`` fp32 = ``<D, silu(g) * u>`` per row (the routing-weight gradient).

    Args:
        a: ``[M, K]`` bf16 (or any number of rows with `a_row_index`, as in the nn GEMM).
        b: ``[G, K, N]`` bf16 (the forward's second weight, N = I).
        act_weighted: ``[M, N]`` bf16 output.
        h: ``[M, 2N]`` bf16, read and overwritten in place.
        row_weight: ``[M]`` fp32 routing weight of each row.
        group_offsets: ``[G + 1]`` int32 on the GPU, as in `m_grouped_bf16_gemm_nt_contiguous`.
        a_row_index: optional int64 ``[M]`` row gather of `a`.

    Only rows inside a group are written (row_dw is undefined elsewhere). K a multiple of 64,
    N of 8. Deterministic: each row's sum is reduced in a fixed order.
    """
    check_tensor("act_weighted", act_weighted, torch.bfloat16, 2)
    config = get_swiglu_bwd_config(act_weighted.shape[1])
    row_dw_part = torch.empty(act_weighted.shape[0], -(-act_weighted.shape[1] // config.block_n),
                              device=act_weighted.device, dtype=torch.float32)
    _launch(a, b, act_weighted, group_offsets, True, config, a_row_index, swiglu_bwd=(h, row_weight, row_dw_part))
    return row_dw_part.sum(1)
