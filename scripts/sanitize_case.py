"""A small run of every grouped-GEMM kernel for compute-sanitizer (memcheck, racecheck)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from deep_gemm.testing import offsets_from_sizes  # noqa: E402

sizes = [0, 1, 130, 64, 70]
offsets = offsets_from_sizes(sizes)
rows = sum(sizes)
a = torch.randn(rows, 192, device="cuda", dtype=torch.bfloat16)
for block_n in (128, 256):
    b = torch.randn(len(sizes), 264, 192, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(rows, 264, device="cuda", dtype=torch.bfloat16)
    deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, offsets, block_n=block_n)
    deep_gemm.m_grouped_bf16_gemm_nn_contiguous(a, b.view(len(sizes), 192, 264), d, offsets, block_n=block_n)
    w = torch.empty(len(sizes), 192, 264, device="cuda")
    deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, d, w, offsets, block_n=block_n)
    deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, d, w, offsets, accumulate=True, block_n=block_n)
torch.cuda.synchronize()
print("sanitize case done")
