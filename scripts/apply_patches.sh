#!/usr/bin/env bash
# Grafts the Mega MoE backward onto an upstream DeepGEMM checkout, then builds it with upstream's
# own tooling (README, "Patch an upstream checkout"):
#   bash scripts/apply_patches.sh UPSTREAM_DIR [--no-build | --install]
#   bash scripts/apply_patches.sh --check-compilers     (step 2 alone)
# 1. refuses a checkout at another commit than patches/UPSTREAM names, or without its submodules
#    (third-party/cutlass, third-party/fmt: the build is offline);
# 2. refuses a compiler (CC, CXX, the LDSHARED linker) that would link another libstdc++ than the
#    one Python loads, or link libstdc++ in statically (such a build segfaults in its first
#    std::regex: docs/DESIGN.md, "Patched upstream install"), and says what to set;
# 3. git apply --unidiff-zero --check, then applies patches/*.patch (add-only hunks);
# 4. copies megamoe_bwd next to upstream's deep_gemm, with this repository's deep_gemm inside it
#    as megamoe_bwd._vendored (the kernels megamoe_bwd runs on);
# 5. runs upstream's develop.sh (build in place; default) or install.sh (--install: wheel + pip).
# Running it again on a patched checkout skips step 3 and refreshes step 4.
set -euo pipefail
die() { echo "apply_patches.sh: $*" >&2; exit 1; }

# Which libstdc++ a shared object linked by compiler $1 loads (as an extension would, -lstdc++):
# empty if the compiler links it in statically. The GPU image's /opt/gcc wrappers put a directory
# holding only libstdc++.a first on the library path: the extension then carries its own copy
# beside the one torch loads, and std::regex's locale facets cross the two (a segfault).
libstdcxx_of() {
  local dir
  dir=$(mktemp -d)
  printf '#include <locale>\nint probe() { return static_cast<int>(std::locale().name().size()); }\n' > "$dir/p.cpp"
  if ! "$1" -x c++ -shared -fPIC "$dir/p.cpp" -o "$dir/p.so" -lstdc++ 2>/dev/null; then
    rm -rf "$dir"
    return 1
  fi
  ldd "$dir/p.so" | awk '$1 == "libstdc++.so.6" { print $3 }' | xargs -r readlink -f
  rm -rf "$dir"
}
check_compilers() {
  local loaded linker compiler ours hint
  loaded=$(python3 -c "import torch; print(next(l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l))" \
           2>/dev/null) || die "python3 with torch is needed (it loads the extension upstream builds)"
  loaded=$(readlink -f "$loaded")
  linker=$(python3 -c "import os, sysconfig; print((os.environ.get('LDSHARED') or sysconfig.get_config_var('LDSHARED')).split()[0])")
  hint="pick a gcc whose libstdc++ is $loaded"
  [[ $(libstdcxx_of /usr/bin/g++ 2>/dev/null) == "$loaded" ]] &&
    hint="export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED=\"/usr/bin/g++ -shared\""
  for compiler in "${CC:-gcc}" "${CXX:-g++}" "$linker"; do
    ours=$(libstdcxx_of "$compiler") || die "compiler $compiler not found, or it cannot link a shared object"
    [[ -n $ours ]] || die "$compiler links libstdc++ statically, while Python loads $loaded: the extension would
  carry a second libstdc++ (its first std::regex segfaults). $hint"
    [[ $ours == "$loaded" ]] || die "$compiler links against $ours, but Python loads $loaded: the extension would
  mix two libstdc++s (its first std::regex segfaults). $hint"
  done
}
if [[ ${1:-} == --check-compilers ]]; then
  check_compilers
  echo "compilers: ${CC:-gcc}, ${CXX:-g++} and the linker all link the libstdc++ Python loads"
  exit 0
fi
[[ $# -ge 1 ]] || die "usage: bash scripts/apply_patches.sh UPSTREAM_DIR [--no-build | --install] | --check-compilers"
up=$(cd "$1" 2>/dev/null && pwd) || die "$1 is not a directory"
mode=${2:-develop}
case $mode in develop | --no-build | --install) ;; *) die "unknown option $mode" ;; esac
here=$(cd "$(dirname "$0")/.." && pwd)
pinned=$(awk '$1 == "commit" { print $2 }' "$here/patches/UPSTREAM")

head=$(git -C "$up" rev-parse HEAD 2>/dev/null) || die "$up is not a git checkout of DeepGEMM"
[[ $head == "$pinned" ]] || die "$up is at $head; the patches are pinned to $pinned (git -C $up checkout $pinned)"
for dir in third-party/cutlass/include third-party/fmt/include; do
  [[ -d $up/$dir ]] || die "$up/$dir is missing: upstream builds against its submodules and the build is offline
  (git -C $up submodule update --init where there is network, or copy them in)"
done
check_compilers

if git -C "$up" apply --unidiff-zero --reverse --check "$here"/patches/*.patch 2>/dev/null; then
  echo "patches already applied"
else
  git -C "$up" apply --unidiff-zero --check "$here"/patches/*.patch
  git -C "$up" apply --unidiff-zero "$here"/patches/*.patch
  echo "applied: $(cd "$here/patches" && ls ./*.patch | tr '\n' ' ')"
fi

rm -rf "$up/megamoe_bwd"
copy() {  # sources only: no caches, builds or compiled kernels
  (cd "$1" && find . -name __pycache__ -prune -o -type f ! -name '*.pyc' ! -name '*.so' -print0 \
    | xargs -0 -I{} install -D -m 644 {} "$2/{}")
}
copy "$here/megamoe_bwd" "$up/megamoe_bwd"
copy "$here/deep_gemm" "$up/megamoe_bwd/_vendored"
echo "copied megamoe_bwd (with deep_gemm as megamoe_bwd._vendored) into $up"

case $mode in
  develop) (cd "$up" && bash develop.sh) ;;
  --install) (cd "$up" && bash install.sh) ;;
  --no-build) echo "not built (--no-build)" ;;
esac
