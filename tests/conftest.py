"""Fixtures the test files share."""
import pytest


@pytest.fixture
def weight_quantizations(monkeypatch) -> list:
    """Every FP8 weight quantization the layer makes from here on (`deep_gemm.moe.fp8`'s
    `fp8_quantize_weights`), each as whether a CUDA graph was being captured when it ran."""
    import torch
    from deep_gemm.moe import fp8 as moe_fp8
    calls = []
    quantize = moe_fp8.fp8_quantize_weights

    def counted(w, **kwargs):
        calls.append(torch.cuda.is_current_stream_capturing())
        return quantize(w, **kwargs)

    monkeypatch.setattr(moe_fp8, "fp8_quantize_weights", counted)
    return calls
