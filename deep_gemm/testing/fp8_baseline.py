import torch

from .groups import offsets_from_sizes

E4M3_MAX = 448.0


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, fp32 scales over the last dimension): one scale per row, the
    rowwise recipe of torch._scaled_grouped_mm."""
    amax = x.float().abs().amax(dim=-1).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def torch_fp8_rowwise_grouped_mm(a: torch.Tensor, b: torch.Tensor, group_offsets: torch.Tensor,
                                 fast_accum: bool = True) -> torch.Tensor:
    """PyTorch's FP8 grouped GEMM on rowwise-quantized operands, ``D[rows of g] = A @ B[g].T``:
    a ``[M, K]``, b ``[G, N, K]`` bf16, group_offsets ``[G + 1]`` int32; bf16 ``[M, N]``."""
    qa, sa = quantize_rowwise(a)
    qb, sb = quantize_rowwise(b)
    return torch._scaled_grouped_mm(qa, qb.transpose(-2, -1), sa, sb, offs=group_offsets[1:], out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accum)


def torch_fp8_rowwise_wgrad(a: torch.Tensor, b: torch.Tensor, sizes: list[int]):
    """torch._scaled_grouped_mm's weight gradient ``[G, M, N]`` of a ``[R, M]``, b ``[R, N]``
    bf16, on groups padded with zero rows to multiples of 16 (at least 16), scales per group and
    column (rowwise along the tokens): (a function running it, its padded rows)."""
    padded = [max(16, -(-s // 16) * 16) for s in sizes]
    pa = a.new_zeros(sum(padded), a.shape[1])
    pb = b.new_zeros(sum(padded), b.shape[1])
    src = dst = 0
    qa, qb, sa, sb = [], [], [], []
    for s, p in zip(sizes, padded):
        pa[dst:dst + s], pb[dst:dst + s] = a[src:src + s], b[src:src + s]
        q, scale = quantize_rowwise(pa[dst:dst + p].T)  # [M, p], one scale per column of the group
        qa.append(q), sa.append(scale)
        q, scale = quantize_rowwise(pb[dst:dst + p].T)
        qb.append(q), sb.append(scale)
        src, dst = src + s, dst + p
    mat_a = torch.cat(qa, dim=1).contiguous()  # [M, R'] row-major
    mat_b = torch.cat(qb, dim=1).contiguous().T  # [R', N] column-major
    scale_a, scale_b = torch.cat(sa), torch.cat(sb)  # [G * M], [G * N]
    ends = offsets_from_sizes(padded)[1:].contiguous()
    return (lambda: torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=ends, out_dtype=torch.bfloat16,
                                             use_fast_accum=True)), sum(padded)
