"""Compares the benchmark logs of `device_ab.sh`: per figure, the median over the rounds for the
base and the new tree, new / base (a time ratio: below 1 is faster), and the same ratio with each
of our times first divided by torch's time of the same case in the same process ("vs torch":
torch's code is the same in both trees, so this takes out drifts of the GPU's clocks between
the two measurements, at the price of torch's own noise).

    python scripts/ab_compare.py OUT_DIR
"""
from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path


def gemm_rows(text: str) -> dict:
    """(model, routing, gemm) -> (our ms, torch's ms), from bench_gemm.py's table; the launch
    overhead line as ("-", "-", "launch us")."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"(\w+)\s+(uniform|skewed)\s+(\S+(?: \S+)?)\s+[\d,]+\s+([\d.]+)\s+\d+\s+([\d.]+)", line)
        if m:
            rows[(m.group(1), m.group(2), m.group(3))] = (float(m.group(4)), float(m.group(5)))
        m = re.match(r"host launch overhead per call: ours ([\d.]+) us, torch._grouped_mm ([\d.]+) us", line)
        if m:
            rows[("-", "-", "launch us")] = (float(m.group(1)), float(m.group(2)))
    return rows


def moe_rows(text: str) -> dict:
    """(model, routing, "MoE fwd" / "MoE bwd" / "MoE fwd+bwd") -> (our ms, torch's ms), from
    bench_mega_moe.py's table."""
    times: dict = {}
    for line in text.splitlines():
        m = re.match(r"(\w+)\s+(uniform|skewed)\s+(ours|torch)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", line)
        if m:
            times[(m.group(1), m.group(2), m.group(3))] = [float(v) for v in m.groups()[3:]]
    rows = {}
    for (model, routing, impl), values in times.items():
        if impl == "ours" and (model, routing, "torch") in times:
            for part, ours, theirs in zip(("fwd", "bwd", "fwd+bwd"), values, times[(model, routing, "torch")]):
                rows[(model, routing, f"MoE {part}")] = (ours, theirs)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="the folder of device_ab.sh's logs")
    out = parser.parse_args().out_dir
    values: dict = defaultdict(lambda: defaultdict(list))  # figure -> tree -> [(ours, torch) per round]
    for log in sorted(out.glob("*_*_*.log")):
        tree, _, kind = log.stem.split("_")
        parse = gemm_rows if kind == "gemm" else moe_rows
        for figure, pair in parse(log.read_text()).items():
            values[figure][tree].append(pair)
    print(f"{'model':<5} {'route':<7} {'figure':<13} {'base':>9} {'new':>9} {'new/base':>8} {'vs torch':>8}  "
          "rounds (ms; launch: us)")
    worst = worst_vs_torch = 0.0
    for figure in sorted(values):
        base, new = values[figure]["base"], values[figure]["new"]
        if not base or not new:
            continue
        b, n = statistics.median(o for o, _ in base), statistics.median(o for o, _ in new)
        relative = statistics.median(o / t for o, t in new) / statistics.median(o / t for o, t in base)
        if figure[2] != "launch us":  # (torch's launch time is the noise, not a figure of ours)
            worst, worst_vs_torch = max(worst, n / b), max(worst_vs_torch, relative)
        flag = "  SLOWER" if n / b > 1.03 else ""
        print(f"{figure[0]:<5} {figure[1]:<7} {figure[2]:<13} {b:>9.3f} {n:>9.3f} {n / b:>8.3f} {relative:>8.3f}  "
              f"{len(base)}/{len(new)}{flag}")
    print(f"worst new/base (kernel times): {worst:.3f}; worst vs torch: {worst_vs_torch:.3f}")


if __name__ == "__main__":
    main()
