"""The FP8 GEMMs' k-loops in static SASS, on a machine without a GPU: every FP8 GEMM variant the
launchers can pick is compiled (into the JIT cache; nvcc, no GPU), disassembled, and each innermost
loop that promotes a product (64 or more FFMAs) is printed with its instruction count and its
opcode mix; with --base, another checkout's kernels beside them, so that a mainloop change is read
against the code before it before any GPU run (docs/PERF.md, session 49).

    python scripts/kloop_sass.py [--base OTHER_CHECKOUT] [--only k_grouped] [--disassembler PATH]

The disassembler is nvdisasm (run as `nvdisasm -c`) or cuobjdump (`--dump-sass`): --disassembler,
else the first found on PATH. Where the toolkit lacks both, pip's nvidia-cuda-nvdisasm wheel
carries nvdisasm. Static counts say what a k-block issues, not what it costs: only a GPU says that.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sass_profile import opcode  # noqa: E402

# `/*0c40*/  @!P0 BRA `(.L_x_41) ;` (nvdisasm -c) or `/*0c40*/  BRA 0x1c0 ;  /* 0x... */` (cuobjdump)
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?(?:`\((\.L_x_\d+)\)|\b0x([0-9a-f]+)\b)")
PROMOTION_FFMAS = 64


@dataclasses.dataclass
class Loop:
    start: int  # the address the backward branch goes to
    end: int  # the branch's own address
    body: list[str]  # the instructions from start to the branch

    def opcodes(self) -> collections.Counter:
        return collections.Counter(opcode(i) for i in self.body)


def instructions(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """The (address, instruction) pairs of one kernel's SASS, in order, and each label's address
    (that of the instruction after it)."""
    out, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.match(line)
        if m:
            address = int(m.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            out.append((address, m.group(2)))
    return out, labels


def loops(sass: str) -> list[Loop]:
    """Every loop a backward branch closes, as [its target, the branch]."""
    ins, labels = instructions(sass)
    found = []
    for i, (address, text) in enumerate(ins):
        m = _BRANCH_TARGET.search(text)
        if not m:
            continue
        target = labels.get(m.group(1)) if m.group(1) else int(m.group(2), 16)
        if target is not None and target <= address:
            found.append(Loop(target, address, [t for a, t in ins[:i + 1] if a >= target]))
    return found


def k_loops(sass: str) -> list[Loop]:
    """The innermost loops with a promotion's FFMAs (a mainloop's k-blocks), in address order."""
    promoting = sorted((lp for lp in loops(sass) if lp.opcodes()["FFMA"] >= PROMOTION_FFMAS), key=lambda lp: len(lp.body))
    kept = []
    for lp in promoting:
        if not any(lp.start <= k.start and k.end <= lp.end for k in kept):
            kept.append(lp)
    return sorted(kept, key=lambda lp: lp.start)


def find_disassembler() -> str | None:
    """nvdisasm, else cuobjdump, from PATH (None if neither is there)."""
    return shutil.which("nvdisasm") or shutil.which("cuobjdump")


def disassemble(cubin: str, tool: str) -> str:
    args = [tool, "-c", cubin] if os.path.basename(tool).startswith("nvdisasm") else [tool, "--dump-sass", cubin]
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


def fp8_gemm_kernels(package) -> dict:
    """label -> kernel builder of every FP8 GEMM variant of a `deep_gemm` package (ours or another
    checkout's, by the labels of its `precompile`)."""
    precompile = importlib.import_module(f"{package.__name__}.precompile")
    return {label: build for label, build in precompile.all_kernels()
            if label.startswith(("m_grouped_fp8", "k_grouped_fp8"))}


def summary(loop: Loop, top: int = 8) -> str:
    mix = ", ".join(f"{name} {count}" for name, count in loop.opcodes().most_common(top))
    return f"{len(loop.body)} instructions ({mix})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="another checkout whose kernels are printed beside these")
    parser.add_argument("--only", default="", help="labels holding one of these substrings, comma-separated")
    parser.add_argument("--disassembler", default=None, help="nvdisasm or cuobjdump (default: the first on PATH)")
    args = parser.parse_args()
    tool = args.disassembler or find_disassembler()
    if tool is None:
        sys.exit("kloop_sass.py needs nvdisasm or cuobjdump (--disassembler PATH; pip's nvidia-cuda-nvdisasm has one)")
    import deep_gemm
    from bench_common import import_deep_gemm
    trees = {"": fp8_gemm_kernels(deep_gemm)}
    if args.base:
        trees["base "] = fp8_gemm_kernels(import_deep_gemm(args.base, "deep_gemm_base"))
    wanted = [w for w in args.only.split(",") if w]
    for label in trees[""]:
        if wanted and not any(w in label for w in wanted):
            continue
        for tag, kernels in trees.items():
            if label not in kernels:
                print(f"{tag}{label}: not in this checkout")
                continue
            found = k_loops(disassemble(str(kernels[label]().cubin), tool))
            print(f"{tag}{label}: " + ("; ".join(summary(lp) for lp in found) or "no k-loop found"), flush=True)


if __name__ == "__main__":
    main()
