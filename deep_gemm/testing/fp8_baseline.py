import torch

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
