"""Compiles every kernel variant the launchers can choose, in parallel (nvcc processes), so a
GPU session spends no device time compiling. Honors DG_JIT_CACHE_DIR."""
import os
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from test_jit import all_kernels, resource_report  # noqa: E402

if __name__ == "__main__":
    kernels = all_kernels()
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        built = list(pool.map(lambda item: (item[0], item[1]()), kernels))
    for label, kernel in built:
        print(f"{label:<36} {resource_report(kernel)}")
