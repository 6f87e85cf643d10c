"""PyTorch emulations of the kernels with their contracts, in any dtype and on any device, so
code built on them can be tested on a CPU in float64. Rows the kernels leave unwritten (outside
every group, or past the routed rows) are filled with NaN here, so any leak shows."""
import torch
import torch.nn.functional as F

from ..quant.reference import fp8_quantize_columns_torch, fp8_quantize_rows_torch


def _bounds(group_offsets: torch.Tensor):
    offsets = group_offsets.tolist()
    return list(zip(offsets[:-1], offsets[1:]))


def _m_grouped(a, b, d, group_offsets, transpose_b: bool, a_row_index=None, num_passes: int = 1, pass_range=None):
    if a_row_index is not None:
        a = a.index_select(0, a_row_index)
    if pass_range is None:  # (a launch over some passes leaves the others' rows as they are)
        d.fill_(float("nan"))
    begin, end_pass = (0, num_passes) if pass_range is None else pass_range
    for run, (start, end) in enumerate(_bounds(group_offsets)):  # run g * S + s uses group g's B
        g = run // num_passes
        if not begin <= run % num_passes < end_pass:
            continue
        w = b[g].T if transpose_b else b[g]
        d[start:end] = (a[start:end].to(torch.float64) @ w.to(torch.float64)).to(d.dtype)


def m_grouped_gemm_nt(a, b, d, group_offsets, *, a_row_index=None, num_passes=1, pass_range=None, **_):
    """Emulates `deep_gemm.m_grouped_bf16_gemm_nt_contiguous` (ready_flags: nothing to wait for)."""
    _m_grouped(a, b, d, group_offsets, True, a_row_index, num_passes, pass_range)


def m_grouped_gemm_nn(a, b, d, group_offsets, *, a_row_index=None, num_passes=1, pass_range=None, **_):
    """Emulates `deep_gemm.m_grouped_bf16_gemm_nn_contiguous`."""
    _m_grouped(a, b, d, group_offsets, False, a_row_index, num_passes, pass_range)


def m_grouped_gemm_nt_swiglu(a, b, h, act, group_offsets, *, a_row_index=None, num_passes=1, **_):
    """Emulates `deep_gemm.m_grouped_bf16_gemm_nt_swiglu_contiguous`."""
    _m_grouped(a, b, h, group_offsets, True, a_row_index, num_passes)
    gate, up = h.chunk(2, dim=-1)
    act.copy_(F.silu(gate) * up)


def k_grouped_gemm_tn(a, b, d, group_offsets, *, accumulate: bool = False, **_):
    """Emulates `deep_gemm.k_grouped_bf16_gemm_tn_contiguous`."""
    for g, (start, end) in enumerate(_bounds(group_offsets)):
        out = a[start:end].to(torch.float64).T @ b[start:end].to(torch.float64)
        d[g] = (d[g].to(torch.float64) + out).to(d.dtype) if accumulate else out.to(d.dtype)


def _dequantized(pair, scale_dims: tuple[int, ...]):
    """An FP8 ``(data, scales)`` pair as float64: each scale repeated over the 128 elements of
    its block along `scale_dims` of the data."""
    data, scales = pair
    for dim in scale_dims:
        scales = scales.repeat_interleave(128, dim=dim)
    return data.to(torch.float64) * scales.to(torch.float64)


def m_grouped_fp8_gemm_nt(a, b, d, group_offsets, *, a_row_index=None, num_passes=1, pass_range=None, **_):
    """Emulates `deep_gemm.m_grouped_fp8_gemm_nt_contiguous` on the dequantized operands."""
    _m_grouped(_dequantized(a, (1,)), _dequantized(b, (1, 2)), d, group_offsets, True, a_row_index, num_passes,
               pass_range)


def m_grouped_fp8_gemm_nt_swiglu(a, b, h, act, group_offsets, *, a_row_index=None, num_passes=1, **_):
    """Emulates `deep_gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous` on the dequantized operands;
    an act given as an e4m3 (data, scales) pair gets the emulated act, rounded to bf16 as the
    kernel rounds it, quantized per row by the reference."""
    fp8_act = isinstance(act, (tuple, list))
    act_out = torch.empty(act[0].shape, dtype=torch.bfloat16, device=act[0].device) if fp8_act else act
    m_grouped_gemm_nt_swiglu(_dequantized(a, (1,)), _dequantized(b, (1, 2)), h, act_out, group_offsets,
                             a_row_index=a_row_index, num_passes=num_passes)
    if fp8_act:  # (rows outside every group: NaN data and scales, as unwritten rows are here)
        rows = fp8_quantize_rows_torch(act_out)
        written = torch.zeros(act_out.shape[0], dtype=torch.bool, device=act_out.device)
        for start, end in _bounds(group_offsets):
            written[start:end] = True
        act[0].copy_(rows.data)
        act[1].copy_(torch.where(written[:, None], rows.scales, float("nan")))


