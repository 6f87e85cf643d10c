"""The fused MoE layer inside the models people already train: `transformers` (an experts
backend for Hugging Face MoE models) and `torchtitan` (a TorchTitan-style experts module).
Import the one you use; neither package is needed by the rest of megamoe_bwd."""
