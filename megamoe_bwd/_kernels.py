"""Everything megamoe_bwd takes from its kernel package, in one place.

That package is this repository's `deep_gemm`, or, in an upstream DeepGEMM install patched by
scripts/apply_patches.sh (where `deep_gemm` is upstream's, with other kernels and signatures),
the copy of ours that the patch set vendors as `megamoe_bwd._vendored` (docs/DESIGN.md, "Patched
upstream install"). Our package imports itself only relatively, so it runs under either name.
"""
import importlib

try:
    PACKAGE = importlib.import_module(f"{__package__}._vendored")
except ModuleNotFoundError:
    PACKAGE = importlib.import_module("deep_gemm")


def _module(name: str):
    return importlib.import_module(f"{PACKAGE.__name__}.{name}")


gemm = _module("gemm")
k_grouped_bf16, m_grouped_bf16 = _module("gemm.k_grouped_bf16"), _module("gemm.m_grouped_bf16")
k_grouped_bf16_gemm_tn_contiguous = gemm.k_grouped_bf16_gemm_tn_contiguous
m_grouped_bf16_gemm_nn_contiguous = gemm.m_grouped_bf16_gemm_nn_contiguous
m_grouped_bf16_gemm_nt_contiguous = gemm.m_grouped_bf16_gemm_nt_contiguous

k_grouped_fp8, m_grouped_fp8 = _module("gemm.k_grouped_fp8"), _module("gemm.m_grouped_fp8")
k_grouped_fp8_gemm_tn_contiguous = gemm.k_grouped_fp8_gemm_tn_contiguous
m_grouped_fp8_gemm_nt_contiguous = gemm.m_grouped_fp8_gemm_nt_contiguous
m_grouped_fp8_gemm_nt_swiglu_contiguous = gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous
quant = _module("quant")
quant_reference = _module("quant.reference")
quant_kernels = _module("quant.kernels")
fp8_quantize_columns, fp8_quantize_rows, Fp8Rows = quant.fp8_quantize_columns, quant.fp8_quantize_rows, quant.Fp8Rows
Fp8Columns, empty_fp8_rows = quant.Fp8Columns, quant.empty_fp8_rows

moe_forward, moe_kernels, moe_layout = _module("moe.forward"), _module("moe.kernels"), _module("moe.layout")
moe_fp8, moe_kernels_fp8 = _module("moe.fp8"), _module("moe.kernels_fp8")
fp8_mega_moe, fp8_weights, FP8_DIM_MULTIPLE = moe_fp8.fp8_mega_moe, moe_fp8.fp8_weights, moe_fp8.FP8_DIM_MULTIPLE
fp8_dgrad_weights, kept_dgrad_weights = moe_fp8.fp8_dgrad_weights, moe_fp8.kept_dgrad_weights
Fp8WeightCopies, get_fp8_weight_copies = moe_fp8.Fp8WeightCopies, moe_fp8.get_fp8_weight_copies
MegaMoEHandle, bf16_mega_moe, dense_rows = moe_forward.MegaMoEHandle, moe_forward.bf16_mega_moe, moe_forward.dense_rows
DIM_MULTIPLE = moe_forward.DIM_MULTIPLE
check_expert_ids, check_moe_inputs, gate_up_swiglu = (moe_forward.check_expert_ids, moe_forward.check_moe_inputs,
                                                     moe_forward.gate_up_swiglu)
build_routing_layout, ep_wait_flags = moe_kernels.build_routing_layout, moe_kernels.ep_wait_flags
moe_combine_bf16, moe_gather_rows_bf16 = moe_kernels.moe_combine_bf16, moe_kernels.moe_gather_rows_bf16
moe_swiglu_bwd_bf16, moe_swiglu_bwd_fp8 = moe_kernels.moe_swiglu_bwd_bf16, moe_kernels_fp8.moe_swiglu_bwd_fp8
RoutingLayout = moe_layout.RoutingLayout

stream_write_u32 = _module("jit.runtime").stream_write_u32
utils = _module("utils")
check_bool, check_disjoint, check_tensor = utils.check_bool, utils.check_disjoint, utils.check_tensor
get_num_sms = utils.get_num_sms
testing = _module("testing")
relative_error = testing.relative_error
