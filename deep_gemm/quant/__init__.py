"""Blockwise FP8 quantization (float8_e4m3fn values, fp32 scales) for the FP8 grouped GEMMs:
activations per 1 x 128, their transposed copies per 128 x 1 for the weight gradients, weights
per 128 x 128 in both orientations (docs/DESIGN.md, "Blockwise FP8"). On a CUDA device by our
kernels (impls/fp8_quantize.cuh), elsewhere by the PyTorch reference, with the same results."""
from .kernels import empty_fp8_rows, fp8_columns_nbytes, fp8_quantize_columns, fp8_quantize_rows, fp8_quantize_weights
from .reference import Fp8Columns, Fp8Rows, Fp8Weights, padded_group_width
