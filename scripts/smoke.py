"""One tiny grouped-GEMM case by name, for bisecting failures under a hard timeout:
    python scripts/smoke.py nt|nn|tn SIZES N K [CONFIG]   (SIZES like 128,0,37; CONFIG an
    index into the launcher's all_configs())
With DG_JIT_DEBUG_TRACE=1, prints CTA 0's checkpoints 3 s after the launch (a hang shows
where it stopped: slot 0 producer, 1-2 math warpgroups, 4 start, 5-7 register setup, 10-11
epilogue; values 1000+k waiting, 2000+k landed/issued, 3000+k MMA done)."""
import argparse
import faulthandler
import os
import sys
import time

import torch

T0 = time.time()
faulthandler.dump_traceback_later(float(os.environ.get("SMOKE_STACK_DUMP_S", "30")), exit=True)


def step(msg: str) -> None:
    print(f"[{time.time() - T0:6.2f}s] {msg}", flush=True)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from bench_common import require_sm90  # noqa: E402
from deep_gemm.gemm import k_grouped_bf16, m_grouped_bf16  # noqa: E402
from deep_gemm.testing import offsets_from_sizes, relative_error  # noqa: E402
from deep_gemm.utils import env_flag  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("kind", choices=("nt", "nn", "tn"))
parser.add_argument("sizes", help="group sizes, comma-separated (e.g. 128,0,37)")
parser.add_argument("d1", type=int, help="N (nt, nn) or M (tn)")
parser.add_argument("d2", type=int, help="K (nt, nn) or N (tn)")
parser.add_argument("config", type=int, nargs="?", default=None, help="an index into the launcher's all_configs()")
args = parser.parse_args()
require_sm90("smoke.py")

kind, sizes, d1, d2 = args.kind, [int(s) for s in args.sizes.split(",")], args.d1, args.d2
config_idx = args.config
step("imported")


def show_trace() -> None:
    if env_flag("DG_JIT_DEBUG_TRACE"):
        from deep_gemm.jit.runtime import trace_buffer
        for _ in range(2):
            time.sleep(1.5)
            step(f"trace: {trace_buffer().tolist()}")


offsets, rows, g = offsets_from_sizes(sizes), sum(sizes), len(sizes)
bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
if kind in ("nt", "nn"):
    n, k = d1, d2
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(g, *((n, k) if kind == "nt" else (k, n)), device="cuda", dtype=torch.bfloat16)
    d = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    fn = deep_gemm.m_grouped_bf16_gemm_nt_contiguous if kind == "nt" else deep_gemm.m_grouped_bf16_gemm_nn_contiguous
    step("inputs ready")
    config = None if config_idx is None else m_grouped_bf16.all_configs()[config_idx]
    fn(a, b, d, offsets, config=config)
    step("launched")
    show_trace()
    ref = torch.cat([a[s:e].float() @ (b[i].float().T if kind == "nt" else b[i].float()) for i, (s, e) in enumerate(bounds)])
else:
    m, n = d1, d2
    a = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    d = torch.full((g, m, n), float("nan"), device="cuda")
    step("inputs ready")
    config = None if config_idx is None else k_grouped_bf16.all_configs(d.dtype)[config_idx]
    deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, b, d, offsets, config=config)
    step("launched")
    show_trace()
    ref = torch.stack([a[s:e].float().T @ b[s:e].float() for s, e in bounds])
torch.cuda.synchronize()
print(f"{' '.join(sys.argv[1:])}: rel.err {relative_error(d, ref):.2e}")
