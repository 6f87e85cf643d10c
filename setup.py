"""Install the pure-Python packages; CUDA kernels are compiled at run time (JIT)."""
from setuptools import find_packages, setup

setup(
    name="deep_gemm",
    version="0.1.0",
    description="Hopper (sm_90a) grouped GEMMs and a fused Mixture-of-Experts layer for training",
    packages=find_packages(include=["deep_gemm", "deep_gemm.*", "megamoe_bwd", "megamoe_bwd.*"]),
    package_data={"deep_gemm": ["include/deep_gemm/**/*.cuh"]},
    include_package_data=True,
    python_requires=">=3.9",
    install_requires=["torch>=2.9", "cuda-bindings>=12.8"],
)
