"""`deep_gemm.mega_moe_backward` against the float64 reference, upstream DeepGEMM style: a script
that also runs under pytest. It imports whatever `deep_gemm` is installed, so it checks an
upstream checkout patched by scripts/apply_patches.sh from outside this repository:

    cd UPSTREAM_DIR && python /path/to/tests/test_mega_moe_bwd.py [--num-processes N]

Every output (y from `megamoe_bwd.bf16_mega_moe`, dx, dtopk_weights, dl1, dl2) must meet the
accuracy bar: at most 1.5x the relative error of the bf16 torch._grouped_mm MoE. With N > 1,
N processes (one GPU each) run the cases on their own fresh inputs.
"""
import argparse

import pytest
import torch

import deep_gemm
import megamoe_bwd
from megamoe_bwd.testing import accuracy
from megamoe_bwd.ep import launch

CASES = [  # (label, T, H, I, E, K, routing, empty-slot fraction)
    ("30B-like", 512, 2048, 768, 16, 8, "uniform", 0.0),
    ("235B-like, skewed", 256, 4096, 1536, 16, 8, "skewed", 0.0),
    ("empty slots", 200, 1024, 512, 8, 4, "uniform", 0.25),
    ("one hot expert", 300, 1024, 512, 8, 4, "one_hot", 0.0),
    ("T=1", 1, 1024, 512, 8, 4, "uniform", 0.0),
]
HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def check_cases(verbose: bool = True) -> list[str]:
    """Runs every case on the current GPU; returns the outputs that miss the bar."""
    failures = []
    for label, *shape in CASES:
        for name, (ours, base) in accuracy(megamoe_bwd.bf16_mega_moe, deep_gemm.mega_moe_backward, *shape).items():
            ok = ours <= 1.5 * base + 1e-6
            if verbose:
                print(f" > {label:<18} {name:<14} ours {ours:.2e}  torch._grouped_mm {base:.2e}  "
                      f"{'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                failures.append(f"{label} {name}: {ours:.2e} vs {base:.2e}")
    return failures


def _rank(rank: int, world: int) -> None:
    failures = check_cases(verbose=rank == 0)
    assert not failures, f"rank {rank}: {failures}"


@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
def test_mega_moe_backward_meets_the_accuracy_bar():
    assert not check_cases(verbose=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Test deep_gemm.mega_moe_backward")
    parser.add_argument("--num-processes", type=int, default=1, help="processes, one GPU each")
    args = parser.parse_args()
    assert HAS_SM90, "needs an sm_90 GPU"
    print(f"deep_gemm {getattr(deep_gemm, '__version__', '')} from {deep_gemm.__file__}; megamoe_bwd's kernels: "
          f"{megamoe_bwd._kernels.PACKAGE.__name__}")
    if args.num_processes == 1:
        assert not check_cases()
    else:
        launch(_rank, args.num_processes)
    print("mega_moe_backward: all cases meet the accuracy bar")