def k_grouped_fp8_gemm_tn(a, b, d, padded_offsets, *, accumulate: bool = False, **_):
    """Emulates `deep_gemm.k_grouped_fp8_gemm_tn_contiguous` on the dequantized columns."""
    a = _dequantized((a[0], a[1].T), (1,))  # [M, Mp]
    b = _dequantized((b[0], b[1].T), (1,))  # [N, Mp]
    for g, (start, end) in enumerate(_bounds(padded_offsets)):
        out = a[:, start:end] @ b[:, start:end].T
        d[g] = (d[g].to(torch.float64) + out).to(d.dtype) if accumulate else out.to(d.dtype)


def moe_combine(rows, layout, weights, out, *, addend=None):
    """Emulates `deep_gemm.moe.kernels.moe_combine_bf16` (in float64)."""
    num_tokens, num_topk = layout.slot_row.shape
    gathered = rows.index_select(0, layout.slot_row.flatten()).view(num_tokens, num_topk, rows.shape[1])
    gathered = torch.where(layout.slot_valid.unsqueeze(-1), gathered, 0).to(torch.float64)
    w = torch.ones(num_tokens, num_topk, dtype=torch.float64, device=rows.device) if weights is None else weights.to(torch.float64)
    w = torch.where(layout.slot_valid, w, 0.0)
    total = torch.einsum("tk,tkh->th", w, gathered)
    if addend is not None:
        total += addend[:, :num_tokens].to(torch.float64).sum(0)
    out.copy_(total)
    return out


def moe_gather_rows(src, layout):
    """Emulates `deep_gemm.moe.kernels.moe_gather_rows_bf16`."""
    out = src.index_select(0, layout.row_token)
    out[int(layout.offsets[-1]):] = float("nan")
    return out


def moe_swiglu_fwd(h, offsets):
    """Emulates `deep_gemm.moe.kernels.moe_swiglu_fwd_bf16`."""
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    act[int(offsets[-1]):] = float("nan")
    return act


def moe_swiglu_bwd(h, d_act, layout, *, dz=None, act_weighted=None):
    """Emulates `deep_gemm.moe.kernels.moe_swiglu_bwd_bf16` (outputs may be its inputs)."""
    outputs = dz, act_weighted
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    act = gate * sig * up
    w = layout.row_weight.to(d_act.dtype).unsqueeze(-1)
    da = d_act * w
    dz = torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig], dim=-1)
    row_dw = (d_act * act).sum(-1)
    act_weighted = act * w
    for t in (dz, act_weighted, row_dw):
        t[int(layout.offsets[-1]):] = float("nan")
    dz, act_weighted = (t if out is None else out.copy_(t) for t, out in zip((dz, act_weighted), outputs))
    return dz, act_weighted, row_dw


def moe_swiglu_bwd_fp8(h, d_act, layout, *, power_of_two_scales=False):
    """Emulates `deep_gemm.moe.kernels_fp8.moe_swiglu_bwd_fp8`: `moe_swiglu_bwd`'s outputs in h's
    dtype, quantized by the reference (rows of empty slots: NaN)."""
    dz, act_weighted, row_dw = moe_swiglu_bwd(h, d_act, layout)
    dz_rows, dz_columns = fp8_quantize_columns_torch(dz, layout.offsets, with_rows=True,
                                                     power_of_two_scales=power_of_two_scales)
    _, act_columns = fp8_quantize_columns_torch(act_weighted, layout.offsets, power_of_two_scales=power_of_two_scales)
    return dz_rows, dz_columns, act_columns, row_dw


def ep_wait_flags(flags, sources, timeout_ms):
    """Emulates `deep_gemm.moe.kernels.ep_wait_flags` where the writers are done already (CPU
    buffers, after a barrier): every flag must be set."""
    del timeout_ms
    for flag, source in zip(flags.tolist(), sources.tolist()):
        if flag == 0:
            raise RuntimeError(f"rank {source} sent nothing (its flag is not set)")
    flags.zero_()
