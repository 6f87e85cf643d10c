"""scripts/sass_profile.py: per-opcode instructions and warp-state samples from ncu's source page."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import sass_profile  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_barrier","stall_wait","stall_barrier (Not Issued)"')


def _page(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text('"Kernel Name","k"\n' + HEADER + "\n" + "\n".join(rows) + "\n")
    return str(path)


def test_opcodes_drop_predicates_and_modifiers():
    assert sass_profile.opcode("@!P0  BRA 0x7f00") == "BRA"
    assert sass_profile.opcode("QGMMA.64x192x32.F32.E4M3.E4M3 R24, gdesc[UR12], RZ, !UPT") == "QGMMA"
    assert sass_profile.opcode("") == ""


def test_counts_are_summed_per_opcode_and_divided_per_unit(tmp_path):
    ours = _page(tmp_path, "ours.csv", [
        '"0x0","FFMA R1, R2, R3, R1","30","10","1,000","0","30","0"',
        '"0x10","FFMA R4, R2, R3, R4","10","5","1000","0","10","0"',
        '"0x20","@P0 BRA 0x0","60","60","500","60","0","60"',
    ])
    theirs = _page(tmp_path, "theirs.csv", ['"0x0","FFMA R1, R2, R3, R1","50","0","2000","0","50","0"'])
    ins = sass_profile.load(ours)
    assert [i.opcode for i in ins] == ["FFMA", "FFMA", "BRA"]
    assert ins[0].executed == 1000 and ins[2].stalls == {"barrier": 60.0, "wait": 0.0}
    executed, samples = sass_profile.by_opcode(ins)
    assert executed["FFMA"] == 2000 and samples["BRA"] == 60
    text = sass_profile.report([ours, theirs], per=100, top=1)
    assert "25.0 warp instructions a unit, 100 samples" in text  # (1000 + 1000 + 500) / 100
    assert "barrier 60.0%" in text
    ffma = next(line for line in text.splitlines() if line.startswith("FFMA"))
    assert ffma.split()[1:] == ["20.00", "40.0%", "20.00", "100.0%"]


def test_a_csv_without_the_source_page_columns_is_refused(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"Section Name","Metric Name","Metric Value"\n"a","b","1"\n')
    with pytest.raises(ValueError, match="not an ncu source page"):
        sass_profile.load(str(path))
