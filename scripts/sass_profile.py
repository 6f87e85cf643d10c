"""Where a kernel's instructions and warp stalls go, per SASS opcode, from Nsight Compute's source
page: one or more kernels side by side (e.g. ours and upstream DeepGEMM's at the same shape).

Each CSV is one launch's source page with per-instruction counters (a Hopper GPU and ncu):

    ncu --set full --import-source no -o ours -k regex:dg_sm90_fp8_m_grouped --launch-skip 3 \\
        --launch-count 1 python scripts/bench_gemm.py --precision fp8 --models 30b --routing uniform --only fwd1
    ncu --import ours.ncu-rep --page source --print-source sass --csv > ours.csv
    python scripts/sass_profile.py ours.csv theirs.csv --per 1048576 --top 15

Prints, for each CSV, the warp instructions executed and the warp-state samples, the stall reasons'
shares of the samples, and the instructions holding the most samples; then every opcode whose count
differs by more than half an instruction a unit between the kernels (`--per`: units to divide the
counts by, e.g. math warps x k-blocks; 1 by default) or that holds at least 1% of a kernel's samples.
"""
from __future__ import annotations

import argparse
import collections
import csv
import dataclasses

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclasses.dataclass
class Instruction:
    source: str  # the SASS line
    opcode: str  # its opcode without modifiers or predicate (FFMA, QGMMA, ...)
    executed: float  # warp instructions executed
    samples: float  # warp-state samples at it
    stalls: dict  # stall reason -> samples (issued or not), as ncu names them without "stall_"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """The opcode of a SASS line: its first word after any predicate, up to the first dot."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def load(path: str) -> list[Instruction]:
    """The instructions of the source page's CSV at `path` (its first line names the kernel, the
    second holds the column names)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next((r for r in rows if "Source" in r and SAMPLES in r), None)
    if header is None:
        raise ValueError(f"{path}: no header with 'Source' and {SAMPLES!r}: not an ncu source page CSV")
    column = {name: i for i, name in enumerate(header)}
    stall_columns = [(name[len("stall_"):], i) for name, i in column.items()
                     if name.startswith("stall_") and "(Not Issued)" not in name]
    instructions = []
    for row in rows[rows.index(header) + 1:]:
        if len(row) != len(header):
            continue
        source = row[column["Source"]].strip()
        instructions.append(Instruction(source, opcode(source), _number(row[column[EXECUTED]]),
                                        _number(row[column[SAMPLES]]),
                                        {reason: _number(row[i]) for reason, i in stall_columns}))
    return instructions


def by_opcode(instructions: list[Instruction]) -> tuple[collections.Counter, collections.Counter]:
    """(executed, samples) summed per opcode."""
    executed, samples = collections.Counter(), collections.Counter()
    for ins in instructions:
        executed[ins.opcode] += ins.executed
        samples[ins.opcode] += ins.samples
    return executed, samples


def report(paths: list[str], per: float = 1.0, top: int = 10) -> str:
    """The text the script prints for the CSVs at `paths`."""
    kernels = {path: load(path) for path in paths}
    lines = []
    for path, instructions in kernels.items():
        total = sum(i.samples for i in instructions) or 1.0
        stalls = collections.Counter()
        for ins in instructions:
            stalls.update(ins.stalls)
        lines.append(f"== {path}: {sum(i.executed for i in instructions) / per:,.1f} warp instructions a unit, "
                     f"{total:,.0f} samples")
        lines.append("   stalls: " + ", ".join(f"{r} {100 * v / total:.1f}%" for r, v in stalls.most_common(8)))
        for ins in sorted(instructions, key=lambda i: -i.samples)[:top]:
            named = sorted(ins.stalls.items(), key=lambda kv: -kv[1])[:2]
            why = ", ".join(f"{r} {100 * v / max(ins.samples, 1):.0f}%" for r, v in named)
            lines.append(f"   {100 * ins.samples / total:5.1f}%  {ins.executed / per:8.2f}  {ins.source[:64]:<64}  {why}")
    counts = {path: by_opcode(instructions) for path, instructions in kernels.items()}
    totals = {path: sum(s.values()) or 1.0 for path, (_, s) in counts.items()}
    opcodes = set().union(*(executed.keys() for executed, _ in counts.values()))
    spread = {op: max(e[op] for e, _ in counts.values()) - min(e[op] for e, _ in counts.values()) for op in opcodes}
    shown = [op for op in opcodes if spread[op] / per > 0.5 or
             any(s[op] / totals[path] >= 0.01 for path, (_, s) in counts.items())]
    lines.append("opcode      " + "".join(f"{'a unit':>9} {'samples':>8}   " for _ in paths) + "  (kernels in order)")
    for op in sorted(shown, key=lambda o: -spread[o]):
        lines.append(f"{op:<11} " + "".join(f"{e[op] / per:9.2f} {100 * s[op] / totals[path]:7.1f}%   "
                                            for path, (e, s) in counts.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+", help="ncu --page source --print-source sass --csv exports, one launch each")
    parser.add_argument("--per", type=float, default=1.0, help="divide instruction counts by this (e.g. warps x k-blocks)")
    parser.add_argument("--top", type=int, default=10, help="instructions listed per kernel, most samples first")
    args = parser.parse_args()
    if args.per <= 0:
        parser.error(f"--per must be positive, got {args.per}")
    print(report(args.csv, args.per, args.top))


if __name__ == "__main__":
    main()
