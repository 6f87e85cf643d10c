"""Compares the benchmark logs of `device_ab.sh`: per figure, the median over the rounds for the
base and the new tree, and new / base (time ratio: below 1 is faster).

    python scripts/ab_compare.py OUT_DIR
"""
from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def gemm_rows(text: str) -> dict:
    """(model, routing, gemm) -> our ms, from bench_gemm.py's table."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"(\w+)\s+(uniform|skewed)\s+(\S+(?: \S+)?)\s+[\d,]+\s+([\d.]+)\s+\d+\s+([\d.]+)", line)
        if m:
            rows[(m.group(1), m.group(2), m.group(3))] = float(m.group(4))
        m = re.match(r"host launch overhead per call: ours ([\d.]+) us", line)
        if m:
            rows[("-", "-", "launch us")] = float(m.group(1))
    return rows


def moe_rows(text: str) -> dict:
    """(model, routing, fwd/bwd/total) -> ms of our layer, from bench_mega_moe.py's table."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"(\w+)\s+(uniform|skewed)\s+ours\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", line)
        if m:
            for part, value in zip(("fwd", "bwd", "fwd+bwd"), m.groups()[2:]):
                rows[(m.group(1), m.group(2), f"MoE {part}")] = float(value)
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    values: dict = defaultdict(lambda: defaultdict(list))  # figure -> tree -> [ms per round]
    for log in sorted(out.glob("*_*_*.log")):
        tree, _, kind = log.stem.split("_")
        parse = gemm_rows if kind == "gemm" else moe_rows
        for figure, ms in parse(log.read_text()).items():
            values[figure][tree].append(ms)
    print(f"{'model':<5} {'route':<7} {'figure':<13} {'base':>9} {'new':>9} {'new/base':>8}  rounds (ms; launch: us)")
    worst = 0.0
    for figure in sorted(values, key=lambda f: (f[0], f[1], f[2])):
        base, new = values[figure]["base"], values[figure]["new"]
        if not base or not new:
            continue
        b, n = statistics.median(base), statistics.median(new)
        worst = max(worst, n / b)
        flag = "  SLOWER" if n / b > 1.03 else ""
        print(f"{figure[0]:<5} {figure[1]:<7} {figure[2]:<13} {b:>9.3f} {n:>9.3f} {n / b:>8.3f}  "
              f"{len(base)}/{len(new)}{flag}")
    print(f"worst new/base: {worst:.3f}")


if __name__ == "__main__":
    main()
