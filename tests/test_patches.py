"""Spec of patches/: add-only hunks, pinned to one upstream commit, applying to a tree of that
commit's shape; the apply script's refusals; and the patched install's layout, on a synthetic
upstream (no upstream line exists in this repository or in these tests).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
HAS_GIT = shutil.which("git") is not None
requires_git = pytest.mark.skipif(not HAS_GIT, reason="needs git")


def _upstream() -> tuple[str, dict[str, int]]:
    """(pinned commit, {file: line count at that commit}) from patches/UPSTREAM."""
    commit, files = None, {}
    for line in (ROOT / "patches" / "UPSTREAM").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "commit":
            commit = fields[1]
        elif fields and fields[0] == "file":
            files[fields[1]] = int(fields[2])
    return commit, files


def _hunks(patch: Path):
    """(file, old start, old count, new lines) of every hunk."""
    file = None
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            file = line[6:]
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@(.*)$", line)
        if m:
            yield file, int(m.group(1)), 1 if m.group(2) is None else int(m.group(2)), m.group(3)


def test_there_are_patches_and_a_pinned_commit():
    commit, files = _upstream()
    assert PATCHES and re.fullmatch(r"[0-9a-f]{40}", commit)
    assert {file for patch in PATCHES for file, *_ in _hunks(patch)} <= set(files)


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_every_hunk_only_adds_lines(patch):
    """Zero old lines per hunk and no removed line: no upstream line is in a patch."""
    for line in patch.read_text().splitlines():
        assert not (line.startswith("-") and not line.startswith("--- ")), f"{patch.name} removes a line: {line}"
        assert not line.startswith(" "), f"{patch.name} has a context line: {line}"
    for file, _, old_count, trailer in _hunks(patch):
        assert old_count == 0 and trailer == "", f"{patch.name}: a hunk of {file} keeps upstream text"


def _synthetic_upstream(tmp_path: Path, line=lambda file, i: f"# {file} line {i}") -> Path:
    """A git tree with every patched file at its pinned line count, of placeholder lines."""
    tree = tmp_path / "upstream"
    for file, count in _upstream()[1].items():
        (tree / file).parent.mkdir(parents=True, exist_ok=True)
        (tree / file).write_text("".join(line(file, i) + "\n" for i in range(1, count + 1)))
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    return tree


@requires_git
def test_the_patches_apply_to_a_tree_of_the_pinned_shape(tmp_path):
    tree = _synthetic_upstream(tmp_path)
    args = ["git", "-C", str(tree), "apply", "--unidiff-zero"]
    subprocess.run(args + ["--check", *map(str, PATCHES)], check=True)
    subprocess.run(args + list(map(str, PATCHES)), check=True)
    for patch in PATCHES:
        for file, old_start, _, _ in _hunks(patch):
            lines = (tree / file).read_text().splitlines()
            assert lines[old_start - 1] == f"# {file} line {old_start}"  # the hunk went in right after it


@requires_git
def test_the_apply_script_refuses_another_commit(tmp_path):
    tree = _synthetic_upstream(tmp_path)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    subprocess.run(["git", "-C", str(tree), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(tree), "commit", "-qm", "not upstream"], check=True, env=env)
    run = subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), str(tree), "--no-build"],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "the patches are pinned to" in run.stderr, run.stderr
    assert not (tree / "megamoe_bwd").exists()
    run = subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), str(tmp_path / "nowhere")],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "not a directory" in run.stderr


@requires_git
def test_a_patched_install_keeps_upstreams_names_and_adds_the_backward(tmp_path):
    """A synthetic upstream deep_gemm (its own bf16_mega_moe), patched, with megamoe_bwd and our
    kernels vendored beside it as the apply script lays them out: `deep_gemm.bf16_mega_moe`
    stays upstream's, `deep_gemm.mega_moe_backward` is ours, and megamoe_bwd runs on the vendored
    copy of our package."""
    upstream_init = {1: "def bf16_mega_moe():", 2: "    return 'upstream'"}
    upstream_line = lambda file, i: (upstream_init[i] if file.endswith("__init__.py") and i in upstream_init  # noqa: E731
                                     else f"# {file} line {i}")
    tree = _synthetic_upstream(tmp_path, upstream_line)
    subprocess.run(["git", "-C", str(tree), "apply", "--unidiff-zero", *map(str, PATCHES)], check=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    shutil.copytree(ROOT / "megamoe_bwd", tree / "megamoe_bwd", ignore=ignore)
    shutil.copytree(ROOT / "deep_gemm", tree / "megamoe_bwd" / "_vendored", ignore=ignore)
    probe = ("import deep_gemm, megamoe_bwd\n"
             "from megamoe_bwd import _kernels\n"
             "print(deep_gemm.bf16_mega_moe())\n"
             "print(deep_gemm.mega_moe_backward is megamoe_bwd.mega_moe_backward, deep_gemm.MegaMoE is megamoe_bwd.MegaMoE)\n"
             "print(_kernels.PACKAGE.__name__, _kernels.bf16_mega_moe.__module__)\n"
             "print(sorted(n for n in __import__('sys').modules if n == 'deep_gemm.gemm'))\n")
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["upstream", "True True", "megamoe_bwd._vendored megamoe_bwd._vendored.moe.forward",
                                          "[]"], out.stdout


def _static_libstdcxx() -> str | None:
    """The system g++'s libstdc++.a, if it has one."""
    if shutil.which("g++") is None:
        return None
    path = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.skipif(_static_libstdcxx() is None, reason="needs g++ with a static libstdc++.a")
def test_the_apply_script_refuses_a_compiler_that_links_libstdcxx_statically(tmp_path):
    """Like the GPU image's /opt/gcc wrapper: a -B directory holding only libstdc++.a, so an
    extension would carry its own libstdc++ beside the one torch loads."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libstdc++.a").symlink_to(_static_libstdcxx())
    wrapper = tmp_path / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec g++ -B{tmp_path / "lib"}/ "$@"\n')
    wrapper.chmod(0o755)
    run = subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), "--check-compilers"],
                         env=dict(os.environ, CXX=str(wrapper)), capture_output=True, text=True)
    assert run.returncode != 0 and "links libstdc++ statically" in run.stderr, run.stderr
    assert "CXX=" in run.stderr  # it says what to set
