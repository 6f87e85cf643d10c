"""A small run of every grouped-GEMM kernel for compute-sanitizer (memcheck, racecheck)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from deep_gemm.gemm import k_grouped_bf16, m_grouped_bf16  # noqa: E402
from deep_gemm.testing import offsets_from_sizes  # noqa: E402

sizes = [0, 1, 130, 64, 70]
offsets = offsets_from_sizes(sizes)
rows = sum(sizes)
a = torch.randn(rows, 192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(len(sizes), 264, 192, device="cuda", dtype=torch.bfloat16)
d = torch.empty(rows, 264, device="cuda", dtype=torch.bfloat16)
for config in m_grouped_bf16.all_configs():
    deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, offsets, config=config)
    deep_gemm.m_grouped_bf16_gemm_nn_contiguous(a, b.view(len(sizes), 192, 264), d, offsets, config=config)
for dtype in (torch.float32, torch.bfloat16):
    w = torch.zeros(len(sizes), 192, 264, device="cuda", dtype=dtype)
    for config in k_grouped_bf16.all_configs(dtype):
        deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, d, w, offsets, config=config)
        deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, d, w, offsets, accumulate=True, config=config)
torch.cuda.synchronize()
print("sanitize case done")
