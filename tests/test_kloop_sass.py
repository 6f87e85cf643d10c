"""scripts/kloop_sass.py: a mainloop's k-loop found in static SASS, as nvdisasm or cuobjdump print it."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import kloop_sass  # noqa: E402


def _kernel(nvdisasm: bool) -> str:
    """A tile loop around a k-loop of 64 FFMAs and a QGMMA, with a small spin loop inside the k-loop
    and a loop of 64 FFMAs around it all (the outer loops must not count as the k-loop)."""
    lines, address = [], 0

    def emit(text: str, label: str = "") -> int:
        nonlocal address
        if label and nvdisasm:
            lines.append(f"{label}:")
        lines.append(f"        /*{address:04x}*/                   {text} ;" + ("" if nvdisasm else "  /* 0x000 */"))
        address += 16
        return address - 16

    def branch(target_label: str, target: int, predicate: str = "@!P0 ") -> None:
        emit(f"{predicate}BRA `({target_label})" if nvdisasm else f"{predicate}BRA 0x{target:x}")

    tile = emit("S2R R0, SR_TID.X", ".L_x_1")
    kblock = emit("CS2R R26, SR_CLOCKLO", ".L_x_2")
    spin = emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR20+0x34800], R24", ".L_x_3")
    branch(".L_x_3", spin)
    emit("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR32], RZ, !UPT")
    for _ in range(64):
        emit("FFMA R120, R24, R102, R120")
    branch(".L_x_2", kblock)
    for _ in range(64):
        emit("FFMA R121, R25, R102, R121")
    branch(".L_x_1", tile, predicate="")
    emit("EXIT")
    return "\n".join(lines)


def test_the_k_loop_is_the_innermost_loop_with_a_promotion_in_either_disassembler():
    for nvdisasm in (True, False):
        sass = _kernel(nvdisasm)
        assert len(kloop_sass.loops(sass)) == 3  # the spin, the k-loop, the tile loop
        (k_loop,) = kloop_sass.k_loops(sass)
        ops = k_loop.opcodes()
        assert len(k_loop.body) == 69 and ops["FFMA"] == 64 and ops["QGMMA"] == 1 and ops["SYNCS"] == 1
        assert ops["BRA"] == 2 and k_loop.start == 0x10
        assert kloop_sass.summary(k_loop, top=2) == "69 instructions (FFMA 64, BRA 2)"


def test_forward_branches_and_loops_without_a_promotion_are_not_k_loops():
    sass = "\n".join([
        "        /*0000*/                   FFMA R1, R2, R3, R1 ;",
        "        /*0010*/                   @P0 BRA 0x40 ;",
        "        /*0020*/                   IADD3 R1, R1, 0x1, RZ ;",
        "        /*0030*/                   @P1 BRA 0x0 ;",
        "        /*0040*/                   EXIT ;",
    ])
    assert [(lp.start, lp.end) for lp in kloop_sass.loops(sass)] == [(0, 0x30)]
    assert kloop_sass.k_loops(sass) == []


def test_another_checkout_imports_beside_ours_and_lists_the_same_fp8_gemms():
    """`--base`: the other checkout's package under another name (here this checkout's own), its FP8
    GEMM variants by the labels of its precompile (nothing compiled)."""
    import deep_gemm
    from bench_common import import_deep_gemm
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = import_deep_gemm(root, "deep_gemm_kloop_test")
    assert base.__name__ == "deep_gemm_kloop_test" and base is not deep_gemm
    labels = list(kloop_sass.fp8_gemm_kernels(base))
    assert labels == list(kloop_sass.fp8_gemm_kernels(deep_gemm))
    assert any(label.startswith("m_grouped_fp8") for label in labels)
    assert any(label.startswith("k_grouped_fp8") for label in labels)
